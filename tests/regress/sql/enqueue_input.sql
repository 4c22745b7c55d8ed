-- outbox_enqueue's arguments: what it refuses, with which SQLSTATE, message and hint, and that a
-- refused call writes nothing; the limits are inclusive.
CREATE EXTENSION outbox;
\set SHOW_CONTEXT never
SET outbox.max_payload_size = '1kB';

SELECT outbox_enqueue(NULL, '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', NULL);
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('', '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue(repeat('t', 257), '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue(E'a\nb', '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue(E'a\tb', '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue(E'x\u0001', '{}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', jsonb_build_object('data', repeat('x', 1024)));
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{not json');
\echo SQLSTATE :SQLSTATE

-- A key is at most 1 KiB however it would be stored: a long key of one repeated character
-- compresses to a few bytes, and is refused before it is read.
SELECT outbox_enqueue('t', '{}', repeat('k', 1025));
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', repeat('k', 100 * 1024 * 1024));
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', repeat('ü', 513));
\echo SQLSTATE :SQLSTATE

-- Headers are a JSON object of strings; a delay is not negative.
SELECT outbox_enqueue('t', '{}', headers => '[1]');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', headers => '{"a": 1}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', deliver_after => '-1 second');
\echo SQLSTATE :SQLSTATE

-- None of the refused calls wrote a row, nor took an id.
SELECT count(*) AS rows FROM outbox;
SELECT last_value, is_called FROM outbox_id_seq;

-- The limits are inclusive: a 256-byte topic, 1 kB of JSON text, a 1 KiB key.
SELECT outbox_enqueue(repeat('t', 256), '{}') > 0 AS enqueued;
SELECT length(jsonb_build_object('d', repeat('x', 1024 - 9))::text) AS payload_bytes;
SELECT outbox_enqueue('t', jsonb_build_object('d', repeat('x', 1024 - 9))) > 0 AS enqueued;
SELECT outbox_enqueue('t', '{}', repeat('k', 1024)) > 0 AS enqueued;
SELECT outbox_enqueue('t', '{}', key => '', headers => '{"a": "b"}', deliver_after => '0') > 0 AS enqueued;
SELECT topic = repeat('t', 256) AS long_topic, length(key) AS key_bytes, headers, attempts
FROM outbox ORDER BY id;
DROP EXTENSION outbox;

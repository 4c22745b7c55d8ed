-- outbox_enqueue's headers and delay: headers are a JSON object of strings, a delay is neither
-- negative nor infinite; each refusal is 22023 and writes nothing. An infinite interval is
-- PostgreSQL 17's: before it, the interval's own input refuses 'infinity' (22007), which
-- expected/enqueue_options_1.out pins.
CREATE EXTENSION outbox;
\set SHOW_CONTEXT never

SELECT outbox_enqueue('t', '{}', 'k', '[]');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', 'k', '"traceparent"');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', 'k', '{"n": 1}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', 'k', '{"nested": {"a": "b"}}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', 'k', '{"a": "b", "c": null}');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', 'k', 'null');
\echo SQLSTATE :SQLSTATE

SELECT outbox_enqueue('t', '{}', deliver_after => '-1 second');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', deliver_after => '1 day -25 hours');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', deliver_after => 'infinity');
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', deliver_after => 'infinity'::interval);
\echo SQLSTATE :SQLSTATE
SELECT outbox_enqueue('t', '{}', deliver_after => '1 day'::interval + 'infinity');
\echo SQLSTATE :SQLSTATE

-- Nothing written, no id taken.
SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_delayed) AS rows;
SELECT last_value, is_called FROM outbox_id_seq;

-- An empty object and a zero delay are fine: no headers to speak of, due at once.
SELECT outbox_enqueue('t', '{}', NULL, '{}', '0 seconds') > 0 AS enqueued;
SELECT outbox_enqueue('t', '{}', headers => '{"a": ""}') > 0 AS enqueued;
SELECT count(*) AS due_now FROM outbox WHERE next_attempt_at IS NULL;
SELECT count(*) AS delayed FROM outbox_delayed;

DROP EXTENSION outbox;

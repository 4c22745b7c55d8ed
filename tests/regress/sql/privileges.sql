-- What a role may do with the extension: EXECUTE on outbox_enqueue is all an application needs,
-- and it gives no access to the table; a table of the caller's named like the extension's,
-- first on its search_path, is not written to; the payload limit is not the caller's to raise.
CREATE EXTENSION outbox;
\set SHOW_CONTEXT never
CREATE ROLE regress_outbox_app;
CREATE ROLE regress_outbox_stranger;
CREATE SCHEMA regress_evil;
GRANT ALL ON SCHEMA regress_evil TO regress_outbox_app;

-- A role without EXECUTE can neither enqueue nor touch the table.
SET ROLE regress_outbox_stranger;
SELECT outbox_enqueue('t', '{}');
\echo SQLSTATE :SQLSTATE
SELECT * FROM outbox;
\echo SQLSTATE :SQLSTATE
INSERT INTO outbox (topic, payload) VALUES ('t', '{}');
\echo SQLSTATE :SQLSTATE
RESET ROLE;

GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, jsonb, interval) TO regress_outbox_app;
SET ROLE regress_outbox_app;
CREATE TABLE regress_evil.outbox (id bigserial, topic text, payload jsonb);
SET search_path = regress_evil, public;
SELECT public.outbox_enqueue('t', '{}') > 0 AS enqueued;
SELECT * FROM public.outbox;
\echo SQLSTATE :SQLSTATE
SET search_path = '';
SELECT public.outbox_enqueue('t', '{}') > 0 AS enqueued;
SET search_path = regress_evil;
SELECT public.outbox_enqueue('t', '{}') > 0 AS enqueued;
SELECT count(*) AS shadow_rows FROM regress_evil.outbox;

-- The payload limit: not the caller's to raise, by SET or set_config.
SET outbox.max_payload_size = '100MB';
\echo SQLSTATE :SQLSTATE
SELECT set_config('outbox.max_payload_size', '2MB', false);
\echo SQLSTATE :SQLSTATE
SELECT public.outbox_enqueue('t', jsonb_build_object('d', repeat('x', 1024 * 1024 + 1)));
\echo SQLSTATE :SQLSTATE
RESET ROLE;
RESET search_path;
SELECT count(*) AS rows FROM outbox;

-- A superuser raises it, up to 64 MB.
SET outbox.max_payload_size = '65MB';
\echo SQLSTATE :SQLSTATE
SET outbox.max_payload_size = '64MB';
SELECT outbox_enqueue('t', jsonb_build_object('d', repeat('x', 1024 * 1024 + 1))) > 0 AS enqueued;

DROP TABLE regress_evil.outbox;
DROP SCHEMA regress_evil;
DROP EXTENSION outbox;
DROP ROLE regress_outbox_app;
DROP ROLE regress_outbox_stranger;

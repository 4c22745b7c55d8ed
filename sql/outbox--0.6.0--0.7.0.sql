-- outbox 0.6.0 -> 0.7.0: a view for metrics exporters.
--
-- outbox_metrics gives this database's backlog, health and the relay's counters (events
-- published, failed attempts, dead letters, since the server started) as numbers, which the
-- postgres_exporter queries file in contrib/ scrapes. Nothing the relay reads changes: a 0.7.0
-- library relays 0.6.0 objects as they are.
CREATE FUNCTION @extschema@._outbox_counters(
    OUT published bigint, OUT failed bigint, OUT dead_lettered bigint)
    RETURNS SETOF record
    LANGUAGE c VOLATILE
    AS 'MODULE_PATHNAME', '_outbox_counters_wrapper';

-- What a metrics exporter scrapes (shipped as contrib/postgres_exporter.yml): one row for this
-- database, in numbers. The counters count since the server started; the ages are in seconds.
CREATE VIEW @extschema@.outbox_metrics AS
    SELECT pg_catalog.current_database()::text AS database,
           s.pending,
           COALESCE(EXTRACT(epoch FROM s.oldest_pending_age), 0)::pg_catalog.float8
               AS oldest_pending_seconds,
           s.dead,
           c.published AS published_total,
           c.failed AS failed_total,
           c.dead_lettered AS dead_lettered_total,
           EXTRACT(epoch FROM pg_catalog.now() OPERATOR(pg_catalog.-) s.last_published_at)::pg_catalog.float8
               AS last_published_seconds,
           s.workers_running
    FROM @extschema@.outbox_status s, @extschema@._outbox_counters() c;
COMMENT ON VIEW @extschema@.outbox_metrics IS
    'Backlog, counters since the server started, and health of the outbox in this database, for a metrics exporter.';

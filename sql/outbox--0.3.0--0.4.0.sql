-- outbox 0.3.0 -> 0.4.0: the relay works in several databases (outbox.database takes a list, or
-- *). outbox_workers shows each worker's database; outbox_status counts this database's workers.
-- Both views are replaced in place, so the grants made on them stay.

CREATE FUNCTION @extschema@._outbox_slot_database(slot int) RETURNS text
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_slot_database_wrapper';

CREATE OR REPLACE VIEW @extschema@.outbox_workers AS
    SELECT slot, pid, state, published, last_batch_at, last_error, last_error_at,
           @extschema@._outbox_slot_database(slot) AS database
    FROM @extschema@._outbox_worker_slots();
COMMENT ON VIEW @extschema@.outbox_workers IS
    'One row per relay worker slot, from shared memory: the workers of every database relayed.';

CREATE OR REPLACE VIEW @extschema@.outbox_status AS
    SELECT
        (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NULL)
        + (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NOT NULL) AS pending,
        now() - LEAST(
            (SELECT min(created_at) FROM @extschema@.outbox
                WHERE published_at IS NULL AND next_attempt_at IS NULL),
            (SELECT min(created_at) FROM @extschema@.outbox
                WHERE published_at IS NULL AND next_attempt_at IS NOT NULL))
            AS oldest_pending_age,
        (SELECT count(*) FROM @extschema@.outbox_dead) AS dead,
        @extschema@._outbox_last_published_at() AS last_published_at,
        (SELECT count(*)::int FROM @extschema@._outbox_worker_slots() w
            WHERE w.pid IS NOT NULL
              AND @extschema@._outbox_slot_database(w.slot) OPERATOR(pg_catalog.=) pg_catalog.current_database()::text)
            AS workers_running;

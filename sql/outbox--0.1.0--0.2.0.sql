-- outbox 0.1.0 -> 0.2.0: retry state in the table, dead letters keyed by the event's identity,
-- redrive for whoever is granted EXECUTE.

-- Events Redis rejected wait in the table, not in one worker's memory, and in an index of their
-- own, so that claiming the others never steps over them.
ALTER TABLE @extschema@.outbox ADD COLUMN next_attempt_at timestamptz;
DROP INDEX @extschema@.outbox_unpublished;
CREATE INDEX outbox_unpublished ON @extschema@.outbox (id)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;
CREATE INDEX outbox_retrying ON @extschema@.outbox (next_attempt_at)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;

-- Ids can be used again (TRUNCATE ... RESTART IDENTITY, setval, a restore): a dead letter is
-- known by (id, created_at), so one kept from before never blocks a new one.
ALTER TABLE @extschema@.outbox_dead DROP CONSTRAINT outbox_dead_pkey;
ALTER TABLE @extschema@.outbox_dead ADD PRIMARY KEY (id, created_at);

ALTER FUNCTION @extschema@.outbox_redrive(bigint) SECURITY DEFINER;
ALTER FUNCTION @extschema@.outbox_redrive_all() SECURITY DEFINER;

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
        (SELECT count(*)::int FROM @extschema@._outbox_worker_slots() w WHERE w.pid IS NOT NULL)
            AS workers_running;

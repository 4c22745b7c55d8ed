-- outbox 0.4.0 -> 0.5.0: keys, headers and delayed delivery. outbox_enqueue takes a key, headers
-- and a delivery delay; the table gains their columns and the lane each worker relays by; the
-- claim index carries the lane, failing events get an index of their own, and delayed events a
-- table of their own.
--
-- The two-argument outbox_enqueue becomes the five-argument one whose last three arguments
-- default to NULL (both could not exist: a two-argument call would match both). Whoever could
-- execute the old function can execute the new one.

CREATE FUNCTION @extschema@.outbox_enqueue(topic text, payload jsonb, key text DEFAULT NULL,
                                          headers jsonb DEFAULT NULL,
                                          deliver_after interval DEFAULT NULL) RETURNS bigint
    LANGUAGE c VOLATILE PARALLEL UNSAFE SECURITY DEFINER
    AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';
COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) IS
    'Writes an event in the current transaction and returns its id; the relay publishes it after commit (or once deliver_after has passed).';
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) FROM PUBLIC;

DO $$
DECLARE
    fresh_acl pg_catalog.aclitem[];
    grant_sql text;
BEGIN
    SELECT p.proacl INTO fresh_acl FROM pg_catalog.pg_proc p
    WHERE p.oid OPERATOR(pg_catalog.=)
            '@extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval)'::pg_catalog.regprocedure;
    FOR grant_sql IN
        SELECT pg_catalog.format(
                   'GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) TO %s%s',
                   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                        ELSE pg_catalog.quote_ident(r.rolname) END,
                   CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
        FROM pg_catalog.pg_proc p,
             LATERAL pg_catalog.aclexplode(p.proacl) a
             LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) a.grantee
        WHERE p.oid OPERATOR(pg_catalog.=)
                '@extschema@.outbox_enqueue(text, jsonb)'::pg_catalog.regprocedure
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
          AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
    LOOP
        EXECUTE grant_sql;
    END LOOP;
    -- PostgreSQL records what an extension script grants as the extension's own privileges,
    -- which pg_dump leaves out. These grants are the users', so the record keeps what a fresh
    -- install grants, and a dump carries them as it carried the old function's.
    UPDATE pg_catalog.pg_init_privs SET initprivs = fresh_acl
    WHERE objoid OPERATOR(pg_catalog.=)
            '@extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval)'::pg_catalog.regprocedure
      AND classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
      AND objsubid OPERATOR(pg_catalog.=) 0;
END
$$;

DROP FUNCTION @extschema@.outbox_enqueue(text, jsonb);

CREATE FUNCTION @extschema@.outbox_lane(key text, topic text) RETURNS smallint
    LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'outbox_lane_wrapper';
COMMENT ON FUNCTION @extschema@.outbox_lane(text, text) IS
    'The relay lane of an event with this key (else this topic), as outbox_enqueue sets it.';

-- Events already waiting stay in lane 0, where rows inserted by hand go: one worker relays
-- them in id order, as 0.4.0 did with one worker.
ALTER TABLE @extschema@.outbox
    ADD COLUMN key text,
    ADD COLUMN headers jsonb,
    ADD COLUMN lane smallint NOT NULL DEFAULT 0;
ALTER TABLE @extschema@.outbox_dead
    ADD COLUMN key text,
    ADD COLUMN headers jsonb;

DROP INDEX @extschema@.outbox_unpublished;
CREATE INDEX outbox_unpublished ON @extschema@.outbox (id, lane)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;
CREATE INDEX outbox_failing ON @extschema@.outbox
    (lane, pg_catalog.left(COALESCE('k' OPERATOR(pg_catalog.||) key,
                                               't' OPERATOR(pg_catalog.||) topic), 200), id)
    WHERE published_at IS NULL
      AND (attempts OPERATOR(pg_catalog.>) 0
           OR next_attempt_at OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz);

-- Events enqueued with deliver_after wait here, not in outbox, until they are due; the relay then
-- moves them into outbox with their id, and they go out as any event. However many wait, they
-- lengthen none of outbox's indexes (which the claims and every vacuum of outbox go through) and
-- keep none of its partitions from being emptied.
CREATE TABLE @extschema@.outbox_delayed (
    id          bigint PRIMARY KEY,
    topic       text NOT NULL,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL,
    key         text,
    headers     jsonb,
    lane        smallint NOT NULL,
    deliver_at  timestamptz NOT NULL
);
CREATE INDEX outbox_delayed_due ON @extschema@.outbox_delayed (deliver_at);
COMMENT ON TABLE @extschema@.outbox_delayed IS
    'Events enqueued with deliver_after, until they are due; the relay then moves them into outbox.';
SELECT pg_catalog.pg_extension_config_dump('@extschema@.outbox_delayed', '');

CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive(id bigint) RETURNS boolean
    LANGUAGE sql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
    WITH moved AS (
        DELETE FROM @extschema@.outbox_dead d WHERE d.id = $1
        RETURNING d.id, d.topic, d.payload, d.created_at, d.last_error, d.key, d.headers
    ), back AS (
        INSERT INTO @extschema@.outbox
            (id, topic, payload, created_at, attempts, last_error, key, headers, lane)
        SELECT id, topic, payload, created_at, 0, last_error, key, headers,
               @extschema@.outbox_lane(key, topic)
        FROM moved
        RETURNING 1
    )
    SELECT count(*) > 0 FROM back, LATERAL (SELECT @extschema@._outbox_wake()) w;
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive_all() RETURNS bigint
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
    WITH moved AS (
        DELETE FROM @extschema@.outbox_dead d
        RETURNING d.id, d.topic, d.payload, d.created_at, d.last_error, d.key, d.headers
    ), back AS (
        INSERT INTO @extschema@.outbox
            (id, topic, payload, created_at, attempts, last_error, key, headers, lane)
        SELECT id, topic, payload, created_at, 0, last_error, key, headers,
               @extschema@.outbox_lane(key, topic)
        FROM moved ORDER BY id
        RETURNING 1
    )
    SELECT count(*) FROM back, LATERAL (SELECT @extschema@._outbox_wake()) w;
$$;

CREATE OR REPLACE VIEW @extschema@.outbox_status AS
    SELECT
        (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NULL)
        + (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NOT NULL)
        + (SELECT count(*) FROM @extschema@.outbox_delayed) AS pending,
        -- Since an event could be published: its commit, or its delivery time when delayed.
        now() - LEAST(
            (SELECT min(created_at) FROM @extschema@.outbox
                WHERE published_at IS NULL AND next_attempt_at IS NULL),
            (SELECT min(created_at) FROM @extschema@.outbox
                WHERE published_at IS NULL
                  AND (attempts OPERATOR(pg_catalog.>) 0
                       OR next_attempt_at OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz)),
            (SELECT min(deliver_at) FROM @extschema@.outbox_delayed
                WHERE deliver_at OPERATOR(pg_catalog.<=) now()))
            AS oldest_pending_age,
        (SELECT count(*) FROM @extschema@.outbox_dead) AS dead,
        @extschema@._outbox_last_published_at() AS last_published_at,
        (SELECT count(*)::int FROM @extschema@._outbox_worker_slots() w
            WHERE w.pid IS NOT NULL
              AND @extschema@._outbox_slot_database(w.slot) OPERATOR(pg_catalog.=) pg_catalog.current_database()::text)
            AS workers_running;

CREATE VIEW @extschema@.outbox_blocked AS
    SELECT o.id, o.topic, o.key, o.attempts, o.last_error, o.next_attempt_at
    FROM @extschema@.outbox o
    WHERE o.published_at IS NULL AND o.attempts OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW @extschema@.outbox_blocked IS
    'Events Redis rejected and not yet published: the later events of each one''s key (else topic) wait for it.';

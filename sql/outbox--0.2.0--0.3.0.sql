-- outbox 0.2.0 -> 0.3.0: the table becomes a ring of 16 partitions that the relay empties with
-- TRUNCATE, so that pruning leaves no dead row versions (see sql/outbox.sql and src/ring.rs).
--
-- The rows are copied into the new table under the old one's ACCESS EXCLUSIVE lock: writers wait
-- for the update, which takes about as long as copying the table (a second or two per million
-- rows). Privileges granted on the old table are granted on the new one. Triggers, policies and
-- indexes added to the old table by hand are not carried over.

-- The old table steps aside under another name; its id sequence stays, with its position.
ALTER TABLE @extschema@.outbox RENAME TO outbox_before_0_3_0;
ALTER TABLE @extschema@.outbox_before_0_3_0 RENAME CONSTRAINT outbox_pkey TO outbox_before_0_3_0_pkey;
ALTER INDEX @extschema@.outbox_unpublished RENAME TO outbox_before_0_3_0_unpublished;
ALTER INDEX @extschema@.outbox_retrying RENAME TO outbox_before_0_3_0_retrying;
ALTER SEQUENCE @extschema@.outbox_id_seq OWNED BY NONE;
-- From PostgreSQL 18 on, NOT NULL constraints have names (outbox_id_not_null, ...): they move
-- aside too, so that the new table's get the names a fresh install gives them.
DO $$
DECLARE
    old_name name;
BEGIN
    FOR old_name IN
        SELECT conname FROM pg_catalog.pg_constraint
        WHERE conrelid OPERATOR(pg_catalog.=) '@extschema@.outbox_before_0_3_0'::regclass
          AND contype OPERATOR(pg_catalog.=) 'n'
    LOOP
        EXECUTE pg_catalog.format(
            'ALTER TABLE @extschema@.outbox_before_0_3_0 RENAME CONSTRAINT %I TO %I',
            old_name, 'before_0_3_0_' || old_name);
    END LOOP;
END
$$;

CREATE FUNCTION @extschema@._outbox_id_hash(bigint) RETURNS int
    LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', '_outbox_id_hash_wrapper';
CREATE FUNCTION @extschema@._outbox_id_hash_extended(bigint, bigint) RETURNS bigint
    LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', '_outbox_id_hash_extended_wrapper';
CREATE OPERATOR FAMILY @extschema@.outbox_id_chunk_ops USING hash;
CREATE OPERATOR CLASS @extschema@.outbox_id_chunk_ops FOR TYPE bigint
    USING hash FAMILY @extschema@.outbox_id_chunk_ops AS
    OPERATOR 1 pg_catalog.= (bigint, bigint),
    FUNCTION 1 @extschema@._outbox_id_hash(bigint),
    FUNCTION 2 @extschema@._outbox_id_hash_extended(bigint, bigint);

CREATE TABLE @extschema@.outbox (
    id           bigint NOT NULL DEFAULT nextval('@extschema@.outbox_id_seq'::regclass) PRIMARY KEY,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts     int NOT NULL DEFAULT 0,
    last_error   text,
    -- Set when Redis rejected the event: the relay tries it again from then on. Kept in the
    -- table, so every worker honours it and a restart does not forget it.
    next_attempt_at timestamptz
) PARTITION BY HASH (id @extschema@.outbox_id_chunk_ops);
COMMENT ON TABLE @extschema@.outbox IS
    'Events written by outbox_enqueue; the relay publishes them to Redis Streams and sets published_at.';

-- The relay's claims read only unpublished rows: these indexes stay the size of the backlog
-- however much history is kept. Events waiting out a retry delay have an index of their own,
-- so that however many wait, claiming the others never steps over them.
CREATE INDEX outbox_unpublished ON @extschema@.outbox (id)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;
CREATE INDEX outbox_retrying ON @extschema@.outbox (next_attempt_at)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;

-- The partitions, outbox_00 to outbox_15. Each row is inserted and marked once; the marks'
-- old versions are what vacuum has to reclaim before the partition is truncated, so vacuum
-- early and often.
DO $$
BEGIN
    FOR r IN 0..15 LOOP
        EXECUTE pg_catalog.format(
            'CREATE TABLE @extschema@.%I PARTITION OF @extschema@.outbox '
            'FOR VALUES WITH (MODULUS 16, REMAINDER %s) WITH ('
            'autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000, '
            'autovacuum_vacuum_insert_scale_factor = 0.01, '
            'autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0, '
            'fillfactor = 90)',
            'outbox_' || pg_catalog.lpad(r::text, 2, '0'), r);
        -- pg_dump includes the events, so a restore loses none.
        PERFORM pg_catalog.pg_extension_config_dump(
            pg_catalog.format('@extschema@.%I', 'outbox_' || pg_catalog.lpad(r::text, 2, '0'))::regclass, '');
    END LOOP;
END
$$;

ALTER SEQUENCE @extschema@.outbox_id_seq OWNED BY @extschema@.outbox.id;

INSERT INTO @extschema@.outbox
    (id, topic, payload, created_at, published_at, attempts, last_error, next_attempt_at)
    SELECT id, topic, payload, created_at, published_at, attempts, last_error, next_attempt_at
    FROM @extschema@.outbox_before_0_3_0;

-- Whoever could read or write the old table can do the same with the new one.
DO $$
DECLARE
    grant_sql text;
BEGIN
    FOR grant_sql IN
        SELECT pg_catalog.format('GRANT %s ON @extschema@.outbox TO %s%s', a.privilege_type,
                   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                        ELSE pg_catalog.quote_ident(r.rolname) END,
                   CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
        FROM pg_catalog.pg_class c,
             LATERAL pg_catalog.aclexplode(c.relacl) a
             LEFT JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) a.grantee
        WHERE c.oid OPERATOR(pg_catalog.=) '@extschema@.outbox_before_0_3_0'::regclass
          AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
    LOOP
        EXECUTE grant_sql;
    END LOOP;
END
$$;

-- The view is bound to the table it was created on: bind it to the new one, keeping its grants.
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

-- Out of the extension first, which also takes it off the list of tables pg_dump dumps.
ALTER EXTENSION outbox DROP TABLE @extschema@.outbox_before_0_3_0;
DROP TABLE @extschema@.outbox_before_0_3_0;

-- The outbox's SQL surface. Hand-written so that what users call is plain, reviewable SQL; the
-- C entry points behind it are private (_outbox_*).

-- Rows are routed to a ring of 16 partitions by runs of 65,536 ids (src/ring.rs): writers fill
-- one partition while the relay empties those behind it with TRUNCATE once their rows are all
-- published and past outbox.retention. Pruning then leaves no dead row versions, and a
-- partition's space comes back within seconds of its retention, whatever autovacuum does.
-- The operator class hashes an id to its run; it is for this partitioning only.
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
    id           bigserial PRIMARY KEY,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts     int NOT NULL DEFAULT 0,
    last_error   text,
    -- Set when Redis rejected the event: the relay claims it again from then on. Kept in the
    -- table, so every worker honours it and a restart does not forget it.
    next_attempt_at timestamptz,
    -- What outbox_enqueue was given beside the topic and the payload; both go into the stream
    -- entry when set.
    key          text,
    headers      jsonb,
    -- The share of the relay the event belongs to, a hash of its key (else its topic) into
    -- 0..1023, set by outbox_enqueue: each worker relays a range of lanes, so the events of one
    -- key never go through two workers at once. A row inserted by hand stays in lane 0.
    lane         smallint NOT NULL DEFAULT 0
) PARTITION BY HASH (id @extschema@.outbox_id_chunk_ops);
COMMENT ON TABLE @extschema@.outbox IS
    'Events written by outbox_enqueue; the relay publishes them to Redis Streams and sets published_at.';

-- The relay's claims read only unpublished rows: these indexes stay the size of the backlog
-- however much history is kept. The lane beside the id lets a worker skip the rows of other
-- workers' lanes in the index, without reading them. Events waiting out a retry delay have an
-- index of their own, so that however many wait, claiming the others never steps over them.
-- An event held behind an earlier one of its key that failed waits there too, with
-- next_attempt_at 'infinity' until the relay releases it, so that however many are held,
-- claiming the others never steps over them either. The events that hold others back, failed
-- or held, have a small index by lane and key (else topic; its first 200 characters, to stay
-- within an index entry), which tells the relay whose later events wait.
CREATE INDEX outbox_unpublished ON @extschema@.outbox (id, lane)
    WHERE published_at IS NULL AND next_attempt_at IS NULL;
CREATE INDEX outbox_retrying ON @extschema@.outbox (next_attempt_at)
    WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;
CREATE INDEX outbox_failing ON @extschema@.outbox
    (lane, pg_catalog.left(COALESCE('k' OPERATOR(pg_catalog.||) key,
                                               't' OPERATOR(pg_catalog.||) topic), 200), id)
    WHERE published_at IS NULL
      AND (attempts OPERATOR(pg_catalog.>) 0
           OR next_attempt_at OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz);

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

-- Keyed by the event's identity, (id, created_at): ids can be used again (TRUNCATE ... RESTART
-- IDENTITY, setval, a restore), and a dead letter kept from before must not block a new one.
CREATE TABLE @extschema@.outbox_dead (
    id           bigint NOT NULL,
    topic        text NOT NULL,
    payload      jsonb NOT NULL,
    created_at   timestamptz NOT NULL,
    published_at timestamptz,
    attempts     int NOT NULL,
    last_error   text,
    failed_at    timestamptz NOT NULL DEFAULT now(),
    key          text,
    headers      jsonb,
    PRIMARY KEY (id, created_at)
);
COMMENT ON TABLE @extschema@.outbox_dead IS
    'Events that failed outbox.max_attempts publishes; outbox_redrive puts them back.';

-- pg_dump includes the dead letters and the id sequence (and, above, each partition's events),
-- so a restore loses nothing and new ids do not collide with restored ones.
SELECT pg_catalog.pg_extension_config_dump('@extschema@.outbox_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.outbox_dead', '');

-- Runs as its caller (SECURITY INVOKER): EXECUTE is the privilege it asks for, and the row goes
-- in with the table owner's right to insert it, while what the insert fires (triggers, CHECK
-- constraints, defaults, index expressions added by hand) runs as the caller, as it would for
-- the caller's own INSERT. Nothing the caller's search_path reaches is ever run with the
-- owner's rights. See src/write/enqueue.rs.
CREATE FUNCTION @extschema@.outbox_enqueue(topic text, payload jsonb, key text DEFAULT NULL,
                                          headers jsonb DEFAULT NULL,
                                          deliver_after interval DEFAULT NULL) RETURNS bigint
    LANGUAGE c VOLATILE PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', 'outbox_enqueue_wrapper';
COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) IS
    'Writes an event in the current transaction and returns its id; the relay publishes it after commit (or once deliver_after has passed).';

-- The lane outbox_enqueue gives an event of this key and topic; for rows inserted by hand.
CREATE FUNCTION @extschema@.outbox_lane(key text, topic text) RETURNS smallint
    LANGUAGE c IMMUTABLE PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'outbox_lane_wrapper';
COMMENT ON FUNCTION @extschema@.outbox_lane(text, text) IS
    'The relay lane of an event with this key (else this topic), as outbox_enqueue sets it.';

CREATE FUNCTION @extschema@._outbox_wake() RETURNS void
    LANGUAGE c VOLATILE PARALLEL UNSAFE
    AS 'MODULE_PATHNAME', '_outbox_wake_wrapper';

-- The redrive functions run as their owner, and so does what their statements fire (triggers,
-- constraints and defaults on outbox). Their pinned search_path puts pg_catalog first, but a
-- session's temporary schema is always searched for relations and types, last where it is
-- named last: a name that a trigger leaves unqualified and pg_catalog does not hold finds the
-- caller's temporary table, view or domain, whose triggers or functions would then run with
-- the owner's rights. So they refuse to run in a session whose temporary schema holds any.
CREATE FUNCTION @extschema@._outbox_no_temporary_objects() RETURNS void
    LANGUAGE plpgsql STABLE
    SET search_path = pg_catalog, pg_temp
    AS $$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_class c
               WHERE c.relnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema())
       OR EXISTS (SELECT FROM pg_catalog.pg_type t
                  WHERE t.typnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()) THEN
        RAISE EXCEPTION 'cannot redrive in a session that has temporary tables or types'
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'The redrive functions run what their insert into outbox fires with '
                           'their owner''s rights, and an unqualified name there would find '
                           'this session''s temporary objects.',
                  HINT = 'Redrive from a session without temporary objects (DISCARD TEMP).';
    END IF;
END
$$;

-- SECURITY DEFINER, so that EXECUTE is all a role needs to redrive; the pinned search_path
-- and the refusal of a session's temporary objects keep callers' objects out of it. A dead event goes back with its own id, and outbox holds
-- each id once: a dead event whose id outbox holds (ids used again, see the README, or another
-- dead event of that id redriven first) stays in outbox_dead, and a WARNING says so, so that
-- it never undoes the redrive of the others. The insert comes first and the delete takes only
-- what it inserted, so a dead event is never deleted without being back in outbox. Only the
-- primary key is passed by: a constraint added to outbox by hand fails the call, as it would
-- an INSERT.
CREATE FUNCTION @extschema@.outbox_redrive(id bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    dead_id ALIAS FOR $1;
    dead_events bigint;
    moved bigint;
BEGIN
    PERFORM @extschema@._outbox_no_temporary_objects();
    -- Of dead events that share the id, the one created first goes back.
    WITH candidates AS (
        SELECT d.id, d.topic, d.payload, d.created_at, d.last_error, d.key, d.headers
        FROM @extschema@.outbox_dead d
        WHERE d.id = dead_id
        ORDER BY d.created_at
        FOR UPDATE
    ), back AS (
        INSERT INTO @extschema@.outbox AS o
            (id, topic, payload, created_at, attempts, last_error, key, headers, lane)
        SELECT c.id, c.topic, c.payload, c.created_at, 0, c.last_error, c.key, c.headers,
               @extschema@.outbox_lane(c.key, c.topic)
        FROM candidates c
        ORDER BY c.created_at
        ON CONFLICT ON CONSTRAINT outbox_pkey DO NOTHING
        RETURNING o.id, o.created_at
    ), gone AS (
        DELETE FROM @extschema@.outbox_dead d USING back b
        WHERE d.id = b.id AND d.created_at = b.created_at
        RETURNING d.id
    )
    SELECT (SELECT count(*) FROM candidates), (SELECT count(*) FROM gone)
    INTO dead_events, moved;
    IF moved > 0 THEN
        PERFORM @extschema@._outbox_wake();
    END IF;
    IF moved = 0 AND dead_events > 0 THEN
        RAISE WARNING 'dead event % stays in outbox_dead: outbox holds another event with id %',
                      dead_id, dead_id
            USING DETAIL = 'A dead event goes back with its own id, and outbox holds each id once.',
                  HINT = 'Ids are used again after TRUNCATE outbox RESTART IDENTITY, a setval '
                         'on outbox_id_seq or a restore. Redrive it once the event holding its '
                         'id has left outbox (published, then pruned after outbox.retention).';
    ELSIF moved < dead_events THEN
        RAISE WARNING '% of the % dead events with id % stay in outbox_dead',
                      dead_events - moved, dead_events, dead_id
            USING DETAIL = 'The one created first went back; outbox holds each id once.',
                  HINT = 'Redrive the others once that event has left outbox (published, then '
                         'pruned after outbox.retention).';
    END IF;
    RETURN moved > 0;
END
$$;
COMMENT ON FUNCTION @extschema@.outbox_redrive(bigint) IS
    'Moves the dead event with this id back into outbox with its id and attempts reset; false if there is none, or (with a WARNING) if outbox holds that id.';

CREATE FUNCTION @extschema@.outbox_redrive_all() RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    moved bigint;
    stayed bigint;
    stayed_ids bigint[];
BEGIN
    PERFORM @extschema@._outbox_no_temporary_objects();
    WITH candidates AS (
        SELECT d.id, d.topic, d.payload, d.created_at, d.last_error, d.key, d.headers
        FROM @extschema@.outbox_dead d
        ORDER BY d.id, d.created_at
        FOR UPDATE
    ), back AS (
        INSERT INTO @extschema@.outbox AS o
            (id, topic, payload, created_at, attempts, last_error, key, headers, lane)
        SELECT c.id, c.topic, c.payload, c.created_at, 0, c.last_error, c.key, c.headers,
               @extschema@.outbox_lane(c.key, c.topic)
        FROM candidates c
        ORDER BY c.id, c.created_at
        ON CONFLICT ON CONSTRAINT outbox_pkey DO NOTHING
        RETURNING o.id, o.created_at
    ), gone AS (
        DELETE FROM @extschema@.outbox_dead d USING back b
        WHERE d.id = b.id AND d.created_at = b.created_at
        RETURNING d.id, d.created_at
    ), left_behind AS (
        SELECT c.id FROM candidates c
        WHERE NOT EXISTS (SELECT FROM gone g WHERE g.id = c.id AND g.created_at = c.created_at)
    )
    SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM left_behind),
           (SELECT array_agg(l.id ORDER BY l.id)
            FROM (SELECT DISTINCT lb.id FROM left_behind lb ORDER BY lb.id LIMIT 11) l)
    INTO moved, stayed, stayed_ids;
    IF moved > 0 THEN
        PERFORM @extschema@._outbox_wake();
    END IF;
    IF stayed > 0 THEN
        RAISE WARNING '% stay in outbox_dead: outbox holds events with their ids',
                      CASE WHEN stayed = 1 THEN '1 dead event' ELSE stayed || ' dead events' END
            USING DETAIL = 'Their ids: '
                           || array_to_string(stayed_ids[1:10], ', ')
                           || CASE WHEN cardinality(stayed_ids) > 10 THEN ', ...' ELSE '' END
                           || '. A dead event goes back with its own id, and outbox holds each id once.',
                  HINT = 'Ids are used again after TRUNCATE outbox RESTART IDENTITY, a setval '
                         'on outbox_id_seq or a restore, and dead events can share one. Redrive '
                         'them once the events holding their ids have left outbox (published, '
                         'then pruned after outbox.retention).';
    END IF;
    RETURN moved;
END
$$;
COMMENT ON FUNCTION @extschema@.outbox_redrive_all() IS
    'Moves every dead event back into outbox with attempts reset, but those whose id outbox holds (a WARNING names them); returns how many moved.';

CREATE FUNCTION @extschema@._outbox_worker_slots(
    OUT slot int, OUT pid int, OUT state text, OUT published bigint,
    OUT last_batch_at timestamptz, OUT last_error text, OUT last_error_at timestamptz)
    RETURNS SETOF record
    LANGUAGE c VOLATILE
    AS 'MODULE_PATHNAME', '_outbox_worker_slots_wrapper';

CREATE FUNCTION @extschema@._outbox_last_published_at() RETURNS timestamptz
    LANGUAGE c VOLATILE
    AS 'MODULE_PATHNAME', '_outbox_last_published_at_wrapper';

CREATE FUNCTION @extschema@._outbox_slot_database(slot int) RETURNS text
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_slot_database_wrapper';

-- How the slot's worker deduplicates on the Redis it writes to: idmp, markers or off (NULL
-- before its first chunk).
CREATE FUNCTION @extschema@._outbox_slot_dedupe(slot int) RETURNS text
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_slot_dedupe_wrapper';

CREATE VIEW @extschema@.outbox_workers AS
    SELECT slot, pid, state, published, last_batch_at, last_error, last_error_at,
           @extschema@._outbox_slot_database(slot) AS database,
           @extschema@._outbox_slot_dedupe(slot) AS dedupe
    FROM @extschema@._outbox_worker_slots();
COMMENT ON VIEW @extschema@.outbox_workers IS
    'One row per relay worker slot, from shared memory: the workers of every database relayed.';

-- Sessions of this database listening on a channel, as outbox_enqueue counts them.
CREATE FUNCTION @extschema@._outbox_notify_listeners(channel text) RETURNS bigint
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_notify_listeners_wrapper';

CREATE VIEW @extschema@.outbox_status AS
    SELECT
        (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NULL)
        + (SELECT count(*) FROM @extschema@.outbox
            WHERE published_at IS NULL AND next_attempt_at IS NOT NULL)
        + (SELECT count(*) FROM @extschema@.outbox_delayed) AS pending,
        -- Since an event could be published: its created_at (its transaction's start), or its
        -- delivery time while it waits in outbox_delayed.
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
            AS workers_running,
        -- What outbox.workers asks for: more than workers_running while max_worker_processes
        -- leaves no room for some (the others then relay their lanes too).
        COALESCE(pg_catalog.current_setting('outbox.workers', true)::int, 0) AS workers_wanted,
        -- Sessions of this database listening on outbox.notify_channel: while none does, the
        -- commits that enqueue send no notification (NULL without the preload: they always do).
        @extschema@._outbox_notify_listeners(pg_catalog.current_setting('outbox.notify_channel', true))
            AS notify_listeners;
COMMENT ON VIEW @extschema@.outbox_status IS 'Backlog and health of the outbox, in one row.';

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
           s.workers_running,
           s.workers_wanted
    FROM @extschema@.outbox_status s, @extschema@._outbox_counters() c;
COMMENT ON VIEW @extschema@.outbox_metrics IS
    'Backlog, counters since the server started, and health of the outbox in this database, for a metrics exporter.';

CREATE VIEW @extschema@.outbox_blocked AS
    SELECT o.id, o.topic, o.key, o.attempts, o.last_error, o.next_attempt_at
    FROM @extschema@.outbox o
    WHERE o.published_at IS NULL AND o.attempts OPERATOR(pg_catalog.>) 0;
COMMENT ON VIEW @extschema@.outbox_blocked IS
    'Events Redis rejected and not yet published: the later events of each one''s key (else topic) wait for it.';

-- PUBLIC gets nothing that writes or reads events. An application role needs
-- GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, jsonb, interval); a monitoring
-- role needs GRANT SELECT ON outbox_status, outbox_workers, outbox_metrics (and outbox_blocked,
-- which shows topics and keys). The views call the status functions as the querying role, so those stay
-- executable: they expose worker state, never events.
REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@._outbox_wake() FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_redrive(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.outbox_redrive_all() FROM PUBLIC;

-- outbox 0.8.0 -> 0.9.0: outbox_enqueue runs as its caller; outbox_status shows a shortage of
-- workers and who listens for the notifications, which are sent only when someone does.
--
-- As SECURITY DEFINER, the triggers, CHECK constraints and defaults that its insert fired ran
-- as the extension's owner with the caller's search_path, where the caller's temporary tables
-- come first: a caller with EXECUTE and TEMP could get its own code run with the owner's
-- rights. The library now gives the insert the owner's right to write the row and runs all
-- it fires as the caller. Nothing the relay reads changes: the library relays 0.8.0, 0.7.0
-- and 0.6.0 objects as they are (and runs outbox_enqueue as their owner until this update).
ALTER FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, jsonb, interval) SECURITY INVOKER;

-- The redrive functions stay SECURITY DEFINER, and refuse to run in a session whose temporary
-- schema holds relations or types: their pinned search_path cannot keep a trigger's
-- unqualified name from finding those.
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive(id bigint) RETURNS boolean
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive_all() RETURNS bigint
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

-- outbox_status gains workers_wanted (outbox.workers: a database short of workers shows
-- workers_running below it) and notify_listeners (the sessions listening on
-- outbox.notify_channel: while none does, enqueueing commits send no notification);
-- outbox_metrics gains workers_wanted.
-- Sessions of this database listening on a channel, as outbox_enqueue counts them.
CREATE FUNCTION @extschema@._outbox_notify_listeners(channel text) RETURNS bigint
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_notify_listeners_wrapper';

CREATE OR REPLACE VIEW @extschema@.outbox_status AS
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

CREATE OR REPLACE VIEW @extschema@.outbox_metrics AS
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

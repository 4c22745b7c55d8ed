-- outbox 0.5.0 -> 0.6.0: every waiting event in its lane, redrives that leave a dead event
-- whose id outbox holds where it is instead of failing, and events held behind a failed one of
-- their key in the index of failing events.
--
-- The update to 0.5.0 left the events waiting at the time in lane 0, while the events of their
-- key (else topic) enqueued since go to the lane outbox_enqueue computes. With several workers
-- the two lanes go through different workers: old and new events of one topic interleaved out
-- of order, and an old failing event no longer held back the later events of its topic. The
-- update to 0.5.0 is released and stays as it is; this one gives each unpublished event the
-- lane outbox_enqueue would give it (outbox_lane is the function it computes the lane with),
-- which also repairs a database that went through the update to 0.5.0 some time ago. Rows
-- inserted by hand, left in lane 0, move to their lane as well. Published rows keep theirs: a
-- lane matters only until an event is out.
--
-- Two statements, one per partial index that holds the unpublished events, so that each can
-- read its index rather than the published history. A relay of 0.6.0 waits for this update to
-- commit; one of 0.5.0 still running claims with FOR UPDATE SKIP LOCKED, so an event it holds
-- is waited for here and left alone once published, and the events moved here are out of its
-- reach until the commit.
UPDATE @extschema@.outbox o SET lane = @extschema@.outbox_lane(o.key, o.topic)
WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
  AND o.lane OPERATOR(pg_catalog.<>) @extschema@.outbox_lane(o.key, o.topic);
UPDATE @extschema@.outbox o SET lane = @extschema@.outbox_lane(o.key, o.topic)
WHERE o.published_at IS NULL AND o.next_attempt_at IS NOT NULL
  AND o.lane OPERATOR(pg_catalog.<>) @extschema@.outbox_lane(o.key, o.topic);

-- SECURITY DEFINER, so that EXECUTE is all a role needs to redrive; the pinned search_path
-- keeps callers' objects out of it. A dead event goes back with its own id, and outbox holds
-- each id once: a dead event whose id outbox holds (ids used again, see the README, or another
-- dead event of that id redriven first) stays in outbox_dead, and a WARNING says so, so that
-- it never undoes the redrive of the others. The insert comes first and the delete takes only
-- what it inserted, so a dead event is never deleted without being back in outbox. Only the
-- primary key is passed by: a constraint added to outbox by hand fails the call, as it would
-- an INSERT.
CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive(id bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    dead_id ALIAS FOR $1;
    dead_events bigint;
    moved bigint;
BEGIN
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_redrive_all() RETURNS bigint
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    moved bigint;
    stayed bigint;
    stayed_ids bigint[];
BEGIN
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

-- An event behind a failed one of its key is held (next_attempt_at 'infinity') until the relay
-- releases it, so that claims never step over it again; the index of the events that hold
-- others back takes the held ones too, and the oldest pending event may be one of them.
DROP INDEX @extschema@.outbox_failing;
CREATE INDEX outbox_failing ON @extschema@.outbox
    (lane, pg_catalog.left(COALESCE('k' OPERATOR(pg_catalog.||) key,
                                               't' OPERATOR(pg_catalog.||) topic), 200), id)
    WHERE published_at IS NULL
      AND (attempts OPERATOR(pg_catalog.>) 0
           OR next_attempt_at OPERATOR(pg_catalog.=) 'infinity'::pg_catalog.timestamptz);

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
            AS workers_running;

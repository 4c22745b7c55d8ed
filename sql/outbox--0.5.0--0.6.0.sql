-- outbox 0.5.0 -> 0.6.0: every waiting event in its lane, and redrives that leave a dead event
-- whose id outbox holds where it is instead of failing.
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

-- outbox 0.5.0 -> 0.6.0: every waiting event in its lane.
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

-- outbox 0.7.0 -> 0.8.0: outbox_workers shows how each worker deduplicates.
--
-- outbox.dedupe = auto (the default) chooses Redis's own idempotent production (IDMP) where
-- every node the worker writes to runs Redis 8.6.2 or later, and markers elsewhere, per
-- connection; the new column says which. Nothing the relay reads changes: a 0.8.0 library
-- relays 0.7.0 and 0.6.0 objects as they are.
CREATE FUNCTION @extschema@._outbox_slot_dedupe(slot int) RETURNS text
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', '_outbox_slot_dedupe_wrapper';

CREATE OR REPLACE VIEW @extschema@.outbox_workers AS
    SELECT slot, pid, state, published, last_batch_at, last_error, last_error_at,
           @extschema@._outbox_slot_database(slot) AS database,
           @extschema@._outbox_slot_dedupe(slot) AS dedupe
    FROM @extschema@._outbox_worker_slots();

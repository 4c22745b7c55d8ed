//! Retention: how the `outbox` table keeps only what `outbox.retention` asks for.
//!
//! The table is a ring of partitions that ids fill in turn (`model/ring.rs`). Once every row of a
//! partition is published and past the retention, a relay worker empties it with `TRUNCATE`
//! (`truncate.rs`), which leaves nothing for vacuum. Published rows that the ring does not empty
//! in time (a quiet table, a long retention) are deleted in id ranges (`prune.rs`). The relay's
//! workers run both between their passes, one worker at a time per database.

pub mod prune;
pub mod truncate;

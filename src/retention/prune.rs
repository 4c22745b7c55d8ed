//! Pruning what emptying partitions cannot reach in time. A partition is emptied (see
//! `truncate.rs`) only once all its rows have expired and writers have moved on to the next
//! run of ids, which takes minutes at a busy rate and may take months at a quiet one, and never
//! comes with a retention longer than the ring takes to go round. Published rows that outlive
//! the retention by [`grace`] are therefore deleted here, in id ranges, one short transaction
//! per range, oldest first, and vacuum reclaims them. The grace keeps these deletes away from
//! the rows a busy ring empties anyway (deleting them would only leave dead row versions in
//! the partition being written). Unpublished rows are never touched.
//!
//! Ids grow with the time events are created, so the walk starts at the smallest id and stops
//! at the first range that holds a row *created* within the retention: every row past it was
//! created later, and so published later still. (The walk does not stop at a row *published*
//! recently: a redriven old event is published long after its neighbours, and must not keep all
//! later history.) Each range is an index range scan on the primary key, a gap in the ids is
//! skipped in one step, so a round costs what it deletes, not the size of the history, and
//! takes no lock beyond the rows it deletes.

use std::time::Duration;

use pgrx::prelude::*;

use crate::pg::schema::{Schema, SCHEMA};
use crate::pg::worker::{self, in_transaction, End};
use crate::shmem::DatabaseShare;

/// Least time between two pruning rounds, across all workers.
const EVERY: Duration = Duration::from_secs(60);

/// Ids covered by one delete, and so by one transaction.
const RANGE: i64 = 10_000;
/// Ranges one round may walk before it yields to relaying.
const MAX_RANGES_PER_ROUND: usize = 100;

/// Runs a pruning round, one short transaction per range, when a minute (or the retention, if
/// shorter, as in tests) has passed since the last round of any worker and this worker wins the
/// turn.
pub fn prune_if_due(shared: &DatabaseShare, retention: Duration, schema: &Schema, index: usize) {
    if !shared.claim_prune_turn(worker::now(), EVERY.min(retention)) {
        return;
    }
    let Some(mut from) = in_transaction(|| (first_id(schema), End::Commit)) else {
        return;
    };
    let age = retention.saturating_add(grace(retention));
    let mut deleted = 0;
    for _ in 0..MAX_RANGES_PER_ROUND {
        if worker::shutdown_requested() {
            break;
        }
        let to = from.saturating_add(RANGE);
        let pruned = in_transaction(|| (prune_range(schema, from, to, age), End::Commit));
        deleted += pruned.deleted;
        match pruned.next {
            Some(next) => from = next,
            None => break,
        }
    }
    if deleted > 0 {
        debug1!("outbox relay {index}: pruned {deleted} published events");
    }
}

/// How long past the retention a published row may wait for its partition to be emptied
/// before it is deleted: ten retentions, at least 10 s and at most an hour. At a rate where
/// bloat matters, a run of ids is written in well under that (65,536 ids take 33 s at 2,000
/// events/s), so the ring empties its partitions first.
pub fn grace(retention: Duration) -> Duration {
    retention
        .saturating_mul(10)
        .clamp(Duration::from_secs(10), Duration::from_secs(3600))
}

/// The smallest id in the table, or `None` when it is empty.
fn first_id(schema: &Schema) -> Option<i64> {
    let sql = schema.sql(&format!("SELECT pg_catalog.min(id) FROM {SCHEMA}.outbox"));
    Spi::connect_mut(|client| {
        client
            .update(sql.as_c_str(), Some(1), &[])?
            .first()
            .get_one::<i64>()
    })
    .ok()
    .flatten()
}

/// What pruning one range did.
struct Pruned {
    deleted: i64,
    /// Where the next range starts: the first id past this one, or `None` at the end of the
    /// walk (no row past it, or this range holds a row created within the retention).
    next: Option<i64>,
}

/// Deletes the rows with ids in `[from, to)` published more than `age` ago.
fn prune_range(schema: &Schema, from: i64, to: i64, age: Duration) -> Pruned {
    let s = SCHEMA;
    let sql = schema.sql(&format!(
        "WITH cutoff AS (SELECT pg_catalog.now() OPERATOR(pg_catalog.-) \
                                ($3 OPERATOR(pg_catalog.*) interval '1 second') AS at), \
              doomed AS (DELETE FROM {s}.outbox o USING cutoff \
                         WHERE o.id OPERATOR(pg_catalog.>=) $1 \
                           AND o.id OPERATOR(pg_catalog.<) $2 \
                           AND o.published_at OPERATOR(pg_catalog.<) cutoff.at \
                         RETURNING 1) \
         SELECT (SELECT pg_catalog.count(*) FROM doomed), \
                EXISTS (SELECT 1 FROM {s}.outbox o, cutoff \
                        WHERE o.id OPERATOR(pg_catalog.>=) $1 \
                          AND o.id OPERATOR(pg_catalog.<) $2 \
                          AND o.created_at OPERATOR(pg_catalog.>=) cutoff.at), \
                (SELECT pg_catalog.min(o.id) FROM {s}.outbox o \
                 WHERE o.id OPERATOR(pg_catalog.>=) $2)"
    ));
    let seconds = age.as_secs_f64();
    Spi::connect_mut(|client| {
        let table = client
            .update(
                sql.as_c_str(),
                Some(1),
                &[from.into(), to.into(), seconds.into()],
            )
            .unwrap_or_else(|e| error!("outbox relay: pruning failed: {e}"))
            .first();
        let deleted = table.get::<i64>(1).ok().flatten().unwrap_or_default();
        let reached_recent = table.get::<bool>(2).ok().flatten().unwrap_or(true);
        let after = table.get::<i64>(3).ok().flatten();
        Pruned {
            deleted,
            next: after.filter(|_| !reached_recent),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_is_ten_retentions_within_bounds() {
        assert_eq!(grace(Duration::from_secs(1)), Duration::from_secs(10));
        assert_eq!(grace(Duration::from_secs(5)), Duration::from_secs(50));
        assert_eq!(
            grace(Duration::from_secs(7 * 86400)),
            Duration::from_secs(3600)
        );
        assert_eq!(grace(Duration::MAX), Duration::from_secs(3600));
    }
}

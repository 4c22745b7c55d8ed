//! Emptying the ring's partitions (see `ring.rs`): a partition whose rows are all published,
//! and were all marked more than `outbox.retention` ago, is emptied with `TRUNCATE`. That
//! leaves no dead row versions and gives the space back at once, where deleting the rows one by
//! one would leave three dead versions per event for autovacuum, which comes once a minute at
//! best.
//!
//! When a batch's rows were last marked in each partition is kept in shared memory (every
//! worker records it before its mark commits; after a restart, the start time stands for the
//! marks before it). A partition is a candidate when that time is older than the retention,
//! it holds anything at all, and the writers are not filling it. It is emptied only under its
//! `ACCESS EXCLUSIVE` lock, taken without waiting: no transaction that writes, marks or reads
//! it is in progress, and none can start until the emptying commits. Under the lock the mark
//! time is read again and the partition is checked to hold no unpublished row. Writers, which
//! insert into the partition of the current run, never wait for it; another worker's claim
//! waits for as long as the `TRUNCATE` takes.

use std::time::Duration;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::worker::{self, in_transaction, End};
use crate::ring::{self, LEAVES};
use crate::shmem::DatabaseShare;

/// Least time between two looks for partitions to empty, across all workers.
const EVERY: Duration = Duration::from_secs(1);

/// What the relay knows about one partition before it tries to empty it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// When rows in it were last marked published.
    pub marked_at: i64,
    /// Its size on disk, in bytes.
    pub bytes: i64,
}

/// The partitions worth trying to empty at `now`: not the one writers fill (that of the id
/// `position` the sequence stands at), not empty already, and marked more than `retention`
/// ago.
pub fn candidates(leaves: &[Leaf; LEAVES], position: i64, now: i64, retention: i64) -> Vec<usize> {
    let writing = ring::leaf_of(position);
    (0..LEAVES)
        .filter(|&leaf| leaf != writing)
        .filter(|&leaf| leaves[leaf].bytes > 0)
        .filter(|&leaf| expired(leaves[leaf].marked_at, now, retention))
        .collect()
}

/// Whether rows marked at `marked_at` are past a retention of `retention` at `now`.
fn expired(marked_at: i64, now: i64, retention: i64) -> bool {
    marked_at.saturating_add(retention) <= now
}

/// How one try at a partition ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Emptied,
    /// Another transaction holds a lock on it.
    Busy,
    /// Rows in it were marked within the retention after all.
    Recent,
    /// It holds an event not yet published.
    Pending,
}

/// Empties the partitions that are due, one transaction each, when this worker wins the turn
/// (at most one look a second across all workers).
pub fn truncate_if_due(shared: &DatabaseShare, retention: Duration, schema: &str, index: usize) {
    let now = worker::now();
    if !shared.claim_truncate_turn(now, EVERY) {
        return;
    }
    let retention = retention.as_micros().min(i64::MAX as u128) as i64;
    let due = (0..LEAVES).any(|leaf| expired(shared.leaf_marked_at(leaf), now, retention));
    if !due {
        return;
    }
    let Some((position, names, oids, sizes)) = in_transaction(|| (survey(schema), End::Commit))
    else {
        return;
    };
    let leaves: [Leaf; LEAVES] = std::array::from_fn(|leaf| Leaf {
        marked_at: shared.leaf_marked_at(leaf),
        bytes: sizes[leaf],
    });
    for leaf in candidates(&leaves, position, now, retention) {
        if worker::shutdown_requested() {
            return;
        }
        let outcome = in_transaction(|| {
            let outcome = empty(shared, leaf, oids[leaf], &names[leaf], retention);
            (outcome, End::Commit)
        });
        if outcome == Outcome::Emptied {
            debug1!(
                "outbox relay {index}: emptied {} ({} bytes)",
                names[leaf],
                sizes[leaf]
            );
        }
    }
}

/// The sequence's position, and each partition's qualified name, OID and size.
#[allow(clippy::type_complexity)]
fn survey(schema: &str) -> Option<(i64, Vec<String>, Vec<pg_sys::Oid>, Vec<i64>)> {
    let s = spi::quote_identifier(schema);
    let names: Vec<String> = (0..LEAVES)
        .map(|leaf| format!("{s}.{}", spi::quote_identifier(format!("outbox_{leaf:02}"))))
        .collect();
    let regclasses: Vec<String> = names
        .iter()
        .map(|name| format!("{}::pg_catalog.regclass", spi::quote_literal(name)))
        .collect();
    let sql = format!(
        "SELECT (SELECT last_value FROM {s}.outbox_id_seq), \
                ARRAY[{}]::pg_catalog.oid[], ARRAY[{}]::pg_catalog.int8[]",
        regclasses.join(", "),
        regclasses
            .iter()
            .map(|r| format!("pg_catalog.pg_relation_size({r})"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (position, oids, sizes) = Spi::get_three::<i64, Vec<pg_sys::Oid>, Vec<i64>>(&sql)
        .unwrap_or_else(|e| error!("outbox relay: cannot read the partitions' sizes: {e}"));
    let (position, oids, sizes) = (position?, oids?, sizes?);
    (oids.len() == LEAVES && sizes.len() == LEAVES).then_some((position, names, oids, sizes))
}

/// Empties partition `leaf` if nothing holds it and it is still due; see the module comment.
fn empty(
    shared: &DatabaseShare,
    leaf: usize,
    oid: pg_sys::Oid,
    name: &str,
    retention: i64,
) -> Outcome {
    // SAFETY: a lock on a relation, inside the caller's transaction, which releases it.
    let locked = unsafe {
        pg_sys::ConditionalLockRelationOid(oid, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE)
    };
    if !locked {
        return Outcome::Busy;
    }
    // Marks record their time before they commit, and a mark's commit comes before the lock.
    if !expired(shared.leaf_marked_at(leaf), worker::now(), retention) {
        return Outcome::Recent;
    }
    let pending = Spi::get_one::<bool>(&format!(
        "SELECT EXISTS (SELECT 1 FROM {name} \
                        WHERE published_at IS NULL AND next_attempt_at IS NULL) \
             OR EXISTS (SELECT 1 FROM {name} \
                        WHERE published_at IS NULL AND next_attempt_at IS NOT NULL)"
    ))
    .unwrap_or_else(|e| error!("outbox relay: cannot read {name}: {e}"));
    if pending != Some(false) {
        return Outcome::Pending;
    }
    Spi::run(&format!("TRUNCATE {name}"))
        .unwrap_or_else(|e| error!("outbox relay: cannot empty {name}: {e}"));
    Outcome::Emptied
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::CHUNK;

    fn leaves(marked_at: i64, bytes: i64) -> [Leaf; LEAVES] {
        [Leaf { marked_at, bytes }; LEAVES]
    }

    #[test]
    fn the_partition_being_written_is_never_a_candidate() {
        let all = leaves(0, 8192);
        let position = 3 * CHUNK + 17;
        let got = candidates(&all, position, 1_000, 10);
        assert_eq!(got.len(), LEAVES - 1);
        assert!(!got.contains(&3));
    }

    #[test]
    fn empty_and_recently_marked_partitions_are_left_alone() {
        let mut all = leaves(0, 8192);
        all[1].bytes = 0;
        all[2].marked_at = 995;
        all[5].marked_at = 990;
        let got = candidates(&all, 0, 1_000, 10);
        assert!(!got.contains(&1), "already empty");
        assert!(!got.contains(&2), "marked 5 µs ago, retention 10");
        assert!(got.contains(&5), "marked exactly one retention ago");
        assert!(got.contains(&6));
    }

    #[test]
    fn a_retention_as_long_as_time_never_expires() {
        assert!(!expired(5, i64::MAX - 1, i64::MAX));
        assert!(expired(0, 10, 10));
    }
}

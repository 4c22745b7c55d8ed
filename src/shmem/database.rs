//! What the workers of one database share in shared memory: the turns at pruning and at
//! emptying partitions, when each partition was last marked, their counters, when they last
//! published, and whether the launcher must leave the database alone.

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::time::{time_or_null, NO_TIME};
use crate::model::ring::LEAVES;

/// Events a relay transaction published, charged a failed attempt, and moved to
/// `outbox_dead`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub published: u64,
    pub failed: u64,
    pub dead_lettered: u64,
}

/// What the workers of one database share: the pruning and emptying turns, each partition's
/// last mark, when they last published, and whether the launcher must leave the database alone.
#[repr(C)]
pub struct DatabaseShare {
    /// The database's OID; 0 while the entry is free.
    pub(super) oid: AtomicU32,
    /// When any of its workers last marked a batch published.
    last_published_at: AtomicI64,
    /// Events its workers published, charged a failed attempt, and moved to `outbox_dead`, in
    /// transactions that committed since the entry was taken: counters for monitoring.
    published_total: AtomicU64,
    failed_total: AtomicU64,
    dead_lettered_total: AtomicU64,
    /// Earliest time the next pruning round may start; claimed by compare-and-swap.
    next_prune_at: AtomicI64,
    /// When a worker last looked for partitions to empty (0: not since the entry was taken);
    /// the next look is claimed by compare-and-swap.
    truncate_looked_at: AtomicI64,
    /// When a partition that is due but was not emptied is to be tried again.
    truncate_again_at: AtomicI64,
    /// When a look that found a due partition in use is to be repeated (0: the last look found
    /// none in use): an idle worker wakes for it.
    truncate_retry_at: AtomicI64,
    /// Looks in a row that found a due partition in use: the retries back off with it.
    truncate_busy_looks: AtomicU32,
    /// For each partition of the ring, when a batch with rows in it was last marked published
    /// (at the latest when the entry was taken): every row in it was published no later than
    /// that.
    leaves_marked_at: [AtomicI64; LEAVES],
    /// Until when no worker may run in the database: a `DROP DATABASE` or a rename is waiting
    /// for them to leave.
    paused_until: AtomicI64,
    /// Until when the launcher need not look again: the extension was not found there.
    absent_until: AtomicI64,
}

impl DatabaseShare {
    pub(super) fn new() -> DatabaseShare {
        DatabaseShare {
            oid: AtomicU32::new(0),
            last_published_at: AtomicI64::new(NO_TIME),
            published_total: AtomicU64::new(0),
            failed_total: AtomicU64::new(0),
            dead_lettered_total: AtomicU64::new(0),
            next_prune_at: AtomicI64::new(0),
            truncate_looked_at: AtomicI64::new(0),
            truncate_again_at: AtomicI64::new(0),
            truncate_retry_at: AtomicI64::new(0),
            truncate_busy_looks: AtomicU32::new(0),
            leaves_marked_at: std::array::from_fn(|_| AtomicI64::new(0)),
            paused_until: AtomicI64::new(0),
            absent_until: AtomicI64::new(0),
        }
    }

    /// Resets the entry for a database taken at `now`.
    pub(super) fn reset(&self, now: i64) {
        self.last_published_at.store(NO_TIME, Ordering::Relaxed);
        self.published_total.store(0, Ordering::Relaxed);
        self.failed_total.store(0, Ordering::Relaxed);
        self.dead_lettered_total.store(0, Ordering::Relaxed);
        self.next_prune_at.store(0, Ordering::Relaxed);
        self.truncate_looked_at.store(0, Ordering::Relaxed);
        self.truncate_again_at.store(0, Ordering::Relaxed);
        self.truncate_retry_at.store(0, Ordering::Relaxed);
        self.truncate_busy_looks.store(0, Ordering::Relaxed);
        for marked_at in &self.leaves_marked_at {
            marked_at.store(now, Ordering::Relaxed);
        }
        self.paused_until.store(0, Ordering::Relaxed);
        self.absent_until.store(0, Ordering::Relaxed);
    }

    pub fn oid(&self) -> u32 {
        self.oid.load(Ordering::Acquire)
    }

    /// Records that a worker marked a batch published at `at`.
    pub fn record_published(&self, at: i64) {
        self.last_published_at.fetch_max(at, Ordering::Relaxed);
    }

    /// Adds what a committed relay transaction did to the database's counters.
    pub fn count(&self, counts: Counts) {
        self.published_total
            .fetch_add(counts.published, Ordering::Relaxed);
        self.failed_total
            .fetch_add(counts.failed, Ordering::Relaxed);
        self.dead_lettered_total
            .fetch_add(counts.dead_lettered, Ordering::Relaxed);
    }

    /// The database's counters since the entry was taken.
    pub fn counts(&self) -> Counts {
        Counts {
            published: self.published_total.load(Ordering::Relaxed),
            failed: self.failed_total.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered_total.load(Ordering::Relaxed),
        }
    }

    /// When a worker of the database last marked a batch published, since the entry was taken.
    pub fn last_published_at(&self) -> Option<i64> {
        time_or_null(self.last_published_at.load(Ordering::Relaxed))
    }

    /// Claims the next pruning round for the caller if none has started within `every` of
    /// `now`: at most one worker wins each turn.
    pub fn claim_prune_turn(&self, now: i64, every: Duration) -> bool {
        claim_turn(&self.next_prune_at, now, every)
    }

    /// When a worker last looked for partitions to empty.
    pub fn truncate_looked_at(&self) -> i64 {
        self.truncate_looked_at.load(Ordering::Acquire)
    }

    /// Claims a look for partitions to empty at `now` for the caller, if no worker has looked
    /// since `seen`: at most one worker wins each look.
    pub fn claim_truncate_look(&self, seen: i64, now: i64) -> bool {
        self.truncate_looked_at
            .compare_exchange(seen, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// When partitions due but not emptied at the last look are to be tried again.
    pub fn truncate_again_at(&self) -> i64 {
        self.truncate_again_at.load(Ordering::Acquire)
    }

    /// Sets when partitions due but not emptied are to be tried again.
    pub fn set_truncate_again_at(&self, at: i64) {
        self.truncate_again_at.store(at, Ordering::Release);
    }

    /// When a look that found a due partition in use is to be repeated; 0 when none was.
    pub fn truncate_retry_at(&self) -> i64 {
        self.truncate_retry_at.load(Ordering::Acquire)
    }

    /// Sets when a look that found a due partition in use is to be repeated (0: none was).
    pub fn set_truncate_retry_at(&self, at: i64) {
        self.truncate_retry_at.store(at, Ordering::Release);
    }

    /// Counts a look that found a due partition in use (`busy`), or ends a run of them; returns
    /// how many looks in a row have.
    pub fn count_truncate_look(&self, busy: bool) -> u32 {
        if busy {
            self.truncate_busy_looks
                .fetch_add(1, Ordering::AcqRel)
                .saturating_add(1)
        } else {
            self.truncate_busy_looks.store(0, Ordering::Release);
            0
        }
    }

    /// Records that a batch with rows in the partitions of bitmask `leaves` was marked
    /// published, in a transaction that committed before `at`.
    pub fn record_marked(&self, leaves: u32, at: i64) {
        for (leaf, marked_at) in self.leaves_marked_at.iter().enumerate() {
            if leaves & (1 << leaf) != 0 {
                marked_at.fetch_max(at, Ordering::Relaxed);
            }
        }
    }

    /// When rows of partition `leaf` were last marked published (see `leaves_marked_at`).
    pub fn leaf_marked_at(&self, leaf: usize) -> i64 {
        self.leaves_marked_at[leaf].load(Ordering::Relaxed)
    }

    /// Keeps workers out of the database until `until`.
    pub fn pause_until(&self, until: i64) {
        self.paused_until.store(until, Ordering::Release);
    }

    pub fn is_paused(&self, now: i64) -> bool {
        now < self.paused_until.load(Ordering::Acquire)
    }

    /// Notes that the extension is missing; the launcher looks again after `until`.
    pub fn absent_until(&self, until: i64) {
        self.absent_until.store(until, Ordering::Release);
    }

    pub fn is_absent(&self, now: i64) -> bool {
        now < self.absent_until.load(Ordering::Acquire)
    }
}

/// Claims the turn `next_at` stands for if it is due at `now`, and puts the next one `every`
/// later; at most one caller wins each turn.
fn claim_turn(next_at: &AtomicI64, now: i64, every: Duration) -> bool {
    let due = next_at.load(Ordering::Relaxed);
    if now < due {
        return false;
    }
    let next = now.saturating_add(every.as_micros().min(i64::MAX as u128) as i64);
    next_at
        .compare_exchange(due, next, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_worker_wins_each_pruning_turn() {
        let shared = DatabaseShare::new();
        let minute = Duration::from_secs(60);
        assert!(shared.claim_prune_turn(1_000, minute));
        assert!(
            !shared.claim_prune_turn(1_000, minute),
            "the same turn twice"
        );
        assert!(!shared.claim_prune_turn(1_000 + 59_999_999, minute));
        assert!(shared.claim_prune_turn(1_000 + 60_000_000, minute));
    }

    #[test]
    fn marks_move_each_partition_forward_on_its_own() {
        let shared = DatabaseShare::new();
        shared.record_marked(u32::MAX, 5);
        shared.record_marked(0b101, 30);
        shared.record_marked(0b001, 20);
        assert_eq!(shared.leaf_marked_at(0), 30);
        assert_eq!(shared.leaf_marked_at(1), 5);
        assert_eq!(shared.leaf_marked_at(2), 30);
        assert_eq!(shared.leaf_marked_at(LEAVES - 1), 5);
    }

    #[test]
    fn one_caller_wins_each_truncate_look() {
        let shared = DatabaseShare::new();
        let seen = shared.truncate_looked_at();
        assert!(shared.claim_truncate_look(seen, 1_000));
        assert!(
            !shared.claim_truncate_look(seen, 1_050),
            "another worker looked"
        );
        assert_eq!(shared.truncate_looked_at(), 1_000);
        assert!(shared.claim_truncate_look(1_000, 1_100));
    }

    #[test]
    fn counters_add_up_until_the_entry_is_taken_again() {
        let shared = DatabaseShare::new();
        let counts = |published, failed, dead_lettered| Counts {
            published,
            failed,
            dead_lettered,
        };
        shared.count(counts(5, 1, 0));
        shared.count(counts(2, 3, 1));
        assert_eq!(shared.counts(), counts(7, 4, 1));
        shared.reset(1);
        assert_eq!(shared.counts(), Counts::default());
    }

    #[test]
    fn the_last_publication_only_moves_forward() {
        let shared = DatabaseShare::new();
        assert_eq!(shared.last_published_at(), None);
        shared.record_published(20);
        shared.record_published(10);
        assert_eq!(shared.last_published_at(), Some(20));
    }

    #[test]
    fn a_pause_and_an_absence_end_on_time() {
        let entry = DatabaseShare::new();
        assert!(!entry.is_paused(10));
        entry.pause_until(100);
        assert!(entry.is_paused(99));
        assert!(!entry.is_paused(100));
        entry.absent_until(50);
        assert!(entry.is_absent(49));
        assert!(!entry.is_absent(50));
    }
}

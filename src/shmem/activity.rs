//! Transactions that enqueue, counted in shared memory as they enqueue and as they commit, and
//! read by the relay: whether one may have made events visible below where the relay last
//! claimed, and which partitions a commit wrote to.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::ring::LEAVES;

/// Transactions that enqueued, counted when they enqueue first and again when they have ended
/// (after their commit became visible, or at their rollback or PREPARE). A relay may claim past
/// its last batch only while the two counts stayed equal: then no enqueued event can have
/// become visible below it since (see `relay/claim/cursor.rs`).
///
/// Beside them, per partition of the ring, counts of the commits that wrote to it: one as a
/// transaction is about to commit, one once its commit is visible (or, after the first, once it
/// aborted). A relay that found a partition without a claimable event need not look into it
/// again until the counts move, and may trust that only while the two are equal: no commit is
/// between them (see `relay/claim/cursor.rs`).
#[repr(C)]
pub struct EnqueueActivity {
    started: AtomicU64,
    ended: AtomicU64,
    committing_to: [AtomicU64; LEAVES],
    committed_to: [AtomicU64; LEAVES],
}

impl EnqueueActivity {
    pub(super) fn new() -> EnqueueActivity {
        EnqueueActivity {
            started: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            committing_to: std::array::from_fn(|_| AtomicU64::new(0)),
            committed_to: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// A transaction that wrote events to the partitions in `leaves` (a bit each) is about to
    /// commit.
    pub fn committing_to(&self, leaves: u16) {
        count(&self.committing_to, leaves);
    }

    /// A transaction counted by [`EnqueueActivity::committing_to`] has committed, its commit
    /// visible, or has aborted after all. Before [`EnqueueActivity::end`].
    pub fn committed_to(&self, leaves: u16) {
        count(&self.committed_to, leaves);
    }

    /// Per partition, the count of commits that wrote to it, or `None` while one of them is
    /// between its two counts.
    pub fn commits_to(&self) -> [Option<u64>; LEAVES] {
        std::array::from_fn(|leaf| {
            // The second count first: equal to the first read after it, no commit was between
            // its two counts at that moment.
            let committed = self.committed_to[leaf].load(Ordering::SeqCst);
            let committing = self.committing_to[leaf].load(Ordering::SeqCst);
            (committed == committing).then_some(committed)
        })
    }

    /// A transaction enqueues for the first time.
    pub fn start(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }

    /// A transaction counted by [`EnqueueActivity::start`] has ended.
    pub fn end(&self) {
        self.ended.fetch_add(1, Ordering::SeqCst);
    }

    /// How many transactions have started, if every one of them has ended.
    pub fn quiet(&self) -> Option<u64> {
        // Ended first: a count of started read after it that equals it leaves no transaction in
        // between.
        let ended = self.ended.load(Ordering::SeqCst);
        let started = self.started.load(Ordering::SeqCst);
        (started == ended).then_some(started)
    }

    /// How many transactions have started.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }
}

/// Adds one to each count of `counts` whose bit is set in `leaves`.
fn count(counts: &[AtomicU64; LEAVES], leaves: u16) {
    for (leaf, count) in counts.iter().enumerate() {
        if leaves & (1 << leaf) != 0 {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }
}

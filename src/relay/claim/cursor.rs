//! Where a claim starts: from the lowest unpublished id, or past the last id claimed.
//!
//! The index of unpublished events keeps an entry for each event published since vacuum last
//! came (or since its partition was emptied), and a claim from the lowest id steps over all of
//! them, which slows the draining of a backlog in a table that has been busy for long. A claim
//! past the last id claimed steps over none. It is right only if no event became visible below
//! that id since the claim that reached it: an event committed late below a draining backlog
//! must go out before its key's later events (`tests/keys.rs` shows what happens otherwise).
//!
//! Every transaction that enqueues is counted when it enqueues first and again once it has
//! ended (`shmem::EnqueueActivity`). The relay claims past its last batch only while the two
//! counts stayed equal and unchanged since that batch was claimed: no enqueued event can have
//! appeared below it. A claim past the cursor during which an enqueueing transaction began is
//! claimed again from the lowest id. A `COMMIT PREPARED` statement is counted too, by the utility
//! hook (`hooks/utility.rs`). Rows written without either (a hand-written `INSERT`, a prepared
//! transaction committed by logical replication's apply worker) are not counted: a claim past
//! the cursor that finds too few events looks below it too, at most once per
//! `outbox.poll_interval`, as the poll would.
//!
//! A claim from the lowest id reads the index of unpublished events in every partition of the
//! ring, one index scan each, where a pass woken by a commit finds its handful of events in one
//! of them: under a stream of commits, starting those scans is a measurable part of the relay's
//! time. So each commit that enqueued counts itself against the partitions it wrote to
//! (`shmem::EnqueueActivity`), as it is about to commit and again once it is visible; a claim
//! from the lowest id that found fewer events than it asked for leaves the partitions it read
//! settled at the counts read before it, where no commit was between its two counts. The next
//! claim from the lowest id reads only the partitions whose count moved since: one of them
//! through that partition alone (and again from all, should another move meanwhile), none at
//! all, or, with more, all as before. What reaches a partition without such a commit (a
//! hand-written `INSERT`, a row another session kept locked, the relay's own batch rolled back
//! or held back) is found by a claim from the lowest id in every partition at least once per
//! `outbox.poll_interval`, or at once where the relay knows of it ([`ClaimStart::forget`]);
//! where a `COMMIT PREPARED` could make events visible, every such claim reads every partition.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::model::ring::LEAVES;

/// How long an idle worker may wait, at most `wait`, so as to make each look due once per
/// `poll_interval` from the last one (`looks`: when each was last made) in time, however many
/// passes woken by commits came between. A look overdue is left to the wait: the pass just made
/// could not make it (another worker still held the lanes), and retrying at once would spin.
pub fn until_next_look(
    wait: Duration,
    now: Instant,
    poll_interval: Duration,
    looks: &[Option<Instant>],
) -> Duration {
    looks
        .iter()
        .flatten()
        .map(|at| poll_interval.saturating_sub(now.saturating_duration_since(*at)))
        .filter(|left| !left.is_zero())
        // Whole milliseconds, rounded up, as the latch waits: rounded down, the worker would
        // wake before the look is due and wait again for nothing, 0 ms at a time.
        .map(|left| Duration::from_millis(left.as_micros().div_ceil(1000) as u64))
        .fold(wait, Duration::min)
}

/// Whether a partition other than `leaf` was counted between `before` and `after` (or was
/// between its two counts at either moment): then a claim from `leaf` alone made in between may
/// have seen another partition's events that no count told it about.
pub fn moved_elsewhere(
    before: &[Option<u64>; LEAVES],
    after: &[Option<u64>; LEAVES],
    leaf: usize,
) -> bool {
    (0..LEAVES).any(|l| l != leaf && (before[l].is_none() || before[l] != after[l]))
}

/// The last claim's reach, while it may be claimed past.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    /// The highest id claimed.
    above: i64,
    /// Enqueueing transactions started when it was reached, all of them ended.
    started: u64,
    /// The lanes it was reached in.
    lanes: Range<i16>,
}

/// The partitions a claim from the lowest id found without a claimable event, in some lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Settled {
    /// Per partition, the count of commits to it read before that claim; `None` where a commit
    /// was between its two counts then, which keeps the partition to be looked into.
    at: [Option<u64>; LEAVES],
    lanes: Range<i16>,
}

/// Where a claim from the lowest id looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Nowhere: no commit wrote to a partition since it was found without a claimable event.
    Nowhere,
    /// Into this partition alone.
    Leaf(usize),
    /// Into every partition.
    Everywhere,
}

/// What the relay knows of where its next claim may start.
#[derive(Debug, Default)]
pub struct ClaimStart {
    cursor: Option<Cursor>,
    /// When a claim last looked at the lowest ids in every partition.
    looked_below_at: Option<Instant>,
    settled: Option<Settled>,
}

/// What to do with a claim just made.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// It claimed past the cursor while an enqueueing transaction began: claim again from the
    /// lowest id.
    Redo,
}

impl ClaimStart {
    /// The id to claim past in `lanes`, given the count of enqueueing transactions read just
    /// before the claim (`Some` when none was under way); `None` to claim from the lowest id.
    pub fn above(&self, quiet: Option<u64>, lanes: &Range<i16>) -> Option<i64> {
        match (&self.cursor, quiet) {
            (Some(cursor), Some(started))
                if cursor.started == started && cursor.lanes == *lanes =>
            {
                Some(cursor.above)
            }
            _ => None,
        }
    }

    /// Takes note of a claim in `lanes`: `quiet` as read before it, the count of started
    /// transactions read after it, the id it claimed past (from [`ClaimStart::above`]) and the
    /// highest id it claimed.
    pub fn claimed(
        &mut self,
        quiet: Option<u64>,
        started_after: u64,
        above: Option<i64>,
        highest: Option<i64>,
        lanes: &Range<i16>,
    ) -> Verdict {
        let undisturbed = quiet == Some(started_after);
        if above.is_some() && !undisturbed {
            self.cursor = None;
            return Verdict::Redo;
        }
        self.cursor = match (undisturbed, above.max(highest)) {
            (true, Some(reach)) => Some(Cursor {
                above: reach,
                started: started_after,
                lanes: lanes.clone(),
            }),
            _ => None,
        };
        Verdict::Keep
    }

    /// Whether a claim past the cursor that finds too few events should look below it at
    /// `now`: once per `poll_interval`.
    pub fn below_due(&self, now: Instant, poll_interval: Duration) -> bool {
        self.looked_below_at
            .is_none_or(|at| now.saturating_duration_since(at) >= poll_interval)
    }

    /// When a claim last looked at the lowest ids in every partition.
    pub fn looked_below_at(&self) -> Option<Instant> {
        self.looked_below_at
    }

    /// Takes note that a claim looked at the lowest ids at `now`.
    pub fn looked_below(&mut self, now: Instant) {
        self.looked_below_at = Some(now);
    }

    /// Where a claim from the lowest id in `lanes` must look, given the counts of commits to
    /// each partition read just before it.
    pub fn reach(&mut self, commits: &[Option<u64>; LEAVES], lanes: &Range<i16>) -> Reach {
        if self.settled.as_ref().is_some_and(|s| s.lanes != *lanes) {
            // What was settled in other lanes says nothing of these, nor of those lanes once
            // another worker has had them.
            self.settled = None;
        }
        let Some(settled) = self.settled.as_ref() else {
            return Reach::Everywhere;
        };
        let mut moved = (0..LEAVES)
            .filter(|&leaf| settled.at[leaf].is_none() || settled.at[leaf] != commits[leaf]);
        match (moved.next(), moved.next()) {
            (None, _) => Reach::Nowhere,
            (Some(leaf), None) => Reach::Leaf(leaf),
            _ => Reach::Everywhere,
        }
    }

    /// Takes note of a claim from the lowest id in `lanes` that looked where `reach` says and
    /// found fewer events than it asked for, `commits` being the counts read before it: where
    /// it looked holds no event the relay can claim until a commit writes there.
    pub fn exhausted(&mut self, reach: Reach, commits: &[Option<u64>; LEAVES], lanes: &Range<i16>) {
        match reach {
            Reach::Everywhere => {
                self.settled = Some(Settled {
                    at: *commits,
                    lanes: lanes.clone(),
                });
            }
            Reach::Leaf(leaf) => {
                if let Some(settled) = self.settled.as_mut().filter(|s| s.lanes == *lanes) {
                    settled.at[leaf] = commits[leaf];
                }
            }
            Reach::Nowhere => {}
        }
    }

    /// Moves the cursor back to `id` if it is past it: events above `id` that the claims passed
    /// by (the later events of the key of the failed event `id`) may be claimed now.
    pub fn rewind(&mut self, id: i64) {
        if let Some(cursor) = self.cursor.as_mut() {
            cursor.above = cursor.above.min(id);
        }
    }

    /// Forgets the cursor and the settled partitions: events below it were left unpublished
    /// (held back, or the batch rolled back), or events with lower ids were written (moved from
    /// `outbox_delayed`).
    pub fn forget(&mut self) {
        self.cursor = None;
        self.settled = None;
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{moved_elsewhere, until_next_look, ClaimStart, Reach, Verdict};
    use crate::model::ring::LEAVES;

    const LANES: std::ops::Range<i16> = 0..1024;

    #[test]
    fn a_quiet_claim_leaves_a_cursor_the_next_quiet_claim_starts_past() {
        let mut start = ClaimStart::default();
        assert_eq!(start.above(Some(7), &LANES), None);
        assert_eq!(
            start.claimed(Some(7), 7, None, Some(100), &LANES),
            Verdict::Keep
        );
        assert_eq!(start.above(Some(7), &LANES), Some(100));
        // A claim past it that found nothing keeps it where it was.
        assert_eq!(
            start.claimed(Some(7), 7, Some(100), None, &LANES),
            Verdict::Keep
        );
        assert_eq!(start.above(Some(7), &LANES), Some(100));
        assert_eq!(
            start.claimed(Some(7), 7, Some(100), Some(250), &LANES),
            Verdict::Keep
        );
        assert_eq!(start.above(Some(7), &LANES), Some(250));
    }

    #[test]
    fn a_rewound_cursor_starts_at_the_released_event_and_stays_valid() {
        let mut start = ClaimStart::default();
        start.claimed(Some(7), 7, None, Some(100), &LANES);
        start.rewind(40);
        assert_eq!(start.above(Some(7), &LANES), Some(40));
        // Never forward.
        start.rewind(90);
        assert_eq!(start.above(Some(7), &LANES), Some(40));
        // Still bound to the enqueue counts it was reached at.
        assert_eq!(start.above(Some(8), &LANES), None);
        // Without a cursor there is nothing to move: the next claim starts from the lowest id.
        let mut none = ClaimStart::default();
        none.rewind(40);
        assert_eq!(none.above(Some(7), &LANES), None);
    }

    #[test]
    fn an_enqueue_under_way_or_since_means_a_claim_from_the_lowest_id() {
        let mut start = ClaimStart::default();
        start.claimed(Some(7), 7, None, Some(100), &LANES);
        // Under way now.
        assert_eq!(start.above(None, &LANES), None);
        // Begun and ended since.
        assert_eq!(start.above(Some(8), &LANES), None);
        // Other lanes (the shares moved).
        assert_eq!(start.above(Some(7), &(0..512)), None);
    }

    #[test]
    fn an_enqueue_begun_during_a_claim_past_the_cursor_has_it_redone() {
        let mut start = ClaimStart::default();
        start.claimed(Some(7), 7, None, Some(100), &LANES);
        assert_eq!(
            start.claimed(Some(7), 8, Some(100), Some(200), &LANES),
            Verdict::Redo
        );
        assert_eq!(start.above(Some(8), &LANES), None);
    }

    #[test]
    fn a_claim_from_the_lowest_id_during_an_enqueue_leaves_no_cursor() {
        let mut start = ClaimStart::default();
        assert_eq!(
            start.claimed(None, 8, None, Some(100), &LANES),
            Verdict::Keep
        );
        assert_eq!(start.above(Some(8), &LANES), None);
        assert_eq!(
            start.claimed(Some(8), 9, None, Some(100), &LANES),
            Verdict::Keep
        );
        assert_eq!(start.above(Some(9), &LANES), None);
    }

    #[test]
    fn below_the_cursor_is_looked_at_once_per_poll_interval() {
        let mut start = ClaimStart::default();
        let (t0, poll) = (Instant::now(), Duration::from_secs(1));
        assert!(start.below_due(t0, poll));
        start.looked_below(t0);
        assert!(!start.below_due(t0 + Duration::from_millis(999), poll));
        assert!(start.below_due(t0 + poll, poll));
    }

    #[test]
    fn a_claim_from_the_lowest_id_looks_only_where_commits_wrote_since_it_found_too_few() {
        let mut start = ClaimStart::default();
        let mut commits = [Some(5); LEAVES];
        // Nothing known yet.
        assert_eq!(start.reach(&commits, &LANES), Reach::Everywhere);
        start.exhausted(Reach::Everywhere, &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Nowhere);
        commits[3] = Some(6);
        assert_eq!(start.reach(&commits, &LANES), Reach::Leaf(3));
        let before = commits;
        // A commit lands during the claim that found too few: still to look into.
        commits[3] = Some(7);
        start.exhausted(Reach::Leaf(3), &before, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Leaf(3));
        start.exhausted(Reach::Leaf(3), &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Nowhere);
        // Two partitions written to: every partition, as the claim cannot merge them.
        commits[3] = Some(8);
        commits[4] = Some(6);
        assert_eq!(start.reach(&commits, &LANES), Reach::Everywhere);
        start.exhausted(Reach::Everywhere, &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Nowhere);
    }

    #[test]
    fn a_partition_read_while_a_commit_was_between_its_counts_stays_to_look_into() {
        let mut start = ClaimStart::default();
        let mut commits = [Some(5); LEAVES];
        commits[2] = None;
        start.exhausted(Reach::Everywhere, &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Leaf(2));
        // Its events became visible after the claim: whatever the count now, it is looked into
        // until a claim finds it settled with no commit between counts.
        commits[2] = Some(6);
        assert_eq!(start.reach(&commits, &LANES), Reach::Leaf(2));
        start.exhausted(Reach::Leaf(2), &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Nowhere);
        // A commit between its counts in another partition: both are looked into.
        commits[9] = None;
        commits[2] = Some(7);
        assert_eq!(start.reach(&commits, &LANES), Reach::Everywhere);
    }

    #[test]
    fn settled_partitions_are_forgotten_with_the_cursor_and_with_other_lanes() {
        let mut start = ClaimStart::default();
        let commits = [Some(0); LEAVES];
        start.exhausted(Reach::Everywhere, &commits, &LANES);
        assert_eq!(start.reach(&commits, &LANES), Reach::Nowhere);
        // Other lanes (the shares moved): their events may be anywhere, and once back, so may
        // these lanes' (another worker had them meanwhile).
        assert_eq!(start.reach(&commits, &(0..512)), Reach::Everywhere);
        assert_eq!(start.reach(&commits, &LANES), Reach::Everywhere);
        start.exhausted(Reach::Everywhere, &commits, &LANES);
        start.forget();
        assert_eq!(start.reach(&commits, &LANES), Reach::Everywhere);
    }

    #[test]
    fn an_idle_wait_ends_when_a_look_comes_due() {
        let (t0, poll) = (Instant::now(), Duration::from_secs(1));
        let ms = Duration::from_millis;
        // Looked 900 ms ago: due in 100 ms, not a poll interval after the last pass.
        assert_eq!(
            until_next_look(poll, t0, poll, &[Some(t0 - ms(900))]),
            ms(100)
        );
        // Rounded up to the millisecond the latch can wait.
        let us = Duration::from_micros;
        assert_eq!(
            until_next_look(poll, t0, poll, &[Some(t0 - us(999_700))]),
            ms(1)
        );
        // The soonest of two looks.
        assert_eq!(
            until_next_look(poll, t0, poll, &[Some(t0 - ms(300)), Some(t0 - ms(600))]),
            ms(400)
        );
        // Never made, or overdue: the wait as it was.
        assert_eq!(until_next_look(ms(700), t0, poll, &[None]), ms(700));
        assert_eq!(
            until_next_look(ms(700), t0, poll, &[Some(t0 - ms(1500))]),
            ms(700)
        );
        // A shorter wait stays.
        assert_eq!(
            until_next_look(ms(50), t0, poll, &[Some(t0 - ms(900))]),
            ms(50)
        );
    }

    #[test]
    fn a_claim_from_one_partition_is_redone_when_another_was_counted_meanwhile() {
        let before = [Some(4); LEAVES];
        let mut after = before;
        assert!(!moved_elsewhere(&before, &after, 3));
        // Its own partition counted again: nothing it could not have seen.
        after[3] = Some(5);
        assert!(!moved_elsewhere(&before, &after, 3));
        after[7] = Some(5);
        assert!(moved_elsewhere(&before, &after, 3));
        after[7] = None;
        assert!(moved_elsewhere(&before, &after, 3));
    }

    #[test]
    fn a_forgotten_cursor_is_gone() {
        let mut start = ClaimStart::default();
        start.claimed(Some(7), 7, None, Some(100), &LANES);
        start.forget();
        assert_eq!(start.above(Some(7), &LANES), None);
    }
}

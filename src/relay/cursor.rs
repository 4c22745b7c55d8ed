//! Where a claim starts: from the lowest unpublished id, or past the last id claimed.
//!
//! The index of unpublished events keeps an entry for each event published since vacuum last
//! came (or since its partition was emptied), and a claim from the lowest id steps over all of
//! them; after a soak, that made draining a backlog a third slower. A claim past the last id
//! claimed steps over none. It is right only if no event became visible below that id since the
//! claim that reached it: an event committed late below a draining backlog must go out before
//! its key's later events (`tests/keys.rs` shows what happens otherwise).
//!
//! Every transaction that enqueues is counted when it enqueues first and again once it has
//! ended (`shmem::EnqueueActivity`). The relay claims past its last batch only while the two
//! counts stayed equal and unchanged since that batch was claimed: no enqueued event can have
//! appeared below it. A claim past the cursor during which an enqueueing transaction began is
//! claimed again from the lowest id. Rows written without `outbox_enqueue` (a hand-written
//! `INSERT`, a `COMMIT PREPARED`) are not counted: a claim past the cursor that finds too few
//! events looks below it too, at most once per `outbox.poll_interval`, as the poll would.

use std::ops::Range;
use std::time::{Duration, Instant};

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

/// What the relay knows of where its next claim may start.
#[derive(Debug, Default)]
pub struct ClaimStart {
    cursor: Option<Cursor>,
    /// When a claim last looked at the lowest ids.
    looked_below_at: Option<Instant>,
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

    /// Takes note that a claim looked at the lowest ids at `now`.
    pub fn looked_below(&mut self, now: Instant) {
        self.looked_below_at = Some(now);
    }

    /// Forgets the cursor: events below it were left unpublished (held back, or the batch rolled
    /// back), or events with lower ids were written (moved from `outbox_delayed`).
    pub fn forget(&mut self) {
        self.cursor = None;
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{ClaimStart, Verdict};

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
    fn a_forgotten_cursor_is_gone() {
        let mut start = ClaimStart::default();
        start.claimed(Some(7), 7, None, Some(100), &LANES);
        start.forget();
        assert_eq!(start.above(Some(7), &LANES), None);
    }
}

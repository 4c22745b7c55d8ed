//! Events held behind an earlier event of their key, and the look that frees those whose key
//! has nothing before them any more. Pure logic, unit-tested; the SQL is in `sql.rs`.
//!
//! An event whose key (else topic) has an earlier event that failed is held: the claim that
//! finds it blocked sets its `next_attempt_at` to 'infinity', in the same transaction. It leaves
//! the index of fresh events, which every claim reads in id order, and waits in the index of
//! retries past every due time: however many are held, a claim reads each once, not once per
//! pass. A held event still holds back the later events of its key, as a failed one does.
//!
//! The relay releases a key's held events in the transaction that removes the key's first event
//! that failed: when it is published, or buried in `outbox_dead`. Those are the relay's own
//! doing; an event removed by hand (`DELETE`, or marked published) releases nothing, so once per
//! poll interval, while something in its lanes holds others back, the worker looks at the next
//! few of those events in index order for a held one with nothing before it in its key, and
//! releases that key. A whole round takes as many poll intervals as the held events fill looks.

use std::ops::Range;
use std::time::{Duration, Instant};

/// Where the look for held events whose key has nothing before them stands.
#[derive(Debug, Default)]
pub struct Sweep {
    /// The lanes looked in, and the last entry the last look read (the next starts past it);
    /// `None` after a look that read to the end.
    lanes: Option<Range<i16>>,
    after: Option<i64>,
    looked_at: Option<Instant>,
}

impl Sweep {
    /// Whether a look is due in `lanes` at `now` (once per `poll_interval`), and if so, the
    /// entry it starts past (`None`: from the start of the lanes).
    pub fn due(
        &mut self,
        lanes: &Range<i16>,
        now: Instant,
        poll_interval: Duration,
    ) -> Option<Option<i64>> {
        if self.lanes.as_ref() != Some(lanes) {
            // Other lanes: the position says nothing of them.
            self.lanes = Some(lanes.clone());
            self.after = None;
            self.looked_at = None;
        }
        let due = self
            .looked_at
            .is_none_or(|at| now.saturating_duration_since(at) >= poll_interval);
        due.then_some(self.after)
    }

    /// Takes note of a look at `now` that asked for `limit` entries and read `entries` (id, and
    /// whether it is a held event with nothing before it in its key); returns the ids of those
    /// to release.
    pub fn looked(&mut self, now: Instant, limit: usize, entries: &[(i64, bool)]) -> Vec<i64> {
        self.looked_at = Some(now);
        self.after = match entries.last() {
            Some(&(id, _)) if entries.len() >= limit => Some(id),
            // The end of the lanes: the next look starts over.
            _ => None,
        };
        entries
            .iter()
            .filter(|(_, stuck)| *stuck)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Forgets the position: the ids it names belong to another table.
    pub fn forget(&mut self) {
        *self = Sweep::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LANES: Range<i16> = 0..1024;

    #[test]
    fn a_look_is_due_once_per_poll_interval() {
        let (t0, poll) = (Instant::now(), Duration::from_secs(1));
        let mut sweep = Sweep::default();
        assert_eq!(sweep.due(&LANES, t0, poll), Some(None));
        assert!(sweep.looked(t0, 10, &[]).is_empty());
        assert_eq!(
            sweep.due(&LANES, t0 + Duration::from_millis(999), poll),
            None
        );
        assert_eq!(sweep.due(&LANES, t0 + poll, poll), Some(None));
        // A clock read before the look was recorded counts the look as recent.
        assert_eq!(sweep.due(&LANES, t0 - Duration::from_millis(1), poll), None);
    }

    #[test]
    fn a_full_look_is_continued_past_its_last_entry_and_a_short_one_starts_over() {
        let (t0, poll) = (Instant::now(), Duration::from_millis(100));
        let mut sweep = Sweep::default();
        assert_eq!(sweep.due(&LANES, t0, poll), Some(None));
        let stuck = sweep.looked(t0, 3, &[(7, false), (9, true), (4, false)]);
        assert_eq!(stuck, [9]);
        // Index order, not id order: the last entry read is where the next look starts.
        assert_eq!(sweep.due(&LANES, t0 + poll, poll), Some(Some(4)));
        let stuck = sweep.looked(t0 + poll, 3, &[(12, true), (15, true)]);
        assert_eq!(stuck, [12, 15]);
        assert_eq!(sweep.due(&LANES, t0 + 2 * poll, poll), Some(None));
    }

    #[test]
    fn other_lanes_or_another_table_start_from_the_beginning_at_once() {
        let (t0, poll) = (Instant::now(), Duration::from_secs(1));
        let mut sweep = Sweep::default();
        assert_eq!(sweep.due(&LANES, t0, poll), Some(None));
        sweep.looked(t0, 1, &[(5, false)]);
        assert_eq!(sweep.due(&(0..512), t0, poll), Some(None));
        sweep.looked(t0, 1, &[(5, false)]);
        assert_eq!(sweep.due(&(0..512), t0 + poll, poll), Some(Some(5)));
        sweep.forget();
        assert_eq!(sweep.due(&(0..512), t0 + poll, poll), Some(None));
    }
}

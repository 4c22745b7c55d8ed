//! When an event that failed is tried again. The schedule itself is in the table
//! (`next_attempt_at`), shared by every worker and kept across restarts; a worker only keeps the
//! earliest retry it scheduled, so that it looks for due events then rather than at its next
//! poll. Also when a claim looks for due events, and when a worker looks again for failed events
//! in its lanes. Pure logic, unit-tested.

use std::ops::Range;
use std::time::{Duration, Instant};

/// Longest wait before an event that failed is tried again.
pub const CAP: Duration = Duration::from_secs(60);

/// Wait before an event that failed `attempts` times is claimed again: 1 s, 2 s, 4 s ... capped
/// at [`CAP`], so that a poison event costs little while it exhausts `outbox.max_attempts` and
/// the events behind it flow on.
pub fn delay(attempts: i32) -> Duration {
    let exponent = attempts.saturating_sub(1).clamp(0, 31) as u32;
    Duration::from_secs(1)
        .checked_mul(2u32.saturating_pow(exponent))
        .map_or(CAP, |d| d.min(CAP))
}

/// The earliest retry this worker scheduled and has not yet reached.
#[derive(Debug, Default)]
pub struct RetrySchedule {
    next: Option<Instant>,
}

impl RetrySchedule {
    /// Notes that an event will be due at `at`.
    pub fn scheduled(&mut self, at: Instant) {
        self.next = Some(self.next.map_or(at, |next| next.min(at)));
    }

    /// How long to sleep at `now` when nothing wakes the worker: the poll interval, or less when
    /// a retry falls due sooner; at least a millisecond.
    pub fn wait(&mut self, now: Instant, poll_interval: Duration) -> Duration {
        if self.next.is_some_and(|at| at <= now) {
            self.next = None;
        }
        self.next
            .map_or(poll_interval, |at| (at - now).min(poll_interval))
            .max(Duration::from_millis(1))
    }
}

/// Whether a claim looks for events whose retry is due, and in what room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DueLook {
    /// Not in this claim.
    Skip,
    /// In the room the events that never failed leave.
    IfRoom,
    /// Before the events that never failed, sure of half the room (all of a room of one) and
    /// given what the fresh events leave of the rest: a backlog that fills every batch would
    /// otherwise hold retries off until it drained.
    First,
}

impl DueLook {
    /// How a claim at `now` looks for due events, given when a claim last found all it could
    /// take (`looked_at`): first once `poll_interval` has passed since, so that a due event
    /// waits at most about that long whatever the backlog; in between, in the room left while
    /// an event of the worker's lanes is `failing` (its retry may fall due at any pass).
    pub fn at(
        now: Instant,
        looked_at: Option<Instant>,
        poll_interval: Duration,
        failing: bool,
    ) -> DueLook {
        if looked_at.is_none_or(|at| now.saturating_duration_since(at) >= poll_interval) {
            DueLook::First
        } else if failing {
            DueLook::IfRoom
        } else {
            DueLook::Skip
        }
    }
}

/// How long a worker that saw no failed event in its lanes trusts that, before looking again:
/// an event charged by hand is noticed this late (and one charged by another worker in lanes
/// that went to it and came back between two looks), whereas the worker's own failures are
/// noticed at once, and so are those in lanes other than the ones it last looked at.
pub const FAILING_RECHECK: Duration = Duration::from_millis(100);

/// What the worker last saw of failed events (`attempts > 0`) in its lanes, which lanes it
/// looked at, and when.
#[derive(Debug, Default)]
pub struct FailingLook {
    lanes: Option<Range<i16>>,
    at: Option<Instant>,
    failing: bool,
}

impl FailingLook {
    /// Whether a pass over `lanes` at `now` looks again: on every pass while something has
    /// failed; else once [`FAILING_RECHECK`] has passed since the last look, or at once when
    /// `lanes` are not the lanes looked at (a share that grew holds lanes whose previous worker
    /// may have charged an event a moment ago).
    pub fn stale(&self, lanes: &Range<i16>, now: Instant) -> bool {
        self.failing
            || self.lanes.as_ref() != Some(lanes)
            || self
                .at
                .is_none_or(|at| now.saturating_duration_since(at) >= FAILING_RECHECK)
    }

    /// Records a look over `lanes` at `now`.
    pub fn looked(&mut self, lanes: &Range<i16>, now: Instant, failing: bool) {
        self.lanes = Some(lanes.clone());
        self.at = Some(now);
        self.failing = failing;
    }

    /// One of the worker's own events failed: something is failing until a look says otherwise.
    pub fn failed(&mut self) {
        self.failing = true;
    }

    /// Whether an event had failed at the last look, or failed since.
    pub fn failing(&self) -> bool {
        self.failing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_per_attempt() {
        assert_eq!(delay(0), Duration::from_secs(1));
        assert_eq!(delay(1), Duration::from_secs(1));
        assert_eq!(delay(2), Duration::from_secs(2));
        assert_eq!(delay(4), Duration::from_secs(8));
        assert_eq!(delay(7), CAP);
        assert_eq!(delay(i32::MAX), CAP);
    }

    #[test]
    fn the_worker_wakes_for_its_earliest_retry_then_polls() {
        let start = Instant::now();
        let poll = Duration::from_secs(1);
        let mut schedule = RetrySchedule::default();
        assert_eq!(schedule.wait(start, poll), poll);
        schedule.scheduled(start + Duration::from_millis(400));
        schedule.scheduled(start + Duration::from_millis(900));
        assert_eq!(schedule.wait(start, poll), Duration::from_millis(400));
        // A later retry does not push back an earlier one.
        schedule.scheduled(start + Duration::from_secs(5));
        assert_eq!(
            schedule.wait(start + Duration::from_millis(100), poll),
            Duration::from_millis(300)
        );
        // Once it is reached, the worker polls again; a retry further off than the poll waits
        // for the poll.
        assert_eq!(
            schedule.wait(start + Duration::from_millis(400), poll),
            poll
        );
        schedule.scheduled(start + Duration::from_secs(30));
        assert_eq!(schedule.wait(start, poll), poll);
        assert_eq!(
            RetrySchedule::default().wait(start, Duration::ZERO),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn due_events_are_looked_for_first_once_a_poll_interval_has_passed() {
        let start = Instant::now();
        let poll = Duration::from_millis(500);
        let soon = start + Duration::from_millis(100);
        let later = start + poll;
        // Never looked: first, failing or not.
        assert_eq!(DueLook::at(start, None, poll, false), DueLook::First);
        assert_eq!(DueLook::at(start, None, poll, true), DueLook::First);
        // Looked recently: in the room left while something fails, else not at all.
        assert_eq!(DueLook::at(soon, Some(start), poll, true), DueLook::IfRoom);
        assert_eq!(DueLook::at(soon, Some(start), poll, false), DueLook::Skip);
        // A poll interval since the last look: first, however full the batches are.
        assert_eq!(DueLook::at(later, Some(start), poll, true), DueLook::First);
        assert_eq!(DueLook::at(later, Some(start), poll, false), DueLook::First);
        // A clock read before the last look was recorded counts that look as recent.
        assert_eq!(DueLook::at(start, Some(soon), poll, false), DueLook::Skip);
    }

    #[test]
    fn failed_events_are_looked_for_again_when_the_lanes_change() {
        let start = Instant::now();
        let soon = start + Duration::from_millis(10);
        let half = 0..8;
        let all = 0..16;
        let mut look = FailingLook::default();
        // Never looked.
        assert!(look.stale(&half, start));
        look.looked(&half, start, false);
        // Nothing failed in these lanes a moment ago: trusted until FAILING_RECHECK has passed.
        assert!(!look.stale(&half, soon));
        assert!(look.stale(&half, start + FAILING_RECHECK));
        // A share that grew: its new lanes were never looked at, however recent the look.
        assert!(look.stale(&all, soon));
        look.looked(&all, soon, false);
        assert!(!look.stale(&all, soon));
        // A share that shrank is another set of lanes too.
        assert!(look.stale(&half, soon));
        // A look that found a failed event is followed by another at the next pass.
        look.looked(&all, soon, true);
        assert!(look.failing());
        assert!(look.stale(&all, soon));
        look.looked(&all, soon, false);
        assert!(!look.stale(&all, soon));
        // While something fails, every pass looks.
        look.failed();
        assert!(look.failing());
        assert!(look.stale(&all, soon));
        look.looked(&all, soon, false);
        assert!(!look.failing());
        // A clock read before the look was recorded counts the look as recent.
        assert!(!look.stale(&all, start));
    }
}

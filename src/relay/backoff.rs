//! How long the relay waits: after losing Redis, and between passes under a stream of commits.
//! Pure logic, unit-tested.

use std::time::{Duration, Instant};

/// First wait after Redis becomes unreachable.
pub const INITIAL: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to reach Redis.
pub const CAP: Duration = Duration::from_secs(10);
/// Exponential backoff for a lost Redis: 100 ms, 200 ms, 400 ms ... capped at [`CAP`].
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
}

impl Backoff {
    /// Records one more failure and returns how long to wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = doubling(INITIAL, self.failures, CAP);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// Whether the last attempt failed.
    pub fn is_failing(&self) -> bool {
        self.failures > 0
    }

    /// Records a success; returns whether that ends a run of failures.
    pub fn reset(&mut self) -> bool {
        std::mem::take(&mut self.failures) > 0
    }
}

/// Least time between the starts of two passes woken by commits.
pub const SPACING: Duration = Duration::from_millis(1);
/// Most time between the starts of two passes woken by commits: what a commit may wait for the
/// next pass to start, at most.
pub const MAX_SPACING: Duration = Duration::from_millis(4);
/// Passes take at most this share of the relay's time while commits keep coming, so that the
/// relay leaves the CPU to the writers when they are the ones who need it.
pub const BUSY_SHARE: u32 = 3;

/// Least time between the starts of two passes woken by commits, given how many events the
/// last pass published and how long it took.
///
/// A pass that found nothing lets the next commit be published at once. Otherwise the next
/// pass takes what committed while this one ran: it starts as soon as a commit wakes the relay,
/// but no sooner than [`SPACING`] after this one started, so that a pass gathers at least a
/// millisecond of commits instead of paying a transaction and a round trip per commit, and no
/// sooner than [`BUSY_SHARE`] times its own length, so that on a loaded machine, where passes
/// take longer, the relay takes no more than its share; within [`MAX_SPACING`]. Batches grow
/// with the load by themselves, up to `outbox.batch_size`, after which passes follow each other
/// at once.
pub fn pass_spacing(published: u64, took: Duration) -> Duration {
    match published {
        0 => Duration::ZERO,
        _ => took.saturating_mul(BUSY_SHARE).clamp(SPACING, MAX_SPACING),
    }
}

/// When the next pass may start, from when the last one started, how long it took and what it
/// published.
#[derive(Debug)]
pub struct Pacing {
    last_started: Instant,
    took: Duration,
    published: u64,
}

impl Pacing {
    pub fn new(now: Instant) -> Pacing {
        Pacing {
            last_started: now,
            took: Duration::ZERO,
            published: 0,
        }
    }

    pub fn pass_started(&mut self, now: Instant) {
        self.last_started = now;
    }

    pub fn pass_ended(&mut self, now: Instant, events: u64) {
        self.took = now.saturating_duration_since(self.last_started);
        self.published = events;
    }

    pub fn next_pass_at(&self) -> Instant {
        self.last_started + pass_spacing(self.published, self.took)
    }
}

fn doubling(base: Duration, exponent: u32, cap: Duration) -> Duration {
    base.checked_mul(2u32.saturating_pow(exponent.min(31)))
        .map_or(cap, |d| d.min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let mut b = Backoff::default();
        let delays: Vec<u128> = (0..10).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(
            delays,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000, 10_000]
        );
        for _ in 0..100 {
            assert_eq!(b.next_delay(), CAP);
        }
    }

    #[test]
    fn reset_reports_the_end_of_a_failure_run() {
        let mut b = Backoff::default();
        assert!(!b.reset());
        b.next_delay();
        assert!(b.is_failing());
        assert!(b.reset());
        assert!(!b.is_failing());
        assert_eq!(b.next_delay(), INITIAL);
    }

    #[test]
    fn passes_are_spaced_by_their_length_within_bounds() {
        let us = Duration::from_micros;
        assert_eq!(pass_spacing(0, us(900)), Duration::ZERO);
        assert_eq!(pass_spacing(1, us(100)), SPACING);
        // A pass of 0.5 ms: the next one 1.5 ms after it started.
        assert_eq!(pass_spacing(10, us(500)), us(1_500));
        assert_eq!(pass_spacing(10, us(5_000)), MAX_SPACING);
        assert_eq!(pass_spacing(u64::MAX, Duration::MAX), MAX_SPACING);
    }

    #[test]
    fn pacing_spaces_the_next_pass_from_the_start_of_the_last() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let mut pacing = Pacing::new(start);
        pacing.pass_started(start + ms(10));
        pacing.pass_ended(start + ms(10) + Duration::from_micros(200), 50);
        assert_eq!(pacing.next_pass_at(), start + ms(11));
        pacing.pass_started(start + ms(20));
        pacing.pass_ended(start + ms(22), 50);
        assert_eq!(pacing.next_pass_at(), start + ms(24));
        pacing.pass_started(start + ms(30));
        pacing.pass_ended(start + ms(31), 0);
        assert_eq!(pacing.next_pass_at(), start + ms(30));
    }
}

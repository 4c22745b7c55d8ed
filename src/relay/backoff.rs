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

/// Passes that published fewer events than this are a trickle: the next one may start 1 ms later.
pub const TRICKLE: u64 = 10;
/// Least spacing of passes under a busy stream.
pub const BUSY_MIN: Duration = Duration::from_millis(5);
/// Most spacing of passes under a busy stream: the latency a busy stream's events may gain.
pub const BUSY_MAX: Duration = Duration::from_millis(20);

/// Least time between the starts of two passes woken by commits, given how many events the
/// last pass published and how long after the pass before it that pass started.
///
/// A pass that found nothing lets the next commit be published at once. A trickle (fewer than
/// [`TRICKLE`] events) waits 1 ms: its commits are further apart than that, so it costs them no
/// latency. Under a busy stream, every pass pays a transaction and a Redis round trip however
/// few events it carries, and a commit-woken relay would otherwise pass far more often than a
/// polled one, at a higher cost per event. So the next pass waits until, at the rate the last
/// one saw, three quarters of a batch have committed, within [`BUSY_MIN`]..[`BUSY_MAX`]: most
/// of a batch, but not all of it, since a full pass is followed at once by another, small one.
pub fn pass_spacing(published: u64, since_previous: Duration, batch_size: usize) -> Duration {
    match published {
        0 => Duration::ZERO,
        1..TRICKLE => Duration::from_millis(1),
        _ => since_previous
            .mul_f64(0.75 * batch_size as f64 / published as f64)
            .clamp(BUSY_MIN, BUSY_MAX),
    }
}

/// When the passes woken by commits began, and what the last one published.
#[derive(Debug)]
pub struct Pacing {
    last_started: Instant,
    /// From the start of the pass before the last one to the start of the last one.
    interval: Duration,
    published: u64,
}

impl Pacing {
    pub fn new(now: Instant) -> Pacing {
        Pacing {
            last_started: now,
            interval: Duration::ZERO,
            published: 0,
        }
    }

    pub fn pass_started(&mut self, now: Instant) {
        self.interval = now.saturating_duration_since(self.last_started);
        self.last_started = now;
    }

    pub fn pass_published(&mut self, events: u64) {
        self.published = events;
    }

    /// The earliest time the next pass woken by a commit may start (see [`pass_spacing`]).
    pub fn next_pass_at(&self, batch_size: usize) -> Instant {
        self.last_started + pass_spacing(self.published, self.interval, batch_size)
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
    fn passes_are_spaced_by_how_busy_the_last_one_was() {
        let ms = Duration::from_millis;
        assert_eq!(pass_spacing(0, ms(3), 100), Duration::ZERO);
        assert_eq!(pass_spacing(1, ms(3), 100), ms(1));
        assert_eq!(pass_spacing(9, ms(3), 100), ms(1));
        // 50 events in 10 ms: three quarters of a batch of 100 gather in 15 ms.
        assert_eq!(pass_spacing(50, ms(10), 100), ms(15));
        // Faster than a batch per 5 ms, or slower than one per 20 ms: the bounds.
        assert_eq!(pass_spacing(100, ms(2), 100), BUSY_MIN);
        assert_eq!(pass_spacing(10, ms(100), 100), BUSY_MAX);
        assert_eq!(
            pass_spacing(10, Duration::from_secs(3600), 10_000),
            BUSY_MAX
        );
        assert_eq!(pass_spacing(u64::MAX, Duration::ZERO, 10_000), BUSY_MIN);
    }

    #[test]
    fn pacing_spaces_the_next_pass_from_the_start_of_the_last() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let mut pacing = Pacing::new(start);
        pacing.pass_started(start + ms(10));
        pacing.pass_published(50);
        // 50 events in the 10 ms since the pass before: 75 gather in 15 ms.
        assert_eq!(pacing.next_pass_at(100), start + ms(25));
        pacing.pass_started(start + ms(30));
        pacing.pass_published(0);
        assert_eq!(pacing.next_pass_at(100), start + ms(30));
    }
}

//! How long the relay waits: after losing Redis, and between passes under a stream of commits.
//! Pure logic, unit-tested (the one reading of the scheduler's clock is `contention.rs`'s).

use std::time::{Duration, Instant};

use super::contention::{self, Contention};

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

/// How far apart passes are spaced while commits keep coming: 1 ms for each `per_ms` events a
/// second the last pass saw, from [`SPACING`] up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spacing {
    pub per_ms: u32,
    pub max: Duration,
}

/// With CPUs to spare: 2 ms at 5,000 events/s, 4 ms at 10,000, at most 8 ms, what a commit may
/// wait for the next pass to start.
pub const IDLE_CPUS: Spacing = Spacing {
    per_ms: 2_500,
    max: Duration::from_millis(8),
};

/// While the relay's thread waits for a CPU (`contention.rs`): every pass then takes CPU from
/// the writers, so passes carry ten times the events, 4 ms at 1,000 events/s, at most 20 ms.
pub const CONTENDED_CPUS: Spacing = Spacing {
    per_ms: 250,
    max: Duration::from_millis(20),
};

/// Least time between the starts of two passes woken by commits, given how many events the
/// last pass published, how long after the pass before it that pass started, and the spacing
/// the machine's load calls for.
///
/// A pass that found nothing lets the next commit be published at once. Otherwise the next
/// pass takes what committed since this one started: it starts as soon as a commit wakes the
/// relay, but no sooner than [`SPACING`] after this one, so that a pass gathers at least a
/// millisecond of commits instead of paying a transaction and a round trip per commit. The
/// busier the stream (at the rate the last pass saw), the longer the wait, up to the
/// spacing's most: every pass costs a transaction and a Redis round trip however few events it
/// carries, and under a heavy stream the relay would otherwise take CPU from the writers for
/// passes of a few events each. Batches grow with the load, up to `outbox.batch_size`, after
/// which passes follow each other at once.
pub fn pass_spacing(published: u64, since_previous: Duration, spacing: Spacing) -> Duration {
    if published == 0 {
        return Duration::ZERO;
    }
    let rate = published as f64 / since_previous.as_secs_f64().max(1e-6);
    Duration::from_micros((rate / f64::from(spacing.per_ms) * 1000.0).min(1e9) as u64)
        .clamp(SPACING, spacing.max)
}

/// When the next pass may start, from when the last two started and what the last published.
#[derive(Debug)]
pub struct Pacing {
    last_started: Instant,
    /// From the start of the pass before the last one to the start of the last one.
    interval: Duration,
    published: u64,
    contention: Contention,
}

impl Pacing {
    pub fn new(now: Instant) -> Pacing {
        Pacing {
            last_started: now,
            interval: Duration::ZERO,
            published: 0,
            contention: Contention::new(now, contention::read()),
        }
    }

    pub fn pass_started(&mut self, now: Instant) {
        self.interval = now.saturating_duration_since(self.last_started);
        self.last_started = now;
        if self.contention.due(now) {
            self.contention.sample(now, contention::read());
        }
    }

    pub fn pass_ended(&mut self, events: u64) {
        self.published = events;
    }

    pub fn next_pass_at(&self) -> Instant {
        let spacing = if self.contention.contended() {
            CONTENDED_CPUS
        } else {
            IDLE_CPUS
        };
        self.last_started + pass_spacing(self.published, self.interval, spacing)
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
    fn passes_are_spaced_by_the_rate_within_bounds() {
        let ms = Duration::from_millis;
        let idle = IDLE_CPUS;
        assert_eq!(pass_spacing(0, ms(3), idle), Duration::ZERO);
        // 5 events in 10 ms, 500 a second: the least spacing.
        assert_eq!(pass_spacing(5, ms(10), idle), SPACING);
        // 10 events in 2 ms, 5,000 a second: 2 ms.
        assert_eq!(pass_spacing(10, ms(2), idle), ms(2));
        // 40 events in 4 ms, 10,000 a second: 4 ms.
        assert_eq!(pass_spacing(40, ms(4), idle), ms(4));
        assert_eq!(pass_spacing(1_000, ms(1), idle), idle.max);
        assert_eq!(pass_spacing(u64::MAX, Duration::ZERO, idle), idle.max);
        assert_eq!(pass_spacing(1, Duration::MAX, idle), SPACING);
    }

    #[test]
    fn contended_cpus_space_passes_ten_times_as_far() {
        let ms = Duration::from_millis;
        let busy = CONTENDED_CPUS;
        assert_eq!(pass_spacing(0, ms(3), busy), Duration::ZERO);
        // 1,000 events a second: 4 ms; 2,500: 10 ms, ten times the idle machine's 1 ms.
        assert_eq!(pass_spacing(4, ms(4), busy), ms(4));
        assert_eq!(pass_spacing(25, ms(10), busy), ms(10));
        assert_eq!(pass_spacing(25, ms(10), IDLE_CPUS), SPACING);
        // 6,000 a second: the most, 20 ms.
        assert_eq!(pass_spacing(60, ms(10), busy), busy.max);
        assert_eq!(pass_spacing(1, Duration::MAX, busy), SPACING);
    }

    #[test]
    fn pacing_spaces_the_next_pass_from_the_start_of_the_last() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let mut pacing = Pacing::new(start);
        pacing.pass_started(start + ms(10));
        pacing.pass_ended(5);
        assert_eq!(pacing.next_pass_at(), start + ms(11));
        pacing.pass_started(start + ms(14));
        pacing.pass_ended(20);
        // 20 events in the 4 ms since the pass before: 5,000 a second, 2 ms.
        assert_eq!(pacing.next_pass_at(), start + ms(16));
        pacing.pass_started(start + ms(30));
        pacing.pass_ended(0);
        assert_eq!(pacing.next_pass_at(), start + ms(30));
    }
}

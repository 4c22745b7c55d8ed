//! Whether the relay's thread waits for a CPU: the sign that the machine runs more than it has
//! cores for, when each pass the relay makes takes CPU the writing backends would use.
//!
//! Linux counts, for each thread, the time it ran, the time it waited on a run queue, ready but
//! without a CPU, and the times it was given one (`/proc/thread-self/schedstat`). Over windows
//! of [`WINDOW`] of wall time, how long the relay's main thread waited on average each time
//! it was woken says whether the CPUs are contended (see [`WAIT_PER_WAKE`]). The measure is
//! mostly the machine's load, but not only: once passes are spaced wider, each wake-up carries
//! more work and waits longer (on the machine of [`WAIT_PER_WAKE`], 106 us became 175 us at
//! 5,000 events/s, about 200 us about 280 us at full load), so a contended relay tends to stay
//! so while that load lasts. Where the file cannot be read (another kernel, a kernel without
//! scheduler statistics), nothing is ever contended. Pure logic, unit-tested, beside the one
//! read.

use std::time::{Duration, Instant};

/// The wall time over which the waiting is summed before it is judged.
pub const WINDOW: Duration = Duration::from_millis(100);

/// Contended: on average over a window, the thread waited at least this long for a CPU each
/// time it was woken. With a CPU free, a woken thread runs within tens of microseconds; with
/// more runnable processes than CPUs, it waits for another's time slice to end. Measured on
/// a 2-core machine over 6 s, the relay's main thread waited 25 us a wake-up beside writers at
/// 500 events/s, 106 us at 5,000 events/s and about 200 us with pgbench's 8 clients writing as
/// fast as they could.
pub const WAIT_PER_WAKE: Duration = Duration::from_micros(150);

/// What the contention is judged by in a thread's scheduler clock: the time it waited for a
/// CPU, and how many times it was given one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedClock {
    pub waited: Duration,
    pub slices: u64,
}

/// `schedstat`'s text: nanoseconds run (checked, not kept), nanoseconds waited on a run queue,
/// time slices.
pub fn parse(text: &str) -> Option<SchedClock> {
    let mut fields = text.split_ascii_whitespace().map(str::parse::<u64>);
    let _ran = fields.next()?.ok()?;
    let waited = fields.next()?.ok()?;
    let slices = fields.next()?.ok()?;
    Some(SchedClock {
        waited: Duration::from_nanos(waited),
        slices,
    })
}

/// The calling thread's scheduler clock, if the kernel shows it.
pub fn read() -> Option<SchedClock> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|text| parse(&text))
}

/// Whether the CPUs were contended in the last whole window.
#[derive(Debug)]
pub struct Contention {
    started: Instant,
    at_start: Option<SchedClock>,
    contended: bool,
}

impl Contention {
    pub fn new(now: Instant, clock: Option<SchedClock>) -> Contention {
        Contention {
            started: now,
            at_start: clock,
            contended: false,
        }
    }

    /// Whether a window has passed, to be judged from a reading.
    pub fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.started) >= WINDOW
    }

    /// Takes a reading; once a window has passed, judges it and starts the next.
    pub fn sample(&mut self, now: Instant, clock: Option<SchedClock>) {
        if !self.due(now) {
            return;
        }
        self.contended = match (self.at_start, clock) {
            (Some(then), Some(now)) => {
                let waited = now.waited.saturating_sub(then.waited);
                let wakes = now.slices.saturating_sub(then.slices);
                wakes > 0
                    && waited >= WAIT_PER_WAKE.saturating_mul(wakes.min(u32::MAX.into()) as u32)
            }
            _ => false,
        };
        self.started = now;
        self.at_start = clock;
    }

    pub fn contended(&self) -> bool {
        self.contended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clock(waited_us: u64, wakes: u64) -> Option<SchedClock> {
        Some(SchedClock {
            waited: Duration::from_micros(waited_us),
            slices: wakes,
        })
    }

    #[test]
    fn reads_the_kernels_line() {
        assert_eq!(
            parse("105504 2338640 3\n"),
            Some(SchedClock {
                waited: Duration::from_nanos(2_338_640),
                slices: 3,
            })
        );
        assert_eq!(parse(""), None);
        assert_eq!(parse("12 x 3"), None);
        assert_eq!(parse("12 13"), None);
    }

    #[test]
    fn judges_each_whole_window_by_the_wait_per_wake_up() {
        let start = Instant::now();
        let ms = Duration::from_millis;
        let mut contention = Contention::new(start, clock(0, 0));
        // Within the window nothing is judged, however long the waits.
        assert!(!contention.due(start + ms(50)));
        contention.sample(start + ms(50), clock(40_000, 10));
        assert!(!contention.contended());
        // 100 wake-ups that waited 20 ms in all: 200 us each, contended.
        contention.sample(start + ms(100), clock(20_000, 100));
        assert!(contention.contended());
        // The next 400 waited 10 ms more: 25 us each.
        contention.sample(start + ms(220), clock(30_000, 500));
        assert!(!contention.contended());
        // 100 at exactly 150 us each.
        contention.sample(start + ms(420), clock(45_000, 600));
        assert!(contention.contended());
        // No wake-up in a window: nothing to judge by.
        contention.sample(start + ms(600), clock(45_000, 600));
        assert!(!contention.contended());
    }

    #[test]
    fn without_the_kernels_figures_nothing_is_contended() {
        let start = Instant::now();
        let mut contention = Contention::new(start, None);
        contention.sample(start + Duration::from_secs(1), None);
        assert!(!contention.contended());
        let mut contention = Contention::new(start, clock(0, 0));
        contention.sample(start + Duration::from_secs(1), clock(900_000, 10));
        assert!(contention.contended());
        contention.sample(start + Duration::from_secs(2), None);
        assert!(!contention.contended());
    }
}

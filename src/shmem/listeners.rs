//! How many sessions listen on each channel, by database: `outbox_enqueue` notifies at commit
//! only where someone can hear it (a notifying commit takes a database-wide lock through its
//! flush, which costs every writer when nobody listens).
//!
//! A fixed array of counters, each channel of each database counted in the one a hash of both
//! picks. Channels that share a counter are counted together: a database may then notify on a
//! channel nobody listens to, which costs what it always did, and never fails to notify one
//! that has a listener. The counts are kept by the backends that listen (`hooks/listen.rs`).

use std::sync::atomic::{AtomicU32, Ordering};

/// Counters in all.
const COUNTERS: usize = 4096;

pub struct Listeners {
    counts: [AtomicU32; COUNTERS],
}

impl Listeners {
    pub fn new() -> Listeners {
        Listeners {
            counts: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }

    fn counter(&self, database: u32, channel: &[u8]) -> &AtomicU32 {
        &self.counts[counter_of(database, channel)]
    }

    /// A session of `database` listens on `channel` from now on.
    pub fn add(&self, database: u32, channel: &[u8]) {
        self.counter(database, channel)
            .fetch_add(1, Ordering::AcqRel);
    }

    /// A session of `database` no longer listens on `channel`.
    pub fn remove(&self, database: u32, channel: &[u8]) {
        let _ = self.counter(database, channel).fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |count| Some(count.saturating_sub(1)),
        );
    }

    /// Sessions of `database` listening on `channel` (or on a channel counted with it).
    pub fn count(&self, database: u32, channel: &[u8]) -> u32 {
        self.counter(database, channel).load(Ordering::Acquire)
    }
}

/// The counter of `channel` in `database`: FNV-1a of both.
fn counter_of(database: u32, channel: &[u8]) -> usize {
    let mut hash: u32 = 0x811c_9dc5;
    for &byte in database.to_le_bytes().iter().chain(channel) {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    (hash ^ (hash >> 16)) as usize % COUNTERS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_channel_is_counted_per_database() {
        let listeners = Box::new(Listeners::new());
        listeners.add(5, b"outbox");
        listeners.add(5, b"outbox");
        assert_eq!(listeners.count(5, b"outbox"), 2);
        assert_eq!(listeners.count(6, b"outbox"), 0);
        listeners.remove(5, b"outbox");
        listeners.remove(5, b"outbox");
        listeners.remove(5, b"outbox");
        assert_eq!(listeners.count(5, b"outbox"), 0, "never below zero");
    }

    #[test]
    fn channels_spread_over_the_counters() {
        let used: std::collections::HashSet<usize> = (0..1000)
            .map(|n| counter_of(16384, format!("channel{n}").as_bytes()))
            .collect();
        assert!(
            used.len() > 850,
            "{} counters for 1000 channels",
            used.len()
        );
    }
}

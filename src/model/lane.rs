//! Lanes: how events are shared among a database's relay workers without two workers ever
//! carrying events of the same key at once.
//!
//! `outbox_enqueue` stores each event's lane, a hash of its key (or, without a key, its topic)
//! into `0..LANES`. The lanes are cut into [`GROUPS`] groups of consecutive lanes, and each of
//! the database's `n` workers relays a contiguous range of groups. Before claiming, a worker
//! takes a transaction lock on each of its groups without waiting; a worker that still holds one
//! (a worker on its way out while the launcher hands its share to another) keeps the other off
//! the group until its batch has committed. Events of one key therefore go through one worker
//! at a time, in id order. Pure logic, unit-tested; the locks are in `relay/claim/scope.rs`.

/// Lanes an event can be in: `outbox.lane` holds `0..LANES`.
pub const LANES: i16 = 1024;
/// Groups of consecutive lanes, the unit a worker locks: as many as there can be workers.
pub const GROUPS: u32 = 32;
const LANES_PER_GROUP: i16 = LANES / GROUPS as i16;

/// The lane of an event with `key`, or without one, of `topic`: FNV-1a (32 bits) of the bytes,
/// after a byte that tells a key from a topic, folded into `0..LANES`. Stored in the table, so it
/// must never change.
pub fn lane_of(key: Option<&[u8]>, topic: &[u8]) -> i16 {
    let (tag, bytes) = match key {
        Some(key) => (b'k', key),
        None => (b't', topic),
    };
    let mut hash: u32 = 0x811c_9dc5;
    for &byte in std::iter::once(&tag).chain(bytes) {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    // Fold the high bits in: FNV's low bits mix least.
    ((hash ^ (hash >> 16)) % LANES as u32) as i16
}

/// The group lane `lane` is in (0 for a lane out of range, which no claim returns).
pub fn group_of(lane: i16) -> u16 {
    if (0..LANES).contains(&lane) {
        (lane / LANES_PER_GROUP) as u16
    } else {
        0
    }
}

/// The share of the lanes that worker `ordinal` of `workers` relays: its groups, and the lanes
/// they hold (`lanes.start <= lane < lanes.end`). Every group goes to exactly one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub groups: std::ops::Range<u32>,
    pub lanes: std::ops::Range<i16>,
}

/// Worker `ordinal`'s share when `workers` workers relay the database (`ordinal < workers`).
pub fn share(ordinal: usize, workers: usize) -> Share {
    let workers = workers.clamp(1, GROUPS as usize) as u32;
    let ordinal = (ordinal as u32).min(workers - 1);
    let start = ordinal * GROUPS / workers;
    let end = (ordinal + 1) * GROUPS / workers;
    Share {
        groups: start..end,
        lanes: (start as i16 * LANES_PER_GROUP)..(end as i16 * LANES_PER_GROUP),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_stable_and_in_range() {
        // Stored in tables: these values must not change from one version to the next (computed
        // apart, by a few lines of Python implementing FNV-1a).
        assert_eq!(lane_of(Some(b"account-7"), b"account.created"), 510);
        assert_eq!(lane_of(None, b"account.created"), 595);
        assert_eq!(lane_of(Some(b""), b"x"), lane_of(Some(b""), b"y"));
        assert_ne!(lane_of(Some(b"orders"), b"t"), lane_of(None, b"orders"));
        for n in 0..10_000 {
            let lane = lane_of(Some(format!("key-{n}").as_bytes()), b"t");
            assert!((0..LANES).contains(&lane));
        }
    }

    #[test]
    fn a_lanes_group_is_the_one_a_worker_locks() {
        for workers in 1..=GROUPS as usize {
            for ordinal in 0..workers {
                let share = share(ordinal, workers);
                for lane in share.lanes.clone() {
                    assert!(share.groups.contains(&u32::from(group_of(lane))));
                }
            }
        }
        assert_eq!(group_of(LANES - 1), GROUPS as u16 - 1);
        assert_eq!(group_of(-1), 0);
    }

    #[test]
    fn two_hundred_keys_spread_over_four_workers() {
        let mut per_worker = [0; 4];
        for n in 0..200 {
            let lane = lane_of(Some(format!("key-{n}").as_bytes()), b"t");
            let owner = (0..4).find(|&w| share(w, 4).lanes.contains(&lane)).unwrap();
            per_worker[owner] += 1;
        }
        assert!(per_worker.iter().all(|&n| n >= 30), "{per_worker:?}");
    }

    #[test]
    fn every_group_and_lane_has_exactly_one_worker() {
        for workers in 1..=GROUPS as usize {
            let shares: Vec<Share> = (0..workers).map(|w| share(w, workers)).collect();
            assert_eq!(shares[0].groups.start, 0);
            assert_eq!(shares[0].lanes.start, 0);
            assert_eq!(shares[workers - 1].groups.end, GROUPS);
            assert_eq!(shares[workers - 1].lanes.end, LANES);
            for pair in shares.windows(2) {
                assert_eq!(pair[0].groups.end, pair[1].groups.start);
                assert_eq!(pair[0].lanes.end, pair[1].lanes.start);
                assert!(!pair[0].groups.is_empty());
            }
        }
        assert_eq!(share(0, 1).lanes, 0..LANES);
        assert_eq!(share(1, 2).groups, 16..32);
        assert_eq!(share(5, 3), share(2, 3));
    }
}

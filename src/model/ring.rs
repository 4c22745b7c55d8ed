//! Where an event's row lives: the `outbox` table is a ring of [`LEAVES`] partitions, and ids
//! go to them in runs of [`CHUNK`]. Ids `0..CHUNK` go to `outbox_00`, the next `CHUNK` ids to
//! `outbox_01`, and so on round the ring, back to `outbox_00` after `LEAVES * CHUNK` ids.
//!
//! The sequence hands out ids in order, so at any moment writers fill one partition while the
//! ones behind it only see the relay's marks; once a partition's rows are all published and
//! past `outbox.retention`, the relay empties it with `TRUNCATE` (see `truncate.rs`),
//! which leaves no dead row versions behind, long before the sequence comes round to it again.
//!
//! PostgreSQL routes rows with hash partitioning (`PARTITION BY HASH (id
//! outbox_id_chunk_ops)`), whose operator class hashes an id to its run number: hash
//! partitioning computes `hash_combine64(0, h) % modulus` from the extended hash `h`, so the
//! extended hash returns the run number less the constant `hash_combine64` adds. Unlike range
//! partitions, the ring covers every id for ever (no partition to create ahead of the writers,
//! no default partition), and `id` stays the parent table's primary key.

use pgrx::prelude::*;

/// Ids in one run: consecutive ids that share a partition.
pub const CHUNK: i64 = 1 << 16;
/// Partitions in the ring; `sql/outbox.sql` creates them as `outbox_00` ... `outbox_15`.
pub const LEAVES: usize = 16;

/// What `hash_combine64(0, h)` adds to `h` (PostgreSQL's `src/include/common/hashfn.h`).
const HASH_COMBINE_OFFSET: u64 = 0x49a0_f4dd_15e5_a8e3;

/// The run an id belongs to (ids below zero have runs below zero).
pub fn run_of(id: i64) -> i64 {
    id.div_euclid(CHUNK)
}

/// The partition (0 to `LEAVES - 1`) that holds `id`, as PostgreSQL's routing computes it.
pub fn leaf_of(id: i64) -> usize {
    ((run_of(id) as u64) % LEAVES as u64) as usize
}

/// The extended hash of the operator class (its seed does not matter: see the module comment).
pub fn extended_hash(id: i64) -> i64 {
    (run_of(id) as u64).wrapping_sub(HASH_COMBINE_OFFSET) as i64
}

/// The standard hash: the low 32 bits of the extended one, as PostgreSQL requires.
pub fn standard_hash(id: i64) -> i32 {
    extended_hash(id) as i32
}

#[pg_extern(sql = false, immutable, parallel_safe)]
fn _outbox_id_hash(id: i64) -> i32 {
    standard_hash(id)
}

#[pg_extern(sql = false, immutable, parallel_safe)]
fn _outbox_id_hash_extended(id: i64, _seed: i64) -> i64 {
    extended_hash(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `hash_combine64` as PostgreSQL defines it.
    fn hash_combine64(mut a: u64, b: u64) -> u64 {
        a ^= b
            .wrapping_add(HASH_COMBINE_OFFSET)
            .wrapping_add(a << 54)
            .wrapping_add(a >> 7);
        a
    }

    /// The partition PostgreSQL's hash routing picks for `id` among `LEAVES` of one modulus.
    fn routed(id: i64) -> usize {
        (hash_combine64(0, extended_hash(id) as u64) % LEAVES as u64) as usize
    }

    #[test]
    fn runs_of_chunk_ids_go_round_the_ring() {
        assert_eq!(leaf_of(0), 0);
        assert_eq!(leaf_of(CHUNK - 1), 0);
        assert_eq!(leaf_of(CHUNK), 1);
        assert_eq!(leaf_of(15 * CHUNK), 15);
        assert_eq!(leaf_of(16 * CHUNK), 0);
        assert_eq!(leaf_of(17 * CHUNK + 5), 1);
    }

    #[test]
    fn postgres_routing_agrees_with_leaf_of_everywhere() {
        let samples = [
            i64::MIN,
            i64::MIN + 1,
            -CHUNK - 1,
            -CHUNK,
            -1,
            0,
            1,
            CHUNK - 1,
            CHUNK,
            123_456_789,
            i64::MAX - CHUNK,
            i64::MAX,
        ];
        for id in samples.into_iter().chain((0..200).map(|k| k * 7919 * 31)) {
            assert_eq!(routed(id), leaf_of(id), "id {id}");
        }
    }

    #[test]
    fn negative_ids_have_runs_of_their_own() {
        assert_eq!(run_of(-1), -1);
        assert_eq!(leaf_of(-1), 15);
        assert_eq!(run_of(i64::MIN), i64::MIN / CHUNK);
    }

    #[test]
    fn the_standard_hash_is_the_low_half_of_the_extended_one() {
        for id in [0, 1, CHUNK, -5, i64::MAX] {
            assert_eq!(standard_hash(id) as u32, extended_hash(id) as u64 as u32);
        }
    }
}

//! Emptying the ring's partitions (see `model/ring.rs`): a partition whose rows are all published,
//! and were all marked more than `outbox.retention` ago, is emptied with `TRUNCATE`. That
//! leaves no dead row versions and gives the space back at once, where deleting the rows one by
//! one would leave three dead versions per event for autovacuum, which comes once a minute at
//! best.
//!
//! When a batch's rows were last marked in each partition is kept in shared memory (every
//! worker records it before its mark commits; after a restart, the start time stands for the
//! marks before it). A partition is a candidate when that time is older than the retention,
//! it holds anything at all, and the writers are not filling it. It is emptied only under its
//! `ACCESS EXCLUSIVE` lock, taken without waiting: no transaction that writes, marks or reads
//! it is in progress, and none can start until the emptying commits. Under the lock the mark
//! time is read again and the partition is checked to hold no unpublished row. Writers, which
//! insert into the partition of the current run, never wait for it; another worker's claim
//! waits for as long as the `TRUNCATE` takes.
//!
//! A partition is looked at as soon as its retention runs out (an idle worker wakes for it),
//! so that the table holds a partition's rows no longer than that. A partition found in use is
//! tried again within [`SOON`], then less often the longer it stays in use: up to once per
//! [`EVERY`] while something besides the relay's workers holds it (a `pg_dump` reading it), up
//! to once per [`RELAY_HELD`] while only they do (each claim locks every partition until its
//! batch commits, a moment unless Redis hangs). If what holds it is an autovacuum (of a
//! partition with nothing left to publish, and not one that prevents wraparound), the relay
//! cancels it, as PostgreSQL cancels an autovacuum that blocks a lock request: vacuuming rows
//! about to be emptied is wasted work, and the partition's rows would stay for as long as it
//! runs.

use std::time::Duration;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::model::ring::{self, LEAVES};
use crate::pg::schema::{Schema, SCHEMA};
use crate::pg::worker::{self, in_transaction, End};
use crate::shmem::DatabaseShare;

/// Least time between two looks for partitions to empty, across all workers, unless a
/// partition comes due in between: a partition due but not emptied at the last look (holding
/// an event not yet published, or in use for long) is tried again this often.
const EVERY: Duration = Duration::from_secs(1);
/// Time before another look when a partition was in use at the last one, at first.
const SOON: Duration = Duration::from_millis(20);
/// Longest time between looks at a partition that only the relay's workers held at the last
/// ones: they let go when their batch commits.
const RELAY_HELD: Duration = Duration::from_millis(100);

/// How long after a look that found a due partition in use, the `looks`-th such look in a row,
/// the relay looks again: [`SOON`] at first, doubling up to [`EVERY`] if something besides the
/// relay's workers held one at the last look (`by_others`), so that a partition held for long
/// (a `pg_dump` reading it, say) costs a look a second, not fifty; up to [`RELAY_HELD`] if not.
/// An idle worker wakes for it; a busy one, woken by commits, looks once the time has come.
fn retry_in(looks: u32, by_others: bool) -> Duration {
    let most = if by_others { EVERY } else { RELAY_HELD };
    SOON.saturating_mul(1 << looks.saturating_sub(1).min(16))
        .min(most)
}

/// What the relay knows about one partition before it tries to empty it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// When rows in it were last marked published.
    pub marked_at: i64,
    /// Its size on disk, in bytes.
    pub bytes: i64,
}

/// The partitions worth trying to empty at `now`: not the one writers fill (that of the id
/// `position` the sequence stands at), not empty already, and marked more than `retention`
/// ago.
pub fn candidates(leaves: &[Leaf; LEAVES], position: i64, now: i64, retention: i64) -> Vec<usize> {
    let writing = ring::leaf_of(position);
    (0..LEAVES)
        .filter(|&leaf| leaf != writing)
        .filter(|&leaf| leaves[leaf].bytes > 0)
        .filter(|&leaf| expired(leaves[leaf].marked_at, now, retention))
        .collect()
}

/// Whether rows marked at `marked_at` are past a retention of `retention` at `now`.
fn expired(marked_at: i64, now: i64, retention: i64) -> bool {
    marked_at.saturating_add(retention) <= now
}

/// When each partition comes due: when the retention of its last mark runs out.
fn due_times(shared: &DatabaseShare, retention: i64) -> [i64; LEAVES] {
    std::array::from_fn(|leaf| shared.leaf_marked_at(leaf).saturating_add(retention))
}

/// Whether to look for partitions to empty at `now`, the last look having been at `looked_at`
/// (times in µs): at once when a partition has come due since that look, so that it is emptied
/// when its retention runs out rather than up to a look's interval later, and otherwise from
/// `again_at` on while any partition is due.
pub fn look_now(due: &[i64; LEAVES], looked_at: i64, again_at: i64, now: i64) -> bool {
    let came_due = due.iter().any(|&at| looked_at < at && at <= now);
    let again = now >= again_at && due.iter().any(|&at| at <= now);
    came_due || again
}

/// How long from `now` until the next look an idle worker must wake for, rounded up to a
/// millisecond: when the next partition comes due (if one will without another mark), or,
/// while a partition is due, when a look that found one in use is to be repeated (`retry_at`,
/// 0 for none). A retry already past is due at once: the worker that looked may have spent
/// longer than the retry's delay on other work (a pruning round) before it came to wait.
pub fn next_look_in(due: &[i64; LEAVES], retry_at: i64, now: i64) -> Option<Duration> {
    let coming = due.iter().copied().filter(|&at| at > now).min();
    let retry = (retry_at > 0 && due.iter().any(|&at| at <= now)).then_some(retry_at.max(now));
    let at = coming.into_iter().chain(retry).min()?;
    let micros = at.saturating_sub(now) as u64;
    Some(Duration::from_millis(micros.div_ceil(1000)))
}

/// How long an idle worker may wait before a partition of its database comes due, or a
/// partition found in use is to be tried again.
pub fn wait_for_due(shared: &DatabaseShare, retention: Duration) -> Option<Duration> {
    next_look_in(
        &due_times(shared, micros(retention)),
        shared.truncate_retry_at(),
        worker::now(),
    )
}

fn micros(duration: Duration) -> i64 {
    duration.as_micros().min(i64::MAX as u128) as i64
}

/// How one try at a partition ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Emptied,
    /// Another transaction holds a lock on it; autovacuums there cancelled; whether a process
    /// other than the relay's workers holds it.
    Busy {
        vacuums_cancelled: i64,
        by_others: bool,
    },
    /// Rows in it were marked within the retention after all.
    Recent,
    /// It holds an event not yet published.
    Pending,
}

/// Empties the partitions that are due, one transaction each, when this worker wins the look
/// (see [`look_now`]; one worker looks at a time).
pub fn truncate_if_due(shared: &DatabaseShare, retention: Duration, schema: &Schema, index: usize) {
    let now = worker::now();
    let retention = micros(retention);
    let looked_at = shared.truncate_looked_at();
    let again_at = shared.truncate_again_at();
    if !look_now(&due_times(shared, retention), looked_at, again_at, now)
        || !shared.claim_truncate_look(looked_at, now)
    {
        return;
    }
    // While this look runs, no other worker starts one, nor waits for the last one's retry.
    shared.set_truncate_again_at(now.saturating_add(micros(EVERY)));
    shared.set_truncate_retry_at(0);
    let Held { busy, by_others } = look(shared, retention, now, schema, index);
    let held_looks = shared.count_truncate_look(busy);
    // Counted from the look's end: a look can take longer than SOON.
    let end = worker::now();
    let again_in = if busy {
        retry_in(held_looks, by_others)
    } else {
        EVERY
    };
    shared.set_truncate_again_at(end.saturating_add(micros(again_in)));
    shared.set_truncate_retry_at(if busy {
        end.saturating_add(micros(again_in))
    } else {
        0
    });
}

/// Whether a look found a due partition in use, and whether by something other than the
/// relay's workers.
#[derive(Clone, Copy, Default)]
struct Held {
    busy: bool,
    by_others: bool,
}

/// Surveys the partitions and tries to empty those that are due; whether one was in use.
fn look(shared: &DatabaseShare, retention: i64, now: i64, schema: &Schema, index: usize) -> Held {
    let Some((position, names, oids, sizes)) = in_transaction(|| (survey(schema), End::Commit))
    else {
        return Held::default();
    };
    let leaves: [Leaf; LEAVES] = std::array::from_fn(|leaf| Leaf {
        marked_at: shared.leaf_marked_at(leaf),
        bytes: sizes[leaf],
    });
    let mut held = Held::default();
    for leaf in candidates(&leaves, position, now, retention) {
        if worker::shutdown_requested() {
            break;
        }
        let outcome = in_transaction(|| {
            let outcome = empty(shared, leaf, oids[leaf], schema, &names[leaf], retention);
            (outcome, End::Commit)
        });
        match outcome {
            Outcome::Emptied => debug1!(
                "outbox relay {index}: emptied {} ({} bytes)",
                schema.show(&names[leaf]),
                sizes[leaf]
            ),
            Outcome::Busy {
                vacuums_cancelled,
                by_others,
            } => {
                held.busy = true;
                // One partition held for long slows the looks at all of them: the others come
                // free at the same look anyway, or at the next.
                held.by_others |= by_others;
                if vacuums_cancelled > 0 {
                    debug1!(
                        "outbox relay {index}: cancelled an autovacuum of {} to empty it",
                        schema.show(&names[leaf])
                    );
                }
            }
            Outcome::Recent | Outcome::Pending => {}
        }
    }
    held
}

/// The sequence's position, and each partition's qualified name (naming the schema as
/// [`SCHEMA`]), OID and size.
#[allow(clippy::type_complexity)]
fn survey(schema: &Schema) -> Option<(i64, Vec<String>, Vec<pg_sys::Oid>, Vec<i64>)> {
    let partitions: Vec<String> = (0..LEAVES)
        .map(|leaf| format!("outbox_{leaf:02}"))
        .collect();
    let oids = partitions
        .iter()
        .map(|partition| {
            let partition = std::ffi::CString::new(partition.as_str()).ok()?;
            // SAFETY: a catalog lookup inside the caller's transaction.
            let oid = unsafe { pg_sys::get_relname_relid(partition.as_ptr(), schema.oid()) };
            (oid != pg_sys::InvalidOid).then_some(oid)
        })
        .collect::<Option<Vec<pg_sys::Oid>>>()?;
    let sizes: Vec<String> = oids
        .iter()
        .map(|oid| {
            let oid = oid.to_u32();
            format!("pg_catalog.pg_relation_size({oid}::pg_catalog.oid::pg_catalog.regclass)")
        })
        .collect();
    let sql = schema.sql(&format!(
        "SELECT (SELECT last_value FROM {SCHEMA}.outbox_id_seq), ARRAY[{}]::pg_catalog.int8[]",
        sizes.join(", ")
    ));
    let (position, sizes) = Spi::connect_mut(|client| {
        client
            .update(sql.as_c_str(), Some(1), &[])?
            .first()
            .get_two::<i64, Vec<i64>>()
    })
    .unwrap_or_else(|e| error!("outbox relay: cannot read the partitions' sizes: {e}"));
    let (position, sizes) = (position?, sizes?);
    let names = partitions
        .iter()
        .map(|partition| format!("{SCHEMA}.{}", spi::quote_identifier(partition)))
        .collect();
    (sizes.len() == LEAVES).then_some((position, names, oids, sizes))
}

/// Empties partition `leaf` (`name` in `schema`) if nothing holds it and it is still due; see
/// the module comment.
fn empty(
    shared: &DatabaseShare,
    leaf: usize,
    oid: pg_sys::Oid,
    schema: &Schema,
    name: &str,
    retention: i64,
) -> Outcome {
    // SAFETY: a lock on a relation, inside the caller's transaction, which releases it.
    let locked = unsafe {
        pg_sys::ConditionalLockRelationOid(oid, pg_sys::AccessExclusiveLock as pg_sys::LOCKMODE)
    };
    if !locked {
        // Without the lock, rows may still be marked: only a partition with nothing to publish
        // is worth a cancelled vacuum.
        let vacuums_cancelled = if holds_unpublished(schema, name) {
            0
        } else {
            cancel_autovacuums(oid)
        };
        return Outcome::Busy {
            vacuums_cancelled,
            by_others: held_by_others(oid),
        };
    }
    // Marks record their time before they commit, and a mark's commit comes before the lock.
    if !expired(shared.leaf_marked_at(leaf), worker::now(), retention) {
        return Outcome::Recent;
    }
    if holds_unpublished(schema, name) {
        return Outcome::Pending;
    }
    let sql = schema.sql(&format!("TRUNCATE {name}"));
    Spi::connect_mut(|client| client.update(sql.as_c_str(), None, &[]).map(|_| ()))
        .unwrap_or_else(|e| error!("outbox relay: cannot empty {}: {e}", schema.show(name)));
    Outcome::Emptied
}

/// Whether anything other than this database's relay workers holds a lock on the relation
/// `oid`: another session, or a prepared transaction (whose locks have no pid). A relay worker
/// holds every partition only while its batch is in flight, and lets go at its commit: a
/// partition held by them alone is worth trying again soon.
fn held_by_others(oid: pg_sys::Oid) -> bool {
    // SAFETY: reads this process's database.
    let database = unsafe { pg_sys::MyDatabaseId };
    let (database, oid) = (database.to_u32(), oid.to_u32());
    Spi::get_one::<bool>(&format!(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks l \
                        LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid \
                        WHERE l.locktype = 'relation' AND l.database = {database} \
                          AND l.relation = {oid} AND l.granted \
                          AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid() \
                          AND a.backend_type IS DISTINCT FROM 'outbox relay')"
    ))
    .unwrap_or_else(|e| error!("outbox relay: cannot read the locks: {e}"))
    .unwrap_or(true)
}

/// Whether partition `name` of `schema` holds an event not yet published (or cannot be read).
fn holds_unpublished(schema: &Schema, name: &str) -> bool {
    let sql = schema.sql(&format!(
        "SELECT EXISTS (SELECT 1 FROM {name} \
                        WHERE published_at IS NULL AND next_attempt_at IS NULL) \
             OR EXISTS (SELECT 1 FROM {name} \
                        WHERE published_at IS NULL AND next_attempt_at IS NOT NULL)"
    ));
    let pending = Spi::connect_mut(|client| {
        client
            .update(sql.as_c_str(), Some(1), &[])?
            .first()
            .get_one::<bool>()
    })
    .unwrap_or_else(|e| error!("outbox relay: cannot read {}: {e}", schema.show(name)));
    pending != Some(false)
}

/// Cancels the autovacuums (vacuum or analyze) running on the relation `oid` in this database,
/// except those that prevent wraparound, which PostgreSQL does not cancel either; how many.
fn cancel_autovacuums(oid: pg_sys::Oid) -> i64 {
    // SAFETY: reads this process's database.
    let database = unsafe { pg_sys::MyDatabaseId };
    let (database, oid) = (database.to_u32(), oid.to_u32());
    Spi::get_one::<i64>(&format!(
        "SELECT pg_catalog.count(*) FILTER (WHERE pg_catalog.pg_cancel_backend(a.pid)) \
           FROM pg_catalog.pg_stat_activity a \
          WHERE a.backend_type = 'autovacuum worker' AND a.datid = {database} \
            AND a.query NOT LIKE '%(to prevent wraparound)' \
            AND a.pid IN (SELECT pid FROM pg_catalog.pg_stat_progress_vacuum \
                          WHERE relid = {oid} \
                          UNION ALL \
                          SELECT pid FROM pg_catalog.pg_stat_progress_analyze \
                          WHERE relid = {oid})"
    ))
    .unwrap_or_else(|e| error!("outbox relay: cannot look for autovacuums: {e}"))
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ring::CHUNK;

    fn leaves(marked_at: i64, bytes: i64) -> [Leaf; LEAVES] {
        [Leaf { marked_at, bytes }; LEAVES]
    }

    #[test]
    fn the_partition_being_written_is_never_a_candidate() {
        let all = leaves(0, 8192);
        let position = 3 * CHUNK + 17;
        let got = candidates(&all, position, 1_000, 10);
        assert_eq!(got.len(), LEAVES - 1);
        assert!(!got.contains(&3));
    }

    #[test]
    fn empty_and_recently_marked_partitions_are_left_alone() {
        let mut all = leaves(0, 8192);
        all[1].bytes = 0;
        all[2].marked_at = 995;
        all[5].marked_at = 990;
        let got = candidates(&all, 0, 1_000, 10);
        assert!(!got.contains(&1), "already empty");
        assert!(!got.contains(&2), "marked 5 µs ago, retention 10");
        assert!(got.contains(&5), "marked exactly one retention ago");
        assert!(got.contains(&6));
    }

    #[test]
    fn a_partition_is_looked_at_as_soon_as_it_comes_due() {
        let mut due = [i64::MAX; LEAVES];
        due[4] = 1_500;
        // Due since the last look, however recent that was and whenever the next was set.
        assert!(look_now(&due, 1_400, 2_400, 1_500));
        assert!(look_now(&due, 1_499, 2_499, 1_600));
        // Looked at once due (and not emptied): again from the time the look set.
        assert!(!look_now(&due, 1_500, 2_500, 1_600));
        assert!(!look_now(&due, 1_500, 2_500, 2_499));
        assert!(look_now(&due, 1_500, 2_500, 2_500));
        assert!(look_now(&due, 1_500, 1_520, 1_520), "in use: soon");
        // Nothing due, however long since the last look.
        assert!(!look_now(&due, 0, 0, 1_499));
        assert!(!look_now(&[i64::MAX; LEAVES], 0, 0, 5_000));
    }

    #[test]
    fn an_idle_worker_wakes_when_the_next_partition_comes_due() {
        let mut due = [100; LEAVES];
        assert_eq!(next_look_in(&due, 0, 1_000), None, "all due already");
        due[2] = 5_000;
        due[9] = 3_000_001;
        assert_eq!(next_look_in(&due, 0, 1_000), Some(Duration::from_millis(4)));
        assert_eq!(next_look_in(&due, 0, 4_999), Some(Duration::from_millis(1)));
        assert_eq!(
            next_look_in(&due, 0, 5_000),
            Some(Duration::from_millis(2_996))
        );
        assert!(next_look_in(&[i64::MAX; LEAVES], 0, 0) > Some(Duration::from_secs(1 << 40)));
    }

    #[test]
    fn an_idle_worker_wakes_to_try_a_partition_in_use_again() {
        let due = [100; LEAVES];
        // The last look found one in use: again 20 ms later, though nothing else comes due.
        assert_eq!(
            next_look_in(&due, 21_000, 1_000),
            Some(Duration::from_millis(20))
        );
        // Whichever comes first.
        let mut soon = due;
        soon[3] = 6_000;
        assert_eq!(
            next_look_in(&soon, 21_000, 1_000),
            Some(Duration::from_millis(5))
        );
        // A retry that fell due while the worker did something else after its look (pruning,
        // say): at once, not at the next poll.
        assert_eq!(next_look_in(&due, 900, 1_000), Some(Duration::ZERO));
        // A retry for partitions no longer due (marked again since) wakes no one.
        assert!(next_look_in(&[i64::MAX; LEAVES], 900, 1_000) > Some(Duration::from_secs(1 << 40)));
        assert_eq!(
            next_look_in(&[5_000; LEAVES], 900, 1_000),
            Some(Duration::from_millis(4))
        );
    }

    #[test]
    fn the_relay_backs_off_while_a_partition_stays_in_use() {
        let waits: Vec<u128> = (1..=9).map(|n| retry_in(n, true).as_millis()).collect();
        assert_eq!(waits, [20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        assert_eq!(retry_in(0, true), SOON);
        assert_eq!(retry_in(u32::MAX, true), EVERY);
        // Held by the relay's workers alone: they let go within a batch.
        let waits: Vec<u128> = (1..=5).map(|n| retry_in(n, false).as_millis()).collect();
        assert_eq!(waits, [20, 40, 80, 100, 100]);
        assert_eq!(retry_in(u32::MAX, false), RELAY_HELD);
    }

    #[test]
    fn a_retention_as_long_as_time_never_expires() {
        assert!(!expired(5, i64::MAX - 1, i64::MAX));
        assert!(expired(0, 10, 10));
    }
}

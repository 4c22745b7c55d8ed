//! The functions behind the `outbox_workers` and `outbox_status` views: they read the workers'
//! shared-memory slots. Without the preload there are no slots, and no relay is running.

use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::shmem::{self, WorkerState};

fn timestamp(value: Option<i64>) -> Option<TimestampWithTimeZone> {
    value.and_then(|v| TimestampWithTimeZone::try_from(v).ok())
}

/// One row per worker slot the launcher assigned to a database, whichever; declared in
/// `sql/outbox.sql`.
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn _outbox_worker_slots() -> TableIterator<
    'static,
    (
        name!(slot, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(published, i64),
        name!(last_batch_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    let rows: Vec<_> = match shmem::shared() {
        None => Vec::new(),
        Some(shared) => shared
            .all_slots()
            .iter()
            .enumerate()
            .filter(|(_, slot)| slot.database() != 0)
            .map(|(index, slot)| {
                let s = slot.snapshot();
                let running = s.pid != 0;
                (
                    index as i32,
                    running.then_some(s.pid),
                    if running {
                        s.state
                    } else {
                        WorkerState::Stopped
                    }
                    .name()
                    .to_string(),
                    s.published,
                    timestamp(s.last_batch_at),
                    s.last_error,
                    timestamp(s.last_error_at),
                )
            })
            .collect(),
    };
    TableIterator::new(rows)
}

/// How the worker of `slot` deduplicates on the Redis it writes to (`idmp`, `markers`, `off`);
/// NULL while it runs no chunk yet, or no worker runs. Declared in `sql/outbox.sql`.
#[pg_extern(sql = false)]
fn _outbox_slot_dedupe(slot: i32) -> Option<&'static str> {
    let shared = shmem::shared()?;
    let slot = shared.all_slots().get(usize::try_from(slot).ok()?)?;
    let snapshot = slot.snapshot();
    if snapshot.pid == 0 {
        return None;
    }
    snapshot.dedupe
}

/// When a worker of this database last marked a batch published, since the server started.
#[pg_extern(sql = false)]
fn _outbox_last_published_at() -> Option<TimestampWithTimeZone> {
    // SAFETY: reads this backend's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    timestamp(shmem::shared()?.database(database)?.last_published_at())
}

/// The relay's counters for this database since the server started (since the database was
/// last taken up by a worker): events published, failed attempts charged, events moved to
/// `outbox_dead`. Always one row, of zeros without a relay; declared in `sql/outbox.sql`.
#[pg_extern(sql = false)]
fn _outbox_counters() -> TableIterator<
    'static,
    (
        name!(published, i64),
        name!(failed, i64),
        name!(dead_lettered, i64),
    ),
> {
    // SAFETY: reads this backend's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    let counts = shmem::shared()
        .and_then(|shared| shared.database(database))
        .map(|share| share.counts())
        .unwrap_or_default();
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    TableIterator::once((
        count(counts.published),
        count(counts.failed),
        count(counts.dead_lettered),
    ))
}

/// The name of the database slot `slot` is assigned to, as `text` (declared so in
/// `sql/outbox.sql`); NULL if none (or it was dropped). The name's bytes go out as they are, as
/// `current_database()` gives them, which the views compare it with: they need not be UTF-8, so
/// they are returned as a varlena of bytes, which is what a `text` value is.
#[pg_extern(sql = false)]
fn _outbox_slot_database(slot: i32) -> Option<Vec<u8>> {
    let shared = shmem::shared()?;
    let index = usize::try_from(slot).ok()?;
    let database = shared.all_slots().get(index)?.database();
    if database == 0 {
        return None;
    }
    // SAFETY: a catalog lookup by OID, inside the caller's transaction.
    unsafe {
        let raw = pg_sys::get_database_name(pg_sys::Oid::from(database));
        (!raw.is_null()).then(|| std::ffi::CStr::from_ptr(raw).to_bytes().to_vec())
    }
}

/// How many sessions of this database listen on `channel` (a `text` read as its bytes, as
/// `_outbox_slot_database` returns one), as `outbox_enqueue` counts them before it notifies:
/// 0 means its commits send no notification there. NULL without the preload, where it always
/// notifies.
#[pg_extern(sql = false)]
fn _outbox_notify_listeners(channel: &[u8]) -> Option<i64> {
    let shared = shmem::shared()?;
    // SAFETY: reads this backend's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    Some(i64::from(shared.listeners.count(database, channel)))
}

//! The shared-memory area: one slot per relay worker (`slot.rs`), an entry per database its
//! workers share (`database.rs`), the counts of enqueueing transactions (`activity.rs`), and of
//! the sessions listening on each channel (`listeners.rs`).
//! Exists only when the library is preloaded.
//!
//! Everything is an atomic so that the commit callback and the status views never wait on a
//! lock held by a worker; the last error text is guarded by a per-slot sequence counter. Taking
//! and freeing a database's entry holds the extension's LWLock (`pg_stat_activity` shows a wait
//! on it as `LWLock` / `outbox`).

mod activity;
mod database;
mod listeners;
mod slot;
mod time;

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::OnceLock;

use pgrx::pg_sys;

pub use activity::EnqueueActivity;
pub use database::{Counts, DatabaseShare};
pub use listeners::Listeners;
pub use slot::{WorkerSlot, WorkerState};

use crate::gucs::MAX_WORKERS;

/// Databases that can have an entry at once: those relayed, and under `*` those looked into.
pub const MAX_DATABASES: usize = 256;

/// How many counters of enqueueing transactions there are; a database uses the one its OID
/// picks, shared with the databases whose OIDs fall on the same one.
const ACTIVITY_COUNTERS: usize = 64;

#[repr(C)]
pub struct Shared {
    slots: [WorkerSlot; MAX_WORKERS as usize],
    /// One entry per database relayed since the server started (or since the entry was freed).
    databases: [DatabaseShare; MAX_DATABASES],
    /// Transactions that enqueued, by database OID (see [`EnqueueActivity`]).
    activity: [EnqueueActivity; ACTIVITY_COUNTERS],
    /// Sessions listening, by database and channel.
    pub listeners: Listeners,
}

impl Shared {
    fn new() -> Shared {
        Shared {
            slots: std::array::from_fn(|_| WorkerSlot::new()),
            databases: std::array::from_fn(|_| DatabaseShare::new()),
            activity: std::array::from_fn(|_| EnqueueActivity::new()),
            listeners: Listeners::new(),
        }
    }

    /// The count of enqueueing transactions of database `oid`.
    pub fn activity(&self, oid: u32) -> &EnqueueActivity {
        &self.activity[oid as usize % ACTIVITY_COUNTERS]
    }

    /// The slot of worker `index` (clamped to the slots there are).
    pub fn slot(&self, index: usize) -> &WorkerSlot {
        &self.slots[index.min(self.slots.len() - 1)]
    }

    /// Every slot.
    pub fn all_slots(&self) -> &[WorkerSlot] {
        &self.slots
    }

    /// Where slot `index` stands among the slots whose workers relay `database`: its position,
    /// and how many there are (at least 1). A slot whose worker has not started (or could not:
    /// `max_worker_processes` used up) or has exited is left out, so that the workers that run
    /// share all the lanes between them and no key waits for a worker that is not there.
    pub fn ordinal_of(&self, index: usize, database: u32) -> (usize, usize) {
        let relaying = self
            .slots
            .iter()
            .map(|slot| if slot.relays(database) { database } else { 0 });
        ordinal_among(relaying, index, database)
    }

    /// The entry of database `oid`, if it has one.
    pub fn database(&self, oid: u32) -> Option<&DatabaseShare> {
        (oid != 0)
            .then(|| self.databases.iter().find(|d| d.oid() == oid))
            .flatten()
    }

    /// Runs `body` holding the extension's LWLock, the lock on taking and freeing entries:
    /// a few loads and stores inside, nothing that can raise an error. An area made in process
    /// memory (the unit tests') has no PostgreSQL to lock, and one thread.
    fn with_entries_locked<R>(&self, body: impl FnOnce() -> R) -> R {
        let lock = ENTRIES_LOCK.load(Ordering::Acquire);
        let Some(calls) = LOCK_CALLS.get().filter(|_| !lock.is_null()) else {
            return body();
        };
        // SAFETY: the lock is the tranche's, in shared memory for the server's life; it is
        // released below, and PostgreSQL releases it at an error anyway.
        unsafe { (calls.acquire)(lock) };
        let result = body();
        // SAFETY: held since just above.
        unsafe { (calls.release)(lock) };
        result
    }

    /// The entry of database `oid`, taking a free one (reset as of `now`) if it has none;
    /// `None` when every entry is taken. One database never gets two entries.
    pub fn database_or_take(&self, oid: u32, now: i64) -> Option<&DatabaseShare> {
        if oid == 0 {
            return None;
        }
        if let Some(found) = self.database(oid) {
            return Some(found);
        }
        self.with_entries_locked(|| {
            if let Some(found) = self.database(oid) {
                return Some(found);
            }
            let free = self.databases.iter().find(|d| d.oid() == 0)?;
            free.reset(now);
            free.oid.store(oid, Ordering::Release);
            Some(free)
        })
    }

    /// Frees the entries of databases not in `keep` that no slot is assigned to and no worker
    /// still runs in.
    pub fn release_databases(&self, keep: &[u32]) {
        self.with_entries_locked(|| {
            for entry in &self.databases {
                let oid = entry.oid();
                let in_use = self
                    .slots
                    .iter()
                    .any(|s| s.database() == oid || s.working_in.load(Ordering::Acquire) == oid);
                if oid != 0 && !keep.contains(&oid) && !in_use {
                    entry.oid.store(0, Ordering::Release);
                }
            }
        })
    }

    /// Sets the latch of every running worker of database `oid`.
    pub fn wake_database(&self, oid: u32) {
        for slot in self.slots.iter().filter(|s| s.database() == oid) {
            slot.wake();
        }
    }
}

/// The area in this process's address space, set by the startup hook.
static SHARED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
/// The lock on taking and freeing entries, set by the startup hook with [`SHARED`].
static ENTRIES_LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
/// PostgreSQL's calls that take and release [`ENTRIES_LOCK`], set by the startup hook too:
/// reached only through it, so that the unit tests, which have no PostgreSQL, link without them.
static LOCK_CALLS: OnceLock<LockCalls> = OnceLock::new();

struct LockCalls {
    acquire: unsafe fn(*mut pg_sys::LWLock),
    release: unsafe fn(*mut pg_sys::LWLock),
}

/// # Safety
/// `lock` is an LWLock in shared memory, not held by this process.
unsafe fn lock_exclusive(lock: *mut pg_sys::LWLock) {
    // SAFETY: the caller's promise.
    unsafe { pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE) };
}

/// # Safety
/// `lock` is an LWLock this process holds.
unsafe fn unlock(lock: *mut pg_sys::LWLock) {
    // SAFETY: the caller's promise.
    unsafe { pg_sys::LWLockRelease(lock) };
}
/// The startup hook installed before ours.
static PREV_SHMEM_STARTUP_HOOK: OnceLock<pg_sys::shmem_startup_hook_type> = OnceLock::new();

/// The shared area, or `None` in a backend of a server that did not preload the library.
pub fn shared() -> Option<&'static Shared> {
    // SAFETY: SHARED is written once, by the startup hook, before any backend runs our code,
    // and then points at shared memory that lives as long as the server.
    unsafe { SHARED.load(Ordering::Acquire).as_ref() }
}

/// Asks for the shared area. Only valid while `shared_preload_libraries` is being processed.
pub fn init() {
    crate::pg::compat::request_shared_memory(std::mem::size_of::<Shared>());
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining hooks is the documented
    // way for an extension to take part in shared-memory setup.
    unsafe {
        if PREV_SHMEM_STARTUP_HOOK
            .set(pg_sys::shmem_startup_hook)
            .is_ok()
        {
            pg_sys::shmem_startup_hook = Some(startup_shmem);
        }
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn startup_shmem() {
    // SAFETY: called once per process that attaches to shared memory; AddinShmemInitLock makes
    // the first caller initialise the area and the others only find it.
    unsafe {
        if let Some(Some(prev)) = PREV_SHMEM_STARTUP_HOOK.get() {
            prev();
        }
        let lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock; // AddinShmemInitLock
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let area = pg_sys::ShmemInitStruct(
            c"outbox relay state".as_ptr(),
            std::mem::size_of::<Shared>(),
            &mut found,
        )
        .cast::<Shared>();
        if !found {
            // A database's entry is reset when a worker takes it: rows published before then
            // were published before its marks.
            area.write(Shared::new());
        }
        let _ = LOCK_CALLS.set(LockCalls {
            acquire: lock_exclusive,
            release: unlock,
        });
        ENTRIES_LOCK.store(crate::pg::compat::tranche_lock(), Ordering::Release);
        SHARED.store(area, Ordering::Release);
        pg_sys::LWLockRelease(lock);
    }
}

/// Where slot `index` stands among the slots assigned to `database`, given each slot's database.
fn ordinal_among(
    databases: impl Iterator<Item = u32>,
    index: usize,
    database: u32,
) -> (usize, usize) {
    let (mut ordinal, mut count) = (0, 0);
    for (at, assigned) in databases.enumerate() {
        if assigned != database {
            continue;
        }
        if at < index {
            ordinal += 1;
        }
        count += 1;
    }
    (ordinal, count.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_knows_its_place_among_its_databases_workers() {
        let slots = [5, 7, 5, 0, 5, 7];
        assert_eq!(ordinal_among(slots.into_iter(), 0, 5), (0, 3));
        assert_eq!(ordinal_among(slots.into_iter(), 2, 5), (1, 3));
        assert_eq!(ordinal_among(slots.into_iter(), 4, 5), (2, 3));
        assert_eq!(ordinal_among(slots.into_iter(), 5, 7), (1, 2));
        // A slot taken away from the database: the worker still has a share to hold.
        assert_eq!(ordinal_among(slots.into_iter(), 3, 9), (0, 1));
    }

    #[test]
    fn each_database_gets_an_entry_of_its_own_until_it_is_released() {
        let shared = Box::new(Shared::new());
        let a = shared.database_or_take(100, 7).unwrap();
        assert_eq!(
            a.leaf_marked_at(3),
            7,
            "a new entry's marks start when it is taken"
        );
        a.record_marked(u32::MAX, 50);
        let b = shared.database_or_take(200, 9).unwrap();
        assert_eq!(
            b.leaf_marked_at(3),
            9,
            "another database's marks are its own"
        );
        assert_eq!(shared.database(100).unwrap().leaf_marked_at(3), 50);
        assert!(shared.database(300).is_none());
        assert!(shared.database(0).is_none());
        shared.slot(4).assign(200);
        assert!(shared.slot(5).attach(77, std::ptr::null_mut(), 300));
        shared.database_or_take(300, 1).unwrap();
        shared.release_databases(&[]);
        assert!(
            shared.database(300).is_some(),
            "a database a worker still runs in is kept"
        );
        assert!(
            !shared.slot(5).attach(78, std::ptr::null_mut(), 300),
            "a held slot is taken twice"
        );
        shared.slot(5).detach(78);
        assert_eq!(
            shared.slot(5).pid(),
            77,
            "another process's detach freed the slot"
        );
        shared.slot(5).detach(77);
        shared.release_databases(&[]);
        assert!(shared.database(300).is_none());
        assert!(
            shared.database(100).is_none(),
            "a database nobody relays is released"
        );
        assert!(
            shared.database(200).is_some(),
            "a database with a slot is kept"
        );
        for oid in 1000..1000 + MAX_DATABASES as u32 - 1 {
            assert!(shared.database_or_take(oid, 1).is_some());
        }
        assert!(
            shared.database_or_take(5, 1).is_none(),
            "every entry is taken"
        );
    }
}

//! The shared-memory area: one slot per relay worker (latch, state, counters, last error) and
//! the few facts the workers share. Exists only when the library is preloaded.
//!
//! Everything is an atomic so that the commit callback and the status views never wait on a
//! lock held by a worker; the last error text is guarded by a per-slot sequence counter.

use std::sync::atomic::{
    fence, AtomicI32, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, Ordering,
};
use std::sync::OnceLock;
use std::time::Duration;

use pgrx::pg_sys;

use crate::gucs::MAX_WORKERS;
use crate::retention::ring::LEAVES;

/// `TimestampTz` value standing for SQL NULL in a slot.
const NO_TIME: i64 = i64::MIN;
/// Bytes of the last error kept per slot.
const ERROR_BYTES: usize = 256;

/// What a relay worker is doing, as shown by `outbox_workers.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WorkerState {
    Stopped = 0,
    Starting,
    Idle,
    Publishing,
    Backoff,
    WaitingForExtension,
    Standby,
}

impl WorkerState {
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Stopped => "stopped",
            WorkerState::Starting => "starting",
            WorkerState::Idle => "idle",
            WorkerState::Publishing => "publishing",
            WorkerState::Backoff => "backoff",
            WorkerState::WaitingForExtension => "waiting_for_extension",
            WorkerState::Standby => "standby",
        }
    }

    fn from_u8(value: u8) -> WorkerState {
        match value {
            1 => WorkerState::Starting,
            2 => WorkerState::Idle,
            3 => WorkerState::Publishing,
            4 => WorkerState::Backoff,
            5 => WorkerState::WaitingForExtension,
            6 => WorkerState::Standby,
            _ => WorkerState::Stopped,
        }
    }
}

#[repr(C)]
pub struct WorkerSlot {
    /// The database the slot's worker relays for (its OID), 0 while the slot is unassigned.
    database: AtomicU32,
    /// The database the slot's running worker is connected to: it may still run there for a
    /// moment after the launcher gave the slot away.
    working_in: AtomicU32,
    pid: AtomicI32,
    latch: AtomicPtr<pg_sys::Latch>,
    state: AtomicU8,
    published: AtomicU64,
    last_batch_at: AtomicI64,
    error_seq: AtomicU32,
    error_at: AtomicI64,
    error_len: AtomicU32,
    error_text: [AtomicU8; ERROR_BYTES],
}

/// A consistent copy of one slot, for the `outbox_workers` view.
pub struct SlotSnapshot {
    pub pid: i32,
    pub state: WorkerState,
    pub published: i64,
    pub last_batch_at: Option<i64>,
    pub last_error: Option<String>,
    pub last_error_at: Option<i64>,
}

/// A time kept in shared memory, `None` for SQL NULL.
pub fn time_or_null(value: i64) -> Option<i64> {
    (value != NO_TIME).then_some(value)
}

impl WorkerSlot {
    fn new() -> WorkerSlot {
        WorkerSlot {
            database: AtomicU32::new(0),
            working_in: AtomicU32::new(0),
            pid: AtomicI32::new(0),
            latch: AtomicPtr::new(std::ptr::null_mut()),
            state: AtomicU8::new(WorkerState::Stopped as u8),
            published: AtomicU64::new(0),
            last_batch_at: AtomicI64::new(NO_TIME),
            error_seq: AtomicU32::new(0),
            error_at: AtomicI64::new(NO_TIME),
            error_len: AtomicU32::new(0),
            error_text: std::array::from_fn(|_| AtomicU8::new(0)),
        }
    }

    /// Called by the worker when it starts, for database `database`: counters restart, its
    /// latch becomes wakeable. False if another process holds the slot, which is left alone.
    pub fn attach(&self, pid: i32, latch: *mut pg_sys::Latch, database: u32) -> bool {
        if self
            .pid
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.published.store(0, Ordering::Relaxed);
        self.last_batch_at.store(NO_TIME, Ordering::Relaxed);
        self.set_error(None, NO_TIME);
        self.state
            .store(WorkerState::Starting as u8, Ordering::Relaxed);
        self.working_in.store(database, Ordering::Release);
        self.latch.store(latch, Ordering::Release);
        true
    }

    /// Assigns the slot to a database (0 frees it); the launcher does, before it starts the
    /// slot's worker.
    pub fn assign(&self, database: u32) {
        self.database.store(database, Ordering::Release);
    }

    /// The database the slot is assigned to, 0 if none.
    pub fn database(&self) -> u32 {
        self.database.load(Ordering::Acquire)
    }

    /// The pid of the slot's running worker, 0 if none.
    pub fn pid(&self) -> i32 {
        self.pid.load(Ordering::Acquire)
    }

    /// Called on the way out of the worker `pid`, however it exits; a slot another process
    /// holds is left alone.
    pub fn detach(&self, pid: i32) {
        if self.pid.load(Ordering::Acquire) != pid {
            return;
        }
        self.latch.store(std::ptr::null_mut(), Ordering::Release);
        self.state
            .store(WorkerState::Stopped as u8, Ordering::Relaxed);
        self.working_in.store(0, Ordering::Release);
        let _ = self
            .pid
            .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    pub fn set_state(&self, state: WorkerState) {
        self.state.store(state as u8, Ordering::Relaxed);
    }

    pub fn record_batch(&self, published: u64, at: i64) {
        self.published.fetch_add(published, Ordering::Relaxed);
        self.last_batch_at.store(at, Ordering::Relaxed);
    }

    /// Sets (or clears, with `None`) the last error. Only the slot's worker writes it.
    pub fn set_error(&self, error: Option<&str>, at: i64) {
        let bytes = error.map(|e| truncate(e, ERROR_BYTES)).unwrap_or(b"");
        self.error_seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        for (cell, byte) in self.error_text.iter().zip(bytes) {
            cell.store(*byte, Ordering::Relaxed);
        }
        self.error_len.store(
            if error.is_some() {
                bytes.len() as u32 + 1
            } else {
                0
            },
            Ordering::Relaxed,
        );
        self.error_at.store(
            if error.is_some() { at } else { NO_TIME },
            Ordering::Relaxed,
        );
        self.error_seq.fetch_add(1, Ordering::Release);
    }

    fn wake(&self) {
        let latch = self.latch.load(Ordering::Acquire);
        if !latch.is_null() {
            // SAFETY: the pointer is the worker's PGPROC latch, which lives in shared memory for
            // the server's life; setting a latch that has since been reused only causes a
            // spurious wake-up of its new owner.
            unsafe { pg_sys::SetLatch(latch) };
        }
    }

    pub fn snapshot(&self) -> SlotSnapshot {
        let (last_error, last_error_at) = loop {
            let before = self.error_seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let len = self.error_len.load(Ordering::Relaxed) as usize;
            let at = self.error_at.load(Ordering::Relaxed);
            let text: Vec<u8> = self.error_text[..len.saturating_sub(1).min(ERROR_BYTES)]
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
            fence(Ordering::Acquire);
            if self.error_seq.load(Ordering::Relaxed) == before {
                let error = (len > 0).then(|| String::from_utf8_lossy(&text).into_owned());
                break (error, time_or_null(at));
            }
        };
        SlotSnapshot {
            pid: self.pid.load(Ordering::Acquire),
            state: WorkerState::from_u8(self.state.load(Ordering::Relaxed)),
            published: self.published.load(Ordering::Relaxed) as i64,
            last_batch_at: time_or_null(self.last_batch_at.load(Ordering::Relaxed)),
            last_error,
            last_error_at,
        }
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary.
fn truncate(text: &str, max: usize) -> &[u8] {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text.as_bytes()[..end]
}

/// Events a relay transaction published, charged a failed attempt, and moved to
/// `outbox_dead`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub published: u64,
    pub failed: u64,
    pub dead_lettered: u64,
}

/// What the workers of one database share: the pruning and emptying turns, each partition's
/// last mark, when they last published, and whether the launcher must leave the database alone.
#[repr(C)]
pub struct DatabaseShare {
    /// The database's OID; 0 while the entry is free.
    oid: AtomicU32,
    /// When any of its workers last marked a batch published.
    last_published_at: AtomicI64,
    /// Events its workers published, charged a failed attempt, and moved to `outbox_dead`, in
    /// transactions that committed since the entry was taken: counters for monitoring.
    published_total: AtomicU64,
    failed_total: AtomicU64,
    dead_lettered_total: AtomicU64,
    /// Earliest time the next pruning round may start; claimed by compare-and-swap.
    next_prune_at: AtomicI64,
    /// When a worker last looked for partitions to empty (0: not since the entry was taken);
    /// the next look is claimed by compare-and-swap.
    truncate_looked_at: AtomicI64,
    /// When a partition that is due but was not emptied is to be tried again.
    truncate_again_at: AtomicI64,
    /// When a look that found a due partition in use is to be repeated (0: the last look found
    /// none in use): an idle worker wakes for it.
    truncate_retry_at: AtomicI64,
    /// Looks in a row that found a due partition in use: the retries back off with it.
    truncate_busy_looks: AtomicU32,
    /// For each partition of the ring, when a batch with rows in it was last marked published
    /// (at the latest when the entry was taken): every row in it was published no later than
    /// that.
    leaves_marked_at: [AtomicI64; LEAVES],
    /// Until when no worker may run in the database: a `DROP DATABASE` or a rename is waiting
    /// for them to leave.
    paused_until: AtomicI64,
    /// Until when the launcher need not look again: the extension was not found there.
    absent_until: AtomicI64,
}

impl DatabaseShare {
    fn new() -> DatabaseShare {
        DatabaseShare {
            oid: AtomicU32::new(0),
            last_published_at: AtomicI64::new(NO_TIME),
            published_total: AtomicU64::new(0),
            failed_total: AtomicU64::new(0),
            dead_lettered_total: AtomicU64::new(0),
            next_prune_at: AtomicI64::new(0),
            truncate_looked_at: AtomicI64::new(0),
            truncate_again_at: AtomicI64::new(0),
            truncate_retry_at: AtomicI64::new(0),
            truncate_busy_looks: AtomicU32::new(0),
            leaves_marked_at: std::array::from_fn(|_| AtomicI64::new(0)),
            paused_until: AtomicI64::new(0),
            absent_until: AtomicI64::new(0),
        }
    }

    /// Resets the entry for a database taken at `now`.
    fn reset(&self, now: i64) {
        self.last_published_at.store(NO_TIME, Ordering::Relaxed);
        self.published_total.store(0, Ordering::Relaxed);
        self.failed_total.store(0, Ordering::Relaxed);
        self.dead_lettered_total.store(0, Ordering::Relaxed);
        self.next_prune_at.store(0, Ordering::Relaxed);
        self.truncate_looked_at.store(0, Ordering::Relaxed);
        self.truncate_again_at.store(0, Ordering::Relaxed);
        self.truncate_retry_at.store(0, Ordering::Relaxed);
        self.truncate_busy_looks.store(0, Ordering::Relaxed);
        for marked_at in &self.leaves_marked_at {
            marked_at.store(now, Ordering::Relaxed);
        }
        self.paused_until.store(0, Ordering::Relaxed);
        self.absent_until.store(0, Ordering::Relaxed);
    }

    pub fn oid(&self) -> u32 {
        self.oid.load(Ordering::Acquire)
    }

    /// Records that a worker marked a batch published at `at`.
    pub fn record_published(&self, at: i64) {
        self.last_published_at.fetch_max(at, Ordering::Relaxed);
    }

    /// Adds what a committed relay transaction did to the database's counters.
    pub fn count(&self, counts: Counts) {
        self.published_total
            .fetch_add(counts.published, Ordering::Relaxed);
        self.failed_total
            .fetch_add(counts.failed, Ordering::Relaxed);
        self.dead_lettered_total
            .fetch_add(counts.dead_lettered, Ordering::Relaxed);
    }

    /// The database's counters since the entry was taken.
    pub fn counts(&self) -> Counts {
        Counts {
            published: self.published_total.load(Ordering::Relaxed),
            failed: self.failed_total.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered_total.load(Ordering::Relaxed),
        }
    }

    /// When a worker of the database last marked a batch published, since the entry was taken.
    pub fn last_published_at(&self) -> Option<i64> {
        time_or_null(self.last_published_at.load(Ordering::Relaxed))
    }

    /// Claims the next pruning round for the caller if none has started within `every` of
    /// `now`: at most one worker wins each turn.
    pub fn claim_prune_turn(&self, now: i64, every: Duration) -> bool {
        claim_turn(&self.next_prune_at, now, every)
    }

    /// When a worker last looked for partitions to empty.
    pub fn truncate_looked_at(&self) -> i64 {
        self.truncate_looked_at.load(Ordering::Acquire)
    }

    /// Claims a look for partitions to empty at `now` for the caller, if no worker has looked
    /// since `seen`: at most one worker wins each look.
    pub fn claim_truncate_look(&self, seen: i64, now: i64) -> bool {
        self.truncate_looked_at
            .compare_exchange(seen, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// When partitions due but not emptied at the last look are to be tried again.
    pub fn truncate_again_at(&self) -> i64 {
        self.truncate_again_at.load(Ordering::Acquire)
    }

    /// Sets when partitions due but not emptied are to be tried again.
    pub fn set_truncate_again_at(&self, at: i64) {
        self.truncate_again_at.store(at, Ordering::Release);
    }

    /// When a look that found a due partition in use is to be repeated; 0 when none was.
    pub fn truncate_retry_at(&self) -> i64 {
        self.truncate_retry_at.load(Ordering::Acquire)
    }

    /// Sets when a look that found a due partition in use is to be repeated (0: none was).
    pub fn set_truncate_retry_at(&self, at: i64) {
        self.truncate_retry_at.store(at, Ordering::Release);
    }

    /// Counts a look that found a due partition in use (`busy`), or ends a run of them; returns
    /// how many looks in a row have.
    pub fn count_truncate_look(&self, busy: bool) -> u32 {
        if busy {
            self.truncate_busy_looks
                .fetch_add(1, Ordering::AcqRel)
                .saturating_add(1)
        } else {
            self.truncate_busy_looks.store(0, Ordering::Release);
            0
        }
    }

    /// Records that a batch with rows in the partitions of bitmask `leaves` was marked
    /// published, in a transaction that committed before `at`.
    pub fn record_marked(&self, leaves: u32, at: i64) {
        for (leaf, marked_at) in self.leaves_marked_at.iter().enumerate() {
            if leaves & (1 << leaf) != 0 {
                marked_at.fetch_max(at, Ordering::Relaxed);
            }
        }
    }

    /// When rows of partition `leaf` were last marked published (see `leaves_marked_at`).
    pub fn leaf_marked_at(&self, leaf: usize) -> i64 {
        self.leaves_marked_at[leaf].load(Ordering::Relaxed)
    }

    /// Keeps workers out of the database until `until`.
    pub fn pause_until(&self, until: i64) {
        self.paused_until.store(until, Ordering::Release);
    }

    pub fn is_paused(&self, now: i64) -> bool {
        now < self.paused_until.load(Ordering::Acquire)
    }

    /// Notes that the extension is missing; the launcher looks again after `until`.
    pub fn absent_until(&self, until: i64) {
        self.absent_until.store(until, Ordering::Release);
    }

    pub fn is_absent(&self, now: i64) -> bool {
        now < self.absent_until.load(Ordering::Acquire)
    }
}

/// Databases that can have an entry at once: those relayed, and under `*` those looked into.
pub const MAX_DATABASES: usize = 256;

/// How many counters of enqueueing transactions there are; a database uses the one its OID
/// picks, shared with the databases whose OIDs fall on the same one.
const ACTIVITY_COUNTERS: usize = 64;

/// Transactions that enqueued, counted when they enqueue first and again when they have ended
/// (after their commit became visible, or at their rollback or PREPARE). A relay may claim past
/// its last batch only while the two counts stayed equal: then no enqueued event can have
/// become visible below it since (see `relay/cursor.rs`).
///
/// Beside them, per partition of the ring, counts of the commits that wrote to it: one as a
/// transaction is about to commit, one once its commit is visible (or, after the first, once it
/// aborted). A relay that found a partition without a claimable event need not look into it
/// again until the counts move, and may trust that only while the two are equal: no commit is
/// between them (see `relay/cursor.rs`).
#[repr(C)]
pub struct EnqueueActivity {
    started: AtomicU64,
    ended: AtomicU64,
    committing_to: [AtomicU64; LEAVES],
    committed_to: [AtomicU64; LEAVES],
}

impl EnqueueActivity {
    fn new() -> EnqueueActivity {
        EnqueueActivity {
            started: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            committing_to: std::array::from_fn(|_| AtomicU64::new(0)),
            committed_to: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// A transaction that wrote events to the partitions in `leaves` (a bit each) is about to
    /// commit.
    pub fn committing_to(&self, leaves: u16) {
        count(&self.committing_to, leaves);
    }

    /// A transaction counted by [`EnqueueActivity::committing_to`] has committed, its commit
    /// visible, or has aborted after all. Before [`EnqueueActivity::end`].
    pub fn committed_to(&self, leaves: u16) {
        count(&self.committed_to, leaves);
    }

    /// Per partition, the count of commits that wrote to it, or `None` while one of them is
    /// between its two counts.
    pub fn commits_to(&self) -> [Option<u64>; LEAVES] {
        std::array::from_fn(|leaf| {
            // The second count first: equal to the first read after it, no commit was between
            // its two counts at that moment.
            let committed = self.committed_to[leaf].load(Ordering::SeqCst);
            let committing = self.committing_to[leaf].load(Ordering::SeqCst);
            (committed == committing).then_some(committed)
        })
    }

    /// A transaction enqueues for the first time.
    pub fn start(&self) {
        self.started.fetch_add(1, Ordering::SeqCst);
    }

    /// A transaction counted by [`EnqueueActivity::start`] has ended.
    pub fn end(&self) {
        self.ended.fetch_add(1, Ordering::SeqCst);
    }

    /// How many transactions have started, if every one of them has ended.
    pub fn quiet(&self) -> Option<u64> {
        // Ended first: a count of started read after it that equals it leaves no transaction in
        // between.
        let ended = self.ended.load(Ordering::SeqCst);
        let started = self.started.load(Ordering::SeqCst);
        (started == ended).then_some(started)
    }

    /// How many transactions have started.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }
}

/// Adds one to each count of `counts` whose bit is set in `leaves`.
fn count(counts: &[AtomicU64; LEAVES], leaves: u16) {
    for (leaf, count) in counts.iter().enumerate() {
        if leaves & (1 << leaf) != 0 {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[repr(C)]
pub struct Shared {
    slots: [WorkerSlot; MAX_WORKERS as usize],
    /// One entry per database relayed since the server started (or since the entry was freed).
    databases: [DatabaseShare; MAX_DATABASES],
    /// Held (1) while an entry is taken or freed: a few loads and stores, never a wait inside.
    entries_lock: AtomicU32,
    /// Transactions that enqueued, by database OID (see [`EnqueueActivity`]).
    activity: [EnqueueActivity; ACTIVITY_COUNTERS],
}

impl Shared {
    fn new() -> Shared {
        Shared {
            slots: std::array::from_fn(|_| WorkerSlot::new()),
            databases: std::array::from_fn(|_| DatabaseShare::new()),
            entries_lock: AtomicU32::new(0),
            activity: std::array::from_fn(|_| EnqueueActivity::new()),
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

    /// Where slot `index` stands among the slots assigned to `database`: its position, and how
    /// many there are (at least 1).
    pub fn ordinal_of(&self, index: usize, database: u32) -> (usize, usize) {
        ordinal_among(self.slots.iter().map(WorkerSlot::database), index, database)
    }

    /// The entry of database `oid`, if it has one.
    pub fn database(&self, oid: u32) -> Option<&DatabaseShare> {
        (oid != 0)
            .then(|| self.databases.iter().find(|d| d.oid() == oid))
            .flatten()
    }

    /// Runs `body` holding the lock on taking and freeing entries.
    fn with_entries_locked<R>(&self, body: impl FnOnce() -> R) -> R {
        while self
            .entries_lock
            .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        let result = body();
        self.entries_lock.store(0, Ordering::Release);
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

/// Claims the turn `next_at` stands for if it is due at `now`, and puts the next one `every`
/// later; at most one caller wins each turn.
fn claim_turn(next_at: &AtomicI64, now: i64, every: Duration) -> bool {
    let due = next_at.load(Ordering::Relaxed);
    if now < due {
        return false;
    }
    let next = now.saturating_add(every.as_micros().min(i64::MAX as u128) as i64);
    next_at
        .compare_exchange(due, next, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
}

/// The area in this process's address space, set by the startup hook.
static SHARED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
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
    fn error_text_round_trips_and_clears() {
        let slot = WorkerSlot::new();
        assert!(slot.snapshot().last_error.is_none());
        slot.set_error(Some("connection refused"), 42);
        let snap = slot.snapshot();
        assert_eq!(snap.last_error.as_deref(), Some("connection refused"));
        assert_eq!(snap.last_error_at, Some(42));
        slot.set_error(Some(""), 43);
        assert_eq!(slot.snapshot().last_error.as_deref(), Some(""));
        slot.set_error(None, 44);
        assert!(slot.snapshot().last_error.is_none());
        assert!(slot.snapshot().last_error_at.is_none());
    }

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let slot = WorkerSlot::new();
        let long = "é".repeat(200); // 400 bytes
        slot.set_error(Some(&long), 1);
        let kept = slot.snapshot().last_error.unwrap();
        assert_eq!(kept, "é".repeat(128));
    }

    #[test]
    fn one_worker_wins_each_pruning_turn() {
        let shared = DatabaseShare::new();
        let minute = Duration::from_secs(60);
        assert!(shared.claim_prune_turn(1_000, minute));
        assert!(
            !shared.claim_prune_turn(1_000, minute),
            "the same turn twice"
        );
        assert!(!shared.claim_prune_turn(1_000 + 59_999_999, minute));
        assert!(shared.claim_prune_turn(1_000 + 60_000_000, minute));
    }

    #[test]
    fn marks_move_each_partition_forward_on_its_own() {
        let shared = DatabaseShare::new();
        shared.record_marked(u32::MAX, 5);
        shared.record_marked(0b101, 30);
        shared.record_marked(0b001, 20);
        assert_eq!(shared.leaf_marked_at(0), 30);
        assert_eq!(shared.leaf_marked_at(1), 5);
        assert_eq!(shared.leaf_marked_at(2), 30);
        assert_eq!(shared.leaf_marked_at(LEAVES - 1), 5);
    }

    #[test]
    fn one_caller_wins_each_truncate_look() {
        let shared = DatabaseShare::new();
        let seen = shared.truncate_looked_at();
        assert!(shared.claim_truncate_look(seen, 1_000));
        assert!(
            !shared.claim_truncate_look(seen, 1_050),
            "another worker looked"
        );
        assert_eq!(shared.truncate_looked_at(), 1_000);
        assert!(shared.claim_truncate_look(1_000, 1_100));
    }

    #[test]
    fn counters_add_up_until_the_entry_is_taken_again() {
        let shared = DatabaseShare::new();
        let counts = |published, failed, dead_lettered| Counts {
            published,
            failed,
            dead_lettered,
        };
        shared.count(counts(5, 1, 0));
        shared.count(counts(2, 3, 1));
        assert_eq!(shared.counts(), counts(7, 4, 1));
        shared.reset(1);
        assert_eq!(shared.counts(), Counts::default());
    }

    #[test]
    fn the_last_publication_only_moves_forward() {
        let shared = DatabaseShare::new();
        assert_eq!(shared.last_published_at(), None);
        shared.record_published(20);
        shared.record_published(10);
        assert_eq!(shared.last_published_at(), Some(20));
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

    #[test]
    fn a_pause_and_an_absence_end_on_time() {
        let entry = DatabaseShare::new();
        assert!(!entry.is_paused(10));
        entry.pause_until(100);
        assert!(entry.is_paused(99));
        assert!(!entry.is_paused(100));
        entry.absent_until(50);
        assert!(entry.is_absent(49));
        assert!(!entry.is_absent(50));
    }
}

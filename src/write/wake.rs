//! The signal path: a transaction that enqueued wakes the relay workers when it commits.
//!
//! Background workers cannot LISTEN, and NOTIFY costs a global lock at commit, so the wake-up is
//! a latch: `outbox_enqueue` only records the wish, and a transaction callback sets every
//! worker's latch at COMMIT. A rollback or PREPARE TRANSACTION wakes nobody; a `COMMIT
//! PREPARED` statement wakes the relay at its own commit (the utility hook, `hooks/utility.rs`,
//! asks for it; for a prepared transaction that logical replication's apply worker commits, the
//! poll picks the events up).
//!
//! The same wish counts the transaction in its database's [`EnqueueActivity`] when it is made,
//! and again once the transaction has ended: the relay claims past its last batch only while no
//! such transaction ran.

use std::cell::Cell;
use std::ffi::c_void;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::backend::{self, BackendLocal};
use crate::model::ring;
use crate::shmem;

/// Whether this backend's current transaction wants the relay woken at commit.
static WAKE_PENDING: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));

/// The partitions of the ring the current transaction's events went to, a bit each.
static LEAVES_WRITTEN: BackendLocal<Cell<u16>> = BackendLocal::new(Cell::new(0));

/// The partitions the current transaction was counted against as about to commit.
static LEAVES_COMMITTING: BackendLocal<Cell<u16>> = BackendLocal::new(Cell::new(0));

/// Asks for the relay to be woken when the current transaction commits. Cheap enough to call on
/// every enqueue: after the first call in a transaction it only reads a flag. Call it before
/// the events are written: the transaction is then counted as enqueueing before any of its
/// events can be seen.
pub fn wake_relay_at_commit() {
    let Some(shared) = shmem::shared() else {
        return; // not preloaded: no relay to wake
    };
    if WAKE_PENDING.get().get() {
        return;
    }
    backend::register_once(&backend::XACT_CALLBACK, || {
        // SAFETY: registers a callback that lives as long as the library, once per backend.
        unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
    });
    // SAFETY: reads this backend's database.
    shared
        .activity(unsafe { pg_sys::MyDatabaseId.to_u32() })
        .start();
    WAKE_PENDING.get().set(true);
}

/// Notes that the current transaction wrote event `id`, after [`wake_relay_at_commit`]: its
/// commit tells the relay which partitions to look into (see `relay/claim/cursor.rs`).
pub fn wrote(id: i64) {
    let written = LEAVES_WRITTEN.get();
    written.set(written.get() | 1 << ring::leaf_of(id));
}

/// Asks for the relay to be woken when the current transaction commits, for events it made
/// visible anywhere in the ring.
pub fn wake_relay_at_commit_anywhere() {
    wake_relay_at_commit();
    LEAVES_WRITTEN.get().set(u16::MAX);
}

/// `_outbox_wake()`: lets hand-written SQL (redrive) ask for the same wake-up.
#[pg_extern(sql = false)]
fn _outbox_wake() {
    wake_relay_at_commit_anywhere();
}

/// Whether the relay works in this backend's database (its workers have a share of shared
/// memory for it).
pub fn database_is_relayed() -> bool {
    // SAFETY: reads this backend's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    shmem::shared().is_some_and(|shared| shared.database(database).is_some())
}

/// Whether a utility statement is a `COMMIT PREPARED`, which makes the events of a prepared
/// transaction visible when the statement's own transaction commits.
///
/// # Safety
/// `node` must be a valid parse node or null.
pub unsafe fn commits_prepared(node: *mut pg_sys::Node) -> bool {
    // SAFETY: guaranteed by the caller; the cast follows the node's tag.
    unsafe {
        !node.is_null()
            && (*node).type_ == pg_sys::NodeTag::T_TransactionStmt
            && (*node.cast::<pg_sys::TransactionStmt>()).kind
                == pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    match event {
        // Counted against the partitions it wrote to as it is about to commit, and again once
        // its events are visible (see `shmem::EnqueueActivity`): a relay that claims from one
        // partition alone (see `relay/claim/cursor.rs`) never takes a partition between the two
        // counts for one without an event to claim, so an earlier event of a key, visible and
        // not yet counted, is never passed by.
        XACT_EVENT_PRE_COMMIT | XACT_EVENT_PARALLEL_PRE_COMMIT if WAKE_PENDING.get().get() => {
            let leaves = LEAVES_WRITTEN.get().get();
            if let Some(shared) = shmem::shared() {
                // SAFETY: reads this backend's database.
                let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
                shared.activity(database).committing_to(leaves);
                LEAVES_COMMITTING.get().set(leaves);
            }
        }
        // Called once the commit is visible to others: a relay that sees the transaction as
        // ended sees its events too.
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT if WAKE_PENDING.get().get() => {
            WAKE_PENDING.get().set(false);
            LEAVES_WRITTEN.get().set(0);
            let leaves = LEAVES_COMMITTING.get().replace(0);
            if let Some(shared) = shmem::shared() {
                // SAFETY: reads this backend's database.
                let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
                let activity = shared.activity(database);
                activity.committed_to(leaves);
                activity.end();
                shared.wake_database(database);
            }
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT | XACT_EVENT_PREPARE
            if WAKE_PENDING.get().get() =>
        {
            WAKE_PENDING.get().set(false);
            LEAVES_WRITTEN.get().set(0);
            // An abort after the first count: the second, so that the counts agree again.
            let leaves = LEAVES_COMMITTING.get().replace(0);
            if let Some(shared) = shmem::shared() {
                // SAFETY: reads this backend's database.
                let activity = shared.activity(unsafe { pg_sys::MyDatabaseId.to_u32() });
                activity.committed_to(leaves);
                activity.end();
            }
        }
        _ => {}
    }
}

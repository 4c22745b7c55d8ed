//! The signal path: a transaction that enqueued wakes the relay workers when it commits.
//!
//! Background workers cannot LISTEN, and NOTIFY costs a global lock at commit, so the wake-up is
//! a latch: `outbox_enqueue` only records the wish, and a transaction callback sets every
//! worker's latch at COMMIT. A rollback or PREPARE TRANSACTION wakes nobody; the poll picks up
//! a prepared transaction once it is committed.

use std::ffi::c_void;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::shmem;

/// Whether this backend's current transaction wants the relay woken at commit.
static mut WAKE_PENDING: bool = false;
/// Whether the transaction callback is registered in this backend.
static mut CALLBACK_REGISTERED: bool = false;

/// Asks for the relay to be woken when the current transaction commits. Cheap enough to call on
/// every enqueue: after the first call in a transaction it only reads a flag.
pub fn wake_relay_at_commit() {
    if shmem::shared().is_none() {
        return; // not preloaded: no relay to wake
    }
    // SAFETY: backend-local statics touched only from the backend's one thread.
    unsafe {
        if !CALLBACK_REGISTERED {
            pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
            CALLBACK_REGISTERED = true;
        }
        WAKE_PENDING = true;
    }
}

/// `_outbox_wake()`: lets hand-written SQL (redrive) ask for the same wake-up.
#[pg_extern(sql = false)]
fn _outbox_wake() {
    wake_relay_at_commit();
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    // SAFETY: called by PostgreSQL on the backend's thread.
    unsafe {
        match event {
            XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT if WAKE_PENDING => {
                WAKE_PENDING = false;
                if let Some(shared) = shmem::shared() {
                    shared.wake_all();
                }
            }
            XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT | XACT_EVENT_PREPARE => {
                WAKE_PENDING = false;
            }
            _ => {}
        }
    }
}

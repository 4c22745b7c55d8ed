//! The executor-start hook, in every backend that loads the library (preloaded or not, since
//! `outbox_enqueue` can run in either): it lends the table owner's right to the one insert
//! `outbox_enqueue` runs as a statement (`write/insert/owner_right.rs`) and changes nothing
//! else.

use std::sync::OnceLock;

use pgrx::pg_sys;

use crate::write::insert::owner_right;

static PREVIOUS: OnceLock<pg_sys::ExecutorStart_hook_type> = OnceLock::new();

unsafe extern "C-unwind" {
    /// PostgreSQL's own executor start, called as it is (see `utility.rs` on why not through
    /// pgrx's wrapper): an ERROR it raises stays PostgreSQL's.
    #[link_name = "standard_ExecutorStart"]
    fn standard_executor_start(query_desc: *mut pg_sys::QueryDesc, eflags: std::ffi::c_int);
}

/// Installs the hook, once per backend, in front of whatever hook was there.
pub fn init() {
    // SAFETY: hooks are installed while the library loads, on the backend's only thread.
    unsafe {
        if PREVIOUS.set(pg_sys::ExecutorStart_hook).is_ok() {
            pg_sys::ExecutorStart_hook = Some(executor_start);
        }
    }
}

unsafe extern "C-unwind" fn executor_start(
    query_desc: *mut pg_sys::QueryDesc,
    eflags: std::ffi::c_int,
) {
    // SAFETY: PostgreSQL passes a valid query descriptor; `lend` only reads and sets fields of
    // its plan, and raises nothing. The next hook runs as C calls it: nothing alive here has a
    // destructor for its longjmp to skip.
    unsafe {
        if !query_desc.is_null() {
            owner_right::lend((*query_desc).plannedstmt);
        }
        match PREVIOUS.get().copied().flatten() {
            Some(previous) => previous(query_desc, eflags),
            None => standard_executor_start(query_desc, eflags),
        }
    }
}

//! The utility hook, in every backend of a server that preloads the extension: what some
//! statements need of the relay. A `DROP DATABASE` or a rename of a database the relay works in
//! first has its workers leave (`step_aside.rs`); a `COMMIT PREPARED` wakes the relay at its
//! commit, as the commit of a transaction that enqueued does (`write/wake.rs`).

use std::sync::OnceLock;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::{listen, step_aside};
use crate::write::wake;

static PREVIOUS: OnceLock<pg_sys::ProcessUtility_hook_type> = OnceLock::new();

unsafe extern "C-unwind" {
    /// PostgreSQL's own utility processing, declared here to be called as it is: pgrx's
    /// `pg_sys::standard_ProcessUtility` runs it under `pg_guard_ffi_boundary`, which turns an
    /// ERROR raised inside (a `GRANT` on a function that does not exist) into a Rust panic that
    /// the hook's `#[pg_guard]` raises again as an error of its own: without the error's
    /// position, context or object names, and with a Rust backtrace in its DETAIL when
    /// `RUST_BACKTRACE` is set in the server's environment.
    #[link_name = "standard_ProcessUtility"]
    fn standard_process_utility(
        pstmt: *mut pg_sys::PlannedStmt,
        query_string: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        query_env: *mut pg_sys::QueryEnvironment,
        dest: *mut pg_sys::DestReceiver,
        qc: *mut pg_sys::QueryCompletion,
    );
}

/// Installs the hook; called from `_PG_init` while preloading.
pub fn init() {
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining hooks is the documented
    // way for an extension to take part in utility processing.
    unsafe {
        if PREVIOUS.set(pg_sys::ProcessUtility_hook).is_ok() {
            pg_sys::ProcessUtility_hook = Some(process_utility);
        }
    }
}

#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL passes a valid statement; the hook chain is called as it was given.
    unsafe {
        let node = (*pstmt).utilityStmt;
        let stepped = step_aside::before(node);
        let listening = listen::action(node);
        if wake::commits_prepared(node) && wake::database_is_relayed() {
            wake::wake_relay_at_commit_anywhere();
        }
        // The statement runs as C calls it, outside any pgrx guard: an ERROR it raises is
        // PostgreSQL's, and goes to PostgreSQL's handler (a longjmp past this frame) exactly as
        // it was raised. Nothing alive here has a destructor to skip (`stepped` and `listening`
        // are `Copy`).
        let next = PREVIOUS
            .get()
            .copied()
            .flatten()
            .unwrap_or(standard_process_utility);
        next(
            pstmt,
            query_string,
            read_only_tree,
            context,
            params,
            query_env,
            dest,
            qc,
        );
        step_aside::after(stepped);
        listen::after(listening);
    }
}

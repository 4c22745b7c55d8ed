//! `DROP DATABASE` and `ALTER DATABASE ... RENAME` of a database the relay works in, without
//! `WITH (FORCE)`: both refuse to run while anyone else is connected to it, and the relay's
//! workers are. A utility hook, in every backend, pauses the database in shared memory (so the
//! launcher starts no worker there), asks its workers to leave, waits for them, and lets the
//! command run. A paused database is picked up again ten seconds later, should the command have
//! failed; after a rename, at once.

use std::ffi::CStr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::shmem;

/// How long a database stays paused for a command that waits for its workers.
const PAUSE: Duration = Duration::from_secs(10);
/// How long the command waits for the workers to leave; `DROP DATABASE` itself waits 5 s more.
const WAIT: Duration = Duration::from_secs(5);

static PREVIOUS: OnceLock<pg_sys::ProcessUtility_hook_type> = OnceLock::new();

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

/// What a statement does to a database the relay may be connected to.
enum Leaving {
    Drop(String),
    Rename(String),
}

/// The database a `DROP DATABASE` or a rename of a database is about, if the statement is one.
///
/// # Safety
/// `node` must be a valid parse node or null.
unsafe fn leaving(node: *mut pg_sys::Node) -> Option<Leaving> {
    // SAFETY: guaranteed by the caller; the casts follow the node's tag.
    unsafe {
        if node.is_null() {
            return None;
        }
        let name = |raw: *const std::ffi::c_char| {
            (!raw.is_null()).then(|| CStr::from_ptr(raw).to_string_lossy().into_owned())
        };
        match (*node).type_ {
            pg_sys::NodeTag::T_DropdbStmt => {
                name((*node.cast::<pg_sys::DropdbStmt>()).dbname).map(Leaving::Drop)
            }
            pg_sys::NodeTag::T_RenameStmt => {
                let stmt = node.cast::<pg_sys::RenameStmt>();
                if (*stmt).renameType == pg_sys::ObjectType::OBJECT_DATABASE {
                    name((*stmt).subname).map(Leaving::Rename)
                } else {
                    None
                }
            }
            _ => None,
        }
    }
}

/// Pauses the database `name` and waits until none of its relay workers is connected; returns
/// its OID if it was paused.
fn step_aside(name: &str) -> Option<u32> {
    let shared = shmem::shared()?;
    let cname = std::ffi::CString::new(name).ok()?;
    // SAFETY: a catalog lookup by name inside the statement's transaction.
    let oid = unsafe { pg_sys::get_database_oid(cname.as_ptr(), true) };
    // Only for someone the command will let through: anyone else could stop the relay for ten
    // seconds with a DROP DATABASE that fails.
    if oid == pg_sys::InvalidOid || !crate::compat::owns_database(oid) {
        return None;
    }
    let oid = oid.to_u32();
    // SAFETY: reads the clock.
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let share = shared.database_or_take(oid, now)?;
    share.pause_until(now + PAUSE.as_micros() as i64);
    let connected = || {
        shared
            .all_slots()
            .iter()
            .filter(|s| s.database() == oid && s.pid() != 0)
            .map(|s| s.pid())
            .collect::<Vec<i32>>()
    };
    for pid in connected() {
        // SAFETY: a signal to a relay worker of this server, found in its slot.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let started = Instant::now();
    while !connected().is_empty() && started.elapsed() < WAIT {
        // SAFETY: sleeps 10 ms, then lets a cancel or termination of this backend through.
        unsafe {
            pg_sys::pg_usleep(10_000);
            pg_sys::check_for_interrupts!();
        }
    }
    Some(oid)
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
        let leaving = leaving((*pstmt).utilityStmt);
        let paused = match &leaving {
            // DROP DATABASE refuses to run in a transaction block: it would fail anyway.
            Some(Leaving::Drop(_)) if pg_sys::IsTransactionBlock() => None,
            Some(Leaving::Drop(name)) | Some(Leaving::Rename(name)) => step_aside(name),
            None => None,
        };
        match PREVIOUS.get().copied().flatten() {
            Some(previous) => previous(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
            None => pg_sys::standard_ProcessUtility(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
        }
        // A renamed database is relayed again at once (if the setting still selects it).
        if let (Some(Leaving::Rename(_)), Some(oid)) = (&leaving, paused) {
            if let Some(share) = shmem::shared().and_then(|s| s.database(oid)) {
                share.pause_until(0);
            }
        }
    }
}

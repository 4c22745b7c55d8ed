//! Statements that need a database the relay works in to themselves, run without `WITH
//! (FORCE)`: `DROP DATABASE`, `ALTER DATABASE ... RENAME`, `CREATE DATABASE ... TEMPLATE` of it
//! and `ALTER DATABASE ... SET TABLESPACE`. Each refuses to run while anyone else is connected
//! to it, and the relay's workers are. Before such a command runs (from the utility hook,
//! `utility.rs`, in every backend), the database is paused in shared memory (so the launcher
//! starts no worker there), its workers are asked to leave and waited for, and the command
//! runs. A paused database is picked up again ten seconds later, should the command have
//! failed; after a rename, a copy or a move, at once.

use std::ffi::{CStr, CString};
use std::time::{Duration, Instant};

use pgrx::pg_sys;

use crate::shmem;

/// How long a database stays paused for a command that waits for its workers.
const PAUSE: Duration = Duration::from_secs(10);
/// How long the command waits for the workers to leave; `DROP DATABASE` itself waits 5 s more.
const WAIT: Duration = Duration::from_secs(5);

/// What a statement does to a database the relay may be connected to, named as the statement
/// names it: bytes in the session's database encoding, which need not be UTF-8.
enum Leaving {
    Drop(CString),
    /// A rename, a copy (the database as a template) or a move (to another tablespace): the
    /// database stays, and is relayed again as soon as the statement has run.
    Return(CString),
}

/// The value of option `name` in a statement's list of options, if it is given as a name.
///
/// # Safety
/// `options` must be a valid list of `DefElem` nodes, or null.
unsafe fn option(options: *mut pg_sys::List, name: &CStr) -> Option<CString> {
    // SAFETY: guaranteed by the caller; the casts follow the nodes' tags.
    unsafe {
        if options.is_null() {
            return None;
        }
        (0..(*options).length).find_map(|at| {
            let def = (*(*options).elements.add(at as usize))
                .ptr_value
                .cast::<pg_sys::DefElem>();
            if def.is_null()
                || (*def).defname.is_null()
                || CStr::from_ptr((*def).defname) != name
                || (*def).arg.is_null()
                || (*(*def).arg).type_ != pg_sys::NodeTag::T_String
            {
                return None;
            }
            let value = (*(*def).arg.cast::<pg_sys::String>()).sval;
            (!value.is_null()).then(|| CStr::from_ptr(value).to_owned())
        })
    }
}

/// The database a statement needs to itself, if it is one of those above.
///
/// # Safety
/// `node` must be a valid parse node or null.
unsafe fn leaving(node: *mut pg_sys::Node) -> Option<Leaving> {
    // SAFETY: guaranteed by the caller; the casts follow the node's tag.
    unsafe {
        if node.is_null() {
            return None;
        }
        let name =
            |raw: *const std::ffi::c_char| (!raw.is_null()).then(|| CStr::from_ptr(raw).to_owned());
        match (*node).type_ {
            pg_sys::NodeTag::T_DropdbStmt => {
                name((*node.cast::<pg_sys::DropdbStmt>()).dbname).map(Leaving::Drop)
            }
            pg_sys::NodeTag::T_RenameStmt => {
                let stmt = node.cast::<pg_sys::RenameStmt>();
                if (*stmt).renameType == pg_sys::ObjectType::OBJECT_DATABASE {
                    name((*stmt).subname).map(Leaving::Return)
                } else {
                    None
                }
            }
            pg_sys::NodeTag::T_CreatedbStmt => {
                option((*node.cast::<pg_sys::CreatedbStmt>()).options, c"template")
                    .map(Leaving::Return)
            }
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let stmt = node.cast::<pg_sys::AlterDatabaseStmt>();
                option((*stmt).options, c"tablespace")
                    .and(name((*stmt).dbname))
                    .map(Leaving::Return)
            }
            _ => None,
        }
    }
}

/// Pauses the database `name` and waits until none of its relay workers is connected; returns
/// its OID if it was paused.
fn step_aside(name: &CStr) -> Option<u32> {
    let shared = shmem::shared()?;
    // SAFETY: a catalog lookup by name inside the statement's transaction.
    let oid = unsafe { pg_sys::get_database_oid(name.as_ptr(), true) };
    // Only for someone the command will let through: anyone else could stop the relay for ten
    // seconds with a DROP DATABASE that fails.
    if oid == pg_sys::InvalidOid || !crate::pg::compat::owns_database(oid) {
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

/// What stepping aside did for a command: whether the database stays, and the database it
/// paused. Plain data: it is kept across the command, which may end in PostgreSQL's longjmp,
/// past any destructor.
#[derive(Clone, Copy)]
pub struct SteppingAside {
    stays: bool,
    paused: Option<u32>,
}

/// Before a utility statement runs: if it needs a database the relay works in to itself, its
/// workers leave first.
///
/// # Safety
/// `node` must be the statement's valid parse node, or null.
pub unsafe fn before(node: *mut pg_sys::Node) -> Option<SteppingAside> {
    // SAFETY: guaranteed by the caller.
    let leaving = unsafe { leaving(node) }?;
    let paused = match &leaving {
        // DROP DATABASE refuses to run in a transaction block: it would fail anyway.
        // SAFETY: reads the transaction state.
        Leaving::Drop(_) if unsafe { pg_sys::IsTransactionBlock() } => None,
        Leaving::Drop(name) | Leaving::Return(name) => step_aside(name),
    };
    Some(SteppingAside {
        stays: matches!(leaving, Leaving::Return(_)),
        paused,
    })
}

/// After the statement ran: a database renamed, copied or moved is relayed again at once (if
/// the setting still selects it).
pub fn after(stepped: Option<SteppingAside>) {
    if let Some(SteppingAside {
        stays: true,
        paused: Some(oid),
    }) = stepped
    {
        if let Some(share) = shmem::shared().and_then(|s| s.database(oid)) {
            share.pause_until(0);
        }
    }
}

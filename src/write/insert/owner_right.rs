//! The table owner's right to write the row, lent to the inserts that `outbox_enqueue` runs as
//! statements (into a table reshaped by hand, and into `outbox_delayed`), and to nothing they
//! fire.
//!
//! `outbox_enqueue` runs as its caller, who needs no privilege on the tables. The executor's
//! single-row insert checks none; a statement checks the privileges of each relation it writes
//! at executor start, against the role its range table names (`checkAsUser`, what a view
//! sets to its owner) or else the current one. So, as for a view, the statement's own relation
//! is checked as its owner, while the statement runs as the caller: its defaults, CHECK
//! constraints and triggers run as the caller, with the caller's privileges, exactly as they
//! would for the caller's own `INSERT`, and no object the caller can create (a temporary table
//! that an unqualified name in a trigger finds first) ever runs with the owner's rights.
//!
//! [`with_owner_right`] arms the loan for one relation; the executor-start hook
//! (`hooks/executor.rs`) calls [`lend`] for each statement that starts, which spends it on the
//! first `INSERT` into that relation and on nothing else. Anything the insert fires starts
//! later, with the loan spent. An unspent loan is dropped when the body returns or fails.

use std::cell::Cell;

use pgrx::pg_sys;

use crate::pg::compat;
use crate::write::backend::BackendLocal;

/// The relation an insert may write with its owner's right, and that owner, until a statement
/// spends it.
static LOAN: BackendLocal<Cell<Option<(pg_sys::Oid, pg_sys::Oid)>>> =
    BackendLocal::new(Cell::new(None));

/// Runs `body`, in which one `INSERT` into `relid` is checked as the relation's owner.
///
/// # Safety
/// Must run inside a transaction; `relid` must be a table's OID.
pub unsafe fn with_owner_right<R>(relid: pg_sys::Oid, body: impl FnOnce() -> R) -> R {
    struct Spent;
    impl Drop for Spent {
        fn drop(&mut self) {
            LOAN.get().set(None);
        }
    }
    // SAFETY: a relcache read of a relation the insert locks the same way.
    let owner = unsafe {
        let lockmode = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(relid, lockmode);
        let owner = (*(*rel).rd_rel).relowner;
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        owner
    };
    let _spent = Spent;
    LOAN.get().set(Some((relid, owner)));
    body()
}

/// Called as each statement starts: if it is the `INSERT` the loan is for, its relation is
/// checked as the owner, and the loan is spent. Any other statement is left as it is.
///
/// # Safety
/// `stmt` must be the starting statement's valid plan.
pub unsafe fn lend(stmt: *mut pg_sys::PlannedStmt) {
    let Some((relid, owner)) = LOAN.get().get() else {
        return;
    };
    // SAFETY: guaranteed by the caller; the lists hold the nodes their types say.
    unsafe {
        if stmt.is_null() || (*stmt).commandType != pg_sys::CmdType::CMD_INSERT {
            return;
        }
        let mut lent = false;
        for (entry_relid, required, check_as) in permissions(stmt) {
            if entry_relid == relid && required & compat::acl_insert() != 0 {
                *check_as = owner;
                lent = true;
            }
        }
        if lent {
            LOAN.get().set(None);
        }
    }
}

/// The statement's permission entries: each relation with the rights it requires and the role
/// they are checked as.
///
/// # Safety
/// `stmt` must be a valid plan that outlives the references.
unsafe fn permissions<'a>(
    stmt: *mut pg_sys::PlannedStmt,
) -> Vec<(pg_sys::Oid, pg_sys::AclMode, &'a mut pg_sys::Oid)> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        #[cfg(feature = "pg15")]
        let (list, tag) = ((*stmt).rtable, pg_sys::NodeTag::T_RangeTblEntry);
        #[cfg(not(feature = "pg15"))]
        let (list, tag) = ((*stmt).permInfos, pg_sys::NodeTag::T_RTEPermissionInfo);
        let mut entries = Vec::new();
        if list.is_null() {
            return entries;
        }
        for at in 0..(*list).length {
            let node = (*(*list).elements.add(at as usize))
                .ptr_value
                .cast::<pg_sys::Node>();
            if node.is_null() || (*node).type_ != tag {
                continue;
            }
            #[cfg(feature = "pg15")]
            {
                let rte = node.cast::<pg_sys::RangeTblEntry>();
                if (*rte).rtekind == pg_sys::RTEKind::RTE_RELATION {
                    entries.push(((*rte).relid, (*rte).requiredPerms, &mut (*rte).checkAsUser));
                }
            }
            #[cfg(not(feature = "pg15"))]
            {
                let info = node.cast::<pg_sys::RTEPermissionInfo>();
                entries.push((
                    (*info).relid,
                    (*info).requiredPerms,
                    &mut (*info).checkAsUser,
                ));
            }
        }
        entries
    }
}

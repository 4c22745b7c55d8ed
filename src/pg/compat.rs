//! What differs between the PostgreSQL majors the extension builds for (15 to 19), in one place:
//! each function here has one body per range of majors, chosen by the `pgNN` feature, and the
//! rest of the code calls it without knowing the major.

use pgrx::pg_sys;

/// The attributes of a tuple descriptor, dropped ones included, in column order.
///
/// # Safety
/// `tupdesc` must be a valid tuple descriptor that outlives the returned slice.
pub unsafe fn attributes<'a>(tupdesc: pg_sys::TupleDesc) -> &'a [pg_sys::FormData_pg_attribute] {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let natts = (*tupdesc).natts.max(0) as usize;
        #[cfg(not(any(feature = "pg18", feature = "pg19")))]
        {
            (*tupdesc).attrs.as_slice(natts)
        }
        // From 18 on, the full attributes follow an array of compact ones.
        #[cfg(any(feature = "pg18", feature = "pg19"))]
        {
            let first = (*tupdesc)
                .compact_attrs
                .as_ptr()
                .add(natts)
                .cast::<pg_sys::FormData_pg_attribute>();
            std::slice::from_raw_parts(first, natts)
        }
    }
}

/// Gives the executor state a range table holding `rte` alone, as logical replication's apply
/// worker does for the relation it writes to. From 16 on, permissions live in a list of their
/// own; from 18 on, the executor also wants to know which entries survived pruning.
///
/// # Safety
/// `estate` must be a fresh executor state, `rte` a palloc'd relation entry.
pub unsafe fn init_range_table(estate: *mut pg_sys::EState, rte: *mut pg_sys::RangeTblEntry) {
    // SAFETY: guaranteed by the caller; the lists are palloc'd in the current memory context.
    unsafe {
        let range_table = pg_sys::lappend(std::ptr::null_mut(), rte.cast());
        #[cfg(feature = "pg15")]
        pg_sys::ExecInitRangeTable(estate, range_table);
        #[cfg(not(feature = "pg15"))]
        {
            let mut permissions: *mut pg_sys::List = std::ptr::null_mut();
            pg_sys::addRTEPermissionInfo(&mut permissions, rte);
            #[cfg(not(any(feature = "pg18", feature = "pg19")))]
            pg_sys::ExecInitRangeTable(estate, range_table, permissions);
            #[cfg(any(feature = "pg18", feature = "pg19"))]
            pg_sys::ExecInitRangeTable(
                estate,
                range_table,
                permissions,
                pg_sys::bms_make_singleton(1),
            );
        }
    }
}

/// Reserves the `outbox.` prefix, so that a typo such as `outbox.worker` is reported at startup.
pub fn reserve_guc_prefix() {
    // SAFETY: called from _PG_init while preloading, as PostgreSQL's own modules do.
    unsafe {
        pg_sys::MarkGUCPrefixReserved(c"outbox".as_ptr());
    }
}

/// The tranche of the extension's one LWLock in shared memory, as `pg_stat_activity` names a
/// wait on it (`LWLock` / `outbox`).
pub const LOCK_TRANCHE: &std::ffi::CStr = c"outbox";

/// Asks for `size` bytes of shared memory and one LWLock in tranche [`LOCK_TRANCHE`]. Called
/// from `_PG_init` while preloading: the requests must come from `shmem_request_hook`, which is
/// installed here, chained to any earlier hook.
pub fn request_shared_memory(size: usize) {
    // SAFETY: _PG_init runs single-threaded in the postmaster; chaining hooks is the documented
    // way for an extension to take part in shared-memory setup.
    unsafe {
        if SHMEM_REQUEST
            .set((size, pg_sys::shmem_request_hook))
            .is_ok()
        {
            pg_sys::shmem_request_hook = Some(request_shmem);
        }
    }
}

/// The size to request and the hook that was installed before ours.
static SHMEM_REQUEST: std::sync::OnceLock<(usize, pg_sys::shmem_request_hook_type)> =
    std::sync::OnceLock::new();

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn request_shmem() {
    let Some(&(size, previous)) = SHMEM_REQUEST.get() else {
        return;
    };
    // SAFETY: called by the postmaster while shared memory is being sized.
    unsafe {
        if let Some(previous) = previous {
            previous();
        }
        pg_sys::RequestAddinShmemSpace(size);
        pg_sys::RequestNamedLWLockTranche(LOCK_TRANCHE.as_ptr(), 1);
    }
}

/// The INSERT privilege, as `pg_class_aclcheck` takes it: a 64-bit mask from 16 on.
#[allow(clippy::useless_conversion)] // the same type before 16
pub fn acl_insert() -> pg_sys::AclMode {
    pg_sys::ACL_INSERT.into()
}

/// Ends the process with `code`: `proc_exit`, which 18's headers no longer mark as not
/// returning.
pub fn proc_exit(code: i32) -> ! {
    // SAFETY: ends the process; its exit callbacks run as for any proc_exit.
    unsafe { pg_sys::proc_exit(code) };
    #[cfg(any(feature = "pg18", feature = "pg19"))]
    unreachable!("proc_exit returned")
}

/// The partitions of a partitioned table, without those being detached.
///
/// # Safety
/// `rel` must be an open partitioned table.
pub unsafe fn partition_desc(rel: pg_sys::Relation) -> pg_sys::PartitionDesc {
    // SAFETY: guaranteed by the caller.
    unsafe { pg_sys::RelationGetPartitionDesc(rel, true) }
}

/// Whether the current user owns database `oid` (superusers own everything). Up to 15 a
/// function of its own; from 16 on the generic object check.
pub fn owns_database(oid: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup by OID, inside the caller's transaction.
    unsafe {
        #[cfg(feature = "pg15")]
        {
            pg_sys::pg_database_ownercheck(oid, pg_sys::GetUserId())
        }
        #[cfg(not(feature = "pg15"))]
        {
            pg_sys::object_ownercheck(pg_sys::DatabaseRelationId, oid, pg_sys::GetUserId())
        }
    }
}

/// How far the WAL is on disk.
pub fn wal_flushed_to() -> u64 {
    // SAFETY: reads shared WAL state under its spinlock.
    unsafe { pg_sys::GetFlushRecPtr(std::ptr::null_mut()) }
}

/// The LWLock that [`request_shared_memory`] asked for. Only valid once shared memory is set
/// up, in a process attached to it.
///
/// # Safety
/// Must run in `shmem_startup_hook` or later, in a server that preloaded the library.
pub unsafe fn tranche_lock() -> *mut pg_sys::LWLock {
    // SAFETY: the caller's promise: the tranche was requested and shared memory is set up.
    unsafe { &raw mut (*pg_sys::GetNamedLWLockTranche(LOCK_TRANCHE.as_ptr())).lock }
}

//! What a pass may claim: the lanes of its worker's share, once it holds the locks of their
//! groups, and whether an event in them failed or is held.

use pgrx::pg_sys;

/// Which of the table's events a claim may take: the lanes of this worker's share, and whether
/// some event in them failed or is held (its key's later events must then wait for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub lanes: std::ops::Range<i16>,
    pub failing: bool,
}

/// Takes, for the current transaction, the lock of each lane group in `groups` without waiting;
/// false if another process holds one of them (a worker whose share this was, still finishing
/// its batch). The locks are advisory locks of a kind SQL cannot take (`objsubid` 3 in
/// `pg_locks`), so no session can hold the relay up by taking them.
pub fn hold_groups(groups: std::ops::Range<u32>) -> bool {
    groups.into_iter().all(|group| {
        let tag = pg_sys::LOCKTAG {
            // SAFETY: reads this process's database.
            locktag_field1: unsafe { pg_sys::MyDatabaseId.to_u32() },
            // "obox"
            locktag_field2: 0x6f62_6f78,
            locktag_field3: group,
            locktag_field4: 3,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        };
        // SAFETY: a transaction lock taken without waiting, inside the worker's transaction.
        let result = unsafe {
            pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, true)
        };
        result != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
    })
}

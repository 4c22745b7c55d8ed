//! The relay's own session settings, pinned before it connects to its database.
//!
//! The relay runs as the bootstrap superuser inside a database whose owner may be anyone. What
//! the owner (or a role) sets with `ALTER DATABASE ... SET` or `ALTER ROLE ... SET` is applied
//! to every new session at a lower priority than these, so none of it reaches the relay: a
//! `search_path` that puts the owner's functions before `pg_catalog` cannot hijack the relay's
//! statements, and an isolation level, read-only default or timeout cannot change what it does.

use std::ffi::{CStr, CString};

use pgrx::pg_sys;

/// Each setting and the value the relay runs with.
const PINNED: &[(&CStr, &str)] = &[
    // Nothing of the database owner's is found by name: the relay's SQL resolves functions,
    // operators and types in pg_catalog (and names its own tables with their schema).
    (c"search_path", "pg_catalog, pg_temp"),
    (c"role", "none"),
    (c"default_transaction_isolation", "read committed"),
    (c"default_transaction_read_only", "off"),
    (c"default_transaction_deferrable", "off"),
    (c"session_replication_role", "origin"),
    (c"statement_timeout", "0"),
    (c"lock_timeout", "0"),
    (c"idle_in_transaction_session_timeout", "0"),
    // The relay's commits never wait for a synchronous standby: a fast shutdown would otherwise
    // hang on one that is absent. A mark lost in a failover only makes the relay publish that
    // batch again, which the dedupe markers absorb. With dedupe on they do not wait for their
    // WAL flush either (see `commit_without_waiting`).
    (c"synchronous_commit", "local"),
    // A claim planned during a large backlog would otherwise be JIT-compiled on every poll.
    (c"jit", "off"),
    (c"max_parallel_workers_per_gather", "0"),
    // The relay's statements are planned once and kept, and their plans never scan the table.
    // Left to itself, the plan cache re-planned the claim on every pass, a cost paid per
    // batch under a stream of commits, and a generic plan built while the table held a
    // page or two was a sequential scan, kept through the next burst until autoanalyze ran.
    // With sequential scans and sorts priced out, every plan walks an index (the claims the
    // partial indexes of unpublished rows, which alone give their order, see `sql.rs`; the
    // others the primary key), whatever the statistics say when it is built.
    (c"plan_cache_mode", "force_generic_plan"),
    (c"enable_seqscan", "off"),
    (c"enable_sort", "off"),
    (c"enable_incremental_sort", "off"),
    (c"enable_indexscan", "on"),
    (c"enable_indexonlyscan", "on"),
];

/// Pins the relay's settings; called before the worker connects to its database.
pub fn pin_settings(application_name: &str) {
    set(c"application_name", application_name);
    for (name, value) in PINNED {
        set(name, value);
    }
    // Session timeouts that only some majors have (14 and 17 added one each).
    for name in [c"idle_session_timeout", c"transaction_timeout"] {
        // SAFETY: a read-only lookup of a GUC by name, from the worker's main thread.
        let exists = unsafe { !pg_sys::GetConfigOption(name.as_ptr(), true, false).is_null() };
        if exists {
            set(name, "0");
        }
    }
}

/// With dedupe on, the relay's commits do not wait for their WAL to reach disk: a mark lost in
/// a crash makes the relay publish its batch again, and the batch's markers absorb that, since
/// they are deleted only once the commit is on disk (outbox-redis's `publish.rs`). That takes a
/// WAL flush off every pass of a busy relay. With dedupe off nothing would absorb it, and commits
/// wait.
pub fn commit_without_waiting(dedupe: bool) {
    set(c"synchronous_commit", if dedupe { "off" } else { "local" });
}

fn set(name: &CStr, value: &str) {
    let value = CString::new(value).unwrap_or_default();
    // SAFETY: setting a GUC in our own process from its main thread. PGC_S_OVERRIDE outranks
    // the database's and the role's defaults, which the connection applies afterwards.
    unsafe {
        pg_sys::SetConfigOption(
            name.as_ptr(),
            value.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_OVERRIDE,
        );
    }
}

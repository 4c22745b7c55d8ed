//! `outbox`: the transactional outbox inside PostgreSQL.
//!
//! `outbox_enqueue` writes an event in the caller's transaction; background workers relay the
//! committed events to Redis Streams. The SQL surface is hand-written in `sql/outbox.sql`.
//!
//! The code is grouped by concern: `write/` runs in the caller's transaction, `relay/` is the
//! background workers, `retention/` keeps the table to `outbox.retention`, `shmem/` is what the
//! backends and the workers share, `hooks/` what the extension hooks into every backend, `pg/`
//! the PostgreSQL plumbing both sides use, `gucs/` every `outbox.*` setting, `model/` what they
//! all agree on (the partition ring, lanes, W3C trace context), and `status.rs` the functions
//! behind the views. The Redis side is the `outbox-redis` crate.
//!
//! Folders import only downward, in this order: `hooks/` and `status.rs`; `relay/` and `write/`,
//! side by side and not importing each other; `retention/`; `shmem/`; `gucs/`; `pg/`; `model/`.
//! `scripts/import-cycles.py` checks it.

use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{PgLogLevel, PgSqlErrorCode};

mod gucs;
mod hooks;
mod model;
mod pg;
mod relay;
mod retention;
mod shmem;
mod status;
mod write;

::pgrx::pg_module_magic!(name, version);

extension_sql_file!("../sql/outbox.sql", name = "outbox_objects", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    gucs::init();
    // SAFETY: plain reads of postmaster globals during library load.
    let (binary_upgrade, preloading) = unsafe {
        (
            pg_sys::IsBinaryUpgrade,
            pg_sys::process_shared_preload_libraries_in_progress,
        )
    };
    if binary_upgrade {
        // pg_upgrade starts servers with our library preloaded; relaying there would be wrong.
        return;
    }
    // Wherever outbox_enqueue can run, preloaded or not.
    hooks::executor::init();
    if !preloading {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
            "outbox is not in shared_preload_libraries: events are enqueued but no relay is running",
            function_name!(),
        )
        .set_hint("Add 'outbox' to shared_preload_libraries in postgresql.conf and restart the server.")
        .report(PgLogLevel::LOG);
        return;
    }
    pg::compat::reserve_guc_prefix();
    shmem::init();
    hooks::utility::init();
    relay::register_workers();
}

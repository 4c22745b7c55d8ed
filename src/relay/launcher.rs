//! The launcher: one static background worker that keeps `outbox.workers` relay workers running
//! in every database `outbox.database` selects, as dynamic background workers.
//!
//! Once a second, and whenever a worker starts or stops (the postmaster then sets its latch), it
//! reads `pg_database`, gives each selected database its slots in shared memory, starts the
//! workers that are missing, and stops those of databases no longer selected. A worker that
//! exits is started again a second later, unless its database is paused (a `DROP DATABASE` or a
//! rename is waiting for it to leave) or, under `*`, the extension was not found there (looked
//! for again every few seconds). Workers never restart on their own: after a crash of the server
//! the launcher starts them all again, and there is never a second worker in a slot.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, DynamicBackgroundWorker,
    SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::gucs;
use crate::model::databases::Selection;
use crate::pg::worker;
use crate::shmem::{self, Shared};

/// How long after a worker stopped the launcher starts it again.
const RESTART_AFTER: Duration = Duration::from_secs(1);
/// How often the launcher looks at the databases when nothing wakes it.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Registers the launcher, which starts the relay workers; called from `_PG_init` while
/// preloading.
pub fn register_workers() {
    if gucs::workers() > 0 {
        register();
    }
}

/// Registers the launcher.
fn register() {
    BackgroundWorkerBuilder::new("outbox launcher")
        .set_type("outbox launcher")
        .set_library("outbox")
        .set_function("outbox_launcher_main")
        .enable_spi_access()
        // Its workers wait on a hot standby for the promotion, as they did when static.
        .set_start_time(BgWorkerStartTime::ConsistentState)
        .set_restart_time(Some(RESTART_AFTER))
        .load();
}

/// A database as `pg_database` describes it.
struct Database {
    oid: u32,
    /// As `pg_database` holds it (see `model/databases.rs`).
    name: Vec<u8>,
    template: bool,
    /// Allows connections and is not half-dropped.
    connectable: bool,
}

/// What the launcher knows of a slot's worker.
struct Started {
    handle: DynamicBackgroundWorker,
    database: u32,
}

/// Entry point of the launcher.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: pg_database is a shared catalog, readable from here.
    BackgroundWorker::connect_worker_to_spi(None, None);
    let Some(shared) = shmem::shared() else {
        error!("outbox launcher: shared memory is missing; is outbox in shared_preload_libraries?");
    };
    Launcher {
        shared,
        started: HashMap::new(),
        stopped_at: HashMap::new(),
        last_selection: None,
    }
    .run();
}

struct Launcher {
    shared: &'static Shared,
    /// Workers this launcher registered, by slot.
    started: HashMap<usize, Started>,
    /// When a slot's worker was last seen gone, for the restart delay.
    stopped_at: HashMap<usize, Instant>,
    /// What the log last said was relayed, so that it speaks only of changes.
    last_selection: Option<String>,
}

impl Launcher {
    fn run(&mut self) -> ! {
        loop {
            if worker::shutdown_requested() {
                // 1, not 0: the postmaster forgets a static worker that exits with 0, and a
                // pg_terminate_backend of the launcher would end relaying until a restart.
                crate::pg::compat::proc_exit(1);
            }
            worker::reload_configuration();
            self.look();
            worker::wait_latch(LOOK_EVERY);
        }
    }

    /// One look: which databases, which slots, which workers to start and stop.
    fn look(&mut self) {
        let selection = match Selection::parse(&gucs::database()) {
            Ok(selection) => selection,
            Err(_) => return, // the check hook refused it; the previous value is in force
        };
        let databases = list_databases();
        let wanted: Vec<&Database> = databases
            .iter()
            .filter(|d| d.connectable && selection.selects(&d.name, d.template))
            .collect();
        self.log_selection(&selection, &databases, &wanted);
        let wanted_oids: Vec<u32> = wanted.iter().map(|d| d.oid).collect();
        let slots = self.shared.all_slots();

        let now = worker::now();
        let absent = |oid: u32| self.shared.database(oid).is_some_and(|d| d.is_absent(now));
        // Slots of databases no longer selected (or dropped) are freed, their workers stopped;
        // so are those of databases found without the extension, until they are looked at again.
        for (index, slot) in slots.iter().enumerate() {
            let database = slot.database();
            if database == 0 {
                continue;
            }
            if !wanted_oids.contains(&database) {
                slot.assign(0);
                self.stop(index, slot.pid());
            } else if absent(database) && slot.pid() == 0 {
                slot.assign(0);
                self.started.remove(&index);
            }
        }
        // Each selected database gets its slots, in the order the databases are listed.
        let per_database = gucs::workers();
        for database in wanted.iter().filter(|d| !absent(d.oid)) {
            let mut assigned = slots
                .iter()
                .filter(|s| s.database() == database.oid)
                .count();
            for slot in slots.iter() {
                if assigned >= per_database {
                    break;
                }
                if slot.database() == 0 && slot.pid() == 0 {
                    slot.assign(database.oid);
                    assigned += 1;
                }
            }
            if assigned < per_database {
                warning!(
                    "outbox launcher: no free worker slot for database {} ({} slots in all)",
                    String::from_utf8_lossy(&database.name),
                    slots.len()
                );
            }
        }
        // Workers missing from their slots are started.
        for (index, slot) in slots.iter().enumerate() {
            let database = slot.database();
            if database == 0 || slot.pid() != 0 || self.is_starting(index, database) {
                continue;
            }
            if self
                .stopped_at
                .get(&index)
                .is_some_and(|at| at.elapsed() < RESTART_AFTER)
            {
                continue;
            }
            let held = self
                .shared
                .database(database)
                .is_some_and(|d| d.is_paused(now) || d.is_absent(now));
            if !held {
                self.start(index, database);
            }
        }
        self.shared.release_databases(&wanted_oids);
    }

    /// Whether the worker registered for slot `index` is still on its way up.
    fn is_starting(&mut self, index: usize, database: u32) -> bool {
        let Some(started) = self.started.get(&index) else {
            return false;
        };
        if started.database == database {
            use pgrx::bgworkers::BackgroundWorkerStatus::*;
            match started.handle.pid() {
                Ok(_) | Err(NotYetStarted) => return true,
                Err(_) => {}
            }
        }
        self.started.remove(&index);
        self.stopped_at.insert(index, Instant::now());
        false
    }

    fn start(&mut self, index: usize, database: u32) {
        // SAFETY: reads this process's pid.
        let me = unsafe { pg_sys::MyProcPid };
        let registered = BackgroundWorkerBuilder::new(&format!("outbox relay {index}"))
            .set_type("outbox relay")
            .set_library("outbox")
            .set_function("outbox_relay_main")
            .set_argument((index as i32).into_datum())
            .set_extra(&database.to_string())
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::ConsistentState)
            .set_restart_time(None)
            .set_notify_pid(me)
            .load_dynamic();
        match registered {
            Ok(handle) => {
                self.started.insert(index, Started { handle, database });
                self.stopped_at.remove(&index);
            }
            Err(_) => {
                // max_worker_processes is used up: try again after the restart delay.
                self.stopped_at.insert(index, Instant::now());
                warning!(
                    "outbox launcher: could not start relay worker {index}: max_worker_processes \
                     is used up (the relay needs one launcher and outbox.workers per database)"
                );
            }
        }
    }

    /// Asks the worker with `pid` to stop (it exits at its next check).
    fn stop(&mut self, index: usize, pid: i32) {
        self.started.remove(&index);
        if pid != 0 {
            // SAFETY: a signal to a worker of this server, found in its slot.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }

    fn log_selection(&mut self, selection: &Selection, all: &[Database], wanted: &[&Database]) {
        let mut text = wanted
            .iter()
            .map(|d| String::from_utf8_lossy(&d.name))
            .collect::<Vec<_>>()
            .join(", ");
        if let Selection::Named(names) = selection {
            let missing: Vec<_> = names
                .iter()
                .filter(|n| !all.iter().any(|d| &d.name == *n && d.connectable))
                .map(|n| String::from_utf8_lossy(n))
                .collect();
            if !missing.is_empty() {
                text.push_str(&format!(
                    "; not found or not accepting connections: {}",
                    missing.join(", ")
                ));
            }
        }
        if self.last_selection.as_deref() != Some(text.as_str()) {
            log!("outbox launcher: relaying in databases: {text}");
            self.last_selection = Some(text);
        }
    }
}

/// Every database in `pg_database`.
fn list_databases() -> Vec<Database> {
    let mut databases = Vec::new();
    // SAFETY: the scan autovacuum makes of pg_database, a shared catalog, in a transaction of
    // its own; each tuple is read while the scan holds it.
    unsafe {
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        let relation = pg_sys::table_open(
            pg_sys::DatabaseRelationId,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
        );
        let scan = pg_sys::table_beginscan_catalog(relation, 0, std::ptr::null_mut());
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            let header = (*tuple).t_data;
            let form = header
                .cast::<u8>()
                .add((*header).t_hoff as usize)
                .cast::<pg_sys::FormData_pg_database>();
            let name = std::ffi::CStr::from_ptr((*form).datname.data.as_ptr())
                .to_bytes()
                .to_vec();
            databases.push(Database {
                oid: (*form).oid.to_u32(),
                name,
                template: (*form).datistemplate,
                // -2 marks a database whose DROP was interrupted.
                connectable: (*form).datallowconn && (*form).datconnlimit != -2,
            });
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(relation, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        pg_sys::PopActiveSnapshot();
        pg_sys::CommitTransactionCommand();
    }
    databases
}

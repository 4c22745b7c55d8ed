//! A relay worker's start: the entry point the launcher names, which attaches the process to
//! its slot and its database's share, pins its session settings and connects to the database;
//! then the relay it runs.

use std::time::Instant;

use outbox_redis::publish::Publisher;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::backoff::{Backoff, Pacing};
use super::claim::retry::RetrySchedule;
use super::claim::Claims;
use super::due_moves::DelayedMoves;
use super::extension::Extension;
use super::flush::WalFlush;
use super::session;
use super::settings::Settings;
use super::state::Status;
use super::Relay;
use crate::gucs;
use crate::model::databases::Selection;
use crate::pg::worker::{self, in_transaction, End};
use crate::shmem::{self, Counts, DatabaseShare, EnqueueActivity, Shared, WorkerSlot};

/// Entry point of a relay worker, started by the launcher for slot `arg` in the database whose
/// OID is the worker's extra.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_relay_main(arg: pg_sys::Datum) {
    // SAFETY: the launcher passes the slot as an Int32 datum.
    let index = unsafe { i32::from_polymorphic_datum(arg, false, pg_sys::INT4OID) }
        .unwrap_or(0)
        .clamp(0, gucs::MAX_WORKERS - 1) as usize;
    let database: u32 = BackgroundWorker::get_extra().parse().unwrap_or(0);
    let Some((shared, slot)) = attach(index, database) else {
        // The launcher gave the slot to another database, or another process holds it.
        worker::exit();
    };
    let now = worker::now();
    let Some(share) = shared.database_or_take(database, now) else {
        log!("outbox relay {index}: every shared entry for databases is taken");
        worker::exit();
    };
    if share.is_paused(now) {
        worker::exit();
    }
    session::pin_settings(&format!("outbox relay {index}"));
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(database)), None);
    relay(index, share, slot, shared.activity(database)).run();
}

/// The relay of worker `index` in the database the process is connected to: its settings read,
/// its start logged (unless it is still looking for the extension under '*'), its Redis thread
/// started.
fn relay(
    index: usize,
    share: &'static DatabaseShare,
    slot: &'static WorkerSlot,
    activity: &'static EnqueueActivity,
) -> Relay {
    // SAFETY: plain reads of process globals, after the database connection is made.
    let namespace = unsafe {
        format!(
            "{}.{}",
            pg_sys::GetSystemIdentifier(),
            pg_sys::MyDatabaseId.to_u32()
        )
    };
    let database = in_transaction(|| {
        // SAFETY: a catalog lookup of this process's own database, in a transaction.
        let name = unsafe {
            let raw = pg_sys::get_database_name(pg_sys::MyDatabaseId);
            if raw.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(raw).to_string_lossy().into_owned()
            }
        };
        (name, End::Commit)
    });
    let settings = Settings::read(&namespace, &database);
    session::commit_without_waiting(settings.target.dedupe.is_on());
    // Under '*', a worker that finds no extension leaves at once, and another looks again a
    // few seconds later: it speaks only once it has found the extension.
    let probing =
        !Selection::parse(&gucs::database()).is_ok_and(|selection| selection.waits_for_extension());
    if !probing {
        log!(
            "outbox relay {index} started: {}",
            settings.describe(&database)
        );
    }
    Relay {
        everywhere: probing,
        index,
        share,
        slot,
        publisher: Publisher::spawn(settings.target.clone())
            .unwrap_or_else(|e| error!("outbox relay {index}: cannot start its Redis thread: {e}")),
        settings,
        extension: Extension::default(),
        status: Status::new(index, database, probing, slot),
        pacing: Pacing::new(Instant::now()),
        claims: Claims::new(worker::two_phase_commit_enabled()),
        activity,
        backoff: Backoff::default(),
        retries: RetrySchedule::default(),
        delayed: DelayedMoves::default(),
        flush: WalFlush::default(),
        uncommitted: Counts::default(),
    }
}

/// Sets up the signal handlers and attaches the process to slot `index` for database
/// `database`; the slot is cleared again however the process ends. `None` if the slot is
/// assigned elsewhere or another process holds it.
pub fn attach(index: usize, database: u32) -> Option<(&'static Shared, &'static WorkerSlot)> {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(shared) = shmem::shared() else {
        error!("outbox relay: shared memory is missing; is outbox in shared_preload_libraries?");
    };
    let slot = shared.slot(index);
    if slot.database() != database {
        return None;
    }
    // SAFETY: MyProcPid and MyLatch are this process's own, valid for its life; the exit
    // callback clears the slot however the process ends.
    unsafe {
        if !slot.attach(pg_sys::MyProcPid, pg_sys::MyLatch, database) {
            return None;
        }
        pg_sys::before_shmem_exit(Some(detach), pg_sys::Datum::from(index));
    }
    Some((shared, slot))
}

#[pg_guard]
unsafe extern "C-unwind" fn detach(_code: i32, arg: pg_sys::Datum) {
    if let Some(shared) = shmem::shared() {
        // SAFETY: reads this process's pid.
        let me = unsafe { pg_sys::MyProcPid };
        shared
            .slot(arg.value().min(gucs::MAX_WORKERS as usize - 1))
            .detach(me);
    }
}

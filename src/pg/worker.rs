//! A background worker process's plumbing: signals, the latch, the clock, WAL positions, and the
//! transaction bracket that every statement of the relay and of retention runs in.

use std::ffi::c_long;
use std::time::{Duration, Instant};

use pgrx::pg_sys;

pub fn shutdown_requested() -> bool {
    // SAFETY: a sig_atomic_t flag set by the SIGTERM handler.
    unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) != 0 }
}

/// Rereads the configuration file if SIGHUP asked for it; says whether it did.
pub fn reload_configuration() -> bool {
    // SAFETY: ConfigReloadPending is set by the SIGHUP handler; ProcessConfigFile is what a
    // background worker must call itself.
    unsafe {
        if std::ptr::read_volatile(&raw const pg_sys::ConfigReloadPending) == 0 {
            return false;
        }
        pg_sys::ConfigReloadPending = 0;
        pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
    }
    true
}

/// Waits on the latch for at most `timeout`; exits the process if the postmaster died. Says
/// whether the latch was set (else the time ran out).
///
/// The latch is reset only when the wait saw it set, and the caller then looks for work. A wait
/// that ran out leaves it alone: a commit that sets it between the timeout and a reset would
/// otherwise be forgotten, and its event would wait for the next commit or the poll (the
/// relay's short wait after each of its commits, followed by a long one, lost such commits).
pub fn wait_latch(timeout: Duration) -> bool {
    // SAFETY: the standard latch wait of a background worker, on its own latch.
    unsafe {
        let events = pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout.as_millis().min(c_long::MAX as u128) as c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        let set = events & pg_sys::WL_LATCH_SET as i32 != 0;
        if set {
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        absorb_barriers();
        set
    }
}

/// Absorbs a ProcSignalBarrier that PostgreSQL has raised, as `CHECK_FOR_INTERRUPTS` in a query
/// would: the process that raised it waits until every process has (PostgreSQL 19's promotion
/// of a standby, `DROP DATABASE`'s release of files), and a worker that only waits on its latch
/// (on a standby, say) runs no query. The signal sets the latch, so a wait ends to come here.
fn absorb_barriers() {
    // SAFETY: the flag is set by the SIGUSR1 handler; absorbing is what ProcessInterrupts does
    // with it, on this process's main thread.
    unsafe {
        if std::ptr::read_volatile(&raw const pg_sys::ProcSignalBarrierPending) != 0 {
            pg_sys::ProcessProcSignalBarrier();
        }
    }
}

/// Sleeps until `delay` has passed, waking only for SIGTERM and SIGHUP; a wake-up after which
/// `reloaded` says true ends the sleep early.
pub fn sleep(delay: Duration, mut reloaded: impl FnMut() -> bool) {
    let deadline = Instant::now() + delay;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || shutdown_requested() {
            return;
        }
        wait_latch(left);
        if reloaded() {
            return;
        }
    }
}

/// Whether transactions can be prepared (`max_prepared_transactions` > 0): a `COMMIT PREPARED`
/// makes events visible without the commit callbacks of the session that wrote them.
pub fn two_phase_commit_enabled() -> bool {
    // SAFETY: reads a server setting by name; the string stays valid until settings change.
    let value =
        unsafe { pg_sys::GetConfigOption(c"max_prepared_transactions".as_ptr(), true, false) };
    if value.is_null() {
        return true;
    }
    // SAFETY: a NUL-terminated string PostgreSQL keeps.
    let value = unsafe { std::ffi::CStr::from_ptr(value) };
    value.to_str().ok().and_then(|v| v.parse::<i64>().ok()) != Some(0)
}

/// Exits the process if the postmaster has died, without waiting.
pub fn exit_if_postmaster_died() {
    // SAFETY: a zero-timeout wait whose only event is postmaster death; the latch is untouched.
    unsafe {
        pg_sys::WaitLatch(
            std::ptr::null_mut(),
            (pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            0,
            pg_sys::PG_WAIT_EXTENSION,
        );
    }
}

/// Exits with code 1: the postmaster restarts a worker stopped by pg_terminate_backend, and
/// ignores the code during a shutdown.
pub fn exit() -> ! {
    // The exit callbacks clear the slot and abort any transaction.
    super::compat::proc_exit(1)
}

/// Where the commit record of this process's last committed transaction ends in the WAL.
pub fn last_commit_end() -> u64 {
    // SAFETY: reads a process global that CommitTransactionCommand has just set.
    unsafe { pg_sys::XactLastCommitEnd }
}

/// How far the WAL is on disk.
pub fn wal_flushed_to() -> u64 {
    super::compat::wal_flushed_to()
}

/// How far the synchronous standbys have confirmed flushing the WAL, when
/// `synchronous_standby_names` asks for any: a commit past it is lost by a failover to one of
/// them. `None` without synchronous standbys.
pub fn sync_standbys_flushed_to() -> Option<u64> {
    // SAFETY: the GUC's string is PostgreSQL's, valid until the next reload (this process's
    // own, read on its main thread); `WalSndCtl` points into shared memory set up at start. The
    // position is a 64-bit word the walsenders advance under `SyncRepLock`: read whole on a
    // 64-bit server, at worst a moment old, which only keeps markers a little longer.
    unsafe {
        let names = pg_sys::SyncRepStandbyNames;
        if names.is_null() || *names == 0 || pg_sys::WalSndCtl.is_null() {
            return None;
        }
        let lsn = &raw const (*pg_sys::WalSndCtl).lsn[pg_sys::SYNC_REP_WAIT_FLUSH as usize];
        Some(std::ptr::read_volatile(lsn))
    }
}

/// Writes and flushes the WAL up to `lsn`, as a synchronous commit would have.
pub fn flush_wal(lsn: u64) {
    // SAFETY: the flush any committing backend does, outside recovery (the relay never commits
    // during one).
    unsafe { pg_sys::XLogFlush(lsn) }
}

/// Whether the server is a hot standby (or still recovering).
pub fn in_recovery() -> bool {
    // SAFETY: reads shared recovery state.
    unsafe { pg_sys::RecoveryInProgress() }
}

/// The current time as a PostgreSQL `TimestampTz`.
pub fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Shows the worker as running a statement or idle in `pg_stat_activity`.
pub fn report_activity(running: bool) {
    let activity = if running {
        pg_sys::BackendState::STATE_RUNNING
    } else {
        pg_sys::BackendState::STATE_IDLE
    };
    // SAFETY: reports this backend's own activity.
    unsafe { pg_sys::pgstat_report_activity(activity, std::ptr::null()) };
}

/// How a transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    Commit,
    Rollback,
}

/// Runs `body` in a transaction of its own, ended as `body` says, then reports statistics so
/// autovacuum sees the relay's updates and deletes while the worker lives.
pub fn in_transaction<R>(body: impl FnOnce() -> (R, End)) -> R {
    // SAFETY: the standard transaction bracket of a background worker, outside any transaction.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let (result, end) = body();
    // SAFETY: closes the bracket opened above.
    unsafe {
        pg_sys::PopActiveSnapshot();
        if end == End::Commit {
            pg_sys::CommitTransactionCommand();
        } else {
            pg_sys::AbortCurrentTransaction();
        }
        pg_sys::pgstat_report_stat(false);
    }
    result
}

//! The relay: `outbox.workers` background workers, each looping claim → publish → mark in one
//! transaction, woken at commit and polling as a safety net.
//!
//! The mark is written while Redis works on the batch, but the transaction commits only once
//! Redis has answered, and rolls back if it could not be reached. A crash before the commit
//! publishes the batch again instead of losing it (`outbox.dedupe` absorbs the repeat).
//! Failures are logged when the worker's situation changes, never once per retry. Here the
//! loop; `start.rs` the start, `pass/` one pass's transaction, `claim/` how it claims,
//! `due_moves.rs` due delayed events, `flush.rs` WAL flushes, `state.rs` the state and its log
//! lines; the SQL in `sql.rs`, prepared in `statements.rs`. The process's plumbing is
//! `pg/worker.rs`; the Redis thread is the outbox-redis crate.

pub mod backoff;
mod claim;
mod contention;
mod due_moves;
mod extension;
mod flush;
pub mod launcher;
mod order;
mod pass;
mod session;
mod settings;
mod sql;
mod start;
mod state;
mod statements;

use std::time::{Duration, Instant};

use outbox_redis::publish::Publisher;

use crate::pg::worker::{self, in_transaction, End};
use crate::retention::{prune, truncate};
use crate::shmem::{Counts, DatabaseShare, EnqueueActivity, WorkerSlot, WorkerState};
use backoff::{Backoff, Pacing};
use claim::retry::RetrySchedule;
use claim::Claims;
use due_moves::DelayedMoves;
use extension::Extension;
use flush::WalFlush;
use pass::{Pass, PassRun};
use settings::Settings;
use state::Status;

pub use launcher::register_workers;

/// How long a worker that found no extension under '*' keeps the launcher from looking again.
const LOOK_AGAIN_AFTER: Duration = Duration::from_secs(3);

/// One worker's relay: what it keeps from pass to pass, each concern in a struct of its own.
struct Relay {
    index: usize,
    /// `outbox.database = '*'`: without the extension, the worker leaves rather than waits.
    everywhere: bool,
    /// What the workers of this database share.
    share: &'static DatabaseShare,
    slot: &'static WorkerSlot,
    settings: Settings,
    publisher: Publisher,
    extension: Extension,
    /// Its state, and what it has logged of it.
    status: Status,
    pacing: Pacing,
    /// What its claims remember from pass to pass: the cursor, the lanes, failures.
    claims: Claims,
    /// The count of this database's enqueueing transactions.
    activity: &'static EnqueueActivity,
    backoff: Backoff,
    retries: RetrySchedule,
    /// When due delayed events were last moved into `outbox`.
    delayed: DelayedMoves,
    /// How far its commits are on disk, as told to the Redis thread.
    flush: WalFlush,
    /// Failed attempts and dead letters of the transaction under way, counted once it commits.
    uncommitted: Counts,
}

impl Relay {
    fn run(&mut self) -> ! {
        loop {
            if worker::shutdown_requested() {
                // Asked to stop by the launcher or a DROP DATABASE: say which, then go.
                self.leave_if_unwanted();
                self.exit();
            }
            self.reload_if_requested();
            self.leave_if_unwanted();
            let idmp = self.status.idmp();
            if self
                .flush
                .hold_for_window(idmp, &self.settings, &self.publisher)
            {
                continue;
            }
            let pass = self.pass();
            if let (Some(retention), Some(schema)) =
                (self.settings.retention, self.extension.schema())
            {
                truncate::truncate_if_due(self.share, retention, schema, self.index);
                prune::prune_if_due(self.share, retention, schema, self.index);
            }
            if matches!(pass, Pass::NoExtension) && self.extension.is_missing() && self.everywhere {
                self.status.extension_gone();
                // Under '*', a database without the extension keeps no worker: the launcher
                // looks again in a few seconds.
                self.share
                    .absent_until(worker::now() + LOOK_AGAIN_AFTER.as_micros() as i64);
                self.exit();
            }
            match pass {
                Pass::Full => {}
                Pass::Drained | Pass::NoExtension => self.wait_for_work(),
                // A change to the Redis settings ends the wait: a corrected URL or certificate is
                // tried at once, not at the end of a backoff that may have grown to seconds.
                Pass::RedisDown(delay) => worker::sleep(delay, || self.reload_if_requested()),
            }
        }
    }

    /// Waits for a commit to wake the relay, or for the next poll, due retry, look into every
    /// partition or partition to empty, then keeps the passes' spacing (see `backoff.rs`).
    fn wait_for_work(&mut self) {
        let mut wait = self
            .retries
            .wait(Instant::now(), self.settings.poll_interval);
        // Awake for the next look into every partition, and for events whose retry is due, once
        // per poll interval from the last, whatever passes commits woke meanwhile.
        wait = claim::cursor::until_next_look(
            wait,
            Instant::now(),
            self.settings.poll_interval,
            &[
                self.claims.start.looked_below_at(),
                self.claims.due_looked_at,
            ],
        );
        // Awake when a partition comes due, to empty it then.
        if let Some(retention) = self.settings.retention {
            if let Some(due_in) = truncate::wait_for_due(self.share, retention) {
                wait = wait.min(due_in);
            }
        }
        self.flush.wait_for_commits(wait, &self.publisher);
        let next = self.pacing.next_pass_at();
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
    }

    fn exit(&mut self) -> ! {
        self.status.exit(&self.settings, self.extension.schema())
    }

    fn set_state(&mut self, state: WorkerState) {
        self.status
            .set(state, &self.settings, self.extension.schema());
    }

    /// Leaves when the launcher gave the slot away (the database is no longer selected) or the
    /// database is paused for a `DROP DATABASE` or a rename.
    fn leave_if_unwanted(&mut self) {
        if self.status.unwanted(self.share) {
            self.exit();
        }
    }

    /// Reads the settings again after a SIGHUP; says whether the Redis target changed.
    fn reload_if_requested(&mut self) -> bool {
        let database = self.status.database();
        self.settings
            .reload_if_requested(self.index, database, &self.publisher)
    }

    /// One pass: a batch in a transaction of its own, then the bookkeeping once it has ended.
    fn pass(&mut self) -> Pass {
        if worker::in_recovery() {
            self.set_state(WorkerState::Standby);
            return Pass::NoExtension;
        }
        self.pacing.pass_started(Instant::now());
        let (pass, published, end) = in_transaction(|| {
            let batch = self.pass_run().relay_batch();
            if batch.end == End::Commit && batch.leaves != 0 {
                // Before the commit that releases the rows' locks: whoever empties a partition
                // takes its lock first, and then reads a time no earlier than its rows' marks.
                self.share.record_marked(batch.leaves, worker::now());
            }
            ((batch.pass, batch.published, batch.end), batch.end)
        });
        let committed_at = (end == End::Commit).then(worker::last_commit_end);
        let flush = &mut self.flush;
        flush.transaction_ended(committed_at, published, &self.publisher);
        if end != End::Commit {
            // Its events are unpublished again, below the cursor.
            self.claims.start.forget();
        }
        self.pacing.pass_ended(published);
        let counts = std::mem::take(&mut self.uncommitted);
        if end == End::Commit {
            self.share.count(Counts {
                published,
                ..counts
            });
        }
        if published > 0 {
            let at = worker::now();
            self.slot.record_batch(published, at);
            self.share.record_published(at);
        }
        self.status.found(self.publisher.found(), &self.settings);
        self.set_state(match pass {
            Pass::NoExtension => WorkerState::WaitingForExtension,
            Pass::RedisDown(_) => WorkerState::Backoff,
            Pass::Full => WorkerState::Publishing,
            Pass::Drained => WorkerState::Idle,
        });
        pass
    }

    /// What one pass borrows of the relay, for its transaction.
    fn pass_run(&mut self) -> PassRun<'_> {
        PassRun {
            index: self.index,
            settings: &self.settings,
            extension: &mut self.extension,
            publisher: &self.publisher,
            status: &mut self.status,
            slot: self.slot,
            activity: self.activity,
            claims: &mut self.claims,
            retries: &mut self.retries,
            backoff: &mut self.backoff,
            delayed: &mut self.delayed,
            uncommitted: &mut self.uncommitted,
        }
    }
}

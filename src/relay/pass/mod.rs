//! One pass's transaction: claim a batch, publish it chunk by chunk while marking it, charge
//! the events that failed, and say how the transaction must end (`batch.rs`).
//!
//! A large batch goes out in chunks: while Redis works on one chunk, the database marks it and
//! claims the next, so the two work side by side. The transaction commits once every chunk is
//! answered, and rolls back if Redis could not be used.
//!
//! A pass borrows what it needs of the relay ([`PassRun`]) for the one transaction: what it
//! learns of the cursor, the failures and the schedules stays with the relay for the next.
//! What it learns chunk after chunk is its [`Progress`] (`progress.rs`); its claims go through
//! a [`Claimer`] (`relay/claim/`), and the events Redis refused through [`Charges`]
//! (`failures.rs`).

mod batch;
mod failures;
mod progress;

pub use batch::{Batch, Pass};

use std::time::{Duration, Instant};

use outbox_redis::encode::Event;
use outbox_redis::error::Error;
use outbox_redis::outcome::Outcome;
use outbox_redis::publish::{Interrupted, Publisher, Reply};
use pgrx::prelude::*;

use super::backoff::{self, Backoff};
use super::claim::retry::RetrySchedule;
use super::claim::{not_cloudevents, Claimed, Claimer, Claims, Failure, Scope};
use super::due_moves::DelayedMoves;
use super::extension::Extension;
use super::flush;
use super::settings::Settings;
use super::state::Status;
use crate::pg::worker::{self, End};
use crate::shmem::{Counts, EnqueueActivity, WorkerSlot, WorkerState};
use batch::chunk_size;
use failures::Charges;
use progress::{Freed, Progress, Rewind, Sorted};

/// How often the main thread looks up from a Redis call to check for SIGTERM.
const SIGNAL_TICK: Duration = Duration::from_millis(50);

/// What one pass borrows of the relay: its settings and its link to Redis, and what it keeps
/// from pass to pass (see the relay's fields for what each means).
pub struct PassRun<'a> {
    pub index: usize,
    pub settings: &'a Settings,
    pub extension: &'a mut Extension,
    pub publisher: &'a Publisher,
    /// Set to publishing while Redis works on a chunk; the worker exits through it.
    pub status: &'a mut Status,
    pub slot: &'static WorkerSlot,
    pub activity: &'static EnqueueActivity,
    pub claims: &'a mut Claims,
    pub retries: &'a mut RetrySchedule,
    pub backoff: &'a mut Backoff,
    pub delayed: &'a mut DelayedMoves,
    /// Failed attempts and dead letters of this transaction, counted once it commits.
    pub uncommitted: &'a mut Counts,
}

impl PassRun<'_> {
    /// The most events this pass claims (see [`flush::batch_limit`]).
    fn batch_size(&self) -> usize {
        flush::batch_limit(self.settings.batch_size, self.status.may_use_idmp())
    }

    /// One batch inside the caller's transaction; says how to end it.
    pub fn relay_batch(&mut self) -> Batch {
        let batch_size = self.batch_size();
        let chunk = chunk_size(batch_size);
        let mut scope = match self.begin(batch_size) {
            Ok(scope) => scope,
            Err(batch) => return batch,
        };
        let mut progress = Progress::new();
        progress.unheld |= self.sweep(&scope, batch_size);
        let mut next = self.claim(chunk, &scope);
        while next.len() > 0 {
            let got = next.len();
            let (mut events, mut unreadable) = progress.took(next);
            if self.settings.target.format.cloudevents_source().is_some() {
                unreadable.extend(not_cloudevents(&mut events));
            }
            if !unreadable.is_empty() {
                progress.freed(self.charge(unreadable));
            }
            progress.order.admit(&mut events);
            let claim_next = |run: &mut Self, progress: &Progress| {
                run.claimer().map_or_else(Claimed::default, |mut claimer| {
                    let (claimed, full) = (progress.claimed, progress.full_of_bytes);
                    claimer.next((got, chunk), claimed, batch_size, full, &scope)
                })
            };
            if events.is_empty() {
                next = claim_next(self, &progress);
                continue;
            }
            if !self.send(events) {
                return Batch::nothing(Pass::NoExtension);
            }
            next = claim_next(self, &progress);
            let (sent, results) = match self.answer() {
                Ok(answer) => answer,
                Err(error) => return self.lost_redis(error),
            };
            let sorted = progress.sort(sent, results);
            self.settle(sorted, &mut progress, &mut scope);
        }
        let (batch, rewind) = progress.finish(batch_size);
        match rewind {
            Rewind::Forget => self.claims.start.forget(),
            // The claims passed by the later events of the keys of failed events while the
            // cursor moved on; now that those keys are free, the claims past the cursor start
            // below them again.
            Rewind::To(id) => self.claims.start.rewind(id),
            Rewind::Keep => {}
        }
        batch
    }

    /// Before the pass's claims: the extension and the lanes it may claim in, and the delayed
    /// events now due moved in. `Err` ends the pass at once with what it says.
    fn begin(&mut self, batch_size: usize) -> Result<Scope, Batch> {
        let Some(extension) = self.extension.find(self.index).map(|s| s.extension) else {
            return Err(Batch::nothing(Pass::NoExtension));
        };
        if self.claims.claiming_in != Some(extension) {
            // Another installation of the extension, another table: nothing known of it.
            self.claims.start.forget();
            self.claims.sweep.forget();
            self.claims.claiming_in = Some(extension);
        }
        let Some(mut claimer) = self.claimer() else {
            return Err(Batch::nothing(Pass::NoExtension));
        };
        let Some(scope) = claimer.scope() else {
            // A worker whose share this was is finishing its batch: wait for it.
            return Err(Batch::nothing(Pass::Drained));
        };
        let Some(statements) = self.extension.statements() else {
            return Err(Batch::nothing(Pass::NoExtension));
        };
        let now = Instant::now();
        if self.delayed.due(now, self.settings.poll_interval) {
            let moved =
                self.delayed
                    .move_due(now, statements, batch_size, &scope.lanes, self.index);
            if moved.any {
                // Their ids are older than the backlog's: claim from the lowest.
                self.claims.start.forget();
            }
            if moved.renumbered {
                // Committed before any of them is published: the new id is the event's identity
                // in Redis (its markers name it), and a pass that published it and then rolled
                // back would move it again under another id, which no marker would catch. The
                // next pass follows at once.
                return Err(Batch::nothing(Pass::Full));
            }
        }
        Ok(scope)
    }

    /// Where an event of the scope failed, looks for held events whose key has nothing before
    /// them, when the look is due, and releases them; says whether any was released.
    fn sweep(&mut self, scope: &Scope, batch_size: usize) -> bool {
        if !scope.failing {
            return false;
        }
        let now = Instant::now();
        let poll_interval = self.settings.poll_interval;
        let Some(after) = self.claims.sweep.due(&scope.lanes, now, poll_interval) else {
            return false;
        };
        let Some(statements) = self.extension.statements() else {
            return false;
        };
        let entries = statements.sweep(batch_size, &scope.lanes, after);
        let stuck = self.claims.sweep.looked(now, batch_size, &entries);
        self.release_behind(&stuck, &[])
    }

    /// Hands a chunk to the Redis thread, and marks its events published while Redis works
    /// (undone by the rollback if Redis fails). False, with nothing sent, when the extension's
    /// statements are gone: they are looked up before the chunk goes, since a return between the
    /// send and the wait for its reply would leave that reply to the next pass, which would mark
    /// its own events by it.
    fn send(&mut self, events: Vec<Event>) -> bool {
        let Some(statements) = self.extension.statements() else {
            return false;
        };
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        if !self.publisher.send(events) {
            self.exit();
        }
        statements.mark_published(ids);
        true
    }

    /// Waits for the Redis thread's answer to the chunk sent: the events with what became of
    /// each, or why Redis could not be used.
    fn answer(&mut self) -> Result<(Vec<Event>, Vec<Outcome>), Error> {
        self.set_state(WorkerState::Publishing);
        let reply = match self.publisher.wait(SIGNAL_TICK, || {
            worker::exit_if_postmaster_died();
            !worker::shutdown_requested()
        }) {
            Ok(reply) => reply,
            Err(Interrupted::Stopped) => self.exit(),
        };
        let (results, sent) = match reply {
            Reply::Answered(results, sent) => (results, sent),
            Reply::Unavailable(error) => return Err(error),
        };
        if self.backoff.reset() {
            log!(
                "outbox relay {}: Redis at {} is reachable again",
                self.index,
                self.settings.target.url
            );
            self.slot.set_error(None, worker::now());
        }
        Ok((sent, results))
    }

    /// Acts on a chunk's sorted answer: the events held back lose their mark, the failed ones
    /// are charged, and the keys of events that had failed and are now out are released.
    fn settle(&mut self, sorted: Sorted, progress: &mut Progress, scope: &mut Scope) {
        let Sorted {
            retried,
            failures,
            held_back,
        } = sorted;
        if !held_back.is_empty() {
            if let Some(statements) = self.extension.statements() {
                statements.unmark(held_back);
            }
        }
        if !failures.is_empty() {
            scope.failing = true;
            self.claims.failing.failed();
            // Unmarked, and scheduled for later: the claims left in this transaction hold
            // the later events of their keys.
            progress.freed(self.charge(failures));
        }
        if !retried.is_empty() {
            progress.unheld |= self.release_behind(&retried, &[]);
        }
    }

    /// The first claim of the pass (see [`Claimer::claim`]).
    fn claim(&mut self, limit: usize, scope: &Scope) -> Claimed {
        self.claimer()
            .map_or_else(Claimed::default, |mut claimer| claimer.claim(limit, scope))
    }

    /// What the pass's claims borrow, while the extension's statements are there.
    fn claimer(&mut self) -> Option<Claimer<'_>> {
        Some(Claimer {
            index: self.index,
            statements: self.extension.statements()?,
            claims: self.claims,
            activity: self.activity,
            poll_interval: self.settings.poll_interval,
        })
    }

    /// What charging failures borrows, while the extension's statements are there.
    fn charges(&mut self) -> Option<Charges<'_>> {
        Some(Charges {
            index: self.index,
            max_attempts: self.settings.max_attempts,
            statements: self.extension.statements()?,
            start: &mut self.claims.start,
            retries: self.retries,
            uncommitted: self.uncommitted,
            slot: self.slot,
        })
    }

    /// See [`Charges::charge`].
    fn charge(&mut self, failures: Vec<Failure>) -> Freed {
        self.charges()
            .map_or_else(Freed::default, |mut charges| charges.charge(failures))
    }

    /// See [`Charges::release_behind`].
    fn release_behind(&mut self, anchors: &[i64], buried: &[i64]) -> bool {
        self.charges()
            .is_some_and(|mut charges| charges.release_behind(anchors, buried))
    }

    /// Redis could not be used: the transaction rolls back, and the worker backs off.
    fn lost_redis(&mut self, error: Error) -> Batch {
        if !self.backoff.is_failing() {
            warning!(
                "outbox relay {}: lost Redis at {}: {error}; retrying with backoff up to {}s",
                self.index,
                self.settings.target.url,
                backoff::CAP.as_secs()
            );
        }
        self.slot.set_error(Some(error.text()), worker::now());
        Batch {
            end: End::Rollback,
            ..Batch::nothing(Pass::RedisDown(self.backoff.next_delay()))
        }
    }

    fn set_state(&mut self, state: WorkerState) {
        self.status
            .set(state, self.settings, self.extension.schema());
    }

    fn exit(&mut self) -> ! {
        self.status.exit(self.settings, self.extension.schema())
    }
}

//! One pass's transaction: claim a batch, publish it chunk by chunk while marking it, charge
//! the events that failed, and say how the transaction must end.
//!
//! A large batch goes out in chunks: while Redis works on one chunk, the database marks it and
//! claims the next, so the two work side by side. The transaction commits once every chunk is
//! answered, and rolls back if Redis could not be used.
//!
//! A pass borrows what it needs of the relay ([`PassRun`]) for the one transaction: what it
//! learns of the cursor, the failures and the schedules stays with the relay for the next.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_redis::encode::{self, Event, Ordering};
use outbox_redis::outcome::Outcome;
use outbox_redis::publish::{Interrupted, Publisher, Reply};
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::backoff::{self, Backoff};
use super::claim::{self, Claimed, Failure, Scope};
use super::claims::Claims;
use super::cursor::{self, Reach, Verdict};
use super::delayed::DelayedMoves;
use super::extension::Extension;
use super::flush;
use super::order::PassOrder;
use super::pass::{chunk_size, Batch, Pass};
use super::retry::{self, DueLook, RetrySchedule};
use super::settings::Settings;
use super::state::Status;
use super::worker::{self, End};
use crate::retention::ring;
use crate::shmem::{Counts, EnqueueActivity, WorkerSlot, WorkerState};
use crate::write::lane;

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
        let Some(extension) = self.extension.find(self.index).map(|s| s.extension) else {
            return Batch::nothing(Pass::NoExtension);
        };
        if self.claims.claiming_in != Some(extension) {
            // Another installation of the extension, another table: nothing known of it.
            self.claims.start.forget();
            self.claims.sweep.forget();
            self.claims.claiming_in = Some(extension);
        }
        let Some(mut scope) = self.scope() else {
            // A worker whose share this was is finishing its batch: wait for it.
            return Batch::nothing(Pass::Drained);
        };
        let Some(statements) = self.extension.statements() else {
            return Batch::nothing(Pass::NoExtension);
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
                return Batch::nothing(Pass::Full);
            }
        }
        // Whether held events were released in this pass.
        let mut unheld = false;
        if scope.failing {
            if let Some(after) =
                self.claims
                    .sweep
                    .due(&scope.lanes, now, self.settings.poll_interval)
            {
                let entries = statements.sweep(batch_size, &scope.lanes, after);
                let stuck = self.claims.sweep.looked(now, batch_size, &entries);
                unheld |= self.release_behind(&stuck, &[]);
            }
        }
        let mut next = self.claim(chunk, &scope);
        let mut batch = Batch::nothing(Pass::Drained);
        let mut claimed = 0;
        // Whether a claim that looked for due events first left some out or was filled by them.
        let mut more_due = false;
        let mut order = PassOrder::default();
        // The lowest id of the events that had failed and went out or to outbox_dead in this
        // pass: the later events of their keys, passed by until now, have higher ids.
        let mut released: Option<i64> = None;
        // Whether a claim read its fill of bytes and left rows unread: the pass claims no more,
        // since a later claim could take later events of their keys.
        let mut full_of_bytes = false;
        while next.len() > 0 {
            let got = next.len();
            claimed += got;
            more_due |= next.more_due;
            // Its blocked rows are held already (see `PassRun::claim`).
            let Claimed {
                mut events,
                unreadable,
                left,
                ..
            } = next;
            if !left.is_empty() {
                full_of_bytes = true;
                order.left_for_later();
            }
            if !unreadable.is_empty() {
                let freed = self.charge_failures(unreadable);
                released = lowest(released, freed.buried);
                unheld |= freed.released;
            }
            order.admit(&mut events);
            if events.is_empty() {
                next = self.claim_next(got, chunk, claimed, full_of_bytes, &scope);
                continue;
            }
            let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
            // Looked up before the chunk goes: between the send and the wait for its reply, a
            // return would leave that reply to the next pass, which would mark its own events
            // by it.
            let Some(statements) = self.extension.statements() else {
                return Batch::nothing(Pass::NoExtension);
            };
            if !self.publisher.send(events) {
                self.exit();
            }
            // Written while Redis works; undone by the rollback if Redis fails.
            statements.mark_published(ids);
            next = self.claim_next(got, chunk, claimed, full_of_bytes, &scope);
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
                Reply::Unavailable(error) => return self.lost_redis(error),
            };
            if self.backoff.reset() {
                log!(
                    "outbox relay {}: Redis at {} is reachable again",
                    self.index,
                    self.settings.target.url
                );
                self.slot.set_error(None, worker::now());
            }
            // Failed and held back ones included: a later time than their rows' marks only
            // delays emptying.
            batch.leaves |= sent
                .iter()
                .fold(0, |leaves, e| leaves | 1 << ring::leaf_of(e.id));
            // Each the first failed event of its key, whose held events it now releases.
            let retried: Vec<i64> = sent
                .iter()
                .zip(&results)
                .filter(|(e, outcome)| e.attempts > 0 && **outcome == Outcome::Added)
                .map(|(e, _)| e.id)
                .collect();
            let mut failures: Vec<Failure> = Vec::new();
            let mut held_back = Vec::new();
            for (event, outcome) in sent.into_iter().zip(results) {
                let error = match outcome {
                    Outcome::Added => {
                        batch.published += 1;
                        continue;
                    }
                    Outcome::HeldBack => {
                        // Behind an event of its key that failed: unmarked and uncharged, it
                        // waits for that one as the events `order` holds back do.
                        held_back.push(event.id);
                        continue;
                    }
                    Outcome::Failed(error) => error,
                };
                let Event {
                    id,
                    topic,
                    attempts,
                    key,
                    ..
                } = event;
                // The later events of its key wait: those claimed in this pass are held
                // back (unmarked, they are claimed again once this one is out), and the
                // claims after this one pass them by in SQL.
                order.hold(match key {
                    Some(key) => Ordering::Key(key),
                    None => Ordering::Topic(topic.clone()),
                });
                failures.push(Failure {
                    id,
                    topic,
                    attempts,
                    error,
                    permanent: false,
                });
            }
            // An event that had failed is out: its key's later events may go.
            released = lowest(released, retried.iter().min().copied());
            if !held_back.is_empty() {
                order.left_for_later();
                if let Some(statements) = self.extension.statements() {
                    statements.unmark(held_back);
                }
            }
            if !failures.is_empty() {
                scope.failing = true;
                self.claims.failing.failed();
                // Unmarked, and scheduled for later: the claims left in this transaction hold
                // the later events of their keys.
                let freed = self.charge_failures(failures);
                released = lowest(released, freed.buried);
                unheld |= freed.released;
            }
            if !retried.is_empty() {
                unheld |= self.release_behind(&retried, &[]);
            }
        }
        if order.deferred() {
            // Events held back stay unpublished below the cursor.
            self.claims.start.forget();
        } else if let Some(id) = released {
            // The claims passed by the later events of the keys of failed events while the
            // cursor moved on; now that those keys are free, the claims past the cursor start
            // below them again.
            self.claims.start.rewind(id);
        }
        if claimed == batch_size || full_of_bytes {
            batch.pass = Pass::Full;
        } else if order.deferred() && batch.published > 0 {
            // Events held back for going to another stream than their key's earlier ones: the
            // next pass sends them, at once rather than at the next wake-up.
            batch.pass = Pass::Full;
        } else if released.is_some() || unheld {
            // The claims held (or passed by) the later events of the keys of failed events;
            // with those out of the way, the next pass claims them, at once rather than at the
            // poll.
            batch.pass = Pass::Full;
        } else if more_due {
            // A claim left due events out, or they filled it: the next pass takes more of them.
            batch.pass = Pass::Full;
        }
        batch
    }

    /// The claim of the batch's next chunk, of the `claimed` so far: after a full chunk (`got`
    /// events of `chunk`), while the batch has room and no claim read its fill of bytes; else
    /// nothing, which ends the pass's claims.
    fn claim_next(
        &mut self,
        got: usize,
        chunk: usize,
        claimed: usize,
        full_of_bytes: bool,
        scope: &Scope,
    ) -> Claimed {
        let batch_size = self.batch_size();
        if got == chunk && claimed < batch_size && !full_of_bytes {
            self.claim(chunk.min(batch_size - claimed), scope)
        } else {
            Claimed::default()
        }
    }

    /// Claims up to `limit` events of `scope`, past the last claim's reach while no transaction
    /// enqueued since (see `cursor.rs`), else from the lowest id, and holds the rows it found
    /// behind an earlier event of their key that failed or is held (see `hold.rs`). Held at
    /// once, before any reply of this pass can release their key: a row held after its key's
    /// release would wait for the look that finds it alone.
    fn claim(&mut self, limit: usize, scope: &Scope) -> Claimed {
        let now = Instant::now();
        let claimed = self.claim_at(now, limit, scope);
        if claimed.looked_due {
            self.claims.due_looked_at = Some(now);
        }
        if !claimed.blocked.is_empty() {
            if let Some(statements) = self.extension.statements() {
                statements.hold(&claimed.blocked);
            }
        }
        claimed
    }

    /// [`PassRun::claim`], at `now`.
    fn claim_at(&mut self, now: Instant, limit: usize, scope: &Scope) -> Claimed {
        let Some(statements) = self.extension.statements() else {
            return Claimed::default();
        };
        // Before the claim: what commits after it wrote is looked for again.
        let commits = self.activity.commits_to();
        let quiet = self.activity.quiet();
        let above = self.claims.start.above(quiet, &scope.lanes);
        let below = self
            .claims
            .start
            .below_due(now, self.settings.poll_interval);
        // From the lowest id: in every partition once per poll interval, while an event failed
        // (the claim that passes by its key's later events reads them all), and where a
        // `COMMIT PREPARED` may make events visible that no commit counted.
        let reach = if below || scope.failing || self.claims.two_phase {
            Reach::Everywhere
        } else {
            self.claims.start.reach(&commits, &scope.lanes)
        };
        let due = DueLook::at(
            now,
            self.claims.due_looked_at,
            self.settings.poll_interval,
            scope.failing,
        );
        let claimed = statements.claim(limit, above, below, reach, due, scope);
        if !claimed.looked_fresh {
            // Due events filled it: it read nothing of the fresh events' partitions, and says
            // nothing of where their next claim starts.
            return claimed;
        }
        if let Reach::Leaf(leaf) = reach {
            // Its snapshot was taken after the counts were read: a commit counted since in
            // another partition may be visible to it, and hold an earlier event of a key whose
            // later one it took. Claimed again from every partition, this transaction's rows
            // with the rest.
            if cursor::moved_elsewhere(&commits, &self.activity.commits_to(), leaf) {
                self.claims.start.forget();
                return statements.claim(limit, None, false, Reach::Everywhere, due, scope);
            }
        }
        if (above.is_none() && reach == Reach::Everywhere) || (below && claimed.len() < limit) {
            self.claims.start.looked_below(now);
        }
        // A claim that passed by the events behind a failed key found too few only for now:
        // once that key's event is out, they are claimable where no commit has written since.
        if above.is_none() && claimed.len() < limit && !scope.failing {
            self.claims.start.exhausted(reach, &commits, &scope.lanes);
        }
        let verdict = self.claims.start.claimed(
            quiet,
            self.activity.started(),
            above,
            claimed.highest(),
            &scope.lanes,
        );
        match verdict {
            // The rows claimed past the cursor are this transaction's: claimed again with the
            // rest, not skipped.
            Verdict::Redo => statements.claim(limit, None, false, Reach::Everywhere, due, scope),
            Verdict::Keep => claimed,
        }
    }

    /// What this pass may claim: the lanes of the worker's share, once it holds their groups'
    /// locks (`None` while another worker still does), and whether an event in them has failed
    /// (looked up as [`retry::FailingLook`] says).
    fn scope(&mut self) -> Option<Scope> {
        let (ordinal, workers) = ordinal(self.index);
        let share = lane::share(ordinal, workers);
        if self.claims.lanes.as_ref() != Some(&share.lanes) {
            // Another worker may have had these lanes meanwhile, and left events anywhere.
            self.claims.start.forget();
            self.claims.lanes = Some(share.lanes.clone());
        }
        if !claim::hold_groups(share.groups.clone()) {
            return None;
        }
        let now = Instant::now();
        if self.claims.failing.stale(&share.lanes, now) {
            if let Some(statements) = self.extension.statements() {
                let failing = statements.any_failing(&share.lanes);
                self.claims.failing.looked(&share.lanes, now, failing);
            }
        }
        Some(Scope {
            lanes: share.lanes,
            failing: self.claims.failing.failing(),
        })
    }

    /// Redis could not be used: the transaction rolls back, and the worker backs off.
    fn lost_redis(&mut self, error: String) -> Batch {
        if !self.backoff.is_failing() {
            warning!(
                "outbox relay {}: lost Redis at {}: {error}; retrying with backoff up to {}s",
                self.index,
                self.settings.target.url,
                backoff::CAP.as_secs()
            );
        }
        self.slot.set_error(Some(&error), worker::now());
        Batch {
            end: End::Rollback,
            ..Batch::nothing(Pass::RedisDown(self.backoff.next_delay()))
        }
    }

    /// Releases the held events of the keys of the events `anchors`, each its key's first that
    /// failed and now out or about to be buried (`buried`), or a held event with nothing before
    /// it in its key; says whether any was released. The released events are below the cursor,
    /// and a claim past it could take a later event of their key before them: the claims left
    /// in this pass start from the lowest id.
    fn release_behind(&mut self, anchors: &[i64], buried: &[i64]) -> bool {
        let Some(statements) = self.extension.statements() else {
            return false;
        };
        let mut any = false;
        for &anchor in anchors {
            any |= !statements.release(anchor, buried).is_empty();
        }
        if any {
            self.claims.start.forget();
        }
        any
    }

    /// Takes the mark back from each event that failed, charges it an attempt and schedules its
    /// retry; buries those out of attempts, and those that retrying cannot help, releasing the
    /// events held behind them. Returns the lowest id buried among events that had failed
    /// before this pass (claims may have passed by the later events of their keys; an event
    /// failing for the first time held none back), and whether held events were released.
    fn charge_failures(&mut self, failures: Vec<Failure>) -> Freed {
        let Some(statements) = self.extension.statements() else {
            return Freed::default();
        };
        let charges: Vec<(i64, String, Duration)> = failures
            .iter()
            .map(|f| {
                let delay = retry::delay(f.attempts.saturating_add(1));
                (f.id, f.error.clone(), delay)
            })
            .collect();
        let attempts: HashMap<i64, i32> = statements
            .record_failures(&charges)
            .into_iter()
            .map(|c| (c.id, c.attempts))
            .collect();
        let (index, max_attempts) = (self.index, self.settings.max_attempts);
        let mut exhausted = Vec::new();
        let mut released = None;
        let mut last_error = None;
        // The events whose attempt was recorded (one gone from the table meanwhile was not).
        let failures_charged = attempts.len() as u64;
        for failure in failures {
            let Some(&attempts) = attempts.get(&failure.id) else {
                continue;
            };
            let (id, topic) = (failure.id, encode::ascii_safe(&failure.topic));
            let error = encode::ascii_safe(&failure.error);
            if failure.permanent || attempts >= max_attempts {
                warning!(
                    "outbox relay {index}: event {id} (topic {topic}) moved to outbox_dead after \
                     {attempts} failed attempts: {error}"
                );
                exhausted.push(id);
                if failure.attempts > 0 {
                    released = lowest(released, Some(id));
                }
            } else {
                if attempts == 1 {
                    warning!(
                        "outbox relay {index}: Redis rejected event {id} (topic {topic}): \
                         {error}; it will be retried up to outbox.max_attempts ({max_attempts}) \
                         times"
                    );
                }
                self.retries
                    .scheduled(Instant::now() + retry::delay(attempts));
            }
            last_error = Some(error);
        }
        self.uncommitted.failed += failures_charged;
        self.uncommitted.dead_lettered += exhausted.len() as u64;
        let mut unheld = false;
        if !exhausted.is_empty() {
            // While their rows are there to name their keys, and left out of what holds the
            // others back.
            unheld = self.release_behind(&exhausted, &exhausted);
            if let Some(statements) = self.extension.statements() {
                statements.bury(exhausted);
            }
        }
        self.slot.set_error(last_error.as_deref(), worker::now());
        Freed {
            buried: released,
            released: unheld,
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

/// This worker's place among its database's workers, and how many they are: what its share
/// of the lanes follows from.
fn ordinal(index: usize) -> (usize, usize) {
    // SAFETY: reads this process's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    match crate::shmem::shared() {
        Some(shared) => shared.ordinal_of(index, database),
        None => (0, 1),
    }
}

/// What charging failures freed.
#[derive(Default)]
struct Freed {
    /// The lowest id buried among events that had failed before this pass.
    buried: Option<i64>,
    /// Whether events held behind the buried ones were released.
    released: bool,
}

/// The lower of two ids, either of which may be missing.
fn lowest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    a.into_iter().chain(b).min()
}

//! The relay: `outbox.workers` background workers, each looping claim → publish → mark in one
//! transaction, woken at commit and polling as a safety net.
//!
//! The mark is written while Redis works on the batch, but the transaction commits only once
//! Redis has answered, and rolls back if it could not be reached: a mark never outlives a
//! failed publish. A crash before the commit publishes the batch again instead of losing it
//! (and with `outbox.dedupe` the markers in Redis absorb the repeat). Failures are
//! logged when the worker's situation changes (Redis lost, Redis back, an event rejected,
//! an event buried), never once per retry.

pub mod backoff;
mod claim;
pub mod encode;
mod prune;
pub mod publish;
mod session;

use std::collections::HashMap;
use std::ffi::c_long;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::shmem::{self, Shared, WorkerSlot, WorkerState};
use crate::{gucs, redis_url};
use backoff::Backoff;
use claim::{Failure, Statements};
use publish::{Interrupted, Markers, Publisher, Reply, Request, Target};

/// How often the main thread looks up from a Redis call to check for SIGTERM.
const SIGNAL_TICK: Duration = Duration::from_millis(50);
/// Least time between two pruning rounds, across all workers.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
/// How long the worker trusts its last look-up of the extension while it is relaying.
const EXTENSION_RECHECK: Duration = Duration::from_secs(1);
/// Restart delay after a worker exits with an error (or is terminated).
const RESTART_AFTER: Duration = Duration::from_secs(1);

/// Events per chunk of a batch: a batch goes out in up to four chunks of at least 50 events, so
/// that the database's work on one chunk overlaps Redis's work on another; a small batch goes
/// out whole.
fn chunk_size(batch_size: usize) -> usize {
    batch_size.div_ceil(4).max(50).min(batch_size.max(1))
}

/// Registers the relay workers; called from `_PG_init` while preloading.
pub fn register_workers() {
    for slot in 0..gucs::workers() {
        BackgroundWorkerBuilder::new(&format!("outbox relay {slot}"))
            .set_type("outbox relay")
            .set_library("outbox")
            .set_function("outbox_relay_main")
            .set_argument((slot as i32).into_datum())
            .enable_spi_access()
            // Starting at consistent state lets a hot standby's worker wait for promotion.
            .set_start_time(BgWorkerStartTime::ConsistentState)
            .set_restart_time(Some(RESTART_AFTER))
            .load();
    }
}

/// Entry point of a relay worker.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_relay_main(arg: pg_sys::Datum) {
    // SAFETY: the postmaster passes the Int32 datum set by register_workers.
    let index = unsafe { i32::from_polymorphic_datum(arg, false, pg_sys::INT4OID) }
        .unwrap_or(0)
        .clamp(0, gucs::MAX_WORKERS - 1) as usize;
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(shared) = shmem::shared() else {
        error!("outbox relay: shared memory is missing; is outbox in shared_preload_libraries?");
    };
    let slot = &shared.slots[index];
    // SAFETY: MyProcPid and MyLatch are this process's own, valid for its life; the exit
    // callback clears the slot however the process ends.
    unsafe {
        slot.attach(pg_sys::MyProcPid, pg_sys::MyLatch);
        pg_sys::before_shmem_exit(Some(detach_slot), pg_sys::Datum::from(index));
    }
    session::pin_settings(&format!("outbox relay {index}"));

    BackgroundWorker::connect_worker_to_spi(Some(&gucs::database()), None);

    let mut relay = Relay::new(index, shared);
    relay.log_config("started");
    relay.run();
}

#[pg_guard]
unsafe extern "C-unwind" fn detach_slot(_code: i32, arg: pg_sys::Datum) {
    if let Some(shared) = shmem::shared() {
        shared.slots[arg.value().min(gucs::MAX_WORKERS as usize - 1)].detach();
    }
}

fn shutdown_requested() -> bool {
    // SAFETY: a sig_atomic_t flag set by the SIGTERM handler.
    unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) != 0 }
}

/// Waits on the latch for at most `timeout`; exits the process if the postmaster died.
fn wait_latch(timeout: Duration) {
    // SAFETY: the standard latch wait of a background worker, on its own latch.
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout.as_millis().min(c_long::MAX as u128) as c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
}

/// Exits the process if the postmaster has died, without waiting.
fn exit_if_postmaster_died() {
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

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// How a transaction ends.
#[derive(PartialEq, Eq)]
enum End {
    Commit,
    Rollback,
}

/// Runs `body` in a transaction of its own, ended as `body` says, then reports statistics so
/// autovacuum sees the relay's updates and deletes while the worker lives.
fn in_transaction<R>(body: impl FnOnce() -> (R, End)) -> R {
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

/// What one pass of the loop found.
enum Pass {
    /// A full batch went out: claim again at once.
    Full,
    /// Less than a full batch: wait for a wake-up or the poll.
    Drained,
    /// Redis is unreachable: wait this long, whatever wakes the latch.
    RedisDown(Duration),
    /// The extension does not exist (yet) in `outbox.database`.
    NoExtension,
}

/// What one transaction did, for the bookkeeping done after it commits.
struct Batch {
    pass: Pass,
    published: u64,
    markers: Vec<Markers>,
    end: End,
}

struct Relay {
    index: usize,
    shared: &'static Shared,
    slot: &'static WorkerSlot,
    publisher: Publisher,
    target: Target,
    batch_size: usize,
    poll_interval: Duration,
    max_attempts: i32,
    retention: Option<Duration>,
    statements: Option<Statements>,
    /// When the extension was last looked up in the catalog.
    extension_checked_at: Instant,
    /// The extension's version, when it is not the one this library relays (logged once).
    outdated_version: Option<String>,
    schema: String,
    state: WorkerState,
    /// When the last pass began, and how many events it published.
    last_pass_started: Instant,
    /// Time from the start of the pass before the last one to the start of the last one.
    last_pass_interval: Duration,
    last_pass_published: u64,
    backoff: Backoff,
    /// When a retry this worker scheduled falls due: it then polls early. The schedule itself
    /// is in the table (`next_attempt_at`), shared by all workers and kept across restarts.
    next_retry: Option<Instant>,
    /// Markers of committed batches, removed on the next round trip to Redis.
    committed_markers: Vec<Markers>,
}

impl Relay {
    fn new(index: usize, shared: &'static Shared) -> Relay {
        // SAFETY: plain reads of process globals, after the database connection is made.
        let marker_namespace = unsafe {
            format!(
                "{}.{}",
                pg_sys::GetSystemIdentifier(),
                pg_sys::MyDatabaseId.to_u32()
            )
        };
        let mut relay = Relay {
            index,
            shared,
            slot: &shared.slots[index],
            publisher: Publisher::spawn(),
            target: Target {
                url: String::new(),
                timeout: Duration::ZERO,
                stream_prefix: String::new(),
                stream_maxlen: 0,
                dedupe: true,
                dedupe_ttl: Duration::ZERO,
                marker_namespace,
            },
            batch_size: 1,
            poll_interval: Duration::from_secs(1),
            max_attempts: 1,
            retention: None,
            statements: None,
            extension_checked_at: Instant::now(),
            outdated_version: None,
            schema: String::new(),
            state: WorkerState::Starting,
            last_pass_started: Instant::now(),
            last_pass_interval: Duration::ZERO,
            last_pass_published: 0,
            backoff: Backoff::default(),
            next_retry: None,
            committed_markers: Vec::new(),
        };
        relay.read_settings();
        relay
    }

    fn read_settings(&mut self) {
        self.target.url = gucs::redis_url();
        self.target.timeout = gucs::redis_timeout();
        self.target.stream_prefix = gucs::stream_prefix();
        self.target.stream_maxlen = gucs::stream_maxlen();
        self.target.dedupe = gucs::dedupe();
        self.target.dedupe_ttl = gucs::dedupe_ttl();
        self.batch_size = gucs::batch_size();
        self.poll_interval = gucs::poll_interval();
        self.max_attempts = gucs::max_attempts();
        self.retention = gucs::retention();
    }

    fn log_config(&self, event: &str) {
        let retention = self
            .retention
            .map_or("off".to_string(), |r| format!("{}s", r.as_secs()));
        log!(
            "outbox relay {} {event}: database={} redis_url={} batch_size={} poll_interval={}ms \
             redis_timeout={}ms stream_prefix='{}' stream_maxlen={} max_attempts={} retention={} \
             dedupe={} dedupe_ttl={}s",
            self.index,
            gucs::database(),
            redis_url::mask(&self.target.url),
            self.batch_size,
            self.poll_interval.as_millis(),
            self.target.timeout.as_millis(),
            self.target.stream_prefix,
            self.target.stream_maxlen,
            self.max_attempts,
            retention,
            if self.target.dedupe { "on" } else { "off" },
            self.target.dedupe_ttl.as_secs(),
        );
    }

    fn set_state(&mut self, state: WorkerState) {
        if self.state == state {
            return;
        }
        match state {
            WorkerState::WaitingForExtension => log!(
                "outbox relay {}: waiting for CREATE EXTENSION outbox in database {}",
                self.index,
                gucs::database()
            ),
            WorkerState::Standby => {
                log!(
                    "outbox relay {}: server is a standby; relaying starts on promotion",
                    self.index
                )
            }
            _ if matches!(
                self.state,
                WorkerState::WaitingForExtension | WorkerState::Standby
            ) =>
            {
                log!(
                    "outbox relay {}: relaying from schema {}",
                    self.index,
                    self.schema
                )
            }
            _ => {}
        }
        self.state = state;
        self.slot.set_state(state);
        let activity = match state {
            WorkerState::Publishing => pg_sys::BackendState::STATE_RUNNING,
            _ => pg_sys::BackendState::STATE_IDLE,
        };
        // SAFETY: reports this backend's own activity.
        unsafe { pg_sys::pgstat_report_activity(activity, std::ptr::null()) };
    }

    fn run(&mut self) {
        loop {
            if shutdown_requested() {
                self.exit();
            }
            self.reload_if_requested();
            let pass = self.pass();
            self.prune_if_due();
            match pass {
                Pass::Full => {}
                Pass::Drained | Pass::NoExtension => {
                    wait_latch(self.next_wait());
                    let spacing = backoff::pass_spacing(
                        self.last_pass_published,
                        self.last_pass_interval,
                        self.batch_size,
                    );
                    let since = self.last_pass_started.elapsed();
                    if since < spacing {
                        std::thread::sleep(spacing - since);
                    }
                }
                Pass::RedisDown(delay) => self.sleep(delay),
            }
        }
    }

    /// Exits with code 1: the postmaster restarts a worker stopped by pg_terminate_backend, and
    /// ignores the code during a shutdown.
    fn exit(&mut self) -> ! {
        self.set_state(WorkerState::Stopped);
        // The exit callbacks clear the slot and abort any transaction.
        crate::compat::proc_exit(1)
    }

    fn reload_if_requested(&mut self) {
        // SAFETY: ConfigReloadPending is set by the SIGHUP handler; ProcessConfigFile is what a
        // background worker must call itself.
        unsafe {
            if std::ptr::read_volatile(&raw const pg_sys::ConfigReloadPending) == 0 {
                return;
            }
            pg_sys::ConfigReloadPending = 0;
            pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP);
        }
        let before = (
            self.target.clone(),
            self.batch_size,
            self.poll_interval,
            self.max_attempts,
            self.retention,
        );
        self.read_settings();
        if before
            != (
                self.target.clone(),
                self.batch_size,
                self.poll_interval,
                self.max_attempts,
                self.retention,
            )
        {
            self.log_config("reloaded");
        }
    }

    /// Sleeps until `delay` has passed, waking only for SIGTERM and SIGHUP.
    fn sleep(&mut self, delay: Duration) {
        let deadline = Instant::now() + delay;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || shutdown_requested() {
                return;
            }
            wait_latch(left);
            self.reload_if_requested();
        }
    }

    /// The poll interval, or less when a retry this worker scheduled falls due sooner.
    fn next_wait(&mut self) -> Duration {
        let now = Instant::now();
        if self.next_retry.is_some_and(|at| at <= now) {
            self.next_retry = None;
        }
        self.next_retry
            .map(|at| at.saturating_duration_since(now))
            .map_or(self.poll_interval, |left| left.min(self.poll_interval))
            .max(Duration::from_millis(1))
    }

    fn pass(&mut self) -> Pass {
        // SAFETY: reads shared recovery state.
        if unsafe { pg_sys::RecoveryInProgress() } {
            self.set_state(WorkerState::Standby);
            return Pass::NoExtension;
        }
        let started = Instant::now();
        self.last_pass_interval = started - self.last_pass_started;
        self.last_pass_started = started;
        let batch = in_transaction(|| {
            let mut batch = self.relay_batch();
            let end = std::mem::replace(&mut batch.end, End::Commit);
            (batch, end)
        });
        self.last_pass_published = batch.published;
        if batch.published > 0 {
            let at = now();
            self.slot.record_batch(batch.published, at);
            self.shared
                .last_published_at
                .fetch_max(at, std::sync::atomic::Ordering::Relaxed);
        }
        // The batch is committed (or, if Redis failed, has no markers): its markers have done
        // their job.
        self.committed_markers.extend(batch.markers);
        match batch.pass {
            Pass::NoExtension => self.set_state(WorkerState::WaitingForExtension),
            Pass::RedisDown(_) => self.set_state(WorkerState::Backoff),
            Pass::Full => self.set_state(WorkerState::Publishing),
            Pass::Drained => self.set_state(WorkerState::Idle),
        }
        batch.pass
    }

    /// Finds the extension, preparing its statements when it is new; `None` if it is missing.
    /// While relaying, the catalog is consulted at most once a second: should the extension be
    /// dropped in between, the next statement fails and the worker restarts into waiting.
    fn statements(&mut self) -> Option<&Statements> {
        if self.statements.is_some() && self.extension_checked_at.elapsed() < EXTENSION_RECHECK {
            return self.statements.as_ref();
        }
        self.extension_checked_at = Instant::now();
        // SAFETY: a catalog lookup inside the current transaction.
        let oid = unsafe { pg_sys::get_extension_oid(c"outbox".as_ptr(), true) };
        if oid == pg_sys::InvalidOid {
            self.statements = None;
            return None;
        }
        if self.statements.as_ref().map(|s| s.extension) != Some(oid) {
            self.statements = None;
            let (schema, version) = claim::extension_schema(oid)?;
            if version != env!("CARGO_PKG_VERSION") {
                // The library was upgraded and the SQL objects not yet: relaying resumes once
                // ALTER EXTENSION brings them to the version this library's statements need.
                if self.outdated_version.as_deref() != Some(version.as_str()) {
                    log!(
                        "outbox relay {}: the extension's objects are at version {version}, this \
                         library relays version {}; run ALTER EXTENSION outbox UPDATE in \
                         database {}",
                        self.index,
                        env!("CARGO_PKG_VERSION"),
                        gucs::database()
                    );
                    self.outdated_version = Some(version);
                }
                return None;
            }
            self.outdated_version = None;
            self.statements = Some(Statements::prepare(oid, &schema));
            self.schema = schema;
        }
        self.statements.as_ref()
    }

    /// One batch inside the caller's transaction; says how to end it. A large batch goes out in
    /// chunks: while Redis works on one chunk, the next is marked and claimed, so the database
    /// and Redis work side by side. The transaction commits once every chunk is answered.
    fn relay_batch(&mut self) -> Batch {
        let nothing = |pass| Batch {
            pass,
            published: 0,
            markers: Vec::new(),
            end: End::Commit,
        };
        if self.statements().is_none() {
            return nothing(Pass::NoExtension);
        }
        let chunk = chunk_size(self.batch_size);
        let Some(statements) = self.statements.as_ref() else {
            return nothing(Pass::NoExtension);
        };
        let mut next = statements.claim(chunk);
        if next.len() == 0 && self.committed_markers.is_empty() {
            return nothing(Pass::Drained);
        }
        let markers_sent = self.committed_markers.clone();
        let mut cleanup = std::mem::take(&mut self.committed_markers);
        let mut claimed = 0;
        let mut batch = Batch {
            pass: Pass::Drained,
            published: 0,
            markers: Vec::new(),
            end: End::Commit,
        };
        loop {
            let got = next.len();
            claimed += got;
            if !next.unreadable.is_empty() {
                self.charge_failures(std::mem::take(&mut next.unreadable));
            }
            let size = next.events.len();
            let sent: Vec<(i64, String, i32)> = next
                .events
                .iter()
                .map(|e| (e.id, e.topic.clone(), e.attempts))
                .collect();
            let ids: Vec<i64> = sent.iter().map(|e| e.0).collect();
            let request = Request {
                target: self.target.clone(),
                events: next.events,
                committed_markers: std::mem::take(&mut cleanup),
            };
            if !self.publisher.send(request) {
                self.exit();
            }
            let Some(statements) = self.statements.as_ref() else {
                return nothing(Pass::NoExtension);
            };
            let mut following = claim::Claimed::default();
            if size > 0 {
                // Written while Redis works; undone by the rollback if Redis fails.
                statements.mark_published(ids);
                if got == chunk && claimed < self.batch_size {
                    following = statements.claim(chunk.min(self.batch_size - claimed));
                }
                self.set_state(WorkerState::Publishing);
            }
            let reply = match self.publisher.wait(SIGNAL_TICK, || {
                exit_if_postmaster_died();
                !shutdown_requested()
            }) {
                Ok(reply) => reply,
                Err(Interrupted::Stopped) => self.exit(),
            };
            match reply {
                Reply::Unavailable(error) => {
                    self.committed_markers = markers_sent;
                    if !self.backoff.is_failing() {
                        warning!(
                            "outbox relay {}: lost Redis at {}: {error}; retrying with backoff up to {}s",
                            self.index,
                            redis_url::mask(&self.target.url),
                            backoff::CAP.as_secs()
                        );
                    }
                    self.slot.set_error(Some(&error), now());
                    return Batch {
                        end: End::Rollback,
                        ..nothing(Pass::RedisDown(self.backoff.next_delay()))
                    };
                }
                Reply::Answered { results, markers } => {
                    if self.backoff.reset() {
                        log!(
                            "outbox relay {}: Redis at {} is reachable again",
                            self.index,
                            redis_url::mask(&self.target.url)
                        );
                        self.slot.set_error(None, now());
                    }
                    let failures: Vec<Failure> = sent
                        .into_iter()
                        .zip(results)
                        .filter_map(|((id, topic, attempts), result)| {
                            result.err().map(|error| Failure {
                                id,
                                topic,
                                attempts,
                                error,
                                permanent: false,
                            })
                        })
                        .collect();
                    batch.published += (size - failures.len()) as u64;
                    batch.markers.extend(markers);
                    if !failures.is_empty() {
                        // Unmarked, and scheduled for later: the claims left in this
                        // transaction pass them by.
                        self.charge_failures(failures);
                    }
                }
            }
            if following.len() == 0 {
                break;
            }
            next = following;
        }
        if claimed == self.batch_size {
            batch.pass = Pass::Full;
        }
        batch
    }

    /// Takes the mark back from each event that failed, charges it an attempt and schedules its
    /// retry; buries those out of attempts, and those that retrying cannot help.
    fn charge_failures(&mut self, failures: Vec<Failure>) {
        let Some(statements) = self.statements.as_ref() else {
            return;
        };
        let charges: Vec<(i64, String, Duration)> = failures
            .iter()
            .map(|f| {
                let delay = backoff::event_retry_delay(f.attempts.saturating_add(1));
                (f.id, f.error.clone(), delay)
            })
            .collect();
        let attempts: HashMap<i64, i32> = statements
            .record_failures(&charges)
            .into_iter()
            .map(|c| (c.id, c.attempts))
            .collect();
        let mut exhausted = Vec::new();
        let mut last_error = None;
        for failure in failures {
            let Failure {
                id,
                topic,
                error,
                permanent,
                ..
            } = failure;
            let topic = encode::ascii_safe(&topic);
            let error = encode::ascii_safe(&error);
            let Some(&attempts) = attempts.get(&id) else {
                continue;
            };
            if permanent || attempts >= self.max_attempts {
                warning!(
                    "outbox relay {}: event {id} (topic {topic}) moved to outbox_dead after \
                     {attempts} failed attempts: {error}",
                    self.index
                );
                exhausted.push(id);
            } else {
                if attempts == 1 {
                    warning!(
                        "outbox relay {}: Redis rejected event {id} (topic {topic}): {error}; \
                         it will be retried up to outbox.max_attempts ({}) times",
                        self.index,
                        self.max_attempts
                    );
                }
                let due = Instant::now() + backoff::event_retry_delay(attempts);
                self.next_retry = Some(self.next_retry.map_or(due, |at| at.min(due)));
            }
            last_error = Some(error);
        }
        if !exhausted.is_empty() {
            statements.bury(exhausted);
        }
        self.slot.set_error(last_error.as_deref(), now());
    }

    /// Runs a pruning round when retention is on, a minute (or the retention, if shorter) has
    /// passed since the last round of any worker, and this worker wins the race to start it.
    fn prune_if_due(&mut self) {
        let Some(retention) = self.retention else {
            return;
        };
        if self.statements.is_none() {
            return;
        }
        let at = now();
        let due = self
            .shared
            .next_prune_at
            .load(std::sync::atomic::Ordering::Relaxed);
        if at < due {
            return;
        }
        // A retention shorter than a minute (as in tests) is honoured at its own pace.
        let next = at + PRUNE_EVERY.min(retention).as_micros() as i64;
        if self
            .shared
            .next_prune_at
            .compare_exchange(
                due,
                next,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_err()
        {
            return;
        }
        let schema = self.schema.clone();
        let Some(mut from) = in_transaction(|| (prune::first_id(&schema), End::Commit)) else {
            return;
        };
        let mut deleted = 0;
        for _ in 0..prune::MAX_RANGES_PER_ROUND {
            if shutdown_requested() {
                break;
            }
            let pruned =
                in_transaction(|| (prune::prune_range(&schema, from, retention), End::Commit));
            deleted += pruned.deleted;
            match pruned.next {
                Some(next) => from = next,
                None => break,
            }
        }
        if deleted > 0 {
            debug1!(
                "outbox relay {}: pruned {deleted} published events",
                self.index
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_size;

    #[test]
    fn batches_go_out_in_up_to_four_chunks_of_fifty_or_more() {
        assert_eq!(chunk_size(1), 1);
        assert_eq!(chunk_size(50), 50);
        assert_eq!(chunk_size(99), 50);
        assert_eq!(chunk_size(100), 50);
        assert_eq!(chunk_size(199), 50);
        assert_eq!(chunk_size(400), 100);
        assert_eq!(chunk_size(1000), 250);
        assert_eq!(chunk_size(1001), 251);
        assert_eq!(chunk_size(10_000), 2500);
    }
}

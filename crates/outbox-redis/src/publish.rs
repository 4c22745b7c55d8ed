//! Redis: a thread of its own that publishes one chunk of a batch per round trip, and owns
//! everything only it uses: the connection, the Redis-side settings and the dedupe markers.
//!
//! The worker's main thread, the only one that calls PostgreSQL, hands a chunk over a channel
//! and waits for the reply while it keeps watching for SIGTERM and postmaster death, so a Redis
//! that hangs never holds up a shutdown. When the transaction holding the chunks ends, the main
//! thread says whether it committed, and where its commit record ends in the WAL. The markers of
//! a committed batch have done their job once that record is on disk (the relay's commits do not
//! wait for it, see the extension's `relay/session.rs`): the main thread says how far the WAL is
//! flushed, and the markers are deleted in the next round trip after that, or after a short idle
//! moment if none comes. Until then a crash that loses the commit finds them, and they absorb the
//! batch's republication, as the markers of a rolled-back batch do.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::connection::{self, Connection};
use crate::doubt::Doubt;
use crate::encode::Event;
use crate::error::Error;
use crate::outcome::{Markers, Outcome};
use crate::pipeline::Chunk;
use crate::server::InUse;
use crate::target::Target;

/// How long the thread waits for another chunk before it deletes committed markers alone.
const CLEANUP_AFTER: Duration = Duration::from_millis(20);

/// What the main thread tells the Redis thread.
enum Command {
    /// Settings, at start and after a reload that changed them.
    Configure(Box<Target>),
    /// A chunk to publish; a [`Reply`] follows.
    Publish(Vec<Event>),
    /// The transaction that holds the chunks published since the last end has committed; its
    /// commit record ends at this WAL position.
    Committed(u64),
    /// The WAL is on disk up to this position.
    Flushed(u64),
    /// It has rolled back.
    RolledBack,
}

/// What became of a chunk.
pub enum Reply {
    /// Redis answered: one outcome per event, in the chunk's order, and the chunk itself, handed
    /// back so that its events are dropped by the thread that allocated them.
    Answered(Vec<Outcome>, Vec<Event>),
    /// Redis could not be used at all, and why; nothing may be marked.
    Unavailable(Error),
}

/// Why waiting for a reply ended without one.
pub enum Interrupted {
    /// The caller's check asked to stop waiting.
    Stopped,
}

/// What the Redis thread last found of the servers it writes to, for the worker to show and
/// to log when it changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    /// How the last chunk was deduplicated.
    pub dedupe: Option<InUse>,
    /// The servers written to, as `INFO` names them.
    pub servers: String,
    /// Whether every one of them trims with `ACKED`.
    pub acked: bool,
    /// Why the last chunk's trimming by age failed, if it did.
    pub trim_error: Option<String>,
}

/// The main thread's end of the channel to the Redis thread.
pub struct Publisher {
    commands: Sender<Command>,
    replies: Receiver<Reply>,
    found: Arc<Mutex<Found>>,
}

impl Publisher {
    /// Starts the Redis thread; `Err` if the system would not start a thread.
    pub fn spawn(target: Target) -> std::io::Result<Publisher> {
        let (commands, incoming) = crossbeam_channel::unbounded::<Command>();
        let (outgoing, replies) = crossbeam_channel::unbounded::<Reply>();
        // The thread is born with every signal blocked (a thread inherits its creator's mask):
        // blocking them only once it runs left a moment in which a SIGTERM could land there,
        // and PostgreSQL's handler may only run on the main thread.
        let found = Arc::new(Mutex::new(Found::default()));
        let shared = Arc::clone(&found);
        let previous = block_signals();
        let spawned = thread::Builder::new()
            .name("outbox-redis".into())
            .spawn(move || RedisSide::new(target, shared).serve(incoming, outgoing));
        restore_signals(&previous);
        spawned?;
        Ok(Publisher {
            commands,
            replies,
            found,
        })
    }

    /// What the Redis thread last found of the servers (nothing before its first chunk).
    pub fn found(&self) -> Found {
        self.found.lock().map(|f| f.clone()).unwrap_or_default()
    }

    /// Hands new settings to the Redis thread.
    pub fn configure(&self, target: Target) {
        let _ = self.commands.send(Command::Configure(Box::new(target)));
    }

    /// Hands a chunk to the Redis thread and returns at once; [`Publisher::wait`] collects the
    /// outcome, so that the caller can work in the meantime. False if the thread is gone.
    pub fn send(&self, events: Vec<Event>) -> bool {
        self.commands.send(Command::Publish(events)).is_ok()
    }

    /// Tells the Redis thread how the transaction holding the chunks sent since the last call
    /// ended: committed with its commit record ending at a WAL position, or rolled back.
    pub fn transaction_ended(&self, committed_at: Option<u64>) {
        let command = match committed_at {
            Some(lsn) => Command::Committed(lsn),
            None => Command::RolledBack,
        };
        let _ = self.commands.send(command);
    }

    /// Tells the Redis thread that the WAL is on disk up to `lsn`.
    pub fn flushed(&self, lsn: u64) {
        let _ = self.commands.send(Command::Flushed(lsn));
    }

    /// Waits for the outcome of the chunk last sent, calling `keep_waiting` every `tick` while
    /// Redis has not answered; when it returns false the wait ends (the thread finishes the call
    /// on its own).
    pub fn wait(
        &self,
        tick: Duration,
        mut keep_waiting: impl FnMut() -> bool,
    ) -> Result<Reply, Interrupted> {
        loop {
            match self.replies.recv_timeout(tick) {
                Ok(reply) => return Ok(reply),
                Err(RecvTimeoutError::Timeout) => {
                    if !keep_waiting() {
                        return Err(Interrupted::Stopped);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Ok(Reply::Unavailable(Error::Unreachable(
                        "the Redis thread has stopped".into(),
                    )))
                }
            }
        }
    }
}

/// The Redis thread's state.
struct RedisSide {
    target: Target,
    connection: Option<Connection>,
    /// Markers of chunks whose transaction has not ended yet.
    in_flight: Vec<Markers>,
    /// The events a transaction that did not commit sent, and how: each goes again the same
    /// way (see `doubt.rs`).
    doubt: Doubt,
    /// Markers of committed batches whose commit may not be durable yet.
    unflushed: Unflushed,
    /// Markers of committed batches, to delete.
    committed: Vec<Markers>,
    /// Whether deleting them alone failed: then they wait for the next chunk's round trip.
    cleanup_failed: bool,
    /// Shared with [`Publisher::found`].
    found: Arc<Mutex<Found>>,
}

impl RedisSide {
    fn new(target: Target, found: Arc<Mutex<Found>>) -> RedisSide {
        RedisSide {
            found,
            target,
            connection: None,
            in_flight: Vec::new(),
            doubt: Doubt::default(),
            unflushed: Unflushed::default(),
            committed: Vec::new(),
            cleanup_failed: false,
        }
    }

    fn serve(mut self, incoming: Receiver<Command>, outgoing: Sender<Reply>) {
        block_signals();
        loop {
            let command = if self.committed.is_empty() || self.cleanup_failed {
                incoming.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                incoming.recv_timeout(CLEANUP_AFTER)
            };
            match command {
                Ok(Command::Configure(target)) => self.target = *target,
                Ok(Command::Publish(events)) => {
                    if outgoing.send(self.publish(events)).is_err() {
                        return;
                    }
                }
                Ok(Command::Committed(lsn)) => {
                    let now = Instant::now();
                    self.doubt.committed(now, self.target.dedupe_ttl);
                    let markers = std::mem::take(&mut self.in_flight);
                    self.unflushed.committed(lsn, now, markers);
                    self.unflushed.expire(now, self.target.dedupe_ttl);
                    self.release_flushed();
                }
                Ok(Command::Flushed(lsn)) => {
                    self.unflushed.flushed(lsn);
                    self.release_flushed();
                }
                Ok(Command::RolledBack) => {
                    self.in_flight.clear();
                    self.doubt
                        .rolled_back(Instant::now(), self.target.dedupe_ttl);
                }
                Err(RecvTimeoutError::Timeout) => self.clean_up(),
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn publish(&mut self, events: Vec<Event>) -> Reply {
        let chunk = Chunk {
            target: &self.target,
            events: &events,
            cleanup: &self.committed,
            in_doubt: self.doubt.way_for(&events),
            sent_as: Cell::new(None),
        };
        let result = connection::publish(&mut self.connection, &chunk);
        if let Some(way) = chunk.sent_as.get() {
            self.doubt.sent(&events, way);
        }
        if let Some(connection) = &self.connection {
            if let Ok(mut found) = self.found.lock() {
                *found = Found {
                    dedupe: connection.in_use,
                    servers: connection.features.servers.clone(),
                    acked: connection.features.acked,
                    trim_error: result.as_ref().ok().and_then(|a| a.trim_error.clone()),
                };
            }
        }
        match result {
            Ok(answer) => {
                self.committed.clear();
                self.cleanup_failed = false;
                self.doubt.answered(&events, &answer.results);
                self.in_flight.extend(answer.markers);
                Reply::Answered(answer.results, events)
            }
            Err(error) => Reply::Unavailable(error),
        }
    }

    /// Hands the markers of batches whose commit is on disk over for deletion.
    fn release_flushed(&mut self) {
        self.unflushed.take_durable(&mut self.committed);
    }

    /// Deletes the committed markers in a round trip of their own.
    fn clean_up(&mut self) {
        let chunk = Chunk {
            target: &self.target,
            events: &[],
            cleanup: &self.committed,
            in_doubt: None,
            sent_as: Cell::new(None),
        };
        match connection::send(&mut self.connection, &chunk) {
            Ok(_) => self.committed.clear(),
            Err(_) => {
                self.connection = None;
                self.cleanup_failed = true;
            }
        }
    }
}

/// The markers of committed batches, until their commit is durable (on disk, and on the
/// synchronous standbys), oldest first, with where each commit record ends and when it was
/// noted. While no synchronous standby confirms (one that is down), commits go on and never
/// become durable: a note whose markers Redis has expired meanwhile (they live
/// `outbox.dedupe_ttl` from their chunk, which came before the commit) has nothing left to
/// delete, and is forgotten, so that the notes stay bounded by what one `dedupe_ttl` commits.
#[derive(Debug, Default)]
struct Unflushed {
    batches: VecDeque<(u64, Instant, Vec<Markers>)>,
    /// How far the WAL is known to be durable.
    flushed: u64,
}

impl Unflushed {
    /// A commit whose record ends at `lsn`, noted at `at`, made `markers` unnecessary once it is
    /// durable.
    fn committed(&mut self, lsn: u64, at: Instant, markers: Vec<Markers>) {
        if !markers.is_empty() {
            self.batches.push_back((lsn, at, markers));
        }
    }

    /// The WAL is durable up to `lsn`.
    fn flushed(&mut self, lsn: u64) {
        self.flushed = self.flushed.max(lsn);
    }

    /// Forgets the notes older than `ttl` at `now`.
    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((_, at, _)) = self.batches.front() {
            if now.saturating_duration_since(*at) < ttl {
                break;
            }
            self.batches.pop_front();
        }
    }

    /// Moves the markers of the batches whose commit is durable into `to`.
    fn take_durable(&mut self, to: &mut Vec<Markers>) {
        while let Some((lsn, _, _)) = self.batches.front() {
            if *lsn > self.flushed {
                break;
            }
            if let Some((_, _, mut markers)) = self.batches.pop_front() {
                to.append(&mut markers);
            }
        }
    }
}

/// Keeps the process's signals (SIGTERM, SIGHUP, SIGUSR1 ...) off this thread: they are the main
/// thread's to handle, and one landing here would interrupt a socket read (EINTR), which would
/// read as Redis being unavailable, or run PostgreSQL's handler off the main thread. Returns
/// the mask it replaced.
fn block_signals() -> libc::sigset_t {
    // SAFETY: fills a local signal set and installs it as this thread's mask, keeping the old.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut previous);
        previous
    }
}

/// Puts back a mask [`block_signals`] replaced.
fn restore_signals(previous: &libc::sigset_t) {
    // SAFETY: installs a mask this thread had before.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, previous, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn markers(n: usize) -> Vec<Markers> {
        (0..n)
            .map(|i| Markers {
                hash: format!("h{i}"),
                field: "f".into(),
            })
            .collect()
    }

    #[test]
    fn durable_commits_hand_their_markers_over_oldest_first() {
        let mut notes = Unflushed::default();
        let start = Instant::now();
        notes.committed(100, start, markers(2));
        notes.committed(200, start, markers(1));
        notes.committed(300, start, Vec::new());
        let mut deleted = Vec::new();
        notes.flushed(150);
        notes.take_durable(&mut deleted);
        assert_eq!(deleted.len(), 2);
        notes.flushed(120);
        notes.flushed(250);
        notes.take_durable(&mut deleted);
        assert_eq!(deleted.len(), 3);
        assert!(notes.batches.is_empty());
    }

    #[test]
    fn notes_never_durable_are_forgotten_once_their_markers_expired() {
        let ttl = Duration::from_secs(60);
        let mut notes = Unflushed::default();
        let start = Instant::now();
        // A synchronous standby is down: commits go on, none becomes durable.
        for n in 0..1_000u64 {
            let at = start + Duration::from_millis(n * 100);
            notes.committed(n, at, markers(1));
            notes.expire(at, ttl);
        }
        // 100 s of commits, 10 a second: those of the last 60 s are kept.
        assert_eq!(notes.batches.len(), 600);
        let mut deleted = Vec::new();
        notes.take_durable(&mut deleted);
        assert!(deleted.is_empty());
    }
}

//! How far the relay's commits are on disk, told to the Redis thread: a batch's dedupe markers
//! stay in Redis until the commit that marked it is durable, so the relay reports each flush it
//! sees, and flushes its own last commit when the WAL writer would be too late.

use std::time::{Duration, Instant};

use outbox_redis::publish::Publisher;

use super::worker;

/// How long a relay that found no more events waits for the next commit before it flushes its
/// own last commit: longer than the passes of a steady stream are apart (at most 8 ms, see
/// `backoff.rs`), so that those never wait for a flush.
const FLUSH_IF_IDLE_FOR: Duration = Duration::from_millis(20);

/// How long a busy relay leaves its commits to the WAL writer at most before it flushes them
/// itself: the default `wal_writer_delay`. A batch's markers stay in Redis until its commit is
/// on disk, so this bounds how many pile up, whatever `wal_writer_delay` says.
const FLUSH_AT_LEAST_EVERY: Duration = Duration::from_millis(200);

/// The relay's commits not yet known on disk, and how far the WAL was last said to be.
#[derive(Default)]
pub struct WalFlush {
    /// The end of the last commit record told to the Redis thread and not yet known on disk,
    /// and since when the oldest such commit has waited.
    unflushed: Option<(u64, Instant)>,
    /// How far the WAL was last said to be on disk.
    flushed_told: u64,
}

impl WalFlush {
    /// Tells the Redis thread how the transaction holding the chunks sent since the last call
    /// ended (committed, its commit record ending at `committed_at`, or rolled back), then how
    /// far the WAL is on disk.
    pub fn transaction_ended(&mut self, committed_at: Option<u64>, publisher: &Publisher) {
        publisher.transaction_ended(committed_at);
        if let Some(lsn) = committed_at {
            self.committed(lsn);
        }
        self.report(false, publisher);
    }

    /// Takes note of a commit whose record ends at `lsn`.
    fn committed(&mut self, lsn: u64) {
        self.unflushed = Some(match self.unflushed {
            Some((told, since)) => (told.max(lsn), since),
            None => (lsn, Instant::now()),
        });
    }

    /// Waits up to `wait` for a commit to wake the relay. While a commit of its own may not be
    /// on disk, it first waits only [`FLUSH_IF_IDLE_FOR`]: under a steady stream a commit wakes
    /// it sooner, and the WAL writer flushes in the background; otherwise it flushes that commit
    /// itself, so that neither the batch nor its markers in Redis wait on the WAL writer while
    /// the relay sleeps.
    pub fn wait_for_commits(&mut self, wait: Duration, publisher: &Publisher) {
        if self.unflushed.is_some() {
            let first = wait.min(FLUSH_IF_IDLE_FOR);
            if worker::wait_latch(first) {
                return;
            }
            self.report(true, publisher);
            worker::wait_latch(wait - first);
        } else {
            worker::wait_latch(wait);
        }
    }

    /// Tells the Redis thread how far the WAL is on disk (and, with synchronous standbys, on
    /// theirs), so that it deletes the markers of the batches whose commit is. The WAL writer flushes the relay's commits within
    /// `wal_writer_delay`; with `flush`, or once a commit has waited [`FLUSH_AT_LEAST_EVERY`]
    /// (`wal_writer_delay` may be set up to 10 s), the relay flushes its last commit itself.
    fn report(&mut self, flush: bool, publisher: &Publisher) {
        let Some((waiting, since)) = self.unflushed else {
            return;
        };
        let mut flushed = worker::wal_flushed_to();
        if flushed < waiting && (flush || since.elapsed() >= FLUSH_AT_LEAST_EVERY) {
            worker::flush_wal(waiting);
            flushed = worker::wal_flushed_to().max(waiting);
        }
        // With synchronous standbys, a commit is durable once they have it too: one promoted
        // after a crash must find the markers of every batch whose mark it lacks.
        if let Some(replicated) = worker::sync_standbys_flushed_to() {
            flushed = flushed.min(replicated);
        }
        if flushed > self.flushed_told {
            publisher.flushed(flushed);
            self.flushed_told = flushed;
        }
        if flushed >= waiting {
            self.unflushed = None;
        }
        // Else the wait keeps the start of the oldest commit reported unflushed: the relay's own
        // flush may come early, never late.
    }
}

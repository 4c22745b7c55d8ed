//! How far the relay's commits are on disk, told to the Redis thread: a batch's dedupe markers
//! stay in Redis until the commit that marked it is durable, so the relay reports each flush it
//! sees, and flushes its own last commit when the WAL writer would be too late. With IDMP,
//! Redis keeps the identities of the last [`WINDOW_IDS`] events per producer and stream: the
//! relay flushes before what a crash could send again outgrows half of that (the other half
//! covers a worker that took over a lane group meanwhile).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use outbox_redis::idmp::WINDOW_IDS;
use outbox_redis::publish::Publisher;

use super::settings::Settings;
use crate::pg::worker;

/// How long a relay that found no more events waits for the next commit before it flushes its
/// own last commit: longer than the passes of a steady stream are apart (at most 8 ms, see
/// `backoff.rs`), so that those never wait for a flush.
const FLUSH_IF_IDLE_FOR: Duration = Duration::from_millis(20);

/// How long a busy relay leaves its commits to the WAL writer at most before it flushes them
/// itself: the default `wal_writer_delay`. A batch's markers stay in Redis until its commit is
/// on disk, so this bounds how many pile up, whatever `wal_writer_delay` says.
const FLUSH_AT_LEAST_EVERY: Duration = Duration::from_millis(200);

/// How long a relay held by a full IDMP window waits before it looks again.
const WINDOW_WAIT: Duration = Duration::from_millis(10);

/// The most events a pass claims for `outbox.batch_size`: with IDMP in use (or not yet known
/// not to be), half the window, so that one batch in doubt always fits in the half the window
/// keeps for it, and a relay with nothing in doubt is never held.
pub fn batch_limit(batch_size: usize, idmp: bool) -> usize {
    if idmp {
        batch_size.min((WINDOW_IDS / 2) as usize)
    } else {
        batch_size
    }
}

/// The relay's commits not yet known on disk, and how far the WAL was last said to be.
#[derive(Default)]
pub struct WalFlush {
    /// The end of the last commit record told to the Redis thread and not yet known on disk,
    /// and since when the oldest such commit has waited.
    unflushed: Option<(u64, Instant)>,
    /// How far the WAL was last said to be on disk.
    flushed_told: u64,
    /// The events published by each commit not yet known on disk.
    pending: Pending,
}

/// The events each commit published, until the WAL is known on disk past its record: what a
/// crash could send again. Commits the WAL writer flushed in the background leave it as they
/// are seen, so that a relay whose commits the WAL writer keeps up with never flushes for the
/// IDMP window itself.
#[derive(Debug, Default)]
struct Pending {
    /// Each commit's record end and its events, oldest first.
    commits: VecDeque<(u64, u64)>,
    /// Their events in all.
    events: u64,
}

impl Pending {
    /// A commit whose record ends at `lsn` that published `events`.
    fn committed(&mut self, lsn: u64, events: u64) {
        if events == 0 {
            return;
        }
        match self.commits.back_mut() {
            // Commits are recorded in order; one at the same end adds to it.
            Some((last, count)) if *last >= lsn => *count += events,
            _ => self.commits.push_back((lsn, events)),
        }
        self.events += events;
    }

    /// The WAL is on disk up to `lsn`: the commits whose record ends there or before are durable.
    fn flushed(&mut self, lsn: u64) {
        while let Some(&(end, events)) = self.commits.front() {
            if end > lsn {
                break;
            }
            self.commits.pop_front();
            self.events -= events;
        }
    }
}

impl WalFlush {
    /// Tells the Redis thread how the transaction holding the chunks sent since the last call
    /// ended (committed, its commit record ending at `committed_at`, or rolled back), then how
    /// far the WAL is on disk. The transaction published `published` events, counted against
    /// the IDMP window until the commit is known on disk ([`WalFlush::hold_for_window`]).
    pub fn transaction_ended(
        &mut self,
        committed_at: Option<u64>,
        published: u64,
        publisher: &Publisher,
    ) {
        publisher.transaction_ended(committed_at);
        if let Some(lsn) = committed_at {
            self.committed(lsn);
            self.pending.committed(lsn, published);
        }
        self.report(false, publisher);
    }

    /// Whether another batch could take what a crash may send again past half the IDMP window.
    fn window_full(&self, settings: &Settings) -> bool {
        self.pending.events + batch_limit(settings.batch_size, true) as u64 > WINDOW_IDS / 2
    }

    /// With IDMP (`idmp`), whether the relay must wait before its next pass, because what a
    /// crash could send again (the events of its commits not yet durable, on disk and on the
    /// synchronous standbys) would outgrow the window with another batch. It flushes its own
    /// commits first, and waits a moment if that was not enough (a synchronous standby behind):
    /// a primary that fails over to that standby sends again every event whose mark it lacks.
    pub fn hold_for_window(
        &mut self,
        idmp: bool,
        settings: &Settings,
        publisher: &Publisher,
    ) -> bool {
        if !idmp || !self.window_full(settings) {
            return false;
        }
        // The commits the WAL writer flushed meanwhile count out first; only if that is not
        // enough does the relay flush itself.
        let mut durable = worker::wal_flushed_to();
        if let Some(replicated) = worker::sync_standbys_flushed_to() {
            durable = durable.min(replicated);
        }
        self.pending.flushed(durable);
        if !self.window_full(settings) {
            return false;
        }
        self.report(true, publisher);
        if !self.window_full(settings) {
            return false;
        }
        worker::wait_latch(WINDOW_WAIT);
        true
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
        self.pending.flushed(flushed);
        if flushed >= waiting {
            self.unflushed = None;
        }
        // Else the wait keeps the start of the oldest commit reported unflushed: the relay's own
        // flush may come early, never late.
    }
}

#[cfg(test)]
mod tests {
    use super::{batch_limit, Pending, WINDOW_IDS};

    #[test]
    fn with_idmp_a_batch_fits_in_half_the_window() {
        assert_eq!(batch_limit(10_000, false), 10_000);
        assert_eq!(batch_limit(10_000, true), (WINDOW_IDS / 2) as usize);
        assert_eq!(batch_limit(6_000, true), 5_000);
        assert_eq!(batch_limit(1_000, true), 1_000);
    }

    #[test]
    fn commits_flushed_in_the_background_count_out_oldest_first() {
        let mut pending = Pending::default();
        pending.committed(100, 1000);
        pending.committed(200, 1000);
        pending.committed(300, 500);
        assert_eq!(pending.events, 2500);
        // The WAL writer got past the first commit, not to the end of the second.
        pending.flushed(150);
        assert_eq!(pending.events, 1500);
        pending.flushed(200);
        assert_eq!(pending.events, 500);
        pending.flushed(1000);
        assert_eq!(pending.events, 0);
        assert!(pending.commits.is_empty());
    }

    #[test]
    fn a_commit_that_published_nothing_holds_no_place() {
        let mut pending = Pending::default();
        pending.committed(100, 0);
        assert!(pending.commits.is_empty());
        pending.committed(200, 10);
        pending.committed(200, 5);
        assert_eq!(pending.commits.len(), 1);
        assert_eq!(pending.events, 15);
        pending.flushed(199);
        assert_eq!(pending.events, 15);
    }
}

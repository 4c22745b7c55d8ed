//! One slot per relay worker in shared memory: the database it relays for, its process and
//! latch, its state as `outbox_workers` shows it, what it published, and its last error.
//!
//! The status views read a slot while its worker writes it, without a lock: the last error's
//! text is guarded by a sequence counter, which a reader checks before and after its copy.

use std::sync::atomic::{
    fence, AtomicI32, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, Ordering,
};

use outbox_redis::server::InUse;
use pgrx::pg_sys;

use super::time::{time_or_null, NO_TIME};

/// Bytes of the last error kept per slot.
const ERROR_BYTES: usize = 256;

/// What a relay worker is doing, as shown by `outbox_workers.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WorkerState {
    Stopped = 0,
    Starting,
    Idle,
    Publishing,
    Backoff,
    WaitingForExtension,
    Standby,
}

impl WorkerState {
    pub fn name(self) -> &'static str {
        match self {
            WorkerState::Stopped => "stopped",
            WorkerState::Starting => "starting",
            WorkerState::Idle => "idle",
            WorkerState::Publishing => "publishing",
            WorkerState::Backoff => "backoff",
            WorkerState::WaitingForExtension => "waiting_for_extension",
            WorkerState::Standby => "standby",
        }
    }

    fn from_u8(value: u8) -> WorkerState {
        match value {
            1 => WorkerState::Starting,
            2 => WorkerState::Idle,
            3 => WorkerState::Publishing,
            4 => WorkerState::Backoff,
            5 => WorkerState::WaitingForExtension,
            6 => WorkerState::Standby,
            _ => WorkerState::Stopped,
        }
    }
}

#[repr(C)]
pub struct WorkerSlot {
    /// The database the slot's worker relays for (its OID), 0 while the slot is unassigned.
    database: AtomicU32,
    /// The database the slot's running worker is connected to: it may still run there for a
    /// moment after the launcher gave the slot away.
    pub(super) working_in: AtomicU32,
    pid: AtomicI32,
    latch: AtomicPtr<pg_sys::Latch>,
    state: AtomicU8,
    /// How the worker last deduplicated: 0 not yet, then off, markers, idmp.
    dedupe: AtomicU8,
    published: AtomicU64,
    last_batch_at: AtomicI64,
    error_seq: AtomicU32,
    error_at: AtomicI64,
    error_len: AtomicU32,
    error_text: [AtomicU8; ERROR_BYTES],
}

/// A consistent copy of one slot, for the `outbox_workers` view.
pub struct SlotSnapshot {
    pub pid: i32,
    pub state: WorkerState,
    /// `outbox.dedupe` as the worker's connection chose it, before its first chunk `None`.
    pub dedupe: Option<&'static str>,
    pub published: i64,
    pub last_batch_at: Option<i64>,
    pub last_error: Option<String>,
    pub last_error_at: Option<i64>,
}

impl WorkerSlot {
    pub(super) fn new() -> WorkerSlot {
        WorkerSlot {
            database: AtomicU32::new(0),
            working_in: AtomicU32::new(0),
            pid: AtomicI32::new(0),
            latch: AtomicPtr::new(std::ptr::null_mut()),
            state: AtomicU8::new(WorkerState::Stopped as u8),
            dedupe: AtomicU8::new(0),
            published: AtomicU64::new(0),
            last_batch_at: AtomicI64::new(NO_TIME),
            error_seq: AtomicU32::new(0),
            error_at: AtomicI64::new(NO_TIME),
            error_len: AtomicU32::new(0),
            error_text: std::array::from_fn(|_| AtomicU8::new(0)),
        }
    }

    /// Called by the worker when it starts, for database `database`: counters restart, its
    /// latch becomes wakeable. False if another process holds the slot, which is left alone.
    pub fn attach(&self, pid: i32, latch: *mut pg_sys::Latch, database: u32) -> bool {
        if self
            .pid
            .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.published.store(0, Ordering::Relaxed);
        self.dedupe.store(0, Ordering::Relaxed);
        self.last_batch_at.store(NO_TIME, Ordering::Relaxed);
        self.set_error(None, NO_TIME);
        self.state
            .store(WorkerState::Starting as u8, Ordering::Relaxed);
        self.working_in.store(database, Ordering::Release);
        self.latch.store(latch, Ordering::Release);
        true
    }

    /// Records how the worker's connection deduplicates (`outbox_workers.dedupe`).
    pub fn set_dedupe(&self, in_use: Option<InUse>) {
        let code = match in_use {
            None => 0,
            Some(InUse::Off) => 1,
            Some(InUse::Markers) => 2,
            Some(InUse::Idmp) => 3,
        };
        self.dedupe.store(code, Ordering::Relaxed);
    }

    /// Assigns the slot to a database (0 frees it); the launcher does, before it starts the
    /// slot's worker.
    pub fn assign(&self, database: u32) {
        self.database.store(database, Ordering::Release);
    }

    /// The database the slot is assigned to, 0 if none.
    pub fn database(&self) -> u32 {
        self.database.load(Ordering::Acquire)
    }

    /// The pid of the slot's running worker, 0 if none.
    pub fn pid(&self) -> i32 {
        self.pid.load(Ordering::Acquire)
    }

    /// Whether a worker runs in the slot and relays `database`, to which the slot is assigned.
    pub fn relays(&self, database: u32) -> bool {
        self.database() == database
            && self.pid() != 0
            && self.working_in.load(Ordering::Acquire) == database
    }

    /// Called on the way out of the worker `pid`, however it exits; a slot another process
    /// holds is left alone.
    pub fn detach(&self, pid: i32) {
        if self.pid.load(Ordering::Acquire) != pid {
            return;
        }
        self.latch.store(std::ptr::null_mut(), Ordering::Release);
        self.state
            .store(WorkerState::Stopped as u8, Ordering::Relaxed);
        self.working_in.store(0, Ordering::Release);
        let _ = self
            .pid
            .compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
    }

    pub fn set_state(&self, state: WorkerState) {
        self.state.store(state as u8, Ordering::Relaxed);
    }

    pub fn record_batch(&self, published: u64, at: i64) {
        self.published.fetch_add(published, Ordering::Relaxed);
        self.last_batch_at.store(at, Ordering::Relaxed);
    }

    /// Sets (or clears, with `None`) the last error. Only the slot's worker writes it.
    pub fn set_error(&self, error: Option<&str>, at: i64) {
        let bytes = error.map(|e| truncate(e, ERROR_BYTES)).unwrap_or(b"");
        self.error_seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        for (cell, byte) in self.error_text.iter().zip(bytes) {
            cell.store(*byte, Ordering::Relaxed);
        }
        self.error_len.store(
            if error.is_some() {
                bytes.len() as u32 + 1
            } else {
                0
            },
            Ordering::Relaxed,
        );
        self.error_at.store(
            if error.is_some() { at } else { NO_TIME },
            Ordering::Relaxed,
        );
        self.error_seq.fetch_add(1, Ordering::Release);
    }

    pub(super) fn wake(&self) {
        let latch = self.latch.load(Ordering::Acquire);
        if !latch.is_null() {
            // SAFETY: the pointer is the worker's PGPROC latch, which lives in shared memory for
            // the server's life; setting a latch that has since been reused only causes a
            // spurious wake-up of its new owner.
            unsafe { pg_sys::SetLatch(latch) };
        }
    }

    pub fn snapshot(&self) -> SlotSnapshot {
        let (last_error, last_error_at) = loop {
            let before = self.error_seq.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let len = self.error_len.load(Ordering::Relaxed) as usize;
            let at = self.error_at.load(Ordering::Relaxed);
            let text: Vec<u8> = self.error_text[..len.saturating_sub(1).min(ERROR_BYTES)]
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
            fence(Ordering::Acquire);
            if self.error_seq.load(Ordering::Relaxed) == before {
                let error = (len > 0).then(|| String::from_utf8_lossy(&text).into_owned());
                break (error, time_or_null(at));
            }
        };
        SlotSnapshot {
            pid: self.pid.load(Ordering::Acquire),
            state: WorkerState::from_u8(self.state.load(Ordering::Relaxed)),
            dedupe: match self.dedupe.load(Ordering::Relaxed) {
                1 => Some(InUse::Off.name()),
                2 => Some(InUse::Markers.name()),
                3 => Some(InUse::Idmp.name()),
                _ => None,
            },
            published: self.published.load(Ordering::Relaxed) as i64,
            last_batch_at: time_or_null(self.last_batch_at.load(Ordering::Relaxed)),
            last_error,
            last_error_at,
        }
    }
}

/// Cuts `text` to at most `max` bytes on a character boundary.
fn truncate(text: &str, max: usize) -> &[u8] {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text.as_bytes()[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_round_trips_and_clears() {
        let slot = WorkerSlot::new();
        assert!(slot.snapshot().last_error.is_none());
        slot.set_error(Some("connection refused"), 42);
        let snap = slot.snapshot();
        assert_eq!(snap.last_error.as_deref(), Some("connection refused"));
        assert_eq!(snap.last_error_at, Some(42));
        slot.set_error(Some(""), 43);
        assert_eq!(slot.snapshot().last_error.as_deref(), Some(""));
        slot.set_error(None, 44);
        assert!(slot.snapshot().last_error.is_none());
        assert!(slot.snapshot().last_error_at.is_none());
    }

    #[test]
    fn long_errors_are_cut_on_a_character_boundary() {
        let slot = WorkerSlot::new();
        let long = "é".repeat(200); // 400 bytes
        slot.set_error(Some(&long), 1);
        let kept = slot.snapshot().last_error.unwrap();
        assert_eq!(kept, "é".repeat(128));
    }
}

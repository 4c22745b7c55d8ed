//! Moving the delayed events that are due from `outbox_delayed` into `outbox`, where the claims
//! find them: how often a pass does it, and the move itself, which warns of each event that had
//! to take a new id.

use std::ops::Range;
use std::time::{Duration, Instant};

use pgrx::prelude::*;

use super::statements::Statements;

/// How often the relay moves due delayed events into `outbox`, at most (and at least twice per
/// `outbox.poll_interval`); at once again while a move finds a full batch.
const MOVE_DUE_EVERY: Duration = Duration::from_millis(100);

/// When due delayed events were last moved into `outbox`, and whether that move was full.
#[derive(Default)]
pub struct DelayedMoves {
    moved_at: Option<Instant>,
    moved_full: bool,
}

/// What a move did.
pub struct Moved {
    /// Whether any event moved.
    pub any: bool,
    /// Whether an event went into `outbox` under another id than its own.
    pub renumbered: bool,
}

impl DelayedMoves {
    /// Whether a pass at `now` moves due delayed events first.
    pub fn due(&self, now: Instant, poll_interval: Duration) -> bool {
        let move_every = (poll_interval / 2).min(MOVE_DUE_EVERY);
        self.moved_at
            .is_none_or(|at| now.duration_since(at) >= move_every || self.moved_full)
    }

    /// Moves up to `batch_size` due delayed events of `lanes` into `outbox`, warning (as worker
    /// `index`) of each that takes a new id because `outbox` holds another event with its own.
    pub fn move_due(
        &mut self,
        now: Instant,
        statements: &Statements,
        batch_size: usize,
        lanes: &Range<i16>,
        index: usize,
    ) -> Moved {
        let moved = statements.move_due(batch_size, lanes);
        self.moved_at = Some(now);
        self.moved_full = moved.count == batch_size;
        let renumbered = !moved.renumbered.is_empty();
        for (delayed, id) in moved.renumbered {
            warning!(
                "outbox relay {index}: delayed event {delayed} is due, but outbox holds another \
                 event with id {delayed} (ids used again): it goes into outbox as event {id}"
            );
        }
        Moved {
            any: moved.count > 0,
            renumbered,
        }
    }
}

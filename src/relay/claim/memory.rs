//! What the relay's claims remember from pass to pass: where the next claim may start, for
//! which extension and lanes that holds, whether an event in those lanes has failed, where the
//! look for held events stands, and when events whose retry is due were last looked for.

use std::ops::Range;
use std::time::Instant;

use pgrx::pg_sys;

use super::cursor::ClaimStart;
use super::hold::Sweep;
use super::retry::FailingLook;

pub struct Claims {
    /// Where the next claim may start (see `cursor.rs`).
    pub start: ClaimStart,
    /// The extension the last pass claimed in, and the lanes of this worker's share then: what
    /// `start` knows holds for them alone.
    pub claiming_in: Option<pg_sys::Oid>,
    pub lanes: Option<Range<i16>>,
    /// Whether an event in this worker's lanes had failed when last looked, over which lanes,
    /// and when that was.
    pub failing: FailingLook,
    /// Where the look for held events whose key has nothing before them stands (see `hold.rs`).
    pub sweep: Sweep,
    /// When a claim last looked for events whose retry is due. Only the relay schedules retries,
    /// and an event it charged counts as failing (`attempts > 0`) until it is out: while
    /// nothing in its lanes is failing, a pass looks for due events once per
    /// `outbox.poll_interval`, as the poll would (for a `next_attempt_at` set by hand), rather
    /// than with every claim (an index scan per partition each time).
    pub due_looked_at: Option<Instant>,
    /// Whether a `COMMIT PREPARED` can make events visible (see `cursor.rs`): then every claim
    /// from the lowest id reads every partition.
    pub two_phase: bool,
}

impl Claims {
    /// Nothing known yet; `two_phase` where a `COMMIT PREPARED` can make events visible.
    pub fn new(two_phase: bool) -> Claims {
        Claims {
            start: ClaimStart::default(),
            claiming_in: None,
            lanes: None,
            failing: FailingLook::default(),
            sweep: Sweep::default(),
            due_looked_at: None,
            two_phase,
        }
    }
}

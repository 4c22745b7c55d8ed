//! Charging the events Redis refused: each failed event's mark taken back, an attempt charged
//! and its retry scheduled; those out of attempts (or that retrying cannot help) buried in
//! `outbox_dead`; and the events held behind a key's first failed event released once it is out
//! or buried.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use outbox_redis::encode;
use pgrx::prelude::*;

use super::progress::{lowest, Freed};
use crate::pg::worker;
use crate::relay::claim::cursor::ClaimStart;
use crate::relay::claim::retry::{self, RetrySchedule};
use crate::relay::claim::Failure;
use crate::relay::statements::Statements;
use crate::shmem::{Counts, WorkerSlot};

/// What charging failures borrows of a pass.
pub struct Charges<'a> {
    pub index: usize,
    pub max_attempts: i32,
    pub statements: &'a Statements,
    /// Forgotten when held events are released: they are below it.
    pub start: &'a mut ClaimStart,
    pub retries: &'a mut RetrySchedule,
    pub uncommitted: &'a mut Counts,
    pub slot: &'static WorkerSlot,
}

impl Charges<'_> {
    /// Releases the held events of the keys of the events `anchors`, each its key's first that
    /// failed and now out or about to be buried (`buried`), or a held event with nothing before
    /// it in its key; says whether any was released. The released events are below the cursor,
    /// and a claim past it could take a later event of their key before them: the claims left
    /// in this pass start from the lowest id.
    pub fn release_behind(&mut self, anchors: &[i64], buried: &[i64]) -> bool {
        let mut any = false;
        for &anchor in anchors {
            any |= !self.statements.release(anchor, buried).is_empty();
        }
        if any {
            self.start.forget();
        }
        any
    }

    /// Takes the mark back from each event that failed, charges it an attempt and schedules its
    /// retry; buries those out of attempts, and those that retrying cannot help, releasing the
    /// events held behind them. Returns the lowest id buried among events that had failed
    /// before this pass (claims may have passed by the later events of their keys; an event
    /// failing for the first time held none back), and whether held events were released.
    pub fn charge(&mut self, failures: Vec<Failure>) -> Freed {
        let charges: Vec<(i64, String, Duration)> = failures
            .iter()
            .map(|f| {
                let delay = retry::delay(f.attempts.saturating_add(1));
                (f.id, f.error.clone(), delay)
            })
            .collect();
        let attempts: HashMap<i64, i32> = self
            .statements
            .record_failures(&charges)
            .into_iter()
            .map(|c| (c.id, c.attempts))
            .collect();
        let mut exhausted = Vec::new();
        let mut released = None;
        let mut last_error = None;
        // The events whose attempt was recorded (one gone from the table meanwhile was not).
        let failures_charged = attempts.len() as u64;
        for failure in failures {
            let Some(&attempts) = attempts.get(&failure.id) else {
                continue;
            };
            let error = encode::ascii_safe(&failure.error);
            if failure.permanent || attempts >= self.max_attempts {
                self.log_buried(&failure, attempts, &error);
                exhausted.push(failure.id);
                if failure.attempts > 0 {
                    released = lowest(released, Some(failure.id));
                }
            } else {
                if attempts == 1 {
                    self.log_first_failure(&failure, &error);
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
            self.statements.bury(exhausted);
        }
        self.slot.set_error(last_error.as_deref(), worker::now());
        Freed {
            buried: released,
            released: unheld,
        }
    }

    fn log_buried(&self, failure: &Failure, attempts: i32, error: &str) {
        let (index, id, topic) = (self.index, failure.id, encode::ascii_safe(&failure.topic));
        warning!(
            "outbox relay {index}: event {id} (topic {topic}) moved to outbox_dead after \
             {attempts} failed attempts: {error}"
        );
    }

    fn log_first_failure(&self, failure: &Failure, error: &str) {
        let (index, id, topic) = (self.index, failure.id, encode::ascii_safe(&failure.topic));
        let max_attempts = self.max_attempts;
        warning!(
            "outbox relay {index}: Redis rejected event {id} (topic {topic}): {error}; it will be \
             retried up to outbox.max_attempts ({max_attempts}) times"
        );
    }
}

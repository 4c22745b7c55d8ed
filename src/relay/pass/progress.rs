//! What a pass has learnt so far, chunk after chunk, and what it makes of it at the end: whether
//! the next pass follows at once, and where the next claims start. Pure logic, unit-tested.

use outbox_redis::encode::{Event, Ordering};
use outbox_redis::outcome::Outcome;

use super::batch::{Batch, Pass};
use crate::model::ring;
use crate::relay::claim::{Claimed, Failure};
use crate::relay::order::PassOrder;

/// A pass's account, carried from chunk to chunk.
pub struct Progress {
    /// What the transaction did so far.
    pub batch: Batch,
    /// Rows claimed so far, the blocked and unread ones included.
    pub claimed: usize,
    /// Whether a claim that looked for due events first left some out or was filled by them.
    pub more_due: bool,
    /// Which keys' events may go in this pass (see `order.rs`).
    pub order: PassOrder,
    /// The lowest id of the events that had failed and went out or to `outbox_dead` in this
    /// pass: the later events of their keys, passed by until now, have higher ids.
    pub released: Option<i64>,
    /// Whether a claim read its fill of bytes and left rows unread: the pass claims no more,
    /// since a later claim could take later events of their keys.
    pub full_of_bytes: bool,
    /// Whether held events were released in this pass.
    pub unheld: bool,
}

/// What charging failures freed.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Freed {
    /// The lowest id buried among events that had failed before this pass.
    pub buried: Option<i64>,
    /// Whether events held behind the buried ones were released.
    pub released: bool,
}

/// A chunk's answer, sorted.
#[derive(Default, Debug)]
pub struct Sorted {
    /// Events that had failed before and are now out: each the first failed event of its key,
    /// whose held events it releases.
    pub retried: Vec<i64>,
    /// Events Redis refused, to charge.
    pub failures: Vec<Failure>,
    /// Events held back behind an event of their key that failed in the same chunk: unmarked
    /// and uncharged, they wait for that one.
    pub held_back: Vec<i64>,
}

/// What the claims' cursor learns at the end of a pass.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewind {
    /// Events held back stay unpublished below the cursor: the next claims start from the
    /// lowest id.
    Forget,
    /// The keys of failed events are free again: the claims past the cursor start below this.
    To(i64),
    /// Nothing to change.
    Keep,
}

impl Progress {
    pub fn new() -> Progress {
        Progress {
            batch: Batch::nothing(Pass::Drained),
            claimed: 0,
            more_due: false,
            order: PassOrder::default(),
            released: None,
            full_of_bytes: false,
            unheld: false,
        }
    }

    /// Counts a claim; gives its events and its unreadable rows (its blocked rows are held
    /// already, see `Claimer::claim`).
    pub fn took(&mut self, claimed: Claimed) -> (Vec<Event>, Vec<Failure>) {
        self.claimed += claimed.len();
        self.more_due |= claimed.more_due;
        let Claimed {
            events,
            unreadable,
            left,
            ..
        } = claimed;
        if !left.is_empty() {
            self.full_of_bytes = true;
            self.order.left_for_later();
        }
        (events, unreadable)
    }

    /// Takes account of what charging failures freed.
    pub fn freed(&mut self, freed: Freed) {
        self.released = lowest(self.released, freed.buried);
        self.unheld |= freed.released;
    }

    /// Sorts a chunk's answer: `results[k]` is what became of `sent[k]`. Counts the published
    /// events and the partitions they were in, and holds the keys of the failed ones for the
    /// rest of the pass.
    pub fn sort(&mut self, sent: Vec<Event>, results: Vec<Outcome>) -> Sorted {
        // Failed and held back ones included: a later time than their rows' marks only delays
        // emptying.
        self.batch.leaves |= sent
            .iter()
            .fold(0, |leaves, e| leaves | 1 << ring::leaf_of(e.id));
        let mut sorted = Sorted::default();
        for (event, outcome) in sent.into_iter().zip(results) {
            let error = match outcome {
                Outcome::Added => {
                    self.batch.published += 1;
                    if event.attempts > 0 {
                        sorted.retried.push(event.id);
                    }
                    continue;
                }
                Outcome::HeldBack => {
                    sorted.held_back.push(event.id);
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
            // The later events of its key wait: those claimed in this pass are held back
            // (unmarked, they are claimed again once this one is out), and the claims after this
            // one pass them by in SQL.
            self.order.hold(match key {
                Some(key) => Ordering::Key(key),
                None => Ordering::Topic(topic.clone()),
            });
            sorted.failures.push(Failure {
                id,
                topic,
                attempts,
                error,
                permanent: false,
            });
        }
        // An event that had failed is out: its key's later events may go.
        self.released = lowest(self.released, sorted.retried.iter().min().copied());
        if !sorted.held_back.is_empty() {
            self.order.left_for_later();
        }
        sorted
    }

    /// The pass's end, of a batch of `batch_size`: what its transaction did, with whether the
    /// next pass follows at once, and what the claims' cursor learns.
    pub fn finish(self, batch_size: usize) -> (Batch, Rewind) {
        let deferred = self.order.deferred();
        let rewind = match self.released {
            _ if deferred => Rewind::Forget,
            Some(id) => Rewind::To(id),
            None => Rewind::Keep,
        };
        let mut batch = self.batch;
        // The next pass follows at once when this one claimed all it could; when it held events
        // back for going to another stream than their key's earlier ones; when it freed the keys
        // of failed events, whose later events the claims held or passed by; and when a claim
        // left due events out, or they filled it.
        let again = self.claimed == batch_size
            || self.full_of_bytes
            || (deferred && batch.published > 0)
            || self.released.is_some()
            || self.unheld
            || self.more_due;
        if again {
            batch.pass = Pass::Full;
        }
        (batch, rewind)
    }
}

/// The lower of two ids, either of which may be missing.
pub fn lowest(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    a.into_iter().chain(b).min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_redis::encode::sample_event;

    fn claimed(events: Vec<Event>) -> Claimed {
        Claimed {
            events,
            ..Claimed::default()
        }
    }

    #[test]
    fn a_drained_pass_waits_and_a_full_one_follows_at_once() {
        let mut progress = Progress::new();
        let (events, _) = progress.took(claimed(vec![sample_event(1, "t")]));
        let _ = progress.sort(events, vec![Outcome::Added]);
        let (batch, rewind) = progress.finish(100);
        assert!(matches!(batch.pass, Pass::Drained));
        assert_eq!((batch.published, rewind), (1, Rewind::Keep));

        let mut progress = Progress::new();
        let _ = progress.took(claimed(vec![sample_event(1, "t"), sample_event(2, "t")]));
        assert!(matches!(progress.finish(2).0.pass, Pass::Full));
    }

    #[test]
    fn a_failed_event_holds_its_key_and_a_retried_one_rewinds_the_cursor() {
        let mut progress = Progress::new();
        let mut failing = sample_event(5, "t");
        failing.key = Some("k".into());
        let mut retried = sample_event(3, "t");
        retried.attempts = 2;
        let sorted = progress.sort(
            vec![retried, failing],
            vec![Outcome::Added, Outcome::Failed("WRONGTYPE".into())],
        );
        assert_eq!(sorted.retried, [3]);
        assert_eq!(sorted.failures.len(), 1);
        assert_eq!(sorted.failures[0].id, 5);
        let mut later = vec![sample_event(9, "t")];
        later[0].key = Some("k".into());
        progress.order.admit(&mut later);
        assert!(later.is_empty(), "the failed event's key was not held");
        let (batch, rewind) = progress.finish(100);
        assert!(matches!(batch.pass, Pass::Full));
        assert_eq!(
            rewind,
            Rewind::Forget,
            "an event held back keeps the cursor low"
        );
    }

    #[test]
    fn freed_keys_rewind_to_the_lowest_id() {
        let mut progress = Progress::new();
        progress.freed(Freed {
            buried: Some(40),
            released: false,
        });
        progress.freed(Freed {
            buried: Some(12),
            released: true,
        });
        let (batch, rewind) = progress.finish(100);
        assert!(matches!(batch.pass, Pass::Full));
        assert_eq!(rewind, Rewind::To(12));
    }
}

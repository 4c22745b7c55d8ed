//! Keeping each key's order in a chunk sent again event by event. Pure logic, unit-tested.
//!
//! A chunk that breaks the connection is sent again event by event (see `connection.rs`), and
//! there the events of a key to one stream no longer fail together: one too large for Redis
//! fails alone. So a key stops at its first event that fails there, and its later events in the
//! chunk are not sent; they are held back like the events the relay holds back within a pass,
//! unmarked and uncharged.

use std::collections::HashSet;

use crate::encode::{Event, Ordering};
use crate::outcome::Outcome;

/// The keys (and key-less topics) of a chunk sent event by event whose event failed: the events
/// of a key after its failed one are not sent. Sent, they would be in the stream before it, which
/// goes out only once retried.
#[derive(Debug, Default)]
pub struct OneByOne {
    failed: HashSet<Ordering>,
}

impl OneByOne {
    /// Whether `event` may be sent: no earlier event of its key (else topic) failed.
    pub fn may_send(&self, event: &Event) -> bool {
        self.failed.is_empty() || !self.failed.contains(&event.ordering())
    }

    /// Takes note of what became of `event`, sent alone.
    pub fn sent(&mut self, event: &Event, outcomes: &[Outcome]) {
        if outcomes.iter().any(|o| matches!(o, Outcome::Failed(_))) {
            self.failed.insert(event.ordering());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::sample_event;

    fn event(id: i64, topic: &str, key: Option<&str>) -> Event {
        Event {
            key: key.map(str::to_string),
            ..sample_event(id, topic)
        }
    }

    /// Sends `events` one at a time as `OneByOne` allows, each failing if its id is in `fails`;
    /// returns the outcomes and the ids sent.
    fn one_by_one(events: &[Event], fails: &[i64]) -> (Vec<Outcome>, Vec<i64>) {
        let mut stops = OneByOne::default();
        let mut sent = Vec::new();
        let outcomes = events
            .iter()
            .map(|event| {
                if !stops.may_send(event) {
                    return Outcome::HeldBack;
                }
                sent.push(event.id);
                let outcome = if fails.contains(&event.id) {
                    Outcome::Failed("too large".into())
                } else {
                    Outcome::Added
                };
                stops.sent(event, std::slice::from_ref(&outcome));
                outcome
            })
            .collect();
        (outcomes, sent)
    }

    #[test]
    fn sent_one_by_one_a_key_stops_at_its_first_failed_event() {
        let events = [
            event(1, "a", Some("k")),
            event(2, "a", Some("k")),
            event(3, "a", Some("j")),
            event(4, "a", Some("k")),
            event(5, "t", None),
            event(6, "t", None),
            event(7, "t", Some("i")),
            event(8, "u", None),
        ];
        let (outcomes, sent) = one_by_one(&events, &[2, 5]);
        // k goes out up to its failed event 2, and no further; the key-less events of topic t
        // stop at 5, while t's keyed events and other topics go on.
        assert_eq!(sent, [1, 2, 3, 5, 7, 8]);
        let failed = || Outcome::Failed("too large".into());
        assert_eq!(
            outcomes,
            [
                Outcome::Added,
                failed(),
                Outcome::Added,
                Outcome::HeldBack,
                failed(),
                Outcome::HeldBack,
                Outcome::Added,
                Outcome::Added,
            ]
        );
        // Nothing failed: everything is sent.
        let (outcomes, sent) = one_by_one(&events, &[]);
        assert_eq!(sent, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(outcomes.iter().all(|o| *o == Outcome::Added));
    }
}

//! Keeping each key's order within one pass. Pure logic, unit-tested.
//!
//! A pass may claim several events of one key (or, without a key, of one topic), and sends them
//! in one round trip. Redis refuses a stream's entries alike (a stream key holding another
//! type, say), so the events of a key that go to one stream succeed or fail together. Events of
//! a key that go to different streams do not: the first could be refused while the next, in
//! another stream, is added. So within a pass, a key's events go out only while they go to the
//! stream its first one went to; from its first event bound for another stream on, the key's
//! events are held back for a later pass, which claims them again in id order. A key whose event
//! failed is held back the same way for the rest of the pass (the passes after pass it by in
//! SQL, see `claim.rs`).
//!
//! A chunk that breaks the connection is sent again event by event (see `connection.rs`), and
//! there the events of a key to one stream no longer fail together: one too large for Redis
//! fails alone. So a key stops at its first event that fails there, and its later events in the
//! chunk are not sent; they are held back like the others, unmarked and uncharged.

use std::collections::{HashMap, HashSet};

use outbox_redis::encode::{Event, Ordering};

use super::pipeline::Outcome;

#[derive(Debug, Default)]
pub struct PassOrder {
    /// Keys (and key-less topics) whose remaining events wait for a later pass.
    held: HashSet<Ordering>,
    /// For each key sent in this pass, the topic its events went to.
    topics: HashMap<String, String>,
    /// Whether an event was held back: the next pass must then claim from the lowest id.
    deferred: bool,
}

impl PassOrder {
    /// Leaves in `events` (claimed in id order) those that may go out now, in order.
    pub fn admit(&mut self, events: &mut Vec<Event>) {
        let (held, topics) = (&mut self.held, &mut self.topics);
        let mut deferred = false;
        events.retain(|event| {
            let Some(key) = &event.key else {
                // A key-less event's order is its topic's, whose events share one stream.
                if !held.is_empty() && held.contains(&Ordering::Topic(event.topic.clone())) {
                    deferred = true;
                    return false;
                }
                return true;
            };
            if !held.is_empty() && held.contains(&Ordering::Key(key.clone())) {
                deferred = true;
                return false;
            }
            match topics.get(key) {
                None => {
                    topics.insert(key.clone(), event.topic.clone());
                    true
                }
                Some(topic) if *topic == event.topic => true,
                Some(_) => {
                    held.insert(Ordering::Key(key.clone()));
                    deferred = true;
                    false
                }
            }
        });
        self.deferred |= deferred;
    }

    /// Holds back the rest of a key's events (one of them failed).
    pub fn hold(&mut self, ordering: Ordering) {
        self.held.insert(ordering);
    }

    /// Notes that an event claimed in this pass was left for a later one after it was admitted
    /// (not sent behind a failed event of its key, see [`OneByOne`]).
    pub fn left_for_later(&mut self) {
        self.deferred = true;
    }

    /// Whether an event claimed in this pass was left for a later one.
    pub fn deferred(&self) -> bool {
        self.deferred
    }
}

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
    use outbox_redis::encode::sample_event;

    fn event(id: i64, topic: &str, key: Option<&str>) -> Event {
        Event {
            key: key.map(str::to_string),
            ..sample_event(id, topic)
        }
    }

    fn ids(events: &[Event]) -> Vec<i64> {
        events.iter().map(|e| e.id).collect()
    }

    #[test]
    fn a_key_goes_out_while_it_stays_on_its_first_stream() {
        let mut order = PassOrder::default();
        let mut events = vec![
            event(1, "a", Some("k")),
            event(2, "a", Some("k")),
            event(3, "b", Some("k")),
            event(4, "a", Some("k")),
            event(5, "b", Some("j")),
            event(6, "a", None),
            event(7, "b", None),
        ];
        order.admit(&mut events);
        assert_eq!(ids(&events), [1, 2, 5, 6, 7]);
        assert!(order.deferred());
        // The next chunk of the same pass: k stays held, j stays on b.
        let mut more = vec![event(8, "a", Some("k")), event(9, "b", Some("j"))];
        order.admit(&mut more);
        assert_eq!(ids(&more), [9]);
    }

    #[test]
    fn a_failed_key_or_topic_is_held_for_the_rest_of_the_pass() {
        let mut order = PassOrder::default();
        let mut first = vec![event(1, "a", Some("k")), event(2, "t", None)];
        order.admit(&mut first);
        assert_eq!(ids(&first), [1, 2]);
        assert!(!order.deferred());
        order.hold(Ordering::Key("k".into()));
        order.hold(Ordering::Topic("t".into()));
        let mut next = vec![
            event(3, "a", Some("k")),
            event(4, "t", None),
            event(5, "t", Some("other")),
            event(6, "u", None),
        ];
        order.admit(&mut next);
        assert_eq!(ids(&next), [5, 6]);
        assert!(order.deferred());
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

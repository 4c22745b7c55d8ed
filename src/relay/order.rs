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
//! SQL, see `sql.rs`). A chunk sent again event by event keeps its keys' order as
//! `one_by_one.rs` in outbox-redis says.

use std::collections::{HashMap, HashSet};

use outbox_redis::encode::{Event, Ordering};

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
    /// (not sent behind a failed event of its key, see `one_by_one.rs` in outbox-redis).
    pub fn left_for_later(&mut self) {
        self.deferred = true;
    }

    /// Whether an event claimed in this pass was left for a later one.
    pub fn deferred(&self) -> bool {
        self.deferred
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
}

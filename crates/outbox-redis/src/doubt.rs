//! Which events are in doubt, and how each went: an event sent in a transaction that did not
//! commit (its chunk's reply was lost, or a later chunk failed) may be in its stream, recorded
//! by the markers or by IDMP, whichever deduplicated it. Markers and IDMP do not see each
//! other's record, so such an event goes again the way it went (see
//! [`crate::server::choose_with_doubt`]) until a committed transaction has put it in its
//! stream, whichever pass sends it again: the next pass may reach only part of a chunk in doubt
//! (a smaller batch, a late commit below it, a key held back), and the rest must not switch
//! with the events the pass did reach.
//!
//! Nothing is in doubt in a steady stream: then a chunk costs a note of its events' identities,
//! dropped at the commit.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::encode::Event;
use crate::outcome::Outcome;
use crate::server::InUse;

/// An event's identity: its id and its `created_at` (ids can be used again).
type Identity = (i64, i64);

fn identity(event: &Event) -> Identity {
    (event.id, event.created_at)
}

/// The events in doubt, and those sent in the transaction in progress.
#[derive(Debug, Default)]
pub struct Doubt {
    /// Events sent in a transaction that did not commit: how each last went, and when.
    events: HashMap<Identity, (InUse, Instant)>,
    /// Events sent since the transaction began, and how (in doubt if it does not commit).
    sent: Vec<(Identity, InUse)>,
    /// Events in doubt that this transaction put in their stream: settled by its commit.
    settling: Vec<Identity>,
}

impl Doubt {
    /// How the events in doubt among `events` went, for [`crate::server::choose_with_doubt`]:
    /// markers if any went with markers (where Redis has IDMP, markers also record IDMP's
    /// identities, so they serve events that went with IDMP too), else IDMP if any went so.
    pub fn way_for(&self, events: &[Event]) -> Option<InUse> {
        if self.events.is_empty() {
            return None;
        }
        let mut way = None;
        for event in events {
            match self.events.get(&identity(event)) {
                Some((InUse::Markers, _)) => return Some(InUse::Markers),
                Some((InUse::Idmp, _)) => way = Some(InUse::Idmp),
                _ => {}
            }
        }
        way
    }

    /// `events` were sent (or may have been), deduplicated `way`.
    pub fn sent(&mut self, events: &[Event], way: InUse) {
        if way != InUse::Off {
            self.sent.extend(events.iter().map(|e| (identity(e), way)));
        }
    }

    /// Redis answered `results` for `events`: those in doubt that are now in their stream are
    /// settled if this transaction commits.
    pub fn answered(&mut self, events: &[Event], results: &[Outcome]) {
        if self.events.is_empty() {
            return;
        }
        for (event, result) in events.iter().zip(results) {
            let id = identity(event);
            if *result == Outcome::Added && self.events.contains_key(&id) {
                self.settling.push(id);
            }
        }
    }

    /// The transaction committed: what it put in the streams is settled.
    pub fn committed(&mut self, now: Instant, ttl: Duration) {
        for id in self.settling.drain(..) {
            self.events.remove(&id);
        }
        self.sent.clear();
        self.expire(now, ttl);
    }

    /// The transaction rolled back: what it sent is in doubt.
    pub fn rolled_back(&mut self, now: Instant, ttl: Duration) {
        for (id, way) in self.sent.drain(..) {
            self.events.insert(id, (way, now));
        }
        self.settling.clear();
        self.expire(now, ttl);
    }

    /// Forgets what went more than `ttl` ago: neither the markers nor IDMP's window hold it
    /// longer, so the way it went no longer matters.
    fn expire(&mut self, now: Instant, ttl: Duration) {
        if !self.events.is_empty() {
            self.events
                .retain(|_, (_, at)| now.saturating_duration_since(*at) < ttl);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(ids: std::ops::Range<i64>) -> Vec<Event> {
        ids.map(|id| Event {
            id,
            topic: "t".into(),
            payload: "{}".into(),
            created_at: 1_000 + id,
            attempts: 0,
            key: None,
            headers: None,
            group: 0,
        })
        .collect()
    }

    const TTL: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_steady_stream_leaves_nothing_in_doubt() {
        let mut doubt = Doubt::default();
        let now = Instant::now();
        for start in (0..1_000).step_by(100) {
            let chunk = events(start..start + 100);
            assert_eq!(doubt.way_for(&chunk), None);
            doubt.sent(&chunk, InUse::Idmp);
            doubt.answered(&chunk, &vec![Outcome::Added; chunk.len()]);
            doubt.committed(now, TTL);
        }
        assert!(doubt.events.is_empty());
        assert!(doubt.sent.is_empty());
    }

    #[test]
    fn a_chunk_in_doubt_goes_the_way_it_went_until_a_commit_has_each_event() {
        let mut doubt = Doubt::default();
        let now = Instant::now();
        // Forty events sent with markers; the reply is lost and the transaction rolls back.
        doubt.sent(&events(1..41), InUse::Markers);
        doubt.rolled_back(now, TTL);
        assert_eq!(doubt.events.len(), 40);
        // The next pass reaches ten of them, and events that were never sent.
        let first = events(1..11);
        assert_eq!(doubt.way_for(&first), Some(InUse::Markers));
        assert_eq!(doubt.way_for(&events(100..110)), None);
        doubt.sent(&first, InUse::Markers);
        doubt.answered(&first, &vec![Outcome::Added; 10]);
        doubt.committed(now, TTL);
        // The other thirty are still in doubt, whatever the commit in between.
        assert_eq!(doubt.events.len(), 30);
        assert_eq!(doubt.way_for(&events(11..41)), Some(InUse::Markers));
        assert_eq!(doubt.way_for(&events(40..60)), Some(InUse::Markers));
        assert_eq!(doubt.way_for(&first), None);
    }

    #[test]
    fn only_what_a_committed_transaction_put_in_its_stream_is_settled() {
        let mut doubt = Doubt::default();
        let now = Instant::now();
        let chunk = events(1..5);
        doubt.sent(&chunk, InUse::Idmp);
        doubt.rolled_back(now, TTL);
        // Sent again: one refused, one held back; then the transaction rolls back anyway.
        doubt.sent(&chunk, InUse::Idmp);
        let results = [
            Outcome::Added,
            Outcome::Failed("OOM".into()),
            Outcome::HeldBack,
            Outcome::Added,
        ];
        doubt.answered(&chunk, &results);
        doubt.rolled_back(now, TTL);
        assert_eq!(doubt.events.len(), 4);
        // Sent again and committed: the refused and held-back ones stay in doubt.
        doubt.sent(&chunk, InUse::Idmp);
        doubt.answered(&chunk, &results);
        doubt.committed(now, TTL);
        assert_eq!(doubt.events.len(), 2);
        assert_eq!(doubt.way_for(&chunk[1..3]), Some(InUse::Idmp));
    }

    #[test]
    fn markers_win_over_idmp_and_dedupe_off_leaves_no_doubt() {
        let mut doubt = Doubt::default();
        let now = Instant::now();
        doubt.sent(&events(1..3), InUse::Idmp);
        doubt.sent(&events(3..5), InUse::Markers);
        doubt.sent(&events(5..7), InUse::Off);
        doubt.rolled_back(now, TTL);
        assert_eq!(doubt.way_for(&events(1..3)), Some(InUse::Idmp));
        assert_eq!(doubt.way_for(&events(1..5)), Some(InUse::Markers));
        assert_eq!(doubt.way_for(&events(5..7)), None);
        // The same id with another created_at (ids used again) is another event.
        let mut again = events(1..3);
        again[0].created_at += 1;
        again[1].created_at += 1;
        assert_eq!(doubt.way_for(&again), None);
    }

    #[test]
    fn doubt_older_than_the_records_is_forgotten() {
        let mut doubt = Doubt::default();
        let start = Instant::now();
        doubt.sent(&events(1..11), InUse::Markers);
        doubt.rolled_back(start, TTL);
        doubt.sent(&events(11..21), InUse::Markers);
        doubt.rolled_back(start + TTL / 2, TTL);
        doubt.committed(start + TTL, TTL);
        assert_eq!(doubt.events.len(), 10);
        assert_eq!(doubt.way_for(&events(1..11)), None);
    }
}

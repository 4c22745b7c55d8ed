//! What a claim took, and how its rows are read: one at a time as the executor produces them
//! (`query.rs`), their text converted to UTF-8 event by event, so that an event whose text
//! cannot be is charged alone instead of failing the claim. The claims themselves are prepared
//! in `relay/statements.rs`, their SQL is in `relay/sql.rs`.

use outbox_redis::cloudevents;
use outbox_redis::encode::Event;
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::query::Plan;
use crate::model::lane;
use crate::pg::utf8::{self, NotUtf8};

/// What a claim took: the events to publish, those whose text cannot be sent as UTF-8 (with the
/// reason), which must be charged in the same transaction, and those that wait behind an earlier
/// event of their key that failed or is held, which must be held in the same transaction.
#[derive(Default)]
pub struct Claimed {
    pub events: Vec<Event>,
    pub unreadable: Vec<Failure>,
    pub blocked: Vec<i64>,
    /// The claim looked for events whose retry is due, and found all it could take.
    pub looked_due: bool,
    /// A claim that looked for due events first left some out, or was filled by them: more
    /// may be due.
    pub more_due: bool,
    /// The claim looked for events that never failed (due events first may leave no room).
    pub looked_fresh: bool,
    /// The highest id among the events claimed that never failed.
    pub(crate) fresh_highest: Option<i64>,
    /// Rows claimed (and locked) but left unread, the claim having read [`CLAIM_BYTES`]:
    /// they stay unpublished and go out in a later pass.
    pub left: Vec<i64>,
}

impl Claimed {
    /// How many rows the claim took, the blocked ones included: its `LIMIT` counts them.
    pub fn len(&self) -> usize {
        self.events.len() + self.unreadable.len() + self.blocked.len() + self.left.len()
    }

    /// The highest id claimed among the events that never failed, if any: how far the claim
    /// reached in id order. Due events are left out: their ids say nothing of where the fresh
    /// ones stand, and a cursor moved past fresh events the claim did not take would skip them.
    pub fn highest(&self) -> Option<i64> {
        self.fresh_highest
    }

    /// The highest id of everything in this claim. Blocked rows count: they are held in the
    /// same transaction, and leave the index of fresh events as published ones do.
    pub(crate) fn highest_of_all(&self) -> Option<i64> {
        let events = self.events.iter().map(|e| e.id);
        let unreadable = self.unreadable.iter().map(|f| f.id);
        events
            .chain(unreadable)
            .chain(self.blocked.iter().copied())
            .chain(self.left.iter().copied())
            .max()
    }

    /// Keeps at most `n` of the rows: readable events first, then unreadable ones, then blocked
    /// ones, then those left unread. Those left out stay as they are, locked until the
    /// transaction ends.
    pub(crate) fn truncate(&mut self, n: usize) {
        self.events.truncate(n);
        self.unreadable.truncate(n - self.events.len());
        self.blocked
            .truncate(n - self.events.len() - self.unreadable.len());
        self.left
            .truncate(n - self.events.len() - self.unreadable.len() - self.blocked.len());
    }

    /// Adds `due`'s rows and keeps the events in id order.
    pub(crate) fn add_due(&mut self, due: Claimed) {
        self.blocked.extend(due.blocked);
        if !due.events.is_empty() || !due.unreadable.is_empty() || !due.left.is_empty() {
            self.events.extend(due.events);
            self.unreadable.extend(due.unreadable);
            self.left.extend(due.left);
            self.events.sort_unstable_by_key(|e| e.id);
        }
    }
}

/// An event that could not be published this time.
#[derive(Debug)]
pub struct Failure {
    pub id: i64,
    pub topic: String,
    /// Attempts charged before this one.
    pub attempts: i32,
    pub error: String,
    /// Retrying cannot help (its text cannot be sent as UTF-8): it goes to `outbox_dead` now.
    pub permanent: bool,
}

/// Takes out of `events` those that cannot be written as CloudEvents (enqueued before
/// `outbox.message_format` became `cloudevents`, or inserted by hand), as failures retrying
/// cannot help: they go to `outbox_dead` with the reason, as unreadable text does.
pub fn not_cloudevents(events: &mut Vec<Event>) -> Vec<Failure> {
    let mut refused = Vec::new();
    events.retain(|event| match cloudevents::problem(event) {
        None => true,
        Some(why) => {
            refused.push(Failure {
                id: event.id,
                topic: event.topic.clone(),
                attempts: event.attempts,
                error: format!("not a CloudEvent: {why}"),
                permanent: true,
            });
            false
        }
    });
    refused
}

/// Runs the claim `statement` for up to `limit` events of `lanes` (past or up to `id`, for the
/// claims that take one), reading its rows as the executor produces them.
pub fn run_claim(
    statement: &Plan,
    limit: usize,
    lanes: &std::ops::Range<i16>,
    id: Option<i64>,
) -> Claimed {
    let mut args = vec![
        (pg_sys::INT8OID, pg_sys::Datum::from(limit as i64)),
        (pg_sys::INT2OID, pg_sys::Datum::from(lanes.start)),
        (pg_sys::INT2OID, pg_sys::Datum::from(lanes.end)),
    ];
    args.extend(id.map(|id| (pg_sys::INT8OID, pg_sys::Datum::from(id))));
    let utf8_database = utf8::database_is_utf8();
    let mut claimed = Claimed {
        events: Vec::with_capacity(limit.min(1024)),
        ..Claimed::default()
    };
    let mut bytes = 0;
    statement.run(
        &args,
        &mut |values, nulls| {
            if bytes >= CLAIM_BYTES {
                // Locked by the claim, and left for a later pass (`left`); the first row is
                // always read, however long.
                claimed.left.push(values[0].value() as i64);
                return;
            }
            let read = claimed.events.len();
            read_row(&mut claimed, values, nulls, utf8_database);
            bytes += claimed.events[read..]
                .iter()
                .map(Event::text_bytes)
                .sum::<usize>();
        },
        "claim failed",
    );
    claimed
}

/// Most bytes of text (topic, payload, key, headers) one claim statement reads (a claim runs up
/// to three: due events, and fresh ones above and below the cursor): a chunk of large events
/// is held in memory twice over (as read, and as sent), and the next chunk is claimed while
/// Redis works on it.
const CLAIM_BYTES: usize = 16 * 1024 * 1024;

/// Reads one claimed row, its columns in the order of `CLAIMED_TYPES` (`sql.rs`). Topic and
/// payload are read as the database stores them and converted to UTF-8 here, one event at a
/// time, so that text which cannot be converted is charged to its event instead of failing the
/// claim. Of a blocked row only the id is read.
fn read_row(claimed: &mut Claimed, values: &[pg_sys::Datum], nulls: &[bool], utf8_database: bool) {
    let column = |i: usize| (!nulls[i]).then_some(values[i]);
    // By value, as a 64-bit server passes bigint, timestamptz and integer datums.
    let Some(id) = column(0).map(|d| d.value() as i64) else {
        error!("outbox relay: a claimed row has no id");
    };
    if column(7).is_some_and(|d| d.value() != 0) {
        claimed.blocked.push(id);
        return;
    }
    let created_at = column(3).map(|d| d.value() as i64);
    let attempts = column(4).map_or(0, |d| d.value() as i32);
    let group = column(8).map_or(0, |d| lane::group_of(d.value() as i16));
    let text = |i: usize, name: &str| match column(i) {
        None => Ok(None),
        // SAFETY: a non-null text datum of the row being read.
        Some(datum) => unsafe { utf8_text(datum, utf8_database) }
            .map(Some)
            .map_err(|why| format!("{name} {why}")),
    };
    let required = |i: usize, name: &str| {
        text(i, name).and_then(|v| v.ok_or_else(|| format!("{name} is null")))
    };
    let topic = required(1, "topic");
    let payload = required(2, "payload");
    let key = text(5, "key");
    let headers = text(6, "headers");
    match (topic, payload, key, headers, created_at) {
        (Ok(topic), Ok(payload), Ok(key), Ok(headers), Some(created_at)) => {
            claimed.events.push(Event {
                id,
                topic,
                payload,
                created_at,
                attempts,
                key,
                headers,
                group,
            })
        }
        (topic, payload, key, headers, created_at) => {
            let error = [
                topic.as_ref().err(),
                payload.as_ref().err(),
                key.as_ref().err(),
                headers.as_ref().err(),
            ]
            .into_iter()
            .flatten()
            .next()
            .cloned()
            .or_else(|| {
                created_at
                    .is_none()
                    .then(|| "created_at is null".to_string())
            })
            .unwrap_or_default();
            claimed.unreadable.push(Failure {
                id,
                topic: topic.unwrap_or_default(),
                attempts,
                error,
                permanent: true,
            });
        }
    }
}

/// A text datum as UTF-8; the error says why it cannot be, after the column's name.
///
/// # Safety
/// `datum` is a non-null `text` datum, valid while its row is being read.
unsafe fn utf8_text(datum: pg_sys::Datum, utf8_database: bool) -> Result<String, NotUtf8> {
    let stored = datum.cast_mut_ptr::<pg_sys::varlena>();
    // SAFETY: the caller's promise. Only a compressed or out-of-line value needs PostgreSQL to
    // fetch it (into the executor's memory); a plain or short one is read where it is.
    let text = unsafe {
        if pgrx::varlena::varatt_is_4b_c(stored) || pgrx::varlena::varatt_is_1b_e(stored) {
            pg_sys::pg_detoast_datum_packed(stored)
        } else {
            stored
        }
    };
    // SAFETY: a varlena in memory, as just made sure.
    let bytes = unsafe { pgrx::varlena::varlena_to_byte_slice(text) };
    let invalid = |e: std::str::Utf8Error| NotUtf8::Invalid(e.to_string());
    let read = if utf8_database {
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(invalid)
    } else {
        utf8::to_utf8(bytes).and_then(|utf8| {
            String::from_utf8(utf8.into_owned()).map_err(|e| invalid(e.utf8_error()))
        })
    };
    if text != stored {
        // SAFETY: the copy fetched above, read no more: freed now rather than with the
        // statement, which may fetch hundreds of them.
        unsafe { pg_sys::pfree(text.cast()) };
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_redis::encode::sample_event;

    fn failure(id: i64) -> Failure {
        Failure {
            id,
            topic: "t".into(),
            attempts: 0,
            error: "not UTF-8".into(),
            permanent: true,
        }
    }

    fn claimed(events: &[i64], unreadable: &[i64], blocked: &[i64]) -> Claimed {
        Claimed {
            events: events.iter().map(|&id| sample_event(id, "t")).collect(),
            unreadable: unreadable.iter().map(|&id| failure(id)).collect(),
            blocked: blocked.to_vec(),
            ..Claimed::default()
        }
    }

    #[test]
    fn events_that_cannot_be_cloudevents_fail_for_good() {
        let mut events: Vec<Event> = (1..=4).map(|id| sample_event(id, "t")).collect();
        events[1].headers = Some(r#"{"X-Tenant": "7"}"#.into());
        events[2].headers = Some(r#"{"tenant": "7"}"#.into());
        events[3].key = Some("a\nb".into());
        let refused = not_cloudevents(&mut events);
        let kept: Vec<i64> = events.iter().map(|e| e.id).collect();
        assert_eq!(kept, [1, 3]);
        let ids: Vec<i64> = refused.iter().map(|f| f.id).collect();
        assert_eq!(ids, [2, 4]);
        assert!(refused.iter().all(|f| f.permanent));
        assert!(
            refused[0].error.contains("X-Tenant"),
            "{}",
            refused[0].error
        );
    }

    #[test]
    fn blocked_rows_count_against_the_limit_and_move_the_reach() {
        let claim = claimed(&[3, 5], &[4], &[1, 2, 9]);
        // The claim's LIMIT counted them: a chunk of blocked rows is a full chunk.
        assert_eq!(claim.len(), 6);
        // Held in the same transaction, they leave the index of fresh events behind the cursor.
        assert_eq!(claim.highest_of_all(), Some(9));
        assert_eq!(claimed(&[], &[], &[]).highest_of_all(), None);
    }

    #[test]
    fn a_truncated_claim_keeps_events_then_unreadable_then_blocked_rows() {
        let mut claim = claimed(&[3, 5], &[4], &[1, 2, 9]);
        claim.truncate(4);
        assert_eq!(claim.len(), 4);
        assert_eq!(claim.blocked, [1]);
        claim.truncate(2);
        assert_eq!((claim.events.len(), claim.unreadable.len()), (2, 0));
        assert!(claim.blocked.is_empty());
    }

    #[test]
    fn due_rows_join_in_id_order_with_their_blocked_rows() {
        let mut claim = claimed(&[3, 8], &[], &[6]);
        claim.add_due(claimed(&[1, 5], &[], &[2]));
        let ids: Vec<i64> = claim.events.iter().map(|e| e.id).collect();
        assert_eq!(ids, [1, 3, 5, 8]);
        assert_eq!(claim.blocked, [6, 2]);
        // Due rows that are all blocked still join.
        claim.add_due(claimed(&[], &[], &[7]));
        assert_eq!(claim.len(), 7);
    }
}

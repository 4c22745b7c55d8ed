//! A table changed by hand: its payload column changed to `json`, new columns with defaults (one
//! of them volatile), a column that takes the enqueue off its fast path. `outbox_enqueue`
//! writes each event as an INSERT would, key, headers, lane and delay included, and the relay
//! publishes it. Against a real PostgreSQL and Redis (how a session's insert follows changes
//! made while it runs is in `enqueue.rs`).

mod common;

use std::time::Duration;

use common::sql::one;
use common::{wait_until, Pg, Redis};

/// The payload column changed to `json`: outbox_enqueue stores its jsonb argument converted to
/// the column's type (not a jsonb datum in a json column), and the relay publishes the text. A
/// session that enqueued before the change follows it.
#[test]
fn a_payload_column_changed_to_json_takes_and_relays_events() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut app = pg.with_extension();
    pg.wait_for_workers(1);
    let before: i64 = one(&mut app, "SELECT outbox_enqueue('t', '{\"a\": 0}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("t") == 1));

    pg.connect()
        .batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE json USING payload::json")
        .unwrap();
    let id: i64 = app
        .query_one("SELECT outbox_enqueue('t', '{\"a\": 1}')", &[])
        .unwrap_or_else(|e| panic!("outbox_enqueue failed on a json column: {e:?}"))
        .get(0);
    let stored: String = app
        .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(stored, r#"{"a": 1}"#);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("t") == 2),
        "the event was not published"
    );
    let entries = redis.entries("t");
    assert_eq!(redis.ids("t"), [before, id]);
    assert_eq!(entries[1].1["payload"], r#"{"a": 1}"#);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
}

/// New columns with defaults, one NOT NULL and one volatile (evaluated per row): outbox_enqueue
/// fills them as an INSERT would, and the relay publishes the event. A session that enqueued
/// before the change follows it.
#[test]
fn new_columns_with_defaults_are_filled_on_enqueue() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut app = pg.with_extension();
    pg.wait_for_workers(1);
    let before: i64 = one(&mut app, "SELECT outbox_enqueue('t', '{}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("t") == 1));

    pg.connect()
        .batch_execute(
            "ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'acme';
             ALTER TABLE outbox ADD COLUMN trace uuid DEFAULT gen_random_uuid();",
        )
        .unwrap();
    let ids: Vec<i64> = (0..2)
        .map(|_| {
            app.query_one("SELECT outbox_enqueue('t', '{}')", &[])
                .unwrap_or_else(|e| panic!("outbox_enqueue failed with new columns: {e:?}"))
                .get(0)
        })
        .collect();
    let rows = app
        .query(
            "SELECT tenant, trace::text FROM outbox WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )
        .unwrap();
    let tenants: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let traces: Vec<Option<String>> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(tenants, ["acme", "acme"]);
    assert!(traces.iter().all(Option::is_some), "{traces:?}");
    assert_ne!(traces[0], traces[1], "the volatile default runs per row");
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("t") == 3),
        "the events were not published"
    );
    assert_eq!(redis.ids("t"), [before, ids[0], ids[1]]);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
}

/// A table changed by hand takes a plain INSERT instead of the fast path: the key, the headers
/// and the lane are written the same way; a delayed event goes to outbox_delayed as always.
#[test]
fn a_table_changed_by_hand_gets_the_same_columns() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 'acme'")
        .unwrap();
    let mut transaction = client.transaction().unwrap();
    let id: i64 = transaction
        .query_one(
            "SELECT outbox_enqueue('t', '{}', 'k-1', '{\"a\": \"b\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    let row = transaction
        .query_one(
            "SELECT key, headers::text, lane, outbox_lane('k-1', 't'), tenant, \
                    next_attempt_at IS NULL \
             FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap();
    // A delayed event waits in outbox_delayed, whatever outbox's shape.
    let delayed: i64 = transaction
        .query_one(
            "SELECT outbox_enqueue('t', '{}', 'k-1', deliver_after => '90 minutes')",
            &[],
        )
        .unwrap()
        .get(0);
    let waiting = transaction
        .query_one(
            "SELECT key, lane, deliver_at = now() + interval '90 minutes', \
                    (SELECT count(*) FROM outbox WHERE id = $1) \
             FROM outbox_delayed WHERE id = $1",
            &[&delayed],
        )
        .unwrap();
    transaction.commit().unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("k-1"));
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some(r#"{"a": "b"}"#)
    );
    assert_eq!(row.get::<_, i16>(2), row.get::<_, i16>(3));
    assert_eq!(
        row.get::<_, String>(4),
        "acme",
        "the plain INSERT was not taken"
    );
    assert!(
        row.get::<_, bool>(5),
        "an event without delay has a retry time"
    );
    assert_eq!(waiting.get::<_, Option<String>>(0).as_deref(), Some("k-1"));
    assert_eq!(waiting.get::<_, i16>(1), row.get::<_, i16>(3));
    assert!(
        waiting.get::<_, bool>(2),
        "the delivery time is not the transaction's start plus the delay"
    );
    assert_eq!(
        waiting.get::<_, i64>(3),
        0,
        "the delayed event is in outbox too"
    );
}

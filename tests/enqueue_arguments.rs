//! `outbox_enqueue`'s last three arguments, a message key, headers and a delivery delay: the key
//! and the headers reach the stream entry beside the contract's fields (a long key whole,
//! however PostgreSQL stores it), and a delayed event goes out when it is due. Against a real
//! PostgreSQL and Redis (the order kept per key is in `keys.rs`; bad headers and delays are
//! refused in `regress/sql/enqueue_options.sql`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// Keys and headers
// ---------------------------------------------------------------------------------------------

/// The key and the headers go into the stream entry beside the contract's fields; the
/// two-argument call keeps its entry as it was; the lane is the key's, else the topic's.
#[test]
fn keys_and_headers_reach_the_stream_entry() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();
    let plain: i64 = client
        .query_one("SELECT outbox_enqueue('orders', '{\"n\": 1}')", &[])
        .unwrap()
        .get(0);
    let keyed: i64 = client
        .query_one(
            "SELECT outbox_enqueue('orders', '{\"n\": 2}', 'account-7', \
             '{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    let named: i64 = client
        .query_one(
            "SELECT outbox_enqueue('orders', '{\"n\": 3}', headers => '{\"a\": \"b\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    let empty_key: i64 = client
        .query_one("SELECT outbox_enqueue('orders', '{}', key => '')", &[])
        .unwrap()
        .get(0);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("orders") == 4),
        "the events did not arrive"
    );
    let entries: HashMap<i64, HashMap<String, String>> = redis
        .entries("orders")
        .into_iter()
        .map(|(_, fields)| (fields["id"].parse().unwrap(), fields))
        .collect();
    let names = |id: i64| {
        let mut names: Vec<String> = entries[&id].keys().cloned().collect();
        names.sort();
        names
    };
    assert_eq!(names(plain), ["created_at", "id", "payload", "topic"]);
    assert_eq!(
        names(keyed),
        ["created_at", "headers", "id", "key", "payload", "topic"]
    );
    assert_eq!(entries[&keyed]["key"], "account-7");
    let headers: serde_json::Value = serde_json::from_str(&entries[&keyed]["headers"]).unwrap();
    assert_eq!(
        headers["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert_eq!(
        names(named),
        ["created_at", "headers", "id", "payload", "topic"]
    );
    assert_eq!(entries[&named]["headers"], r#"{"a": "b"}"#);
    assert_eq!(entries[&empty_key]["key"], "");

    // Each event's lane is what outbox_lane says of its key, else of its topic.
    let lanes: Vec<(i64, i16, i16)> = client
        .query(
            "SELECT id, lane, outbox_lane(key, topic) FROM outbox ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    for (id, lane, expected) in &lanes {
        assert_eq!(lane, expected, "event {id}");
    }
    assert_ne!(lanes[0].1, lanes[1].1, "the key did not pick the lane");
    assert_eq!(
        lanes[0].1, lanes[2].1,
        "an event without a key is in its topic's lane"
    );
}

/// A key is stored as PostgreSQL sees fit: a short one with a one-byte header, a long one
/// compressed in the row, a long one that does not compress out of line in the TOAST table. The
/// relay reads each whole.
#[test]
fn long_keys_reach_the_stream_whole_however_they_are_stored() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();
    // Written by hand, the relay pointed away meanwhile, so that the rows can be looked at
    // before they are claimed.
    let point_relay = |client: &mut postgres::Client, statement: &str| {
        client.batch_execute(statement).unwrap();
        client.batch_execute("SELECT pg_reload_conf()").unwrap();
    };
    point_relay(
        &mut client,
        "ALTER SYSTEM SET outbox.redis_url = 'redis://127.0.0.1:1/'",
    );
    std::thread::sleep(Duration::from_millis(500));
    let keys = [
        ("short", "SELECT 'k-7'"),
        ("compressed", "SELECT repeat('k', 100000)"),
        (
            "out of line",
            "SELECT string_agg(md5(i::text), '') FROM generate_series(1, 2000) i",
        ),
    ];
    let mut expected = HashMap::new();
    for (kind, key_sql) in keys {
        // `outbox_enqueue` takes keys of up to 1 KiB; longer ones are rows from before that
        // limit, or written by hand, and go out all the same.
        let row = client
            .query_one(
                &format!(
                    "WITH k (key) AS ({key_sql}) \
                     INSERT INTO outbox (topic, payload, key, lane) \
                     SELECT 'long-keys', '{{}}', k.key, outbox_lane(k.key, 'long-keys') FROM k \
                     RETURNING id, key"
                ),
                &[],
            )
            .unwrap();
        let (id, key): (i64, String) = (row.get(0), row.get(1));
        expected.insert(id, (kind, key));
    }
    // How each key is stored: its size in the row against its length.
    let stored: Vec<(i64, i32, i32)> = client
        .query(
            "SELECT id, pg_column_size(key), octet_length(key) FROM outbox ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let toast: i64 = client
        .query_one(
            "SELECT sum(pg_relation_size(c.reltoastrelid))::bigint FROM pg_inherits i \
             JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox'::regclass",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(stored[0].1 < 8, "the short key is not short: {stored:?}");
    assert!(
        stored[1].1 < stored[1].2 / 10,
        "the repeated key is not compressed: {stored:?}"
    );
    assert!(toast > 0, "no key went out of line: {stored:?}");
    point_relay(&mut client, "ALTER SYSTEM RESET outbox.redis_url");
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("long-keys") == 3),
        "the events did not arrive"
    );
    for (_, fields) in redis.entries("long-keys") {
        let id: i64 = fields["id"].parse().unwrap();
        let (kind, key) = &expected[&id];
        assert!(fields["key"] == *key, "the {kind} key arrived changed");
    }
    assert!(
        wait_until(Duration::from_secs(10), || pg.pending() == 0),
        "the events were not marked"
    );
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Delayed delivery
// ---------------------------------------------------------------------------------------------

/// A delayed event is not published before its time, and goes out within the poll interval of
/// it; events enqueued beside it go out at once.
#[test]
fn delayed_events_go_out_when_due() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "200ms")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let committed = Instant::now();
    client
        .batch_execute(
            "BEGIN; \
             SELECT outbox_enqueue('later', '{\"n\": 1}', deliver_after => '3 seconds'); \
             SELECT outbox_enqueue('now', '{\"n\": 2}'); \
             COMMIT",
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("now") == 1),
        "the event without delay did not go out"
    );
    // The entry is in Redis before the relay's mark commits: counted as pending until then.
    let pending = |client: &mut postgres::Client| -> i64 {
        client
            .query_one("SELECT pending FROM outbox_status", &[])
            .unwrap()
            .get(0)
    };
    assert!(
        wait_until(Duration::from_secs(5), || pending(&mut client) == 1),
        "the delayed event is not pending alone: {} pending",
        pending(&mut client)
    );
    let waiting: i64 = client
        .query_one("SELECT count(*) FROM outbox_delayed", &[])
        .unwrap()
        .get(0);
    assert_eq!(waiting, 1, "the delayed event is not in outbox_delayed");
    let age: Option<f64> = client
        .query_one(
            "SELECT extract(epoch FROM oldest_pending_age)::float8 FROM outbox_status",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        age, None,
        "an event not yet due has no age as a pending event"
    );
    while committed.elapsed() < Duration::from_millis(2_800) {
        assert_eq!(redis.xlen("later"), 0, "published before its time");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("later") == 1),
        "the delayed event never went out"
    );
    let arrived = committed.elapsed();
    // Due 3 s after the transaction began; the poll interval is 0.2 s (1.5 s of slack for a
    // loaded machine).
    assert!(
        arrived < Duration::from_millis(4_700),
        "arrived {arrived:?} after the commit"
    );
    let payload = &redis.entries("later")[0].1["payload"];
    assert_eq!(payload, r#"{"n": 1}"#);
    let (waiting, published): (i64, i64) = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_delayed), \
                    (SELECT count(*) FROM outbox WHERE topic = 'later' AND published_at IS NOT NULL)",
            &[],
        )
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!(
        (waiting, published),
        (0, 1),
        "the event did not move into outbox"
    );
}

/// A delayed event whose id outbox holds when it is due (ids used again, by a `setval` here)
/// goes into outbox with a new id, rather than stay due for ever, first in every move of its
/// lane: with `outbox.batch_size` 1 it held back every later delayed event of the lane.
#[test]
fn a_delayed_event_whose_id_is_taken_goes_out_with_a_new_id() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "100ms"),
            ("outbox.batch_size", "1"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let one = |client: &mut postgres::Client, sql: &str| -> i64 {
        client.query_one(sql, &[]).unwrap().get(0)
    };
    let taken = one(&mut client, "SELECT outbox_enqueue('now', '{}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("now") == 1));
    // The sequence set back by one: the first delayed event gets the id of the event in outbox.
    client
        .execute("SELECT setval('outbox_id_seq', $1, false)", &[&taken])
        .unwrap();
    let first = one(
        &mut client,
        "SELECT outbox_enqueue('later', '{\"n\": 1}', deliver_after => '1 second')",
    );
    assert_eq!(first, taken, "the sequence was not set back");
    // Due later, in the same lane.
    let second = one(
        &mut client,
        "SELECT outbox_enqueue('later', '{\"n\": 2}', deliver_after => '2 seconds')",
    );

    assert!(
        wait_until(Duration::from_secs(15), || redis.xlen("later") == 2),
        "the delayed events did not both go out: {} of 2",
        redis.xlen("later")
    );
    let by_payload: HashMap<String, i64> = redis
        .entries("later")
        .into_iter()
        .map(|(_, f)| (f["payload"].clone(), f["id"].parse().unwrap()))
        .collect();
    let renumbered = by_payload[r#"{"n": 1}"#];
    assert_ne!(
        renumbered, taken,
        "the delayed event went out with a taken id"
    );
    assert!(
        renumbered > second,
        "the new id {renumbered} is not from the sequence"
    );
    assert_eq!(by_payload[r#"{"n": 2}"#], second);
    assert_eq!(
        redis.ids("now"),
        [taken],
        "the event holding the id was touched"
    );
    let waiting = one(&mut client, "SELECT count(*) FROM outbox_delayed");
    assert_eq!(waiting, 0, "a delayed event stayed in outbox_delayed");
    assert!(
        pg.log().contains(&format!(
            "delayed event {taken} is due, but outbox holds another event with id {taken} \
             (ids used again): it goes into outbox as event {renumbered}"
        )),
        "no WARNING named the delayed event's new id"
    );
}

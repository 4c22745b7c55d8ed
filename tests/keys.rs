//! Message keys, headers and delayed delivery (`outbox_enqueue`'s last three arguments), and the
//! order kept per key over several workers, against a real PostgreSQL and Redis.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{sqlstate, wait_until, Pg, Redis};

fn count(client: &mut postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM outbox", &[])
        .unwrap()
        .get(0)
}

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

/// Headers that are not an object of strings, and a negative delay, are refused with 22023,
/// and nothing is written.
#[test]
fn bad_headers_and_negative_delays_are_refused() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    for headers in [
        "'[]'",
        "'\"traceparent\"'",
        "'{\"n\": 1}'",
        "'{\"nested\": {\"a\": \"b\"}}'",
        "'{\"a\": \"b\", \"c\": null}'",
        "'null'",
    ] {
        let error = client
            .query_one(
                &format!("SELECT outbox_enqueue('t', '{{}}', 'k', {headers})"),
                &[],
            )
            .expect_err(headers);
        assert_eq!(sqlstate(&error), "22023", "headers {headers}: {error:?}");
        let message = error.as_db_error().unwrap().message().to_string();
        assert!(message.contains("headers"), "{message}");
    }
    let error = client
        .query_one(
            "SELECT outbox_enqueue('t', '{}', deliver_after => '-1 second')",
            &[],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&error), "22023", "{error:?}");
    let error = client
        .query_one(
            "SELECT outbox_enqueue('t', '{}', deliver_after => '1 day -25 hours')",
            &[],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&error), "22023", "{error:?}");
    assert_eq!(count(&mut client), 0, "a refused call wrote a row");

    // An empty object and a zero delay are fine: no headers to speak of, due at once.
    client
        .batch_execute(
            "SELECT outbox_enqueue('t', '{}', NULL, '{}', '0 seconds'); \
             SELECT outbox_enqueue('t', '{}', headers => '{\"a\": \"\"}')",
        )
        .unwrap();
    let due: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE next_attempt_at IS NULL",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(due, 2);
}

/// An infinite delay (an interval PostgreSQL 17 and later accept) would keep the event waiting
/// forever: it is refused with 22023, as a negative one is, and nothing is written. Before 17,
/// PostgreSQL's own interval input refuses it (22007).
#[test]
fn an_infinite_delay_is_refused() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .unwrap()
        .get(0);
    let expected = if version >= 170000 { "22023" } else { "22007" };
    for delay in [
        "'infinity'",
        "'infinity'::interval",
        "'1 day'::interval + 'infinity'",
    ] {
        let result = client.query_one(
            &format!("SELECT outbox_enqueue('t', '{{}}', deliver_after => {delay})"),
            &[],
        );
        let error = result.expect_err(delay);
        assert_eq!(sqlstate(&error), expected, "{delay}: {error:?}");
        if expected == "22023" {
            let message = error.as_db_error().unwrap().message().to_string();
            assert!(message.contains("deliver_after"), "{message}");
        }
    }
    let written: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_delayed)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(written, 0, "a refused call wrote a row");
}

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

/// The acceptance case of per-key order: 8 clients, 200 keys, each transaction locks its key's
/// business row, reads the key's counter and enqueues an event carrying it; 4 workers, two of
/// them killed with SIGKILL during the run (each kill restarts the server). In the end every
/// key's events are in the stream exactly once each, in commit order (their counters
/// ascending), and none is missing.
#[test]
fn each_keys_events_keep_commit_order_over_four_workers_and_two_kills() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.workers", "4"),
            ("outbox.batch_size", "50"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    ordered_run(&mut pg, &redis, 4, |pg| {
        let pids = pg.worker_pids();
        assert!(!pids.is_empty(), "no worker to kill");
        pg.kill9(pids[pids.len() / 2]);
        // Back up: the postmaster restarts the whole server after the kill.
        std::thread::sleep(Duration::from_secs(1));
        pg.wait_for_workers(4);
    });
}

/// `outbox.workers` changed under load (2, then 3, then 1, each a restart): the lanes move to
/// other workers, and every key's events stay in commit order.
#[test]
fn changing_the_number_of_workers_keeps_each_keys_order() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.workers", "2"),
            ("outbox.batch_size", "50"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut next = [3, 1].into_iter();
    ordered_run(&mut pg, &redis, 2, move |pg| {
        let workers = next.next().unwrap_or(1);
        pg.set(&[("outbox.workers", &workers.to_string())]);
        pg.restart();
        pg.wait_for_workers(workers);
    });
}

/// Runs 8 clients enqueueing for 200 keys (see above) for about 12 s, calling `disturb` twice
/// along the way, then checks each key's order in the stream.
fn ordered_run(pg: &mut Pg, redis: &Redis, workers: usize, mut disturb: impl FnMut(&mut Pg)) {
    let mut client = pg.with_extension();
    client
        .batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, seq int NOT NULL DEFAULT 0); \
             INSERT INTO accounts (id) SELECT g FROM generate_series(0, 199) g",
        )
        .unwrap();
    pg.wait_for_workers(workers);

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let stop = stop.clone();
            let address = format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=10",
                pg.port
            );
            std::thread::spawn(move || {
                let mut n: u64 = c;
                let mut client = None;
                while !stop.load(Ordering::Relaxed) {
                    let conn = match client.as_mut() {
                        Some(conn) => conn,
                        None => match postgres::Client::connect(&address, postgres::NoTls) {
                            Ok(conn) => client.insert(conn),
                            Err(_) => {
                                std::thread::sleep(Duration::from_millis(50));
                                continue;
                            }
                        },
                    };
                    n = n
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let key = (n >> 33) % 200;
                    let result = conn.batch_execute(&format!(
                        "BEGIN; \
                         SELECT outbox_enqueue('orders', json_build_object('key', {key}, 'seq', \
                             (SELECT seq FROM accounts WHERE id = {key} FOR UPDATE))::jsonb, \
                             'key-{key}'); \
                         UPDATE accounts SET seq = seq + 1 WHERE id = {key}; \
                         COMMIT"
                    ));
                    if result.is_err() {
                        // The server restarted under the client: connect again.
                        client = None;
                    }
                }
            })
        })
        .collect();

    for _ in 0..2 {
        std::thread::sleep(Duration::from_secs(4));
        disturb(pg);
    }
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(60), || pg.pending() == 0),
        "the backlog was not drained"
    );

    let committed: HashMap<i64, i64> = pg
        .query_retrying("SELECT id::int8, seq::int8 FROM accounts")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let total: i64 = committed.values().sum();
    assert!(total > 2_000, "only {total} events were enqueued");
    let mut seen: HashMap<i64, Vec<i64>> = HashMap::new();
    for (_, fields) in redis.entries("orders") {
        let payload: serde_json::Value = serde_json::from_str(&fields["payload"]).unwrap();
        let key = payload["key"].as_i64().unwrap();
        assert_eq!(fields["key"], format!("key-{key}"));
        seen.entry(key)
            .or_default()
            .push(payload["seq"].as_i64().unwrap());
    }
    for (key, &n) in &committed {
        let order = seen.remove(key).unwrap_or_default();
        let expected: Vec<i64> = (0..n).collect();
        assert_eq!(
            order, expected,
            "key {key}: the stream holds its events in this order (commit order is 0..{n})"
        );
    }
    let dead: i64 = pg.query_retrying("SELECT count(*) FROM outbox_dead")[0].get(0);
    assert_eq!(dead, 0);
    let shares: i64 = pg.query_retrying("SELECT count(DISTINCT lane / 256) FROM outbox")[0].get(0);
    assert_eq!(shares, 4, "the keys did not spread over the lanes");
}

/// An event Redis rejects holds back the later events of its key, and only those: the other
/// keys' events flow, the held ones follow in order once the rejected one is out. With
/// `outbox.max_attempts` reached, the rejected event goes to `outbox_dead` and its key moves on.
#[test]
fn a_rejected_event_holds_back_only_its_own_key() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "3"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // The stream key of topic 'broken' holds a string: every XADD to it is refused.
    redis.query::<()>(redis::cmd("SET").arg("broken").arg("x"));

    let enqueue = |client: &mut postgres::Client, topic: &str, key: &str, n: i64| {
        client
            .batch_execute(&format!(
                "SELECT outbox_enqueue('{topic}', '{{\"n\": {n}}}', '{key}')"
            ))
            .unwrap();
    };
    enqueue(&mut client, "broken", "held", 0);
    for n in 1..=5 {
        enqueue(&mut client, "orders", "held", n);
        enqueue(&mut client, "orders", "free", n);
    }
    // A key-less event of the broken topic holds back that topic's key-less events.
    client
        .batch_execute(
            "SELECT outbox_enqueue('broken', '{\"n\": 10}'); \
             SELECT outbox_enqueue('broken', '{\"n\": 11}')",
        )
        .unwrap();
    let ns = |key: &str| -> Vec<String> {
        redis
            .entries("orders")
            .into_iter()
            .filter(|(_, f)| f.get("key").map(String::as_str) == Some(key))
            .map(|(_, f)| f["payload"].clone())
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(10), || ns("free").len() == 5),
        "the other key's events did not flow"
    );
    // Two tries of the rejected event (1 s apart) pass meanwhile.
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(ns("held"), Vec::<String>::new(), "a held event went out");
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE key = 'held' AND published_at IS NULL",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(held, 6);
    let attempts: i32 = client
        .query_one(
            "SELECT max(attempts) FROM outbox WHERE key = 'held' AND topic = 'orders'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        attempts, 0,
        "held events were charged for another's failure"
    );

    // The third attempt buries the rejected event; the key moves on, in order.
    assert!(
        wait_until(Duration::from_secs(15), || ns("held").len() == 5),
        "the held events did not follow once the rejected one was buried"
    );
    let expected: Vec<String> = (1..=5).map(|n| format!("{{\"n\": {n}}}")).collect();
    assert_eq!(ns("held"), expected);
    let dead: Vec<(Option<String>, String)> = client
        .query(
            "SELECT key, payload::text FROM outbox_dead ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        dead[0],
        (Some("held".to_string()), r#"{"n": 0}"#.to_string())
    );

    // The key-less events of the broken topic follow one another there: the second is tried
    // only once the first is buried. Then, with the stream fixed, the dead events are redriven
    // and go out in their order.
    assert!(
        wait_until(Duration::from_secs(30), || client
            .query_one("SELECT count(*) FROM outbox_dead", &[])
            .unwrap()
            .get::<_, i64>(0)
            == 3),
        "the key-less events of the broken topic did not reach outbox_dead"
    );
    let first_tries: Vec<i32> = client
        .query("SELECT attempts FROM outbox_dead ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(first_tries, [3, 3, 3]);
    redis.query::<()>(redis::cmd("DEL").arg("broken"));
    let redriven: i64 = client
        .query_one("SELECT outbox_redrive_all()", &[])
        .unwrap()
        .get(0);
    assert_eq!(redriven, 3);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("broken") == 3),
        "the redriven events did not go out"
    );
    let broken: Vec<String> = redis
        .entries("broken")
        .into_iter()
        .map(|(_, f)| f["payload"].clone())
        .collect();
    assert_eq!(broken, [r#"{"n": 0}"#, r#"{"n": 10}"#, r#"{"n": 11}"#]);
}

/// Events charged by someone else than this worker (by hand here; another worker before the
/// shares moved) are failing events the worker learns of only at its next look for them, up to
/// 100 ms later. Due meanwhile, two of one key still go out in id order, whichever is due first.
#[test]
fn due_events_of_one_key_go_out_in_id_order_whoever_charged_them() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.batch_size", "1"), ("outbox.poll_interval", "10ms")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    std::thread::sleep(Duration::from_millis(500));
    const KEYS: usize = 5;
    for k in 0..KEYS {
        // The later event is due a second before the earlier one.
        client
            .batch_execute(&format!(
                "BEGIN; \
                 SELECT outbox_enqueue('orders', '{{\"n\": 1}}', 'k{k}'); \
                 SELECT outbox_enqueue('orders', '{{\"n\": 2}}', 'k{k}'); \
                 UPDATE outbox SET attempts = 1, last_error = 'charged by hand', \
                   next_attempt_at = now() - CASE WHEN payload->>'n' = '1' \
                     THEN interval '1 second' ELSE interval '2 seconds' END \
                 WHERE key = 'k{k}'; \
                 COMMIT"
            ))
            .unwrap();
        std::thread::sleep(Duration::from_millis(37));
    }
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("orders") == 2 * KEYS),
        "the events charged by hand did not go out"
    );
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for (_, fields) in redis.entries("orders") {
        order
            .entry(fields["key"].clone())
            .or_default()
            .push(fields["payload"].clone());
    }
    for (key, payloads) in &order {
        assert_eq!(
            payloads,
            &[r#"{"n": 1}"#, r#"{"n": 2}"#],
            "key {key}: its events went out in this order"
        );
    }
}

/// Once a rejected event goes out (or to `outbox_dead`), the later events of its key, which the
/// claims passed by while it failed, follow at once: no commit wakes the relay for them, and
/// the poll is 10 s away here.
#[test]
fn the_events_behind_a_rejected_one_follow_it_at_once() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "10s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis.query::<()>(redis::cmd("SET").arg("broken").arg("x"));
    client
        .batch_execute("SELECT outbox_enqueue('broken', '{}', 'k')")
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || {
            client
                .query_one("SELECT count(*) FROM outbox WHERE attempts = 1", &[])
                .unwrap()
                .get::<_, i64>(0)
                == 1
        }),
        "the event was not rejected"
    );
    client
        .batch_execute("SELECT outbox_enqueue('orders', '{}', 'k')")
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.xlen("orders"), 0, "the later event did not wait");
    // The retry, a second after the rejection, finds the stream key free.
    redis.query::<()>(redis::cmd("DEL").arg("broken"));
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("broken") == 1),
        "the rejected event was not retried"
    );
    let retried = Instant::now();
    assert!(
        wait_until(Duration::from_secs(15), || redis.xlen("orders") == 1),
        "the later event never went out"
    );
    let after = retried.elapsed();
    eprintln!("the later event followed {} ms after", after.as_millis());
    assert!(
        after < Duration::from_secs(2),
        "the later event followed {after:?} after the retried one"
    );
}

/// An event larger than Redis takes (`proto-max-bulk-len`) makes Redis close the connection, and
/// its chunk is sent again event by event. The later event of its key in that chunk must wait
/// for it, uncharged: it used to go out alone, and once the limit was raised the large event
/// landed after it. Here it waits, and the two reach the stream in their order.
fn an_event_that_breaks_the_connection_holds_back_its_key(dedupe: &str) {
    let redis = Redis::start_with_args(&["--proto-max-bulk-len", "1mb"]);
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.max_payload_size", "4MB"),
            ("outbox.max_attempts", "100"),
            ("outbox.poll_interval", "100ms"),
            ("outbox.dedupe", dedupe),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let id = |client: &mut postgres::Client, sql: &str| -> i64 {
        client.query_one(sql, &[]).unwrap().get(0)
    };
    // One transaction, so one chunk. The event of another topic after the two leaves a command
    // unanswered when Redis closes the connection, dedupe on or off: the chunk breaks, rather
    // than come back with an error for both.
    client.batch_execute("BEGIN").unwrap();
    let big = id(
        &mut client,
        "SELECT outbox_enqueue('orders', jsonb_build_object('x', repeat('a', 2000000)), \
         key => 'k')",
    );
    let small = id(
        &mut client,
        "SELECT outbox_enqueue('orders', '{\"n\": 2}', key => 'k')",
    );
    let other = id(&mut client, "SELECT outbox_enqueue('other', '{}')");
    client.batch_execute("COMMIT").unwrap();

    assert!(
        wait_until(Duration::from_secs(10), || redis.ids("other") == [other]),
        "the chunk's event of another topic did not go out"
    );
    let attempts = |client: &mut postgres::Client, event: i64| -> i32 {
        client
            .query_one("SELECT attempts FROM outbox WHERE id = $1", &[&event])
            .unwrap()
            .get(0)
    };
    // Charged once in the broken chunk, and again at its retry a second later.
    assert!(
        wait_until(Duration::from_secs(10), || attempts(&mut client, big) >= 2),
        "the large event was not charged twice"
    );
    assert_eq!(
        redis.ids("orders"),
        Vec::<i64>::new(),
        "the later event of the key went out before the large one"
    );
    let held = client
        .query_one(
            // Not scheduled for a retry: fresh, or held behind the large one ('infinity').
            "SELECT published_at IS NULL, attempts, \
                    COALESCE(next_attempt_at = 'infinity', true) FROM outbox \
             WHERE id = $1",
            &[&small],
        )
        .unwrap();
    assert_eq!(
        (
            held.get::<_, bool>(0),
            held.get::<_, i32>(1),
            held.get::<_, bool>(2)
        ),
        (true, 0, true),
        "the held event is not waiting unmarked and uncharged"
    );

    redis.query::<()>(
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("proto-max-bulk-len")
            .arg("4mb"),
    );
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("orders") == 2),
        "the two events did not go out once Redis took the large one"
    );
    assert_eq!(redis.ids("orders"), [big, small]);
    assert_eq!(attempts(&mut client, small), 0);
}

#[test]
fn an_event_that_breaks_the_connection_holds_back_its_key_with_dedupe_on() {
    an_event_that_breaks_the_connection_holds_back_its_key("on");
}

#[test]
fn an_event_that_breaks_the_connection_holds_back_its_key_with_dedupe_off() {
    an_event_that_breaks_the_connection_holds_back_its_key("off");
}

/// A backlog that fills every batch does not hold off the retries of rejected events, nor the
/// later events of their keys: those wait for the retries (within about a poll interval of their
/// due time), not for the backlog to drain. Forty keys are held, more than one claim takes.
#[test]
fn rejected_events_and_their_keys_move_on_while_a_backlog_fills_every_batch() {
    const BACKLOG: usize = 20_000;
    const KEYS: usize = 40;
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "1"),
            ("outbox.poll_interval", "500ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis.query::<()>(redis::cmd("SET").arg("broken").arg("x"));
    // Each key's first event is refused; its second, bound for a healthy stream, waits for it.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('broken', '{{}}', 'k' || g) FROM generate_series(1, {KEYS}) g; \
             SELECT outbox_enqueue('orders', '{{}}', 'k' || g) FROM generate_series(1, {KEYS}) g"
        ))
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            client
                .query_one("SELECT count(*) FROM outbox WHERE attempts >= 1", &[])
                .unwrap()
                .get::<_, i64>(0)
                == KEYS as i64
        }),
        "the events were not rejected"
    );
    assert_eq!(
        redis.xlen("orders"),
        0,
        "the keys' later events did not wait"
    );
    // One event per pass: every batch is full until the backlog is out.
    common::enqueue_many(&mut client, "backlog", BACKLOG as i64);
    // The retries find the stream key free. Made due now, whatever their delays have grown
    // to, so that the test measures when the relay looks for them, not how long they wait.
    redis.query::<()>(redis::cmd("DEL").arg("broken"));
    client
        .batch_execute("UPDATE outbox SET next_attempt_at = now() WHERE attempts > 0")
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(120), || redis.xlen("broken") == KEYS
            && redis.xlen("orders") == KEYS),
        "the rejected events or their keys' later events never went out"
    );
    let out = redis.xlen("backlog");
    eprintln!("{KEYS} retried keys through with {out} of {BACKLOG} backlog events out");
    assert!(
        out < BACKLOG,
        "the retries or their keys waited until the whole backlog was out"
    );
    // Each key's later event went out after its retried one, never in an earlier pass.
    let early: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox d JOIN outbox e ON e.key = d.key \
             WHERE d.topic = 'broken' AND e.topic = 'orders' \
               AND e.published_at < d.published_at",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        early, 0,
        "later events went out before their key's retried one"
    );
    assert!(
        wait_until(Duration::from_secs(120), || redis.xlen("backlog")
            == BACKLOG),
        "the backlog was not drained"
    );
}

/// A `COMMIT PREPARED` makes an event visible without the counts of commits per partition by
/// which a pass woken by a commit reads that commit's partition alone (see `cursor.rs`). With
/// prepared transactions enabled, a later event of its key in another partition still goes out
/// after it, and at once, not at the poll.
#[test]
fn an_event_committed_prepared_keeps_its_place_in_its_key() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "10s"),
            ("max_prepared_transactions", "5"),
            // A transaction that notified cannot be prepared.
            ("outbox.notify_channel", ""),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // The prepared event takes the last id of outbox_01's run; the later ones go to outbox_02.
    client
        .batch_execute("SELECT setval('outbox_id_seq', 131070)")
        .unwrap();
    let mut preparer = pg.connect();
    preparer
        .batch_execute(
            "BEGIN; SELECT outbox_enqueue('orders', '{\"n\": 1}', 'k'); \
             PREPARE TRANSACTION 'first'",
        )
        .unwrap();
    // A pass for outbox_02 alone, which leaves it looked into.
    client
        .batch_execute("SELECT outbox_enqueue('warm', '{}')")
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || redis.xlen("warm") == 1));
    std::thread::sleep(Duration::from_millis(200));
    client.batch_execute("COMMIT PREPARED 'first'").unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('orders', '{\"n\": 2}', 'k')")
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("orders") == 2),
        "{} of the key's 2 events went out before the poll",
        redis.xlen("orders")
    );
    let order: Vec<String> = redis
        .entries("orders")
        .into_iter()
        .map(|(_, f)| f["payload"].clone())
        .collect();
    assert_eq!(order, [r#"{"n": 1}"#, r#"{"n": 2}"#]);
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

/// A transaction that commits while the relay drains a backlog past its event, followed by the
/// next event of its key: the two keep their order. (The relay used to claim past the last id
/// it had claimed first, and published the second event while the first waited below.)
#[test]
fn an_event_committed_below_a_draining_backlog_keeps_its_place_in_its_key() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut late = pg.connect();
    late.batch_execute("BEGIN; SELECT outbox_enqueue('orders', '{\"n\": 1}', 'k')")
        .unwrap();
    let backlog =
        "SELECT outbox_enqueue('orders', jsonb_build_object('n', g), 'other-' || (g % 50)) \
                   FROM generate_series(1, 20000) g";
    client.batch_execute(backlog).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("orders") >= 1_000),
        "the backlog did not start to drain"
    );
    late.batch_execute("COMMIT").unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('orders', '{\"n\": 2}', 'k')")
        .unwrap();
    client.batch_execute(backlog).unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || pg.pending() == 0),
        "the backlog was not drained"
    );
    let ns: Vec<String> = redis
        .entries("orders")
        .into_iter()
        .filter(|(_, f)| f.get("key").map(String::as_str) == Some("k"))
        .map(|(_, f)| f["payload"].clone())
        .collect();
    assert_eq!(ns, [r#"{"n": 1}"#, r#"{"n": 2}"#]);
}

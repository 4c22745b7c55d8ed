//! The order kept per key: each key's events reach their stream in commit order over several
//! workers, with workers killed and their number changed; an event Redis rejects holds back the
//! later events of its key (without a key, of its topic), and only those, until it is out or
//! buried; and an event committed late (prepared, or below a draining backlog) keeps its place.
//! Against a real PostgreSQL and Redis.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::sql::count;
use common::{enqueue_many, wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// Order over workers, kills and restarts
// ---------------------------------------------------------------------------------------------

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

/// More workers asked for than `max_worker_processes` leaves room for (the launcher and the
/// logical replication launcher take two of three): the one that cannot start never relays,
/// so the workers that run cover its lanes, and every key's events go out in order. The
/// shortage shows in `outbox_status`.
#[test]
fn the_workers_that_run_cover_the_lanes_of_those_that_cannot_start() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.workers", "2"),
            ("max_worker_processes", "3"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected: HashMap<String, Vec<i64>> = HashMap::new();
    for round in 0..3 {
        for key in 0..8 {
            let key = format!("account-{key}");
            let id: i64 = client
                .query_one(
                    "SELECT outbox_enqueue('accounts', $1::text::jsonb, $2)",
                    &[&format!("{{\"round\": {round}}}"), &key],
                )
                .unwrap()
                .get(0);
            expected.entry(key).or_default().push(id);
        }
    }
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("accounts") == 24),
        "{} of 24 events published with one of two workers unable to start",
        redis.xlen("accounts")
    );
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    for (_, fields) in redis.entries("accounts") {
        by_key
            .entry(fields["key"].clone())
            .or_default()
            .push(fields["id"].parse().unwrap());
    }
    assert_eq!(by_key, expected, "each key's events, in commit order");
    let (running, wanted): (i32, i32) = {
        let row = client
            .query_one(
                "SELECT workers_running, workers_wanted FROM outbox_status",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((running, wanted), (1, 2));
    assert!(pg.log().contains("max_worker_processes is used up"));
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

// ---------------------------------------------------------------------------------------------
// A rejected event holds back its key
// ---------------------------------------------------------------------------------------------

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

/// Held events go out in their order once nothing is before them in their key, even when the
/// rejected events they waited for are deleted by hand (no publication or burial by the relay
/// releases them then: the worker's look once per poll interval finds them).
#[test]
fn held_events_follow_in_order_once_their_rejected_ones_are_deleted_by_hand() {
    const BACKLOG: i64 = 300;
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "1000"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis.query::<()>(redis::cmd("SET").arg("bad").arg("x"));
    let ids = enqueue_many(&mut client, "bad", BACKLOG);
    assert!(
        wait_until(Duration::from_secs(30), || count(
            &mut client,
            "SELECT count(*) FROM outbox \
             WHERE topic = 'bad' AND published_at IS NULL AND next_attempt_at IS NULL"
        ) == 0),
        "the events behind the rejected ones were not held"
    );
    // Their key's later events wait, and a healthy topic flows meanwhile.
    let good = enqueue_many(&mut client, "good", 10);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("good") == 10));
    assert_eq!(redis.ids("good"), good);

    let deleted: Vec<i64> = client
        .query(
            "DELETE FROM outbox WHERE topic = 'bad' AND attempts > 0 RETURNING id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(!deleted.is_empty(), "no rejected event to delete");
    redis.query::<()>(redis::cmd("DEL").arg("bad"));
    let left: Vec<i64> = ids.into_iter().filter(|id| !deleted.contains(id)).collect();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("bad") == left.len()),
        "{} of the {} held events went out after their rejected ones were deleted",
        redis.xlen("bad"),
        left.len()
    );
    assert_eq!(
        redis.ids("bad"),
        left,
        "the held events went out out of order"
    );
    // Marked once Redis has answered.
    assert!(wait_until(Duration::from_secs(10), || count(
        &mut client,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL"
    ) == 0));
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox_dead"), 0);
}

// ---------------------------------------------------------------------------------------------
// Events committed late
// ---------------------------------------------------------------------------------------------

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

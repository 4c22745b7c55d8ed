//! Operating the outbox against real servers: dead letters, monitoring views, and dump and
//! restore (pruning over time: `pruning.rs`).

use std::collections::BTreeSet;
use std::time::Duration;

use common::redis_keys::poison;
use common::sql::one;
use common::{enqueue_many, wait_until, Client, Pg, Redis};

#[test]
fn a_poison_event_is_buried_after_max_attempts_and_redriven() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.max_attempts", "3"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    poison(&redis, "orders");
    let mut tx = client.transaction().unwrap();
    let bad: i64 = tx
        .query_one("SELECT outbox_enqueue('orders', '{\"n\": 1}')", &[])
        .unwrap()
        .get(0);
    let good: i64 = tx
        .query_one("SELECT outbox_enqueue('payments', '{\"n\": 2}')", &[])
        .unwrap()
        .get(0);
    tx.commit().unwrap();

    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("payments") == 1),
        "the good event waited"
    );
    assert_eq!(redis.ids("payments"), [good]);
    // Retries after 1 s and 2 s, then the third failure buries it.
    assert!(
        wait_until(Duration::from_secs(20), || one::<i64>(
            &mut pg.connect(),
            "SELECT dead FROM outbox_status"
        ) == 1),
        "the poison event never reached outbox_dead"
    );
    let row = client
        .query_one(
            "SELECT id, topic, payload::text, attempts, last_error, failed_at IS NOT NULL, created_at IS NOT NULL \
             FROM outbox_dead",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), bad);
    assert_eq!(row.get::<_, String>(1), "orders");
    assert_eq!(row.get::<_, String>(2), r#"{"n": 1}"#);
    assert_eq!(row.get::<_, i32>(3), 3);
    assert!(row.get::<_, String>(4).contains("WRONGTYPE"));
    assert!(row.get::<_, bool>(5) && row.get::<_, bool>(6));
    assert_eq!(
        one::<i64>(
            &mut client,
            &format!("SELECT count(*) FROM outbox WHERE id = {bad}")
        ),
        0
    );
    assert!(pg.log().contains(&format!(
        "event {bad} (topic orders) moved to outbox_dead after 3 failed attempts"
    )));

    // Fix the key, redrive: the event goes out with its original id.
    redis::cmd("DEL")
        .arg("orders")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    assert!(one::<bool>(
        &mut client,
        &format!("SELECT outbox_redrive({bad})")
    ));
    assert!(
        !one::<bool>(&mut client, &format!("SELECT outbox_redrive({bad})")),
        "redriven twice"
    );
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("orders") == 1),
        "the redriven event was not published"
    );
    assert_eq!(redis.ids("orders"), [bad]);
    assert_eq!(one::<i64>(&mut client, "SELECT dead FROM outbox_status"), 0);

    // outbox_redrive_all brings back every dead event.
    poison(&redis, "refunds");
    let dead: BTreeSet<i64> = enqueue_many(&mut client, "refunds", 3)
        .into_iter()
        .collect();
    assert!(wait_until(Duration::from_secs(20), || one::<i64>(
        &mut pg.connect(),
        "SELECT dead FROM outbox_status"
    ) == 3));
    redis::cmd("DEL")
        .arg("refunds")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    assert_eq!(one::<i64>(&mut client, "SELECT outbox_redrive_all()"), 3);
    assert!(wait_until(Duration::from_secs(5), || redis.xlen("refunds") == 3));
    assert_eq!(
        redis.ids("refunds").into_iter().collect::<BTreeSet<_>>(),
        dead
    );
    let attempts: i32 = one(
        &mut client,
        &format!(
            "SELECT attempts FROM outbox WHERE id = {}",
            dead.first().unwrap()
        ),
    );
    assert_eq!(attempts, 0, "attempts are reset by a redrive");
}

/// `outbox` holds each id once. A dead event whose id it holds (an id used again), and the
/// second of two dead events that share an id, stay in `outbox_dead` with a WARNING, where a
/// unique violation used to undo the call: `outbox_redrive(id)` returns false for them, and
/// `outbox_redrive_all()` moves every other dead event.
#[test]
fn redrives_leave_dead_events_whose_id_is_taken_and_move_the_rest() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let live: i64 = one(&mut client, "SELECT outbox_enqueue('live', '{}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("live") == 1));
    // Dead letters as ids used again leave them: one with the live event's id, two that share
    // an id outbox does not hold, and one of its own.
    let (shared, own) = (live + 1_000, live + 2_000);
    client
        .execute(
            "INSERT INTO outbox_dead (id, topic, payload, created_at, attempts, last_error) VALUES \
               ($1, 'orders', '{\"n\": 1}', now() - interval '3 days', 10, 'WRONGTYPE'), \
               ($2, 'orders', '{\"n\": 2}', now() - interval '2 days', 10, 'WRONGTYPE'), \
               ($2, 'orders', '{\"n\": 3}', now() - interval '1 day', 10, 'WRONGTYPE'), \
               ($3, 'orders', '{\"n\": 4}', now() - interval '1 day', 10, 'WRONGTYPE')",
            &[&live, &shared, &own],
        )
        .unwrap();
    let dead_payloads = |client: &mut Client| -> Vec<(i64, String)> {
        client
            .query(
                "SELECT id, payload::text FROM outbox_dead ORDER BY id, created_at",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    };

    let redriven: bool = client
        .query_one("SELECT outbox_redrive($1)", &[&live])
        .unwrap_or_else(|e| panic!("redriving a dead event whose id is taken failed: {e}"))
        .get(0);
    assert!(!redriven, "a dead event whose id is taken was redriven");
    assert!(
        wait_until(Duration::from_secs(5), || pg.log().contains(&format!(
            "dead event {live} stays in outbox_dead: outbox holds another event with id {live}"
        ))),
        "no WARNING said why the dead event stayed"
    );

    // Of the two that share an id, the one created first goes back.
    let redriven: bool = client
        .query_one("SELECT outbox_redrive($1)", &[&shared])
        .unwrap_or_else(|e| panic!("redriving one of two dead events of an id failed: {e}"))
        .get(0);
    assert!(redriven, "neither dead event of the shared id was redriven");
    assert!(
        wait_until(Duration::from_secs(5), || pg.log().contains(&format!(
            "1 of the 2 dead events with id {shared} stay in outbox_dead"
        ))),
        "no WARNING said that a dead event of the shared id stayed"
    );
    assert_eq!(
        dead_payloads(&mut client),
        [
            (live, r#"{"n": 1}"#.to_string()),
            (shared, r#"{"n": 3}"#.to_string()),
            (own, r#"{"n": 4}"#.to_string()),
        ]
    );

    // The rest goes back; the two whose ids are taken stay, and are named.
    let moved: i64 = client
        .query_one("SELECT outbox_redrive_all()", &[])
        .unwrap_or_else(|e| panic!("outbox_redrive_all failed: {e}"))
        .get(0);
    assert_eq!(moved, 1, "outbox_redrive_all did not move the one it could");
    assert!(
        wait_until(Duration::from_secs(5), || {
            let log = pg.log();
            log.contains("2 dead events stay in outbox_dead: outbox holds events with their ids")
                && log.contains(&format!("Their ids: {live}, {shared}."))
        }),
        "no WARNING named the dead events outbox_redrive_all left"
    );
    assert_eq!(
        dead_payloads(&mut client),
        [
            (live, r#"{"n": 1}"#.to_string()),
            (shared, r#"{"n": 3}"#.to_string()),
        ]
    );
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("orders") == 2),
        "the redriven events were not published"
    );
    let mut published = redis.ids("orders");
    published.sort_unstable();
    assert_eq!(published, [shared, own]);
    let payloads: BTreeSet<String> = redis
        .entries("orders")
        .into_iter()
        .map(|(_, f)| f["payload"].clone())
        .collect();
    assert_eq!(
        payloads,
        BTreeSet::from([r#"{"n": 2}"#.to_string(), r#"{"n": 4}"#.to_string()])
    );
    assert_eq!(redis.ids("live"), [live], "the live event was touched");
}

#[test]
fn status_views_follow_a_backlog_and_an_outage() {
    let mut redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "100ms"),
            ("outbox.redis_timeout", "300ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let status = |c: &mut Client| -> (i64, Option<f64>, i64, bool, i32) {
        let r = c
            .query_one(
                "SELECT pending, extract(epoch FROM oldest_pending_age)::float8, dead, \
                        last_published_at IS NOT NULL, workers_running FROM outbox_status",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
    };
    assert_eq!(status(&mut client), (0, None, 0, false, 1));

    redis.stop();
    enqueue_many(&mut client, "backlog", 40);
    assert!(wait_until(Duration::from_secs(10), || {
        one::<String>(&mut pg.connect(), "SELECT state FROM outbox_workers") == "backoff"
    }));
    std::thread::sleep(Duration::from_millis(1100));
    let (pending, age, _, _, running) = status(&mut client);
    assert_eq!(pending, 40);
    assert!(age.is_some_and(|a| a >= 1.0), "oldest_pending_age {age:?}");
    assert_eq!(running, 1);
    let row = client
        .query_one(
            "SELECT last_error, last_error_at IS NOT NULL FROM outbox_workers",
            &[],
        )
        .unwrap();
    assert!(row.get::<_, Option<String>>(0).is_some() && row.get::<_, bool>(1));

    redis.start_again();
    assert!(
        wait_until(Duration::from_secs(30), || status(&mut pg.connect()).0 == 0),
        "backlog not drained"
    );
    let (pending, age, dead, published, _) = status(&mut client);
    assert_eq!((pending, age, dead, published), (0, None, 0, true));
    assert!(wait_until(Duration::from_secs(5), || {
        one::<String>(&mut pg.connect(), "SELECT state FROM outbox_workers") == "idle"
    }));
    let row = client
        .query_one(
            "SELECT published, last_error, last_batch_at IS NOT NULL FROM outbox_workers",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 40);
    assert_eq!(
        row.get::<_, Option<String>>(1),
        None,
        "the error clears when Redis is back"
    );
    assert!(row.get::<_, bool>(2));
}

#[test]
fn status_views_never_scan_a_million_rows_of_history() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.retention", "0")]);
    let mut client = pg.with_extension();
    client
        .batch_execute(
            "INSERT INTO outbox (topic, payload, published_at) \
             SELECT 'history', '{}', now() FROM generate_series(1, 1000000); \
             ANALYZE outbox",
        )
        .unwrap();
    enqueue_many(&mut client, "fresh", 5);
    for view in ["outbox_status", "outbox_workers"] {
        let plan: Vec<String> = client
            .query(&format!("EXPLAIN SELECT * FROM {view}"), &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let plan = plan.join("\n");
        // outbox_dead and outbox_delayed hold dead letters and events waiting for their time,
        // never the history.
        let seq_scans_of_outbox = plan
            .lines()
            .filter(|l| {
                l.contains("Seq Scan on outbox")
                    && !l.contains("Seq Scan on outbox_dead")
                    && !l.contains("Seq Scan on outbox_delayed")
            })
            .count();
        assert_eq!(seq_scans_of_outbox, 0, "{view} scans the history:\n{plan}");
    }
    assert!(wait_until(Duration::from_secs(10), || one::<i64>(
        &mut pg.connect(),
        "SELECT pending FROM outbox_status"
    ) == 0));
}

#[test]
fn dump_and_restore_keep_events_dead_letters_and_ids() {
    let redis = Redis::start();
    let url = redis.url();
    // The source does not relay, so its events stay pending.
    let source = Pg::start(&[("outbox.workers", "0")]);
    let mut client = source.with_extension();
    let pending = enqueue_many(&mut client, "moved", 20);
    client
        .batch_execute(
            "INSERT INTO outbox_dead (id, topic, payload, created_at, attempts, last_error) \
             VALUES (nextval('outbox_id_seq'), 'dead', '{}', now(), 10, 'WRONGTYPE'); \
             INSERT INTO outbox (topic, payload, published_at) VALUES ('old', '{}', now())",
        )
        .unwrap();
    let highest: i64 = one(
        &mut client,
        "SELECT max(id) FROM (SELECT id FROM outbox UNION ALL SELECT id FROM outbox_dead) t",
    );
    let dump = source.dir.join("outbox.sql");
    source.client_program("pg_dump", &["-d", "postgres", "-f", dump.to_str().unwrap()]);

    let target = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.poll_interval", "100ms"),
    ]);
    target.client_program(
        "psql",
        &[
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            "postgres",
            "-f",
            dump.to_str().unwrap(),
        ],
    );
    assert!(
        wait_until(Duration::from_secs(15), || redis.xlen("moved") == 20),
        "restored events not published"
    );
    assert_eq!(redis.ids("moved"), pending);
    let mut restored = target.connect();
    assert_eq!(
        one::<i64>(&mut restored, "SELECT count(*) FROM outbox_dead"),
        1
    );
    assert_eq!(
        redis.xlen("old"),
        0,
        "an event published before the dump went out again"
    );
    let next: i64 = one(
        &mut restored,
        "SELECT outbox_enqueue('after.restore', '{}')",
    );
    assert!(
        next > highest,
        "new id {next} collides with restored ids up to {highest}"
    );
}

#[test]
fn a_monitoring_role_needs_only_select_on_the_views() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[]);
    let mut admin = pg.with_extension();
    admin
        .batch_execute("CREATE ROLE monitoring LOGIN; GRANT SELECT ON outbox_status, outbox_workers TO monitoring")
        .unwrap();
    let mut monitor = pg.connect();
    monitor.batch_execute("SET ROLE monitoring").unwrap();
    assert_eq!(
        one::<i64>(&mut monitor, "SELECT pending FROM outbox_status"),
        0
    );
    assert_eq!(
        monitor
            .query("SELECT * FROM outbox_workers", &[])
            .unwrap()
            .len(),
        1
    );
    let error = monitor.batch_execute("SELECT * FROM outbox").unwrap_err();
    assert_eq!(error.code().map(|c| c.code()), Some("42501"));
    let error = monitor
        .batch_execute("SELECT outbox_redrive_all()")
        .unwrap_err();
    assert_eq!(error.code().map(|c| c.code()), Some("42501"));
}

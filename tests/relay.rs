//! The relay against real servers: wake-up latency, parallel workers, crashes, Redis outages,
//! poison events, shutdown, standby and reloads.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use common::{enqueue_many, wait_until, Pg, Redis};

fn count_ids(ids: &[i64]) -> HashMap<i64, usize> {
    let mut counts = HashMap::new();
    for id in ids {
        *counts.entry(*id).or_insert(0) += 1;
    }
    counts
}

/// The partitions' primary keys, and their indexes of unpublished events, for LIKE.
const PRIMARY_KEYS: &str = "outbox\\_%\\_pkey";
const UNPUBLISHED_INDEXES: &str = "outbox\\_%\\_id\\_lane\\_idx";
const RETRY_INDEXES: &str = "outbox\\_%\\_next\\_attempt\\_at\\_idx";
/// The partitions' indexes of the events that hold others back (`outbox_failing`).
const FAILING_INDEXES: &str = "outbox\\_%\\_lane\\_left\\_id\\_idx";

/// Index entries read from the partitions' indexes whose names are `LIKE pattern`, as the
/// statistics count them.
fn index_entries_read(client: &mut postgres::Client, pattern: &str) -> i64 {
    index_statistic(client, "idx_tup_read", pattern)
}

/// Index scans of the partitions' indexes whose names are `LIKE pattern`.
fn index_scans(client: &mut postgres::Client, pattern: &str) -> i64 {
    index_statistic(client, "idx_scan", pattern)
}

/// The sum of a column of `pg_stat_user_indexes` over the partitions' indexes whose names are
/// `LIKE pattern`.
fn index_statistic(client: &mut postgres::Client, column: &str, pattern: &str) -> i64 {
    client
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .unwrap();
    client
        .query_one(
            &format!(
                "SELECT coalesce(sum({column}), 0)::bigint FROM pg_stat_user_indexes \
                 WHERE indexrelname LIKE $1 \
                   AND relid IN (SELECT inhrelid FROM pg_inherits \
                                 WHERE inhparent = 'outbox'::regclass)"
            ),
            &[&pattern],
        )
        .unwrap()
        .get(0)
}

/// Enqueues `n` events to `topic`, each in its own transaction once the one before is in its
/// stream: each takes a pass of its own.
fn enqueue_one_pass_each(client: &mut postgres::Client, redis: &Redis, topic: &str, n: usize) {
    for i in 1..=n {
        client
            .batch_execute(&format!("SELECT outbox_enqueue('{topic}', '{{}}')"))
            .unwrap();
        assert!(wait_until(Duration::from_secs(10), || redis.xlen(topic) == i));
    }
}

/// Events of a prepared transaction become visible at `COMMIT PREPARED`, which may run in another
/// session: that commit wakes the relay too, rather than leaving the events to the poll.
#[test]
fn a_commit_prepared_wakes_the_relay() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "30s"),
            ("max_prepared_transactions", "5"),
            // A transaction that notified cannot be prepared.
            ("outbox.notify_channel", ""),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // A pass woken by a commit, after which the worker sleeps on its 30 s poll.
    client
        .batch_execute("SELECT outbox_enqueue('warm', '{}')")
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("warm") == 1));
    let mut preparer = pg.connect();
    preparer
        .batch_execute(
            "BEGIN; SELECT outbox_enqueue('prepared', '{}'); PREPARE TRANSACTION 'later'",
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(redis.xlen("prepared"), 0, "published before its commit");
    let started = Instant::now();
    client.batch_execute("COMMIT PREPARED 'later'").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("prepared") == 1),
        "not published {:?} after COMMIT PREPARED (the poll is 30 s)",
        started.elapsed()
    );
    // ROLLBACK PREPARED publishes nothing.
    preparer
        .batch_execute(
            "BEGIN; SELECT outbox_enqueue('prepared', '{}'); PREPARE TRANSACTION 'never'",
        )
        .unwrap();
    client.batch_execute("ROLLBACK PREPARED 'never'").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(redis.xlen("prepared"), 1);
}

/// Returns once the worker has reported the counts of its passes so far: it reports after a
/// pass, at most once a second, and a reload wakes it for one more pass.
fn after_the_worker_reports(client: &mut postgres::Client) {
    std::thread::sleep(Duration::from_millis(1200));
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
}

#[test]
fn a_committed_event_reaches_its_stream_long_before_the_poll() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "10s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // Let the worker finish its first pass and go to sleep on its 10 s poll.
    std::thread::sleep(Duration::from_millis(500));

    let started = Instant::now();
    let row = client
        .query_one(
            "SELECT outbox_enqueue('account.created', '{\"account_id\": 7}')",
            &[],
        )
        .unwrap();
    let id: i64 = row.get(0);
    assert!(
        wait_until(Duration::from_secs(9), || redis.xlen("account.created")
            == 1),
        "the event did not arrive"
    );
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(1),
        "woken at commit, yet it took {elapsed:?}"
    );

    let entries = redis.entries("account.created");
    let fields = &entries[0].1;
    assert_eq!(fields["id"], id.to_string());
    assert_eq!(fields["topic"], "account.created");
    assert_eq!(fields["payload"], r#"{"account_id": 7}"#);
    let created_at = &fields["created_at"];
    assert!(
        created_at.ends_with('Z') && created_at.contains('T'),
        "not RFC 3339: {created_at}"
    );
    let stored: String = client
        .query_one(
            "SELECT to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(created_at, &stored);
    let fields_in_order: Vec<String> = {
        let raw: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg("account.created")
            .arg("-")
            .arg("+")
            .query(&mut redis.conn())
            .unwrap();
        raw[0].1.iter().step_by(2).cloned().collect()
    };
    assert_eq!(fields_in_order, ["id", "topic", "payload", "created_at"]);

    assert!(
        wait_until(Duration::from_secs(5), || pg.pending() == 0),
        "the event was not marked published"
    );
}

#[test]
fn prefix_and_maxlen_shape_the_stream() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.stream_prefix", "app:"),
            ("outbox.stream_maxlen", "10"),
        ],
    );
    let mut client = pg.with_extension();
    enqueue_many(&mut client, "orders", 500);
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "backlog not drained"
    );
    assert_eq!(redis.xlen("orders"), 0, "the prefix was not applied");
    let len = redis.xlen("app:orders");
    // MAXLEN ~ trims whole macro nodes, so the stream keeps at least 10 and far fewer than 500.
    assert!((10..500).contains(&len), "stream length {len}");
    let ids = redis.ids("app:orders");
    assert_eq!(*ids.last().unwrap(), 500, "the newest entry is kept");
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "entries out of id order"
    );
}

#[test]
fn four_workers_share_a_backlog_without_double_publishing() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.workers", "4"),
            ("outbox.batch_size", "50"),
            ("outbox.dedupe", "off"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(4);
    let ids = enqueue_many(&mut client, "parallel", 200);
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "backlog not drained"
    );
    std::thread::sleep(Duration::from_millis(300));
    let published = redis.ids("parallel");
    assert_eq!(
        published.len(),
        200,
        "the stream grew by {} instead of 200",
        published.len()
    );
    let unique: BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(
        unique,
        ids.iter().copied().collect::<BTreeSet<_>>(),
        "each id exactly once"
    );

    let mut status = pg.connect();
    let rows = status
        .query(
            "SELECT slot, pid, state, published FROM outbox_workers ORDER BY slot",
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), 4);
    let total: i64 = rows.iter().map(|r| r.get::<_, i64>(3)).sum();
    assert_eq!(
        total, 200,
        "the workers' counters add up to the events published"
    );
    assert!(rows.iter().all(|r| r.get::<_, Option<i32>>(1).is_some()));
}

#[test]
fn killing_a_worker_mid_drain_loses_nothing() {
    let redis = Redis::start();
    let batch = 100;
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.batch_size", "100"), ("outbox.dedupe", "off")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    client
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    // A backlog committed at once, so the worker drains it batch after batch.
    let expected: BTreeSet<i64> = enqueue_many(&mut client, "drain", 50_000)
        .into_iter()
        .collect();
    drop(client);

    let mut kills = 0;
    for _ in 0..4 {
        // Let it publish some, then kill -9 the worker in the middle of the drain.
        let before = redis.xlen("drain");
        wait_until(Duration::from_secs(20), || {
            redis.xlen("drain") > before + 2_000
        });
        if let Some(pid) = pg.worker_pids().first() {
            pg.kill9(*pid);
            kills += 1;
        }
        pg.wait_for_workers(1);
    }
    assert!(kills >= 3, "only {kills} kills landed");
    assert!(
        wait_until(Duration::from_secs(120), || pg.pending() == 0),
        "backlog not drained after the kills"
    );
    std::thread::sleep(Duration::from_millis(300));

    let published = redis.ids("drain");
    let counts = count_ids(&published);
    let unique: BTreeSet<i64> = counts.keys().copied().collect();
    assert_eq!(unique, expected, "every event reaches Redis");
    let duplicates = published.len() - unique.len();
    eprintln!(
        "{kills} kills during a 50000-event drain: {duplicates} duplicate entries, none lost"
    );
    // Only batches in flight at a kill can be published twice: at most one batch per kill.
    assert!(
        duplicates <= kills * batch,
        "{duplicates} duplicates from {kills} kills"
    );
    assert!(
        counts.values().all(|&c| c <= 1 + kills),
        "an id was published too often"
    );
    assert!(
        pg.log().contains("terminated by signal 9"),
        "the kills did not happen"
    );
}

#[test]
fn a_redis_outage_delays_events_and_logs_a_handful_of_lines() {
    let mut redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "100ms"),
            ("outbox.redis_timeout", "500ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut client, "outage", 10);
    // Marked, not only in the stream: a Redis killed between adding the entries and sending
    // the reply leaves the first ten unmarked, to go out again after the outage.
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("outage")
        == 10
        && pg.pending() == 0));

    redis.stop();
    let log_before = pg.log().len();
    let mut during = Vec::new();
    for _ in 0..20 {
        during.extend(enqueue_many(&mut client, "outage", 5));
        std::thread::sleep(Duration::from_millis(150));
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            let rows = pg
                .connect()
                .query("SELECT state FROM outbox_workers", &[])
                .unwrap();
            rows.iter().any(|r| r.get::<_, String>(0) == "backoff")
        }),
        "the worker never showed state backoff"
    );
    let error: Option<String> = client
        .query_one("SELECT last_error FROM outbox_workers", &[])
        .unwrap()
        .get(0);
    assert!(error.is_some(), "last_error is not set during the outage");
    assert_eq!(pg.pending(), 100, "nothing is marked while Redis is down");

    redis.start_again();
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "events not delivered after Redis returned"
    );
    let ids = redis.ids("outage");
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        during.iter().copied().collect(),
        "every event arrives"
    );
    assert!(wait_until(Duration::from_secs(5), || {
        let state: String = pg
            .connect()
            .query_one("SELECT state FROM outbox_workers", &[])
            .unwrap()
            .get(0);
        state == "idle"
    }));

    let log = pg.log();
    let outage_lines: Vec<&str> = log[log_before..]
        .lines()
        .filter(|l| l.contains("outbox relay"))
        .collect();
    eprintln!("log lines during the outage:\n{}", outage_lines.join("\n"));
    assert!(
        (2..=4).contains(&outage_lines.len()),
        "expected a line for the loss and one for the recovery, got {outage_lines:#?}"
    );
    assert!(outage_lines.iter().any(|l| l.contains("lost Redis")));
    assert!(outage_lines.iter().any(|l| l.contains("reachable again")));
}

#[test]
fn a_plain_insert_is_published_by_the_poll() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "1s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    std::thread::sleep(Duration::from_millis(300));
    client
        .batch_execute("INSERT INTO outbox (topic, payload) VALUES ('by.hand', '{\"x\": 1}')")
        .unwrap();
    // No wake-up: only the 1 s poll can find it. Allow for a loaded machine.
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("by.hand") == 1),
        "never published"
    );
    assert_eq!(redis.entries("by.hand")[0].1["payload"], r#"{"x": 1}"#);
}

#[test]
fn a_poison_event_does_not_stop_the_events_behind_it() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.max_attempts", "100")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // A stream key that holds a hash: XADD to it fails with WRONGTYPE.
    redis::cmd("HSET")
        .arg("poisoned")
        .arg("f")
        .arg("v")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    let mut tx = client.transaction().unwrap();
    let before: i64 = tx
        .query_one("SELECT outbox_enqueue('good', '{\"n\": 1}')", &[])
        .unwrap()
        .get(0);
    let poison: i64 = tx
        .query_one("SELECT outbox_enqueue('poisoned', '{}')", &[])
        .unwrap()
        .get(0);
    let after: i64 = tx
        .query_one("SELECT outbox_enqueue('good', '{\"n\": 2}')", &[])
        .unwrap()
        .get(0);
    tx.commit().unwrap();
    let later = enqueue_many(&mut client, "good", 50);

    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("good") == 52),
        "good events held up"
    );
    let mut expected = vec![before, after];
    expected.extend(later);
    assert_eq!(redis.ids("good"), expected);
    let row = client
        .query_one(
            "SELECT published_at IS NULL, attempts, last_error FROM outbox WHERE id = $1",
            &[&poison],
        )
        .unwrap();
    assert!(row.get::<_, bool>(0), "the poison event is still pending");
    assert!(row.get::<_, i32>(1) >= 1, "its attempts were counted");
    let error: String = row.get(2);
    assert!(error.contains("WRONGTYPE"), "{error}");
    assert!(
        pg.log().contains("rejected event"),
        "the rejection was not logged"
    );
}

#[test]
fn fast_shutdown_is_quick_while_redis_hangs() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.redis_timeout", "60s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis.pause();
    enqueue_many(&mut client, "stuck", 10);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let state: String = pg
                .connect()
                .query_one("SELECT state FROM outbox_workers", &[])
                .unwrap()
                .get(0);
            state == "publishing"
        }),
        "the worker never started publishing"
    );
    drop(client);
    let took = pg.stop("fast");
    redis.resume();
    assert!(
        took < Duration::from_secs(5),
        "fast shutdown took {took:?} with Redis frozen"
    );
}

#[test]
fn a_standby_waits_and_publishes_after_promotion() {
    let redis = Redis::start();
    let url = redis.url();
    // The primary does not relay, so whatever reaches Redis came from the standby.
    let primary = Pg::start(&[("outbox.redis_url", url.as_str()), ("outbox.workers", "0")]);
    let mut client = primary.with_extension();
    let standby = primary.start_standby(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.poll_interval", "200ms"),
        ("hot_standby", "on"),
    ]);
    let ids = enqueue_many(&mut client, "replicated", 25);
    let mut replica = standby.connect();
    assert!(
        wait_until(Duration::from_secs(20), || {
            replica
                .query_one("SELECT count(*) FROM outbox", &[])
                .map(|r| r.get::<_, i64>(0) == 25)
                .unwrap_or(false)
        }),
        "the rows did not replicate"
    );
    let state: String = replica
        .query_one("SELECT state FROM outbox_workers", &[])
        .unwrap()
        .get(0);
    assert_eq!(state, "standby");
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(redis.xlen("replicated"), 0, "a standby published");

    standby.promote();
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("replicated") == 25),
        "nothing after promotion"
    );
    assert_eq!(redis.ids("replicated"), ids);
    assert!(standby.log().contains("relaying starts on promotion"));
}

#[test]
fn the_worker_waits_for_create_extension_then_relays_without_restart() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    pg.wait_for_workers(1);
    let pid_before = pg.worker_pids();
    assert!(wait_until(Duration::from_secs(10), || pg
        .log()
        .contains("waiting for CREATE EXTENSION outbox")));
    let mut client = pg.with_extension();
    let id: i64 = client
        .query_one("SELECT outbox_enqueue('late', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("late") == 1));
    assert_eq!(redis.ids("late"), [id]);
    assert_eq!(pg.worker_pids(), pid_before, "the worker was restarted");
}

#[test]
fn workers_are_named_and_reload_their_settings_on_sighup() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(&redis, &[]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let row = client
        .query_one("SELECT application_name, backend_type FROM pg_stat_activity WHERE backend_type = 'outbox relay'", &[])
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "outbox relay 0");

    pg.set(&[
        ("outbox.stream_prefix", "reloaded:"),
        ("outbox.batch_size", "7"),
    ]);
    assert!(
        wait_until(Duration::from_secs(10), || pg.log().contains("reloaded")
            && pg.log().contains("batch_size=7")),
        "the reload was not logged"
    );
    client
        .query_one("SELECT outbox_enqueue('after', '{}')", &[])
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("reloaded:after")
            == 1),
        "prefix not reloaded"
    );

    // pg_terminate_backend stops a worker; the postmaster starts it again.
    let pid = pg.worker_pids()[0];
    client
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        let pids = pg.worker_pids();
        pids.len() == 1 && pids[0] != pid
    }));
}

#[test]
fn an_extension_in_its_own_schema_is_relayed() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.connect();
    client
        .batch_execute("CREATE SCHEMA infra; CREATE EXTENSION outbox SCHEMA infra")
        .unwrap();
    let id: i64 = client
        .query_one("SELECT infra.outbox_enqueue('elsewhere', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(wait_until(Duration::from_secs(10), || redis
        .xlen("elsewhere")
        == 1));
    assert_eq!(redis.ids("elsewhere"), [id]);
    let pending: i64 = client
        .query_one("SELECT pending FROM infra.outbox_status", &[])
        .unwrap()
        .get(0);
    assert_eq!(pending, 0);
    assert!(pg.log().contains("relaying from schema infra"));
}

#[test]
fn large_batches_go_out_in_chunks_around_a_poison_event() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "1000"),
            ("outbox.max_attempts", "100"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis::cmd("HSET")
        .arg("bad")
        .arg("f")
        .arg("v")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    // 3000 events in one transaction; the one in the middle of the second chunk goes to a
    // stream key that holds a hash.
    let ids: Vec<(i64, String)> = client
        .query(
            "SELECT outbox_enqueue(CASE WHEN g = 1400 THEN 'bad' ELSE 'good' END, jsonb_build_object('n', g)), \
                    CASE WHEN g = 1400 THEN 'bad' ELSE 'good' END \
             FROM generate_series(1, 3000) g",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let good: Vec<i64> = ids
        .iter()
        .filter(|(_, t)| t == "good")
        .map(|(id, _)| *id)
        .collect();
    let bad = ids.iter().find(|(_, t)| t == "bad").unwrap().0;
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("good") == 2999),
        "good events held up"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(redis.ids("good"), good, "each good event once, in id order");
    let row = client
        .query_one(
            "SELECT published_at IS NULL, attempts >= 1 FROM outbox WHERE id = $1",
            &[&bad],
        )
        .unwrap();
    assert!(
        row.get::<_, bool>(0) && row.get::<_, bool>(1),
        "the poison event is pending with an attempt charged"
    );
    assert_eq!(pg.pending(), 1);
}

/// The relay's plans walk indexes whatever the statistics said when they were made: plans made
/// while the table held a page are kept through the burst that follows, and must not scan it.
#[test]
fn plans_made_on_a_small_table_never_scan_it_during_a_burst() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.max_attempts", "100")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    client.batch_execute("VACUUM ANALYZE outbox").unwrap();
    // A stream key holding a hash: its event is rejected, so the failure statement is planned
    // on the small table too.
    redis::cmd("HSET")
        .arg("rejected")
        .arg("f")
        .arg("v")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('rejected', '{}')")
        .unwrap();
    // Events one at a time: each its own pass, enough for the plan cache to settle on the
    // plans it keeps (it tries five custom plans first).
    for n in 1..=10 {
        client
            .batch_execute("SELECT outbox_enqueue('small', '{}')")
            .unwrap();
        assert!(wait_until(Duration::from_secs(10), || redis.xlen("small") == n));
    }
    let stats = |client: &mut postgres::Client| -> (i64, i64) {
        let row = client
            .query_one(
                "SELECT sum(seq_scan)::bigint, sum(n_tup_upd)::bigint FROM pg_stat_user_tables \
                 WHERE relid IN (SELECT inhrelid FROM pg_inherits \
                                 WHERE inhparent = 'outbox'::regclass)",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(
        wait_until(Duration::from_secs(10), || stats(&mut client).1 >= 11),
        "the worker's first updates never reached the statistics"
    );
    let (scans_before, updated_before) = stats(&mut client);

    enqueue_many(&mut client, "burst", 20_000);
    assert!(
        wait_until(Duration::from_secs(60), || redis.xlen("burst") == 20_000),
        "the burst was not relayed"
    );
    // The worker flushes its statistics after each pass; wait until they show the burst.
    assert!(
        wait_until(Duration::from_secs(10), || {
            stats(&mut client).1 >= updated_before + 20_000
        }),
        "the burst's updates never reached the statistics"
    );
    let (scans_after, _) = stats(&mut client);
    assert_eq!(
        scans_after,
        scans_before,
        "the relay scanned the outbox table {} times during the burst",
        scans_after - scans_before
    );
}

/// The claims read the index of unpublished events whatever the statistics say. A partition
/// analyzed while its rows were unpublished (autovacuum after a burst, say), then emptied, is
/// planned for as a small table of unpublished rows: a claim ordered by id alone went through
/// its primary key, and once the ring came round to it again, read every row published there
/// since, for every pass.
#[test]
fn claims_pass_by_published_rows_through_the_index_of_unpublished_ones() {
    let redis = Redis::start();
    // Statistics stay what this test makes them.
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.batch_size", "100"), ("autovacuum", "off")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let relayed = |topic: &str, n: usize| {
        assert!(
            wait_until(Duration::from_secs(60), || redis.xlen(topic) == n),
            "{topic} was not relayed"
        );
    };
    // The second partition's run of ids: analyzed while unpublished, published, emptied.
    client
        .batch_execute("SELECT setval('outbox_id_seq', 65536)")
        .unwrap();
    client.batch_execute("BEGIN").unwrap();
    enqueue_many(&mut client, "before", 1_000);
    client.batch_execute("ANALYZE outbox; COMMIT").unwrap();
    relayed("before", 1_000);
    for statement in ["TRUNCATE outbox", "VACUUM outbox"] {
        client.batch_execute(statement).unwrap();
    }
    // A pass from the lowest id (as after any enqueue) plans the claims again, on the empty
    // partition.
    client.batch_execute("SELECT _outbox_wake()").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // 30,000 published rows in it.
    enqueue_many(&mut client, "history", 30_000);
    relayed("history", 30_000);
    after_the_worker_reports(&mut client);
    let before = index_entries_read(&mut client, PRIMARY_KEYS);
    // Each event its own transaction: each pass claims from the lowest id.
    enqueue_one_pass_each(&mut client, &redis, "single", 100);
    after_the_worker_reports(&mut client);
    // Marking reads one entry per event; a claim through the primary key reads the 30,000
    // published rows.
    let read = index_entries_read(&mut client, PRIMARY_KEYS) - before;
    eprintln!("{read} primary key entries read for 100 events");
    assert!(
        read >= 100,
        "{read} primary key entries read: the counts were not reported"
    );
    assert!(
        read < 10_000,
        "{read} primary key entries read for 100 events"
    );
}

/// After a pass of its own the worker waits a short while for more commits before it flushes
/// its commit and waits again, up to the poll interval. A commit that wakes it just as that
/// short wait runs out still has its event go out at once, not at the poll. The commits here
/// come a little later each time after the last event arrived, sweeping across the moment the
/// short wait ends.
#[test]
fn a_commit_as_the_workers_short_wait_ends_still_wakes_it() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "1h")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    std::thread::sleep(Duration::from_millis(500));
    let mut conn = redis.conn();
    let mut last_entry = "0-0".to_string();
    let mut slowest = Duration::ZERO;
    for n in 0..600_u64 {
        client
            .batch_execute("SELECT outbox_enqueue('swept', '{}')")
            .unwrap();
        let committed = Instant::now();
        last_entry = common::next_entry(
            &redis,
            &mut conn,
            "swept",
            &last_entry,
            Duration::from_secs(5),
        )
        .unwrap_or_else(|| {
            panic!("event {n} was not in its stream 5 s after its commit (the poll is 1 h)")
        });
        slowest = slowest.max(committed.elapsed());
        // The next commit 19.5 to 22.5 ms after this arrival, 5 us later each time.
        std::thread::sleep(Duration::from_micros(19_500 + 5 * n));
    }
    eprintln!("600 events, the slowest in its stream {slowest:?} after its commit");
}

/// A pass woken by a commit claims a handful of events, all in the partition the commit wrote
/// to. Its claim reads that partition's index of unpublished events, not all 16 (the others
/// had none when last read and no commit wrote to them since). And while no event in the
/// worker's lanes has failed, none can be waiting out a retry (only the relay schedules
/// retries, and what it charged counts as failing until it is out), so the index of waiting
/// events is read once per poll interval, as the poll would, not with every claim.
#[test]
fn a_woken_pass_reads_only_the_index_its_commit_wrote_to() {
    let redis = Redis::start();
    // No poll falls inside the measured passes, however slowly a loaded machine runs them.
    let mut pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "1h")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    std::thread::sleep(Duration::from_millis(500));
    after_the_worker_reports(&mut client);
    let (fresh, retry) = (
        index_scans(&mut client, UNPUBLISHED_INDEXES),
        index_scans(&mut client, RETRY_INDEXES),
    );
    enqueue_one_pass_each(&mut client, &redis, "single", 50);
    after_the_worker_reports(&mut client);
    let fresh = index_scans(&mut client, UNPUBLISHED_INDEXES) - fresh;
    let retry = index_scans(&mut client, RETRY_INDEXES) - retry;
    eprintln!("50 passes: {fresh} scans of the unpublished indexes, {retry} of the retry indexes");
    // Each event took a pass of its own, whose claim read at least its partition's index.
    assert!(
        fresh >= 50,
        "{fresh} scans of the unpublished indexes: the counts were not reported"
    );
    // The reload that makes the worker report wakes it for a pass that looks into every
    // partition; one more such look is left as slack.
    assert!(
        fresh <= 50 + 2 * 16,
        "{fresh} scans of the unpublished indexes in 50 passes"
    );
    assert!(
        retry <= 16,
        "{retry} scans of the retry indexes in 50 passes with nothing failed"
    );

    // An event given a retry time by hand (attempts still 0: nothing failed) goes out with the
    // poll, as a row written by hand does.
    pg.set(&[("outbox.poll_interval", "500ms")]);
    std::thread::sleep(Duration::from_millis(500));
    client
        .batch_execute(
            "INSERT INTO outbox (topic, payload, next_attempt_at) \
             VALUES ('by-hand', '{}', now())",
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || redis.xlen("by-hand") == 1),
        "an event due for a retry set by hand was not published"
    );
}

/// `TRUNCATE outbox` locks the table, then its partitions; a relay pass woken by a commit
/// claims from one partition. Taking that partition's lock before the table's deadlocked with
/// the `TRUNCATE` (four times in a minute of the write benchmark, which truncates between runs).
#[test]
fn truncating_outbox_while_the_relay_works_never_deadlocks() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "10s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let mut writer = pg.connect();
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                writer
                    .batch_execute("SELECT outbox_enqueue('t', '{}')")
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    let started = Instant::now();
    let (mut truncated, mut deadlocks) = (0, 0);
    while started.elapsed() < Duration::from_secs(8) {
        match client.batch_execute("TRUNCATE outbox") {
            Ok(()) => truncated += 1,
            Err(e) if common::sqlstate(&e) == "40P01" => deadlocks += 1,
            Err(e) => panic!("TRUNCATE failed: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let enqueued = writer.join().unwrap();
    let log_deadlocks = pg.log().matches("deadlock detected").count();
    eprintln!(
        "{truncated} TRUNCATEs beside {enqueued} enqueues: {deadlocks} deadlocked, {log_deadlocks} \
         deadlocks in the server log"
    );
    assert!(
        enqueued > 1_000,
        "only {enqueued} enqueues: the relay was hardly woken"
    );
    assert_eq!(
        log_deadlocks, 0,
        "the relay deadlocked with TRUNCATE outbox"
    );
}

/// An event whose transaction took its id before a backlog's and commits in the middle of the
/// drain sits below the last batch claimed, and must still go out, once: while its transaction
/// runs, the relay claims from the lowest id.
#[test]
fn a_late_commit_below_a_draining_backlog_is_published() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.batch_size", "100")]);
    let mut late = pg.with_extension();
    pg.wait_for_workers(1);
    late.batch_execute("BEGIN").unwrap();
    let late_id: i64 = late
        .query_one("SELECT outbox_enqueue('late', '{}')", &[])
        .unwrap()
        .get(0);
    let mut client = pg.connect();
    let backlog = enqueue_many(&mut client, "backlog", 100_000);
    assert!(backlog[0] > late_id);
    assert!(
        wait_until(Duration::from_secs(60), || redis.xlen("backlog") >= 5_000),
        "the backlog did not start draining"
    );
    late.batch_execute("COMMIT").unwrap();
    let drained_at_commit = redis.xlen("backlog");
    assert!(
        wait_until(Duration::from_secs(60), || redis.xlen("late") == 1
            && redis.xlen("backlog") == 100_000),
        "the late event was not published (backlog at {} of 100000)",
        redis.xlen("backlog")
    );
    eprintln!("the late event committed with {drained_at_commit} of the backlog published");
    assert_eq!(redis.ids("late"), [late_id]);
    assert_eq!(redis.ids("backlog"), backlog);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
}

/// A backlog drained while no transaction enqueues is claimed past the last batch, not from the
/// lowest unpublished id: each claim from the lowest id steps over the index entries of every
/// event published since vacuum came, which a snapshot held elsewhere keeps from being marked
/// dead. Counted in index entries read, not timed.
#[test]
fn a_quiet_backlog_is_claimed_past_the_last_batch() {
    let redis = Redis::start();
    // No poll once the backlog is out: each would read every entry once more.
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.batch_size", "100"), ("outbox.poll_interval", "1h")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // A snapshot held in the database keeps the published events' entries alive.
    let mut reader = pg.connect();
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .unwrap();
    let before = index_entries_read(&mut client, UNPUBLISHED_INDEXES);
    let n = 20_000;
    enqueue_many(&mut client, "quiet", n);
    assert!(
        wait_until(Duration::from_secs(120), || redis.xlen("quiet")
            == n as usize),
        "the backlog was not drained"
    );
    after_the_worker_reports(&mut client);
    let read = index_entries_read(&mut client, UNPUBLISHED_INDEXES) - before;
    // Claims past the last batch read each entry about once; claims from the lowest id, 400
    // of them, would read millions.
    eprintln!("{read} index entries read to drain {n} events");
    assert!(
        read >= n,
        "only {read} index entries read: the counts were not reported"
    );
    assert!(
        read < 10 * n,
        "{read} index entries read to drain {n} events"
    );
    reader.batch_execute("COMMIT").unwrap();
    assert_eq!(redis.ids("quiet").len(), n as usize);
}

/// A relay backing off from a Redis it cannot reach tries a corrected `outbox.redis_url` as soon
/// as the configuration is reloaded, not at the end of a backoff that has grown to seconds.
#[test]
fn a_corrected_redis_url_is_tried_at_once_after_a_reload() {
    let redis = Redis::start();
    // Nothing listens on this port.
    let wrong = format!("redis://127.0.0.1:{}", common::free_port());
    let mut pg = Pg::start(&[
        ("outbox.redis_url", wrong.as_str()),
        ("outbox.poll_interval", "100ms"),
        ("outbox.redis_timeout", "500ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let ids = enqueue_many(&mut client, "fixed", 3);
    // The backoff doubles from 100 ms: after 8 s of failures the next wait is 6.4 s or 10 s.
    assert!(
        wait_until(Duration::from_secs(10), || pg.log().contains("lost Redis")),
        "the worker did not report the unreachable Redis"
    );
    std::thread::sleep(Duration::from_secs(8));
    let url = redis.url();
    let fixed = Instant::now();
    pg.set(&[("outbox.redis_url", url.as_str())]);
    assert!(
        wait_until(Duration::from_secs(15), || redis.xlen("fixed") == 3),
        "the events never went out"
    );
    let took = fixed.elapsed();
    assert_eq!(redis.ids("fixed"), ids);
    assert!(
        took < Duration::from_secs(4),
        "the corrected URL was tried {took:?} after the reload"
    );
}

/// The anonymous memory of a process now, in KiB (`RssAnon`: its heap, not the shared buffers
/// it touched).
fn anonymous_kib(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Events are bounded in the relay's memory by bytes, not only by count: forty rows with 8 MB
/// keys (written by hand, as rows from before keys were capped; they compress to a few KB)
/// make a batch of 320 MB of text, which the relay would hold twice over. Claims stop reading
/// at 16 MB, so the worker's heap stays far below one batch.
#[test]
fn large_events_are_claimed_a_few_megabytes_at_a_time() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let pid = pg.worker_pids()[0];
    let before = anonymous_kib(pid).expect("cannot read the worker's memory");
    client
        .batch_execute(
            "INSERT INTO outbox (topic, payload, key, lane) \
             SELECT 'large', jsonb_build_object('n', g), k, outbox_lane(k, 'large') \
             FROM generate_series(1, 40) g, LATERAL (SELECT repeat('k', 8 * 1024 * 1024) || g AS k) key",
        )
        .unwrap();
    let mut peak = before;
    let drained = wait_until(Duration::from_secs(120), || {
        peak = peak.max(anonymous_kib(pid).unwrap_or(0));
        pg.pending() == 0
    });
    assert!(drained, "the large events were not published");
    assert_eq!(redis.xlen("large"), 40);
    let grown_mb = peak.saturating_sub(before) / 1024;
    eprintln!("the worker's heap grew by {grown_mb} MB at most");
    // One batch read whole is 320 MB of keys, held twice: over 600 MB.
    assert!(
        grown_mb < 200,
        "the worker's heap grew by {grown_mb} MB while relaying 40 events of 8 MB"
    );
    // Published in id order, none twice.
    let ids = redis.ids("large");
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
}

/// The first of a query's single `bigint` column.
fn count(client: &mut postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).unwrap().get(0)
}

/// 20,000 events of one topic that Redis rejects (its stream key holds a string), without a
/// key: the first of them fail, and all the others wait behind those. The claims used to read
/// every waiting one again in every pass, each with a probe for the failed events before it: a
/// healthy topic's events beside them waited 80 ms at the median. Now the claims hold the
/// waiting events once, and then a pass reads what it claims: the index entries that 100
/// passes read stay far below what a single pass read before (the backlog's 20,000).
#[test]
fn a_rejected_topics_held_backlog_costs_each_pass_a_batch() {
    const BACKLOG: i64 = 20_000;
    let redis = Redis::start();
    // Statistics stay what this test makes them; the rejected events are never buried.
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.max_attempts", "1000"),
            ("autovacuum", "off"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    redis.query::<()>(redis::cmd("SET").arg("bad").arg("x"));
    enqueue_many(&mut client, "bad", BACKLOG);
    assert!(
        wait_until(Duration::from_secs(60), || count(
            &mut client,
            "SELECT count(*) FROM outbox \
             WHERE topic = 'bad' AND published_at IS NULL AND next_attempt_at IS NULL"
        ) == 0),
        "{} events of the rejected topic were still among the fresh ones",
        count(
            &mut client,
            "SELECT count(*) FROM outbox \
             WHERE topic = 'bad' AND published_at IS NULL AND next_attempt_at IS NULL"
        )
    );
    let held = count(
        &mut client,
        "SELECT count(*) FROM outbox WHERE topic = 'bad' AND next_attempt_at = 'infinity'",
    );
    let failed = count(
        &mut client,
        "SELECT count(*) FROM outbox WHERE topic = 'bad' AND attempts > 0",
    );
    eprintln!("{held} events of the rejected topic held, {failed} charged");
    // Those sent in the first pass failed; every other one waits, held, uncharged.
    assert!(failed >= 1, "no event of the rejected topic was charged");
    assert!(held >= BACKLOG - 100, "{held} of {BACKLOG} held");
    assert_eq!(
        count(
            &mut client,
            "SELECT count(*) FROM outbox WHERE topic = 'bad' AND published_at IS NULL"
        ),
        BACKLOG,
        "an event of the rejected topic was marked published"
    );

    after_the_worker_reports(&mut client);
    let read = |client: &mut postgres::Client| {
        index_entries_read(client, UNPUBLISHED_INDEXES)
            + index_entries_read(client, FAILING_INDEXES)
    };
    let before = read(&mut client);
    // Each event its own transaction, published before the next: a pass each, each claiming
    // from the lowest id in every partition (an event of the worker's lanes has failed).
    enqueue_one_pass_each(&mut client, &redis, "good", 100);
    after_the_worker_reports(&mut client);
    let read = read(&mut client) - before;
    eprintln!("{read} index entries read in 100 passes beside {held} held events");
    assert!(
        read >= 100,
        "{read} index entries read: the counts were not reported"
    );
    assert!(
        read < BACKLOG,
        "{read} index entries read in 100 passes beside {held} held events"
    );
    assert_eq!(
        count(
            &mut client,
            "SELECT count(*) FROM outbox \
             WHERE topic = 'bad' AND published_at IS NULL AND next_attempt_at IS NULL"
        ),
        0,
        "held events went back among the fresh ones while their key still failed"
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

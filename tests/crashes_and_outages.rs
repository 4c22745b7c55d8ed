//! Crashes and outages: a worker killed with SIGKILL in the middle of a drain loses no event;
//! Redis down, frozen or at a wrong URL delays the events without losing them or flooding the
//! log, and a corrected URL is tried as soon as it is reloaded; a fast shutdown stays quick
//! while Redis hangs and while a synchronous standby is absent. Against a real PostgreSQL and
//! Redis (that a crash publishes nothing twice is in `dedupe.rs`).

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

/// With `synchronous_standby_names` naming a standby that is not there, every commit that waits
/// for it waits forever. The relay's must not: it used to publish its first batch, then hang in
/// the commit (relaying nothing more), and a fast shutdown waited for it until pg_ctl gave up.
#[test]
fn fast_shutdown_is_quick_with_an_absent_synchronous_standby() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("synchronous_standby_names", "nobody"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.connect();
    // The test's own commits must not wait for the standby either.
    client
        .batch_execute("SET synchronous_commit = local")
        .unwrap();
    client.batch_execute("CREATE EXTENSION outbox").unwrap();
    pg.wait_for_workers(1);
    let mut ids = enqueue_many(&mut client, "sync", 1);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("sync") == 1),
        "the first event was not published"
    );
    ids.extend(enqueue_many(&mut client, "sync", 100));
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("sync") == 101),
        "the relay stopped after its first batch: its commit waits for the absent standby"
    );
    println!("unmarked events at shutdown: {}", pg.pending());
    drop(client);
    let took = pg.stop("fast");
    println!("fast shutdown took {took:?}");
    assert!(
        took < Duration::from_secs(5),
        "fast shutdown took {took:?} with an absent synchronous standby"
    );
    assert_eq!(redis.ids("sync"), ids, "every event reached Redis once");
}

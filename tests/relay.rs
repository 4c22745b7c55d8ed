//! The relay's everyday work against real servers: a commit (or a `COMMIT PREPARED`) wakes it
//! and the event reaches its stream at once, with the contract's fields, while rows written by
//! hand go out with the poll; the stream prefix and MAXLEN shape the stream; several workers
//! share a backlog, are named and reload their settings, wait for `CREATE EXTENSION`, find the
//! extension in a schema of its own, and on a standby wait for the promotion.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{enqueue_many, wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// A commit wakes the relay
// ---------------------------------------------------------------------------------------------

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

/// Events of a prepared transaction become visible at `COMMIT PREPARED`, which may run in another
/// session: that commit wakes the relay too, rather than leaving the events to the poll. With
/// the default `outbox.notify_channel`: the notification is decided at commit, and a prepared
/// transaction sends none (a transaction that notified could not be prepared).
#[test]
fn a_commit_prepared_wakes_the_relay() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "30s"),
            ("max_prepared_transactions", "5"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // A pass woken by a commit, after which the worker sleeps on its 30 s poll.
    client
        .batch_execute("SELECT outbox_enqueue('warm', '{}')")
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("warm") == 1));
    let mut listener = pg.connect();
    listener.batch_execute("LISTEN outbox").unwrap();
    let mut preparer = pg.connect();
    preparer
        .batch_execute(
            "BEGIN; SELECT outbox_enqueue('prepared', '{}'); PREPARE TRANSACTION 'later'",
        )
        .unwrap_or_else(|e| panic!("a transaction that enqueued could not be prepared: {e:?}"));
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
    let heard = common::notifications(&mut listener, Duration::from_millis(300), 1);
    assert!(
        heard.is_empty(),
        "a prepared transaction notified: {heard:?}"
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

/// A row whose created_at is 'infinity', '-infinity' or past the year 9999 (a database owner can
/// write any) is published like any other, its created_at in the same shape with more digits to
/// the year, and the relay's arithmetic on it does not overflow.
#[test]
fn created_at_at_the_ends_of_time_is_published() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "1s")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    client
        .batch_execute(
            "INSERT INTO outbox (topic, payload, created_at) VALUES \
             ('ends', '{\"at\": \"end\"}', 'infinity'), \
             ('ends', '{\"at\": \"start\"}', '-infinity'), \
             ('ends', '{\"at\": \"far\"}', '12345-06-07 08:09:10.5+00')",
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("ends") == 3),
        "not published: {}",
        pg.log()
    );
    let stamps: std::collections::HashMap<String, String> = redis
        .entries("ends")
        .into_iter()
        .map(|(_, fields)| (fields["payload"].clone(), fields["created_at"].clone()))
        .collect();
    assert!(stamps[r#"{"at": "end"}"#].starts_with("294247-01-10T04:00:54."));
    assert!(stamps[r#"{"at": "start"}"#].starts_with('-'));
    assert_eq!(stamps[r#"{"at": "far"}"#], "12345-06-07T08:09:10.500000Z");
    assert!(wait_until(Duration::from_secs(5), || pg.pending() == 0));
    assert!(!pg.log().contains("panicked"), "{}", pg.log());
}

// ---------------------------------------------------------------------------------------------
// The stream
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// The workers
// ---------------------------------------------------------------------------------------------

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

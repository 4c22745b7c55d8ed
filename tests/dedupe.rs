//! Exactly once into Redis: a relay killed between publishing a batch and marking it leaves no
//! duplicate with `outbox.dedupe = on`, and the at-least-once duplicates come back with it off.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use common::{enqueue_many, kill_between_publish_and_mark, wait_until, Pg, Redis};

const BATCH: i64 = 100;
/// The relay sends a batch of 100 in two chunks of 50.
const CHUNK: usize = 50;
/// Longer than the relay lets its own commits go unflushed (200 ms) plus a pass.
const RECENT: Duration = Duration::from_millis(400);

/// The marker hashes in Redis, with how many markers each holds and its remaining lifetime in
/// seconds. Through `Redis::query`, which asks again when a signal to the test process
/// interrupted the read (this once failed a CI run with EINTR).
fn marker_sets(redis: &Redis) -> Vec<(String, usize, i64)> {
    let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("outbox:dedupe:*"));
    keys.into_iter()
        .map(|key| {
            let members = hash_markers(redis, &key).len();
            let ttl: i64 = redis.query(redis::cmd("TTL").arg(&key));
            (key, members, ttl)
        })
        .collect()
}

/// The markers one hash holds, as "<id>|<created_at>": a field per script call, listing those
/// of the events the call added, separated by ';'.
fn hash_markers(redis: &Redis, key: &str) -> Vec<String> {
    let fields: HashMap<String, String> = redis.query(redis::cmd("HGETALL").arg(key));
    fields
        .values()
        .flat_map(|value| value.split(';').map(str::to_string))
        .collect()
}

/// Markers held in Redis: events across all marker hashes.
fn markers(redis: &Redis) -> usize {
    marker_sets(redis)
        .iter()
        .map(|(_, members, _)| members)
        .sum()
}

/// Five kills, each between publishing a batch and marking it, then one at a random moment of
/// a 20,000-event drain. Returns the published ids, the enqueued ones, and how many entries
/// reached the stream in the [`RECENT`] before the last kill.
fn drain_with_kills(dedupe: &str) -> (Vec<i64>, BTreeSet<i64>, Redis, usize) {
    let redis = Redis::start();
    let batch = BATCH.to_string();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.dedupe", dedupe),
            ("outbox.batch_size", batch.as_str()),
            ("outbox.poll_interval", "100ms"),
            // How long the relay's commits may stay off disk (see below).
            ("wal_writer_delay", "20ms"),
        ],
    );
    pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = BTreeSet::new();
    for _ in 0..5 {
        expected.extend(kill_between_publish_and_mark(
            &pg,
            || redis.xlen("drain"),
            "drain",
            2_000,
            || {},
        ));
    }
    let mut client = pg.connect();
    expected.extend(enqueue_many(&mut client, "drain", 20_000));
    drop(client);
    // How many entries reached the stream in the last RECENT before the kill: the commits whose
    // markers a kill may leave are among them (see the bound below).
    let pid = pg.worker_pids()[0];
    let before = redis.xlen("drain");
    let start = Instant::now();
    let mut seen: VecDeque<(Instant, usize)> = VecDeque::new();
    loop {
        let now = (Instant::now(), redis.xlen("drain"));
        while seen.len() > 1 && now.0 - seen[1].0 >= RECENT {
            seen.pop_front();
        }
        seen.push_back(now);
        if now.1 > before + 5_000 || start.elapsed() > Duration::from_secs(20) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    pg.kill9(pid);
    let recent = seen.back().unwrap().1 - seen.front().unwrap().1;
    assert!(
        wait_until(Duration::from_secs(120), || pg.pending() == 0),
        "backlog not drained"
    );
    std::thread::sleep(Duration::from_millis(300));
    (redis.ids("drain"), expected, redis, recent)
}

fn duplicates(ids: &[i64]) -> usize {
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for id in ids {
        *counts.entry(*id).or_default() += 1;
    }
    counts.values().map(|c| c - 1).sum()
}

#[test]
fn with_dedupe_on_kills_leave_every_id_in_its_stream_once() {
    // `on` is `auto`: IDMP on Redis 8.6.2 and later, markers elsewhere.
    let (ids, expected, redis, recent) = drain_with_kills("on");
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        expected,
        "an event was lost"
    );
    assert_eq!(duplicates(&ids), 0, "duplicates with dedupe on");
    assert_eq!(ids.len(), expected.len());
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "a single worker publishes in id order"
    );
    eprintln!(
        "dedupe on: 6 kills, {} entries for {} events",
        ids.len(),
        expected.len()
    );
    // A kill leaves the markers of the batches whose commits were not yet known to be on disk:
    // the batch in flight, and those committed since the last flush. The WAL writer flushes
    // every 20 ms here, but a busy machine can hold it back; the relay flushes its own commits
    // once they have waited 200 ms, so what it published in the RECENT 400 ms before the kill
    // bounds them, with the batch in flight and those released but not yet deleted (a relay
    // that never deleted markers would leave 30,000). They are in hashes that expire within
    // twice outbox.dedupe_ttl (1 day).
    let sets = marker_sets(&redis);
    let left = markers(&redis);
    eprintln!("markers left after the kills: {left}; published in the last 400 ms: {recent}");
    assert!(
        left <= recent + 5 * BATCH as usize,
        "markers left: {sets:?}"
    );
    for (key, _, ttl) in &sets {
        assert!((1..=2 * 86_400).contains(ttl), "{key} expires in {ttl}s");
    }
    if redis.has_idmp() {
        let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("*"));
        assert_eq!(keys, ["drain"], "IDMP left keys beside the stream");
        let info: Vec<redis::Value> = redis.query(redis::cmd("XINFO").arg("STREAM").arg("drain"));
        let duplicates = info
            .chunks(2)
            .find(|kv| kv[0] == redis::Value::BulkString(b"iids-duplicates".to_vec()))
            .map(|kv| kv[1].clone());
        eprintln!("IDMP: duplicates Redis absorbed: {duplicates:?}");
        assert!(
            matches!(duplicates, Some(redis::Value::Int(n)) if n > 0),
            "no republished event reached Redis: the kills did not test IDMP"
        );
    }
}

#[test]
fn with_dedupe_off_the_same_kills_duplicate_batches() {
    let (ids, expected, _redis, _) = drain_with_kills("off");
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        expected,
        "an event was lost"
    );
    let dups = duplicates(&ids);
    eprintln!("dedupe off: 6 kills, {dups} duplicate entries");
    // Each of the five kills held back a published chunk: a batch of 100 goes out as two
    // chunks of 50, and the kill lands while the first one's mark waits.
    assert!(
        dups >= 5 * CHUNK,
        "only {dups} duplicates: the test cannot see them"
    );
    assert!(
        dups <= 6 * BATCH as usize,
        "{dups} duplicates from six kills"
    );
}

/// With dedupe on, the relay's commits do not wait for their WAL flush, so a crash of the server
/// can lose the marks of the last batches it committed. Their markers stay in Redis until the
/// commits are on disk, and absorb the republication: six crashes of the whole server in the
/// middle of a drain leave every id in the stream once.
#[test]
fn server_crashes_during_a_drain_leave_every_id_once() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.poll_interval", "100ms"),
            // The WAL writer flushes seldom: a crash finds the relay's last commits unflushed.
            ("wal_writer_delay", "10s"),
            ("wal_writer_flush_after", "1GB"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let expected: BTreeSet<i64> = enqueue_many(&mut client, "crash", 30_000)
        .into_iter()
        .collect();
    drop(client);
    let mut unmarked_after = Vec::new();
    // A crash finds the last commit unflushed about half the time while a batch is in flight
    // (seen: 50 to 200 events unmarked a crash); six crashes all within one batch would be rare.
    for _ in 0..6 {
        let reached = redis.xlen("crash");
        assert!(
            wait_until(Duration::from_secs(60), || redis.xlen("crash")
                >= reached + 2_000),
            "the relay did not get going"
        );
        // The relay comes back pointed away from Redis, so that what the crash undid can be
        // counted: events in the stream whose marks were lost.
        pg.set_at_next_start(&[("outbox.redis_url", "redis://127.0.0.1:1/")]);
        pg.crash_and_start();
        let published: Vec<i64> = redis.ids("crash");
        let unmarked: i64 = pg
            .connect()
            .query_one(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND id = ANY($1)",
                &[&published],
            )
            .unwrap()
            .get(0);
        unmarked_after.push(unmarked);
        pg.set(&[("outbox.redis_url", redis.url().as_str())]);
    }
    // With every commit waiting for its flush, only the batch in flight at a crash (at most
    // 100 events) can be in the stream and unmarked after it; more means a committed mark was
    // lost, which is what the markers must absorb.
    eprintln!("events in the stream and unmarked after each crash: {unmarked_after:?}");
    assert!(
        unmarked_after.iter().any(|&n| n > BATCH),
        "no crash lost a committed mark: the test cannot see it ({unmarked_after:?})"
    );
    assert!(
        wait_until(Duration::from_secs(120), || pg.pending() == 0),
        "backlog not drained"
    );
    std::thread::sleep(Duration::from_millis(300));
    let ids = redis.ids("crash");
    assert_eq!(
        ids.iter().copied().collect::<BTreeSet<_>>(),
        expected,
        "an event was lost"
    );
    assert_eq!(duplicates(&ids), 0, "duplicates after server crashes");
}

/// WAL flushes (`pg_stat_wal.wal_sync`, `pg_stat_io` from 18 on) during 4 s of 500 events/s, each committed by a client
/// that does not wait for its own flush: what is counted is the relay's and the WAL writer's.
fn wal_syncs_under_a_steady_stream(pg: &Pg, redis: &Redis, topic: &str) -> i64 {
    let mut client = pg.connect();
    client
        .batch_execute("SET synchronous_commit = off")
        .unwrap();
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .unwrap()
        .get(0);
    // From 18 on, pg_stat_io counts them.
    let count = if version >= 180_000 {
        "SELECT COALESCE(sum(fsyncs), 0)::bigint FROM pg_stat_io WHERE object = 'wal'"
    } else {
        "SELECT wal_sync FROM pg_stat_wal"
    };
    let syncs =
        |client: &mut postgres::Client| -> i64 { client.query_one(count, &[]).unwrap().get(0) };
    let before = syncs(&mut client);
    let started = std::time::Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(4) {
        client
            .execute("SELECT outbox_enqueue($1, '{}')", &[&topic])
            .unwrap();
        sent += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen(topic) == sent),
        "the events did not arrive"
    );
    // The statistics of the relay's and the WAL writer's flushes reach pg_stat_wal within a
    // second (they report at most that often).
    std::thread::sleep(Duration::from_millis(1_500));
    syncs(&mut client) - before
}

/// With dedupe on, the relay's passes under a steady stream of commits do not wait for the WAL
/// flush of their commits; with it off they do, one flush a pass.
#[test]
fn a_steady_stream_does_not_flush_the_wal_once_a_pass() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(&redis, &[("fsync", "on")]);
    pg.with_extension();
    pg.wait_for_workers(1);
    let with_dedupe = wal_syncs_under_a_steady_stream(&pg, &redis, "steady-on");
    pg.set(&[("outbox.dedupe", "off")]);
    std::thread::sleep(Duration::from_millis(500));
    let without = wal_syncs_under_a_steady_stream(&pg, &redis, "steady-off");
    eprintln!("WAL flushes in 4 s at 500 events/s: {with_dedupe} with dedupe on, {without} off");
    assert!(
        without >= 400,
        "only {without} flushes with dedupe off: the test cannot see the relay's"
    );
    assert!(
        with_dedupe <= 100,
        "{with_dedupe} WAL flushes with dedupe on ({without} off)"
    );
}

/// `outbox.batch_size` above half the IDMP window (it allows 10,000): with IDMP, the relay held
/// every pass for the window even with nothing in doubt, and stopped after its first batch.
/// Whatever the dedupe in use, both rounds of events go out.
#[test]
fn a_batch_size_past_half_the_idmp_window_keeps_relaying() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.batch_size", "6000"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut ids = enqueue_many(&mut client, "wide", 10);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("wide") == 10));
    ids.extend(enqueue_many(&mut client, "wide", 10));
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("wide") == 20),
        "{} of 20 events published with batch_size 6000 (IDMP: {})",
        redis.xlen("wide"),
        redis.has_idmp()
    );
    assert_eq!(redis.ids("wide"), ids);
}

#[test]
fn markers_stay_bounded_by_a_few_batches() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.batch_size", "100"), ("outbox.dedupe", "markers")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let (mut most, mut most_keys) = (0, 0);
    for _ in 0..20 {
        enqueue_many(&mut client, "steady", 1_000);
        for _ in 0..5 {
            most = most.max(markers(&redis));
            most_keys = most_keys.max(marker_sets(&redis).len());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(wait_until(Duration::from_secs(30), || pg.pending() == 0));
    assert_eq!(redis.xlen("steady"), 20_000);
    eprintln!("most markers seen in Redis while relaying 20000 events: {most} in {most_keys} keys");
    assert!(
        most > 0,
        "no marker was ever seen: the test cannot see them"
    );
    // A batch's markers go once its commit is on disk, which the relay sees to itself before
    // it waits for more: at most one burst of 1,000 events and the batches after it are marked
    // in Redis at a time.
    assert!(most <= 1_000 + 3 * 100, "{most} markers for bursts of 1000");
    // 1,300 consecutive ids span at most 22 hashes of 64, a batch after them 3 more.
    assert!(
        most_keys <= 25,
        "{most_keys} marker keys for bursts of 1000"
    );
    assert!(
        wait_until(Duration::from_secs(5), || marker_sets(&redis).is_empty()),
        "marker keys left when idle"
    );
}

#[test]
fn a_crash_leaves_markers_that_absorb_the_retry_and_expire() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.dedupe_ttl", "1h"), ("outbox.dedupe", "markers")],
    );
    pg.with_extension();
    pg.wait_for_workers(1);
    let ids = kill_between_publish_and_mark(
        &pg,
        || redis.xlen("crash"),
        "crash",
        10,
        || {
            // Ten consecutive ids: one or two hashes of 64 ids each.
            let sets = marker_sets(&redis);
            assert!((1..=2).contains(&sets.len()), "marker hashes: {sets:?}");
            let mut recorded: BTreeSet<String> = BTreeSet::new();
            for (key, _, ttl) in &sets {
                // The hash tag puts the markers in the stream's Redis Cluster slot.
                assert!(key.ends_with(":{crash}"), "{key}");
                assert!(
                    (3590..=7200).contains(ttl),
                    "{key} expires in {ttl}s, not within one to two outbox.dedupe_ttl"
                );
                // Each marker records its event's id and created_at.
                recorded.extend(hash_markers(&redis, key));
            }
            let entries: BTreeSet<String> = redis
                .entries("crash")
                .into_iter()
                .map(|(_, fields)| format!("{}|{}", fields["id"], fields["created_at"]))
                .collect();
            assert_eq!(entries.len(), 10);
            assert_eq!(
                recorded, entries,
                "one marker per published, unmarked event"
            );
        },
    );
    assert_eq!(redis.xlen("crash"), 10);
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "the batch was not marked after the crash"
    );
    assert_eq!(
        redis.ids("crash"),
        ids,
        "the republished batch added entries"
    );
    assert!(
        wait_until(Duration::from_secs(5), || markers(&redis) == 0),
        "markers outlived their batch"
    );
}

/// The script itself, called as the relay calls it: markers from the previous period absorb
/// their events, whether an earlier version wrote them (a field per event) or this one (a field
/// per call), and move to the call's own field; a marker of an earlier event with the same id
/// but another created_at does not absorb; an event's key and headers go into its entry when
/// set; and a key error is reported per event with no marker written.
#[test]
fn the_script_consults_the_previous_period_and_reports_errors_per_event() {
    let redis = Redis::start();
    let mut conn = redis.conn();
    let script = include_str!("../crates/outbox-redis/src/dedupe.lua");
    let (current, previous) = ("m:2:0:s", "m:1:0:s");
    let stamp = "2026-11-30T00:00:00.000000Z";
    let other = "2026-11-29T00:00:00.000000Z";
    let _: () = redis::cmd("HSET")
        .arg(previous)
        .arg(5)
        .arg(format!("1-1|{stamp}"))
        .arg(6)
        .arg(format!("1-2|{other}"))
        .arg("mearlier")
        .arg(format!("12|{stamp};99|{stamp}"))
        .query(&mut conn)
        .unwrap();
    let expires_at = 4_102_444_800_000_u64; // 2100-01-01
    let fields =
        |key: &str| -> HashMap<String, String> { redis.query(redis::cmd("HGETALL").arg(key)) };
    // In a pipeline that keeps errors as values, as the relay sends it: one run.
    let call = |stream: &str, field: &str, ids: &[i64], conn: &mut redis::Connection| {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let cmd = pipe
            .cmd("EVAL")
            .arg(script)
            .arg(3)
            .arg(stream)
            .arg(current)
            .arg(previous);
        // Key and headers: both for event 6 (an empty key is a key), a key for 9, headers for
        // 10, none for the others.
        let shape = |id: i64| match id {
            6 => 'b',
            9 => 'k',
            10 => 'h',
            _ => '-',
        };
        let shapes: String = ids.iter().map(|&id| shape(id)).collect();
        let marker: Vec<String> = ids.iter().map(|id| format!("{id}|{stamp}")).collect();
        cmd.arg(0).arg(expires_at).arg("t").arg(shapes).arg(field);
        cmd.arg(ids.len()).arg(marker.join(";"));
        for id in ids {
            cmd.arg(id);
        }
        for &id in ids {
            cmd.arg(format!("{{\"n\": {id}}}")).arg(stamp);
            if matches!(shape(id), 'k' | 'b') {
                cmd.arg(if id == 6 {
                    String::new()
                } else {
                    format!("key-{id}")
                });
            }
            if matches!(shape(id), 'h' | 'b') {
                cmd.arg(format!("{{\"h\": {id}}}"));
            }
        }
        let mut replies: Vec<redis::Value> = pipe.query(conn).unwrap();
        replies.remove(0)
    };
    let redis::Value::Array(reply) = call("s", "mfirst", &[4, 5, 6, 12], &mut conn) else {
        panic!("not an array");
    };
    let entries = redis.entries("s");
    assert_eq!(redis.ids("s"), [4, 6], "a marked event was added again");
    assert!(!entries[0].1.contains_key("key") && !entries[0].1.contains_key("headers"));
    assert_eq!(entries[1].1["key"], "");
    assert_eq!(entries[1].1["headers"], r#"{"h": 6}"#);
    assert_eq!(entries[0].1["topic"], "t");
    assert_eq!(entries[1].1["payload"], r#"{"n": 6}"#);
    assert_eq!(entries[1].1["created_at"], stamp);
    assert_eq!(reply, [], "no event was refused");
    // The call's field lists every event of the run now in the stream, the two found there
    // included; their old markers left the fields that held them, and the others stayed.
    assert_eq!(
        fields(current),
        HashMap::from([(
            "mfirst".to_string(),
            format!("4|{stamp};5|{stamp};6|{stamp};12|{stamp}")
        )])
    );
    assert_eq!(
        fields(previous),
        HashMap::from([
            ("6".to_string(), format!("1-2|{other}")),
            ("mearlier".to_string(), format!("99|{stamp}")),
        ])
    );
    // PTTL rather than PEXPIRETIME, which Redis 6.2 lacks: the time left, from now.
    let left: i64 = redis::cmd("PTTL").arg(current).query(&mut conn).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let expected_left = expires_at as i64 - now_ms;
    assert!(
        (expected_left - 5..=expected_left + 1_000).contains(&left),
        "expires in {left} ms, not at {expires_at}"
    );

    // Events with a key alone, headers alone and neither, in one call: each gets its own fields,
    // and the call's marker is the one it was given.
    let redis::Value::Array(reply) = call("s", "msecond", &[9, 10, 11], &mut conn) else {
        panic!("not an array");
    };
    assert_eq!(reply, []);
    let entries = redis.entries("s");
    assert_eq!(redis.ids("s"), [4, 6, 9, 10, 11]);
    let (key, headers) = (&entries[2].1, &entries[3].1);
    assert_eq!(key["key"], "key-9");
    assert_eq!(key["payload"], r#"{"n": 9}"#);
    assert!(!key.contains_key("headers"));
    assert_eq!(headers["headers"], r#"{"h": 10}"#);
    assert_eq!(headers["payload"], r#"{"n": 10}"#);
    assert!(!headers.contains_key("key"));
    assert!(!entries[4].1.contains_key("key") && !entries[4].1.contains_key("headers"));
    assert_eq!(entries[4].1["payload"], r#"{"n": 11}"#);
    assert_eq!(
        fields(current)["msecond"],
        format!("9|{stamp};10|{stamp};11|{stamp}")
    );

    // A stream key holding a string: each event gets the error, as its position and text (an
    // error reply inside the array would fail the whole reply in a cluster client), and no
    // marker is written.
    let _: () = redis::cmd("SET")
        .arg("poison")
        .arg("x")
        .query(&mut conn)
        .unwrap();
    let redis::Value::Array(reply) = call("poison", "mthird", &[7, 8], &mut conn) else {
        panic!("not an array");
    };
    assert_eq!(reply.len(), 4, "{reply:?}");
    for (pair, position) in reply.chunks(2).zip(1..) {
        assert_eq!(pair[0], redis::Value::Int(position));
        match &pair[1] {
            redis::Value::BulkString(text) => assert!(
                text.starts_with(b"WRONGTYPE "),
                "{}",
                String::from_utf8_lossy(text)
            ),
            other => panic!("expected an error, got {other:?}"),
        }
    }
    assert!(!fields(current).contains_key("mthird"));
}

/// Exactly once across a failover to a synchronous standby. The relay commits without waiting
/// for the standby, so a standby promoted after a crash may lack the marks of the last batches
/// and publish them again: their markers must still be in Redis to absorb the repeat. The
/// standby's WAL receiver is frozen from a third of the drain on, so that the primary gets
/// ahead of it by many batches; at half the primary crashes, the receiver is killed with what
/// it had not written, and the standby is promoted. With IDMP (Redis 8.6.2+) the relay gets
/// ahead only as far as Redis's window reaches, and then waits for the standby.
#[test]
fn a_synchronous_standby_promoted_mid_drain_publishes_nothing_twice() {
    const EVENTS: i64 = 300_000;
    let redis = Redis::start();
    let url = redis.relay_url();
    let mut primary = Pg::start(&[
        // Pointed away while the events are written, so that the drain starts all at once.
        ("outbox.redis_url", "redis://127.0.0.1:1"),
        ("outbox.redis_timeout", "1s"),
        ("outbox.batch_size", "1000"),
    ]);
    let mut client = primary.with_extension();
    let standby = primary.start_standby(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.batch_size", "1000"),
        ("outbox.poll_interval", "100ms"),
    ]);
    primary.set(&[("synchronous_standby_names", "*")]);
    assert!(
        wait_until(Duration::from_secs(30), || primary
            .query_retrying("SELECT sync_state FROM pg_stat_replication")
            .first()
            .is_some_and(|r| r.get::<_, String>(0) == "sync")),
        "the standby did not become synchronous"
    );
    // Committed on the standby too, each transaction waiting for it.
    for _ in 0..10 {
        client
            .batch_execute(
                "SELECT outbox_enqueue('failover', jsonb_build_object('n', g)) \
                 FROM generate_series(1, 30000) g",
            )
            .unwrap();
    }
    let expected: BTreeSet<i64> = client
        .query("SELECT id FROM outbox", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(expected.len(), EVENTS as usize);

    primary.set(&[("outbox.redis_url", url.as_str())]);
    assert!(
        wait_until(Duration::from_secs(120), || redis.xlen("failover")
            >= 100_000),
        "the drain did not reach a third"
    );
    let receiver: i32 = standby.query_retrying("SELECT pid FROM pg_stat_wal_receiver")[0].get(0);
    signal(receiver, "-STOP");
    let frozen_at = redis.xlen("failover");
    if redis.has_idmp() {
        // IDMP's window keeps 10,000 identities per producer and stream: the relay stops once
        // what a failover could send again (all it published since the standby froze) would
        // outgrow half of it with another batch, and waits for the standby.
        std::thread::sleep(Duration::from_secs(3));
        let held_at = redis.xlen("failover");
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(
            redis.xlen("failover"),
            held_at,
            "the relay went on past the window"
        );
        assert!(
            held_at <= frozen_at + 5_000 + 2_000,
            "{} events published while the standby was frozen",
            held_at - frozen_at
        );
        eprintln!(
            "IDMP: held {} events after the standby froze",
            held_at - frozen_at
        );
    } else {
        assert!(
            wait_until(Duration::from_secs(120), || redis.xlen("failover")
                >= 150_000),
            "the drain stopped while the standby was frozen"
        );
    }
    primary.stop("immediate");
    // What the receiver had not written yet, in its socket's buffer too, is lost with it: the
    // standby restarts from the WAL on its disk.
    signal(receiver, "-KILL");
    assert!(
        wait_until(Duration::from_secs(60), || standby
            .log()
            .contains("all server processes terminated; reinitializing")),
        "the standby did not restart after its WAL receiver was killed"
    );
    let in_recovery: bool = standby.query_retrying("SELECT pg_is_in_recovery()")[0].get(0);
    assert!(in_recovery, "the standby came back promoted");
    standby.promote();
    assert!(
        wait_until(Duration::from_secs(180), || standby.pending() == 0),
        "the promoted standby did not finish the drain"
    );
    let published = redis.ids("failover");
    let unique: BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(
        unique.len(),
        expected.len(),
        "lost {} events",
        expected.difference(&unique).count()
    );
    assert_eq!(
        published.len(),
        unique.len(),
        "{} events published twice (the standby was frozen at {frozen_at})",
        published.len() - unique.len()
    );
}

fn signal(pid: i32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("cannot run kill");
    assert!(status.success(), "kill {signal} {pid} failed");
}

/// Events the SIGKILL drains below relay: `OUTBOX_KILL_EVENTS`, 40,000 unless set (the README's
/// figures come from 400,000).
fn kill_events() -> i64 {
    std::env::var("OUTBOX_KILL_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(40_000)
}

/// Enqueues `events` on the topic `kills` while the relay points nowhere, points it at `url`,
/// then kills it with SIGKILL 150 ms after each start until the backlog is drained (every kill
/// is a crash of the server, which loses the relay's commits not yet on disk). Returns the
/// enqueued ids and the number of kills.
fn drain_killed_every_150ms(pg: &mut Pg, url: &str, events: i64) -> (BTreeSet<i64>, usize) {
    let mut client = pg.with_extension();
    let mut expected = BTreeSet::new();
    let mut left = events;
    while left > 0 {
        let n = left.min(50_000);
        expected.extend(enqueue_many(&mut client, "kills", n));
        left -= n;
    }
    drop(client);
    pg.set(&[("outbox.redis_url", url)]);
    let started = Instant::now();
    let mut kills = 0;
    while pg.pending() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "not drained in 15 minutes: {} pending after {kills} kills",
            pg.pending()
        );
        pg.wait_for_workers(1);
        std::thread::sleep(Duration::from_millis(150));
        if let Some(&pid) = pg.worker_pids().first() {
            pg.kill9(pid);
            kills += 1;
        }
    }
    (expected, kills)
}

/// SIGKILL every 150 ms through a drain: not an event lost, not one published twice. Where the
/// server has IDMP, Redis holds nothing but the stream afterwards, and its window absorbed the
/// republished events.
#[test]
fn sigkill_every_150ms_loses_nothing_and_duplicates_nothing() {
    let redis = Redis::start();
    let mut pg = Pg::start(&[
        ("outbox.redis_url", "redis://127.0.0.1:1"),
        ("outbox.batch_size", "1000"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let (expected, kills) = drain_killed_every_150ms(&mut pg, &redis.relay_url(), kill_events());
    let published = redis.ids("kills");
    let unique: BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(
        unique.len(),
        expected.len(),
        "lost {}",
        expected.difference(&unique).count()
    );
    assert_eq!(unique, expected);
    assert_eq!(duplicates(&published), 0, "duplicates after {kills} kills");
    let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("*"));
    let absorbed = if redis.has_idmp() {
        assert_eq!(keys, ["kills"], "keys beside the stream");
        let info: Vec<redis::Value> = redis.query(redis::cmd("XINFO").arg("STREAM").arg("kills"));
        let absorbed = info
            .chunks(2)
            .find(|kv| kv[0] == redis::Value::BulkString(b"iids-duplicates".to_vec()))
            .map(|kv| kv[1].clone());
        assert!(
            matches!(absorbed, Some(redis::Value::Int(n)) if n > 0),
            "IDMP absorbed nothing: the kills republished nothing"
        );
        format!("{absorbed:?} duplicates absorbed by IDMP")
    } else {
        format!("{} marker keys left", keys.len() - 1)
    };
    eprintln!(
        "{} events, {kills} kills 150 ms apart on {:?}: 0 lost, 0 duplicates; {absorbed}",
        expected.len(),
        redis.version()
    );
    assert!(kills >= 2, "only {kills} kills");
}

/// The same on a Redis Cluster of three primaries and three replicas.
#[test]
fn on_a_cluster_sigkill_every_150ms_loses_nothing_and_duplicates_nothing() {
    let cluster = common::topology::Cluster::start(3);
    let mut pg = Pg::start(&[
        ("outbox.redis_url", "redis://127.0.0.1:1"),
        ("outbox.redis_mode", "cluster"),
        ("outbox.batch_size", "1000"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let urls = cluster.urls();
    let (expected, kills) = drain_killed_every_150ms(&mut pg, &urls, kill_events());
    let published = cluster.ids("kills");
    let unique: BTreeSet<i64> = published.iter().copied().collect();
    assert_eq!(
        unique,
        expected,
        "lost {}",
        expected.difference(&unique).count()
    );
    assert_eq!(duplicates(&published), 0, "duplicates after {kills} kills");
    let keys = cluster.keys();
    if cluster.has_idmp() {
        assert_eq!(keys, ["kills"], "keys beside the stream");
    }
    eprintln!(
        "cluster: {} events, {kills} kills 150 ms apart: 0 lost, 0 duplicates; {} keys",
        expected.len(),
        keys.len()
    );
    assert!(kills >= 2, "only {kills} kills");
}

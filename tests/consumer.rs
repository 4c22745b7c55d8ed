//! The reference consumer (crates/outbox-consumer) against a live relay. Killed with SIGKILL
//! again and again mid-stream and started again, under its own name (it finishes its pending
//! entries) or under a new one (it takes the dead consumer's over with XAUTOCLAIM), it applies
//! every event exactly once. Duplicate entries (a relay killed between publishing and marking
//! with dedupe off, an entry copied by hand) are absorbed by its inbox; entries that are not
//! events are recorded as dead and acknowledged. Where Redis has XACKDEL (8.2+) the acknowledged
//! entries leave the stream; without it they stay.
//!
//! Run against Redis 8 too: OUTBOX_TEST_REDIS_SERVER=/path/to/redis-server.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::printing::Printing;
use common::{enqueue_many, kill_between_publish_and_mark, wait_until, Pg, Redis};
use redis::Value;

const ORDERS: i64 = 20_000;
const PAYMENTS: i64 = 2_000;
const REFUNDS: i64 = 300;
const STREAMS: [&str; 3] = ["orders", "payments", "refunds"];
const GROUP: &str = "billing";
/// Kills of the consumer at least; more if the consumer whose entries a new one must take over
/// had none pending when killed.
const KILLS: usize = 6;

#[test]
fn a_consumer_killed_mid_stream_again_and_again_applies_every_event_once() {
    let started = Instant::now();
    let binary = consumer_binary();
    let redis = Redis::start();
    // XACKDEL came with ACKED trimming, in Redis 8.2; Valkey has neither.
    let xackdel = redis.has_acked_trimming();
    // With dedupe off, a relay killed between publishing a batch and marking it publishes the
    // batch again: duplicates in the stream, as the contract allows.
    let pg = Pg::relaying_to(&redis, &[("outbox.dedupe", "off")]);
    pg.with_extension()
        .batch_execute("CREATE DATABASE store")
        .unwrap();
    pg.wait_for_workers(1);
    let store = format!("host=127.0.0.1 port={} user=postgres dbname=store", pg.port);

    let mut expected: BTreeSet<i64> =
        kill_between_publish_and_mark(&pg, || redis.xlen("refunds"), "refunds", REFUNDS, || {})
            .into_iter()
            .collect();
    assert!(
        wait_until(Duration::from_secs(60), || pg.pending() == 0),
        "the relay did not publish the refunds again"
    );
    // The kill restarted the cluster, which closed the connection.
    let mut source = pg.connect();
    let refunds = redis.entries("refunds");
    let distinct: BTreeSet<&String> = refunds.iter().map(|(_, fields)| &fields["id"]).collect();
    assert!(
        refunds.len() > distinct.len(),
        "the relay's kill left no duplicate in the stream: {} entries",
        refunds.len()
    );

    // Entries that are not events, each an event with one field taken out or spoiled: no id,
    // an id that is not UTF-8, a payload that is not JSON, a created_at that is no time. The
    // last two only PostgreSQL finds out, in the middle of a batch.
    let spoiled: [(&str, Option<&[u8]>); 4] = [
        ("id", None),
        ("id", Some(b"\xff")),
        ("payload", Some(b"not json")),
        ("created_at", Some(b"noon")),
    ];
    let mut broken_ids: Vec<String> = spoiled
        .iter()
        .enumerate()
        .map(|(i, (spoiled, value))| {
            let id = (900_000_000 + i).to_string();
            let event: [(&str, &[u8]); 4] = [
                ("id", id.as_bytes()),
                ("topic", b"orders"),
                ("payload", b"{}"),
                ("created_at", b"2025-01-01T00:00:00Z"),
            ];
            let mut xadd = redis::cmd("XADD");
            xadd.arg("orders").arg("*");
            for (name, good) in event {
                if name != *spoiled {
                    xadd.arg(name).arg(good);
                } else if let Some(bad) = value {
                    xadd.arg(name).arg(*bad);
                }
            }
            redis.query::<String>(&xadd)
        })
        .collect();
    broken_ids.sort();

    // The consumer starts first, and reads while the relay publishes the events committed now.
    let mut name = "c1";
    let mut run = Run::start(&binary, &redis, &store, name, &[]);
    expected.extend(enqueue_many(&mut source, "orders", ORDERS));
    expected.extend(
        source
            .query(
                "SELECT outbox_enqueue('payments', jsonb_build_object('n', g), \
                 'account-' || g % 10, jsonb_build_object('trace', g::text)) \
                 FROM generate_series(1, $1::bigint) g",
                &[&PAYMENTS],
            )
            .unwrap()
            .iter()
            .map(|row| row.get::<_, i64>(0)),
    );

    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    eprintln!("random seed {seed}");
    // What the next run must report: the entries its name left pending (it finishes them
    // first), and those of a dead consumer it takes over (only XAUTOCLAIM can).
    let mut own_pending = 0;
    let mut taken_over = 0;
    let mut switched = false;
    let mut kills = 0;
    loop {
        let batches = 5 + rng.below(40);
        let printed = run.wait_for(Duration::from_secs(120), |lines| {
            lines.iter().filter(|l| l.starts_with("batch ")).count() >= batches
                && total(lines, "claimed", "entries") >= taken_over
        });
        assert!(printed, "{name} did not print {batches} batches");
        // Somewhere in a batch: reading, applying, committing, acknowledging.
        std::thread::sleep(Duration::from_millis(rng.below(20) as u64));
        let lines = run.kill();
        kills += 1;
        assert_eq!(
            total(&lines, "pending", "entries"),
            own_pending,
            "{name} did not finish its pending entries first"
        );
        assert_eq!(total(&lines, "claimed", "entries"), taken_over);
        let left = pending_at(&redis, name);
        eprintln!("kill {kills}: {name} after {batches} batches, {left} entries left pending");
        (own_pending, taken_over) = (left, 0);
        if kills >= 3 && !switched && left > 0 {
            // A new name: the dead consumer's entries are pending at it, and nobody else can
            // finish them but through XAUTOCLAIM.
            (name, switched) = ("c2", true);
            (own_pending, taken_over) = (0, left);
        }
        if kills >= KILLS && switched {
            break;
        }
        assert!(kills < 3 * KILLS, "no kill left entries pending at {name}");
        run = Run::start(&binary, &redis, &store, name, &[]);
    }
    // The last run drains the streams once the relay has published everything.
    assert!(
        wait_until(Duration::from_secs(120), || pg.pending() == 0),
        "the relay did not publish every event"
    );
    let lines = Run::start(
        &binary,
        &redis,
        &store,
        name,
        &["--exit-when-idle-ms", "1500"],
    )
    .wait_exit(Duration::from_secs(180));
    assert_eq!(total(&lines, "pending", "entries"), own_pending);
    assert_eq!(total(&lines, "claimed", "entries"), taken_over);
    let ack = if xackdel { "ack=XACKDEL" } else { "ack=XACK" };
    assert!(lines[0].ends_with(ack), "{} on {xackdel:?}", lines[0]);

    // Every event applied, once, as it was enqueued.
    let mut store_client = pg.connect_to("store");
    let applied = events(
        &mut store_client,
        "SELECT event_id, topic, payload::text, key, headers::text, created_at::text \
         FROM applied_events",
    );
    let enqueued = events(
        &mut source,
        "SELECT id, topic, payload::text, key, headers::text, created_at::text FROM outbox",
    );
    assert_eq!(enqueued.len(), expected.len());
    assert_eq!(
        applied.len(),
        expected.len(),
        "events applied, with repeats"
    );
    let applied: BTreeMap<i64, Vec<Option<String>>> = applied.into_iter().collect();
    let enqueued: BTreeMap<i64, Vec<Option<String>>> = enqueued.into_iter().collect();
    assert_eq!(applied.len(), expected.len(), "distinct events applied");
    assert!(
        applied.keys().eq(expected.iter()),
        "not the events enqueued"
    );
    let differ = applied.iter().filter(|(id, e)| enqueued[id] != **e).count();
    assert_eq!(differ, 0, "events applied with other contents");
    let inbox: i64 = store_client
        .query_one("SELECT count(*) FROM outbox_consumer_inbox", &[])
        .unwrap()
        .get(0);
    assert_eq!(inbox, expected.len() as i64);
    let dead: Vec<String> = store_client
        .query(
            "SELECT entry_id FROM outbox_consumer_dead ORDER BY entry_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(dead, broken_ids, "the entries recorded as dead");

    // A copy of an applied event, by hand: acknowledged, not applied.
    let mut copy = redis::cmd("XADD");
    copy.arg("refunds").arg("*");
    for (name, value) in &refunds[0].1 {
        copy.arg(name).arg(value);
    }
    redis.query::<String>(&copy);
    let lines = Run::start(
        &binary,
        &redis,
        &store,
        name,
        &["--exit-when-idle-ms", "500"],
    )
    .wait_exit(Duration::from_secs(60));
    assert_eq!(total(&lines, "new", "entries"), 1, "{lines:?}");
    assert_eq!(total(&lines, "new", "duplicates"), 1, "{lines:?}");
    let rows: i64 = store_client
        .query_one("SELECT count(*) FROM applied_events", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, expected.len() as i64);

    // Nothing left pending; the entries left in the streams tell XACKDEL from XACK.
    assert_eq!(pending_at(&redis, "*"), 0, "entries left pending");
    let lengths: Vec<usize> = STREAMS.iter().map(|stream| redis.xlen(stream)).collect();
    if xackdel {
        assert_eq!(
            lengths,
            [0, 0, 0],
            "XACKDEL ACKED leaves entries in the streams"
        );
    } else {
        assert!(
            lengths[0] >= ORDERS as usize + spoiled.len()
                && lengths[1] >= PAYMENTS as usize
                && lengths[2] == refunds.len() + 1,
            "XACK removed entries from the streams: {lengths:?}"
        );
    }
    eprintln!(
        "{} events (and {} duplicate entries) applied once over {kills} kills in {:.1} s, \
         acknowledged with {ack}",
        expected.len(),
        refunds.len() - distinct.len(),
        started.elapsed().as_secs_f64()
    );
}

/// The consumer's binary, built now (nothing to do when it is up to date). `CARGO_BIN_EXE_*`
/// names this package's binaries only, so cargo builds it, into the target directory this test
/// was built in: the test runs as <target>/<profile>/deps/consumer-<hash>, wherever
/// CARGO_TARGET_DIR put it.
fn consumer_binary() -> PathBuf {
    let test = std::env::current_exe().expect("cannot find the test's own path");
    let profile = test
        .parent()
        .and_then(Path::parent)
        .expect("the test is not in <target>/<profile>/deps");
    let mut build = Command::new(env!("CARGO"));
    build
        .args([
            "build",
            "--quiet",
            "-p",
            "outbox-consumer",
            "--manifest-path",
        ])
        .arg(common::repository().join("Cargo.toml"))
        .arg("--target-dir")
        .arg(profile.parent().expect("no target directory"));
    if profile.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().expect("cannot run cargo");
    assert!(status.success(), "cargo build -p outbox-consumer failed");
    profile.join("outbox-consumer")
}

/// A running consumer and the lines it printed.
struct Run(Printing);

impl Run {
    fn start(binary: &Path, redis: &Redis, store: &str, name: &str, extra: &[&str]) -> Run {
        Run(Printing::spawn(
            Command::new(binary)
                .args(["--redis-url", &redis.url(), "--postgres", store])
                .args(["--group", GROUP, "--consumer", name, "--count", "50"])
                .args(["--block-ms", "200", "--min-idle-ms", "1000"])
                .args(["--claim-every-ms", "500"])
                .args(STREAMS.iter().flat_map(|stream| ["--stream", stream]))
                .args(extra),
        ))
    }

    /// Waits up to `timeout` for the lines printed to satisfy `done`; false if they did not
    /// before the timeout or the end of the process.
    fn wait_for(&mut self, timeout: Duration, done: impl Fn(&[String]) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        while !done(&self.0.seen) {
            if !self
                .0
                .read_one(deadline.saturating_duration_since(Instant::now()))
            {
                return false;
            }
        }
        true
    }

    /// SIGKILL; returns every line the consumer printed.
    fn kill(self) -> Vec<String> {
        self.0.kill()
    }

    /// Waits for the consumer to exit, successfully; returns every line it printed.
    fn wait_exit(mut self, timeout: Duration) -> Vec<String> {
        let mut status: Option<ExitStatus> = None;
        let exited = wait_until(timeout, || {
            status = self
                .0
                .child
                .try_wait()
                .expect("cannot wait for outbox-consumer");
            status.is_some()
        });
        assert!(exited, "outbox-consumer did not exit: {:?}", self.0.seen);
        assert!(status.is_some_and(|s| s.success()), "{status:?}");
        self.0.finish()
    }
}

/// The sum of `field` over the consumer's lines for batches from `source` (`pending`,
/// `claimed`, `new`).
fn total(lines: &[String], source: &str, field: &str) -> usize {
    let source = format!("source={source}");
    let field = format!("{field}=");
    lines
        .iter()
        .filter(|line| line.starts_with("batch ") && line.split(' ').any(|w| w == source))
        .flat_map(|line| line.split(' ').filter_map(|w| w.strip_prefix(&field)))
        .map(|n| n.parse::<usize>().expect("not a count"))
        .sum()
}

/// `XPENDING <stream> <group>`: count, lowest id, highest id, (consumer, count) pairs (nil when
/// nothing is pending).
type PendingSummary = (usize, Value, Value, Option<Vec<(String, String)>>);

/// Entries pending at `consumer` (`*`: at any) in the group, over every stream.
fn pending_at(redis: &Redis, consumer: &str) -> usize {
    STREAMS
        .iter()
        .map(|stream| {
            let (_, _, _, per_consumer): PendingSummary =
                redis.query(redis::cmd("XPENDING").arg(stream).arg(GROUP));
            per_consumer
                .unwrap_or_default()
                .iter()
                .filter(|(name, _)| consumer == "*" || name == consumer)
                .map(|(_, count)| count.parse::<usize>().expect("not a count"))
                .sum::<usize>()
        })
        .sum()
}

/// Rows of (id, the other columns as text).
fn events(client: &mut common::Client, sql: &str) -> Vec<(i64, Vec<Option<String>>)> {
    client
        .query(sql, &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), (1..row.len()).map(|i| row.get(i)).collect()))
        .collect()
}

/// xorshift64: kill points that differ from run to run, from a seed the test prints.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Entries trimmed from their stream while pending at a consumer that died: another consumer
/// takes the rest over, applies them, and drops the trimmed ones from the pending list. Redis
/// 6.2's `XAUTOCLAIM` answers nil for those (7.0 and later leave them out and list their ids),
/// and keeps them pending.
#[test]
fn entries_trimmed_while_pending_are_dropped_and_the_rest_applied() {
    let binary = consumer_binary();
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[]);
    pg.with_extension()
        .batch_execute("CREATE DATABASE store")
        .unwrap();
    pg.wait_for_workers(1);
    let store = format!("host=127.0.0.1 port={} user=postgres dbname=store", pg.port);
    let ids = enqueue_many(&mut pg.connect(), "orders", 5);
    assert!(wait_until(Duration::from_secs(20), || redis.xlen("orders") == 5));
    for stream in STREAMS {
        let _: () = redis.query(
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(stream)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM"),
        );
    }
    // A consumer reads all five and dies; the oldest two are trimmed away meanwhile.
    let _: Value = redis.query(
        redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("dead")
            .arg("STREAMS")
            .arg("orders")
            .arg(">"),
    );
    let _: i64 = redis.query(redis::cmd("XTRIM").arg("orders").arg("MAXLEN").arg(3));
    std::thread::sleep(Duration::from_millis(1100));

    let heir = Run::start(
        &binary,
        &redis,
        &store,
        "heir",
        &["--count", "2", "--exit-when-idle-ms", "1000"],
    );
    let lines = heir.wait_exit(Duration::from_secs(30));
    assert_eq!(total(&lines, "claimed", "applied"), 3, "{lines:?}");
    assert_eq!(pending_at(&redis, "*"), 0, "{lines:?}");
    let applied: Vec<i64> = pg
        .connect_to("store")
        .query("SELECT event_id FROM applied_events ORDER BY event_id", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(applied, ids[2..]);
}

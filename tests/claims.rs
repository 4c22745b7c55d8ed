//! Claims: what a relay pass reads to find its events. The claims walk the index of unpublished
//! events, never the table, whatever the statistics said when they were planned; a pass woken
//! by a commit reads the index of that commit's partition only; a quiet backlog is claimed past
//! the last batch, while an event committed late below it still goes out; a claim stops at a
//! few megabytes; a rejected topic's held backlog costs each pass no more than a batch; and
//! `TRUNCATE outbox` beside the relay never deadlocks. Counted in index entries and scans, not
//! timed, against a real PostgreSQL and Redis.

use std::time::{Duration, Instant};

use common::sql::count;
use common::{enqueue_many, wait_until, Pg, Redis};

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

/// Returns once the worker has reported the counts of its passes so far: it reports after a
/// pass, at most once a second, and a reload wakes it for one more pass.
fn after_the_worker_reports(client: &mut postgres::Client) {
    std::thread::sleep(Duration::from_millis(1200));
    client.batch_execute("SELECT pg_reload_conf()").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
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

//! The table's storage: a ring of partitions that the relay empties with `TRUNCATE` once their
//! rows are published and past `outbox.retention`, so that pruning leaves no dead row versions.

use std::time::{Duration, Instant};

use common::sql::one;
use common::{enqueue_many, wait_until, Pg, Redis};
use postgres::Client;

/// Ids in one run of the ring (`src/model/ring.rs`).
const CHUNK: i64 = 1 << 16;

/// Rows, size on disk, file and deletes counted so far of one partition.
#[derive(Debug, PartialEq)]
struct Partition {
    rows: i64,
    bytes: i64,
    filenode: u32,
    deleted: i64,
}

fn partition(client: &mut Client, name: &str) -> Partition {
    let row = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {name}), pg_relation_size('{name}'), \
                        (SELECT relfilenode FROM pg_class WHERE oid = '{name}'::regclass), \
                        coalesce(pg_stat_get_tuples_deleted('{name}'::regclass), 0) \
                        + coalesce(pg_stat_get_xact_tuples_deleted('{name}'::regclass), 0)"
            ),
            &[],
        )
        .unwrap();
    Partition {
        rows: row.get(0),
        bytes: row.get(1),
        filenode: row.get::<_, postgres::types::Oid>(2),
        deleted: row.get(3),
    }
}

/// Whether partition `name` holds no row within 15 s.
fn emptied(client: &mut Client, name: &str) -> bool {
    emptied_within(client, name, Duration::from_secs(15))
}

fn emptied_within(client: &mut Client, name: &str, limit: Duration) -> bool {
    wait_until(limit, || partition(client, name).rows == 0)
}

/// The server's clock, in seconds since the epoch.
fn clock(client: &mut Client) -> f64 {
    one(
        client,
        "SELECT extract(epoch FROM clock_timestamp())::float8",
    )
}

/// Waits up to 40 s for partition `name` to hold no row; how many seconds after `since` (a
/// time of the server's clock) that was.
fn seconds_until_emptied(client: &mut Client, name: &str, since: f64) -> f64 {
    assert!(
        emptied_within(client, name, Duration::from_secs(40)),
        "the expired partition kept its rows"
    );
    clock(client) - since
}

/// Moves the id sequence to the start of run `run`, so that writers fill another partition.
fn start_run(client: &mut Client, run: i64) {
    client
        .execute(
            "SELECT setval('outbox_id_seq', $1, false)",
            &[&(run * CHUNK)],
        )
        .unwrap();
}

/// A session in a transaction that has read `outbox_01`, and so holds a lock on it until it
/// ends.
fn reading_outbox_01(pg: &Pg) -> Client {
    let mut reader = pg.connect();
    reader
        .batch_execute("BEGIN; SELECT count(*) FROM outbox_01")
        .unwrap();
    reader
}

/// Writes `old` events (topic `old`) in run 1 and `new` ones (topic `new`) in run 2, so that
/// run 1's partition can come due once they are published, and waits until Redis holds them
/// all.
fn publish_old_then_new(client: &mut Client, redis: &Redis, old: i64, new: i64) {
    start_run(client, 1);
    enqueue_many(client, "old", old);
    start_run(client, 2);
    enqueue_many(client, "new", new);
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("old")
            == old as usize
            && redis.xlen("new") == new as usize),
        "events not published"
    );
}

/// Rows enqueued by `outbox_enqueue` and by a plain `INSERT` land where hash partitioning puts
/// them: runs of 65,536 ids go round the 16 partitions, negative ids included.
#[test]
fn rows_go_round_the_ring_in_runs_of_ids() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    let cases = [
        (1_i64, "outbox_00"),
        (CHUNK - 1, "outbox_00"),
        (CHUNK, "outbox_01"),
        (15 * CHUNK + 9, "outbox_15"),
        (16 * CHUNK, "outbox_00"),
        (1_000_000_007, "outbox_10"),
    ];
    for (id, expected) in cases {
        client
            .execute("SELECT setval('outbox_id_seq', $1, false)", &[&id])
            .unwrap();
        let enqueued: i64 = one(&mut client, "SELECT outbox_enqueue('ring', '{}')");
        assert_eq!(enqueued, id);
        // 32 runs on, the same partition again.
        let inserted = id + 32 * CHUNK;
        client
            .execute(
                "INSERT INTO outbox (id, topic, payload) VALUES ($1, 'ring', '{}')",
                &[&inserted],
            )
            .unwrap();
        for id in [enqueued, inserted] {
            let leaf: String = client
                .query_one(
                    "SELECT tableoid::regclass::text FROM outbox WHERE id = $1",
                    &[&id],
                )
                .unwrap()
                .get(0);
            assert_eq!(leaf, expected, "id {id}");
        }
    }
    client
        .execute(
            "INSERT INTO outbox (id, topic, payload) VALUES (-1, 'ring', '{}')",
            &[],
        )
        .unwrap();
    let leaf: String = one(
        &mut client,
        "SELECT tableoid::regclass::text FROM outbox WHERE id = -1",
    );
    assert_eq!(leaf, "outbox_15");
    let key: String = one(
        &mut client,
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = 'outbox'::regclass AND contype = 'p'",
    );
    assert_eq!(key, "PRIMARY KEY (id)");
}

/// Published rows past the retention go with their partition: it is emptied by `TRUNCATE`
/// (a new file, no row deleted), while the partition writers fill keeps its rows.
#[test]
fn an_expired_partition_is_emptied_without_deleting_rows() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "1s"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    publish_old_then_new(&mut client, &redis, 500, 5);
    let before = partition(&mut client, "outbox_01");
    assert_eq!(before.rows, 500);
    assert!(
        emptied(&mut client, "outbox_01"),
        "the expired partition kept its rows: {:?}",
        partition(&mut client, "outbox_01")
    );
    let after = partition(&mut client, "outbox_01");
    assert_eq!(after.bytes, 0, "space not given back");
    assert_ne!(after.filenode, before.filenode, "not emptied by TRUNCATE");
    assert_eq!(after.deleted, 0, "rows were deleted one by one");
    // The partition being written keeps its rows, published ones included, however old.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(partition(&mut client, "outbox_02").rows, 5);
}

/// A partition holding an event Redis has not taken is not emptied, however old its other rows
/// are; once the event is published and its retention is over, it is.
#[test]
fn a_partition_with_an_unpublished_event_is_kept() {
    let mut redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "1s"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    start_run(&mut client, 1);
    enqueue_many(&mut client, "kept", 3);
    assert!(wait_until(Duration::from_secs(15), || redis.xlen("kept") == 3));
    redis.stop();
    enqueue_many(&mut client, "kept", 1);
    start_run(&mut client, 2);
    enqueue_many(&mut client, "later", 1);
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(partition(&mut client, "outbox_01").rows, 4);
    assert_eq!(pg.pending(), 2);

    redis.start_again();
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "not published after Redis came back"
    );
    assert!(
        emptied(&mut client, "outbox_01"),
        "the partition was not emptied once its last event was published"
    );
}

/// The relay never waits for a lock to empty a partition: while a reader holds one, the
/// partition stays, and writers and the relay go on; once the reader is done, it is emptied.
#[test]
fn a_partition_in_use_is_left_until_it_is_free() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "1s"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    start_run(&mut client, 1);
    enqueue_many(&mut client, "held", 10);
    start_run(&mut client, 2);
    assert!(wait_until(Duration::from_secs(15), || redis.xlen("held") == 10));

    let mut reader = reading_outbox_01(&pg);
    std::thread::sleep(Duration::from_secs(3));
    let mut writer = pg.connect();
    for round in 1..=5_i64 {
        enqueue_many(&mut writer, "meanwhile", 20);
        assert!(
            wait_until(Duration::from_secs(10), || redis.xlen("meanwhile")
                == (round * 20) as usize),
            "relaying stalled while a partition was held"
        );
    }
    assert_eq!(partition(&mut client, "outbox_01").rows, 10);
    let waiting: i64 = one(
        &mut client,
        "SELECT count(*) FROM pg_locks WHERE NOT granted",
    );
    assert_eq!(waiting, 0, "someone waits for a lock");
    reader.batch_execute("COMMIT").unwrap();
    assert!(
        emptied(&mut client, "outbox_01"),
        "not emptied after the reader finished"
    );
}

/// A partition is emptied when its retention runs out, not when the relay next has something
/// to do: with nothing to relay and a poll interval of 30 s, it goes within seconds of coming
/// due.
#[test]
fn an_idle_relay_empties_a_partition_when_it_comes_due() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.retention", "2s"), ("outbox.poll_interval", "30s")],
    );
    let mut client = pg.with_extension();
    publish_old_then_new(&mut client, &redis, 50, 1);
    let due_at: f64 = one(
        &mut client,
        "SELECT extract(epoch FROM max(published_at) + interval '2 s')::float8 FROM outbox_01",
    );
    let late = seconds_until_emptied(&mut client, "outbox_01", due_at);
    eprintln!("outbox_01 emptied {late:.2} s after its retention ran out");
    assert!(
        late < 10.0,
        "emptied {late:.1} s after its retention ran out, at the relay's next poll"
    );
    assert_eq!(partition(&mut client, "outbox_02").rows, 1);
}

/// A relay that polls every 30 s, idle unless the test writes, with a retention of `retention`,
/// and a reader holding `outbox_01` in an open transaction since before its 50 events were
/// published.
struct Held {
    client: Client,
    reader: Client,
    pg: Pg,
    redis: Redis,
}

fn held_by_a_reader(retention: &str) -> Held {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", retention),
            ("outbox.poll_interval", "30s"),
        ],
    );
    let mut client = pg.with_extension();
    let reader = reading_outbox_01(&pg);
    publish_old_then_new(&mut client, &redis, 50, 1);
    Held {
        client,
        reader,
        pg,
        redis,
    }
}

/// A partition in use when it comes due is tried again within moments, though the relay has
/// nothing else to do: once the reader lets it go, it is emptied then, not at the next poll.
#[test]
fn an_idle_relay_empties_a_partition_once_a_reader_lets_it_go() {
    let mut held = held_by_a_reader("2s");
    // Held past the time it comes due, so that the relay finds it in use.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(partition(&mut held.client, "outbox_01").rows, 50);
    held.reader.batch_execute("COMMIT").unwrap();
    let released_at = clock(&mut held.client);
    let late = seconds_until_emptied(&mut held.client, "outbox_01", released_at);
    eprintln!("outbox_01 emptied {late:.2} s after the reader let it go");
    assert!(
        late < 10.0,
        "emptied {late:.1} s after the reader let it go, at the relay's next poll"
    );
}

/// Transactions the database has counted so far, committed or rolled back.
fn transactions(client: &mut Client) -> i64 {
    one(
        client,
        "SELECT xact_commit + xact_rollback FROM pg_stat_database \
         WHERE datname = current_database()",
    )
}

/// While a due partition stays in use for long (a `pg_dump` reading it, say), an idle relay
/// looks at it again less and less often, up to once a second, rather than every 20 ms.
#[test]
fn an_idle_relay_looks_seldom_at_a_partition_held_for_long() {
    let mut held = held_by_a_reader("1s");
    // Due after a second; the worker's statistics reach the view within a second or two.
    std::thread::sleep(Duration::from_secs(3));
    let before = transactions(&mut held.client);
    std::thread::sleep(Duration::from_secs(6));
    let during = transactions(&mut held.client) - before;
    // A look every 20 ms, each a survey and a try besides the pass it wakes for, is over 600.
    seldom_then_emptied(held, "transactions in 6 s", during, 150);
}

/// Ends a test of a relay that found the due partition `outbox_01` held: it was kept, `count`
/// (of `what`) stayed below `limit`, and the partition is emptied once the reader lets it go.
fn seldom_then_emptied(mut held: Held, what: &str, count: i64, limit: i64) {
    eprintln!("{count} {what} while the due partition was held");
    assert_eq!(partition(&mut held.client, "outbox_01").rows, 50);
    assert!(
        count < limit,
        "{count} {what}: the relay keeps looking at the held partition"
    );
    held.reader.batch_execute("COMMIT").unwrap();
    assert!(emptied(&mut held.client, "outbox_01"));
}

/// Reads of the id sequence counted so far: one per id handed out, and one per look of the
/// relay for partitions to empty (it reads where the sequence stands).
fn sequence_reads(client: &mut Client) -> i64 {
    one(
        client,
        "SELECT coalesce(sum(blks_hit + blks_read), 0)::bigint FROM pg_statio_user_sequences \
         WHERE relname = 'outbox_id_seq'",
    )
}

/// While a due partition stays in use for long, a relay kept busy by a steady stream looks at
/// it again less and less often too, though every commit wakes it: not every 20 ms for as long
/// as the reader holds it.
#[test]
fn a_busy_relay_looks_seldom_at_a_partition_held_for_long() {
    // Due after 2 s, and its rows not old enough for pruning to delete (22 s) by the end.
    let mut held = held_by_a_reader("2s");
    // The worker reports its statistics at most once a second.
    std::thread::sleep(Duration::from_secs(3));
    let before = sequence_reads(&mut held.client);
    // About 100 events a second for 6 s, each committed alone: each commit wakes the relay.
    let mut writer = held.pg.connect();
    let started = Instant::now();
    let mut written = 0;
    while started.elapsed() < Duration::from_secs(6) {
        writer
            .execute("SELECT outbox_enqueue('steady', '{}')", &[])
            .unwrap();
        written += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    // A session reports its statistics as it ends.
    drop(writer);
    assert!(
        wait_until(Duration::from_secs(30), || held.redis.xlen("steady")
            == written as usize),
        "the steady stream was not relayed"
    );
    std::thread::sleep(Duration::from_secs(2));
    let looks = sequence_reads(&mut held.client) - before - written;
    eprintln!("{written} events went out");
    // A look every 20 ms for 6 s is about 300.
    seldom_then_emptied(held, "looks", looks, 80);
}

/// The file behind partition `name`: `TRUNCATE` gives it a new one. Read from the catalog, so
/// that watching for it takes no lock on the partition (which would keep it from being emptied).
fn filenode(client: &mut Client, name: &str) -> u32 {
    client
        .query_one(
            "SELECT relfilenode FROM pg_class WHERE oid = $1::text::regclass",
            &[&name],
        )
        .unwrap()
        .get::<_, postgres::types::Oid>(0)
}

/// A due partition held only by another relay worker, whose batch is in flight (a claim that
/// reads every partition locks each until its batch commits), is tried again at least every
/// 100 ms, not less and less often as for a reader that may hold it for long: it is emptied
/// soon after that batch commits.
#[test]
fn a_partition_held_by_another_worker_is_emptied_once_its_batch_commits() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "1s"),
            ("outbox.poll_interval", "30s"),
            ("outbox.workers", "2"),
            ("outbox.redis_timeout", "30s"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(2);
    publish_old_then_new(&mut client, &redis, 50, 1);
    let before = filenode(&mut client, "outbox_01");
    // Redis takes no write for 3.5 s: the worker that claims the next event holds every
    // partition meanwhile. outbox_01 comes due a second after its events were marked; the
    // other worker, idle, finds it held.
    let pause = Duration::from_millis(3_500);
    redis.query::<()>(
        redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(pause.as_millis() as u64)
            .arg("WRITE"),
    );
    let paused_at = Instant::now();
    // A pass woken by an enqueue claims from the partition the commit wrote to alone
    // (outbox_02 here); `_outbox_wake()`, which `outbox_redrive` calls, has it claim from every
    // partition.
    client
        .batch_execute("BEGIN; SELECT outbox_enqueue('held', '{}'); SELECT _outbox_wake(); COMMIT")
        .unwrap();
    std::thread::sleep(pause - Duration::from_millis(200));
    assert_eq!(
        filenode(&mut client, "outbox_01"),
        before,
        "outbox_01 was emptied while a batch was in flight"
    );
    assert!(
        wait_until(Duration::from_secs(15), || filenode(
            &mut client,
            "outbox_01"
        ) != before),
        "outbox_01 was not emptied"
    );
    let late = paused_at.elapsed().saturating_sub(pause);
    eprintln!(
        "emptied {} ms after Redis took writes again",
        late.as_millis()
    );
    assert_eq!(redis.xlen("held"), 1);
    // Backing off as from a reader, the worker would look 2.26 and 3.26 s after the partition
    // came due, and find it free only at the second look, about 0.7 s late.
    assert!(
        late < Duration::from_millis(500),
        "outbox_01 emptied {} ms after the batch that held it could commit",
        late.as_millis()
    );
}

/// A prepared transaction that read a due partition holds it until it is committed, which may
/// take days, and no session shows it: the relay backs off from it as from a reader.
#[test]
fn a_prepared_transaction_holding_a_partition_is_looked_at_seldom() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            // Due after 2 s, and its rows not old enough for pruning to delete (22 s) by the end.
            ("outbox.retention", "2s"),
            ("outbox.poll_interval", "30s"),
            ("max_prepared_transactions", "2"),
        ],
    );
    let mut client = pg.with_extension();
    pg.connect()
        .batch_execute("BEGIN; SELECT count(*) FROM outbox_01; PREPARE TRANSACTION 'reading'")
        .unwrap();
    publish_old_then_new(&mut client, &redis, 50, 1);
    // The worker reports its statistics at most once a second.
    std::thread::sleep(Duration::from_secs(3));
    let before = sequence_reads(&mut client);
    std::thread::sleep(Duration::from_secs(6));
    // Nothing writes meanwhile: every read of the sequence is a look.
    let looks = sequence_reads(&mut client) - before;
    eprintln!("{looks} looks in 6 s while a prepared transaction held the due partition");
    assert_eq!(partition(&mut client, "outbox_01").rows, 50);
    // Every 100 ms, as for a partition only the relay's workers hold, is about 60.
    assert!(
        looks < 30,
        "{looks} looks: the relay keeps looking at the partition the prepared transaction holds"
    );
    client.batch_execute("COMMIT PREPARED 'reading'").unwrap();
    assert!(emptied(&mut client, "outbox_01"));
}

/// An autovacuum of a partition that is due does not keep it: the relay cancels that vacuum,
/// as PostgreSQL cancels one that blocks a lock request, and empties the partition, where
/// waiting for the vacuum to end would hold the partition's rows for as long as it runs.
#[test]
fn an_autovacuum_does_not_keep_a_due_partition() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "3s"),
            ("outbox.poll_interval", "100ms"),
            ("autovacuum_naptime", "1s"),
            ("log_autovacuum_min_duration", "0"),
        ],
    );
    let mut client = pg.with_extension();
    // A vacuum of outbox_01 that takes minutes: a 100 ms nap for every page it reads.
    client
        .batch_execute(
            "ALTER TABLE outbox_01 SET (autovacuum_vacuum_threshold = 0, \
             autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_insert_threshold = 0, \
             autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_cost_delay = 100, \
             autovacuum_vacuum_cost_limit = 1)",
        )
        .unwrap();
    // Keeps the relay from emptying it until autovacuum has started there.
    let mut reader = reading_outbox_01(&pg);
    publish_old_then_new(&mut client, &redis, 20_000, 1);
    let vacuumed = wait_until(Duration::from_secs(30), || {
        pg.log().contains("canceling autovacuum task")
            || one::<i64>(
                &mut client,
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE backend_type = 'autovacuum worker' AND query LIKE '%outbox_01%'",
            ) > 0
    });
    assert!(vacuumed, "autovacuum never started on outbox_01");
    reader.batch_execute("COMMIT").unwrap();
    assert!(
        emptied(&mut client, "outbox_01"),
        "the due partition was kept while autovacuum ran there"
    );
    assert!(pg.log().contains("canceling autovacuum task"));
    assert_eq!(partition(&mut client, "outbox_02").rows, 1);
}

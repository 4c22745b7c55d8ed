//! Pruning what was published, over time: rounds of events past a short retention, and old
//! events redriven long after their neighbours. Timing, not the PostgreSQL major, is what these
//! test, so `make test` runs them once.

use std::time::{Duration, Instant};

use common::redis_keys::{poison, unpoison};
use common::sql::one;
use common::{enqueue_many, wait_until, Pg, Redis};

#[test]
fn pruning_keeps_pending_rows_and_the_table_flat() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "1s"),
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "1000000"),
            // Ten rounds take seconds here, not days: let autovacuum look every second.
            ("autovacuum_naptime", "1s"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    // An event that can never be published: it must survive every pruning round.
    poison(&redis, "stuck");
    let stuck: i64 = one(&mut client, "SELECT outbox_enqueue('stuck', '{}')");

    // All of it in the partition being written, which the ring does not empty: the rows go by
    // deletes once past the retention and its grace (10 s here), and vacuum reclaims them.
    let mut sizes = Vec::new();
    for round in 0..6 {
        enqueue_many(&mut client, "churn", 2_000);
        assert!(
            wait_until(Duration::from_secs(30), || {
                one::<i64>(
                    &mut pg.connect(),
                    "SELECT count(*) FROM outbox WHERE topic = 'churn'",
                ) == 0
            }),
            "round {round}: published rows were not pruned"
        );
        sizes.push(one::<i64>(
            &mut client,
            "SELECT sum(pg_relation_size(inhrelid))::bigint FROM pg_inherits \
             WHERE inhparent = 'outbox'::regclass",
        ));
    }
    eprintln!("outbox heap size after each round (bytes): {sizes:?}");
    assert_eq!(
        redis.xlen("churn"),
        12_000,
        "every event was published before being pruned"
    );
    let early = *sizes[..2].iter().max().unwrap();
    assert!(early > 0, "the partitions' sizes were not read: {sizes:?}");
    assert!(
        sizes[5] <= 2 * early,
        "the table grew from {early} to {} bytes over six rounds: {sizes:?}",
        sizes[5]
    );
    let still: i64 = client
        .query_one("SELECT count(*) FROM outbox WHERE id = $1", &[&stuck])
        .unwrap()
        .get(0);
    assert_eq!(still, 1, "a pending row was pruned");

    // Retention 0 keeps history forever.
    pg.set(&[("outbox.retention", "0")]);
    assert!(wait_until(Duration::from_secs(10), || pg
        .log()
        .contains("retention=off")));
    enqueue_many(&mut client, "kept", 100);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("kept") == 100));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        one::<i64>(
            &mut client,
            "SELECT count(*) FROM outbox WHERE topic = 'kept'"
        ),
        100
    );
}

/// Old events redriven from outbox_dead are published long after their neighbours (as are
/// events of a transaction that commits late). Pruning walked the ids from the lowest and
/// stopped at the first range holding a recently published row, so while old ids kept being
/// published, everything after them was kept forever. Here one old event is redriven, then
/// another every half second, while 100 events with ids past 50,000, published long before,
/// must be pruned.
#[test]
fn redriven_old_events_do_not_keep_later_history_from_pruning() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.retention", "2s"),
            ("outbox.max_attempts", "1"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    poison(&redis, "bad");
    let old = enqueue_many(&mut client, "bad", 80);
    assert!(
        wait_until(Duration::from_secs(60), || one::<i64>(
            &mut pg.connect(),
            "SELECT count(*) FROM outbox_dead"
        ) == 80),
        "the bad events did not all reach outbox_dead"
    );
    client
        .batch_execute("SELECT setval('outbox_id_seq', 50000)")
        .unwrap();
    let recent = enqueue_many(&mut client, "good", 100);
    assert!(recent[0] > 50_000);
    assert!(wait_until(Duration::from_secs(20), || redis.xlen("good") == 100));
    assert!(wait_until(Duration::from_secs(20), || pg.pending() == 0));
    unpoison(&redis, "bad");

    // A: the oldest event, published now.
    assert!(one::<bool>(
        &mut client,
        &format!("SELECT outbox_redrive({})", old[0])
    ));
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("bad") == 1),
        "the redriven event was not published"
    );
    assert_eq!(redis.ids("bad"), [old[0]]);

    let started = Instant::now();
    let mut redriven = 1;
    let mut last_redrive = Instant::now();
    loop {
        let left: i64 = one(&mut client, "SELECT count(*) FROM outbox WHERE id > 50000");
        if left == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{left} published events with ids past 50000 are still there 30 s after the \
             redrive, while old ids kept being published ({redriven} redriven)"
        );
        if last_redrive.elapsed() >= Duration::from_millis(500) && redriven < old.len() {
            assert!(one::<bool>(
                &mut client,
                &format!("SELECT outbox_redrive({})", old[redriven])
            ));
            redriven += 1;
            last_redrive = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "events past 50000 pruned {:?} after the first redrive, {redriven} old events redriven",
        started.elapsed()
    );
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("bad") == redriven),
        "a redriven event was not published"
    );
    assert_eq!(redis.ids("bad"), old[..redriven]);
}

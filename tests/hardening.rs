//! Hardening, what is left of it while it is split by concern: the relay against pruning after a
//! redrive, and PostgreSQL's errors through the utility hook.

mod common;

use std::time::{Duration, Instant};

use common::redis_keys::{poison, unpoison};
use common::sql::one;
use common::{enqueue_many, wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// 11: pruning after a redrive
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// 14: PostgreSQL's own errors through the utility hook
// ---------------------------------------------------------------------------------------------

/// Every utility statement of the server runs through the extension's hook. An error
/// PostgreSQL raises there must reach the client as PostgreSQL raised it: run under pgrx's
/// guard, it came back as an error of pgrx's, without its position and, with `RUST_BACKTRACE`
/// in the server's environment, with a Rust backtrace in its DETAIL.
#[test]
fn postgres_errors_in_utility_statements_reach_the_client_unchanged() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    pg.restart_with_env(&[("RUST_BACKTRACE", "1")]);
    let mut client = pg.connect();

    let error = client
        .batch_execute("GRANT EXECUTE ON FUNCTION no_such_fn() TO PUBLIC")
        .unwrap_err();
    let db = error.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "42883", "{db:?}");
    assert_eq!(db.message(), "function no_such_fn() does not exist");
    assert_eq!(
        db.detail(),
        None,
        "PostgreSQL's error has no DETAIL: {db:?}"
    );

    let error = client
        .batch_execute("CREATE TABLE t (a no_such_type)")
        .unwrap_err();
    let db = error.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "42704", "{db:?}");
    assert_eq!(db.message(), "type \"no_such_type\" does not exist");
    assert_eq!(
        db.detail(),
        None,
        "PostgreSQL's error has no DETAIL: {db:?}"
    );
    assert!(
        matches!(
            db.position(),
            Some(postgres::error::ErrorPosition::Original(_))
        ),
        "the error lost its position in the statement: {db:?}"
    );
}

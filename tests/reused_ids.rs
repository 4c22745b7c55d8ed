//! Ids used again: `TRUNCATE outbox RESTART IDENTITY`, a sequence set back by hand and a restored
//! base backup give new events the ids of events already published, whose dedupe markers may
//! still be in Redis. The new events must go out all the same, and a dead letter whose id is
//! used again must be kept beside the first. Against a real PostgreSQL and Redis.

use std::collections::BTreeSet;
use std::time::Duration;

use common::redis_keys::{keys, poison};
use common::sql::one;
use common::{enqueue_many, wait_until, Client, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// New events with the ids of published ones
// ---------------------------------------------------------------------------------------------

/// Enqueues five events on `t` with payloads {"gen": `generation`, "n": 1..5} in one
/// transaction; returns their (id, payload as JSON text).
fn enqueue_generation(client: &mut Client, generation: i32) -> Vec<(i64, String)> {
    client
        .query(
            "SELECT outbox_enqueue('t', jsonb_build_object('gen', $1::int, 'n', g)), \
                    jsonb_build_object('gen', $1::int, 'n', g)::text \
             FROM generate_series(1, 5) g",
            &[&generation],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn ids_of(events: &[(i64, String)]) -> Vec<i64> {
    events.iter().map(|(id, _)| *id).collect()
}

/// Stops the relay worker with pg_terminate_backend and waits for the postmaster's new one.
fn restart_worker(pg: &Pg) {
    let before = pg.worker_pids();
    assert_eq!(before.len(), 1, "one relay worker expected: {before:?}");
    pg.connect()
        .query_one("SELECT pg_terminate_backend($1)", &[&before[0]])
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            let now = pg.worker_pids();
            now.len() == 1 && now[0] != before[0]
        }),
        "the relay worker was not started again"
    );
}

/// A Redis whose `relay` user may do everything but `HDEL`, that user's URL and password file:
/// the markers of every batch stay behind, as those of a relay stopped right after it published
/// (the relay deletes a committed batch's markers moments later).
fn redis_keeping_markers() -> (Redis, String, common::PasswordFile) {
    let redis = Redis::start();
    let (url, file) = redis.relay_user("~* +@all -hdel");
    (redis, url, file)
}

/// Publishes a first generation of five events (ids 1 to 5) and checks that the markers of
/// its batch are still in Redis. Returns the generation.
fn publish_first_generation(pg: &Pg, redis: &Redis) -> Vec<(i64, String)> {
    let first = enqueue_generation(&mut pg.connect(), 1);
    assert_eq!(ids_of(&first), [1, 2, 3, 4, 5]);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("t") == 5),
        "the first generation was not published"
    );
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "the first generation was not marked published"
    );
    let markers = keys(redis, "*outbox:dedupe:*");
    assert!(
        !markers.is_empty(),
        "precondition: the dedupe markers of the last batch are still in Redis"
    );
    println!("markers left in Redis: {markers:?}");
    first
}

/// After the ids of `first` were given to `second`: both generations are in the stream, in
/// order, each event once, and (id, created_at) tells the ten apart.
fn assert_both_generations_published(
    pg: &Pg,
    redis: &Redis,
    first: &[(i64, String)],
    second: &[(i64, String)],
) {
    assert_eq!(
        ids_of(second),
        ids_of(first),
        "precondition: the second generation has the first one's ids"
    );
    let arrived = wait_until(Duration::from_secs(30), || redis.xlen("t") >= 10);
    let payloads = |redis: &Redis| -> Vec<String> {
        redis
            .entries("t")
            .into_iter()
            .map(|(_, f)| f["payload"].clone())
            .collect()
    };
    assert!(
        arrived,
        "events with ids used again were taken for the earlier events and dropped: the stream \
         holds {:?}",
        payloads(redis)
    );
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "the second generation was not marked published"
    );
    std::thread::sleep(Duration::from_millis(300));
    let expected: Vec<String> = first.iter().chain(second).map(|(_, p)| p.clone()).collect();
    assert_eq!(payloads(redis), expected, "each event once, in order");
    let identities: BTreeSet<(String, String)> = redis
        .entries("t")
        .into_iter()
        .map(|(_, f)| (f["id"].clone(), f["created_at"].clone()))
        .collect();
    assert_eq!(
        identities.len(),
        10,
        "(id, created_at) tells the events apart"
    );
}

/// Publishes a first generation, restarts the worker (the new one does not know the markers
/// left in Redis), runs `reuse` to give the next events the same ids, and checks that the second
/// generation is published too.
fn ids_used_again_after(reuse: &str) {
    let (redis, url, file) = redis_keeping_markers();
    let pg = Pg::start(&[
        ("outbox.redis_url", &url),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.poll_interval", "1h"),
        // The markers left behind are what this tests (on Redis 8.6 `auto` takes IDMP).
        ("outbox.dedupe", "markers"),
    ]);
    pg.with_extension();
    pg.wait_for_workers(1);
    let first = publish_first_generation(&pg, &redis);
    restart_worker(&pg);
    let mut client = pg.connect();
    client.batch_execute(reuse).unwrap();
    let second = enqueue_generation(&mut client, 2);
    assert_both_generations_published(&pg, &redis, &first, &second);
}

/// `TRUNCATE outbox RESTART IDENTITY` gives the next events ids 1, 2 ... again, while the dedupe
/// markers of the events that had them may still be in Redis. The new events must not be
/// mistaken for the old ones and dropped.
#[test]
fn ids_used_again_after_truncate_restart_identity_are_published() {
    ids_used_again_after("TRUNCATE outbox RESTART IDENTITY");
}

/// The same with the rows deleted and the sequence set back by hand.
#[test]
fn ids_used_again_after_setval_are_published() {
    ids_used_again_after("DELETE FROM outbox; SELECT setval('outbox_id_seq', 1, false)");
}

/// A base backup taken before the first events, restored after they were published: the
/// restored cluster (same system identifier, same database) gives the same ids to new events,
/// while the markers of the lost ones are in Redis.
#[test]
fn ids_used_again_after_restoring_a_base_backup_are_published() {
    let (redis, url, file) = redis_keeping_markers();
    let settings = [
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.poll_interval", "1h"),
        ("outbox.dedupe", "markers"),
    ];
    let pg = Pg::start(&settings);
    pg.with_extension();
    pg.wait_for_workers(1);
    let backup = pg.base_backup();
    let first = publish_first_generation(&pg, &redis);
    pg.stop("immediate");

    let restored = Pg::start_from_backup(backup, &settings);
    restored.promote();
    restored.wait_for_workers(1);
    let second = enqueue_generation(&mut restored.connect(), 2);
    assert_both_generations_published(&restored, &redis, &first, &second);
}

// ---------------------------------------------------------------------------------------------
// A dead letter with an id used again
// ---------------------------------------------------------------------------------------------

/// `outbox_dead` keeps its rows when `outbox` is truncated and its ids restart: a new event
/// with the id of a dead letter that then fails for good must be buried beside it. The
/// conflict used to abort the relay's transaction, restart the worker and do it all again,
/// with nothing marked.
#[test]
fn a_dead_letter_with_an_id_used_again_is_kept_beside_the_first() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.max_attempts", "1"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let pids = pg.worker_pids();
    poison(&redis, "bad");
    let first: i64 = one(&mut client, "SELECT outbox_enqueue('bad', '{\"try\": 1}')");
    let buried = format!("SELECT count(*) FROM outbox_dead WHERE id = {first}");
    assert!(
        wait_until(Duration::from_secs(30), || one::<i64>(
            &mut pg.connect(),
            &buried
        ) == 1),
        "the first bad event never reached outbox_dead"
    );
    client
        .batch_execute("TRUNCATE outbox RESTART IDENTITY")
        .unwrap();
    let second: i64 = one(&mut client, "SELECT outbox_enqueue('bad', '{\"try\": 2}')");
    assert_eq!(second, first, "precondition: the id is used again");
    let good = enqueue_many(&mut client, "good", 5);

    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("good") == 5),
        "the good events were not published"
    );
    assert_eq!(redis.ids("good"), good);
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the good events were not marked published"
    );
    assert!(
        wait_until(Duration::from_secs(30), || one::<i64>(
            &mut pg.connect(),
            &buried
        ) == 2),
        "the second dead letter with id {first} was not kept"
    );
    let row = client
        .query_one(
            "SELECT count(DISTINCT payload::text), count(DISTINCT created_at) FROM outbox_dead \
             WHERE id = $1",
            &[&first],
        )
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (2, 2),
        "both dead letters, told apart by created_at"
    );
    assert_eq!(
        pg.worker_pids(),
        pids,
        "the worker exited and was restarted"
    );
    assert!(!pg.log().contains("duplicate key"));
}

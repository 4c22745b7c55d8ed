//! Upgrades between released versions: `CREATE EXTENSION outbox VERSION '0.1.0'`, events
//! enqueued under it, then `ALTER EXTENSION outbox UPDATE`.

use std::time::Duration;

use common::{enqueue_many, wait_until, Pg, Redis};

/// The extension's member objects as `pg_dump --binary-upgrade` writes them (it lists what an
/// extension owns, which a plain dump leaves to `CREATE EXTENSION`), without the OIDs that
/// differ from one database to another, and without the data-dependent lines a binary-upgrade
/// dump adds.
fn member_schema(pg: &Pg, database: &str) -> String {
    let dump = pg.client_program(
        "pg_dump",
        &[
            "--schema-only",
            "--binary-upgrade",
            "--no-owner",
            "-d",
            database,
        ],
    );
    dump.lines()
        .filter(|line| !line.contains("binary_upgrade_") && !line.starts_with("--"))
        // psql's \restrict and \unrestrict lines carry a random key per dump.
        .filter(|line| !line.starts_with('\\'))
        // A column added with a default by an update is stored as a "missing value", which a
        // binary-upgrade dump sets through a function (filtered above) in a block of its own:
        // the blank lines around it are all that would remain.
        .filter(|line| !line.is_empty())
        .filter(|line| !line.contains("pg_extension_config_dump"))
        // Per-database facts: transaction horizons, OIDs, and where the id sequence stands.
        .filter(|line| {
            !line.starts_with("SET relfrozenxid")
                && !line.starts_with("WHERE oid = ")
                && !line.contains("pg_catalog.setval(")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The released 0.1.0 objects with the new library: enqueueing works, the relay waits (its
/// statements need the new objects) and says what to run; after `ALTER EXTENSION outbox
/// UPDATE` the waiting events are published, and the upgraded objects equal a fresh install's.
#[test]
fn an_upgrade_from_0_1_0_publishes_waiting_events_and_matches_a_fresh_install() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.connect();
    client
        .batch_execute("CREATE EXTENSION outbox VERSION '0.1.0'")
        .unwrap();
    pg.wait_for_workers(1);
    let ids = enqueue_many(&mut client, "upgrade", 3);
    assert!(
        wait_until(Duration::from_secs(10), || pg
            .log()
            .contains("run ALTER EXTENSION outbox UPDATE")),
        "the relay did not say that the extension needs an update"
    );
    assert_eq!(
        redis.xlen("upgrade"),
        0,
        "published through the old objects"
    );

    // A role allowed to enqueue keeps that right across the change of signature in 0.5.0.
    client
        .batch_execute(
            "CREATE ROLE app LOGIN; \
             GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb) TO app",
        )
        .unwrap();
    client
        .batch_execute("ALTER EXTENSION outbox UPDATE")
        .unwrap();
    let mut app = pg.connect_as("postgres", "app");
    let keyed: i64 = app
        .query_one(
            "SELECT outbox_enqueue('upgrade-keyed', '{}', 'k', '{\"h\": \"v\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        wait_until(Duration::from_secs(20), || redis.ids("upgrade-keyed")
            == [keyed]),
        "an event enqueued with a key after the update was not published"
    );
    let version: String = client
        .query_one(
            "SELECT extversion FROM pg_extension WHERE extname = 'outbox'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(version, common::extension_version());
    assert!(
        wait_until(Duration::from_secs(20), || pg.pending() == 0),
        "the waiting events were not published after the update"
    );
    assert_eq!(redis.ids("upgrade"), ids);
    let more = enqueue_many(&mut client, "upgrade", 2);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("upgrade") == 5),
        "events enqueued after the update were not published"
    );
    assert_eq!(redis.ids("upgrade")[3..], more[..]);

    client.batch_execute("CREATE DATABASE fresh").unwrap();
    pg.connect_to("fresh")
        .batch_execute(
            "CREATE EXTENSION outbox; \
             GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, jsonb, interval) TO app",
        )
        .unwrap();
    // A plain dump repeats the grant, as it would have the old function's.
    let plain = pg.client_program("pg_dump", &["--schema-only", "-d", "postgres"]);
    assert!(
        plain.lines().any(
            |line| line.starts_with("GRANT ALL ON FUNCTION public.outbox_enqueue(")
                && line.ends_with("TO app;")
        ),
        "a dump of the upgraded database does not grant app the new outbox_enqueue:\n{}",
        plain
            .lines()
            .filter(|line| line.contains("GRANT") || line.contains("REVOKE"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let upgraded = member_schema(&pg, "postgres");
    let fresh = member_schema(&pg, "fresh");
    assert!(
        upgraded.contains("CREATE TABLE public.outbox"),
        "the dump lists no member objects:\n{upgraded}"
    );
    if upgraded != fresh {
        let diff: Vec<String> = upgraded
            .lines()
            .zip(fresh.lines())
            .filter(|(a, b)| a != b)
            .take(10)
            .map(|(a, b)| format!("upgraded: {a}\n   fresh: {b}"))
            .collect();
        panic!(
            "the upgraded schema ({} lines) differs from a fresh install's ({} lines):\n{}",
            upgraded.lines().count(),
            fresh.lines().count(),
            diff.join("\n")
        );
    }
}

/// A populated 0.1.0 table moves into the ring: every row keeps its id, columns and partition
/// by run, grants on the table are kept, the sequence goes on where it stood, the relay
/// publishes what was pending, and the upgraded database dumps and restores.
#[test]
fn an_upgrade_moves_a_populated_table_into_the_ring() {
    const CHUNK: i64 = 1 << 16;
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.connect();
    client
        .batch_execute(
            "CREATE EXTENSION outbox VERSION '0.1.0';
             CREATE ROLE reader;
             GRANT SELECT ON outbox TO reader;
             SELECT count(outbox_enqueue('moved', jsonb_build_object('n', g)))
             FROM generate_series(1, 150000) g;
             UPDATE outbox SET published_at = created_at, attempts = 1 WHERE id <= 149000;",
        )
        .unwrap();
    // The relay publishes the pending rows as soon as the update commits: the fingerprint
    // counts only the rows published before it.
    let fingerprint = "SELECT count(*), sum(id)::bigint, \
                       count(published_at) FILTER (WHERE id <= 149000), \
                       sum(attempts)::bigint, sum((payload->>'n')::bigint)::bigint, \
                       min(created_at)::text FROM outbox";
    let row = client.query_one(fingerprint, &[]).unwrap();
    let before: (i64, i64, i64, i64, i64, String) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    assert_eq!(before.0, 150_000);

    client
        .batch_execute("ALTER EXTENSION outbox UPDATE")
        .unwrap();
    let row = client.query_one(fingerprint, &[]).unwrap();
    let after: (i64, i64, i64, i64, i64, String) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    assert_eq!(after, before, "the rows changed on the way");
    let misplaced: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox \
             WHERE tableoid::regclass::text <> 'outbox_' || lpad(((id / $1) % 16)::text, 2, '0')",
            &[&CHUNK],
        )
        .unwrap()
        .get(0);
    assert_eq!(misplaced, 0);
    let runs: Vec<String> = client
        .query(
            "SELECT DISTINCT tableoid::regclass::text FROM outbox ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(runs, ["outbox_00", "outbox_01", "outbox_02"]);
    let granted: bool = client
        .query_one(
            "SELECT has_table_privilege('reader', 'outbox', 'SELECT')",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(granted, "the grant on the table was lost");
    let next: i64 = client
        .query_one("SELECT outbox_enqueue('moved', '{}')", &[])
        .unwrap()
        .get(0);
    assert_eq!(next, 150_001);

    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the pending events were not published after the update"
    );
    let published = redis.ids("moved");
    assert_eq!(
        published,
        (149_001..=150_001).collect::<Vec<i64>>(),
        "published other than the pending events"
    );

    let dump = pg.dir.join("upgraded.sql");
    pg.client_program("pg_dump", &["-d", "postgres", "-f", dump.to_str().unwrap()]);
    client.batch_execute("CREATE DATABASE restored").unwrap();
    pg.client_program(
        "psql",
        &[
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            "restored",
            "-f",
            dump.to_str().unwrap(),
        ],
    );
    let restored: i64 = pg
        .connect_to("restored")
        .query_one("SELECT count(*) FROM outbox", &[])
        .unwrap()
        .get(0);
    assert_eq!(restored, 150_001);
}

/// Events waiting at the update to 0.5.0 were left in lane 0, while the later events of their
/// topic went to the topic's lane: with two workers those lanes belong to different workers,
/// so the new events went out before the old ones, passing an old event that Redis had
/// rejected. After the update every waiting event is in its topic's lane, the old failing event
/// holds back the new ones too, and the topic's events reach the stream in id order.
#[test]
fn an_upgrade_from_0_4_0_keeps_each_topics_order_over_two_workers() {
    // Its key-less events are in lane 595, which the second of two workers relays (lane 0 is
    // the first's).
    const TOPIC: &str = "account.created";
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[("outbox.workers", "2"), ("outbox.poll_interval", "100ms")],
    );
    let mut client = pg.connect();
    client
        .batch_execute("CREATE EXTENSION outbox VERSION '0.4.0'")
        .unwrap();
    pg.wait_for_workers(2);
    let before = enqueue_many(&mut client, TOPIC, 100);
    // The first of them was rejected by Redis before the update (charged by hand, as the relay
    // at 0.4.0 would have): it is retried a few seconds from now, and every later event of its
    // topic must wait for it.
    client
        .execute(
            "UPDATE outbox SET attempts = 1, last_error = 'WRONGTYPE before the update', \
             next_attempt_at = now() + interval '4 seconds' WHERE id = $1",
            &[&before[0]],
        )
        .unwrap();

    client
        .batch_execute("ALTER EXTENSION outbox UPDATE")
        .unwrap();
    let misplaced: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox \
             WHERE published_at IS NULL AND lane <> outbox_lane(key, topic)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(misplaced, 0, "waiting events were left outside their lane");
    let after = enqueue_many(&mut client, TOPIC, 100);

    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen(TOPIC) == 200),
        "the topic's events were not all published: {} of 200",
        redis.xlen(TOPIC)
    );
    let published = redis.ids(TOPIC);
    let expected: Vec<i64> = before.iter().chain(&after).copied().collect();
    assert_eq!(
        published.first(),
        Some(&before[0]),
        "events went out before the failing event of their topic"
    );
    assert_eq!(published, expected, "the topic's events are out of order");
}

/// 0.7.0 only added a view for metrics exporters: a 0.7.0 library relays 0.6.0 objects without
/// waiting for `ALTER EXTENSION outbox UPDATE`, and the update adds `outbox_metrics` while the
/// relay goes on.
#[test]
fn objects_of_0_6_0_are_relayed_before_the_update() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.connect();
    client
        .batch_execute("CREATE EXTENSION outbox VERSION '0.6.0'")
        .unwrap();
    pg.wait_for_workers(1);
    let before = enqueue_many(&mut client, "upgrade", 3);
    assert!(
        wait_until(Duration::from_secs(10), || redis.ids("upgrade") == before),
        "events of 0.6.0 objects were not published"
    );
    assert!(!pg.log().contains("run ALTER EXTENSION outbox UPDATE"));
    assert!(client.query("SELECT * FROM outbox_metrics", &[]).is_err());

    client
        .batch_execute("ALTER EXTENSION outbox UPDATE")
        .unwrap();
    let after = enqueue_many(&mut client, "upgrade", 2);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("upgrade") == 5),
        "events enqueued after the update were not published"
    );
    assert_eq!(redis.ids("upgrade")[3..], after[..]);
    // Redis has the entries before the relay's transaction that marks them commits.
    let published = || -> i64 {
        pg.connect()
            .query_one("SELECT published_total FROM outbox_metrics", &[])
            .unwrap()
            .get(0)
    };
    assert!(
        wait_until(Duration::from_secs(10), || published() == 5),
        "outbox_metrics counts {} published",
        published()
    );
}

//! Several databases on one server: a launcher keeps workers in each database `outbox.database`
//! names (or in every one with the extension, with `*`), into streams the `{database}` prefix
//! keeps apart; databases join without a restart, and `DROP DATABASE` and a rename work without
//! `WITH (FORCE)`. The utility hook that sees to the last leaves PostgreSQL's own errors as
//! they are.

use std::time::{Duration, Instant};

use common::{enqueue_many, wait_until, Pg, Redis};

/// Creates `name` and the extension in it; returns a client connected to it.
fn database_with_extension(pg: &Pg, name: &str) -> postgres::Client {
    pg.connect()
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .unwrap();
    let mut client = pg.connect_to(name);
    client.batch_execute("CREATE EXTENSION outbox").unwrap();
    client
}

/// The relay workers' (database, pid, state), as `outbox_workers` in `shop` shows them: every
/// database's workers are in it.
fn workers(pg: &Pg) -> Vec<(Option<String>, Option<i32>, String)> {
    pg.connect_to("shop")
        .query(
            "SELECT database, pid, state FROM outbox_workers ORDER BY slot",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

fn launcher_pid(pg: &Pg) -> i32 {
    pg.query_retrying("SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox launcher'")[0]
        .get(0)
}

fn pid_in(pg: &Pg, database: &str) -> Option<i32> {
    pg.query_retrying(&format!(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox relay' AND datname = '{database}'"
    ))
    .first()
    .map(|r| r.get(0))
}

#[test]
fn three_databases_relay_side_by_side_a_fourth_joins_and_one_is_dropped() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "shop, billing, crm"),
            ("outbox.stream_prefix", "{database}:"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut clients: Vec<(String, postgres::Client)> = ["shop", "billing", "crm"]
        .iter()
        .map(|name| (name.to_string(), database_with_extension(&pg, name)))
        .collect();
    pg.wait_for_workers(3);
    let mut expected = std::collections::BTreeMap::new();
    for (name, client) in &mut clients {
        expected.insert(name.clone(), enqueue_many(client, "orders", 200));
    }
    for (name, ids) in &expected {
        let stream = format!("{name}:orders");
        assert!(
            wait_until(Duration::from_secs(20), || redis.xlen(&stream) == ids.len()),
            "{stream} did not get its events: {:?}",
            workers(&pg)
        );
    }
    let shown = workers(&pg);
    assert_eq!(shown.len(), 3, "{shown:?}");
    for name in ["shop", "billing", "crm"] {
        assert!(
            shown
                .iter()
                .any(|(db, pid, _)| db.as_deref() == Some(name) && pid.is_some()),
            "no running worker of {name} in outbox_workers: {shown:?}"
        );
    }
    let running: i32 = clients[0]
        .1
        .query_one("SELECT workers_running FROM outbox_status", &[])
        .unwrap()
        .get(0);
    assert_eq!(
        running, 1,
        "outbox_status counts this database's workers only"
    );

    // A fourth database joins with a reload, no restart.
    let launcher_before = launcher_pid(&pg);
    let mut audit = database_with_extension(&pg, "audit");
    pg.set(&[("outbox.database", "shop, billing, crm, audit")]);
    let joined = Instant::now();
    let audit_ids = enqueue_many(&mut audit, "orders", 50);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("audit:orders") == 50),
        "the fourth database was not relayed: {:?}",
        workers(&pg)
    );
    eprintln!(
        "the fourth database was relayed {:?} after the reload",
        joined.elapsed()
    );
    assert_eq!(redis.ids("audit:orders"), audit_ids);
    let launcher_after = launcher_pid(&pg);
    assert_eq!(launcher_before, launcher_after, "the launcher restarted");

    // Someone who may not drop a database cannot stop its relay by trying; nor can a DROP
    // that would fail in a transaction block.
    let shop_pid = pid_in(&pg, "shop").unwrap();
    pg.connect()
        .batch_execute("CREATE ROLE mallory LOGIN")
        .unwrap();
    let refused = pg
        .connect_as("postgres", "mallory")
        .batch_execute("DROP DATABASE shop")
        .unwrap_err();
    assert_eq!(common::sqlstate(&refused), "42501", "{refused}");
    let in_block = pg
        .connect()
        .batch_execute("BEGIN; DROP DATABASE shop")
        .unwrap_err();
    assert_eq!(common::sqlstate(&in_block), "25001", "{in_block}");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        pid_in(&pg, "shop"),
        Some(shop_pid),
        "a DROP DATABASE that could not run stopped the relay"
    );

    // A plain DROP DATABASE of a relayed database, its worker connected.
    assert!(pid_in(&pg, "billing").is_some());
    clients.retain(|(name, _)| name != "billing");
    let dropped = Instant::now();
    pg.connect()
        .batch_execute("DROP DATABASE billing")
        .expect("DROP DATABASE failed while the relay worked there");
    eprintln!("DROP DATABASE took {:?}", dropped.elapsed());
    // A rename, likewise; the renamed database is no longer named, so it is left alone.
    clients.retain(|(name, _)| name != "crm");
    assert!(pid_in(&pg, "crm").is_some());
    pg.connect()
        .batch_execute("ALTER DATABASE crm RENAME TO crm_archive")
        .expect("ALTER DATABASE RENAME failed while the relay worked there");

    // The others go on.
    for (name, client) in &mut clients {
        let more = enqueue_many(client, "orders", 100);
        expected.get_mut(name).unwrap().extend(more);
    }
    for (name, client) in &clients {
        let _ = client;
        let stream = format!("{name}:orders");
        let ids = &expected[name];
        assert!(
            wait_until(Duration::from_secs(20), || redis.xlen(&stream) == ids.len()),
            "{stream} stopped getting its events after the drop"
        );
        assert_eq!(&redis.ids(&stream), ids);
    }
    assert!(
        wait_until(Duration::from_secs(10), || pid_in(&pg, "crm_archive")
            .is_none()),
        "a worker went back into the renamed database"
    );
    let log = pg.log();
    assert!(
        log.contains("leaving database billing for a DROP DATABASE, a rename, a copy or a move")
    );
}

/// `CREATE DATABASE ... TEMPLATE` of a relayed database and `ALTER DATABASE ... SET TABLESPACE`
/// need it to themselves, as `DROP DATABASE` does: its worker steps aside for each, and relays
/// there again right after.
#[test]
fn a_relayed_database_can_be_copied_and_moved() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "shop"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut shop = database_with_extension(&pg, "shop");
    pg.wait_for_workers(1);
    let mut expected = enqueue_many(&mut shop, "orders", 3);
    assert!(wait_until(Duration::from_secs(20), || redis.xlen("orders") == 3));
    drop(shop);

    let location = pg.dir.join("tablespace");
    std::fs::create_dir(&location).unwrap();
    common::give_to_postgres(&location);
    let mut admin = pg.connect();
    admin
        .batch_execute(&format!(
            "CREATE TABLESPACE elsewhere LOCATION '{}'",
            location.display()
        ))
        .unwrap();
    admin
        .batch_execute("ALTER DATABASE shop SET TABLESPACE elsewhere")
        .expect("ALTER DATABASE ... SET TABLESPACE failed while the relay worked there");
    pg.wait_for_workers(1);
    admin
        .batch_execute("CREATE DATABASE shop_copy TEMPLATE shop")
        .expect("CREATE DATABASE ... TEMPLATE failed while the relay worked there");

    let mut shop = pg.connect_to("shop");
    expected.extend(enqueue_many(&mut shop, "orders", 3));
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("orders") == 6),
        "the relay did not come back to the moved database"
    );
    assert_eq!(redis.ids("orders"), expected);
    assert!(
        pid_in(&pg, "shop_copy").is_none(),
        "the copy is not selected"
    );
}

#[test]
fn every_database_with_the_extension_is_relayed_and_a_crash_stops_only_its_own_worker() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "*"),
            ("outbox.stream_prefix", "{database}:"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut shop = database_with_extension(&pg, "shop");
    let mut billing = database_with_extension(&pg, "billing");
    // A database without the extension keeps no worker.
    pg.connect().batch_execute("CREATE DATABASE plain").unwrap();
    let shop_ids = enqueue_many(&mut shop, "orders", 100);
    let mut billing_ids = enqueue_many(&mut billing, "orders", 100);
    assert!(wait_until(Duration::from_secs(20), || redis
        .xlen("shop:orders")
        == 100
        && redis.xlen("billing:orders") == 100));
    assert!(
        wait_until(Duration::from_secs(10), || pid_in(&pg, "plain").is_none()
            && pid_in(&pg, "postgres").is_none()),
        "a worker stays in a database without the extension"
    );

    // CREATE EXTENSION in a new database: relayed within seconds, no reload.
    let mut late = database_with_extension(&pg, "late");
    let created = Instant::now();
    let late_ids = enqueue_many(&mut late, "orders", 10);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("late:orders") == 10),
        "CREATE EXTENSION in a new database was not picked up"
    );
    eprintln!(
        "a new database's events arrived {:?} after CREATE EXTENSION",
        created.elapsed()
    );
    assert_eq!(redis.ids("late:orders"), late_ids);

    // DROP EXTENSION: the database's worker leaves; a database without it never got one to
    // speak of (the workers that looked there left without a word).
    late.batch_execute("DROP EXTENSION outbox").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || pid_in(&pg, "late").is_none()),
        "the worker stayed after DROP EXTENSION"
    );
    // (Its next statement failed, or its next look-up found nothing: either way it left, and
    // no worker waits there.)
    std::thread::sleep(Duration::from_secs(4));
    let log = pg.log();
    assert!(!log.contains("waiting for CREATE EXTENSION outbox in database late"));
    assert!(
        !log.contains("database=plain ") && !log.contains("in database plain"),
        "the workers that looked into a database without the extension filled the log"
    );
    // Between looks, they hold no worker slot either.
    assert!(
        wait_until(Duration::from_secs(10), || {
            let held: i64 = shop
                .query_one(
                    "SELECT count(*) FROM outbox_workers WHERE database IN ('plain', 'late')",
                    &[],
                )
                .unwrap()
                .get(0);
            held == 0
        }),
        "databases without the extension hold worker slots"
    );

    // One database's worker dies with an error (terminated): the others keep their workers.
    let billing_pid = pid_in(&pg, "billing").unwrap();
    let shop_pid = pid_in(&pg, "shop").unwrap();
    pg.connect()
        .query_one("SELECT pg_terminate_backend($1)", &[&shop_pid])
        .unwrap();
    billing_ids.extend(enqueue_many(&mut billing, "orders", 50));
    assert!(wait_until(Duration::from_secs(20), || redis
        .xlen("billing:orders")
        == 150));
    assert_eq!(
        pid_in(&pg, "billing"),
        Some(billing_pid),
        "billing's worker was disturbed"
    );
    assert!(
        wait_until(Duration::from_secs(20), || pid_in(&pg, "shop")
            .is_some_and(|p| p != shop_pid)),
        "shop's worker was not started again"
    );
    assert_eq!(redis.ids("shop:orders"), shop_ids);

    // A SIGKILL restarts the whole server; every database is relayed again, nothing lost.
    let killed = pid_in(&pg, "billing").unwrap();
    pg.kill9(killed);
    // The server restarts every backend; the launcher starts the workers again.
    assert!(
        wait_until(Duration::from_secs(30), || pid_in(&pg, "billing")
            .is_some_and(|p| p != killed)
            && pid_in(&pg, "shop").is_some()),
        "the workers did not come back after the crash"
    );
    let mut billing = pg.connect_to("billing");
    billing_ids.extend(enqueue_many(&mut billing, "orders", 50));
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("billing:orders")
            >= 200),
        "billing was not relayed after the crash"
    );
    let got = redis.ids("billing:orders");
    let distinct: std::collections::BTreeSet<i64> = got.iter().copied().collect();
    assert_eq!(distinct, billing_ids.iter().copied().collect());
    let mut shop = pg.connect_to("shop");
    let more = enqueue_many(&mut shop, "orders", 5);
    assert!(wait_until(Duration::from_secs(20), || redis
        .xlen("shop:orders")
        == 105));
    assert_eq!(redis.ids("shop:orders")[100..], more[..]);
}

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

//! Redis users: who the relay is to Redis. Its password is read from a file that only the
//! server's OS user may read and is shown nowhere (settings, errors, the log), and a password
//! written into `outbox.redis_url` is refused. An ACL user limited to the stream prefix, with
//! the fewest rights the README lists, publishes with dedupe on and off; one that may not run
//! scripts holds the events back uncharged. Against a real PostgreSQL and Redis (the users of a
//! Sentinel or a Cluster are in `topologies.rs`).

use std::time::Duration;

use common::redis_keys::keys;
use common::sql::{one, worker_state};
use common::{enqueue_many, password_file, sqlstate, wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// The password
// ---------------------------------------------------------------------------------------------

/// The password lives in a file that the relay reads when it connects: a monitoring role sees
/// the URL and the file's name, never the password, and neither does the server log.
#[test]
fn the_redis_password_is_read_from_a_file_and_shown_nowhere() {
    let redis = Redis::start_with_password(Some("right-horse-battery"));
    let file = password_file("wrong-staple-s3cret");
    let url = redis.relay_url();
    let pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.redis_timeout", "1s"),
    ]);
    let mut admin = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut admin, "secret", 3);
    assert!(wait_until(Duration::from_secs(10), || {
        pg.worker_state().0 == "backoff"
    }));
    let error = pg.worker_state().1.unwrap_or_default();
    assert!(
        error.to_lowercase().contains("password") || error.contains("WRONGPASS"),
        "{error}"
    );
    assert!(!error.contains("wrong-staple-s3cret"), "{error}");

    // What pg_monitor (and so pg_read_all_settings) reads: the URL and the file's name.
    admin
        .batch_execute("CREATE ROLE watcher LOGIN; GRANT pg_monitor TO watcher")
        .unwrap();
    let mut watcher = pg.connect_as("postgres", "watcher");
    assert_eq!(one::<String>(&mut watcher, "SHOW outbox.redis_url"), url);
    assert_eq!(
        one::<String>(&mut watcher, "SHOW outbox.redis_password_file"),
        file.as_str()
    );
    let settings: String = one(
        &mut watcher,
        "SELECT string_agg(name || '=' || setting, ' ') FROM pg_settings WHERE name LIKE 'outbox.%'",
    );
    assert!(!settings.contains("s3cret"), "{settings}");

    // The file is read again at the next connection: with the right password the backlog goes
    // out, without a reload.
    std::fs::write(file.as_str(), "right-horse-battery\n").unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("secret") == 3),
        "the relay did not read the password file again: {:?}",
        pg.worker_state()
    );
    let log = pg.log();
    assert!(
        log.contains(&format!("redis_password_file='{}'", file.as_str())),
        "the start-up line names the file:\n{log}"
    );
    for password in ["wrong-staple-s3cret", "right-horse-battery"] {
        assert!(
            !log.contains(password),
            "the password reached the server log:\n{log}"
        );
    }
}

/// A password written into `outbox.redis_url` is refused wherever it comes from: `ALTER
/// SYSTEM` fails with 22023 and a hint, and a configuration file that holds one starts the
/// server, but the relay waits and says why rather than publish to the URL kept before.
#[test]
fn a_password_in_the_redis_url_is_refused() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut admin = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut admin, "before", 1);
    assert!(wait_until(Duration::from_secs(20), || redis.xlen("before") == 1));

    let with_password = format!("redis://:url-s3cret@127.0.0.1:{}", redis.port);
    let error = admin
        .batch_execute(&format!(
            "ALTER SYSTEM SET outbox.redis_url = '{with_password}'"
        ))
        .unwrap_err();
    let db = error.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "22023", "{error:?}");
    assert!(!db.message().contains("s3cret"), "{}", db.message());
    assert!(
        db.hint()
            .is_some_and(|h| h.contains("outbox.redis_password_file")),
        "{:?}",
        db.hint()
    );
    let socket = "unix:///run/redis.sock?pass=url-s3cret";
    let error = admin
        .batch_execute(&format!("ALTER SYSTEM SET outbox.redis_url = '{socket}'"))
        .unwrap_err();
    assert_eq!(sqlstate(&error), "22023", "{error:?}");

    // In the configuration file, at a reload: the relay keeps nothing of it and waits. Events
    // committed before the worker has taken the reload in go to the URL it had, so the events
    // follow the reload.
    pg.set(&[("outbox.redis_url", with_password.as_str())]);
    assert!(
        wait_until(Duration::from_secs(20), || pg
            .log()
            .contains("redis_url=(refused: it holds a password)")),
        "the relay did not take the reload in"
    );
    enqueue_many(&mut admin, "refused", 2);
    assert!(
        wait_until(Duration::from_secs(20), || pg.worker_state().0 == "backoff"),
        "the relay did not stop at a refused URL: {:?}",
        pg.worker_state()
    );
    let error = pg.worker_state().1.unwrap_or_default();
    assert!(error.contains("outbox.redis_password_file"), "{error}");
    // And at a restart, the server starts all the same.
    pg.restart();
    pg.wait_for_workers(1);
    assert!(
        wait_until(Duration::from_secs(20), || pg.worker_state().0 == "backoff"),
        "after a restart the relay did not wait at a refused URL: {:?}",
        pg.worker_state()
    );
    let error = pg.worker_state().1.unwrap_or_default();
    assert!(error.contains("outbox.redis_password_file"), "{error}");
    assert_eq!(redis.xlen("refused"), 0, "published with a refused URL");
    let log = pg.log();
    assert!(
        log.contains("invalid value for parameter \"outbox.redis_url\""),
        "{log}"
    );
    // Only the refused statements, as typed, show it: no line of the relay or of a reload.
    let leaks: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("s3cret") && !l.contains("STATEMENT:  ALTER SYSTEM"))
        .collect();
    assert!(leaks.is_empty(), "the password reached the log: {leaks:#?}");

    // Without the password, the relay goes on.
    let url = redis.relay_url();
    pg.set(&[("outbox.redis_url", url.as_str())]);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("refused") == 2),
        "the relay did not resume: {:?}",
        pg.worker_state()
    );
}

/// A password file that other users could read is refused, as PostgreSQL refuses such a
/// `ssl_key_file`; made private, it is used at the next try.
#[test]
fn a_password_file_others_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let redis = Redis::start_with_password(Some("open-s3cret"));
    let pg = Pg::relaying_to(&redis, &[("outbox.redis_timeout", "1s")]);
    let file: String = one(&mut pg.connect(), "SHOW outbox.redis_password_file");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut admin = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut admin, "guarded", 2);
    assert!(wait_until(Duration::from_secs(20), || {
        pg.worker_state().0 == "backoff"
    }));
    let error = pg.worker_state().1.unwrap_or_default();
    assert!(
        error.contains("outbox.redis_password_file") && error.contains("0644"),
        "{error}"
    );
    assert!(pg.log().contains("group or world access"), "{}", pg.log());
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("guarded") == 2),
        "{:?}",
        pg.worker_state()
    );
}

// ---------------------------------------------------------------------------------------------
// ACL users limited to the stream prefix
// ---------------------------------------------------------------------------------------------

/// A Redis user that may not run scripts cannot publish with `outbox.dedupe = on`: that is a
/// fault of the configuration, not of the events, and must not use up their attempts (which
/// would bury the whole backlog); the worker backs off saying why, and once the user may run
/// scripts the events go out, with the markers kept under the stream prefix the user is
/// limited to.
#[test]
fn a_redis_user_without_scripting_holds_events_back_uncharged() {
    let redis = Redis::start();
    let (url, file) = redis.relay_user("~app:* +@all -@scripting");
    let mut pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.stream_prefix", "app:"),
        ("outbox.dedupe", "off"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let first = enqueue_many(&mut client, "orders", 10);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("app:orders") == 10),
        "without dedupe the user's rights suffice, yet the events were not published"
    );
    assert_eq!(redis.ids("app:orders"), first);

    pg.set(&[("outbox.dedupe", "on")]);
    assert!(
        wait_until(Duration::from_secs(20), || pg
            .log()
            .lines()
            .any(|l| l.contains("reloaded") && l.contains("dedupe=on"))),
        "the worker did not reload dedupe=on"
    );
    let second = enqueue_many(&mut client, "orders", 10);
    assert!(
        wait_until(Duration::from_secs(20), || worker_state(&pg, "postgres").0
            == "backoff"),
        "the worker did not back off: {:?}",
        worker_state(&pg, "postgres")
    );
    std::thread::sleep(Duration::from_secs(3));
    // A retry may be under way at any moment: the state settles back to backoff.
    assert!(
        wait_until(Duration::from_secs(10), || worker_state(&pg, "postgres").0
            == "backoff"),
        "the worker left backoff: {:?}",
        worker_state(&pg, "postgres")
    );
    let error = worker_state(&pg, "postgres").1.unwrap_or_default();
    assert!(error.contains("NOPERM"), "last_error: {error}");
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE id = ANY($1) AND published_at IS NULL AND attempts = 0",
            &[&second],
        )
        .unwrap()
        .get(0);
    assert_eq!(held, 10, "events were charged for the Redis user's rights");
    assert_eq!(
        one::<i64>(&mut client, "SELECT count(*) FROM outbox_dead"),
        0
    );
    assert_eq!(redis.xlen("app:orders"), 10);

    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("relay")
        .arg("+@scripting")
        .query::<()>(&mut redis.conn())
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("app:orders") == 20),
        "the events did not go out once the user could run scripts: {:?}",
        worker_state(&pg, "postgres")
    );
    let mut expected = first;
    expected.extend(second);
    assert_eq!(redis.ids("app:orders"), expected);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
    assert_eq!(
        one::<i64>(&mut client, "SELECT count(*) FROM outbox_dead"),
        0
    );
}

/// The least a Redis user needs, as the README's "Redis users" section lists it, limited to the
/// stream prefix: events go out with dedupe on (script, markers and their clean-up) and off,
/// and the worker never meets a refusal.
#[test]
fn the_readme_minimal_redis_user_publishes_with_and_without_dedupe() {
    let redis = Redis::start();
    let (url, file) = redis.relay_user(
        "~app:* +ping +hello +auth +select +xadd +evalsha +script|load +hdel +hgetall +hset \
         +pexpireat",
    );
    let mut pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.stream_prefix", "app:"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = enqueue_many(&mut client, "orders", 150);
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("app:orders") == 150),
        "with dedupe on, the minimal user's events were not published: {:?}",
        worker_state(&pg, "postgres")
    );
    // The next round trip deletes the markers of the committed batches.
    expected.extend(enqueue_many(&mut client, "orders", 1));
    assert!(wait_until(Duration::from_secs(20), || redis
        .xlen("app:orders")
        == 151));
    assert!(
        wait_until(Duration::from_secs(10), || keys(
            &redis,
            "app:outbox:dedupe:*"
        )
        .len()
            <= 1),
        "markers were not cleaned up: {:?}",
        keys(&redis, "*outbox:dedupe:*")
    );
    pg.set(&[("outbox.dedupe", "off")]);
    assert!(wait_until(Duration::from_secs(20), || pg
        .log()
        .lines()
        .any(|l| l.contains("reloaded") && l.contains("dedupe=off"))));
    expected.extend(enqueue_many(&mut client, "orders", 10));
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("app:orders") == 161),
        "with dedupe off, the minimal user's events were not published"
    );
    assert_eq!(redis.ids("app:orders"), expected);
    assert!(!pg.log().contains("NOPERM"), "the worker met a refusal");
    assert_eq!(
        one::<i64>(&mut client, "SELECT count(*) FROM outbox_dead"),
        0
    );
}

//! The write path against a real server: transactions, the row as an INSERT writes it,
//! notifications, bad input, privileges, and a server without the preload. The relay is off
//! here (`outbox.workers = 0`) so that rows stay where the tests put them. How the row is
//! inserted (the fast path, what a session keeps, a table changed by hand) is in `insert.rs`.

mod common;

use std::time::Duration;

use common::sql::count;
use common::{notifications, server, sqlstate, Pg};

#[test]
fn a_rolled_back_transaction_leaves_neither_row() {
    let pg = server();
    let mut client = pg.with_extension();
    client
        .batch_execute("CREATE TABLE accounts (id serial PRIMARY KEY, email text NOT NULL)")
        .unwrap();
    // The seed's crash test: both writes, then the transaction fails.
    let result = client.batch_execute(
        "DO $$
         DECLARE account int;
         BEGIN
             INSERT INTO accounts (email) VALUES ('a@example.com') RETURNING id INTO account;
             PERFORM outbox_enqueue('account.created', jsonb_build_object('account_id', account));
             RAISE EXCEPTION 'crash after both writes';
         END $$",
    );
    assert!(result.is_err(), "the block should have failed");
    assert_eq!(count(&mut client, "SELECT count(*) FROM accounts"), 0);
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox"), 0);
}

#[test]
fn a_committed_enqueue_is_visible_with_its_id() {
    let pg = server();
    let mut client = pg.with_extension();
    let mut tx = client.transaction().unwrap();
    let id: i64 = tx
        .query_one(
            "SELECT outbox_enqueue('account.created', '{\"account_id\": 7}')",
            &[],
        )
        .unwrap()
        .get(0);
    tx.commit().unwrap();

    let mut other = pg.connect();
    let row = other
        .query_one(
            "SELECT topic, payload::text, published_at IS NULL, attempts, last_error IS NULL, \
                    created_at <= now() FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "account.created");
    assert_eq!(row.get::<_, String>(1), r#"{"account_id": 7}"#);
    assert!(row.get::<_, bool>(2), "a new event is unpublished");
    assert_eq!(row.get::<_, i32>(3), 0);
    assert!(row.get::<_, bool>(4));
    assert!(row.get::<_, bool>(5));

    let next: i64 = client
        .query_one("SELECT outbox_enqueue('t', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(next > id, "ids grow: {next} after {id}");
}

/// The row goes in as an INSERT's would: the table's defaults, visible to the transaction's
/// next statement, several per statement, a large payload stored out of line, and row
/// triggers fired (a BEFORE trigger's change is what is stored and what the id says).
#[test]
fn an_enqueued_row_behaves_like_an_inserted_one() {
    let pg = server();
    let mut client = pg.with_extension();
    let mut tx = client.transaction().unwrap();
    let ids: Vec<i64> = tx
        .query(
            "SELECT outbox_enqueue('many', jsonb_build_object('n', g)) FROM generate_series(1, 3) g",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let hand: i64 = tx
        .query_one(
            "INSERT INTO outbox (topic, payload) VALUES ('hand', '{}') RETURNING id",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(hand > ids[2], "the sequence is shared with plain inserts");
    // Same defaults as the plain insert; seen by the next statement of the transaction.
    let same: i64 = tx
        .query_one(
            "SELECT count(*) FROM outbox o, outbox h
             WHERE h.topic = 'hand' AND o.topic = 'many'
               AND o.created_at = h.created_at AND o.created_at = now()
               AND o.attempts = 0 AND o.published_at IS NULL AND o.last_error IS NULL",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(same, 3);
    tx.commit().unwrap();

    // 600 kB of JSON, stored compressed or out of line, comes back whole.
    let big: i64 = client
        .query_one(
            "SELECT outbox_enqueue('big', jsonb_build_object('blob', \
             (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 20000) g)))",
            &[],
        )
        .unwrap()
        .get(0);
    let length: i32 = client
        .query_one(
            "SELECT length(payload->>'blob') FROM outbox WHERE id = $1",
            &[&big],
        )
        .unwrap()
        .get(0);
    assert_eq!(length, 640_000);

    client
        .batch_execute(
            "CREATE TABLE audit (event bigint, topic text);
             CREATE FUNCTION stamp() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN NEW.payload := NEW.payload || '{\"stamped\": true}'; RETURN NEW; END $$;
             CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO audit VALUES (NEW.id, NEW.topic); RETURN NULL; END $$;
             CREATE TRIGGER stamp BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION stamp();
             CREATE TRIGGER audit AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION audit();",
        )
        .unwrap();
    let id: i64 = client
        .query_one("SELECT outbox_enqueue('audited', '{\"a\": 1}')", &[])
        .unwrap()
        .get(0);
    let row = client
        .query_one(
            "SELECT o.payload::text, a.event FROM outbox o JOIN audit a ON a.event = o.id
             WHERE o.topic = 'audited'",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, String>(0), r#"{"a": 1, "stamped": true}"#);
    assert_eq!(row.get::<_, i64>(1), id);
}

#[test]
fn notify_arrives_only_after_commit() {
    let pg = server();
    let mut writer = pg.with_extension();
    let mut listener = pg.connect();
    listener.batch_execute("LISTEN outbox").unwrap();

    writer.batch_execute("BEGIN").unwrap();
    writer
        .query_one("SELECT outbox_enqueue('order.paid', '{}')", &[])
        .unwrap();
    writer
        .query_one(
            "SELECT outbox_enqueue('order.paid', '{\"again\": true}')",
            &[],
        )
        .unwrap();
    writer
        .query_one("SELECT outbox_enqueue('order.shipped', '{}')", &[])
        .unwrap();
    // Ask the server something so that any notification already sent would be read.
    listener.batch_execute("SELECT 1").unwrap();
    let early = notifications(&mut listener, Duration::from_millis(300), 1);
    assert!(early.is_empty(), "notified before commit: {early:?}");

    writer.batch_execute("COMMIT").unwrap();
    let mut got = notifications(&mut listener, Duration::from_secs(5), 2);
    got.sort();
    // Identical notifications of one transaction collapse: one per topic.
    assert_eq!(
        got,
        [
            ("outbox".to_string(), "order.paid".to_string()),
            ("outbox".to_string(), "order.shipped".to_string())
        ]
    );
    let extra = notifications(&mut listener, Duration::from_millis(300), 1);
    assert!(
        extra.is_empty(),
        "more notifications than topics: {extra:?}"
    );
}

/// A session that starts listening while a writer's transaction is open still gets its
/// notification: the writer decides at its commit whether anyone listens.
#[test]
fn a_listener_that_starts_during_the_writers_transaction_is_notified() {
    let pg = server();
    let mut writer = pg.with_extension();
    let mut listener = pg.connect();
    writer
        .batch_execute("BEGIN; SELECT outbox_enqueue('late.listener', '{}')")
        .unwrap();
    listener.batch_execute("LISTEN outbox").unwrap();
    writer.batch_execute("COMMIT").unwrap();
    let got = notifications(&mut listener, Duration::from_secs(5), 1);
    assert_eq!(got, [("outbox".to_string(), "late.listener".to_string())]);
}

/// What `outbox_status.notify_listeners` says: the sessions of this database listening on
/// `outbox.notify_channel`, which decide whether an enqueueing commit notifies. Each way of
/// listening and of stopping counts, in this database only.
#[test]
fn the_listeners_are_counted_as_sessions_listen_and_stop() {
    let pg = server();
    let mut admin = pg.with_extension();
    admin.batch_execute("CREATE DATABASE elsewhere").unwrap();
    let listeners = |client: &mut common::Client| -> i64 {
        count(client, "SELECT notify_listeners FROM outbox_status")
    };
    let session = || pg.connect();
    assert_eq!(listeners(&mut admin), 0);

    // A LISTEN counts from its commit; rolled back, it does not.
    let mut a = session();
    a.batch_execute("BEGIN; LISTEN outbox; ROLLBACK").unwrap();
    assert_eq!(listeners(&mut admin), 0, "a rolled-back LISTEN counted");
    a.batch_execute("LISTEN outbox; LISTEN outbox").unwrap();
    assert_eq!(listeners(&mut admin), 1);
    // In PL/pgSQL's EXECUTE too; another channel is another count.
    let mut b = session();
    b.batch_execute("DO $$BEGIN EXECUTE 'LISTEN outbox'; EXECUTE 'LISTEN other'; END$$")
        .unwrap();
    assert_eq!(listeners(&mut admin), 2);
    // Another database's sessions are not counted here.
    let mut far = pg.connect_to("elsewhere");
    far.batch_execute("LISTEN outbox").unwrap();
    assert_eq!(listeners(&mut admin), 2);

    // A subtransaction's UNLISTEN that rolls back leaves the session listening.
    a.batch_execute("BEGIN; SAVEPOINT s; UNLISTEN outbox; ROLLBACK TO s; COMMIT")
        .unwrap();
    assert_eq!(listeners(&mut admin), 2);
    a.batch_execute("UNLISTEN outbox").unwrap();
    assert_eq!(listeners(&mut admin), 1);
    b.batch_execute("UNLISTEN *").unwrap();
    assert_eq!(listeners(&mut admin), 0);
    b.batch_execute("LISTEN outbox").unwrap();
    a.batch_execute("LISTEN outbox").unwrap();
    assert_eq!(listeners(&mut admin), 2);
    b.batch_execute("DISCARD ALL").unwrap();
    assert_eq!(listeners(&mut admin), 1);
    // A session that ends, or whose backend is terminated, stops counting.
    let pid: i32 = count(&mut a, "SELECT pg_backend_pid()::bigint") as i32;
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .unwrap();
    assert!(
        common::wait_until(Duration::from_secs(5), || listeners(&mut admin) == 0),
        "a terminated listener is still counted"
    );
    drop(far);

    // The channel a session sets is the one counted and notified.
    admin
        .batch_execute("SET outbox.notify_channel = 'other'")
        .unwrap();
    assert_eq!(listeners(&mut admin), 0);
    let mut c = session();
    c.batch_execute("LISTEN other").unwrap();
    assert_eq!(listeners(&mut admin), 1);
    admin
        .batch_execute("SELECT outbox_enqueue('heard', '{}')")
        .unwrap();
    let got = notifications(&mut c, Duration::from_secs(5), 1);
    assert_eq!(got, [("other".to_string(), "heard".to_string())]);
}

#[test]
fn a_rolled_back_enqueue_notifies_nobody() {
    let pg = server();
    let mut writer = pg.with_extension();
    let mut listener = pg.connect();
    listener.batch_execute("LISTEN outbox").unwrap();
    writer
        .batch_execute("BEGIN; SELECT outbox_enqueue('t', '{}'); ROLLBACK")
        .unwrap();
    let got = notifications(&mut listener, Duration::from_millis(500), 1);
    assert!(got.is_empty(), "{got:?}");
}

#[test]
fn an_empty_channel_setting_sends_no_notification() {
    let pg = server();
    let mut writer = pg.with_extension();
    let mut listener = pg.connect();
    listener.batch_execute("LISTEN outbox").unwrap();
    writer
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    let id: i64 = writer
        .query_one("SELECT outbox_enqueue('quiet', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(id > 0);
    let got = notifications(&mut listener, Duration::from_millis(500), 1);
    assert!(got.is_empty(), "{got:?}");

    // Another channel name is honoured.
    listener.batch_execute("LISTEN events").unwrap();
    writer
        .batch_execute("SET outbox.notify_channel = 'events'; SELECT outbox_enqueue('loud', '{}')")
        .unwrap();
    let got = notifications(&mut listener, Duration::from_secs(5), 1);
    assert_eq!(got, [("events".to_string(), "loud".to_string())]);
}

#[test]
fn bad_input_gets_its_sqlstate_and_writes_nothing() {
    let pg = server();
    let mut client = pg.with_extension();
    client
        .batch_execute("SET outbox.max_payload_size = '1kB'")
        .unwrap();
    let long_topic = "t".repeat(257);
    let big_payload = format!("{{\"data\": \"{}\"}}", "x".repeat(1024));
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "NULL topic",
            "SELECT outbox_enqueue(NULL, '{}')".into(),
            "22004",
        ),
        (
            "NULL payload",
            "SELECT outbox_enqueue('t', NULL)".into(),
            "22004",
        ),
        (
            "empty topic",
            "SELECT outbox_enqueue('', '{}')".into(),
            "22023",
        ),
        (
            "257-byte topic",
            format!("SELECT outbox_enqueue('{long_topic}', '{{}}')"),
            "22023",
        ),
        (
            "newline in topic",
            "SELECT outbox_enqueue(E'a\\nb', '{}')".into(),
            "22023",
        ),
        (
            "tab in topic",
            "SELECT outbox_enqueue(E'a\\tb', '{}')".into(),
            "22023",
        ),
        (
            "payload over the limit",
            format!("SELECT outbox_enqueue('t', '{big_payload}')"),
            "54000",
        ),
        (
            "invalid JSON",
            "SELECT outbox_enqueue('t', '{not json')".into(),
            "22P02",
        ),
    ];
    for (what, sql, expected) in cases {
        let error = client.batch_execute(&sql).expect_err(what);
        assert_eq!(sqlstate(&error), expected, "{what}: {error:?}");
        let db = error.as_db_error().expect("a server error");
        assert!(
            db.message().contains("outbox_enqueue") || expected == "22P02",
            "{what}: {}",
            db.message()
        );
    }
    // None of the refused calls wrote a row.
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox"), 0);

    // The limits are inclusive: 256 bytes of topic and exactly 1 kB of JSON text are fine.
    let ok_topic = "t".repeat(256);
    client
        .query_one(&format!("SELECT outbox_enqueue('{ok_topic}', '{{}}')"), &[])
        .unwrap();
    let exact = format!("{{\"d\": \"{}\"}}", "x".repeat(1024 - 9));
    assert_eq!(exact.len(), 1024);
    client
        .query_one("SELECT outbox_enqueue('t', $1::text::jsonb)", &[&exact])
        .unwrap();
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox"), 2);
}

/// A key is at most 1 KiB, however it would be stored (a long key of one repeated character
/// compresses to a few bytes), and refused longer with 22023 before it is read.
#[test]
fn keys_longer_than_a_kibibyte_are_refused() {
    let pg = server();
    let mut client = pg.with_extension();
    for (what, key_sql) in [
        ("1025 bytes", "repeat('k', 1025)"),
        ("compressible, 100 MB", "repeat('k', 100 * 1024 * 1024)"),
        ("multibyte", "repeat('ü', 513)"),
    ] {
        let error = client
            .batch_execute(&format!("SELECT outbox_enqueue('t', '{{}}', {key_sql})"))
            .expect_err(what);
        assert_eq!(sqlstate(&error), "22023", "{what}: {error:?}");
        let db = error.as_db_error().expect("a server error");
        assert!(
            db.message().contains("key is") && db.message().contains("limit of 1024"),
            "{what}: {}",
            db.message()
        );
    }
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox"), 0);
    client
        .batch_execute("SELECT outbox_enqueue('t', '{}', repeat('k', 1024))")
        .unwrap();
    assert_eq!(count(&mut client, "SELECT count(*) FROM outbox"), 1);
}

/// `outbox_enqueue` runs with its owner's rights: the payload limit is not the caller's to
/// raise, and a superuser raises it only up to 64 MB.
#[test]
fn only_a_superuser_changes_the_payload_limit_and_only_up_to_its_ceiling() {
    let pg = server();
    let mut admin = pg.with_extension();
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN; GRANT EXECUTE ON FUNCTION \
             outbox_enqueue(text, jsonb, text, jsonb, interval) TO app",
        )
        .unwrap();
    let mut app = pg.connect_as("postgres", "app");
    let error = app
        .batch_execute("SET outbox.max_payload_size = '100MB'")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "42501", "{error:?}");
    let error = app
        .batch_execute("SELECT set_config('outbox.max_payload_size', '2MB', false)")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "42501", "{error:?}");
    let big = format!("{{\"d\": \"{}\"}}", "x".repeat(1024 * 1024 + 1));
    let error = app
        .query_one("SELECT outbox_enqueue('t', $1::text::jsonb)", &[&big])
        .unwrap_err();
    assert_eq!(sqlstate(&error), "54000", "{error:?}");

    let error = admin
        .batch_execute("SET outbox.max_payload_size = '65MB'")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "22023", "{error:?}");
    admin
        .batch_execute("SET outbox.max_payload_size = '64MB'")
        .unwrap();
    admin
        .query_one("SELECT outbox_enqueue('t', $1::text::jsonb)", &[&big])
        .unwrap();
}

#[test]
fn errors_say_what_is_wrong_with_a_hint() {
    let pg = server();
    let mut client = pg.with_extension();
    let error = client
        .batch_execute("SELECT outbox_enqueue('', '{}')")
        .unwrap_err();
    let db = error.as_db_error().unwrap();
    assert_eq!(db.message(), "outbox_enqueue: topic must not be empty");
    assert!(
        db.hint().is_some_and(|h| h.contains("stream")),
        "{:?}",
        db.hint()
    );
    let error = client
        .batch_execute("SELECT outbox_enqueue(E'x\\u0001', '{}')")
        .unwrap_err();
    assert!(error
        .as_db_error()
        .unwrap()
        .message()
        .contains("control character"));
}

#[test]
fn execute_privilege_is_all_an_application_needs() {
    let pg = server();
    let mut admin = pg.with_extension();
    admin
        .batch_execute("CREATE ROLE app LOGIN; CREATE ROLE stranger LOGIN; CREATE SCHEMA evil; GRANT ALL ON SCHEMA evil TO app")
        .unwrap();

    let mut stranger = pg.connect();
    stranger.batch_execute("SET ROLE stranger").unwrap();
    let error = stranger
        .batch_execute("SELECT outbox_enqueue('t', '{}')")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "42501", "{error:?}");
    let error = stranger.batch_execute("SELECT * FROM outbox").unwrap_err();
    assert_eq!(sqlstate(&error), "42501");
    let error = stranger
        .batch_execute("INSERT INTO outbox (topic, payload) VALUES ('t', '{}')")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "42501");

    admin
        .batch_execute(
            "GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, jsonb, interval) TO app",
        )
        .unwrap();
    let mut app = pg.connect();
    app.batch_execute("SET ROLE app").unwrap();
    // A table of the caller's named like ours, first on its search_path, is not written to.
    app.batch_execute(
        "CREATE TABLE evil.outbox (id bigserial, topic text, payload jsonb); SET search_path = evil, public",
    )
    .unwrap();
    let id: i64 = app
        .query_one("SELECT public.outbox_enqueue('t', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(id > 0);
    let error = app
        .batch_execute("SELECT * FROM public.outbox")
        .unwrap_err();
    assert_eq!(
        sqlstate(&error),
        "42501",
        "the application cannot read the table"
    );
    assert_eq!(count(&mut app, "SELECT count(*) FROM evil.outbox"), 0);
    // Nor does an empty search_path, or one with only the caller's schema, stop it.
    app.batch_execute("SET search_path = ''").unwrap();
    app.query_one("SELECT public.outbox_enqueue('t', '{}')", &[])
        .unwrap();
    app.batch_execute("SET search_path = evil").unwrap();
    app.query_one("SELECT public.outbox_enqueue('t', '{}')", &[])
        .unwrap();
    assert_eq!(count(&mut app, "SELECT count(*) FROM evil.outbox"), 0);
    let stored: i64 = admin
        .query_one("SELECT count(*) FROM outbox WHERE id = $1", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(stored, 1);
}

#[test]
fn without_the_preload_events_are_written_and_the_log_says_no_relay_runs() {
    let pg = Pg::start(&[("shared_preload_libraries", "")]);
    let mut client = pg.with_extension();
    let id: i64 = client
        .query_one("SELECT outbox_enqueue('t', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(id > 0);
    let running: i32 = client
        .query_one("SELECT workers_running FROM outbox_status", &[])
        .unwrap()
        .get(0);
    assert_eq!(running, 0);
    assert_eq!(
        client
            .query("SELECT * FROM outbox_workers", &[])
            .unwrap()
            .len(),
        0
    );
    assert_eq!(count(&mut client, "SELECT pending FROM outbox_status"), 1);
    let log = pg.log();
    assert!(
        log.contains("outbox is not in shared_preload_libraries"),
        "{log}"
    );
    assert!(
        log.contains("HINT:  Add 'outbox' to shared_preload_libraries"),
        "{log}"
    );
}

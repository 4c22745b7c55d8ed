//! The write path against a real server: transactions, the row as an INSERT writes it,
//! notifications, and a server without the preload. The relay is off here (`outbox.workers =
//! 0`) so that rows stay where the tests put them. How the row is inserted (the fast path, what
//! a session keeps, a table changed by hand) is in `insert.rs`; bad input, its SQLSTATEs and
//! hints, and privileges are pinned by `tests/regress` (pg_regress).

use std::time::Duration;

use common::sql::count;
use common::{notifications, server, Pg};

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
    // Nor notified: this database's commit reaches its own listeners only.
    admin
        .batch_execute("SELECT outbox_enqueue('here', '{}')")
        .unwrap();
    let got = notifications(&mut a, Duration::from_secs(5), 1);
    assert_eq!(got, [("outbox".to_string(), "here".to_string())]);
    far.batch_execute("SELECT 1").unwrap();
    let heard_far = notifications(&mut far, Duration::from_millis(300), 1);
    assert!(heard_far.is_empty(), "another database heard {heard_far:?}");

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

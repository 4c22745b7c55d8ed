//! The write path against a real server: transactions, notifications, bad input, privileges.
//! The relay is off here (`outbox.workers = 0`) so that rows stay where the tests put them.

mod common;

use std::time::Duration;

use common::sql::count;
use common::{notifications, sqlstate, Client, Pg};

fn server() -> Pg {
    Pg::start(&[("outbox.workers", "0")])
}

/// [`count`] with sequential and bitmap scans off, so that the rows are found through an index.
fn count_through_indexes(client: &mut Client, sql: &str) -> i64 {
    let mut tx = client.transaction().unwrap();
    tx.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off")
        .unwrap();
    let n = tx.query_one(sql, &[]).unwrap().get(0);
    tx.commit().unwrap();
    n
}

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

/// Checks every index of `outbox` against the table with amcheck: each row that belongs in an
/// index is in it. PostgreSQL installations without the contrib modules (the PyPI builds of 16
/// and 18 used here) have no amcheck; there the test's own assertions stand alone.
fn check_indexes(client: &mut Client) {
    let available: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'amcheck')",
            &[],
        )
        .unwrap()
        .get(0);
    if !available {
        eprintln!("amcheck is not installed here: indexes not verified against the table");
        return;
    }
    client
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS amcheck;
             SELECT bt_index_check(i.indexrelid, true) FROM pg_index i
             WHERE i.indrelid IN (SELECT inhrelid FROM pg_inherits
                                  WHERE inhparent = 'outbox'::regclass)",
        )
        .unwrap();
}

/// A session keeps what its inserts need between calls (the table, its columns, its indexes);
/// changes made by other sessions, and by a trigger in the middle of an insert, must reach it.
#[test]
fn the_insert_follows_changes_made_to_the_table() {
    let pg = server();
    let mut app = pg.with_extension();
    let mut admin = pg.connect();
    let enqueue = |client: &mut Client, topic: &str, payload: &str| {
        client.query_one(
            "SELECT outbox_enqueue($1, $2::text::jsonb)",
            &[&topic, &payload],
        )
    };
    enqueue(&mut app, "unique.a", "{}").unwrap();

    // A partial unique index on a column of the partition being written, made by another
    // session: the next call maintains it. (A unique index on the whole table must hold the
    // partition key, id.)
    admin
        .batch_execute(
            "CREATE UNIQUE INDEX one_per_topic ON outbox_00 (topic) WHERE topic LIKE 'unique.%'",
        )
        .unwrap();
    enqueue(&mut app, "unique.b", "{}").unwrap();
    let error = enqueue(&mut app, "unique.b", "{}").unwrap_err();
    assert_eq!(sqlstate(&error), "23505");
    // Rows its predicate leaves out are not in it.
    enqueue(&mut app, "other", "{}").unwrap();
    enqueue(&mut app, "other", "{}").unwrap();
    check_indexes(&mut admin);
    admin.batch_execute("DROP INDEX one_per_topic").unwrap();
    enqueue(&mut app, "unique.b", "{}").unwrap();

    // An index on an expression, on the partition.
    admin
        .batch_execute("CREATE UNIQUE INDEX one_per_key ON outbox_00 ((payload->>'key'))")
        .unwrap();
    enqueue(&mut app, "keyed", r#"{"key": "k"}"#).unwrap();
    let error = enqueue(&mut app, "keyed", r#"{"key": "k"}"#).unwrap_err();
    assert_eq!(sqlstate(&error), "23505");
    check_indexes(&mut admin);
    admin.batch_execute("DROP INDEX one_per_key").unwrap();

    // An index made on the whole table goes onto every partition: the next call maintains it.
    admin
        .batch_execute("CREATE INDEX by_topic ON outbox (topic)")
        .unwrap();
    enqueue(&mut app, "indexed", "{}").unwrap();
    check_indexes(&mut admin);
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE topic = 'indexed'"
        ),
        1,
        "the new index lacks the row"
    );
    admin.batch_execute("DROP INDEX by_topic").unwrap();

    // A trigger that changes the table's catalog entry and enqueues again, in the middle of
    // the outer insert: the inner call builds afresh while the outer one still inserts.
    admin
        .batch_execute(
            "CREATE FUNCTION nest() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF NEW.topic = 'outer' THEN
                 GRANT SELECT ON outbox TO PUBLIC;
                 PERFORM outbox_enqueue('inner', '{}');
               END IF;
               RETURN NEW;
             END $$;
             CREATE TRIGGER nest BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION nest();",
        )
        .unwrap();
    for _ in 0..3 {
        enqueue(&mut app, "outer", "{}").unwrap();
    }
    assert_eq!(
        count(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE topic IN ('outer', 'inner')"
        ),
        6
    );
    check_indexes(&mut admin);
    let unpublished = count(&mut admin, "SELECT count(*) FROM outbox");
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        ),
        unpublished,
        "the partial index holds every unpublished row"
    );

    // The extension dropped and created again: the next call finds the new table.
    admin
        .batch_execute("DROP EXTENSION outbox CASCADE; CREATE EXTENSION outbox")
        .unwrap();
    let id: i64 = enqueue(&mut app, "again", "{}").unwrap().get(0);
    assert_eq!(id, 1, "the new table's sequence starts again");
    assert_eq!(count(&mut admin, "SELECT count(*) FROM outbox"), 1);
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

/// The table as the extension creates it (and as the upgrade leaves it) takes the fast path,
/// with or without a key: a statement-level trigger, which a plain `INSERT` statement fires and
/// the executor's single-row insert does not, never fires for `outbox_enqueue`.
#[test]
fn the_extensions_own_table_takes_the_fast_path() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    client
        .batch_execute(
            "CREATE TABLE statements (n int NOT NULL); INSERT INTO statements VALUES (0); \
             CREATE FUNCTION count_statement() RETURNS trigger LANGUAGE plpgsql AS \
               $$BEGIN UPDATE statements SET n = n + 1; RETURN NULL; END$$; \
             CREATE TRIGGER count_statement AFTER INSERT ON outbox \
               FOR EACH STATEMENT EXECUTE FUNCTION count_statement()",
        )
        .unwrap();
    let statements = |client: &mut postgres::Client| -> i32 {
        client
            .query_one("SELECT n FROM statements", &[])
            .unwrap()
            .get(0)
    };
    client
        .batch_execute(
            "SELECT outbox_enqueue('t', '{}'); \
             SELECT outbox_enqueue('t', '{}', 'k', '{\"a\": \"b\"}'); \
             SELECT outbox_enqueue('t', '{}', deliver_after => '1 hour')",
        )
        .unwrap();
    assert_eq!(
        statements(&mut client),
        0,
        "outbox_enqueue ran an INSERT statement"
    );
    client
        .batch_execute("INSERT INTO outbox (topic, payload) VALUES ('t', '{}')")
        .unwrap();
    assert_eq!(
        statements(&mut client),
        1,
        "the trigger does not count statements"
    );
}

/// The relation locks this session holds, as `relation:mode`, sorted.
fn locks_held(client: &mut postgres::Transaction) -> Vec<String> {
    client
        .query(
            "SELECT l.relation::regclass::text || ':' || l.mode FROM pg_locks l \
             WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' \
               AND l.relation <> 'pg_locks'::regclass ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// What an insert into the extension's own table prepares (the partition's check, its indexes'
/// predicates and expressions) is prepared once per session, not on every call. Seen through
/// the locks a call leaves: preparing the partition check opens `outbox` again under
/// `AccessShareLock`, which an `INSERT` does not take; and indexes opened for one call by
/// `ExecOpenIndices` are unlocked at once, while those whose state is kept stay locked, as the
/// table does, until the transaction ends.
#[test]
fn an_enqueue_prepares_its_insert_once_per_session() {
    let pg = server();
    let mut client = pg.with_extension();
    // The first call builds what the next ones use.
    client
        .batch_execute("SELECT outbox_enqueue('warm', '{}', 'k', '{\"a\": \"b\"}')")
        .unwrap();
    for call in [
        "outbox_enqueue('t', '{}')",
        "outbox_enqueue('t', '{}', 'k', '{\"a\": \"b\"}')",
    ] {
        let mut tx = client.transaction().unwrap();
        tx.batch_execute(&format!("SELECT {call}")).unwrap();
        let held = locks_held(&mut tx);
        let on = |relation: &str| -> Vec<&str> {
            held.iter()
                .filter_map(|l| l.strip_prefix(&format!("{relation}:")))
                .collect()
        };
        assert_eq!(on("outbox"), ["RowExclusiveLock"], "{call}: {held:?}");
        for relation in [
            "outbox_00",
            "outbox_00_pkey",
            "outbox_00_id_lane_idx",
            "outbox_00_next_attempt_at_idx",
            "outbox_00_lane_left_id_idx",
        ] {
            assert_eq!(on(relation), ["RowExclusiveLock"], "{call}: {held:?}");
        }
        tx.rollback().unwrap();
    }
}

/// An index whose expression or predicate calls a function of the database's own (prepared for
/// each call, as an `INSERT` prepares it for each statement; see `src/insert/kept.rs`) stays
/// right when the function is replaced between two calls of one session: the next call runs
/// the new function.
#[test]
fn an_index_on_a_function_of_the_database_follows_its_replacement() {
    let pg = server();
    let mut app = pg.with_extension();
    let mut admin = pg.connect();
    admin
        .batch_execute(
            "CREATE FUNCTION shout(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS \
               $$BEGIN RETURN upper(t); END$$; \
             CREATE INDEX by_shout ON outbox_00 (shout(topic)); \
             CREATE UNIQUE INDEX one_per_quiet ON outbox_00 (topic) WHERE shout(topic) = 'QUIET'",
        )
        .unwrap();
    app.batch_execute("SELECT outbox_enqueue('loud', '{}'), outbox_enqueue('quiet', '{}')")
        .unwrap();
    let error = app
        .batch_execute("SELECT outbox_enqueue('quiet', '{}')")
        .unwrap_err();
    assert_eq!(sqlstate(&error), "23505");
    // Replaced by another session (and its index rebuilt to match, as the owner must).
    admin
        .batch_execute(
            "CREATE OR REPLACE FUNCTION shout(t text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS \
               $$BEGIN RETURN upper(t) || '!'; END$$; \
             REINDEX INDEX by_shout; REINDEX INDEX one_per_quiet",
        )
        .unwrap();
    app.batch_execute("SELECT outbox_enqueue('quiet', '{}'), outbox_enqueue('later', '{}')")
        .unwrap();
    check_indexes(&mut admin);
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE shout(topic) = 'LATER!'"
        ),
        1,
        "the index was given the replaced function's value"
    );
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE shout(topic) = 'QUIET!'"
        ),
        2
    );
}

/// An index a database owner may put on a partition whose predicate reads the whole row: its
/// first evaluation caches the row's descriptor in memory that lives as long as the call, so
/// such an index is prepared per call (`ExecOpenIndices`, which unlocks the indexes at the end
/// of the call, where kept ones stay locked until the transaction ends), and every call of a
/// session, not only its first, inserts as `INSERT` does.
#[test]
fn an_index_reading_the_whole_row_works_on_every_call() {
    let pg = server();
    let mut app = pg.with_extension();
    let mut admin = pg.connect();
    admin
        .batch_execute(
            "CREATE UNIQUE INDEX whole_rows ON outbox_00 (topic) \
               WHERE outbox_00 IS NOT NULL OR topic LIKE 'whole.%'",
        )
        .unwrap();
    for n in 0..5 {
        app.batch_execute(&format!("SELECT outbox_enqueue('whole.{n}', '{{}}')"))
            .unwrap();
        let error = app
            .batch_execute(&format!("SELECT outbox_enqueue('whole.{n}', '{{}}')"))
            .unwrap_err();
        assert_eq!(sqlstate(&error), "23505", "call {n}: {error}");
    }
    check_indexes(&mut admin);
    let mut tx = app.transaction().unwrap();
    tx.batch_execute("SELECT outbox_enqueue('whole.last', '{}')")
        .unwrap();
    let held = locks_held(&mut tx);
    assert!(
        !held.iter().any(|l| l.starts_with("whole_rows:")),
        "the whole-row index was kept prepared: {held:?}"
    );
    tx.rollback().unwrap();
}

/// A call that fails in an index (a unique violation on an expression) leaves what the session
/// keeps for its inserts usable: the next calls insert and index as before.
#[test]
fn a_call_that_fails_in_an_index_leaves_the_next_ones_working() {
    let pg = server();
    let mut app = pg.with_extension();
    let mut admin = pg.connect();
    admin
        .batch_execute("CREATE UNIQUE INDEX one_per_lower ON outbox_00 (lower(topic))")
        .unwrap();
    app.batch_execute("SELECT outbox_enqueue('Same', '{}')")
        .unwrap();
    for _ in 0..3 {
        let error = app
            .batch_execute("SELECT outbox_enqueue('SAME', '{}')")
            .unwrap_err();
        assert_eq!(sqlstate(&error), "23505");
    }
    app.batch_execute("SELECT outbox_enqueue('other', '{}'), outbox_enqueue('Third', '{}')")
        .unwrap();
    check_indexes(&mut admin);
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox_00 WHERE lower(topic) IN ('same', 'other', 'third')"
        ),
        3
    );
}

//! The row's insert behind `outbox_enqueue`: the fast path on the table as the extension makes
//! it, what a session prepares once and keeps between calls, the table's indexes kept right
//! (functions replaced, whole-row expressions, a call that fails in an index), and a table
//! changed by hand, by another session meanwhile or before: new indexes, triggers, a payload
//! column changed to `json`, new columns with defaults, all written as an INSERT would write
//! them. Against a real PostgreSQL, and Redis where the events must go out.

use std::time::Duration;

use common::sql::{count, one};
use common::{server, sqlstate, wait_until, Client, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// The fast path and what a session keeps
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// The table's indexes
// ---------------------------------------------------------------------------------------------

/// [`count`] with sequential and bitmap scans off, so that the rows are found through an index.
fn count_through_indexes(client: &mut Client, sql: &str) -> i64 {
    let mut tx = client.transaction().unwrap();
    tx.batch_execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off")
        .unwrap();
    let n = tx.query_one(sql, &[]).unwrap().get(0);
    tx.commit().unwrap();
    n
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

/// An index whose expression or predicate calls a function of the database's own (prepared for
/// each call, as an `INSERT` prepares it for each statement; see `src/write/insert/kept.rs`)
/// stays right when the function is replaced between two calls of one session: the next call
/// runs the new function.
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

// ---------------------------------------------------------------------------------------------
// A table changed by hand
// ---------------------------------------------------------------------------------------------

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

/// A table changed by hand takes a plain INSERT instead of the fast path: the key, the headers
/// and the lane are written the same way; a delayed event goes to outbox_delayed as always.
#[test]
fn a_table_changed_by_hand_gets_the_same_columns() {
    let pg = Pg::start(&[("outbox.workers", "0")]);
    let mut client = pg.with_extension();
    client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant text DEFAULT 'acme'")
        .unwrap();
    let mut transaction = client.transaction().unwrap();
    let id: i64 = transaction
        .query_one(
            "SELECT outbox_enqueue('t', '{}', 'k-1', '{\"a\": \"b\"}')",
            &[],
        )
        .unwrap()
        .get(0);
    let row = transaction
        .query_one(
            "SELECT key, headers::text, lane, outbox_lane('k-1', 't'), tenant, \
                    next_attempt_at IS NULL \
             FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap();
    // A delayed event waits in outbox_delayed, whatever outbox's shape.
    let delayed: i64 = transaction
        .query_one(
            "SELECT outbox_enqueue('t', '{}', 'k-1', deliver_after => '90 minutes')",
            &[],
        )
        .unwrap()
        .get(0);
    let waiting = transaction
        .query_one(
            "SELECT key, lane, deliver_at = now() + interval '90 minutes', \
                    (SELECT count(*) FROM outbox WHERE id = $1) \
             FROM outbox_delayed WHERE id = $1",
            &[&delayed],
        )
        .unwrap();
    transaction.commit().unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("k-1"));
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some(r#"{"a": "b"}"#)
    );
    assert_eq!(row.get::<_, i16>(2), row.get::<_, i16>(3));
    assert_eq!(
        row.get::<_, String>(4),
        "acme",
        "the plain INSERT was not taken"
    );
    assert!(
        row.get::<_, bool>(5),
        "an event without delay has a retry time"
    );
    assert_eq!(waiting.get::<_, Option<String>>(0).as_deref(), Some("k-1"));
    assert_eq!(waiting.get::<_, i16>(1), row.get::<_, i16>(3));
    assert!(
        waiting.get::<_, bool>(2),
        "the delivery time is not the transaction's start plus the delay"
    );
    assert_eq!(
        waiting.get::<_, i64>(3),
        0,
        "the delayed event is in outbox too"
    );
}

/// The payload column changed to `json`: outbox_enqueue stores its jsonb argument converted to
/// the column's type (not a jsonb datum in a json column), and the relay publishes the text. A
/// session that enqueued before the change follows it.
#[test]
fn a_payload_column_changed_to_json_takes_and_relays_events() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut app = pg.with_extension();
    pg.wait_for_workers(1);
    let before: i64 = one(&mut app, "SELECT outbox_enqueue('t', '{\"a\": 0}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("t") == 1));

    pg.connect()
        .batch_execute("ALTER TABLE outbox ALTER COLUMN payload TYPE json USING payload::json")
        .unwrap();
    let id: i64 = app
        .query_one("SELECT outbox_enqueue('t', '{\"a\": 1}')", &[])
        .unwrap_or_else(|e| panic!("outbox_enqueue failed on a json column: {e:?}"))
        .get(0);
    let stored: String = app
        .query_one("SELECT payload::text FROM outbox WHERE id = $1", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(stored, r#"{"a": 1}"#);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("t") == 2),
        "the event was not published"
    );
    let entries = redis.entries("t");
    assert_eq!(redis.ids("t"), [before, id]);
    assert_eq!(entries[1].1["payload"], r#"{"a": 1}"#);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
}

/// New columns with defaults, one NOT NULL and one volatile (evaluated per row): outbox_enqueue
/// fills them as an INSERT would, and the relay publishes the event. A session that enqueued
/// before the change follows it.
#[test]
fn new_columns_with_defaults_are_filled_on_enqueue() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut app = pg.with_extension();
    pg.wait_for_workers(1);
    let before: i64 = one(&mut app, "SELECT outbox_enqueue('t', '{}')");
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("t") == 1));

    pg.connect()
        .batch_execute(
            "ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'acme';
             ALTER TABLE outbox ADD COLUMN trace uuid DEFAULT gen_random_uuid();",
        )
        .unwrap();
    let ids: Vec<i64> = (0..2)
        .map(|_| {
            app.query_one("SELECT outbox_enqueue('t', '{}')", &[])
                .unwrap_or_else(|e| panic!("outbox_enqueue failed with new columns: {e:?}"))
                .get(0)
        })
        .collect();
    let rows = app
        .query(
            "SELECT tenant, trace::text FROM outbox WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )
        .unwrap();
    let tenants: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let traces: Vec<Option<String>> = rows.iter().map(|r| r.get(1)).collect();
    assert_eq!(tenants, ["acme", "acme"]);
    assert!(traces.iter().all(Option::is_some), "{traces:?}");
    assert_ne!(traces[0], traces[1], "the volatile default runs per row");
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("t") == 3),
        "the events were not published"
    );
    assert_eq!(redis.ids("t"), [before, ids[0], ids[1]]);
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
}

/// An index made on a partition by another session while a transaction already holds the
/// table's lock: the invalidation it sends is read only when the call takes a lock it does not
/// hold yet (here the id sequence's, between the check of the kept state and the partition's
/// open). The call must still see the index, and put its row in it.
#[test]
fn an_index_made_during_the_transaction_gets_the_row() {
    let pg = server();
    let mut app = pg.with_extension();
    let mut admin = pg.connect();
    app.batch_execute("SELECT outbox_enqueue('warm', '{}')")
        .unwrap();
    let mut tx = app.transaction().unwrap();
    tx.batch_execute("LOCK TABLE ONLY outbox IN ROW EXCLUSIVE MODE")
        .unwrap();
    admin
        .batch_execute(
            "DO $$DECLARE p regclass; BEGIN \
               FOR p IN SELECT inhrelid::regclass FROM pg_inherits \
                        WHERE inhparent = 'outbox'::regclass LOOP \
                 EXECUTE format('CREATE INDEX ON %s (topic)', p); \
               END LOOP; END$$",
        )
        .unwrap();
    tx.batch_execute("SELECT outbox_enqueue('raced', '{}')")
        .unwrap();
    tx.commit().unwrap();
    assert_eq!(
        count_through_indexes(
            &mut admin,
            "SELECT count(*) FROM outbox WHERE topic = 'raced'"
        ),
        1,
        "the index made meanwhile lacks the row"
    );
    check_indexes(&mut admin);
}

/// `ALTER SCHEMA ... RENAME` of the extension's schema: a session that already wrote a delayed
/// event goes on writing them under the new name.
#[test]
fn a_renamed_schema_goes_on_taking_delayed_events() {
    let pg = server();
    let mut admin = pg.connect();
    admin
        .batch_execute("CREATE SCHEMA before; CREATE EXTENSION outbox SCHEMA before")
        .unwrap();
    let mut app = pg.connect();
    let delayed = "outbox_enqueue('later', '{}', deliver_after => '1 hour')";
    app.batch_execute(&format!("SELECT before.{delayed}"))
        .unwrap();
    admin
        .batch_execute("ALTER SCHEMA before RENAME TO after")
        .unwrap();
    app.batch_execute(&format!("SELECT after.{delayed}"))
        .unwrap_or_else(|e| panic!("a delayed event after the rename: {e:?}"));
    app.batch_execute("SELECT after.outbox_enqueue('now', '{}')")
        .unwrap();
    assert_eq!(
        count(&mut admin, "SELECT count(*) FROM after.outbox_delayed"),
        2
    );
}

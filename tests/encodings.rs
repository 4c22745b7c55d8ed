//! Encodings: databases whose encoding is not UTF-8 (LATIN1, WIN1252, SQL_ASCII). Their events'
//! text reaches Redis as UTF-8, a topic's control characters are those of its encoding, and text
//! with no UTF-8 form is buried saying why; the names of schemas and databases stored in them
//! are relayed from, and logged, in UTF-8. Against a real PostgreSQL and Redis.

use std::collections::HashMap;
use std::time::Duration;

use common::redis_keys::keys;
use common::sql::{one, session, value_in, SESSION_OPTIONS};
use common::{wait_until, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// Text in the database's encoding
// ---------------------------------------------------------------------------------------------

/// A cluster relaying from a new database `db` created with `encoding`, with the extension.
fn encoded_database(redis: &Redis, db: &str, encoding: &str) -> Pg {
    let pg = Pg::relaying_to(
        redis,
        &[
            ("outbox.database", db),
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "2"),
        ],
    );
    pg.connect()
        .batch_execute(&format!(
            "CREATE DATABASE {db} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        ))
        .unwrap();
    session(&pg, db)
        .batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    // The worker connects to the database from the start.
    pg.restart();
    pg.wait_for_workers(1);
    pg
}

/// Waits until `stream` (UTF-8) holds `n` entries; names the keys Redis holds if it does not.
fn assert_stream_fills(redis: &Redis, stream: &str, n: usize) {
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen(stream) == n),
        "stream {stream} holds {} entries, not {n}; keys in Redis: {:?}",
        redis.xlen(stream),
        keys(redis, "*")
    );
}

fn assert_no_crash(pg: &Pg, pids: &[i32]) {
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        pg.worker_pids(),
        pids,
        "the worker exited and was restarted"
    );
    assert!(!pg.log().contains("panicked"), "the relay panicked");
}

/// Every entry of a stream as field name -> raw value bytes: what reached Redis, byte for
/// byte, valid UTF-8 or not.
fn raw_entries(redis: &Redis, stream: &str) -> Vec<HashMap<String, Vec<u8>>> {
    let reply: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(&mut redis.conn())
        .expect("XRANGE failed");
    reply
        .into_iter()
        .map(|(_, flat)| {
            flat.chunks(2)
                .map(|kv| (String::from_utf8_lossy(&kv[0]).into_owned(), kv[1].clone()))
                .collect()
        })
        .collect()
}

/// Text in a LATIN1 database is stored in LATIN1: the relay must send it to Redis as UTF-8
/// (it used to read it as if it were UTF-8), in the stream key as in the fields.
#[test]
fn a_latin1_database_publishes_its_events_as_utf8() {
    let redis = Redis::start();
    let pg = encoded_database(&redis, "latin", "LATIN1");
    let pids = pg.worker_pids();
    let mut client = session(&pg, "latin");
    // The client speaks UTF-8; the server converts.
    let id: i64 = client
        .query_one(
            "SELECT outbox_enqueue($1, $2::text::jsonb)",
            &[&"café", &r#"{"name": "Zoë"}"#],
        )
        .unwrap()
        .get(0);
    let stored: i32 = client
        .query_one(
            "SELECT octet_length(topic) FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(stored, 4, "precondition: the topic is stored in LATIN1");
    let plain: i64 = one(&mut client, "SELECT outbox_enqueue('plain', '{\"n\": 1}')");

    assert_stream_fills(&redis, "café", 1);
    let entries = raw_entries(&redis, "café");
    assert_eq!(entries[0]["id"], id.to_string().into_bytes());
    assert_eq!(entries[0]["topic"], "café".as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&entries[0]["payload"]),
        r#"{"name": "Zoë"}"#
    );
    assert_eq!(entries[0]["payload"], r#"{"name": "Zoë"}"#.as_bytes());
    assert_stream_fills(&redis, "plain", 1);
    assert_eq!(redis.ids("plain"), [plain]);
    assert!(
        wait_until(Duration::from_secs(10), || value_in::<i64>(
            &pg,
            "latin",
            "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        ) == 0),
        "the events were not marked published"
    );
    assert_no_crash(&pg, &pids);
}

/// A topic's control characters are those of the text it is, whatever the database's encoding:
/// in LATIN1 the byte 0x85 is NEL, a C1 control, and is refused with 22023; in WIN1252 the bytes
/// 0xC2 0x80 are "Â€", printable, and go out as such (read as UTF-8 they would look like a C1
/// control).
#[test]
fn a_topics_control_characters_are_read_in_the_databases_encoding() {
    let redis = Redis::start();
    let pg = encoded_database(&redis, "latin", "LATIN1");
    let mut latin = session(&pg, "latin");
    let error = latin
        .query_one("SELECT outbox_enqueue($1, '{}')", &[&"next\u{85}line"])
        .unwrap_err();
    assert_eq!(
        error.code().map(|c| c.code()),
        Some("22023"),
        "a C1 control in a LATIN1 topic: {error:?}"
    );
    assert_eq!(one::<i64>(&mut latin, "SELECT count(*) FROM outbox"), 0);
    drop(latin);

    pg.connect()
        .batch_execute(
            "CREATE DATABASE win ENCODING 'WIN1252' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0",
        )
        .unwrap();
    let mut win = session(&pg, "win");
    win.batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    let id: i64 = win
        .query_one("SELECT outbox_enqueue($1, '{}')", &[&"price.Â€"])
        .unwrap()
        .get(0);
    let stored: Vec<u8> = win
        .query_one(
            "SELECT convert_to(topic, 'WIN1252') FROM outbox WHERE id = $1",
            &[&id],
        )
        .unwrap()
        .get(0);
    assert_eq!(stored, b"price.\xc2\x80", "precondition: stored in WIN1252");
    // 0x81 is a byte WIN1252 stores but maps to no character: the topic has no UTF-8 form, is
    // taken (nothing in it is a control), and the relay buries its event saying why.
    let unmapped: i64 = win
        .query_one(
            "SELECT outbox_enqueue('price.' || convert_from('\\x81'::bytea, 'SQL_ASCII'), '{}')",
            &[],
        )
        .unwrap()
        .get(0);
    let after: i64 = win
        .query_one("SELECT outbox_enqueue('price.Â€', '{}')", &[])
        .unwrap()
        .get(0);
    // Relayed from the second database of the same server.
    drop(win);
    let mut pg = pg;
    pg.set(&[("outbox.database", "latin, win")]);
    assert_stream_fills(&redis, "price.Â€", 2);
    assert_eq!(redis.ids("price.Â€"), [id, after]);
    let buried = format!("SELECT count(*) FROM outbox_dead WHERE id = {unmapped}");
    assert!(
        wait_until(Duration::from_secs(30), || value_in::<i64>(
            &pg, "win", &buried
        ) == 1),
        "the event whose topic has no UTF-8 form never reached outbox_dead"
    );
    let error: String = value_in(
        &pg,
        "win",
        &format!("SELECT last_error FROM outbox_dead WHERE id = {unmapped}"),
    );
    println!("its last_error: {error}");
    assert!(error.contains("UTF-8"), "last_error: {error}");
}

/// A SQL_ASCII database stores whatever bytes it is given. Valid UTF-8 goes out as is; an event
/// whose text is not UTF-8 cannot be sent as a Redis Stream entry of JSON: it goes to
/// outbox_dead saying why, and the events behind it go out.
#[test]
fn a_sql_ascii_database_buries_what_is_not_utf8() {
    let redis = Redis::start();
    let pg = encoded_database(&redis, "ascii", "SQL_ASCII");
    let pids = pg.worker_pids();
    let mut client = session(&pg, "ascii");
    let name: i64 = client
        .query_one(
            "SELECT outbox_enqueue('names', $1::text::jsonb)",
            &[&r#"{"name": "Zoë"}"#],
        )
        .unwrap()
        .get(0);
    let mut tx = client.transaction().unwrap();
    // Built on the server: the client can only send UTF-8.
    let bad: i64 = tx
        .query_one(
            r#"SELECT outbox_enqueue('bad', ('{"a": "' || convert_from('\xe9'::bytea, 'SQL_ASCII') || '"}')::jsonb)"#,
            &[],
        )
        .unwrap()
        .get(0);
    let stored: Vec<u8> = tx
        .query_one(
            "SELECT convert_to(payload::text, 'SQL_ASCII') FROM outbox WHERE id = $1",
            &[&bad],
        )
        .unwrap()
        .get(0);
    assert_eq!(
        stored, b"{\"a\": \"\xe9\"}",
        "precondition: the payload holds the lone byte 0xE9"
    );
    tx.commit().unwrap();
    let after: i64 = one(&mut client, "SELECT outbox_enqueue('after', '{\"n\": 1}')");

    assert_stream_fills(&redis, "after", 1);
    assert_eq!(redis.ids("after"), [after]);
    assert_stream_fills(&redis, "names", 1);
    let entries = raw_entries(&redis, "names");
    assert_eq!(entries[0]["id"], name.to_string().into_bytes());
    assert_eq!(entries[0]["payload"], r#"{"name": "Zoë"}"#.as_bytes());

    let buried = format!("SELECT count(*) FROM outbox_dead WHERE id = {bad}");
    assert!(
        wait_until(Duration::from_secs(60), || value_in::<i64>(
            &pg, "ascii", &buried
        ) == 1),
        "the event that is not UTF-8 never reached outbox_dead"
    );
    // Read as bytes: nothing of the event's own text goes through the UTF-8 client.
    let error: Option<Vec<u8>> = value_in(
        &pg,
        "ascii",
        &format!("SELECT convert_to(last_error, 'SQL_ASCII') FROM outbox_dead WHERE id = {bad}"),
    );
    let error = String::from_utf8_lossy(&error.unwrap_or_default()).to_lowercase();
    assert!(
        error.contains("utf8") || error.contains("utf-8"),
        "last_error does not say the text is not UTF-8: {error:?}"
    );
    assert_eq!(redis.xlen("bad"), 0, "the event was published anyway");
    assert_no_crash(&pg, &pids);
}

// ---------------------------------------------------------------------------------------------
// Names in the database's encoding
// ---------------------------------------------------------------------------------------------

/// A new LATIN1 database `db` (created as `owner`'s, if given), with nothing in it.
fn latin1_database(pg: &Pg, db: &str, owner: Option<&str>) {
    let owner = owner.map(|o| format!("OWNER {o}")).unwrap_or_default();
    pg.connect()
        .batch_execute(&format!(
            "CREATE DATABASE {db} {owner} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        ))
        .unwrap();
}

/// How many bytes the name of the schema holding the extension takes in `db`.
fn extension_schema_bytes(pg: &Pg, db: &str) -> i32 {
    value_in(
        pg,
        db,
        "SELECT octet_length(n.nspname::text) FROM pg_namespace n \
         JOIN pg_extension e ON e.extnamespace = n.oid WHERE e.extname = 'outbox'",
    )
}

/// The server log, bytes that are not UTF-8 replaced: a LATIN1 database's backends may write
/// some.
fn log_text(pg: &Pg) -> String {
    String::from_utf8_lossy(&std::fs::read(pg.log_path()).unwrap_or_default()).into_owned()
}

/// Asserts that pgrx's conversion of text to a Rust string, which panics on bytes that are not
/// UTF-8, never ran into a name.
fn assert_no_utf8_panic(pg: &Pg) {
    let log = log_text(pg);
    assert!(
        !log.contains("should be valid UTF-8"),
        "a name was read as UTF-8:\n{log}"
    );
}

/// A schema's name is bytes in the database's encoding: `"ausgänge"` in a LATIN1 database holds
/// the byte 0xE4, which is not UTF-8. The worker read it into a Rust string and panicked on
/// every start; it must relay from that schema, prune there, and name it in UTF-8 in its log.
#[test]
fn a_latin1_schema_name_is_relayed_from() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "latin"),
            ("outbox.poll_interval", "100ms"),
            // The relay's pruning and emptying of partitions name the schema too.
            ("outbox.retention", "1s"),
        ],
    );
    latin1_database(&pg, "latin", None);
    // The client speaks UTF-8; the server converts.
    session(&pg, "latin")
        .batch_execute(r#"CREATE SCHEMA "ausgänge"; CREATE EXTENSION outbox SCHEMA "ausgänge""#)
        .unwrap();
    assert_eq!(
        extension_schema_bytes(&pg, "latin"),
        8,
        "precondition: the schema's name is stored in LATIN1"
    );
    pg.restart();
    pg.wait_for_workers(1);
    let pids = pg.worker_pids();

    let mut client = session(&pg, "latin");
    let ids: Vec<i64> = (0..3)
        .map(|n| {
            one(
                &mut client,
                &format!(r#"SELECT "ausgänge".outbox_enqueue('schemas', '{{"n": {n}}}')"#),
            )
        })
        .collect();
    assert_stream_fills(&redis, "schemas", 3);
    assert_eq!(redis.ids("schemas"), ids);
    // Published rows are pruned once they are older than the retention and its grace (10 s).
    assert!(
        wait_until(Duration::from_secs(60), || value_in::<i64>(
            &pg,
            "latin",
            r#"SELECT count(*) FROM "ausgänge".outbox"#
        ) == 0),
        "the published events were never pruned from the schema"
    );
    // Written once the worker's state changes, which may come after its first events.
    assert!(
        wait_until(Duration::from_secs(10), || log_text(&pg)
            .contains("relaying from schema \"ausgänge\"")),
        "the log does not name the schema in UTF-8:\n{}",
        log_text(&pg)
    );
    assert_no_utf8_panic(&pg);
    assert_no_crash(&pg, &pids);
}

/// The database owner owns `public` (PostgreSQL 15 on) and may rename it, the extension in it,
/// to a name that is not ASCII. The worker fails once on the statements it prepared under the
/// old name, and must then relay from the new one rather than panic on every start.
#[test]
fn a_database_owner_renaming_public_to_a_latin1_name_does_not_stop_the_relay() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "latin"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    pg.connect()
        .batch_execute("CREATE ROLE shopkeeper LOGIN")
        .unwrap();
    latin1_database(&pg, "latin", Some("shopkeeper"));
    session(&pg, "latin")
        .batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    pg.restart();
    pg.wait_for_workers(1);
    let before: i64 = one(
        &mut session(&pg, "latin"),
        "SELECT public.outbox_enqueue('renamed', '{}')",
    );
    assert_stream_fills(&redis, "renamed", 1);

    pg.connect_with("latin", "shopkeeper", SESSION_OPTIONS)
        .batch_execute(r#"ALTER SCHEMA public RENAME TO "öffentlich""#)
        .unwrap();
    assert_eq!(
        extension_schema_bytes(&pg, "latin"),
        10,
        "precondition: the new name is stored in LATIN1"
    );
    let after: i64 = one(
        &mut session(&pg, "latin"),
        r#"SELECT "öffentlich".outbox_enqueue('renamed', '{}')"#,
    );
    assert_stream_fills(&redis, "renamed", 2);
    assert_eq!(redis.ids("renamed"), [before, after]);
    // Written once the worker's state changes, which may come after its first events.
    assert!(
        wait_until(Duration::from_secs(10), || log_text(&pg)
            .contains("relaying from schema \"öffentlich\"")),
        "the log does not name the schema in UTF-8:\n{}",
        log_text(&pg)
    );
    assert_no_utf8_panic(&pg);
    assert_no_crash(&pg, &pg.worker_pids());
}

/// A database's name is bytes too: named from a LATIN1 session, `läden` is stored as
/// `l\xe4den`, and `outbox.database`, set from such a session, holds the same bytes. The check of
/// the setting refused what is not UTF-8 and the launcher compared names as lossy UTF-8; the
/// database must be selected and relayed, and `outbox_workers` must name it as
/// `current_database()` does.
#[test]
fn a_database_named_in_latin1_is_selected_and_relayed() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "postgres"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    latin1_database(&pg, "latin", None);
    latin1_database(&pg, "shop_template", None);
    // The relay never connects to the template (it could not be copied while anyone is).
    let id: i64 = {
        let mut template = session(&pg, "shop_template");
        template
            .batch_execute("CREATE EXTENSION outbox SCHEMA public")
            .unwrap();
        one(&mut template, "SELECT outbox_enqueue('shops', '{}')")
    };
    let mut latin = session(&pg, "latin");
    latin
        .batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    latin
        .batch_execute("CREATE DATABASE \"läden\" TEMPLATE shop_template")
        .unwrap();
    assert_eq!(
        one::<i32>(
            &mut latin,
            "SELECT octet_length(datname::text) FROM pg_database WHERE datname = 'läden'"
        ),
        5,
        "precondition: the database's name is stored in LATIN1"
    );
    latin
        .batch_execute("ALTER SYSTEM SET outbox.database = 'läden'")
        .unwrap_or_else(|e| panic!("outbox.database refused a LATIN1 name: {e:?}"));
    latin.batch_execute("SELECT pg_reload_conf()").unwrap();

    assert_stream_fills(&redis, "shops", 1);
    assert_eq!(redis.ids("shops"), [id]);
    let named: Vec<String> = latin
        .query(
            "SELECT database FROM outbox_workers WHERE pid IS NOT NULL",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(named, ["läden"], "outbox_workers names the database");
    assert_no_utf8_panic(&pg);
}

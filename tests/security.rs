//! Security: the relay runs as the bootstrap superuser in databases that others own. A database
//! owner who is not a superuser must not get it to run her code, through overloads planted in a
//! schema she owns or a search_path set on her database, nor break it with session defaults set
//! on the database; and a role granted only EXECUTE on the redrive functions can redrive, yet
//! not read the events. Against a real PostgreSQL and Redis.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::redis_keys::{poison, unpoison};
use common::sql::{one, query_in, session, value_in};
use common::{enqueue_many, sqlstate, wait_until, Client, Pg, Redis};

// ---------------------------------------------------------------------------------------------
// A hostile database owner: set-up
// ---------------------------------------------------------------------------------------------

/// `ids` as a SQL array literal.
fn id_array(ids: &[i64]) -> String {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("'{{{}}}'::bigint[]", list.join(","))
}

/// Functions mallory plants, as (name, argument types, result type, the real call): names the
/// relay's SQL could resolve through search_path. Where pg_catalog's function is polymorphic
/// (array_position, unnest, cardinality ...), an exact-typed one in any schema on the path
/// wins over it even behind pg_catalog; the others win when the path puts her schema first.
const TRAP_FUNCTIONS: &[(&str, &str, &str, &str)] = &[
    (
        "array_position",
        "bigint[], bigint",
        "integer",
        "pg_catalog.array_position($1, $2)",
    ),
    (
        "array_position",
        "text[], text",
        "integer",
        "pg_catalog.array_position($1, $2)",
    ),
    (
        "array_length",
        "bigint[], integer",
        "integer",
        "pg_catalog.array_length($1, $2)",
    ),
    (
        "cardinality",
        "bigint[]",
        "integer",
        "pg_catalog.cardinality($1)",
    ),
    (
        "array_append",
        "bigint[], bigint",
        "bigint[]",
        "pg_catalog.array_append($1, $2)",
    ),
    (
        "array_to_string",
        "text[], text",
        "text",
        "pg_catalog.array_to_string($1, $2)",
    ),
    (
        "unnest",
        "bigint[]",
        "SETOF bigint",
        "pg_catalog.unnest($1)",
    ),
    ("unnest", "text[]", "SETOF text", "pg_catalog.unnest($1)"),
    ("to_jsonb", "text", "jsonb", "pg_catalog.to_jsonb($1)"),
    ("now", "", "timestamptz", "pg_catalog.now()"),
    (
        "clock_timestamp",
        "",
        "timestamptz",
        "pg_catalog.clock_timestamp()",
    ),
    (
        "statement_timestamp",
        "",
        "timestamptz",
        "pg_catalog.statement_timestamp()",
    ),
    ("length", "text", "integer", "pg_catalog.length($1)"),
    (
        "octet_length",
        "text",
        "integer",
        "pg_catalog.octet_length($1)",
    ),
    (
        "convert_to",
        "text, name",
        "bytea",
        "pg_catalog.convert_to($1, $2)",
    ),
    (
        "convert_from",
        "bytea, name",
        "text",
        "pg_catalog.convert_from($1, $2)",
    ),
    (
        "to_char",
        "timestamptz, text",
        "text",
        "pg_catalog.to_char($1, $2)",
    ),
    (
        "timezone",
        "text, timestamptz",
        "timestamp",
        "pg_catalog.timezone($1, $2)",
    ),
    (
        "date_part",
        "text, timestamptz",
        "double precision",
        "pg_catalog.date_part($1, $2)",
    ),
    // Named, with defaults, as pg_catalog's: a call like make_interval(secs => x) finds it.
    (
        "make_interval",
        "years integer DEFAULT 0, months integer DEFAULT 0, weeks integer DEFAULT 0, \
         days integer DEFAULT 0, hours integer DEFAULT 0, mins integer DEFAULT 0, \
         secs double precision DEFAULT 0",
        "interval",
        "pg_catalog.make_interval($1, $2, $3, $4, $5, $6, $7)",
    ),
    (
        "set_config",
        "text, text, boolean",
        "text",
        "pg_catalog.set_config($1, $2, $3)",
    ),
];

/// Operators mallory plants, as (operator, left type, right type, result type).
const TRAP_OPERATORS: &[(&str, &str, &str, &str)] = &[
    ("=", "bigint", "bigint", "boolean"),
    ("<>", "bigint", "bigint", "boolean"),
    ("<", "bigint", "bigint", "boolean"),
    ("<=", "bigint", "bigint", "boolean"),
    (">=", "bigint", "bigint", "boolean"),
    ("<", "timestamptz", "timestamptz", "boolean"),
    ("<=", "timestamptz", "timestamptz", "boolean"),
    (">=", "timestamptz", "timestamptz", "boolean"),
    ("+", "integer", "integer", "integer"),
    ("+", "timestamptz", "interval", "timestamptz"),
    ("-", "timestamptz", "interval", "timestamptz"),
    ("*", "double precision", "interval", "interval"),
    ("=", "text", "text", "boolean"),
    ("||", "text", "text", "text"),
];

/// A cluster whose relay works in database `app`, owned by `mallory`, a role that is not a
/// superuser; a superuser created the extension there (in `public`, which the database owner
/// owns). Rejected events stay pending (100 attempts), and a 1 s retention makes the relay's
/// pruning statements run during the test too.
fn hostile_owner(redis: &Redis) -> Pg {
    let pg = Pg::relaying_to(
        redis,
        &[
            ("outbox.database", "app"),
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "100"),
            ("outbox.retention", "1s"),
        ],
    );
    let mut admin = pg.connect();
    admin.batch_execute("CREATE ROLE mallory LOGIN").unwrap();
    admin
        .batch_execute("CREATE DATABASE app OWNER mallory")
        .unwrap();
    session(&pg, "app")
        .batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    pg
}

/// As mallory, plants in `schema` of database `app` a function, operator or aggregate of each
/// name the relay might call. Each one, called by a superuser, notes its name in
/// `<schema>.trap_log` and makes mallory a superuser, then does the real job, so that nothing
/// visible goes wrong.
fn plant_traps(pg: &Pg, schema: &str) {
    let s = schema;
    let spring = |label: &str| {
        format!(
            "INSERT INTO {s}.trap_log VALUES ('{label}'); EXECUTE 'ALTER ROLE mallory SUPERUSER';"
        )
    };
    let mut sql = format!("CREATE TABLE {s}.trap_log (fired text);\n");
    for (name, args, result, real) in TRAP_FUNCTIONS {
        let give = if result.starts_with("SETOF ") {
            format!("RETURN QUERY SELECT {real};")
        } else {
            format!("RETURN {real};")
        };
        sql.push_str(&format!(
            "CREATE FUNCTION {s}.{name}({args}) RETURNS {result} LANGUAGE plpgsql \
             AS $trap$ BEGIN {} {give} END $trap$;\n",
            spring(&format!("{name}({args})"))
        ));
    }
    for (n, (op, left, right, result)) in TRAP_OPERATORS.iter().enumerate() {
        sql.push_str(&format!(
            "CREATE FUNCTION {s}.trap_operator_{n}(a {left}, b {right}) RETURNS {result} \
             LANGUAGE plpgsql AS $trap$ BEGIN {} RETURN a OPERATOR(pg_catalog.{op}) b; END $trap$;\n\
             CREATE OPERATOR {s}.{op} (LEFTARG = {left}, RIGHTARG = {right}, \
             FUNCTION = {s}.trap_operator_{n});\n",
            spring(&format!("operator {left} {op} {right}"))
        ));
    }
    sql.push_str(&format!(
        "CREATE FUNCTION {s}.trap_count(bigint) RETURNS bigint LANGUAGE plpgsql \
         AS $trap$ BEGIN {} RETURN $1 OPERATOR(pg_catalog.+) 1; END $trap$;\n\
         CREATE AGGREGATE {s}.count(*) (SFUNC = {s}.trap_count, STYPE = bigint, INITCOND = '0');\n\
         CREATE FUNCTION {s}.trap_min(bigint, bigint) RETURNS bigint LANGUAGE plpgsql \
         AS $trap$ BEGIN {} RETURN LEAST($1, $2); END $trap$;\n\
         CREATE AGGREGATE {s}.min(bigint) (SFUNC = {s}.trap_min, STYPE = bigint);\n\
         CREATE FUNCTION {s}.trap_max(bigint, bigint) RETURNS bigint LANGUAGE plpgsql \
         AS $trap$ BEGIN {} RETURN GREATEST($1, $2); END $trap$;\n\
         CREATE AGGREGATE {s}.max(bigint) (SFUNC = {s}.trap_max, STYPE = bigint);\n",
        spring("count(*)"),
        spring("min(bigint)"),
        spring("max(bigint)"),
    ));
    pg.connect_as("app", "mallory")
        .batch_execute(&sql)
        .unwrap_or_else(|e| panic!("mallory could not plant her functions: {e:?}"));
}

fn mallory_is_superuser(pg: &Pg) -> bool {
    one(
        &mut pg.connect(),
        "SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'",
    )
}

/// The test only means something if the traps work: a superuser session of `app` with the
/// database's own defaults that runs `sql` (a call naming no schema) makes mallory a
/// superuser. Rolled back.
fn assert_traps_spring(pg: &Pg, sql: &str) {
    let mut victim = pg.connect_to("app");
    let mut tx = victim.transaction().unwrap();
    tx.batch_execute(sql).unwrap();
    let escalated: bool = tx
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        escalated,
        "precondition: a superuser running {sql} in app makes mallory a superuser"
    );
    tx.rollback().unwrap();
    assert!(!mallory_is_superuser(pg), "the rollback undid it");
}

/// Enqueues (in `app`) an event on a poisoned stream and three healthy ones, and waits until the
/// relay has run each of its paths there: the healthy events published and marked, the
/// rejected one charged an attempt, and the published rows pruned. The test's statements call
/// none of the planted names, and name the extension's objects with their schema.
fn relay_in_app_through_every_path(pg: &Pg, redis: &Redis) {
    poison(redis, "bad");
    let mut app = session(pg, "app");
    let bad: i64 = one(
        &mut app,
        "SELECT public.outbox_enqueue('bad', '{\"n\": 0}')",
    );
    let good: Vec<i64> = (1..=3)
        .map(|n| {
            app.query_one(
                "SELECT public.outbox_enqueue('good', $1::text::jsonb)",
                &[&format!("{{\"n\": {n}}}")],
            )
            .unwrap()
            .get(0)
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(30), || redis.xlen("good") == 3),
        "the healthy events were not published"
    );
    assert_eq!(redis.ids("good"), good);
    let unmarked = format!(
        "SELECT count(*) FROM public.outbox WHERE id = ANY({}) AND published_at IS NULL",
        id_array(&good)
    );
    assert!(
        wait_until(Duration::from_secs(30), || value_in::<i64>(
            pg, "app", &unmarked
        ) == 0),
        "the healthy events were not marked published"
    );
    let charged = format!("SELECT attempts FROM public.outbox WHERE id = {bad}");
    assert!(
        wait_until(Duration::from_secs(30), || value_in::<i32>(
            pg, "app", &charged
        ) >= 1),
        "the rejected event was never charged an attempt"
    );
    let kept = format!(
        "SELECT count(*) FROM public.outbox WHERE id = ANY({})",
        id_array(&good)
    );
    assert!(
        wait_until(Duration::from_secs(30), || value_in::<i64>(
            pg, "app", &kept
        ) == 0),
        "the published events were never pruned (retention 1s)"
    );
}

/// Mallory is not a superuser, and none of her functions ran.
fn assert_mallory_gained_nothing(pg: &Pg, schema: &str) {
    let fired: Vec<String> = query_in(pg, "app", &format!("SELECT fired FROM {schema}.trap_log"))
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        !mallory_is_superuser(pg),
        "mallory became a superuser: the relay ran her {fired:?}"
    );
    assert!(fired.is_empty(), "the relay ran mallory's {fired:?}");
}

// ---------------------------------------------------------------------------------------------
// A hostile database owner
// ---------------------------------------------------------------------------------------------

/// The relay runs as the bootstrap superuser inside a database whose owner may be anyone. An
/// owner who is not a superuser must not get it to run her code: here she plants, in the
/// `public` schema she owns, exact-typed overloads that beat pg_catalog's polymorphic functions
/// (the relay's failure statement used to call `array_position(bigint[], bigint)` unqualified,
/// so the first rejected event made her a superuser).
#[test]
fn a_database_owner_cannot_hijack_the_relay_with_overloads() {
    let redis = Redis::start();
    let pg = hostile_owner(&redis);
    plant_traps(&pg, "public");
    assert_traps_spring(
        &pg,
        "SELECT array_position(ARRAY[1, 2]::bigint[], 2::bigint)",
    );
    // The worker connects, and prepares its statements, with the overloads in place.
    pg.restart();
    pg.wait_for_workers(1);
    relay_in_app_through_every_path(&pg, &redis);
    assert_mallory_gained_nothing(&pg, "public");
}

/// The same owner sets her database's search_path to put her schema before pg_catalog, with
/// functions, operators and aggregates of the names the relay calls in it: a relay that took
/// the database's search_path would run them (`now()` in its first mark) as a superuser.
#[test]
fn a_database_owner_cannot_hijack_the_relay_through_search_path() {
    let redis = Redis::start();
    let pg = hostile_owner(&redis);
    pg.connect_as("app", "mallory")
        .batch_execute("CREATE SCHEMA evil")
        .unwrap();
    plant_traps(&pg, "evil");
    pg.connect_as("app", "mallory")
        .batch_execute("ALTER DATABASE app SET search_path = evil, pg_catalog")
        .unwrap();
    let path: String = one(&mut pg.connect_as("app", "mallory"), "SHOW search_path");
    assert_eq!(
        path, "evil, pg_catalog",
        "precondition: the database default"
    );
    assert_traps_spring(&pg, "SELECT now()");
    // The worker connects again, with the database's new defaults.
    pg.restart();
    pg.wait_for_workers(1);
    relay_in_app_through_every_path(&pg, &redis);
    assert_mallory_gained_nothing(&pg, "evil");
}

// ---------------------------------------------------------------------------------------------
// Session defaults inherited from the database
// ---------------------------------------------------------------------------------------------

/// Settings made with `ALTER DATABASE ... SET` apply to every new session of the database,
/// the relay's included unless it pins its own: serializable transactions can make its workers
/// fail on each other, read-only ones make every mark fail, and 1 ms timeouts cancel its
/// statements. Four workers drain 20,000 events with all of these set on their database.
#[test]
fn database_defaults_do_not_reach_the_relay() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.database", "app"),
            ("outbox.workers", "4"),
            ("outbox.batch_size", "100"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    // A database of its own, so that the harness's sessions (in postgres) keep plain defaults;
    // the test's own sessions in app override them at connection start.
    let mut admin = pg.connect();
    admin.batch_execute("CREATE DATABASE app").unwrap();
    session(&pg, "app")
        .batch_execute("CREATE EXTENSION outbox SCHEMA public")
        .unwrap();
    admin
        .batch_execute(
            "ALTER DATABASE app SET default_transaction_isolation = 'serializable';
             ALTER DATABASE app SET default_transaction_read_only = on;
             ALTER DATABASE app SET statement_timeout = '1ms';
             ALTER DATABASE app SET lock_timeout = '1ms';
             ALTER DATABASE app SET idle_in_transaction_session_timeout = '1ms';",
        )
        .unwrap();
    let defaults: Vec<String> = one(
        &mut admin,
        "SELECT setconfig FROM pg_db_role_setting s JOIN pg_database d ON d.oid = s.setdatabase \
         WHERE d.datname = 'app' AND s.setrole = 0",
    );
    assert_eq!(defaults.len(), 5, "precondition: {defaults:?}");
    drop(admin);
    // The workers connect again, with the database's new defaults.
    pg.restart();
    pg.wait_for_workers(4);
    let pids = pg.worker_pids();

    let mut app = session(&pg, "app");
    let mut expected = BTreeSet::new();
    for _ in 0..4 {
        expected.extend(enqueue_many(&mut app, "burst", 5_000));
    }
    let started = Instant::now();
    assert!(
        wait_until(Duration::from_secs(120), || value_in::<i64>(
            &pg,
            "app",
            "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        ) == 0),
        "the backlog was not drained"
    );
    println!(
        "4 workers drained 20000 events under hostile defaults in {:?}",
        started.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    let ids = redis.ids("burst");
    let unique: BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(unique, expected, "every event reaches its stream");
    assert_eq!(ids.len(), expected.len(), "an event was published twice");
    assert_eq!(pg.worker_pids(), pids, "a worker exited and was restarted");
    let log = pg.log();
    for symptom in [
        "could not serialize",
        "read-only transaction",
        "canceling statement due to statement timeout",
        "canceling statement due to lock timeout",
        "idle-in-transaction timeout",
    ] {
        assert!(!log.contains(symptom), "the server log says {symptom:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// A redrive by a role granted only EXECUTE
// ---------------------------------------------------------------------------------------------

/// The README says redriving is for whoever the table owner grants EXECUTE to: such a role must
/// be able to redrive (the functions used to run with its own rights, which reach neither
/// table), and still not read the events.
#[test]
fn a_role_granted_only_execute_can_redrive() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.max_attempts", "1"),
            ("outbox.poll_interval", "100ms"),
        ],
    );
    let mut admin = pg.with_extension();
    pg.wait_for_workers(1);
    admin
        .batch_execute(
            "CREATE ROLE ops LOGIN; \
             GRANT EXECUTE ON FUNCTION outbox_redrive(bigint), outbox_redrive_all() TO ops",
        )
        .unwrap();
    poison(&redis, "bad");
    let dead = enqueue_many(&mut admin, "bad", 2);
    assert!(
        wait_until(Duration::from_secs(30), || one::<i64>(
            &mut pg.connect(),
            "SELECT count(*) FROM outbox_dead"
        ) == 2),
        "the bad events never reached outbox_dead"
    );
    unpoison(&redis, "bad");

    let mut ops = pg.connect_as("postgres", "ops");
    let back: bool = ops
        .query_one("SELECT outbox_redrive($1)", &[&dead[0]])
        .unwrap_or_else(|e| panic!("ops could not redrive: {e:?}"))
        .get(0);
    assert!(back);
    let rest: i64 = ops
        .query_one("SELECT outbox_redrive_all()", &[])
        .unwrap_or_else(|e| panic!("ops could not redrive all: {e:?}"))
        .get(0);
    assert_eq!(rest, 1);
    let returned: i64 = admin
        .query_one("SELECT count(*) FROM outbox WHERE id = ANY($1)", &[&dead])
        .unwrap()
        .get(0);
    assert_eq!(returned, 2, "both events are back in outbox");
    assert_eq!(
        one::<i64>(&mut admin, "SELECT count(*) FROM outbox_dead"),
        0
    );
    assert!(
        wait_until(Duration::from_secs(20), || redis.xlen("bad") == 2),
        "the redriven events were not published"
    );
    assert_eq!(redis.ids("bad"), dead);

    for table in ["outbox", "outbox_dead"] {
        let error = ops
            .batch_execute(&format!("SELECT * FROM {table}"))
            .unwrap_err();
        assert_eq!(sqlstate(&error), "42501", "ops reads {table}: {error:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// What outbox_enqueue fires runs as its caller
// ---------------------------------------------------------------------------------------------

/// A server with the extension, no relay, and `app`: a role granted EXECUTE on
/// `outbox_enqueue` and, as every role is by default, TEMP on the database. `admin` is the
/// superuser's session, which sets up what a DBA adds to the tables.
fn caller_and_admin() -> (Pg, Client) {
    let pg = common::server();
    let mut admin = pg.with_extension();
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN; \
             GRANT EXECUTE ON FUNCTION outbox_enqueue(text, jsonb, text, jsonb, interval) TO app",
        )
        .unwrap();
    (pg, admin)
}

/// `app`'s own objects, each of which runs `ALTER ROLE app SUPERUSER` when used: a temporary
/// table whose insert trigger does, and a temporary view that calls a function that does. An
/// unqualified name finds a temporary table or view before any schema's.
const SEIZE: &str = "\
    CREATE FUNCTION pg_temp.seize() RETURNS text LANGUAGE plpgsql AS \
        $$BEGIN ALTER ROLE app SUPERUSER; RETURN 'seized'; END$$; \
    CREATE FUNCTION pg_temp.seize_row() RETURNS trigger LANGUAGE plpgsql AS \
        $$BEGIN PERFORM pg_temp.seize(); RETURN NEW; END$$;";

fn app_is_superuser(admin: &mut Client) -> bool {
    one(admin, "SELECT rolsuper FROM pg_roles WHERE rolname = 'app'")
}

/// The escalation a DBA's everyday audit trigger opened: its unqualified `outbox_audit` found
/// `app`'s temporary table first, whose trigger ran with the extension owner's rights. Now the
/// trigger runs as the caller, as it does for the caller's own INSERT: it needs the caller's
/// privileges, records the caller as current_user, and what it reaches of the caller's runs
/// with the caller's rights only, on both ways in (`outbox` and, delayed, `outbox_delayed`).
#[test]
fn a_trigger_on_outbox_runs_as_the_caller_of_outbox_enqueue() {
    let (pg, mut admin) = caller_and_admin();
    admin
        .batch_execute(
            "CREATE TABLE public.outbox_audit (id bigint, by_role text); \
             CREATE FUNCTION public.audit_outbox() RETURNS trigger LANGUAGE plpgsql AS \
                 $$BEGIN INSERT INTO outbox_audit VALUES (NEW.id, current_user); RETURN NEW; END$$; \
             CREATE TRIGGER audit AFTER INSERT ON outbox \
                 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox(); \
             CREATE TRIGGER audit AFTER INSERT ON outbox_delayed \
                 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox()",
        )
        .unwrap();
    let calls = [
        "SELECT outbox_enqueue('audited', '{}')",
        "SELECT outbox_enqueue('audited', '{}', deliver_after => '1 hour')",
    ];

    let mut app = pg.connect_as("postgres", "app");
    for call in calls {
        let error = app.batch_execute(call).unwrap_err();
        assert_eq!(
            sqlstate(&error),
            "42501",
            "{call}: the trigger ran with more than the caller's rights: {error:?}"
        );
    }
    admin
        .batch_execute("GRANT INSERT ON public.outbox_audit TO app")
        .unwrap();
    for call in calls {
        app.batch_execute(call)
            .unwrap_or_else(|e| panic!("{call}: {e:?}"));
    }
    let audited: Vec<(i64, String)> = admin
        .query(
            "SELECT id, by_role FROM public.outbox_audit ORDER BY id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(audited.len(), 2, "{audited:?}");
    assert!(audited.iter().all(|(_, by)| by == "app"), "{audited:?}");

    app.batch_execute(&format!(
        "{SEIZE} CREATE TEMP TABLE outbox_audit (id bigint, by_role text); \
         CREATE TRIGGER seize BEFORE INSERT ON pg_temp.outbox_audit \
             FOR EACH ROW EXECUTE FUNCTION pg_temp.seize_row()"
    ))
    .unwrap();
    for call in calls {
        let error = app.batch_execute(call).unwrap_err();
        assert_eq!(sqlstate(&error), "42501", "{call}: {error:?}");
        assert!(!app_is_superuser(&mut admin), "{call} made app a superuser");
    }
    assert_eq!(
        one::<i64>(
            &mut admin,
            "SELECT (SELECT count(*) FROM outbox) + (SELECT count(*) FROM outbox_delayed)"
        ),
        2,
        "a failed call wrote an event"
    );
}

/// The same through a CHECK constraint whose function reads a table by an unqualified name:
/// `app`'s temporary view of that name is found first, and its function runs as `app`.
#[test]
fn a_check_constraint_on_outbox_runs_as_the_caller_of_outbox_enqueue() {
    let (pg, mut admin) = caller_and_admin();
    admin
        .batch_execute(
            "CREATE TABLE public.banned_topics (topic text); \
             GRANT SELECT ON public.banned_topics TO app; \
             CREATE FUNCTION public.topic_allowed(t text) RETURNS boolean LANGUAGE plpgsql AS \
                 $$BEGIN RETURN NOT EXISTS (SELECT 1 FROM banned_topics b WHERE b.topic = t); END$$; \
             ALTER TABLE outbox ADD CONSTRAINT topic_allowed CHECK (public.topic_allowed(topic))",
        )
        .unwrap();
    let mut app = pg.connect_as("postgres", "app");
    app.batch_execute("SELECT outbox_enqueue('checked', '{}')")
        .unwrap();

    seize_through_a_view(&mut app, &mut admin, "banned_topics", "topic", "checked");
}

/// `app` puts a temporary view named `view` (of one column, `column`), which runs `ALTER ROLE
/// app SUPERUSER` when read, where an unqualified name in what `outbox_enqueue` fires finds it
/// first: the call fails as `app` may not alter roles, `app` stays what it was, and nothing is
/// written.
fn seize_through_a_view(
    app: &mut Client,
    admin: &mut Client,
    view: &str,
    column: &str,
    topic: &str,
) {
    let before = one::<i64>(admin, "SELECT count(*) FROM outbox");
    app.batch_execute(&format!(
        "{SEIZE} CREATE TEMP VIEW {view} AS SELECT pg_temp.seize() AS {column}"
    ))
    .unwrap();
    let error = app
        .batch_execute(&format!("SELECT outbox_enqueue('{topic}', '{{}}')"))
        .unwrap_err();
    assert_eq!(sqlstate(&error), "42501", "{error:?}");
    assert!(!app_is_superuser(admin), "{view} made app a superuser");
    assert_eq!(one::<i64>(admin, "SELECT count(*) FROM outbox"), before);
}

/// The same through a column default added by hand (which sends the row through an `INSERT`
/// statement instead of the executor's single-row insert): the default's function runs as the
/// caller, and gives the row its value.
#[test]
fn a_column_default_on_outbox_runs_as_the_caller_of_outbox_enqueue() {
    let (pg, mut admin) = caller_and_admin();
    admin
        .batch_execute(
            "CREATE TABLE public.sources (name text); \
             INSERT INTO public.sources VALUES ('billing'); \
             GRANT SELECT ON public.sources TO app; \
             CREATE FUNCTION public.current_source() RETURNS text LANGUAGE plpgsql AS \
                 $$BEGIN RETURN (SELECT name FROM sources LIMIT 1); END$$; \
             ALTER TABLE outbox ADD COLUMN source text DEFAULT public.current_source()",
        )
        .unwrap();
    let mut app = pg.connect_as("postgres", "app");
    let id: i64 = one(&mut app, "SELECT outbox_enqueue('sourced', '{}')");
    let source: String = admin
        .query_one("SELECT source FROM outbox WHERE id = $1", &[&id])
        .unwrap()
        .get(0);
    assert_eq!(source, "billing");

    seize_through_a_view(&mut app, &mut admin, "sources", "name", "sourced");
}

/// The redrive functions run as their owner, so what their insert into `outbox` fires does
/// too: a DBA's trigger with an unqualified name would find the caller's temporary table. They
/// refuse a session whose temporary schema holds anything, and redrive once it is empty.
#[test]
fn a_redrive_refuses_a_session_with_temporary_objects() {
    let (pg, mut admin) = caller_and_admin();
    admin
        .batch_execute(
            "CREATE ROLE ops LOGIN; \
             GRANT EXECUTE ON FUNCTION outbox_redrive(bigint), outbox_redrive_all() TO ops; \
             CREATE TABLE public.outbox_audit (id bigint, by_role text); \
             CREATE FUNCTION public.audit_outbox() RETURNS trigger LANGUAGE plpgsql AS \
                 $$BEGIN INSERT INTO outbox_audit VALUES (NEW.id, current_user); RETURN NEW; END$$; \
             CREATE TRIGGER audit AFTER INSERT ON outbox \
                 FOR EACH ROW EXECUTE FUNCTION public.audit_outbox(); \
             INSERT INTO outbox_dead (id, topic, payload, created_at, attempts, last_error) \
                 SELECT nextval('outbox_id_seq'), 'dead', '{}', now(), 1, 'rejected' \
                 FROM generate_series(1, 2)",
        )
        .unwrap();
    let dead: Vec<i64> = admin
        .query("SELECT id FROM outbox_dead ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();

    let mut ops = pg.connect_as("postgres", "ops");
    ops.batch_execute(&format!(
        "{} CREATE TEMP TABLE outbox_audit (id bigint, by_role text); \
         CREATE TRIGGER seize BEFORE INSERT ON pg_temp.outbox_audit \
             FOR EACH ROW EXECUTE FUNCTION pg_temp.seize_row()",
        SEIZE.replace("ALTER ROLE app", "ALTER ROLE ops")
    ))
    .unwrap();
    for call in [
        format!("SELECT outbox_redrive({})", dead[0]),
        "SELECT outbox_redrive_all()".to_string(),
    ] {
        let error = ops.batch_execute(&call).unwrap_err();
        assert_eq!(sqlstate(&error), "55000", "{call}: {error:?}");
        assert!(
            !one::<bool>(
                &mut admin,
                "SELECT rolsuper FROM pg_roles WHERE rolname = 'ops'"
            ),
            "{call} made ops a superuser"
        );
    }
    assert_eq!(
        one::<i64>(&mut admin, "SELECT count(*) FROM outbox_dead"),
        2
    );

    // With the trigger's table named with its schema, a session without temporary objects
    // redrives.
    admin
        .batch_execute(
            "CREATE OR REPLACE FUNCTION public.audit_outbox() RETURNS trigger LANGUAGE plpgsql AS \
                 $$BEGIN INSERT INTO public.outbox_audit VALUES (NEW.id, current_user); RETURN NEW; END$$",
        )
        .unwrap();
    ops.batch_execute("DISCARD TEMP").unwrap();
    assert_eq!(one::<i64>(&mut ops, "SELECT outbox_redrive_all()"), 2);
    assert_eq!(
        one::<i64>(&mut admin, "SELECT count(*) FROM public.outbox_audit"),
        2
    );
}

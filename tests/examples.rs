//! The examples in examples/, run against real servers with their own clients: Python's asyncpg
//! and redis-py (python-asyncio), SQLAlchemy with psycopg (sqlalchemy, consumed by
//! python-asyncio's consumer), Node's pg and node-redis (node). Each producer creates 1,000
//! accounts through its own write, in two runs; the consumer applies the first run's events,
//! is caught inside a batch of the second's (a lock held by the test on its effect's table) and
//! killed with SIGKILL, and a consumer under a new name takes the dead one's pending entries over
//! with XAUTOCLAIM and applies the rest. A copy of an applied event, left pending at a consumer
//! as if it had died holding it, is finished by that consumer when it starts again under its
//! name, and skipped. Every event is applied exactly once and nothing is left pending.
//!
//! The clients are installed on first use, into the repository only: Python's into virtual
//! environments under target/examples/, Node's into examples/node/node_modules (`npm ci`). That
//! needs PyPI and the npm registry; without them the test fails and says so.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::Duration;

use common::printing::Printing;
use common::sql::count;
use common::{repository, wait_until, Pg, Redis};
use redis::Value;

const STREAM: &str = "account.created";
const GROUP: &str = "welcome";
/// The consumers' database, beside the producers' (`postgres`, where the extension is).
const CONSUMER_DB: &str = "welcome";
/// Accounts created by the producer's first run, all applied before the kill; then the rest.
const FIRST: i64 = 300;
const ACCOUNTS: i64 = 1_000;
/// Entries per batch: the dead consumer leaves at most this many pending.
const COUNT: &str = "20";
/// How long anything the test waits for may take, on a busy machine.
const PATIENCE: Duration = Duration::from_secs(120);

#[test]
fn python_asyncio_creates_accounts_and_applies_each_event_once() {
    let python = python_venv("python-asyncio");
    let dir = examples().join("python-asyncio");
    let servers = Servers::start();
    let produce = |n: i64| {
        let mut cmd = Command::new(&python);
        cmd.arg(dir.join("producer.py"))
            .arg(n.to_string())
            .env("DATABASE_URL", servers.app_url("postgresql"));
        cmd
    };
    let consumer = |name: &str, min_idle_ms: u64| {
        let mut cmd = Command::new(&python);
        cmd.arg(dir.join("consumer.py"));
        servers.consumer_env(&mut cmd, name, min_idle_ms);
        cmd
    };
    servers.produce_and_consume(&produce, &consumer);
}

#[test]
fn sqlalchemy_writes_events_with_key_and_headers_that_are_applied_once() {
    let python = python_venv("sqlalchemy");
    let consumer_python = python_venv("python-asyncio");
    let dir = examples().join("sqlalchemy");
    // Django is not installed: its snippet is only parsed.
    run(Command::new(&python)
        .args(["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read())"])
        .arg(dir.join("django_snippet.py")));
    let servers = Servers::start();
    let produce = |n: i64| {
        let mut cmd = Command::new(&python);
        cmd.arg(dir.join("producer.py"))
            .arg(n.to_string())
            .env("DATABASE_URL", servers.app_url("postgresql+psycopg"));
        cmd
    };
    let consumer = |name: &str, min_idle_ms: u64| {
        let mut cmd = Command::new(&consumer_python);
        cmd.arg(examples().join("python-asyncio/consumer.py"));
        servers.consumer_env(&mut cmd, name, min_idle_ms);
        cmd
    };
    servers.produce_and_consume(&produce, &consumer);

    // Each entry has its account's key, and headers that are a JSON object of one W3C
    // traceparent (the payload an object too, not a JSON string).
    let entries = servers.redis.entries(STREAM);
    assert_eq!(entries.len(), ACCOUNTS as usize + 1);
    let mut traces = BTreeSet::new();
    for (entry_id, fields) in &entries {
        let payload: serde_json::Value = serde_json::from_str(&fields["payload"]).unwrap();
        let account_id = payload["account_id"].as_i64().expect("no account_id");
        assert_eq!(
            fields.get("key").map(String::as_str),
            Some(format!("account-{account_id}").as_str()),
            "{entry_id}: {fields:?}"
        );
        let headers: serde_json::Value =
            serde_json::from_str(fields.get("headers").expect("no headers")).unwrap();
        let headers = headers.as_object().expect("headers are not an object");
        let traceparent = headers["traceparent"].as_str().expect("not a string");
        assert_eq!(headers.len(), 1, "{headers:?}");
        let parts: Vec<&str> = traceparent.split('-').collect();
        assert!(
            parts.len() == 4 && parts[1].len() == 32 && parts[2].len() == 16,
            "{traceparent}"
        );
        traces.insert(traceparent.to_string());
    }
    // The copy of an applied event repeats its traceparent.
    assert_eq!(traces.len(), ACCOUNTS as usize);
}

#[test]
fn node_creates_accounts_and_applies_each_event_once() {
    npm_ci("node");
    let dir = examples().join("node");
    let servers = Servers::start();
    let produce = |n: i64| {
        let mut cmd = Command::new("node");
        cmd.arg(dir.join("producer.js"))
            .arg(n.to_string())
            .env("DATABASE_URL", servers.app_url("postgresql"));
        cmd
    };
    let consumer = |name: &str, min_idle_ms: u64| {
        let mut cmd = Command::new("node");
        cmd.arg(dir.join("consumer.js"));
        servers.consumer_env(&mut cmd, name, min_idle_ms);
        cmd
    };
    servers.produce_and_consume(&produce, &consumer);
}

/// A Redis and a PostgreSQL relaying to it, with the consumers' database.
struct Servers {
    redis: Redis,
    pg: Pg,
}

impl Servers {
    fn start() -> Servers {
        let redis = Redis::start();
        let pg = Pg::relaying_to(&redis, &[]);
        pg.with_extension()
            .batch_execute(&format!("CREATE DATABASE {CONSUMER_DB}"))
            .unwrap();
        Servers { redis, pg }
    }

    /// The producers' database (`postgres`) as a URL of `scheme`.
    fn app_url(&self, scheme: &str) -> String {
        format!("{scheme}://postgres@127.0.0.1:{}/postgres", self.pg.port)
    }

    fn consumer_env(&self, cmd: &mut Command, name: &str, min_idle_ms: u64) {
        let db = format!(
            "postgresql://postgres@127.0.0.1:{}/{CONSUMER_DB}",
            self.pg.port
        );
        cmd.env("DATABASE_URL", db)
            .env("REDIS_URL", self.redis.url())
            .env("STREAM", STREAM)
            .env("GROUP", GROUP)
            .env("CONSUMER", name)
            .env("COUNT", COUNT)
            .env("BLOCK_MS", "200")
            .env("MIN_IDLE_MS", min_idle_ms.to_string())
            .env("CLAIM_EVERY_MS", "200");
    }

    /// `produce(n)` creates n accounts; `consumer(name, min_idle_ms)` starts the consumer.
    fn produce_and_consume(
        &self,
        produce: &dyn Fn(i64) -> Command,
        consumer: &dyn Fn(&str, u64) -> Command,
    ) {
        let redis = &self.redis;
        let mut app = self.pg.connect();
        let mut store = self.pg.connect_to(CONSUMER_DB);
        let processed =
            |store: &mut common::Client| count(store, "SELECT count(*) FROM processed_events");

        run(&mut produce(FIRST));
        self.wait_for_stream(FIRST);
        let mut first = Run::start(consumer("c1", 60_000), "c1");
        // A batch's line is printed once it is committed and acknowledged.
        first.wait_for("c1 applying the first accounts' events", |lines| {
            total(lines, "*", "applied") >= FIRST as usize
        });
        assert_eq!(processed(&mut store), FIRST);
        assert_eq!(pending_at(redis, "*"), 0);

        // The effect's table locked: c1 reads the next batch, and waits inside its transaction.
        let mut locker = self.pg.connect_to(CONSUMER_DB);
        locker
            .batch_execute("BEGIN; LOCK TABLE welcome_emails IN SHARE MODE")
            .unwrap();
        run(&mut produce(ACCOUNTS - FIRST));
        self.wait_for_stream(ACCOUNTS);
        first.wait_for("c1 waiting for the lock inside a batch", |_| {
            count(
                &mut app,
                &format!(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE datname = '{CONSUMER_DB}' AND wait_event_type = 'Lock'"
                ),
            ) == 1
        });
        let first_lines = first.kill();
        locker.batch_execute("ROLLBACK").unwrap();
        let left = pending_at(redis, "c1");
        assert!(left > 0, "c1 left nothing pending: {first_lines:?}");
        assert_eq!(processed(&mut store), FIRST);
        eprintln!("c1 killed with {FIRST} events applied and {left} entries pending at it");

        // A consumer under a new name: only XAUTOCLAIM gives it c1's entries.
        let mut second = Run::start(consumer("c2", 500), "c2");
        second.wait_for("c2 applying every event", |lines| {
            total(lines, "*", "applied") >= (ACCOUNTS - FIRST) as usize
                && pending_at(redis, "*") == 0
        });
        let second_lines = second.kill();
        assert_eq!(total(&second_lines, "claimed", "entries"), left);
        let lines = [first_lines, second_lines].concat();
        assert_eq!(
            total(&lines, "*", "applied"),
            ACCOUNTS as usize,
            "{lines:?}"
        );
        assert_eq!(total(&lines, "*", "duplicates"), 0, "{lines:?}");

        // A copy of an applied event, pending at c2 as if c2 had read it and died: c2 started
        // again under its name finishes it first (no XAUTOCLAIM can take it yet), and skips it.
        let (_, fields) = &redis.entries(STREAM)[0];
        let mut copy = redis::cmd("XADD");
        copy.arg(STREAM).arg("*");
        for (name, value) in fields {
            copy.arg(name).arg(value);
        }
        let _: String = redis.query(&copy);
        let _: Value = redis.query(
            redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg("c2")
                .arg("STREAMS")
                .arg(STREAM)
                .arg(">"),
        );
        assert_eq!(pending_at(redis, "c2"), 1);
        let mut again = Run::start(consumer("c2", 600_000), "c2 again");
        again.wait_for("c2 finishing its pending entry", |lines| {
            total(lines, "pending", "entries") >= 1
        });
        let lines = again.kill();
        assert_eq!(total(&lines, "pending", "entries"), 1, "{lines:?}");
        assert_eq!(total(&lines, "pending", "duplicates"), 1, "{lines:?}");
        assert_eq!(total(&lines, "*", "applied"), 0, "{lines:?}");

        // Each event applied once: one processed_events row and one welcome e-mail per event
        // and account, no more.
        let events: BTreeSet<(i64, i64)> = pairs(
            &mut app,
            "SELECT id, (extract(epoch FROM created_at) * 1000000)::bigint FROM outbox",
        )
        .into_iter()
        .collect();
        assert_eq!(events.len(), ACCOUNTS as usize);
        let processed_rows = pairs(
            &mut store,
            "SELECT event_id, (extract(epoch FROM created_at) * 1000000)::bigint \
             FROM processed_events",
        );
        assert_eq!(processed_rows.len(), ACCOUNTS as usize);
        assert_eq!(processed_rows.into_iter().collect::<BTreeSet<_>>(), events);
        let accounts: BTreeMap<i64, String> = app
            .query("SELECT id, email FROM accounts", &[])
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        assert_eq!(accounts.len(), ACCOUNTS as usize);
        let emails: Vec<(i64, String, i64)> = store
            .query(
                "SELECT account_id, email, event_id FROM welcome_emails",
                &[],
            )
            .unwrap()
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect();
        assert_eq!(
            emails.len(),
            ACCOUNTS as usize,
            "e-mails sent, with repeats"
        );
        let sent: BTreeMap<i64, String> = emails
            .iter()
            .map(|(account, email, _)| (*account, email.clone()))
            .collect();
        assert_eq!(sent, accounts, "e-mails sent, by account");
        let sent_for: BTreeSet<i64> = emails.iter().map(|(_, _, event)| *event).collect();
        let event_ids: BTreeSet<i64> = events.iter().map(|(id, _)| *id).collect();
        assert_eq!(sent_for, event_ids, "e-mails sent, by event");
        assert_eq!(pending_at(redis, "*"), 0, "entries left pending");
    }

    /// Waits for the relay to have published `n` events in all.
    fn wait_for_stream(&self, n: i64) {
        assert!(
            wait_until(PATIENCE, || self.redis.xlen(STREAM) == n as usize),
            "the relay did not publish {n} events: {} in the stream",
            self.redis.xlen(STREAM)
        );
    }
}

/// The repository's root, without the `tests/..` of `repository()`.
fn root() -> PathBuf {
    repository()
        .canonicalize()
        .expect("cannot find the repository")
}

/// examples/ in the repository.
fn examples() -> PathBuf {
    root().join("examples")
}

/// The Python of the example's virtual environment, target/examples/<example>/venv, with its
/// requirements.txt.
fn python_venv(example: &str) -> PathBuf {
    common::python::venv(
        &root().join("target/examples").join(example).join("venv"),
        &examples().join(example).join("requirements.txt"),
    )
}

/// One `npm ci` at a time.
static INSTALLING: Mutex<()> = Mutex::new(());

/// `npm ci` in the example, unless its node_modules has its package-lock.json installed.
fn npm_ci(example: &str) {
    let _installing = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = examples().join(example);
    let lock = fs::read_to_string(dir.join("package-lock.json")).expect("no package-lock.json");
    // A copy of the lock file installed, written once it is (npm ci empties node_modules first).
    let installed = dir.join("node_modules/.installed-package-lock.json");
    if fs::read_to_string(&installed).ok().as_deref() == Some(lock.as_str()) {
        return;
    }
    say(format!(
        "examples/{example}: installing package-lock.json's packages into {} (npm ci; from the \
         npm registry)",
        dir.join("node_modules").display()
    ));
    let npm = output(
        Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir),
    );
    assert!(
        npm.status.success(),
        "npm ci in examples/{example} failed (does this machine reach the npm registry?):\n{}{}",
        String::from_utf8_lossy(&npm.stdout),
        String::from_utf8_lossy(&npm.stderr)
    );
    fs::write(&installed, lock).expect("cannot write .installed-package-lock.json");
}

/// A line on the test's stderr, shown whether the test passes or fails (the test harness keeps
/// `eprintln!`'s output for failures only): an install takes a while.
fn say(line: String) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a program of an example to its end, successfully.
fn run(cmd: &mut Command) {
    let out = output(cmd.env("PYTHONDONTWRITEBYTECODE", "1"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running consumer and the lines it printed. Its errors go to the test's output.
struct Run {
    name: &'static str,
    out: Printing,
}

impl Run {
    fn start(mut cmd: Command, name: &'static str) -> Run {
        Run {
            name,
            out: Printing::spawn(cmd.env("PYTHONDONTWRITEBYTECODE", "1")),
        }
    }

    /// Waits for `done`, given the lines printed so far; fails if the consumer exits first.
    fn wait_for(&mut self, what: &str, mut done: impl FnMut(&[String]) -> bool) {
        let out = &mut self.out;
        let held = wait_until(PATIENCE, || {
            let exited = out.child.try_wait().expect("cannot wait for the consumer");
            out.read();
            if let Some(status) = exited {
                panic!("{} exited ({status}): {:?}", self.name, out.seen);
            }
            done(&out.seen)
        });
        self.out.read();
        assert!(held, "{what}: not after {PATIENCE:?}: {:?}", self.out.seen);
    }

    /// SIGKILL; returns every line the consumer printed.
    fn kill(self) -> Vec<String> {
        self.out.kill()
    }
}

/// The sum of `field` over the consumer's lines for batches from `source` (`pending`,
/// `claimed`, `new`; `*`: any).
fn total(lines: &[String], source: &str, field: &str) -> usize {
    let source = format!("source={source}");
    let field = format!("{field}=");
    lines
        .iter()
        .filter(|line| line.starts_with("batch "))
        .filter(|line| source == "source=*" || line.split(' ').any(|w| w == source))
        .flat_map(|line| line.split(' ').filter_map(|w| w.strip_prefix(&field)))
        .map(|n| n.parse::<usize>().expect("not a count"))
        .sum()
}

/// `XPENDING <stream> <group>`: count, lowest id, highest id, (consumer, count) pairs (nil when
/// nothing is pending).
type PendingSummary = (usize, Value, Value, Option<Vec<(String, String)>>);

/// Entries pending at `consumer` (`*`: at any); 0 before the group exists.
fn pending_at(redis: &Redis, consumer: &str) -> usize {
    let groups: Vec<Value> = redis.query(redis::cmd("XINFO").arg("GROUPS").arg(STREAM));
    if groups.is_empty() {
        return 0;
    }
    let (total, _, _, per_consumer): PendingSummary =
        redis.query(redis::cmd("XPENDING").arg(STREAM).arg(GROUP));
    if consumer == "*" {
        return total;
    }
    per_consumer
        .unwrap_or_default()
        .iter()
        .filter(|(name, _)| name == consumer)
        .map(|(_, count)| count.parse::<usize>().expect("not a count"))
        .sum()
}

/// Rows of two bigints.
fn pairs(client: &mut common::Client, sql: &str) -> Vec<(i64, i64)> {
    client
        .query(sql, &[])
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

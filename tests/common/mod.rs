//! Test harness: a throwaway PostgreSQL cluster with the extension preloaded and a throwaway
//! `redis-server`, each on a free port, stopped and removed when the test ends (panics
//! included). When the tests run as root, PostgreSQL runs as the `postgres` OS user.
//!
//! The extension must be installed first (`make test` does it).

#![allow(dead_code)]

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use postgres::Client;

pub mod printing;
pub mod proxy;
pub mod python;
pub mod redis_keys;
pub mod sql;
pub mod topology;

/// The server program the tests start: `redis-server`, or another that speaks its protocol
/// (Valkey's `valkey-server`) named by `OUTBOX_TEST_REDIS_SERVER`.
pub fn redis_server() -> String {
    std::env::var("OUTBOX_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// The server under test, if an upgrade in place to it switches dedupe: it has IDMP and
/// Debian's Redis 7.0 (`redis-server`, the upgrade's source) has not. Found by starting both.
pub fn idmp_upgrade_target() -> Option<String> {
    let target = redis_server();
    let target_has_idmp = Redis::start().has_idmp();
    let source_lacks_idmp = !Redis::start_program("redis-server", &[]).has_idmp();
    (target_has_idmp && source_lacks_idmp).then_some(target)
}

/// Waits up to `block` for the first entry of `stream` after the entry `after` (`"0-0"` for the
/// first of all) and returns its id, `None` if none came. A blocking read returns as the entry
/// arrives, where polling `XLEN` in a loop takes a core of a two-core machine from the relay and
/// Redis. A signal to the test process that interrupts the read (EINTR) says nothing about
/// Redis: the read is made again, on a new connection of `redis` (the interrupted one may still
/// get the reply), for what is left of `block`.
pub fn next_entry(
    redis: &Redis,
    conn: &mut redis::Connection,
    stream: &str,
    after: &str,
    block: Duration,
) -> Option<String> {
    type Streams = Vec<(String, Vec<(String, Vec<String>)>)>;
    let started = Instant::now();
    let mut tries = 0;
    let reply: Option<Streams> = loop {
        tries += 1;
        let left = block
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        match redis::cmd("XREAD")
            .arg("BLOCK")
            .arg(left.as_millis() as u64)
            .arg("STREAMS")
            .arg(stream)
            .arg(after)
            .query(conn)
        {
            Ok(reply) => break reply,
            Err(e) if tries < 5 && e.to_string().contains("Interrupted") => *conn = redis.conn(),
            Err(e) => panic!("XREAD of {stream} failed: {e}"),
        }
    };
    reply
        .and_then(|streams| streams.into_iter().next())
        .and_then(|(_, entries)| entries.into_iter().next())
        .map(|(id, _)| id)
}

/// Ports this process has handed out. A server binds its port a moment after it is handed the
/// number; until then the kernel counts the port as free and may offer it again.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Takes `port` for this process: false if it was handed out before.
pub fn claim_port(port: u16) -> bool {
    HANDED_OUT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .insert(port)
}

/// The event id an entry's fields carry, in either shape: the field `id`, or a CloudEvent's
/// `ce_id` (`<id>@<created_at>`).
pub fn event_id<'a>(mut fields: impl Iterator<Item = (&'a str, &'a str)>) -> i64 {
    let text = fields
        .find_map(|(name, value)| match name {
            "id" => Some(value),
            "ce_id" => value.split_once('@').map(|(id, _)| id),
            _ => None,
        })
        .expect("the entry has neither id nor ce_id");
    text.parse().expect("the event id is not a number")
}

/// A port nobody listens on right now and this process has not handed out before.
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free port");
        if claim_port(port) {
            return port;
        }
    }
}

/// Polls `condition` every 20 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    run(Command::new("id").arg("-u")).trim() == "0"
}

/// The repository's root folder (this crate is its `tests/` folder).
pub fn repository() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The extension's version: its package's in the repository's `Cargo.toml`.
pub fn extension_version() -> &'static str {
    include_str!("../../Cargo.toml")
        .lines()
        .find_map(|line| line.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("no version in Cargo.toml")
}

/// PostgreSQL's program directory, from `$PG_CONFIG` (Debian's 15 by default).
pub fn bindir() -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG")
        .unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    PathBuf::from(run(Command::new(pg_config).arg("--bindir")).trim())
}

/// A command that runs a PostgreSQL program, as `postgres` when we are root.
fn pg_command(program: &str) -> Command {
    let path = bindir().join(program);
    if is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(path);
        cmd
    } else {
        Command::new(path)
    }
}

pub fn give_to_postgres(path: &Path) {
    if is_root() {
        run(Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(path));
    }
}

/// A file holding a password on its first line, as `outbox.redis_password_file` names one; its
/// folder is removed when it is dropped.
pub struct PasswordFile {
    path: String,
    dir: PathBuf,
}

impl PasswordFile {
    pub fn as_str(&self) -> &str {
        &self.path
    }
}

impl Drop for PasswordFile {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A file holding `password` on its first line: owned by the server's OS user and closed to
/// everyone else.
pub fn password_file(password: &str) -> PasswordFile {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch_dir("secret");
    let path = dir.join("redis.password");
    fs::write(&path, format!("{password}\n")).expect("cannot write a password file");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .expect("cannot restrict a password file");
    give_to_postgres(&path);
    PasswordFile {
        path: path.display().to_string(),
        dir,
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn scratch_dir(kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "outbox-test-{}-{}-{kind}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("cannot create a scratch directory");
    dir
}

pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    /// The server program: [`redis_server`] unless the test names another.
    program: String,
    child: Option<Child>,
    password: Option<String>,
    /// Extra `redis-server` options, kept for `start_again`.
    args: Vec<String>,
}

impl Redis {
    pub fn start() -> Redis {
        Redis::start_with_password(None)
    }

    /// A server that requires `password` (`requirepass`).
    pub fn start_with_password(password: Option<&str>) -> Redis {
        Redis::launch(password, &[])
    }

    /// A server started with extra options, e.g. `["--proto-max-bulk-len", "1mb"]`.
    pub fn start_with_args(args: &[&str]) -> Redis {
        Redis::launch(None, args)
    }

    /// A server of `program` (another version than the tests' own), with extra options.
    pub fn start_program(program: &str, args: &[&str]) -> Redis {
        Redis::launch_program(program.to_string(), None, args)
    }

    fn launch(password: Option<&str>, args: &[&str]) -> Redis {
        Redis::launch_program(redis_server(), password, args)
    }

    fn launch_program(program: String, password: Option<&str>, args: &[&str]) -> Redis {
        let mut redis = Redis {
            port: free_port(),
            dir: scratch_dir("redis"),
            program,
            child: None,
            password: password.map(str::to_string),
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        let child = Command::new(&self.program)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(
                self.password
                    .iter()
                    .flat_map(|p| ["--requirepass", p.as_str()]),
            )
            .args(&self.args)
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start redis-server; is it installed?");
        self.child = Some(child);
        let port = self.port;
        assert!(
            wait_until(Duration::from_secs(10), || redis::Client::open(format!(
                "redis://127.0.0.1:{port}"
            ))
            .and_then(|c| c.get_connection())
            .is_ok()),
            "redis-server did not start on port {port}"
        );
    }

    /// The URL the relay is given: without the password, which it reads from a file.
    pub fn relay_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's URL for the test's own connections, with its password if it has one.
    pub fn url(&self) -> String {
        match &self.password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn conn(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).expect("bad redis url");
        let conn = client.get_connection().expect("cannot connect to redis");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        conn
    }

    /// Stops the server; `start_again` brings it back on the same port, empty.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "redis is still running");
        self.spawn();
    }

    /// Kills the server and starts `program` in its place: the same port, options and data
    /// directory (what it kept on disk, with `--appendonly yes`), as an upgrade in place does.
    pub fn upgrade_to(&mut self, program: &str) {
        self.stop();
        self.program = program.to_string();
        self.spawn();
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("redis is not running").id();
        run(Command::new("kill").args([signal, &pid.to_string()]));
    }

    /// Freezes the server: connections stay open but nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Runs `cmd` on a new connection, once more if a signal to the test process interrupted
    /// the socket read (EINTR), which says nothing about Redis.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let mut tries = 0;
        loop {
            tries += 1;
            match cmd.query(&mut self.conn()) {
                Ok(value) => return value,
                Err(e) if tries < 5 && e.to_string().contains("Interrupted") => continue,
                Err(e) => panic!("{cmd:?} failed: {e}"),
            }
        }
    }

    /// Every entry of a stream, as (entry id, fields).
    pub fn entries(&self, stream: &str) -> Vec<(String, HashMap<String, String>)> {
        entries_of(self.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+")))
    }

    /// The event id of every entry of a stream, in stream order (see [`event_id`]).
    pub fn ids(&self, stream: &str) -> Vec<i64> {
        self.entries(stream)
            .iter()
            .map(|(_, f)| event_id(f.iter().map(|(n, v)| (n.as_str(), v.as_str()))))
            .collect()
    }

    pub fn xlen(&self, stream: &str) -> usize {
        self.query(redis::cmd("XLEN").arg(stream))
    }

    /// Creates the ACL user `relay`, password `pw`, with `rules` (`ACL SETUSER`'s, separated by
    /// spaces); returns its URL for `outbox.redis_url` and a file holding its password.
    pub fn relay_user(&self, rules: &str) -> (String, PasswordFile) {
        let mut acl = redis::cmd("ACL");
        acl.arg("SETUSER").arg("relay").arg("on").arg(">pw");
        for rule in rules.split_whitespace() {
            acl.arg(rule);
        }
        let _: () = self.query(&acl);
        let url = format!("redis://relay@127.0.0.1:{}", self.port);
        (url, password_file("pw"))
    }

    /// The server's product and version: see [`server_version`].
    pub fn version(&self) -> (String, (u32, u32, u32)) {
        server_version(&self.query::<String>(redis::cmd("INFO").arg("server")))
    }

    /// Whether `outbox.dedupe = auto` deduplicates with IDMP here: see [`has_idmp`].
    pub fn has_idmp(&self) -> bool {
        has_idmp(&self.query::<String>(redis::cmd("INFO").arg("server")))
    }

    /// Whether trimming can keep what a consumer group has not acknowledged: Redis 8.2 or later.
    pub fn has_acked_trimming(&self) -> bool {
        let (product, version) = self.version();
        product == "redis" && version >= (8, 2, 0)
    }
}

/// A server's product and version from its `INFO server` reply, read here apart from the
/// relay's own reading: ("redis" or "valkey", (major, minor, patch)).
pub fn server_version(info: &str) -> (String, (u32, u32, u32)) {
    let field = |name: &str| {
        info.lines().find_map(|l| {
            l.trim()
                .strip_prefix(&format!("{name}:"))
                .map(str::to_string)
        })
    };
    let (product, version) = match field("valkey_version") {
        Some(v) => ("valkey", v),
        None => ("redis", field("redis_version").expect("no redis_version")),
    };
    let n: Vec<u32> = version.split('.').map(|p| p.parse().unwrap_or(0)).collect();
    (product.to_string(), (n[0], n[1], n[2]))
}

/// An `XRANGE` reply as (entry id, fields).
pub fn entries_of(reply: Vec<(String, Vec<String>)>) -> Vec<(String, HashMap<String, String>)> {
    reply
        .into_iter()
        .map(|(id, flat)| {
            let fields = flat
                .chunks(2)
                .map(|kv| (kv[0].clone(), kv[1].clone()))
                .collect();
            (id, fields)
        })
        .collect()
}

/// Whether the server whose `INFO server` reply this is has IDMP: Redis 8.6.2 or later.
pub fn has_idmp(info: &str) -> bool {
    let (product, version) = server_version(info);
    product == "redis" && version >= (8, 6, 2)
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

pub struct Pg {
    pub port: u16,
    pub dir: PathBuf,
    settings: Vec<(String, String)>,
    /// Password files its settings name, removed after the server (the relay reads them at
    /// each connection).
    secrets: Vec<PasswordFile>,
}

impl Pg {
    /// Starts a cluster with the extension preloaded and `settings` in postgresql.conf.
    pub fn start(settings: &[(&str, &str)]) -> Pg {
        let dir = scratch_dir("pg");
        give_to_postgres(&dir);
        run(pg_command("initdb")
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
                "-D",
            ])
            .arg(dir.join("data")));
        Pg::start_in(dir, settings)
    }

    /// A cluster whose relay publishes to `redis`, with `extra` settings.
    pub fn relaying_to(redis: &Redis, extra: &[(&str, &str)]) -> Pg {
        let url = redis.relay_url();
        let file = redis.password.as_deref().map(password_file);
        let mut settings = vec![("outbox.redis_url", url.as_str())];
        if let Some(file) = &file {
            settings.push(("outbox.redis_password_file", file.as_str()));
        }
        settings.extend_from_slice(extra);
        let mut pg = Pg::start(&settings);
        pg.secrets.extend(file);
        pg
    }

    fn start_in(dir: PathBuf, settings: &[(&str, &str)]) -> Pg {
        give_to_postgres(&dir);
        let pg = Pg {
            port: free_port(),
            dir,
            settings: settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            secrets: Vec::new(),
        };
        pg.write_conf();
        pg.ctl_start();
        pg
    }

    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    fn write_conf(&self) {
        // `jit = off`: PostgreSQL 17 unpacked by scripts/fetch-postgresql.sh has its JIT provider
        // without the LLVM library it loads, and a query planned as costly (scans turned off)
        // would fail there.
        let mut conf = format!(
            "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             shared_preload_libraries = 'outbox'\nfsync = off\nmax_connections = 50\njit = off\n",
            self.port,
            self.dir.display()
        );
        for (key, value) in &self.settings {
            conf.push_str(&format!("{key} = '{}'\n", value.replace('\'', "''")));
        }
        // Our settings live in a file of their own, included from postgresql.conf, so that
        // what pg_basebackup -R writes to postgresql.auto.conf survives.
        let path = self.data().join("harness.conf");
        fs::write(&path, conf).expect("cannot write harness.conf");
        give_to_postgres(&path);
        let main = self.data().join("postgresql.conf");
        let text = fs::read_to_string(&main).expect("cannot read postgresql.conf");
        if !text.contains("include 'harness.conf'") {
            fs::write(&main, format!("{text}\ninclude 'harness.conf'\n"))
                .expect("cannot write postgresql.conf");
        }
    }

    /// Starts the server again after [`Pg::stop`].
    pub fn ctl_start(&self) {
        self.ctl_start_with(&[]);
    }

    /// Starts the server with `env` added to its environment.
    fn ctl_start_with(&self, env: &[(&str, &str)]) {
        run(pg_command("pg_ctl")
            .envs(env.iter().copied())
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "start"]));
    }

    /// Changes settings in postgresql.conf and reloads the server.
    pub fn set(&mut self, settings: &[(&str, &str)]) {
        self.set_at_next_start(settings);
        self.connect()
            .execute("SELECT pg_reload_conf()", &[])
            .unwrap();
    }

    /// Changes settings in postgresql.conf without telling the server.
    pub fn set_at_next_start(&mut self, settings: &[(&str, &str)]) {
        for (key, value) in settings {
            self.settings.retain(|(k, _)| k != key);
            self.settings.push((key.to_string(), value.to_string()));
        }
        self.write_conf();
    }

    pub fn connect_to(&self, dbname: &str) -> Client {
        self.connect_with(dbname, "postgres", "")
    }

    /// Connects to `dbname` as `user` (a role created by the test, say).
    pub fn connect_as(&self, dbname: &str, user: &str) -> Client {
        self.connect_with(dbname, user, "")
    }

    /// Connects to `dbname` as `user` with `options` sent at connection start (`-c name=value
    /// ...`, a space in a value escaped with a backslash): they apply before the first
    /// statement, and win over the database's and the role's defaults.
    pub fn connect_with(&self, dbname: &str, user: &str, options: &str) -> Client {
        let mut config = postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(user)
            .dbname(dbname)
            .connect_timeout(Duration::from_secs(10));
        if !options.is_empty() {
            config.options(options);
        }
        let mut last = None;
        // Right after a crash restart the server refuses connections for a moment.
        for _ in 0..300 {
            match config.connect(postgres::NoTls) {
                Ok(client) => return client,
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "cannot connect to PostgreSQL on port {} as {user}: {last:?}",
            self.port
        )
    }

    pub fn connect(&self) -> Client {
        self.connect_to("postgres")
    }

    /// Connects and creates the extension.
    pub fn with_extension(&self) -> Client {
        let mut client = self.connect();
        client
            .batch_execute("CREATE EXTENSION outbox")
            .expect("CREATE EXTENSION failed");
        client
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Runs a query on a fresh connection, trying again while the server is restarting
    /// after a crash (connections then break mid-query).
    pub fn query_retrying(&self, sql: &str) -> Vec<postgres::Row> {
        let mut last = None;
        for _ in 0..200 {
            match self.connect().query(sql, &[]) {
                Ok(rows) => return rows,
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{sql} kept failing: {last:?}")
    }

    /// Pids of the running relay workers, from pg_stat_activity.
    pub fn worker_pids(&self) -> Vec<i32> {
        self.query_retrying(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox relay' ORDER BY pid",
        )
        .iter()
        .map(|r| r.get(0))
        .collect()
    }

    /// Waits for `n` relay workers to be running.
    pub fn wait_for_workers(&self, n: usize) {
        assert!(
            wait_until(Duration::from_secs(30), || self.worker_pids().len() == n),
            "expected {n} relay workers, found {:?}",
            self.worker_pids()
        );
    }

    /// `kill -9` of a process of this server; returns once the postmaster has ended every other
    /// process to restart the cluster. (Before that, the killed worker may still be listed and a
    /// new connection be accepted, only to be cut by the restart.)
    pub fn kill9(&self, pid: i32) {
        const RESTART: &str = "all server processes terminated; reinitializing";
        let restarts = self.log().matches(RESTART).count();
        run(Command::new("kill").args(["-9", &pid.to_string()]));
        assert!(
            wait_until(Duration::from_secs(30), || self
                .log()
                .matches(RESTART)
                .count()
                > restarts),
            "the server did not restart after the kill of {pid}:\n{}",
            self.log()
        );
    }

    /// Stops the server with `pg_ctl stop -m <mode>`; returns how long that took.
    pub fn stop(&self, mode: &str) -> Duration {
        let started = Instant::now();
        run(pg_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", mode, "-w", "-t", "60", "stop"]));
        started.elapsed()
    }

    pub fn restart(&self) {
        self.stop("fast");
        self.ctl_start();
    }

    /// Restarts the server with `env` added to its environment (`RUST_BACKTRACE`, say), for
    /// as long as it runs.
    pub fn restart_with_env(&self, env: &[(&str, &str)]) {
        self.stop("fast");
        self.ctl_start_with(env);
    }

    /// Crashes the server (`pg_ctl stop -m immediate`: WAL not yet written is lost) and starts it
    /// again, through crash recovery.
    pub fn crash_and_start(&self) {
        self.stop("immediate");
        self.ctl_start();
    }

    pub fn promote(&self) {
        run(pg_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-w", "promote"]));
    }

    /// A streaming replica of this server, with the extension preloaded and `settings`.
    pub fn start_standby(&self, settings: &[(&str, &str)]) -> Pg {
        Pg::start_from_backup(self.base_backup(), settings)
    }

    /// A base backup of this server (`pg_basebackup -R -X stream`) in a scratch directory, not
    /// started: `start_from_backup` starts it, as a standby of this server (promote it to
    /// restore it as a primary).
    pub fn base_backup(&self) -> PathBuf {
        let dir = scratch_dir("backup");
        give_to_postgres(&dir);
        run(pg_command("pg_basebackup")
            .args(self.client_args())
            .args(["-R", "-X", "stream", "-D"])
            .arg(dir.join("data")));
        dir
    }

    /// Starts the cluster of a `base_backup`, on a port of its own, with `settings`.
    pub fn start_from_backup(dir: PathBuf, settings: &[(&str, &str)]) -> Pg {
        Pg::start_in(dir, settings)
    }

    /// Runs a client program of PostgreSQL's (pg_dump, psql) against this server.
    pub fn client_program(&self, program: &str, args: &[&str]) -> String {
        run(Command::new(bindir().join(program))
            .args(self.client_args())
            .args(args))
    }

    /// The options that point a PostgreSQL client program at this server as `postgres`.
    pub fn client_args(&self) -> Vec<String> {
        [
            "-h",
            "127.0.0.1",
            "-p",
            &self.port.to_string(),
            "-U",
            "postgres",
        ]
        .map(String::from)
        .to_vec()
    }

    /// The state and last error of the only relay worker.
    pub fn worker_state(&self) -> (String, Option<String>) {
        let rows = self.query_retrying("SELECT state, last_error FROM outbox_workers");
        (rows[0].get(0), rows[0].get(1))
    }

    /// Number of outbox rows still unpublished.
    pub fn pending(&self) -> i64 {
        self.query_retrying("SELECT count(*) FROM outbox WHERE published_at IS NULL")[0].get(0)
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        let _ = pg_command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if std::thread::panicking() {
            eprintln!("---- server log of the failed test ----\n{}", self.log());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A server whose relay is off (`outbox.workers = 0`), so that rows stay where the test puts
/// them.
pub fn server() -> Pg {
    Pg::start(&[("outbox.workers", "0")])
}

/// Enqueues `n` events on `topic` in one transaction; returns their ids.
pub fn enqueue_many(client: &mut Client, topic: &str, n: i64) -> Vec<i64> {
    client
        .query(
            "SELECT outbox_enqueue($1, jsonb_build_object('n', g)) FROM generate_series(1::bigint, $2) g",
            &[&topic, &n],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Notifications that reach `client` within `timeout`, as (channel, payload); stops early once
/// `max` have arrived.
pub fn notifications(client: &mut Client, timeout: Duration, max: usize) -> Vec<(String, String)> {
    use postgres::fallible_iterator::FallibleIterator;
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut notifications = client.notifications();
    while got.len() < max {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match notifications
            .timeout_iter(left)
            .next()
            .expect("connection failed while listening")
        {
            Some(n) => got.push((n.channel().to_string(), n.payload().to_string())),
            None => break,
        }
    }
    got
}

/// The SQLSTATE of a failed statement, or a note that it has none.
pub fn sqlstate(error: &postgres::Error) -> String {
    error
        .code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| format!("no SQLSTATE: {error}"))
}

/// Commits `n` events on `stream` and kills the worker with SIGKILL after it has published the
/// first batch and before it could mark it: a SHARE lock on the events' partitions, queued
/// behind the committing writer, holds back the mark (ROW EXCLUSIVE) but not the claim (ROW
/// SHARE). `published` counts the stream's entries; `before_kill` looks at that moment. Returns
/// the ids.
pub fn kill_between_publish_and_mark(
    pg: &Pg,
    published: impl Fn() -> usize,
    stream: &str,
    n: i64,
    before_kill: impl FnOnce(),
) -> Vec<i64> {
    // A worker that has found the extension has prepared its statements (which takes the locks
    // a mark needs), so the lock below catches it in a mark, not in its preparation.
    assert!(
        wait_until(Duration::from_secs(20), || {
            pg.query_retrying("SELECT state FROM outbox_workers")
                .first()
                .map(|r| r.get::<_, String>(0))
                == Some("idle".into())
        }),
        "the worker did not become idle"
    );
    let pid = pg.worker_pids()[0];
    let published_before = published();
    let mut writer = pg.connect();
    writer.batch_execute("BEGIN").unwrap();
    let ids = enqueue_many(&mut writer, stream, n);
    let (release, released) = std::sync::mpsc::channel::<()>();
    let port = pg.port;
    // The partitions that hold the events (runs of 65,536 ids go round 16 of them): the relay
    // marks each partition's rows through the partition.
    let mut partitions: Vec<String> = ids
        .iter()
        .map(|id| format!("outbox_{:02}", (id / 65_536) % 16))
        .collect();
    partitions.dedup();
    let lock = format!("BEGIN; LOCK TABLE {} IN SHARE MODE", partitions.join(", "));
    let locker = std::thread::spawn(move || {
        let conninfo = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
        let mut client = postgres::Client::connect(&conninfo, postgres::NoTls).unwrap();
        let _ = client.batch_execute(&lock);
        let _ = released.recv();
    });
    assert!(wait_until(Duration::from_secs(10), || {
        let waiting = pg.query_retrying(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'BEGIN; LOCK TABLE%' AND wait_event_type = 'Lock'",
        );
        waiting[0].get::<_, i64>(0) == 1
    }));
    writer.batch_execute("COMMIT").unwrap();
    let held = wait_until(Duration::from_secs(10), || {
        let waiting = pg.query_retrying(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid} AND wait_event_type = 'Lock'"
        ));
        waiting[0].get::<_, i64>(0) == 1 && published() > published_before
    });
    assert!(
        held,
        "the worker was not caught between publishing and marking"
    );
    before_kill();
    pg.kill9(pid);
    let _ = release.send(());
    locker.join().unwrap();
    pg.wait_for_workers(1);
    ids
}

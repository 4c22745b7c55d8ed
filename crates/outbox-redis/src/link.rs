//! The Redis thread's link to Redis as `outbox.redis_mode` describes it: one server, a primary
//! found through Sentinel (both a plain connection), or a Redis Cluster (redis-rs's cluster
//! connection, which routes each command to the primary of its key's slot). Opening the link
//! (with the TLS files, and a check that Redis answers) and running one chunk's commands as
//! pipelines are here; what the commands are and what their replies mean are not.

use std::collections::BTreeSet;
use std::time::Duration;

use redis::cluster::{ClusterClientBuilder, ClusterConnection};
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionLike, ErrorKind, IntoConnectionInfo,
    RedisConnectionInfo, RedisError, ServerError, TlsCertificates, TlsMode, Value,
};

use crate::error::{describe, Error};
use crate::resp::Packed;
use crate::server::{parse_info, Server};
use crate::target::{Mode, Target, TlsFiles};
use crate::{password_file, redis_url};

/// An open link to Redis.
pub enum Link {
    /// One server: standalone, or the primary Sentinel named.
    Node(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

/// Replies that say a cluster command went to a node that does not (or not yet, or no longer)
/// serve its slot. The command was not run, so it may be sent again.
fn is_redirection(code: &str) -> bool {
    matches!(
        code,
        "MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN" | "READONLY" | "MASTERDOWN" | "LOADING"
    )
}

/// Whether a command runs a script (the markers' or IDMP's, see `scripts.rs`), which adds
/// nothing twice whatever the number of times it is sent.
fn is_script(cmd: &Cmd) -> bool {
    matches!(cmd.args_iter().next(), Some(redis::Arg::Simple(name)) if name == b"EVAL")
}

/// Sends one command of a cluster pipeline on its own: its reply, or its error as a reply.
fn resend(connection: &mut ClusterConnection, cmd: &Cmd) -> Result<Value, RedisError> {
    match connection.req_command(cmd) {
        Ok(value) => Ok(value),
        Err(error) => ServerError::try_from(error).map(Value::ServerError),
    }
}

/// Opens a link as the target says, and checks that Redis answers on it: every primary, for a
/// cluster, so that a cluster still missing a primary reads as unavailable.
pub fn open(target: &Target) -> Result<Link, Error> {
    let certificates = certificates(&target.tls)?;
    let password = password_file::read("outbox.redis_password_file", &target.password_file)?;
    // A WAIT may block for the whole timeout: the socket gives it that much more.
    let read_timeout = if target.wait_replicas > 0 {
        target.timeout * 2
    } else {
        target.timeout
    };
    let urls = redis_url::split(&target.url);
    let Some(&first) = urls.first() else {
        return Err(Error::Setting("outbox.redis_url is empty".into()));
    };
    match target.mode {
        Mode::Standalone => {
            if urls.len() > 1 {
                return Err(Error::Setting(format!(
                    "outbox.redis_url lists {} URLs; with outbox.redis_mode = standalone it \
                     names one server (use cluster or sentinel for a list)",
                    urls.len()
                )));
            }
            let mut info = first.into_connection_info().map_err(setting)?;
            if let Some(password) = &password {
                let settings = info.redis_settings().clone().set_password(password);
                info = info.set_redis_settings(settings);
            }
            let client = match certificates {
                Some(certificates) => Client::build_with_tls(info, certificates),
                None => Client::open(info),
            }
            .map_err(setting)?;
            node(&client, target.timeout, read_timeout)
        }
        Mode::Sentinel => {
            let client = primary_from_sentinels(target, &urls, certificates, password)?;
            node(&client, target.timeout, read_timeout)
        }
        Mode::Cluster => {
            let mut builder = ClusterClientBuilder::new(urls.iter().copied())
                .connection_timeout(target.timeout)
                .response_timeout(read_timeout)
                // Each retry of a redirected command waits a little longer; a few cover a
                // failover's switch, and past them the worker's own backoff takes over.
                .retries(6)
                .min_retry_wait(10)
                .max_retry_wait(500);
            if let Some(certificates) = certificates {
                builder = builder.certs(certificates);
            }
            if let Some(password) = password {
                builder = builder.password(password);
            }
            let mut connection = builder
                .build()
                .and_then(|client| client.get_connection())
                .map_err(|e| Error::from_redis(&e))?;
            let every_primary = RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::AllSucceeded),
            ));
            connection
                .route_command(&redis::cmd("PING"), every_primary)
                .and_then(|v| v.extract_error())
                .map_err(|e| Error::from_redis(&e).context("a cluster primary does not answer"))?;
            Ok(Link::Cluster(Box::new(connection)))
        }
    }
}

/// A URL or client setting the redis crate refused.
fn setting(error: redis::RedisError) -> Error {
    Error::Setting(describe(&error))
}

/// A plain connection to the server `client` points at, with its timeouts, once it answers.
fn node(client: &Client, timeout: Duration, read_timeout: Duration) -> Result<Link, Error> {
    let mut connection = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| Error::from_redis(&e))?;
    connection
        .set_read_timeout(Some(read_timeout))
        .map_err(|e| Error::from_redis(&e))?;
    connection
        .set_write_timeout(Some(timeout))
        .map_err(|e| Error::from_redis(&e))?;
    redis::cmd("PING")
        .query::<String>(&mut connection)
        .map_err(|e| Error::from_redis(&e))?;
    Ok(Link::Node(connection))
}

/// Asks the sentinels for the primary of `outbox.redis_sentinel_master`. The URLs name the
/// sentinels; their user and database are the primary's, `password` is the primary's too, the
/// sentinels get the one of `outbox.redis_sentinel_password_file`, and `rediss://` means TLS to
/// both.
fn primary_from_sentinels(
    target: &Target,
    urls: &[&str],
    certificates: Option<TlsCertificates>,
    password: Option<String>,
) -> Result<Client, Error> {
    if target.sentinel_master.is_empty() {
        return Err(Error::Setting(
            "outbox.redis_sentinel_master is empty; with outbox.redis_mode = sentinel it names \
             the primary the sentinels watch"
                .into(),
        ));
    }
    let (sentinels, tls, credentials) = sentinel_addresses(urls)?;
    let mut builder = SentinelClientBuilder::new(
        sentinels,
        &target.sentinel_master,
        SentinelServerType::Master,
    )
    .map_err(setting)?;
    if let Some(settings) = credentials {
        if let Some(user) = settings.username() {
            builder = builder.set_client_to_redis_username(user);
        }
        builder = builder.set_client_to_redis_db(settings.db());
    }
    if let Some(password) = password {
        builder = builder.set_client_to_redis_password(password);
    }
    let sentinel_password = password_file::read(
        "outbox.redis_sentinel_password_file",
        &target.sentinel_password_file,
    )?;
    if let Some(password) = sentinel_password {
        builder = builder.set_client_to_sentinel_password(password);
    }
    if let Some(mode) = tls {
        builder = builder
            .set_client_to_redis_tls_mode(mode)
            .set_client_to_sentinel_tls_mode(mode);
        if let Some(certificates) = certificates {
            builder = builder
                .set_client_to_redis_certificates(certificates.clone())
                .set_client_to_sentinel_certificates(certificates);
        }
    }
    let mut sentinel = builder.build().map_err(setting)?;
    sentinel.get_client().map_err(|e| {
        Error::from_redis(&e).context(format_args!(
            "no sentinel named a reachable primary for '{}'",
            target.sentinel_master
        ))
    })
}

/// What the sentinels' URLs say: the addresses, whether they are reached over TLS, and the user
/// and database of the first URL (the primary's).
type Sentinels = (
    Vec<ConnectionAddr>,
    Option<TlsMode>,
    Option<RedisConnectionInfo>,
);

/// The sentinels the URLs name (see [`Sentinels`]).
fn sentinel_addresses(urls: &[&str]) -> Result<Sentinels, Error> {
    let mut sentinels = Vec::with_capacity(urls.len());
    let mut tls = None;
    let mut credentials = None;
    for url in urls {
        let info = url.into_connection_info().map_err(setting)?;
        let address = match info.addr() {
            ConnectionAddr::Tcp(host, port) => ConnectionAddr::Tcp(host.clone(), *port),
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                ..
            } => {
                tls = Some(if *insecure {
                    TlsMode::Insecure
                } else {
                    TlsMode::Secure
                });
                ConnectionAddr::Tcp(host.clone(), *port)
            }
            _ => {
                return Err(Error::Setting(
                    "sentinels are reached over TCP, not a Unix socket".into(),
                ))
            }
        };
        sentinels.push(address);
        credentials.get_or_insert_with(|| info.redis_settings().clone());
    }
    Ok((sentinels, tls, credentials))
}

/// The TLS files, read; `None` when none is set (the system's roots, no client certificate).
fn certificates(files: &TlsFiles) -> Result<Option<TlsCertificates>, Error> {
    let read = |setting: &str, path: &str| -> Result<Option<Vec<u8>>, Error> {
        if path.is_empty() {
            return Ok(None);
        }
        std::fs::read(path)
            .map(Some)
            .map_err(|e| Error::Setting(format!("cannot read {setting} '{path}': {e}")))
    };
    let root_cert = read("outbox.redis_tls_ca_file", &files.ca_file)?;
    let cert = read("outbox.redis_tls_cert_file", &files.cert_file)?;
    let key = read("outbox.redis_tls_key_file", &files.key_file)?;
    let client_tls =
        match (cert, key) {
            (Some(client_cert), Some(client_key)) => Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            }),
            (None, None) => None,
            _ => return Err(Error::Setting(
                "outbox.redis_tls_cert_file and outbox.redis_tls_key_file go together: set both \
                 or neither"
                    .into(),
            )),
        };
    if root_cert.is_none() && client_tls.is_none() {
        return Ok(None);
    }
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

impl Link {
    /// Whether commands go to a cluster, where scripts are sent whole (`EVAL`): a node may not
    /// have loaded them, and the cluster pipeline does not take `EVALSHA`.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Link::Cluster(_))
    }

    /// What `INFO server` says of each node written to (each primary of a cluster): `None` for
    /// all when the user may not run `INFO` or a node does not answer it.
    pub fn servers(&mut self) -> Vec<Option<Server>> {
        let mut info = redis::cmd("INFO");
        info.arg("server");
        let reply = match self {
            Link::Node(connection) => info.query::<Value>(connection),
            Link::Cluster(connection) => connection.route_command(
                &info,
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
            ),
        };
        let text = |value: &Value| match value {
            Value::BulkString(bytes) => parse_info(&String::from_utf8_lossy(bytes)),
            Value::VerbatimString { text, .. } => parse_info(text),
            _ => None,
        };
        match reply {
            Ok(Value::Map(nodes)) => nodes.iter().map(|(_, value)| text(value)).collect(),
            Ok(value) => vec![text(&value)],
            Err(_) => vec![None],
        }
    }

    /// Runs a command on its own (on a cluster, routed by its key).
    pub fn run<T: redis::FromRedisValue>(&mut self, cmd: &Cmd) -> Result<T, RedisError> {
        match self {
            Link::Node(connection) => cmd.query(connection),
            Link::Cluster(connection) => cmd.query(connection),
        }
    }

    /// Sends `commands` as pipelines (one, or one per node of a cluster) and returns one reply
    /// per command after the first `ignored`, whose replies are dropped, and whether any
    /// command had to be sent again. On a cluster, commands whose node redirected them are sent
    /// again one by one, following the redirection; one that still cannot be placed fails the
    /// call with its error.
    pub fn pipeline(
        &mut self,
        commands: &Packed,
        ignored: usize,
    ) -> Result<(Vec<Value>, bool), RedisError> {
        if commands.is_empty() {
            return Ok((Vec::new(), false));
        }
        match self {
            Link::Node(connection) => {
                // What redis-rs's own pipelines call. Every reply is read, errors among them,
                // and the ignored ones dropped here: redis-rs would fail the whole call over an
                // error in those it skips.
                let mut values =
                    connection.req_packed_commands(commands.bytes(), 0, commands.len())?;
                values.drain(..ignored.min(values.len()));
                Ok((values, false))
            }
            Link::Cluster(connection) => {
                let mut pipe = redis::cluster::cluster_pipe();
                let commands = commands.commands().ok_or_else(|| {
                    RedisError::from((ErrorKind::Client, "commands not written as RESP"))
                })?;
                for (i, cmd) in commands.into_iter().enumerate() {
                    pipe.add_command(cmd);
                    if i < ignored {
                        pipe.ignore();
                    }
                }
                let error = match pipe.query::<Vec<Value>>(connection) {
                    Ok(values) => return Ok((values, false)),
                    Err(error) => error,
                };
                // A single server error is not a pipeline's: the call failed as a whole.
                let error = match ServerError::try_from(error) {
                    Ok(single) => return Err(single.into()),
                    Err(error) => error,
                };
                // Some commands answered with an error, and the cluster pipeline then keeps
                // none of the other replies: each command is told apart by its position.
                let Some(failures) = error.clone().into_server_errors() else {
                    return Err(error);
                };
                let mut values = Vec::with_capacity(pipe.cmd_iter().count() - ignored);
                let mut resent = false;
                for (index, cmd) in pipe.cmd_iter().enumerate().skip(ignored) {
                    let failure = failures.iter().find(|(i, _)| *i == index).map(|(_, e)| e);
                    let value = match failure {
                        // Not run where it was sent: send it again, following the redirection.
                        Some(e) if is_redirection(e.code()) => {
                            resent = true;
                            resend(connection, cmd)?
                        }
                        Some(e) => Value::ServerError(e.clone()),
                        // A script's reply says what became of each event (IDMP's, that its
                        // stream was gone), and it was lost: the script runs again, and its
                        // markers or IDMP make it add nothing twice.
                        None if is_script(cmd) => resend(connection, cmd)?,
                        // An XADD without IDMP, which answers with an entry id whenever it is
                        // not an error (pipeline::read needs only that).
                        None => Value::SimpleString("added".into()),
                    };
                    values.push(value);
                }
                Ok((values, resent))
            }
        }
    }

    /// Waits until `replicas` replicas hold what this link wrote, on every node that got writes:
    /// the one server, or the primaries of `slots` (one after another, stopping at the first
    /// that falls short, so that missing replicas cost one timeout, not one per slot). Returns
    /// the fewest replicas any of them reported within `timeout`.
    pub fn wait(
        &mut self,
        replicas: u32,
        timeout: Duration,
        slots: &BTreeSet<u16>,
    ) -> Result<u32, RedisError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(timeout.as_millis() as u64);
        match self {
            Link::Node(connection) => wait.query(connection),
            Link::Cluster(connection) => {
                let mut fewest = u32::MAX;
                for &slot in slots {
                    let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                        Route::new(slot, SlotAddr::Master),
                    ));
                    let value = connection.route_command(&wait, route)?;
                    let acknowledged: i64 = redis::from_redis_value(value).map_err(|e| {
                        RedisError::from((ErrorKind::Parse, "WAIT answered", e.to_string()))
                    })?;
                    fewest = fewest.min(acknowledged.max(0) as u32);
                    if fewest < replicas {
                        break;
                    }
                }
                Ok(if fewest == u32::MAX { replicas } else { fewest })
            }
        }
    }
}

//! Redis: a thread of its own that publishes one chunk of a batch per round trip.
//!
//! The worker's main thread, the only one that calls PostgreSQL, hands a batch over a channel
//! and waits for the reply while it keeps watching for SIGTERM and postmaster death, so a Redis
//! that hangs never holds up a shutdown. The thread keeps one connection and reconnects after
//! any connection-level failure.

use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use redis::Value;

use super::encode::{group_by_stream, marker_key, marker_period, rfc3339, shard_runs, Event};
use crate::redis_url;

const DEDUPE_SCRIPT: &str = include_str!("dedupe.lua");

/// The script's SHA1, by which batches call it (`EVALSHA`) once a connection has loaded it.
fn dedupe_script_sha() -> &'static str {
    static SHA: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SHA.get_or_init(|| redis::Script::new(DEDUPE_SCRIPT).get_hash().to_string())
}

/// Where and how to publish: a snapshot of the settings, taken by the main thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub url: String,
    pub timeout: Duration,
    pub stream_prefix: String,
    pub stream_maxlen: u64,
    pub dedupe: bool,
    pub dedupe_ttl: Duration,
    /// Tells apart databases sharing a Redis in marker hash keys.
    pub marker_namespace: String,
}

/// Dedupe markers: event ids in one marker hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Markers {
    pub hash: String,
    pub ids: Vec<i64>,
}

pub struct Request {
    pub target: Target,
    pub events: Vec<Event>,
    /// Markers of batches whose transaction has committed: removed in the same round trip.
    pub committed_markers: Vec<Markers>,
}

/// What became of a batch.
pub enum Reply {
    /// Redis answered: one result per event, in the batch's order, and the markers the batch
    /// left behind (with dedupe on) to remove once the batch is marked.
    Answered {
        results: Vec<Result<(), String>>,
        markers: Vec<Markers>,
    },
    /// Redis could not be used at all; nothing may be marked.
    Unavailable(String),
}

/// Whether a Redis error code concerns one event (its key) or the whole server. An ACL refusal
/// (`NOPERM`) is the server's: it says what the relay's Redis user may do, and charging it to
/// events would bury a whole backlog over a permission to fix.
pub fn is_server_wide(code: &str) -> bool {
    matches!(
        code,
        "NOAUTH"
            | "WRONGPASS"
            | "LOADING"
            | "READONLY"
            | "MASTERDOWN"
            | "BUSY"
            | "OOM"
            | "CLUSTERDOWN"
            | "TRYAGAIN"
            | "MISCONF"
            | "NOREPLICAS"
            | "NOSCRIPT"
            | "EXECABORT"
            | "NOPERM"
    )
}

pub struct Publisher {
    requests: Sender<Request>,
    replies: Receiver<Reply>,
}

/// Why waiting for a reply ended without one.
pub enum Interrupted {
    /// The caller's check asked to stop waiting.
    Stopped,
}

impl Publisher {
    pub fn spawn() -> Publisher {
        let (requests, incoming) = bounded::<Request>(1);
        let (outgoing, replies) = bounded::<Reply>(1);
        thread::Builder::new()
            .name("outbox-redis".into())
            .spawn(move || serve(incoming, outgoing))
            .expect("could not start the Redis thread");
        Publisher { requests, replies }
    }

    /// Hands a batch to the Redis thread and returns at once; [`Publisher::wait`] collects the
    /// outcome, so that the caller can work in the meantime.
    pub fn send(&self, request: Request) -> bool {
        self.requests.send(request).is_ok()
    }

    /// Waits for the outcome of the batch last sent, calling `keep_waiting` every `tick` while
    /// Redis has not answered; when it returns false the wait ends (the thread finishes the call
    /// on its own).
    pub fn wait(
        &self,
        tick: Duration,
        mut keep_waiting: impl FnMut() -> bool,
    ) -> Result<Reply, Interrupted> {
        loop {
            match self.replies.recv_timeout(tick) {
                Ok(reply) => return Ok(reply),
                Err(RecvTimeoutError::Timeout) => {
                    if !keep_waiting() {
                        return Err(Interrupted::Stopped);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Ok(Reply::Unavailable("the Redis thread has stopped".into()))
                }
            }
        }
    }
}

fn serve(incoming: Receiver<Request>, outgoing: Sender<Reply>) {
    block_signals();
    let mut connection: Option<Connection> = None;
    for request in incoming {
        let reply = handle(&mut connection, request);
        if outgoing.send(reply).is_err() {
            return;
        }
    }
}

/// Keeps the process's signals (SIGTERM, SIGHUP, SIGUSR1 ...) off this thread: they are the main
/// thread's to handle, and one landing here would interrupt a socket read (EINTR), which would
/// read as Redis being unavailable.
fn block_signals() {
    // SAFETY: fills a local signal set and installs it as this thread's mask.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
}

/// One connection to Redis, and what it was opened for.
struct Connection {
    url: String,
    timeout: Duration,
    inner: redis::Connection,
    /// Whether the dedupe script is loaded (only needed, and only asked for, with dedupe on).
    script_loaded: bool,
}

/// Opens a connection and checks that Redis answers on it.
fn connect(target: &Target) -> Result<Connection, String> {
    let client = redis::Client::open(target.url.as_str()).map_err(|e| describe(&e))?;
    let mut inner = client
        .get_connection_with_timeout(target.timeout)
        .map_err(|e| describe(&e))?;
    inner
        .set_read_timeout(Some(target.timeout))
        .map_err(|e| describe(&e))?;
    inner
        .set_write_timeout(Some(target.timeout))
        .map_err(|e| describe(&e))?;
    redis::cmd("PING")
        .query::<String>(&mut inner)
        .map_err(|e| describe(&e))?;
    Ok(Connection {
        url: target.url.clone(),
        timeout: target.timeout,
        inner,
        script_loaded: false,
    })
}

/// Loads the dedupe script on a connection that has not loaded it. A restarted or flushed
/// Redis has forgotten it; a NOSCRIPT reply counts as a lost connection.
fn load_script(connection: &mut Connection) -> Result<(), String> {
    if !connection.script_loaded {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(DEDUPE_SCRIPT)
            .query::<String>(&mut connection.inner)
            .map_err(|e| describe(&e))?;
        connection.script_loaded = true;
    }
    Ok(())
}

/// A client error as Redis words it (`NOPERM this user has no permissions ...`) when Redis
/// answered, and as the client does otherwise (an I/O error, a timeout).
fn describe(error: &redis::RedisError) -> String {
    match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => error.to_string(),
    }
}

/// An error reply as Redis words it: `WRONGTYPE Operation against a key ...`.
fn reply_error(error: &redis::ServerError) -> String {
    match error.details() {
        Some(detail) => format!("{} {detail}", error.code()),
        None => error.code().to_string(),
    }
}

/// Why a request could not be answered event by event.
enum Failed {
    /// Redis said no to the whole request (NOAUTH, NOPERM, OOM ...): nobody is charged.
    Refused(String),
    /// The connection failed in the middle of the request (an I/O error, a timeout, a reply
    /// that makes no sense): Redis may be gone, or one event may have broken the connection.
    Broken(String),
}

fn handle(slot: &mut Option<Connection>, request: Request) -> Reply {
    match publish(slot, &request) {
        Ok(reply) => reply,
        Err(Failed::Refused(error)) => Reply::Unavailable(error),
        Err(Failed::Broken(error)) => {
            *slot = None;
            // Whether Redis itself is reachable tells a lost Redis from an event that cannot
            // be published (larger than Redis accepts, say): the first waits with backoff, the
            // second is charged to its event, alone.
            match connect(&request.target) {
                Err(_) => Reply::Unavailable(error),
                Ok(connection) => {
                    *slot = Some(connection);
                    isolate(slot, request, error)
                }
            }
        }
    }
}

/// Publishes the request's events one at a time, after a failure that a reachable Redis made
/// of the whole request: each event that fails alone is charged with its error.
fn isolate(slot: &mut Option<Connection>, request: Request, error: String) -> Reply {
    if request.events.len() <= 1 {
        return Reply::Answered {
            results: vec![Err(error); request.events.len()],
            markers: Vec::new(),
        };
    }
    let mut results = Vec::with_capacity(request.events.len());
    let mut markers = Vec::new();
    let mut committed_markers = request.committed_markers;
    for event in request.events {
        let single = Request {
            target: request.target.clone(),
            events: vec![event],
            committed_markers: std::mem::take(&mut committed_markers),
        };
        match publish(slot, &single) {
            Ok(Reply::Answered {
                results: mut one,
                markers: left,
            }) => {
                results.append(&mut one);
                markers.extend(left);
            }
            Ok(Reply::Unavailable(error)) | Err(Failed::Refused(error)) => {
                return Reply::Unavailable(error)
            }
            Err(Failed::Broken(error)) => match retry_alone(slot, &single, error) {
                Ok(Reply::Answered {
                    results: mut one,
                    markers: left,
                }) => {
                    results.append(&mut one);
                    markers.extend(left);
                }
                Ok(Reply::Unavailable(error)) => return Reply::Unavailable(error),
                Err(error) => results.push(Err(error)),
            },
        }
    }
    Reply::Answered { results, markers }
}

/// Sends one event again on a new connection, after it broke the one it was sent on (which an
/// earlier event may have left half-closed). `Err` is the event's own failure: it broke a fresh
/// connection too, while Redis still answers on another.
fn retry_alone(
    slot: &mut Option<Connection>,
    single: &Request,
    error: String,
) -> Result<Reply, String> {
    *slot = None;
    match connect(&single.target) {
        Err(_) => return Ok(Reply::Unavailable(error)),
        Ok(connection) => *slot = Some(connection),
    }
    match publish(slot, single) {
        Ok(reply) => Ok(reply),
        Err(Failed::Refused(error)) => Ok(Reply::Unavailable(error)),
        Err(Failed::Broken(error)) => {
            *slot = None;
            match connect(&single.target) {
                Err(_) => Ok(Reply::Unavailable(error)),
                Ok(connection) => {
                    *slot = Some(connection);
                    Err(error)
                }
            }
        }
    }
}

/// Sends the request as one pipeline on the slot's connection, opening one if needed.
fn publish(slot: &mut Option<Connection>, request: &Request) -> Result<Reply, Failed> {
    let target = &request.target;
    let reusable = matches!(slot, Some(c) if c.url == target.url && c.timeout == target.timeout);
    if !reusable {
        *slot = None;
        let connection = connect(target).map_err(|e| {
            Failed::Refused(format!(
                "cannot connect to {}: {e}",
                redis_url::mask(&target.url)
            ))
        })?;
        *slot = Some(connection);
    }
    let Some(connection) = slot.as_mut() else {
        return Err(Failed::Refused("no Redis connection".into()));
    };
    if target.dedupe {
        if let Err(e) = load_script(connection) {
            *slot = None;
            return Err(Failed::Refused(format!(
                "cannot load the dedupe script (outbox.dedupe needs EVALSHA and SCRIPT LOAD): {e}"
            )));
        }
    }
    let (pipeline, layout) = build_pipeline(request);
    let values = pipeline
        .query::<Vec<Value>>(&mut connection.inner)
        .map_err(|e| Failed::Broken(describe(&e)))?;
    if values.iter().any(closes_connection) {
        // Redis has closed this connection after its reply; the next request opens another.
        *slot = None;
    }
    read_replies(request, &layout, values).map_err(|failure| {
        if let Failed::Refused(_) = failure {
            // NOSCRIPT, or a server that is going away: start afresh next time.
            *slot = None;
        }
        failure
    })
}

/// How the pipeline's replies map back to events: per command, the batch positions it covers.
struct Layout {
    commands: Vec<Vec<usize>>,
    markers: Vec<Markers>,
}

fn build_pipeline(request: &Request) -> (redis::Pipeline, Layout) {
    let target = &request.target;
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for markers in &request.committed_markers {
        pipe.cmd("HDEL")
            .arg(&markers.hash)
            .arg(&markers.ids)
            .ignore();
    }
    let mut layout = Layout {
        commands: Vec::new(),
        markers: Vec::new(),
    };
    if target.dedupe {
        let ttl_ms = target.dedupe_ttl.as_millis() as u64;
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let period = marker_period(now_ms, ttl_ms);
        let namespace = &target.marker_namespace;
        for (stream, positions) in group_by_stream(&target.stream_prefix, &request.events) {
            let runs = shard_runs(&request.events, &positions);
            let cmd = pipe
                .cmd("EVALSHA")
                .arg(dedupe_script_sha())
                .arg(1 + 2 * runs.len())
                .arg(&stream);
            for (shard, run) in &runs {
                let prefix = &target.stream_prefix;
                let current = marker_key(prefix, namespace, period.current, *shard, &stream);
                let previous = marker_key(
                    prefix,
                    namespace,
                    period.current.saturating_sub(1),
                    *shard,
                    &stream,
                );
                cmd.arg(&current).arg(previous);
                layout.markers.push(Markers {
                    hash: current,
                    ids: run.iter().map(|&p| request.events[p].id).collect(),
                });
            }
            cmd.arg(target.stream_maxlen).arg(period.expires_at_ms);
            for (_, run) in &runs {
                cmd.arg(run.len());
            }
            for &p in &positions {
                cmd.arg(request.events[p].id);
            }
            for &p in &positions {
                let event = &request.events[p];
                cmd.arg(&event.topic)
                    .arg(&event.payload)
                    .arg(rfc3339(event.created_at));
            }
            layout.commands.push(positions);
        }
    } else {
        for (index, event) in request.events.iter().enumerate() {
            let cmd = pipe.cmd("XADD").arg(super::encode::stream_key(
                &target.stream_prefix,
                &event.topic,
            ));
            if target.stream_maxlen > 0 {
                cmd.arg("MAXLEN").arg("~").arg(target.stream_maxlen);
            }
            cmd.arg("*");
            for (name, value) in event.fields() {
                cmd.arg(name).arg(value.as_ref());
            }
            layout.commands.push(vec![index]);
        }
    }
    (pipe, layout)
}

/// Whether a reply is a protocol error, after which Redis closes the connection (a bulk
/// argument larger than `proto-max-bulk-len`, say).
fn closes_connection(value: &Value) -> bool {
    match value {
        Value::ServerError(e) => e
            .details()
            .is_some_and(|detail| detail.starts_with("Protocol error")),
        Value::Array(items) => items.iter().any(closes_connection),
        _ => false,
    }
}

/// Turns the pipeline's replies into per-event results. A server-wide error anywhere makes the
/// whole batch unavailable, so that no event is charged an attempt for it.
fn read_replies(request: &Request, layout: &Layout, values: Vec<Value>) -> Result<Reply, Failed> {
    if values.len() != layout.commands.len() {
        return Err(Failed::Broken(format!(
            "Redis answered {} replies to {} commands",
            values.len(),
            layout.commands.len()
        )));
    }
    let mut results: Vec<Result<(), String>> = vec![Ok(()); request.events.len()];
    for (value, positions) in values.into_iter().zip(&layout.commands) {
        match value {
            Value::ServerError(e) => {
                let message = reply_error(&e);
                if is_server_wide(e.code()) {
                    return Err(Failed::Refused(message));
                }
                for &p in positions {
                    results[p] = Err(message.clone());
                }
            }
            Value::Array(items) if request.target.dedupe => {
                if items.len() != positions.len() {
                    return Err(Failed::Broken(
                        "unexpected reply from the dedupe script".into(),
                    ));
                }
                for (item, &p) in items.into_iter().zip(positions) {
                    match item {
                        Value::BulkString(_) | Value::SimpleString(_) => {}
                        Value::ServerError(e) => {
                            if is_server_wide(e.code()) {
                                return Err(Failed::Refused(reply_error(&e)));
                            }
                            results[p] = Err(reply_error(&e));
                        }
                        other => {
                            return Err(Failed::Broken(format!(
                                "unexpected item from the dedupe script: {other:?}"
                            )))
                        }
                    }
                }
            }
            Value::BulkString(_) | Value::SimpleString(_) if !request.target.dedupe => {}
            other => {
                return Err(Failed::Broken(format!(
                    "unexpected reply from Redis: {other:?}"
                )))
            }
        }
    }
    Ok(Reply::Answered {
        results,
        markers: layout.markers.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_errors_are_per_event_and_the_rest_server_wide() {
        assert!(!is_server_wide("WRONGTYPE"));
        assert!(!is_server_wide("ERR"));
        for code in [
            "NOAUTH",
            "WRONGPASS",
            "OOM",
            "LOADING",
            "READONLY",
            "BUSY",
            "MISCONF",
            "NOPERM",
        ] {
            assert!(is_server_wide(code), "{code}");
        }
    }
}

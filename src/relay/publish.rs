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

/// Whether a Redis error code concerns one event (its key) or the whole server.
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
    let mut connection: Option<(Target, redis::Connection)> = None;
    for request in incoming {
        let reply = handle(&mut connection, request);
        if outgoing.send(reply).is_err() {
            return;
        }
    }
}

fn connect(target: &Target) -> Result<redis::Connection, String> {
    let client = redis::Client::open(target.url.as_str()).map_err(|e| e.to_string())?;
    let connection = client
        .get_connection_with_timeout(target.timeout)
        .map_err(|e| e.to_string())?;
    connection
        .set_read_timeout(Some(target.timeout))
        .map_err(|e| e.to_string())?;
    connection
        .set_write_timeout(Some(target.timeout))
        .map_err(|e| e.to_string())?;
    let mut connection = connection;
    // Loaded on every new connection: a restarted or flushed Redis has forgotten it, and a
    // NOSCRIPT reply counts as a lost connection.
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(DEDUPE_SCRIPT)
        .query::<String>(&mut connection)
        .map_err(|e| e.to_string())?;
    Ok(connection)
}

fn handle(slot: &mut Option<(Target, redis::Connection)>, request: Request) -> Reply {
    let reusable = matches!(slot, Some((t, _)) if t.url == request.target.url && t.timeout == request.target.timeout);
    if !reusable {
        *slot = None;
        match connect(&request.target) {
            Ok(connection) => *slot = Some((request.target.clone(), connection)),
            Err(e) => {
                return Reply::Unavailable(format!(
                    "cannot connect to {}: {e}",
                    redis_url::mask(&request.target.url)
                ))
            }
        }
    }
    let Some((_, connection)) = slot.as_mut() else {
        return Reply::Unavailable("no Redis connection".into());
    };

    let (pipeline, layout) = build_pipeline(&request);
    match pipeline.query::<Vec<Value>>(connection) {
        Ok(values) => match read_replies(&request, &layout, values) {
            Ok(reply) => reply,
            Err(e) => {
                *slot = None;
                Reply::Unavailable(e)
            }
        },
        Err(e) => {
            *slot = None;
            Reply::Unavailable(e.to_string())
        }
    }
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
                let current = marker_key(namespace, period.current, *shard, &stream);
                let previous =
                    marker_key(namespace, period.current.saturating_sub(1), *shard, &stream);
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

/// Turns the pipeline's replies into per-event results. A server-wide error anywhere makes the
/// whole batch unavailable, so that no event is charged an attempt for it.
fn read_replies(request: &Request, layout: &Layout, values: Vec<Value>) -> Result<Reply, String> {
    if values.len() != layout.commands.len() {
        return Err(format!(
            "Redis answered {} replies to {} commands",
            values.len(),
            layout.commands.len()
        ));
    }
    let mut results: Vec<Result<(), String>> = vec![Ok(()); request.events.len()];
    for (value, positions) in values.into_iter().zip(&layout.commands) {
        match value {
            Value::ServerError(e) => {
                let message = e.to_string();
                if is_server_wide(e.code()) {
                    return Err(message);
                }
                for &p in positions {
                    results[p] = Err(message.clone());
                }
            }
            Value::Array(items) if request.target.dedupe => {
                if items.len() != positions.len() {
                    return Err("unexpected reply from the dedupe script".into());
                }
                for (item, &p) in items.into_iter().zip(positions) {
                    match item {
                        Value::BulkString(_) | Value::SimpleString(_) => {}
                        Value::ServerError(e) => {
                            if is_server_wide(e.code()) {
                                return Err(e.to_string());
                            }
                            results[p] = Err(e.to_string());
                        }
                        other => {
                            return Err(format!(
                                "unexpected item from the dedupe script: {other:?}"
                            ))
                        }
                    }
                }
            }
            Value::BulkString(_) | Value::SimpleString(_) if !request.target.dedupe => {}
            other => return Err(format!("unexpected reply from Redis: {other:?}")),
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
        ] {
            assert!(is_server_wide(code), "{code}");
        }
    }
}

//! How a round trip's replies map back to a chunk's events: the layout a pipeline was built
//! with, and the outcome per event it reads from the replies; which errors concern one event and
//! which the whole server.

use std::collections::BTreeSet;

use redis::Value;

use crate::error::Error;
use crate::outcome::{Answer, Failed, Markers, Outcome};

/// An error reply as Redis words it: `WRONGTYPE Operation against a key ...`.
pub fn reply_error(error: &redis::ServerError) -> String {
    match error.details() {
        Some(detail) => format!("{} {detail}", error.code()),
        None => error.code().to_string(),
    }
}

/// The text of an error a script's `redis.pcall` gave, as a reply gives it: Redis 6.2 puts the
/// script's place and a `-` before it (`@user_script: 194: -OOM command not allowed ...\r\n`),
/// which would hide its code.
pub fn script_error(text: &str) -> &str {
    let text = text.trim_end();
    let text = match text.strip_prefix("@user_script:") {
        Some(rest) => rest.split_once(": ").map_or(rest, |(_, error)| error),
        None => text,
    };
    text.trim_start_matches('-')
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

/// How the pipeline's replies map back to events: per command, the batch positions it covers.
pub struct Layout {
    /// Replies to trimming by age, read before the events': an error there fails no event (the
    /// entries are in), and is reported beside the outcomes.
    pub(super) leading: usize,
    /// Whether the events' commands are calls of the markers' script.
    pub(super) script: bool,
    /// Whether they are calls of `add.lua` with IDMP, which answers 0 when its stream does not
    /// exist.
    pub(super) idmp: bool,
    pub(super) covers: Covers,
    pub(super) markers: Vec<Markers>,
    /// The hash slots of the streams written, for `WAIT` on a cluster (gathered only then).
    pub slots: BTreeSet<u16>,
}

/// The batch positions each of the chunk's own commands covers.
pub(super) enum Covers {
    /// An `XADD` per event: command `k` covers the event at position `k`, of so many.
    Each(usize),
    /// A script call per stream (the markers' or `add.lua`), covering that stream's events.
    Streams(Vec<Vec<usize>>),
}

impl Covers {
    fn len(&self) -> usize {
        match self {
            Covers::Each(count) => *count,
            Covers::Streams(calls) => calls.len(),
        }
    }
}

/// Whether a reply is a protocol error, after which Redis closes the connection (a bulk
/// argument larger than `proto-max-bulk-len`, say).
pub fn closes_connection(value: &Value) -> bool {
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
pub fn read(events: usize, layout: &Layout, values: Vec<Value>) -> Result<Answer, Failed> {
    if values.len() != layout.leading + layout.covers.len() {
        return Err(Failed::Broken(format!(
            "Redis answered {} replies to {} commands",
            values.len(),
            layout.leading + layout.covers.len()
        )));
    }
    let mut values = values.into_iter();
    let mut trim_error = None;
    for value in values.by_ref().take(layout.leading) {
        if let Value::ServerError(e) = value {
            trim_error.get_or_insert_with(|| format!("XTRIM: {}", reply_error(&e)));
        }
    }
    let mut results = vec![Outcome::Added; events];
    let mut missing = Vec::new();
    for (command, value) in values.enumerate() {
        let positions: &[usize] = match &layout.covers {
            Covers::Each(_) => std::slice::from_ref(&command),
            Covers::Streams(calls) => &calls[command],
        };
        match value {
            Value::ServerError(e) => {
                let message = reply_error(&e);
                if is_server_wide(e.code()) {
                    return Err(Failed::Refused(Error::Refused(message)));
                }
                for &p in positions {
                    results[p] = Outcome::Failed(message.clone());
                }
            }
            Value::Array(items) if matches!(layout.covers, Covers::Streams(_)) => {
                script_refusals(items, positions, &mut results)?;
            }
            Value::BulkString(_) | Value::SimpleString(_)
                if matches!(layout.covers, Covers::Each(_)) => {}
            // The IDMP script's stream does not exist: it added nothing.
            Value::Int(0) if layout.idmp => missing.extend_from_slice(positions),
            other => {
                return Err(Failed::Broken(format!(
                    "unexpected reply from Redis: {other:?}"
                )))
            }
        }
    }
    Ok(Answer {
        results,
        markers: layout.markers.clone(),
        trim_error,
        missing,
    })
}

/// A script's reply: pairs of an event's position in the script's share (from 1) and the error
/// `XADD` gave it, each failing its event at `positions`; the events not named are in the
/// stream. A server-wide error refuses the chunk.
fn script_refusals(
    items: Vec<Value>,
    positions: &[usize],
    results: &mut [Outcome],
) -> Result<(), Failed> {
    if !items.len().is_multiple_of(2) {
        return Err(Failed::Broken(
            "unexpected reply from the dedupe script".into(),
        ));
    }
    let mut items = items.into_iter();
    while let (Some(position), Some(error)) = (items.next(), items.next()) {
        let p = match position {
            Value::Int(at) if at >= 1 && (at as usize) <= positions.len() => {
                positions[at as usize - 1]
            }
            other => {
                return Err(Failed::Broken(format!(
                    "unexpected position from the dedupe script: {other:?}"
                )))
            }
        };
        let message = match error {
            Value::BulkString(text) => script_error(&String::from_utf8_lossy(&text)).to_string(),
            Value::SimpleString(text) => script_error(&text).to_string(),
            other => {
                return Err(Failed::Broken(format!(
                    "unexpected error from the dedupe script: {other:?}"
                )))
            }
        };
        if is_server_wide(message.split(' ').next().unwrap_or("")) {
            return Err(Failed::Refused(Error::Refused(message)));
        }
        results[p] = Outcome::Failed(message);
    }
    Ok(())
}

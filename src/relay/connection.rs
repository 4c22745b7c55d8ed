//! The Redis thread's connection: opening it (and checking that Redis answers), loading the
//! dedupe script, and sending a chunk, with the isolation of an event that breaks the
//! connection while Redis itself stays reachable.

use std::time::Duration;

use redis::Value;

use super::pipeline::{self, Answer, Chunk, DEDUPE_SCRIPT};
use super::publish::Target;
use crate::redis_url;

/// One connection to Redis, and what it was opened for.
pub struct Connection {
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

/// Why a chunk could not be answered event by event.
pub enum Failed {
    /// Redis said no to the whole chunk (NOAUTH, NOPERM, OOM ...): nobody is charged.
    Refused(String),
    /// The connection failed in the middle of the chunk (an I/O error, a timeout, a reply
    /// that makes no sense): Redis may be gone, or one event may have broken the connection.
    Broken(String),
}

/// Publishes a chunk; `Err` says why Redis could not be used at all (nothing may be marked).
pub fn publish(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, String> {
    match send(slot, chunk) {
        Ok(answer) => Ok(answer),
        Err(Failed::Refused(error)) => Err(error),
        Err(Failed::Broken(error)) => {
            // Whether Redis itself is reachable tells a lost Redis from an event that cannot
            // be published (larger than Redis accepts, say): the first waits with backoff, the
            // second is charged to its event, alone.
            reopen(slot, chunk.target).map_err(|_| error)?;
            isolate(slot, chunk)
        }
    }
}

/// Replaces the slot's connection with a new one; `Err` if Redis does not answer on it.
fn reopen(slot: &mut Option<Connection>, target: &Target) -> Result<(), String> {
    *slot = None;
    *slot = Some(connect(target)?);
    Ok(())
}

/// Publishes the chunk's events one at a time, after a failure that a reachable Redis made of
/// the whole chunk: each event that fails alone is charged with its error.
fn isolate(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, String> {
    let mut results = Vec::with_capacity(chunk.events.len());
    let mut markers = Vec::new();
    for (i, event) in chunk.events.iter().enumerate() {
        let single = Chunk {
            target: chunk.target,
            events: std::slice::from_ref(event),
            cleanup: if i == 0 { chunk.cleanup } else { &[] },
        };
        let mut answer = send_alone(slot, &single)?;
        results.append(&mut answer.results);
        markers.append(&mut answer.markers);
    }
    Ok(Answer { results, markers })
}

/// Sends a chunk of one event. If it breaks the connection, which an earlier event may have
/// left half-closed, it is sent once more on a fresh one: only an event that breaks a fresh
/// connection too, while Redis still answers on another, is charged.
fn send_alone(slot: &mut Option<Connection>, single: &Chunk) -> Result<Answer, String> {
    let mut tries = 0;
    loop {
        tries += 1;
        match send(slot, single) {
            Ok(answer) => return Ok(answer),
            Err(Failed::Refused(error)) => return Err(error),
            Err(Failed::Broken(error)) => {
                reopen(slot, single.target).map_err(|_| error.clone())?;
                if tries == 2 {
                    return Ok(Answer {
                        results: vec![Err(error)],
                        markers: Vec::new(),
                    });
                }
            }
        }
    }
}

/// Sends the chunk as one pipeline on the slot's connection, opening one if needed.
pub fn send(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, Failed> {
    let target = chunk.target;
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
    let (pipeline, layout) = pipeline::build(chunk);
    let values = pipeline
        .query::<Vec<Value>>(&mut connection.inner)
        .map_err(|e| Failed::Broken(describe(&e)))?;
    if values.iter().any(pipeline::closes_connection) {
        // Redis has closed this connection after its reply; the next chunk opens another.
        *slot = None;
    }
    pipeline::read(chunk, &layout, values).map_err(|failure| {
        if let Failed::Refused(_) = failure {
            // NOSCRIPT, or a server that is going away: start afresh next time.
            *slot = None;
        }
        failure
    })
}

//! The Redis thread's connection: opening it (checking that Redis answers, and what its servers
//! can do), loading the dedupe script, and sending a chunk, with the isolation of an event that
//! breaks the connection while Redis itself stays reachable.

use std::cell::Cell;
use std::collections::HashSet;

use crate::encode::{group_by_stream, stream_key, Event};
use crate::error::{describe, Error};
use crate::idmp;
use crate::link::{self, Link};
use crate::one_by_one::OneByOne;
use crate::outcome::{Answer, Failed, Markers, Outcome};
use crate::pipeline::{self, Chunk, Layout, Shape};
use crate::resp::Packed;
use crate::scripts::{ScriptCall, DEDUPE};
use crate::server::{self, Features, InUse};
use crate::target::Target;

/// A link to Redis, and what it was opened for.
pub struct Connection {
    /// The target's settings that the link depends on.
    opened_for: Target,
    link: Link,
    /// Whether the dedupe script is loaded (only needed, and only asked for, with markers and
    /// one server; a cluster is sent the script whole).
    script_loaded: bool,
    /// What every node written to can do, asked when the link opened.
    pub features: Features,
    /// Streams whose IDMP window this connection has seen to.
    configured: HashSet<String>,
    /// Whether Redis refused to size a window (the user's ACL names no `XINFO` or `XCFGSET`):
    /// markers then record no IDMP identity on this connection.
    windows_refused: bool,
    /// Whether the user may run `EVAL`, once asked (only without dedupe, see
    /// [`may_run_scripts`]).
    may_script: Option<bool>,
    /// How the last chunk was deduplicated.
    pub in_use: Option<InUse>,
    /// The last round trip's buffer, emptied, for the next.
    spare: Packed,
}

/// Whether a link opened for `old` serves `new`: the settings that shape the Redis side of a
/// chunk (prefix, dedupe ...) are read per chunk, the others need a new link.
fn same_link(old: &Target, new: &Target) -> bool {
    old.url == new.url
        && old.mode == new.mode
        && old.sentinel_master == new.sentinel_master
        && old.tls == new.tls
        && old.password_file == new.password_file
        && old.sentinel_password_file == new.sentinel_password_file
        && old.url_refused == new.url_refused
        && old.timeout == new.timeout
        && (old.wait_replicas > 0) == (new.wait_replicas > 0)
}

/// Opens a link and checks that Redis answers on it.
fn connect(target: &Target) -> Result<Connection, Error> {
    let mut link = link::open(target)?;
    let features = server::features(&link.servers());
    Ok(Connection {
        opened_for: target.clone(),
        link,
        script_loaded: false,
        features,
        configured: HashSet::new(),
        windows_refused: false,
        may_script: None,
        in_use: None,
        spare: Packed::default(),
    })
}

/// Loads the dedupe script on a server that has not loaded it. A restarted or flushed Redis
/// has forgotten it; a NOSCRIPT reply counts as a lost connection.
fn load_script(connection: &mut Connection) -> Result<(), Error> {
    if !connection.script_loaded && !connection.link.is_cluster() {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(DEDUPE);
        connection
            .link
            .run::<String>(&load)
            .map_err(|e| Error::from_redis(&e))?;
        connection.script_loaded = true;
    }
    Ok(())
}

/// Gives the chunk's streams that this connection has not seen to their IDMP window, in a round
/// trip of their own before the events': an event added to a stream with a smaller window
/// (Redis's default keeps 100 ids for 100 s) could be added again after a crash. A key that is
/// not a stream is left to the XADDs, which fail their events; a refusal (`NOPERM`) refuses the
/// chunk, whose events then wait, uncharged.
fn size_windows(connection: &mut Connection, chunk: &Chunk) -> Result<(), Failed> {
    let streams: Vec<String> = group_by_stream(&chunk.target.stream_prefix, chunk.events)
        .into_iter()
        .map(|(stream, _)| stream)
        .filter(|stream| !connection.configured.contains(stream))
        .collect();
    if streams.is_empty() {
        return Ok(());
    }
    let mut commands = Packed::default();
    for stream in &streams {
        commands.push(&idmp::configure(stream, chunk.target.dedupe_ttl));
    }
    let (values, _) = connection
        .link
        .pipeline(&commands, 0)
        .map_err(|e| Failed::Broken(describe(&e)))?;
    for value in &values {
        if let redis::Value::ServerError(e) = value {
            if pipeline::is_server_wide(e.code()) {
                return Err(Failed::Refused(Error::Refused(format!(
                    "cannot size a stream's IDMP window: {}",
                    pipeline::reply_error(e)
                ))));
            }
        }
    }
    connection.configured.extend(streams);
    Ok(())
}

/// Whether the connection's user may run `EVAL`, asked once per connection, without dedupe: a
/// stream's share of a chunk then goes as one call of `add.lua`, which adds nothing after an
/// event Redis refused, so that memory freed in the middle of a round trip cannot put a key's
/// later events before its earlier ones. A user the README's rights for `off` allow (`+xadd`
/// alone) sends plain `XADD`s, one per event, which that can reorder.
fn may_run_scripts(connection: &mut Connection) -> Result<bool, Failed> {
    if let Some(may) = connection.may_script {
        return Ok(may);
    }
    let mut probe = redis::cmd("EVAL");
    probe.arg("return 1").arg(0);
    let may = match connection.link.run::<i64>(&probe) {
        Ok(_) => true,
        Err(e) if e.code() == Some("NOPERM") => false,
        Err(e) if e.code().is_some() => return Err(Failed::Refused(Error::from_redis(&e))),
        Err(e) => return Err(Failed::Broken(describe(&e))),
    };
    connection.may_script = Some(may);
    Ok(may)
}

/// Some of `chunk`'s events, sent on their own: the way the chunk went (if it went) is in doubt
/// for them too.
fn part_of<'a>(chunk: &Chunk<'a>, events: &'a [Event], cleanup: &'a [Markers]) -> Chunk<'a> {
    Chunk {
        target: chunk.target,
        events,
        cleanup,
        in_doubt: chunk.sent_as.get().or(chunk.in_doubt),
        sent_as: Cell::new(None),
    }
}

/// Publishes a chunk; `Err` says why Redis could not be used at all (nothing may be marked).
pub fn publish(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, Error> {
    match send(slot, chunk) {
        Ok(answer) => Ok(answer),
        Err(Failed::Refused(error)) => Err(error),
        Err(Failed::Broken(error)) => {
            // Whether Redis itself is reachable tells a lost Redis from an event that cannot
            // be published (larger than Redis accepts, say): the first waits with backoff, the
            // second is charged to its event, alone.
            reopen(slot, chunk.target).map_err(|_| Error::Unreachable(error))?;
            isolate(slot, chunk)
        }
    }
}

/// Replaces the slot's connection with a new one; `Err` if Redis does not answer on it.
fn reopen(slot: &mut Option<Connection>, target: &Target) -> Result<(), Error> {
    *slot = None;
    *slot = Some(connect(target)?);
    Ok(())
}

/// Publishes the chunk's events one at a time, after a failure that a reachable Redis made of
/// the whole chunk: each event that fails alone is charged with its error, and the later events
/// of its key (else topic) are held back, not sent.
fn isolate(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, Error> {
    let mut results = Vec::with_capacity(chunk.events.len());
    let mut markers = Vec::new();
    let mut trim_error = None;
    let mut stops = OneByOne::default();
    let mut cleanup = chunk.cleanup;
    for event in chunk.events {
        if !stops.may_send(event) {
            results.push(Outcome::HeldBack);
            continue;
        }
        let single = part_of(
            chunk,
            std::slice::from_ref(event),
            std::mem::take(&mut cleanup),
        );
        let sent = send_alone(slot, &single);
        chunk
            .sent_as
            .set(chunk.sent_as.get().or(single.sent_as.get()));
        let mut answer = sent?;
        stops.sent(event, &answer.results);
        results.append(&mut answer.results);
        markers.append(&mut answer.markers);
        trim_error = trim_error.or(answer.trim_error);
    }
    Ok(Answer {
        results,
        markers,
        trim_error,
        missing: Vec::new(),
    })
}

/// Sends a chunk of one event. If it breaks the connection, which an earlier event may have
/// left half-closed, it is sent once more on a fresh one: only an event that breaks a fresh
/// connection too, while Redis still answers on another, is charged.
fn send_alone(slot: &mut Option<Connection>, single: &Chunk) -> Result<Answer, Error> {
    let mut tries = 0;
    loop {
        tries += 1;
        match send(slot, single) {
            Ok(answer) => return Ok(answer),
            Err(Failed::Refused(error)) => return Err(error),
            Err(Failed::Broken(error)) => {
                reopen(slot, single.target).map_err(|_| Error::Unreachable(error.clone()))?;
                if tries == 2 {
                    return Ok(Answer {
                        results: vec![Outcome::Failed(error)],
                        markers: Vec::new(),
                        trim_error: None,
                        missing: Vec::new(),
                    });
                }
            }
        }
    }
}

/// Sends the chunk as [`send_once`] does; with IDMP, events whose stream was gone (deleted or
/// flushed since this connection gave it its window) go again once the stream has it.
pub fn send(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, Failed> {
    let mut answer = send_once(slot, chunk)?;
    if answer.missing.is_empty() {
        return Ok(answer);
    }
    let again: Vec<Event> = answer
        .missing
        .iter()
        .map(|&p| chunk.events[p].clone())
        .collect();
    if let Some(connection) = slot.as_mut() {
        for event in &again {
            let stream = stream_key(&chunk.target.stream_prefix, &event.topic);
            connection.configured.remove(&stream);
        }
    }
    let retry = part_of(chunk, &again, &[]);
    let second = send_once(slot, &retry)?;
    if !second.missing.is_empty() {
        return Err(Failed::Refused(Error::Refused(
            "streams were deleted again as soon as the relay created them".into(),
        )));
    }
    for (outcome, &p) in second.results.into_iter().zip(&answer.missing) {
        answer.results[p] = outcome;
    }
    answer.missing.clear();
    answer.trim_error = answer.trim_error.or(second.trim_error);
    Ok(answer)
}

/// Sends the chunk as one pipeline on the slot's connection (one per node of a cluster),
/// opening one if needed; with `outbox.redis_wait_replicas`, waits for the replicas before it
/// answers.
fn send_once(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<Answer, Failed> {
    open_if_needed(slot, chunk.target)?;
    let (script, shape) = shape_for(slot, chunk)?;
    let Some(connection) = slot.as_mut() else {
        return Err(Failed::Refused(Error::Unreachable(
            "no Redis connection".into(),
        )));
    };
    let built = pipeline::build(chunk, script, &shape, std::mem::take(&mut connection.spare));
    let layout = built.layout;
    // From here on Redis may have the events, deduplicated this way.
    chunk.sent_as.set(Some(shape.dedupe));
    let sent = connection.link.pipeline(&built.commands, built.ignored);
    connection.spare = built.commands.emptied();
    let (values, resent) = match sent {
        Ok(answer) => answer,
        // A cluster that could not place a command (a slot without a primary, a redirection
        // that kept failing) or refused it outright: Redis is there, but not usable yet.
        Err(e) if connection.link.is_cluster() && e.code().is_some() => {
            return Err(Failed::Refused(Error::from_redis(&e)))
        }
        Err(e) => return Err(Failed::Broken(describe(&e))),
    };
    if values.iter().any(pipeline::closes_connection) {
        // Redis has closed this connection after its reply; the next chunk opens another.
        *slot = None;
    }
    let answer = pipeline::read(chunk, &layout, values).map_err(|failure| {
        if let Failed::Refused(_) = failure {
            // NOSCRIPT, or a server that is going away: start afresh next time.
            *slot = None;
        }
        failure
    })?;
    if chunk.target.wait_replicas > 0 {
        wait_for_replicas(slot, chunk.target, &layout, resent, &answer)?;
    }
    Ok(answer)
}

/// Opens a connection in the slot if it has none, or one for other settings.
fn open_if_needed(slot: &mut Option<Connection>, target: &Target) -> Result<(), Failed> {
    if matches!(slot, Some(c) if same_link(&c.opened_for, target)) {
        return Ok(());
    }
    *slot = None;
    if let Some(why) = target.url_refused {
        return Err(Failed::Refused(Error::Setting(why.to_string())));
    }
    let connection = connect(target).map_err(|e| {
        Failed::Refused(e.context(format_args!("cannot connect to {}", target.url)))
    })?;
    *slot = Some(connection);
    Ok(())
}

/// How the chunk goes out on the slot's connection: deduplicated as the settings, the servers
/// and the chunks in doubt allow, with the script loaded where markers need it (a script that
/// cannot be loaded drops the connection), the streams' IDMP windows sized where IDMP needs
/// them, and the shape of the round trip.
fn shape_for(slot: &mut Option<Connection>, chunk: &Chunk) -> Result<(ScriptCall, Shape), Failed> {
    let Some(connection) = slot.as_mut() else {
        return Err(Failed::Refused(Error::Unreachable(
            "no Redis connection".into(),
        )));
    };
    let in_use =
        server::choose_with_doubt(chunk.target.dedupe, &connection.features, chunk.in_doubt)
            .map_err(Failed::Refused)?;
    connection.in_use = Some(in_use);
    if in_use == InUse::Markers {
        if let Err(e) = load_script(connection) {
            *slot = None;
            return Err(Failed::Refused(e.context(
                "cannot load the dedupe script (dedupe with markers needs EVALSHA and SCRIPT LOAD)",
            )));
        }
    }
    let script = if connection.link.is_cluster() {
        ScriptCall::Whole
    } else {
        ScriptCall::BySha
    };
    // Markers record IDMP's identities too where every node has IDMP (see `Shape::idmp`), in
    // windows of the size IDMP needs; a user who may not size them (the ACL the README gives for
    // markers) deduplicates with markers alone.
    let mut idmp_too =
        in_use == InUse::Markers && connection.features.idmp && !connection.windows_refused;
    if in_use == InUse::Idmp {
        size_windows(connection, chunk)?;
    } else if idmp_too {
        match size_windows(connection, chunk) {
            Ok(()) => {}
            Err(Failed::Refused(_)) => {
                connection.windows_refused = true;
                idmp_too = false;
            }
            Err(broken) => return Err(broken),
        }
    }
    let plain = in_use == InUse::Off && !may_run_scripts(connection)?;
    let shape = Shape {
        dedupe: in_use,
        acked: chunk.target.stream_trim_acked && connection.features.acked,
        idmp: idmp_too,
        plain,
    };
    Ok((script, shape))
}

/// `outbox.redis_wait_replicas`: the chunk counts as published only once that many replicas
/// acknowledged it; `resent` says whether slots moved under it.
fn wait_for_replicas(
    slot: &mut Option<Connection>,
    target: &Target,
    layout: &Layout,
    resent: bool,
    answer: &Answer,
) -> Result<(), Failed> {
    let wanted = target.wait_replicas;
    if resent {
        // Slots moved under the chunk: a WAIT now goes by the new map, and may ask a node whose
        // connection wrote nothing. The chunk is published again once the cluster has settled
        // (its markers absorb what is already there).
        return Err(Failed::Refused(Error::Refused(
            "slots moved during the chunk, so WAIT cannot vouch for it; it is published again"
                .into(),
        )));
    }
    if !answer.results.contains(&Outcome::Added) {
        return Ok(());
    }
    let Some(connection) = slot.as_mut() else {
        // A reply closed the connection (an event too large, say): taken apart, the chunk
        // charges that event alone.
        return Err(Failed::Broken(
            "Redis closed the connection before WAIT".into(),
        ));
    };
    let acknowledged = connection
        .link
        .wait(wanted, target.timeout, &layout.slots)
        .map_err(|e| {
            let error = format!("WAIT failed: {}", describe(&e));
            if e.code().is_some() {
                Failed::Refused(Error::Refused(error))
            } else {
                Failed::Broken(error)
            }
        })?;
    if acknowledged < wanted {
        return Err(Failed::Refused(Error::Refused(format!(
            "WAIT: {acknowledged} of the {wanted} replicas asked for (outbox.redis_wait_replicas) \
             acknowledged the chunk within {} ms; it is published again later",
            target.timeout.as_millis()
        ))));
    }
    Ok(())
}

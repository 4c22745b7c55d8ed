//! One round trip to Redis as a pipeline: the commands that publish a chunk of events (a script
//! call per stream: with markers, or with IDMP or no dedupe; plain XADDs without dedupe for a
//! user who may not run scripts), the deletion of
//! markers whose batch committed, trimming by age, and how the replies map back to events. No
//! I/O here.

use std::cell::Cell;
use std::collections::hash_map::RandomState;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{SystemTime, UNIX_EPOCH};

use redis::Value;

use crate::encode::{
    group_by_stream, key_slot, marker_key, marker_period, optional_fields, rfc3339, rfc3339_arg,
    shard_runs, Event,
};
use crate::outcome::{Answer, Failed, Markers, Outcome};
use crate::resp::{Args, Packed};
use crate::scripts::{ScriptCall, ADD_SCRIPT, DEDUPE_SCRIPT};
use crate::server::InUse;
use crate::target::Target;
use crate::{idmp, xadd};

/// The hash field a script call's markers go to: unique to the call, among all the relay's
/// processes, so that a call never overwrites the markers another left (in a retry after a
/// crash, say). Starts with a letter: a field named by a number is a marker an earlier version
/// wrote for one event.
fn marker_field() -> String {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static CALLS: AtomicU64 = AtomicU64::new(0);
    // The standard library keys a `RandomState` from the operating system's randomness.
    let seed = *SEED.get_or_init(|| RandomState::new().hash_one(std::process::id()));
    format!(
        "m{seed:016x}.{:x}",
        CALLS.fetch_add(1, AtomicOrdering::Relaxed)
    )
}

/// One round trip's worth of work.
pub struct Chunk<'a> {
    pub target: &'a Target,
    pub events: &'a [Event],
    /// Markers of batches whose transaction has committed, deleted on the way.
    pub cleanup: &'a [Markers],
    /// How the chunks sent since the last commit were deduplicated (see
    /// [`crate::server::choose_with_doubt`]).
    pub in_doubt: Option<InUse>,
    /// How this chunk was deduplicated, once it was sent (or may have been).
    pub sent_as: Cell<Option<InUse>>,
}

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

/// What the connection a chunk goes out on can do.
pub struct Shape {
    pub dedupe: InUse,
    /// Whether every node trims with `ACKED` (and `outbox.stream_trim_acked` asks for it).
    pub acked: bool,
    /// Whether every node has IDMP: markers then record each event's IDMP identity too, so that
    /// a chunk in doubt sent again the other way (the setting switched while a relay process
    /// died) adds nothing twice.
    pub idmp: bool,
    /// Whether a chunk without dedupe goes as plain `XADD`s, one per event (its user may not run
    /// `EVAL`), rather than as a call of `add.lua` per stream.
    pub plain: bool,
}

/// How the pipeline's replies map back to events: per command, the batch positions it covers.
pub struct Layout {
    /// Replies to trimming by age, read before the events': an error there fails no event (the
    /// entries are in), and is reported beside the outcomes.
    leading: usize,
    /// Whether the events' commands are calls of the markers' script.
    script: bool,
    /// Whether they are calls of `add.lua` with IDMP, which answers 0 when its stream does not
    /// exist.
    idmp: bool,
    covers: Covers,
    markers: Vec<Markers>,
    /// The hash slots of the streams written, for `WAIT` on a cluster (gathered only then).
    pub slots: BTreeSet<u16>,
}

/// The batch positions each of the chunk's own commands covers.
enum Covers {
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

/// The commands of one round trip: first the marker deletions (`ignored` of them, whose replies
/// nobody reads), then the chunk's own commands, one reply each, as the layout says.
pub struct Commands {
    pub commands: Packed,
    pub ignored: usize,
    pub layout: Layout,
}

/// `XADD`'s trimming arguments, where it trims.
fn trim_args(cmd: &mut Args<'_>, target: &Target, acked: bool) {
    if target.stream_maxlen > 0 {
        if acked {
            cmd.arg("ACKED");
        }
        cmd.arg("MAXLEN").arg("~").uint(target.stream_maxlen);
    }
}

/// Writes the chunk's round trip into `commands`, an empty buffer (kept from the connection's
/// last round trip, so that a chunk's hundreds of kilobytes are not asked of the allocator
/// each time).
pub fn build(chunk: &Chunk, script: ScriptCall, shape: &Shape, mut commands: Packed) -> Commands {
    let target = chunk.target;
    let bytes: usize = chunk
        .events
        .iter()
        .map(|event| 300 + event.text_bytes())
        .sum();
    commands.reserve(bytes);
    for markers in chunk.cleanup {
        commands.command(|cmd| {
            cmd.arg("HDEL").arg(&markers.hash).arg(&markers.field);
        });
    }
    let ignored = commands.len();
    // The slots written matter only to a WAIT after the chunk.
    let waits = target.wait_replicas > 0;
    let mut layout = Layout {
        leading: 0,
        script: shape.dedupe == InUse::Markers,
        idmp: shape.dedupe == InUse::Idmp,
        covers: Covers::Each(0),
        markers: Vec::new(),
        slots: BTreeSet::new(),
    };
    if !target.stream_max_age.is_zero() {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let oldest_ms = now_ms.saturating_sub(target.stream_max_age.as_millis() as u64);
        for (stream, _) in group_by_stream(&target.stream_prefix, chunk.events) {
            commands.command(|trim| {
                trim.arg("XTRIM")
                    .arg(&stream)
                    .arg("MINID")
                    .arg("~")
                    .uint(oldest_ms);
                if shape.acked {
                    trim.arg("ACKED");
                }
            });
        }
        layout.leading = commands.len() - ignored;
    }
    if layout.script {
        let ttl_ms = target.dedupe_ttl.as_millis() as u64;
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let period = marker_period(now_ms, ttl_ms);
        let namespace = &target.marker_namespace;
        let mut calls = Vec::new();
        let mut producers = idmp::Producers::default();
        let stamps: Vec<String> = chunk
            .events
            .iter()
            .map(|event| rfc3339(event.created_at))
            .collect();
        // The script's first argument, the same for every stream of the chunk.
        let acked = if shape.acked { "a" } else { "" };
        let window = if shape.idmp {
            format!(
                "i:{}:{}",
                idmp::window_seconds(target.dedupe_ttl),
                idmp::WINDOW_IDS
            )
        } else {
            String::new()
        };
        let bound = format!("{}{acked}{window}", target.stream_maxlen);
        for (stream, positions) in group_by_stream(&target.stream_prefix, chunk.events) {
            let runs = shard_runs(chunk.events, &positions);
            let mut cmd = DEDUPE_SCRIPT.call(script);
            cmd.arg(1 + 2 * runs.len()).arg(&stream);
            let field = marker_field();
            for (shard, _) in &runs {
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
                    field: field.clone(),
                });
            }
            let topic = &chunk.events[positions[0]].topic;
            let shapes = optional_fields(chunk.events, &positions);
            cmd.arg(&bound)
                .arg(period.expires_at_ms)
                .arg(topic)
                .arg(shapes)
                .arg(&field);
            for (_, run) in &runs {
                let mut marker = String::with_capacity(run.len() * 40);
                for &p in run {
                    if !marker.is_empty() {
                        marker.push(';');
                    }
                    let _ = write!(marker, "{}|{}", chunk.events[p].id, stamps[p]);
                }
                cmd.arg(run.len()).arg(marker);
            }
            for &p in &positions {
                cmd.arg(chunk.events[p].id);
            }
            for &p in &positions {
                let event = &chunk.events[p];
                cmd.arg(&event.payload).arg(&stamps[p]);
                if shape.idmp {
                    cmd.arg(producers.of(&target.marker_namespace, event.group))
                        .arg(idmp::identity(event.id, event.created_at));
                }
                if let Some(key) = &event.key {
                    cmd.arg(key);
                }
                if let Some(headers) = &event.headers {
                    cmd.arg(headers);
                }
            }
            if waits {
                layout.slots.insert(key_slot(stream.as_bytes()));
            }
            commands.push(&cmd);
            calls.push(positions);
        }
        layout.covers = Covers::Streams(calls);
    } else if layout.idmp || !shape.plain {
        layout.covers = Covers::Streams(add_calls(
            &mut commands,
            chunk.events,
            target,
            shape.acked,
            layout.idmp,
            |stream| {
                if waits {
                    layout.slots.insert(key_slot(stream.as_bytes()));
                }
            },
        ));
    } else {
        let slots = &mut layout.slots;
        xadd::build(
            &mut commands,
            chunk.events,
            target,
            |cmd| trim_args(cmd, target, shape.acked),
            |stream| {
                if waits {
                    slots.insert(key_slot(stream.as_bytes()));
                }
            },
        );
        layout.covers = Covers::Each(chunk.events.len());
    }
    Commands {
        commands,
        ignored,
        layout,
    }
}

/// Writes one call of `add.lua` per stream of the chunk, with IDMP (`idmp`) or without dedupe,
/// sent whole (with IDMP its user needs `EVAL` for the streams' windows already). Returns the
/// positions each call covers; `stream_seen` is told each stream key.
fn add_calls(
    commands: &mut Packed,
    events: &[Event],
    target: &Target,
    acked: bool,
    idmp: bool,
    mut stream_seen: impl FnMut(&str),
) -> Vec<Vec<usize>> {
    let mut producers = idmp::Producers::default();
    let mut calls = Vec::new();
    let bound = format!(
        "{}{}{}",
        target.stream_maxlen,
        if acked { "a" } else { "" },
        if idmp { "i" } else { "" }
    );
    for (stream, positions) in group_by_stream(&target.stream_prefix, events) {
        stream_seen(&stream);
        commands.command(|cmd| {
            ADD_SCRIPT.write_call(ScriptCall::Whole, cmd);
            cmd.arg("1").arg(&stream);
            cmd.arg(&bound);
            cmd.arg(&events[positions[0]].topic)
                .arg(optional_fields(events, &positions));
            for &p in &positions {
                let event = &events[p];
                if idmp {
                    cmd.arg(producers.of(&target.marker_namespace, event.group));
                    idmp::identity_arg(cmd, event.id, event.created_at);
                }
                cmd.int(event.id).arg(&event.payload);
                rfc3339_arg(cmd, event.created_at);
                if let Some(key) = &event.key {
                    cmd.arg(key);
                }
                if let Some(headers) = &event.headers {
                    cmd.arg(headers);
                }
            }
        });
        calls.push(positions);
    }
    calls
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
pub fn read(chunk: &Chunk, layout: &Layout, values: Vec<Value>) -> Result<Answer, Failed> {
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
    let mut results = vec![Outcome::Added; chunk.events.len()];
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
                    return Err(Failed::Refused(message));
                }
                for &p in positions {
                    results[p] = Outcome::Failed(message.clone());
                }
            }
            Value::Array(items) if matches!(layout.covers, Covers::Streams(_)) => {
                // Pairs of an event's position in the script's share (from 1) and the error
                // XADD gave it; the events not named are in the stream.
                if items.len() % 2 != 0 {
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
                        Value::BulkString(text) => {
                            script_error(&String::from_utf8_lossy(&text)).to_string()
                        }
                        Value::SimpleString(text) => script_error(&text).to_string(),
                        other => {
                            return Err(Failed::Broken(format!(
                                "unexpected error from the dedupe script: {other:?}"
                            )))
                        }
                    };
                    if is_server_wide(message.split(' ').next().unwrap_or("")) {
                        return Err(Failed::Refused(message));
                    }
                    results[p] = Outcome::Failed(message);
                }
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::encode::sample_event as event;
    use crate::target::{Dedupe, Mode};
    use redis::Cmd;
    use std::time::Duration;

    fn reply(resp: &[u8]) -> Value {
        redis::parse_redis_value(resp).expect("not RESP")
    }

    fn target(dedupe: Dedupe) -> Target {
        Target {
            url: "redis://127.0.0.1".into(),
            mode: Mode::Standalone,
            sentinel_master: String::new(),
            tls: Default::default(),
            password_file: String::new(),
            sentinel_password_file: String::new(),
            url_refused: None,
            wait_replicas: 0,
            timeout: Duration::from_secs(1),
            stream_prefix: String::new(),
            stream_maxlen: 0,
            stream_max_age: Duration::ZERO,
            stream_trim_acked: false,
            dedupe,
            dedupe_ttl: Duration::from_secs(1),
            marker_namespace: "t".into(),
        }
    }

    /// Without dedupe, plain `XADD`s; [`plain_or_not`] says otherwise.
    fn shape(dedupe: InUse) -> Shape {
        plain_or_not(dedupe, true)
    }

    fn plain_or_not(dedupe: InUse, plain: bool) -> Shape {
        Shape {
            dedupe,
            acked: false,
            idmp: false,
            plain,
        }
    }

    fn chunk_of<'a>(target: &'a Target, events: &'a [Event]) -> Chunk<'a> {
        Chunk {
            target,
            events,
            cleanup: &[],
            in_doubt: None,
            sent_as: Cell::new(None),
        }
    }

    #[test]
    fn a_key_error_fails_its_events_and_a_refusal_fails_the_chunk() {
        let target = target(Dedupe::Off);
        let events = [event(1, "a"), event(2, "b"), event(3, "a")];
        let chunk = chunk_of(&target, &events);
        let layout = built(&chunk, &shape(InUse::Off)).layout;
        let added = || reply(b"$3\r\n1-1\r\n");
        let wrongtype = || reply(b"-WRONGTYPE Operation against a key\r\n");
        let Ok(answer) = read(&chunk, &layout, vec![wrongtype(), added(), wrongtype()]) else {
            panic!("a key error failed the whole chunk");
        };
        assert_eq!(
            answer.results,
            [
                Outcome::Failed("WRONGTYPE Operation against a key".to_string()),
                Outcome::Added,
                Outcome::Failed("WRONGTYPE Operation against a key".to_string()),
            ]
        );
        let noperm = reply(b"-NOPERM this user has no permissions\r\n");
        assert!(matches!(
            read(&chunk, &layout, vec![added(), noperm, added()]),
            Err(Failed::Refused(error)) if error.starts_with("NOPERM")
        ));
        assert!(matches!(
            read(&chunk, &layout, vec![added()]),
            Err(Failed::Broken(_))
        ));
    }

    /// The chunk's round trip on one server, into a new buffer.
    fn built(chunk: &Chunk, shape: &Shape) -> Commands {
        build(chunk, ScriptCall::BySha, shape, Packed::default())
    }

    /// The commands built, read back one by one.
    fn listed(built: &Commands) -> Vec<Cmd> {
        built.commands.commands().expect("not RESP")
    }

    /// A command's arguments as text, for the tests here and in `xadd.rs`.
    pub(crate) fn args(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not simple>".into(),
            })
            .collect()
    }

    #[test]
    fn the_script_gets_the_topic_once_and_optional_fields_only_when_set() {
        let target = target(Dedupe::Markers);
        let mut events = [event(1, "a"), event(2, "a"), event(3, "a"), event(4, "a")];
        events[1].key = Some("k2".into());
        events[2].key = Some("k3".into());
        events[2].headers = Some("h3".into());
        events[3].headers = Some("h4".into());
        let chunk = chunk_of(&target, &events);
        let commands = built(&chunk, &shape(InUse::Markers));
        assert_eq!(commands.commands.len(), 1);
        let args = args(&listed(&commands)[0]);
        // EVALSHA, the digest, 3 keys (the stream, one run's two marker hashes).
        assert_eq!(args[2..4], ["3", "a"]);
        let argv = &args[6..];
        assert_eq!(argv[0], "0", "no MAXLEN");
        assert_eq!(argv[2..4], ["a", "-kbh"]);
        // The call's own marker field, then the one run: its size and its ready-made marker.
        assert!(argv[4].starts_with('m'), "{}", argv[4]);
        let stamp = rfc3339(0);
        assert_eq!(argv[5], "4");
        assert_eq!(argv[6], format!("1|{stamp};2|{stamp};3|{stamp};4|{stamp}"));
        assert_eq!(argv[7..11], ["1", "2", "3", "4"]);
        assert_eq!(
            argv[11..],
            ["{}", &stamp, "{}", &stamp, "k2", "{}", &stamp, "k3", "h3", "{}", &stamp, "h4"]
        );
    }

    #[test]
    fn markers_carry_each_events_idmp_identity_where_redis_has_idmp() {
        let target = target(Dedupe::Auto);
        let mut events = [event(1, "a"), event(2, "a")];
        events[0].group = 3;
        events[0].created_at = 1_000;
        events[1].key = Some("k2".into());
        let chunk = chunk_of(&target, &events);
        let shape = Shape {
            dedupe: InUse::Markers,
            acked: false,
            idmp: true,
            plain: false,
        };
        let args = args(&listed(&built(&chunk, &shape))[0]);
        let argv = &args[6..];
        // The bound says IDMP is there, and the window a stream the call makes gets.
        let window = idmp::window_seconds(target.dedupe_ttl);
        assert_eq!(argv[0], format!("0i:{window}:10000"));
        let (s0, s1) = (rfc3339(1_000), rfc3339(0));
        // After the run's ids: per event its payload, created_at, producer and identity, then
        // its key.
        assert_eq!(
            argv[argv.len() - 9..],
            ["{}", &s0, "t:3", "1-1000", "{}", &s1, "t:0", "2-0", "k2"]
        );
    }

    #[test]
    fn the_script_names_the_events_it_refused() {
        let target = target(Dedupe::Markers);
        let events = [event(1, "a"), event(2, "b"), event(3, "a")];
        let chunk = chunk_of(&target, &events);
        // One call per stream: a gets events 1 and 3, b event 2.
        let layout = built(&chunk, &shape(InUse::Markers)).layout;
        let none = || reply(b"*0\r\n");
        let Ok(answer) = read(&chunk, &layout, vec![none(), none()]) else {
            panic!("an empty reply failed the chunk");
        };
        assert_eq!(
            answer.results,
            [Outcome::Added, Outcome::Added, Outcome::Added]
        );
        let second = reply(b"*2\r\n:2\r\n$27\r\nWRONGTYPE Operation against\r\n");
        let Ok(answer) = read(&chunk, &layout, vec![second, none()]) else {
            panic!("a refused event failed the chunk");
        };
        assert_eq!(
            answer.results,
            [
                Outcome::Added,
                Outcome::Added,
                Outcome::Failed("WRONGTYPE Operation against".to_string())
            ]
        );
        let noperm = reply(b"*2\r\n:1\r\n$6\r\nNOPERM\r\n");
        assert!(matches!(
            read(&chunk, &layout, vec![none(), noperm]),
            Err(Failed::Refused(error)) if error == "NOPERM"
        ));
        for broken in [
            &b"*1\r\n:1\r\n"[..],
            b"*2\r\n:3\r\n$3\r\nERR\r\n",
            b"*2\r\n:0\r\n$3\r\nERR\r\n",
        ] {
            assert!(matches!(
                read(&chunk, &layout, vec![reply(broken), none()]),
                Err(Failed::Broken(_))
            ));
        }
    }

    #[test]
    fn idmp_sends_a_call_per_stream_naming_the_lane_group_and_the_event() {
        let mut target = target(Dedupe::Auto);
        target.stream_maxlen = 1000;
        let mut events = [event(7, "a"), event(8, "b"), event(9, "a")];
        events[0].group = 3;
        events[0].created_at = 1_000;
        events[2].key = Some("k".into());
        let chunk = chunk_of(&target, &events);
        let shape = Shape {
            dedupe: InUse::Idmp,
            acked: true,
            idmp: false,
            plain: false,
        };
        let built = built(&chunk, &shape);
        // One call per stream, sent whole: a's events 7 and 9, then b's 8.
        assert_eq!(built.commands.len(), 2);
        let a = args(&listed(&built)[0]);
        assert_eq!(a[0], "EVAL");
        assert!(a[1].contains("IDMP"));
        let stamp = |at| rfc3339(at);
        assert_eq!(
            a[2..],
            [
                "1",
                "a",
                "1000ai",
                "a",
                "-k",
                "t:3",
                "7-1000",
                "7",
                "{}",
                &stamp(1_000),
                "t:0",
                "9-0",
                "9",
                "{}",
                &stamp(0),
                "k"
            ]
        );
        assert_eq!(
            args(&listed(&built)[1])[2..9],
            ["1", "b", "1000ai", "b", "-", "t:0", "8-0"]
        );
        // A stream that does not exist adds nothing, and its events are named to go again.
        let none = || reply(b"*0\r\n");
        let Ok(answer) = read(&chunk, &built.layout, vec![none(), reply(b":0\r\n")]) else {
            panic!("a missing stream failed the chunk");
        };
        assert_eq!(answer.missing, [1]);
        assert_eq!(answer.results, vec![Outcome::Added; 3]);
        // A refusal for memory is every event's, and the chunk's.
        let oom = || reply(b"*4\r\n:1\r\n$3\r\nOOM\r\n:2\r\n$3\r\nOOM\r\n");
        assert!(matches!(
            read(&chunk, &built.layout, vec![oom(), none()]),
            Err(Failed::Refused(error)) if error == "OOM"
        ));
    }

    #[test]
    fn without_dedupe_a_call_per_stream_names_no_producer_unless_plain() {
        let target = target(Dedupe::Off);
        let mut events = [event(7, "a"), event(8, "b"), event(9, "a")];
        events[2].key = Some("k".into());
        let chunk = chunk_of(&target, &events);
        let built = built(&chunk, &plain_or_not(InUse::Off, false));
        assert_eq!(built.commands.len(), 2);
        let a = args(&listed(&built)[0]);
        assert_eq!(a[0], "EVAL");
        let stamp = rfc3339(0);
        // The bound without 'i', then per event its id, payload and created_at, and its key.
        assert_eq!(
            a[2..],
            ["1", "a", "0", "a", "-k", "7", "{}", &stamp, "9", "{}", &stamp, "k"]
        );
        // A stream's events refused alike: the first named by Redis's error, the later ones by
        // the same error, untried.
        let none = || reply(b"*0\r\n");
        let wrongtype = reply(b"*4\r\n:1\r\n$9\r\nWRONGTYPE\r\n:2\r\n$9\r\nWRONGTYPE\r\n");
        let Ok(answer) = read(&chunk, &built.layout, vec![wrongtype, none()]) else {
            panic!("a key error failed the chunk");
        };
        let failed = Outcome::Failed("WRONGTYPE".into());
        assert_eq!(answer.results, [failed.clone(), Outcome::Added, failed]);
        // Plain XADDs for a user who may not run scripts.
        let plain = built_plain(&chunk);
        assert_eq!(plain.commands.len(), 3);
        assert_eq!(args(&listed(&plain)[0])[..3], ["XADD", "a", "*"]);
    }

    fn built_plain(chunk: &Chunk) -> Commands {
        built(chunk, &plain_or_not(InUse::Off, true))
    }

    #[test]
    fn trimming_by_age_comes_before_the_events_once_per_stream() {
        let mut target = target(Dedupe::Off);
        target.stream_max_age = Duration::from_secs(60);
        let events = [event(1, "a"), event(2, "a")];
        let chunk = chunk_of(&target, &events);
        let built = built(&chunk, &shape(InUse::Off));
        assert_eq!(built.commands.len(), 3);
        let trim = args(&listed(&built)[0]);
        assert_eq!(trim[..4], ["XTRIM", "a", "MINID", "~"]);
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let oldest: u64 = trim[4].parse().unwrap();
        assert!(
            oldest <= now_ms - 60_000 && oldest > now_ms - 70_000,
            "{oldest}"
        );
        assert_eq!(args(&listed(&built)[1])[..3], ["XADD", "a", "*"]);
        // A failed trim fails no event: it is reported beside them.
        let added = || reply(b"$3\r\n1-1\r\n");
        let noperm = reply(b"-NOPERM no permissions to run the 'xtrim' command\r\n");
        let Ok(answer) = read(&chunk, &built.layout, vec![noperm, added(), added()]) else {
            panic!("a failed trim failed the chunk");
        };
        assert_eq!(answer.results, vec![Outcome::Added; 2]);
        assert!(answer
            .trim_error
            .is_some_and(|e| e.starts_with("XTRIM: NOPERM")));
        assert!(matches!(
            read(&chunk, &built.layout, vec![added(), added()]),
            Err(Failed::Broken(_))
        ));
    }

    #[test]
    fn a_scripts_error_is_read_without_the_place_redis_6_2_puts_before_it() {
        let oom = "@user_script: 194: -OOM command not allowed when used memory > 'maxmemory'.\r\n";
        assert_eq!(
            script_error(oom),
            "OOM command not allowed when used memory > 'maxmemory'."
        );
        assert_eq!(script_error("WRONGTYPE Operation"), "WRONGTYPE Operation");
        let target = target(Dedupe::Markers);
        let events = [event(1, "a")];
        let chunk = chunk_of(&target, &events);
        let layout = built(&chunk, &shape(InUse::Markers)).layout;
        let reply = redis::Value::Array(vec![
            redis::Value::Int(1),
            redis::Value::BulkString(oom.as_bytes().to_vec()),
        ]);
        assert!(matches!(
            read(&chunk, &layout, vec![reply]),
            Err(Failed::Refused(error)) if error.starts_with("OOM ")
        ));
    }

    #[test]
    fn each_call_gets_a_marker_field_of_its_own() {
        let fields: std::collections::HashSet<String> = (0..1000).map(|_| marker_field()).collect();
        assert_eq!(fields.len(), 1000);
        // Never taken for a marker of the old kind, a field named by an event id.
        assert!(fields.iter().all(|f| f.starts_with('m')));
    }
}

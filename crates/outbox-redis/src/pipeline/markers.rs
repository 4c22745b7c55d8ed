//! The markers' script (`dedupe.lua`) called once per stream of a chunk: its marker hashes
//! (this period's and the one before, per shard of ids), the call's marker field, and each
//! event's id, payload, timestamp and optional fields, with its IDMP identity where every node
//! has IDMP.

use std::collections::hash_map::RandomState;
use std::fmt::Write as _;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::cloudevents;
use crate::encode::{
    group_by_stream, marker_key, marker_period, optional_fields, shard_runs, Event,
};
use crate::idmp;
use crate::outcome::Markers;
use crate::resp::Packed;
use crate::rfc3339::rfc3339;
use crate::scripts::{ScriptCall, DEDUPE_SCRIPT};
use crate::target::Target;

/// The hash field a script call's markers go to: unique to the call, among all the relay's
/// processes, so that a call never overwrites the markers another left (in a retry after a
/// crash, say). Starts with a letter: a field named by a number is a marker an earlier version
/// wrote for one event.
pub(super) fn marker_field() -> String {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static CALLS: AtomicU64 = AtomicU64::new(0);
    // The standard library keys a `RandomState` from the operating system's randomness.
    let seed = *SEED.get_or_init(|| RandomState::new().hash_one(std::process::id()));
    format!(
        "m{seed:016x}.{:x}",
        CALLS.fetch_add(1, AtomicOrdering::Relaxed)
    )
}

/// Writes one call of the markers' script per stream of `events` into `commands`, `script` says
/// how (by SHA1 or whole); `(acked, idmp)`: whether trimming keeps unacknowledged entries, and
/// whether the markers record IDMP identities too. Returns the positions each call covers and
/// the markers the calls leave; `stream_seen` is told each stream key.
pub(super) fn calls(
    commands: &mut Packed,
    events: &[Event],
    target: &Target,
    script: ScriptCall,
    (acked, idmp): (bool, bool),
    mut stream_seen: impl FnMut(&str),
) -> (Vec<Vec<usize>>, Vec<Markers>) {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let period = marker_period(now_ms, target.dedupe_ttl.as_millis() as u64);
    let stamps: Vec<String> = events.iter().map(|e| rfc3339(e.created_at)).collect();
    let bound = first_argument(target, acked, idmp);
    let mut producers = idmp.then(idmp::Producers::default);
    let (mut calls, mut markers) = (Vec::new(), Vec::new());
    for (stream, positions) in group_by_stream(&target.stream_prefix, events) {
        stream_seen(&stream);
        let runs = shard_runs(events, &positions);
        let mut cmd = DEDUPE_SCRIPT.call(script);
        cmd.arg(1 + 2 * runs.len()).arg(&stream);
        let field = marker_field();
        for (shard, _) in &runs {
            let key = |of: u64| {
                let namespace = &target.marker_namespace;
                marker_key(&target.stream_prefix, namespace, of, *shard, &stream)
            };
            let current = key(period.current);
            cmd.arg(&current).arg(key(period.current.saturating_sub(1)));
            markers.push(Markers {
                hash: current,
                field: field.clone(),
            });
        }
        cmd.arg(&bound)
            .arg(period.expires_at_ms)
            .arg(&events[positions[0]].topic)
            .arg(optional_fields(events, &positions))
            .arg(&field);
        for (_, run) in &runs {
            let mut marker = String::with_capacity(run.len() * 40);
            for &p in run {
                if !marker.is_empty() {
                    marker.push(';');
                }
                let _ = write!(marker, "{}|{}", events[p].id, stamps[p]);
            }
            cmd.arg(run.len()).arg(marker);
        }
        for &p in &positions {
            cmd.arg(events[p].id);
        }
        for &p in &positions {
            event_args(&mut cmd, &events[p], &stamps[p], target, producers.as_mut());
        }
        if let Some(source) = target.format.cloudevents_source() {
            cmd.arg(source);
        }
        commands.push(&cmd);
        calls.push(positions);
    }
    (calls, markers)
}

/// The script's first argument, the same for every stream of a chunk: the `MAXLEN` bound, `a`
/// to trim with `ACKED`, `c` for CloudEvents, and with IDMP identities `i:` and the window's
/// seconds and ids.
fn first_argument(target: &Target, acked: bool, idmp: bool) -> String {
    let acked = if acked { "a" } else { "" };
    let ce = match target.format.cloudevents_source() {
        Some(_) => "c",
        None => "",
    };
    let window = if idmp {
        format!(
            "i:{}:{}",
            idmp::window_seconds(target.dedupe_ttl),
            idmp::WINDOW_IDS
        )
    } else {
        String::new()
    };
    format!("{}{acked}{ce}{window}", target.stream_maxlen)
}

/// One event's arguments after the ids: its payload and timestamp, its IDMP producer and
/// identity (with `producers`), then its key and headers where it has them (for a CloudEvent,
/// the headers as the number of extension attributes and their field names and values).
fn event_args(
    cmd: &mut redis::Cmd,
    event: &Event,
    stamp: &str,
    target: &Target,
    producers: Option<&mut idmp::Producers>,
) {
    cmd.arg(&event.payload).arg(stamp);
    if let Some(producers) = producers {
        cmd.arg(producers.of(&target.marker_namespace, event.group))
            .arg(idmp::identity(event.id, event.created_at));
    }
    if let Some(key) = &event.key {
        cmd.arg(key);
    }
    if let Some(headers) = &event.headers {
        if target.format.cloudevents_source().is_some() {
            let attributes = cloudevents::extensions(headers).unwrap_or_default();
            cmd.arg(attributes.len());
            for (name, value) in attributes {
                cmd.arg(name).arg(value);
            }
        } else {
            cmd.arg(headers);
        }
    }
}

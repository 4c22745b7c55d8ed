//! `add.lua` called once per stream of a chunk: with IDMP, or without dedupe for a user who may
//! run scripts. The script adds nothing after an event Redis refused, so that a key's later
//! events never go before its earlier ones.

use crate::cloudevents;
use crate::encode::{group_by_stream, optional_fields, Event};
use crate::idmp;
use crate::resp::{Args, Packed};
use crate::rfc3339::rfc3339_arg;
use crate::scripts::{ScriptCall, ADD_SCRIPT};
use crate::target::Target;

/// Writes one call of `add.lua` per stream of the chunk, with IDMP (`idmp`) or without dedupe,
/// sent whole (with IDMP its user needs `EVAL` for the streams' windows already). Returns the
/// positions each call covers; `stream_seen` is told each stream key.
pub(super) fn calls(
    commands: &mut Packed,
    events: &[Event],
    target: &Target,
    acked: bool,
    idmp: bool,
    mut stream_seen: impl FnMut(&str),
) -> Vec<Vec<usize>> {
    let mut producers = idmp::Producers::default();
    let mut calls = Vec::new();
    let source = target.format.cloudevents_source();
    let bound = format!(
        "{}{}{}{}",
        target.stream_maxlen,
        if acked { "a" } else { "" },
        if source.is_some() { "c" } else { "" },
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
                    match source {
                        None => cmd.arg(headers),
                        Some(_) => extension_args(cmd, headers),
                    };
                }
            }
            if let Some(source) = source {
                cmd.arg(source);
            }
        });
        calls.push(positions);
    }
    calls
}

/// An event's headers as the scripts take them for a CloudEvent: the number of its extension
/// attributes, then each one's field name and value.
fn extension_args<'a, 'b>(cmd: &'b mut Args<'a>, headers: &str) -> &'b mut Args<'a> {
    let attributes = cloudevents::extensions(headers).unwrap_or_default();
    cmd.uint(attributes.len() as u64);
    for (name, value) in attributes {
        cmd.arg(name).arg(value);
    }
    cmd
}

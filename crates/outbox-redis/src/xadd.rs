//! One `XADD` per event, with IDMP or without dedupe: the commands of a chunk that the markers'
//! script does not write.
//!
//! A chunk sends a thousand of these, so each is built into one command buffer sized up front,
//! with what events share (the stream key of a run of one topic, the producer of a lane group)
//! made once per chunk and the rest written in place: the relay's Redis thread spends its time
//! here, beside the main thread on the same cores.

use std::fmt::Write as _;

use redis::Cmd;

use crate::encode::{stream_key, write_rfc3339, Event};
use crate::idmp;
use crate::target::Target;

/// Builds the chunk's `XADD`s, one per event in order; `idmp` adds `NOMKSTREAM` and the event's
/// identity, `trim` writes the trimming arguments. `stream_seen` is told each event's stream key.
pub fn build(
    events: &[Event],
    target: &Target,
    idmp: bool,
    trim: impl Fn(&mut Cmd),
    mut stream_seen: impl FnMut(&str),
) -> Vec<Cmd> {
    let mut commands = Vec::with_capacity(events.len());
    let mut producers: Vec<Option<String>> = Vec::new();
    let mut stream = String::new();
    let mut topic: Option<&str> = None;
    let mut scratch = String::with_capacity(48);
    for event in events {
        if topic != Some(event.topic.as_str()) {
            stream = stream_key(&target.stream_prefix, &event.topic);
            topic = Some(event.topic.as_str());
        }
        stream_seen(&stream);
        let mut cmd = Cmd::with_capacity(20, 200 + stream.len() + event.text_bytes());
        cmd.arg("XADD").arg(stream.as_str());
        if idmp {
            // A stream created by XADD would have Redis's default window: see `missing`.
            cmd.arg("NOMKSTREAM");
        }
        trim(&mut cmd);
        if idmp {
            let group = usize::from(event.group);
            if producers.len() <= group {
                producers.resize(group + 1, None);
            }
            let producer = producers[group]
                .get_or_insert_with(|| idmp::producer(&target.marker_namespace, event.group));
            scratch.clear();
            idmp::write_identity(&mut scratch, event.id, event.created_at);
            cmd.arg("IDMP").arg(producer.as_str()).arg(scratch.as_str());
        }
        cmd.arg("*");
        write_fields(&mut cmd, event, &mut scratch);
        commands.push(cmd);
    }
    commands
}

/// The entry's fields, as [`Event::fields`] lists them, written into `cmd`.
fn write_fields(cmd: &mut Cmd, event: &Event, scratch: &mut String) {
    scratch.clear();
    let _ = write!(scratch, "{}", event.id);
    cmd.arg("id").arg(scratch.as_str());
    cmd.arg("topic").arg(event.topic.as_str());
    cmd.arg("payload").arg(event.payload.as_str());
    scratch.clear();
    write_rfc3339(scratch, event.created_at);
    cmd.arg("created_at").arg(scratch.as_str());
    if let Some(key) = &event.key {
        cmd.arg("key").arg(key.as_str());
    }
    if let Some(headers) = &event.headers {
        cmd.arg("headers").arg(headers.as_str());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::sample_event;
    use crate::pipeline::tests::args;

    #[test]
    fn the_fields_written_are_the_contracts() {
        let mut event = sample_event(42, "account.created");
        event.created_at = 1_234_567;
        event.payload = r#"{"a": 1}"#.into();
        for (key, headers) in [(None, None), (Some("k"), Some(r#"{"h": "v"}"#))] {
            event.key = key.map(String::from);
            event.headers = headers.map(String::from);
            let mut cmd = Cmd::new();
            write_fields(&mut cmd, &event, &mut String::new());
            let expected: Vec<String> = event
                .fields()
                .into_iter()
                .flat_map(|(name, value)| [name.to_string(), value.into_owned()])
                .collect();
            assert_eq!(args(&cmd), expected);
        }
    }
}

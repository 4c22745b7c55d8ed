//! One `XADD` per event, without dedupe: the commands of a chunk that no script writes.
//!
//! A chunk sends a thousand of these, so each is written straight into the round trip's buffer
//! (`resp.rs`), with the stream key of a run of one topic made once per run and the numbers and
//! timestamps written in place: the relay's Redis thread spends its time here, beside the main
//! thread on the same cores.

use crate::cloudevents;
use crate::encode::{stream_key, Event};
use crate::resp::{Args, Packed};
use crate::rfc3339::{rfc3339, rfc3339_arg};
use crate::target::Target;

/// Writes the chunk's `XADD`s into `out`, one per event in order; `trim` writes the trimming
/// arguments. `stream_seen` is told each event's stream key.
pub fn build(
    out: &mut Packed,
    events: &[Event],
    target: &Target,
    trim: impl Fn(&mut Args<'_>),
    mut stream_seen: impl FnMut(&str),
) {
    let mut stream = String::new();
    let mut topic: Option<&str> = None;
    for event in events {
        if topic != Some(event.topic.as_str()) {
            stream = stream_key(&target.stream_prefix, &event.topic);
            topic = Some(event.topic.as_str());
        }
        stream_seen(&stream);
        out.command(|cmd| {
            cmd.arg("XADD").arg(&stream);
            trim(cmd);
            cmd.arg("*");
            match target.format.cloudevents_source() {
                None => write_fields(cmd, event),
                Some(source) => write_cloudevent(cmd, event, source),
            }
        });
    }
}

/// The entry's fields, as [`Event::fields`] lists them, written into `cmd`.
fn write_fields(cmd: &mut Args<'_>, event: &Event) {
    cmd.arg("id").int(event.id);
    cmd.arg("topic").arg(&event.topic);
    cmd.arg("payload").arg(&event.payload);
    cmd.arg("created_at");
    rfc3339_arg(cmd, event.created_at);
    if let Some(key) = &event.key {
        cmd.arg("key").arg(key);
    }
    if let Some(headers) = &event.headers {
        cmd.arg("headers").arg(headers);
    }
}

/// The entry's fields as a CloudEvent, as [`cloudevents::fields`] lists them, written into `cmd`.
fn write_cloudevent(cmd: &mut Args<'_>, event: &Event, source: &str) {
    let time = rfc3339(event.created_at);
    cmd.arg("ce_specversion").arg(cloudevents::SPECVERSION);
    cmd.arg("ce_id").arg(cloudevents::id(event.id, &time));
    cmd.arg("ce_source").arg(source);
    cmd.arg("ce_type").arg(&event.topic);
    cmd.arg("ce_time").arg(&time);
    if let Some(subject) = cloudevents::subject(event) {
        cmd.arg("ce_subject").arg(subject);
    }
    cmd.arg("content-type").arg(cloudevents::CONTENT_TYPE);
    cmd.arg("data").arg(&event.payload);
    if let Some(headers) = &event.headers {
        for (name, value) in cloudevents::extensions(headers).unwrap_or_default() {
            cmd.arg(name).arg(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::sample_event;
    use crate::resp::args;

    #[test]
    fn the_fields_written_are_the_contracts() {
        let mut event = sample_event(42, "account.created");
        event.created_at = 1_234_567;
        event.payload = r#"{"a": 1}"#.into();
        for (key, headers) in [(None, None), (Some("k"), Some(r#"{"h": "v"}"#))] {
            event.key = key.map(String::from);
            event.headers = headers.map(String::from);
            let mut packed = Packed::default();
            packed.command(|cmd| write_fields(cmd, &event));
            let cmd = &packed.commands().unwrap()[0];
            let expected: Vec<String> = event
                .fields()
                .into_iter()
                .flat_map(|(name, value)| [name.to_string(), value.into_owned()])
                .collect();
            assert_eq!(args(cmd), expected);
            let mut packed = Packed::default();
            packed.command(|cmd| write_cloudevent(cmd, &event, "//postgresql/1/d"));
            let cmd = &packed.commands().unwrap()[0];
            let expected: Vec<String> = cloudevents::fields(&event, "//postgresql/1/d")
                .into_iter()
                .flat_map(|(name, value)| [name, value])
                .collect();
            assert_eq!(args(cmd), expected);
        }
    }
}

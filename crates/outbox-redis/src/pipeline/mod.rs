//! One round trip to Redis as a pipeline: the deletion of markers whose batch committed,
//! trimming by age, and the commands that publish a chunk of events, one of three ways: a call
//! of the markers' script per stream (`markers.rs`), a call of `add.lua` per stream, with IDMP
//! or without dedupe (`add.rs`), or plain `XADD`s for a user who may not run scripts
//! (`xadd.rs`). `replies.rs` maps the replies back to events. No I/O here.

mod add;
mod markers;
mod replies;
#[cfg(test)]
mod tests;
mod xadd;

use std::cell::Cell;
use std::collections::BTreeSet;
use std::time::{SystemTime, UNIX_EPOCH};

use redis::Value;

use replies::Covers;
pub use replies::{closes_connection, is_server_wide, reply_error, Layout};

use crate::encode::{group_by_stream, key_slot, Event};
use crate::outcome::{Answer, Failed, Markers};
use crate::resp::{Args, Packed};
use crate::scripts::ScriptCall;
use crate::server::InUse;
use crate::target::Target;

/// One round trip's worth of work.
pub struct Chunk<'a> {
    pub target: &'a Target,
    pub events: &'a [Event],
    /// Markers of batches whose transaction has committed, deleted on the way.
    pub cleanup: &'a [Markers],
    /// How the chunk's events that are in doubt went, if any are (see `doubt.rs` and
    /// [`crate::server::choose_with_doubt`]).
    pub in_doubt: Option<InUse>,
    /// How this chunk was deduplicated, once it was sent (or may have been).
    pub sent_as: Cell<Option<InUse>>,
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

/// An `XTRIM MINID ~` per stream of the chunk, to `outbox.stream_max_age` before now.
fn trims_by_age(commands: &mut Packed, chunk: &Chunk, acked: bool) {
    let target = chunk.target;
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
            if acked {
                trim.arg("ACKED");
            }
        });
    }
}

/// Turns the pipeline's replies into per-event results (see [`replies::read`]).
pub fn read(chunk: &Chunk, layout: &Layout, values: Vec<Value>) -> Result<Answer, Failed> {
    replies::read(chunk.events.len(), layout, values)
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
        trims_by_age(&mut commands, chunk, shape.acked);
        layout.leading = commands.len() - ignored;
    }
    if layout.script {
        let (calls, markers) = markers::calls(
            &mut commands,
            chunk.events,
            target,
            script,
            (shape.acked, shape.idmp),
            |stream| {
                if waits {
                    layout.slots.insert(key_slot(stream.as_bytes()));
                }
            },
        );
        layout.markers = markers;
        layout.covers = Covers::Streams(calls);
    } else if layout.idmp || !shape.plain {
        layout.covers = Covers::Streams(add::calls(
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

//! Deduplication by Redis itself (`outbox.dedupe = idmp`, or `auto` where every node runs Redis
//! 8.6.2 or later): each `XADD` names a producer and the event's identity (`IDMP <producer>
//! <id>`), and Redis adds an entry for an identity only once while its stream's window holds it.
//! No marker keys, and in a cluster nothing but the stream in its slot. A stream's events go in
//! one script call (`add.lua`), which Redis runs whole or not at all.
//!
//! What a crash can send again is what the relay published and had not durably marked: the
//! batch in flight and the commits not yet flushed. The producer is the event's lane group (as
//! the extension's lanes define it), which one worker relays at a time whatever the number of
//! workers, and which is the same after a restart or a failover; the relay keeps what it has
//! published and not flushed under half of [`WINDOW_IDS`] plus a batch (see the extension's
//! `relay/flush.rs`), so the window of each producer and stream holds all of it. The window's
//! duration is `outbox.dedupe_ttl`, at most the 24 hours Redis allows.

use std::time::Duration;

use crate::resp::Args;

/// Ids a stream's window keeps per producer: the most Redis allows.
pub const WINDOW_IDS: u64 = 10_000;
/// The longest window Redis allows, in seconds.
const LONGEST_WINDOW_S: u64 = 24 * 3600;

/// The script that gives a stream its window; see the file.
pub const CONFIG_SCRIPT: &str = include_str!("idmp_config.lua");

/// The window's duration for `outbox.dedupe_ttl`, in seconds.
pub fn window_seconds(ttl: Duration) -> u64 {
    ttl.as_secs().clamp(1, LONGEST_WINDOW_S)
}

/// The producer of an event in lane group `group` of the database `namespace` names.
pub fn producer(namespace: &str, group: u16) -> String {
    format!("{namespace}:{group}")
}

/// The producers of a chunk's lane groups, each named once per chunk.
#[derive(Default)]
pub struct Producers(Vec<Option<String>>);

impl Producers {
    /// The producer of lane group `group` of the database `namespace` names.
    pub fn of(&mut self, namespace: &str, group: u16) -> &str {
        let at = usize::from(group);
        if self.0.len() <= at {
            self.0.resize(at + 1, None);
        }
        self.0[at].get_or_insert_with(|| producer(namespace, group))
    }
}

/// An event's identity: its id and `created_at` (microseconds), as ids can be used again; what
/// [`identity_arg`] writes, as text (for the markers' script, which takes it as a `Cmd`'s
/// argument).
pub fn identity(id: i64, created_at: i64) -> String {
    format!("{id}-{created_at}")
}

/// An event's identity (its id and `created_at` in microseconds, as ids can be used again), as a
/// command's argument: `42-1000`.
pub fn identity_arg(args: &mut Args<'_>, id: i64, created_at: i64) {
    args.int_pair(id, b'-', created_at);
}

/// The command that sizes `stream`'s window, before the first XADD to it on a connection.
pub fn configure(stream: &str, ttl: Duration) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CONFIG_SCRIPT)
        .arg(1)
        .arg(stream)
        .arg(window_seconds(ttl))
        .arg(WINDOW_IDS);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_follows_the_ttl_within_what_redis_allows() {
        assert_eq!(window_seconds(Duration::from_secs(3600)), 3600);
        assert_eq!(window_seconds(Duration::from_secs(7 * 24 * 3600)), 86_400);
        assert_eq!(window_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn an_identity_tells_apart_a_reused_id() {
        assert_eq!(producer("7.5", 3), "7.5:3");
        assert_eq!(identity(42, 1_000), "42-1000");
        assert_ne!(identity(42, 1_000), identity(42, 1_001));
        assert_ne!(identity(4, 21_000), identity(42, 1_000));
        assert_eq!(identity(-1, -946_684_800_000_000), "-1--946684800000000");
        for (id, created_at) in [(42, 1_000), (-1, -7), (i64::MAX, i64::MIN)] {
            let mut packed = crate::resp::Packed::default();
            packed.command(|args| identity_arg(args, id, created_at));
            let mut expected = redis::Cmd::new();
            expected.arg(identity(id, created_at));
            assert_eq!(packed.bytes(), expected.get_packed_command());
        }
    }
}

//! What an event looks like on its way to Redis: stream keys, entry fields and marker hashes
//! (its timestamp is `rfc3339.rs`'s). Pure functions, unit-tested without a server.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::rfc3339::rfc3339;

/// One claimed event, as the relay reads it from the `outbox` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: i64,
    pub topic: String,
    /// The payload's JSON text.
    pub payload: String,
    /// `created_at` as a PostgreSQL `TimestampTz`: microseconds since 2000-01-01 00:00 UTC.
    pub created_at: i64,
    /// Failed publishes charged so far.
    pub attempts: i32,
    /// The key `outbox_enqueue` was given, if any.
    pub key: Option<String>,
    /// The headers' JSON text, if any.
    pub headers: Option<String>,
    /// The group of the event's lane (see the extension's `model/lane.rs`): the same for the
    /// event whichever worker relays it, and relayed by one worker at a time. It names the
    /// event's IDMP producer.
    pub group: u16,
}

impl Event {
    /// The bytes of text the event holds: what a chunk of events costs in memory.
    pub fn text_bytes(&self) -> usize {
        self.topic.len()
            + self.payload.len()
            + self.key.as_ref().map_or(0, String::len)
            + self.headers.as_ref().map_or(0, String::len)
    }

    /// The entry's field/value pairs, in the contract's order: `key` and `headers` only when
    /// set. Topic and payload are borrowed: the payload is copied once, into the command sent
    /// to Redis.
    pub fn fields(&self) -> Vec<(&'static str, Cow<'_, str>)> {
        let mut fields = vec![
            ("id", Cow::Owned(self.id.to_string())),
            ("topic", Cow::Borrowed(self.topic.as_str())),
            ("payload", Cow::Borrowed(self.payload.as_str())),
            ("created_at", Cow::Owned(rfc3339(self.created_at))),
        ];
        if let Some(key) = &self.key {
            fields.push(("key", Cow::Borrowed(key.as_str())));
        }
        if let Some(headers) = &self.headers {
            fields.push(("headers", Cow::Borrowed(headers.as_str())));
        }
        fields
    }

    /// The events this one keeps its order among.
    pub fn ordering(&self) -> Ordering {
        match &self.key {
            Some(key) => Ordering::Key(key.clone()),
            None => Ordering::Topic(self.topic.clone()),
        }
    }
}

/// The events whose relative order the relay keeps: those with the same key, or without a key,
/// those of the same topic.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ordering {
    Key(String),
    Topic(String),
}

/// The stream an event goes to.
pub fn stream_key(prefix: &str, topic: &str) -> String {
    format!("{prefix}{topic}")
}

/// Event ids per marker hash: consecutive ids share a hash, each script call writes one field
/// per hash it touches, and a call that finds a hash already there reads all of it (see
/// `dedupe.lua`): small enough that reading one at the edge of every chunk stays cheap.
pub const MARKER_SHARD: i64 = 64;

/// The period of `outbox.dedupe_ttl` the relay's clock reads `now_ms` in.
///
/// Markers go to one hash per stream, shard of ids and period. A hash expires at the end of the
/// period after its own, so a marker lives at least one TTL and at most two, and a lookup
/// consults the current period's hash and the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MarkerPeriod {
    /// The period new markers go to.
    pub current: u64,
    /// When the current period's hashes expire, in Unix milliseconds.
    pub expires_at_ms: u64,
}

/// The marker period at `now_ms` for a lifetime of `ttl_ms`.
pub fn marker_period(now_ms: u64, ttl_ms: u64) -> MarkerPeriod {
    let ttl_ms = ttl_ms.max(1);
    let current = now_ms / ttl_ms;
    MarkerPeriod {
        current,
        expires_at_ms: (current + 2) * ttl_ms,
    }
}

/// The hash holding the markers of `stream`'s ids `shard * MARKER_SHARD ..` written during
/// `period`. `namespace` tells apart the databases that share a Redis. The key starts with the
/// stream prefix, so that a Redis user limited to the prefix's keys can keep markers, and ends
/// with a hash tag that puts it in the stream's hash slot, so that in a Redis Cluster the dedupe
/// script touches one slot.
pub fn marker_key(prefix: &str, namespace: &str, period: u64, shard: i64, stream: &str) -> String {
    let head = format!("{prefix}outbox:dedupe:{namespace}:{period}:{shard}:");
    let slot = key_slot(stream.as_bytes());
    let natural = match hash_tag(stream.as_bytes()) {
        // The stream's own tag, which holds no `}`; or the whole key when that holds none.
        Some(tag) => Some(format!("{head}{{{}}}", String::from_utf8_lossy(tag))),
        None if !stream.contains('}') => Some(format!("{head}{{{stream}}}")),
        None => None,
    };
    if let Some(key) = natural.filter(|key| key_slot(key.as_bytes()) == slot) {
        return key;
    }
    // A stream key with a `}` but no tag, or a prefix with braces of its own: the first number
    // whose key lands in the stream's slot (one in 16384 does, so the search ends quickly; the
    // range is unbounded, and every slot has such a number).
    (0u64..)
        .map(|n| format!("{head}{{{n}}}"))
        .find(|key| key_slot(key.as_bytes()) == slot)
        .unwrap_or_default()
}

/// Number of hash slots of a Redis Cluster.
const SLOTS: u16 = 16384;

/// The hash slot Redis Cluster stores `key` in: CRC16 (XMODEM) of its hash tag, or of the whole
/// key when it has none, modulo 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key).unwrap_or(key)) % SLOTS
}

/// The part between the first `{` and the first `}` after it, when not empty.
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let close = key[open + 1..].iter().position(|&b| b == b'}')?;
    let tag = &key[open + 1..open + 1 + close];
    (!tag.is_empty()).then_some(tag)
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster computes it.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// `text` with every character outside printable ASCII written as `\u{..}`: error messages
/// stored in the database must be valid in any database encoding.
pub fn ascii_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == ' ' || c.is_ascii_graphic() {
            out.push(c);
        } else {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        }
    }
    out
}

/// Splits positions (of events in id order) into runs whose ids share a marker shard, keeping
/// their order.
pub fn shard_runs(events: &[Event], positions: &[usize]) -> Vec<(i64, Vec<usize>)> {
    let mut runs: Vec<(i64, Vec<usize>)> = Vec::new();
    for &p in positions {
        let shard = events[p].id.div_euclid(MARKER_SHARD);
        match runs.last_mut() {
            Some((last, run)) if *last == shard => run.push(p),
            _ => runs.push((shard, vec![p])),
        }
    }
    runs
}

/// Groups events by stream key: each group holds positions in `events`, in the order given
/// (claims come in id order), and groups come in order of first appearance.
pub fn group_by_stream(prefix: &str, events: &[Event]) -> Vec<(String, Vec<usize>)> {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut last: Option<(&str, usize)> = None;
    for (position, event) in events.iter().enumerate() {
        // Events come in runs of one topic: only a new run looks its topic up.
        if let Some((topic, group)) = last {
            if topic == event.topic {
                groups[group].1.push(position);
                continue;
            }
        }
        let group = match index.get(event.topic.as_str()) {
            Some(&group) => {
                groups[group].1.push(position);
                group
            }
            None => {
                index.insert(&event.topic, groups.len());
                groups.push((stream_key(prefix, &event.topic), vec![position]));
                groups.len() - 1
            }
        };
        last = Some((&event.topic, group));
    }
    groups
}

/// How a script learns which of each event's optional fields follow its payload and created_at:
/// one character per event at `positions`, `-` neither, `k` its key, `h` its headers, `b` both
/// (key first).
pub fn optional_fields(events: &[Event], positions: &[usize]) -> String {
    positions
        .iter()
        .map(|&p| match (&events[p].key, &events[p].headers) {
            (None, None) => '-',
            (Some(_), None) => 'k',
            (None, Some(_)) => 'h',
            (Some(_), Some(_)) => 'b',
        })
        .collect()
}

/// An event on `topic` with an empty payload, for unit tests.
#[cfg(any(test, feature = "test-support"))]
pub fn sample_event(id: i64, topic: &str) -> Event {
    Event {
        id,
        topic: topic.into(),
        payload: "{}".into(),
        created_at: 0,
        attempts: 0,
        key: None,
        headers: None,
        group: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64, topic: &str) -> Event {
        sample_event(id, topic)
    }

    #[test]
    fn fields_follow_the_contract() {
        let mut e = Event {
            id: 7,
            topic: "account.created".into(),
            payload: r#"{"a": 1}"#.into(),
            created_at: 0,
            attempts: 0,
            key: None,
            headers: None,
            group: 0,
        };
        let names: Vec<&str> = e.fields().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["id", "topic", "payload", "created_at"]);
        assert_eq!(e.fields()[0].1, "7");
        assert_eq!(e.fields()[2].1, r#"{"a": 1}"#);
        e.key = Some("account-7".into());
        e.headers = Some(r#"{"traceparent": "00-1-2-01"}"#.into());
        let fields: Vec<(&str, String)> = e
            .fields()
            .into_iter()
            .map(|(n, v)| (n, v.into_owned()))
            .collect();
        assert_eq!(fields[4], ("key", "account-7".to_string()));
        assert_eq!(fields[5].0, "headers");
        assert_eq!(fields.len(), 6);
        e.key = None;
        assert_eq!(e.fields()[4].0, "headers");
    }

    #[test]
    fn markers_live_between_one_and_two_lifetimes() {
        let day = 86_400_000;
        let period = marker_period(20_000 * day + 5, day);
        assert_eq!(
            marker_key("", "42.5", period.current, 3, "a.b"),
            "outbox:dedupe:42.5:20000:3:{a.b}"
        );
        assert_eq!(
            marker_key("app:", "42.5", period.current - 1, 3, "app:a.b"),
            "app:outbox:dedupe:42.5:19999:3:{app:a.b}"
        );
        assert_eq!(period.expires_at_ms, 20_002 * day);
        for now in [0, 1, 999, 1000, 1001, 123_456_789] {
            let life = marker_period(now, 1000).expires_at_ms - now;
            assert!((1000..=2000).contains(&life), "{now}: {life}");
        }
        // A marker written in the previous period is still consulted.
        let then = marker_period(1500, 1000);
        let later = marker_period(2999, 1000);
        assert_eq!(later.current - 1, then.current);
        assert_eq!(marker_period(5, 0).expires_at_ms, 7);
    }

    #[test]
    fn errors_become_printable_ascii() {
        assert_eq!(ascii_safe("WRONGTYPE Operation"), "WRONGTYPE Operation");
        assert_eq!(ascii_safe("key 'café'"), "key 'caf\\u{e9}'");
        assert_eq!(ascii_safe("a\nb\u{7f}"), "a\\u{a}b\\u{7f}");
    }

    #[test]
    fn consecutive_ids_share_a_marker_shard() {
        let events: Vec<Event> = [1, 2, 63, 64, 65, 200, 7]
            .iter()
            .map(|&id| event(id, "a"))
            .collect();
        let runs = shard_runs(&events, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(runs, [(0, vec![0, 1, 2]), (1, vec![3, 4]), (3, vec![5])]);
        // Out of order, a shard may come back in a run of its own; the order is kept.
        assert_eq!(
            shard_runs(&events, &[0, 3, 6]),
            [(0, vec![0]), (1, vec![3]), (0, vec![6])]
        );
        assert!(shard_runs(&events, &[]).is_empty());
    }

    #[test]
    fn groups_keep_id_order_per_stream() {
        let topics = ["a", "b", "b", "a", "a", "c", "b", "b"];
        let events: Vec<Event> = (0..).zip(topics).map(|(id, t)| event(id, t)).collect();
        let groups = group_by_stream("p:", &events);
        let shape: Vec<(&str, Vec<usize>)> = groups
            .iter()
            .map(|(k, positions)| (k.as_str(), positions.clone()))
            .collect();
        assert_eq!(
            shape,
            [
                ("p:a", vec![0, 3, 4]),
                ("p:b", vec![1, 2, 6, 7]),
                ("p:c", vec![5])
            ]
        );
    }

    #[test]
    fn slots_match_redis_cluster() {
        // Check values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
    }

    #[test]
    fn markers_share_their_streams_slot() {
        let prefixes = ["", "app:", "{app}:", "a{", "x{}y:", "}{", "\u{e9}t\u{e9}:"];
        let topics = [
            "orders",
            "account.created",
            "{tenant-7}:orders",
            "a}b",
            "{}",
            "{",
            "}",
            "x{y",
            "\u{1f600}",
            "q{{r}s",
        ];
        for prefix in prefixes {
            for topic in topics {
                let stream = stream_key(prefix, topic);
                for (period, shard) in [(0, 0), (20_000, -3), (7, 123_456)] {
                    let marker = marker_key(prefix, "ns", period, shard, &stream);
                    assert!(marker.starts_with(prefix), "{marker}");
                    assert_eq!(
                        key_slot(marker.as_bytes()),
                        key_slot(stream.as_bytes()),
                        "{marker} is not in the slot of {stream}"
                    );
                }
            }
        }
        assert_eq!(
            marker_key("app:", "ns", 5, 2, "app:orders"),
            "app:outbox:dedupe:ns:5:2:{app:orders}"
        );
        assert_eq!(
            marker_key("", "ns", 5, 2, "{t1}:orders"),
            "outbox:dedupe:ns:5:2:{t1}"
        );
    }
}

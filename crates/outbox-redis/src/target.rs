//! Where and how the relay publishes: the Redis side of its settings, as plain values. The
//! extension reads them from its `outbox.*` settings and hands them over; every other module of
//! the crate takes them from here, so that none depends on another for its settings.

use std::time::Duration;

/// What `outbox.redis_url` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One server (a primary), reached at the one URL.
    Standalone,
    /// A Redis Cluster: the URLs are seed nodes, the rest is discovered.
    Cluster,
    /// A primary found through Sentinel: the URLs are the sentinels.
    Sentinel,
}

/// Where and how to publish: the Redis side of the settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// One URL, or a comma-separated list (cluster seed nodes, or sentinels).
    pub url: String,
    pub mode: Mode,
    /// The service name Sentinel knows the primary by.
    pub sentinel_master: String,
    pub tls: TlsFiles,
    /// Files holding the passwords for Redis and for the sentinels; empty strings are unset.
    pub password_file: String,
    pub sentinel_password_file: String,
    /// Why the configured URL was refused, when it was: the relay then connects nowhere.
    pub url_refused: Option<&'static str>,
    /// Replicas that must acknowledge a chunk before its events count as published.
    pub wait_replicas: u32,
    pub timeout: Duration,
    pub stream_prefix: String,
    pub stream_maxlen: u64,
    /// Entries older than this are trimmed (`XTRIM ... MINID`); zero keeps them.
    pub stream_max_age: Duration,
    /// Trimming keeps the entries a consumer group has not acknowledged, where Redis can.
    pub stream_trim_acked: bool,
    pub dedupe: Dedupe,
    /// How long a crash's republication is absorbed: the markers' lifetime, or IDMP's window.
    pub dedupe_ttl: Duration,
    /// Tells apart databases sharing a Redis: in marker hash keys, and IDMP's producer ids.
    pub marker_namespace: String,
    /// The shape of the stream entries.
    pub format: Format,
}

/// `outbox.message_format`: the shape of a stream entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// The project's own fields: `id`, `topic`, `payload`, `created_at`, `key`, `headers`.
    Fields,
    /// A CloudEvent in binary content mode (`cloudevents.rs`), from `source` (`ce_source`).
    CloudEvents { source: String },
}

impl Format {
    /// The CloudEvents source, when entries are CloudEvents.
    pub fn cloudevents_source(&self) -> Option<&str> {
        match self {
            Format::Fields => None,
            Format::CloudEvents { source } => Some(source),
        }
    }
}

/// `outbox.dedupe`: how a batch republished after a crash is kept out of the streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedupe {
    /// IDMP where every node written to has it (Redis 8.6.2 or later), markers elsewhere.
    Auto,
    /// Marker hashes kept by the dedupe script (any Redis 6.2+ or Valkey).
    Markers,
    /// Redis's own idempotent production (`XADD ... IDMP`); refused where Redis lacks it.
    Idmp,
    /// No deduplication: a crash between publishing and marking duplicates the batch.
    Off,
}

impl Dedupe {
    /// Whether anything absorbs a republished batch.
    pub fn is_on(self) -> bool {
        self != Dedupe::Off
    }
}

/// PEM files for `rediss://`; empty strings are unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
}

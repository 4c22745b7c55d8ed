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
    pub dedupe: bool,
    pub dedupe_ttl: Duration,
    /// Tells apart databases sharing a Redis in marker hash keys.
    pub marker_namespace: String,
}

/// PEM files for `rediss://`; empty strings are unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
}

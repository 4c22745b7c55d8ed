//! The relay's settings, read once at start and again after each reload: a snapshot, so that a
//! pass never sees half of a reload, and so that a reload that changed nothing says nothing.

use std::time::Duration;

use crate::{gucs, redis_url};

use super::publish::Target;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Where and how to publish: the Redis thread's share.
    pub target: Target,
    pub batch_size: usize,
    pub poll_interval: Duration,
    pub max_attempts: i32,
    /// `None` keeps history forever.
    pub retention: Option<Duration>,
}

impl Settings {
    /// The settings in force; `marker_namespace` tells apart the databases sharing a Redis.
    pub fn read(marker_namespace: &str) -> Settings {
        Settings {
            target: Target {
                url: gucs::redis_url(),
                timeout: gucs::redis_timeout(),
                stream_prefix: gucs::stream_prefix(),
                stream_maxlen: gucs::stream_maxlen(),
                dedupe: gucs::dedupe(),
                dedupe_ttl: gucs::dedupe_ttl(),
                marker_namespace: marker_namespace.to_string(),
            },
            batch_size: gucs::batch_size(),
            poll_interval: gucs::poll_interval(),
            max_attempts: gucs::max_attempts(),
            retention: gucs::retention(),
        }
    }

    /// The settings as the worker logs them, with the Redis password masked.
    pub fn describe(&self, database: &str) -> String {
        let target = &self.target;
        let retention = self
            .retention
            .map_or("off".to_string(), |r| format!("{}s", r.as_secs()));
        format!(
            "database={database} redis_url={} batch_size={} poll_interval={}ms \
             redis_timeout={}ms stream_prefix='{}' stream_maxlen={} max_attempts={} retention={} \
             dedupe={} dedupe_ttl={}s",
            redis_url::mask(&target.url),
            self.batch_size,
            self.poll_interval.as_millis(),
            target.timeout.as_millis(),
            target.stream_prefix,
            target.stream_maxlen,
            self.max_attempts,
            retention,
            if target.dedupe { "on" } else { "off" },
            target.dedupe_ttl.as_secs(),
        )
    }
}

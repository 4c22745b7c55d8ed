//! The relay's settings, read once at start and again after each reload: a snapshot, so that a
//! pass never sees half of a reload, and so that a reload that changed nothing says nothing.

use std::time::Duration;

use outbox_redis::cloudevents;
use outbox_redis::publish::Publisher;
use outbox_redis::target::{Format, Mode, Target, TlsFiles};
use pgrx::prelude::*;

use super::session;
use crate::gucs;
use crate::pg::worker;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Where and how to publish: the Redis thread's share.
    pub target: Target,
    pub batch_size: usize,
    pub poll_interval: Duration,
    pub max_attempts: i32,
    /// `None` keeps history forever.
    pub retention: Option<Duration>,
    /// `outbox.dedupe` as it was set (`on` is `auto`), for the log.
    pub dedupe_name: &'static str,
}

impl Settings {
    /// The settings in force; `marker_namespace` tells apart the databases sharing a Redis.
    pub fn read(marker_namespace: &str, database: &str) -> Settings {
        let (dedupe, dedupe_name) = gucs::dedupe();
        Settings {
            target: Target {
                url: gucs::redis_url(),
                mode: gucs::redis_mode(),
                sentinel_master: gucs::redis_sentinel_master(),
                tls: TlsFiles {
                    ca_file: gucs::redis_tls_ca_file(),
                    cert_file: gucs::redis_tls_cert_file(),
                    key_file: gucs::redis_tls_key_file(),
                },
                password_file: gucs::redis_password_file(),
                sentinel_password_file: gucs::redis_sentinel_password_file(),
                url_refused: gucs::redis_url_refused(),
                wait_replicas: gucs::redis_wait_replicas(),
                timeout: gucs::redis_timeout(),
                stream_prefix: crate::model::databases::stream_prefix(
                    &gucs::stream_prefix(),
                    database,
                ),
                stream_maxlen: gucs::stream_maxlen(),
                stream_max_age: gucs::stream_max_age(),
                stream_trim_acked: gucs::stream_trim_acked(),
                dedupe,
                dedupe_ttl: gucs::dedupe_ttl(),
                marker_namespace: marker_namespace.to_string(),
                format: format(database),
            },
            batch_size: gucs::batch_size(),
            poll_interval: gucs::poll_interval(),
            max_attempts: gucs::max_attempts(),
            retention: gucs::retention(),
            dedupe_name,
        }
    }

    /// Reads the settings again after a SIGHUP, logging them (as worker `index` of `database`)
    /// when they changed and handing a changed Redis target to `publisher`; says whether the
    /// Redis target changed.
    pub fn reload_if_requested(
        &mut self,
        index: usize,
        database: &str,
        publisher: &Publisher,
    ) -> bool {
        if !worker::reload_configuration() {
            return false;
        }
        let settings = Settings::read(&self.target.marker_namespace, database);
        if settings == *self {
            return false;
        }
        log!(
            "outbox relay {index} reloaded: {}",
            settings.describe(database)
        );
        let retarget = settings.target != self.target;
        session::commit_without_waiting(settings.target.dedupe.is_on());
        if retarget {
            publisher.configure(settings.target.clone());
        }
        *self = settings;
        retarget
    }

    /// The settings as the worker logs them (the URL holds no password).
    pub fn describe(&self, database: &str) -> String {
        let target = &self.target;
        let retention = self
            .retention
            .map_or("off".to_string(), |r| format!("{}s", r.as_secs()));
        let mode = match target.mode {
            Mode::Standalone => "standalone".to_string(),
            Mode::Cluster => "cluster".to_string(),
            Mode::Sentinel => format!("sentinel master='{}'", target.sentinel_master),
        };
        let mut tls = String::new();
        for (name, file) in [
            ("ca", &target.tls.ca_file),
            ("cert", &target.tls.cert_file),
            ("key", &target.tls.key_file),
        ] {
            if !file.is_empty() {
                tls.push_str(&format!(" redis_tls_{name}_file='{file}'"));
            }
        }
        for (name, file) in [
            ("password", &target.password_file),
            ("sentinel_password", &target.sentinel_password_file),
        ] {
            if !file.is_empty() {
                tls.push_str(&format!(" redis_{name}_file='{file}'"));
            }
        }
        let wait = match target.wait_replicas {
            0 => String::new(),
            n => format!(" redis_wait_replicas={n}"),
        };
        format!(
            "database={database} redis_url={} redis_mode={mode}{tls}{wait} batch_size={} poll_interval={}ms \
             redis_timeout={}ms stream_prefix='{}' stream_maxlen={}{} max_attempts={} retention={} \
             dedupe={} dedupe_ttl={}s{}",
            match target.url_refused {
                Some(_) => "(refused: it holds a password)",
                None => target.url.as_str(),
            },
            self.batch_size,
            self.poll_interval.as_millis(),
            target.timeout.as_millis(),
            target.stream_prefix,
            target.stream_maxlen,
            trimming(target),
            self.max_attempts,
            retention,
            self.dedupe_name,
            target.dedupe_ttl.as_secs(),
            match target.format.cloudevents_source() {
                None => " message_format=fields".to_string(),
                Some(source) => format!(" message_format=cloudevents cloudevents_source='{source}'"),
            },
        )
    }
}

/// `outbox.message_format`, with the CloudEvents source of `database`.
fn format(database: &str) -> Format {
    if !gucs::cloudevents() {
        return Format::Fields;
    }
    // SAFETY: a plain read of a value the server set at its start.
    let system_identifier = unsafe { pg_sys::GetSystemIdentifier() };
    Format::CloudEvents {
        source: cloudevents::source(&gucs::cloudevents_source(), system_identifier, database),
    }
}

/// The trimming settings beside `stream_maxlen`, when set.
fn trimming(target: &Target) -> String {
    let mut text = String::new();
    if !target.stream_max_age.is_zero() {
        text.push_str(&format!(
            " stream_max_age={}s",
            target.stream_max_age.as_secs()
        ));
    }
    if target.stream_trim_acked {
        text.push_str(" stream_trim_acked=on");
    }
    text
}

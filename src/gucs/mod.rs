//! Every `outbox.*` setting, read through typed getters. The settings themselves, one row each,
//! are in `table.rs`; the check hooks that refuse a bad value, and say why, in `checks.rs`.
//!
//! Durations are stored in the unit PostgreSQL shows for them (ms or s) and handed out as
//! [`Duration`]; strings are handed out as owned `String`s so callers never hold a pointer into
//! GUC memory across a reload.

mod checks;
mod table;

use std::ffi::{c_char, CStr, CString};
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_redis::target::{Dedupe, Mode};
use pgrx::guc::GucSetting;

pub use table::MAX_WORKERS;
use table::*;

/// Registers every setting. Called from `_PG_init`, preloaded or not, so that `SET` and `SHOW`
/// work in any backend that loaded the library.
pub fn init() {
    table::register();
}

fn string(setting: &GucSetting<Option<CString>>) -> String {
    setting
        .get()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn millis(setting: &GucSetting<i32>) -> Duration {
    Duration::from_millis(setting.get().max(0) as u64)
}

fn seconds(setting: &GucSetting<i32>) -> Duration {
    Duration::from_secs(setting.get().max(0) as u64)
}

/// As bytes: a database's name need not be UTF-8 (see `model/databases.rs`).
pub fn database() -> Vec<u8> {
    DATABASE.get().map(CString::into_bytes).unwrap_or_default()
}

pub fn workers() -> usize {
    WORKERS.get().clamp(0, MAX_WORKERS) as usize
}

pub fn redis_url() -> String {
    string(&REDIS_URL)
}

pub fn redis_mode() -> Mode {
    match REDIS_MODE.get() {
        RedisMode::Standalone => Mode::Standalone,
        RedisMode::Cluster => Mode::Cluster,
        RedisMode::Sentinel => Mode::Sentinel,
    }
}

pub fn redis_sentinel_master() -> String {
    string(&REDIS_SENTINEL_MASTER)
}

pub fn redis_password_file() -> String {
    string(&REDIS_PASSWORD_FILE)
}

pub fn redis_sentinel_password_file() -> String {
    string(&REDIS_SENTINEL_PASSWORD_FILE)
}

/// Why the value of `outbox.redis_url` that the configuration files hold was refused, when the
/// last one this process checked was: the relay then waits instead of publishing to the URL it
/// kept (the default, or the one before).
pub fn redis_url_refused() -> Option<&'static str> {
    checks::REDIS_URL_REFUSED
        .load(Ordering::Relaxed)
        .then_some(checks::PASSWORD_IN_URL)
}

pub fn redis_tls_ca_file() -> String {
    string(&REDIS_TLS_CA_FILE)
}

pub fn redis_tls_cert_file() -> String {
    string(&REDIS_TLS_CERT_FILE)
}

pub fn redis_tls_key_file() -> String {
    string(&REDIS_TLS_KEY_FILE)
}

pub fn redis_wait_replicas() -> u32 {
    REDIS_WAIT_REPLICAS.get().max(0) as u32
}

pub fn batch_size() -> usize {
    BATCH_SIZE.get().max(1) as usize
}

pub fn poll_interval() -> Duration {
    millis(&POLL_INTERVAL_MS)
}

pub fn redis_timeout() -> Duration {
    millis(&REDIS_TIMEOUT_MS)
}

pub fn stream_prefix() -> String {
    string(&STREAM_PREFIX)
}

pub fn stream_maxlen() -> u64 {
    STREAM_MAXLEN.get().max(0) as u64
}

/// The notify channel without copying it: `outbox_enqueue` reads it on every call.
/// `None` when the setting is empty.
pub fn notify_channel_ptr() -> Option<*const c_char> {
    let raw = NOTIFY_CHANNEL.as_ptr();
    // SAFETY: `raw` points at the GUC variable; PostgreSQL keeps it either null or pointing at a
    // NUL-terminated string it owns until the next assignment, which cannot happen during a call.
    unsafe {
        let ptr = *raw;
        if ptr.is_null() || *ptr == 0 {
            None
        } else {
            Some(ptr.cast_const())
        }
    }
}

/// A string setting read without copying it unless it is set: `outbox_enqueue` reads these on
/// every call.
fn set_string(setting: &GucSetting<Option<CString>>) -> Option<String> {
    // SAFETY: as in `notify_channel_ptr`.
    unsafe {
        let ptr = *setting.as_ptr();
        if ptr.is_null() || *ptr == 0 {
            None
        } else {
            Some(CStr::from_ptr(ptr).to_string_lossy().into_owned())
        }
    }
}

pub fn traceparent() -> Option<String> {
    set_string(&TRACEPARENT)
}

pub fn tracestate() -> Option<String> {
    set_string(&TRACESTATE)
}

pub fn max_payload_size() -> usize {
    MAX_PAYLOAD_SIZE.get().max(1) as usize
}

pub fn max_attempts() -> i32 {
    MAX_ATTEMPTS.get().max(1)
}

/// `None` when history is kept forever.
pub fn retention() -> Option<Duration> {
    let d = seconds(&RETENTION_S);
    (!d.is_zero()).then_some(d)
}

/// `outbox.dedupe` for the Redis side, and the name it was set by (for the log).
pub fn dedupe() -> (Dedupe, &'static str) {
    use DedupeSetting::*;
    match DEDUPE.get() {
        Auto => (Dedupe::Auto, "auto"),
        Markers => (Dedupe::Markers, "markers"),
        Idmp => (Dedupe::Idmp, "idmp"),
        Off => (Dedupe::Off, "off"),
        On | True | Yes | One => (Dedupe::Auto, "on"),
        False | No | Zero => (Dedupe::Off, "off"),
    }
}

/// Zero keeps entries whatever their age.
pub fn stream_max_age() -> Duration {
    seconds(&STREAM_MAX_AGE_S)
}

pub fn stream_trim_acked() -> bool {
    STREAM_TRIM_ACKED.get()
}

pub fn dedupe_ttl() -> Duration {
    seconds(&DEDUPE_TTL_S)
}

/// Whether entries are CloudEvents (`outbox.message_format = cloudevents`).
pub fn cloudevents() -> bool {
    MESSAGE_FORMAT.get() == MessageFormat::CloudEvents
}

/// `outbox.cloudevents_source` as set (empty for the default).
pub fn cloudevents_source() -> String {
    string(&CLOUDEVENTS_SOURCE)
}

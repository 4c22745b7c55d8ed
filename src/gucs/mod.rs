//! Every `outbox.*` setting: one static each, registered by [`init`], read through typed getters.
//! The check hooks that refuse a bad value, and say why, are in `checks.rs`.
//!
//! Durations are stored in the unit PostgreSQL shows for them (ms or s) and handed out as
//! [`Duration`]; strings are handed out as owned `String`s so callers never hold a pointer into
//! GUC memory across a reload.

mod checks;

use std::ffi::{c_char, CStr, CString};
use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_redis::target::{Dedupe, Mode};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use pgrx::pg_sys;

/// Most relay workers one server can run; sizes the shared-memory slot array.
pub const MAX_WORKERS: i32 = 32;

/// Databases the relay works in: one, a list, or `*`.
static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));
/// Number of relay workers started by the postmaster.
static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);
/// Where events are published. Never holds a password (`outbox.redis_password_file` does).
static REDIS_URL: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"redis://127.0.0.1:6379"));
/// How `outbox.redis_url` is read: one server, the seed nodes of a cluster, or sentinels.
static REDIS_MODE: GucSetting<RedisMode> = GucSetting::<RedisMode>::new(RedisMode::Standalone);
/// The name Sentinel knows the primary by.
static REDIS_SENTINEL_MASTER: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
/// Files whose first line is the password the relay gives Redis, and the one it gives the
/// sentinels; empty: none.
static REDIS_PASSWORD_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
static REDIS_SENTINEL_PASSWORD_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
/// PEM files for TLS: the CA to trust, and the client's certificate and key.
static REDIS_TLS_CA_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
static REDIS_TLS_CERT_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
static REDIS_TLS_KEY_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c""));
/// Replicas that must acknowledge a chunk (`WAIT`) before it is marked; 0 waits for none.
static REDIS_WAIT_REPLICAS: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Most events one claim takes.
static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(100);
/// Safety-net poll, in milliseconds, for when no wake-up arrives.
static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
/// Connect, read and write timeout towards Redis, in milliseconds.
static REDIS_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5000);
/// Prefix of every stream key; the key is prefix + topic.
static STREAM_PREFIX: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));
/// When positive, streams are trimmed with `MAXLEN ~ n`.
static STREAM_MAXLEN: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Channel of the `pg_notify` call made by `outbox_enqueue`; empty turns it off.
static NOTIFY_CHANNEL: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"outbox"));
/// The W3C trace context a session's events carry when their statement has none of its own.
static TRACEPARENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));
static TRACESTATE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c""));
/// Most `outbox.max_payload_size` can be raised to: the relay holds a batch's events in memory,
/// and Redis takes no string over 512 MB.
pub const PAYLOAD_SIZE_CEILING: i32 = 64 * 1024 * 1024;
/// Largest payload, in bytes of JSON text, that `outbox_enqueue` accepts.
static MAX_PAYLOAD_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);
/// Failed publishes of one event before it moves to `outbox_dead`.
static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Age, in seconds, after which published rows are pruned; 0 keeps them forever.
static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
/// How a batch published again after a crash is kept out of the streams.
static DEDUPE: GucSetting<DedupeSetting> = GucSetting::<DedupeSetting>::new(DedupeSetting::Auto);
/// Age, in seconds, past which stream entries are trimmed; 0 keeps them.
static STREAM_MAX_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Trimming keeps what a consumer group has not acknowledged, where Redis can (8.2+).
static STREAM_TRIM_ACKED: GucSetting<bool> = GucSetting::<bool>::new(false);
/// Lifetime, in seconds, of a dedupe marker left behind by a crash.
static DEDUPE_TTL_S: GucSetting<i32> = GucSetting::<i32>::new(24 * 3600);

/// `outbox.dedupe`'s values: those [`dedupe`] maps to the Redis side's [`Dedupe`], and, hidden,
/// the boolean spellings the setting took when it was on or off (on is now `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PostgresGucEnum)]
enum DedupeSetting {
    #[name = c"auto"]
    Auto,
    #[name = c"markers"]
    Markers,
    #[name = c"idmp"]
    Idmp,
    #[name = c"off"]
    Off,
    #[name = c"on"]
    #[hidden = true]
    On,
    #[name = c"true"]
    #[hidden = true]
    True,
    #[name = c"yes"]
    #[hidden = true]
    Yes,
    #[name = c"1"]
    #[hidden = true]
    One,
    #[name = c"false"]
    #[hidden = true]
    False,
    #[name = c"no"]
    #[hidden = true]
    No,
    #[name = c"0"]
    #[hidden = true]
    Zero,
}

/// What `outbox.redis_url` names: the setting's values, which [`redis_mode`] maps to the Redis
/// side's own [`Mode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PostgresGucEnum)]
enum RedisMode {
    /// One server (a primary), reached at the one URL.
    #[name = c"standalone"]
    Standalone,
    /// A Redis Cluster: the URLs are seed nodes, the rest is discovered.
    #[name = c"cluster"]
    Cluster,
    /// A primary found through Sentinel: the URLs are the sentinels.
    #[name = c"sentinel"]
    Sentinel,
}

/// Registers every setting. Called from `_PG_init`, preloaded or not, so that `SET` and `SHOW`
/// work in any backend that loaded the library. PostgreSQL allows restart-only settings to be
/// created only while preloading; without the preload no relay runs, and they are not needed.
pub fn init() {
    // SAFETY: a plain read of a postmaster global during library load.
    if unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        init_restart_only();
    }
    init_reloadable();
}

fn init_restart_only() {
    GucRegistry::define_int_guc(
        c"outbox.workers",
        c"Number of outbox relay workers per database; 0 disables relaying.",
        c"Several workers claim disjoint batches with FOR UPDATE SKIP LOCKED.",
        &WORKERS,
        0,
        MAX_WORKERS,
        GucContext::Postmaster,
        GucFlags::default(),
    );
}

fn init_reloadable() {
    // SAFETY: the check hooks are #[pg_guard] functions that only read their arguments.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.database",
            c"Databases the outbox relay works in: a name, a comma-separated list, or * for every database with the extension.",
            c"CREATE EXTENSION outbox must be run in each of them.",
            &DATABASE,
            GucContext::Sighup,
            GucFlags::default(),
            Some(checks::check_database),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.redis_url",
            c"Redis the outbox relay publishes to: one redis:// or rediss:// URL, or a comma-separated list (cluster seed nodes, or sentinels).",
            c"Holds no password: the relay reads it from outbox.redis_password_file.",
            &REDIS_URL,
            GucContext::Sighup,
            GucFlags::SUPERUSER_ONLY,
            Some(checks::check_redis_url),
            None,
            None,
        );
    }
    GucRegistry::define_enum_guc(
        c"outbox.redis_mode",
        c"What outbox.redis_url names: standalone (one server), cluster (seed nodes) or sentinel (sentinels).",
        c"",
        &REDIS_MODE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_sentinel_master",
        c"The service name Sentinel knows the Redis primary by (outbox.redis_mode = sentinel).",
        c"",
        &REDIS_SENTINEL_MASTER,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_password_file",
        c"File whose first line is the password the relay gives Redis (empty: none).",
        c"Read at each connection; refused if other users can read it. The user name stays in outbox.redis_url.",
        &REDIS_PASSWORD_FILE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_sentinel_password_file",
        c"File whose first line is the password the relay gives the sentinels (empty: none).",
        c"Read at each connection; refused if other users can read it.",
        &REDIS_SENTINEL_PASSWORD_FILE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_tls_ca_file",
        c"PEM file of the CA the relay trusts for rediss:// (empty: the system's roots).",
        c"",
        &REDIS_TLS_CA_FILE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_tls_cert_file",
        c"PEM file of the client certificate the relay presents over rediss://.",
        c"Needs outbox.redis_tls_key_file too.",
        &REDIS_TLS_CERT_FILE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_string_guc(
        c"outbox.redis_tls_key_file",
        c"PEM file of the private key of outbox.redis_tls_cert_file.",
        c"",
        &REDIS_TLS_KEY_FILE,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_int_guc(
        c"outbox.redis_wait_replicas",
        c"When positive, the relay marks a chunk only once this many Redis replicas acknowledged it (WAIT).",
        c"A chunk fewer replicas acknowledge is not marked: the worker backs off and publishes it again.",
        &REDIS_WAIT_REPLICAS,
        0,
        64,
        GucContext::Sighup,
        GucFlags::SUPERUSER_ONLY,
    );
    GucRegistry::define_int_guc(
        c"outbox.batch_size",
        c"Most events one relay claim takes.",
        c"",
        &BATCH_SIZE,
        1,
        10_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.poll_interval",
        c"How often the relay polls when no commit wakes it.",
        c"Wake-ups at commit make this a safety net, not the source of latency.",
        &POLL_INTERVAL_MS,
        10,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.redis_timeout",
        c"Connect, read and write timeout towards Redis.",
        c"",
        &REDIS_TIMEOUT_MS,
        10,
        600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_string_guc(
        c"outbox.stream_prefix",
        c"Prefix of the Redis stream key; the key is prefix + topic.",
        c"",
        &STREAM_PREFIX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.stream_maxlen",
        c"When positive, streams are trimmed with XADD MAXLEN ~ n.",
        c"",
        &STREAM_MAXLEN,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::default(),
    );
    // SAFETY: the check hook is a #[pg_guard] function that only reads its arguments.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.notify_channel",
            c"Channel of the pg_notify call made by outbox_enqueue; empty turns it off.",
            c"A transaction that notifies takes a global lock at commit; empty it if nobody listens.",
            &NOTIFY_CHANNEL,
            GucContext::Userset,
            GucFlags::default(),
            Some(checks::check_notify_channel),
            None,
            None,
        );
    }
    // SAFETY: the check hooks are #[pg_guard] functions that only read their arguments.
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.traceparent",
            c"W3C traceparent that outbox_enqueue adds to the headers of this session's events.",
            c"Used when the calling statement carries no sqlcommenter traceparent and the caller passes none in the headers; empty for none.",
            &TRACEPARENT,
            GucContext::Userset,
            GucFlags::default(),
            Some(checks::check_traceparent),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"outbox.tracestate",
            c"W3C tracestate that goes with outbox.traceparent.",
            c"Added only with outbox.traceparent; empty for none.",
            &TRACESTATE,
            GucContext::Userset,
            GucFlags::default(),
            Some(checks::check_tracestate),
            None,
            None,
        );
    }
    GucRegistry::define_int_guc(
        c"outbox.max_payload_size",
        c"Largest payload, as JSON text, that outbox_enqueue accepts.",
        c"Only superusers change it: outbox_enqueue runs with its owner's rights, and the relay holds the events in memory.",
        &MAX_PAYLOAD_SIZE,
        1,
        PAYLOAD_SIZE_CEILING,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_attempts",
        c"Failed publishes of one event before it moves to outbox_dead.",
        c"",
        &MAX_ATTEMPTS,
        1,
        1_000_000,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.retention",
        c"Published rows older than this are deleted by the relay; 0 keeps them forever.",
        c"",
        &RETENTION_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_enum_guc(
        c"outbox.dedupe",
        c"Publish idempotently: a batch republished after a relay crash adds no second entry.",
        c"auto: Redis's IDMP where every node runs Redis 8.6.2 or later, markers elsewhere; markers; idmp; off.",
        &DEDUPE,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.stream_max_age",
        c"Stream entries older than this are trimmed (XTRIM MINID ~); 0 keeps them.",
        c"",
        &STREAM_MAX_AGE_S,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_bool_guc(
        c"outbox.stream_trim_acked",
        c"Trimming keeps the entries a consumer group has not acknowledged (Redis 8.2 or later).",
        c"On older servers and Valkey the relay logs this once and trims as without it.",
        &STREAM_TRIM_ACKED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.dedupe_ttl",
        c"How long a dedupe marker left behind by a relay crash lives in Redis, and IDMP's window (at most 24 h).",
        c"",
        &DEDUPE_TTL_S,
        1,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
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

/// As bytes: a database's name need not be UTF-8 (see `relay/databases.rs`).
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

//! Every `outbox.*` setting as one row of [`SETTINGS`]: its name, who may change it and when, its
//! value (a static holding the default, with bounds or a check), and the descriptions `SHOW` and
//! `pg_settings` give. [`register`] defines the rows with PostgreSQL; `mod.rs` reads the statics.

use std::ffi::{CStr, CString};

use pgrx::guc::{GucContext, GucEnum, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};
use pgrx::pg_sys;

use super::checks;

/// Most relay workers one server can run; sizes the shared-memory slot array.
pub const MAX_WORKERS: i32 = 32;

/// Most `outbox.max_payload_size` can be raised to: the relay holds a batch's events in memory,
/// and Redis takes no string over 512 MB.
const PAYLOAD_SIZE_CEILING: i32 = 64 * 1024 * 1024;

type Text = GucSetting<Option<CString>>;

pub(super) static DATABASE: Text = Text::new(Some(c"postgres"));
pub(super) static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);
/// Never holds a password (`outbox.redis_password_file` does).
pub(super) static REDIS_URL: Text = Text::new(Some(c"redis://127.0.0.1:6379"));
pub(super) static REDIS_MODE: GucSetting<RedisMode> =
    GucSetting::<RedisMode>::new(RedisMode::Standalone);
pub(super) static REDIS_SENTINEL_MASTER: Text = Text::new(Some(c""));
pub(super) static REDIS_PASSWORD_FILE: Text = Text::new(Some(c""));
pub(super) static REDIS_SENTINEL_PASSWORD_FILE: Text = Text::new(Some(c""));
pub(super) static REDIS_TLS_CA_FILE: Text = Text::new(Some(c""));
pub(super) static REDIS_TLS_CERT_FILE: Text = Text::new(Some(c""));
pub(super) static REDIS_TLS_KEY_FILE: Text = Text::new(Some(c""));
pub(super) static REDIS_WAIT_REPLICAS: GucSetting<i32> = GucSetting::<i32>::new(0);
pub(super) static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(100);
pub(super) static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
pub(super) static REDIS_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5000);
pub(super) static STREAM_PREFIX: Text = Text::new(Some(c""));
pub(super) static STREAM_MAXLEN: GucSetting<i32> = GucSetting::<i32>::new(0);
pub(super) static NOTIFY_CHANNEL: Text = Text::new(Some(c"outbox"));
pub(super) static TRACEPARENT: Text = Text::new(Some(c""));
pub(super) static TRACESTATE: Text = Text::new(Some(c""));
pub(super) static MAX_PAYLOAD_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);
pub(super) static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(10);
pub(super) static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
pub(super) static DEDUPE: GucSetting<DedupeSetting> =
    GucSetting::<DedupeSetting>::new(DedupeSetting::Auto);
pub(super) static STREAM_MAX_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(0);
pub(super) static STREAM_TRIM_ACKED: GucSetting<bool> = GucSetting::<bool>::new(false);
pub(super) static DEDUPE_TTL_S: GucSetting<i32> = GucSetting::<i32>::new(24 * 3600);
pub(super) static MESSAGE_FORMAT: GucSetting<MessageFormat> =
    GucSetting::<MessageFormat>::new(MessageFormat::Fields);
pub(super) static CLOUDEVENTS_SOURCE: Text = Text::new(Some(c""));

/// Who may change a setting, and when it takes effect.
#[derive(Clone, Copy)]
enum Scope {
    /// postgresql.conf, at the server's start.
    Restart,
    /// postgresql.conf, at a reload.
    Reload,
    /// Also `SET` by a superuser.
    Superuser,
    /// Also `SET` by anyone.
    Anyone,
}

/// A setting's value: its static, and what bounds or checks it.
enum Value {
    Integer(&'static GucSetting<i32>, i32, i32),
    Boolean(&'static GucSetting<bool>),
    Chars(&'static Text, pg_sys::GucStringCheckHook),
    Enumerated(&'static (dyn EnumSetting + Sync)),
}

/// One setting.
struct Setting {
    name: &'static CStr,
    scope: Scope,
    flags: GucFlags,
    value: Value,
    short: &'static CStr,
    long: &'static CStr,
}

const NONE: GucFlags = GucFlags::empty();
const SUPERUSER: GucFlags = GucFlags::SUPERUSER_ONLY;
const MS: GucFlags = GucFlags::UNIT_MS;
const S: GucFlags = GucFlags::UNIT_S;
const BYTES: GucFlags = GucFlags::UNIT_BYTE;

use Scope::{Anyone, Reload, Restart, Superuser};
use Value::{Boolean, Chars, Enumerated as Of, Integer};

#[rustfmt::skip]
static SETTINGS: &[Setting] = &[
    Setting { name: c"outbox.workers", scope: Restart, flags: NONE, value: Integer(&WORKERS, 0, MAX_WORKERS),
        short: c"Number of outbox relay workers per database; 0 disables relaying.",
        long: c"Several workers claim disjoint batches with FOR UPDATE SKIP LOCKED." },
    Setting { name: c"outbox.database", scope: Reload, flags: NONE, value: Chars(&DATABASE, Some(checks::check_database)),
        short: c"Databases the outbox relay works in: a name, a comma-separated list, or * for every database with the extension.",
        long: c"CREATE EXTENSION outbox must be run in each of them." },
    Setting { name: c"outbox.redis_url", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_URL, Some(checks::check_redis_url)),
        short: c"Redis the outbox relay publishes to: one redis:// or rediss:// URL, or a comma-separated list (cluster seed nodes, or sentinels).",
        long: c"Holds no password: the relay reads it from outbox.redis_password_file." },
    Setting { name: c"outbox.redis_mode", scope: Reload, flags: SUPERUSER, value: Of(&REDIS_MODE),
        short: c"What outbox.redis_url names: standalone (one server), cluster (seed nodes) or sentinel (sentinels).",
        long: c"" },
    Setting { name: c"outbox.redis_sentinel_master", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_SENTINEL_MASTER, None),
        short: c"The service name Sentinel knows the Redis primary by (outbox.redis_mode = sentinel).",
        long: c"" },
    Setting { name: c"outbox.redis_password_file", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_PASSWORD_FILE, None),
        short: c"File whose first line is the password the relay gives Redis (empty: none).",
        long: c"Read at each connection; refused if other users can read it. The user name stays in outbox.redis_url." },
    Setting { name: c"outbox.redis_sentinel_password_file", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_SENTINEL_PASSWORD_FILE, None),
        short: c"File whose first line is the password the relay gives the sentinels (empty: none).",
        long: c"Read at each connection; refused if other users can read it." },
    Setting { name: c"outbox.redis_tls_ca_file", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_TLS_CA_FILE, None),
        short: c"PEM file of the CA the relay trusts for rediss:// (empty: the system's roots).",
        long: c"" },
    Setting { name: c"outbox.redis_tls_cert_file", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_TLS_CERT_FILE, None),
        short: c"PEM file of the client certificate the relay presents over rediss://.",
        long: c"Needs outbox.redis_tls_key_file too." },
    Setting { name: c"outbox.redis_tls_key_file", scope: Reload, flags: SUPERUSER, value: Chars(&REDIS_TLS_KEY_FILE, None),
        short: c"PEM file of the private key of outbox.redis_tls_cert_file.",
        long: c"" },
    Setting { name: c"outbox.redis_wait_replicas", scope: Reload, flags: SUPERUSER, value: Integer(&REDIS_WAIT_REPLICAS, 0, 64),
        short: c"When positive, the relay marks a chunk only once this many Redis replicas acknowledged it (WAIT).",
        long: c"A chunk fewer replicas acknowledge is not marked: the worker backs off and publishes it again." },
    Setting { name: c"outbox.batch_size", scope: Reload, flags: NONE, value: Integer(&BATCH_SIZE, 1, 10_000),
        short: c"Most events one relay claim takes.",
        long: c"" },
    Setting { name: c"outbox.poll_interval", scope: Reload, flags: MS, value: Integer(&POLL_INTERVAL_MS, 10, 3_600_000),
        short: c"How often the relay polls when no commit wakes it.",
        long: c"Wake-ups at commit make this a safety net, not the source of latency." },
    Setting { name: c"outbox.redis_timeout", scope: Reload, flags: MS, value: Integer(&REDIS_TIMEOUT_MS, 10, 600_000),
        short: c"Connect, read and write timeout towards Redis.",
        long: c"" },
    Setting { name: c"outbox.stream_prefix", scope: Reload, flags: NONE, value: Chars(&STREAM_PREFIX, None),
        short: c"Prefix of the Redis stream key; the key is prefix + topic.",
        long: c"" },
    Setting { name: c"outbox.stream_maxlen", scope: Reload, flags: NONE, value: Integer(&STREAM_MAXLEN, 0, i32::MAX),
        short: c"When positive, streams are trimmed with XADD MAXLEN ~ n.",
        long: c"" },
    Setting { name: c"outbox.notify_channel", scope: Anyone, flags: NONE, value: Chars(&NOTIFY_CHANNEL, Some(checks::check_notify_channel)),
        short: c"Channel of the pg_notify call made by outbox_enqueue; empty turns it off.",
        long: c"A transaction that notifies takes a global lock at commit; empty it if nobody listens." },
    Setting { name: c"outbox.traceparent", scope: Anyone, flags: NONE, value: Chars(&TRACEPARENT, Some(checks::check_traceparent)),
        short: c"W3C traceparent that outbox_enqueue adds to the headers of this session's events.",
        long: c"Used when the calling statement carries no sqlcommenter traceparent and the caller passes none in the headers; empty for none." },
    Setting { name: c"outbox.tracestate", scope: Anyone, flags: NONE, value: Chars(&TRACESTATE, Some(checks::check_tracestate)),
        short: c"W3C tracestate that goes with outbox.traceparent.",
        long: c"Added only with outbox.traceparent; empty for none." },
    Setting { name: c"outbox.max_payload_size", scope: Superuser, flags: BYTES, value: Integer(&MAX_PAYLOAD_SIZE, 1, PAYLOAD_SIZE_CEILING),
        short: c"Largest payload, as JSON text, that outbox_enqueue accepts.",
        long: c"Only superusers change it: outbox_enqueue runs with its owner's rights, and the relay holds the events in memory." },
    Setting { name: c"outbox.max_attempts", scope: Reload, flags: NONE, value: Integer(&MAX_ATTEMPTS, 1, 1_000_000),
        short: c"Failed publishes of one event before it moves to outbox_dead.",
        long: c"" },
    Setting { name: c"outbox.retention", scope: Reload, flags: S, value: Integer(&RETENTION_S, 0, i32::MAX),
        short: c"Published rows older than this are deleted by the relay; 0 keeps them forever.",
        long: c"" },
    Setting { name: c"outbox.dedupe", scope: Reload, flags: NONE, value: Of(&DEDUPE),
        short: c"Publish idempotently: a batch republished after a relay crash adds no second entry.",
        long: c"auto: Redis's IDMP where every node runs Redis 8.6.2 or later, markers elsewhere; markers; idmp; off." },
    Setting { name: c"outbox.stream_max_age", scope: Reload, flags: S, value: Integer(&STREAM_MAX_AGE_S, 0, i32::MAX),
        short: c"Stream entries older than this are trimmed (XTRIM MINID ~); 0 keeps them.",
        long: c"" },
    Setting { name: c"outbox.stream_trim_acked", scope: Reload, flags: NONE, value: Boolean(&STREAM_TRIM_ACKED),
        short: c"Trimming keeps the entries a consumer group has not acknowledged (Redis 8.2 or later).",
        long: c"On older servers and Valkey the relay logs this once and trims as without it." },
    Setting { name: c"outbox.dedupe_ttl", scope: Reload, flags: S, value: Integer(&DEDUPE_TTL_S, 1, i32::MAX),
        short: c"How long a dedupe marker left behind by a relay crash lives in Redis, and IDMP's window (at most 24 h).",
        long: c"" },
    Setting { name: c"outbox.message_format", scope: Reload, flags: NONE, value: Of(&MESSAGE_FORMAT),
        short: c"Shape of the stream entries: fields (id, topic, payload, created_at, key, headers) or cloudevents (CloudEvents 1.0, binary content mode).",
        long: c"With cloudevents, outbox_enqueue accepts only headers whose names are CloudEvents extension attribute names." },
    Setting { name: c"outbox.cloudevents_source", scope: Reload, flags: NONE, value: Chars(&CLOUDEVENTS_SOURCE, Some(checks::check_cloudevents_source)),
        short: c"The CloudEvents source (ce_source) of the events; {database} becomes the database's name. Empty: //postgresql/<system identifier>/<database>.",
        long: c"" },
];

/// Defines every setting with PostgreSQL; the restart-only ones only while the library is
/// preloaded, since PostgreSQL allows them only then (without the preload no relay runs, and
/// they are not needed).
pub(super) fn register() {
    // SAFETY: a plain read of a postmaster global during library load.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    for setting in SETTINGS {
        if matches!(setting.scope, Restart) && !preloading {
            continue;
        }
        setting.register();
    }
}

impl Setting {
    fn register(&self) {
        let (name, short, long, flags) = (self.name, self.short, self.long, self.flags);
        let context = self.scope.context();
        match self.value {
            Integer(value, min, max) => {
                GucRegistry::define_int_guc(name, short, long, value, min, max, context, flags)
            }
            Boolean(value) => {
                GucRegistry::define_bool_guc(name, short, long, value, context, flags)
            }
            // SAFETY: the check hooks are #[pg_guard] functions that only read their arguments.
            Chars(value, check) => unsafe {
                GucRegistry::define_string_guc_with_hooks(
                    name, short, long, value, context, flags, check, None, None,
                )
            },
            Of(value) => value.define(name, short, long, context, flags),
        }
    }
}

impl Scope {
    fn context(self) -> GucContext {
        match self {
            Restart => GucContext::Postmaster,
            Reload => GucContext::Sighup,
            Superuser => GucContext::Suset,
            Anyone => GucContext::Userset,
        }
    }
}

/// An enum setting's static, whatever its enum.
trait EnumSetting {
    fn define(
        &'static self,
        name: &'static CStr,
        short: &'static CStr,
        long: &'static CStr,
        context: GucContext,
        flags: GucFlags,
    );
}

impl<T: GucEnum> EnumSetting for GucSetting<T> {
    fn define(
        &'static self,
        name: &'static CStr,
        short: &'static CStr,
        long: &'static CStr,
        context: GucContext,
        flags: GucFlags,
    ) {
        GucRegistry::define_enum_guc(name, short, long, self, context, flags);
    }
}

/// `outbox.dedupe`'s values: those `mod.rs` maps to the Redis side's `Dedupe`, and, hidden, the
/// boolean spellings the setting took when it was on or off (on is now `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PostgresGucEnum)]
pub(super) enum DedupeSetting {
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

/// `outbox.message_format`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PostgresGucEnum)]
pub(super) enum MessageFormat {
    #[name = c"fields"]
    Fields,
    #[name = c"cloudevents"]
    CloudEvents,
}

/// What `outbox.redis_url` names: the setting's values, which `mod.rs` maps to the Redis side's
/// own `Mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PostgresGucEnum)]
pub(super) enum RedisMode {
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

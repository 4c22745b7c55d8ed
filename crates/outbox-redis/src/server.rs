//! What the servers the relay writes to can do, and so how it deduplicates and trims: read from
//! `INFO server` of each node (each primary of a cluster) when a link opens. Redis 8.6.2 added
//! idempotent production to streams (`XADD ... IDMP`), Redis 8.2 trimming that keeps what a
//! consumer group has not acknowledged (`ACKED`); Valkey has neither. Pure logic, unit-tested.

use std::fmt;

use crate::error::Error;
use crate::target::Dedupe;

/// The first Redis whose `XADD ... IDMP` the relay relies on.
const IDMP_SINCE: (u32, u32, u32) = (8, 6, 2);
/// The first Redis with `XADD`/`XTRIM ... ACKED`.
const ACKED_SINCE: (u32, u32, u32) = (8, 2, 0);

/// One server, as its `INFO server` section describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Server {
    pub valkey: bool,
    pub version: (u32, u32, u32),
}

impl fmt::Display for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor, patch) = self.version;
        let name = if self.valkey { "Valkey" } else { "Redis" };
        write!(f, "{name} {major}.{minor}.{patch}")
    }
}

/// Reads `INFO server`'s reply. Valkey reports a `redis_version` too (the Redis it is
/// compatible with): its own `valkey_version` wins.
pub fn parse_info(text: &str) -> Option<Server> {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
    };
    let (valkey, version) = match field("valkey_version") {
        Some(version) => (true, version),
        None => (false, field("redis_version")?),
    };
    let mut parts = version.split('.').map(|part| part.parse::<u32>().ok());
    let mut next = || parts.next().flatten();
    Some(Server {
        valkey,
        version: (next()?, next().unwrap_or(0), next().unwrap_or(0)),
    })
}

/// What every node written to can do. A node whose version is unknown (its user may not run
/// `INFO`) can do nothing new.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Features {
    /// Whether every node's version is known: else the others are false for want of knowing.
    pub known: bool,
    pub idmp: bool,
    pub acked: bool,
    /// The servers, for the log: "Redis 8.6.3", or "Redis 8.6.3, Redis 7.0.15" in a cluster
    /// being upgraded, or why they are unknown.
    pub servers: String,
}

/// The features of the nodes `INFO` described (`None` for a node it could not).
pub fn features(nodes: &[Option<Server>]) -> Features {
    if nodes.is_empty() || nodes.iter().any(Option::is_none) {
        return Features {
            servers: "a server whose version is unknown (INFO refused)".into(),
            ..Features::default()
        };
    }
    let nodes: Vec<Server> = nodes.iter().flatten().copied().collect();
    let all = |since| nodes.iter().all(|s| !s.valkey && s.version >= since);
    let mut names: Vec<String> = nodes.iter().map(Server::to_string).collect();
    names.sort();
    names.dedup();
    Features {
        known: true,
        idmp: all(IDMP_SINCE),
        acked: all(ACKED_SINCE),
        servers: names.join(", "),
    }
}

/// How a connection deduplicates, as `outbox_workers.dedupe` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InUse {
    Off,
    Markers,
    Idmp,
}

impl InUse {
    pub fn name(self) -> &'static str {
        match self {
            InUse::Off => "off",
            InUse::Markers => "markers",
            InUse::Idmp => "idmp",
        }
    }
}

/// What `outbox.dedupe` comes to on servers with `features`; `Err` when it asks for IDMP where
/// a server lacks it: the relay then waits, publishing nothing, until the setting or the
/// servers change.
pub fn choose(setting: Dedupe, features: &Features) -> Result<InUse, Error> {
    match setting {
        Dedupe::Off => Ok(InUse::Off),
        Dedupe::Markers => Ok(InUse::Markers),
        Dedupe::Auto if features.idmp => Ok(InUse::Idmp),
        Dedupe::Auto => Ok(InUse::Markers),
        Dedupe::Idmp if features.idmp => Ok(InUse::Idmp),
        Dedupe::Idmp => Err(Error::Setting(format!(
            "outbox.dedupe = idmp needs Redis 8.6.2 or later on every node written to, \
             and the relay writes to {}",
            features.servers
        ))),
    }
}

/// How to deduplicate the next chunk: as [`choose`] says, unless some of its events are in doubt,
/// sent another way in a transaction that did not commit (a chunk whose reply was lost when
/// Redis restarted, say): markers and IDMP do not see each other's record, so the chunk goes the
/// way they went (see `doubt.rs`). Markers always can; IDMP can unless the servers are known to
/// lack it (a reconnect whose `INFO` failed does not know).
pub fn choose_with_doubt(
    setting: Dedupe,
    features: &Features,
    in_doubt: Option<InUse>,
) -> Result<InUse, Error> {
    let chosen = choose(setting, features);
    match (in_doubt, &chosen) {
        (Some(InUse::Markers), Ok(InUse::Idmp)) => Ok(InUse::Markers),
        (Some(InUse::Idmp), Ok(InUse::Markers) | Err(_)) if !features.known || features.idmp => {
            Ok(InUse::Idmp)
        }
        _ => chosen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_in_doubt_go_again_the_way_they_went() {
        let upgraded = features(&[redis((8, 6, 3))]);
        let old = features(&[redis((7, 0, 15))]);
        let unknown = features(&[None]);
        let markers = Some(InUse::Markers);
        let idmp = Some(InUse::Idmp);
        // Nothing in doubt: as the setting and the servers say.
        assert_eq!(
            choose_with_doubt(Dedupe::Auto, &upgraded, None),
            Ok(InUse::Idmp)
        );
        // Upgraded under a chunk sent with markers: markers for its events.
        assert_eq!(
            choose_with_doubt(Dedupe::Auto, &upgraded, markers),
            Ok(InUse::Markers)
        );
        assert_eq!(
            choose_with_doubt(Dedupe::Idmp, &upgraded, markers),
            Ok(InUse::Markers)
        );
        // Switched to markers by a reload under a chunk sent with IDMP: IDMP for its events.
        assert_eq!(
            choose_with_doubt(Dedupe::Markers, &upgraded, idmp),
            Ok(InUse::Idmp)
        );
        assert_eq!(
            choose_with_doubt(Dedupe::Markers, &upgraded, None),
            Ok(InUse::Markers)
        );
        // A reconnect that could not read INFO keeps IDMP for what it sent.
        assert_eq!(
            choose_with_doubt(Dedupe::Auto, &unknown, idmp),
            Ok(InUse::Idmp)
        );
        assert_eq!(
            choose_with_doubt(Dedupe::Idmp, &unknown, idmp),
            Ok(InUse::Idmp)
        );
        // Servers known to lack IDMP cannot take it, whatever is in doubt.
        assert_eq!(
            choose_with_doubt(Dedupe::Auto, &old, idmp),
            Ok(InUse::Markers)
        );
        assert!(choose_with_doubt(Dedupe::Idmp, &old, idmp).is_err());
        // Dedupe turned off turns it off.
        assert_eq!(
            choose_with_doubt(Dedupe::Off, &upgraded, markers),
            Ok(InUse::Off)
        );
    }

    fn redis(version: (u32, u32, u32)) -> Option<Server> {
        Some(Server {
            valkey: false,
            version,
        })
    }

    #[test]
    fn info_names_the_server_and_its_version() {
        let redis8 = "# Server\r\nredis_version:8.6.3\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(parse_info(redis8), redis((8, 6, 3)));
        let valkey =
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n";
        assert_eq!(
            parse_info(valkey),
            Some(Server {
                valkey: true,
                version: (9, 1, 2)
            })
        );
        assert_eq!(parse_info("redis_version:7.0.15\n"), redis((7, 0, 15)));
        assert_eq!(
            parse_info("redis_version:255.255.255\n"),
            redis((255, 255, 255))
        );
        assert_eq!(parse_info("# Server\r\nuptime:3\r\n"), None);
        assert_eq!(parse_info("redis_version:x.1\r\n"), None);
        assert_eq!(parse_info(""), None);
    }

    #[test]
    fn every_node_must_have_a_feature() {
        let new = features(&[redis((8, 6, 2)), redis((8, 6, 3))]);
        assert!(new.idmp && new.acked);
        assert_eq!(new.servers, "Redis 8.6.2, Redis 8.6.3");
        let early_8_6 = features(&[redis((8, 6, 1))]);
        assert!(!early_8_6.idmp && early_8_6.acked);
        let mixed = features(&[redis((8, 6, 3)), redis((7, 0, 15)), redis((8, 6, 3))]);
        assert!(!mixed.idmp && !mixed.acked);
        assert_eq!(mixed.servers, "Redis 7.0.15, Redis 8.6.3");
        let valkey = features(&[Some(Server {
            valkey: true,
            version: (9, 1, 2),
        })]);
        assert!(!valkey.idmp && !valkey.acked);
        let unknown = features(&[redis((8, 6, 3)), None]);
        assert!(!unknown.idmp && !unknown.acked);
        assert!(unknown.servers.contains("unknown"));
        assert!(!features(&[]).idmp);
    }

    #[test]
    fn auto_takes_idmp_only_where_every_node_has_it() {
        let new = features(&[redis((8, 6, 3))]);
        let old = features(&[redis((7, 0, 15))]);
        assert_eq!(choose(Dedupe::Auto, &new), Ok(InUse::Idmp));
        assert_eq!(choose(Dedupe::Auto, &old), Ok(InUse::Markers));
        assert_eq!(choose(Dedupe::Markers, &new), Ok(InUse::Markers));
        assert_eq!(choose(Dedupe::Off, &new), Ok(InUse::Off));
        assert_eq!(choose(Dedupe::Idmp, &new), Ok(InUse::Idmp));
        let refused = choose(Dedupe::Idmp, &old).unwrap_err().to_string();
        assert!(refused.contains("Redis 7.0.15"), "{refused}");
    }
}

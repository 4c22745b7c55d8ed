//! `outbox.redis_url`: one URL, or a comma-separated list of them (the seed nodes of a cluster,
//! or the sentinels), and whether the Redis client takes them. A URL never holds a password:
//! settings are readable by roles such as `pg_monitor`, so the password lives in a file
//! (`outbox.redis_password_file`).

use std::fmt;

use redis::{ConnectionAddr, IntoConnectionInfo};

/// The URLs of a setting, trimmed, empty items dropped.
pub fn split(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// Why a value of `outbox.redis_url` was refused. Its text never quotes the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// A URL holds a password.
    Password,
    /// Anything else, said in words.
    Invalid(String),
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::Password => f.write_str(
                "A Redis URL holds no password: settings are readable by monitoring roles.",
            ),
            Refused::Invalid(why) => f.write_str(why),
        }
    }
}

const LOOKS_LIKE: &str =
    "A Redis URL looks like redis://host:6379/0, redis://user@host or rediss://host.";

/// Accepts what the Redis client accepts (`redis://`, `rediss://` for TLS, `unix://` or
/// `redis+unix://` for a socket), one URL or several, without a password; says what is wrong
/// otherwise. The URLs of a list must agree on TLS, user and database: the relay reaches every
/// node of one deployment the same way.
pub fn validate(list: &str) -> Result<(), Refused> {
    let urls = split(list);
    if urls.is_empty() {
        return Err(Refused::Invalid(LOOKS_LIKE.to_string()));
    }
    // The URLs are named by their place in the list, never shown: a URL that does not parse
    // cannot be told apart into a password and the rest.
    let place = |n: usize| {
        if urls.len() == 1 {
            "The URL".to_string()
        } else {
            format!("URL {} of {}", n + 1, urls.len())
        }
    };
    let mut first: Option<(bool, Option<String>, i64)> = None;
    for (n, url) in urls.iter().enumerate() {
        let info = url
            .into_connection_info()
            .map_err(|e| Refused::Invalid(format!("{}: {e}. {LOOKS_LIKE}", place(n))))?;
        let settings = info.redis_settings();
        if settings.password().is_some() || socket_user_info(url) {
            return Err(Refused::Password);
        }
        let seen = (
            is_tls(info.addr()),
            settings.username().map(str::to_string),
            settings.db(),
        );
        match &first {
            None => first = Some(seen),
            Some(f) if *f == seen => {}
            Some(_) => {
                return Err(Refused::Invalid(format!(
                    "{} differs from the first in its scheme, user or database; the URLs of a \
                     list must agree on them.",
                    place(n)
                )))
            }
        }
    }
    Ok(())
}

fn is_tls(addr: &ConnectionAddr) -> bool {
    matches!(addr, ConnectionAddr::TcpTls { .. })
}

/// Whether a socket URL (`unix://`, `redis+unix://`) carries user information before its path:
/// the client ignores it, but what is written there is meant as a password.
fn socket_user_info(url: &str) -> bool {
    let Some((scheme, rest)) = url.split_once(':') else {
        return false;
    };
    let scheme = scheme.to_ascii_lowercase();
    if !scheme.ends_with("unix") {
        return false;
    }
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    rest.contains('@')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_tls_user_and_socket_urls() {
        assert!(validate("redis://127.0.0.1:6379").is_ok());
        assert!(validate("redis://relay@localhost:6380/2").is_ok());
        assert!(validate("rediss://redis.example.com").is_ok());
        assert!(validate("unix:///run/redis.sock").is_ok());
        assert!(validate("unix:///run/redis.sock?db=2").is_ok());
    }

    #[test]
    fn rejects_other_schemes_and_missing_hosts() {
        for list in [
            "http://127.0.0.1:6379",
            "127.0.0.1:6379",
            "redis://",
            "redis://:6379",
            "redis://h/notadb",
            "",
            " , ",
        ] {
            assert!(matches!(validate(list), Err(Refused::Invalid(_))), "{list}");
        }
    }

    #[test]
    fn refuses_every_way_of_writing_a_password() {
        for list in [
            "redis://:pw@localhost:6380/2",
            "rediss://user:pw@redis.example.com",
            "redis://a:1,redis://:pw@b:2",
            "unix:///run/redis.sock?db=0&pass=pw",
            "redis+unix:///run/redis.sock?pass=pw",
        ] {
            assert_eq!(validate(list), Err(Refused::Password), "{list}");
        }
        // User information in a socket URL, which the client ignores: refused all the same.
        for list in [
            "unix://:pw@/run/redis.sock",
            "unix://u:pw@localhost/run/redis.sock",
        ] {
            assert!(validate(list).is_err(), "{list}");
        }
    }

    #[test]
    fn names_a_refused_url_by_its_place_never_by_its_text() {
        for list in [
            "redis://:s3cret@h:99999",
            "redis://:pa/s3cret@h:6379",
            "redis://:pa,s3cret@h:6379",
            "redis//:s3cret@h",
            "redis://:a@h:1,redis://:s3cret@h:2",
        ] {
            let why = validate(list).expect_err(list).to_string();
            assert!(!why.contains("s3cret"), "{list}: {why}");
            assert!(why.contains("URL"), "{list}: {why}");
        }
        let why = validate("redis://a@h:1,redis://b@h:2").unwrap_err();
        assert!(why.to_string().starts_with("URL 2 of 2 differs"), "{why}");
    }

    #[test]
    fn accepts_lists_that_agree_and_rejects_those_that_do_not() {
        assert!(validate("redis://u@a:7000, redis://u@b:7001,redis://u@c:7002").is_ok());
        assert_eq!(
            split(" redis://a:1 ,, redis://b:2 "),
            ["redis://a:1", "redis://b:2"]
        );
        let mixed_tls = validate("rediss://a:1,redis://b:2").unwrap_err();
        assert!(
            mixed_tls.to_string().starts_with("URL 2 of 2"),
            "{mixed_tls}"
        );
        assert!(validate("redis://a:1/0,redis://b:2/3").is_err());
        assert!(validate("redis://a:1,http://b:2").is_err());
    }
}

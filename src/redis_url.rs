//! `outbox.redis_url`: one URL, or a comma-separated list of them (the seed nodes of a cluster,
//! or the sentinels); whether the Redis client takes them, and how to show them without their
//! passwords.

use redis::{ConnectionAddr, IntoConnectionInfo};

/// The URLs of a setting, trimmed, empty items dropped.
pub fn split(list: &str) -> Vec<&str> {
    list.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// Accepts what the Redis client accepts (`redis://`, `rediss://` for TLS, `unix://` or
/// `redis+unix://` for a socket), one URL or several; says what is wrong otherwise. The URLs of
/// a list must agree on TLS, user, password and database: the relay reaches every node of one
/// deployment the same way.
pub fn validate(list: &str) -> Result<(), String> {
    let urls = split(list);
    if urls.is_empty() {
        return Err(
            "A Redis URL looks like redis://:password@host:6379/0 or rediss://host.".to_string(),
        );
    }
    let mut first: Option<(bool, Option<String>, Option<String>, i64)> = None;
    for url in &urls {
        let info = url.into_connection_info().map_err(|e| {
            format!(
                "{}: {e}. A Redis URL looks like redis://:password@host:6379/0 or rediss://host.",
                mask(url)
            )
        })?;
        let settings = info.redis_settings();
        let seen = (
            is_tls(info.addr()),
            settings.username().map(str::to_string),
            settings.password().map(str::to_string),
            settings.db(),
        );
        match &first {
            None => first = Some(seen),
            Some(f) if *f == seen => {}
            Some(_) => {
                return Err(format!(
                    "{} differs from the first URL in its scheme, user, password or database; \
                     the URLs of a list must agree on them.",
                    mask(url)
                ))
            }
        }
    }
    Ok(())
}

fn is_tls(addr: &ConnectionAddr) -> bool {
    matches!(addr, ConnectionAddr::TcpTls { .. })
}

/// The URLs with any password replaced by `***`, for logs and error messages.
pub fn mask(list: &str) -> String {
    list.split(',').map(mask_one).collect::<Vec<_>>().join(",")
}

fn mask_one(url: &str) -> String {
    if url.trim().is_empty() {
        return url.to_string();
    }
    // Without a scheme nothing tells a password from a host: shown as nothing of it.
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(not a URL)".to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_string();
    };
    let masked = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        // `redis://secret@host` is read by Redis clients as a password alone.
        None => "***".to_string(),
    };
    format!("{scheme}://{masked}@{host}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_tls_and_socket_urls() {
        assert!(validate("redis://127.0.0.1:6379").is_ok());
        assert!(validate("redis://:pw@localhost:6380/2").is_ok());
        assert!(validate("rediss://user:pw@redis.example.com").is_ok());
        assert!(validate("unix:///run/redis.sock").is_ok());
    }

    #[test]
    fn rejects_other_schemes_and_missing_hosts() {
        assert!(validate("http://127.0.0.1:6379").is_err());
        assert!(validate("127.0.0.1:6379").is_err());
        assert!(validate("redis://").is_err());
        assert!(validate("redis://:pw@").is_err());
        assert!(validate("redis://:6379").is_err());
        assert!(validate("redis://h/notadb").is_err());
        assert!(validate("").is_err());
        assert!(validate(" , ").is_err());
    }

    #[test]
    fn accepts_lists_that_agree_and_rejects_those_that_do_not() {
        assert!(validate("redis://:pw@a:7000, redis://:pw@b:7001,redis://:pw@c:7002").is_ok());
        assert_eq!(
            split(" redis://a:1 ,, redis://b:2 "),
            ["redis://a:1", "redis://b:2"]
        );
        let mixed_tls = validate("rediss://a:1,redis://b:2").unwrap_err();
        assert!(mixed_tls.contains("redis://b:2"), "{mixed_tls}");
        let other_password = validate("redis://:one@a:1,redis://:two@b:2").unwrap_err();
        assert!(!other_password.contains("two"), "{other_password}");
        assert!(validate("redis://a:1/0,redis://b:2/3").is_err());
        assert!(validate("redis://a:1,http://b:2").is_err());
    }

    #[test]
    fn masks_passwords_only() {
        assert_eq!(mask("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(mask("redis://:s3cret@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(mask("rediss://app:s3cret@h"), "rediss://app:***@h");
        assert_eq!(mask("redis://s3cret@h"), "redis://***@h");
        assert_eq!(mask("redis://:p@ss@word@h/0"), "redis://:***@h/0");
        assert!(!mask("redis://u:pa%40ss@h").contains("pa%40ss"));
        assert_eq!(
            mask("redis://:a@h:1, redis://:b@h:2"),
            "redis://:***@h:1, redis://:***@h:2"
        );
        assert_eq!(mask("redis://h:1,"), "redis://h:1,");
    }

    #[test]
    fn masks_what_is_not_a_url_whole() {
        assert_eq!(mask("redis//:s3cret@h"), "(not a URL)");
        assert_eq!(mask("redis://h:1,x:s3cret@y"), "redis://h:1,(not a URL)");
    }
}

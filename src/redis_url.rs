//! `outbox.redis_url`: whether the Redis client takes it, and how to show it without its
//! password.

/// Accepts exactly what the Redis client accepts (`redis://`, `rediss://` for TLS, `unix://`
/// or `redis+unix://` for a socket); says what is wrong otherwise.
pub fn validate(url: &str) -> Result<(), String> {
    redis::IntoConnectionInfo::into_connection_info(url)
        .map(|_| ())
        .map_err(|e| {
            format!("{e}. A Redis URL looks like redis://:password@host:6379/0 or rediss://host.")
        })
}

/// The URL with any password replaced by `***`, for logs and error messages.
pub fn mask(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
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
    }

    #[test]
    fn masks_passwords_only() {
        assert_eq!(mask("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(mask("redis://:s3cret@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(mask("rediss://app:s3cret@h"), "rediss://app:***@h");
        assert_eq!(mask("redis://s3cret@h"), "redis://***@h");
        assert_eq!(mask("redis://:p@ss@word@h/0"), "redis://:***@h/0");
        assert!(!mask("redis://u:pa%40ss@h").contains("pa%40ss"));
    }
}

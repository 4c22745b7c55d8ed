//! `outbox.redis_url`: what a valid value looks like, and how to show it without its password.

/// Accepts `redis://` and `rediss://` URLs with a host; says what is wrong otherwise.
pub fn validate(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"))
        .ok_or_else(|| {
            "The URL must start with redis:// or rediss://, as in redis://:password@host:6379/0."
                .to_string()
        })?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    if host.is_empty() || host.starts_with(':') {
        return Err("The URL names no host, as in redis://127.0.0.1:6379.".to_string());
    }
    Ok(())
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
    fn accepts_plain_and_tls_urls() {
        assert!(validate("redis://127.0.0.1:6379").is_ok());
        assert!(validate("redis://:pw@localhost:6380/2").is_ok());
        assert!(validate("rediss://user:pw@redis.example.com").is_ok());
    }

    #[test]
    fn rejects_other_schemes_and_missing_hosts() {
        assert!(validate("http://127.0.0.1:6379").is_err());
        assert!(validate("127.0.0.1:6379").is_err());
        assert!(validate("redis://").is_err());
        assert!(validate("redis://:pw@").is_err());
        assert!(validate("redis://:6379").is_err());
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

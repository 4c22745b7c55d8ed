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
    // The URLs are named by their place in the list, never shown: a URL that does not parse
    // cannot be told apart into a password and the rest.
    let place = |n: usize| {
        if urls.len() == 1 {
            "The URL".to_string()
        } else {
            format!("URL {} of {}", n + 1, urls.len())
        }
    };
    let mut first: Option<(bool, Option<String>, Option<String>, i64)> = None;
    for (n, url) in urls.iter().enumerate() {
        let info = url.into_connection_info().map_err(|e| {
            format!(
                "{}: {e}. A Redis URL looks like redis://:password@host:6379/0 or rediss://host.",
                place(n)
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
                    "{} differs from the first in its scheme, user, password or database; \
                     the URLs of a list must agree on them.",
                    place(n)
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
    let lead = url.len() - url.trim_start().len();
    let (space, url) = url.split_at(lead);
    // The scheme as the URL parser reads it: up to the first ':'. Without one nothing tells a
    // password from a host: shown as nothing of it.
    let scheme_len = url.bytes().take_while(|&b| is_scheme_byte(b)).count();
    let (scheme, after) = url.split_at(scheme_len);
    let Some(after) = after.strip_prefix(':').filter(|_| scheme_len > 0) else {
        return format!("{space}(not a URL)");
    };
    let (separator, rest) = match after.strip_prefix("//") {
        Some(rest) => ("://", rest),
        None => (":", after),
    };
    // A socket URL (`unix:///run/r.sock`, `unix:/run/r.sock`) gives its password in its query.
    if is_socket_scheme(scheme.as_bytes()) {
        let rest = mask_query(rest.as_bytes());
        return format!(
            "{space}{scheme}{separator}{}",
            text(mask_socket_user_info(&rest))
        );
    }
    if separator != "://" {
        return format!("{space}(not a URL)");
    }
    // Up to the last '@': a password written with '/', '?' or '#' unescaped is masked whole.
    let rest = mask_user_info(rest.as_bytes());
    format!("{space}{scheme}://{}", text(mask_query(&rest)))
}

/// Whether a byte may be part of a URL's scheme: letters, digits, `+`, `-` and `.`.
pub(crate) fn is_scheme_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')
}

/// Whether a scheme names a socket (`unix`, `redis+unix`, in any case).
pub(crate) fn is_socket_scheme(scheme: &[u8]) -> bool {
    const UNIX: &[u8] = b"unix";
    scheme.len() >= UNIX.len() && scheme[scheme.len() - UNIX.len()..].eq_ignore_ascii_case(UNIX)
}

/// The part of a URL after `://` with what precedes its last `@` masked, a user name kept.
pub(crate) fn mask_user_info(rest: &[u8]) -> Vec<u8> {
    let Some(at) = rest.iter().rposition(|&b| b == b'@') else {
        return rest.to_vec();
    };
    let mut out = match rest[..at].iter().position(|&b| b == b':') {
        Some(colon) => [&rest[..colon], b":***"].concat(),
        // `redis://secret@host` is read by Redis clients as a password alone.
        None => b"***".to_vec(),
    };
    out.extend_from_slice(&rest[at..]);
    out
}

/// A socket URL's user information masked: the Redis client ignores it, but a password typed
/// there (`unix://:secret@/run/redis.sock`) is one still. What precedes the last `@` before the
/// query is masked.
pub(crate) fn mask_socket_user_info(rest: &[u8]) -> Vec<u8> {
    // Up to the query, or to the last `@` before a host and the socket's path (which is
    // absolute): a password may hold `?`.
    let query = rest.iter().position(|&b| b == b'?').unwrap_or(rest.len());
    let before_path = (0..rest.len())
        .rev()
        .filter(|&at| rest[at] == b'@')
        .find(|&at| {
            rest[at + 1..]
                .iter()
                .find(|b| matches!(b, b'/' | b'?' | b'#' | b'@'))
                == Some(&b'/')
        })
        .map_or(0, |at| at + 1);
    let end = query.max(before_path);
    let mut out = mask_user_info(&rest[..end]);
    out.extend_from_slice(&rest[end..]);
    out
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The query's `pass` parameter masked, to the end: a socket URL
/// (`unix:///run/redis.sock?pass=...`) gives its password there, and one with an unescaped `&`
/// or `#` in it would show the rest.
pub(crate) fn mask_query(rest: &[u8]) -> Vec<u8> {
    let Some(question) = rest.iter().position(|&b| b == b'?') else {
        return rest.to_vec();
    };
    let query = &rest[question + 1..];
    let mut pair = 0;
    while pair < query.len() {
        let end = query[pair..]
            .iter()
            .position(|&b| b == b'&')
            .map_or(query.len(), |p| pair + p);
        if let Some(equals) = query[pair..end].iter().position(|&b| b == b'=') {
            if percent_decoded(&query[pair..pair + equals]) == "pass" {
                let value = question + 1 + pair + equals + 1;
                return [&rest[..value], b"***"].concat();
            }
        }
        pair = end + 1;
    }
    rest.to_vec()
}

/// A query key as the URL parser reads it: `%XX` escapes and `+` decoded.
pub(crate) fn percent_decoded(bytes: &[u8]) -> String {
    // The URL parser drops tabs and line breaks wherever they are.
    let bytes: Vec<u8> = bytes
        .iter()
        .copied()
        .filter(|b| !matches!(b, b'\t' | b'\n' | b'\r'))
        .collect();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |at: usize| {
            bytes
                .get(at)
                .and_then(|&b| (b as char).to_digit(16))
                .map(|d| d as u8)
        };
        match (bytes[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push(high << 4 | low);
                i += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
    fn names_a_refused_url_by_its_place_never_by_its_text() {
        for list in [
            "redis://:s3cret@h:99999",
            "redis://:pa/s3cret@h:6379",
            "redis://:pa,s3cret@h:6379",
            "redis//:s3cret@h",
            "redis://:a@h:1,redis://:s3cret@h:2",
        ] {
            let why = validate(list).expect_err(list);
            assert!(!why.contains("s3cret"), "{list}: {why}");
            assert!(why.contains("URL"), "{list}: {why}");
        }
        let why = validate("redis://:a@h:1,redis://:b@h:2").unwrap_err();
        assert!(why.starts_with("URL 2 of 2 differs"), "{why}");
    }

    #[test]
    fn accepts_lists_that_agree_and_rejects_those_that_do_not() {
        assert!(validate("redis://:pw@a:7000, redis://:pw@b:7001,redis://:pw@c:7002").is_ok());
        assert_eq!(
            split(" redis://a:1 ,, redis://b:2 "),
            ["redis://a:1", "redis://b:2"]
        );
        let mixed_tls = validate("rediss://a:1,redis://b:2").unwrap_err();
        assert!(mixed_tls.starts_with("URL 2 of 2"), "{mixed_tls}");
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
        assert_eq!(mask("redis://:pa/ss?w#d@h:1/0"), "redis://:***@h:1/0");
        // A socket URL's password is in its query.
        assert_eq!(
            mask("unix:///run/redis.sock?db=2&pass=s3cret&user=app"),
            "unix:///run/redis.sock?db=2&pass=***"
        );
        assert_eq!(
            mask("redis+unix:///s?p%61ss=s3cret#x"),
            "redis+unix:///s?p%61ss=***"
        );
        assert!(!mask("unix:///s?pass=a@s3cret").contains("s3cret"));
        assert!(!mask("redis://:x?pass=y@h").contains('x'));
        assert_eq!(mask("unix:///s?db=1"), "unix:///s?db=1");
        // The scheme in capitals, a tab in the key: the client reads both as a socket's password.
        assert!(!mask("REDIS+UNIX:///run/redis.sock?pass=a@s3cret").contains("s3cret"));
        assert!(!mask("unix:///s?pa\tss=s3cret").contains("s3cret"));
        // Written without `//`, with a `://` or an unescaped `&` or `#` in the password.
        assert_eq!(
            mask("unix:/run/r.sock?pass=ab://s3cret"),
            "unix:/run/r.sock?pass=***"
        );
        assert!(!mask("unix:///s?pass=ab&s3cret").contains("s3cret"));
        assert!(!mask("unix:///s?pass=ab#s3cret").contains("s3cret"));
        assert_eq!(mask("redis//h"), "(not a URL)");
        // The client ignores a socket URL's user information; a password there is masked.
        assert_eq!(
            mask("unix://:s3cret@/run/r.sock?db=1"),
            "unix://:***@/run/r.sock?db=1"
        );
        assert!(!mask("unix://:s3?cret@localhost/run/r.sock").contains("cret"));
    }

    #[test]
    fn masks_what_is_not_a_url_whole() {
        assert_eq!(mask("redis//:s3cret@h"), "(not a URL)");
        assert_eq!(mask("redis://h:1,x:s3cret@y"), "redis://h:1,(not a URL)");
    }
}

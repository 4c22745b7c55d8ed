//! Redis URLs in free text (a log line, a statement), found and masked so that no password
//! shows. Pure logic, unit-tested; `log_mask.rs` applies it to what PostgreSQL logs.
//!
//! The text is bytes in the server's encoding, every one of which keeps ASCII bytes for ASCII
//! characters, and nothing in it can be trusted to be well formed: a value may be cut short
//! (`log_parameter_max_length`), quoted in any of SQL's ways, or be one the setting refused.
//! So the masking errs on the side of hiding: a URL runs from its scheme to where the next
//! one starts, white space and quotes included; everything before the last `@` in that stretch
//! is user information, and a `pass=` value runs to the last quote in it (or to its end, when
//! another URL follows). Masking masked text again changes nothing; the extension's own lines,
//! masked as they are written (`redis_url::mask`), are left alone (`log_mask.rs`).

use crate::redis_url::{mask_socket_user_info, mask_user_info, percent_decoded};

/// Whether the text names the setting (`outbox.redis_url`, in any case or quoting).
pub fn names_setting(text: &[u8]) -> bool {
    const SETTING: &[u8] = b"redis_url";
    text.windows(SETTING.len())
        .any(|w| w.eq_ignore_ascii_case(SETTING))
}

/// Whether the text holds a URL of a Redis scheme followed by `/`, as a value given under a
/// mistyped or cut name would (`redis:users:1`, a cache key, is no URL).
pub fn has_redis_url(text: &[u8]) -> bool {
    url_starts(text).iter().any(|url| {
        is_redis_scheme(&text[url.scheme..url.name_end])
            && text[url.name_end..url.rest].contains(&b'/')
    })
}

/// Schemes the Redis client reads, known even when written without `//` (`unix:/run/r.sock`)
/// or mistyped without their colon (`redis//host`).
const SCHEMES: &[&[u8]] = &[
    b"redis",
    b"rediss",
    b"redis+unix",
    b"unix",
    b"valkey",
    b"valkeys",
    b"valkey+unix",
];

fn is_redis_scheme(name: &[u8]) -> bool {
    SCHEMES.iter().any(|s| name.eq_ignore_ascii_case(s))
}

/// The text with the password of every URL in it masked, or `None` when nothing changes.
/// Masking masked text again changes nothing.
pub fn mask_urls(text: &[u8]) -> Option<Vec<u8>> {
    let starts = url_starts(text);
    let first = starts.first().map_or(text.len(), |url| url.scheme);
    let mut out = mask_words(&text[..first]);
    for (n, url) in starts.iter().enumerate() {
        let end = starts.get(n + 1).map_or(text.len(), |next| next.scheme);
        out.extend_from_slice(&text[url.scheme..url.rest]);
        let rest = &text[url.rest..end];
        let scheme = &text[url.scheme..url.name_end];
        let socket =
            starts_with_ignore_case(scheme, b"unix") || contains_ignore_case(scheme, b"+unix");
        out.extend(mask_url(rest, socket, n + 1 == starts.len()));
    }
    (out != text).then_some(out)
}

/// What follows `scheme://` up to the next URL (`last` when none follows), masked. An `@`
/// after the query's start with a password in the query leaves no telling which `@` ends which
/// password: then all of it is hidden.
fn mask_url(rest: &[u8], socket: bool, last: bool) -> Vec<u8> {
    if let Some(question) = rest.iter().position(|&b| b == b'?') {
        let query = &rest[question + 1..];
        if query.contains(&b'@') && pass_values(query).next().is_some() {
            return hidden(rest, last);
        }
    }
    if socket {
        // A socket URL gives its password in its query.
        mask_socket_user_info(&mask_query(rest, last))
    } else {
        mask_query(&mask_user_info_or_cut(rest), last)
    }
}

/// `***` in place of a value, and what follows it: of the last URL, what follows the last
/// quote (the one that closes the value, when it is quoted); of one another URL follows, the
/// separator before that one (a quote there may be in the password).
fn hidden(value: &[u8], last: bool) -> Vec<u8> {
    let kept = if last {
        value
            .iter()
            .rposition(|&b| b == b'\'' || b == b'"')
            .unwrap_or(value.len())
    } else {
        value.len()
            - value
                .iter()
                .rev()
                .take_while(|&&b| b == b',' || b.is_ascii_whitespace())
                .count()
    };
    [&b"***"[..], &value[kept..]].concat()
}

/// The values of a query's `pass` keys, each to the end of the text.
fn pass_values(query: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut pair = 0;
    std::iter::from_fn(move || {
        while pair < query.len() {
            let start = pair;
            let end = query[start..]
                .iter()
                .position(|&b| b == b'&')
                .map_or(query.len(), |p| start + p);
            pair = end + 1;
            let Some(equals) = query[start..end].iter().position(|&b| b == b'=') else {
                continue;
            };
            if percent_decoded(&query[start..start + equals]) == "pass" {
                return Some(&query[start + equals + 1..]);
            }
        }
        None
    })
}

/// Where a URL starts (its scheme), where the scheme's name ends, and where what follows
/// `scheme://` starts.
struct UrlStart {
    scheme: usize,
    name_end: usize,
    rest: usize,
}

/// The URLs' starts: a scheme followed by `://`, or a Redis scheme followed by `:` or `/`,
/// where a value may start (so that `redis://unix:secret@host` is one URL, not two).
fn url_starts(text: &[u8]) -> Vec<UrlStart> {
    let mut starts = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let b = text[at];
        if b != b':' && b != b'/' {
            at += 1;
            continue;
        }
        let scheme = scheme_start(text, at);
        let name = &text[scheme..at];
        let may_start = scheme == 0 || is_value_start(text[scheme - 1]);
        let rest = if !may_start || name.is_empty() {
            None
        } else if text[at..].starts_with(b"://") {
            Some(at + 3)
        } else if is_redis_scheme(name) {
            Some(
                at + text[at..]
                    .iter()
                    .take_while(|&&c| c == b':' || c == b'/')
                    .count(),
            )
        } else {
            None
        };
        let Some(rest) = rest else {
            at += 1;
            continue;
        };
        starts.push(UrlStart {
            scheme,
            name_end: at,
            rest,
        });
        at = rest;
    }
    starts
}

/// Whether a value may start after this byte: white space, a quote, a bracket, or what
/// separates a name from its value or one value from the next.
fn is_value_start(before: u8) -> bool {
    before.is_ascii_whitespace()
        || matches!(
            before,
            b'\'' | b'"' | b'$' | b'=' | b',' | b';' | b'(' | b'[' | b'{' | b'<' | b'>'
        )
}

/// Where the scheme that ends at `end` starts: the letters, digits, `+`, `-` and `.` before it.
fn scheme_start(text: &[u8], end: usize) -> usize {
    let scheme = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.');
    end - text[..end].iter().rev().take_while(|b| scheme(b)).count()
}

/// User information masked. Without an `@`, a value cut short (`...`, as PostgreSQL shortens
/// long parameters) is masked up to the cut, which may be inside a password; and a refused
/// value whose `user:password` lacks its `@host` has what follows the `:` masked, unless that
/// is a port.
fn mask_user_info_or_cut(rest: &[u8]) -> Vec<u8> {
    if rest.contains(&b'@') {
        return mask_user_info(rest);
    }
    if let Some(cut) = rest.windows(3).position(|w| w == b"...").filter(|&c| c > 0) {
        return [&b"***"[..], &rest[cut..]].concat();
    }
    let authority = rest
        .iter()
        .position(|&b| {
            matches!(b, b'/' | b'?' | b'#' | b',' | b'\'' | b'"') || b.is_ascii_whitespace()
        })
        .unwrap_or(rest.len());
    let colon = rest[..authority].iter().position(|&b| b == b':');
    match colon {
        Some(colon)
            if !rest.starts_with(b"[")
                && !rest[colon + 1..authority].iter().all(u8::is_ascii_digit) =>
        {
            [&rest[..colon], b":***", &rest[authority..]].concat()
        }
        _ => rest.to_vec(),
    }
}

/// The query's `pass` value masked. It runs past `&`, `#` and white space, which a password
/// may hold (`hidden`).
fn mask_query(rest: &[u8], last: bool) -> Vec<u8> {
    let Some(question) = rest.iter().position(|&b| b == b'?') else {
        return rest.to_vec();
    };
    match pass_values(&rest[question + 1..]).next() {
        Some(value) => [&rest[..rest.len() - value.len()], &hidden(value, last)].concat(),
        None => rest.to_vec(),
    }
}

/// Text before any URL: a word with an `@` (a refused value without a scheme, say) has what
/// precedes its last `@` masked, and a `pass=` in it too.
fn mask_words(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for (n, word) in text.split(|&b| b == b' ').enumerate() {
        if n > 0 {
            out.push(b' ');
        }
        let quotes = word
            .iter()
            .take_while(|&&b| matches!(b, b'\'' | b'"' | b'(' | b'\t' | b'\n'))
            .count();
        let (lead, word) = word.split_at(quotes);
        out.extend_from_slice(lead);
        out.extend(mask_query(&mask_user_info(word), true));
    }
    out
}

fn starts_with_ignore_case(text: &[u8], prefix: &[u8]) -> bool {
    text.len() >= prefix.len() && text[..prefix.len()].eq_ignore_ascii_case(prefix)
}

fn contains_ignore_case(text: &[u8], needle: &[u8]) -> bool {
    text.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn masked(text: &str) -> Option<String> {
        mask_urls(text.as_bytes()).map(|b| String::from_utf8(b).expect("not UTF-8"))
    }

    #[test]
    fn masks_the_urls_of_a_line_or_a_statement() {
        assert_eq!(
            masked(r#"parameter "outbox.redis_url" changed to "redis://app:s3cret@h:1/0""#)
                .as_deref(),
            Some(r#"parameter "outbox.redis_url" changed to "redis://app:***@h:1/0""#)
        );
        assert_eq!(
            masked("ALTER SYSTEM SET OUTBOX.REDIS_URL = 'redis://:a@h:1,rediss://:b@h:2';")
                .as_deref(),
            Some("ALTER SYSTEM SET OUTBOX.REDIS_URL = 'redis://:***@h:1,rediss://:***@h:2';")
        );
        // A socket URL's password is in its query, and runs to the last quote.
        assert_eq!(
            masked("SET outbox.redis_url TO 'redis+unix:///s.sock?db=1&pass=s3cret'").as_deref(),
            Some("SET outbox.redis_url TO 'redis+unix:///s.sock?db=1&pass=***'")
        );
        assert_eq!(
            masked("SELECT set_config('outbox.redis_url', 'unix:///s?pass=s3cret', false)")
                .as_deref(),
            Some("SELECT set_config('outbox.redis_url', 'unix:///s?pass=***', false)")
        );
        // An '@' in the query with a password there: which '@' ends which is unknown.
        assert_eq!(
            masked("parameters: $1 = 'unix:///s?pass=a@s3cret', $2 = 'x'").as_deref(),
            Some("parameters: $1 = 'unix://***'")
        );
    }

    #[test]
    fn masks_each_url_of_a_list_to_its_separator() {
        assert_eq!(
            masked("SET outbox.redis_url = 'unix:///s?pass=a,unix:///t?pass=b'").as_deref(),
            Some("SET outbox.redis_url = 'unix:///s?pass=***,unix:///t?pass=***'")
        );
        // A quote in the first password is no closing quote.
        assert_eq!(
            masked(r#"changed to "unix:///a?pass=ab's3cret, unix:///b?pass=ab's3cret""#).as_deref(),
            Some(r#"changed to "unix:///a?pass=***, unix:///b?pass=***""#)
        );
    }

    #[test]
    fn hides_passwords_that_break_words_or_quotes() {
        for text in [
            // Quotes, commas, '@' and white space in a password.
            "SET outbox.redis_url = 'redis://:pa''s,s3cret@h:1'",
            "changed to \"redis://:pa\"s3cret@h\"",
            "outbox.redis_url='redis://u:p@s3cret@h'",
            "outbox.redis_url = 'redis://:my s3cret@h'",
            "outbox.redis_url = E'redis://:a\\'s3cret@h'",
            "outbox.redis_url = 'redis://:s3cret\n@h'",
            // Taken without `//`, or refused: no scheme, a mistyped one.
            "changed to \"unix:/run/redis.sock?pass=s3cret\"",
            "SET outbox.redis_url = 'redis//:s3cret@h'",
            "SET outbox.redis_url = '127.0.0.1:6379,x:s3cret@y'",
            // Cut short inside the password by log_parameter_max_length.
            "parameters: $1 = 'outbox.redis_url', $2 = 'redis://default:s3cret...'",
            // A user named like a scheme; a password with `://`, `&`, `#` or an '@'.
            "SET outbox.redis_url = 'redis://unix:s3cret@h'",
            "SET outbox.redis_url = 'redis://:ab://s3cret@h'",
            "SET outbox.redis_url = 'unix:///s?pass=a&s3cret#x'",
            "SET outbox.redis_url = 'unix:///s?pass=a#s3cret'",
            "SET outbox.redis_url = 'redis://u:p@h?pass=a@s3cret'",
            "SET outbox.redis_url = 'redis://:s3cret?pass=a@h'",
            // A socket URL's user information, which the client ignores.
            "SET outbox.redis_url = 'unix://:s3cret@/run/r.sock'",
            "SET outbox.redis_url = 'unix://:s3?cret@/run/r.sock'",
            // A list whose passwords hold quotes.
            "ALTER SYSTEM SET outbox.redis_url = 'unix:///a?pass=ab''s3cret,unix:///b?pass=ab''s3cret'",
            // User information without its host: refused, shown with the error.
            "SET outbox.redis_url = 'redis://default:s3cret'",
            "SET outbox.redis_url = 'redis://default:s3cret%40redis.example.com:6379'",
            "SET outbox.redis_url = 'redis://:s3cret,unix:@h'",
            "SET outbox.redis_url = 'redis://:my x://s3cret@h'",
            // A password that looks masked; a key the URL parser reads as `pass`.
            "changed to \"unix:///s?pass=*** s3cret\"",
            "SET outbox.redis_url = 'unix:///s?pass=***''s3cret'",
            "SET outbox.redis_url = E'unix:///s?pa\tss=s3cret'",
            // Dollar-quoted, under a mistyped name.
            "SET outbox.redis_uri = $$redis://:s3cret@h$$",
        ] {
            let masked = masked(text).unwrap_or_else(|| panic!("{text}: unchanged"));
            assert!(!masked.contains("s3cret"), "{text}: {masked}");
            assert!(masked.contains("***"), "{text}: {masked}");
        }
        assert_eq!(
            masked("$1 = 'redis://default:9f3a7c...'").as_deref(),
            Some("$1 = 'redis://***...'")
        );
        // Text in another encoding keeps its bytes.
        assert_eq!(
            mask_urls(b"\xe9t\xe9 'redis://:s3cret@h'"),
            Some(b"\xe9t\xe9 'redis://:***@h'".to_vec())
        );
    }

    #[test]
    fn leaves_text_without_passwords_alone() {
        for text in [
            r#"parameter "outbox.redis_url" changed to "redis://h:1""#,
            "SET outbox.redis_url = 'unix:///s.sock?db=1'",
            "parameter \"outbox.redis_url\" cannot be changed now",
            "SET outbox.redis_url = 'redis://127.0.0.1:6379/0'",
            "SET outbox.redis_url = 'redis://[::1]:6379'",
            "SET outbox.redis_url = 'redis://h:1,redis://h:2'",
        ] {
            assert_eq!(masked(text), None, "{text}");
        }
        // Masking twice changes nothing more.
        for text in [
            "outbox.redis_url = 'redis://u:pw@h?pass=x'",
            "SET outbox.redis_url = '127.0.0.1:6379,x:s3cret@y'",
            "$1 = 'redis://default:9f3a7c...'",
            "changed to \"unix:/run/redis.sock?pass=s3cret\"",
            "SET outbox.redis_url = 'unix:///s?db=1&pass=a&s3cret#x'",
            "SET outbox.redis_url = 'unix://:s3cret@/run/r.sock'",
            "SET outbox.redis_url = 'redis://u:p@h?pass=a@s3cret'",
        ] {
            let once = masked(text).expect(text);
            assert_eq!(masked(&once), None, "{once}");
        }
    }

    #[test]
    fn finds_redis_urls_where_values_start() {
        assert!(has_redis_url(b"SET outbox.redis_uri = 'redis://:s3cret@h'"));
        assert!(has_redis_url(b"$2 = 'unix:/run/r.sock?pass=x'"));
        assert!(has_redis_url(b"VALKEYS://h"));
        assert!(!has_redis_url(b"see https://www.postgresql.org/docs"));
        assert!(!has_redis_url(b"host=xredis://h"));
        assert!(!has_redis_url(b"a unix socket: /run/r.sock"));
        assert!(has_redis_url(
            b"SET outbox.redis_uri = $$redis://:s3cret@h$$"
        ));
        // A cache key is no URL: a line with one and an e-mail address is left alone.
        assert!(!has_redis_url(
            b"INSERT INTO users VALUES ('bob@example.com', 'redis:users:1')"
        ));
    }

    #[test]
    fn names_the_setting_in_any_case() {
        assert!(names_setting(b"ALTER SYSTEM SET OUTBOX.REDIS_URL = ''"));
        assert!(names_setting(b"parameter \"outbox.redis_url\" changed"));
        assert!(!names_setting(b"parameter \"outbox.batch_size\" changed"));
    }
}

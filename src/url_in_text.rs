//! Redis URLs in free text (a log line, a statement), found and masked so that no password
//! shows. Pure logic, unit-tested; `log_mask.rs` applies it to what PostgreSQL logs.
//!
//! The text is bytes in the server's encoding, every one of which keeps ASCII bytes for ASCII
//! characters, and nothing in it can be trusted to be well formed: a value may be cut short
//! (`log_parameter_max_length`), quoted in any of SQL's ways, or be one the setting refused.
//! So the masking errs on the side of hiding: a URL runs from its scheme to where the next
//! one starts (after a comma or the quote that closes its value), white space and quotes
//! included; everything before the last `@` in that stretch is user information, and a
//! `pass=` value runs to the quote (or dollar quote) that closes it, or to the next URL's comma,
//! or to the end of the text. The extension's own lines, masked as they are written
//! (`redis_url::mask`), are left alone (`log_mask.rs`).

use crate::redis_url::{
    is_scheme_byte, is_socket_scheme, mask_socket_user_info, mask_user_info, percent_decoded,
};

/// Whether a report or statement concerns the Redis URL: it names the setting, or holds a URL
/// of a Redis scheme (as a value given under a mistyped or cut name would).
pub fn concerns_redis_url(text: &[u8]) -> bool {
    names_setting(text) || has_redis_url(text)
}

/// Whether the text names the setting (`outbox.redis_url`, in any case or quoting; a column
/// named `redis_url` is not it).
fn names_setting(text: &[u8]) -> bool {
    const SETTING: &[u8] = b"redis_url";
    const PREFIX: &[u8] = b"outbox";
    text.windows(SETTING.len())
        .enumerate()
        .filter(|(_, w)| w.eq_ignore_ascii_case(SETTING))
        .any(|(at, _)| {
            let quoting = text[..at]
                .iter()
                .rev()
                .take(3)
                .take_while(|&&b| b == b'.' || b == b'"')
                .count();
            let before = &text[..at - quoting];
            quoting > 0
                && before.len() >= PREFIX.len()
                && before[before.len() - PREFIX.len()..].eq_ignore_ascii_case(PREFIX)
        })
}

/// Whether the text holds a URL of a Redis scheme followed by `/` (`redis:users:1`, a cache
/// key, is no URL).
fn has_redis_url(text: &[u8]) -> bool {
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
pub fn mask_urls(text: &[u8]) -> Option<Vec<u8>> {
    let urls = url_starts(text);
    let first = urls.first().map_or(text.len(), |url| url.scheme);
    let mut out = mask_words(&text[..first]);
    for (n, url) in urls.iter().enumerate() {
        let end = urls.get(n + 1).map_or(text.len(), |next| next.scheme);
        out.extend_from_slice(&text[url.scheme..url.rest]);
        let rest = &text[url.rest..end];
        let socket = is_socket_scheme(&text[url.scheme..url.name_end]);
        let value = Value {
            closer: url.closer,
            last: n + 1 == urls.len(),
        };
        out.extend(mask_url(rest, socket, value));
    }
    (out != text).then_some(out)
}

/// Where a URL's value ends: the quote or dollar sign that opened it (`None` for a bare
/// value), and whether another URL follows it in the text.
#[derive(Clone, Copy)]
struct Value {
    closer: Option<u8>,
    last: bool,
}

/// What follows `scheme://` up to the next URL, masked. A value cut short (`...`, as
/// PostgreSQL shortens long parameters) is hidden up to the cut, which may be inside a
/// password; an `@` after the query's start with a password in the query leaves no telling
/// which `@` ends which password, and all of it is hidden.
fn mask_url(rest: &[u8], socket: bool, value: Value) -> Vec<u8> {
    // PostgreSQL's cut: `...` and the closing quote (a quote in the value is doubled).
    let cut = rest
        .windows(4)
        .position(|w| w == b"...'")
        .filter(|&c| rest.get(c + 4) != Some(&b'\''));
    if let Some(cut) = cut {
        return [&b"***"[..], &rest[cut..]].concat();
    }
    if let Some(question) = rest.iter().position(|&b| b == b'?') {
        if rest[question..].contains(&b'@') && first_pass_value(rest).is_some() {
            return hidden(rest, value);
        }
    }
    if socket {
        // A socket URL gives its password in its query.
        mask_socket_user_info(&mask_query(rest, value))
    } else if rest.contains(&b'@') {
        mask_query(&mask_user_info(rest), value)
    } else {
        mask_query(&mask_hostless_user_info(rest, value), value)
    }
}

/// `***` in place of a value, and what follows it. After the last URL, that is what follows
/// the last of the quotes that opened the value (its closing one; nothing of a bare value).
/// Before another URL, it is from the last comma, or the closing quote, before that one.
fn hidden(value: &[u8], at: Value) -> Vec<u8> {
    let closes = |b: &u8| at.closer == Some(*b);
    let kept = if at.last {
        match value.iter().rposition(closes) {
            // A dollar quote's tag: `$tag$`.
            Some(end) if at.closer == Some(b'$') => {
                let tag = value[..end]
                    .iter()
                    .rev()
                    .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
                    .count();
                match value[..end - tag].last() {
                    Some(b'$') => end - tag - 1,
                    _ => end,
                }
            }
            Some(end) => end,
            None => value.len(),
        }
    } else {
        value
            .iter()
            .rposition(|b| *b == b',')
            .or_else(|| value.iter().rposition(closes))
            .unwrap_or(value.len())
    };
    [&b"***"[..], &value[kept..]].concat()
}

/// Where the value of the first `pass` key starts: a key after any `?` (one in a password may
/// come before the query's) or after an `&` that follows one. One pass over the text.
fn first_pass_value(rest: &[u8]) -> Option<usize> {
    // `pass` percent-encoded whole is 12 bytes; a longer key is another.
    const LONGEST: usize = 12;
    let mut in_query = false;
    let mut key = None;
    for (at, &b) in rest.iter().enumerate() {
        match b {
            b'?' => {
                in_query = true;
                key = Some(at + 1);
            }
            b'&' if in_query => key = Some(at + 1),
            b'=' => {
                if let Some(start) = key.take() {
                    if at - start <= LONGEST && percent_decoded(&rest[start..at]) == "pass" {
                        return Some(at + 1);
                    }
                }
            }
            _ => {}
        }
    }
    None
}

/// Where a URL starts (its scheme), where the scheme's name ends, where what follows
/// `scheme://` starts, and what closes its value.
struct UrlStart {
    scheme: usize,
    name_end: usize,
    rest: usize,
    closer: Option<u8>,
}

/// The URLs: a scheme followed by `://`, or a Redis scheme followed by `:` or `/`, where a value
/// may start (so that `redis://unix:secret@host` is one URL, not two). A URL after the first
/// starts only after a comma or the previous value's closing quote: what looks like one inside
/// a password (`pass=ab://cd`) is the password's.
fn url_starts(text: &[u8]) -> Vec<UrlStart> {
    let mut starts: Vec<UrlStart> = Vec::new();
    // What the text since the last URL's start holds: a comma, the quote that closes its value.
    let mut since = Since::default();
    let mut at = 0;
    while at < text.len() {
        let b = text[at];
        if b != b':' && b != b'/' {
            at += 1;
            continue;
        }
        let scheme = scheme_start(text, at);
        let name = &text[scheme..at];
        let before = scheme.checked_sub(1).map(|i| text[i]);
        let may_start = before.is_none_or(is_value_start);
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
        let opener = before.filter(|b| matches!(b, b'\'' | b'"' | b'$'));
        let closer = match starts.last() {
            None => opener,
            Some(previous) => {
                since.read(text, previous.closer, scheme);
                if !since.closed && !since.comma {
                    at += 1;
                    continue;
                }
                // An item of a list keeps the quotes of the list.
                opener.or(if since.closed { None } else { previous.closer })
            }
        };
        since = Since {
            read_to: rest,
            ..Since::default()
        };
        starts.push(UrlStart {
            scheme,
            name_end: at,
            rest,
            closer,
        });
        at = rest;
    }
    starts
}

/// What the text read since a URL's start holds, read once however many candidates follow.
#[derive(Default)]
struct Since {
    read_to: usize,
    comma: bool,
    closed: bool,
}

impl Since {
    /// Reads on to `to`. A quote doubled or escaped (`''`, `\'`) is the value's, as is a `$`
    /// that does not make a dollar quote's `$tag$`.
    fn read(&mut self, text: &[u8], closer: Option<u8>, to: usize) {
        let mut at = self.read_to;
        while at < to {
            let b = text[at];
            if b == b',' {
                self.comma = true;
            }
            if Some(b) == closer {
                if b == b'$' {
                    let tag = text[at + 1..to]
                        .iter()
                        .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
                        .count();
                    if text[at + 1 + tag..to].first() == Some(&b'$') {
                        self.closed = true;
                        at += tag + 2;
                        continue;
                    }
                    at += 1 + tag;
                    continue;
                }
                if text[at + 1..to].first() == Some(&b) {
                    at += 2;
                    continue;
                }
                if at == 0 || text[at - 1] != b'\\' {
                    self.closed = true;
                }
            }
            at += 1;
        }
        self.read_to = self.read_to.max(at);
    }
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
    end - text[..end]
        .iter()
        .rev()
        .take_while(|&&b| is_scheme_byte(b))
        .count()
}

/// A refused value whose `user:password` lacks its `@host`: what follows the first `:` is
/// hidden to the value's end, unless it is a port (digits, then the end of the host).
fn mask_hostless_user_info(rest: &[u8], value: Value) -> Vec<u8> {
    if rest.starts_with(b"[") {
        return rest.to_vec();
    }
    let word = rest
        .iter()
        .position(|&b| matches!(b, b'\'' | b'"' | b'$' | b',') || b.is_ascii_whitespace())
        .unwrap_or(rest.len());
    let Some(colon) = rest[..word].iter().position(|&b| b == b':') else {
        return rest.to_vec();
    };
    let digits = rest[colon + 1..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    let port_ends = digits <= 5
        && rest.get(colon + 1 + digits).is_none_or(|&b| {
            matches!(
                b,
                b'/' | b'?' | b'#' | b',' | b'\'' | b'"' | b'$' | b')' | b';' | b'.'
            ) || b.is_ascii_whitespace()
        });
    if digits > 0 && port_ends {
        return rest.to_vec();
    }
    [&rest[..=colon], &hidden(&rest[colon + 1..], value)].concat()
}

/// The query's `pass` value masked. It runs past `&`, `#` and white space, which a password
/// may hold, to the value's end (`hidden`).
fn mask_query(rest: &[u8], value: Value) -> Vec<u8> {
    match first_pass_value(rest) {
        Some(at) => [&rest[..at], &hidden(&rest[at..], value)].concat(),
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
        let bare = Value {
            closer: None,
            last: true,
        };
        out.extend(mask_query(&mask_user_info(word), bare));
    }
    out
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
    fn keeps_what_closes_a_value() {
        assert_eq!(
            masked("ALTER SYSTEM SET outbox.redis_url = $$unix:///r.sock?pass=ab's3cret$$")
                .as_deref(),
            Some("ALTER SYSTEM SET outbox.redis_url = $$unix:///r.sock?pass=***$$")
        );
        assert_eq!(
            masked("SET outbox.redis_url = $t$redis://default:pa s3cret$t$; SELECT 1").as_deref(),
            Some("SET outbox.redis_url = $t$redis://default:***$t$; SELECT 1")
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
            // A quote in a password of a value quoted otherwise, or not at all.
            "ALTER SYSTEM SET outbox.redis_url = $$unix:///r.sock?pass=ab's3cret$$",
            "ALTER SYSTEM SET outbox.redis_url = $x$redis://u:p@h?pass=a\"b@s3cret$x$",
            "NOTICE: unix:///s?pass=ab's3cret",
            // What looks like a URL inside a password.
            "SET outbox.redis_url = 'unix:///run/redis.sock?pass=ab://s3cret'",
            "SET outbox.redis_url = 'unix:///s?pass=ab x://s3cret'",
            "SET outbox.redis_url = 'unix:///s?pass=ab=x://s3cret'",
            "SET outbox.redis_url = 'unix:///s?pass=ab;unix:s3cret'",
            "SET outbox.redis_url = 'redis://:my s3cret://x@h'",
            // A socket URL's user information with a '?' and a host; a query after it.
            "SET outbox.redis_url = 'unix://:s3?cret@localhost/run/redis.sock'",
            "SET outbox.redis_url = 'unix://:a?b@localhost/s?pass=s3cret'",
            // No host after the password, which holds what ends a host, or digits.
            "SET outbox.redis_url = 'redis://default:kX9/s3cret+Q'",
            "SET outbox.redis_url = 'redis://default:pa#s3cret'",
            "SET outbox.redis_url = 'redis://default:pa s3cret'",
            "SET outbox.redis_url = 'redis://default:123456789'",
            // Cut short by log_parameter_max_length.
            "parameters: $1 = 'unix://:s3cr...'",
            "parameters: $1 = 'redis://:ab@s3cr...'",
            // Not cut: a password with `...` in it.
            "ALTER SYSTEM SET outbox.redis_url = 'redis://:my...s3cret@h:6379'",
            "changed to \"unix:///run/redis.sock?pass=wait...s3cret\"",
            "Parameters: $1 = 'unix:///s?pass=...s3cret'",
            "SET outbox.redis_url = 'redis://:a...s3cret@h1:6379,redis://:a...s3cret@h2:6379'",
            // A quote doubled, or a lone `$`, before what looks like a scheme.
            "SET outbox.redis_url = 'unix:///s?pass=a''b://s3cret'",
            "ALTER SYSTEM SET outbox.redis_url = $$unix:///s?pass=a$b://s3cret$$",
        ] {
            let masked = masked(text).unwrap_or_else(|| panic!("{text}: unchanged"));
            // "cret": a password may be written "s3?cret".
            assert!(!masked.contains("cret"), "{text}: {masked}");
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
            "ALTER SYSTEM SET outbox.redis_url = $$redis://h:6379$$",
            "SELECT 'redis://h:6379'; -- and redis://h:6379. (redis://h:6379)",
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
            "ALTER SYSTEM SET outbox.redis_url = $$unix:///r.sock?pass=ab's3cret$$",
            "SET outbox.redis_url = 'redis://default:kX9/s3cret+Q'",
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
    fn reads_a_long_value_once() {
        // Read again from every `?` or candidate scheme, these would take minutes.
        let queries = format!("SET x.y = 'redis://h/{}'", "?a=b&".repeat(200_000));
        assert_eq!(mask_urls(queries.as_bytes()), None);
        let schemes = format!("SET x.y = 'redis://h {}'", "a:// ".repeat(200_000));
        assert_eq!(mask_urls(schemes.as_bytes()), None);
    }

    #[test]
    fn names_the_setting_in_any_case() {
        assert!(names_setting(b"ALTER SYSTEM SET OUTBOX.REDIS_URL = ''"));
        assert!(names_setting(b"parameter \"outbox.redis_url\" changed"));
        assert!(names_setting(b"SET \"outbox\".\"redis_url\" = ''"));
        assert!(!names_setting(b"parameter \"outbox.batch_size\" changed"));
        // An application's column.
        assert!(!names_setting(
            b"SELECT redis_url FROM tenants WHERE owner_email = 'bob@example.com'"
        ));
    }
}

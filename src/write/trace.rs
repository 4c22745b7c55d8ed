//! Trace context without code: the W3C `traceparent` (and `tracestate`) of the request that
//! enqueues an event go into the event's headers, so that a trace started in a web request
//! continues in the consumer.
//!
//! The context comes from the statement that calls `outbox_enqueue`, where OpenTelemetry's SQL
//! instrumentations put it as a sqlcommenter comment (`SELECT ... /*traceparent='00-...-01'*/`,
//! appended, or prepended by some), or else from the session's `outbox.traceparent` and
//! `outbox.tracestate`. Headers the caller passed with a `traceparent` of their own are left as
//! they are. A malformed comment is ignored: it must never fail the caller's transaction.
//!
//! The comment is looked for only at the very end or start of the statement's text, never in its
//! middle, where a string literal could carry one; it is parsed once per statement (a trigger
//! that enqueues for each row of a large `INSERT` does not read the statement again).

use std::cell::RefCell;
use std::ffi::{CStr, CString};

use pgrx::fcinfo::direct_function_call_as_datum;
use pgrx::pg_sys;
use pgrx::IntoDatum;

use crate::gucs;
use crate::model::w3c::{is_traceparent, is_tracestate};

/// Longest comment read, in bytes: sqlcommenter comments hold a few short pairs.
const MAX_COMMENT_BYTES: usize = 8192;

/// A valid `traceparent`, and the `tracestate` that came with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: Option<String>,
}

impl TraceContext {
    /// The headers object the context adds, as JSON text.
    pub fn headers_json(&self) -> String {
        let mut headers = serde_json::Map::new();
        headers.insert("traceparent".into(), self.traceparent.clone().into());
        if let Some(state) = &self.tracestate {
            headers.insert("tracestate".into(), state.clone().into());
        }
        serde_json::Value::Object(headers).to_string()
    }
}

/// The text between `/*` and `*/` of the comment that ends `statement` (before any `;` and
/// white space), as sqlcommenter appends it.
fn trailing_comment(statement: &[u8]) -> Option<&[u8]> {
    let mut end = statement.len();
    while end > 0 && (is_space(statement[end - 1]) || statement[end - 1] == b';') {
        end -= 1;
    }
    let body = statement[..end].strip_suffix(b"*/")?;
    let from = body.len().saturating_sub(MAX_COMMENT_BYTES);
    let at = body[from..].windows(2).rposition(|w| w == b"/*")?;
    Some(&body[from + at + 2..])
}

/// The text of the comment that starts `statement` (after white space), as some frameworks
/// prepend it.
fn leading_comment(statement: &[u8]) -> Option<&[u8]> {
    let start = statement.iter().position(|&b| !is_space(b))?;
    let body = statement[start..].strip_prefix(b"/*")?;
    let within = &body[..body.len().min(MAX_COMMENT_BYTES)];
    let at = within.windows(2).position(|w| w == b"*/")?;
    Some(&body[..at])
}

fn is_space(b: u8) -> bool {
    b" \t\n\r\x0b\x0c".contains(&b)
}

/// `%XX` decoded; `None` for a `%` not followed by two hex digits. `%%` stands for `%`: Python's
/// integrations double it for drivers that read `%` as a parameter marker, and the doubling
/// stays in the text when a statement has no parameters.
fn percent_decoded(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'%' {
            if text.get(i + 1) == Some(&b'%') {
                i += 1;
            }
            let digits = text.get(i + 1..i + 3)?;
            if !digits.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            let hex = std::str::from_utf8(digits).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(text[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The `key='value'` pairs of a sqlcommenter comment, keys and values decoded; `None` if the
/// comment is not in that form. A value is in single quotes (a quote inside escaped as `\'`),
/// or bare where Python's integrations write a number (`dbapi_threadsafety=2`).
fn pairs(mut body: &[u8]) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut pairs = Vec::new();
    loop {
        body = body.trim_ascii_start();
        if body.is_empty() {
            return Some(pairs);
        }
        let eq = body.iter().position(|&b| b == b'=')?;
        let key = percent_decoded(body[..eq].trim_ascii())?;
        body = body[eq + 1..].trim_ascii_start();
        let raw = if let Some(quoted) = body.strip_prefix(b"'") {
            let mut raw = Vec::new();
            let mut i = 0;
            loop {
                match *quoted.get(i)? {
                    b'\\' if quoted.get(i + 1).is_some() => {
                        raw.push(quoted[i + 1]);
                        i += 2;
                    }
                    b'\'' => break,
                    b => {
                        raw.push(b);
                        i += 1;
                    }
                }
            }
            body = &quoted[i + 1..];
            raw
        } else {
            let end = body.iter().position(|&b| b == b',').unwrap_or(body.len());
            let raw = body[..end].trim_ascii().to_vec();
            if raw.is_empty() || raw.contains(&b'\'') {
                return None;
            }
            body = &body[end..];
            raw
        };
        pairs.push((key, percent_decoded(&raw)?));
        body = body.trim_ascii_start();
        match body.first() {
            None => return Some(pairs),
            Some(b',') => body = &body[1..],
            Some(_) => return None,
        }
    }
}

/// The trace context of a statement's sqlcommenter comment, if it carries a valid
/// `traceparent`; a `tracestate` beside it is kept when it is valid too.
pub fn from_statement(statement: &[u8]) -> Option<TraceContext> {
    [trailing_comment(statement), leading_comment(statement)]
        .into_iter()
        .flatten()
        .find_map(from_comment)
}

fn from_comment(body: &[u8]) -> Option<TraceContext> {
    let pairs = pairs(body)?;
    let value = |name: &[u8]| {
        pairs
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_slice())
    };
    let parent = value(b"traceparent").filter(|v| is_traceparent(v))?;
    let state = value(b"tracestate").filter(|v| is_tracestate(v));
    Some(TraceContext {
        // Both are ASCII, checked above.
        traceparent: String::from_utf8_lossy(parent).into_owned(),
        tracestate: state.map(|s| String::from_utf8_lossy(s).into_owned()),
    })
}

/// A statement told from the next by its text's address and its start time.
type Statement = (usize, i64);

thread_local! {
    /// The last statement read and the context found in it.
    static LAST_STATEMENT: RefCell<Option<(Statement, Option<TraceContext>)>> =
        const { RefCell::new(None) };
}

/// The context of the statement running now (the client's, whatever function or trigger calls
/// `outbox_enqueue` inside it), else of the session's settings.
fn current() -> Option<TraceContext> {
    // SAFETY: `debug_query_string` is null or the NUL-terminated text of the statement running
    // in this backend; PostgreSQL keeps it for as long as the statement runs.
    let (text, started) = unsafe {
        (
            pg_sys::debug_query_string,
            pg_sys::GetCurrentStatementStartTimestamp(),
        )
    };
    let from_comment = if text.is_null() {
        None
    } else {
        let at = (text as usize, started);
        LAST_STATEMENT.with_borrow_mut(|last| match last {
            Some((seen, context)) if *seen == at => context.clone(),
            _ => {
                // SAFETY: see above.
                let context = from_statement(unsafe { CStr::from_ptr(text) }.to_bytes());
                *last = Some((at, context.clone()));
                context
            }
        })
    };
    from_comment.or_else(|| {
        gucs::traceparent().map(|traceparent| TraceContext {
            traceparent,
            tracestate: gucs::tracestate(),
        })
    })
}

/// The headers an event goes out with: the caller's, with the current trace context added unless
/// they hold a `traceparent` of their own. `None` when there are none.
///
/// # Safety
/// `headers` must be a jsonb datum (an object, checked by the caller) or `None`.
pub unsafe fn with_trace_context(headers: Option<pg_sys::Datum>) -> Option<pg_sys::Datum> {
    // SAFETY: the jsonb functions take non-null datums of the types given; their results live in
    // the call's memory context.
    unsafe {
        if let Some(headers) = headers {
            let has_own = direct_function_call_as_datum(
                pg_sys::jsonb_exists,
                &[Some(headers), "traceparent".into_datum()],
            )
            .is_some_and(|found| found.value() != 0);
            if has_own {
                return Some(headers);
            }
        }
        let Some(context) = current() else {
            return headers;
        };
        // Valid contexts are printable ASCII: no NUL.
        let text = CString::new(context.headers_json()).ok()?;
        let trace = direct_function_call_as_datum(
            pg_sys::jsonb_in,
            &[Some(pg_sys::Datum::from(text.as_ptr()))],
        )?;
        match headers {
            // The caller's other headers win over the context's.
            Some(headers) => {
                direct_function_call_as_datum(pg_sys::jsonb_concat, &[Some(trace), Some(headers)])
            }
            None => Some(trace),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// What OpenTelemetry's sqlcommenter integrations append (Python's psycopg2 and SQLAlchemy,
    /// Django, Go, Java's Spring, Rails): URL-encoded values in single quotes, sorted keys.
    #[test]
    fn reads_the_comments_instrumentations_append() {
        // Python's: sorted keys, numbers bare, `%` doubled, before the statement's `;`.
        let python = format!(
            "SELECT outbox_enqueue('a', '{{}}') /*db_driver='psycopg2%%3A2.9.9',\
             dbapi_level='2.0',dbapi_threadsafety=2,driver_paramstyle='pyformat',\
             libpq_version=160002,traceparent='{PARENT}',\
             tracestate='congo%%3Dt61rcWkgMzE'*/;"
        );
        let context = from_statement(python.as_bytes()).unwrap();
        assert_eq!(context.traceparent, PARENT);
        assert_eq!(context.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
        // Datadog's: a space inside the comment's ends.
        let spaced = format!("SELECT 1 /* dddbs='app',traceparent='{PARENT}' */");
        assert_eq!(
            from_statement(spaced.as_bytes()).unwrap().traceparent,
            PARENT
        );

        let with_state = format!(
            "SELECT outbox_enqueue($1, $2) /*action='%2Fparam*d',controller='index',\
             framework='spring',traceparent='{PARENT}',\
             tracestate='congo%3Dt61rcWkgMzE%2Crojo%3D00f067aa0ba902b7'*/"
        );
        let context = from_statement(with_state.as_bytes()).unwrap();
        assert_eq!(
            context.tracestate.as_deref(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );

        // Prepended, as Rails does with `prepend_comment`, and across lines.
        let prepended = format!("  /*traceparent='{PARENT}'*/\nSELECT outbox_enqueue('a', '{{}}')");
        assert_eq!(
            from_statement(prepended.as_bytes()).unwrap().traceparent,
            PARENT
        );
        // Spaces around the pairs, and an escaped quote in another value.
        let spaced = format!("SELECT 1 /* route='it\\'s' , traceparent = '{PARENT}' */ ;\n ");
        assert_eq!(
            from_statement(spaced.as_bytes()).unwrap().traceparent,
            PARENT
        );
    }

    #[test]
    fn ignores_what_is_not_a_trailing_or_leading_comment() {
        // In a string literal in the middle of the statement.
        let literal =
            format!("SELECT outbox_enqueue('a', '{{\"x\": \"/*traceparent=''{PARENT}''*/\"}}')");
        assert_eq!(from_statement(literal.as_bytes()), None);
        // In a comment in the middle.
        let middle = format!("SELECT /*traceparent='{PARENT}'*/ outbox_enqueue('a', '{{}}')");
        assert_eq!(from_statement(middle.as_bytes()), None);
        // Malformed comments, an invalid traceparent, no comment at all.
        for statement in [
            "SELECT 1 /*traceparent=*/".to_string(),
            format!("SELECT 1 /*traceparent={PARENT}'*/"),
            format!("SELECT 1 /*traceparent='{PARENT}*/"),
            format!("SELECT 1 /*traceparent='{PARENT}' x='y'*/"),
            "SELECT 1 /*traceparent='00-00000000000000000000000000000000-00f067aa0ba902b7-01'*/"
                .to_string(),
            "SELECT 1 /*traceparent='00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01%'*/"
                .to_string(),
            "SELECT 1 /*traceparent='00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0%+1'*/"
                .to_string(),
            "SELECT 1".to_string(),
            "*/".to_string(),
            "/*".to_string(),
            String::new(),
        ] {
            assert_eq!(from_statement(statement.as_bytes()), None, "{statement}");
        }
        // Bytes that are not UTF-8 around it change nothing.
        let mut latin1 = b"SELECT '\xe9t\xe9' ".to_vec();
        latin1.extend_from_slice(format!("/*traceparent='{PARENT}'*/").as_bytes());
        assert_eq!(from_statement(&latin1).unwrap().traceparent, PARENT);
    }

    #[test]
    fn an_invalid_tracestate_is_left_out() {
        let statement = format!("SELECT 1 /*traceparent='{PARENT}',tracestate='%0Aa%3Db'*/");
        let context = from_statement(statement.as_bytes()).unwrap();
        assert_eq!(context.tracestate, None);
    }

    #[test]
    fn headers_json_escapes_what_json_needs() {
        let context = TraceContext {
            traceparent: PARENT.into(),
            tracestate: Some("a=\"b\\".into()),
        };
        let parsed: serde_json::Value = serde_json::from_str(&context.headers_json()).unwrap();
        assert_eq!(parsed["traceparent"], PARENT);
        assert_eq!(parsed["tracestate"], "a=\"b\\");
    }
}

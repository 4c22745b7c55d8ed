//! An event as a CloudEvent 1.0 in binary content mode (`outbox.message_format =
//! 'cloudevents'`), after the CloudEvents Kafka protocol binding: each attribute a field named
//! `ce_<attribute>`, the payload the field `data`, its media type the field `content-type`.
//!
//! | field | value |
//! | --- | --- |
//! | `ce_specversion` | `1.0` |
//! | `ce_id` | `<id>@<created_at>`: the event's identity, unique within its source even when ids are used again |
//! | `ce_source` | `outbox.cloudevents_source`, by default `//postgresql/<system identifier>/<database>` |
//! | `ce_type` | the topic |
//! | `ce_time` | `created_at`, RFC 3339 |
//! | `ce_subject` | the key, when set and not empty |
//! | `content-type` | `application/json` |
//! | `data` | the payload's JSON text |
//! | `ce_<name>` | each header, an extension attribute (`traceparent` and `tracestate` are the distributed-tracing extension's) |
//!
//! A header becomes an attribute only if its name is a valid extension attribute name (ASCII
//! lower-case letters and digits, and none of the context attributes' names) and its value has
//! no control character: `outbox_enqueue` refuses other headers while the format is
//! `cloudevents`, and the relay moves an event enqueued before the switch that has one to
//! `outbox_dead`, with the reason. Pure functions, unit-tested without a server.

use std::fmt;

use crate::encode::Event;
use crate::rfc3339::rfc3339;

/// `ce_specversion`.
pub const SPECVERSION: &str = "1.0";

/// `content-type`: the payload is JSON.
pub const CONTENT_TYPE: &str = "application/json";

/// The names CloudEvents gives its context attributes and the data, which no header may take.
const RESERVED: [&str; 9] = [
    "specversion",
    "id",
    "source",
    "type",
    "datacontenttype",
    "dataschema",
    "subject",
    "time",
    "data",
];

/// Why an event cannot be written as a CloudEvent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A header's name is not lower-case ASCII letters and digits.
    Name(String),
    /// A header's name is a context attribute's.
    Reserved(String),
    /// A header's value holds a control character (U+0000 to U+001F, U+007F to U+009F).
    Value(String),
    /// The key holds a control character.
    Subject,
    /// The headers are not a JSON object of strings (a row inserted by hand).
    Headers,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Name(name) => write!(
                f,
                "header \"{}\" is not a CloudEvents attribute name (ASCII a-z and 0-9 only)",
                name.escape_default()
            ),
            Refusal::Reserved(name) => write!(
                f,
                "header \"{name}\" is the name of a CloudEvents context attribute"
            ),
            Refusal::Value(name) => write!(
                f,
                "the value of header \"{name}\" holds a control character, which a CloudEvents attribute may not"
            ),
            Refusal::Subject => f.write_str(
                "the key holds a control character, which a CloudEvents subject may not",
            ),
            Refusal::Headers => f.write_str("the headers are not a JSON object of strings"),
        }
    }
}

/// Whether `name` may be an extension attribute's name.
pub fn check_name(name: &str) -> Result<(), Refusal> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(Refusal::Name(name.to_string()));
    }
    if RESERVED.contains(&name) {
        return Err(Refusal::Reserved(name.to_string()));
    }
    Ok(())
}

/// Whether `text` may be a CloudEvents string: no control character (C0, DEL, C1).
pub fn is_attribute_text(text: &str) -> bool {
    !text.chars().any(char::is_control)
}

/// Whether the header `name` = `value` may be an extension attribute.
pub fn check_header(name: &str, value: &str) -> Result<(), Refusal> {
    check_name(name)?;
    if !is_attribute_text(value) {
        return Err(Refusal::Value(name.to_string()));
    }
    Ok(())
}

/// The extension attributes of the headers' JSON text, as entry fields (`ce_<name>`, value), in
/// the order of the names.
pub fn extensions(headers: &str) -> Result<Vec<(String, String)>, Refusal> {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_str(headers) else {
        return Err(Refusal::Headers);
    };
    let mut fields = Vec::with_capacity(map.len());
    for (name, value) in map {
        let serde_json::Value::String(value) = value else {
            return Err(Refusal::Headers);
        };
        check_header(&name, &value)?;
        fields.push((format!("ce_{name}"), value));
    }
    Ok(fields)
}

/// Why `event` cannot be written as a CloudEvent, if it cannot.
pub fn problem(event: &Event) -> Option<Refusal> {
    if event.key.as_deref().is_some_and(|k| !is_attribute_text(k)) {
        return Some(Refusal::Subject);
    }
    event.headers.as_deref().and_then(|h| extensions(h).err())
}

/// `ce_id`: the event's id and `created_at` (`created_at` as written in `ce_time`).
pub fn id(event_id: i64, created_at: &str) -> String {
    format!("{event_id}@{created_at}")
}

/// `ce_subject`: the key, unless it is empty (CloudEvents has no empty subject).
pub fn subject(event: &Event) -> Option<&str> {
    event.key.as_deref().filter(|k| !k.is_empty())
}

/// The entry's field/value pairs for `event` from `source`, in the order the relay writes them.
/// Headers that cannot be attributes are left out (the relay does not send such an event: see
/// [`problem`]).
pub fn fields(event: &Event, source: &str) -> Vec<(String, String)> {
    let time = rfc3339(event.created_at);
    let mut fields = vec![
        ("ce_specversion".to_string(), SPECVERSION.to_string()),
        ("ce_id".to_string(), id(event.id, &time)),
        ("ce_source".to_string(), source.to_string()),
        ("ce_type".to_string(), event.topic.clone()),
        ("ce_time".to_string(), time),
    ];
    if let Some(subject) = subject(event) {
        fields.push(("ce_subject".to_string(), subject.to_string()));
    }
    fields.push(("content-type".to_string(), CONTENT_TYPE.to_string()));
    fields.push(("data".to_string(), event.payload.clone()));
    if let Some(headers) = &event.headers {
        fields.extend(extensions(headers).unwrap_or_default());
    }
    fields
}

/// The default `ce_source` of a database: `//postgresql/<system identifier>/<database>`, the
/// name percent-encoded where it holds more than URI's unreserved characters.
pub fn default_source(system_identifier: u64, database: &str) -> String {
    format!(
        "//postgresql/{system_identifier}/{}",
        percent_encoded(database)
    )
}

/// `outbox.cloudevents_source` with `{database}` replaced by the database's name,
/// percent-encoded; empty: [`default_source`].
pub fn source(setting: &str, system_identifier: u64, database: &str) -> String {
    if setting.is_empty() {
        default_source(system_identifier, database)
    } else {
        setting.replace("{database}", &percent_encoded(database))
    }
}

/// Whether `setting` may be `outbox.cloudevents_source`: a URI reference holds printable ASCII
/// without spaces (other characters are percent-encoded).
pub fn is_source(setting: &str) -> bool {
    setting.bytes().all(|b| b.is_ascii_graphic())
}

/// `text` with every byte outside URI's unreserved characters written as `%XX`.
fn percent_encoded(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::sample_event;

    #[test]
    fn header_names_are_lower_case_letters_and_digits_and_no_context_attribute() {
        for name in ["traceparent", "tracestate", "tenant", "x1", "partitionkey"] {
            assert_eq!(check_name(name), Ok(()), "{name}");
        }
        for name in ["", "Tenant", "x-request-id", "trace_id", "caf\u{e9}", "a b"] {
            assert_eq!(check_name(name), Err(Refusal::Name(name.into())), "{name}");
        }
        for name in RESERVED {
            assert_eq!(check_name(name), Err(Refusal::Reserved(name.into())));
        }
        assert_eq!(check_header("tenant", "7 \u{e9}"), Ok(()));
        for value in ["a\nb", "\u{7f}", "\u{85}", "\0"] {
            assert_eq!(
                check_header("tenant", value),
                Err(Refusal::Value("tenant".into()))
            );
        }
    }

    #[test]
    fn headers_become_extension_attributes() {
        assert_eq!(
            extensions(r#"{"traceparent": "00-1-2-01", "tenant": "t7"}"#),
            Ok(vec![
                ("ce_tenant".into(), "t7".into()),
                ("ce_traceparent".into(), "00-1-2-01".into())
            ])
        );
        assert_eq!(extensions("{}"), Ok(vec![]));
        assert_eq!(
            extensions(r#"{"X-Id": "1"}"#),
            Err(Refusal::Name("X-Id".into()))
        );
        for bad in [r#"{"a": 1}"#, "[]", "\"a\"", "not json"] {
            assert_eq!(extensions(bad), Err(Refusal::Headers), "{bad}");
        }
    }

    #[test]
    fn an_event_becomes_binary_content_mode_fields() {
        let mut event = sample_event(8, "account.debited");
        event.created_at = 1_000_001;
        event.payload = r#"{"amount": 10}"#.into();
        let plain = fields(&event, "//postgresql/1/shop");
        let names: Vec<&str> = plain.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "ce_specversion",
                "ce_id",
                "ce_source",
                "ce_type",
                "ce_time",
                "content-type",
                "data"
            ]
        );
        assert_eq!(plain[1].1, "8@2000-01-01T00:00:01.000001Z");
        assert_eq!(plain[4].1, "2000-01-01T00:00:01.000001Z");
        assert_eq!(plain[6].1, r#"{"amount": 10}"#);
        event.key = Some("account-7".into());
        event.headers = Some(r#"{"traceparent": "00-a-b-01"}"#.into());
        let full = fields(&event, "s");
        assert_eq!(full[5], ("ce_subject".into(), "account-7".into()));
        assert_eq!(full[8], ("ce_traceparent".into(), "00-a-b-01".into()));
        assert_eq!(problem(&event), None);
        event.key = Some(String::new());
        assert!(fields(&event, "s").iter().all(|(n, _)| n != "ce_subject"));
        event.key = Some("a\tb".into());
        assert_eq!(problem(&event), Some(Refusal::Subject));
        event.key = None;
        event.headers = Some(r#"{"type": "x"}"#.into());
        assert_eq!(problem(&event), Some(Refusal::Reserved("type".into())));
    }

    #[test]
    fn the_source_names_the_server_and_the_database() {
        assert_eq!(
            source("", 7_300_000_001, "shop"),
            "//postgresql/7300000001/shop"
        );
        assert_eq!(
            source("", 1, "caf\u{e9} db"),
            "//postgresql/1/caf%C3%A9%20db"
        );
        assert_eq!(
            source("https://example.com/{database}", 1, "a/b"),
            "https://example.com/a%2Fb"
        );
        assert_eq!(source("urn:shop", 1, "x"), "urn:shop");
        assert!(is_source("//postgresql/1/x%20y"));
        assert!(!is_source("a b"));
        assert!(!is_source("caf\u{e9}"));
        assert!(!is_source("a\tb"));
    }
}

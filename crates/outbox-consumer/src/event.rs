//! An outbox event as a stream entry carries it, in either shape the relay writes: its own
//! fields (`id`, `topic`, `payload`, `created_at`, and `key` and `headers` when set), or a
//! CloudEvent in binary content mode (`outbox.message_format = cloudevents`: `ce_id` is
//! `<id>@<created_at>`, `ce_type` the topic, `data` the payload, `ce_subject` the key, other
//! `ce_` attributes the headers). Read without trusting the entry: anyone who may write to the
//! stream may write anything. Pure: no server.

/// An event of the outbox. Its identity is `id` and `created_at` together: ids are unique at any
/// one time, but `TRUNCATE outbox RESTART IDENTITY` (or a restored backup) gives the next events
/// ids that earlier events had, and those must not be taken for the earlier ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: i64,
    /// RFC 3339 with microseconds, as the relay writes it: PostgreSQL reads it back exactly.
    pub created_at: String,
    pub topic: String,
    /// JSON text; checked by PostgreSQL when it is stored as `jsonb`.
    pub payload: String,
    pub key: Option<String>,
    /// JSON text, when the event has headers.
    pub headers: Option<String>,
}

impl Event {
    /// Reads an entry's flat field/value list, in either shape. Fields it does not know are
    /// ignored, so that a newer relay that adds one does not stop this consumer.
    pub fn from_fields(flat: &[Vec<u8>]) -> Result<Event, String> {
        if !flat.len().is_multiple_of(2) {
            return Err("the entry has a field without a value".into());
        }
        let field = |name: &str| -> Result<Option<String>, String> {
            match flat.chunks(2).find(|pair| pair[0] == name.as_bytes()) {
                None => Ok(None),
                Some(pair) => String::from_utf8(pair[1].clone())
                    .map(Some)
                    .map_err(|_| format!("field {name} is not UTF-8")),
            }
        };
        let required =
            |name: &str| field(name)?.ok_or_else(|| format!("the entry has no {name} field"));
        if field("ce_specversion")?.is_some() {
            return Event::from_cloudevent(flat, required);
        }
        let id = required("id")?;
        Ok(Event {
            id: id
                .parse()
                .map_err(|_| format!("id {id:?} is not a whole number"))?,
            created_at: required("created_at")?,
            topic: required("topic")?,
            payload: required("payload")?,
            key: field("key")?,
            headers: field("headers")?,
        })
    }
}

impl Event {
    /// Reads an entry written as a CloudEvent; `required` reads a field that must be there.
    fn from_cloudevent(
        flat: &[Vec<u8>],
        required: impl Fn(&str) -> Result<String, String>,
    ) -> Result<Event, String> {
        let ce_id = required("ce_id")?;
        let created_at = required("ce_time")?;
        let id = ce_id
            .strip_suffix(&created_at)
            .and_then(|id| id.strip_suffix('@'))
            .ok_or_else(|| format!("ce_id {ce_id:?} is not <id>@<ce_time>"))?;
        let id = id
            .parse()
            .map_err(|_| format!("ce_id {ce_id:?} does not start with a whole number"))?;
        let mut key = None;
        let mut headers = Vec::new();
        for pair in flat.chunks(2) {
            let Some(name) = pair[0].strip_prefix(b"ce_") else {
                continue;
            };
            let value = || {
                String::from_utf8(pair[1].clone()).map_err(|_| {
                    format!("field {} is not UTF-8", String::from_utf8_lossy(&pair[0]))
                })
            };
            match name {
                b"specversion" | b"id" | b"source" | b"type" | b"time" => {}
                b"subject" => key = Some(value()?),
                _ => headers.push((String::from_utf8_lossy(name).into_owned(), value()?)),
            }
        }
        Ok(Event {
            id,
            created_at,
            topic: required("ce_type")?,
            payload: required("data")?,
            key,
            headers: (!headers.is_empty()).then(|| json_object(&headers)),
        })
    }
}

/// A JSON object of strings.
fn json_object(pairs: &[(String, String)]) -> String {
    let members: Vec<String> = pairs
        .iter()
        .map(|(name, value)| format!("{}: {}", json_string(name), json_string(value)))
        .collect();
    format!("{{{}}}", members.join(", "))
}

/// `text` as a JSON string.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The fields of an entry as readable text, for the record of an entry that could not be read.
/// Debug formatting escapes what PostgreSQL's `text` cannot hold (NUL) or a terminal garbles.
pub fn describe(flat: &[Vec<u8>]) -> String {
    flat.chunks(2)
        .map(|pair| {
            let name = String::from_utf8_lossy(&pair[0]);
            match pair.get(1) {
                Some(value) => format!("{name:?}={:?}", String::from_utf8_lossy(value)),
                None => format!("{name:?} without a value"),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(pairs: &[(&str, &[u8])]) -> Vec<Vec<u8>> {
        pairs
            .iter()
            .flat_map(|(name, value)| [name.as_bytes().to_vec(), value.to_vec()])
            .collect()
    }

    const FULL: [(&str, &[u8]); 6] = [
        ("id", b"42"),
        ("topic", b"orders"),
        ("payload", b"{\"n\": 1}"),
        ("created_at", b"2025-01-02T03:04:05.123456Z"),
        ("key", b"account-7"),
        ("headers", b"{\"trace\": 1}"),
    ];

    #[test]
    fn reads_every_field_of_the_contract() {
        let event = Event::from_fields(&flat(&FULL)).unwrap();
        assert_eq!(
            event,
            Event {
                id: 42,
                created_at: "2025-01-02T03:04:05.123456Z".into(),
                topic: "orders".into(),
                payload: "{\"n\": 1}".into(),
                key: Some("account-7".into()),
                headers: Some("{\"trace\": 1}".into()),
            }
        );
    }

    #[test]
    fn key_and_headers_are_optional_and_unknown_fields_ignored() {
        let mut fields = FULL[..4].to_vec();
        fields.push(("added_later", b"x"));
        let event = Event::from_fields(&flat(&fields)).unwrap();
        assert_eq!((event.id, event.key, event.headers), (42, None, None));
    }

    #[test]
    fn a_broken_entry_is_an_error_that_names_the_field() {
        let without = |name: &str| {
            let fields: Vec<_> = FULL.iter().copied().filter(|f| f.0 != name).collect();
            Event::from_fields(&flat(&fields)).unwrap_err()
        };
        assert_eq!(without("id"), "the entry has no id field");
        assert_eq!(without("created_at"), "the entry has no created_at field");
        assert_eq!(without("payload"), "the entry has no payload field");

        let mut fields = FULL.to_vec();
        fields[0] = ("id", b"4x");
        let err = Event::from_fields(&flat(&fields)).unwrap_err();
        assert_eq!(err, "id \"4x\" is not a whole number");
        fields[0] = ("id", b"42");
        fields[2] = ("payload", b"\xff\xfe");
        let err = Event::from_fields(&flat(&fields)).unwrap_err();
        assert_eq!(err, "field payload is not UTF-8");

        let mut odd = flat(&FULL);
        odd.pop();
        let err = Event::from_fields(&odd).unwrap_err();
        assert_eq!(err, "the entry has a field without a value");
    }

    #[test]
    fn reads_a_cloudevent() {
        let fields = [
            ("ce_specversion", &b"1.0"[..]),
            ("ce_id", b"42@2025-01-02T03:04:05.123456Z"),
            ("ce_source", b"//postgresql/1/shop"),
            ("ce_type", b"orders"),
            ("ce_time", b"2025-01-02T03:04:05.123456Z"),
            ("ce_subject", b"account-7"),
            ("content-type", b"application/json"),
            ("data", b"{\"n\": 1}"),
            ("ce_traceparent", b"00-1-2-01"),
            ("ce_tenant", b"a\"b"),
        ];
        let event = Event::from_fields(&flat(&fields)).unwrap();
        assert_eq!(
            event,
            Event {
                id: 42,
                created_at: "2025-01-02T03:04:05.123456Z".into(),
                topic: "orders".into(),
                payload: "{\"n\": 1}".into(),
                key: Some("account-7".into()),
                headers: Some(r#"{"traceparent": "00-1-2-01", "tenant": "a\"b"}"#.into()),
            }
        );
        let mut plain = fields[..8].to_vec();
        plain.remove(5);
        let event = Event::from_fields(&flat(&plain)).unwrap();
        assert_eq!((event.key, event.headers), (None, None));
        plain[1] = ("ce_id", b"x@2025-01-02T03:04:05.123456Z");
        let err = Event::from_fields(&flat(&plain)).unwrap_err();
        assert!(err.contains("does not start with a whole number"), "{err}");
        plain[1] = ("ce_id", b"42");
        let err = Event::from_fields(&flat(&plain)).unwrap_err();
        assert!(err.contains("is not <id>@<ce_time>"), "{err}");
    }

    #[test]
    fn describe_escapes_what_text_cannot_hold() {
        let mut fields = flat(&[("id", b"1\0"), ("payload", b"\xff")]);
        fields.push(b"topic".to_vec());
        let text = describe(&fields);
        assert_eq!(
            text,
            "\"id\"=\"1\\0\" \"payload\"=\"\u{fffd}\" \"topic\" without a value"
        );
    }
}

//! The write path: `outbox_enqueue(topic, payload, key, headers, deliver_after)` and its input
//! checks, and `outbox_lane(key, topic)`.
//!
//! The function runs as its caller (`sql/outbox.sql` declares it without SECURITY DEFINER): a
//! role needs `EXECUTE` on it and no privilege on the tables, because the insert lends itself
//! the table owner's right to write the row (`insert/`), while what the insert fires runs as
//! the caller, as for the caller's own `INSERT`. It resolves nothing through `search_path`: it
//! finds its tables by the extension's schema, so a caller's objects cannot hijack it.
//!
//! The row goes in through the executor's single-row insert (`insert/`). The arguments
//! stay raw datums: the topic is checked as bytes and the payload is never converted to a Rust
//! value.

use std::ffi::CStr;

use pgrx::fcinfo::{direct_function_call_as_datum, pg_arg_is_null, pg_getarg_datum_raw};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{pg_sys, varlena, PgLogLevel, PgSqlErrorCode};

use outbox_redis::cloudevents;

use super::{insert, notify, trace, wake};
use crate::gucs;
use crate::model::lane;
use crate::pg::utf8;

/// Longest topic accepted, in bytes: topics become Redis keys and channel payloads.
pub const MAX_TOPIC_BYTES: usize = 256;

/// Longest key accepted, in bytes: a key names the entity whose events keep their order (an
/// account's id), and the relay holds it beside every event of a batch.
pub const MAX_KEY_BYTES: usize = 1024;

/// Why an `outbox_enqueue` argument was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum InputError {
    NullTopic,
    NullPayload,
    EmptyTopic,
    TopicTooLong(usize),
    TopicControlCharacter(usize),
    KeyTooLong(usize),
    PayloadTooLarge {
        size: usize,
        limit: usize,
    },
    HeadersNotObjectOfStrings,
    /// With `outbox.message_format = cloudevents`: a header or the key that cannot be an
    /// attribute of a CloudEvent, and why.
    NotCloudEvent(cloudevents::Refusal),
    HeadersTooLarge {
        size: usize,
        limit: usize,
    },
    NegativeDelay,
    /// `deliver_after` is `'infinity'` (PostgreSQL 17 and later): the event would never be due.
    InfiniteDelay,
}

impl InputError {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        match self {
            InputError::NullTopic | InputError::NullPayload => {
                PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED
            }
            InputError::EmptyTopic
            | InputError::TopicTooLong(_)
            | InputError::TopicControlCharacter(_)
            | InputError::KeyTooLong(_)
            | InputError::HeadersNotObjectOfStrings
            | InputError::NotCloudEvent(_)
            | InputError::NegativeDelay
            | InputError::InfiniteDelay => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            InputError::PayloadTooLarge { .. } | InputError::HeadersTooLarge { .. } => {
                PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED
            }
        }
    }

    pub fn message(&self) -> String {
        match self {
            InputError::NullTopic => "outbox_enqueue: topic must not be null".into(),
            InputError::NullPayload => "outbox_enqueue: payload must not be null".into(),
            InputError::EmptyTopic => "outbox_enqueue: topic must not be empty".into(),
            InputError::TopicTooLong(len) => format!(
                "outbox_enqueue: topic is {len} bytes long, longer than the limit of {MAX_TOPIC_BYTES}"
            ),
            InputError::TopicControlCharacter(at) => format!(
                "outbox_enqueue: topic contains a control character at byte {at}"
            ),
            InputError::KeyTooLong(len) => format!(
                "outbox_enqueue: key is {len} bytes long, longer than the limit of {MAX_KEY_BYTES}"
            ),
            InputError::PayloadTooLarge { size, limit } => format!(
                "outbox_enqueue: payload is {size} bytes of JSON, larger than outbox.max_payload_size ({limit} bytes)"
            ),
            InputError::HeadersNotObjectOfStrings => {
                "outbox_enqueue: headers must be a JSON object whose values are strings".into()
            }
            InputError::NotCloudEvent(why) => {
                format!("outbox_enqueue: {why} (outbox.message_format is cloudevents)")
            }
            InputError::HeadersTooLarge { size, limit } => format!(
                "outbox_enqueue: headers are {size} bytes of JSON, larger than outbox.max_payload_size ({limit} bytes)"
            ),
            InputError::NegativeDelay => "outbox_enqueue: deliver_after must not be negative".into(),
            InputError::InfiniteDelay => "outbox_enqueue: deliver_after must be finite".into(),
        }
    }

    pub fn hint(&self) -> Option<&'static str> {
        match self {
            InputError::NullPayload => Some("Pass an empty object ('{}') for an event without data."),
            InputError::EmptyTopic | InputError::TopicControlCharacter(_) => {
                Some("A topic names the Redis stream the event goes to, such as 'account.created'.")
            }
            InputError::KeyTooLong(_) => Some(
                "A key names the entity whose events keep their order, such as an account's id.",
            ),
            InputError::PayloadTooLarge { .. } => Some(
                "Store large data elsewhere and enqueue a reference to it, or have a superuser raise outbox.max_payload_size.",
            ),
            InputError::HeadersNotObjectOfStrings => Some(
                "Pass headers such as '{\"traceparent\": \"00-...-01\"}', or NULL for none.",
            ),
            InputError::NotCloudEvent(_) => Some(
                "Each header becomes a CloudEvents extension attribute: name it with lower-case ASCII letters and digits (such as 'tenantid'), none of specversion, id, source, type, datacontenttype, dataschema, subject, time or data, and keep control characters out of its value and out of the key.",
            ),
            InputError::NegativeDelay | InputError::InfiniteDelay => {
                Some("Pass NULL or a positive interval such as '5 minutes'.")
            }
            InputError::NullTopic
            | InputError::TopicTooLong(_)
            | InputError::HeadersTooLarge { .. } => None,
        }
    }
}

/// Checks a topic: its bytes as stored (`stored`, in the database's encoding) not empty and at
/// most [`MAX_TOPIC_BYTES`]; no control character (C0, DEL, or C1) in the text it is, read in
/// its UTF-8 form (`utf8`, the form Redis gets). Without that form (text the database's encoding
/// cannot give as UTF-8, which the relay will bury), the stored bytes are checked for C0 and
/// DEL, which are the same bytes in every server encoding. The position is in the form checked.
pub fn check_topic(stored: &[u8], utf8: Option<&[u8]>) -> Result<(), InputError> {
    if stored.is_empty() {
        return Err(InputError::EmptyTopic);
    }
    if stored.len() > MAX_TOPIC_BYTES {
        return Err(InputError::TopicTooLong(stored.len()));
    }
    let (text, c1_too) = match utf8 {
        Some(text) => (text, true),
        None => (stored, false),
    };
    let c1 =
        |at: usize| c1_too && text[at] == 0xC2 && matches!(text.get(at + 1), Some(0x80..=0x9F));
    if let Some(at) = (0..text.len()).find(|&at| text[at] < 0x20 || text[at] == 0x7F || c1(at)) {
        return Err(InputError::TopicControlCharacter(at));
    }
    Ok(())
}

/// Checks the length of a key, in bytes as stored.
pub fn check_key(len: usize) -> Result<(), InputError> {
    if len > MAX_KEY_BYTES {
        return Err(InputError::KeyTooLong(len));
    }
    Ok(())
}

/// Checks the size of the payload's JSON text against the limit.
pub fn check_payload_size(size: usize, limit: usize) -> Result<(), InputError> {
    if size > limit {
        return Err(InputError::PayloadTooLarge { size, limit });
    }
    Ok(())
}

fn raise(error: InputError) -> ! {
    let mut report = ErrorReport::new(error.sqlstate(), error.message(), function_name!());
    if let Some(hint) = error.hint() {
        report = report.set_hint(hint);
    }
    report.report(PgLogLevel::ERROR);
    unreachable!("ereport(ERROR) returned")
}

/// `outbox_enqueue(topic text, payload jsonb, key text, headers jsonb, deliver_after interval)
/// returns bigint`, declared in `sql/outbox.sql`. The objects of versions before 0.5.0 declare it
/// with the first two arguments only, and reach the same entry point.
#[pg_extern(sql = false)]
fn outbox_enqueue(fcinfo: pg_sys::FunctionCallInfo) -> i64 {
    // SAFETY: PostgreSQL calls this with the arguments declared in SQL: text and jsonb, then
    // (from 0.5.0) text, jsonb and interval, any of the last three null.
    unsafe {
        if pg_arg_is_null(fcinfo, 0) {
            raise(InputError::NullTopic);
        }
        if pg_arg_is_null(fcinfo, 1) {
            raise(InputError::NullPayload);
        }
        let topic_datum = pg_getarg_datum_raw(fcinfo, 0);
        let payload_datum = pg_getarg_datum_raw(fcinfo, 1);
        let topic = text_bytes(topic_datum);
        // Converted only once its length is known to be fine.
        let topic_utf8 = (!topic.is_empty() && topic.len() <= MAX_TOPIC_BYTES)
            .then(|| utf8::to_utf8(topic).ok())
            .flatten();
        if let Err(error) = check_topic(topic, topic_utf8.as_deref()) {
            raise(error);
        }
        let limit = gucs::max_payload_size();
        if let Err(error) = check_payload_size(json_text_len(payload_datum), limit) {
            raise(error);
        }
        let extra = (i32::from((*fcinfo).nargs) >= 5).then(|| {
            let argument =
                |n: usize| (!pg_arg_is_null(fcinfo, n)).then(|| pg_getarg_datum_raw(fcinfo, n));
            let as_cloudevents = gucs::cloudevents();
            let key = argument(2);
            if let Some(key) = key {
                // Measured before it is read: a long key may be stored compressed.
                if let Err(error) = check_key(raw_text_len(key)) {
                    raise(error);
                }
                if as_cloudevents && !is_attribute_text(text_bytes(key)) {
                    raise(InputError::NotCloudEvent(cloudevents::Refusal::Subject));
                }
            }
            let headers = argument(3);
            if let Some(headers) = headers {
                if let Err(error) = check_headers(headers, as_cloudevents) {
                    raise(error);
                }
                let size = json_text_len(headers);
                if size > limit {
                    raise(InputError::HeadersTooLarge { size, limit });
                }
            }
            let headers = trace::with_trace_context(headers);
            let deliver_at = argument(4).and_then(|delay| deliver_at(delay));
            insert::Extra {
                lane: lane::lane_of(key.map(|k| text_bytes(k)), topic),
                key,
                headers,
                deliver_at,
            }
        });

        let schema = pg_sys::get_func_namespace((*(*fcinfo).flinfo).fn_oid);
        let id = match &extra {
            Some(extra) if extra.deliver_at.is_some() => {
                insert::insert_delayed(schema, topic_datum, payload_datum, extra)
            }
            _ => {
                // Before the insert, so that the transaction counts as enqueueing before its
                // event exists (see `wake.rs`).
                wake::wake_relay_at_commit();
                let id = insert::insert_event(schema, topic_datum, payload_datum, extra.as_ref());
                wake::wrote(id);
                id
            }
        };

        notify::note(topic);
        id
    }
}

/// `outbox_lane(key text, topic text) returns smallint`: the lane `outbox_enqueue` gives an
/// event with this key, or without one, this topic; null when both are null.
#[pg_extern(sql = false)]
fn outbox_lane(fcinfo: pg_sys::FunctionCallInfo) -> Option<i16> {
    // SAFETY: PostgreSQL calls this with two text arguments, either of them null.
    unsafe {
        let argument = |n: usize| {
            (!pg_arg_is_null(fcinfo, n)).then(|| text_bytes(pg_getarg_datum_raw(fcinfo, n)))
        };
        match (argument(0), argument(1)) {
            (None, None) => None,
            (key, topic) => Some(lane::lane_of(key, topic.unwrap_or_default())),
        }
    }
}

/// When an event enqueued with `deliver_after = delay` is due: the transaction's start plus the
/// delay, or `None` for a delay of zero (due at once). A negative delay is refused, and so is an
/// infinite one, which PostgreSQL 17 and later accept and which would keep the event waiting
/// for ever.
///
/// # Safety
/// `delay` must be a non-null interval datum.
unsafe fn deliver_at(delay: pg_sys::Datum) -> Option<pg_sys::Datum> {
    // SAFETY: the interval functions take two non-null datums of the types given.
    unsafe {
        let start = pg_sys::Datum::from(pg_sys::GetCurrentTransactionStartTimestamp());
        let due = direct_function_call_as_datum(
            pg_sys::timestamptz_pl_interval,
            &[Some(start), Some(delay)],
        )?;
        let due_at = due.value() as i64;
        // `'infinity'` as a timestamp: the latest one (a finite interval that went past the
        // latest finite timestamp has already failed, out of range).
        if due_at == i64::MAX {
            raise(InputError::InfiniteDelay);
        }
        match due_at.cmp(&(start.value() as i64)) {
            std::cmp::Ordering::Less => raise(InputError::NegativeDelay),
            std::cmp::Ordering::Equal => None,
            std::cmp::Ordering::Greater => Some(due),
        }
    }
}

/// Whether a jsonb datum is an object whose values are all strings, and with `as_cloudevents`,
/// CloudEvents extension attributes: valid names, values without control characters.
///
/// # Safety
/// `datum` must be a non-null jsonb datum.
unsafe fn check_headers(datum: pg_sys::Datum, as_cloudevents: bool) -> Result<(), InputError> {
    use pg_sys::JsonbIteratorToken::*;
    // SAFETY: iterates over a detoasted jsonb in the call's memory context; a string value's
    // bytes stay there while it is read.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
        let mut iterator = pg_sys::JsonbIteratorInit(&raw mut (*jsonb).root);
        let mut value: pg_sys::JsonbValue = std::mem::zeroed();
        if pg_sys::JsonbIteratorNext(&mut iterator, &mut value, true) != WJB_BEGIN_OBJECT {
            return Err(InputError::HeadersNotObjectOfStrings);
        }
        let string = |value: &pg_sys::JsonbValue| {
            let string = value.val.string;
            std::slice::from_raw_parts(string.val.cast::<u8>(), string.len.max(0) as usize)
        };
        let mut name = String::new();
        loop {
            match pg_sys::JsonbIteratorNext(&mut iterator, &mut value, true) {
                WJB_KEY if as_cloudevents => {
                    // Valid names are ASCII, the same bytes in every server encoding.
                    name = String::from_utf8_lossy(string(&value)).into_owned();
                    cloudevents::check_name(&name).map_err(InputError::NotCloudEvent)?;
                }
                WJB_KEY => {}
                WJB_VALUE if value.type_ == pg_sys::jbvType::jbvString => {
                    if as_cloudevents && !is_attribute_text(string(&value)) {
                        let why = cloudevents::Refusal::Value(std::mem::take(&mut name));
                        return Err(InputError::NotCloudEvent(why));
                    }
                }
                WJB_END_OBJECT | WJB_DONE => return Ok(()),
                _ => return Err(InputError::HeadersNotObjectOfStrings),
            }
        }
    }
}

/// Whether text stored in the database's encoding may be a CloudEvents string once converted to
/// UTF-8: no control character. Text that cannot be converted passes: the relay buries it.
fn is_attribute_text(stored: &[u8]) -> bool {
    match utf8::to_utf8(stored) {
        Ok(text) => std::str::from_utf8(&text).is_ok_and(cloudevents::is_attribute_text),
        Err(_) => true,
    }
}

/// The bytes of a text datum, detoasted only if it is compressed or stored out of line.
///
/// # Safety
/// `datum` must be a non-null text datum; the slice lives as long as the call's memory context.
unsafe fn text_bytes<'a>(datum: pg_sys::Datum) -> &'a [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let mut text = datum.cast_mut_ptr::<pg_sys::varlena>();
        if varlena::varatt_is_1b_e(text) || varlena::varatt_is_4b_c(text) {
            text = pg_sys::pg_detoast_datum_packed(text);
        }
        varlena::varlena_to_byte_slice(text)
    }
}

/// Length in bytes of a text datum's contents, without decompressing or fetching it.
///
/// # Safety
/// `datum` must be a non-null text datum.
unsafe fn raw_text_len(datum: pg_sys::Datum) -> usize {
    // SAFETY: guaranteed by the caller; the size comes from the datum's header alone.
    let size = unsafe { pg_sys::toast_raw_datum_size(datum) };
    size.saturating_sub(pg_sys::VARHDRSZ)
}

/// Length of the jsonb datum's JSON text, the form the relay publishes.
///
/// # Safety
/// `datum` must be a non-null jsonb datum.
unsafe fn json_text_len(datum: pg_sys::Datum) -> usize {
    // SAFETY: guaranteed by the caller; the text is palloc'd in the call's memory context.
    unsafe {
        let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
        let text = pg_sys::JsonbToCString(
            std::ptr::null_mut(),
            &raw mut (*jsonb).root,
            pgrx::varlena::varsize_any(jsonb.cast()) as i32,
        );
        CStr::from_ptr(text).to_bytes().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A topic of a UTF-8 database.
    fn check(topic: &[u8]) -> Result<(), InputError> {
        check_topic(topic, Some(topic))
    }

    #[test]
    fn accepts_ordinary_topics() {
        assert_eq!(check("account.created".as_bytes()), Ok(()));
        assert_eq!(check("orders/eu-west:v2 ünïcode".as_bytes()), Ok(()));
        assert_eq!(check("x".repeat(MAX_TOPIC_BYTES).as_bytes()), Ok(()));
        // U+00A0 and U+00A1 share the C1 controls' lead byte and are not controls.
        assert_eq!(check("a\u{a0}\u{a1}".as_bytes()), Ok(()));
    }

    #[test]
    fn refuses_keys_past_the_limit() {
        assert_eq!(check_key(0), Ok(()));
        assert_eq!(check_key(MAX_KEY_BYTES), Ok(()));
        assert_eq!(
            check_key(MAX_KEY_BYTES + 1),
            Err(InputError::KeyTooLong(MAX_KEY_BYTES + 1))
        );
        let error = InputError::KeyTooLong(4000);
        assert_eq!(
            error.sqlstate(),
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert!(
            error.message().contains("4000 bytes"),
            "{}",
            error.message()
        );
    }

    #[test]
    fn refuses_empty_long_and_control_topics() {
        assert_eq!(check("".as_bytes()), Err(InputError::EmptyTopic));
        assert_eq!(
            check("x".repeat(MAX_TOPIC_BYTES + 1).as_bytes()),
            Err(InputError::TopicTooLong(MAX_TOPIC_BYTES + 1))
        );
        // The limit is in bytes: 129 two-byte characters are 258 bytes.
        assert_eq!(
            check("é".repeat(129).as_bytes()),
            Err(InputError::TopicTooLong(258))
        );
        assert_eq!(
            check("a\nb".as_bytes()),
            Err(InputError::TopicControlCharacter(1))
        );
        assert_eq!(
            check("tab\there".as_bytes()),
            Err(InputError::TopicControlCharacter(3))
        );
        assert_eq!(
            check("del\u{7f}".as_bytes()),
            Err(InputError::TopicControlCharacter(3))
        );
        assert_eq!(
            check("c1\u{9f}".as_bytes()),
            Err(InputError::TopicControlCharacter(2))
        );
    }

    #[test]
    fn reads_controls_in_the_text_the_topic_is() {
        // LATIN1 "next<NEL>line": its UTF-8 form shows the C1 control.
        assert_eq!(
            check_topic(b"next\x85line", Some("next\u{85}line".as_bytes())),
            Err(InputError::TopicControlCharacter(4))
        );
        // WIN1252 "Â€", stored as the bytes UTF-8 uses for a C1 control, is printable.
        assert_eq!(check_topic(b"\xc2\x80", Some("Â€".as_bytes())), Ok(()));
        // Text with no UTF-8 form: C0 and DEL are still refused, nothing else can be told.
        assert_eq!(
            check_topic(b"a\tb\xe9", None),
            Err(InputError::TopicControlCharacter(1))
        );
        assert_eq!(check_topic(b"\xc2\x85\xe9", None), Ok(()));
        // The limit is on the stored bytes: 256 LATIN1 "é" are 512 bytes in UTF-8.
        assert_eq!(
            check_topic(
                &[0xE9; MAX_TOPIC_BYTES],
                Some("é".repeat(MAX_TOPIC_BYTES).as_bytes())
            ),
            Ok(())
        );
    }

    #[test]
    fn payload_limit_is_inclusive() {
        assert_eq!(check_payload_size(10, 10), Ok(()));
        assert_eq!(
            check_payload_size(11, 10),
            Err(InputError::PayloadTooLarge {
                size: 11,
                limit: 10
            })
        );
    }
}

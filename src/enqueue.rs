//! The write path: `outbox_enqueue(topic, payload)` and its input checks.
//!
//! The function is declared in `sql/outbox.sql` as SECURITY DEFINER, so a role needs only
//! `EXECUTE` on it, never a privilege on the table. It resolves nothing through `search_path`:
//! its one statement names the table with the extension's schema and takes parameters of the
//! columns' own types, so a caller's objects cannot hijack it, and it spares every call the
//! cost of a `SET search_path` clause (about a tenth of a small transaction's throughput). The
//! insert runs through a plan prepared once per backend; the jsonb argument is taken as a raw
//! datum so it is never converted to a Rust value.

use std::ffi::{c_char, CStr, CString};

use pgrx::fcinfo::{direct_function_call_as_datum, pg_arg_is_null, pg_getarg, pg_getarg_datum_raw};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{pg_sys, IntoDatum, PgLogLevel, PgSqlErrorCode};

use crate::{gucs, wake};

/// Longest topic accepted, in bytes: topics become Redis keys and channel payloads.
pub const MAX_TOPIC_BYTES: usize = 256;

/// Why an `outbox_enqueue` argument was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum InputError {
    NullTopic,
    NullPayload,
    EmptyTopic,
    TopicTooLong(usize),
    TopicControlCharacter(usize),
    PayloadTooLarge { size: usize, limit: usize },
}

impl InputError {
    pub fn sqlstate(&self) -> PgSqlErrorCode {
        match self {
            InputError::NullTopic | InputError::NullPayload => {
                PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED
            }
            InputError::EmptyTopic
            | InputError::TopicTooLong(_)
            | InputError::TopicControlCharacter(_) => {
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
            }
            InputError::PayloadTooLarge { .. } => PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
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
            InputError::PayloadTooLarge { size, limit } => format!(
                "outbox_enqueue: payload is {size} bytes of JSON, larger than outbox.max_payload_size ({limit} bytes)"
            ),
        }
    }

    pub fn hint(&self) -> Option<&'static str> {
        match self {
            InputError::NullPayload => Some("Pass an empty object ('{}') for an event without data."),
            InputError::EmptyTopic | InputError::TopicControlCharacter(_) => {
                Some("A topic names the Redis stream the event goes to, such as 'account.created'.")
            }
            InputError::PayloadTooLarge { .. } => Some(
                "Store large data elsewhere and enqueue a reference to it, or raise outbox.max_payload_size.",
            ),
            InputError::NullTopic | InputError::TopicTooLong(_) => None,
        }
    }
}

/// Checks a topic: not empty, at most [`MAX_TOPIC_BYTES`] bytes, no control character.
pub fn check_topic(topic: &str) -> Result<(), InputError> {
    if topic.is_empty() {
        return Err(InputError::EmptyTopic);
    }
    if topic.len() > MAX_TOPIC_BYTES {
        return Err(InputError::TopicTooLong(topic.len()));
    }
    if let Some((at, _)) = topic.char_indices().find(|(_, c)| c.is_control()) {
        return Err(InputError::TopicControlCharacter(at));
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

/// `outbox_enqueue(topic text, payload jsonb) returns bigint`, declared in `sql/outbox.sql`.
#[pg_extern(sql = false)]
fn outbox_enqueue(fcinfo: pg_sys::FunctionCallInfo) -> i64 {
    // SAFETY: PostgreSQL calls this with two arguments, text and jsonb, as declared in SQL.
    unsafe {
        if pg_arg_is_null(fcinfo, 0) {
            raise(InputError::NullTopic);
        }
        if pg_arg_is_null(fcinfo, 1) {
            raise(InputError::NullPayload);
        }
        let topic: &str = pg_getarg(fcinfo, 0).unwrap_or_default();
        if let Err(error) = check_topic(topic) {
            raise(error);
        }
        let topic_datum = pg_getarg_datum_raw(fcinfo, 0);
        let payload_datum = pg_getarg_datum_raw(fcinfo, 1);
        if let Err(error) =
            check_payload_size(json_text_len(payload_datum), gucs::max_payload_size())
        {
            raise(error);
        }

        let schema = pg_sys::get_func_namespace((*(*fcinfo).flinfo).fn_oid);
        let id = insert_event(schema, topic_datum, payload_datum);

        if let Some(channel) = gucs::notify_channel_ptr() {
            notify(channel, topic);
        }
        wake::wake_relay_at_commit();
        id
    }
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

/// The insert plan, prepared on first use and kept for the backend's life, with the schema it
/// names. Backends are single threaded; only this module touches them.
static mut INSERT_PLAN: pg_sys::SPIPlanPtr = std::ptr::null_mut();
static mut INSERT_PLAN_SCHEMA: pg_sys::Oid = pg_sys::InvalidOid;

/// Prepares `INSERT INTO <schema>.outbox ...` for the schema with oid `schema`.
///
/// # Safety
/// Must run inside SPI (between SPI_connect and SPI_finish).
unsafe fn prepare_insert(schema: pg_sys::Oid) -> pg_sys::SPIPlanPtr {
    // SAFETY: catalog lookups and SPI calls on the backend's only thread.
    unsafe {
        let name = pg_sys::get_namespace_name(schema);
        if name.is_null() {
            error!("outbox_enqueue: the extension's schema no longer exists");
        }
        let quoted = CStr::from_ptr(pg_sys::quote_identifier(name)).to_string_lossy();
        let sql = CString::new(format!(
            "INSERT INTO {quoted}.outbox (topic, payload) VALUES ($1, $2) RETURNING id"
        ))
        .unwrap_or_default();
        let mut types = [pg_sys::TEXTOID, pg_sys::JSONBOID];
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), 2, types.as_mut_ptr());
        if plan.is_null() {
            let code = std::ptr::read(&raw const pg_sys::SPI_result);
            error!("outbox_enqueue: could not prepare the insert (SPI error {code})");
        }
        pg_sys::SPI_keepplan(plan);
        plan
    }
}

/// Inserts the event into the `outbox` table of schema `schema` and returns its id.
///
/// # Safety
/// Both datums must be non-null, of types text and jsonb.
unsafe fn insert_event(schema: pg_sys::Oid, topic: pg_sys::Datum, payload: pg_sys::Datum) -> i64 {
    // SAFETY: plain SPI use from the backend's only thread. PostgreSQL's plan cache re-plans
    // the kept plan if the table is dropped and created again; a new schema gets a new plan.
    unsafe {
        pg_sys::SPI_connect();
        if INSERT_PLAN.is_null() || INSERT_PLAN_SCHEMA != schema {
            if !INSERT_PLAN.is_null() {
                pg_sys::SPI_freeplan(INSERT_PLAN);
                INSERT_PLAN = std::ptr::null_mut();
            }
            INSERT_PLAN = prepare_insert(schema);
            INSERT_PLAN_SCHEMA = schema;
        }
        let mut values = [topic, payload];
        let nulls = [b' ' as c_char, b' ' as c_char];
        let rc =
            pg_sys::SPI_execute_plan(INSERT_PLAN, values.as_mut_ptr(), nulls.as_ptr(), false, 1);
        if rc != pg_sys::SPI_OK_INSERT_RETURNING as i32 || pg_sys::SPI_processed != 1 {
            error!("outbox_enqueue: the insert into outbox failed (SPI result {rc})");
        }
        let table = pg_sys::SPI_tuptable;
        let mut is_null = false;
        let id = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, 1, &mut is_null);
        pg_sys::SPI_finish();
        id.value() as i64
    }
}

/// `pg_notify(channel, topic)`: PostgreSQL delivers it at commit and collapses duplicates.
fn notify(channel: *const c_char, topic: &str) {
    // SAFETY: `channel` is the NUL-terminated GUC value; pg_notify copies both arguments.
    unsafe {
        let channel = CStr::from_ptr(channel).to_str().unwrap_or_default();
        direct_function_call_as_datum(
            pg_sys::pg_notify,
            &[channel.into_datum(), topic.into_datum()],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_topics() {
        assert_eq!(check_topic("account.created"), Ok(()));
        assert_eq!(check_topic("orders/eu-west:v2 ünïcode"), Ok(()));
        assert_eq!(check_topic(&"x".repeat(MAX_TOPIC_BYTES)), Ok(()));
    }

    #[test]
    fn refuses_empty_long_and_control_topics() {
        assert_eq!(check_topic(""), Err(InputError::EmptyTopic));
        assert_eq!(
            check_topic(&"x".repeat(MAX_TOPIC_BYTES + 1)),
            Err(InputError::TopicTooLong(MAX_TOPIC_BYTES + 1))
        );
        // The limit is in bytes: 129 two-byte characters are 258 bytes.
        assert_eq!(
            check_topic(&"é".repeat(129)),
            Err(InputError::TopicTooLong(258))
        );
        assert_eq!(
            check_topic("a\nb"),
            Err(InputError::TopicControlCharacter(1))
        );
        assert_eq!(
            check_topic("tab\there"),
            Err(InputError::TopicControlCharacter(3))
        );
        assert_eq!(
            check_topic("del\u{7f}"),
            Err(InputError::TopicControlCharacter(3))
        );
        assert_eq!(
            check_topic("c1\u{85}"),
            Err(InputError::TopicControlCharacter(2))
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

    #[test]
    fn each_error_has_the_contract_sqlstate() {
        use PgSqlErrorCode::*;
        assert_eq!(
            InputError::NullTopic.sqlstate(),
            ERRCODE_NULL_VALUE_NOT_ALLOWED
        );
        assert_eq!(
            InputError::NullPayload.sqlstate(),
            ERRCODE_NULL_VALUE_NOT_ALLOWED
        );
        assert_eq!(
            InputError::EmptyTopic.sqlstate(),
            ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert_eq!(
            InputError::TopicTooLong(300).sqlstate(),
            ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert_eq!(
            InputError::TopicControlCharacter(0).sqlstate(),
            ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert_eq!(
            InputError::PayloadTooLarge { size: 2, limit: 1 }.sqlstate(),
            ERRCODE_PROGRAM_LIMIT_EXCEEDED
        );
    }
}

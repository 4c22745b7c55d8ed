//! The insert for a table whose shape was changed by hand: a plain `INSERT` statement, so that
//! its columns get their types and defaults as in any `INSERT`. It runs as the caller of
//! `outbox_enqueue`, with the table owner's right to write the row (`owner_right.rs`): the
//! defaults, constraints and triggers added by hand run as the caller.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::extra::Extra;
use super::owner_right;

/// Inserts the event with id `id` with a plain `INSERT` statement into `table`, the `outbox` of
/// `schema`, for a table whose shape the fast path does not fill: the other columns get their
/// types and defaults as in any `INSERT`. The values go in as literals, which PostgreSQL reads
/// with the columns' own input functions, whatever their types.
///
/// # Safety
/// Both datums must be non-null, of types text and jsonb; `extra`'s datums as it says.
pub unsafe fn insert_statement(
    schema: pg_sys::Oid,
    table_oid: pg_sys::Oid,
    id: i64,
    topic: pg_sys::Datum,
    payload: pg_sys::Datum,
    extra: Option<&Extra>,
) -> i64 {
    // SAFETY: catalog reads and an SPI statement inside the caller's transaction; every string
    // is palloc'd in the call's memory context and NUL-terminated.
    unsafe {
        let namespace = pg_sys::get_namespace_name(schema);
        if namespace.is_null() {
            error!("outbox_enqueue: the extension's schema is missing");
        }
        let table = pg_sys::quote_qualified_identifier(namespace, c"outbox".as_ptr());
        let text = |datum: pg_sys::Datum| {
            let literal = pg_sys::quote_literal_cstr(pg_sys::text_to_cstring(datum.cast_mut_ptr()));
            CStr::from_ptr(literal).to_bytes().to_vec()
        };
        let json = |datum: pg_sys::Datum| {
            let jsonb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()).cast::<pg_sys::Jsonb>();
            let json = pg_sys::JsonbToCString(
                std::ptr::null_mut(),
                &raw mut (*jsonb).root,
                pgrx::varlena::varsize_any(jsonb.cast()) as i32,
            );
            CStr::from_ptr(pg_sys::quote_literal_cstr(json))
                .to_bytes()
                .to_vec()
        };
        let mut columns: Vec<&[u8]> = vec![b"id", b"topic", b"payload"];
        let mut values = vec![id.to_string().into_bytes(), text(topic), json(payload)];
        if let Some(extra) = extra {
            columns.push(b"lane");
            values.push(extra.lane.to_string().into_bytes());
            if let Some(key) = extra.key {
                columns.push(b"key");
                values.push(text(key));
            }
            if let Some(headers) = extra.headers {
                columns.push(b"headers");
                values.push(json(headers));
            }
        }
        let mut sql = b"INSERT INTO ".to_vec();
        sql.extend_from_slice(CStr::from_ptr(table).to_bytes());
        sql.extend_from_slice(b" (");
        sql.extend_from_slice(&columns.join(&b", "[..]));
        sql.extend_from_slice(b") VALUES (");
        sql.extend_from_slice(&values.join(&b", "[..]));
        sql.extend_from_slice(b") RETURNING id::pg_catalog.int8");
        let sql = std::ffi::CString::new(sql).unwrap_or_default();

        pg_sys::SPI_connect();
        let status = owner_right::with_owner_right(table_oid, || {
            pg_sys::SPI_execute(sql.as_ptr(), false, 1)
        });
        let id = returned_id(status, "outbox");
        pg_sys::SPI_finish();
        id
    }
}

/// The id that the `INSERT ... RETURNING id` just run through SPI returned, for one row into
/// `table`; an error if it returned none.
///
/// # Safety
/// Must run right after the statement, before `SPI_finish`.
pub unsafe fn returned_id(status: i32, table: &str) -> i64 {
    // SAFETY: reads SPI's result of the statement just run, as the caller guarantees.
    unsafe {
        if status != pg_sys::SPI_OK_INSERT_RETURNING as i32 || pg_sys::SPI_processed != 1 {
            error!("outbox_enqueue: the insert into {table} did not return the new row");
        }
        let tuptable = pg_sys::SPI_tuptable;
        let mut isnull = false;
        let id = pg_sys::SPI_getbinval(*(*tuptable).vals, (*tuptable).tupdesc, 1, &mut isnull);
        if isnull {
            error!("outbox_enqueue: the new row in {table} has no id");
        }
        // Taken before SPI_finish frees the tuple table; an int8 is passed by value.
        id.value() as i64
    }
}

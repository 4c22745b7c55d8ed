//! The insert of a delayed event (`deliver_after`) into `outbox_delayed`, where it waits until it
//! is due; the relay then moves it into `outbox` (see `relay/sql.rs`). Delayed events stay out
//! of `outbox` so that however many wait, they neither lengthen the indexes the relay's claims
//! and vacuum go through nor keep the ring's partitions from being emptied.
//!
//! The statement is prepared once per backend and schema and kept (`SPI_keepplan`); PostgreSQL's
//! plan cache plans it again when the table changes, and looks its names up again if the
//! extension is created anew.

use std::cell::RefCell;
use std::ffi::CString;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::extra::Extra;
use crate::write::backend::BackendLocal;

/// The kept plan, and the schema it inserts into.
static PLAN: BackendLocal<RefCell<Option<(pg_sys::Oid, pg_sys::SPIPlanPtr)>>> =
    BackendLocal::new(RefCell::new(None));

/// Inserts a delayed event into `outbox_delayed` of schema `schema`; returns its id, taken from
/// `outbox_id_seq` like any event's.
///
/// # Safety
/// Both datums must be non-null, of types text and jsonb; `extra`'s datums as it says, and its
/// `deliver_at` set.
pub unsafe fn insert_delayed(
    schema: pg_sys::Oid,
    topic: pg_sys::Datum,
    payload: pg_sys::Datum,
    extra: &Extra,
) -> i64 {
    // SAFETY: SPI calls inside the caller's transaction, with datums of the declared types.
    unsafe {
        pg_sys::SPI_connect();
        let plan = plan_for(schema);
        let key = extra.key.unwrap_or(pg_sys::Datum::from(0));
        let headers = extra.headers.unwrap_or(pg_sys::Datum::from(0));
        let deliver_at = extra.deliver_at.unwrap_or(pg_sys::Datum::from(0));
        let mut values = [
            topic,
            payload,
            pg_sys::Datum::from(pg_sys::GetCurrentTransactionStartTimestamp()),
            key,
            headers,
            pg_sys::Datum::from(extra.lane),
            deliver_at,
        ];
        let null = |absent: bool| {
            if absent {
                b'n' as std::ffi::c_char
            } else {
                b' ' as std::ffi::c_char
            }
        };
        let nulls = [
            null(false),
            null(false),
            null(false),
            null(extra.key.is_none()),
            null(extra.headers.is_none()),
            null(false),
            null(extra.deliver_at.is_none()),
        ];
        let status = pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), false, 1);
        let id = super::statement::returned_id(status, "outbox_delayed");
        pg_sys::SPI_finish();
        id
    }
}

/// The kept plan for `schema`, prepared on first use.
///
/// # Safety
/// Must run between `SPI_connect` and `SPI_finish`.
unsafe fn plan_for(schema: pg_sys::Oid) -> pg_sys::SPIPlanPtr {
    if let Some((kept, plan)) = *PLAN.get().borrow() {
        if kept == schema {
            return plan;
        }
    }
    // SAFETY: catalog reads and SPI calls inside the caller's transaction.
    unsafe {
        let namespace = pg_sys::get_namespace_name(schema);
        if namespace.is_null() {
            error!("outbox_enqueue: the extension's schema is missing");
        }
        let text = |ptr: *const std::ffi::c_char| std::ffi::CStr::from_ptr(ptr).to_bytes().to_vec();
        let table = text(pg_sys::quote_qualified_identifier(
            namespace,
            c"outbox_delayed".as_ptr(),
        ));
        let sequence = text(pg_sys::quote_literal_cstr(
            pg_sys::quote_qualified_identifier(namespace, c"outbox_id_seq".as_ptr()),
        ));
        let mut sql = b"INSERT INTO ".to_vec();
        sql.extend_from_slice(&table);
        sql.extend_from_slice(
            b" (id, topic, payload, created_at, key, headers, lane, deliver_at) \
              VALUES (pg_catalog.nextval(",
        );
        sql.extend_from_slice(&sequence);
        sql.extend_from_slice(
            b"::pg_catalog.regclass), $1, $2, $3, $4, $5, $6, $7) RETURNING id::pg_catalog.int8",
        );
        let sql = CString::new(sql).unwrap_or_default();
        let mut types = [
            pg_sys::TEXTOID,
            pg_sys::JSONBOID,
            pg_sys::TIMESTAMPTZOID,
            pg_sys::TEXTOID,
            pg_sys::JSONBOID,
            pg_sys::INT2OID,
            pg_sys::TIMESTAMPTZOID,
        ];
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr());
        if plan.is_null() {
            error!("outbox_enqueue: cannot prepare the insert into outbox_delayed");
        }
        pg_sys::SPI_keepplan(plan);
        if let Some((_, old)) = PLAN.get().replace(Some((schema, plan))) {
            pg_sys::SPI_freeplan(old);
        }
        plan
    }
}

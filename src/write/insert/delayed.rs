//! The insert of a delayed event (`deliver_after`) into `outbox_delayed`, where it waits until it
//! is due; the relay then moves it into `outbox` (see `relay/sql.rs`). Delayed events stay out
//! of `outbox` so that however many wait, they neither lengthen the indexes the relay's claims
//! and vacuum go through nor keep the ring's partitions from being emptied.
//!
//! The statement is prepared once per backend and schema and kept (`SPI_keepplan`); PostgreSQL's
//! plan cache plans it again when the table changes, and looks its names up again if the
//! extension is created anew. Its text names the schema, so a renamed schema gets a statement
//! of its own. It runs as the caller of `outbox_enqueue`, with the table owner's right to write
//! the row (`owner_right.rs`); the id comes from the sequence as the owner takes it.

use std::cell::RefCell;
use std::ffi::{CStr, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::extra::Extra;
use super::owner_right;
use crate::write::backend::BackendLocal;

/// The kept plan, and the schema it inserts into: its OID and the name the statement gives it.
static PLAN: BackendLocal<RefCell<Option<(pg_sys::Oid, CString, pg_sys::SPIPlanPtr)>>> =
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
    // SAFETY: catalog reads and SPI calls inside the caller's transaction, with datums of the
    // declared types.
    unsafe {
        let namespace = pg_sys::get_namespace_name(schema);
        let relid = |name: &CStr| pg_sys::get_relname_relid(name.as_ptr(), schema);
        let (table, sequence) = (relid(c"outbox_delayed"), relid(c"outbox_id_seq"));
        if namespace.is_null() || table == pg_sys::InvalidOid || sequence == pg_sys::InvalidOid {
            error!(
                "outbox_enqueue: the extension's outbox_delayed table or id sequence is missing"
            );
        }
        let id = super::target::nextval(sequence);
        pg_sys::SPI_connect();
        let plan = plan_for(schema, CStr::from_ptr(namespace));
        let key = extra.key.unwrap_or(pg_sys::Datum::from(0));
        let headers = extra.headers.unwrap_or(pg_sys::Datum::from(0));
        let deliver_at = extra.deliver_at.unwrap_or(pg_sys::Datum::from(0));
        let mut values = [
            pg_sys::Datum::from(id),
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
            null(false),
            null(extra.key.is_none()),
            null(extra.headers.is_none()),
            null(false),
            null(extra.deliver_at.is_none()),
        ];
        let status = owner_right::with_owner_right(table, || {
            pg_sys::SPI_execute_plan(plan, values.as_mut_ptr(), nulls.as_ptr(), false, 1)
        });
        let id = super::statement::returned_id(status, "outbox_delayed");
        pg_sys::SPI_finish();
        id
    }
}

/// The kept plan for `schema`, named `namespace`, prepared on first use and again when the
/// schema's name changed.
///
/// # Safety
/// Must run between `SPI_connect` and `SPI_finish`.
unsafe fn plan_for(schema: pg_sys::Oid, namespace: &CStr) -> pg_sys::SPIPlanPtr {
    if let Some((kept, name, plan)) = &*PLAN.get().borrow() {
        if *kept == schema && name.as_c_str() == namespace {
            return *plan;
        }
    }
    // SAFETY: SPI calls inside the caller's transaction.
    unsafe {
        let table = CStr::from_ptr(pg_sys::quote_qualified_identifier(
            namespace.as_ptr(),
            c"outbox_delayed".as_ptr(),
        ));
        let mut sql = b"INSERT INTO ".to_vec();
        sql.extend_from_slice(table.to_bytes());
        sql.extend_from_slice(
            b" (id, topic, payload, created_at, key, headers, lane, deliver_at) \
              VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id::pg_catalog.int8",
        );
        let sql = CString::new(sql).unwrap_or_default();
        let mut types = [
            pg_sys::INT8OID,
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
        let kept = (schema, namespace.to_owned(), plan);
        if let Some((_, _, old)) = PLAN.get().replace(Some(kept)) {
            pg_sys::SPI_freeplan(old);
        }
        plan
    }
}

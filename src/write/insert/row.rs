//! One row through the executor's single-row insert, `ExecSimpleRelationInsert`, as logical
//! replication's apply worker makes it: an executor state for the relation, the row in a
//! virtual slot, the indexes (kept ones or built per call), the insert, the triggers' queue.

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgBox;

use super::extra::Extra;
use super::indexes;
use super::target::{Columns, Leaf};
use crate::pg::compat;

/// What goes into the row besides the defaults.
pub(super) struct Row<'a> {
    pub id: i64,
    pub topic: pg_sys::Datum,
    pub payload: pg_sys::Datum,
    pub extra: Option<&'a Extra>,
}

/// Inserts `row` into `rel`, which `leaf` describes, closes `rel`, and returns the row's id (a
/// BEFORE trigger may have changed it).
///
/// # Safety
/// `rel` must be open under `lockmode`, inside the caller's transaction; the row's datums as
/// `insert_event` says.
pub(super) unsafe fn insert(
    row: &Row,
    leaf: &Leaf,
    rel: pg_sys::Relation,
    lockmode: pg_sys::LOCKMODE,
) -> i64 {
    // SAFETY: executor calls on the backend's only thread, in the order logical replication's
    // apply worker makes them for one row. An error anywhere aborts the transaction, whose
    // cleanup closes the relation and frees the executor state's memory.
    unsafe {
        let (estate, result_rel) = executor_state(leaf, rel, lockmode);
        let tupdesc = (*rel).rd_att;
        let slot =
            pg_sys::ExecInitExtraTupleSlot(estate, tupdesc, &raw const pg_sys::TTSOpsVirtual);
        let natts = (*tupdesc).natts as usize;
        fill(slot, natts, leaf.columns, row);
        pg_sys::ExecStoreVirtualTuple(slot);

        match &leaf.indexes {
            Some(cached) => indexes::open_indexes(result_rel, cached),
            None => pg_sys::ExecOpenIndices(result_rel, false),
        }
        if !leaf.partition_check.is_null() {
            (*result_rel).ri_PartitionCheckExpr = leaf.partition_check;
        }
        pg_sys::ExecSimpleRelationInsert(result_rel, estate, slot);
        indexes::close_indexes(result_rel, leaf.indexes.is_some());
        pg_sys::AfterTriggerEndQuery(estate);
        // A BEFORE trigger may have changed the row, or skipped it.
        let inserted = (*slot).tts_tid.ip_posid != 0;
        let id = match leaf.columns.id {
            Some(at) => std::slice::from_raw_parts((*slot).tts_values, natts)[at].value() as i64,
            None => row.id,
        };
        pg_sys::ExecResetTupleTable((*estate).es_tupleTable, false);
        pg_sys::FreeExecutorState(estate);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        if !inserted {
            error!("outbox_enqueue: a trigger on outbox skipped the insert");
        }
        // Later statements of this command see the row, as after a statement run through SPI.
        pg_sys::CommandCounterIncrement();
        id
    }
}

/// An executor state with `rel` as its one result relation, and the trigger queue open.
///
/// # Safety
/// As [`insert`].
unsafe fn executor_state(
    leaf: &Leaf,
    rel: pg_sys::Relation,
    lockmode: pg_sys::LOCKMODE,
) -> (*mut pg_sys::EState, *mut pg_sys::ResultRelInfo) {
    // SAFETY: as in `insert`.
    unsafe {
        let estate = pg_sys::CreateExecutorState();
        let mut rte = PgBox::<pg_sys::RangeTblEntry>::alloc_node(pg_sys::NodeTag::T_RangeTblEntry);
        rte.rtekind = pg_sys::RTEKind::RTE_RELATION;
        rte.relid = leaf.oid;
        rte.relkind = pg_sys::RELKIND_RELATION as std::ffi::c_char;
        rte.rellockmode = lockmode;
        compat::init_range_table(estate, rte.into_pg());
        let result_rel =
            PgBox::<pg_sys::ResultRelInfo>::alloc_node(pg_sys::NodeTag::T_ResultRelInfo).into_pg();
        pg_sys::InitResultRelInfo(result_rel, rel, 1, std::ptr::null_mut(), 0);
        // Where AFTER ROW triggers look for the relation they fire on.
        (*estate).es_opened_result_relations =
            pg_sys::lappend((*estate).es_opened_result_relations, result_rel.cast());
        (*estate).es_output_cid = pg_sys::GetCurrentCommandId(true);
        pg_sys::AfterTriggerBeginQuery();
        (estate, result_rel)
    }
}

/// Fills the virtual `slot` of `natts` attributes with the row: the columns `outbox_enqueue`
/// sets, their defaults, nulls elsewhere.
///
/// # Safety
/// `slot` must be a fresh virtual slot of `natts` attributes; the row's datums as [`insert`].
unsafe fn fill(slot: *mut pg_sys::TupleTableSlot, natts: usize, columns: Columns, row: &Row) {
    // SAFETY: the slot's arrays hold `natts` entries; only this call writes them.
    unsafe {
        let values = std::slice::from_raw_parts_mut((*slot).tts_values, natts);
        let nulls = std::slice::from_raw_parts_mut((*slot).tts_isnull, natts);
        nulls.fill(true);
        let mut set = |at: Option<usize>, value: pg_sys::Datum| {
            if let Some(at) = at {
                values[at] = value;
                nulls[at] = false;
            }
        };
        set(columns.id, row.id.into());
        set(columns.topic, row.topic);
        set(columns.payload, row.payload);
        set(
            columns.created_at,
            pg_sys::GetCurrentTransactionStartTimestamp().into(),
        );
        set(columns.attempts, pg_sys::Datum::from(0_i32));
        if columns.lane.is_some() {
            set(
                columns.lane,
                pg_sys::Datum::from(row.extra.map_or(0, |e| e.lane)),
            );
        }
        if let Some(extra) = row.extra {
            if let Some(key) = extra.key {
                set(columns.key, key);
            }
            if let Some(headers) = extra.headers {
                set(columns.headers, headers);
            }
        }
    }
}

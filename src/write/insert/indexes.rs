//! The table's indexes as an insert uses them, with each index's `IndexInfo` built once and kept
//! (its expressions and predicate ready to evaluate), where `ExecOpenIndices` would rebuild them
//! for every call, and every statement would plan the expressions and predicates again.

use pgrx::pg_sys;
use pgrx::PgMemoryContexts;

use super::kept;

/// Each index of `rel` with its `IndexInfo` built in `context`, its expressions and predicate
/// ready to evaluate; `None` if an index needs per-call state: an index that is not a btree, an
/// exclusion constraint, or an expression or predicate that `kept` leaves to each call.
///
/// # Safety
/// `rel` must be open; `context` must be a valid memory context.
pub unsafe fn build_indexes(
    rel: pg_sys::Relation,
    context: pg_sys::MemoryContext,
) -> Option<Vec<(pg_sys::Oid, *mut pg_sys::IndexInfo)>> {
    // SAFETY: relcache reads of an open relation; allocations in `context`.
    unsafe {
        let list = pg_sys::RelationGetIndexList(rel);
        let oids: Vec<pg_sys::Oid> = if list.is_null() {
            Vec::new()
        } else {
            let elements = (*list).elements;
            (0..(*list).length as usize)
                .map(|i| (*elements.add(i)).oid_value)
                .collect()
        };
        pg_sys::list_free(list);
        let mut indexes = Vec::with_capacity(oids.len());
        for oid in oids {
            let lockmode = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
            let index = pg_sys::index_open(oid, lockmode);
            let info = PgMemoryContexts::For(context).switch_to(|_| {
                let info = pg_sys::BuildIndexInfo(index);
                if (*(*index).rd_rel).relam != pg_sys::BTREE_AM_OID
                    || !(*info).ii_ExclusionOps.is_null()
                {
                    return None;
                }
                // What FormIndexDatum and ExecInsertIndexTuples prepare on the first insert of
                // every statement.
                let expressions = (*info).ii_Expressions;
                if !expressions.is_null() {
                    let mut states: *mut pg_sys::List = std::ptr::null_mut();
                    for i in 0..(*expressions).length as usize {
                        let expression = (*(*expressions).elements.add(i)).ptr_value;
                        let planned = kept::planned(expression.cast())?;
                        let state = pg_sys::ExecInitExpr(planned.cast(), std::ptr::null_mut());
                        states = pg_sys::lappend(states, state.cast());
                    }
                    (*info).ii_ExpressionsState = states;
                }
                if !(*info).ii_Predicate.is_null() {
                    let qual = kept::planned((*info).ii_Predicate.cast())?;
                    (*info).ii_PredicateState =
                        pg_sys::ExecInitQual(qual.cast(), std::ptr::null_mut());
                }
                Some(info)
            });
            pg_sys::index_close(index, lockmode);
            indexes.push((oid, info?));
        }
        Some(indexes)
    }
}

/// Opens the indexes as `ExecOpenIndices` does, with the target's `IndexInfo`s.
///
/// # Safety
/// `result_rel` must be initialised on the open table the indexes belong to.
pub unsafe fn open_indexes(
    result_rel: *mut pg_sys::ResultRelInfo,
    indexes: &[(pg_sys::Oid, *mut pg_sys::IndexInfo)],
) {
    if indexes.is_empty() {
        return;
    }
    // SAFETY: arrays allocated in the call's memory context, as ExecOpenIndices does; the
    // IndexInfos live in the target's context, which outlives the call.
    unsafe {
        let count = indexes.len();
        let descs = pg_sys::palloc(count * std::mem::size_of::<pg_sys::Relation>())
            .cast::<pg_sys::Relation>();
        let infos = pg_sys::palloc(count * std::mem::size_of::<*mut pg_sys::IndexInfo>())
            .cast::<*mut pg_sys::IndexInfo>();
        for (i, (oid, info)) in indexes.iter().enumerate() {
            *descs.add(i) = pg_sys::index_open(*oid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
            *infos.add(i) = *info;
        }
        (*result_rel).ri_NumIndices = count as i32;
        (*result_rel).ri_IndexRelationDescs = descs;
        (*result_rel).ri_IndexRelationInfo = infos;
    }
}

/// Closes the indexes. Those opened by `open_indexes` keep their lock until the transaction
/// ends, as the table's does: releasing it is a lock-table round trip per index and frees
/// nothing an `INSERT`'s lock on the table does not already hold.
///
/// # Safety
/// `result_rel`'s indexes must be open.
pub unsafe fn close_indexes(result_rel: *mut pg_sys::ResultRelInfo, cached: bool) {
    // SAFETY: closes what open_indexes or ExecOpenIndices opened.
    unsafe {
        if !cached {
            pg_sys::ExecCloseIndices(result_rel);
            return;
        }
        for i in 0..(*result_rel).ri_NumIndices as usize {
            let index = *(*result_rel).ri_IndexRelationDescs.add(i);
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
    }
}

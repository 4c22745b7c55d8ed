//! Which expressions an insert prepares once and keeps across calls and transactions: a
//! partition's check, an index's expressions and predicate.
//!
//! PostgreSQL prepares these for each statement and drops them with it. Kept, their functions'
//! cached state (`fn_extra`) outlives the statement, which PostgreSQL's own functions allow
//! (the relcache and the type cache keep theirs for the backend's life) but a function of the
//! database's, or one written in SQL, need not: such an expression is prepared per call, as
//! `INSERT` does. So is one with a node this module does not know to be plain evaluation, and
//! one that reads a whole row: its first evaluation caches the row's descriptor in the call's
//! memory, which is gone by the next call.
//!
//! Built-in functions may still call other code through the caches PostgreSQL keeps for the
//! backend's life, as it does itself: the partition check's `satisfies_hash_partition` calls the
//! partition key's hash function (the extension's own `_outbox_id_hash_extended`), as tuple
//! routing does through the relcache's copy, and comparisons of a user-defined type reach its
//! functions through the type cache.

use std::ffi::c_void;

use pgrx::pg_sys;
use pgrx::prelude::*;

/// `INTERNALlanguageId`: PostgreSQL's built-in functions, written in C in the server itself.
const INTERNAL_LANGUAGE: u32 = 12;

/// `expr` planned as the executor would prepare it (constants folded, simple SQL functions
/// inlined), if it can be kept; `None` if it must be prepared per call.
///
/// # Safety
/// Must run inside a transaction; `expr` must be an expression tree or a list of them. The
/// result is allocated in the current memory context.
pub unsafe fn planned(expr: *mut pg_sys::Node) -> Option<*mut pg_sys::Node> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let planned = pg_sys::expression_planner(expr.cast()).cast::<pg_sys::Node>();
        (!refuses(planned, std::ptr::null_mut())).then_some(planned)
    }
}

/// Walks the tree: true at the first node that is not plain evaluation by built-in functions.
#[pg_guard]
unsafe extern "C-unwind" fn refuses(node: *mut pg_sys::Node, _context: *mut c_void) -> bool {
    use pg_sys::NodeTag::*;
    if node.is_null() {
        return false;
    }
    // SAFETY: `node` is a node of the tree being walked; both calls walk it as the planner does.
    unsafe {
        match (*node).type_ {
            T_List | T_Const | T_FuncExpr | T_OpExpr | T_BoolExpr | T_BooleanTest
            | T_CoalesceExpr | T_RelabelType => {}
            // A column of the row itself; not the whole row (attribute 0), whose evaluation
            // keeps its descriptor in the call's memory, nor a system column.
            T_Var => {
                let var = node.cast::<pg_sys::Var>();
                if (*var).varattno <= 0 || (*var).varlevelsup != 0 {
                    return true;
                }
            }
            // A row's test also keeps a descriptor between evaluations.
            T_NullTest if !(*node.cast::<pg_sys::NullTest>()).argisrow => {}
            _ => return true,
        }
        pg_sys::check_functions_in_node(node, Some(not_built_in), std::ptr::null_mut())
            || pg_sys::expression_tree_walker(node, Some(refuses), std::ptr::null_mut())
    }
}

/// Whether `function` is not one of PostgreSQL's built-in C functions.
#[pg_guard]
unsafe extern "C-unwind" fn not_built_in(function: pg_sys::Oid, _context: *mut c_void) -> bool {
    if function.to_u32() >= pg_sys::FirstGenbkiObjectId {
        return true;
    }
    // SAFETY: a catalog lookup by OID, released before returning.
    unsafe {
        // Up to 18 the cache numbers are unsigned and the function takes an int; from 19 on both
        // are ints.
        #[allow(clippy::unnecessary_cast)]
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::PROCOID as i32,
            pg_sys::Datum::from(function),
        );
        if tuple.is_null() {
            return true;
        }
        let language = (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_proc>(tuple)).prolang;
        pg_sys::ReleaseSysCache(tuple);
        language.to_u32() != INTERNAL_LANGUAGE
    }
}

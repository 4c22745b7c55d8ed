//! Whether the `outbox` table still has the shape `sql/outbox.sql` gave it: the fast path fills
//! exactly those columns with exactly those defaults, and anything else takes a plain `INSERT`.

use std::ffi::CStr;

use pgrx::pg_sys;

use crate::pg::compat;

/// Whether `rel` has the columns, types and defaults of `sql/outbox.sql`, and nothing more: those
/// of 0.5.0, or those of the versions before it (without `key`, `headers` and `lane`).
///
/// # Safety
/// `rel` must be open; `sequence` is the OID of its id sequence.
pub unsafe fn has_plain_shape(rel: pg_sys::Relation, sequence: pg_sys::Oid) -> bool {
    use pg_sys::{INT2OID, INT4OID, INT8OID, JSONBOID, TEXTOID, TIMESTAMPTZOID};
    #[derive(PartialEq)]
    enum Default {
        None,
        NextvalOf(pg_sys::Oid),
        Now,
        Zero,
        ZeroInt2,
    }
    /// Columns before 0.5.0, and the three it added.
    const COLUMNS: usize = 8;
    const ADDED: usize = 3;
    // SAFETY: reads of an open relation's tuple descriptor and of its default expressions.
    unsafe {
        let attributes = compat::attributes((*rel).rd_att);
        let mut found = 0;
        for (at, a) in attributes.iter().enumerate() {
            if a.attisdropped {
                continue;
            }
            let (ty, default) = match CStr::from_ptr(a.attname.data.as_ptr()).to_bytes() {
                b"id" => (INT8OID, Default::NextvalOf(sequence)),
                b"topic" | b"last_error" | b"key" => (TEXTOID, Default::None),
                b"payload" | b"headers" => (JSONBOID, Default::None),
                b"lane" => (INT2OID, Default::ZeroInt2),
                b"created_at" => (TIMESTAMPTZOID, Default::Now),
                b"published_at" | b"next_attempt_at" => (TIMESTAMPTZOID, Default::None),
                b"attempts" => (INT4OID, Default::Zero),
                _ => return false,
            };
            if a.atttypid != ty || a.attgenerated != 0 || a.attidentity != 0 {
                return false;
            }
            let actual = if a.atthasdef {
                let node = pg_sys::build_column_default(rel, at as i32 + 1);
                if is_func(node, pg_sys::F_NOW, 0) {
                    Default::Now
                } else if is_func(node, pg_sys::F_NEXTVAL, 1) {
                    let arg = list_first((*node.cast::<pg_sys::FuncExpr>()).args);
                    match const_value(arg, pg_sys::REGCLASSOID) {
                        Some(oid) => Default::NextvalOf(pg_sys::Oid::from(oid as u32)),
                        None => return false,
                    }
                } else if const_value(node, INT4OID) == Some(0) {
                    Default::Zero
                } else if const_value(node, INT2OID) == Some(0)
                    || (is_func(node, pg_sys::F_INT2_INT4, 1)
                        && const_value(
                            list_first((*node.cast::<pg_sys::FuncExpr>()).args),
                            INT4OID,
                        ) == Some(0))
                {
                    // `smallint DEFAULT 0` is stored as the cast of the integer 0.
                    Default::ZeroInt2
                } else {
                    return false;
                }
            } else {
                Default::None
            };
            if actual != default {
                return false;
            }
            found += 1;
        }
        found == COLUMNS || found == COLUMNS + ADDED
    }
}

/// Whether `node` is a call of the function `funcid` with `args` arguments.
///
/// # Safety
/// `node` must be null or a valid expression node.
unsafe fn is_func(node: *mut pg_sys::Node, funcid: u32, args: i32) -> bool {
    // SAFETY: guaranteed by the caller.
    unsafe {
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_FuncExpr {
            return false;
        }
        let func = node.cast::<pg_sys::FuncExpr>();
        let count = if (*func).args.is_null() {
            0
        } else {
            (*(*func).args).length
        };
        (*func).funcid == pg_sys::Oid::from(funcid) && count == args
    }
}

/// The first element of a non-empty list of nodes.
///
/// # Safety
/// `list` must be a valid, non-empty list of pointers.
unsafe fn list_first(list: *mut pg_sys::List) -> *mut pg_sys::Node {
    // SAFETY: guaranteed by the caller.
    unsafe { (*(*list).elements).ptr_value.cast() }
}

/// The value of `node` if it is a non-null constant of type `ty`.
///
/// # Safety
/// `node` must be null or a valid expression node.
unsafe fn const_value(node: *mut pg_sys::Node, ty: pg_sys::Oid) -> Option<usize> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        if node.is_null() || (*node).type_ != pg_sys::NodeTag::T_Const {
            return None;
        }
        let value = node.cast::<pg_sys::Const>();
        ((*value).consttype == ty && !(*value).constisnull).then(|| (*value).constvalue.value())
    }
}

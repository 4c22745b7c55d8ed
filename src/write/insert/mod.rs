//! The row's way into `outbox`: the executor's single-row insert, with what an `INSERT`'s cached
//! plan keeps between executions kept here for the backend's life.
//!
//! The row goes in through `ExecSimpleRelationInsert`, the insert logical replication uses to
//! apply a change: constraints, indexes and row triggers are handled as by `INSERT`, without
//! planning or running a statement. It is kept because it cuts what `outbox_enqueue` costs
//! against a prepared `INSERT` through SPI, by the measure BENCHMARKS.md gives (`BENCH_ONLY=builds`
//! against a build with that `INSERT`).
//!
//! Each call opens the table and its indexes under `RowExclusiveLock`, as an `INSERT` does. What
//! does not change between calls is built once, in a memory context of its own: the table's and
//! the sequence's OIDs, the columns' positions, each index's `IndexInfo` with its expressions
//! and predicate ready to evaluate, and each partition's constraint ready to check.
//! `ExecOpenIndices` would rebuild the `IndexInfo`s on every call, and the expressions,
//! predicates and partition constraint would go through the planner each time, a measurable
//! part of a loop of keyed calls. Expressions are kept only where `kept.rs` allows.
//! A relcache invalidation of the table, the sequence or an index (DDL, `ANALYZE`, `DROP
//! EXTENSION`) makes the next call build them again, so they are exactly as fresh as the
//! relcache entries they come from.
//!
//! The table is partitioned (a ring of partitions by runs of ids, see `model/ring.rs`). The
//! fast path takes the id first and routes the row itself: the partition for the id is the one
//! hash partitioning would pick, and only it is opened and locked, as `INSERT`'s tuple routing
//! does. Each partition's indexes are built the first time a row goes to it. A table of the
//! layout before 0.3.0 (not partitioned) still takes the fast path; one partitioned otherwise
//! takes the plain `INSERT`.
//!
//! The fast path fills the columns itself, so it is taken only while the table has the shape
//! `sql/outbox.sql` gives it: the same columns and types, and defaults only on `id` (the
//! sequence), `created_at` (`now()`) and `attempts` (0). A table changed by hand (a column's
//! type, a column added with a default) gets a plain `INSERT` statement instead, which gives its
//! columns their types and defaults as any `INSERT` would.

use pgrx::pg_sys;

use crate::model::ring;

mod delayed;
mod extra;
mod indexes;
mod kept;
pub mod owner_right;
mod row;
mod shape;
mod statement;
mod target;

use target::Layout;

pub use delayed::insert_delayed;
pub use extra::Extra;

/// Inserts the event into the `outbox` table of schema `schema` and returns its id.
///
/// The columns' defaults are those of `sql/outbox.sql`: the next value of `outbox_id_seq`,
/// the transaction's start time, 0 attempts and lane 0; the others are null unless `extra`
/// sets them. A table of another shape goes through [`statement::insert_statement`].
///
/// # Safety
/// Both datums must be non-null, of types text and jsonb; `extra`'s datums as it says.
pub unsafe fn insert_event(
    schema: pg_sys::Oid,
    topic: pg_sys::Datum,
    payload: pg_sys::Datum,
    extra: Option<&Extra>,
) -> i64 {
    // SAFETY: relcache and executor calls on the backend's only thread, inside the caller's
    // transaction. An error anywhere aborts the transaction, whose cleanup closes the relations.
    unsafe {
        let lockmode = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let (target, rel) = target::open(schema, lockmode);
        if !target.plain {
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            let id = target::nextval(target.sequence);
            return statement::insert_statement(schema, target.table, id, topic, payload, extra);
        }
        // No privilege on the table is checked: EXECUTE on outbox_enqueue is the one it asks
        // for. The executor's single-row insert checks none either, and what it fires runs as
        // the caller, who is the current role.
        let id = target::nextval(target.sequence);
        let row = row::Row {
            id,
            topic,
            payload,
            extra,
        };
        match &target.layout {
            Layout::Table(leaf) => row::insert(&row, leaf, rel, lockmode),
            Layout::Ring { .. } => {
                let (leaf, leaf_rel) = target::open_leaf(&target, ring::leaf_of(id), lockmode);
                pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                row::insert(&row, &leaf, leaf_rel, lockmode)
            }
        }
    }
}

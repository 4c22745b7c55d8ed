//! What one schema's `outbox` table needs for an insert, built once and kept while the relcache
//! says it is fresh (see `mod.rs`): the table's and the sequence's OIDs, where rows go (the
//! table, or the ring's partitions), and for each relation rows go to its columns' positions,
//! its indexes' `IndexInfo`s and its partition constraint.

use std::cell::{Cell, RefCell};
use std::ffi::CStr;
use std::rc::Rc;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;

use super::{indexes, kept, shape};
use crate::model::ring::LEAVES;
use crate::pg::compat;
use crate::write::backend::{self, BackendLocal};

extern "C-unwind" {
    /// The partition constraint of `rel`, a copy in the current memory context (NIL for a
    /// table that is not a partition). pgrx binds no header that declares it, so calls go
    /// through `pg_guard_ffi_boundary`.
    fn RelationGetPartitionQual(rel: pg_sys::Relation) -> *mut pg_sys::List;
}

/// The sequence's next value, as `nextval(sequence)` returns it to its owner: the caller of
/// `outbox_enqueue` needs no privilege on the extension's id sequence.
///
/// # Safety
/// Must run inside a transaction; `sequence` must be a sequence's OID.
pub(super) unsafe fn nextval(sequence: pg_sys::Oid) -> i64 {
    // SAFETY: guaranteed by the caller; pgrx's binding turns an ERROR into a Rust panic. Without
    // the function-call wrapper and with `check_permissions` false, as `nextval` is to its owner.
    unsafe { pg_sys::nextval_internal(sequence, false) }
}

/// The current target, if one was built.
static TARGET: BackendLocal<RefCell<Option<Rc<Target>>>> = BackendLocal::new(RefCell::new(None));
/// Counts relcache invalidations of the watched relations; a target is valid while it is equal.
static GENERATION: BackendLocal<Cell<u64>> = BackendLocal::new(Cell::new(0));
/// Set while a target is being built: any invalidation read meanwhile may concern it.
static BUILDING: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));

/// Where the columns `outbox_enqueue` fills sit in the table's tuple descriptor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Columns {
    pub id: Option<usize>,
    pub topic: Option<usize>,
    pub payload: Option<usize>,
    pub created_at: Option<usize>,
    pub attempts: Option<usize>,
    pub key: Option<usize>,
    pub headers: Option<usize>,
    pub lane: Option<usize>,
}

impl Columns {
    /// Finds the columns by name among the table's attributes, skipping dropped ones.
    pub fn find<'a>(attributes: impl Iterator<Item = Option<&'a [u8]>>) -> Columns {
        let mut columns = Columns::default();
        for (at, name) in attributes.enumerate() {
            let slot = match name {
                Some(b"id") => &mut columns.id,
                Some(b"topic") => &mut columns.topic,
                Some(b"payload") => &mut columns.payload,
                Some(b"created_at") => &mut columns.created_at,
                Some(b"attempts") => &mut columns.attempts,
                Some(b"key") => &mut columns.key,
                Some(b"headers") => &mut columns.headers,
                Some(b"lane") => &mut columns.lane,
                _ => continue,
            };
            *slot = Some(at);
        }
        columns
    }
}

/// A relation rows are inserted into: the table itself, or one of its partitions.
pub(super) struct Leaf {
    pub(super) oid: pg_sys::Oid,
    pub(super) columns: Columns,
    /// Each index with its `IndexInfo`, or `None` when an index is not a btree, has an
    /// exclusion constraint, or has an expression or predicate that `kept.rs` leaves to each
    /// call: such indexes keep state that must not outlive a call, so `ExecOpenIndices` builds
    /// them per call.
    pub(super) indexes: Option<Vec<(pg_sys::Oid, *mut pg_sys::IndexInfo)>>,
    /// A partition's constraint ready to evaluate, which `ExecSimpleRelationInsert` checks and
    /// would otherwise plan again on every call; null for a table that is not a partition, or a
    /// constraint `kept` leaves to each call.
    pub(super) partition_check: *mut pg_sys::ExprState,
}

impl Leaf {
    /// Reads what an insert into `rel` needs; the `IndexInfo`s go in `context`.
    ///
    /// # Safety
    /// `rel` must be open; `context` must outlive the leaf.
    unsafe fn build(rel: pg_sys::Relation, context: pg_sys::MemoryContext) -> Leaf {
        // SAFETY: reads of an open relation, allocations in the caller's context.
        unsafe {
            let attributes = compat::attributes((*rel).rd_att);
            Leaf {
                oid: (*rel).rd_id,
                columns: Columns::find(attributes.iter().map(|a| {
                    (!a.attisdropped).then(|| CStr::from_ptr(a.attname.data.as_ptr()).to_bytes())
                })),
                indexes: indexes::build_indexes(rel, context),
                partition_check: partition_check(rel, context),
            }
        }
    }

    fn watches(&self, relid: pg_sys::Oid) -> bool {
        relid == self.oid
            || self
                .indexes
                .iter()
                .flatten()
                .any(|(index, _)| *index == relid)
    }
}

/// The partition constraint of `rel` prepared in `context`, as `ExecPartitionCheck` prepares it
/// for each statement; null if `rel` is not a partition or the constraint is not to be kept.
///
/// # Safety
/// `rel` must be open; `context` must outlive the result.
unsafe fn partition_check(
    rel: pg_sys::Relation,
    context: pg_sys::MemoryContext,
) -> *mut pg_sys::ExprState {
    // SAFETY: relcache reads of an open relation; allocations in `context`; an ERROR becomes a
    // Rust panic at the boundary.
    unsafe {
        if !(*(*rel).rd_rel).relispartition {
            return std::ptr::null_mut();
        }
        PgMemoryContexts::For(context).switch_to(|_| {
            let qual = pg_sys::ffi::pg_guard_ffi_boundary(|| RelationGetPartitionQual(rel));
            match kept::planned(qual.cast()) {
                Some(qual) if !qual.is_null() => {
                    pg_sys::ExecInitCheck(qual.cast(), std::ptr::null_mut())
                }
                _ => std::ptr::null_mut(),
            }
        })
    }
}

/// Where rows go.
pub(super) enum Layout {
    /// Into the table itself (the layout before 0.3.0).
    Table(Leaf),
    /// Into the ring's partitions: their OIDs by leaf number, and each one's insert state once
    /// a row went to it.
    Ring {
        oids: [pg_sys::Oid; LEAVES],
        built: RefCell<[Option<Rc<Leaf>>; LEAVES]>,
    },
}

/// What one schema's `outbox` table needs for an insert, built once and shared by the calls
/// that run while it is valid.
pub(super) struct Target {
    schema: pg_sys::Oid,
    generation: u64,
    pub(super) table: pg_sys::Oid,
    pub(super) sequence: pg_sys::Oid,
    /// Whether the table has the shape the fast path fills (see the module comment).
    pub(super) plain: bool,
    pub(super) layout: Layout,
    /// Holds the `IndexInfo`s; deleted when the last call using this target lets go of it.
    context: pg_sys::MemoryContext,
}

impl Target {
    fn watches(&self, relid: pg_sys::Oid) -> bool {
        relid == self.table
            || relid == self.sequence
            || match &self.layout {
                Layout::Table(leaf) => leaf.watches(relid),
                Layout::Ring { oids, built } => {
                    oids.contains(&relid)
                        || match built.try_borrow() {
                            Ok(built) => built.iter().flatten().any(|leaf| leaf.watches(relid)),
                            Err(_) => true,
                        }
                }
            }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // SAFETY: the context was created for this target and nothing else points into it once
        // the last reference to the target is gone.
        unsafe { pg_sys::MemoryContextDelete(self.context) };
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    let watched = BUILDING.get().get()
        || match TARGET.get().try_borrow() {
            Ok(target) => target
                .as_ref()
                .is_some_and(|t| relid == pg_sys::InvalidOid || t.watches(relid)),
            Err(_) => true,
        };
    if watched {
        GENERATION.get().set(GENERATION.get().get() + 1);
    }
}

/// Opens `schema`'s outbox table under `lockmode`, with a target that is valid for it.
///
/// # Safety
/// Must run inside a transaction, on the backend's thread.
pub(super) unsafe fn open(
    schema: pg_sys::Oid,
    lockmode: pg_sys::LOCKMODE,
) -> (Rc<Target>, pg_sys::Relation) {
    // SAFETY: catalog and relcache calls inside the caller's transaction.
    unsafe {
        backend::register_once(&backend::RELCACHE_CALLBACK, || {
            pg_sys::CacheRegisterRelcacheCallback(
                Some(on_relcache_invalidation),
                pg_sys::Datum::from(0),
            );
        });
        let cached = TARGET.get().borrow().clone();
        if let Some(target) = cached.filter(|t| t.schema == schema) {
            if target.generation == GENERATION.get().get() {
                // Taking the lock reads pending invalidations, which may concern the target.
                let rel = pg_sys::try_table_open(target.table, lockmode);
                if !rel.is_null() && target.generation == GENERATION.get().get() {
                    return (target, rel);
                }
                if !rel.is_null() {
                    pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                }
            }
        }
        build(schema, lockmode)
    }
}

/// Builds the target of `schema`'s outbox table, opened under `lockmode`, and keeps it as the
/// current one.
///
/// # Safety
/// As [`open`].
unsafe fn build(schema: pg_sys::Oid, lockmode: pg_sys::LOCKMODE) -> (Rc<Target>, pg_sys::Relation) {
    // SAFETY: catalog and relcache calls inside the caller's transaction; the memory context is
    // owned by the target from its creation on.
    unsafe {
        struct Building;
        impl Drop for Building {
            fn drop(&mut self) {
                BUILDING.get().set(false);
            }
        }
        BUILDING.get().set(true);
        let _building = Building;
        let table = pg_sys::get_relname_relid(c"outbox".as_ptr(), schema);
        let sequence = pg_sys::get_relname_relid(c"outbox_id_seq".as_ptr(), schema);
        if table == pg_sys::InvalidOid || sequence == pg_sys::InvalidOid {
            error!("outbox_enqueue: the extension's outbox table or its id sequence is missing");
        }
        let rel = pg_sys::table_open(table, lockmode);
        // Invalidations read from here on make the next call build again.
        let generation = GENERATION.get().get();
        let plain = shape::has_plain_shape(rel, sequence);
        let context = pg_sys::AllocSetContextCreateInternal(
            pg_sys::CacheMemoryContext,
            c"outbox_enqueue".as_ptr(),
            0,
            pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
            pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
        );
        // Owned from here on, so that an error below deletes the context.
        let mut target = Target {
            schema,
            generation,
            table,
            sequence,
            plain,
            layout: Layout::Table(Leaf {
                oid: table,
                columns: Columns::default(),
                indexes: None,
                partition_check: std::ptr::null_mut(),
            }),
            context,
        };
        let relkind = (*(*rel).rd_rel).relkind as u8;
        if relkind == pg_sys::RELKIND_RELATION {
            target.layout = Layout::Table(Leaf::build(rel, context));
        } else if let Some(oids) = ring_partitions(rel) {
            target.layout = Layout::Ring {
                oids,
                built: RefCell::new(Default::default()),
            };
        } else {
            // Partitioned some other way: PostgreSQL's own routing, through an INSERT.
            target.plain = false;
        }
        let target = Rc::new(target);
        // The replaced target's context goes when the last call still using it returns.
        drop(TARGET.get().replace(Some(target.clone())));
        (target, rel)
    }
}

/// The ring's partitions by leaf number, if `rel` is partitioned as `sql/outbox.sql` does it:
/// by hash, into `LEAVES` partitions of one modulus.
///
/// # Safety
/// `rel` must be open.
unsafe fn ring_partitions(rel: pg_sys::Relation) -> Option<[pg_sys::Oid; LEAVES]> {
    // SAFETY: reads of an open partitioned table's partition descriptor.
    unsafe {
        if (*(*rel).rd_rel).relkind as u8 != pg_sys::RELKIND_PARTITIONED_TABLE {
            return None;
        }
        let desc = compat::partition_desc(rel);
        if desc.is_null() || (*desc).boundinfo.is_null() {
            return None;
        }
        let bounds = (*desc).boundinfo;
        // PARTITION_STRATEGY_HASH, a #define before 16 and an enum after.
        if (*bounds).strategy as u8 != b'h'
            || pg_sys::get_hash_partition_greatest_modulus(bounds) != LEAVES as i32
            || (*desc).nparts != LEAVES as i32
        {
            return None;
        }
        let mut oids = [pg_sys::InvalidOid; LEAVES];
        for (remainder, oid) in oids.iter_mut().enumerate() {
            let part = *(*bounds).indexes.add(remainder);
            if part < 0 || part >= (*desc).nparts || !*(*desc).is_leaf.add(part as usize) {
                return None;
            }
            *oid = *(*desc).oids.add(part as usize);
        }
        Some(oids)
    }
}

/// Opens partition `leaf` of a ring under `lockmode`, with its insert state.
///
/// # Safety
/// Must run inside a transaction, on the backend's thread; `target` must be a ring's.
pub(super) unsafe fn open_leaf(
    target: &Target,
    leaf: usize,
    lockmode: pg_sys::LOCKMODE,
) -> (Rc<Leaf>, pg_sys::Relation) {
    let Layout::Ring { oids, built } = &target.layout else {
        unreachable!("open_leaf is for rings")
    };
    // SAFETY: relcache calls inside the caller's transaction.
    unsafe {
        let rel = pg_sys::table_open(oids[leaf], lockmode);
        let cached = built.borrow()[leaf].clone();
        if let Some(cached) = cached {
            // Any lock taken since the target was checked (the partition's just now, the id
            // sequence's before it) may have read invalidations, which the counter counts: if
            // one came, build from the relcache entry just opened rather than trust the cached
            // state.
            if GENERATION.get().get() == target.generation {
                return (cached, rel);
            }
        }
        let fresh = Rc::new(Leaf::build(rel, target.context));
        built.borrow_mut()[leaf] = Some(fresh.clone());
        (fresh, rel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_found_by_name_and_dropped_ones_skipped() {
        let names: [Option<&[u8]>; 9] = [
            Some(b"id"),
            None,
            Some(b"topic"),
            Some(b"payload"),
            Some(b"created_at"),
            Some(b"published_at"),
            Some(b"attempts"),
            Some(b"extra"),
            Some(b"lane"),
        ];
        assert_eq!(
            Columns::find(names.into_iter()),
            Columns {
                id: Some(0),
                topic: Some(2),
                payload: Some(3),
                created_at: Some(4),
                attempts: Some(6),
                lane: Some(8),
                ..Columns::default()
            }
        );
        assert_eq!(Columns::find([None, Some(&b"x"[..])].into_iter()).id, None);
    }
}

//! The relay's SQL: find the extension, claim a batch, mark it, charge failed events, hold the
//! events behind them and release those again, move exhausted ones to `outbox_dead`. Statements
//! are prepared once per extension and kept, so a batch costs executions only. Every function
//! here runs inside the worker's transaction, in a session whose `search_path` is
//! `pg_catalog, pg_temp` (see `session.rs`); the statements qualify what they call all the same.

use std::time::Duration;

use outbox_redis::encode::{ascii_safe, Event};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::PgOid;

use super::cursor::Reach;
use super::retry::DueLook;
use super::rows::Plan;
use super::schema::{Schema, SCHEMA};
use super::spare;
use crate::pg::utf8;
use crate::retention::ring::{self, LEAVES};

/// The schema the extension with oid `oid` lives in, and its installed version (as UTF-8, for
/// comparing and logging: like a name, it is text in the database's encoding).
pub fn extension_schema(oid: pg_sys::Oid) -> Option<(Schema, String)> {
    let (namespace, version) = Spi::connect_mut(|client| {
        let row = client
            .update(
                "SELECT e.extnamespace, e.extversion FROM pg_catalog.pg_extension e \
                 WHERE e.oid OPERATOR(pg_catalog.=) $1",
                Some(1),
                &[oid.into()],
            )
            .ok()?
            .first();
        let namespace = row.get::<pg_sys::Oid>(1).ok()??;
        let version = row.get_datum_by_ordinal(2).ok()??;
        // SAFETY: a non-null text datum of the row just read, valid while SPI is connected.
        let version = unsafe { text_shown(version) };
        Some((namespace, version))
    })?;
    Some((Schema::of(namespace)?, version))
}

/// A text datum of the database as UTF-8, bytes with no UTF-8 form replaced: for what is only
/// compared with our own text or shown.
///
/// # Safety
/// `datum` must be a non-null text datum.
unsafe fn text_shown(datum: pg_sys::Datum) -> String {
    // SAFETY: guaranteed by the caller; the bytes are copied before the detoasted copy goes.
    let bytes = unsafe {
        let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        pgrx::varlena::varlena_to_byte_slice(text).to_vec()
    };
    utf8::shown(&bytes)
}

/// What a claim took: the events to publish, those whose text cannot be sent as UTF-8 (with the
/// reason), which must be charged in the same transaction, and those that wait behind an earlier
/// event of their key that failed or is held, which must be held in the same transaction.
#[derive(Default)]
pub struct Claimed {
    pub events: Vec<Event>,
    pub unreadable: Vec<Failure>,
    pub blocked: Vec<i64>,
    /// The claim looked for events whose retry is due, and found all it could take.
    pub looked_due: bool,
    /// A claim that looked for due events first left some out, or was filled by them: more
    /// may be due.
    pub more_due: bool,
    /// The claim looked for events that never failed (due events first may leave no room).
    pub looked_fresh: bool,
    /// The highest id among the events claimed that never failed.
    fresh_highest: Option<i64>,
    /// Rows claimed (and locked) but left unread, the claim having read [`CLAIM_BYTES`]:
    /// they stay unpublished and go out in a later pass.
    pub left: Vec<i64>,
}

impl Claimed {
    /// How many rows the claim took, the blocked ones included: its `LIMIT` counts them.
    pub fn len(&self) -> usize {
        self.events.len() + self.unreadable.len() + self.blocked.len() + self.left.len()
    }

    /// The highest id claimed among the events that never failed, if any: how far the claim
    /// reached in id order. Due events are left out: their ids say nothing of where the fresh
    /// ones stand, and a cursor moved past fresh events the claim did not take would skip them.
    pub fn highest(&self) -> Option<i64> {
        self.fresh_highest
    }

    /// The highest id of everything in this claim. Blocked rows count: they are held in the
    /// same transaction, and leave the index of fresh events as published ones do.
    fn highest_of_all(&self) -> Option<i64> {
        let events = self.events.iter().map(|e| e.id);
        let unreadable = self.unreadable.iter().map(|f| f.id);
        events
            .chain(unreadable)
            .chain(self.blocked.iter().copied())
            .chain(self.left.iter().copied())
            .max()
    }

    /// Keeps at most `n` of the rows: readable events first, then unreadable ones, then blocked
    /// ones, then those left unread. Those left out stay as they are, locked until the
    /// transaction ends.
    fn truncate(&mut self, n: usize) {
        self.events.truncate(n);
        self.unreadable.truncate(n - self.events.len());
        self.blocked
            .truncate(n - self.events.len() - self.unreadable.len());
        self.left
            .truncate(n - self.events.len() - self.unreadable.len() - self.blocked.len());
    }

    /// Adds `due`'s rows and keeps the events in id order.
    fn add_due(&mut self, due: Claimed) {
        self.blocked.extend(due.blocked);
        if !due.events.is_empty() || !due.unreadable.is_empty() || !due.left.is_empty() {
            self.events.extend(due.events);
            self.unreadable.extend(due.unreadable);
            self.left.extend(due.left);
            self.events.sort_unstable_by_key(|e| e.id);
        }
    }
}

/// What a move of due delayed events into `outbox` did.
pub struct MovedDue {
    /// How many events moved.
    pub count: usize,
    /// The events that went in with a new id, as (id in `outbox_delayed`, id in `outbox`):
    /// `outbox` held their own.
    pub renumbered: Vec<(i64, i64)>,
}

/// An event that could not be published this time.
pub struct Failure {
    pub id: i64,
    pub topic: String,
    /// Attempts charged before this one.
    pub attempts: i32,
    pub error: String,
    /// Retrying cannot help (its text cannot be sent as UTF-8): it goes to `outbox_dead` now.
    pub permanent: bool,
}

/// A failed event after its attempt was charged.
pub struct Charged {
    pub id: i64,
    pub attempts: i32,
}

/// Takes, for the current transaction, the lock of each lane group in `groups` without waiting;
/// false if another process holds one of them (a worker whose share this was, still finishing
/// its batch). The locks are advisory locks of a kind SQL cannot take (`objsubid` 3 in
/// `pg_locks`), so no session can hold the relay up by taking them.
pub fn hold_groups(groups: std::ops::Range<u32>) -> bool {
    groups.into_iter().all(|group| {
        let tag = pg_sys::LOCKTAG {
            // SAFETY: reads this process's database.
            locktag_field1: unsafe { pg_sys::MyDatabaseId.to_u32() },
            // "obox"
            locktag_field2: 0x6f62_6f78,
            locktag_field3: group,
            locktag_field4: 3,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        };
        // SAFETY: a transaction lock taken without waiting, inside the worker's transaction.
        let result = unsafe {
            pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, false, true)
        };
        result != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
    })
}

/// Which of the table's events a claim may take: the lanes of this worker's share, and whether
/// some event in them failed or is held (its key's later events must then wait for it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    pub lanes: std::ops::Range<i16>,
    pub failing: bool,
}

/// The two forms of each claim: for when no event in the worker's lanes has failed, and for when
/// one has, which tells the events of a key (else topic) behind an earlier one that failed or is
/// held from the others.
struct Claim {
    plain: Plan,
    guarded: Plan,
}

impl Claim {
    fn for_scope(&self, scope: &Scope) -> &Plan {
        if scope.failing {
            &self.guarded
        } else {
            &self.plain
        }
    }
}

/// The prepared statements of one installation of the extension.
pub struct Statements {
    pub extension: pg_sys::Oid,
    /// The partitioned table `outbox`, locked before a claim from one partition (see
    /// [`Statements::claim`]).
    table: pg_sys::Oid,
    claim_fresh: Claim,
    /// The fresh claim in one partition of the ring, one per partition, plain only (see
    /// `cursor.rs`).
    claim_fresh_in: Vec<Plan>,
    /// The fresh claim above an id, and below it (see [`Statements::claim`]).
    claim_fresh_above: Claim,
    claim_fresh_below: Claim,
    /// The claim of due events, guarded only: a due event has failed, or was put back by hand.
    claim_due: Plan,
    /// Whether an event in a range of lanes has failed or is held, and is not yet published.
    failing: OwnedPreparedStatement,
    /// Moves due events of a range of lanes from `outbox_delayed` into `outbox`.
    move_due: OwnedPreparedStatement,
    /// One per partition of the ring: a mark through the partitioned table would look for
    /// every id in every partition (hash partitions are not pruned for `= ANY` of a parameter).
    mark: Vec<OwnedPreparedStatement>,
    /// Takes the mark back from events that were held back, not sent.
    unmark: OwnedPreparedStatement,
    /// One per partition, as `mark`: holds blocked events (`next_attempt_at = 'infinity'`).
    hold: Vec<OwnedPreparedStatement>,
    /// Releases the held events of one event's key, up to its first that failed.
    release: OwnedPreparedStatement,
    /// A look for held events whose key has nothing before them any more: from the start of the
    /// worker's lanes, and after a given event.
    sweep_from_start: OwnedPreparedStatement,
    sweep_after: OwnedPreparedStatement,
    fail: OwnedPreparedStatement,
    bury: OwnedPreparedStatement,
    /// The schema all of them name.
    pub schema: Schema,
}

/// Prepares `sql`, which names the schema as [`SCHEMA`].
fn prepare(schema: &Schema, sql: &str, args: &[pg_sys::Oid]) -> OwnedPreparedStatement {
    let args: Vec<PgOid> = args.iter().map(|&oid| PgOid::from(oid)).collect();
    let text = schema.sql(sql);
    Spi::connect(|client| {
        client
            .prepare_mut(text.as_c_str(), &args)
            .unwrap_or_else(|e| error!("outbox relay: cannot prepare {}: {e}", schema.show(sql)))
            .keep()
    })
}

/// Prepares a claim, whose rows are read as the executor produces them (see `rows.rs`).
fn prepare_rows(schema: &Schema, sql: &str, args: &[pg_sys::Oid]) -> Plan {
    Plan::prepare(&schema.sql(sql), &schema.show(sql), args, &CLAIMED_TYPES)
}

/// The order of the claims of events that never failed: the columns of their partial index.
const FRESH_ORDER: &str = "o.id, o.lane";

/// The columns every plain claim returns, in the order [`read_row`] reads them, but for the last
/// (whether the row is blocked), which a plain claim gives as `false`.
const CLAIMED_COLUMNS: &str =
    "o.id, o.topic, o.payload::pg_catalog.text, o.created_at, o.attempts, \
                               o.key, o.headers::pg_catalog.text";

/// `next_attempt_at` of a held event: it waits behind an earlier event of its key until the
/// relay releases it, never due by itself.
const HELD: &str = "'infinity'::pg_catalog.timestamptz";

/// The events that hold back the later events of their key (else topic): not yet published, and
/// failed or held. The predicate of the index `outbox_failing` (`sql/outbox.sql`), written the
/// same way, so that every statement below that names it reads that index.
fn holding_back(t: &str) -> String {
    format!(
        "{t}.published_at IS NULL \
         AND ({t}.attempts OPERATOR(pg_catalog.>) 0 \
              OR {t}.next_attempt_at OPERATOR(pg_catalog.=) {HELD})"
    )
}

/// The ordering unit of the row `t`: its key, else its topic, told apart by a first letter.
fn unit(t: &str) -> String {
    format!(
        "COALESCE('k' OPERATOR(pg_catalog.||) {t}.key, \
                  't' OPERATOR(pg_catalog.||) {t}.topic)"
    )
}

/// The start of [`unit`] kept in the index `outbox_failing` (an index entry has a size limit).
fn unit_prefix(t: &str) -> String {
    format!("pg_catalog.left({}, 200)", unit(t))
}

/// The arguments of a claim: `$1` the limit, `$2` and `$3` the worker's lanes, and with `with_id`
/// `$4`, a free `bigint`.
fn claim_args(with_id: bool) -> Vec<pg_sys::Oid> {
    let mut args = vec![pg_sys::INT8OID, pg_sys::INT2OID, pg_sys::INT2OID];
    if with_id {
        args.push(pg_sys::INT8OID);
    }
    args
}

/// A claim of `table` (`outbox` or one partition of it): `filter` follows `WHERE`, `order` is
/// the `ORDER BY` list.
///
/// The guarded form returns every row it takes, in order, and says of each whether an earlier
/// event of its key that failed or is held holds it back ([`held_back`]): the relay holds those
/// in the same transaction. It does not pass them by: a claim that passed by the events behind
/// a failed key read every one of them again in every pass (20,000 events of one rejected topic
/// made each claim take 80 ms), where one that takes them reads at most its limit, and never
/// again once they are held. Their payload and headers stay unread.
fn claim_sql(schema: &str, table: &str, filter: &str, order: &str, guarded: bool) -> String {
    let rows = format!(
        "FROM {schema}.{table} o \
         WHERE {filter} \
           AND o.lane OPERATOR(pg_catalog.>=) $2 AND o.lane OPERATOR(pg_catalog.<) $3 \
         ORDER BY {order} LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    if !guarded {
        return format!("SELECT {CLAIMED_COLUMNS}, false {rows}");
    }
    format!(
        "SELECT c.id, c.topic, \
                CASE WHEN c.blocked THEN NULL ELSE c.payload::pg_catalog.text END, \
                c.created_at, c.attempts, c.key, \
                CASE WHEN c.blocked THEN NULL ELSE c.headers::pg_catalog.text END, c.blocked \
         FROM (SELECT o.id, o.topic, o.payload, o.created_at, o.attempts, o.key, o.headers, \
                      {} AS blocked {rows}) c",
        held_back(schema, "o")
    )
}

/// Whether an earlier event of the key (else of the topic, among events without a key) of the
/// row `t` failed or is held, and is not yet published: that one goes first, or to outbox_dead.
/// The index `outbox_failing` holds those events by lane and the start of the key, so the check
/// reads only the entries of the same key, and stops at the first. `OFFSET 0` keeps the planner
/// from turning it into a join that reads every failed event (a hash of 30,000 of them took
/// 50 ms a claim); as a subquery run per row, it is one index probe per partition.
fn held_back(schema: &str, t: &str) -> String {
    format!(
        "EXISTS (SELECT FROM {schema}.outbox f \
             WHERE {} \
               AND f.lane OPERATOR(pg_catalog.=) {t}.lane \
               AND {} OPERATOR(pg_catalog.=) {} \
               AND f.id OPERATOR(pg_catalog.<) {t}.id \
               AND {} OPERATOR(pg_catalog.=) {} \
             OFFSET 0)",
        holding_back("f"),
        unit_prefix("f"),
        unit_prefix(t),
        unit("f"),
        unit(t),
    )
}

/// Prepares a claim of `outbox` in its two forms (see [`claim_sql`] and [`claim_args`]).
fn prepare_claim(schema: &Schema, filter: &str, order: &str, with_id: bool) -> Claim {
    let args = claim_args(with_id);
    Claim {
        plain: prepare_rows(
            schema,
            &claim_sql(SCHEMA, "outbox", filter, order, false),
            &args,
        ),
        guarded: prepare_rows(
            schema,
            &claim_sql(SCHEMA, "outbox", filter, order, true),
            &args,
        ),
    }
}

/// Releases the held events of the key (else topic) of event `$1`, but for the events `$2`
/// (about to be buried): each one up to the key's first event that failed, that one included if
/// held. Those before it are fresh again and go out in id order; it, if it was held, is fresh
/// again too and, having failed, still holds back the rest, which its own publication or burial
/// releases in turn. The key is read from event `$1` once (the `MATERIALIZED` row) and given to
/// the conditions as constants, so that each is an index range of `outbox_failing`.
fn release_sql(s: &str) -> String {
    let lane = "(SELECT a.lane FROM anchor a)";
    let prefix = "(SELECT pg_catalog.left(a.unit, 200) FROM anchor a)";
    let whole = "(SELECT a.unit FROM anchor a)";
    format!(
        "WITH anchor AS MATERIALIZED ( \
           SELECT o.lane, {} AS unit FROM {s}.outbox o WHERE o.id OPERATOR(pg_catalog.=) $1) \
         UPDATE {s}.outbox h SET next_attempt_at = NULL \
         WHERE h.published_at IS NULL \
           AND h.next_attempt_at OPERATOR(pg_catalog.=) {HELD} \
           AND h.lane OPERATOR(pg_catalog.=) {lane} \
           AND {} OPERATOR(pg_catalog.=) {prefix} \
           AND {} OPERATOR(pg_catalog.=) {whole} \
           AND h.id OPERATOR(pg_catalog.<=) COALESCE( \
               (SELECT f.id FROM {s}.outbox f \
                WHERE f.published_at IS NULL AND f.attempts OPERATOR(pg_catalog.>) 0 \
                  AND f.lane OPERATOR(pg_catalog.=) {lane} \
                  AND {} OPERATOR(pg_catalog.=) {prefix} \
                  AND {} OPERATOR(pg_catalog.=) {whole} \
                  AND f.id OPERATOR(pg_catalog.<>) ALL ($2) \
                ORDER BY f.id LIMIT 1), \
               9223372036854775807) \
         RETURNING h.id",
        unit("o"),
        unit_prefix("h"),
        unit("h"),
        unit_prefix("f"),
        unit("f"),
    )
}

/// Up to `$1` entries of `outbox_failing` in the lanes `$2` to `$3`, in its order, with `after`
/// past the entry of event `$4`; each with whether it is a held event with nothing before it in
/// its key (its releaser went away by hand). The entry of event `$4` is found by its own lane
/// and key, read from the row; a row gone since gives no entry, and the look starts over.
fn sweep_sql(s: &str, after: bool) -> String {
    let past = if after {
        format!(
            "AND (o.lane, {}, o.id) OPERATOR(pg_catalog.>) ( \
                 (SELECT a.lane FROM {s}.outbox a WHERE a.id OPERATOR(pg_catalog.=) $4), \
                 (SELECT {} FROM {s}.outbox a WHERE a.id OPERATOR(pg_catalog.=) $4), \
                 $4)",
            unit_prefix("o"),
            unit_prefix("a"),
        )
    } else {
        String::new()
    };
    format!(
        "SELECT b.id, \
                CASE WHEN b.next_attempt_at OPERATOR(pg_catalog.=) {HELD} \
                     THEN NOT {} ELSE false END \
         FROM (SELECT o.id, o.lane, o.topic, o.key, o.next_attempt_at FROM {s}.outbox o \
               WHERE {} \
                 AND o.lane OPERATOR(pg_catalog.>=) $2 AND o.lane OPERATOR(pg_catalog.<) $3 \
                 {past} \
               ORDER BY o.lane, {}, o.id LIMIT $1) b",
        held_back(s, "b"),
        holding_back("o"),
        unit_prefix("o"),
    )
}

impl Statements {
    pub fn prepare(extension: pg_sys::Oid, schema: Schema) -> Statements {
        let s = SCHEMA;
        let fresh = "o.published_at IS NULL AND o.next_attempt_at IS NULL";
        // SAFETY: a catalog lookup inside the current transaction.
        let table = unsafe { pg_sys::get_relname_relid(c"outbox".as_ptr(), schema.oid()) };
        if table == pg_sys::InvalidOid {
            error!("outbox relay: no table outbox in schema {schema}");
        }
        // SAFETY: as above.
        let sequence =
            unsafe { pg_sys::get_relname_relid(c"outbox_id_seq".as_ptr(), schema.oid()) };
        if sequence == pg_sys::InvalidOid {
            error!("outbox relay: no sequence outbox_id_seq in schema {schema}");
        }
        Statements {
            extension,
            table,
            // Events that never failed, in id order, through the partial index that holds
            // only them; the lanes beside the ids pass by other workers' events in the index.
            // Ordered by (id, lane), which is id order, as only that index gives it: ordered
            // by id alone, a partition analyzed while its rows were unpublished and planned
            // for while empty was read through its primary key, every published row of it for
            // every claim (`tests/relay.rs`).
            claim_fresh: prepare_claim(&schema, fresh, FRESH_ORDER, false),
            claim_fresh_in: (0..LEAVES)
                .map(|leaf| {
                    let partition = spi::quote_identifier(format!("outbox_{leaf:02}"));
                    let sql = claim_sql(SCHEMA, &partition, fresh, FRESH_ORDER, false);
                    prepare_rows(&schema, &sql, &claim_args(false))
                })
                .collect(),
            claim_fresh_above: prepare_claim(
                &schema,
                &format!("{fresh} AND o.id OPERATOR(pg_catalog.>) $4"),
                FRESH_ORDER,
                true,
            ),
            claim_fresh_below: prepare_claim(
                &schema,
                &format!("{fresh} AND o.id OPERATOR(pg_catalog.<=) $4"),
                FRESH_ORDER,
                true,
            ),
            // Events whose retry delay is over, through the index of waiting events: however
            // many wait (held ones at 'infinity' included), only the due ones are read. Always
            // guarded: the worker may learn of events charged elsewhere (by hand, see
            // `FAILING_RECHECK`) only at its next look for failing events, up to
            // `FAILING_RECHECK` later, and two due events of one key must not go out by their
            // retry times. A due event behind an earlier one of its key is held, rather than
            // read again by every claim until that one is out.
            claim_due: prepare_rows(
                &schema,
                &claim_sql(
                    SCHEMA,
                    "outbox",
                    "o.published_at IS NULL \
                     AND o.next_attempt_at OPERATOR(pg_catalog.<=) pg_catalog.now()",
                    // Among due events of one key only the earliest passes the check, so the
                    // index's order is enough.
                    "o.next_attempt_at",
                    true,
                ),
                &claim_args(false),
            ),
            failing: prepare(
                &schema,
                &format!(
                    "SELECT EXISTS (SELECT FROM {s}.outbox f \
                     WHERE {} \
                       AND f.lane OPERATOR(pg_catalog.>=) $1 AND f.lane OPERATOR(pg_catalog.<) $2)",
                    holding_back("f")
                ),
                &[pg_sys::INT2OID, pg_sys::INT2OID],
            ),
            // An event whose id outbox holds already (ids used again: `RESTART IDENTITY`, a
            // `setval`, a restore) goes in with a new id from the sequence, a new identity for
            // consumers: kept in outbox_delayed, it would be due for ever, first in every move
            // of its lanes, and with a batch's worth of them, no other delayed event of those
            // lanes would move again. Both inserts go first and the delete takes only what they
            // inserted, so an event whose new id is taken as well (a sequence set back below
            // outbox's ids) stays where it is, and the next move draws it another. The events
            // that keep their id and those given a new one go in by two inserts, each read back
            // by its own ids (a new id may equal a kept one), so the delete never takes an event
            // that did not go in.
            move_due: prepare(
                &schema,
                &format!(
                    "WITH due AS ( \
                       SELECT d.id, d.topic, d.payload, d.created_at, d.key, d.headers, d.lane \
                       FROM {s}.outbox_delayed d \
                       WHERE d.deliver_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
                         AND d.lane OPERATOR(pg_catalog.>=) $2 AND d.lane OPERATOR(pg_catalog.<) $3 \
                       ORDER BY d.deliver_at LIMIT $1 FOR UPDATE SKIP LOCKED), \
                     kept AS ( \
                       INSERT INTO {s}.outbox (id, topic, payload, created_at, key, headers, lane) \
                       SELECT id, topic, payload, created_at, key, headers, lane FROM due \
                       ON CONFLICT DO NOTHING RETURNING id), \
                     taken AS ( \
                       SELECT due.id, pg_catalog.nextval({sequence}::pg_catalog.oid::pg_catalog.regclass) AS new_id FROM due \
                       WHERE NOT EXISTS (SELECT FROM kept \
                                         WHERE kept.id OPERATOR(pg_catalog.=) due.id)), \
                     renumbered AS ( \
                       INSERT INTO {s}.outbox (id, topic, payload, created_at, key, headers, lane) \
                       SELECT t.new_id, due.topic, due.payload, due.created_at, due.key, \
                              due.headers, due.lane \
                       FROM taken t JOIN due ON due.id OPERATOR(pg_catalog.=) t.id \
                       ON CONFLICT DO NOTHING RETURNING id), \
                     moved AS ( \
                       SELECT kept.id, kept.id AS new_id FROM kept \
                       UNION ALL \
                       SELECT t.id, t.new_id FROM taken t \
                       JOIN renumbered r ON r.id OPERATOR(pg_catalog.=) t.new_id), \
                     gone AS ( \
                       DELETE FROM {s}.outbox_delayed d USING moved \
                       WHERE d.id OPERATOR(pg_catalog.=) moved.id \
                       RETURNING d.id, moved.new_id) \
                     SELECT pg_catalog.count(*), \
                            pg_catalog.array_agg(g.id) \
                                FILTER (WHERE g.id OPERATOR(pg_catalog.<>) g.new_id), \
                            pg_catalog.array_agg(g.new_id) \
                                FILTER (WHERE g.id OPERATOR(pg_catalog.<>) g.new_id) \
                     FROM gone g",
                    // By OID: a name in a literal would need the schema's quoting twice over.
                    sequence = sequence.to_u32(),
                ),
                &[pg_sys::INT8OID, pg_sys::INT2OID, pg_sys::INT2OID],
            ),
            mark: (0..LEAVES)
                .map(|leaf| {
                    let partition = spi::quote_identifier(format!("outbox_{leaf:02}"));
                    prepare(
                        &schema,
                        &format!(
                            "UPDATE {s}.{partition} SET published_at = pg_catalog.now() \
                             WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
                        ),
                        &[pg_sys::INT8ARRAYOID],
                    )
                })
                .collect(),
            // Through the table, which looks for each id in every partition: events are held
            // back after being marked only behind one that broke the connection, a handful.
            unmark: prepare(
                &schema,
                &format!(
                    "UPDATE {s}.outbox SET published_at = NULL \
                     WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
                ),
                &[pg_sys::INT8ARRAYOID],
            ),
            hold: (0..LEAVES)
                .map(|leaf| {
                    let partition = spi::quote_identifier(format!("outbox_{leaf:02}"));
                    prepare(
                        &schema,
                        &format!(
                            "UPDATE {s}.{partition} SET next_attempt_at = {HELD} \
                             WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
                        ),
                        &[pg_sys::INT8ARRAYOID],
                    )
                })
                .collect(),
            release: prepare(&schema, &release_sql(s), &[pg_sys::INT8OID, pg_sys::INT8ARRAYOID]),
            sweep_from_start: prepare(
                &schema,
                &sweep_sql(s, false),
                &[pg_sys::INT8OID, pg_sys::INT2OID, pg_sys::INT2OID],
            ),
            sweep_after: prepare(
                &schema,
                &sweep_sql(s, true),
                &[
                    pg_sys::INT8OID,
                    pg_sys::INT2OID,
                    pg_sys::INT2OID,
                    pg_sys::INT8OID,
                ],
            ),
            fail: prepare(
                &schema,
                &format!(
                    "UPDATE {s}.outbox o \
                     SET published_at = NULL, \
                         attempts = o.attempts OPERATOR(pg_catalog.+) 1, \
                         last_error = f.error, \
                         next_attempt_at = pg_catalog.now() OPERATOR(pg_catalog.+) \
                             pg_catalog.make_interval(secs => f.delay) \
                     FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]), \
                                     pg_catalog.unnest($2::pg_catalog.text[]), \
                                     pg_catalog.unnest($3::pg_catalog.float8[])) \
                          AS f(id, error, delay) \
                     WHERE o.id OPERATOR(pg_catalog.=) f.id \
                     RETURNING o.id, o.attempts"
                ),
                &[
                    pg_sys::INT8ARRAYOID,
                    pg_sys::TEXTARRAYOID,
                    pg_sys::FLOAT8ARRAYOID,
                ],
            ),
            // A dead letter is known by (id, created_at); one of the same event left from an
            // earlier burial (a restore, say) is replaced, never a reason to fail the batch.
            bury: prepare(
                &schema,
                &format!(
                    "WITH moved AS (DELETE FROM {s}.outbox o WHERE o.id OPERATOR(pg_catalog.=) ANY ($1) \
                       RETURNING o.id, o.topic, o.payload, o.created_at, o.published_at, \
                                 o.attempts, o.last_error, o.key, o.headers) \
                     INSERT INTO {s}.outbox_dead \
                       (id, topic, payload, created_at, published_at, attempts, last_error, \
                        failed_at, key, headers) \
                     SELECT id, topic, payload, created_at, published_at, attempts, last_error, \
                            pg_catalog.now(), key, headers \
                     FROM moved \
                     ON CONFLICT (id, created_at) DO UPDATE SET \
                       topic = excluded.topic, payload = excluded.payload, \
                       published_at = excluded.published_at, attempts = excluded.attempts, \
                       last_error = excluded.last_error, failed_at = excluded.failed_at, \
                       key = excluded.key, headers = excluded.headers"
                ),
                &[pg_sys::INT8ARRAYOID],
            ),
            schema,
        }
    }

    /// Whether an event in `lanes` has failed or is held, and is not yet published.
    pub fn any_failing(&self, lanes: &std::ops::Range<i16>) -> bool {
        Spi::connect_mut(|client| {
            client
                .update(&self.failing, None, &[lanes.start.into(), lanes.end.into()])
                .and_then(|table| table.first().get::<bool>(1))
                .unwrap_or_else(|e| error!("outbox relay: looking for failed events failed: {e}"))
                .unwrap_or(false)
        })
    }

    /// Moves up to `limit` due events of `lanes` from `outbox_delayed` into `outbox`, where the
    /// claims that follow in the same transaction see them.
    pub fn move_due(&self, limit: usize, lanes: &std::ops::Range<i16>) -> MovedDue {
        Spi::connect_mut(|client| {
            let row = client
                .update(
                    &self.move_due,
                    None,
                    &[(limit as i64).into(), lanes.start.into(), lanes.end.into()],
                )
                .and_then(|table| {
                    let row = table.first();
                    Ok((
                        row.get::<i64>(1)?,
                        row.get::<Vec<i64>>(2)?,
                        row.get::<Vec<i64>>(3)?,
                    ))
                })
                .unwrap_or_else(|e| error!("outbox relay: moving due delayed events failed: {e}"));
            let (count, delayed, ids) = row;
            MovedDue {
                count: count.unwrap_or(0) as usize,
                renumbered: delayed
                    .unwrap_or_default()
                    .into_iter()
                    .zip(ids.unwrap_or_default())
                    .collect(),
            }
        })
    }

    /// Claims up to `limit` events of the lanes in `scope`, skipping rows other workers hold:
    /// those that never failed, in id order, and as `due` says, those whose retry is due
    /// (before them, sure of half the room, or in the room they leave). Returned in id order.
    ///
    /// With `above`, the events that never failed are looked for past that id first, and, if
    /// there are not enough past it and `below` allows, at or below it; without, from the
    /// lowest id where `reach` says. `cursor.rs` says when each is right.
    pub fn claim(
        &self,
        limit: usize,
        above: Option<i64>,
        below: bool,
        reach: Reach,
        due: DueLook,
        scope: &Scope,
    ) -> Claimed {
        let run = |claim: &Claim, limit: usize, id: Option<i64>| {
            run_claim(claim.for_scope(scope), limit, &scope.lanes, id)
        };
        // Looked for first, due events are sure of half the room (all of a room of one), and
        // the fresh events of the rest, so that neither kind waits for the other to run out;
        // what the fresh events leave goes to more due events. They are claimed up to the
        // whole limit at once: a second claim of them would take the same rows again (rows
        // this transaction locked are not skipped). Those left out stay unpublished (and
        // locked until the transaction ends); the next claim, which looks for due events
        // first again, takes them back.
        let due_share = limit.div_ceil(2);
        let first = match due {
            DueLook::First => Some(run_claim(&self.claim_due, limit, &scope.lanes, None)),
            _ => None,
        };
        let room = limit - first.as_ref().map_or(0, |due| due.len().min(due_share));
        let mut claimed = match (above, reach) {
            _ if room == 0 => Claimed::default(),
            (None, Reach::Nowhere) => Claimed::default(),
            // Without the check of failed keys, which the plain form leaves out. The table's
            // lock first, as a claim through it and a `TRUNCATE outbox` take them: taken
            // partition first, a `TRUNCATE` waiting for the partition with the table's lock
            // held, and a later statement of this transaction waiting for the table, deadlocked.
            (None, Reach::Leaf(leaf)) if !scope.failing => {
                // SAFETY: a transaction lock by OID, inside the worker's transaction; an OID
                // whose table is gone (the extension dropped since `find` last looked) is
                // locked without effect, and the claim's own statement then fails.
                unsafe {
                    pg_sys::LockRelationOid(self.table, pg_sys::RowShareLock as pg_sys::LOCKMODE)
                };
                run_claim(&self.claim_fresh_in[leaf], room, &scope.lanes, None)
            }
            (None, _) => run(&self.claim_fresh, room, None),
            (Some(above), _) => {
                let mut claimed = run(&self.claim_fresh_above, room, Some(above));
                if claimed.len() < room && below {
                    let below = run(&self.claim_fresh_below, room - claimed.len(), Some(above));
                    if !below.left.is_empty() {
                        // Rows below the cursor were left unread: the events above it wait
                        // with them, so that none goes out before an earlier one of its key.
                        claimed.left.extend(claimed.events.drain(..).map(|e| e.id));
                    }
                    claimed.events.splice(0..0, below.events);
                    claimed.unreadable.extend(below.unreadable);
                    claimed.blocked.extend(below.blocked);
                    claimed.left.extend(below.left);
                }
                claimed
            }
        };
        claimed.looked_fresh = room > 0;
        claimed.fresh_highest = claimed.highest_of_all();
        if let Some(mut first) = first {
            let found = first.len();
            first.truncate(limit - claimed.len());
            // Due events left out, or that filled the whole limit, may not be all: the next
            // claim looks for them first again, rather than a poll interval later (and the next
            // pass follows at once).
            claimed.more_due = found == limit || first.len() < found;
            claimed.looked_due = !claimed.more_due;
            claimed.add_due(first);
        } else if due == DueLook::IfRoom && claimed.len() < limit {
            claimed.looked_due = true;
            let due = run_claim(&self.claim_due, limit - claimed.len(), &scope.lanes, None);
            claimed.add_due(due);
        }
        claimed
    }

    /// Marks events published, each in its partition.
    pub fn mark_published(&self, ids: Vec<i64>) {
        run_by_leaf(&self.mark, ids, "marking published");
    }

    /// Holds claimed events that wait behind an earlier event of their key, each in its
    /// partition: they leave the index the fresh claims read until [`Statements::release`].
    pub fn hold(&self, ids: &[i64]) {
        run_by_leaf(&self.hold, ids.to_vec(), "holding events back");
    }

    /// Releases the held events of the key (else topic) of event `anchor` up to its first event
    /// that failed, leaving out the events `buried` (about to go to `outbox_dead`); returns the
    /// ids released. Called once `anchor`, its key's first event that failed, is published or
    /// about to be buried, and for a held event [`Statements::sweep`] found with nothing before
    /// it in its key.
    pub fn release(&self, anchor: i64, buried: &[i64]) -> Vec<i64> {
        Spi::connect_mut(|client| {
            client
                .update(
                    &self.release,
                    None,
                    &[anchor.into(), buried.to_vec().into()],
                )
                .unwrap_or_else(|e| error!("outbox relay: releasing held events failed: {e}"))
                .map(|row| match row.get::<i64>(1) {
                    Ok(Some(id)) => id,
                    other => error!("outbox relay: a released event reads back as {other:?}"),
                })
                .collect()
        })
    }

    /// Up to `limit` entries of the events that hold others back in `lanes`, in their index's
    /// order, past the entry of event `after` if given: each id, and whether it is a held event
    /// with nothing before it in its key (see [`Statements::release`]).
    pub fn sweep(
        &self,
        limit: usize,
        lanes: &std::ops::Range<i16>,
        after: Option<i64>,
    ) -> Vec<(i64, bool)> {
        let mut args = vec![(limit as i64).into(), lanes.start.into(), lanes.end.into()];
        let statement = match after {
            Some(id) => {
                args.push(id.into());
                &self.sweep_after
            }
            None => &self.sweep_from_start,
        };
        Spi::connect_mut(|client| {
            client
                .update(statement, None, &args)
                .unwrap_or_else(|e| error!("outbox relay: looking at held events failed: {e}"))
                .map(|row| match (row.get::<i64>(1), row.get::<bool>(2)) {
                    (Ok(Some(id)), Ok(Some(stuck))) => (id, stuck),
                    other => error!("outbox relay: a held event reads back as {other:?}"),
                })
                .collect()
        })
    }

    /// Unmarks events that were held back after they were marked, without charging them: they
    /// are claimed again as if never claimed.
    pub fn unmark(&self, ids: Vec<i64>) {
        Spi::connect_mut(|client| {
            client
                .update(&self.unmark, None, &[ids.into()])
                .unwrap_or_else(|e| error!("outbox relay: taking marks back failed: {e}"));
        });
    }

    /// Unmarks each failed event, charges it an attempt and schedules its retry after the
    /// delay given with it; returns each event's attempts as they now are.
    pub fn record_failures(&self, failures: &[(i64, String, Duration)]) -> Vec<Charged> {
        let ids: Vec<i64> = failures.iter().map(|f| f.0).collect();
        let errors: Vec<String> = failures.iter().map(|f| ascii_safe(&f.1)).collect();
        let delays: Vec<f64> = failures.iter().map(|f| f.2.as_secs_f64()).collect();
        Spi::connect_mut(|client| {
            let table = client
                .update(
                    &self.fail,
                    None,
                    &[ids.into(), errors.into(), delays.into()],
                )
                .unwrap_or_else(|e| error!("outbox relay: recording failures failed: {e}"));
            table
                .map(|row| match (row.get::<i64>(1), row.get::<i32>(2)) {
                    (Ok(Some(id)), Ok(Some(attempts))) => Charged { id, attempts },
                    other => error!("outbox relay: a charged event reads back as {other:?}"),
                })
                .collect()
        })
    }

    /// Moves events to `outbox_dead`.
    pub fn bury(&self, ids: Vec<i64>) {
        Spi::connect_mut(|client| {
            client
                .update(&self.bury, None, &[ids.into()])
                .unwrap_or_else(|e| {
                    error!("outbox relay: moving events to outbox_dead failed: {e}")
                });
        });
    }
}

/// Runs one of `statements` (one per partition of the ring) for the ids of each partition.
fn run_by_leaf(statements: &[OwnedPreparedStatement], ids: Vec<i64>, what: &str) {
    let mut by_leaf: [Vec<i64>; LEAVES] = Default::default();
    for id in ids {
        by_leaf[ring::leaf_of(id)].push(id);
    }
    Spi::connect_mut(|client| {
        for (leaf, ids) in by_leaf.into_iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            client
                .update(&statements[leaf], None, &[ids.into()])
                .unwrap_or_else(|e| error!("outbox relay: {what} failed: {e}"));
        }
    });
}

fn run_claim(
    statement: &Plan,
    limit: usize,
    lanes: &std::ops::Range<i16>,
    id: Option<i64>,
) -> Claimed {
    let mut args = vec![
        (pg_sys::INT8OID, pg_sys::Datum::from(limit as i64)),
        (pg_sys::INT2OID, pg_sys::Datum::from(lanes.start)),
        (pg_sys::INT2OID, pg_sys::Datum::from(lanes.end)),
    ];
    args.extend(id.map(|id| (pg_sys::INT8OID, pg_sys::Datum::from(id))));
    let utf8_database = utf8::database_is_utf8();
    let mut claimed = Claimed {
        events: Vec::with_capacity(limit.min(1024)),
        ..Claimed::default()
    };
    let mut bytes = 0;
    statement.run(
        &args,
        &mut |values, nulls| {
            if bytes >= CLAIM_BYTES {
                // Locked by the claim, and left for a later pass (`left`); the first row is
                // always read, however long.
                claimed.left.push(values[0].value() as i64);
                return;
            }
            let read = claimed.events.len();
            read_row(&mut claimed, values, nulls, utf8_database);
            bytes += claimed.events[read..]
                .iter()
                .map(Event::text_bytes)
                .sum::<usize>();
        },
        "claim failed",
    );
    claimed
}

/// Most bytes of text (topic, payload, key, headers) one claim statement reads (a claim runs up
/// to three: due events, and fresh ones above and below the cursor): a chunk of large events
/// is held in memory twice over (as read, and as sent), and the next chunk is claimed while
/// Redis works on it.
const CLAIM_BYTES: usize = 16 * 1024 * 1024;

/// The claim's columns: their types, in the order of [`CLAIMED_COLUMNS`], then whether the row
/// is blocked.
const CLAIMED_TYPES: [pg_sys::Oid; 8] = [
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::TIMESTAMPTZOID,
    pg_sys::INT4OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::BOOLOID,
];

/// Reads one claimed row, its columns in the order of [`CLAIMED_TYPES`]. Topic and payload
/// are read as the database stores them and converted to UTF-8 here, one event at a time, so
/// that text which cannot be converted is charged to its event instead of failing the claim.
/// Of a blocked row only the id is read.
fn read_row(claimed: &mut Claimed, values: &[pg_sys::Datum], nulls: &[bool], utf8_database: bool) {
    let column = |i: usize| (!nulls[i]).then_some(values[i]);
    // By value, as a 64-bit server passes bigint, timestamptz and integer datums.
    let Some(id) = column(0).map(|d| d.value() as i64) else {
        error!("outbox relay: a claimed row has no id");
    };
    if column(7).is_some_and(|d| d.value() != 0) {
        claimed.blocked.push(id);
        return;
    }
    let created_at = column(3).map(|d| d.value() as i64);
    let attempts = column(4).map_or(0, |d| d.value() as i32);
    let text = |i: usize, name: &str| match column(i) {
        None => Ok(None),
        // SAFETY: a non-null text datum of the row being read.
        Some(datum) => unsafe { utf8_text(datum, utf8_database) }
            .map(Some)
            .map_err(|why| format!("{name} {why}")),
    };
    let required = |i: usize, name: &str| {
        text(i, name).and_then(|v| v.ok_or_else(|| format!("{name} is null")))
    };
    let topic = required(1, "topic");
    let payload = required(2, "payload");
    let key = text(5, "key");
    let headers = text(6, "headers");
    match (topic, payload, key, headers, created_at) {
        (Ok(topic), Ok(payload), Ok(key), Ok(headers), Some(created_at)) => {
            claimed.events.push(Event {
                id,
                topic,
                payload,
                created_at,
                attempts,
                key,
                headers,
            })
        }
        (topic, payload, key, headers, created_at) => {
            let error = [
                topic.as_ref().err(),
                payload.as_ref().err(),
                key.as_ref().err(),
                headers.as_ref().err(),
            ]
            .into_iter()
            .flatten()
            .next()
            .cloned()
            .or_else(|| {
                created_at
                    .is_none()
                    .then(|| "created_at is null".to_string())
            })
            .unwrap_or_default();
            claimed.unreadable.push(Failure {
                id,
                topic: topic.unwrap_or_default(),
                attempts,
                error,
                permanent: true,
            });
        }
    }
}

/// A text datum as UTF-8; the error says why it cannot be, after the column's name.
///
/// # Safety
/// `datum` is a non-null `text` datum, valid while its row is being read.
unsafe fn utf8_text(datum: pg_sys::Datum, utf8_database: bool) -> Result<String, String> {
    let stored = datum.cast_mut_ptr::<pg_sys::varlena>();
    // SAFETY: the caller's promise. Only a compressed or out-of-line value needs PostgreSQL to
    // fetch it (into the executor's memory); a plain or short one is read where it is.
    let text = unsafe {
        if pgrx::varlena::varatt_is_4b_c(stored) || pgrx::varlena::varatt_is_1b_e(stored) {
            pg_sys::pg_detoast_datum_packed(stored)
        } else {
            stored
        }
    };
    // SAFETY: a varlena in memory, as just made sure.
    let bytes = unsafe { pgrx::varlena::varlena_to_byte_slice(text) };
    let invalid = |e: std::str::Utf8Error| format!("is not valid UTF-8: {e}");
    let read = if utf8_database {
        // Into a string kept from an earlier claim (see `spare.rs`).
        std::str::from_utf8(bytes)
            .map(spare::filled)
            .map_err(invalid)
    } else {
        utf8::to_utf8(bytes).and_then(|utf8| {
            String::from_utf8(utf8.into_owned()).map_err(|e| invalid(e.utf8_error()))
        })
    };
    if text != stored {
        // SAFETY: the copy fetched above, read no more: freed now rather than with the
        // statement, which may fetch hundreds of them.
        unsafe { pg_sys::pfree(text.cast()) };
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_redis::encode::sample_event;

    fn failure(id: i64) -> Failure {
        Failure {
            id,
            topic: "t".into(),
            attempts: 0,
            error: "not UTF-8".into(),
            permanent: true,
        }
    }

    fn claimed(events: &[i64], unreadable: &[i64], blocked: &[i64]) -> Claimed {
        Claimed {
            events: events.iter().map(|&id| sample_event(id, "t")).collect(),
            unreadable: unreadable.iter().map(|&id| failure(id)).collect(),
            blocked: blocked.to_vec(),
            ..Claimed::default()
        }
    }

    #[test]
    fn blocked_rows_count_against_the_limit_and_move_the_reach() {
        let claim = claimed(&[3, 5], &[4], &[1, 2, 9]);
        // The claim's LIMIT counted them: a chunk of blocked rows is a full chunk.
        assert_eq!(claim.len(), 6);
        // Held in the same transaction, they leave the index of fresh events behind the cursor.
        assert_eq!(claim.highest_of_all(), Some(9));
        assert_eq!(claimed(&[], &[], &[]).highest_of_all(), None);
    }

    #[test]
    fn a_truncated_claim_keeps_events_then_unreadable_then_blocked_rows() {
        let mut claim = claimed(&[3, 5], &[4], &[1, 2, 9]);
        claim.truncate(4);
        assert_eq!(claim.len(), 4);
        assert_eq!(claim.blocked, [1]);
        claim.truncate(2);
        assert_eq!((claim.events.len(), claim.unreadable.len()), (2, 0));
        assert!(claim.blocked.is_empty());
    }

    #[test]
    fn due_rows_join_in_id_order_with_their_blocked_rows() {
        let mut claim = claimed(&[3, 8], &[], &[6]);
        claim.add_due(claimed(&[1, 5], &[], &[2]));
        let ids: Vec<i64> = claim.events.iter().map(|e| e.id).collect();
        assert_eq!(ids, [1, 3, 5, 8]);
        assert_eq!(claim.blocked, [6, 2]);
        // Due rows that are all blocked still join.
        claim.add_due(claimed(&[], &[], &[7]));
        assert_eq!(claim.len(), 7);
    }
}

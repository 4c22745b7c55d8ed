//! The relay's SQL: the text of every statement it prepares (find the extension, claim a batch,
//! mark it, charge failed events, hold the events behind them and release those again, move due
//! delayed events into `outbox`, move exhausted ones to `outbox_dead`) and the pieces they share.
//!
//! Pure text, prepared by `statements.rs`. The statements name the extension's schema as the
//! `s` (or `schema`) they are given, [`SCHEMA`](super::schema::SCHEMA) in the relay, which
//! `pg/schema.rs` replaces with the quoted name. They run in a session whose `search_path` is
//! `pg_catalog, pg_temp` (see `session.rs`), and qualify what they call all the same.

use pgrx::pg_sys;

/// The schema and version of the extension whose OID is `$1`.
pub const EXTENSION: &str = "SELECT e.extnamespace, e.extversion FROM pg_catalog.pg_extension e \
                             WHERE e.oid OPERATOR(pg_catalog.=) $1";

/// Events that never failed, in id order, through the partial index that holds only them; the
/// lanes beside the ids pass by other workers' events in the index.
pub const FRESH: &str = "o.published_at IS NULL AND o.next_attempt_at IS NULL";

/// The order of the claims of events that never failed: the columns of their partial index.
/// Ordered by (id, lane), which is id order, as only that index gives it: ordered by id alone, a
/// partition analyzed while its rows were unpublished and planned for while empty was read
/// through its primary key, every published row of it for every claim (`tests/claims.rs`).
pub const FRESH_ORDER: &str = "o.id, o.lane";

/// Fresh events above the id `$4`, and at or below it (see [`claim_args`]).
pub fn fresh_above() -> String {
    format!("{FRESH} AND o.id OPERATOR(pg_catalog.>) $4")
}

pub fn fresh_below() -> String {
    format!("{FRESH} AND o.id OPERATOR(pg_catalog.<=) $4")
}

/// The columns every plain claim returns, in the order `read_row` (`claim/rows.rs`) reads them, but
/// for the last (whether the row is blocked), which a plain claim gives as `false`.
pub const CLAIMED_COLUMNS: &str =
    "o.id, o.topic, o.payload::pg_catalog.text, o.created_at, o.attempts, \
                               o.key, o.headers::pg_catalog.text";

/// The claim's columns: their types, in the order of [`CLAIMED_COLUMNS`], then whether the row
/// is blocked, then its lane.
pub const CLAIMED_TYPES: [pg_sys::Oid; 9] = [
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::TIMESTAMPTZOID,
    pg_sys::INT4OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::BOOLOID,
    pg_sys::INT2OID,
];

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
pub fn claim_args(with_id: bool) -> Vec<pg_sys::Oid> {
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
/// a failed key read every one of them again in every pass, so that each claim cost as much as
/// the key's backlog, where one that takes them reads at most its limit, and never again once
/// they are held. Their payload and headers stay unread.
pub fn claim_sql(schema: &str, table: &str, filter: &str, order: &str, guarded: bool) -> String {
    let rows = format!(
        "FROM {schema}.{table} o \
         WHERE {filter} \
           AND o.lane OPERATOR(pg_catalog.>=) $2 AND o.lane OPERATOR(pg_catalog.<) $3 \
         ORDER BY {order} LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    if !guarded {
        return format!("SELECT {CLAIMED_COLUMNS}, false, o.lane {rows}");
    }
    format!(
        "SELECT c.id, c.topic, \
                CASE WHEN c.blocked THEN NULL ELSE c.payload::pg_catalog.text END, \
                c.created_at, c.attempts, c.key, \
                CASE WHEN c.blocked THEN NULL ELSE c.headers::pg_catalog.text END, c.blocked, \
                c.lane \
         FROM (SELECT o.id, o.topic, o.payload, o.created_at, o.attempts, o.key, o.headers, \
                      {} AS blocked, o.lane {rows}) c",
        held_back(schema, "o")
    )
}

/// Whether an earlier event of the key (else of the topic, among events without a key) of the
/// row `t` failed or is held, and is not yet published: that one goes first, or to outbox_dead.
/// The index `outbox_failing` holds those events by lane and the start of the key, so the check
/// reads only the entries of the same key, and stops at the first. `OFFSET 0` keeps the planner
/// from turning it into a join that reads every failed event (a hash of all of them, built for
/// every claim); as a subquery run per row, it is one index probe per partition.
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

/// The claim of events whose retry delay is over, through the index of waiting events: however
/// many wait (held ones at 'infinity' included), only the due ones are read. Always guarded: the
/// worker may learn of events charged elsewhere (by hand, see `FAILING_RECHECK` in `claim/retry.rs`)
/// only at its next look for failing events, up to `FAILING_RECHECK` later, and two due events
/// of one key must not go out by their retry times. A due event behind an earlier one of its key
/// is held, rather than read again by every claim until that one is out.
pub fn claim_due_sql(schema: &str) -> String {
    claim_sql(
        schema,
        "outbox",
        "o.published_at IS NULL \
         AND o.next_attempt_at OPERATOR(pg_catalog.<=) pg_catalog.now()",
        // Among due events of one key only the earliest passes the check, so the index's order
        // is enough.
        "o.next_attempt_at",
        true,
    )
}

/// Whether an event in the lanes `$1` to `$2` has failed or is held, and is not yet published.
pub fn failing_sql(s: &str) -> String {
    format!(
        "SELECT EXISTS (SELECT FROM {s}.outbox f \
         WHERE {} \
           AND f.lane OPERATOR(pg_catalog.>=) $1 AND f.lane OPERATOR(pg_catalog.<) $2)",
        holding_back("f")
    )
}

/// Moves up to `$1` due events of the lanes `$2` to `$3` from `outbox_delayed` into `outbox`;
/// returns how many moved, and the old and new ids of those given a new one.
///
/// An event whose id outbox holds already (ids used again: `RESTART IDENTITY`, a `setval`, a
/// restore) goes in with a new id from the sequence, a new identity for consumers: kept in
/// outbox_delayed, it would be due for ever, first in every move of its lanes, and with a
/// batch's worth of them, no other delayed event of those lanes would move again. Both inserts
/// go first and the delete takes only what they inserted, so an event whose new id is taken as
/// well (a sequence set back below outbox's ids) stays where it is, and the next move draws it
/// another. The events that keep their id and those given a new one go in by two inserts, each
/// read back by its own ids (a new id may equal a kept one), so the delete never takes an event
/// that did not go in.
pub fn move_due_sql(s: &str, sequence: pg_sys::Oid) -> String {
    format!(
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
    )
}

/// Marks the events `$1` of one partition published: one statement per partition, as a mark
/// through the partitioned table would look for every id in every partition (hash partitions are
/// not pruned for `= ANY` of a parameter).
pub fn mark_sql(s: &str, partition: &str) -> String {
    format!(
        "UPDATE {s}.{partition} SET published_at = pg_catalog.now() \
         WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
    )
}

/// Takes the mark back from the events `$1`, held back rather than sent. Through the table,
/// which looks for each id in every partition: events are held back after being marked only
/// behind one that broke the connection, a handful.
pub fn unmark_sql(s: &str) -> String {
    format!(
        "UPDATE {s}.outbox SET published_at = NULL \
         WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
    )
}

/// Holds the blocked events `$1` of one partition (one statement per partition, as
/// [`mark_sql`]).
pub fn hold_sql(s: &str, partition: &str) -> String {
    format!(
        "UPDATE {s}.{partition} SET next_attempt_at = {HELD} \
         WHERE id OPERATOR(pg_catalog.=) ANY ($1)"
    )
}

/// Releases the held events of the key (else topic) of event `$1`, but for the events `$2`
/// (about to be buried): each one up to the key's first event that failed, that one included if
/// held. Those before it are fresh again and go out in id order; it, if it was held, is fresh
/// again too and, having failed, still holds back the rest, which its own publication or burial
/// releases in turn. The key is read from event `$1` once (the `MATERIALIZED` row) and given to
/// the conditions as constants, so that each is an index range of `outbox_failing`.
pub fn release_sql(s: &str) -> String {
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
pub fn sweep_sql(s: &str, after: bool) -> String {
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

/// Unmarks each failed event of `$1`, charges it an attempt, keeps its error of `$2` and
/// schedules its retry after its delay of `$3` (seconds); returns each event's attempts.
pub fn fail_sql(s: &str) -> String {
    format!(
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
    )
}

/// Moves the events `$1` to `outbox_dead`. A dead letter is known by (id, created_at); one of
/// the same event left from an earlier burial (a restore, say) is replaced, never a reason to
/// fail the batch.
pub fn bury_sql(s: &str) -> String {
    format!(
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
    )
}

//! The relay's prepared statements: prepared once per installation of the extension, when the
//! worker finds it (`extension.rs`), and kept, so a batch costs executions only. Each method
//! runs one of them inside the worker's transaction; their text is in `sql.rs`, and the rows a
//! claim takes are read in `claim/rows.rs`.

use std::ffi::CStr;
use std::time::Duration;

use outbox_redis::encode::ascii_safe;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::PgOid;

use super::claim::cursor::Reach;
use super::claim::query::Plan;
use super::claim::retry::DueLook;
use super::claim::rows::run_claim;
use super::claim::{Claimed, Scope};
use super::sql::{self, CLAIMED_TYPES, FRESH, FRESH_ORDER};
use crate::model::ring::{self, LEAVES};
use crate::pg::schema::{Schema, SCHEMA};

/// What a move of due delayed events into `outbox` did.
pub struct MovedDue {
    /// How many events moved.
    pub count: usize,
    /// The events that went in with a new id, as (id in `outbox_delayed`, id in `outbox`):
    /// `outbox` held their own.
    pub renumbered: Vec<(i64, i64)>,
}

/// A failed event after its attempt was charged.
pub struct Charged {
    pub id: i64,
    pub attempts: i32,
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
    /// `claim/cursor.rs`).
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

/// Prepares a claim, whose rows are read as the executor produces them (see `claim/query.rs`).
fn prepare_rows(schema: &Schema, sql: &str, args: &[pg_sys::Oid]) -> Plan {
    Plan::prepare(&schema.sql(sql), &schema.show(sql), args, &CLAIMED_TYPES)
}

/// Prepares a claim of `outbox` in its two forms (see `sql::claim_sql` and `sql::claim_args`).
fn prepare_claim(schema: &Schema, filter: &str, order: &str, with_id: bool) -> Claim {
    let args = sql::claim_args(with_id);
    Claim {
        plain: prepare_rows(
            schema,
            &sql::claim_sql(SCHEMA, "outbox", filter, order, false),
            &args,
        ),
        guarded: prepare_rows(
            schema,
            &sql::claim_sql(SCHEMA, "outbox", filter, order, true),
            &args,
        ),
    }
}

/// The OID of relation `name` in the extension's schema; an error if it is missing.
fn relation(schema: &Schema, name: &CStr, what: &str) -> pg_sys::Oid {
    // SAFETY: a catalog lookup inside the current transaction.
    let oid = unsafe { pg_sys::get_relname_relid(name.as_ptr(), schema.oid()) };
    if oid == pg_sys::InvalidOid {
        error!(
            "outbox relay: no {what} {} in schema {schema}",
            name.to_string_lossy()
        );
    }
    oid
}

/// A statement per partition of the ring, in leaf order, its text made from the partition's
/// quoted name.
fn per_partition(
    schema: &Schema,
    args: &[pg_sys::Oid],
    sql_of: impl Fn(&str) -> String,
) -> Vec<OwnedPreparedStatement> {
    (0..LEAVES)
        .map(|leaf| {
            let partition = spi::quote_identifier(format!("outbox_{leaf:02}"));
            prepare(schema, &sql_of(&partition), args)
        })
        .collect()
}

const IDS: &[pg_sys::Oid] = &[pg_sys::INT8ARRAYOID];
const LANE_RANGE: &[pg_sys::Oid] = &[pg_sys::INT2OID, pg_sys::INT2OID];
const COUNT_AND_LANES: &[pg_sys::Oid] = &[pg_sys::INT8OID, pg_sys::INT2OID, pg_sys::INT2OID];

impl Statements {
    pub fn prepare(extension: pg_sys::Oid, schema: Schema) -> Statements {
        let s = SCHEMA;
        let table = relation(&schema, c"outbox", "table");
        let sequence = relation(&schema, c"outbox_id_seq", "sequence");
        let after = [
            pg_sys::INT8OID,
            pg_sys::INT2OID,
            pg_sys::INT2OID,
            pg_sys::INT8OID,
        ];
        let failures = [
            pg_sys::INT8ARRAYOID,
            pg_sys::TEXTARRAYOID,
            pg_sys::FLOAT8ARRAYOID,
        ];
        Statements {
            extension,
            table,
            claim_fresh: prepare_claim(&schema, FRESH, FRESH_ORDER, false),
            claim_fresh_in: (0..LEAVES)
                .map(|leaf| {
                    let partition = spi::quote_identifier(format!("outbox_{leaf:02}"));
                    let text = sql::claim_sql(SCHEMA, &partition, FRESH, FRESH_ORDER, false);
                    prepare_rows(&schema, &text, &sql::claim_args(false))
                })
                .collect(),
            claim_fresh_above: prepare_claim(&schema, &sql::fresh_above(), FRESH_ORDER, true),
            claim_fresh_below: prepare_claim(&schema, &sql::fresh_below(), FRESH_ORDER, true),
            claim_due: prepare_rows(&schema, &sql::claim_due_sql(s), &sql::claim_args(false)),
            failing: prepare(&schema, &sql::failing_sql(s), LANE_RANGE),
            move_due: prepare(&schema, &sql::move_due_sql(s, sequence), COUNT_AND_LANES),
            mark: per_partition(&schema, IDS, |partition| sql::mark_sql(s, partition)),
            unmark: prepare(&schema, &sql::unmark_sql(s), IDS),
            hold: per_partition(&schema, IDS, |partition| sql::hold_sql(s, partition)),
            release: prepare(
                &schema,
                &sql::release_sql(s),
                &[pg_sys::INT8OID, pg_sys::INT8ARRAYOID],
            ),
            sweep_from_start: prepare(&schema, &sql::sweep_sql(s, false), COUNT_AND_LANES),
            sweep_after: prepare(&schema, &sql::sweep_sql(s, true), &after),
            fail: prepare(&schema, &sql::fail_sql(s), &failures),
            bury: prepare(&schema, &sql::bury_sql(s), IDS),
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
    /// lowest id where `reach` says. `claim/cursor.rs` says when each is right.
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

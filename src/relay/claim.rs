//! The relay's SQL: find the extension, claim a batch, mark it, charge failed events, move
//! exhausted ones to `outbox_dead`. Statements are prepared once per extension and kept, so a
//! batch costs executions only. Every function here runs inside the worker's transaction.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::OwnedPreparedStatement;
use pgrx::PgOid;

use super::encode::Event;

/// The schema the extension with oid `oid` lives in.
pub fn extension_schema(oid: pg_sys::Oid) -> Option<String> {
    Spi::get_one_with_args::<String>(
        "SELECT n.nspname::text FROM pg_catalog.pg_extension e \
         JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.oid = $1",
        &[oid.into()],
    )
    .ok()
    .flatten()
}

/// An event Redis rejected, after its attempt was charged.
pub struct Failed {
    pub id: i64,
    pub attempts: i32,
    pub topic: String,
    pub error: String,
}

/// The prepared statements of one installation of the extension.
pub struct Statements {
    pub extension: pg_sys::Oid,
    claim: OwnedPreparedStatement,
    mark: OwnedPreparedStatement,
    fail: OwnedPreparedStatement,
    bury: OwnedPreparedStatement,
}

fn prepare(sql: &str, args: &[pg_sys::Oid]) -> OwnedPreparedStatement {
    let args: Vec<PgOid> = args.iter().map(|&oid| PgOid::from(oid)).collect();
    Spi::connect(|client| {
        client
            .prepare_mut(sql, &args)
            .unwrap_or_else(|e| error!("outbox relay: cannot prepare {sql}: {e}"))
            .keep()
    })
}

impl Statements {
    pub fn prepare(extension: pg_sys::Oid, schema: &str) -> Statements {
        let s = spi::quote_identifier(schema);
        Statements {
            extension,
            claim: prepare(
                &format!(
                    "SELECT id, topic, payload::text, created_at FROM {s}.outbox \
                     WHERE published_at IS NULL AND id <> ALL($2) \
                     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                &[pg_sys::INT8OID, pg_sys::INT8ARRAYOID],
            ),
            mark: prepare(
                &format!("UPDATE {s}.outbox SET published_at = now() WHERE id = ANY($1)"),
                &[pg_sys::INT8ARRAYOID],
            ),
            fail: prepare(
                // No join: the plan stays an index scan of the primary key.
                &format!(
                    "UPDATE {s}.outbox o \
                     SET published_at = NULL, attempts = o.attempts + 1, \
                         last_error = ($2::text[])[array_position($1, o.id)] \
                     WHERE o.id = ANY($1) RETURNING o.id, o.attempts, o.topic, o.last_error"
                ),
                &[pg_sys::INT8ARRAYOID, pg_sys::TEXTARRAYOID],
            ),
            bury: prepare(
                &format!(
                    "WITH moved AS (DELETE FROM {s}.outbox WHERE id = ANY($1) RETURNING *) \
                     INSERT INTO {s}.outbox_dead \
                       (id, topic, payload, created_at, published_at, attempts, last_error, failed_at) \
                     SELECT id, topic, payload, created_at, published_at, attempts, last_error, now() \
                     FROM moved"
                ),
                &[pg_sys::INT8ARRAYOID],
            ),
        }
    }

    /// Claims up to `limit` unpublished events in id order, skipping rows other workers hold
    /// and the ids in `not_yet` (events waiting out a retry delay).
    pub fn claim(&self, limit: usize, not_yet: &[i64]) -> Vec<Event> {
        Spi::connect_mut(|client| {
            let args: [DatumWithOid; 2] = [(limit as i64).into(), not_yet.to_vec().into()];
            let table = client
                .update(&self.claim, None, &args)
                .unwrap_or_else(|e| error!("outbox relay: claim failed: {e}"));
            let mut events = Vec::with_capacity(table.len());
            for row in table {
                let id = row.get::<i64>(1).ok().flatten().unwrap_or_default();
                let topic = row.get::<String>(2).ok().flatten().unwrap_or_default();
                let payload = row.get::<String>(3).ok().flatten().unwrap_or_default();
                let created_at = row
                    .get_datum_by_ordinal(4)
                    .ok()
                    .and_then(|entry| {
                        entry
                            .value::<pgrx::datum::TimestampWithTimeZone>()
                            .ok()
                            .flatten()
                    })
                    .map(i64::from)
                    .unwrap_or_default();
                events.push(Event {
                    id,
                    topic,
                    payload,
                    created_at,
                });
            }
            events
        })
    }

    pub fn mark_published(&self, ids: Vec<i64>) {
        Spi::connect_mut(|client| {
            client
                .update(&self.mark, None, &[ids.into()])
                .unwrap_or_else(|e| error!("outbox relay: marking published failed: {e}"));
        });
    }

    /// Unmarks each failed event and charges it an attempt; returns each event as it now is.
    pub fn record_failures(&self, failures: Vec<(i64, String)>) -> Vec<Failed> {
        let (ids, errors): (Vec<i64>, Vec<String>) = failures.into_iter().unzip();
        Spi::connect_mut(|client| {
            let table = client
                .update(&self.fail, None, &[ids.into(), errors.into()])
                .unwrap_or_else(|e| error!("outbox relay: recording failures failed: {e}"));
            table
                .map(|row| Failed {
                    id: row.get::<i64>(1).ok().flatten().unwrap_or_default(),
                    attempts: row.get::<i32>(2).ok().flatten().unwrap_or_default(),
                    topic: row.get::<String>(3).ok().flatten().unwrap_or_default(),
                    error: row.get::<String>(4).ok().flatten().unwrap_or_default(),
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

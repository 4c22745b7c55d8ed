//! The PostgreSQL side: the inbox that remembers which events were applied, the effect itself,
//! and the record of entries that could not be read.
//!
//! Redis delivers each entry at least once: an entry read but not yet acknowledged when the
//! consumer dies is delivered again, and a relay that dies between publishing and marking may
//! publish an event twice. The inbox turns that into exactly once: the event's identity goes in
//! in the same transaction as its effect, so either both are committed or neither is, and an
//! event delivered again finds its identity there and is skipped.
//!
//! To use this in a service, replace `apply_effect` (and the `applied_events` table) with what
//! the service does with an event: anything that runs in the transaction it is given.

use postgres::{Client, Transaction};

use crate::event::{describe, Event};

/// A stream entry as Redis returns it: its id and its flat field/value list, `None` when the
/// entry was deleted from the stream (trimmed by `MAXLEN`) while it was pending.
pub type Entry = (String, Option<Vec<Vec<u8>>>);

const TABLES: &str = "
-- One row per event applied: its identity (see event.rs). The stream is part of it because
-- several databases may relay to one Redis, each with ids of its own, into streams of their own.
-- Rows can be deleted once no copy of their event can arrive any more, e.g. older than the
-- longest a consumer may stay down plus a margin.
CREATE TABLE IF NOT EXISTS outbox_consumer_inbox (
    stream     text        NOT NULL,
    event_id   bigint      NOT NULL,
    created_at timestamptz NOT NULL,
    entry_id   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, event_id, created_at)
);

-- The effect, for the demonstration. Deliberately without a unique key: it stands for an effect
-- that cannot be made idempotent by itself (an e-mail, money moved), so a second application
-- would show as a second row.
CREATE TABLE IF NOT EXISTS applied_events (
    stream     text        NOT NULL,
    event_id   bigint      NOT NULL,
    created_at timestamptz NOT NULL,
    topic      text        NOT NULL,
    key        text,
    headers    jsonb,
    payload    jsonb       NOT NULL,
    entry_id   text        NOT NULL
);

-- Entries that are not events this consumer can apply (a field missing, not UTF-8, a payload
-- that is not JSON): kept here for a person to look at, and acknowledged, so that one bad entry
-- does not stop the stream behind it. Not deduplicated: an entry delivered again after a crash
-- may be recorded twice.
CREATE TABLE IF NOT EXISTS outbox_consumer_dead (
    stream    text        NOT NULL,
    entry_id  text        NOT NULL,
    fields    text        NOT NULL,
    error     text        NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT now()
);";

/// What became of a batch's entries.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub applied: usize,
    /// Events already in the inbox: delivered before.
    pub duplicates: usize,
    /// Entries recorded in `outbox_consumer_dead`.
    pub dead: usize,
    /// Entries deleted from the stream before they could be read.
    pub trimmed: usize,
}

pub fn create_tables(pg: &mut Client) -> Result<(), postgres::Error> {
    let mut tx = pg.transaction()?;
    // Consumers started together would race on CREATE TABLE IF NOT EXISTS: they take turns.
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('outbox_consumer_inbox'))",
        &[],
    )?;
    tx.batch_execute(TABLES)?;
    tx.commit()
}

/// Applies the entries of `stream` that are new events, skips those already applied and records
/// those that cannot be read; everything is committed when this returns `Ok`.
pub fn apply_batch(
    pg: &mut Client,
    stream: &str,
    entries: &[Entry],
) -> Result<Tally, postgres::Error> {
    // The whole batch in one transaction: one commit (one flush to disk) per batch.
    match apply_in_one_transaction(pg, stream, entries) {
        Err(e) if is_bad_data(&e) => {
            // A value PostgreSQL refused (a payload that is not JSON, a timestamp that is not
            // one) rolled back the batch: find the culprit by applying its entries one by one.
            let mut total = Tally::default();
            for entry in entries {
                match apply_in_one_transaction(pg, stream, std::slice::from_ref(entry)) {
                    Ok(tally) => total = total.plus(tally),
                    Err(e) if is_bad_data(&e) => {
                        let fields = entry.1.as_deref().unwrap_or_default();
                        let mut tx = pg.transaction()?;
                        record_dead(&mut tx, stream, &entry.0, fields, &message(&e))?;
                        tx.commit()?;
                        total.dead += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(total)
        }
        other => other,
    }
}

fn apply_in_one_transaction(
    pg: &mut Client,
    stream: &str,
    entries: &[Entry],
) -> Result<Tally, postgres::Error> {
    let mut tx = pg.transaction()?;
    let remember = tx.prepare(
        "INSERT INTO outbox_consumer_inbox (stream, event_id, created_at, entry_id) \
         VALUES ($1, $2, $3::text::timestamptz, $4) \
         ON CONFLICT (stream, event_id, created_at) DO NOTHING",
    )?;
    let mut tally = Tally::default();
    for (entry_id, fields) in entries {
        let Some(fields) = fields else {
            tally.trimmed += 1;
            continue;
        };
        let event = match Event::from_fields(fields) {
            Ok(event) => event,
            Err(why) => {
                record_dead(&mut tx, stream, entry_id, fields, &why)?;
                tally.dead += 1;
                continue;
            }
        };
        // 1 row inserted: the first delivery of this event. 0: the inbox has it, from a delivery
        // whose transaction committed (another consumer's still open one makes this wait for
        // its outcome, so two consumers never both apply an event).
        if tx.execute(
            &remember,
            &[&stream, &event.id, &event.created_at, entry_id],
        )? == 1
        {
            apply_effect(&mut tx, stream, entry_id, &event)?;
            tally.applied += 1;
        } else {
            tally.duplicates += 1;
        }
    }
    tx.commit()?;
    Ok(tally)
}

/// What the service does with an event: here, a row in `applied_events`.
fn apply_effect(
    tx: &mut Transaction,
    stream: &str,
    entry_id: &str,
    event: &Event,
) -> Result<(), postgres::Error> {
    tx.execute(
        "INSERT INTO applied_events \
             (stream, event_id, created_at, topic, key, headers, payload, entry_id) \
         VALUES ($1, $2, $3::text::timestamptz, $4, $5, $6::text::jsonb, $7::text::jsonb, $8)",
        &[
            &stream,
            &event.id,
            &event.created_at,
            &event.topic,
            &event.key,
            &event.headers,
            &event.payload,
            &entry_id,
        ],
    )?;
    Ok(())
}

fn record_dead(
    tx: &mut Transaction,
    stream: &str,
    entry_id: &str,
    fields: &[Vec<u8>],
    error: &str,
) -> Result<(), postgres::Error> {
    tx.execute(
        "INSERT INTO outbox_consumer_dead (stream, entry_id, fields, error) \
         VALUES ($1, $2, $3, $4)",
        &[&stream, &entry_id, &describe(fields), &error],
    )?;
    Ok(())
}

/// The error on one line, with what caused it: `postgres::Error` alone says "db error" or
/// "error communicating with the server", and the server's message is in its cause.
pub fn message(error: &postgres::Error) -> String {
    let text = match (error.as_db_error(), std::error::Error::source(error)) {
        (Some(server), _) => server.to_string(),
        (None, Some(cause)) => format!("{error}: {cause}"),
        (None, None) => error.to_string(),
    };
    text.replace('\n', " ")
}

/// A value the entry carried was refused (SQLSTATE class 22, "data exception"): trying again
/// would fail again. Any other error (connection lost, deadlock) is not the entry's fault.
fn is_bad_data(error: &postgres::Error) -> bool {
    error
        .code()
        .is_some_and(|code| code.code().starts_with("22"))
}

impl Tally {
    pub fn plus(self, other: Tally) -> Tally {
        Tally {
            applied: self.applied + other.applied,
            duplicates: self.duplicates + other.duplicates,
            dead: self.dead + other.dead,
            trimmed: self.trimmed + other.trimmed,
        }
    }
}

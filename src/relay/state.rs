//! The worker's state, as `outbox_workers` shows it and as the log tells its changes: a line
//! when it starts waiting for the extension, finds it, or waits for a promotion, never one per
//! pass. Under `outbox.database = '*'` a worker is quiet until it has found the extension. The
//! same for what the Redis thread finds of the servers: a line when the way it deduplicates
//! changes, one when `outbox.stream_trim_acked` cannot be honoured there, and one when trimming
//! by age starts failing.

use outbox_redis::publish::Found;
use outbox_redis::server::InUse;
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::settings::Settings;
use crate::pg::schema::Schema;
use crate::pg::worker;
use crate::shmem::{DatabaseShare, WorkerSlot, WorkerState};

/// What the worker is doing, and what it has said of it.
pub struct Status {
    index: usize,
    /// This database's name.
    database: String,
    /// Looking for the extension under '*', not yet announced in the log.
    probing: bool,
    state: WorkerState,
    slot: &'static WorkerSlot,
    /// What the Redis thread last found of the servers.
    found: Found,
}

impl Status {
    /// Worker `index` in `database`, starting; `probing` while it has not announced itself.
    pub fn new(index: usize, database: String, probing: bool, slot: &'static WorkerSlot) -> Status {
        Status {
            index,
            database,
            probing,
            state: WorkerState::Starting,
            slot,
            found: Found::default(),
        }
    }

    /// This database's name.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// Logs that the extension is gone and the worker stops, unless the worker never said it
    /// had found it.
    pub fn extension_gone(&self) {
        if !self.probing {
            log!(
                "outbox relay {}: the extension is gone from database {}; stopping",
                self.index,
                self.database
            );
        }
    }

    /// Whether the launcher gave the slot away (the database is no longer selected) or the
    /// database is paused for a statement that needs it to itself (`share` says); logs why.
    pub fn unwanted(&self, share: &DatabaseShare) -> bool {
        // SAFETY: reads this process's database.
        let mine = unsafe { pg_sys::MyDatabaseId.to_u32() };
        if self.slot.database() != mine {
            log!(
                "outbox relay {}: database {} is no longer in outbox.database; stopping",
                self.index,
                self.database
            );
            return true;
        }
        if share.is_paused(worker::now()) {
            log!(
                "outbox relay {}: leaving database {} for a DROP DATABASE, a rename, a copy or a move",
                self.index,
                self.database
            );
            return true;
        }
        false
    }

    /// Sets the state shown in the worker's slot and `pg_stat_activity`, logging what changed:
    /// the worker's start (with `settings`) once it has found the extension, and the schema
    /// it relays from once it leaves a wait for the extension or a promotion.
    pub fn set(&mut self, state: WorkerState, settings: &Settings, schema: Option<&Schema>) {
        if self.state == state {
            return;
        }
        let index = self.index;
        let found = matches!(
            state,
            WorkerState::Idle
                | WorkerState::Publishing
                | WorkerState::Backoff
                | WorkerState::Standby
        );
        if self.probing && found {
            // Found: the worker stays, and says so.
            self.probing = false;
            log!(
                "outbox relay {index} started: {}",
                settings.describe(&self.database)
            );
        }
        match state {
            WorkerState::WaitingForExtension if self.probing => {}
            WorkerState::WaitingForExtension => log!(
                "outbox relay {index}: waiting for CREATE EXTENSION outbox in database {}",
                self.database
            ),
            WorkerState::Standby => {
                log!("outbox relay {index}: server is a standby; relaying starts on promotion")
            }
            // Found the extension: at start, after waiting for it, or on promotion.
            _ if matches!(
                self.state,
                WorkerState::Starting | WorkerState::WaitingForExtension | WorkerState::Standby
            ) =>
            {
                if let Some(schema) = schema {
                    log!("outbox relay {index}: relaying from schema {schema}")
                }
            }
            _ => {}
        }
        self.state = state;
        self.slot.set_state(state);
        worker::report_activity(state == WorkerState::Publishing);
    }

    /// Whether the worker's connection deduplicates with IDMP.
    pub fn idmp(&self) -> bool {
        self.found.dedupe == Some(InUse::Idmp)
    }

    /// Whether the worker's connection deduplicates with IDMP, or may: before its first chunk,
    /// how it deduplicates is not known yet.
    pub fn may_use_idmp(&self) -> bool {
        !matches!(self.found.dedupe, Some(InUse::Markers | InUse::Off))
    }

    /// Takes note of what the Redis thread found of the servers: shows how the worker
    /// deduplicates, and logs what changed.
    pub fn found(&mut self, found: Found, settings: &Settings) {
        if found == self.found || found.dedupe.is_none() {
            return;
        }
        let index = self.index;
        if found.dedupe != self.found.dedupe || found.servers != self.found.servers {
            let how = match found.dedupe {
                Some(InUse::Idmp) => "deduplicating with Redis's IDMP",
                Some(InUse::Markers) => "deduplicating with markers",
                _ => "not deduplicating (outbox.dedupe = off)",
            };
            log!("outbox relay {index}: {how}; writing to {}", found.servers);
        }
        if settings.target.stream_trim_acked && !found.acked && found.servers != self.found.servers
        {
            log!(
                "outbox relay {index}: outbox.stream_trim_acked needs Redis 8.2 or later on every \
                 node, and the relay writes to {}; trimming without it",
                found.servers
            );
        }
        if let (Some(error), None) = (&found.trim_error, &self.found.trim_error) {
            log!("outbox relay {index}: trimming by outbox.stream_max_age failed: {error}");
        }
        self.slot.set_dedupe(found.dedupe);
        self.found = found;
    }

    /// Shows the worker stopped, and ends the process.
    pub fn exit(&mut self, settings: &Settings, schema: Option<&Schema>) -> ! {
        self.set(WorkerState::Stopped, settings, schema);
        worker::exit()
    }
}

//! Finding the extension in the relay's database: its schema, whether its objects are at the
//! version this library relays, and the statements prepared for them.

use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::sql;
use super::statements::Statements;
use crate::pg::schema::Schema;
use crate::pg::utf8;

/// The versions of the extension's objects this library's statements relay: its own, and the
/// earlier ones whose updates since changed nothing the relay reads (0.7.0 added a view, 0.8.0
/// a column of `outbox_workers`, 0.9.0 made `outbox_enqueue` run as its caller and gave
/// `outbox_status` a column).
const RELAYED_VERSIONS: [&str; 4] = ["0.6.0", "0.7.0", "0.8.0", env!("CARGO_PKG_VERSION")];

/// How long the worker trusts its last look-up of the extension while it is relaying.
const RECHECK: Duration = Duration::from_secs(1);

/// What the worker knows of the extension.
#[derive(Default)]
pub struct Extension {
    statements: Option<Statements>,
    checked_at: Option<Instant>,
    /// The objects' version when it is not the one this library relays (logged once).
    outdated_version: Option<String>,
    /// Whether the last look-up found no extension at all (rather than one at another version).
    missing: bool,
}

impl Extension {
    /// The schema of the extension being relayed.
    pub fn schema(&self) -> Option<&Schema> {
        self.statements.as_ref().map(|s| &s.schema)
    }

    /// Whether the last look-up found no extension in the database.
    pub fn is_missing(&self) -> bool {
        self.missing
    }

    /// The prepared statements, if the extension was found and is relayed.
    pub fn statements(&self) -> Option<&Statements> {
        self.statements.as_ref()
    }

    /// Looks the extension up, inside the current transaction, preparing its statements when it
    /// is new; `None` while it is missing or its objects are older than this library. While
    /// relaying, the catalog is consulted at most once a second: should the extension be dropped
    /// in between, the next statement fails and the worker restarts into waiting.
    pub fn find(&mut self, index: usize) -> Option<&Statements> {
        let fresh = self.checked_at.is_some_and(|at| at.elapsed() < RECHECK);
        if self.statements.is_some() && fresh {
            return self.statements.as_ref();
        }
        self.checked_at = Some(Instant::now());
        // SAFETY: a catalog lookup inside the current transaction.
        let oid = unsafe { pg_sys::get_extension_oid(c"outbox".as_ptr(), true) };
        self.missing = oid == pg_sys::InvalidOid;
        if self.missing {
            self.statements = None;
            return None;
        }
        if self.statements.as_ref().map(|s| s.extension) != Some(oid) {
            self.statements = None;
            let (schema, version) = extension_schema(oid)?;
            if !RELAYED_VERSIONS.contains(&version.as_str()) {
                // The library was upgraded and the SQL objects not yet: relaying resumes once
                // ALTER EXTENSION brings them to the version this library's statements need.
                if self.outdated_version.as_deref() != Some(version.as_str()) {
                    log!(
                        "outbox relay {index}: the extension's objects are at version {version}, \
                         this library relays version {}; run ALTER EXTENSION outbox UPDATE in \
                         this database",
                        env!("CARGO_PKG_VERSION"),
                    );
                    self.outdated_version = Some(version);
                }
                return None;
            }
            self.outdated_version = None;
            self.statements = Some(Statements::prepare(oid, schema));
        }
        self.statements.as_ref()
    }
}

/// The schema the extension with oid `oid` lives in, and its installed version (as UTF-8, for
/// comparing and logging: like a name, it is text in the database's encoding).
pub fn extension_schema(oid: pg_sys::Oid) -> Option<(Schema, String)> {
    let (namespace, version) = Spi::connect_mut(|client| {
        let row = client
            .update(sql::EXTENSION, Some(1), &[oid.into()])
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

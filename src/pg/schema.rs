//! The schema the extension lives in, as the relay's statements name it.
//!
//! A name in the catalog is bytes in the database's encoding: `"ausgänge"` in a LATIN1 database
//! holds the byte 0xE4, which is not UTF-8, so a name is never read into a Rust string (pgrx's
//! conversion panics on it, and the worker would panic on every start). Statements are
//! written as Rust strings with [`SCHEMA`] where the schema goes, and [`Schema::sql`] puts the
//! name there as PostgreSQL's `quote_identifier` quotes it, byte for byte. Log lines show the
//! name converted to UTF-8.

use std::ffi::{CStr, CString};
use std::fmt;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::pg::utf8;

/// Where a statement names the extension's schema. Neither SQL text nor a name can hold a NUL,
/// so this cannot be mistaken for either.
pub const SCHEMA: &str = "\0schema\0";

/// The extension's schema.
pub struct Schema {
    oid: pg_sys::Oid,
    /// The name quoted for SQL, in the database's encoding.
    quoted: Vec<u8>,
    /// The quoted name in UTF-8, for log lines (bytes with no UTF-8 form replaced).
    shown: String,
}

impl Schema {
    /// The schema with OID `namespace`, or `None` if it is gone. Runs inside a transaction.
    pub fn of(namespace: pg_sys::Oid) -> Option<Schema> {
        // SAFETY: catalog lookups inside the caller's transaction; both return NUL-terminated
        // strings palloc'd in the current memory context (or null for a schema that is gone),
        // copied before anything else runs.
        let quoted = unsafe {
            let name = pg_sys::get_namespace_name(namespace);
            if name.is_null() {
                return None;
            }
            CStr::from_ptr(pg_sys::quote_identifier(name))
                .to_bytes()
                .to_vec()
        };
        let shown = utf8::shown(&quoted);
        Some(Schema {
            oid: namespace,
            quoted,
            shown,
        })
    }

    pub fn oid(&self) -> pg_sys::Oid {
        self.oid
    }

    /// `statement` with each [`SCHEMA`] replaced by the quoted name: its text in the database's
    /// encoding, as SPI takes it.
    pub fn sql(&self, statement: &str) -> CString {
        CString::new(splice(statement, &self.quoted)).unwrap_or_else(|_| {
            error!(
                "outbox relay: a statement holds a NUL: {}",
                self.show(statement)
            )
        })
    }

    /// `statement` as a log line shows it, with the name in place of [`SCHEMA`].
    pub fn show(&self, statement: &str) -> String {
        statement.replace(SCHEMA, &self.shown)
    }
}

/// `statement` with each [`SCHEMA`] replaced by `quoted`, byte for byte.
fn splice(statement: &str, quoted: &[u8]) -> Vec<u8> {
    let mut text = Vec::with_capacity(statement.len() + quoted.len());
    let mut parts = statement.split(SCHEMA);
    if let Some(first) = parts.next() {
        text.extend_from_slice(first.as_bytes());
    }
    for part in parts {
        text.extend_from_slice(quoted);
        text.extend_from_slice(part.as_bytes());
    }
    text
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ausgaenge() -> Schema {
        Schema {
            oid: pg_sys::InvalidOid,
            quoted: b"\"ausg\xe4nge\"".to_vec(),
            shown: "\"ausgänge\"".to_string(),
        }
    }

    #[test]
    fn the_name_goes_in_byte_for_byte_wherever_the_statement_names_the_schema() {
        // Pure: `Schema::sql` adds only the C string, and PostgreSQL's error for a NUL.
        let quoted = &ausgaenge().quoted;
        let sql = splice(
            &format!("SELECT 1 FROM {SCHEMA}.outbox o, {SCHEMA}.outbox_dead d"),
            quoted,
        );
        assert_eq!(
            sql,
            b"SELECT 1 FROM \"ausg\xe4nge\".outbox o, \"ausg\xe4nge\".outbox_dead d"
        );
        assert_eq!(splice("SELECT 1", quoted), b"SELECT 1");
    }

    #[test]
    fn a_log_line_shows_the_name_in_utf8() {
        let schema = ausgaenge();
        assert_eq!(
            schema.show(&format!("TRUNCATE {SCHEMA}.outbox_00")),
            "TRUNCATE \"ausgänge\".outbox_00"
        );
        assert_eq!(schema.to_string(), "\"ausgänge\"");
    }
}

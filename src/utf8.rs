//! Text of the database's encoding as UTF-8, the encoding of everything that reaches Redis.
//! A database may be in any server encoding, `SQL_ASCII` (bytes, unchecked) included.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::PgTryBuilder;

/// Whether the current database's encoding is UTF-8 (its text needs no conversion).
pub fn database_is_utf8() -> bool {
    // SAFETY: reads the session's database encoding.
    unsafe { pg_sys::GetDatabaseEncoding() == pg_sys::pg_enc::PG_UTF8 as i32 }
}

/// Text of a database whose encoding is not UTF-8, as UTF-8 bytes: PostgreSQL's conversion,
/// whose error (an untranslatable character, or bytes that are not UTF-8 in a `SQL_ASCII`
/// database) is caught and returned.
pub fn to_utf8(bytes: &[u8]) -> Result<Vec<u8>, String> {
    PgTryBuilder::new(|| {
        // SAFETY: `bytes` is valid for its length; the result is either `bytes` itself or a
        // NUL-terminated copy palloc'd in the current memory context.
        unsafe {
            let source = bytes.as_ptr().cast::<std::ffi::c_char>();
            let result = pg_sys::pg_server_to_any(
                source,
                bytes.len() as i32,
                pg_sys::pg_enc::PG_UTF8 as i32,
            );
            if result.cast_const() == source {
                Ok(bytes.to_vec())
            } else {
                Ok(CStr::from_ptr(result).to_bytes().to_vec())
            }
        }
    })
    .catch_others(|error| Err(caught_message(error)))
    .execute()
}

fn caught_message(error: pg_sys::panic::CaughtError) -> String {
    match error {
        pg_sys::panic::CaughtError::PostgresError(report)
        | pg_sys::panic::CaughtError::ErrorReport(report)
        | pg_sys::panic::CaughtError::RustPanic {
            ereport: report, ..
        } => report.message().to_string(),
    }
}

//! Text of the database's encoding as UTF-8, the encoding of everything that reaches Redis.
//! A database may be in any server encoding, `SQL_ASCII` (bytes, unchecked) included.
//!
//! Text that has no UTF-8 form is reported, never raised: the conversion runs without an error
//! to catch (PostgreSQL's conversions can stop where they fail instead of raising), since
//! catching an error in the middle of a transaction, without the subtransaction PostgreSQL
//! would roll back, could leave whatever the failed call held behind.

use std::borrow::Cow;

use pgrx::pg_sys;

/// Why text of the database has no UTF-8 form; said after the text's name (`payload is not
/// UTF-8 ...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotUtf8 {
    /// Bytes of a `SQL_ASCII` database (or of a UTF-8 one, read unchecked) that are not UTF-8.
    Invalid(String),
    /// The database's encoding has no conversion to UTF-8.
    NoConversion,
    /// Too long to convert in memory.
    TooLong,
    /// A character, at this byte, has no equivalent in UTF-8.
    NoEquivalent(i32),
}

impl std::fmt::Display for NotUtf8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotUtf8::Invalid(why) => write!(f, "is not valid UTF-8: {why}"),
            NotUtf8::NoConversion => f.write_str(
                "cannot be converted to UTF-8: the database's encoding has no conversion to it",
            ),
            NotUtf8::TooLong => f.write_str("is too long to be converted to UTF-8"),
            NotUtf8::NoEquivalent(at) => write!(
                f,
                "cannot be converted to UTF-8: the character at byte {at} has no equivalent in it"
            ),
        }
    }
}

/// Whether the current database's encoding is UTF-8 (its text needs no conversion).
pub fn database_is_utf8() -> bool {
    // SAFETY: reads the session's database encoding.
    unsafe { pg_sys::GetDatabaseEncoding() == pg_sys::pg_enc::PG_UTF8 as i32 }
}

/// `bytes`, text of the current database, as UTF-8; else why it cannot be.
pub fn to_utf8(bytes: &[u8]) -> Result<Cow<'_, [u8]>, NotUtf8> {
    // SAFETY: reads the session's database encoding.
    let encoding = unsafe { pg_sys::GetDatabaseEncoding() };
    // Every server encoding keeps ASCII as it is.
    if encoding == pg_sys::pg_enc::PG_UTF8 as i32 || bytes.is_ascii() {
        return Ok(Cow::Borrowed(bytes));
    }
    if encoding == pg_sys::pg_enc::PG_SQL_ASCII as i32 {
        return match std::str::from_utf8(bytes) {
            Ok(_) => Ok(Cow::Borrowed(bytes)),
            Err(e) => Err(NotUtf8::Invalid(format!(
                "{e} (a SQL_ASCII database stores any bytes)"
            ))),
        };
    }
    convert(encoding, bytes).map(Cow::Owned)
}

/// Text of the database's encoding as UTF-8 for a log line or a comparison with our own text:
/// what has no UTF-8 form is replaced, never refused.
pub fn shown(bytes: &[u8]) -> String {
    match to_utf8(bytes) {
        Ok(utf8) => String::from_utf8_lossy(&utf8).into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

/// Converts with the database's default conversion to UTF-8, stopping at the first character
/// that has no equivalent.
fn convert(encoding: i32, bytes: &[u8]) -> Result<Vec<u8>, NotUtf8> {
    let utf8 = pg_sys::pg_enc::PG_UTF8 as i32;
    // SAFETY: a catalog lookup inside the caller's transaction.
    let proc = unsafe { pg_sys::FindDefaultConversionProc(encoding, utf8) };
    if proc == pg_sys::InvalidOid {
        return Err(NotUtf8::NoConversion);
    }
    let growth = pg_sys::MAX_CONVERSION_GROWTH as usize;
    let (Ok(length), Some(Ok(room))) = (
        i32::try_from(bytes.len()),
        bytes
            .len()
            .checked_mul(growth)
            .and_then(|n| n.checked_add(1))
            .map(i32::try_from),
    ) else {
        return Err(NotUtf8::TooLong);
    };
    let mut out = Vec::new();
    if out.try_reserve_exact(room as usize).is_err() {
        return Err(NotUtf8::TooLong);
    }
    out.resize(room as usize, 0);
    // SAFETY: `bytes` is read for `length` bytes and not written to; `out` has room for the
    // longest result PostgreSQL's conversions make (`MAX_CONVERSION_GROWTH` bytes per byte) and
    // its terminating NUL. With `noError` the conversion stops before a character it cannot
    // convert and says how many bytes it read.
    let read = unsafe {
        pg_sys::pg_do_encoding_conversion_buf(
            proc,
            encoding,
            utf8,
            bytes.as_ptr().cast_mut(),
            length,
            out.as_mut_ptr(),
            room,
            true,
        )
    };
    if read < length {
        return Err(NotUtf8::NoEquivalent(read));
    }
    let end = out.iter().position(|&b| b == 0).unwrap_or(out.len());
    out.truncate(end);
    // The room for the longest result is let go: a batch keeps its events' text until Redis
    // has answered.
    out.shrink_to_fit();
    Ok(out)
}

//! A time kept in shared memory: a `TimestampTz` in an atomic, with one value that stands for
//! SQL NULL.

/// `TimestampTz` value standing for SQL NULL in shared memory.
pub const NO_TIME: i64 = i64::MIN;

/// A time kept in shared memory, `None` for SQL NULL.
pub fn time_or_null(value: i64) -> Option<i64> {
    (value != NO_TIME).then_some(value)
}

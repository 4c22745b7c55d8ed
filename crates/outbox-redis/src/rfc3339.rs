//! An event's `created_at` as RFC 3339 text in UTC with microseconds, the way it reaches Redis:
//! written without `fmt` where it can be, since a chunk writes a thousand of them. Pure
//! functions, unit-tested without a server.

use std::fmt::Write as _;

use crate::resp::{put_digits, Args};

/// Seconds between 1970-01-01 and 2000-01-01, PostgreSQL's epoch.
const PG_EPOCH_UNIX_SECONDS: i64 = 946_684_800;

/// Formats a `TimestampTz` as RFC 3339 in UTC with microseconds: `2026-11-29T23:01:44.123456Z`.
pub fn rfc3339(timestamp: i64) -> String {
    let mut text = String::with_capacity(27);
    write_rfc3339(&mut text, timestamp);
    text
}

/// [`rfc3339`], appended to `out` without a string of its own.
pub fn write_rfc3339(out: &mut String, timestamp: i64) {
    let utc = Utc::of(timestamp);
    if utc.fits() {
        let mut text = *RFC3339_SHAPE;
        utc.fill(&mut text);
        out.push_str(std::str::from_utf8(&text).unwrap_or_default());
        return;
    }
    let _ = write!(
        out,
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        utc.year,
        utc.month,
        utc.day,
        utc.second_of_day / 3600,
        utc.second_of_day % 3600 / 60,
        utc.second_of_day % 60,
        utc.micros
    );
}

/// [`rfc3339`] as a command's argument, written in place.
pub fn rfc3339_arg(args: &mut Args<'_>, timestamp: i64) {
    let utc = Utc::of(timestamp);
    if utc.fits() {
        args.filled(RFC3339_SHAPE, |text| utc.fill(text));
    } else {
        args.arg(rfc3339(timestamp));
    }
}

/// The text of a timestamp in the years 0 to 9999, before its digits are written.
const RFC3339_SHAPE: &[u8; 27] = b"0000-00-00T00:00:00.000000Z";

/// A timestamp's date and time of day in UTC.
struct Utc {
    year: i64,
    month: u32,
    day: u32,
    second_of_day: i64,
    micros: i64,
}

impl Utc {
    fn of(timestamp: i64) -> Utc {
        // PostgreSQL's infinities are the ends of i64: saturated, they read as far years.
        let unix_micros = timestamp.saturating_add(PG_EPOCH_UNIX_SECONDS * 1_000_000);
        let seconds = unix_micros.div_euclid(1_000_000);
        let (year, month, day) = civil_from_days(seconds.div_euclid(86_400));
        Utc {
            year,
            month,
            day,
            second_of_day: seconds.rem_euclid(86_400),
            micros: unix_micros.rem_euclid(1_000_000),
        }
    }

    /// Whether the text has [`RFC3339_SHAPE`]'s: the years of every timestamp a relay sees,
    /// written without `fmt` since a chunk writes a thousand of them.
    fn fits(&self) -> bool {
        (0..=9999).contains(&self.year)
    }

    /// Writes the digits into `text`, a copy of [`RFC3339_SHAPE`].
    fn fill(&self, text: &mut [u8]) {
        put_digits(&mut text[0..4], self.year as u64);
        put_digits(&mut text[5..7], u64::from(self.month));
        put_digits(&mut text[8..10], u64::from(self.day));
        put_digits(&mut text[11..13], (self.second_of_day / 3600) as u64);
        put_digits(&mut text[14..16], (self.second_of_day % 3600 / 60) as u64);
        put_digits(&mut text[17..19], (self.second_of_day % 60) as u64);
        put_digits(&mut text[20..26], self.micros as u64);
    }
}

/// Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resp::Packed;

    #[test]
    fn formats_timestamps_in_utc() {
        assert_eq!(rfc3339(0), "2000-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(1), "2000-01-01T00:00:00.000001Z");
        assert_eq!(rfc3339(-1), "1999-12-31T23:59:59.999999Z");
        // 2024-02-29 12:34:56.789 UTC is 1709210096.789 Unix seconds.
        let leap = (1_709_210_096 - PG_EPOCH_UNIX_SECONDS) * 1_000_000 + 789_000;
        assert_eq!(rfc3339(leap), "2024-02-29T12:34:56.789000Z");
        // 2026-11-29 23:01:44 UTC is 1795993304 Unix seconds.
        let today = (1_795_993_304 - PG_EPOCH_UNIX_SECONDS) * 1_000_000;
        assert_eq!(rfc3339(today), "2026-11-29T23:01:44.000000Z");
        // Before year 0 and after 9999, as PostgreSQL allows: the sign and digits of `fmt`.
        let day = 86_400 * 1_000_000i64;
        let year_0 = -730_485 * day;
        assert_eq!(rfc3339(year_0), "0000-01-01T00:00:00.000000Z");
        assert_eq!(rfc3339(year_0 - 1), "-001-12-31T23:59:59.999999Z");
        let year_10000 = 2_921_940 * day;
        assert_eq!(rfc3339(year_10000 - 1), "9999-12-31T23:59:59.999999Z");
        assert_eq!(rfc3339(year_10000), "10000-01-01T00:00:00.000000Z");
        // 'infinity' and '-infinity' read as far years, and do not overflow.
        assert!(rfc3339(i64::MAX).starts_with("294247-01-10T04:00:54"));
        assert!(rfc3339(i64::MIN).starts_with('-'));
        for timestamp in [0, -1, year_0 - 1, year_10000 - 1, year_10000, i64::MAX] {
            let mut packed = Packed::default();
            packed.command(|args| rfc3339_arg(args, timestamp));
            let mut expected = redis::Cmd::new();
            expected.arg(rfc3339(timestamp));
            assert_eq!(packed.bytes(), expected.get_packed_command());
        }
    }
}

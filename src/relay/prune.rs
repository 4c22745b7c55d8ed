//! Pruning: published rows older than `outbox.retention` are deleted in id ranges, one short
//! transaction per range, oldest first. Unpublished rows are never touched.
//!
//! Ids grow with time, so the walk starts at the smallest id and stops at the first range that
//! holds a row published within the retention: everything past it is recent too. Each range is
//! an index range scan on the primary key, so a round costs what it deletes, not the size of
//! the history, and takes no lock beyond the rows it deletes.

use std::time::Duration;

use pgrx::prelude::*;

/// Ids covered by one delete, and so by one transaction.
pub const RANGE: i64 = 10_000;
/// Ranges one round may walk before it yields to relaying.
pub const MAX_RANGES_PER_ROUND: usize = 100;

/// The id span to walk: `[min(id), max(id)]` of the table, or `None` when it is empty.
pub fn id_span(schema: &str) -> Option<(i64, i64)> {
    let s = spi::quote_identifier(schema);
    Spi::get_two::<i64, i64>(&format!("SELECT min(id), max(id) FROM {s}.outbox"))
        .ok()
        .and_then(|(lo, hi)| Some((lo?, hi?)))
}

/// Deletes the expired published rows with ids in `[from, from + RANGE)`. Returns the number
/// deleted and whether the range holds a row published within the retention (the walk's end).
pub fn prune_range(schema: &str, from: i64, retention: Duration) -> (i64, bool) {
    let s = spi::quote_identifier(schema);
    let sql = format!(
        "WITH cutoff AS (SELECT now() - $3 * interval '1 second' AS at), \
              doomed AS (DELETE FROM {s}.outbox o USING cutoff \
                         WHERE o.id >= $1 AND o.id < $2 AND o.published_at < cutoff.at \
                         RETURNING 1) \
         SELECT (SELECT count(*) FROM doomed), \
                EXISTS (SELECT 1 FROM {s}.outbox o, cutoff \
                        WHERE o.id >= $1 AND o.id < $2 AND o.published_at >= cutoff.at)"
    );
    let to = from.saturating_add(RANGE);
    let seconds = retention.as_secs_f64();
    Spi::connect_mut(|client| {
        let table = client
            .update(
                sql.as_str(),
                Some(1),
                &[from.into(), to.into(), seconds.into()],
            )
            .unwrap_or_else(|e| error!("outbox relay: pruning failed: {e}"))
            .first();
        let deleted = table.get::<i64>(1).ok().flatten().unwrap_or_default();
        let reached_recent = table.get::<bool>(2).ok().flatten().unwrap_or(true);
        (deleted, reached_recent)
    })
}

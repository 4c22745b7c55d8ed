//! `BENCH_ONLY=keys-workers`: two relay workers beside one, on a backlog over 200 keys, batch
//! 1000, dedupe on. The same drain with one worker is the baseline; the server restarts before
//! every run, for the worker count to change, and the two take turns, so that the worker count is
//! the only difference.

use crate::common::{Pg, Redis};
use crate::drain::{alternating, events_per_second, BACKLOG};
use crate::harness::{fresh_table, set_and_wait};
use crate::report::{median, paired_ratio_each, Report};

/// Two workers beside one: 100,000 events over 200 keys, batch 1000, dedupe on.
pub(crate) fn keyed_workers(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let n = BACKLOG / 2;
    set_and_wait(
        pg,
        &[("outbox.batch_size", "1000"), ("outbox.dedupe", "on")],
        &["batch_size=1000 ", "dedupe=on "],
    );
    let runs = alternating(["one", "two"], |side| {
        let workers = if side == "one" { 1 } else { 2 };
        pg.set(&[("outbox.workers", &workers.to_string())]);
        pg.restart();
        pg.wait_for_workers(workers);
        fresh_table(&mut pg.connect());
        events_per_second(
            pg,
            redis,
            "keyed",
            "SELECT outbox_enqueue('keyed', jsonb_build_object('account_id', g), 'key-' || (g % 200)) \
             FROM generate_series(1::bigint, $1) g",
            n,
        )
    });
    pg.set(&[("outbox.workers", "1")]);
    pg.restart();
    pg.wait_for_workers(1);
    for (side, group) in [
        ("one", "1 worker, 200 keys"),
        ("two", "2 workers, 200 keys"),
    ] {
        let rate = median(runs[side].clone());
        report.bar("drain", group, "relay, dedupe on", rate);
    }
    report.row(
        "relay, batch 1000, dedupe on, 200 keys: two workers",
        format!("{:.0} events/s", median(runs["two"].clone())),
        format!("{:.0} events/s (one worker)", median(runs["one"].clone())),
        paired_ratio_each(&runs["two"], &runs["one"]),
        ">= 1 (not slower)",
    );
}

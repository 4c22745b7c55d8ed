//! `BENCH_ONLY=keys-delayed`: whether delayed events slow the relay's claims of due ones. Drains
//! beside a million events due in a day, against the same drains on the emptied table just
//! before: only the delayed rows differ.

use crate::common::{Pg, Redis};
use crate::drain::{events_per_second, BACKLOG};
use crate::harness::{fresh_table, set_and_wait};
use crate::report::{median, Report};

/// A drain of 100,000 events beside a million delayed ones (due in a day), against the same
/// drain on the emptied table: three each, the delayed ones added in between.
pub(crate) fn beside_delayed(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let n = BACKLOG / 2;
    let mut client = pg.connect();
    set_and_wait(pg, &[("outbox.batch_size", "1000")], &["batch_size=1000 "]);
    let drain = |pg: &Pg| {
        events_per_second(
            pg,
            redis,
            "due",
            "SELECT outbox_enqueue('due', jsonb_build_object('account_id', g)) \
             FROM generate_series(1::bigint, $1) g",
            n,
        )
    };
    fresh_table(&mut client);
    let alone: Vec<f64> = (0..3).map(|_| drain(pg)).collect();
    fresh_table(&mut client);
    client
        .batch_execute(
            "SELECT outbox_enqueue('later', jsonb_build_object('n', g), deliver_after => '1 day') \
             FROM generate_series(1, 1000000) g",
        )
        .unwrap();
    client.batch_execute("VACUUM ANALYZE outbox").unwrap();
    let beside: Vec<f64> = (0..3).map(|_| drain(pg)).collect();
    fresh_table(&mut client);
    println!("  drains alone {alone:?}, beside a million delayed {beside:?}");
    report.row(
        "relay, batch 1000, dedupe on, beside 1,000,000 delayed events",
        format!("{:.0} events/s", median(beside.clone())),
        format!("{:.0} events/s (no delayed event)", median(alone.clone())),
        format!("{:.3}", median(beside) / median(alone)),
        ">= 0.9 (within 10%)",
    );
}

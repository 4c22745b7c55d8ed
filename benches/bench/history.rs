//! `BENCH_ONLY=history`: whether published rows kept in the table slow the relay. A drain with a
//! million published rows kept (retention off) against the same drain on the emptied table,
//! each right after a checkpoint, in pairs whose order alternates, so that neither drain always
//! runs second; only the kept rows differ.

use crate::common::{Client, Pg, Redis};
use crate::drain::{drain_seconds, BACKLOG, RELAY_REPS};
use crate::harness::{fresh_table, set_and_wait};
use crate::report::{median, paired_ratio, Report};

pub(crate) fn history(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    println!("4. history independence (batch 1000)");
    set_and_wait(
        pg,
        &[("outbox.batch_size", "1000"), ("outbox.retention", "0")],
        &["batch_size=1000 ", "retention=off "],
    );
    let mut client = pg.connect();
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for rep in 0..RELAY_REPS {
        // Every other repetition drains the emptied table first, so that neither drain always
        // runs second.
        let empty_first = rep % 2 == 1;
        let mut empty = 0.0;
        if empty_first {
            empty = drain_after_checkpoint(&mut client, pg, redis);
        }
        fresh_table(&mut client);
        client
            .batch_execute(
                "INSERT INTO outbox (topic, payload, published_at) \
                 SELECT 'old', jsonb_build_object('account_id', g), now() FROM generate_series(1, 1000000) g",
            )
            .unwrap();
        client.batch_execute("VACUUM ANALYZE outbox").unwrap();
        // The million rows' WAL would otherwise start a checkpoint during the drain.
        client.batch_execute("CHECKPOINT").unwrap();
        let full = drain_seconds(pg, redis, "history", BACKLOG, false);
        if !empty_first {
            empty = drain_after_checkpoint(&mut client, pg, redis);
        }
        with.push(BACKLOG as f64 / full);
        without.push(BACKLOG as f64 / empty);
        println!("  drain with history {full:.2} s, on the emptied table {empty:.2} s");
    }
    report.row(
        "relay with 1M published rows kept",
        format!("{:.0} events/s", median(with.clone())),
        format!("{:.0} events/s (empty table)", median(without.clone())),
        format!("{:.3}", paired_ratio(&with, &without)),
        ">= 0.9",
    );
    client.batch_execute("TRUNCATE outbox").unwrap();
}

/// Drains a backlog on the emptied table, from the same starting point as a drain with history.
fn drain_after_checkpoint(client: &mut Client, pg: &Pg, redis: &Redis) -> f64 {
    fresh_table(client);
    client.batch_execute("CHECKPOINT").unwrap();
    drain_seconds(pg, redis, "history", BACKLOG, false)
}

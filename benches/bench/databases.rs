//! `BENCH_ONLY=databases`: what relaying other databases costs one. Its drain with two idle
//! databases relayed too (three workers) against its drain as the only database relayed (one
//! worker), the two taking turns in the same run: only the idle databases' workers differ.

use crate::common::{Pg, Redis};
use crate::drain::{alternating, drain_seconds, BACKLOG};
use crate::harness::{relay_databases, set_and_wait};
use crate::report::{median, paired_ratio, Report};

/// One database's drain alone, and beside two idle databases that are relayed too, alternating.
pub(crate) fn idle_databases(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    println!("8. one database's relay beside two idle ones ({BACKLOG} events)");
    for name in ["idle_one", "idle_two"] {
        pg.connect()
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap();
        pg.connect_to(name)
            .batch_execute("CREATE EXTENSION outbox")
            .unwrap();
    }
    set_and_wait(
        pg,
        &[("outbox.batch_size", "1000"), ("outbox.dedupe", "on")],
        &["batch_size=1000 ", "dedupe=on "],
    );
    let runs = alternating(["alone", "beside"], |side| {
        let (list, workers) = if side == "alone" {
            ("postgres", 1)
        } else {
            ("postgres, idle_one, idle_two", 3)
        };
        relay_databases(pg, list, workers);
        BACKLOG as f64 / drain_seconds(pg, redis, "databases", BACKLOG, true)
    });
    pg.set(&[("outbox.database", "postgres")]);
    report.row(
        "relay, batch 1000, dedupe on, two idle databases relayed too",
        format!("{:.0} events/s", median(runs["beside"].clone())),
        format!(
            "{:.0} events/s (this database alone)",
            median(runs["alone"].clone())
        ),
        format!("{:.3}", paired_ratio(&runs["beside"], &runs["alone"])),
        ">= 0.95 (unchanged)",
    );
}

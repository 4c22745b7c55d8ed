//! `BENCH_ONLY=keys-held`: whether a key held back slows the others. 4 clients write 1,000
//! events/s over 199 keys for 20 s while a 200th key waits behind an event Redis rejects (its
//! stream key holds a string), against the same load with no key held back, run just before on
//! the same emptied table.

use std::time::Duration;

use crate::common::{wait_until, Pg, Redis};
use crate::harness::{fresh_table, set_and_wait};
use crate::load::latency_under_load_with;
use crate::report::{percentile, Report};

/// 199 keys beside one held back: 1,000 events/s from 4 clients over keys 1..199, with and
/// without key-0 waiting behind an event Redis rejects.
pub(crate) fn held_key_latency(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    set_and_wait(pg, &[("outbox.batch_size", "100")], &["batch_size=100 "]);
    let mut client = pg.connect();
    fresh_table(&mut client);
    let others = Some("'key-' || (1 + floor(random() * 199))::int");
    let (free, _) = latency_under_load_with(pg, redis, 1_000, 20, others);
    redis.query::<()>(redis::cmd("SET").arg("broken").arg("x"));
    client
        .batch_execute(
            "SELECT outbox_enqueue('broken', '{}', 'key-0'); \
             SELECT outbox_enqueue('load1000', '{\"t\": 0}', 'key-0') FROM generate_series(1, 10)",
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || client
            .query_one("SELECT count(*) FROM outbox_blocked", &[])
            .unwrap()
            .get::<_, i64>(0)
            == 1),
        "the rejected event did not show in outbox_blocked"
    );
    let (held, enqueued) = latency_under_load_with(pg, redis, 1_000, 20, others);
    let waiting: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE key = 'key-0' AND published_at IS NULL",
            &[],
        )
        .unwrap()
        .get(0);
    client
        .batch_execute("DELETE FROM outbox WHERE key = 'key-0'")
        .unwrap();
    redis.query::<()>(redis::cmd("DEL").arg("broken"));
    report.row(
        "latency p99, 199 keys beside one held back by a rejected event, 1000 events/s",
        format!("{:.2} ms", percentile(&held, 0.99)),
        format!("{:.2} ms (no key held back)", percentile(&free, 0.99)),
        format!("{:.2}", percentile(&held, 0.99) / percentile(&free, 0.99)),
        "< 10 ms",
    );
    report.row(
        "latency p50, 199 keys beside one held back",
        format!("{:.2} ms", percentile(&held, 0.5)),
        format!(
            "{:.2} ms (no key held back); {enqueued} events, {waiting} of key-0 still waiting",
            percentile(&free, 0.5)
        ),
        format!("{:.2}", percentile(&held, 0.5) / percentile(&free, 0.5)),
        "",
    );
}

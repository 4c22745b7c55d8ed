//! `BENCH_ONLY=keys-spill`: whether a rejected topic's held backlog slows a healthy topic. The
//! healthy topic's latency at 1,000 events/s from 4 clients for 20 s beside 20,000 events of a
//! topic Redis rejects (its stream key holds a string), all but the first held behind the first;
//! against the same load with no held backlog, run just before on the same emptied table.

use std::time::{Duration, Instant};

use crate::common::{wait_until, Client, Pg, Redis};
use crate::harness::{fresh_table, set_and_wait};
use crate::load::latency_under_load;
use crate::report::{percentile, Report};

/// A healthy topic beside a rejected one's held backlog: 1,000 events/s from 4 clients for 20 s,
/// with and without 20,000 events of a topic Redis rejects (its stream key holds a string), all
/// but the first waiting behind the first, so that claims that stepped over the waiting events
/// in every pass would show in the healthy topic's latency.
pub(crate) fn beside_held_backlog(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    const HELD: i64 = 20_000;
    // The rejected events stay rejected, never buried, for the whole run.
    set_and_wait(
        pg,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.max_attempts", "1000"),
        ],
        &["batch_size=100 ", "max_attempts=1000 "],
    );
    let mut client = pg.connect();
    fresh_table(&mut client);
    let (alone, _) = latency_under_load(pg, redis, 1_000, 20);
    redis.query::<()>(redis::cmd("SET").arg("rejected").arg("x"));
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('rejected', jsonb_build_object('n', g)) \
             FROM generate_series(1, {HELD}) g"
        ))
        .unwrap();
    let count =
        |client: &mut Client, sql: &str| -> i64 { client.query_one(sql, &[]).unwrap().get(0) };
    assert!(
        wait_until(Duration::from_secs(10), || count(
            &mut client,
            "SELECT count(*) FROM outbox_blocked"
        ) > 0),
        "the rejected topic's first events were not rejected"
    );
    // The events behind the rejected ones leave the fresh ones once held. A build that does not
    // hold them never gets there: it is measured as it stands after the wait.
    let fresh = "SELECT count(*) FROM outbox \
                 WHERE topic = 'rejected' AND published_at IS NULL AND next_attempt_at IS NULL";
    let started = Instant::now();
    let held = wait_until(Duration::from_secs(30), || count(&mut client, fresh) == 0);
    println!(
        "  {HELD} rejected events: {} ({:.1} s)",
        if held { "held" } else { "not held" },
        started.elapsed().as_secs_f64()
    );
    let (beside, enqueued) = latency_under_load(pg, redis, 1_000, 20);
    let waiting = count(
        &mut client,
        "SELECT count(*) FROM outbox WHERE topic = 'rejected' AND published_at IS NULL",
    );
    client
        .batch_execute("DELETE FROM outbox WHERE topic = 'rejected'")
        .unwrap();
    redis.query::<()>(redis::cmd("DEL").arg("rejected"));
    set_and_wait(pg, &[("outbox.max_attempts", "10")], &["max_attempts=10 "]);
    for (name, p, target) in [("p50", 0.5, ""), ("p99", 0.99, "< 20 ms")] {
        report.row(
            &format!(
                "latency {name}, a healthy topic at 1000 events/s beside {HELD} held events of a rejected topic"
            ),
            format!("{:.2} ms", percentile(&beside, p)),
            format!(
                "{:.2} ms (no held backlog); {enqueued} events, {waiting} rejected still waiting",
                percentile(&alone, p)
            ),
            format!("{:.2}", percentile(&beside, p) / percentile(&alone, p)),
            target,
        );
    }
}

//! `BENCH_ONLY=cluster`: the relay against a Redis Cluster (three primaries, each with a
//! replica) beside the single node: the same backlog over 50 topics, so that it spreads over the
//! cluster's slots, batch 1000, dedupe on, the two taking turns in the same run. Only the Redis
//! side differs, so the ratio is what the cluster costs the relay.

use std::time::{Duration, Instant};

use crate::common::topology::Cluster;
use crate::common::{wait_until, Pg, Redis};
use crate::drain::{alternating, BACKLOG};
use crate::harness::{fresh_table, set_and_wait};
use crate::report::{median, paired_ratio, Report};

/// The relay against a Redis Cluster beside the single node, alternating: the same backlog over
/// 50 topics (so that it spreads over the cluster's slots), batch 1000, dedupe on.
pub(crate) fn cluster_relay(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let n = BACKLOG / 2;
    println!("7. relay to a Redis Cluster ({n} events over 50 topics)");
    let cluster = Cluster::start(3);
    let (single, seeds) = (redis.url(), cluster.urls());
    let runs = alternating(["one node", "cluster"], |side| {
        let (url, mode) = if side == "cluster" {
            (seeds.as_str(), "cluster")
        } else {
            (single.as_str(), "standalone")
        };
        let expect = format!("redis_mode={mode} ");
        set_and_wait(
            pg,
            &[
                ("outbox.redis_url", url),
                ("outbox.redis_mode", mode),
                ("outbox.batch_size", "1000"),
                ("outbox.dedupe", "on"),
            ],
            &[&expect, "batch_size=1000 ", "dedupe=on "],
        );
        let secs = drain_spread_seconds(pg, n, 50);
        // Empty the streams for the next run: replicas refuse FLUSHALL, primaries take it.
        let _ = redis::cmd("FLUSHALL").query::<()>(&mut redis.conn());
        for node in &cluster.nodes {
            let _ = node.query::<()>(&redis::cmd("FLUSHALL"));
        }
        n as f64 / secs
    });
    let on_cluster = median(runs["cluster"].clone());
    let on_one = median(runs["one node"].clone());
    report.row(
        "relay to a Redis Cluster, batch 1000, dedupe on, 50 topics",
        format!("{on_cluster:.0} events/s (3 primaries, each with a replica)"),
        format!("{on_one:.0} events/s (one node)"),
        format!("{:.3}", paired_ratio(&runs["cluster"], &runs["one node"])),
        "",
    );
    set_and_wait(
        pg,
        &[
            ("outbox.redis_url", single.as_str()),
            ("outbox.redis_mode", "standalone"),
        ],
        &["redis_mode=standalone "],
    );
}

/// Commits `n` events spread over `topics` topics in one transaction, then times until the
/// relay has marked them all.
fn drain_spread_seconds(pg: &Pg, n: i64, topics: i64) -> f64 {
    let mut client = pg.connect();
    fresh_table(&mut client);
    client
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    client
        .execute(
            "SELECT outbox_enqueue('t' || (g % $2), jsonb_build_object('account_id', g, 'email', 'user' || g || '@example.com')) \
             FROM generate_series(1::bigint, $1) g",
            &[&n, &topics],
        )
        .unwrap();
    let committed = Instant::now();
    assert!(
        wait_until(Duration::from_secs(600), || pg.pending() == 0),
        "the backlog did not drain"
    );
    committed.elapsed().as_secs_f64()
}

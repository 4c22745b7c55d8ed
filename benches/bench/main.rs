//! `make bench`: what the outbox costs and how fast it relays, each figure beside its baseline
//! from the same run. Starts its own PostgreSQL (extension preloaded) and redis-server, prints
//! one Markdown table and writes it to BENCHMARKS.md. It reports; it never fails on a figure.
//!
//! Run through `scripts/bench.sh` (`cargo bench --bench bench` once a release build of the
//! extension is installed). It lives in `benches/` with `harness = false`, so `cargo test`
//! does not build it.
//!
//! This file starts the servers, runs the cases `BENCH_ONLY` names (all by default) in a fixed
//! order and writes the report. Each case is a module of its own, whose doc says what it
//! measures and against what baseline; what they share is in `report` (the table and its
//! statistics), `harness` (settings, databases, the table), `pgbench`, `drain` (timed drains)
//! and `load` (latency under a steady load).

#[path = "../../tests/common/mod.rs"]
mod common;

mod drain;
mod harness;
mod load;
mod pgbench;
mod report;

mod cluster;
mod databases;
mod history;
mod idmp;
mod keys;
mod latency;
mod relay;
mod soak;
mod worker;
mod write;

use std::thread;
use std::time::Instant;

use common::{Pg, Redis};
use drain::{BACKLOG, RELAY_REPS};
use harness::set_and_wait;
use report::Report;
use write::{PGBENCH_SECONDS, WRITE_PAIRS, WRITE_REPS};

use cluster::cluster_relay;
use databases::idle_databases;
use history::history;
use idmp::idmp_against_markers;
use keys::keys;
use latency::{latency, latency_at_5000};
use relay::relay_throughput;
use soak::soak;
use worker::worker_resources;
use write::write_cost;

fn main() {
    let redis = Redis::start();
    let url = redis.url();
    let mut pg = Pg::start(&[("outbox.redis_url", url.as_str())]);
    pg.with_extension();
    pg.wait_for_workers(1);
    let mut report = Report { rows: Vec::new() };
    let started = Instant::now();
    let server_version: String = pg
        .connect()
        .query_one("SHOW server_version", &[])
        .unwrap()
        .get(0);

    // BENCH_ONLY=write,relay,latency,history,worker,soak,cluster,databases,idmp,keys runs a subset.
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let wanted = |part: &str| only.is_empty() || only.split(',').any(|p| p == part);
    if wanted("write") {
        write_cost(&pg, &redis, &mut report);
    }
    if wanted("relay") {
        relay_throughput(&mut pg, &redis, &mut report);
    }
    if wanted("latency") {
        set_and_wait(
            &mut pg,
            &[("outbox.batch_size", "100"), ("outbox.dedupe", "on")],
            &["batch_size=100 ", "dedupe=on "],
        );
        latency(&pg, &redis, &mut report);
        latency_at_5000(&pg, &redis, &mut report);
    }
    if wanted("history") {
        history(&mut pg, &redis, &mut report);
    }
    if wanted("worker") {
        worker_resources(&pg, &redis, &mut report);
    }
    if wanted("soak") {
        soak(&mut pg, &redis, &mut report);
    }
    if wanted("cluster") {
        cluster_relay(&mut pg, &redis, &mut report);
    }
    if wanted("databases") {
        idle_databases(&mut pg, &redis, &mut report);
    }
    if wanted("idmp") {
        idmp_against_markers(&mut pg, &redis, &mut report);
    }
    // keys-write, keys-trace, keys-workers, keys-held, keys-delayed and keys-spill run one
    // case of it.
    let keys_parts = |part: &str| wanted("keys") || wanted(part);
    if [
        "keys",
        "keys-write",
        "keys-trace",
        "keys-workers",
        "keys-held",
        "keys-delayed",
        "keys-spill",
    ]
    .iter()
    .any(|part| wanted(part))
    {
        keys(&mut pg, &redis, &mut report, &keys_parts);
    }

    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        .unwrap_or_default();
    let table = report.markdown();
    let text = format!(
        "# Benchmarks\n\nProduced by `make bench` on {} cores ({cpu}), in {:.0} s. Write cases: medians of {WRITE_REPS} runs of {PGBENCH_SECONDS} s each, {WRITE_PAIRS} pairs of runs for those with a target, \
         which are also counted until every event they enqueued was in Redis; \
         relay cases: medians of {RELAY_REPS} drains of {BACKLOG} events; history: medians of {RELAY_REPS} pairs of drains; latency: one run of 5000 events at 500 events/s; \
         worker: one drain of each size and one idle period. \
         PostgreSQL {server_version} with fsync off, extension release build, one relay worker, Redis on the same machine. \
         Ratios compare each figure with the baseline measured in the same run; a throughput ratio is the median of the ratios of \
         runs made next to each other (a write case and the hand-written insert; a relay case, the other dedupe setting and \
         the ceiling; a drain with history and one on the emptied table).\n\n{table}",
        thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        started.elapsed().as_secs_f64()
    );
    println!("\n{table}");
    std::fs::write("BENCHMARKS.md", text).expect("cannot write BENCHMARKS.md");
    println!("written to BENCHMARKS.md");
}

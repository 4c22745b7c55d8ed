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

mod builds;
mod charts;
mod cloudevents;
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

use builds::builds;
use cloudevents::cloudevents_against_fields;
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
    let mut report = Report {
        rows: Vec::new(),
        bars: Vec::new(),
    };
    let started = Instant::now();
    let server_version: String = pg
        .connect()
        .query_one("SHOW server_version", &[])
        .unwrap()
        .get(0);

    // BENCH_ONLY=write,relay,latency,history,worker,soak,cluster,databases,idmp,cloudevents,keys,builds runs a
    // subset.
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
    if wanted("cloudevents") {
        cloudevents_against_fields(&mut pg, &redis, &mut report);
    }
    // Only when named: it needs another build (OUTBOX_BENCH_OTHER) and restarts the server.
    if only.split(',').any(|p| p == "builds") {
        builds(&mut pg, &redis, &mut report);
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
        "# Benchmarks\n\n\
         What the outbox costs a writing transaction and how fast the relay publishes, each figure beside \
         a baseline measured in the same run. `make bench` writes this file (`BENCH_ONLY=relay make bench`, \
         or `write`, `latency`, `history`, `worker`, `soak`, `cluster`, `databases`, `idmp`, `cloudevents`, `keys`, or one \
         of `keys-write`, `keys-trace`, `keys-workers`, `keys-held`, `keys-delayed`, `keys-spill`, \
         comma-separated, runs a subset; `builds`, run only when named, measures this build against another \
         that `OUTBOX_BENCH_OTHER` names). It reports; it never fails on a figure. Earlier runs are in \
         `git log -p BENCHMARKS.md`.\n\n\
         ## The machine\n\n\
         {cores} cores ({cpu}), PostgreSQL {server_version} with `fsync = off` (`on` in the write cases, as a \
         production server writes), the extension's release build, \
         one relay worker unless a case says otherwise, and redis-server on the same machine; the IDMP case \
         uses Redis 8.6. This run: {run}, {seconds:.0} s.\n\n\
         ## Method\n\n\
         `make bench` starts its own PostgreSQL, with the extension preloaded, and redis-server, and \
         measures each case against a baseline in the same run:\n\n\
         - **Write**: pgbench, with `fsync = on`, a business transaction (one row into `accounts`) at 1 and \
         8 clients with `outbox_enqueue` (with the defaults and nobody listening, with a session listening, \
         and with `outbox.notify_channel` empty), against the same transaction with a hand-written `INSERT INTO outbox` of the \
         same row: the least any outbox costs. Medians of {WRITE_REPS} runs of {PGBENCH_SECONDS} s; the targeted cases run \
         {WRITE_PAIRS} pairs, are also counted until the relay has published every event they enqueued (so that the \
         relay's work is not left out), and are compared once more with both transactions drawn at random \
         in one pgbench run at one client, where both meet the machine at the same moments.\n\
         - **Relay**: drains of a backlog of {BACKLOG} events committed at once, timed until Redis holds all \
         of it, {RELAY_REPS} of each side. The baseline is the database's ceiling: a procedure in the server that \
         claims and marks the same rows with the relay's query, batch size and session settings, one \
         transaction per batch, with no client round trip and no Redis.\n\
         - **Latency**: from its commit to an `XREAD` reader, 5000 events at 500 events/s from one \
         client; then from its statement's start with 4 pgbench clients at 500, 2000 and 5000 events/s \
         (the 5000 against the 500).\n\
         - **Soak**: five minutes at each of 2000 and 10000 events/s (4 pgbench clients, retention 5 s, \
         default autovacuum), the table's size against its live rows; then the soaked table and a fresh \
         one in a second database are drained in turns.\n\
         - **Keys**: a keyed write with headers (and one whose `traceparent` comes from a sqlcommenter \
         comment) against a hand-written insert of the same columns; 200 keys drained by two workers \
         against one; a key held back by an event Redis rejects beside 199 free keys; a drain beside a \
         million delayed events; a healthy topic beside the held events of a rejected one.\n\
         - **Cluster**, **databases**, **IDMP**, **history**, **worker**: a 3-primary, 3-replica Redis \
         Cluster against one node; one database's drain with two idle databases relayed too, against it \
         alone; IDMP against markers on Redis 8.6, and Redis's memory per event; a drain beside a million \
         published rows kept, against the emptied table; the worker's memory over a drain against one a \
         quarter the size, and its CPU when idle.\n\
         - **Builds** (only when named): this build against another of different code, in turns, the \
         server restarted with a side's library before its turn: `outbox_enqueue` 200000 times in one \
         statement, the drain of those events at batch 1000, and the worker's CPU per event over it.\n\n\
         **Why pairs and ratios.** On a shared machine with few cores, which PostgreSQL, the relay's two \
         threads, redis-server and pgbench all use, figures move by up to a quarter between runs, and runs \
         of one case differ by up to 40% within minutes. So the two sides of a comparison run in turns, \
         each next to the other (the side going first alternating), and a throughput ratio is the median \
         of the ratios of those pairs, not the ratio of two medians that may come from runs minutes apart: \
         it need not be the ratio of the two figures beside it. The targeted write cases show the middle \
         half of the pair ratios, the relay cases every pair's ratio. Compare ratios, not figures, and only \
         within one table.\n\n\
         ## Figures\n\n{table}\n\
         ## Charts\n\n\
         `make bench` draws these from the cases it runs (`latency`; `relay` and `keys-workers`):\n\n\
         ![Latency percentiles against the event rate](docs/bench/latency.svg)\n\n\
         ![Drain rate against the batch size and the number of workers](docs/bench/drain.svg)\n",
        cores = thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        run = if only.is_empty() {
            "every case".to_string()
        } else {
            format!("`BENCH_ONLY={only}`")
        },
        seconds = started.elapsed().as_secs_f64()
    );
    println!("\n{table}");
    std::fs::write("BENCHMARKS.md", text).expect("cannot write BENCHMARKS.md");
    println!("written to BENCHMARKS.md");
    for chart in charts::draw(&report.bars, std::path::Path::new("docs/bench")) {
        println!("drawn: {chart}");
    }
}

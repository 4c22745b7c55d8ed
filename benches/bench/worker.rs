//! `BENCH_ONLY=worker`: the relay worker's own resources. Its peak private resident memory over a
//! drain against that over a drain a quarter the size, by the same worker in the same run: a
//! ratio near 1 means the worker does not hold the backlog in memory. And its CPU over 10 idle
//! seconds, which has no baseline beside its poll interval: it should be near zero.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::{Pg, Redis};
use crate::drain::{drain_seconds, BACKLOG};
use crate::harness::cpu_ticks;
use crate::report::Report;

pub(crate) fn worker_resources(pg: &Pg, redis: &Redis, report: &mut Report) {
    println!("5. worker memory and idle CPU");
    let small = peak_rss_during_drain(pg, redis, BACKLOG / 4);
    let large = peak_rss_during_drain(pg, redis, BACKLOG);
    report.row(
        &format!("worker peak private RSS, {BACKLOG}-event drain"),
        format!("{:.1} MiB", large as f64 / 1024.0),
        format!(
            "{:.1} MiB ({}-event drain)",
            small as f64 / 1024.0,
            BACKLOG / 4
        ),
        format!("{:.2}", large as f64 / small as f64),
        "flat in backlog size",
    );
    let pid = worker_pid(pg);
    thread::sleep(Duration::from_secs(1));
    let (t0, c0) = (Instant::now(), cpu_ticks(pid));
    thread::sleep(Duration::from_secs(10));
    // /proc/<pid>/stat counts in clock ticks: USER_HZ, 100 on Linux.
    let ticks_per_second = 100.0;
    let cpu = (cpu_ticks(pid) - c0) as f64 / ticks_per_second / t0.elapsed().as_secs_f64() * 100.0;
    report.row(
        "worker CPU while idle 10 s",
        format!("{cpu:.2} %"),
        "poll every 1 s".into(),
        String::new(),
        "",
    );
}

/// Peak private resident memory of the worker while it drains `n` events.
fn peak_rss_during_drain(pg: &Pg, redis: &Redis, n: i64) -> u64 {
    let pid = worker_pid(pg);
    let (stop, stopped) = mpsc::channel::<()>();
    let sampler = thread::spawn(move || {
        let mut peak = 0;
        while stopped.try_recv().is_err() {
            // Private memory: VmRSS would also count the shared buffers the worker touched.
            peak = peak.max(proc_status_kb(pid, "RssAnon:"));
            thread::sleep(Duration::from_millis(5));
        }
        peak
    });
    drain_seconds(pg, redis, "memory", n, true);
    let _ = stop.send(());
    sampler.join().unwrap()
}

fn worker_pid(pg: &Pg) -> i32 {
    pg.worker_pids()[0]
}

fn proc_status_kb(pid: i32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

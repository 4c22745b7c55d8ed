//! `BENCH_ONLY=idmp`: deduplication by Redis's IDMP against markers, on Redis 8.6 (the program
//! `OUTBOX_BENCH_REDIS8` names; scripts/bench.sh points it at the one scripts/fetch-redis.sh
//! fetches). The same backlog of one topic is drained at batch 1000 with `outbox.dedupe = idmp` and
//! `= markers`, taking turns, five pairs; the drain rate's ratio is the median of the pairs'.
//! Redis's memory per published event is `used_memory` after the drain (once the relay has deleted
//! what it deletes: the markers of durable batches) less before it, over the events, beside the
//! same for markers. Redis's CPU time per event over the drain (`INFO cpu`) shows where the time
//! goes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::common::{wait_until, Pg, Redis};
use crate::drain::{alternating, until_stream_holds, BACKLOG};
use crate::harness::{cpu_per_event, fresh_table, set_and_wait, thread_ticks};
use crate::report::{median, paired_ratio_each, Report};

/// Redis's CPU time so far, user and system, in seconds (`INFO cpu`, to the microsecond).
fn used_cpu(redis: &Redis) -> f64 {
    let info: String = redis.query(redis::cmd("INFO").arg("cpu"));
    ["used_cpu_sys:", "used_cpu_user:"]
        .iter()
        .map(|field| {
            info.lines()
                .find_map(|l| l.trim().strip_prefix(field))
                .and_then(|v| v.parse::<f64>().ok())
                .expect("no used_cpu in INFO cpu")
        })
        .sum()
}

fn used_memory(redis: &Redis) -> f64 {
    let info: String = redis.query(redis::cmd("INFO").arg("memory"));
    info.lines()
        .find_map(|l| l.trim().strip_prefix("used_memory:"))
        .and_then(|v| v.parse().ok())
        .expect("no used_memory in INFO memory")
}

pub(crate) fn idmp_against_markers(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let Ok(program) = std::env::var("OUTBOX_BENCH_REDIS8") else {
        println!("idmp: skipped, OUTBOX_BENCH_REDIS8 names no Redis 8.6");
        return;
    };
    let n = BACKLOG;
    println!("8. IDMP against markers on Redis 8.6 ({n} events, batch 1000)");
    let previous = std::env::var("OUTBOX_TEST_REDIS_SERVER").ok();
    std::env::set_var("OUTBOX_TEST_REDIS_SERVER", &program);
    let redis8 = Redis::start();
    match &previous {
        Some(value) => std::env::set_var("OUTBOX_TEST_REDIS_SERVER", value),
        None => std::env::remove_var("OUTBOX_TEST_REDIS_SERVER"),
    }
    let url = redis8.relay_url();
    let mut memory: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut cpu: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut relay_cpu: HashMap<(&str, bool), Vec<f64>> = HashMap::new();
    let runs = alternating(["markers", "idmp"], |side| {
        let expect = format!("dedupe={side} ");
        set_and_wait(
            pg,
            &[
                ("outbox.redis_url", url.as_str()),
                ("outbox.batch_size", "1000"),
                ("outbox.dedupe", side),
            ],
            &[&expect, "batch_size=1000 "],
        );
        let mut client = pg.connect();
        fresh_table(&mut client);
        client
            .batch_execute("SET outbox.notify_channel = ''")
            .unwrap();
        let before = used_memory(&redis8);
        let cpu_before = used_cpu(&redis8);
        let pid = pg.worker_pids()[0];
        let ticks_before = thread_ticks(pid);
        client
            .execute(
                "SELECT outbox_enqueue('idmp', jsonb_build_object('account_id', g, 'email', \
                 'user' || g || '@example.com')) FROM generate_series(1::bigint, $1) g",
                &[&n],
            )
            .unwrap();
        let committed = Instant::now();
        let secs = until_stream_holds(&redis8, "idmp", n as usize)
            .duration_since(committed)
            .as_secs_f64();
        cpu.entry(side)
            .or_default()
            .push((used_cpu(&redis8) - cpu_before) / n as f64 * 1e6);
        let (main_us, others_us) = cpu_per_event(pid, &ticks_before, &thread_ticks(pid), n);
        relay_cpu.entry((side, true)).or_default().push(main_us);
        relay_cpu.entry((side, false)).or_default().push(others_us);
        assert!(wait_until(Duration::from_secs(60), || client
            .query_one(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL",
                &[]
            )
            .unwrap()
            .get::<_, i64>(0)
            == 0));
        // Past the relay's own flush (200 ms) and its idle clean-up of markers (20 ms).
        std::thread::sleep(Duration::from_millis(500));
        let markers: Vec<String> = redis8.query(redis::cmd("KEYS").arg("outbox:dedupe:*"));
        if side == "idmp" {
            assert!(markers.is_empty(), "IDMP left marker keys");
        }
        memory
            .entry(side)
            .or_default()
            .push((used_memory(&redis8) - before) / n as f64);
        let _: i64 = redis8.query(redis::cmd("DEL").arg("idmp"));
        n as f64 / secs
    });
    // Back to the main server and the setting the other cases use: `idmp` would hold every
    // event back on Debian's Redis 7.0.
    let main_url = redis.relay_url();
    set_and_wait(
        pg,
        &[
            ("outbox.redis_url", main_url.as_str()),
            ("outbox.dedupe", "on"),
        ],
        &[&format!("redis_url={main_url} "), "dedupe=on "],
    );
    report.row(
        "relay on Redis 8.6, batch 1000, dedupe idmp",
        format!("{:.0} events/s", median(runs["idmp"].clone())),
        format!(
            "{:.0} events/s (dedupe markers, same server)",
            median(runs["markers"].clone())
        ),
        paired_ratio_each(&runs["idmp"], &runs["markers"]),
        ">= 1",
    );
    report.row(
        "Redis CPU per published event over the drain, dedupe idmp",
        format!("{:.2} µs", median(cpu["idmp"].clone())),
        format!("{:.2} µs (dedupe markers)", median(cpu["markers"].clone())),
        paired_ratio_each(&cpu["idmp"], &cpu["markers"]),
        "",
    );
    for (main, threads) in [(true, "main thread"), (false, "Redis thread")] {
        let (idmp, markers) = (&relay_cpu[&("idmp", main)], &relay_cpu[&("markers", main)]);
        report.row(
            &format!("the relay's {threads}, CPU per published event over the drain, dedupe idmp"),
            format!("{:.2} µs", median(idmp.clone())),
            format!("{:.2} µs (dedupe markers)", median(markers.clone())),
            paired_ratio_each(idmp, markers),
            "",
        );
    }
    let idmp = median(memory["idmp"].clone());
    let markers = median(memory["markers"].clone());
    report.row(
        "Redis memory per published event, dedupe idmp",
        format!("{idmp:.1} bytes"),
        format!("{markers:.1} bytes (dedupe markers)"),
        format!(
            "{:.3} (medians of {} drains each)",
            idmp / markers,
            memory["idmp"].len()
        ),
        "< 1",
    );
}

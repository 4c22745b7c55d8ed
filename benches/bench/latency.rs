//! `BENCH_ONLY=latency`: how long an event takes to reach a reader of its stream. First from its
//! commit to an `XREAD` reader, at 500 events/s from one client on a vacuumed table and a quiet
//! server, beside a C peer's figures: a reference measured elsewhere, not in this run, which the
//! rows say. Then from its statement's start, with 4 pgbench clients at 5000 events/s, against
//! the same load at 500 events/s in the same run, so that the ratio shows what the rate adds.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::{wait_until, Pg, Redis};
use crate::harness::fresh_table;
use crate::load::{latency_under_load, XreadReply};
use crate::report::{percentile, Report};

pub(crate) fn latency(pg: &Pg, redis: &Redis, report: &mut Report) {
    println!("3. commit-to-Redis latency (500 events/s for 10 s)");
    let rate = 500;
    let seconds = 10;
    let url = redis.url();
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let reader = thread::spawn(move || {
        let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
        let mut seen: HashMap<i64, Instant> = HashMap::new();
        let mut last = "$".to_string();
        let _ = ready_tx.send(());
        while seen.len() < rate * seconds {
            let reply: Option<XreadReply> = redis::cmd("XREAD")
                .arg("BLOCK")
                .arg(5_000)
                .arg("STREAMS")
                .arg("latency")
                .arg(&last)
                .query(&mut conn)
                .unwrap();
            let now = Instant::now();
            let Some(streams) = reply else { break };
            for (_, entries) in streams {
                for (entry_id, fields) in entries {
                    let id = fields
                        .chunks(2)
                        .find(|kv| kv[0] == "id")
                        .map(|kv| kv[1].parse().unwrap())
                        .unwrap();
                    seen.insert(id, now);
                    last = entry_id;
                }
            }
        }
        seen
    });
    ready_rx.recv().unwrap();
    let mut client = pg.connect();
    // Latency is measured on a vacuumed table and a quiet server: the earlier cases leave
    // autovacuum work and a checkpoint's worth of dirty pages behind, which would otherwise
    // land in the tail.
    fresh_table(&mut client);
    client.batch_execute("CHECKPOINT").unwrap();
    wait_until(Duration::from_secs(120), || {
        let running: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'",
                &[],
            )
            .unwrap()
            .get(0);
        running == 0
    });
    thread::sleep(Duration::from_millis(200));
    client
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    let statement = client
        .prepare("SELECT outbox_enqueue('latency', '{\"account_id\": 7}')")
        .unwrap();
    let mut committed: HashMap<i64, Instant> = HashMap::new();
    let start = Instant::now();
    for i in 0..rate * seconds {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        let id: i64 = client.query_one(&statement, &[]).unwrap().get(0);
        committed.insert(id, Instant::now());
    }
    let seen = reader.join().unwrap();
    let mut ms: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            seen.get(id)
                .map(|s| s.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    let missing = committed.len() - ms.len();
    report.row(
        "latency p50, 500 events/s",
        format!("{:.2} ms", percentile(&ms, 0.5)),
        "1.4 ms (C peer, NOTIFY-woken; measured elsewhere, not in this run)".into(),
        format!("{:.2}", percentile(&ms, 0.5) / 1.4),
        "< 1 ms",
    );
    report.row(
        "latency p99, 500 events/s",
        format!("{:.2} ms", percentile(&ms, 0.99)),
        "2.7 ms (C peer, NOTIFY-woken; measured elsewhere, not in this run)".into(),
        format!("{:.2}", percentile(&ms, 0.99) / 2.7),
        "< 3 ms",
    );
    report.row(
        "latency max, 500 events/s",
        format!("{:.2} ms", ms.last().copied().unwrap_or(f64::NAN)),
        format!("{} events, {missing} not seen", committed.len()),
        String::new(),
        "",
    );
}

pub(crate) fn latency_at_5000(pg: &Pg, redis: &Redis, report: &mut Report) {
    println!("3b. latency under load (4 pgbench clients, 500, 2000 and 5000 events/s, 20 s each)");
    let mut client = pg.connect();
    fresh_table(&mut client);
    client
        .batch_execute("ALTER DATABASE postgres SET outbox.notify_channel = ''")
        .unwrap();
    let (quiet, _) = latency_under_load(pg, redis, 500, 20);
    let (middle, _) = latency_under_load(pg, redis, 2_000, 20);
    let (busy, enqueued) = latency_under_load(pg, redis, 5_000, 20);
    for (rate, sorted) in [(500, &quiet), (2_000, &middle), (5_000, &busy)] {
        for (name, p) in [("p50", 0.5), ("p95", 0.95), ("p99", 0.99)] {
            let group = format!("{rate} events/s");
            report.bar("latency", &group, name, percentile(sorted, p));
        }
    }
    client
        .batch_execute("ALTER DATABASE postgres RESET outbox.notify_channel")
        .unwrap();
    for (name, p, target) in [("p50", 0.5, "< 2 ms"), ("p99", 0.99, "< 5 ms")] {
        report.row(
            &format!("latency {name}, 5000 events/s (statement start to XREAD)"),
            format!("{:.2} ms", percentile(&busy, p)),
            format!(
                "{:.2} ms (same load at 500 events/s)",
                percentile(&quiet, p)
            ),
            format!("{:.2}", percentile(&busy, p) / percentile(&quiet, p)),
            target,
        );
    }
    report.row(
        "latency max, 5000 events/s",
        format!("{:.2} ms", busy.last().copied().unwrap_or(f64::NAN)),
        format!("{enqueued} events, {} seen", busy.len()),
        String::new(),
        "",
    );
}

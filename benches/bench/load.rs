//! Latency under a steady load: pgbench clients enqueue events at a fixed rate, each payload
//! carrying the time its statement started, and an `XREAD` reader notes when each arrives.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use crate::common::{wait_until, Pg, Redis};
use crate::pgbench::pgbench_at_rate;

/// XREAD's answer: per stream, its entries as (entry id, flat field/value list).
pub(crate) type XreadReply = Vec<(String, Vec<(String, Vec<String>)>)>;

/// Latency under a steady load: 4 pgbench clients enqueue `rate` events a second for
/// `seconds`, each payload carrying the time its statement started; an `XREAD` reader notes
/// when each entry arrives. Returns the latencies in milliseconds, sorted, and how many
/// events were enqueued.
pub(crate) fn latency_under_load(
    pg: &Pg,
    redis: &Redis,
    rate: u32,
    seconds: u32,
) -> (Vec<f64>, usize) {
    latency_under_load_with(pg, redis, rate, seconds, None)
}

/// [`latency_under_load`], each event with the key `key` (an SQL expression) when given.
pub(crate) fn latency_under_load_with(
    pg: &Pg,
    redis: &Redis,
    rate: u32,
    seconds: u32,
    key: Option<&str>,
) -> (Vec<f64>, usize) {
    let url = redis.url();
    let stream = format!("load{rate}");
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let reader = {
        let stream = stream.clone();
        thread::spawn(move || {
            let mut conn = redis::Client::open(url).unwrap().get_connection().unwrap();
            let mut ms = Vec::new();
            let mut last = "$".to_string();
            let _ = ready_tx.send(());
            loop {
                let reply: Option<XreadReply> = redis::cmd("XREAD")
                    .arg("BLOCK")
                    .arg(1_000)
                    .arg("STREAMS")
                    .arg(&stream)
                    .arg(&last)
                    .query(&mut conn)
                    .unwrap();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_micros() as f64;
                let Some(streams) = reply else {
                    if stop_rx.try_recv().is_ok() {
                        break;
                    }
                    continue;
                };
                for (_, entries) in streams {
                    for (entry_id, fields) in entries {
                        let payload = fields
                            .chunks(2)
                            .find(|kv| kv[0] == "payload")
                            .map(|kv| kv[1].clone())
                            .unwrap();
                        let value: serde_json::Value = serde_json::from_str(&payload).unwrap();
                        let started = value["t"].as_f64().unwrap();
                        ms.push((now - started) / 1000.0);
                        last = entry_id;
                    }
                }
            }
            ms
        })
    };
    ready_rx.recv().unwrap();
    let key = key.map_or(String::new(), |key| format!(", key => {key}"));
    let script = format!(
        "SELECT outbox_enqueue('{stream}', jsonb_build_object('t', \
         (extract(epoch FROM clock_timestamp()) * 1000000)::bigint, 'account_id', 7){key});\n"
    );
    let tps = pgbench_at_rate(pg, &script, 4, rate, seconds);
    assert!(
        wait_until(Duration::from_secs(60), || redis.xlen(&stream) as f64
            >= tps * f64::from(seconds) * 0.99),
        "the load's events did not all arrive"
    );
    thread::sleep(Duration::from_millis(1_500));
    let _ = stop_tx.send(());
    let mut ms = reader.join().unwrap();
    ms.sort_by(|a, b| a.total_cmp(b));
    let enqueued = redis.xlen(&stream);
    let _ = redis::cmd("DEL")
        .arg(&stream)
        .query::<i64>(&mut redis.conn());
    (ms, enqueued)
}

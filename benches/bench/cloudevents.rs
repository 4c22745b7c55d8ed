//! `BENCH_ONLY=cloudevents`: `outbox.message_format = cloudevents` against `fields`, with events
//! that have a key and headers (a traceparent and a tenant), as most CloudEvents will. The write:
//! pairs of 8-client pgbench runs of the same `outbox_enqueue` transaction under each setting,
//! taking turns, `fsync = on` as the write cases run (the enqueue checks the headers' names and
//! values with `cloudevents`); also counted until every event is in Redis. The drain: a backlog of
//! such events committed at once, timed until Redis holds them, the settings taking turns; the
//! relay's main thread and Redis thread CPU per event over it.

use std::collections::HashMap;
use std::time::Instant;

use crate::common::{Pg, Redis};
use crate::drain::{alternating, until_stream_holds, BACKLOG};
use crate::harness::{cpu_per_event, fresh_table, set_and_wait, thread_ticks};
use crate::report::{median, paired_ratio_each, paired_ratio_spread, Report};
use crate::write::{set_fsync, tps_of, until_published_row, write_run, WriteRun, STREAM};

/// Write pairs: fewer than the targeted write cases', each side needing a reload.
const PAIRS: usize = 10;

/// Waits until the worker runs with `outbox.message_format = format`.
fn use_format(pg: &mut Pg, format: &str) {
    let expect = format!("message_format={format}");
    set_and_wait(pg, &[("outbox.message_format", format)], &[&expect]);
}

pub(crate) fn cloudevents_against_fields(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    println!("9. CloudEvents against fields (key and headers)");
    write(pg, redis, report);
    drain(pg, redis, report);
    use_format(pg, "fields");
}

fn write(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    set_fsync(pg, "on");
    let script = "BEGIN;\nINSERT INTO accounts (email) VALUES ('ada@example.com');\n\
        SELECT outbox_enqueue('account.created', '{\"account_id\": 7}', 'account-7', \
        '{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\", \"tenant\": \"t7\"}');\n\
        COMMIT;\n";
    let mut admin = pg.connect();
    admin
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, email text NOT NULL)",
        )
        .unwrap();
    let mut runs: HashMap<&str, Vec<WriteRun>> = HashMap::new();
    for rep in 0..PAIRS {
        let mut order = ["fields", "cloudevents"];
        if rep % 2 == 1 {
            order.reverse();
        }
        for format in order {
            use_format(pg, format);
            admin
                .batch_execute("TRUNCATE accounts, outbox; CHECKPOINT")
                .unwrap();
            let run = write_run(pg, redis, &mut admin, script, 8, Some(STREAM));
            runs.entry(format).or_default().push(run);
        }
    }
    set_fsync(pg, "off");
    let tps = tps_of(&runs);
    println!(
        "  fields {:?}\n  cloudevents {:?}",
        tps["fields"], tps["cloudevents"]
    );
    let row = "write, 8 clients: outbox_enqueue with key and headers, message_format cloudevents";
    report.row(
        row,
        format!("{:.0} tps", median(tps["cloudevents"].clone())),
        format!(
            "{:.0} tps (message_format fields)",
            median(tps["fields"].clone())
        ),
        paired_ratio_spread(&tps["cloudevents"], &tps["fields"]),
        "",
    );
    until_published_row(
        report,
        row,
        &runs["cloudevents"],
        &runs["fields"],
        "message_format fields",
    );
}

fn drain(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let n = BACKLOG / 2;
    let stream = "account.debited";
    let mut relay_cpu: HashMap<(&str, bool), Vec<f64>> = HashMap::new();
    let runs = alternating(["fields", "cloudevents"], |format| {
        use_format(pg, format);
        let mut client = pg.connect();
        fresh_table(&mut client);
        client
            .batch_execute("SET outbox.notify_channel = ''")
            .unwrap();
        let pid = pg.worker_pids()[0];
        let ticks_before = thread_ticks(pid);
        client
            .execute(
                "SELECT outbox_enqueue('account.debited', jsonb_build_object('account_id', g, \
                 'amount', 10), 'account-' || (g % 1000), jsonb_build_object('traceparent', \
                 '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', 'tenant', 't' || (g % 10))) \
                 FROM generate_series(1::bigint, $1) g",
                &[&n],
            )
            .unwrap();
        let committed = Instant::now();
        let secs = until_stream_holds(redis, stream, n as usize)
            .duration_since(committed)
            .as_secs_f64();
        let (main_us, others_us) = cpu_per_event(pid, &ticks_before, &thread_ticks(pid), n);
        relay_cpu.entry((format, true)).or_default().push(main_us);
        relay_cpu
            .entry((format, false))
            .or_default()
            .push(others_us);
        let _: i64 = redis.query(redis::cmd("DEL").arg(stream));
        n as f64 / secs
    });
    report.row(
        "relay, keyed events with headers, message_format cloudevents",
        format!("{:.0} events/s", median(runs["cloudevents"].clone())),
        format!(
            "{:.0} events/s (message_format fields)",
            median(runs["fields"].clone())
        ),
        paired_ratio_each(&runs["cloudevents"], &runs["fields"]),
        "",
    );
    for (main, thread) in [(true, "main thread"), (false, "Redis thread")] {
        let (ce, fields) = (
            &relay_cpu[&("cloudevents", main)],
            &relay_cpu[&("fields", main)],
        );
        report.row(
            &format!("the relay's {thread}, CPU per event over that drain, cloudevents"),
            format!("{:.2} µs", median(ce.clone())),
            format!("{:.2} µs (message_format fields)", median(fields.clone())),
            paired_ratio_each(ce, fields),
            "",
        );
    }
}

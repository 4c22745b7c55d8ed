//! `BENCH_ONLY=write`: what the outbox adds to a writing transaction. pgbench runs a business
//! transaction (one row into `accounts`) at 1 and 8 clients, alone, with a hand-written
//! `INSERT INTO outbox`, and with `outbox_enqueue`: with the defaults and nobody listening on
//! `outbox.notify_channel` (no notification is sent), with one session listening (each commit
//! notifies), and with the channel empty, while the relay runs, with `fsync = on`. The baseline is the hand-written insert: the same event row written by
//! plain SQL, the least any outbox costs, so the ratio shows what the function adds. Every case
//! is a transaction of its own; each run starts on an emptied table right after a checkpoint;
//! every other repetition runs the cases backwards; and the ratio is the median of the ratios
//! of runs made next to each other, so that no side meets the machine's drift alone.
//!
//! The targeted case (`outbox_enqueue` with the defaults, 8 clients) runs more pairs, is also counted until the
//! relay has published every event, so that the relay's work for it is not left out, and is
//! compared once more with both transactions drawn at random in one run by one client, which
//! leaves no drift between runs. The keyed write cases reuse this machinery.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::common::{wait_until, Client, Pg, Redis};
use crate::pgbench::{mixed_latencies, run_pgbench_counted};
use crate::report::{median, paired_ratio, paired_ratio_each, paired_ratio_spread, Report};

/// Runs of each write case: pgbench figures swing most between runs on a shared machine.
pub(crate) const WRITE_REPS: usize = 7;

/// Pairs of runs for the write cases with a target (`outbox_enqueue` against the hand-written
/// insert at 8 clients, with and without key and headers). One pair's ratio spreads by a tenth
/// and more on this shared machine, so the median of 7 moves by about 5% from that noise alone,
/// as much as the target allows; that of 25 by about 2%. The machine's drift over minutes moves
/// it more: 0.880 to 0.980 in five runs of the keyed case.
pub(crate) const WRITE_PAIRS: usize = 25;

/// The length in seconds of each write run.
pub(crate) const PGBENCH_SECONDS: u32 = 6;

/// Runs, and their length in seconds, of the write comparison that draws both transactions at
/// random in one run.
const MIXED_RUNS: usize = 3;
const MIXED_SECONDS: u32 = 10;

/// The stream of the write cases' events (topic `account.created`, no stream prefix).
pub(crate) const STREAM: &str = "account.created";

/// Sets `fsync` (`on` for the write cases, as a production server writes: a commit then waits
/// for its flush, and commits that cannot share one, as a notifying commit holding a
/// database-wide lock through it cannot, show what that costs; the other cases run with the
/// harness's `off`) and waits until the server has it.
pub(crate) fn set_fsync(pg: &Pg, value: &str) {
    let mut admin = pg.connect();
    admin
        .batch_execute(&format!("ALTER SYSTEM SET fsync = {value}"))
        .unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || pg
            .connect()
            .query_one("SHOW fsync", &[])
            .map(|row| row.get::<_, String>(0) == value)
            .unwrap_or(false)),
        "fsync is not {value} after the reload"
    );
}

pub(crate) fn write_cost(pg: &Pg, redis: &Redis, report: &mut Report) {
    println!(
        "1. write cost (pgbench, {PGBENCH_SECONDS} s x {WRITE_REPS}, the targeted case x {WRITE_PAIRS}, relay running, fsync on)"
    );
    set_fsync(pg, "on");
    write_cost_cases(pg, redis, report);
    set_fsync(pg, "off");
}

fn write_cost_cases(pg: &Pg, redis: &Redis, report: &mut Report) {
    let mut admin = pg.connect();
    admin
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, email text NOT NULL)",
        )
        .unwrap();
    let business = "INSERT INTO accounts (email) VALUES ('ada@example.com');\n";
    let hand = format!(
        "BEGIN;\n{business}INSERT INTO outbox (topic, payload) VALUES ('account.created', '{{\"account_id\": 7}}');\nCOMMIT;\n"
    );
    let enqueue =
        format!("BEGIN;\n{business}SELECT outbox_enqueue('account.created', '{{\"account_id\": 7}}');\nCOMMIT;\n");
    // Every case is a transaction of its own (BEGIN ... COMMIT), so that the ratios show what
    // the outbox statement adds, not a difference in round trips.
    let alone = format!("BEGIN;\n{business}COMMIT;\n");
    // Each case: its name, its transaction, `outbox.notify_channel`, and whether a session
    // listens on the default channel meanwhile.
    let cases: [(&str, &str, &str, bool); 5] = [
        ("business transaction alone", &alone, "outbox", false),
        ("+ hand-written INSERT INTO outbox", &hand, "outbox", false),
        (
            "+ outbox_enqueue, defaults (nobody listening)",
            &enqueue,
            "outbox",
            false,
        ),
        (
            "+ outbox_enqueue, one session listening",
            &enqueue,
            "outbox",
            true,
        ),
        (
            "+ outbox_enqueue, notify_channel empty",
            &enqueue,
            "",
            false,
        ),
    ];
    for clients in [1, 8] {
        let mut runs: HashMap<&str, Vec<WriteRun>> = HashMap::new();
        // At 8 clients, the case with a target goes on beside the hand-written insert alone
        // for more pairs.
        let reps = if clients == 8 {
            WRITE_PAIRS
        } else {
            WRITE_REPS
        };
        for rep in 0..reps {
            let running: Vec<_> = cases
                .iter()
                .enumerate()
                .filter(|(i, _)| rep < WRITE_REPS || *i == 1 || *i == 2)
                .map(|(_, case)| case)
                .collect();
            // Every other run goes backwards, so that a drift in the machine's load does not
            // favour the cases that come first.
            let order: Vec<_> = if rep % 2 == 0 {
                running
            } else {
                running.into_iter().rev().collect()
            };
            for (name, script, channel, listen) in order {
                let stream = (*name != cases[0].0).then_some(STREAM);
                // Each run starts empty and right after a checkpoint, so that no run pays for
                // a checkpoint the others escape.
                admin
                    .batch_execute("TRUNCATE accounts, outbox; CHECKPOINT")
                    .unwrap();
                admin
                    .batch_execute(&format!(
                        "ALTER DATABASE postgres SET outbox.notify_channel = '{channel}'"
                    ))
                    .unwrap();
                // The listener hears every notification and reads none: PostgreSQL queues them
                // for it, as for a client that is busy.
                let listener = listen.then(|| {
                    let mut listener = pg.connect();
                    listener.batch_execute("LISTEN outbox").unwrap();
                    listener
                });
                runs.entry(name)
                    .or_default()
                    .push(write_run(pg, redis, &mut admin, script, clients, stream));
                drop(listener);
            }
        }
        admin
            .batch_execute("ALTER DATABASE postgres RESET outbox.notify_channel")
            .unwrap();
        let tps = tps_of(&runs);
        let hand = &tps[cases[1].0];
        for (name, ..) in &cases {
            // The hand-written insert's runs of the same repetitions as this case's.
            let baseline = median(hand[..tps[name].len()].to_vec());
            let runs: Vec<String> = tps[name].iter().map(|t| format!("{t:.0}")).collect();
            println!("  {clients} client(s), {name}: runs {}", runs.join(" "));
            let figure = median(tps[name].clone());
            let targeted = *name == cases[2].0 && clients == 8;
            let (ratio, target) = if targeted {
                (paired_ratio_spread(&tps[name], hand), ">= 0.95 (within 5%)")
            } else {
                let pairs = tps[name].len();
                (
                    format!("{:.3}", paired_ratio(&tps[name], &hand[..pairs])),
                    "",
                )
            };
            report.row(
                &format!("write, {clients} client(s): {name}"),
                format!("{figure:.0} tps"),
                format!("{baseline:.0} tps (hand-written insert)"),
                ratio,
                target,
            );
        }
        if clients == 8 {
            until_published_row(
                report,
                "write, 8 clients: + outbox_enqueue, defaults (nobody listening)",
                &runs[cases[2].0],
                &runs[cases[1].0],
                "hand-written insert",
            );
        }
    }
    mixed_write_row(
        pg,
        &mut admin,
        report,
        "+ outbox_enqueue, defaults (nobody listening)",
        &hand,
        &enqueue,
    );
}

/// What one write run measured: pgbench's tps, and the transactions it ran over the time from
/// its start until the relay had published every event they enqueued.
#[derive(Clone, Copy)]
pub(crate) struct WriteRun {
    tps: f64,
    until_published: f64,
}

/// Runs pgbench with `script` for `PGBENCH_SECONDS` as fast as it goes, then waits until the
/// relay has published the event each transaction enqueued to `stream` (none without `stream`),
/// woken at once so that no poll interval is counted, and watched through `XLEN` so that the
/// wait takes nothing from the relay's database. With 8 writers on 2 cores the relay gets a
/// share of the CPU like any backend and falls behind (tens of thousands of events in a run);
/// the next run's `TRUNCATE` would discard that backlog, and pgbench's tps would leave out the
/// relay's work for it, for some cases more than others.
pub(crate) fn write_run(
    pg: &Pg,
    redis: &Redis,
    admin: &mut Client,
    script: &str,
    clients: u32,
    stream: Option<&str>,
) -> WriteRun {
    let before = stream.map_or(0, |s| redis.xlen(s));
    let started = Instant::now();
    let (tps, transactions) =
        run_pgbench_counted(pg, script, clients, &["-T", &PGBENCH_SECONDS.to_string()]);
    if let Some(stream) = stream {
        admin.batch_execute("SELECT _outbox_wake()").unwrap();
        let expected = before + transactions as usize;
        let published = wait_until(Duration::from_secs(300), || redis.xlen(stream) >= expected);
        assert!(published, "the relay did not publish a write run's events");
    }
    WriteRun {
        tps,
        until_published: transactions as f64 / started.elapsed().as_secs_f64(),
    }
}

/// pgbench's tps of each case's write runs.
pub(crate) fn tps_of<'a>(runs: &HashMap<&'a str, Vec<WriteRun>>) -> HashMap<&'a str, Vec<f64>> {
    runs.iter()
        .map(|(name, runs)| (*name, runs.iter().map(|r| r.tps).collect()))
        .collect()
}

/// The targeted write case counted until every event was in Redis, against its baseline so
/// counted (see [`write_run`]).
pub(crate) fn until_published_row(
    report: &mut Report,
    case: &str,
    runs: &[WriteRun],
    baseline: &[WriteRun],
    baseline_name: &str,
) {
    let counted = |runs: &[WriteRun]| runs.iter().map(|r| r.until_published).collect::<Vec<_>>();
    let (runs, baseline) = (counted(runs), counted(baseline));
    report.row(
        &format!("{case}, until every event is in Redis"),
        format!("{:.0} tps", median(runs.clone())),
        format!(
            "{:.0} tps ({baseline_name}, until every event is in Redis)",
            median(baseline.clone())
        ),
        paired_ratio_spread(&runs, &baseline),
        ">= 0.95 (within 5%), the relay's work counted",
    );
}

/// The hand-written insert's transaction and the call's drawn at random in one run by one
/// client: each transaction's latency is its cost, with none of the drift between runs that
/// pairs of 8-client runs are exposed to. Reported as the insert's latency over the call's,
/// which reads as a throughput ratio.
pub(crate) fn mixed_write_row(
    pg: &Pg,
    admin: &mut Client,
    report: &mut Report,
    case: &str,
    hand: &str,
    enqueue: &str,
) {
    let (mut hand_tx, mut enqueue_tx, mut hand_call, mut enqueue_call) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..MIXED_RUNS {
        admin
            .batch_execute("TRUNCATE accounts, outbox; CHECKPOINT")
            .unwrap();
        let got = mixed_latencies(pg, &[hand, enqueue], 1, MIXED_SECONDS);
        hand_tx.push(got[0].0);
        enqueue_tx.push(got[1].0);
        // BEGIN, the business row, then the outbox's statement.
        hand_call.push(got[0].1[2]);
        enqueue_call.push(got[1].1[2]);
    }
    println!(
        "  mixed, 1 client, {case}: hand {hand_tx:?} (insert {hand_call:?})\n  enqueue {enqueue_tx:?} (call {enqueue_call:?})"
    );
    report.row(
        &format!("write, 1 client, both transactions drawn at random in one run: {case}"),
        format!(
            "{:.4} ms a transaction (the call {:.4} ms)",
            median(enqueue_tx.clone()),
            median(enqueue_call)
        ),
        format!(
            "{:.4} ms (the hand-written insert {:.4} ms)",
            median(hand_tx.clone()),
            median(hand_call)
        ),
        paired_ratio_each(&hand_tx, &enqueue_tx),
        "none (the comparison above without drift between runs)",
    );
}

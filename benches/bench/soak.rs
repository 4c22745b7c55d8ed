//! `BENCH_ONLY=soak`: the table under a steady stream, five minutes at each of 2,000 and 10,000
//! events/s, retention 5 s, autovacuum as configured by default. The table's size against its
//! live rows' size, read in the same look (bloat); its largest size in minute 5 against minute 2
//! (growth); and the relay's drain rate and CPU per event after the soak against a fresh table's
//! in a second database, drained in turns with it so that the machine's drift lands on both.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::{wait_until, Client, Pg, Redis};
use crate::drain::{drain_seconds_in, BACKLOG};
use crate::harness::{cpu_ticks, fresh_table, relay_databases, set_and_wait};
use crate::pgbench::pgbench_at_rate;
use crate::report::{median, paired_ratio, Report};

const SOAK_SECONDS: u32 = 300;

/// A steady stream of 200-byte events for five minutes at each rate, retention 5 s, autovacuum
/// as configured by default: the table's size (read every 100 ms) beside its live rows' (every
/// second), and the relay's drain rate and CPU per event after the soak (the median of three
/// drains) beside a fresh table's in a second database, drained in turn with it. The drains
/// before the soak are printed, to show how far the machine drifted over it.
pub(crate) fn soak(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    println!("6. soak ({SOAK_SECONDS} s per rate, retention 5 s)");
    set_and_wait(
        pg,
        &[
            ("outbox.batch_size", "100"),
            ("outbox.dedupe", "on"),
            ("outbox.retention", "5s"),
        ],
        &["batch_size=100 ", "dedupe=on ", "retention=5s "],
    );
    let mut client = pg.connect();
    client
        .batch_execute("ALTER DATABASE postgres SET outbox.notify_channel = ''")
        .unwrap();
    // 200 bytes of JSON text.
    let payload = format!(
        "{{\"account_id\": 7, \"email\": \"ada@example.com\", \"note\": \"{}\"}}",
        "x".repeat(200 - 57)
    );
    assert_eq!(payload.len(), 200);
    let script = format!("SELECT outbox_enqueue('soak', '{payload}');\n");
    client
        .batch_execute("DROP DATABASE IF EXISTS soak_fresh")
        .unwrap();
    client.batch_execute("CREATE DATABASE soak_fresh").unwrap();
    pg.connect_to("soak_fresh")
        .batch_execute("CREATE EXTENSION outbox")
        .unwrap();
    for rate in [2_000_u32, 10_000] {
        let fresh_before = drains_with_cpu(pg, redis, || {
            let mut client = pg.connect();
            fresh_table(&mut client);
            client.batch_execute("CHECKPOINT").unwrap();
        });
        fresh_table(&mut client);
        let vacuums_before = autovacuums(&mut client);
        let started = Instant::now();
        let (done, finished) = mpsc::channel::<f64>();
        let pg_ref: &Pg = pg;
        let (samples, sizes) = thread::scope(|scope| {
            scope.spawn(|| {
                let tps = pgbench_at_rate(pg_ref, &script, 4, rate, SOAK_SECONDS);
                let _ = done.send(tps);
            });
            let (mut samples, mut sizes) = (Vec::new(), Vec::new());
            let mut sampler = pg_ref.connect();
            // The size is a sawtooth (a partition fills in 6.5 s at 10,000 events/s, 33 s at
            // 2,000, then the one before it is emptied): it is read every 100 ms, so that a
            // minute's largest reading is its peak to within 0.1 s of writes, and the rows
            // (a scan of the table) every second.
            let mut tick = 0;
            loop {
                thread::sleep(Duration::from_millis(100));
                tick += 1;
                let at = started.elapsed().as_secs_f64();
                let ended = started.elapsed().as_secs() >= u64::from(SOAK_SECONDS);
                if tick % 10 != 0 {
                    sizes.push((at, total_size(&mut sampler)));
                } else {
                    let s = sample(&mut sampler, at);
                    sizes.push((at, s.total));
                    if tick % 100 == 0 {
                        println!(
                            "  {rate}/s at {:>3.0} s: total {:>6.1} MB, {:>7} live rows, {:>6.1} MB live, {:>7} dead, ratio {:.2}",
                            s.at,
                            s.total as f64 / 1e6,
                            s.rows,
                            s.live as f64 / 1e6,
                            s.dead,
                            s.total as f64 / s.live.max(1) as f64
                        );
                    }
                    samples.push(s);
                }
                if ended {
                    break;
                }
            }
            (samples, sizes)
        });
        let tps = finished.recv().unwrap();
        println!(
            "  autovacuum ran {} times on the partitions during the soak",
            autovacuums(&mut client) - vacuums_before
        );
        assert!(
            wait_until(Duration::from_secs(120), || pg.pending() == 0),
            "the soak's backlog did not drain"
        );
        let _ = redis::cmd("DEL")
            .arg("soak")
            .query::<i64>(&mut redis.conn());
        let [soaked, fresh] = soaked_beside_fresh(pg, redis, "soak_fresh");
        let (soaked_rate, soaked_cpu) = (median(soaked.0.clone()), median(soaked.1));
        let (fresh_rate, fresh_cpu) = (median(fresh.0.clone()), median(fresh.1));
        println!(
            "  fresh table before the soak {:.0} events/s; after it, in turns, the soaked table {soaked_rate:.0}, a fresh one {fresh_rate:.0}",
            median(fresh_before.0),
        );

        let after_first_minute: Vec<&Sample> = samples.iter().filter(|s| s.at >= 60.0).collect();
        let worst = after_first_minute
            .iter()
            .max_by(|a, b| {
                (a.total as f64 / a.live.max(1) as f64)
                    .total_cmp(&(b.total as f64 / b.live.max(1) as f64))
            })
            .expect("no sample after the first minute");
        let largest_in = |from: f64, to: f64| {
            sizes
                .iter()
                .filter(|(at, _)| *at >= from && *at < to + 5.0)
                .map(|(_, total)| *total)
                .max()
                .unwrap_or(0)
        };
        let (minute2, minute5) = (largest_in(60.0, 120.0), largest_in(240.0, 300.0));
        let most_dead = after_first_minute.iter().map(|s| s.dead).max().unwrap_or(0);
        report.row(
            &format!("soak {rate}/s ({tps:.0} achieved): size after minute 1, worst sample"),
            format!("{:.1} MB", worst.total as f64 / 1e6),
            format!(
                "{:.1} MB of live rows ({} rows, {most_dead} dead at most)",
                worst.live as f64 / 1e6,
                worst.rows
            ),
            format!("{:.2}", worst.total as f64 / worst.live.max(1) as f64),
            "< 3",
        );
        report.row(
            &format!("soak {rate}/s: largest size in minute 5"),
            format!("{:.1} MB", minute5 as f64 / 1e6),
            format!("{:.1} MB (largest in minute 2)", minute2 as f64 / 1e6),
            format!("{:.2}", minute5 as f64 / minute2.max(1) as f64),
            "<= 1 (no growth)",
        );
        report.row(
            &format!("soak {rate}/s: relay drain after the soak"),
            format!("{soaked_rate:.0} events/s, {soaked_cpu:.1} µs CPU/event"),
            format!("{fresh_rate:.0} events/s, {fresh_cpu:.1} µs CPU/event (a fresh table, drained in turn)"),
            format!("{:.3}", paired_ratio(&soaked.0, &fresh.0)),
            ">= 0.9",
        );
    }
    client
        .batch_execute("ALTER DATABASE postgres RESET outbox.notify_channel")
        .unwrap();
}

/// One look at the table: its partitions' total size with indexes and TOAST, its live rows,
/// their size (each row as a composite datum: data plus tuple header), and the dead row
/// versions the statistics count.
struct Sample {
    at: f64,
    total: i64,
    rows: i64,
    live: i64,
    dead: i64,
}

/// Autovacuum runs on the table's partitions since the server started.
fn autovacuums(client: &mut Client) -> i64 {
    client
        .query_one(
            "SELECT coalesce(sum(autovacuum_count), 0)::bigint FROM pg_stat_user_tables \
             WHERE relid IN (SELECT inhrelid FROM pg_inherits \
                             WHERE inhparent = 'outbox'::regclass)",
            &[],
        )
        .unwrap()
        .get(0)
}

/// The total size of the table's partitions and their indexes, in bytes.
fn total_size(client: &mut Client) -> i64 {
    client
        .query_one(
            "SELECT sum(pg_total_relation_size(inhrelid))::bigint FROM pg_inherits \
             WHERE inhparent = 'outbox'::regclass",
            &[],
        )
        .unwrap()
        .get(0)
}

fn sample(client: &mut Client, at: f64) -> Sample {
    let row = client
        .query_one(
            "SELECT (SELECT sum(pg_total_relation_size(inhrelid))::bigint FROM pg_inherits \
                     WHERE inhparent = 'outbox'::regclass), \
                    count(*), coalesce(sum(pg_column_size(o.*)), 0)::bigint, \
                    (SELECT sum(n_dead_tup)::bigint FROM pg_stat_user_tables \
                     WHERE relid IN (SELECT inhrelid FROM pg_inherits \
                                     WHERE inhparent = 'outbox'::regclass)) \
             FROM outbox o",
            &[],
        )
        .unwrap();
    Sample {
        at,
        total: row.get(0),
        rows: row.get(1),
        live: row.get(2),
        dead: row.get::<_, Option<i64>>(3).unwrap_or(0),
    }
}

/// Drains a backlog in `db` without emptying its table first: events per second, the worker's
/// CPU time per event, and the autovacuums of the table's partitions that ended meanwhile.
fn drain_with_cpu(pg: &Pg, redis: &Redis, db: &str) -> (f64, f64, i64) {
    let pid: i32 = pg
        .connect()
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox relay' AND datname = $1",
            &[&db],
        )
        .unwrap()
        .get(0);
    let mut client = pg.connect_to(db);
    let vacuums = autovacuums(&mut client);
    let before = cpu_ticks(pid);
    let stream = format!("soak-drain-{db}");
    let secs = drain_seconds_in(pg, redis, db, &stream, BACKLOG / 2, false);
    // /proc/<pid>/stat counts in clock ticks: USER_HZ, 100 on Linux.
    let cpu_us = (cpu_ticks(pid) - before) as f64 * 10_000.0;
    (
        BACKLOG as f64 / 2.0 / secs,
        cpu_us / (BACKLOG as f64 / 2.0),
        autovacuums(&mut client) - vacuums,
    )
}

/// Three drains one after the other, `prepare` run before each: their rates, and their CPU per
/// event. One drain on this machine moves by a quarter from one run to the next.
fn drains_with_cpu(pg: &Pg, redis: &Redis, mut prepare: impl FnMut()) -> (Vec<f64>, Vec<f64>) {
    let (mut rates, mut cpus) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        prepare();
        let (rate, cpu, vacuums) = drain_with_cpu(pg, redis, "postgres");
        println!(
            "  drain: {rate:.0} events/s, {cpu:.1} µs CPU/event, {vacuums} autovacuum(s) ended meanwhile"
        );
        rates.push(rate);
        cpus.push(cpu);
    }
    (rates, cpus)
}

/// After a soak: three drains of the table it left, each next to one of a fresh table in the
/// database `fresh_db` (emptied before it), the two taking turns at going first, so that the
/// machine's drift lands on both sides alike. The soaked drains' rates and CPU per event, then
/// the fresh ones'. `fresh_db` is relayed only meanwhile, so that the soak itself runs beside
/// no other worker.
fn soaked_beside_fresh(pg: &mut Pg, redis: &Redis, fresh_db: &str) -> [(Vec<f64>, Vec<f64>); 2] {
    relay_databases(pg, &format!("postgres, {fresh_db}"), 2);
    let mut sides = [(Vec::new(), Vec::new()), (Vec::new(), Vec::new())];
    for rep in 0..3 {
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let db = if side == 0 { "postgres" } else { fresh_db };
            let mut client = pg.connect_to(db);
            if side == 1 {
                fresh_table(&mut client);
            }
            client.batch_execute("CHECKPOINT").unwrap();
            let (rate, cpu, vacuums) = drain_with_cpu(pg, redis, db);
            println!(
                "  drain, {}: {rate:.0} events/s, {cpu:.1} µs CPU/event, {vacuums} autovacuum(s) ended meanwhile",
                if side == 0 { "the soaked table" } else { "a fresh table" }
            );
            sides[side].0.push(rate);
            sides[side].1.push(cpu);
        }
    }
    relay_databases(pg, "postgres", 1);
    sides
}

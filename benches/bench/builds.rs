//! `BENCH_ONLY=builds`: this build of the extension against another, to settle a code choice (a
//! fast path against the plain API, one channel against another) by measurement. The other
//! build's library is the file `OUTBOX_BENCH_OTHER` names (a `liboutbox.so` from `cargo build
//! --release --lib` of the other code; `OUTBOX_BENCH_OTHER_NAME` says what it is); this side is
//! the installed library, or the one `OUTBOX_BENCH_THIS` names, built the same way as the other.
//! Both builds must relay the extension's objects: `OUTBOX_BENCH_VERSION` creates them at an
//! earlier version for the turns (say `0.7.0`, against a build of that version; the current
//! library relays the objects of the versions it lists as relayed).
//!
//! The sides take turns, the one going first alternating: the server is stopped, the side's
//! library is copied over the installed `outbox.so`, and the server started again. Each turn
//! enqueues a backlog in one statement (timed: the insert path's cost, with no client round
//! trip) and times the relay's drain of it at batch 1000, reading the worker's CPU time over the
//! drain: its main thread (claim, mark, commit) and its other threads (the Redis side). CPU
//! time per event moves much less than a rate does on a shared machine. The installed library
//! is put back at the end.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::common::{Pg, Redis};
use crate::drain::{until_stream_holds, BACKLOG, RELAY_REPS};
use crate::harness::{cpu_per_event, fresh_table, set_and_wait, thread_ticks};
use crate::report::{median, paired_ratio_each, Report};

pub(crate) fn builds(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let Ok(other) = std::env::var("OUTBOX_BENCH_OTHER") else {
        println!("builds: OUTBOX_BENCH_OTHER names no other build; skipped");
        return;
    };
    let other = PathBuf::from(other);
    let name =
        std::env::var("OUTBOX_BENCH_OTHER_NAME").unwrap_or_else(|_| other.display().to_string());
    let installed = installed_library();
    // The installed library is put back at the end; this side is it, or the file
    // `OUTBOX_BENCH_THIS` names (a build made as the other was).
    let kept = std::env::temp_dir().join(format!("outbox-bench-kept-{}.so", std::process::id()));
    std::fs::copy(&installed, &kept).expect("cannot keep a copy of the installed library");
    let this = std::env::var("OUTBOX_BENCH_THIS").map_or_else(|_| kept.clone(), PathBuf::from);
    println!(
        "builds: this build against {name} ({} events a turn)",
        BACKLOG
    );

    let version = std::env::var("OUTBOX_BENCH_VERSION").ok();
    if let Some(version) = &version {
        pg.connect()
            .batch_execute(&format!(
                "DROP EXTENSION outbox; CREATE EXTENSION outbox VERSION '{version}'"
            ))
            .expect("cannot create the extension at OUTBOX_BENCH_VERSION");
    }
    set_and_wait(
        pg,
        &[("outbox.batch_size", "1000"), ("outbox.dedupe", "on")],
        &["batch_size=1000 ", "dedupe=on "],
    );
    let mut turns: [Vec<Turn>; 2] = [Vec::new(), Vec::new()];
    for rep in 0..RELAY_REPS {
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let library = if side == 0 { &this } else { &other };
            switch_library(pg, library, &installed);
            let turn = turn(pg, redis);
            println!(
                "  {}: enqueue {:.0}/s, drain {:.0}/s, main {:.2} µs/event, others {:.2} µs/event",
                if side == 0 { "this" } else { name.as_str() },
                turn.enqueue,
                turn.drain,
                turn.main_us,
                turn.others_us
            );
            turns[side].push(turn);
        }
    }
    switch_library(pg, &kept, &installed);
    let _ = std::fs::remove_file(&kept);
    if version.is_some() {
        pg.connect()
            .batch_execute("DROP EXTENSION outbox; CREATE EXTENSION outbox")
            .unwrap();
    }

    let figures =
        |side: usize, of: fn(&Turn) -> f64| -> Vec<f64> { turns[side].iter().map(of).collect() };
    let rows: [(&str, Measure, &str); 4] = [
        (
            "`outbox_enqueue` in one statement",
            |t| t.enqueue,
            "events/s",
        ),
        (
            "relay drain, batch 1000, dedupe on",
            |t| t.drain,
            "events/s",
        ),
        ("relay main thread CPU per event", |t| t.main_us, "µs"),
        (
            "relay Redis-side threads CPU per event",
            |t| t.others_us,
            "µs",
        ),
    ];
    for (case, of, unit) in rows {
        let (a, b) = (figures(0, of), figures(1, of));
        report.row(
            &format!("this build against {name}: {case}"),
            format!("{:.2} {unit}", median(a.clone())),
            format!("{:.2} {unit} ({name})", median(b.clone())),
            paired_ratio_each(&a, &b),
            "",
        );
    }
}

/// What a row reads of a turn.
type Measure = fn(&Turn) -> f64;

/// One side's turn: the enqueue's rate, the drain's, and the worker's CPU per event.
struct Turn {
    enqueue: f64,
    drain: f64,
    main_us: f64,
    others_us: f64,
}

fn turn(pg: &Pg, redis: &Redis) -> Turn {
    let mut client = pg.connect();
    fresh_table(&mut client);
    client
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    let pid = pg.worker_pids()[0];
    let before = thread_ticks(pid);
    let started = Instant::now();
    client
        .execute(
            "SELECT outbox_enqueue('builds', jsonb_build_object('account_id', g, 'email', 'user' || g || '@example.com')) \
             FROM generate_series(1::bigint, $1) g",
            &[&BACKLOG],
        )
        .unwrap();
    let committed = Instant::now();
    let enqueue = BACKLOG as f64 / committed.duration_since(started).as_secs_f64();
    let drained = until_stream_holds(redis, "builds", BACKLOG as usize);
    let drain = BACKLOG as f64 / drained.duration_since(committed).as_secs_f64();
    let after = thread_ticks(pid);
    let _ = redis::cmd("DEL")
        .arg("builds")
        .query::<i64>(&mut redis.conn());
    let (main_us, others_us) = cpu_per_event(pid, &before, &after, BACKLOG);
    Turn {
        enqueue,
        drain,
        main_us,
        others_us,
    }
}

/// The library the server loads: `outbox.so` in `pg_config --pkglibdir`.
fn installed_library() -> PathBuf {
    let pg_config = std::env::var("PG_CONFIG")
        .unwrap_or_else(|_| "/usr/lib/postgresql/15/bin/pg_config".into());
    let out = Command::new(pg_config)
        .arg("--pkglibdir")
        .output()
        .expect("cannot run pg_config");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("outbox.so")
}

/// Stops the server, puts `library` in place of the installed one and starts it again.
fn switch_library(pg: &Pg, library: &Path, installed: &Path) {
    pg.stop("fast");
    // A new file renamed over the old, so that nothing still mapping the old one sees it change.
    let next = installed.with_extension("so.next");
    std::fs::copy(library, &next).expect("cannot copy the library");
    std::fs::rename(&next, installed).expect("cannot install the library");
    pg.ctl_start();
    pg.wait_for_workers(1);
}

//! The running servers under test: settings applied and waited for, the databases the relay
//! serves, an emptied table, and a process's and its threads' CPU time.

use std::time::Duration;

use crate::common::{wait_until, Client, Pg};

/// Changes settings and waits until the worker's latest configuration line shows `expect`.
pub(crate) fn set_and_wait(pg: &mut Pg, settings: &[(&str, &str)], expect: &[&str]) {
    pg.set(settings);
    let applied = wait_until(Duration::from_secs(10), || {
        let log = pg.log();
        let last = log.lines().rev().find(|l| {
            l.contains("outbox relay 0 started") || l.contains("outbox relay 0 reloaded")
        });
        last.is_some_and(|line| expect.iter().all(|e| line.contains(e)))
    });
    assert!(applied, "the worker did not take {settings:?}");
}

/// Sets `outbox.database` to `list` and waits until the launcher runs `workers` workers.
pub(crate) fn relay_databases(pg: &mut Pg, list: &str, workers: usize) {
    pg.set(&[("outbox.database", list)]);
    assert!(
        wait_until(Duration::from_secs(30), || pg.worker_pids().len()
            == workers),
        "the launcher did not settle on {workers} workers"
    );
}

/// Empties the table and vacuums it, so that every run starts from the same state.
pub(crate) fn fresh_table(client: &mut Client) {
    client.batch_execute("TRUNCATE outbox").unwrap();
    client.batch_execute("VACUUM ANALYZE outbox").unwrap();
}

/// The CPU time the process `pid` has used, user and system, in clock ticks.
pub(crate) fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_name = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of /proc/pid/stat, 12 and 13 after the name.
    fields
        .get(11)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
}

/// Each thread of `pid` with its CPU time so far, user and system, in clock ticks.
pub(crate) fn thread_ticks(pid: i32) -> Vec<(i32, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let tid: i32 = task.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            // utime and stime are fields 14 and 15 of the stat line, 12 and 13 after the name.
            let ticks =
                fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
            Some((tid, ticks))
        })
        .collect()
}

/// The CPU time the threads of `pid` used between `before` and `after` (both from
/// [`thread_ticks`]), per event of `events`, in microseconds: its main thread's, and its other
/// threads' together.
pub(crate) fn cpu_per_event(
    pid: i32,
    before: &[(i32, u64)],
    after: &[(i32, u64)],
    events: i64,
) -> (f64, f64) {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let used = |main: bool| -> f64 {
        let ticks: u64 = after
            .iter()
            .filter(|(tid, _)| (*tid == pid) == main)
            .map(|(tid, t)| t - before.iter().find(|(b, _)| b == tid).map_or(0, |(_, t)| *t))
            .sum();
        ticks as f64 / hz / events as f64 * 1e6
    };
    (used(true), used(false))
}

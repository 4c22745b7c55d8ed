//! pgbench runs against the bench's server: at a fixed rate, as fast as they go (with the
//! number of transactions they ran), and several scripts drawn at random in one run (with each
//! script's and each statement's latency).

use std::process::{Command, Output};

use crate::common::{bindir, Pg};

/// Runs pgbench with `script` at `rate` transactions a second for `seconds`; returns its tps.
pub(crate) fn pgbench_at_rate(pg: &Pg, script: &str, clients: u32, rate: u32, seconds: u32) -> f64 {
    run_pgbench(
        pg,
        script,
        clients,
        &["-R", &rate.to_string(), "-T", &seconds.to_string()],
    )
}

/// Runs pgbench with `script`, `clients` clients and threads, and `options`; returns its tps.
fn run_pgbench(pg: &Pg, script: &str, clients: u32, options: &[&str]) -> f64 {
    run_pgbench_counted(pg, script, clients, options).0
}

/// Runs pgbench with `clients` clients and threads, prepared statements and `options` on the
/// given scripts, each written to a file of its own; with several, every transaction is drawn
/// from them at random with equal weights.
fn pgbench_output(pg: &Pg, scripts: &[&str], clients: u32, options: &[&str]) -> Output {
    let paths: Vec<std::path::PathBuf> = scripts
        .iter()
        .enumerate()
        .map(|(n, script)| {
            let path =
                std::env::temp_dir().join(format!("outbox-bench-{}-{n}.sql", std::process::id()));
            std::fs::write(&path, script).unwrap();
            path
        })
        .collect();
    let mut command = Command::new(bindir().join("pgbench"));
    command
        .args(pg.client_args())
        .args(["-n", "-M", "prepared"])
        .args(["-c", &clients.to_string(), "-j", &clients.to_string()])
        .args(options);
    for path in &paths {
        command.arg("-f").arg(format!("{}@1", path.display()));
    }
    let out = command
        .arg("postgres")
        .output()
        .expect("cannot run pgbench");
    for path in &paths {
        let _ = std::fs::remove_file(path);
    }
    out
}

/// [`run_pgbench`], also returning the number of transactions it ran.
pub(crate) fn run_pgbench_counted(
    pg: &Pg,
    script: &str,
    clients: u32,
    options: &[&str],
) -> (f64, u64) {
    let out = pgbench_output(pg, &[script], clients, options);
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |prefix: &str, nth: usize| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.split_whitespace().nth(nth))
            .map(str::to_owned)
    };
    let tps = field("tps = ", 2).and_then(|v| v.parse().ok());
    let transactions = field("number of transactions actually processed:", 5)
        .and_then(|v| v.split('/').next().and_then(|n| n.parse().ok()));
    match (tps, transactions) {
        (Some(tps), Some(transactions)) => (tps, transactions),
        _ => panic!(
            "pgbench failed: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// One pgbench run in which each transaction is drawn at random from `scripts`, with equal
/// weights, so that every script meets the machine at the same moments: no drift between the
/// runs of one and of another. Returns, per script, its transactions' average latency and each
/// of its statements' average latency, in ms.
pub(crate) fn mixed_latencies(
    pg: &Pg,
    scripts: &[&str],
    clients: u32,
    seconds: u32,
) -> Vec<(f64, Vec<f64>)> {
    let out = pgbench_output(pg, scripts, clients, &["-r", "-T", &seconds.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let mut per_script: Vec<(f64, Vec<f64>)> = Vec::new();
    for line in text.lines() {
        if line.starts_with("SQL script ") {
            per_script.push((f64::NAN, Vec::new()));
        } else if let Some(current) = per_script.last_mut() {
            if let Some(rest) = line.strip_prefix(" - latency average = ") {
                current.0 = rest.split_whitespace().next().unwrap().parse().unwrap();
            } else if let Some(ms) = line
                .split_whitespace()
                .next()
                .filter(|_| line.starts_with("  "))
                .and_then(|first| first.parse::<f64>().ok())
            {
                current.1.push(ms);
            }
        }
    }
    assert!(
        per_script.len() == scripts.len() && per_script.iter().all(|(tx, _)| tx.is_finite()),
        "pgbench failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    per_script
}

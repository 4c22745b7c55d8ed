//! Metrics for Prometheus: Debian's `prometheus-postgres-exporter`, run with the shipped queries
//! file (`contrib/postgres_exporter.yml`) against a live server, serves the figures that
//! `outbox_status` and the relay's counters hold.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{enqueue_many, free_port, wait_until, Pg, Redis};

/// A running `postgres_exporter`, stopped when dropped.
struct Exporter {
    child: Child,
    port: u16,
}

impl Exporter {
    fn start(dsn: &str) -> Exporter {
        let program = std::env::var("OUTBOX_TEST_POSTGRES_EXPORTER")
            .unwrap_or_else(|_| "/usr/bin/prometheus-postgres-exporter".into());
        assert!(
            Path::new(&program).exists(),
            "{program} is missing: scripts/setup.sh installs Debian's prometheus-postgres-exporter"
        );
        let queries = common::repository().join("contrib/postgres_exporter.yml");
        let port = free_port();
        let child = Command::new(program)
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg(format!("--extend.query-path={}", queries.display()))
            .arg("--disable-default-metrics")
            .arg("--disable-settings-metrics")
            .arg("--log.level=warn")
            .env("DATA_SOURCE_NAME", dsn)
            .stdout(Stdio::null())
            .spawn()
            .expect("cannot start the exporter");
        Exporter { child, port }
    }

    /// The body of `GET /metrics`, by a plain HTTP/1.0 request; `None` until it answers 200.
    fn scrape(&self) -> Option<String> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.0 200")
            .then(|| body.to_string())
            .or_else(|| head.starts_with("HTTP/1.1 200").then(|| body.to_string()))
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One sample of the exposition format: its metric name, labels and value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

fn samples(body: &str) -> Vec<Sample> {
    body.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a sample without a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (key, value) = pair.split_once("=\"").expect("a label without a value");
                    (key.to_string(), value.trim_end_matches('"').to_string())
                })
                .collect();
            Sample {
                name: name.to_string(),
                labels,
                value: value.parse().expect("a value that is not a number"),
            }
        })
        .collect()
}

/// The value of the one sample named `name`.
fn value(samples: &[Sample], name: &str) -> f64 {
    let found: Vec<&Sample> = samples.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {found:?}");
    assert_eq!(found[0].labels["database"], "postgres", "{:?}", found[0]);
    found[0].value
}

/// Published, failed and dead-lettered events, a delayed one pending: the exporter's figures
/// are `outbox_status`'s and the relay's counts, labelled with the database, and each worker's
/// state is there.
#[test]
fn the_exporter_serves_what_outbox_status_says() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.poll_interval", "100ms"),
            ("outbox.max_attempts", "2"),
        ],
    );
    let mut client = pg.with_extension();
    client
        .batch_execute(
            "CREATE ROLE exporter LOGIN IN ROLE pg_monitor;
             GRANT SELECT ON outbox_metrics, outbox_workers TO exporter;",
        )
        .unwrap();
    pg.wait_for_workers(1);

    enqueue_many(&mut client, "orders", 5);
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("orders") == 5),
        "the events were not published"
    );
    // Redis rejects every event of this topic: each fails twice, then goes to outbox_dead.
    redis::cmd("HSET")
        .arg("rejected")
        .arg("f")
        .arg("v")
        .query::<i64>(&mut redis.conn())
        .unwrap();
    enqueue_many(&mut client, "rejected", 2);
    assert!(
        wait_until(Duration::from_secs(60), || {
            client
                .query_one("SELECT count(*) FROM outbox_dead", &[])
                .unwrap()
                .get::<_, i64>(0)
                == 2
        }),
        "the rejected events did not reach outbox_dead"
    );
    client
        .batch_execute("SELECT outbox_enqueue('later', '{}', deliver_after => '1 hour')")
        .unwrap();

    let exporter = Exporter::start(&format!(
        "postgresql://exporter@127.0.0.1:{}/postgres?sslmode=disable",
        pg.port
    ));
    let mut body = String::new();
    assert!(
        wait_until(Duration::from_secs(30), || {
            body = exporter.scrape().unwrap_or_default();
            body.contains("outbox_pending{")
        }),
        "the exporter served no outbox metrics: {body}"
    );
    let scraped = samples(&body);

    let status = client
        .query_one(
            "SELECT pending, dead, workers_running,
                    extract(epoch FROM now() - last_published_at)::float8
             FROM outbox_status",
            &[],
        )
        .unwrap();
    let (pending, dead, running, since): (i64, i64, i32, f64) =
        (status.get(0), status.get(1), status.get(2), status.get(3));
    assert_eq!((pending, dead, running), (1, 2, 1));
    assert_eq!(value(&scraped, "outbox_pending"), pending as f64);
    assert_eq!(value(&scraped, "outbox_dead"), dead as f64);
    assert_eq!(value(&scraped, "outbox_workers_running"), running as f64);
    assert_eq!(value(&scraped, "outbox_workers_wanted"), 1.0);
    // The delayed event is not due: nothing could have been published.
    assert_eq!(value(&scraped, "outbox_oldest_pending_seconds"), 0.0);
    let last = value(&scraped, "outbox_last_published_seconds");
    assert!(
        last >= 0.0 && last <= since + 1.0,
        "last publication {last} s ago, outbox_status says {since} s"
    );

    // Counters: every publication, every failed attempt (each one an attempt in outbox_dead),
    // every dead letter.
    assert_eq!(value(&scraped, "outbox_published_total"), 5.0);
    let attempts: i64 = client
        .query_one("SELECT sum(attempts)::bigint FROM outbox_dead", &[])
        .unwrap()
        .get(0);
    assert_eq!(attempts, 4);
    assert_eq!(value(&scraped, "outbox_failed_total"), attempts as f64);
    assert_eq!(value(&scraped, "outbox_dead_lettered_total"), 2.0);

    // Each worker, by slot, with its state.
    let workers: Vec<&Sample> = scraped
        .iter()
        .filter(|s| s.name == "outbox_worker_up")
        .collect();
    assert_eq!(workers.len(), 1, "{workers:?}");
    assert_eq!(workers[0].value, 1.0);
    assert_eq!(workers[0].labels["slot"], "0");
    let state: String = client
        .query_one("SELECT state FROM outbox_workers", &[])
        .unwrap()
        .get(0);
    assert!(
        ["idle", "publishing"].contains(&workers[0].labels["state"].as_str()),
        "{:?} (outbox_workers says {state})",
        workers[0]
    );

    // The counters go on after the exporter's scrape: two more published.
    enqueue_many(&mut client, "orders", 2);
    assert!(wait_until(Duration::from_secs(10), || {
        redis.xlen("orders") == 7
            && exporter
                .scrape()
                .is_some_and(|b| value(&samples(&b), "outbox_published_total") == 7.0)
    }));
}

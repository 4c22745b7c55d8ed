//! Redis as users run it: a cluster that fails over and reshards under the relay, a primary
//! behind Sentinel that is killed mid-drain, TLS with the test's own CA (and refusals of the
//! wrong CA, the wrong host name and a missing client certificate), and ACL users limited to
//! the stream prefix on a cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::thread;
use std::time::Duration;

use common::topology::{server_has_tls, tls_conn, tls_server, Certificates, Cluster, Sentinels};
use common::{enqueue_many, kill_between_publish_and_mark, password_file, wait_until, Client, Pg};

/// Enqueues `n` events numbered from `first`, spread over `topics` topics `t00`, `t01` ...;
/// records each event's id under its topic.
fn enqueue_spread(
    client: &mut Client,
    first: i64,
    n: i64,
    topics: i64,
    expected: &mut BTreeMap<String, Vec<i64>>,
) {
    let rows = client
        .query(
            "SELECT 't' || lpad((g % $3)::text, 2, '0') AS topic, \
                    outbox_enqueue('t' || lpad((g % $3)::text, 2, '0'), jsonb_build_object('n', g)) \
             FROM generate_series($1::bigint, $2::bigint) g",
            &[&first, &(first + n - 1), &topics],
        )
        .unwrap();
    for row in rows {
        expected
            .entry(row.get::<_, String>(0))
            .or_default()
            .push(row.get(1));
    }
}

/// Every expected id is in its stream; returns how many ids are there more than once.
fn check_streams(
    expected: &BTreeMap<String, Vec<i64>>,
    published: impl Fn(&str) -> Vec<i64>,
) -> usize {
    let mut twice = 0;
    for (stream, ids) in expected {
        let got = published(stream);
        let distinct: BTreeSet<i64> = got.iter().copied().collect();
        let want: BTreeSet<i64> = ids.iter().copied().collect();
        let missing: Vec<_> = want.difference(&distinct).take(10).collect();
        assert!(
            missing.is_empty(),
            "{stream}: {} of {} events never arrived, e.g. {missing:?}",
            want.difference(&distinct).count(),
            want.len()
        );
        let stray: Vec<_> = distinct.difference(&want).take(10).collect();
        assert!(stray.is_empty(), "{stream}: entries of no event: {stray:?}");
        twice += got.len() - distinct.len();
    }
    twice
}

/// The relay's log lines (those of its worker), for a look at what it said.
fn relay_log(pg: &Pg) -> Vec<String> {
    pg.log()
        .lines()
        .filter(|l| l.contains("outbox relay") || l.contains("outbox:"))
        .map(str::to_string)
        .collect()
}

/// A port handed to a server that has not bound it yet is free to the kernel, which may offer it
/// again: a cluster once got one port for two of its nodes, one of which never started, and a
/// primary with no replica made the relay's `WAIT 1` time out. No port goes out twice.
#[test]
fn the_harness_never_hands_out_a_port_twice() {
    let mut seen = BTreeSet::new();
    for _ in 0..500 {
        let port = common::free_port();
        assert!(seen.insert(port), "free_port handed out {port} twice");
        let port = common::topology::cluster_port();
        assert!(seen.insert(port), "cluster_port handed out {port} twice");
    }
}

#[test]
fn a_cluster_failover_and_a_reshard_during_the_drain_lose_nothing() {
    let mut cluster = Cluster::start(3);
    let urls = cluster.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "cluster"),
        ("outbox.redis_wait_replicas", "1"),
        ("outbox.redis_timeout", "2s"),
        ("outbox.batch_size", "1000"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = BTreeMap::new();
    let per_round = 5_000;
    let mut reshard = None;
    let mut killed = None;
    for round in 0..20 {
        enqueue_spread(&mut client, round * per_round, per_round, 50, &mut expected);
        match round {
            4 => {
                // The primary of the most slots dies; its replica takes over.
                let primaries = cluster.primaries();
                let (_, port, _) = primaries.iter().max_by_key(|p| p.2).unwrap().clone();
                cluster.node_on(port).kill();
                killed = Some(port);
                assert!(
                    wait_until(Duration::from_secs(30), || {
                        let now = cluster.primaries();
                        now.len() == 3 && now.iter().all(|p| p.1 != port)
                    }),
                    "no replica took over from the killed primary"
                );
            }
            8 => {
                // It comes back, empty, as the new primary's replica.
                cluster.node_on(killed.unwrap()).start_again();
                cluster.wait_ok();
                cluster.wait_replicas_in_sync();
            }
            10 => {
                // An operator moves 2,000 slots while the relay keeps publishing.
                let primaries = cluster.primaries();
                let from = primaries[0].0.clone();
                let to = primaries[1].0.clone();
                let seeds = cluster
                    .nodes
                    .iter()
                    .filter(|n| n.is_running())
                    .map(|n| n.port)
                    .next()
                    .unwrap();
                let mut watcher = pg.connect();
                let pending_then = pg.pending();
                assert!(pending_then > 0, "the drain was over before the reshard");
                reshard = Some(thread::spawn(move || {
                    // What the relay has published, and whether its worker has said it met
                    // moving slots (said once in the log per outage, shown in last_error).
                    let mut look = || -> (i64, bool) {
                        let row = watcher
                            .query_one(
                                "SELECT (SELECT count(*) FROM outbox \
                                         WHERE published_at IS NOT NULL), \
                                        (SELECT bool_or(last_error LIKE '%slots moved%') \
                                         FROM outbox_workers)",
                                &[],
                            )
                            .unwrap();
                        (row.get(0), row.get::<_, Option<bool>>(1).unwrap_or(false))
                    };
                    let (before, _) = look();
                    let started = std::time::Instant::now();
                    let mut child = std::process::Command::new("redis-cli")
                        .args(["--cluster", "reshard"])
                        .arg(format!("127.0.0.1:{seeds}"))
                        .args(["--cluster-from", &from, "--cluster-to", &to])
                        .args(["--cluster-slots", "2000", "--cluster-yes"])
                        .stdout(std::process::Stdio::null())
                        .spawn()
                        .expect("cannot run redis-cli");
                    let mut told = false;
                    let status = loop {
                        told |= look().1;
                        if let Some(status) = child.try_wait().unwrap() {
                            break status;
                        }
                        thread::sleep(Duration::from_millis(50));
                    };
                    assert!(status.success(), "the reshard failed");
                    let (after, moved) = look();
                    (after - before, told || moved, started.elapsed())
                }));
            }
            _ => {}
        }
        thread::sleep(Duration::from_millis(200));
    }
    let (published_during, told, took) = reshard.expect("no reshard").join().unwrap();
    eprintln!("{published_during} events were published during the reshard, which took {took:?}");
    // The relay met the moving slots: it published through them, or (a chunk redirected under
    // outbox.redis_wait_replicas is not marked) said so and backed off. A worker already backing
    // off since the failover says so in outbox_workers, not again in the log.
    assert!(
        published_during > 0
            || told
            || pg
                .worker_state()
                .1
                .is_some_and(|e| e.contains("slots moved"))
            || pg.log().contains("slots moved during the chunk"),
        "the relay never met the reshard; its worker now: {:?}",
        pg.worker_state()
    );
    assert!(
        wait_until(Duration::from_secs(180), || pg.pending() == 0),
        "{} events still pending; worker: {:?}",
        pg.pending(),
        pg.worker_state()
    );
    let twice = check_streams(&expected, |s| cluster.ids(s));
    assert_eq!(
        twice, 0,
        "with dedupe on and outbox.redis_wait_replicas = 1, no event may be published twice"
    );
    let dead: i64 = client
        .query_one("SELECT count(*) FROM outbox_dead", &[])
        .unwrap()
        .get(0);
    assert_eq!(dead, 0, "an event was buried over a failover");
    let log = relay_log(&pg);
    let warnings: Vec<_> = log.iter().filter(|l| l.contains("WARNING")).collect();
    eprintln!(
        "the relay's log over the failover and reshard:\n{}",
        log.join("\n")
    );
    assert!(
        warnings.len() <= 10,
        "the failover took {} warnings to tell: {warnings:#?}",
        warnings.len()
    );
}

/// A primary killed behind Sentinel while the relay drains, its entries CloudEvents: every event
/// is on the new primary, once.
#[test]
fn a_primary_killed_behind_sentinel_mid_drain_loses_nothing() {
    let mut redis = Sentinels::start();
    let urls = redis.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "sentinel"),
        ("outbox.redis_sentinel_master", Sentinels::MASTER),
        ("outbox.redis_wait_replicas", "1"),
        ("outbox.redis_timeout", "2s"),
        ("outbox.batch_size", "200"),
        ("outbox.poll_interval", "100ms"),
        // The entries as CloudEvents: the same over a failover.
        ("outbox.message_format", "cloudevents"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = BTreeMap::new();
    let old_primary = redis.primary.port;
    for round in 0..16 {
        enqueue_spread(&mut client, round * 2_000, 2_000, 4, &mut expected);
        if round == 4 {
            redis.primary.kill();
            let replica = redis.replica.port;
            assert!(
                wait_until(Duration::from_secs(60), || redis.primary_port()
                    == Some(replica)),
                "the sentinels did not promote the replica"
            );
            // Back, empty: the sentinels make it the new primary's replica.
            redis.primary.start_again();
        }
        thread::sleep(Duration::from_millis(200));
    }
    assert!(
        wait_until(Duration::from_secs(180), || pg.pending() == 0),
        "{} events still pending; worker: {:?}",
        pg.pending(),
        pg.worker_state()
    );
    // The primary now: the promoted replica, or (when a loaded machine made the sentinels fail
    // over once more) the old primary back in charge; either holds every acknowledged chunk.
    let now_primary = redis.primary_port().expect("the sentinels name no primary");
    eprintln!(
        "primary at the end: {}",
        if now_primary == old_primary {
            "the old one, after a second failover"
        } else {
            "the promoted replica"
        }
    );
    let new_primary = if now_primary == redis.replica.port {
        &redis.replica
    } else {
        &redis.primary
    };
    let twice = check_streams(&expected, |stream| new_primary.ids(stream));
    assert_eq!(twice, 0, "an event was published twice over the failover");
    let first: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg("t00")
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query(&mut new_primary.conn().unwrap())
        .unwrap();
    assert!(
        first[0].1.contains(&"ce_specversion".to_string()),
        "{first:?}"
    );
    let log = relay_log(&pg);
    eprintln!("the relay's log over the failover:\n{}", log.join("\n"));
}

/// Waits until the worker is in backoff with an error containing `needle`; returns the error.
fn backoff_with(pg: &Pg, needle: &str) -> String {
    let mut last = None;
    let found = wait_until(Duration::from_secs(30), || {
        let state = pg.worker_state();
        let hit = state.0 == "backoff"
            && state
                .1
                .as_deref()
                .is_some_and(|e| e.to_lowercase().contains(&needle.to_lowercase()));
        last = Some(state);
        hit
    });
    assert!(found, "no backoff mentioning '{needle}': {last:?}");
    last.unwrap().1.unwrap()
}

#[test]
fn tls_with_the_tests_ca_publishes_and_refuses_what_it_cannot_verify() {
    if !server_has_tls() {
        eprintln!("skipped: {} is built without TLS", common::redis_server());
        return;
    }
    let ca = Certificates::make("ours");
    let other = Certificates::make("theirs");
    let server = tls_server(&ca);
    let url = format!("rediss://127.0.0.1:{}", server.port);
    let (ca_file, cert_file, key_file) = (
        ca.file("ca.crt"),
        ca.file("client.crt"),
        ca.file("client.key"),
    );
    let mut pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_tls_ca_file", ca_file.as_str()),
        ("outbox.redis_tls_cert_file", cert_file.as_str()),
        ("outbox.redis_tls_key_file", key_file.as_str()),
        ("outbox.poll_interval", "100ms"),
        ("outbox.redis_timeout", "1s"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let xlen = || -> usize {
        redis::cmd("XLEN")
            .arg("orders")
            .query(&mut tls_conn(&ca.dir, server.port).unwrap())
            .unwrap()
    };
    let mut expected = enqueue_many(&mut client, "orders", 20);
    assert!(
        wait_until(Duration::from_secs(20), || xlen() == 20),
        "nothing arrived over TLS: {:?}",
        pg.worker_state()
    );

    // A CA that did not sign the server's certificate. The event goes in once the worker has
    // taken the setting: woken by its commit before the reload reached it, the worker published
    // it over the connection it had, verified with the right CA (seen once on PostgreSQL 16).
    let other_ca = other.file("ca.crt");
    let reloads = pg.log().matches("reloaded:").count();
    pg.set(&[("outbox.redis_tls_ca_file", other_ca.as_str())]);
    assert!(
        wait_until(Duration::from_secs(10), || pg
            .log()
            .matches("reloaded:")
            .count()
            > reloads),
        "the worker did not reload"
    );
    expected.extend(enqueue_many(&mut client, "orders", 1));
    let error = backoff_with(&pg, "certificate");
    eprintln!("another CA: {error}");

    // The right CA, but a host name the certificate does not name.
    let by_name = format!("rediss://localhost:{}", server.port);
    pg.set(&[
        ("outbox.redis_tls_ca_file", ca_file.as_str()),
        ("outbox.redis_url", by_name.as_str()),
    ]);
    let error = backoff_with(&pg, "name");
    eprintln!("another host name: {error}");

    // No client certificate, which the server asks for.
    pg.set(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_tls_cert_file", ""),
        ("outbox.redis_tls_key_file", ""),
    ]);
    let error = wait_for_error_change(&pg, &error);
    eprintln!("no client certificate: {error}");
    assert_eq!(
        xlen(),
        20,
        "an event went out over a connection that was refused"
    );

    // Everything right again: the waiting event goes out, once.
    pg.set(&[
        ("outbox.redis_tls_cert_file", cert_file.as_str()),
        ("outbox.redis_tls_key_file", key_file.as_str()),
    ]);
    assert!(
        wait_until(Duration::from_secs(30), || xlen() == 21),
        "the waiting event did not go out: {:?}",
        pg.worker_state()
    );
    let ids: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg("orders")
        .arg("-")
        .arg("+")
        .query(&mut tls_conn(&ca.dir, server.port).unwrap())
        .unwrap();
    let ids: Vec<i64> = ids.iter().map(|(_, f)| f[1].parse().unwrap()).collect();
    assert_eq!(ids, expected);
}

/// Waits until the worker is in backoff with an error other than `previous`.
fn wait_for_error_change(pg: &Pg, previous: &str) -> String {
    let mut last = None;
    let changed = wait_until(Duration::from_secs(30), || {
        let state = pg.worker_state();
        let hit = state.0 == "backoff" && state.1.as_deref().is_some_and(|e| e != previous);
        last = Some(state);
        hit
    });
    assert!(changed, "the worker's error did not change: {last:?}");
    last.unwrap().1.unwrap()
}

/// The README's least Redis user for a cluster, on every node, limited to the stream prefix:
/// events go out with dedupe on and off, and the worker meets no refusal.
#[test]
fn the_readme_minimal_cluster_user_publishes_with_and_without_dedupe() {
    let cluster = Cluster::start(3);
    let rules = "on >pw ~app:* +ping +hello +auth +cluster|slots +asking +wait +xadd +eval +hdel \
                 +hgetall +hset +pexpireat";
    for node in &cluster.nodes {
        let mut acl = redis::cmd("ACL");
        acl.arg("SETUSER").arg("relay");
        for rule in rules.split_whitespace() {
            acl.arg(rule);
        }
        node.query::<()>(&acl).unwrap();
    }
    let urls: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| format!("redis://relay@127.0.0.1:{}", n.port))
        .collect();
    let urls = urls.join(",");
    let file = password_file("pw");
    let mut pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.redis_mode", "cluster"),
        ("outbox.redis_wait_replicas", "1"),
        ("outbox.stream_prefix", "app:"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = BTreeMap::new();
    enqueue_spread(&mut client, 0, 2_000, 20, &mut expected);
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "with dedupe on, the minimal user's events were not published: {:?}",
        pg.worker_state()
    );
    pg.set(&[("outbox.dedupe", "off")]);
    assert!(wait_until(Duration::from_secs(20), || pg
        .log()
        .lines()
        .any(|l| l.contains("reloaded") && l.contains("dedupe=off"))));
    enqueue_spread(&mut client, 2_000, 2_000, 20, &mut expected);
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "with dedupe off, the minimal user's events were not published: {:?}",
        pg.worker_state()
    );
    let prefixed: BTreeMap<String, Vec<i64>> = expected
        .into_iter()
        .map(|(topic, ids)| (format!("app:{topic}"), ids))
        .collect();
    assert_eq!(check_streams(&prefixed, |s| cluster.ids(s)), 0);
    assert!(!pg.log().contains("NOPERM"), "the worker met a refusal");
}

/// Exactly once on a cluster: the worker is killed between publishing a batch and marking it,
/// three times per stream, for streams whose keys carry hash tags of their own, braces without
/// a tag, and none. The killed batches were in Redis and unmarked, so the next worker publishes
/// them again; only their markers, in their streams' slots, keep them from being added twice.
/// The entries are CloudEvents (`outbox.message_format`).
#[test]
fn on_a_cluster_markers_absorb_the_batches_of_killed_workers() {
    let cluster = Cluster::start(3);
    let urls = cluster.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "cluster"),
        ("outbox.batch_size", "100"),
        ("outbox.poll_interval", "100ms"),
        // The entries as CloudEvents: the dedupe the same.
        ("outbox.message_format", "cloudevents"),
    ]);
    pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for stream in ["plain", "{tenant-7}:orders", "a}b{", "x{}y"] {
        for _ in 0..3 {
            let ids =
                kill_between_publish_and_mark(&pg, || cluster.xlen(stream), stream, 300, || {});
            expected.entry(stream.to_string()).or_default().extend(ids);
        }
    }
    assert!(
        wait_until(Duration::from_secs(60), || pg.pending() == 0),
        "backlog not drained: {:?}",
        pg.worker_state()
    );
    let twice = check_streams(&expected, |s| cluster.ids(s));
    assert_eq!(twice, 0, "a killed worker's batch was added twice");
    let first: Vec<(String, Vec<String>)> = cluster
        .run(
            redis::cmd("XRANGE")
                .arg("plain")
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1),
        )
        .unwrap();
    assert!(
        first[0].1.contains(&"ce_specversion".to_string()),
        "{first:?}"
    );
}

/// A primary demoted under the relay (`SENTINEL FAILOVER`) answers its writes with READONLY:
/// the relay asks the sentinels again and goes on with the new primary, and no event is charged
/// for it.
/// Sentinels that require a password of their own, in front of a primary that requires
/// another: the relay reads each from its file (`outbox.redis_sentinel_password_file`,
/// `outbox.redis_password_file`), and without the sentinels' it says it cannot ask them.
#[test]
fn sentinels_and_their_primary_take_passwords_from_files() {
    let sentinels = Sentinels::start_secured(Some("primary-s3cret"), Some("sentinel-s3cret"));
    let urls = sentinels.urls();
    let primary_file = password_file("primary-s3cret");
    let mut pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "sentinel"),
        ("outbox.redis_sentinel_master", Sentinels::MASTER),
        ("outbox.redis_password_file", primary_file.as_str()),
        ("outbox.redis_timeout", "1s"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let ids = enqueue_many(&mut client, "guarded", 5);
    assert!(
        wait_until(Duration::from_secs(20), || pg.worker_state().0 == "backoff"),
        "{:?}",
        pg.worker_state()
    );
    let error = pg.worker_state().1.unwrap_or_default();
    assert!(error.contains("sentinel"), "{error}");
    assert_eq!(sentinels.primary.ids("guarded"), Vec::<i64>::new());

    let sentinel_file = password_file("sentinel-s3cret");
    pg.set(&[(
        "outbox.redis_sentinel_password_file",
        sentinel_file.as_str(),
    )]);
    assert!(
        wait_until(Duration::from_secs(30), || sentinels.primary.ids("guarded")
            == ids),
        "{:?}",
        pg.worker_state()
    );
    assert!(!pg.log().contains("s3cret"), "{}", pg.log());
}

#[test]
fn a_demoted_primary_sends_the_relay_back_to_the_sentinels() {
    let redis = Sentinels::start();
    let urls = redis.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "sentinel"),
        ("outbox.redis_sentinel_master", Sentinels::MASTER),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut expected = BTreeMap::new();
    enqueue_spread(&mut client, 0, 500, 1, &mut expected);
    assert!(wait_until(Duration::from_secs(20), || pg.pending() == 0));
    let _: () = redis.sentinels[0]
        .query(
            redis::cmd("SENTINEL")
                .arg("FAILOVER")
                .arg(Sentinels::MASTER),
        )
        .unwrap();
    let new_primary = redis.replica.port;
    assert!(
        wait_until(Duration::from_secs(30), || {
            redis.primary_port() == Some(new_primary)
                && redis
                    .primary
                    .query::<Vec<redis::Value>>(&redis::cmd("ROLE"))
                    .is_ok_and(|r| r.first() == Some(&redis::Value::BulkString(b"slave".to_vec())))
        }),
        "the sentinels did not swap the primary and its replica"
    );
    for round in 1..6 {
        enqueue_spread(&mut client, round * 500, 500, 1, &mut expected);
        thread::sleep(Duration::from_millis(100));
    }
    assert!(
        wait_until(Duration::from_secs(60), || pg.pending() == 0),
        "the relay did not follow the new primary: {:?}",
        pg.worker_state()
    );
    let twice = check_streams(&expected, |stream| redis.replica.ids(stream));
    assert_eq!(twice, 0);
    let charged: i64 = client
        .query_one("SELECT count(*) FROM outbox WHERE attempts > 0", &[])
        .unwrap()
        .get(0);
    assert_eq!(charged, 0, "events were charged for a demoted primary");
    eprintln!("the relay's log:\n{}", relay_log(&pg).join("\n"));
}

/// With dedupe off on a cluster, the events Redis refuses (their stream key holds a string) are
/// charged alone: the events beside them in the chunk are added once, not again when the chunk
/// is taken apart. The refused events have no key, so those of the topic after the first ones
/// tried wait for them, uncharged.
#[test]
fn on_a_cluster_a_refused_event_costs_its_neighbours_no_duplicate() {
    let cluster = Cluster::start(3);
    let urls = cluster.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "cluster"),
        ("outbox.dedupe", "off"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut set = cluster.conn();
    let _: () = redis::cmd("SET")
        .arg("poison")
        .arg("x")
        .query(&mut set)
        .unwrap();
    let rows = client
        .query(
            "SELECT CASE WHEN g % 10 = 0 THEN 'poison' ELSE 'fine' || (g % 7) END AS topic, \
                    outbox_enqueue(CASE WHEN g % 10 = 0 THEN 'poison' ELSE 'fine' || (g % 7) END, \
                                   jsonb_build_object('n', g)) \
             FROM generate_series(1, 500) g",
            &[],
        )
        .unwrap();
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in rows {
        let topic: String = row.get(0);
        if topic != "poison" {
            expected.entry(topic).or_default().push(row.get(1));
        }
    }
    assert!(
        wait_until(Duration::from_secs(30), || {
            let charged: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox WHERE topic = 'poison' AND attempts > 0",
                    &[],
                )
                .unwrap()
                .get(0);
            charged > 0
                && expected
                    .iter()
                    .all(|(stream, ids)| cluster.xlen(stream) >= ids.len())
        }),
        "the refused events were not charged, or the others not published: {:?}",
        pg.worker_state()
    );
    let twice = check_streams(&expected, |s| cluster.ids(s));
    assert_eq!(twice, 0, "events beside a refused one were added twice");
    let (tried, waiting): (i64, i64) = client
        .query_one(
            "SELECT count(*) FILTER (WHERE attempts > 0), count(*) FILTER (WHERE attempts = 0) \
             FROM outbox WHERE topic = 'poison'",
            &[],
        )
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!(tried + waiting, 50);
    let marked: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE topic = 'poison' AND published_at IS NOT NULL",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(marked, 0, "a refused event was marked published");
}

/// On a cluster with IDMP, an `XADD` to a stream deleted meanwhile answers nil (the relay adds
/// with `NOMKSTREAM`): the event is not in its stream, and must not be marked published. When
/// another event of the round trip is refused (its stream key holds a string), redis-rs keeps
/// only the errors of the pipeline; the nil reply must still be told from an added entry. The
/// event goes out once its stream is back. With markers (older servers) nothing is missing to
/// begin with, and the same holds.
#[test]
fn on_a_cluster_an_event_whose_stream_was_deleted_is_published_once_it_is_back() {
    let cluster = Cluster::start(3);
    let urls = cluster.urls();
    let pg = Pg::start(&[
        ("outbox.redis_url", urls.as_str()),
        ("outbox.redis_mode", "cluster"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let first: i64 = client
        .query_one("SELECT outbox_enqueue('orders', '{}')", &[])
        .unwrap()
        .get(0);
    assert!(wait_until(Duration::from_secs(20), || cluster
        .xlen("orders")
        == 1));
    let mut conn = cluster.conn();
    let _: () = redis::cmd("SET")
        .arg("bad")
        .arg("x")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("DEL").arg("orders").query(&mut conn).unwrap();
    let second: i64 = {
        let mut tx = client.transaction().unwrap();
        tx.batch_execute("SELECT outbox_enqueue('bad', '{}')")
            .unwrap();
        let id = tx
            .query_one("SELECT outbox_enqueue('orders', '{}')", &[])
            .unwrap()
            .get(0);
        tx.commit().unwrap();
        id
    };
    // The marks are read before the stream: an event the relay publishes and marks between the
    // two reads is then in the stream read, not marked and missing from an older one.
    let published_but_missing = |client: &mut Client| -> Vec<i64> {
        let marked: Vec<i64> = client
            .query(
                "SELECT id FROM outbox WHERE topic = 'orders' AND published_at IS NOT NULL \
                 ORDER BY id",
                &[],
            )
            .unwrap()
            .iter()
            .map(|row| row.get::<_, i64>(0))
            .collect();
        let stream: Vec<i64> = cluster.ids("orders");
        marked
            .into_iter()
            .filter(|id| *id != first && !stream.contains(id))
            .collect()
    };
    assert!(
        wait_until(Duration::from_secs(20), || {
            assert_eq!(
                published_but_missing(&mut client),
                Vec::<i64>::new(),
                "marked published, and not in its stream (IDMP: {})",
                cluster.has_idmp()
            );
            cluster.ids("orders") == [second]
        }),
        "the event never reached its stream again: {:?}",
        cluster.ids("orders")
    );
}

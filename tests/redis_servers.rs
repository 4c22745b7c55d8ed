//! What the relay makes of the Redis it writes to, against the `redis-server` the tests start
//! (`OUTBOX_TEST_REDIS_SERVER` names another: scripts/test.sh runs these against Redis 6.2,
//! 7.0, 8.6 and Valkey 9.1). `outbox.dedupe = auto` deduplicates with Redis's IDMP where the
//! server has it (8.6.2+) and with markers elsewhere, and `outbox_workers` says which; `idmp`
//! waits, uncharged, where the server lacks it. `outbox.stream_trim_acked` keeps what a consumer
//! group has not acknowledged where the server can (8.2+), and elsewhere says so once and trims
//! as without it. Each test asserts what its server must do.

use std::time::Duration;

use common::{enqueue_many, wait_until, Pg, Redis};

/// A stream entry as XREADGROUP returns it: its id and its fields.
type Entry = (String, Vec<(String, String)>);

fn dedupe_shown(pg: &Pg) -> Option<String> {
    pg.query_retrying("SELECT dedupe FROM outbox_workers")
        .first()
        .and_then(|r| r.get::<_, Option<String>>(0))
}

#[test]
fn outbox_workers_shows_how_the_worker_dedupes() {
    let redis = Redis::start();
    let mut pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let ids = enqueue_many(&mut client, "shown", 5);
    assert!(wait_until(Duration::from_secs(20), || redis.ids("shown") == ids));
    let expected = if redis.has_idmp() { "idmp" } else { "markers" };
    assert!(
        wait_until(Duration::from_secs(10), || dedupe_shown(&pg).as_deref()
            == Some(expected)),
        "outbox_workers.dedupe is {:?} on {:?}, not {expected}",
        dedupe_shown(&pg),
        redis.version()
    );
    assert!(pg.log().contains(if redis.has_idmp() {
        "deduplicating with Redis's IDMP; writing to Redis 8."
    } else {
        "deduplicating with markers; writing to "
    }));
    let markers: Vec<String> = redis.query(redis::cmd("KEYS").arg("outbox:dedupe:*"));
    assert_eq!(
        markers.is_empty(),
        redis.has_idmp(),
        "marker keys: {markers:?}"
    );

    pg.set(&[("outbox.dedupe", "off")]);
    assert!(wait_until(Duration::from_secs(20), || pg
        .log()
        .contains("dedupe=off")));
    let more = enqueue_many(&mut client, "shown", 1);
    assert!(wait_until(Duration::from_secs(20), || redis.xlen("shown") == 6));
    assert_eq!(redis.ids("shown")[5..], more[..]);
    assert!(wait_until(Duration::from_secs(10), || dedupe_shown(&pg)
        .as_deref()
        == Some("off")));

    // Asked for by name where the server lacks it: nothing goes out, nothing is charged.
    pg.set(&[("outbox.dedupe", "idmp")]);
    assert!(wait_until(Duration::from_secs(20), || pg
        .log()
        .contains("dedupe=idmp")));
    let last = enqueue_many(&mut client, "shown", 3);
    if redis.has_idmp() {
        assert!(wait_until(Duration::from_secs(20), || redis.xlen("shown") == 9));
        assert_eq!(redis.ids("shown")[6..], last[..]);
        assert_eq!(dedupe_shown(&pg).as_deref(), Some("idmp"));
    } else {
        assert!(
            wait_until(Duration::from_secs(20), || {
                let (state, error) = pg.worker_state();
                state == "backoff" && error.is_some_and(|e| e.contains("needs Redis 8.6.2"))
            }),
            "the worker did not back off saying why"
        );
        assert_eq!(redis.xlen("shown"), 6);
        let charged: i64 = client
            .query_one("SELECT count(*) FROM outbox WHERE attempts > 0", &[])
            .unwrap()
            .get(0);
        assert_eq!(charged, 0, "events were charged for the server's version");
        pg.set(&[("outbox.dedupe", "auto")]);
        assert!(wait_until(Duration::from_secs(30), || redis.xlen("shown") == 9));
        assert_eq!(redis.ids("shown")[6..], last[..]);
    }
}

/// With `stream_maxlen = 1000` and a consumer group that has read nothing, 20,000 events stay
/// in the stream; once the group has acknowledged them, the next events trim it back near 1,000.
/// Where the server cannot trim so, it is trimmed as before and the log says why, once.
#[test]
fn trimming_keeps_what_a_consumer_group_has_not_acknowledged() {
    let redis = Redis::start();
    let _: () = redis.query(
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg("kept")
            .arg("readers")
            .arg("$")
            .arg("MKSTREAM"),
    );
    let pg = Pg::relaying_to(
        &redis,
        &[
            ("outbox.stream_maxlen", "1000"),
            ("outbox.stream_trim_acked", "on"),
            ("outbox.batch_size", "1000"),
        ],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut client, "kept", 20_000);
    assert!(wait_until(Duration::from_secs(120), || pg.pending() == 0));
    let warned = "outbox.stream_trim_acked needs Redis 8.2 or later";
    if !redis.has_acked_trimming() {
        assert!(
            redis.xlen("kept") < 2_000,
            "not trimmed: {}",
            redis.xlen("kept")
        );
        assert_eq!(pg.log().matches(warned).count(), 1, "{}", pg.log());
        return;
    }
    assert!(!pg.log().contains(warned));
    assert_eq!(redis.xlen("kept"), 20_000, "unread entries were trimmed");
    // The group reads and acknowledges everything.
    let read: Vec<(String, Vec<Entry>)> = redis.query(
        redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("readers")
            .arg("r1")
            .arg("COUNT")
            .arg(50_000)
            .arg("STREAMS")
            .arg("kept")
            .arg(">"),
    );
    let entry_ids: Vec<&String> = read[0].1.iter().map(|(id, _)| id).collect();
    assert_eq!(entry_ids.len(), 20_000);
    assert_eq!(
        redis.xlen("kept"),
        20_000,
        "read but unacknowledged entries were trimmed"
    );
    let mut ack = redis::cmd("XACK");
    ack.arg("kept").arg("readers").arg(&entry_ids);
    let acked: i64 = redis.query(&ack);
    assert_eq!(acked, 20_000);
    enqueue_many(&mut client, "kept", 10);
    assert!(wait_until(Duration::from_secs(20), || pg.pending() == 0));
    let left = redis.xlen("kept");
    assert!(
        (1_000..1_200).contains(&left),
        "{left} entries after acknowledging them all"
    );
}

/// The README's rules for a Redis user that deduplicates with IDMP (the `off` set and the IDMP
/// additions), limited to the stream prefix: events go out with IDMP and no refusal. Only a
/// server with IDMP can show it.
#[test]
fn the_readme_redis_user_for_idmp_publishes_with_idmp() {
    let redis = Redis::start();
    if !redis.has_idmp() {
        eprintln!("skipped: {:?} has no IDMP", redis.version());
        return;
    }
    let (url, file) = redis
        .relay_user("~app:* +ping +hello +auth +select +xadd +info +eval +exists +xinfo +xcfgset");
    let pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_password_file", file.as_str()),
        ("outbox.stream_prefix", "app:"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let ids = enqueue_many(&mut client, "orders", 150);
    assert!(
        wait_until(Duration::from_secs(30), || redis.ids("app:orders") == ids),
        "not published: {:?}",
        pg.worker_state()
    );
    assert_eq!(dedupe_shown(&pg).as_deref(), Some("idmp"));
    assert!(!pg.log().contains("NOPERM"), "{}", pg.log());
    let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("*"));
    assert_eq!(keys, ["app:orders"]);
}

/// Redis upgraded in place to a server with IDMP while a chunk is in doubt: the relay sent it
/// with markers, Redis ran it (and kept it, `appendfsync always`), and the reply never came back
/// (the proxy swallowed it) before the old server was killed. On the new server `auto` would
/// choose IDMP, which does not see the markers: the chunk goes again with markers, and IDMP
/// waits until a commit has put its events in the stream. Every event is in its stream once.
/// Needs a server with IDMP as `OUTBOX_TEST_REDIS_SERVER` (the upgrade's target) and Debian's
/// Redis 7.0 as `redis-server` (its source); the other runs of the matrix say so and pass.
#[test]
fn an_upgrade_to_idmp_with_a_chunk_in_doubt_publishes_it_once() {
    upgrade_under_a_chunk_in_doubt("upgraded", |_, _| {});
}

/// As above, but the first pass on the new server sends only part of the chunk in doubt again:
/// the relay rolled back while Redis was down, and a reload made the batch smaller (later events
/// of other keys, a late commit below the chunk or a key held back do the same). The rest of the
/// chunk is still in doubt after that pass's commit: it goes with markers too, not with IDMP,
/// which cannot see what markers recorded on the old server. Needs what the test above needs.
#[test]
fn an_upgrade_to_idmp_with_a_chunk_in_doubt_larger_than_the_next_batch_publishes_it_once() {
    upgrade_under_a_chunk_in_doubt("shrunk", |redis, pg| {
        redis.stop();
        assert!(
            wait_until(Duration::from_secs(20), || pg.log().contains("lost Redis")),
            "the relay did not notice that Redis was gone"
        );
        pg.set(&[("outbox.batch_size", "10")]);
        assert!(wait_until(Duration::from_secs(20), || {
            pg.log()
                .lines()
                .any(|l| l.contains("reloaded") && l.contains("batch_size=10 "))
        }));
    });
}

/// Redis 7.0, keeping what it acknowledged, behind a proxy; a relay on it through the proxy, with
/// one event of `stream` published with markers, then a chunk of 40 in doubt: Redis ran it and
/// the proxy swallows the replies. Then `meanwhile`, Redis upgraded in place to the server with
/// IDMP, and the replies let through again: every event is in its stream once, and the relay
/// ends up on IDMP. Where the servers cannot show it, says so and returns.
fn upgrade_under_a_chunk_in_doubt(stream: &str, meanwhile: impl FnOnce(&mut Redis, &mut Pg)) {
    let Some(target) = common::idmp_upgrade_target() else {
        eprintln!(
            "not run: needs redis-server without IDMP and OUTBOX_TEST_REDIS_SERVER ({}) with it",
            common::redis_server()
        );
        return;
    };
    let mut redis = Redis::start_program(
        "redis-server",
        &["--appendonly", "yes", "--appendfsync", "always"],
    );
    let proxy = common::proxy::Proxy::start(redis.port);
    let url = proxy.url();
    let mut pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_timeout", "1s"),
        ("outbox.poll_interval", "100ms"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut ids = enqueue_many(&mut client, stream, 1);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen(stream) == 1));
    assert_eq!(dedupe_shown(&pg).as_deref(), Some("markers"));

    proxy.swallow_replies(true);
    ids.extend(enqueue_many(&mut client, stream, 40));
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen(stream) == 41),
        "the chunk did not reach Redis"
    );
    meanwhile(&mut redis, &mut pg);
    redis.upgrade_to(&target);
    proxy.swallow_replies(false);
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the chunk was not published again after the upgrade"
    );
    ids.extend(enqueue_many(&mut client, stream, 5));
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
    assert_eq!(redis.ids(stream), ids, "the chunk in doubt went out twice");
    assert!(
        wait_until(Duration::from_secs(10), || dedupe_shown(&pg).as_deref()
            == Some("idmp")),
        "the relay did not switch to IDMP: {:?}",
        dedupe_shown(&pg)
    );
}

/// A relay deduplicating as `dedupe` says, through a proxy, to a Redis with IDMP that keeps what
/// it acknowledged, with one event of `stream` published and then a chunk of 40 in doubt: Redis
/// ran it and the proxy swallows the replies. `None` where the server has no IDMP (the test
/// says so and passes). Returns the servers, a client and the 41 ids.
fn a_chunk_in_doubt(
    stream: &str,
    dedupe: &str,
) -> Option<(Redis, common::proxy::Proxy, Pg, postgres::Client, Vec<i64>)> {
    let redis = Redis::start_with_args(&["--appendonly", "yes", "--appendfsync", "always"]);
    if !redis.has_idmp() {
        eprintln!("not run: {} has no IDMP", common::redis_server());
        return None;
    }
    let proxy = common::proxy::Proxy::start(redis.port);
    let url = proxy.url();
    let pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_timeout", "1s"),
        ("outbox.poll_interval", "100ms"),
        ("outbox.dedupe", dedupe),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut ids = enqueue_many(&mut client, stream, 1);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen(stream) == 1));
    proxy.swallow_replies(true);
    ids.extend(enqueue_many(&mut client, stream, 40));
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen(stream) == 41),
        "the chunk did not reach Redis"
    );
    Some((redis, proxy, pg, client, ids))
}

/// `outbox.dedupe` switched from IDMP to markers by a reload while a chunk sent with IDMP is in
/// doubt (Redis ran it, the proxy swallowed the reply): markers would not see IDMP's record, so
/// the chunk goes again with IDMP, and markers wait until a commit has put its events in the
/// stream. Every event is in its stream once. Needs a server with IDMP; on the others the test
/// says so and passes.
#[test]
fn a_reload_to_markers_with_an_idmp_chunk_in_doubt_publishes_it_once() {
    let Some((redis, proxy, mut pg, mut client, mut ids)) = a_chunk_in_doubt("switched", "auto")
    else {
        return;
    };
    assert_eq!(dedupe_shown(&pg).as_deref(), Some("idmp"));
    set_dedupe(&mut pg, "markers");
    proxy.swallow_replies(false);
    proxy.cut();
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the chunk was not published again after the reload"
    );
    ids.extend(enqueue_many(&mut client, "switched", 5));
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
    assert_eq!(
        redis.ids("switched"),
        ids,
        "the chunk in doubt went out twice"
    );
    assert!(
        wait_until(Duration::from_secs(10), || dedupe_shown(&pg).as_deref()
            == Some("markers")),
        "the relay did not switch to markers after the commit: {:?}",
        dedupe_shown(&pg)
    );
}

/// A worker killed while a chunk it sent with markers is in doubt (Redis ran it, the proxy
/// swallowed the reply), and `outbox.dedupe` switched to IDMP before the new process sends the
/// chunk again: that process does not know how the chunk went. Where Redis has IDMP, markers
/// record each event's IDMP identity too, so the chunk sent again with IDMP adds nothing twice.
/// Needs a server with IDMP; on the others the test says so and passes.
#[test]
fn a_chunk_in_doubt_across_a_worker_crash_and_a_switch_goes_out_once() {
    let Some((redis, proxy, mut pg, _, mut ids)) = a_chunk_in_doubt("crossed", "markers") else {
        return;
    };
    assert_eq!(dedupe_shown(&pg).as_deref(), Some("markers"));
    set_dedupe(&mut pg, "auto");
    let pid = *pg.worker_pids().first().expect("no worker");
    pg.kill9(pid);
    proxy.swallow_replies(false);
    let mut client = pg.connect();
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the chunk was not published again after the crash"
    );
    ids.extend(enqueue_many(&mut client, "crossed", 5));
    assert!(wait_until(Duration::from_secs(10), || pg.pending() == 0));
    assert_eq!(
        dedupe_shown(&pg).as_deref(),
        Some("idmp"),
        "the new process did not take IDMP"
    );
    assert_eq!(
        redis.ids("crossed"),
        ids,
        "the chunk in doubt went out twice"
    );
}

/// The IDMP window of `stream` (`idmp-maxsize`, the ids it keeps per producer), as XINFO says.
fn idmp_window(redis: &Redis, stream: &str) -> Option<i64> {
    let info: Vec<redis::Value> = redis.query(redis::cmd("XINFO").arg("STREAM").arg(stream));
    info.chunks(2).find_map(|pair| match pair {
        [redis::Value::BulkString(name), redis::Value::Int(size)] if name == b"idmp-maxsize" => {
            Some(*size)
        }
        [redis::Value::SimpleString(name), redis::Value::Int(size)] if name == "idmp-maxsize" => {
            Some(*size)
        }
        _ => None,
    })
}

/// A stream deleted while the relay deduplicates with markers, which Redis's IDMP records too,
/// is made again by the markers' script. It must get the IDMP window then: a connection that
/// finds it too small later sets it (`XCFGSET`), which forgets the ids the stream holds, and a
/// chunk in doubt sent again on that connection with IDMP goes in twice (as a Sentinel failover
/// did in the faults campaign, seed 639397397). Needs a server with IDMP.
#[test]
fn a_stream_made_again_by_markers_gets_its_idmp_window() {
    let redis = Redis::start();
    if !redis.has_idmp() {
        eprintln!("not run: {} has no IDMP", common::redis_server());
        return;
    }
    let proxy = common::proxy::Proxy::start(redis.port);
    let url = proxy.url();
    let mut pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_timeout", "1s"),
        ("outbox.poll_interval", "100ms"),
        ("outbox.dedupe", "markers"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    enqueue_many(&mut client, "remade", 1);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("remade") == 1));
    assert_eq!(idmp_window(&redis, "remade"), Some(10_000));
    let _: i64 = redis.query(redis::cmd("DEL").arg("remade"));
    let mut ids = enqueue_many(&mut client, "remade", 5);
    assert!(wait_until(Duration::from_secs(10), || redis.xlen("remade") == 5));

    // With IDMP now, a chunk in doubt (Redis ran it, the reply was lost), sent again on a new
    // connection.
    set_dedupe(&mut pg, "idmp");
    proxy.swallow_replies(true);
    ids.extend(enqueue_many(&mut client, "remade", 40));
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen("remade") == 45),
        "the chunk did not reach Redis"
    );
    assert!(wait_until(Duration::from_secs(10), || pg
        .log()
        .contains("lost Redis")));
    proxy.swallow_replies(false);
    proxy.cut();
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the chunk was not published again: {}",
        pg.log()
    );
    assert_eq!(
        redis.ids("remade"),
        ids,
        "the chunk in doubt went out twice"
    );
    assert_eq!(idmp_window(&redis, "remade"), Some(10_000));
}

/// Sets `outbox.dedupe` by a reload and waits until the worker has taken it.
fn set_dedupe(pg: &mut Pg, dedupe: &str) {
    pg.set(&[("outbox.dedupe", dedupe)]);
    let reloaded = format!("dedupe={dedupe}");
    assert!(wait_until(Duration::from_secs(20), || {
        pg.log()
            .lines()
            .any(|l| l.contains("reloaded") && l.contains(&reloaded))
    }));
}

/// Sets Redis's `maxmemory` (`"1"`: full from the next write; `"0"`: no limit).
fn set_maxmemory(redis: &Redis, bytes: &str) {
    let _: String = redis.query(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(bytes));
}

/// Waits until nothing is pending, then checks that `stream` holds `ids`, once each, in order.
fn published_in_order(pg: &Pg, redis: &Redis, stream: &str, ids: &[i64]) {
    assert!(
        wait_until(Duration::from_secs(30), || pg.pending() == 0),
        "the events were not published once Redis took writes: {}",
        pg.log()
    );
    assert_eq!(redis.ids(stream), ids, "the key's events are out of order");
}

/// Memory full when a round trip begins and freed in its middle: Redis refuses the commands it
/// reads first (OOM) and runs those that arrive after. The proxy stops the relay's commands in
/// the middle of one key's events while the test frees the memory. A stream's share of a chunk
/// is one command whatever the dedupe method, so that no later event of a key is in the stream
/// before an earlier one that goes again once Redis takes writes.
#[test]
fn memory_freed_in_the_middle_of_a_round_trip_keeps_each_key_in_order() {
    memory_freed_in_the_middle_of_a_round_trip("auto");
}

/// The same without dedupe, whose round trip was one `XADD` per event: Redis refused the first
/// twenty and took the next twenty, which then reached the stream twice, the first time before
/// the twenty. A user who may run `EVAL` now sends a stream's share as one call of `add.lua`.
#[test]
fn memory_freed_in_the_middle_of_a_round_trip_keeps_each_key_in_order_with_dedupe_off() {
    memory_freed_in_the_middle_of_a_round_trip("off");
}

fn memory_freed_in_the_middle_of_a_round_trip(dedupe: &str) {
    let redis = Redis::start();
    let proxy = common::proxy::Proxy::start(redis.port);
    let url = proxy.url();
    let pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_timeout", "2s"),
        ("outbox.poll_interval", "100ms"),
        ("outbox.dedupe", dedupe),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let mut ids = enqueue_many(&mut client, "ordered", 1);
    assert!(wait_until(Duration::from_secs(10), || redis
        .xlen("ordered")
        == 1));

    proxy.stop_commands_at("stop-here");
    set_maxmemory(&redis, "1");
    // One key's 40 events in one transaction, the 21st carrying the text the proxy stops at.
    let rows = client
        .query(
            "SELECT outbox_enqueue('ordered', jsonb_build_object('n', g, 'at', \
             CASE WHEN g = 21 THEN 'stop-here' END), key => 'k') \
             FROM generate_series(1, 40) g",
            &[],
        )
        .unwrap();
    ids.extend(rows.iter().map(|r| r.get::<_, i64>(0)));
    assert!(
        wait_until(Duration::from_secs(10), || proxy.stopped()),
        "the chunk did not reach the proxy"
    );
    // What came before the text reached Redis while its memory was full.
    set_maxmemory(&redis, "0");
    proxy.go_on();
    published_in_order(&pg, &redis, "ordered", &ids);
}

/// Memory full, and an earlier round trip that Redis ran but whose transaction rolled back (its
/// reply lost): the next round trip finds the first events of a key already added (their
/// markers) and Redis refuses the rest (OOM). Redis lets a script write once it has written, and
/// taking over the found events' markers is a write that memory does not refuse: a script that
/// went on after a refused event would add the key's events of its next shard of ids, before the
/// refused ones. The key's events span two shards of 64 ids (1 published first, which also
/// gives the stream its IDMP window where Redis has IDMP, 5 in the round trip lost, 200 after).
#[test]
fn memory_full_after_a_lost_round_trip_keeps_each_key_in_order() {
    let redis = Redis::start();
    let proxy = common::proxy::Proxy::start(redis.port);
    let url = proxy.url();
    let pg = Pg::start(&[
        ("outbox.redis_url", url.as_str()),
        ("outbox.redis_timeout", "1s"),
        ("outbox.poll_interval", "100ms"),
        ("outbox.batch_size", "1000"),
        ("outbox.dedupe", "markers"),
    ]);
    let mut client = pg.with_extension();
    pg.wait_for_workers(1);
    let keyed = |client: &mut postgres::Client, n: i64| -> Vec<i64> {
        client
            .query(
                "SELECT outbox_enqueue('ordered', jsonb_build_object('n', g), key => 'k') \
                 FROM generate_series(1, $1::bigint) g",
                &[&n],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };

    let mut ids = keyed(&mut client, 1);
    assert!(wait_until(Duration::from_secs(10), || redis
        .xlen("ordered")
        == 1));

    // Redis adds the next five and their markers; the relay hears nothing and rolls back.
    proxy.swallow_replies(true);
    ids.extend(keyed(&mut client, 5));
    assert_eq!(ids[1], ids[0] + 1, "the ids are not consecutive");
    assert!(wait_until(Duration::from_secs(10), || redis
        .xlen("ordered")
        == 6));
    assert!(
        wait_until(Duration::from_secs(10), || pg.log().contains("lost Redis")),
        "the round trip was not given up: {}",
        pg.log()
    );
    assert_eq!(pg.pending(), 5, "the lost round trip was marked");

    set_maxmemory(&redis, "1");
    ids.extend(keyed(&mut client, 200));
    assert!(ids[6] / 64 == ids[5] / 64 && ids[205] / 64 > ids[6] / 64);
    proxy.cut();
    proxy.swallow_replies(false);
    // Refused for memory as a whole, which charges no event (Redis 6.2 words a script's errors
    // differently).
    let refused = || -> bool {
        pg.query_retrying("SELECT last_error FROM outbox_workers WHERE pid IS NOT NULL")
            .first()
            .and_then(|r| r.get::<_, Option<String>>(0))
            .is_some_and(|e| e.starts_with("OOM "))
    };
    assert!(
        wait_until(Duration::from_secs(20), refused),
        "the relay did not try while memory was full: {}",
        pg.log()
    );
    let charged: i64 =
        pg.query_retrying("SELECT count(*) FROM outbox WHERE attempts > 0")[0].get(0);
    assert_eq!(charged, 0, "events were charged for memory: {}", pg.log());
    set_maxmemory(&redis, "0");
    published_in_order(&pg, &redis, "ordered", &ids);
}

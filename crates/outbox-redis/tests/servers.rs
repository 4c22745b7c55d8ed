//! What the relay does with what the server can do, against the `redis-server` the tests start
//! (`OUTBOX_TEST_REDIS_SERVER` names another: Redis 6.2, 8.6, Valkey). With `outbox.dedupe =
//! auto`, Redis 8.6.2 and later deduplicate with IDMP and no marker key; older servers and
//! Valkey with markers, as before. Trimming with `ACKED` keeps what a consumer group has not
//! acknowledged where the server can, and trims as before elsewhere. Each test asserts what its
//! server must do, so the same test proves both sides, run against each server.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{event, publish, target, Redis};
use outbox_redis::error::Error;
use outbox_redis::outcome::Outcome;
use outbox_redis::publish::{Publisher, Reply};
use outbox_redis::server::{self, InUse};
use outbox_redis::target::Dedupe;

fn outcomes(reply: Reply) -> Vec<Outcome> {
    match reply {
        Reply::Answered(outcomes, _) => outcomes,
        Reply::Unavailable(error) => panic!("Redis was unavailable: {error}"),
    }
}

/// What the test's server can do, asked apart from the code under test.
fn features(redis: &Redis) -> server::Features {
    let info: String = redis.query(redis::cmd("INFO").arg("server"));
    server::features(&[server::parse_info(&info)])
}

fn xinfo(redis: &Redis, stream: &str) -> HashMap<String, redis::Value> {
    let flat: Vec<redis::Value> = redis.query(redis::cmd("XINFO").arg("STREAM").arg(stream));
    flat.chunks(2)
        .filter_map(|pair| match &pair[0] {
            redis::Value::BulkString(name) => {
                Some((String::from_utf8_lossy(name).into_owned(), pair[1].clone()))
            }
            _ => None,
        })
        .collect()
}

fn int(value: Option<&redis::Value>) -> i64 {
    match value {
        Some(redis::Value::Int(n)) => *n,
        other => panic!("not an integer: {other:?}"),
    }
}

/// A batch published twice (its transaction lost) adds its entries once, either way; on a
/// server with IDMP no marker key is written and the stream's window counts the duplicates.
#[test]
fn auto_dedupes_with_idmp_where_the_server_has_it_and_markers_elsewhere() {
    let redis = Redis::start();
    let has = features(&redis);
    let publisher = Publisher::spawn(target(&redis.url(), "app:", Dedupe::Auto))
        .expect("cannot start the Redis thread");
    let batch = || {
        let mut events = vec![event(1, "orders"), event(2, "orders"), event(3, "users")];
        events[1].group = 7;
        events
    };
    assert!(outcomes(publish(&publisher, batch()))
        .iter()
        .all(|o| *o == Outcome::Added));
    let found = publisher.found();
    publisher.transaction_ended(None);
    assert!(outcomes(publish(&publisher, batch()))
        .iter()
        .all(|o| *o == Outcome::Added));
    assert_eq!(redis.xlen("app:orders"), 2, "on {}", has.servers);
    assert_eq!(redis.xlen("app:users"), 1, "on {}", has.servers);
    if has.idmp {
        assert_eq!(found.dedupe, Some(InUse::Idmp));
        assert_eq!(redis.markers("app:"), 0, "IDMP wrote marker keys");
        let keys: Vec<String> = redis.query(redis::cmd("KEYS").arg("*"));
        let mut keys = keys;
        keys.sort();
        assert_eq!(keys, ["app:orders", "app:users"]);
        let info = xinfo(&redis, "app:orders");
        assert_eq!(int(info.get("iids-duplicates")), 2);
        // Two producers: the lane groups 0 and 7.
        assert_eq!(int(info.get("pids-tracked")), 2);
        assert_eq!(int(info.get("idmp-duration")), 3600);
        assert_eq!(int(info.get("idmp-maxsize")), 10_000);
        // The stream was created empty to be given its window: nothing but the events.
        assert_eq!(redis.ids("app:orders"), [1, 2]);
    } else {
        assert_eq!(found.dedupe, Some(InUse::Markers), "on {}", has.servers);
        assert!(redis.markers("app:") > 0);
    }
}

/// `outbox.dedupe = idmp` on a server without IDMP publishes nothing and says why; with it, an
/// event whose id was used again (a new created_at) is a new event.
#[test]
fn idmp_is_refused_where_the_server_lacks_it_and_tells_reused_ids_apart() {
    let redis = Redis::start();
    let has = features(&redis);
    let publisher = Publisher::spawn(target(&redis.url(), "", Dedupe::Idmp))
        .expect("cannot start the Redis thread");
    let reply = publish(&publisher, vec![event(1, "orders")]);
    if !has.idmp {
        match reply {
            Reply::Unavailable(error) => assert!(
                matches!(&error, Error::Setting(text) if text.contains("8.6.2")),
                "{error:?}"
            ),
            Reply::Answered(outcomes, _) => panic!("published without IDMP: {outcomes:?}"),
        }
        assert_eq!(redis.xlen("orders"), 0);
        return;
    }
    assert_eq!(outcomes(reply), [Outcome::Added]);
    let mut reused = event(1, "orders");
    reused.created_at += 1;
    assert_eq!(
        outcomes(publish(&publisher, vec![event(1, "orders"), reused])),
        [Outcome::Added, Outcome::Added]
    );
    assert_eq!(redis.ids("orders"), [1, 1]);
}

/// A stream whose window is smaller than the relay needs is made larger once (setting a
/// window clears it, so never when it is large enough); a larger one is left as it is.
#[test]
fn a_streams_window_is_only_ever_made_larger() {
    let redis = Redis::start();
    let has = features(&redis);
    if !has.idmp {
        eprintln!("skipped: {} has no IDMP", has.servers);
        return;
    }
    let _: String = redis.query(redis::cmd("XADD").arg("small").arg("*").arg("x").arg("1"));
    let _: String = redis.query(redis::cmd("XADD").arg("large").arg("*").arg("x").arg("1"));
    let _: () = redis.query(
        redis::cmd("XCFGSET")
            .arg("large")
            .arg("IDMP-DURATION")
            .arg(86_400)
            .arg("IDMP-MAXSIZE")
            .arg(10_000),
    );
    let publisher = Publisher::spawn(target(&redis.url(), "", Dedupe::Idmp))
        .expect("cannot start the Redis thread");
    assert_eq!(
        outcomes(publish(
            &publisher,
            vec![event(1, "small"), event(2, "large")]
        )),
        [Outcome::Added, Outcome::Added]
    );
    let small = xinfo(&redis, "small");
    assert_eq!(int(small.get("idmp-duration")), 3600);
    assert_eq!(int(small.get("idmp-maxsize")), 10_000);
    let large = xinfo(&redis, "large");
    assert_eq!(int(large.get("idmp-duration")), 86_400);
    // Not set again: the window still holds event 2's identity.
    assert_eq!(int(large.get("iids-tracked")), 1);
}

/// With `stream_trim_acked`, a group that has read nothing keeps every entry past MAXLEN; once
/// it has acknowledged them, the next chunk trims the stream back. Without ACKED (older servers,
/// Valkey) the stream is trimmed as before.
#[test]
fn trimming_keeps_what_a_group_has_not_acknowledged_where_the_server_can() {
    let redis = Redis::start();
    let has = features(&redis);
    let _: () = redis.query(
        redis::cmd("XGROUP")
            .arg("CREATE")
            .arg("t")
            .arg("g")
            .arg("$")
            .arg("MKSTREAM"),
    );
    let mut settings = target(&redis.url(), "", Dedupe::Auto);
    settings.stream_maxlen = 100;
    settings.stream_trim_acked = true;
    let publisher = Publisher::spawn(settings).expect("cannot start the Redis thread");
    for chunk in 0..20 {
        let events = (1..=100).map(|n| event(chunk * 100 + n, "t")).collect();
        assert!(outcomes(publish(&publisher, events))
            .iter()
            .all(|o| *o == Outcome::Added));
        publisher.transaction_ended(Some(chunk as u64 + 1));
    }
    assert_eq!(publisher.found().acked, has.acked);
    if !has.acked {
        assert!(redis.xlen("t") < 400, "not trimmed: {}", redis.xlen("t"));
        return;
    }
    assert_eq!(
        redis.xlen("t"),
        2000,
        "entries the group has not read were trimmed"
    );
    let _: redis::Value = redis.query(
        redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("c")
            .arg("COUNT")
            .arg(5000)
            .arg("STREAMS")
            .arg("t")
            .arg(">"),
    );
    let ids: Vec<String> = redis
        .query::<Vec<(String, Vec<String>)>>(redis::cmd("XRANGE").arg("t").arg("-").arg("+"))
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let mut ack = redis::cmd("XACK");
    ack.arg("t").arg("g").arg(&ids[..1000]);
    let _: i64 = redis.query(&ack);
    assert!(outcomes(publish(&publisher, vec![event(5001, "t")]))
        .iter()
        .all(|o| *o == Outcome::Added));
    let left = redis.xlen("t");
    assert!(
        (1000..1100).contains(&left),
        "read but unacknowledged entries went: {left}"
    );
    let mut ack = redis::cmd("XACK");
    ack.arg("t").arg("g").arg(&ids[1000..]);
    let _: i64 = redis.query(&ack);
    assert!(outcomes(publish(&publisher, vec![event(5002, "t")]))
        .iter()
        .all(|o| *o == Outcome::Added));
    let left = redis.xlen("t");
    assert!(left <= 200, "acknowledged entries stayed: {left}");
}

/// Entries older than `stream_max_age` go with the next chunk.
#[test]
fn entries_older_than_the_max_age_are_trimmed() {
    let redis = Redis::start();
    let mut settings = target(&redis.url(), "", Dedupe::Auto);
    settings.stream_max_age = Duration::from_secs(1);
    let publisher = Publisher::spawn(settings).expect("cannot start the Redis thread");
    let old: Vec<_> = (1..=300).map(|n| event(n, "aged")).collect();
    assert_eq!(outcomes(publish(&publisher, old)).len(), 300);
    assert_eq!(redis.xlen("aged"), 300);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        outcomes(publish(&publisher, vec![event(301, "aged")])),
        [Outcome::Added]
    );
    // Approximate trimming removes whole nodes of the stream's tree (100 entries by default).
    let left = redis.xlen("aged");
    assert!(left <= 101, "old entries stayed: {left}");
}

/// A Redis user that may not run the script sizing a stream's window gets nothing in: the window
/// is seen to in a round trip before the events', so no event goes into a stream whose window
/// (Redis's default keeps 100 ids for 100 s) could not absorb its republication.
#[test]
fn a_window_the_user_may_not_size_keeps_every_event_out() {
    use std::os::unix::fs::PermissionsExt;
    let redis = Redis::start();
    let has = features(&redis);
    if !has.idmp {
        eprintln!("skipped: {} has no IDMP", has.servers);
        return;
    }
    let _: () = redis.query(
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg("relay")
            .arg("on")
            .arg(">pw")
            .arg("~*")
            .arg("+@all")
            .arg("-@scripting"),
    );
    let file = std::env::temp_dir().join(format!("outbox-servers-{}.pw", std::process::id()));
    std::fs::write(&file, "pw\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut settings = target(
        &format!("redis://relay@127.0.0.1:{}", redis.port),
        "",
        Dedupe::Idmp,
    );
    settings.password_file = file.display().to_string();
    let publisher = Publisher::spawn(settings).expect("cannot start the Redis thread");
    match publish(&publisher, vec![event(1, "orders"), event(2, "orders")]) {
        Reply::Unavailable(error) => assert!(
            matches!(&error, Error::Refused(text) if text.contains("NOPERM")),
            "{error:?}"
        ),
        Reply::Answered(outcomes, _) => panic!("answered: {outcomes:?}"),
    }
    let _ = std::fs::remove_file(&file);
    assert_eq!(
        redis.xlen("orders"),
        0,
        "events went in past a refused window"
    );
}

/// A stream deleted (or flushed) after the connection gave it its window is not created again
/// without one: IDMP's XADD creates no stream, and its events go again once the stream has its
/// window, within the same chunk.
#[test]
fn a_stream_deleted_behind_the_relay_gets_its_window_again() {
    let redis = Redis::start();
    let has = features(&redis);
    if !has.idmp {
        eprintln!("skipped: {} has no IDMP", has.servers);
        return;
    }
    let publisher = Publisher::spawn(target(&redis.url(), "", Dedupe::Idmp))
        .expect("cannot start the Redis thread");
    assert_eq!(
        outcomes(publish(&publisher, vec![event(1, "gone")])),
        [Outcome::Added]
    );
    let _: i64 = redis.query(redis::cmd("DEL").arg("gone"));
    assert_eq!(
        outcomes(publish(
            &publisher,
            vec![event(2, "gone"), event(3, "kept"), event(4, "gone")]
        )),
        [Outcome::Added, Outcome::Added, Outcome::Added]
    );
    assert_eq!(redis.ids("gone"), [2, 4]);
    let info = xinfo(&redis, "gone");
    assert_eq!(
        int(info.get("idmp-maxsize")),
        10_000,
        "created without its window"
    );
    assert_eq!(int(info.get("iids-tracked")), 2);
}

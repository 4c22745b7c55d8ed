//! The publisher thread against a real `redis-server`, with no PostgreSQL: a batch goes into its
//! streams with the contract's fields, a batch published again with dedupe on adds nothing, and a
//! Redis that goes away is reported as unavailable until it is back.

mod common;

use std::time::Duration;

use common::{event, publish, target, wait_until, Redis};
use outbox_redis::cloudevents;
use outbox_redis::error::Error;
use outbox_redis::outcome::Outcome;
use outbox_redis::publish::{Publisher, Reply};
use outbox_redis::target::{Dedupe, Format, Mode};

/// `common::CREATED_AT` in RFC 3339.
const STAMP: &str = "2026-11-29T23:01:44.123456Z";

/// What Redis made of a batch that it answered for.
fn outcomes(reply: Reply) -> Vec<Outcome> {
    match reply {
        Reply::Answered(outcomes, _) => outcomes,
        Reply::Unavailable(error) => panic!("Redis was unavailable: {error}"),
    }
}

/// Each event is one entry of `<prefix><topic>`, in id order, with the fields the contract
/// names in its order: id, topic, payload, created_at, then key and headers only when set. The
/// same through the markers' script and, without dedupe, through `add.lua`.
#[test]
fn the_publisher_thread_adds_a_batch_with_the_contracts_fields() {
    let redis = Redis::start();
    for (prefix, dedupe) in [("plain:", Dedupe::Off), ("dedupe:", Dedupe::Markers)] {
        let publisher = Publisher::spawn(target(&redis.url(), prefix, dedupe))
            .expect("cannot start the Redis thread");
        let mut events = vec![event(1, "orders"), event(2, "orders"), event(3, "users")];
        events[1].key = Some("order-2".into());
        events[1].headers = Some(r#"{"traceparent": "00-1-2-01"}"#.into());
        events[2].headers = Some(r#"{"h": 1}"#.into());
        let answered = outcomes(publish(&publisher, events));
        assert_eq!(answered, [Outcome::Added, Outcome::Added, Outcome::Added]);

        let stamp = "2026-11-29T23:01:44.123456Z";
        let fields = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            redis.entries(&format!("{prefix}orders")),
            [
                fields(&[
                    ("id", "1"),
                    ("topic", "orders"),
                    ("payload", r#"{"n": 1}"#),
                    ("created_at", stamp),
                ]),
                fields(&[
                    ("id", "2"),
                    ("topic", "orders"),
                    ("payload", r#"{"n": 2}"#),
                    ("created_at", stamp),
                    ("key", "order-2"),
                    ("headers", r#"{"traceparent": "00-1-2-01"}"#),
                ]),
            ],
            "dedupe = {dedupe:?}"
        );
        assert_eq!(
            redis.entries(&format!("{prefix}users")),
            [fields(&[
                ("id", "3"),
                ("topic", "users"),
                ("payload", r#"{"n": 3}"#),
                ("created_at", stamp),
                ("headers", r#"{"h": 1}"#),
            ])],
            "dedupe = {dedupe:?}"
        );
        // Markers only with dedupe on.
        assert_eq!(redis.markers(prefix) > 0, dedupe.is_on());
    }
}

/// A batch whose transaction rolled back leaves its markers in Redis; published again, it finds
/// them and adds no second entry. Once the batch's transaction has committed and its commit is
/// on disk, the markers are deleted.
/// With `outbox.message_format = cloudevents`, each event is one entry whose fields are
/// `cloudevents::fields`: the same through the markers' script, `add.lua` without dedupe and
/// with IDMP (where the server has it), and plain `XADD`s (a user who may not run scripts). A
/// batch published again with dedupe adds nothing, whatever the shape.
#[test]
fn cloudevents_are_the_same_entries_whichever_way_they_go() {
    use std::os::unix::fs::PermissionsExt;
    let redis = Redis::start();
    let info: String = redis.query(redis::cmd("INFO").arg("server"));
    let idmp = outbox_redis::server::features(&[outbox_redis::server::parse_info(&info)]).idmp;
    let _: () = redis.query(redis::cmd("ACL").arg(
        &[
            "SETUSER",
            "noscripts",
            "on",
            ">pw",
            "~*",
            "+@all",
            "-@scripting",
        ][..],
    ));
    let file = std::env::temp_dir().join(format!("outbox-ce-{}.pw", std::process::id()));
    std::fs::write(&file, "pw\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let source = "//postgresql/7/shop";
    let mut ways = vec![
        ("markers:", Dedupe::Markers, false),
        ("off:", Dedupe::Off, false),
        ("plain:", Dedupe::Off, true),
    ];
    if idmp {
        ways.push(("idmp:", Dedupe::Idmp, false));
    }
    for (prefix, dedupe, plain) in ways {
        let mut settings = target(&redis.url(), prefix, dedupe);
        if plain {
            settings.url = format!("redis://noscripts@127.0.0.1:{}", redis.port);
            settings.password_file = file.display().to_string();
        }
        settings.format = Format::CloudEvents {
            source: source.into(),
        };
        let publisher = Publisher::spawn(settings).expect("cannot start the Redis thread");
        let mut events: Vec<_> = (1..=6).map(|id| event(id, "orders")).collect();
        events[1].key = Some("order-2".into());
        events[2].key = Some(String::new());
        events[3].headers = Some(r#"{"traceparent": "00-1-2-01", "tenant": "t\u00e9"}"#.into());
        events[4].key = Some("order-5".into());
        events[4].headers = Some("{}".into());
        events[5].topic = "users".into();
        events[5].headers = Some(r#"{"tracestate": "a=b"}"#.into());
        for round in 0..2 {
            let answered = outcomes(publish(&publisher, events.clone()));
            assert_eq!(answered, vec![Outcome::Added; 6], "{prefix} round {round}");
        }
        let expected = |events: &[outbox_redis::encode::Event]| -> Vec<Vec<(String, String)>> {
            events
                .iter()
                .map(|e| cloudevents::fields(e, source))
                .collect()
        };
        let orders = redis.entries(&format!("{prefix}orders"));
        let once = expected(&events[..5]);
        if dedupe.is_on() {
            assert_eq!(orders, once, "{prefix}");
        } else {
            // Without dedupe the batch went in twice.
            assert_eq!(orders, [once.clone(), once].concat(), "{prefix}");
        }
        let users = redis.entries(&format!("{prefix}users"));
        assert_eq!(
            users[0],
            cloudevents::fields(&events[5], source),
            "{prefix}"
        );
        assert_eq!(users[0][1], ("ce_id".to_string(), format!("6@{STAMP}")));
    }
    let _ = std::fs::remove_file(&file);
}

#[test]
fn a_batch_published_again_with_dedupe_on_adds_nothing() {
    let redis = Redis::start();
    let publisher = Publisher::spawn(target(&redis.url(), "app:", Dedupe::Markers))
        .expect("cannot start the Redis thread");
    let batch = || vec![event(1, "orders"), event(2, "orders"), event(65, "orders")];
    assert!(outcomes(publish(&publisher, batch()))
        .iter()
        .all(|o| *o == Outcome::Added));
    assert_eq!(redis.xlen("app:orders"), 3);
    // Two shards of ids (1 and 2, then 65): a marker field in each.
    assert_eq!(redis.markers("app:"), 2);

    // The transaction that marked the batch rolled back: the relay publishes it again.
    publisher.transaction_ended(None);
    assert!(outcomes(publish(&publisher, batch()))
        .iter()
        .all(|o| *o == Outcome::Added));
    assert_eq!(
        redis.xlen("app:orders"),
        3,
        "the republished batch added entries"
    );
    assert_eq!(redis.markers("app:"), 2);

    // Committed, but not yet on disk: the markers stay.
    publisher.transaction_ended(Some(100));
    publisher.flushed(99);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(redis.markers("app:"), 2);
    // On disk: they go.
    publisher.flushed(100);
    assert!(
        wait_until(Duration::from_secs(10), || redis.markers("app:") == 0),
        "the markers of a durable batch were not deleted"
    );
    assert_eq!(redis.xlen("app:orders"), 3);
}

/// A Redis that stopped makes a batch unavailable (nothing may be marked), and the same publisher
/// publishes again once Redis is back, loading the dedupe script the new server has not seen.
#[test]
fn a_stopped_redis_is_unavailable_and_a_restarted_one_works_again() {
    let mut redis = Redis::start();
    let publisher = Publisher::spawn(target(&redis.url(), "", Dedupe::Markers))
        .expect("cannot start the Redis thread");
    assert_eq!(
        outcomes(publish(&publisher, vec![event(1, "orders")])),
        [Outcome::Added]
    );
    publisher.transaction_ended(Some(1));

    redis.stop();
    match publish(&publisher, vec![event(2, "orders")]) {
        Reply::Unavailable(error) => assert!(
            matches!(&error, Error::Unreachable(text) if !text.is_empty()),
            "{error:?}"
        ),
        Reply::Answered(outcomes, _) => panic!("a stopped Redis answered: {outcomes:?}"),
    }
    publisher.transaction_ended(None);

    redis.start_again();
    assert_eq!(
        outcomes(publish(&publisher, vec![event(2, "orders")])),
        [Outcome::Added]
    );
    assert_eq!(redis.xlen("orders"), 1, "the restarted Redis starts empty");
}

/// Settings the link cannot work with come back as an unavailable reply that says why, for the
/// relay's main thread to log; no server is needed to find that out.
#[test]
fn settings_the_link_cannot_use_are_reported_not_logged() {
    let mut settings = target("redis://127.0.0.1:1,redis://127.0.0.1:2", "", Dedupe::Off);
    let publisher = Publisher::spawn(settings.clone()).expect("cannot start the Redis thread");
    match publish(&publisher, vec![event(1, "orders")]) {
        Reply::Unavailable(Error::Setting(error)) => assert!(
            error.contains("lists 2 URLs") && error.contains("outbox.redis_mode"),
            "{error}"
        ),
        Reply::Unavailable(error) => panic!("not a setting: {error:?}"),
        Reply::Answered(outcomes, _) => panic!("answered: {outcomes:?}"),
    }
    settings.mode = Mode::Sentinel;
    publisher.configure(settings);
    match publish(&publisher, vec![event(1, "orders")]) {
        Reply::Unavailable(Error::Setting(error)) => {
            assert!(error.contains("outbox.redis_sentinel_master"), "{error}")
        }
        Reply::Unavailable(error) => panic!("not a setting: {error:?}"),
        Reply::Answered(outcomes, _) => panic!("answered: {outcomes:?}"),
    }
}

//! Trace context without code: the `traceparent` (and `tracestate`) of a sqlcommenter comment on
//! the statement that enqueues, or of the session's `outbox.traceparent`, reach the event's
//! headers in Redis, against a real PostgreSQL and Redis.

use std::collections::HashMap;
use std::time::Duration;

use common::{sqlstate, wait_until, Pg, Redis};

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const OTHER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// The headers each event of `topic` arrived with, by the event's payload field `n`, once
/// `count` events are in the stream; `None` for an event without headers.
fn arrived(redis: &Redis, topic: &str, count: usize) -> HashMap<i64, Option<serde_json::Value>> {
    assert!(
        wait_until(Duration::from_secs(10), || redis.xlen(topic) == count),
        "{} of {count} events arrived in {topic}",
        redis.xlen(topic)
    );
    redis
        .entries(topic)
        .into_iter()
        .map(|(_, fields)| {
            let payload: serde_json::Value = serde_json::from_str(&fields["payload"]).unwrap();
            let headers = fields
                .get("headers")
                .map(|h| serde_json::from_str(h).unwrap());
            (payload["n"].as_i64().unwrap(), headers)
        })
        .collect()
}

/// The comment formats OpenTelemetry's SQL instrumentations produce, by the simple and the
/// extended protocol, appended or prepended, from a trigger, beside the caller's own headers,
/// and for a delayed event.
#[test]
fn a_sqlcommenter_traceparent_reaches_the_event_headers() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();

    // Python (psycopg2, SQLAlchemy, Django): sorted keys, numbers bare, '%' doubled when the
    // statement has no parameters, before the ';'. Simple protocol.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('traced', '{{\"n\": 1}}') /*db_driver='psycopg2%%3A2.9.9',\
             dbapi_level='2.0',dbapi_threadsafety=2,driver_paramstyle='pyformat',\
             libpq_version=160002,traceparent='{PARENT}',\
             tracestate='congo%%3Dt61rcWkgMzE%%2Crojo%%3D00f067aa0ba902b7'*/;"
        ))
        .unwrap();
    // Go and Java (Spring): URL-encoded values in quotes, appended. Extended protocol, with
    // parameters, as an ORM sends it.
    client
        .execute(
            &format!(
                "SELECT outbox_enqueue($1, $2::text::jsonb) /*action='%2Forders',\
                 framework='spring',traceparent='{PARENT}'*/"
            ),
            &[&"traced", &r#"{"n": 2}"#],
        )
        .unwrap();
    // Prepended (Rails with prepend_comment), the caller's other headers kept beside it.
    client
        .batch_execute(&format!(
            "/*application='shop',traceparent='{PARENT}'*/ \
             SELECT outbox_enqueue('traced', '{{\"n\": 3}}', headers => '{{\"tenant\": \"eu\"}}')"
        ))
        .unwrap();
    // The caller's own traceparent wins, and no tracestate is added to it.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('traced', '{{\"n\": 4}}', \
             headers => '{{\"traceparent\": \"{OTHER}\"}}') \
             /*traceparent='{PARENT}',tracestate='a%3Db'*/"
        ))
        .unwrap();
    // From a trigger, for each row of a multi-row insert: the client's statement carries it.
    client
        .batch_execute(
            "CREATE TABLE orders (n int);
             CREATE FUNCTION orders_event() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM outbox_enqueue('traced', jsonb_build_object('n', NEW.n));
                 RETURN NEW;
             END $$;
             CREATE TRIGGER orders_event AFTER INSERT ON orders
                 FOR EACH ROW EXECUTE FUNCTION orders_event();",
        )
        .unwrap();
    client
        .batch_execute(&format!(
            "INSERT INTO orders VALUES (5), (6) /*traceparent='{PARENT}'*/"
        ))
        .unwrap();
    // A delayed event keeps it until it is due.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('traced', '{{\"n\": 7}}', deliver_after => '200 ms') \
             /*traceparent='{PARENT}'*/"
        ))
        .unwrap();
    // A comment in a string literal, in the middle, or malformed: no headers, no error.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('traced', '{{\"n\": 8, \"s\": \"/*traceparent=''{PARENT}''*/\"}}')"
        ))
        .unwrap();
    client
        .batch_execute(&format!(
            "SELECT /*traceparent='{PARENT}'*/ outbox_enqueue('traced', '{{\"n\": 9}}')"
        ))
        .unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('traced', '{\"n\": 10}') /*traceparent='00-zz'*/")
        .unwrap();

    let headers = arrived(&redis, "traced", 10);
    let context = |n: i64| {
        headers[&n]
            .clone()
            .unwrap_or_else(|| panic!("event {n} has no headers"))
    };
    assert_eq!(
        context(1),
        serde_json::json!({
            "traceparent": PARENT,
            "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        })
    );
    assert_eq!(context(2), serde_json::json!({ "traceparent": PARENT }));
    assert_eq!(
        context(3),
        serde_json::json!({ "traceparent": PARENT, "tenant": "eu" })
    );
    assert_eq!(context(4), serde_json::json!({ "traceparent": OTHER }));
    for n in [5, 6, 7] {
        assert_eq!(
            context(n),
            serde_json::json!({ "traceparent": PARENT }),
            "event {n}"
        );
    }
    for n in [8, 9, 10] {
        assert_eq!(headers[&n], None, "event {n}");
    }
}

/// A session's `outbox.traceparent` (and `outbox.tracestate`) go into its events' headers when
/// the statement has no comment of its own; a malformed value is refused with 22023.
#[test]
fn the_session_setting_gives_events_a_traceparent() {
    let redis = Redis::start();
    let pg = Pg::relaying_to(&redis, &[("outbox.poll_interval", "100ms")]);
    let mut client = pg.with_extension();

    client
        .batch_execute("SELECT outbox_enqueue('session', '{\"n\": 1}')")
        .unwrap();
    client
        .batch_execute(&format!(
            "BEGIN;
             SET LOCAL outbox.traceparent = '{OTHER}';
             SET LOCAL outbox.tracestate = 'rojo=00f067aa0ba902b7';
             SELECT outbox_enqueue('session', '{{\"n\": 2}}');
             COMMIT;"
        ))
        .unwrap();
    client
        .batch_execute(&format!("SET outbox.traceparent = '{OTHER}'"))
        .unwrap();
    // The statement's comment is the more specific context.
    client
        .batch_execute(&format!(
            "SELECT outbox_enqueue('session', '{{\"n\": 3}}') /*traceparent='{PARENT}'*/"
        ))
        .unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('session', '{\"n\": 4}')")
        .unwrap();
    client.batch_execute("RESET outbox.traceparent").unwrap();
    client
        .batch_execute("SELECT outbox_enqueue('session', '{\"n\": 5}')")
        .unwrap();

    for bad in [
        "SET outbox.traceparent = 'not-a-trace'",
        "SET outbox.traceparent = '00-00000000000000000000000000000000-00f067aa0ba902b7-01'",
        "SET outbox.tracestate = 'no members'",
    ] {
        let error = client.batch_execute(bad).unwrap_err();
        assert_eq!(sqlstate(&error), "22023", "{bad}: {error}");
    }

    let headers = arrived(&redis, "session", 5);
    assert_eq!(headers[&1], None);
    assert_eq!(
        headers[&2],
        Some(serde_json::json!({
            "traceparent": OTHER,
            "tracestate": "rojo=00f067aa0ba902b7",
        }))
    );
    assert_eq!(
        headers[&3],
        Some(serde_json::json!({ "traceparent": PARENT }))
    );
    assert_eq!(
        headers[&4],
        Some(serde_json::json!({ "traceparent": OTHER }))
    );
    assert_eq!(headers[&5], None);
}

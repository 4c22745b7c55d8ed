//! `outbox.message_format = cloudevents`: the entries are CloudEvents in binary content mode,
//! parsed here with the CloudEvents SDK for Python (`tests/cloudevents/parse.py`, installed into
//! a virtual environment under `target/`), which checks them as it builds each event; every
//! attribute is then compared with the row the event came from. The relay switches shape on a
//! reload while a chunk is in flight, and loses nothing: each event is in its stream once, each
//! key's events in id order, fields first and CloudEvents after. `outbox_enqueue` refuses
//! headers that cannot be attributes, with 22023; an event enqueued by hand with one goes to
//! `outbox_dead` with the reason.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{repository, sqlstate, wait_until, Pg, Redis};
use postgres::Client;
use serde_json::Value;

const TOPICS: [&str; 3] = ["orders", "users", "payments"];
/// Events enqueued with the CloudEvents shape in force.
const EVENTS: i64 = 10_000;

/// The Python of a virtual environment with the SDK, under `target/`.
fn python_with_sdk() -> PathBuf {
    common::python::venv(
        &repository().join("target/python/cloudevents"),
        &repository().join("tests/cloudevents/requirements.txt"),
    )
}

/// The rows of `outbox`, by id: topic, payload, key, headers, created_at in microseconds since
/// the Unix epoch.
type Row = (String, Value, Option<String>, Option<Value>, i64);

fn rows(client: &mut Client) -> BTreeMap<i64, Row> {
    client
        .query(
            "SELECT id, topic, payload::text, key, headers::text, \
                    (extract(epoch FROM created_at) * 1000000)::bigint FROM outbox",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| {
            let json = |text: String| serde_json::from_str::<Value>(&text).unwrap();
            let headers: Option<String> = r.get(4);
            (
                r.get(0),
                (
                    r.get(1),
                    json(r.get(2)),
                    r.get(3),
                    headers.map(json),
                    r.get(5),
                ),
            )
        })
        .collect()
}

/// Enqueues events `from..=to` in one statement: three topics; keys of 37 values, none for one
/// event in four, empty for some; headers none, a tenant, a trace context of their own, or two
/// attributes; `comment` after the statement (a sqlcommenter trace context, say).
fn enqueue(client: &mut Client, from: i64, to: i64, comment: &str) {
    client
        .execute(
            &format!(
                "SELECT outbox_enqueue((ARRAY['orders','users','payments'])[i % 3 + 1], \
                    jsonb_build_object('i', i, 'note', 'caf\u{e9} ' || i), \
                    CASE WHEN i % 4 = 0 THEN NULL WHEN i % 101 = 0 THEN '' ELSE 'k' || (i % 37) END, \
                    CASE i % 5 WHEN 0 THEN NULL \
                      WHEN 1 THEN jsonb_build_object('tenant', 't' || (i % 7)) \
                      WHEN 2 THEN jsonb_build_object('traceparent', '00-' || lpad(to_hex(i), 32, '0') \
                        || '-' || lpad(to_hex(i), 16, '0') || '-01', 'tracestate', 'congo=t' || i) \
                      ELSE jsonb_build_object('tenant', 'x', 'region', 'eu' || (i % 3)) END) \
                 FROM generate_series($1::bigint, $2::bigint) AS i {comment}"
            ),
            &[&from, &to],
        )
        .unwrap();
}

#[test]
fn entries_are_cloudevents_the_sdk_reads_and_the_switch_loses_nothing() {
    let python = python_with_sdk();
    let redis = Redis::start();
    // Redis is paused for a moment below: no timeout meanwhile.
    let mut pg = Pg::relaying_to(
        &redis,
        &[("outbox.workers", "2"), ("outbox.redis_timeout", "30s")],
    );
    let mut client = pg.with_extension();
    pg.wait_for_workers(2);
    let system_identifier: i64 = client
        .query_one("SELECT system_identifier FROM pg_control_system()", &[])
        .unwrap()
        .get(0);
    let published = |client: &mut Client| -> i64 {
        client
            .query_one(
                "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
                &[],
            )
            .unwrap()
            .get(0)
    };

    // Fields first; then, while Redis holds a chunk, the switch on reload.
    enqueue(&mut client, 1, 500, "");
    assert!(wait_until(Duration::from_secs(60), || published(
        &mut client
    ) == 500));
    redis.pause();
    enqueue(&mut client, 501, 501, "");
    // Its chunk in flight (sent, Redis not answering): the worker is publishing.
    assert!(
        wait_until(Duration::from_secs(4), || {
            let state = "SELECT count(*) FROM outbox_workers WHERE state = 'publishing'";
            client.query_one(state, &[]).unwrap().get::<_, i64>(0) == 1
        }),
        "no worker took event 501"
    );
    enqueue(&mut client, 502, 1_000, "");
    pg.set(&[("outbox.message_format", "cloudevents")]);
    std::thread::sleep(Duration::from_millis(500));
    redis.resume();

    // Refused with the CloudEvents shape in force, and nothing written.
    let before = rows(&mut client).len();
    for (key, headers) in [
        ("'k'", r#"'{"X-Tenant": "7"}'"#),
        ("'k'", r#"'{"type": "x"}'"#),
        ("'k'", r#"'{"tenant": "a\nb"}'"#),
        ("E'a\\tb'", "NULL"),
    ] {
        let error = client
            .execute(
                &format!("SELECT outbox_enqueue('orders', '{{}}', {key}, {headers}::jsonb)"),
                &[],
            )
            .expect_err(headers);
        assert_eq!(sqlstate(&error), "22023", "{key} {headers}: {error}");
    }
    assert_eq!(
        rows(&mut client).len(),
        before,
        "a refused event was written"
    );

    // The CloudEvents shape: a trace context from a sqlcommenter comment, from the session's
    // setting, and none.
    let comment = "/*traceparent='00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',tracestate='rojo%3D1'*/";
    let last = 1_000 + EVENTS;
    enqueue(&mut client, 1_001, 4_000, comment);
    client
        .batch_execute(
            "SET outbox.traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'",
        )
        .unwrap();
    enqueue(&mut client, 4_001, 7_000, "");
    client.batch_execute("RESET outbox.traceparent").unwrap();
    for from in (7_001..=last).step_by(1_000) {
        enqueue(&mut client, from, (from + 999).min(last), "");
    }
    let total = last;
    assert!(
        wait_until(Duration::from_secs(120), || published(&mut client) == total),
        "{} of {total} published",
        published(&mut client)
    );

    let rows = rows(&mut client);
    assert_eq!(rows.len() as i64, total);
    let source = format!("//postgresql/{system_identifier}/postgres");
    let mut seen: HashMap<i64, usize> = HashMap::new();
    // Per stream and key (or key-less topic): the ids and shapes in stream order.
    let mut order: HashMap<String, Vec<(i64, bool)>> = HashMap::new();
    let mut cloudevents = Vec::new();
    for topic in TOPICS {
        for (entry, fields) in redis.entries(topic) {
            let (id, is_ce) = match fields.get("ce_id") {
                Some(ce_id) => {
                    let (id, _) = ce_id.split_once('@').expect("ce_id without @");
                    cloudevents.push((entry, fields.clone()));
                    (id.parse::<i64>().unwrap(), true)
                }
                None => (fields["id"].parse::<i64>().unwrap(), false),
            };
            *seen.entry(id).or_default() += 1;
            let row = &rows[&id];
            // A key's events in one stream (the same key goes to several).
            let ordering = match &row.2 {
                Some(key) => format!("{topic} key {key}"),
                None => format!("{topic} without a key"),
            };
            order.entry(ordering).or_default().push((id, is_ce));
            if !is_ce {
                assert_eq!(fields["topic"], row.0);
                assert_eq!(
                    serde_json::from_str::<Value>(&fields["payload"]).unwrap(),
                    row.1
                );
            }
        }
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "events in twice: {twice:?}");
    assert_eq!(seen.len() as i64, total, "events missing from the streams");
    for (ordering, events) in &order {
        assert!(
            events.windows(2).all(|w| w[0].0 < w[1].0),
            "{ordering}: out of id order"
        );
        assert!(
            events.windows(2).all(|w| w[0].1 <= w[1].1),
            "{ordering}: fields after CloudEvents"
        );
    }
    assert!(
        cloudevents.len() as i64 >= EVENTS,
        "only {} CloudEvents",
        cloudevents.len()
    );
    assert!(
        seen.len() - cloudevents.len() >= 501,
        "the switch came before the chunk in flight"
    );

    // Every CloudEvent through the SDK, every attribute against its row.
    let mut child = Command::new(&python)
        .arg(repository().join("tests/cloudevents/parse.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("cannot run parse.py");
    let mut input = String::new();
    for (entry, fields) in &cloudevents {
        input.push_str(&serde_json::json!({"entry": entry, "fields": fields}).to_string());
        input.push('\n');
    }
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(output.status.success(), "parse.py failed");
    let parsed: Vec<Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(parsed.len(), cloudevents.len());
    let mut traced_by_comment = 0;
    for event in &parsed {
        assert!(event.get("error").is_none(), "the SDK refused {event}");
        let attributes = event["attributes"].as_object().unwrap();
        let ce_id = attributes["id"].as_str().unwrap();
        let id: i64 = ce_id.split_once('@').unwrap().0.parse().unwrap();
        let (topic, payload, key, headers, created_at) = &rows[&id];
        let mut expected = serde_json::Map::new();
        expected.insert("specversion".into(), "1.0".into());
        expected.insert("id".into(), ce_id.into());
        expected.insert("source".into(), source.clone().into());
        expected.insert("type".into(), topic.clone().into());
        expected.insert("time".into(), (*created_at).into());
        expected.insert("datacontenttype".into(), "application/json".into());
        if let Some(key) = key.as_ref().filter(|k| !k.is_empty()) {
            expected.insert("subject".into(), key.clone().into());
        }
        if let Some(Value::Object(headers)) = headers {
            for (name, value) in headers {
                expected.insert(name.clone(), value.clone());
            }
            let traceparent = headers.get("traceparent").and_then(Value::as_str);
            if traceparent.is_some_and(|t| t.starts_with("00-4bf92f3577b34da6")) {
                traced_by_comment += 1;
            }
        }
        assert_eq!(
            attributes, &expected,
            "event {id}: the attributes differ from its row"
        );
        assert_eq!(&event["data"], payload, "event {id}: data");
        let time = ce_id.split_once('@').unwrap().1;
        assert!(time.ends_with('Z') && time.len() == 27, "{ce_id}");
    }
    assert!(
        traced_by_comment >= 1_000,
        "{traced_by_comment} events traced by the comment"
    );

    // A row inserted by hand with a header that cannot be an attribute goes to outbox_dead.
    client
        .batch_execute(
            r#"INSERT INTO outbox (topic, payload, headers) VALUES ('orders', '{}', '{"X-Id": "1"}')"#,
        )
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || {
            client
                .query("SELECT last_error FROM outbox_dead", &[])
                .unwrap()
                .iter()
                .any(|r| {
                    r.get::<_, String>(0)
                        .contains("not a CloudEvent: header \"X-Id\"")
                })
        }),
        "the event was not buried: {:?}",
        client
            .query("SELECT * FROM outbox_dead", &[])
            .unwrap()
            .len()
    );
}

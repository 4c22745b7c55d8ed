//! The round trip's commands as built for each way of sending a chunk, and the outcomes read
//! from replies Redis could give.

use super::markers::marker_field;
use super::replies::script_error;
use super::*;
use crate::encode::sample_event as event;
use crate::idmp;
use crate::outcome::Outcome;
use crate::resp::args;
use crate::rfc3339::rfc3339;
use crate::target::{Dedupe, Mode};
use redis::Cmd;
use std::time::Duration;

fn reply(resp: &[u8]) -> Value {
    redis::parse_redis_value(resp).expect("not RESP")
}

fn target(dedupe: Dedupe) -> Target {
    Target {
        url: "redis://127.0.0.1".into(),
        mode: Mode::Standalone,
        sentinel_master: String::new(),
        tls: Default::default(),
        password_file: String::new(),
        sentinel_password_file: String::new(),
        url_refused: None,
        wait_replicas: 0,
        timeout: Duration::from_secs(1),
        stream_prefix: String::new(),
        stream_maxlen: 0,
        stream_max_age: Duration::ZERO,
        stream_trim_acked: false,
        dedupe,
        dedupe_ttl: Duration::from_secs(1),
        marker_namespace: "t".into(),
        format: crate::target::Format::Fields,
    }
}

/// Without dedupe, plain `XADD`s; [`plain_or_not`] says otherwise.
fn shape(dedupe: InUse) -> Shape {
    plain_or_not(dedupe, true)
}

fn plain_or_not(dedupe: InUse, plain: bool) -> Shape {
    Shape {
        dedupe,
        acked: false,
        idmp: false,
        plain,
    }
}

fn chunk_of<'a>(target: &'a Target, events: &'a [Event]) -> Chunk<'a> {
    Chunk {
        target,
        events,
        cleanup: &[],
        in_doubt: None,
        sent_as: Cell::new(None),
    }
}

#[test]
fn a_key_error_fails_its_events_and_a_refusal_fails_the_chunk() {
    let target = target(Dedupe::Off);
    let events = [event(1, "a"), event(2, "b"), event(3, "a")];
    let chunk = chunk_of(&target, &events);
    let layout = built(&chunk, &shape(InUse::Off)).layout;
    let added = || reply(b"$3\r\n1-1\r\n");
    let wrongtype = || reply(b"-WRONGTYPE Operation against a key\r\n");
    let Ok(answer) = read(&chunk, &layout, vec![wrongtype(), added(), wrongtype()]) else {
        panic!("a key error failed the whole chunk");
    };
    assert_eq!(
        answer.results,
        [
            Outcome::Failed("WRONGTYPE Operation against a key".to_string()),
            Outcome::Added,
            Outcome::Failed("WRONGTYPE Operation against a key".to_string()),
        ]
    );
    let noperm = reply(b"-NOPERM this user has no permissions\r\n");
    assert!(matches!(
        read(&chunk, &layout, vec![added(), noperm, added()]),
        Err(Failed::Refused(error)) if error.text().starts_with("NOPERM")
    ));
    assert!(matches!(
        read(&chunk, &layout, vec![added()]),
        Err(Failed::Broken(_))
    ));
}

/// The chunk's round trip on one server, into a new buffer.
fn built(chunk: &Chunk, shape: &Shape) -> Commands {
    build(chunk, ScriptCall::BySha, shape, Packed::default())
}

/// The commands built, read back one by one.
fn listed(built: &Commands) -> Vec<Cmd> {
    built.commands.commands().expect("not RESP")
}

#[test]
fn the_script_gets_the_topic_once_and_optional_fields_only_when_set() {
    let target = target(Dedupe::Markers);
    let mut events = [event(1, "a"), event(2, "a"), event(3, "a"), event(4, "a")];
    events[1].key = Some("k2".into());
    events[2].key = Some("k3".into());
    events[2].headers = Some("h3".into());
    events[3].headers = Some("h4".into());
    let chunk = chunk_of(&target, &events);
    let commands = built(&chunk, &shape(InUse::Markers));
    assert_eq!(commands.commands.len(), 1);
    let args = args(&listed(&commands)[0]);
    // EVALSHA, the digest, 3 keys (the stream, one run's two marker hashes).
    assert_eq!(args[2..4], ["3", "a"]);
    let argv = &args[6..];
    assert_eq!(argv[0], "0", "no MAXLEN");
    assert_eq!(argv[2..4], ["a", "-kbh"]);
    // The call's own marker field, then the one run: its size and its ready-made marker.
    assert!(argv[4].starts_with('m'), "{}", argv[4]);
    let stamp = rfc3339(0);
    assert_eq!(argv[5], "4");
    assert_eq!(argv[6], format!("1|{stamp};2|{stamp};3|{stamp};4|{stamp}"));
    assert_eq!(argv[7..11], ["1", "2", "3", "4"]);
    assert_eq!(
        argv[11..],
        ["{}", &stamp, "{}", &stamp, "k2", "{}", &stamp, "k3", "h3", "{}", &stamp, "h4"]
    );
}

#[test]
fn markers_carry_each_events_idmp_identity_where_redis_has_idmp() {
    let target = target(Dedupe::Auto);
    let mut events = [event(1, "a"), event(2, "a")];
    events[0].group = 3;
    events[0].created_at = 1_000;
    events[1].key = Some("k2".into());
    let chunk = chunk_of(&target, &events);
    let shape = Shape {
        dedupe: InUse::Markers,
        acked: false,
        idmp: true,
        plain: false,
    };
    let args = args(&listed(&built(&chunk, &shape))[0]);
    let argv = &args[6..];
    // The bound says IDMP is there, and the window a stream the call makes gets.
    let window = idmp::window_seconds(target.dedupe_ttl);
    assert_eq!(argv[0], format!("0i:{window}:10000"));
    let (s0, s1) = (rfc3339(1_000), rfc3339(0));
    // After the run's ids: per event its payload, created_at, producer and identity, then
    // its key.
    assert_eq!(
        argv[argv.len() - 9..],
        ["{}", &s0, "t:3", "1-1000", "{}", &s1, "t:0", "2-0", "k2"]
    );
}

#[test]
fn the_script_names_the_events_it_refused() {
    let target = target(Dedupe::Markers);
    let events = [event(1, "a"), event(2, "b"), event(3, "a")];
    let chunk = chunk_of(&target, &events);
    // One call per stream: a gets events 1 and 3, b event 2.
    let layout = built(&chunk, &shape(InUse::Markers)).layout;
    let none = || reply(b"*0\r\n");
    let Ok(answer) = read(&chunk, &layout, vec![none(), none()]) else {
        panic!("an empty reply failed the chunk");
    };
    assert_eq!(
        answer.results,
        [Outcome::Added, Outcome::Added, Outcome::Added]
    );
    let second = reply(b"*2\r\n:2\r\n$27\r\nWRONGTYPE Operation against\r\n");
    let Ok(answer) = read(&chunk, &layout, vec![second, none()]) else {
        panic!("a refused event failed the chunk");
    };
    assert_eq!(
        answer.results,
        [
            Outcome::Added,
            Outcome::Added,
            Outcome::Failed("WRONGTYPE Operation against".to_string())
        ]
    );
    let noperm = reply(b"*2\r\n:1\r\n$6\r\nNOPERM\r\n");
    assert!(matches!(
        read(&chunk, &layout, vec![none(), noperm]),
        Err(Failed::Refused(error)) if error.text() == "NOPERM"
    ));
    for broken in [
        &b"*1\r\n:1\r\n"[..],
        b"*2\r\n:3\r\n$3\r\nERR\r\n",
        b"*2\r\n:0\r\n$3\r\nERR\r\n",
    ] {
        assert!(matches!(
            read(&chunk, &layout, vec![reply(broken), none()]),
            Err(Failed::Broken(_))
        ));
    }
}

#[test]
fn idmp_sends_a_call_per_stream_naming_the_lane_group_and_the_event() {
    let mut target = target(Dedupe::Auto);
    target.stream_maxlen = 1000;
    let mut events = [event(7, "a"), event(8, "b"), event(9, "a")];
    events[0].group = 3;
    events[0].created_at = 1_000;
    events[2].key = Some("k".into());
    let chunk = chunk_of(&target, &events);
    let shape = Shape {
        dedupe: InUse::Idmp,
        acked: true,
        idmp: false,
        plain: false,
    };
    let built = built(&chunk, &shape);
    // One call per stream, sent whole: a's events 7 and 9, then b's 8.
    assert_eq!(built.commands.len(), 2);
    let a = args(&listed(&built)[0]);
    assert_eq!(a[0], "EVAL");
    assert!(a[1].contains("IDMP"));
    let stamp = |at| rfc3339(at);
    assert_eq!(
        a[2..],
        [
            "1",
            "a",
            "1000ai",
            "a",
            "-k",
            "t:3",
            "7-1000",
            "7",
            "{}",
            &stamp(1_000),
            "t:0",
            "9-0",
            "9",
            "{}",
            &stamp(0),
            "k"
        ]
    );
    assert_eq!(
        args(&listed(&built)[1])[2..9],
        ["1", "b", "1000ai", "b", "-", "t:0", "8-0"]
    );
    // A stream that does not exist adds nothing, and its events are named to go again.
    let none = || reply(b"*0\r\n");
    let Ok(answer) = read(&chunk, &built.layout, vec![none(), reply(b":0\r\n")]) else {
        panic!("a missing stream failed the chunk");
    };
    assert_eq!(answer.missing, [1]);
    assert_eq!(answer.results, vec![Outcome::Added; 3]);
    // A refusal for memory is every event's, and the chunk's.
    let oom = || reply(b"*4\r\n:1\r\n$3\r\nOOM\r\n:2\r\n$3\r\nOOM\r\n");
    assert!(matches!(
        read(&chunk, &built.layout, vec![oom(), none()]),
        Err(Failed::Refused(error)) if error.text() == "OOM"
    ));
}

#[test]
fn without_dedupe_a_call_per_stream_names_no_producer_unless_plain() {
    let target = target(Dedupe::Off);
    let mut events = [event(7, "a"), event(8, "b"), event(9, "a")];
    events[2].key = Some("k".into());
    let chunk = chunk_of(&target, &events);
    let built = built(&chunk, &plain_or_not(InUse::Off, false));
    assert_eq!(built.commands.len(), 2);
    let a = args(&listed(&built)[0]);
    assert_eq!(a[0], "EVAL");
    let stamp = rfc3339(0);
    // The bound without 'i', then per event its id, payload and created_at, and its key.
    assert_eq!(
        a[2..],
        ["1", "a", "0", "a", "-k", "7", "{}", &stamp, "9", "{}", &stamp, "k"]
    );
    // A stream's events refused alike: the first named by Redis's error, the later ones by
    // the same error, untried.
    let none = || reply(b"*0\r\n");
    let wrongtype = reply(b"*4\r\n:1\r\n$9\r\nWRONGTYPE\r\n:2\r\n$9\r\nWRONGTYPE\r\n");
    let Ok(answer) = read(&chunk, &built.layout, vec![wrongtype, none()]) else {
        panic!("a key error failed the chunk");
    };
    let failed = Outcome::Failed("WRONGTYPE".into());
    assert_eq!(answer.results, [failed.clone(), Outcome::Added, failed]);
    // Plain XADDs for a user who may not run scripts.
    let plain = built_plain(&chunk);
    assert_eq!(plain.commands.len(), 3);
    assert_eq!(args(&listed(&plain)[0])[..3], ["XADD", "a", "*"]);
}

fn built_plain(chunk: &Chunk) -> Commands {
    built(chunk, &plain_or_not(InUse::Off, true))
}

#[test]
fn trimming_by_age_comes_before_the_events_once_per_stream() {
    let mut target = target(Dedupe::Off);
    target.stream_max_age = Duration::from_secs(60);
    let events = [event(1, "a"), event(2, "a")];
    let chunk = chunk_of(&target, &events);
    let built = built(&chunk, &shape(InUse::Off));
    assert_eq!(built.commands.len(), 3);
    let trim = args(&listed(&built)[0]);
    assert_eq!(trim[..4], ["XTRIM", "a", "MINID", "~"]);
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let oldest: u64 = trim[4].parse().unwrap();
    assert!(
        oldest <= now_ms - 60_000 && oldest > now_ms - 70_000,
        "{oldest}"
    );
    assert_eq!(args(&listed(&built)[1])[..3], ["XADD", "a", "*"]);
    // A failed trim fails no event: it is reported beside them.
    let added = || reply(b"$3\r\n1-1\r\n");
    let noperm = reply(b"-NOPERM no permissions to run the 'xtrim' command\r\n");
    let Ok(answer) = read(&chunk, &built.layout, vec![noperm, added(), added()]) else {
        panic!("a failed trim failed the chunk");
    };
    assert_eq!(answer.results, vec![Outcome::Added; 2]);
    assert!(answer
        .trim_error
        .is_some_and(|e| e.starts_with("XTRIM: NOPERM")));
    assert!(matches!(
        read(&chunk, &built.layout, vec![added(), added()]),
        Err(Failed::Broken(_))
    ));
}

#[test]
fn a_scripts_error_is_read_without_the_place_redis_6_2_puts_before_it() {
    let oom = "@user_script: 194: -OOM command not allowed when used memory > 'maxmemory'.\r\n";
    assert_eq!(
        script_error(oom),
        "OOM command not allowed when used memory > 'maxmemory'."
    );
    assert_eq!(script_error("WRONGTYPE Operation"), "WRONGTYPE Operation");
    let target = target(Dedupe::Markers);
    let events = [event(1, "a")];
    let chunk = chunk_of(&target, &events);
    let layout = built(&chunk, &shape(InUse::Markers)).layout;
    let reply = redis::Value::Array(vec![
        redis::Value::Int(1),
        redis::Value::BulkString(oom.as_bytes().to_vec()),
    ]);
    assert!(matches!(
        read(&chunk, &layout, vec![reply]),
        Err(Failed::Refused(error)) if error.text().starts_with("OOM ")
    ));
}

#[test]
fn each_call_gets_a_marker_field_of_its_own() {
    let fields: std::collections::HashSet<String> = (0..1000).map(|_| marker_field()).collect();
    assert_eq!(fields.len(), 1000);
    // Never taken for a marker of the old kind, a field named by an event id.
    assert!(fields.iter().all(|f| f.starts_with('m')));
}

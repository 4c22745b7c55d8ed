//! Timed drains, the relay cases' measure: a backlog committed in one transaction, timed until
//! Redis holds all of it; and two sides of a comparison run in turns, so that the machine's
//! drift lands on both alike.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::common::{wait_until, Client, Pg, Redis};
use crate::harness::fresh_table;

/// Repetitions of the relay throughput cases, the noisiest figures.
pub(crate) const RELAY_REPS: usize = 5;
/// The events a relay case commits at once and times the relay's drain of.
pub(crate) const BACKLOG: i64 = 200_000;

/// Polls for the end of a drain every this often while it is far ...
const POLL_FAR: Duration = Duration::from_millis(20);
/// ... and every this often once it is near.
const POLL_NEAR: Duration = Duration::from_millis(1);

/// Waits until `stream` holds `n` entries and returns when it first saw them, within about a
/// millisecond: it polls on one connection, every [`POLL_FAR`] while the rate seen so far puts
/// the end far away, and every [`POLL_NEAR`] once it is near. Polling every 20 ms throughout
/// added 10 ms on average to drains of under a second, which the in-server ceiling (timed by
/// its statement's return) does not carry; polling every millisecond throughout would take CPU
/// from the relay it times.
pub(crate) fn until_stream_holds(redis: &Redis, stream: &str, n: usize) -> Instant {
    let timeout = Duration::from_secs(600);
    let mut conn = redis.conn();
    let started = Instant::now();
    loop {
        let len: usize = redis::cmd("XLEN").arg(stream).query(&mut conn).unwrap();
        let now = Instant::now();
        if len >= n {
            return now;
        }
        let elapsed = now.duration_since(started);
        assert!(
            elapsed < timeout,
            "{stream} holds {len} of {n} entries after {timeout:?}"
        );
        let left = if len == 0 {
            POLL_FAR
        } else {
            elapsed.mul_f64((n - len) as f64 / len as f64)
        };
        std::thread::sleep((left / 2).clamp(POLL_NEAR, POLL_FAR));
    }
}

/// Commits `n` events in one transaction, then times until the stream holds them all. With
/// `fresh`, the table is emptied first; without, whatever history it holds stays.
pub(crate) fn drain_seconds(pg: &Pg, redis: &Redis, stream: &str, n: i64, fresh: bool) -> f64 {
    drain_seconds_in(pg, redis, "postgres", stream, n, fresh)
}

/// [`drain_seconds`] in the database `db`.
pub(crate) fn drain_seconds_in(
    pg: &Pg,
    redis: &Redis,
    db: &str,
    stream: &str,
    n: i64,
    fresh: bool,
) -> f64 {
    let mut client = pg.connect_to(db);
    if fresh {
        fresh_table(&mut client);
    }
    client
        .batch_execute("SET outbox.notify_channel = ''")
        .unwrap();
    client
        .execute(
            "SELECT outbox_enqueue($1, jsonb_build_object('account_id', g, 'email', 'user' || g || '@example.com')) \
             FROM generate_series(1::bigint, $2) g",
            &[&stream, &n],
        )
        .unwrap();
    let committed = Instant::now();
    let took = until_stream_holds(redis, stream, n as usize)
        .duration_since(committed)
        .as_secs_f64();
    let _ = redis::cmd("DEL")
        .arg(stream)
        .query::<i64>(&mut redis.conn());
    let pending = |client: &mut Client| -> i64 {
        client
            .query_one(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL",
                &[],
            )
            .unwrap()
            .get(0)
    };
    assert!(wait_until(Duration::from_secs(60), || pending(&mut client) == 0));
    took
}

/// Runs `run` for each of two sides `RELAY_REPS` times, the sides taking turns at going first;
/// returns each side's figures.
pub(crate) fn alternating(
    sides: [&'static str; 2],
    mut run: impl FnMut(&'static str) -> f64,
) -> HashMap<&'static str, Vec<f64>> {
    let mut runs: HashMap<&str, Vec<f64>> = HashMap::new();
    for rep in 0..RELAY_REPS {
        let [first, second] = sides;
        let order = if rep % 2 == 0 {
            [first, second]
        } else {
            [second, first]
        };
        for side in order {
            let figure = run(side);
            runs.entry(side).or_default().push(figure);
        }
    }
    runs
}

/// Commits the `n` events `enqueue` writes (`$1` is `n`) in one transaction, then times until
/// `stream` holds them all; returns events a second.
pub(crate) fn events_per_second(
    pg: &Pg,
    redis: &Redis,
    stream: &str,
    enqueue: &str,
    n: i64,
) -> f64 {
    pg.connect().execute(enqueue, &[&n]).unwrap();
    let committed = Instant::now();
    let took = until_stream_holds(redis, stream, n as usize)
        .duration_since(committed)
        .as_secs_f64();
    let _ = redis::cmd("DEL")
        .arg(stream)
        .query::<i64>(&mut redis.conn());
    n as f64 / took
}

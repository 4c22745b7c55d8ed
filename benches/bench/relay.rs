//! `BENCH_ONLY=relay`: how fast the relay drains a backlog committed at once, at batch 100 and
//! 1000, dedupe on and off. The baseline is the database's ceiling: a procedure in the server
//! that claims and marks the same rows with the relay's query, batch size and session settings,
//! one transaction per batch, with no client round trip and no Redis, the most any relay could
//! reach on this server. It runs in a second database of the same server, where no relay works,
//! in turns with the relay's drains, so that the three figures of a repetition see the same
//! drift. Dedupe's cost is the drain with dedupe on against the one with it off, paired alike.

use std::collections::HashMap;
use std::time::Instant;

use crate::common::{Client, Pg, Redis};
use crate::drain::{drain_seconds, BACKLOG, RELAY_REPS};
use crate::harness::{fresh_table, set_and_wait};
use crate::report::{median, paired_ratio_each, Report};

pub(crate) fn relay_throughput(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    println!("2. relay throughput ({BACKLOG} events committed at once)");
    // The database-side ceiling runs in a second database of the same server, where no relay
    // works, so that it can alternate with the relay's runs: all three cases of a repetition
    // see the same drift of a shared machine.
    pg.connect()
        .batch_execute("CREATE DATABASE ceiling")
        .unwrap();
    let mut ceiling_db = pg.connect_to("ceiling");
    ceiling_db.batch_execute("CREATE EXTENSION outbox").unwrap();
    let mut runs: HashMap<(i64, &str), Vec<f64>> = HashMap::new();
    for batch in [100, 1000] {
        for rep in 0..RELAY_REPS {
            let order = if rep % 2 == 0 {
                ["on", "off"]
            } else {
                ["off", "on"]
            };
            for dedupe in order {
                let b = batch.to_string();
                let expect = [format!("batch_size={batch} "), format!("dedupe={dedupe} ")];
                set_and_wait(
                    pg,
                    &[("outbox.batch_size", b.as_str()), ("outbox.dedupe", dedupe)],
                    &[&expect[0], &expect[1]],
                );
                let secs = drain_seconds(pg, redis, "throughput", BACKLOG, true);
                runs.entry((batch, dedupe))
                    .or_default()
                    .push(BACKLOG as f64 / secs);
            }
            let secs = ceiling_seconds(&mut ceiling_db, BACKLOG, batch);
            runs.entry((batch, "ceiling"))
                .or_default()
                .push(BACKLOG as f64 / secs);
        }
    }
    let figures: HashMap<(i64, &str), f64> =
        runs.iter().map(|(k, v)| (*k, median(v.clone()))).collect();
    let ratio =
        |batch: i64, a: &str, b: &str| paired_ratio_each(&runs[&(batch, a)], &runs[&(batch, b)]);

    for batch in [100, 1000] {
        let group = format!("batch {batch}");
        for (side, series) in [
            ("on", "relay, dedupe on"),
            ("off", "relay, dedupe off"),
            ("ceiling", "in-server claim and mark, no Redis"),
        ] {
            report.bar("drain", &group, series, figures[&(batch, side)]);
        }
    }
    for batch in [100, 1000] {
        let ceiling = figures[&(batch, "ceiling")];
        for dedupe in ["on", "off"] {
            let figure = figures[&(batch, dedupe)];
            let target = if batch == 1000 && dedupe == "on" {
                ">= 0.9 of the ceiling"
            } else {
                ""
            };
            report.row(
                &format!("relay, batch {batch}, dedupe {dedupe}"),
                format!("{figure:.0} events/s"),
                format!("{ceiling:.0} events/s (in-server claim+mark loop, no Redis)"),
                ratio(batch, dedupe, "ceiling"),
                target,
            );
        }
        let on = figures[&(batch, "on")];
        let off = figures[&(batch, "off")];
        report.row(
            &format!("dedupe cost, batch {batch}"),
            format!("{on:.0} events/s (on)"),
            format!("{off:.0} events/s (off)"),
            ratio(batch, "on", "off"),
            ">= 0.75 (within 25%)",
        );
    }
}

/// The database side alone: claim and mark the same rows in batches of the same size, one
/// transaction per batch, in the server, with no Redis in between.
fn ceiling_seconds(client: &mut Client, n: i64, batch: i64) -> f64 {
    fresh_table(client);
    client
        .execute(
            "INSERT INTO outbox (topic, payload) SELECT 'ceiling', \
             jsonb_build_object('account_id', g, 'email', 'user' || g || '@example.com') \
             FROM generate_series(1::bigint, $1) g",
            &[&n],
        )
        .unwrap();
    // The relay's claim and mark, in the server: a procedure that claims a batch with the
    // relay's query (every column it reads, the payload and headers as text, in the order of
    // the partial index, past the last batch as a quiet drain's claims are), marks it partition
    // by partition through static statements, as the relay does, and commits, until nothing is
    // left. No client round trip and no Redis: the database's ceiling.
    let marks: Vec<String> = (0..16)
        .map(|leaf| {
            format!(
                "{} leaf = {leaf} THEN UPDATE outbox_{leaf:02} SET published_at = now() \
                 WHERE id = ANY (leaf_ids);",
                if leaf == 0 { "IF" } else { "ELSIF" }
            )
        })
        .collect();
    client
        .batch_execute(&format!(
            "CREATE OR REPLACE PROCEDURE ceiling_drain(batch int) LANGUAGE plpgsql AS $$
             DECLARE
                 ids bigint[];
                 columns bigint;
                 leaf int;
                 leaf_ids bigint[];
                 last_id bigint := -1;
             BEGIN
                 LOOP
                     SELECT array_agg(c.id), max(c.id),
                            count(c.topic) + count(c.payload) + count(c.created_at)
                            + count(c.attempts) + count(c.key) + count(c.headers)
                       INTO ids, last_id, columns
                       FROM (SELECT o.id, o.topic, o.payload::text AS payload, o.created_at,
                                    o.attempts, o.key, o.headers::text AS headers
                               FROM outbox o
                              WHERE o.published_at IS NULL AND o.next_attempt_at IS NULL
                                AND o.lane >= 0 AND o.lane < 1024 AND o.id > last_id
                              ORDER BY o.id, o.lane LIMIT batch FOR UPDATE SKIP LOCKED) c;
                     EXIT WHEN ids IS NULL;
                     FOR leaf, leaf_ids IN
                         SELECT (i / 65536) % 16, array_agg(i) FROM unnest(ids) i GROUP BY 1
                     LOOP
                         {} END IF;
                     END LOOP;
                     COMMIT;
                 END LOOP;
             END $$",
            marks.join(" ")
        ))
        .unwrap();
    // The relay's own session settings (`src/relay/session.rs`) where they bear on the plan: a
    // generic plan kept across passes, an index walk, no JIT; and on its commits: with dedupe
    // on (the target case) they do not wait for their WAL flush.
    client
        .batch_execute(
            "SET plan_cache_mode = force_generic_plan; SET jit = off; \
             SET enable_seqscan = off; SET enable_sort = off; SET enable_incremental_sort = off; \
             SET max_parallel_workers_per_gather = 0; SET synchronous_commit = off",
        )
        .unwrap();
    let started = Instant::now();
    client
        .batch_execute(&format!("CALL ceiling_drain({batch})"))
        .unwrap();
    client.batch_execute("RESET ALL").unwrap();
    started.elapsed().as_secs_f64()
}

//! `BENCH_ONLY=keys-write` and `keys-trace`: the write cost of an event with a key and headers,
//! and of a keyed event whose traceparent comes from a sqlcommenter comment on the statement.
//! The baseline is a hand-written insert of the same columns (the headers written out), so that
//! the ratio shows what the function adds, not what the wider row costs. Measured as the plain
//! write case's targeted one: pairs of 8-client runs in turns, also counted until every event is
//! in Redis, and both transactions drawn at random in one run by one client.

use std::collections::HashMap;

use crate::common::{Pg, Redis};
use crate::report::{median, paired_ratio_spread, Report};
use crate::write::{
    mixed_write_row, tps_of, until_published_row, write_run, WriteRun, STREAM, WRITE_PAIRS,
};

/// A keyed event with headers against a hand-written insert of the same columns, 8 clients.
pub(crate) fn keyed_write(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let business = "INSERT INTO accounts (email) VALUES ('ada@example.com');\n";
    let (payload, key) = ("'{\"account_id\": 7}'", "'account-7'");
    let headers =
        "'{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}'";
    let hand = format!(
        "BEGIN;\n{business}INSERT INTO outbox (topic, payload, key, headers) \
         VALUES ('account.created', {payload}, {key}, {headers});\nCOMMIT;\n"
    );
    let enqueue = format!(
        "BEGIN;\n{business}SELECT outbox_enqueue('account.created', {payload}, {key}, {headers});\nCOMMIT;\n"
    );
    write_pairs(
        pg,
        redis,
        report,
        "+ outbox_enqueue with key and headers",
        &hand,
        &enqueue,
    );
}

/// A keyed event whose traceparent comes from a sqlcommenter comment on the statement, against
/// a hand-written insert of the same columns with the headers written out.
pub(crate) fn traced_write(pg: &mut Pg, redis: &Redis, report: &mut Report) {
    let business = "INSERT INTO accounts (email) VALUES ('ada@example.com');\n";
    let (payload, key) = ("'{\"account_id\": 7}'", "'account-7'");
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let hand = format!(
        "BEGIN;\n{business}INSERT INTO outbox (topic, payload, key, headers) \
         VALUES ('account.created', {payload}, {key}, '{{\"traceparent\": \"{parent}\"}}');\nCOMMIT;\n"
    );
    let enqueue = format!(
        "BEGIN;\n{business}SELECT outbox_enqueue('account.created', {payload}, {key}) \
         /*db_driver='psycopg%3A3.2.3',framework='django%3A5.1',traceparent='{parent}'*/;\nCOMMIT;\n"
    );
    write_pairs(
        pg,
        redis,
        report,
        "+ outbox_enqueue with key, traceparent from a sqlcommenter comment",
        &hand,
        &enqueue,
    );
}

/// Pairs of 8-client runs of `enqueue` and `hand` (the hand-written insert of the same
/// columns), reported as `case`.
fn write_pairs(
    pg: &mut Pg,
    redis: &Redis,
    report: &mut Report,
    case: &str,
    hand: &str,
    enqueue: &str,
) {
    let mut admin = pg.connect();
    let mut runs: HashMap<&str, Vec<WriteRun>> = HashMap::new();
    for rep in 0..WRITE_PAIRS {
        let mut order = [("hand", hand), ("enqueue", enqueue)];
        if rep % 2 == 1 {
            order.reverse();
        }
        for (name, script) in order {
            admin
                .batch_execute("TRUNCATE accounts, outbox; CHECKPOINT")
                .unwrap();
            runs.entry(name).or_default().push(write_run(
                pg,
                redis,
                &mut admin,
                script,
                8,
                Some(STREAM),
            ));
        }
    }
    let tps = tps_of(&runs);
    println!("  hand {:?}\n  enqueue {:?}", tps["hand"], tps["enqueue"]);
    let row = format!("write, 8 clients: {case}");
    report.row(
        &row,
        format!("{:.0} tps", median(tps["enqueue"].clone())),
        format!(
            "{:.0} tps (hand-written insert of the same columns)",
            median(tps["hand"].clone())
        ),
        paired_ratio_spread(&tps["enqueue"], &tps["hand"]),
        ">= 0.95 (within 5%)",
    );
    until_published_row(
        report,
        &row,
        &runs["enqueue"],
        &runs["hand"],
        "hand-written insert of the same columns",
    );

    mixed_write_row(pg, &mut admin, report, case, hand, enqueue);
}

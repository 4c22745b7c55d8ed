//! `BENCH_ONLY=keys`: keys, headers and delayed delivery, in the order below, each also run
//! alone by its own name: `keys-write` and `keys-trace` ([`write`]), `keys-workers`
//! ([`workers`]), `keys-held` ([`held`]), `keys-delayed` ([`delayed`]) and `keys-spill`
//! ([`spill`]). Each file says what it measures and against what.

mod delayed;
mod held;
mod spill;
mod workers;
mod write;

use crate::common::{Pg, Redis};
use crate::report::Report;
use crate::write::set_fsync;
use delayed::beside_delayed;
use held::held_key_latency;
use spill::beside_held_backlog;
use workers::keyed_workers;
use write::{keyed_write, traced_write};

/// Keys, headers and delayed delivery: the write cost of a keyed event with headers, the drain
/// with two workers beside one, the latency of 199 keys beside one held back by a rejected
/// event, and a drain beside a million delayed events; and the latency of a healthy topic beside
/// 20,000 held events of a rejected one.
pub(crate) fn keys(pg: &mut Pg, redis: &Redis, report: &mut Report, parts: &dyn Fn(&str) -> bool) {
    println!("9. keys, headers and delayed delivery");
    pg.connect()
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, email text NOT NULL)",
        )
        .unwrap();
    // The write cases with fsync on, as the plain write case runs.
    if parts("keys-write") {
        set_fsync(pg, "on");
        keyed_write(pg, redis, report);
        set_fsync(pg, "off");
    }
    if parts("keys-trace") {
        set_fsync(pg, "on");
        traced_write(pg, redis, report);
        set_fsync(pg, "off");
    }
    if parts("keys-workers") {
        keyed_workers(pg, redis, report);
    }
    if parts("keys-held") {
        held_key_latency(pg, redis, report);
    }
    if parts("keys-delayed") {
        beside_delayed(pg, redis, report);
    }
    if parts("keys-spill") {
        beside_held_backlog(pg, redis, report);
    }
}

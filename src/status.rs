//! The functions behind the `outbox_workers` and `outbox_status` views: they read the workers'
//! shared-memory slots. Without the preload there are no slots, and no relay is running.

use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;

use crate::gucs;
use crate::shmem::{self, WorkerState};

fn timestamp(value: Option<i64>) -> Option<TimestampWithTimeZone> {
    value.and_then(|v| TimestampWithTimeZone::try_from(v).ok())
}

/// One row per configured worker slot; declared in `sql/outbox.sql`.
#[pg_extern(sql = false)]
#[allow(clippy::type_complexity)]
fn _outbox_worker_slots() -> TableIterator<
    'static,
    (
        name!(slot, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(published, i64),
        name!(last_batch_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    let rows: Vec<_> = match shmem::shared() {
        None => Vec::new(),
        Some(shared) => shared
            .slots(gucs::workers())
            .iter()
            .enumerate()
            .map(|(index, slot)| {
                let s = slot.snapshot();
                let running = s.pid != 0;
                (
                    index as i32,
                    running.then_some(s.pid),
                    if running {
                        s.state
                    } else {
                        WorkerState::Stopped
                    }
                    .name()
                    .to_string(),
                    s.published,
                    timestamp(s.last_batch_at),
                    s.last_error,
                    timestamp(s.last_error_at),
                )
            })
            .collect(),
    };
    TableIterator::new(rows)
}

/// When any worker last marked a batch published, since the server started.
#[pg_extern(sql = false)]
fn _outbox_last_published_at() -> Option<TimestampWithTimeZone> {
    timestamp(shmem::shared()?.last_published_at())
}

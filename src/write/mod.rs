//! The write path: what runs in the caller's backend, inside the caller's transaction, when it
//! enqueues an event.
//!
//! `outbox_enqueue` checks its arguments (`enqueue.rs`), adds the trace context of the statement
//! that called it (`trace.rs`), gives the event its lane (`model/lane.rs`), inserts the row through the
//! executor (`insert/`), asks for the relay to be woken when the transaction commits
//! (`wake.rs`), and notes its topic for the notification sent at commit (`notify.rs`). What a
//! backend keeps between calls is wrapped in `backend.rs`. Nothing here
//! talks to Redis: the relay does, once the transaction has committed.

pub mod backend;
mod enqueue;
pub mod insert;
mod notify;
mod trace;
pub mod wake;

//! Claiming: how a pass takes the events it publishes.
//!
//! `claimer.rs` runs a pass's claims over `scope.rs`'s lanes; `cursor.rs` says where each
//! starts and what it reaches; `query.rs` runs a prepared claim through the executor and
//! `rows.rs` reads what it took; `hold.rs` looks for held events whose key has nothing before
//! them; `retry.rs` says when failed and due events are looked for and when a failed event is
//! tried again; `memory.rs` is what claims remember from pass to pass. The claims' SQL is in
//! `relay/sql.rs`, prepared in `relay/statements.rs`.

mod claimer;
pub mod cursor;
pub mod hold;
mod memory;
pub mod query;
pub mod retry;
pub mod rows;
mod scope;

pub use claimer::Claimer;
pub use memory::Claims;
pub use rows::{not_cloudevents, Claimed, Failure};
pub use scope::Scope;

//! What the write path, the relay, shared memory and the settings agree on, at the bottom of the
//! crate: where an event's row lives (`ring.rs`), its lane (`lane.rs`), what W3C Trace Context
//! accepts (`w3c.rs`) and which databases `outbox.database` names (`databases.rs`). Nothing here
//! imports from the rest of the crate.

pub mod databases;
pub mod lane;
pub mod ring;
pub mod w3c;

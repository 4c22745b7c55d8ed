//! PostgreSQL plumbing that the write path and the relay both use: what differs between the
//! majors the extension builds for (`compat.rs`), the database's text as UTF-8 (`utf8.rs`), the
//! schema the extension lives in (`schema.rs`), and a background worker's signals, latch and
//! transaction bracket (`worker.rs`). Nothing here imports from the rest of the crate.

pub mod compat;
pub mod schema;
pub mod utf8;
pub mod worker;

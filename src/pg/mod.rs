//! PostgreSQL plumbing that the write path and the relay both use: what differs between the
//! majors the extension builds for, and the database's text as UTF-8.

pub mod compat;
pub mod utf8;

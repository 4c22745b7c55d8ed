//! The relay's Redis side, with no PostgreSQL in it: what the extension's background worker
//! hands to Redis and how. The worker's main thread reads the settings and the events from the
//! database and gives them to this crate as plain values; what goes wrong here comes back to it
//! as values too, for it to log.

pub mod encode;
pub mod password_file;
pub mod redis_url;

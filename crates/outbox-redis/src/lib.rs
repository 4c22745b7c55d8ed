//! The relay's Redis side, with no PostgreSQL in it: what the extension's background worker
//! hands to Redis and how. The worker's main thread reads the settings and the events from the
//! database and gives them to this crate as plain values; what goes wrong here comes back to it
//! as values too, for it to log.
//!
//! The modules, each using only those listed before it:
//!
//! - `error`: why Redis could not be used, by kind (`Error`).
//! - `target`: the Redis side of the settings (`Target`, `Mode`, `TlsFiles`).
//! - `resp`: commands written as Redis reads them, into one buffer per round trip.
//! - `rfc3339`: an event's timestamp as the text Redis gets.
//! - `encode`: an event on its way to Redis (`Event`), stream keys, entry fields, marker keys.
//! - `cloudevents`: an event's entry as a CloudEvent, and which events can be one.
//! - `outcome`: what Redis made of a chunk (`Outcome`, `Markers`, `Answer`, `Failed`).
//! - `redis_url`, `password_file`: the URLs of `outbox.redis_url`, and the password files.
//! - `one_by_one`: a key's order in a chunk sent again event by event.
//! - `server`: what the servers can do (IDMP, `ACKED` trimming), from `INFO`, and so how the
//!   relay deduplicates.
//! - `doubt`: the events sent in a transaction that did not commit, and how each went, so that
//!   each goes again the same way.
//! - `scripts`: the markers' Lua script, called by SHA1 or whole.
//! - `idmp`: deduplication by Redis itself: producers, identities, the streams' windows.
//! - `link`: the link per mode (one server, Sentinel, Cluster; TLS), and its pipelines.
//! - `pipeline`: the commands of one round trip (the markers' script, `add.lua` or plain `XADD`s,
//!   a file each) and how their replies map back to events.
//! - `connection`: a chunk sent on a link, and an event that breaks the connection isolated.
//! - `publish`: the publisher thread, and the channel the worker's main thread drives it by.

pub mod cloudevents;
mod connection;
mod doubt;
pub mod encode;
pub mod error;
pub mod idmp;
mod link;
mod one_by_one;
pub mod outcome;
mod password_file;
mod pipeline;
pub mod publish;
pub mod redis_url;
mod resp;
mod rfc3339;
mod scripts;
pub mod server;
pub mod target;

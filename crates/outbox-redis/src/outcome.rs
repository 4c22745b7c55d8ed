//! What Redis made of a chunk: an outcome per event, the dedupe markers the chunk left behind,
//! or why the chunk as a whole could not be answered event by event. The pipeline reads replies
//! into these, the connection retries by them, the publisher thread hands them to the relay.

use crate::error::Error;

/// What became of one event of a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It is in its stream.
    Added,
    /// Redis refused it, or it broke the connection alone: it is charged an attempt.
    Failed(String),
    /// It was not sent: an earlier event of its key (else topic) failed in the same chunk, sent
    /// event by event (see `one_by_one.rs`). It waits for that one, uncharged.
    HeldBack,
}

/// Dedupe markers: those one script call left in one marker hash, under one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Markers {
    pub hash: String,
    pub field: String,
}

/// What Redis made of a chunk: one outcome per event, in order, and the markers the chunk left
/// behind (with dedupe on), to delete once its transaction has committed.
pub struct Answer {
    pub results: Vec<Outcome>,
    pub markers: Vec<Markers>,
    /// Why trimming by age failed, if it did: the events are in their streams all the same.
    pub trim_error: Option<String>,
    /// Positions of events not added because their stream did not exist: with IDMP an XADD
    /// creates no stream (`NOMKSTREAM`), since a stream created so would lack its window. They
    /// go again once the stream has it.
    pub missing: Vec<usize>,
}

/// Why a chunk could not be answered event by event.
pub enum Failed {
    /// Redis said no to the whole chunk (NOAUTH, NOPERM, OOM ...), or could not be used for it
    /// (a setting, a connection that cannot be opened): nobody is charged.
    Refused(Error),
    /// The connection failed in the middle of the chunk (an I/O error, a timeout, a reply
    /// that makes no sense): Redis may be gone, or one event may have broken the connection.
    Broken(String),
}

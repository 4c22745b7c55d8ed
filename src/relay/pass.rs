//! What one pass of the relay's loop found, which says what the loop does next.

use std::time::Duration;

/// What one pass of the loop found.
pub enum Pass {
    /// A full batch went out: claim again at once.
    Full,
    /// Less than a full batch: wait for a wake-up or the poll.
    Drained,
    /// Redis is unreachable: wait this long, whatever wakes the latch.
    RedisDown(Duration),
    /// The extension does not exist (yet) in `outbox.database`, or the server is a standby.
    NoExtension,
}

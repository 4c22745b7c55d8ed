//! What one pass of the relay's loop does: the chunks its batch goes out in, what its
//! transaction did, and what it found, which says what the loop does next.

use std::time::Duration;

use crate::pg::worker::End;

/// Events per chunk of a batch: a batch goes out in up to two chunks of at least 50 events, so
/// that the database's work on one chunk overlaps Redis's work on another; a small batch goes
/// out whole.
pub fn chunk_size(batch_size: usize) -> usize {
    batch_size.div_ceil(2).max(50).min(batch_size.max(1))
}

/// What one transaction did.
pub struct Batch {
    pub pass: Pass,
    pub published: u64,
    /// The ring's partitions that hold the published events, as a bitmask.
    pub leaves: u32,
    pub end: End,
}

impl Batch {
    /// A transaction that published nothing and commits.
    pub fn nothing(pass: Pass) -> Batch {
        Batch {
            pass,
            published: 0,
            leaves: 0,
            end: End::Commit,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::chunk_size;

    #[test]
    fn a_batch_goes_out_in_at_most_two_chunks_of_fifty_or_more() {
        for batch in (1..=10_000)
            .step_by(7)
            .chain([50, 99, 100, 200, 1000, 10_000])
        {
            let chunk = chunk_size(batch);
            let chunks = batch.div_ceil(chunk);
            assert!(chunks <= 2, "batch {batch}: {chunks} chunks of {chunk}");
            assert!(
                chunk >= 50.min(batch),
                "batch {batch}: chunks of {chunk} events"
            );
            assert!(chunk <= batch, "batch {batch}: chunks of {chunk} events");
        }
    }
}

//! Strings kept for the next claim: the texts of events Redis has answered for, emptied.
//!
//! A claim copies each event's topic and payload (and key and headers, when set) into strings
//! that go to the Redis thread and come back with its answer. Allocated for every event and
//! freed once it was answered, they would cost the relay's main thread (the one that runs the
//! claim and the mark, and whose speed is the relay's) a `malloc` and a `free` each; kept and
//! filled again, they cost a copy. The pool is kept for the time it measurably saves that thread
//! while it drains a backlog.
//!
//! The pool is bounded in count and in the size of what it keeps, so that a burst of large
//! payloads does not stay in the worker's memory, and it is emptied when a pass finds less than
//! a full batch, so that an idle worker holds none of it.

use std::cell::RefCell;

use outbox_redis::encode::Event;

thread_local! {
    /// The main thread's pool: the thread that claims, and to which the Redis thread hands the
    /// events back.
    static POOL: RefCell<Spare> = RefCell::new(Spare::default());
}

/// A string holding `text`, from the calling thread's pool when it has one.
pub fn filled(text: &str) -> String {
    POOL.with_borrow_mut(|pool| pool.filled(text))
}

/// Keeps the strings of an event Redis has answered for in the calling thread's pool.
pub fn keep(event: Event) {
    POOL.with_borrow_mut(|pool| {
        pool.keep(event.topic);
        pool.keep(event.payload);
        if let Some(key) = event.key {
            pool.keep(key);
        }
        if let Some(headers) = event.headers {
            pool.keep(headers);
        }
    });
}

/// Frees the calling thread's pool.
pub fn release() {
    POOL.with_borrow_mut(Spare::release);
}

/// Strings kept at most: two per event of a batch of 1,000 and more.
const MOST: usize = 4096;

/// The largest capacity kept; a larger string is freed.
const LARGEST: usize = 1024;

/// Emptied strings, ready to be filled again.
#[derive(Debug, Default)]
pub struct Spare {
    strings: Vec<String>,
}

impl Spare {
    /// An empty string holding `text`, from the pool when it has one.
    pub fn filled(&mut self, text: &str) -> String {
        match self.strings.pop() {
            Some(mut string) => {
                string.push_str(text);
                string
            }
            None => text.to_owned(),
        }
    }

    /// Keeps `string` for a later [`Spare::filled`], emptied, unless the pool is full or the
    /// string too large.
    pub fn keep(&mut self, mut string: String) {
        if self.strings.len() < MOST && string.capacity() <= LARGEST {
            string.clear();
            self.strings.push(string);
        }
    }

    /// Frees every string kept.
    pub fn release(&mut self) {
        self.strings = Vec::new();
    }

    /// How many strings are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.strings.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_string_is_filled_again_without_a_new_allocation() {
        let mut spare = Spare::default();
        let first = spare.filled("account.created");
        assert_eq!(first, "account.created");
        let address = first.as_ptr();
        spare.keep(first);
        assert_eq!(spare.len(), 1);
        let again = spare.filled("short");
        assert_eq!(again, "short");
        assert_eq!(again.as_ptr(), address);
        assert_eq!(spare.len(), 0);
    }

    #[test]
    fn large_strings_are_not_kept() {
        let mut spare = Spare::default();
        spare.keep("x".repeat(LARGEST + 1));
        assert_eq!(spare.len(), 0);
        spare.keep(String::with_capacity(LARGEST));
        assert_eq!(spare.len(), 1);
    }

    #[test]
    fn the_pool_holds_at_most_its_bound_and_release_empties_it() {
        let mut spare = Spare::default();
        for _ in 0..MOST + 10 {
            spare.keep(String::from("payload"));
        }
        assert_eq!(spare.len(), MOST);
        spare.release();
        assert_eq!(spare.len(), 0);
        assert_eq!(spare.filled("{}"), "{}");
    }
}

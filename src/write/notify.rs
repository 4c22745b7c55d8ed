//! The notification `outbox_enqueue` sends on `outbox.notify_channel`: `pg_notify(channel,
//! topic)`, once per topic and transaction, for sessions that `LISTEN`.
//!
//! The topics are noted as events are written and the notifications queued from the pre-commit
//! callback, the last moment PostgreSQL takes them for this commit; the channel is read then,
//! and nothing is sent while no session of the database listens on it (`hooks/listen.rs`
//! counts them): a notifying commit takes a database-wide lock and holds it through its flush,
//! so that notifying commits share no flush, a cost for nobody when nobody listens.
//! A transaction that queued a notification cannot be prepared, so a `PREPARE TRANSACTION`
//! forgets the topics instead: a prepared transaction notifies nobody, and its events reach
//! the relay at `COMMIT PREPARED` (which wakes it, see `wake.rs`). A topic noted in a
//! subtransaction that rolled back is still notified: a listener may hear of a topic with no
//! new event, never miss one.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{c_char, c_void, CString};

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::backend::{self, BackendLocal};
use crate::gucs;

/// The topics the current transaction wrote events to, while the channel was set.
static TOPICS: BackendLocal<RefCell<Option<HashSet<Vec<u8>>>>> =
    BackendLocal::new(RefCell::new(None));

/// Notes that the current transaction wrote an event of `topic` (in the database's encoding),
/// to be notified at commit if `outbox.notify_channel` is set. Cheap for a topic already noted.
pub fn note(topic: &[u8]) {
    if gucs::notify_channel_ptr().is_none() {
        return;
    }
    backend::register_once(&backend::NOTIFY_CALLBACK, || {
        // SAFETY: registers a callback that lives as long as the library, once per backend.
        unsafe { pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut()) };
    });
    let mut topics = TOPICS.get().borrow_mut();
    let topics = topics.get_or_insert_with(HashSet::new);
    if !topics.contains(topic) {
        topics.insert(topic.to_vec());
    }
}

/// Whether a session of this database may listen on `channel`: always without the preload,
/// where nobody counts them.
fn heard(channel: *const c_char) -> bool {
    let Some(shared) = crate::shmem::shared() else {
        return true;
    };
    // SAFETY: `channel` is the NUL-terminated setting's value; reads this backend's database.
    let (channel, database) = unsafe {
        (
            std::ffi::CStr::from_ptr(channel).to_bytes(),
            pg_sys::MyDatabaseId.to_u32(),
        )
    };
    shared.listeners.count(database, channel) > 0
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT => {
            let Some(topics) = TOPICS.get().borrow_mut().take() else {
                return;
            };
            let Some(channel) = gucs::notify_channel_ptr() else {
                return;
            };
            if !heard(channel) {
                return;
            }
            for topic in topics {
                // A text value holds no NUL byte.
                let Ok(payload) = CString::new(topic) else {
                    continue;
                };
                // SAFETY: two NUL-terminated strings, which Async_Notify (what `pg_notify`
                // calls once it has its arguments as C strings) copies; an ERROR (a channel
                // the setting's check let through but NOTIFY refuses) becomes a Rust panic in
                // pgrx's binding and fails the commit, as pg_notify's would have failed the call.
                unsafe { pg_sys::Async_Notify(channel, payload.as_ptr()) };
            }
        }
        XACT_EVENT_PRE_PREPARE | XACT_EVENT_ABORT | XACT_EVENT_COMMIT | XACT_EVENT_PREPARE => {
            TOPICS.get().borrow_mut().take();
        }
        _ => {}
    }
}

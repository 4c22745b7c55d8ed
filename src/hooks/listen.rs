//! Counting the sessions that listen: every `LISTEN`, `UNLISTEN` and `DISCARD ALL` goes through
//! the utility hook (`utility.rs`), in a session's own statements as in PL/pgSQL's `EXECUTE`.
//! Each backend keeps the channels it listens on, as PostgreSQL applies them at commit, and
//! counts them in shared memory (`shmem/listeners.rs`) for `outbox_enqueue` to read at its
//! commit (`write/notify.rs`).
//!
//! Where a count may be off, it errs toward notifying: a `LISTEN` counts from its transaction's
//! pre-commit (before PostgreSQL registers the session for notifications), an `UNLISTEN` stops
//! counting only once its transaction has committed, and a session's exit stops its counts.
//! What a rolled-back transaction or subtransaction asked for is dropped, as PostgreSQL drops
//! it. A server crash resets shared memory, and every session with it.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ffi::{c_void, CStr};

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::shmem;
use crate::write::backend::{self, BackendLocal};

/// A channel's name as a statement gives it (at most `NAMEDATALEN - 1` bytes, as PostgreSQL
/// truncates identifiers), kept as plain data across the statement: an error in it ends in
/// PostgreSQL's longjmp past the hook's frame, which must hold nothing with a destructor.
#[derive(Debug, Clone, Copy)]
pub struct Named {
    bytes: [u8; pg_sys::NAMEDATALEN as usize],
    len: usize,
}

impl Named {
    fn new(name: &[u8]) -> Named {
        let mut bytes = [0; pg_sys::NAMEDATALEN as usize];
        let len = name.len().min(bytes.len());
        bytes[..len].copy_from_slice(&name[..len]);
        Named { bytes, len }
    }

    fn name(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// What a statement asks of the session's listening.
#[derive(Debug, Clone, Copy)]
pub enum Asked {
    Listen(Named),
    Unlisten(Named),
    UnlistenAll,
}

/// The channels a session listens on, and what its transaction asked for so far.
#[derive(Debug, Default)]
pub struct Session {
    listening: BTreeSet<Vec<u8>>,
    /// Each request with the subtransaction that made it.
    pending: Vec<(u32, Asked)>,
    /// Channels counted at pre-commit, before the commit applies them.
    counted_early: Vec<Vec<u8>>,
}

impl Session {
    fn ask(&mut self, subtransaction: u32, asked: Asked) {
        self.pending.push((subtransaction, asked));
    }

    /// The channels the session will listen on once its pending actions are applied.
    fn after_commit(&self) -> BTreeSet<Vec<u8>> {
        let mut after = self.listening.clone();
        for (_, asked) in &self.pending {
            match asked {
                Asked::Listen(channel) => {
                    after.insert(channel.name().to_vec());
                }
                Asked::Unlisten(channel) => {
                    after.remove(channel.name());
                }
                Asked::UnlistenAll => after.clear(),
            }
        }
        after
    }

    /// At pre-commit: the channels the commit will add, to count now.
    fn pre_commit(&mut self) -> &[Vec<u8>] {
        let after = self.after_commit();
        self.counted_early = after.difference(&self.listening).cloned().collect();
        &self.counted_early
    }

    /// At commit: the channels no longer listened on, to stop counting.
    fn commit(&mut self) -> Vec<Vec<u8>> {
        let after = self.after_commit();
        let removed = self.listening.difference(&after).cloned().collect();
        self.listening = after;
        self.pending.clear();
        self.counted_early.clear();
        removed
    }

    /// At abort: nothing applies; the channels counted early, to stop counting.
    fn abort(&mut self) -> Vec<Vec<u8>> {
        self.pending.clear();
        std::mem::take(&mut self.counted_early)
    }

    /// A subtransaction rolled back: what it and those inside it asked for is dropped (their
    /// ids are at least its own).
    fn abort_subtransaction(&mut self, subtransaction: u32) {
        self.pending
            .retain(|(asked_in, _)| *asked_in < subtransaction);
    }

    /// At exit: every channel still counted.
    fn exit(&mut self) -> Vec<Vec<u8>> {
        let mut counted: Vec<Vec<u8>> = std::mem::take(&mut self.listening).into_iter().collect();
        counted.append(&mut self.counted_early);
        self.pending.clear();
        counted
    }
}

static SESSION: BackendLocal<RefCell<Session>> = BackendLocal::new(RefCell::new(Session {
    listening: BTreeSet::new(),
    pending: Vec::new(),
    counted_early: Vec::new(),
}));

/// What `node` asks of the session's listening, if anything: read before the statement runs,
/// applied by [`after`] once it ran without error.
///
/// # Safety
/// `node` must be a valid parse node or null.
pub unsafe fn action(node: *mut pg_sys::Node) -> Option<Asked> {
    // SAFETY: guaranteed by the caller; the casts follow the node's tag.
    unsafe {
        if node.is_null() {
            return None;
        }
        let name = |raw: *const std::ffi::c_char| Named::new(CStr::from_ptr(raw).to_bytes());
        match (*node).type_ {
            pg_sys::NodeTag::T_ListenStmt => {
                let stmt = node.cast::<pg_sys::ListenStmt>();
                let channel = (*stmt).conditionname;
                (!channel.is_null()).then(|| Asked::Listen(name(channel)))
            }
            pg_sys::NodeTag::T_UnlistenStmt => {
                let channel = (*node.cast::<pg_sys::UnlistenStmt>()).conditionname;
                Some(if channel.is_null() {
                    Asked::UnlistenAll
                } else {
                    Asked::Unlisten(name(channel))
                })
            }
            pg_sys::NodeTag::T_DiscardStmt => {
                let stmt = node.cast::<pg_sys::DiscardStmt>();
                ((*stmt).target == pg_sys::DiscardMode::DISCARD_ALL).then_some(Asked::UnlistenAll)
            }
            _ => None,
        }
    }
}

/// After a utility statement ran without error: notes what it asked of the session's
/// listening ([`action`]).
pub fn after(asked: Option<Asked>) {
    let Some(asked) = asked else {
        return;
    };
    if shmem::shared().is_none() {
        return;
    }
    backend::register_once(&backend::LISTEN_CALLBACKS, || {
        // SAFETY: callbacks that live as long as the library, registered once per backend.
        unsafe {
            pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
            pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
            pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0));
        }
    });
    // SAFETY: reads the current subtransaction's id.
    let subtransaction = unsafe { pg_sys::GetCurrentSubTransactionId() };
    SESSION.get().borrow_mut().ask(subtransaction, asked);
}

/// Applies `change` to this database's count of each of `channels`.
fn count(channels: &[Vec<u8>], change: fn(&shmem::Listeners, u32, &[u8])) {
    let Some(shared) = shmem::shared() else {
        return;
    };
    // SAFETY: reads this backend's database.
    let database = unsafe { pg_sys::MyDatabaseId.to_u32() };
    for channel in channels {
        change(&shared.listeners, database, channel);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut c_void) {
    use pg_sys::XactEvent::*;
    let Ok(mut session) = SESSION.get().try_borrow_mut() else {
        return;
    };
    if session.pending.is_empty() && session.counted_early.is_empty() {
        return;
    }
    match event {
        XACT_EVENT_PRE_COMMIT => count(session.pre_commit(), shmem::Listeners::add),
        XACT_EVENT_COMMIT => count(&session.commit(), shmem::Listeners::remove),
        XACT_EVENT_ABORT => count(&session.abort(), shmem::Listeners::remove),
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    subtransaction: pg_sys::SubTransactionId,
    _parent: pg_sys::SubTransactionId,
    _arg: *mut c_void,
) {
    if event == pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB {
        if let Ok(mut session) = SESSION.get().try_borrow_mut() {
            session.abort_subtransaction(subtransaction);
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: std::ffi::c_int, _arg: pg_sys::Datum) {
    if let Ok(mut session) = SESSION.get().try_borrow_mut() {
        count(&session.exit(), shmem::Listeners::remove);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel(name: &str) -> Vec<u8> {
        name.as_bytes().to_vec()
    }

    fn listen(name: &str) -> Asked {
        Asked::Listen(Named::new(name.as_bytes()))
    }

    fn unlisten(name: &str) -> Asked {
        Asked::Unlisten(Named::new(name.as_bytes()))
    }

    #[test]
    fn a_listen_counts_from_its_commit_and_an_unlisten_after_it() {
        let mut session = Session::default();
        session.ask(1, listen("outbox"));
        assert_eq!(session.pre_commit(), [channel("outbox")]);
        assert!(session.commit().is_empty());
        // Listening again adds nothing.
        session.ask(1, listen("outbox"));
        assert!(session.pre_commit().is_empty());
        session.commit();
        session.ask(1, unlisten("outbox"));
        assert!(session.pre_commit().is_empty());
        assert_eq!(session.commit(), [channel("outbox")]);
        assert!(session.listening.is_empty());
    }

    #[test]
    fn unlisten_all_and_the_order_of_a_transactions_statements() {
        let mut session = Session::default();
        session.ask(1, listen("a"));
        session.ask(1, listen("b"));
        session.pre_commit();
        session.commit();
        session.ask(1, Asked::UnlistenAll);
        session.ask(1, listen("b"));
        assert!(session.pre_commit().is_empty());
        assert_eq!(session.commit(), [channel("a")]);
        assert_eq!(session.exit(), [channel("b")]);
    }

    #[test]
    fn what_rolls_back_is_dropped() {
        let mut session = Session::default();
        session.ask(1, listen("a"));
        session.pre_commit();
        // The commit failed after pre-commit: the early count is taken back.
        assert_eq!(session.abort(), [channel("a")]);
        assert!(session.listening.is_empty());
        // A subtransaction's UNLISTEN rolled back: the session still listens.
        session.ask(1, listen("a"));
        session.pre_commit();
        session.commit();
        session.ask(2, unlisten("a"));
        session.ask(3, Asked::UnlistenAll);
        session.abort_subtransaction(2);
        session.pre_commit();
        assert!(session.commit().is_empty());
        assert_eq!(session.listening.len(), 1);
    }
}

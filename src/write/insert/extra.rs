//! What `outbox_enqueue` hands an insert beside the topic and the payload: the same for the fast
//! path, the plain `INSERT` (`statement.rs`) and a delayed event (`delayed.rs`).

use pgrx::pg_sys;

/// What `outbox_enqueue` was given beyond the topic and the payload (from 0.5.0 on).
pub struct Extra {
    /// A text datum.
    pub key: Option<pg_sys::Datum>,
    /// A jsonb datum.
    pub headers: Option<pg_sys::Datum>,
    /// When the event is due (a timestamptz datum), if it is delayed: it then goes to
    /// `outbox_delayed` ([`insert_delayed`](super::insert_delayed)), not to `outbox`.
    pub deliver_at: Option<pg_sys::Datum>,
    pub lane: i16,
}

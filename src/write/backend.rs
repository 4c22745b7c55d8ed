//! State a backend keeps between calls, for its own life: PostgreSQL runs our code on one
//! thread per process, so a value here needs no lock, only a wrapper that says so. Also the
//! flags that say whether this backend registered a callback yet.

use std::cell::Cell;

/// A value the backend's only thread keeps between calls. Statics are never dropped, so nothing
/// here runs PostgreSQL code while the process exits.
pub struct BackendLocal<T>(T);

// SAFETY: a backend runs our code on one thread only; pgrx refuses calls from any other.
unsafe impl<T> Sync for BackendLocal<T> {}

impl<T> BackendLocal<T> {
    pub const fn new(value: T) -> BackendLocal<T> {
        BackendLocal(value)
    }

    pub fn get(&self) -> &T {
        &self.0
    }
}

/// Whether the transaction callback that wakes the relay at commit is registered.
pub static XACT_CALLBACK: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
/// Whether the transaction callback that sends the notifications at commit is registered.
pub static NOTIFY_CALLBACK: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
/// Whether the callbacks that count the session's listening are registered.
pub static LISTEN_CALLBACKS: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));
/// Whether the relcache callback that keeps the insert's set-up fresh is registered.
pub static RELCACHE_CALLBACK: BackendLocal<Cell<bool>> = BackendLocal::new(Cell::new(false));

/// Runs `register` the first time it is called for `flag` in this backend.
pub fn register_once(flag: &BackendLocal<Cell<bool>>, register: impl FnOnce()) {
    if !flag.get().get() {
        register();
        flag.get().set(true);
    }
}

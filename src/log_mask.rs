//! PostgreSQL's own log lines about `outbox.redis_url`, without its password. The relay masks
//! the URLs it logs (`redis_url::mask`), but PostgreSQL writes the setting's value itself: a
//! reload logs `parameter "outbox.redis_url" changed to "..."`, `log_statement` logs an
//! `ALTER SYSTEM SET outbox.redis_url = '...'` whole, and a refused statement is shown with its
//! error. A log hook, installed in every process of a server that loads the library, masks the
//! passwords in each line that names the setting, and in the statement shown with it. A utility
//! statement that names it (`ALTER SYSTEM`, `SET`) is also shown masked in `pg_stat_activity`.

use std::ffi::{c_char, CStr, CString};
use std::sync::{Mutex, OnceLock};

use pgrx::pg_sys;

use crate::redis_url;

static PREVIOUS: OnceLock<pg_sys::emit_log_hook_type> = OnceLock::new();

/// The masked copy of the running statement that `debug_query_string` points to, kept until
/// another takes its place.
static MASKED_STATEMENT: Mutex<Option<CString>> = Mutex::new(None);

/// Installs the hook; called from `_PG_init`.
pub fn init() {
    // SAFETY: _PG_init runs single-threaded as the library loads; chaining the hook is the
    // documented way for an extension to see log lines before they are written.
    unsafe {
        if PREVIOUS.set(pg_sys::emit_log_hook).is_ok() {
            pg_sys::emit_log_hook = Some(emit_log);
        }
    }
}

/// No `pg_guard`: this runs while PostgreSQL reports, where raising an error would recurse. A
/// panic is caught and leaves the line as it was.
unsafe extern "C-unwind" fn emit_log(edata: *mut pg_sys::ErrorData) {
    if !edata.is_null() {
        // SAFETY: PostgreSQL hands the hook the report it is about to write, on its main thread.
        let _ = std::panic::catch_unwind(|| unsafe { mask(&mut *edata) });
    }
    if let Some(previous) = PREVIOUS.get().copied().flatten() {
        // SAFETY: the hook that was installed before ours, called as PostgreSQL would.
        unsafe { previous(edata) }
    }
}

/// # Safety
/// `edata` is the report being written, its strings palloc'd or null.
unsafe fn mask(edata: &mut pg_sys::ErrorData) {
    if !edata.output_to_server {
        return;
    }
    for field in [
        &mut edata.message,
        &mut edata.detail,
        &mut edata.detail_log,
        &mut edata.hint,
        &mut edata.context,
        &mut edata.internalquery,
    ] {
        // SAFETY: each field is null or a NUL-terminated string of the report.
        if let Some(masked) = unsafe { masked(*field) } {
            // SAFETY: copied into the current memory context (the error context while a report
            // is written), as PostgreSQL's own strings of the report are.
            *field = unsafe { pg_sys::pstrdup(masked.as_ptr()) };
        }
    }
    if edata.hide_stmt {
        return;
    }
    // The statement shown with the line: PostgreSQL reads it from `debug_query_string`, which
    // the next statement sets again.
    // SAFETY: a global of the main thread, null or the running statement's text.
    let statement = unsafe { pg_sys::debug_query_string };
    // SAFETY: as above.
    if let Some(masked) = unsafe { masked(statement) } {
        let Ok(mut kept) = MASKED_STATEMENT.lock() else {
            return;
        };
        // SAFETY: the new copy lives in the static until a later statement's replaces it, and
        // `debug_query_string` never points to the one dropped here (masking it again would
        // have changed nothing).
        unsafe { pg_sys::debug_query_string = masked.as_ptr() };
        *kept = Some(masked);
    }
}

/// Shows the running utility statement masked in `pg_stat_activity` if it names the setting
/// with a password: the text stays there once the statement has ended, readable by roles with
/// `pg_read_all_stats` (which `pg_monitor` includes).
///
/// # Safety
/// `query_string` is null or the statement's NUL-terminated text; called on a backend's main
/// thread.
pub unsafe fn mask_activity(query_string: *const c_char) {
    // SAFETY: as the caller says.
    if let Some(masked) = unsafe { masked(query_string) } {
        // SAFETY: the text is copied into the backend's shared-memory entry.
        unsafe {
            pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, masked.as_ptr())
        };
    }
}

/// # Safety
/// `text` is null or a NUL-terminated string.
unsafe fn masked(text: *const c_char) -> Option<CString> {
    if text.is_null() {
        return None;
    }
    // SAFETY: as the caller says.
    let bytes = unsafe { CStr::from_ptr(text) }.to_bytes();
    CString::new(redis_url::mask_in_text(bytes)?).ok()
}

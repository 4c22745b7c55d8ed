//! PostgreSQL's own log lines about `outbox.redis_url`, without its password. The relay masks
//! the URLs it logs (`redis_url::mask`), but PostgreSQL writes the setting's value itself: a
//! reload logs `parameter "outbox.redis_url" changed to "..."`, `log_statement` logs an
//! `ALTER SYSTEM SET outbox.redis_url = '...'` whole, and a refused statement is shown with its
//! error. A log hook, installed in every process of a server that preloads the library, masks
//! the passwords in every part of a report that names the setting or holds a Redis URL
//! anywhere, and in the statement shown with it (`url_in_text.rs`). A utility statement that
//! does (`ALTER SYSTEM`, `SET`) is also shown masked in `pg_stat_activity`.
//!
//! Log hooks run newest first: a library loaded after this one (later in
//! `shared_preload_libraries`) sees a report before it is masked, one loaded before sees it
//! masked. The extension's own lines, masked as they are written, are left as they are.

use std::ffi::{c_char, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use pgrx::pg_sys;

use crate::url_in_text::{concerns_redis_url, mask_urls};

static PREVIOUS: OnceLock<pg_sys::emit_log_hook_type> = OnceLock::new();

/// The masked copy of the running statement that `debug_query_string` points to, kept until
/// another takes its place.
static MASKED_STATEMENT: Mutex<Option<CString>> = Mutex::new(None);

/// Set while the extension reports a line it has masked itself (`redis_url::mask`): the hook
/// leaves that alone, where masking again could cut text that only follows a masked password.
static WRITTEN_MASKED: AtomicBool = AtomicBool::new(false);

/// Runs `report`, a report of the extension's own whose Redis URLs are masked already.
pub fn written_masked<R>(report: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            WRITTEN_MASKED.store(false, Ordering::Relaxed);
        }
    }
    WRITTEN_MASKED.store(true, Ordering::Relaxed);
    let _reset = Reset;
    report()
}

/// Installs the hook; called first thing in `_PG_init`, so that what PostgreSQL reports from
/// then on is masked.
pub fn init() {
    // SAFETY: _PG_init runs single-threaded as the library loads; chaining the hook is the
    // documented way for an extension to see log lines before they are written.
    unsafe {
        if PREVIOUS.set(pg_sys::emit_log_hook).is_ok() {
            pg_sys::emit_log_hook = Some(emit_log);
        }
    }
}

/// No `pg_guard`: this runs while PostgreSQL reports, and nothing here may raise an error (a
/// masked part that `palloc` cannot hold drops the line instead). A panic drops the line too:
/// it may have held a password.
unsafe extern "C-unwind" fn emit_log(edata: *mut pg_sys::ErrorData) {
    if !edata.is_null() {
        // SAFETY: PostgreSQL hands the hook the report it is about to write, on its main thread.
        let panicked = std::panic::catch_unwind(|| unsafe { mask(&mut *edata) }).is_err();
        if panicked {
            // SAFETY: as above; leaving a report out of the server log is what the hook may do.
            unsafe { (*edata).output_to_server = false };
        }
    }
    if let Some(previous) = PREVIOUS.get().copied().flatten() {
        // SAFETY: the hook that was installed before ours, called as PostgreSQL would.
        unsafe { previous(edata) }
    }
}

/// # Safety
/// `edata` is the report being written, its strings allocated in its context or null.
unsafe fn mask(edata: &mut pg_sys::ErrorData) {
    if !edata.output_to_server {
        return;
    }
    // The extension's own line, if the flag is set and the report comes from Rust source: the
    // flag is taken by the first report, so none raised while it is written (an interrupt's)
    // passes unmasked.
    // SAFETY: `filename` is null or the reporting source file's name.
    if WRITTEN_MASKED.swap(false, Ordering::Relaxed)
        && unsafe { bytes(edata.filename) }.is_some_and(|f| f.ends_with(b".rs"))
    {
        return;
    }
    // The statement, where PostgreSQL will print it or a hook called after this one may read
    // it. SAFETY: globals of the main thread; the statement is null or the running one's text.
    let previous_hook = PREVIOUS.get().copied().flatten().is_some();
    let statement = if !edata.hide_stmt
        && (previous_hook
            || statement_is_logged(edata.elevel, unsafe { pg_sys::log_min_error_statement }))
    {
        unsafe { pg_sys::debug_query_string }
    } else {
        std::ptr::null()
    };
    let context = edata.assoc_context;
    let mut fields = [
        &mut edata.message,
        &mut edata.detail,
        &mut edata.detail_log,
        &mut edata.hint,
        &mut edata.context,
        &mut edata.internalquery,
    ];
    // Whether to mask is decided once for the report: a value may be in one part (the
    // parameters of a prepared statement, its DETAIL) and the name in another.
    // SAFETY: each is null or a NUL-terminated string.
    let concerned = fields
        .iter()
        .any(|f| unsafe { bytes(**f) }.is_some_and(concerns_redis_url))
        || unsafe { bytes(statement) }.is_some_and(concerns_redis_url);
    if !concerned {
        return;
    }
    for field in fields.iter_mut() {
        let original: *mut c_char = **field;
        // SAFETY: as above.
        let Some(masked) = unsafe { bytes(original) }.and_then(mask_urls) else {
            continue;
        };
        // More than `palloc` can hold raises an error even where running out does not.
        if masked.len() >= MAX_ALLOC_SIZE {
            edata.output_to_server = false;
            return;
        }
        // SAFETY: copied into the report's context, where PostgreSQL frees its strings, without
        // raising an error when memory is short; the string replaced was allocated there.
        unsafe {
            let copy = pg_sys::MemoryContextAllocExtended(
                context,
                masked.len() + 1,
                pg_sys::MCXT_ALLOC_NO_OOM as i32,
            )
            .cast::<u8>();
            if copy.is_null() {
                edata.output_to_server = false;
                return;
            }
            std::ptr::copy_nonoverlapping(masked.as_ptr(), copy, masked.len());
            *copy.add(masked.len()) = 0;
            **field = copy.cast();
            pg_sys::pfree(original.cast());
        }
    }
    // The statement shown with the line: PostgreSQL reads it from `debug_query_string`, which
    // the next statement sets again.
    // SAFETY: as above.
    let Some(masked) = unsafe { bytes(statement) }.and_then(mask_urls) else {
        return;
    };
    // `try_lock`: a report raised while this one is written (from a signal handler) finds it
    // taken, and has its statement left out.
    let (Ok(masked), Ok(mut kept)) = (CString::new(masked), MASKED_STATEMENT.try_lock()) else {
        edata.hide_stmt = true;
        return;
    };
    // SAFETY: the copy's buffer lives in the static until a later statement's replaces it, and
    // is in place before the one it replaces is dropped.
    unsafe { pg_sys::debug_query_string = masked.as_ptr() };
    *kept = Some(masked);
}

/// `MaxAllocSize`: what one `palloc` may ask for.
const MAX_ALLOC_SIZE: usize = 0x3fff_ffff;

/// Whether PostgreSQL shows the running statement with a report of this level, as its
/// `is_log_level_output` decides against `log_min_error_statement` (`LOG` ranks between
/// `ERROR` and `FATAL` there).
fn statement_is_logged(elevel: i32, min_level: i32) -> bool {
    let log = pg_sys::LOG as i32;
    if elevel == log || elevel == pg_sys::LOG_SERVER_ONLY as i32 {
        min_level == log || min_level <= pg_sys::PGERROR as i32
    } else if min_level == log {
        elevel >= pg_sys::FATAL as i32
    } else {
        elevel >= min_level
    }
}

/// Shows the running top-level utility statement masked in `pg_stat_activity` if it holds a
/// password of a Redis URL: the text stays there once the statement has ended, readable by
/// roles with `pg_read_all_stats` (which `pg_monitor` includes). A statement run by a function
/// is not shown there; the one that called the function is.
///
/// # Safety
/// `query_string` is null or the statement's NUL-terminated text; called on a backend's main
/// thread.
#[cfg(not(feature = "pg13"))]
pub unsafe fn mask_activity(query_string: *const c_char, top_level: bool) {
    if !top_level {
        return;
    }
    // SAFETY: as the caller says.
    let Some(text) = (unsafe { bytes(query_string) }) else {
        return;
    };
    if !concerns_redis_url(text) {
        return;
    }
    if let Some(masked) = mask_urls(text).and_then(|m| CString::new(m).ok()) {
        // SAFETY: the text is copied into the backend's shared-memory entry. Reporting it
        // clears the statement's query id, which is left so: a utility statement's id is
        // computed from its text or its constants, password included.
        unsafe {
            pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, masked.as_ptr())
        };
    }
}

/// # Safety
/// `text` is null or a NUL-terminated string that outlives the slice.
unsafe fn bytes<'a>(text: *const c_char) -> Option<&'a [u8]> {
    // SAFETY: as the caller says.
    (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_the_statement_as_postgresql_decides() {
        let (log, error, fatal, warning) = (
            pg_sys::LOG as i32,
            pg_sys::PGERROR as i32,
            pg_sys::FATAL as i32,
            pg_sys::WARNING as i32,
        );
        // The default, log_min_error_statement = error.
        assert!(statement_is_logged(error, error));
        assert!(statement_is_logged(log, error));
        assert!(!statement_is_logged(warning, error));
        // log_min_error_statement = log: LOG ranks above ERROR.
        assert!(statement_is_logged(log, log));
        assert!(!statement_is_logged(error, log));
        assert!(statement_is_logged(fatal, log));
        // log_min_error_statement = panic: nothing but a PANIC.
        assert!(!statement_is_logged(log, pg_sys::PANIC as i32));
        assert!(!statement_is_logged(fatal, pg_sys::PANIC as i32));
    }
}

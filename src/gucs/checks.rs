//! The check hooks of the `outbox.*` settings whose values PostgreSQL cannot check by itself:
//! each refuses a bad value and says what is wrong with it; for `outbox.redis_url`, without
//! quoting the value, which may hold a password.

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};

use outbox_redis::redis_url;
use pgrx::pg_sys;

use crate::model::databases::Selection;

/// Reads a GUC check hook's candidate value.
///
/// # Safety
/// `newval` must be the pointer PostgreSQL passes to a string check hook.
unsafe fn candidate<'a>(newval: *mut *mut c_char) -> Option<&'a str> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let ptr = *newval;
        if ptr.is_null() {
            None
        } else {
            CStr::from_ptr(ptr).to_str().ok()
        }
    }
}

/// What a failed GUC check reports, in place of PostgreSQL's own words (its message quotes the
/// value).
enum CheckText {
    Message,
    Detail,
    Hint,
}

/// Sets one text of a failed GUC check.
fn check_text(which: CheckText, text: &str) {
    let text = CString::new(text.replace('\0', "")).unwrap_or_default();
    // SAFETY: GUC_check_errmsg_string and its two siblings are PostgreSQL's documented way for
    // a check hook to report; each takes ownership of a palloc'd string, which pstrdup makes.
    unsafe {
        let copy = pg_sys::pstrdup(text.as_ptr());
        match which {
            CheckText::Message => pg_sys::GUC_check_errmsg_string = copy,
            CheckText::Detail => pg_sys::GUC_check_errdetail_string = copy,
            CheckText::Hint => pg_sys::GUC_check_errhint_string = copy,
        }
    }
}

/// What the relay says while the configured `outbox.redis_url` holds a password.
pub(super) const PASSWORD_IN_URL: &str =
    "outbox.redis_url holds a password, so it was refused and the \
     relay waits; put the password in the file named by outbox.redis_password_file and remove it \
     from the URL";

/// Whether the last value of `outbox.redis_url` from a configuration file that this process
/// checked was refused for holding a password. Forked processes inherit the postmaster's.
pub(super) static REDIS_URL_REFUSED: AtomicBool = AtomicBool::new(false);

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_redis_url(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate(newval) }.unwrap_or("");
    let verdict = redis_url::validate(value);
    // A value from the files is refused without stopping the server: PostgreSQL keeps the
    // setting's previous value, and the relay must not publish there in its place.
    if source <= pg_sys::GucSource::PGC_S_ARGV {
        REDIS_URL_REFUSED.store(
            matches!(verdict, Err(redis_url::Refused::Password)),
            Ordering::Relaxed,
        );
    }
    match verdict {
        Ok(()) => true,
        Err(refused) => {
            // PostgreSQL's own message would show the value as it was written, in the server
            // log (a reload) or to the client; none is shown, and the detail names the URL at
            // fault by its place in the list.
            check_text(
                CheckText::Message,
                "invalid value for parameter \"outbox.redis_url\"",
            );
            check_text(CheckText::Detail, &refused.to_string());
            if let redis_url::Refused::Password = refused {
                check_text(
                    CheckText::Hint,
                    "Remove the password from the URL (keep the user name: redis://user@host) and \
                     write it to a file only the server's OS user can read, named by \
                     outbox.redis_password_file.",
                );
            }
            false
        }
    }
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_database(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate_bytes(newval) };
    match Selection::parse(value) {
        Ok(_) => true,
        Err(why) => {
            check_text(CheckText::Detail, &why.to_string());
            false
        }
    }
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_notify_channel(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate(newval) }.unwrap_or("");
    if value.len() >= pg_sys::NAMEDATALEN as usize {
        check_text(
            CheckText::Detail,
            &format!(
                "A notification channel name is at most {} bytes long.",
                pg_sys::NAMEDATALEN - 1
            ),
        );
        return false;
    }
    true
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_cloudevents_source(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate_bytes(newval) };
    if std::str::from_utf8(value).is_ok_and(outbox_redis::cloudevents::is_source) {
        return true;
    }
    check_text(
        CheckText::Detail,
        "A CloudEvents source is a URI reference: printable ASCII without spaces, other \
         characters percent-encoded, such as //shop.example.com/orders.",
    );
    false
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_traceparent(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate_bytes(newval) };
    if value.is_empty() || crate::model::w3c::is_traceparent(value) {
        return true;
    }
    check_text(
        CheckText::Detail,
        "A traceparent is version-traceid-parentid-flags in lowercase hex, such as \
         00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01.",
    );
    false
}

#[pgrx::pg_guard]
pub(super) unsafe extern "C-unwind" fn check_tracestate(
    newval: *mut *mut c_char,
    _extra: *mut *mut c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    // SAFETY: called by PostgreSQL as a string check hook.
    let value = unsafe { candidate_bytes(newval) };
    if value.is_empty() || crate::model::w3c::is_tracestate(value) {
        return true;
    }
    check_text(
        CheckText::Detail,
        &format!(
            "A tracestate is a list of key=value members in printable ASCII, at most {} bytes.",
            crate::model::w3c::MAX_TRACESTATE_BYTES
        ),
    );
    false
}

/// A string check hook's candidate value as bytes, empty for null.
///
/// # Safety
/// `newval` must be a string check hook's argument.
unsafe fn candidate_bytes<'a>(newval: *mut *mut c_char) -> &'a [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let ptr = *newval;
        if ptr.is_null() {
            &[]
        } else {
            CStr::from_ptr(ptr).to_bytes()
        }
    }
}

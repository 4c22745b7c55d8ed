//! What W3C Trace Context accepts as a `traceparent` and a `tracestate`: checked for the
//! context a statement's comment carries (`trace.rs`) and for the session's
//! `outbox.traceparent` and `outbox.tracestate` (`gucs/checks.rs`). Pure logic, unit-tested.

/// Longest `tracestate` kept, in bytes: the length W3C asks every vendor to pass on.
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// Whether `value` is a W3C trace context `traceparent`: `version-traceid-parentid-flags` in
/// lowercase hex, version not `ff`, neither id all zeros; version `00` is exactly 55 bytes, a
/// later version may carry more after a `-`.
pub fn is_traceparent(value: &[u8]) -> bool {
    fn hex(part: &[u8]) -> bool {
        part.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    }
    if value.len() < 55 {
        return false;
    }
    let (version, trace_id, parent_id, flags) =
        (&value[0..2], &value[3..35], &value[36..52], &value[53..55]);
    let dashes = value[2] == b'-' && value[35] == b'-' && value[52] == b'-';
    let length_ok = match version {
        b"00" => value.len() == 55,
        _ => value.len() == 55 || value[55] == b'-',
    };
    dashes
        && length_ok
        && hex(version)
        && version != b"ff"
        && hex(trace_id)
        && trace_id.iter().any(|&b| b != b'0')
        && hex(parent_id)
        && parent_id.iter().any(|&b| b != b'0')
        && hex(flags)
        && value[55..].iter().all(|&b| (0x21..0x7f).contains(&b))
}

/// Whether `value` can be passed on as a `tracestate`: printable ASCII holding at least one
/// `key=value` member, at most [`MAX_TRACESTATE_BYTES`].
pub fn is_tracestate(value: &[u8]) -> bool {
    !value.is_empty()
        && value.len() <= MAX_TRACESTATE_BYTES
        && value.iter().all(|&b| (0x20..0x7f).contains(&b))
        && value.contains(&b'=')
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparents_follow_w3c() {
        assert!(is_traceparent(PARENT.as_bytes()));
        assert!(is_traceparent(
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
        ));
        // A later version may carry more fields.
        assert!(is_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"
        ));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!is_traceparent(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn tracestates_are_short_printable_lists() {
        assert!(is_tracestate(b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"));
        assert!(!is_tracestate(b""));
        assert!(!is_tracestate(b"no members"));
        assert!(!is_tracestate(b"a=b\nc=d"));
        assert!(!is_tracestate(format!("a={}", "x".repeat(511)).as_bytes()));
    }
}

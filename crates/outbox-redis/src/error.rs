//! Why the Redis side could not do what the relay asked, by kind. The relay acts on the kind
//! (wait for a setting to change, back off from Redis); the text says what happened, for the
//! log and `outbox_workers.last_error`.

use std::fmt;

use redis::RedisError;

/// Why Redis could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A setting the relay cannot use as it is: the URL, a password or certificate file, or a
    /// dedupe the servers cannot do. Nothing is tried until the setting or the servers change.
    Setting(String),
    /// Redis answered with an error reply (`NOAUTH`, `NOPERM`, `OOM` ...).
    Refused(String),
    /// Redis could not be reached, or broke the connection (an I/O error, a timeout, a
    /// certificate, a reply that makes no sense).
    Unreachable(String),
}

impl Error {
    /// A client error: refused when Redis answered with an error code, unreachable otherwise.
    pub fn from_redis(error: &RedisError) -> Error {
        match error.code() {
            Some(_) => Error::Refused(describe(error)),
            None => Error::Unreachable(describe(error)),
        }
    }

    /// The same kind, its text put in context: `cannot connect to ...: <text>`.
    pub fn context(self, what: impl fmt::Display) -> Error {
        match self {
            Error::Setting(text) => Error::Setting(format!("{what}: {text}")),
            Error::Refused(text) => Error::Refused(format!("{what}: {text}")),
            Error::Unreachable(text) => Error::Unreachable(format!("{what}: {text}")),
        }
    }

    /// What happened, as the log says it.
    pub fn text(&self) -> &str {
        match self {
            Error::Setting(text) | Error::Refused(text) | Error::Unreachable(text) => text,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}

/// A client error as Redis words it (`NOPERM this user has no permissions ...`) when Redis
/// answered, and as the client does otherwise (an I/O error, a timeout, a certificate).
pub fn describe(error: &RedisError) -> String {
    match (error.code(), error.detail()) {
        (Some(code), Some(detail)) => format!("{code} {detail}"),
        _ => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_refused_and_an_io_error_unreachable() {
        let redis::Value::ServerError(noperm) =
            redis::parse_redis_value(b"-NOPERM no\r\n").unwrap()
        else {
            panic!("not an error reply");
        };
        let reply = RedisError::from(noperm);
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "timed out",
        ));
        assert!(matches!(Error::from_redis(&reply), Error::Refused(_)));
        assert!(matches!(Error::from_redis(&io), Error::Unreachable(_)));
        let setting = Error::Setting("is empty".into()).context("outbox.redis_url");
        assert_eq!(setting, Error::Setting("outbox.redis_url: is empty".into()));
    }
}

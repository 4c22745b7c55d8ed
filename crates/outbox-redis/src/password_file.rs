//! The Redis passwords, read from files at each connection, as PostgreSQL reads `ssl_key_file`:
//! a setting is readable by monitoring roles, a file only by the server's OS user. A file that
//! other users could read is refused, so that a password is never trusted to one.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

use crate::error::Error;

/// Longest password file read; a password is the first line of it.
const MOST_BYTES: u64 = 64 * 1024;

/// The password in the file that `setting` names, or `None` when the setting is empty.
pub fn read(setting: &str, path: &str) -> Result<Option<String>, Error> {
    if path.is_empty() {
        return Ok(None);
    }
    let cannot = |e: std::io::Error| Error::Setting(format!("cannot read {setting} '{path}': {e}"));
    let about = |why: Error| Error::Setting(format!("{setting} '{path}' {why}"));
    // Without waiting: opening a FIFO (or a device) for reading would block until something
    // writes to it, and the Redis thread with it. What is not a regular file is refused below.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(cannot)?;
    let meta = file.metadata().map_err(cannot)?;
    if !meta.is_file() {
        return Err(Error::Setting(format!(
            "{setting} '{path}' is not a regular file"
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    access_is_private(meta.mode(), meta.uid(), me).map_err(about)?;
    let mut bytes = Vec::new();
    file.take(MOST_BYTES)
        .read_to_end(&mut bytes)
        .map_err(cannot)?;
    first_line(&bytes).map(Some).map_err(about)
}

/// PostgreSQL's rule for a private key: owned by the server's user and closed to everyone else,
/// or owned by root and readable at most by its group.
fn access_is_private(mode: u32, owner: u32, me: u32) -> Result<(), Error> {
    let (allowed, rule) = if owner == me {
        (0o700, "u=rw (0600)")
    } else if owner == 0 {
        (0o740, "u=rw,g=r (0640) when owned by root")
    } else {
        return Err(Error::Setting(
            "must be owned by the server's OS user or by root".into(),
        ));
    };
    if mode & 0o777 & !allowed != 0 {
        return Err(Error::Setting(format!(
            "has group or world access (mode {:04o}); permissions should be {rule}",
            mode & 0o7777
        )));
    }
    Ok(())
}

/// The password: the file's first line, without its line end.
fn first_line(bytes: &[u8]) -> Result<String, Error> {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return Err(Error::Setting("holds no password on its first line".into()));
    }
    String::from_utf8(line.to_vec())
        .map_err(|_| Error::Setting("holds a password that is not UTF-8".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_of_the_servers_user_is_closed_to_everyone_else() {
        assert!(access_is_private(0o100600, 70, 70).is_ok());
        assert!(access_is_private(0o100400, 70, 70).is_ok());
        let why = access_is_private(0o100640, 70, 70).unwrap_err().to_string();
        assert!(why.contains("0640") && why.contains("0600"), "{why}");
        assert!(access_is_private(0o100604, 70, 70).is_err());
        assert!(access_is_private(0o100610, 70, 70).is_err());
    }

    #[test]
    fn a_file_of_root_may_be_read_by_its_group_only() {
        assert!(access_is_private(0o100640, 0, 70).is_ok());
        assert!(access_is_private(0o100600, 0, 70).is_ok());
        assert!(access_is_private(0o100660, 0, 70).is_err());
        assert!(access_is_private(0o100644, 0, 70).is_err());
    }

    #[test]
    fn a_file_of_anyone_else_is_refused() {
        let why = access_is_private(0o100600, 1000, 70)
            .unwrap_err()
            .to_string();
        assert!(why.contains("owned by"), "{why}");
    }

    #[test]
    fn a_fifo_is_refused_without_waiting_for_a_writer() {
        let dir = std::env::temp_dir().join(format!("outbox-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("password");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path in a directory of this test's own.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let (done, answer) = std::sync::mpsc::channel();
        let name = fifo.to_str().unwrap().to_string();
        std::thread::spawn(move || {
            let _ = done.send(read("outbox.redis_password_file", &name));
        });
        let got = answer.recv_timeout(std::time::Duration::from_secs(5));
        std::fs::remove_dir_all(&dir).unwrap();
        let why = got
            .expect("reading a FIFO blocked waiting for a writer")
            .unwrap_err()
            .to_string();
        assert!(why.contains("not a regular file"), "{why}");
    }

    #[test]
    fn the_password_is_the_first_line() {
        assert_eq!(first_line(b"s3cret\n").unwrap(), "s3cret");
        assert_eq!(first_line(b"s3cret\r\nsecond").unwrap(), "s3cret");
        assert_eq!(first_line(b"with space ").unwrap(), "with space ");
        assert!(first_line(b"").is_err());
        assert!(first_line(b"\nsecond").is_err());
        assert!(first_line(b"\xff\xfe\n").is_err());
    }
}

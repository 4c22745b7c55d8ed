//! A round trip's commands written the way Redis reads them (RESP: `*<count>` then `$<length>`
//! and the bytes of each argument), one after another into one buffer.
//!
//! A chunk of a thousand events is a thousand `XADD`s without dedupe, or a script call per
//! stream with thousands of arguments. Made as redis-rs `Cmd`s, each argument is an allocation,
//! its length is formatted through `fmt`, and the pipeline then copies them all into a buffer
//! of its own: about a microsecond an event on the relay's Redis thread. Here each argument is
//! copied once, into the buffer that goes to the socket. A cluster, whose pipeline routes each
//! command by its key, gets them back as `Cmd`s ([`Packed::commands`]).

use redis::Cmd;

/// Commands in RESP, and how many.
#[derive(Default)]
pub struct Packed {
    bytes: Vec<u8>,
    count: usize,
}

/// The arguments of the command being written.
pub struct Args<'a> {
    bytes: &'a mut Vec<u8>,
    count: usize,
}

impl Args<'_> {
    /// Adds an argument.
    pub fn arg(&mut self, arg: impl AsRef<[u8]>) -> &mut Self {
        let arg = arg.as_ref();
        self.begin(arg.len());
        self.bytes.extend_from_slice(arg);
        self.end()
    }

    /// Adds an unsigned integer argument, in decimal.
    pub fn uint(&mut self, value: u64) -> &mut Self {
        self.begin(decimal_len(value));
        push_decimal(self.bytes, value);
        self.end()
    }

    /// Adds an integer argument, in decimal.
    pub fn int(&mut self, value: i64) -> &mut Self {
        self.begin(signed_len(value));
        push_signed(self.bytes, value);
        self.end()
    }

    /// Adds `first`, `separator` and `second` as one argument (`42-1000`), integers in decimal.
    pub fn int_pair(&mut self, first: i64, separator: u8, second: i64) -> &mut Self {
        self.begin(signed_len(first) + 1 + signed_len(second));
        push_signed(self.bytes, first);
        self.bytes.push(separator);
        push_signed(self.bytes, second);
        self.end()
    }

    /// Adds an argument of `template`'s length: the template, which `fill` then changes in
    /// place (digits into a timestamp's text, say).
    pub fn filled(&mut self, template: &[u8], fill: impl FnOnce(&mut [u8])) -> &mut Self {
        self.begin(template.len());
        let start = self.bytes.len();
        self.bytes.extend_from_slice(template);
        fill(&mut self.bytes[start..]);
        self.end()
    }

    /// `$<length>\r\n`, with room for the argument after it. The digits, like every byte here,
    /// go straight into the buffer: copied from a small array just written, they cost the
    /// processor a stall each.
    fn begin(&mut self, length: usize) {
        self.bytes.reserve(length + 24);
        self.bytes.push(b'$');
        push_decimal(self.bytes, length as u64);
        self.bytes.extend_from_slice(b"\r\n");
    }

    fn end(&mut self) -> &mut Self {
        self.bytes.extend_from_slice(b"\r\n");
        self.count += 1;
        self
    }
}

impl Packed {
    /// Writes one command, whose arguments `write` adds; its count is written before them once
    /// they are all there, so it cannot disagree with them.
    pub fn command(&mut self, write: impl FnOnce(&mut Args<'_>)) {
        // Room for a count of two digits, which most commands have: `*12\r\n`.
        const ROOM: usize = 5;
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b"*00\r\n");
        let mut args = Args {
            bytes: &mut self.bytes,
            count: 0,
        };
        write(&mut args);
        let count = args.count;
        if (10..100).contains(&count) {
            put_digits(&mut self.bytes[start + 1..start + 3], count as u64);
        } else {
            let mut header = vec![b'*'];
            push_decimal(&mut header, count as u64);
            header.extend_from_slice(b"\r\n");
            self.bytes.splice(start..start + ROOM, header);
        }
        self.count += 1;
    }

    /// Makes room for `bytes` more bytes.
    pub fn reserve(&mut self, bytes: usize) {
        self.bytes.reserve(bytes);
    }

    /// The buffer emptied, to write the next round trip into; one grown past what chunks
    /// usually need is let go.
    pub fn emptied(mut self) -> Packed {
        const KEPT_AT_MOST: usize = 16 << 20;
        if self.bytes.capacity() > KEPT_AT_MOST {
            return Packed::default();
        }
        self.bytes.clear();
        self.count = 0;
        self
    }

    /// Adds a command made as a redis-rs `Cmd`.
    pub fn push(&mut self, cmd: &Cmd) {
        cmd.write_packed_command(&mut self.bytes);
        self.count += 1;
    }

    /// The number of commands written.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The commands, as they go to the socket.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The commands read back as redis-rs `Cmd`s, for a cluster pipeline. `None` only if the
    /// buffer were not RESP, which this module does not write.
    pub fn commands(&self) -> Option<Vec<Cmd>> {
        let mut commands = Vec::with_capacity(self.count);
        let mut rest = self.bytes.as_slice();
        while !rest.is_empty() {
            let (count, after) = header(rest, b'*')?;
            rest = after;
            let mut cmd = Cmd::new();
            for _ in 0..count {
                let (length, after) = header(rest, b'$')?;
                let arg = after.get(..length)?;
                rest = after.get(length..)?.strip_prefix(b"\r\n")?;
                cmd.arg(arg);
            }
            commands.push(cmd);
        }
        Some(commands)
    }
}

/// Reads `<kind><number>\r\n` at the start of `bytes`: the number, and what follows.
fn header(bytes: &[u8], kind: u8) -> Option<(usize, &[u8])> {
    let rest = bytes.strip_prefix(&[kind])?;
    let end = rest.iter().position(|&b| b == b'\r')?;
    let number = std::str::from_utf8(&rest[..end]).ok()?.parse().ok()?;
    Some((number, rest[end..].strip_prefix(b"\r\n")?))
}

/// The number of decimal digits of `value`.
fn decimal_len(value: u64) -> usize {
    value.checked_ilog10().map_or(1, |log| log as usize + 1)
}

/// The length of `value` in decimal, with its sign.
fn signed_len(value: i64) -> usize {
    usize::from(value < 0) + decimal_len(value.unsigned_abs())
}

/// Writes `value`'s last `out.len()` decimal digits into `out`, zero-padded, without `fmt`.
pub fn put_digits(out: &mut [u8], mut value: u64) {
    for digit in out.iter_mut().rev() {
        *digit = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

/// Appends `value` in decimal.
fn push_decimal(out: &mut Vec<u8>, value: u64) {
    let start = out.len();
    out.resize(start + decimal_len(value), b'0');
    put_digits(&mut out[start..], value);
}

/// Appends `value` in decimal, with its sign.
fn push_signed(out: &mut Vec<u8>, value: i64) {
    if value < 0 {
        out.push(b'-');
    }
    push_decimal(out, value.unsigned_abs());
}

/// A command's arguments as text, for the tests of the files that build commands.
#[cfg(test)]
pub(crate) fn args(cmd: &Cmd) -> Vec<String> {
    cmd.args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => "<not simple>".into(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_fmt_writes_them() {
        for value in [
            0,
            7,
            -7,
            9,
            10,
            99,
            100,
            -100,
            123_456_789,
            i64::MAX,
            i64::MIN,
        ] {
            let mut out = Vec::new();
            push_signed(&mut out, value);
            assert_eq!(out, value.to_string().into_bytes());
            assert_eq!(signed_len(value), out.len());
        }
        for value in [0, 1, 9, 10, 999, 1000, u64::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, value);
            assert_eq!(out, value.to_string().into_bytes());
        }
    }

    #[test]
    fn commands_are_written_as_redis_rs_writes_them() {
        let payload = "é\r\n".repeat(5);
        let mut expected = Cmd::new();
        expected
            .arg("XADD")
            .arg("s")
            .arg("*")
            .arg(payload.as_str())
            .arg(-42)
            .arg("")
            .arg(&[0xffu8, 0x00][..]);
        let mut packed = Packed::default();
        for _ in 0..12 {
            packed.command(|args| {
                args.arg("XADD")
                    .arg("s")
                    .arg("*")
                    .arg(&payload)
                    .int(-42)
                    .arg("")
                    .arg([0xffu8, 0x00]);
            });
        }
        packed.push(&expected);
        assert_eq!(packed.len(), 13);
        assert_eq!(packed.bytes(), expected.get_packed_command().repeat(13));
    }

    #[test]
    fn a_command_of_any_number_of_arguments_counts_them_all() {
        for count in [1, 9, 10, 99, 100, 1234] {
            let mut packed = Packed::default();
            packed.command(|args| {
                for i in 0..count {
                    args.uint(i);
                }
            });
            let mut expected = Cmd::new();
            for i in 0..count {
                expected.arg(i);
            }
            assert_eq!(
                packed.bytes(),
                expected.get_packed_command(),
                "{count} arguments"
            );
        }
    }

    #[test]
    fn an_emptied_buffer_writes_as_a_new_one() {
        let mut packed = Packed::default();
        packed.command(|args| {
            args.arg("PING");
        });
        let mut packed = packed.emptied();
        assert!(packed.is_empty());
        packed.command(|args| {
            args.arg("ECHO").arg("x");
        });
        let mut expected = Cmd::new();
        expected.arg("ECHO").arg("x");
        assert_eq!(packed.bytes(), expected.get_packed_command());
        assert_eq!(packed.len(), 1);
    }

    #[test]
    fn commands_read_back_are_the_ones_written() {
        let mut packed = Packed::default();
        let mut first = Cmd::new();
        first.arg("HDEL").arg("h").arg("f");
        packed.push(&first);
        packed.command(|args| {
            args.arg("XADD").arg("s\r\n$3").arg([0u8, 13, 10]).uint(5);
            args.int_pair(-12, b'-', 34)
                .int_pair(i64::MIN, b':', i64::MAX);
            args.filled(b"ab-cd", |text| text[1] = b'x');
        });
        packed.command(|_| {});
        let commands = packed.commands().unwrap();
        assert_eq!(commands.len(), 3);
        assert_eq!(commands[0].get_packed_command(), first.get_packed_command());
        let mut second = Cmd::new();
        second
            .arg("XADD")
            .arg("s\r\n$3")
            .arg(&[0u8, 13, 10][..])
            .arg(5);
        second
            .arg("-12-34")
            .arg(format!("{}:{}", i64::MIN, i64::MAX));
        second.arg("ax-cd");
        assert_eq!(
            commands[1].get_packed_command(),
            second.get_packed_command()
        );
        assert_eq!(commands[2].args_iter().count(), 0);
    }
}

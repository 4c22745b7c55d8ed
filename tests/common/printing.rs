//! A child process whose standard output the test reads line by line as it is printed: the
//! consumers' tests watch what a consumer says, kill it, and read all it said.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

pub struct Printing {
    pub child: Child,
    lines: Receiver<String>,
    /// The lines read so far.
    pub seen: Vec<String>,
}

impl Printing {
    /// Starts `cmd`, its standard output read line by line by a thread of its own.
    pub fn spawn(cmd: &mut Command) -> Printing {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let stdout = child.stdout.take().expect("no stdout");
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Printing {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads the lines printed since, without waiting.
    pub fn read(&mut self) {
        self.seen.extend(self.lines.try_iter());
    }

    /// Waits up to `timeout` for one more line; false if none came (the time ran out, or the
    /// output ended).
    pub fn read_one(&mut self, timeout: Duration) -> bool {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => {
                self.seen.push(line);
                true
            }
            Err(_) => false,
        }
    }

    /// Kills the process (SIGKILL); returns every line it printed.
    pub fn kill(mut self) -> Vec<String> {
        self.child.kill().expect("cannot kill the process");
        self.finish()
    }

    /// Waits for the process to end; returns every line it printed.
    pub fn finish(&mut self) -> Vec<String> {
        let _ = self.child.wait();
        // The reader thread ends at the end of the pipe.
        self.seen.extend(self.lines.iter());
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Printing {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

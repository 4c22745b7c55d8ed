//! A TCP proxy between the relay and Redis that can swallow Redis's replies (the commands go
//! through and Redis runs them, the relay hears nothing back, as when a link breaks after a
//! round trip was sent), hold them back (a slow link), stop the commands at a given text until
//! told to go on (so that a test acts while Redis has run half a round trip), or cut every
//! connection. When either side closes, the proxy closes the other.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    swallow: Arc<AtomicBool>,
    /// Milliseconds each piece of a reply waits before it goes on.
    delay: Arc<AtomicU64>,
    /// The connections open now, to cut.
    open: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<Stop>,
}

/// Where the commands stop: the text, whether they have stopped there, and whether they may
/// go on.
#[derive(Default)]
struct Stop {
    at: Mutex<Option<Vec<u8>>>,
    stopped: AtomicBool,
    go_on: AtomicBool,
}

impl Stop {
    /// Forwards `bytes` to `to`, stopping before the text if it is armed and found: `carry` holds
    /// the end of the last piece that may begin the text, kept back so that a text split between
    /// two reads is found.
    fn forward(
        &self,
        carry: &mut Vec<u8>,
        bytes: &[u8],
        to: &mut TcpStream,
    ) -> std::io::Result<()> {
        let at = self.at.lock().unwrap().clone();
        let Some(at) = at else {
            to.write_all(carry)?;
            carry.clear();
            return to.write_all(bytes);
        };
        carry.extend_from_slice(bytes);
        if let Some(start) = carry.windows(at.len()).position(|w| w == at.as_slice()) {
            to.write_all(&carry[..start])?;
            *self.at.lock().unwrap() = None;
            self.stopped.store(true, Ordering::SeqCst);
            while !self.go_on.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(1));
            }
            to.write_all(&carry[start..])?;
            carry.clear();
            return Ok(());
        }
        // Only an end that may begin the text is kept back: a command that ends otherwise
        // goes whole, and gets its reply.
        let keep = (1..at.len().min(carry.len() + 1))
            .rev()
            .find(|&k| carry.ends_with(&at[..k]))
            .unwrap_or(0);
        to.write_all(&carry[..carry.len() - keep])?;
        carry.drain(..carry.len() - keep);
        Ok(())
    }
}

impl Proxy {
    /// Listens on a free port and forwards each connection to `upstream` on 127.0.0.1.
    pub fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("cannot bind the proxy");
        let port = listener.local_addr().unwrap().port();
        super::claim_port(port);
        let swallow = Arc::new(AtomicBool::new(false));
        let swallowing = swallow.clone();
        let delay = Arc::new(AtomicU64::new(0));
        let delaying = delay.clone();
        let open = Arc::new(Mutex::new(Vec::new()));
        let opened = open.clone();
        let stop = Arc::new(Stop::default());
        let stopping = stop.clone();
        thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                if let (Ok(mut open), Ok(kept)) = (opened.lock(), client.try_clone()) {
                    open.retain(|s: &TcpStream| s.peer_addr().is_ok());
                    open.push(kept);
                }
                // Replies (server to client) can be swallowed or held back; commands go as
                // they come, or stop at a text.
                type Replies = Option<(Arc<AtomicBool>, Arc<AtomicU64>)>;
                let pipe = |from: &TcpStream, to: &TcpStream, replies: Replies| {
                    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                    let stop = stopping.clone();
                    thread::spawn(move || {
                        let mut buffer = [0u8; 16 * 1024];
                        let mut carry = Vec::new();
                        loop {
                            let n = match from.read(&mut buffer) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if let Some((swallow, delay)) = &replies {
                                if swallow.load(Ordering::SeqCst) {
                                    continue;
                                }
                                let wait = delay.load(Ordering::SeqCst);
                                if wait > 0 {
                                    thread::sleep(Duration::from_millis(wait));
                                }
                            } else if stop.forward(&mut carry, &buffer[..n], &mut to).is_err() {
                                break;
                            } else {
                                continue;
                            }
                            if to.write_all(&buffer[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                };
                pipe(&client, &server, None);
                pipe(
                    &server,
                    &client,
                    Some((swallowing.clone(), delaying.clone())),
                );
            }
        });
        Proxy {
            port,
            swallow,
            delay,
            open,
            stop,
        }
    }

    /// Stops the commands just before the next occurrence of `text`: what comes before it
    /// reaches Redis, the rest waits for [`Proxy::go_on`].
    pub fn stop_commands_at(&self, text: &str) {
        self.stop.stopped.store(false, Ordering::SeqCst);
        self.stop.go_on.store(false, Ordering::SeqCst);
        *self.stop.at.lock().unwrap() = Some(text.as_bytes().to_vec());
    }

    /// Whether the commands have stopped at the text.
    pub fn stopped(&self) -> bool {
        self.stop.stopped.load(Ordering::SeqCst)
    }

    /// Lets the stopped commands go on.
    pub fn go_on(&self) {
        self.stop.go_on.store(true, Ordering::SeqCst);
    }

    /// Whether Redis's replies are dropped from now on.
    pub fn swallow_replies(&self, swallow: bool) {
        self.swallow.store(swallow, Ordering::SeqCst);
    }

    /// Holds each piece of Redis's replies back for `delay` from now on (zero: none).
    pub fn delay_replies(&self, delay: Duration) {
        self.delay.store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Cuts every connection open now, in the middle of whatever crosses it.
    pub fn cut(&self) {
        if let Ok(mut open) = self.open.lock() {
            for stream in open.drain(..) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

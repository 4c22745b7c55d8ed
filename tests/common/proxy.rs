//! A TCP proxy between the relay and Redis that can swallow Redis's replies (the commands go
//! through and Redis runs them, the relay hears nothing back, as when a link breaks after a
//! round trip was sent), hold them back (a slow link), or cut every connection. When either
//! side closes, the proxy closes the other.

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
                // they come.
                type Replies = Option<(Arc<AtomicBool>, Arc<AtomicU64>)>;
                let pipe = |from: &TcpStream, to: &TcpStream, replies: Replies| {
                    let (mut from, mut to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
                    thread::spawn(move || {
                        let mut buffer = [0u8; 16 * 1024];
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
        }
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

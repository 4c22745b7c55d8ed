//! The channel between the relay's two threads is crossbeam-channel's unbounded one. These tests
//! pin down what the publisher thread and the worker's main thread rely on it for: messages in
//! order, a receiver woken by a message or by a gone sender, a wait that ends at its timeout (or
//! never, for a timeout too long to count), and a send that fails once the receiver is gone.

use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded as channel, RecvError, RecvTimeoutError, SendError};

#[test]
fn messages_arrive_in_order() {
    let (tx, rx) = channel();
    for n in 0..5 {
        tx.send(n).unwrap();
    }
    let got: Vec<i32> = (0..5).map(|_| rx.recv().unwrap()).collect();
    assert_eq!(got, [0, 1, 2, 3, 4]);
}

#[test]
fn a_waiting_receiver_wakes_for_a_message_from_another_thread() {
    let (tx, rx) = channel();
    let sender = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        tx.send("chunk").unwrap();
        tx
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok("chunk"));
    drop(sender.join().unwrap());
    assert_eq!(rx.recv(), Err(RecvError));
}

#[test]
fn a_wait_ends_at_its_timeout() {
    let (_tx, rx) = channel::<u8>();
    let started = Instant::now();
    assert_eq!(
        rx.recv_timeout(Duration::from_millis(40)),
        Err(RecvTimeoutError::Timeout)
    );
    assert!(started.elapsed() >= Duration::from_millis(40));
}

#[test]
fn a_gone_sender_ends_the_wait_after_its_last_message() {
    let (tx, rx) = channel();
    tx.send(1).unwrap();
    let sender = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        drop(tx);
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(1));
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)),
        Err(RecvTimeoutError::Disconnected)
    );
    sender.join().unwrap();
}

#[test]
fn a_timeout_too_long_to_count_waits_for_the_message() {
    let (tx, rx) = channel();
    let sender = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        tx.send(5).unwrap();
        tx
    });
    assert_eq!(rx.recv_timeout(Duration::MAX), Ok(5));
    drop(sender.join().unwrap());
    assert_eq!(
        rx.recv_timeout(Duration::MAX),
        Err(RecvTimeoutError::Disconnected)
    );
}

#[test]
fn a_gone_sender_wakes_a_receiver_waiting_without_timeout() {
    let (tx, rx) = channel::<u8>();
    let sender = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        drop(tx);
    });
    assert_eq!(rx.recv(), Err(RecvError));
    sender.join().unwrap();
}

#[test]
fn sending_to_a_gone_receiver_gives_the_message_back() {
    let (tx, rx) = channel();
    drop(rx);
    assert_eq!(tx.send(7), Err(SendError(7)));
}

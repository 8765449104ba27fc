//! When the datapath wakes a sample reader that waits on the ring (epoll, as the agent
//! and capture do through tokio). A wake-up is an IRQ-work self-IPI inside the packet's
//! hook (about 27 µs in this VM, `bench datapath`, cold rows): a reader that keeps up
//! must not cost every sample one. With batched wake-ups the reader is woken once a
//! batch waits and finds the rest on its drain timer; with the kernel's default policy,
//! for every sample that finds it caught up.

use std::time::{Duration, Instant};

use roce_trace_common::datapath::{RING_RECORD_BYTES, SAMPLE_BATCH_BYTES};
use roce_trace_common::roce::op;
use roce_trace_datapath::loader::DatapathOptions;
use roce_trace_gen::frame::RoceFrame;
use roce_trace_tests::*;

/// A datapath that samples every packet, its ring drained.
fn sampling_all(batch_wakeups: bool) -> ProgTest {
    let opts = DatapathOptions {
        sample_rate: 1,
        batch_wakeups,
        ..Default::default()
    };
    let mut t = ProgTest::new(&opts);
    t.drain_samples();
    t
}

/// Runs the packets `psns` (each sampled), `pause` after each.
fn run_sampled(t: &mut ProgTest, psns: std::ops::Range<u32>, pause: Duration) {
    for psn in psns {
        let frame = RoceFrame {
            opcode: op::SEND_ONLY,
            psn,
            ..Default::default()
        }
        .build();
        assert_eq!(t.run_xdp(&frame), XDP_PASS);
        std::thread::sleep(pause);
    }
}

/// An epoll instance watching `fd` for `events` (EPOLLIN, with EPOLLET as tokio has it).
fn epoll_on(fd: std::os::fd::RawFd, events: i32) -> i32 {
    // SAFETY: plain epoll calls; `ev` lives across them.
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep >= 0, "epoll_create1: {}", std::io::Error::last_os_error());
        let mut ev = libc::epoll_event {
            events: events as u32,
            u64: 0,
        };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        ep
    }
}

/// Waits on `ep` up to `ms` (0: a look); whether an event came. Closes nothing.
fn epoll_wait(ep: i32, ms: i32) -> bool {
    let mut ev = libc::epoll_event { events: 0, u64: 0 };
    // SAFETY: `ev` outlives the call; one event at most.
    unsafe { libc::epoll_wait(ep, &mut ev, 1, ms) > 0 }
}

/// Runs `packets` sampled packets (one every 2 ms) while a thread waits on the ring for
/// up to `wait`; whether it was woken, and after how long.
fn woken(batch_wakeups: bool, packets: u32, wait: Duration) -> Option<Duration> {
    let mut t = sampling_all(batch_wakeups);
    let fd = t.ring_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // The ProgTest keeps `fd` open until the waiter is joined.
        let ep = epoll_on(fd, libc::EPOLLIN);
        tx.send(()).unwrap();
        let start = Instant::now();
        let woke = epoll_wait(ep, wait.as_millis() as i32);
        // SAFETY: the descriptor epoll_on made, closed once.
        unsafe { libc::close(ep) };
        woke.then(|| start.elapsed())
    });
    rx.recv().unwrap();
    // The waiter is asleep in epoll_wait before the first sample.
    std::thread::sleep(Duration::from_millis(100));
    run_sampled(&mut t, 0..packets, Duration::from_millis(2));
    let r = waiter.join().unwrap();
    assert_eq!(
        t.drain_samples(),
        packets as usize,
        "every packet sampled (rate 1)"
    );
    r
}

#[test]
fn the_default_policy_wakes_a_caught_up_reader_for_one_sample() {
    let w = woken(false, 1, Duration::from_secs(3));
    assert!(
        w.is_some_and(|d| d < Duration::from_secs(1)),
        "a reader that kept up was not woken for a sample ({w:?}): the default policy is the kernel's"
    );
}

#[test]
fn batched_wake_ups_leave_a_reader_asleep_below_a_batch() {
    // 100 samples, a fifth of a batch: none may wake the reader (each would be a
    // self-IPI); it reads them on its drain timer.
    let w = woken(true, 100, Duration::from_millis(1500));
    assert_eq!(w, None, "a sample below a batch woke the reader");
}

#[test]
fn batched_wake_ups_wake_the_reader_once_a_batch_waits() {
    let batch = SAMPLE_BATCH_BYTES.div_ceil(RING_RECORD_BYTES) + 1;
    let w = woken(true, batch, Duration::from_secs(10));
    assert!(w.is_some(), "{batch} samples waited and the reader slept on");
}

/// A reader that was woken for a batch and has not drained it (its wake-up lost on the
/// way, or it is slow) is woken again once another batch has been produced, not left to
/// its timer while the ring fills. The fault this guards: a wake-up only for the sample
/// whose record takes the fill just past a batch, which samples reserved on two CPUs at
/// once can both step over — after that no sample woke the reader until it drained.
#[test]
fn a_reader_that_has_not_drained_is_woken_again_a_batch_later() {
    let mut t = sampling_all(true);
    let batch = SAMPLE_BATCH_BYTES.div_ceil(RING_RECORD_BYTES) + 1;
    // A batch and more wait, the reader woken for it and not reading.
    run_sampled(&mut t, 0..batch, Duration::ZERO);
    // An edge-triggered waiter, as tokio registers the ring: the event for what already
    // waits is taken first, so only a new wake-up ends the second wait.
    let fd = t.ring_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // The ProgTest keeps `fd` open until the waiter is joined.
        let ep = epoll_on(fd, libc::EPOLLIN | libc::EPOLLET);
        tx.send(epoll_wait(ep, 0)).unwrap();
        let woke = epoll_wait(ep, 5000);
        // SAFETY: the descriptor epoll_on made, closed once.
        unsafe { libc::close(ep) };
        woke
    });
    assert!(rx.recv().unwrap(), "the samples waiting were not reported");
    std::thread::sleep(Duration::from_millis(100));
    // Below another batch: no wake-up yet (once a batch, not once a sample).
    run_sampled(&mut t, batch..batch + batch / 2, Duration::ZERO);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished(), "woken before another batch was produced");
    run_sampled(&mut t, batch + batch / 2..2 * batch + batch / 2, Duration::ZERO);
    let woken = waiter.join().unwrap();
    assert!(woken, "another batch waited and the reader slept on");
    assert_eq!(
        t.drain_samples(),
        (batch + batch / 2 + batch) as usize,
        "every packet sampled (rate 1)"
    );
}

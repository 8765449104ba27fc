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

/// Runs `packets` sampled packets (one every 2 ms) while a thread waits on the ring for
/// up to `wait`; whether it was woken, and after how long.
fn woken(batch_wakeups: bool, packets: u32, wait: Duration) -> Option<Duration> {
    let opts = DatapathOptions {
        sample_rate: 1,
        batch_wakeups,
        ..Default::default()
    };
    let mut t = ProgTest::new(&opts);
    t.drain_samples();
    let fd = t.ring_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: plain epoll calls on a descriptor the ProgTest keeps open until joined.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0, "epoll_create1: {}", std::io::Error::last_os_error());
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 0,
            };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
            tx.send(()).unwrap();
            let start = Instant::now();
            let n = libc::epoll_wait(ep, &mut ev, 1, wait.as_millis() as i32);
            libc::close(ep);
            (n > 0).then(|| start.elapsed())
        }
    });
    rx.recv().unwrap();
    // The waiter is asleep in epoll_wait before the first sample.
    std::thread::sleep(Duration::from_millis(100));
    for psn in 0..packets {
        let frame = RoceFrame {
            opcode: op::SEND_ONLY,
            psn,
            ..Default::default()
        }
        .build();
        assert_eq!(t.run_xdp(&frame), XDP_PASS);
        std::thread::sleep(Duration::from_millis(2));
    }
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
    let opts = DatapathOptions {
        sample_rate: 1,
        batch_wakeups: true,
        ..Default::default()
    };
    let mut t = ProgTest::new(&opts);
    t.drain_samples();
    let batch = SAMPLE_BATCH_BYTES.div_ceil(RING_RECORD_BYTES) + 1;
    let mut psn = 0;
    let mut run = |t: &mut ProgTest, n: u32| {
        for _ in 0..n {
            let frame = RoceFrame {
                opcode: op::SEND_ONLY,
                psn,
                ..Default::default()
            }
            .build();
            assert_eq!(t.run_xdp(&frame), XDP_PASS);
            psn += 1;
        }
    };
    // A batch and more wait, the reader woken for it and not reading.
    run(&mut t, batch);
    // An edge-triggered waiter, as tokio registers the ring: the event for what already
    // waits is taken first, so only a new wake-up ends the second wait.
    let fd = t.ring_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: plain epoll calls on a descriptor the ProgTest keeps open until joined.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0, "epoll_create1: {}", std::io::Error::last_os_error());
            let mut ev = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLET) as u32,
                u64: 0,
            };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
            let first = libc::epoll_wait(ep, &mut ev, 1, 0);
            tx.send(first).unwrap();
            let n = libc::epoll_wait(ep, &mut ev, 1, 5000);
            libc::close(ep);
            n > 0
        }
    });
    assert_eq!(rx.recv().unwrap(), 1, "the samples waiting were not reported");
    std::thread::sleep(Duration::from_millis(100));
    // Below another batch: no wake-up yet (once a batch, not once a sample).
    run(&mut t, batch / 2);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished(), "woken before another batch was produced");
    run(&mut t, batch);
    let woken = waiter.join().unwrap();
    assert!(woken, "another batch waited and the reader slept on");
    assert_eq!(
        t.drain_samples(),
        (batch + batch / 2 + batch) as usize,
        "every packet sampled (rate 1)"
    );
}

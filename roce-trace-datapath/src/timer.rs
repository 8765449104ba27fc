//! A periodic kernel timer (`timerfd`) awaited through tokio's reactor: one wake-up a
//! period. tokio's own interval is an entry in its timer wheel, and a period longer than
//! the wheel's first level (64 ms) costs a second wake-up each period, when the entry
//! moves down a level before it fires — an idle `capture` woke ten times a second where
//! five were due.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::Duration,
};

use tokio::io::unix::AsyncFd;

/// Ticks every `period`, the first one period after it is made. Expirations missed while
/// the owner was busy are merged into the next tick (their count is returned), as a
/// reader that drains or reads everything each tick wants.
pub struct Periodic {
    fd: AsyncFd<OwnedFd>,
}

impl Periodic {
    /// Needs a tokio runtime with I/O enabled. `period` must be longer than zero.
    pub fn new(period: Duration) -> io::Result<Self> {
        if period.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a timer period of zero",
            ));
        }
        // SAFETY: plain system call; the descriptor is owned below.
        let fd =
            unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let ts = libc::timespec {
            tv_sec: period.as_secs() as libc::time_t,
            tv_nsec: period.subsec_nanos() as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: ts,
            it_value: ts,
        };
        // SAFETY: a valid timerfd and a valid itimerspec; the old value is not asked for.
        if unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the AsyncFd owns the descriptor: it stays open while registered.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }?;
        Ok(Self { fd })
    }

    /// Waits for the next expiration; how many periods ended since the last tick (at
    /// least 1).
    pub async fn tick(&mut self) -> io::Result<u64> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut n = [0u8; 8];
            // SAFETY: reads 8 bytes into an 8-byte buffer from our own descriptor.
            let r = unsafe { libc::read(self.fd.get_ref().as_raw_fd(), n.as_mut_ptr().cast(), 8) };
            if r == 8 {
                return Ok(u64::from_ne_bytes(n));
            }
            let err = io::Error::last_os_error();
            if r < 0 && err.kind() == io::ErrorKind::WouldBlock {
                guard.clear_ready();
                continue;
            }
            return Err(if r < 0 {
                err
            } else {
                io::Error::new(io::ErrorKind::UnexpectedEof, "a short read from a timerfd")
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// It ticks once a period, the first after one period, and merges the periods a busy
    /// owner missed into one tick that counts them.
    #[tokio::test(flavor = "current_thread")]
    async fn ticks_once_a_period_and_counts_missed_ones() {
        let period = Duration::from_millis(100);
        let start = std::time::Instant::now();
        let mut t = Periodic::new(period).unwrap();
        assert!(t.tick().await.unwrap() >= 1);
        let first = start.elapsed();
        // Not before one period; a busy machine may be late.
        assert!(
            first >= period && first < period * 5,
            "first tick after {first:?}"
        );
        t.tick().await.unwrap();
        // Busy for three periods and a half: one tick then counts the three (or, late, a
        // few more) that ended meanwhile, where a tick a period would say 1.
        std::thread::sleep(period * 7 / 2);
        let n = t.tick().await.unwrap();
        assert!((3..=6).contains(&n), "{n} periods merged");
        assert!(Periodic::new(Duration::ZERO).is_err());
    }
}

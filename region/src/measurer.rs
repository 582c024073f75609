//! The true-up's measurer of a standalone region: one process of the container whose helper thread
//! measures the region's new CUDA contexts (what the driver holds for each process beyond its
//! charge, from NVML), so that the others load no NVML to measure their own. A process that finds
//! no live measurer becomes it; the others ask it for a pass and wait for the pass where an
//! allocation could otherwise exceed the limit. Two counters in the header, each a futex word
//! shared by the container's processes: passes asked and passes finished.

use crate::layout::SLOT_LOCK_BASE;
use crate::Region;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::time::Duration;

impl Region {
    /// The recorded measurer as (slot, pid), where one is.
    pub fn measurer(&self) -> Option<(usize, u32)> {
        let w = self.map.header.trueup_measurer.load(Acquire);
        let slot = (w >> 32) as usize;
        (slot != 0 && slot <= crate::MAX_SLOTS).then(|| (slot - 1, w as u32))
    }

    /// Whether the recorded measurer is alive: its slot still live and its process's, and the
    /// slot's lock held (a dead process's lock is gone, whatever its slot still reads).
    pub fn measurer_alive(&self) -> bool {
        let Some((slot, pid)) = self.measurer() else { return false };
        let s = &self.map.slots[slot];
        if s.state.load(Acquire) != 1 || s.pid.load(Acquire) != pid {
            return false;
        }
        self.lock_tester().is_some_and(|fd| lock_held(fd.as_raw_fd(), SLOT_LOCK_BASE + slot as i64))
    }

    /// Makes the process `pid`, which holds slot `slot`, the measurer, unless a live one is
    /// recorded: true where it is the measurer now (or was already).
    pub fn become_measurer(&self, slot: usize, pid: u32) -> bool {
        if !self.writable || slot >= crate::MAX_SLOTS {
            return false;
        }
        let me = ((slot as u64 + 1) << 32) | u64::from(pid);
        let word = &self.map.header.trueup_measurer;
        let seen = word.load(Acquire);
        if seen == me {
            return true;
        }
        if seen != 0 && self.measurer_alive() {
            return false;
        }
        word.compare_exchange(seen, me, AcqRel, Acquire).is_ok()
    }

    /// Asks the measurer for a pass: the ticket that [`served`](Self::served) passes.
    pub fn ask_measurer(&self) -> u32 {
        let asked = &self.map.header.trueup_asked;
        let ticket = asked.fetch_add(1, AcqRel).wrapping_add(1);
        futex_wake(asked);
        ticket
    }

    /// The measurer's wait for an ask beyond `seen` (at most `timeout`): the asks now.
    pub fn wait_asked(&self, seen: u32, timeout: Duration) -> u32 {
        let asked = &self.map.header.trueup_asked;
        if asked.load(Acquire) == seen {
            futex_wait(asked, seen, timeout);
        }
        asked.load(Acquire)
    }

    /// The asks up to `ticket` are answered (a pass that began after them ended).
    pub fn answered(&self, ticket: u32) {
        let served = &self.map.header.trueup_served;
        let _ = served.fetch_update(AcqRel, Acquire, |s| after(ticket, s).then_some(ticket));
        futex_wake(served);
    }

    /// The newest ask answered: where a measurer taking over begins.
    pub fn measurer_answered(&self) -> u32 {
        self.map.header.trueup_served.load(Acquire)
    }

    /// Whether the ask `ticket` is answered.
    pub fn served(&self, ticket: u32) -> bool {
        !after(ticket, self.map.header.trueup_served.load(Acquire))
    }

    /// Waits (at most `timeout`) for the ask `ticket` to be answered; whether it is.
    pub fn wait_served(&self, ticket: u32, timeout: Duration) -> bool {
        let served = &self.map.header.trueup_served;
        let s = served.load(Acquire);
        if after(ticket, s) {
            futex_wait(served, s, timeout);
        }
        self.served(ticket)
    }
}

/// Whether ticket `t` comes after `s` on the wrapping counter.
fn after(t: u32, s: u32) -> bool {
    (t.wrapping_sub(s) as i32) > 0
}

/// Whether another open file description holds a lock on `byte` of the file (as a test from `fd`).
fn lock_held(fd: i32, byte: i64) -> bool {
    // SAFETY: flock is plain data; the fields F_OFD_GETLK reads are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = byte;
    fl.l_len = 1;
    // SAFETY: a valid descriptor and a pointer to a local flock (l_pid 0, as OFD locks want).
    let r = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) };
    r == 0 && fl.l_type != libc::F_UNLCK as _
}

// The counters are words of a file mapped by every process of the container: futexes without the
// private flag, which the kernel matches by the file's page.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a 4-byte aligned word of a live mapping, with a relative timeout; it
    // returns at once where the word no longer holds `expected`.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts, 0usize, 0u32) };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a 4-byte aligned word of a live mapping wakes its waiters, if any.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
}

#[cfg(test)]
mod tests {
    use super::after;
    use crate::{Init, Region};
    use std::time::{Duration, Instant};

    fn region(name: &str) -> Region {
        let p = std::env::temp_dir().join(format!("vgpu-region-measurer-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let init = Init { devices: vec![("GPU-0".into(), 1 << 30, 0)], standalone: true };
        let r = Region::open_or_create(&p, || init).unwrap();
        let _ = std::fs::remove_file(&p);
        r
    }

    #[test]
    fn tickets_compare_on_a_wrapping_counter() {
        assert!(after(1, 0) && !after(0, 0) && !after(0, 1));
        assert!(after(0, u32::MAX) && after(3, u32::MAX - 2) && !after(u32::MAX, 3));
    }

    #[test]
    fn the_first_claimant_measures_until_its_slot_is_gone() {
        let r = region("claimant");
        let a = r.claim(100, 100).unwrap();
        assert!(!r.measurer_alive(), "none yet");
        assert!(r.become_measurer(a.index, 100));
        assert!(r.become_measurer(a.index, 100), "already");
        assert_eq!(r.measurer(), Some((a.index, 100)));
        assert!(r.measurer_alive());
        // Another process of the container finds it alive.
        let b = r.claim(200, 200).unwrap();
        assert!(!r.become_measurer(b.index, 200));
        // Its slot's lock gone (its process gone): the next one takes over.
        let slot = a.index;
        drop(a);
        assert!(!r.measurer_alive(), "slot {slot}'s lock is free");
        assert!(r.become_measurer(b.index, 200));
        assert_eq!(r.measurer(), Some((b.index, 200)));
    }

    #[test]
    fn an_ask_is_served_by_a_pass_that_began_after_it() {
        let r = region("asks");
        let t1 = r.ask_measurer();
        assert!(!r.served(t1));
        // Not answered: the wait ends at its timeout.
        let t = Instant::now();
        assert!(!r.wait_served(t1, Duration::from_millis(50)));
        assert!(t.elapsed() >= Duration::from_millis(40));
        // The measurer, woken by the ask, answers it from another thread; the waiter wakes.
        let seen = r.wait_asked(0, Duration::from_secs(1));
        assert_eq!(seen, t1);
        let t2 = r.ask_measurer();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                r.answered(t1);
            });
            assert!(!r.wait_served(t2, Duration::from_millis(300)), "t2 came after the pass for t1");
            assert!(r.served(t1));
        });
        r.answered(t2);
        assert!(r.served(t2) && r.wait_served(t2, Duration::ZERO));
        // An older answer does not take the counter back.
        r.answered(t1);
        assert!(r.served(t2));
    }
}

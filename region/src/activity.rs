//! A slice's activity: until when the work its processes queued on each of its GPUs is estimated to
//! run (CLOCK_MONOTONIC ns), for the priority gate (docs/priority.md).
//!
//! One small file per slice, `activity` in its directory, made by the agent and mounted read-write
//! into the slice's containers: its processes add each launch's estimated GPU time. The agent links a
//! high-priority slice's file into `gates/<gpu-uuid>/` (read-only in every container) so that the
//! normal slices of that GPU see when it has work queued. A container can truncate its own file; a
//! mapping of it made here is guarded like a region's ([`crate::shrink`]), so that a reader of
//! another slice's file reads zeros instead of dying.

use crate::MAX_DEVICES;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// The file's first word.
pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUACT1");
/// The file's size: one page.
pub const SIZE: usize = 4096;

#[repr(C)]
pub struct Activity {
    pub magic: AtomicU64,
    /// Per slice device: when the work queued so far is estimated to be done.
    pub until: [AtomicU64; MAX_DEVICES],
    /// Per slice device: when the latest burst of work began (a launch onto an idle queue: a
    /// service's request).
    pub burst: [AtomicU64; MAX_DEVICES],
    /// Per slice device: the smoothed time between bursts, and how far they stray from it (ns).
    pub period: [AtomicU64; MAX_DEVICES],
    pub jitter: [AtomicU64; MAX_DEVICES],
    /// Per slice device: the estimated GPU time of every launch noted so far (ns, wrapping): what
    /// the agent holds the GPU time NVML measures for the slice to (a process that skips the
    /// interposer notes nothing). Files made before it read 0 here.
    pub noted: [AtomicU64; MAX_DEVICES],
}

/// The longest time between bursts that counts as a rhythm (a service at one request a second or
/// faster); a slower or unsteady one is not anticipated.
pub const MAX_PERIOD_NS: u64 = 1_000_000_000;

/// When a slice's bursts of work come, where they come regularly (a service at a fixed rate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rhythm {
    /// When the latest began.
    pub last: u64,
    /// The time between them.
    pub period: u64,
    /// How far they stray from it.
    pub jitter: u64,
}

const _: () = assert!(std::mem::size_of::<Activity>() <= SIZE);

/// Makes `path` an idle activity file, writable by every user (a container's processes, whatever
/// their uid).
pub fn create(path: &Path) -> std::io::Result<()> {
    let mut page = vec![0u8; SIZE];
    page[..8].copy_from_slice(&MAGIC.to_le_bytes());
    let tmp = path.with_extension("tmp");
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_NOFOLLOW).open(&tmp)?;
    f.write_all(&page)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o666))?;
    std::fs::rename(&tmp, path)
}

/// A mapped activity file.
pub struct Mapped {
    map: &'static Activity,
    guard: Option<usize>,
}

impl Mapped {
    /// Maps `path` (read-write, or read-only for another slice's); None where it is not an activity
    /// file of the right size (a link, a truncated or foreign file) or cannot be mapped.
    pub fn open(path: &Path, writable: bool) -> Option<Mapped> {
        let f: File = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .ok()?;
        let md = f.metadata().ok()?;
        if !md.is_file() || md.len() < SIZE as u64 {
            return None;
        }
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: maps SIZE bytes of a regular file at least that long; every field of `Activity` is
        // an atomic integer, for which any bit pattern is valid; the mapping is unmapped only by
        // `Drop`, and references never outlive the `Mapped` (they borrow it). A read-only mapping is
        // only read.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), SIZE, prot, libc::MAP_SHARED, f.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return None;
        }
        let Ok(guard) = crate::shrink::register_len(p as usize, SIZE) else {
            // SAFETY: the mapping just made, not yet handed out.
            unsafe { libc::munmap(p, SIZE) };
            return None;
        };
        // SAFETY: as above.
        let map = unsafe { &*(p as *const Activity) };
        if map.magic.load(Acquire) != MAGIC {
            drop(Mapped { map, guard });
            return None;
        }
        Some(Mapped { map, guard })
    }

    /// When the work queued on slice device `dev` is estimated to be done (0: none ever, or the
    /// file was truncated under the mapping).
    #[inline]
    pub fn until(&self, dev: usize) -> u64 {
        self.map.until.get(dev).map_or(0, |u| u.load(Relaxed))
    }

    /// Notes `cost_ns` more work queued on slice device `dev` at `now`: done at the later of
    /// what was queued and now, plus the cost. Returns the estimate before, and the new one.
    #[inline]
    pub fn note(&self, dev: usize, now: u64, cost_ns: u64) -> (u64, u64) {
        let Some(u) = self.map.until.get(dev) else { return (0, 0) };
        self.map.noted[dev].fetch_add(cost_ns, Relaxed);
        let mut cur = u.load(Relaxed);
        loop {
            let next = cur.max(now).saturating_add(cost_ns);
            match u.compare_exchange_weak(cur, next, Relaxed, Relaxed) {
                Ok(_) => return (cur, next),
                Err(x) => cur = x,
            }
        }
    }

    /// Adds `cost_ns` to the work queued on slice device `dev`, known to be busy (what was queued
    /// ends after now): `note` without the clock.
    #[inline]
    pub fn add(&self, dev: usize, cost_ns: u64) {
        if let Some(u) = self.map.until.get(dev) {
            u.fetch_add(cost_ns, Relaxed);
            self.map.noted[dev].fetch_add(cost_ns, Relaxed);
        }
    }

    /// The estimated GPU time of every launch noted on slice device `dev` so far (ns, wrapping:
    /// the difference of two readings is what was noted between them).
    pub fn noted(&self, dev: usize) -> u64 {
        self.map.noted.get(dev).map_or(0, |n| n.load(Relaxed))
    }

    /// Notes that a burst of work began on slice device `dev` at `now` (its queue was idle): the
    /// time between bursts and its jitter follow, smoothed (1/8 of each new gap).
    pub fn note_burst(&self, dev: usize, now: u64) {
        let m = self.map;
        let (Some(b), Some(p), Some(j)) = (m.burst.get(dev), m.period.get(dev), m.jitter.get(dev)) else { return };
        let last = b.swap(now, Relaxed);
        if last == 0 || now <= last {
            return;
        }
        let gap = now - last;
        let per = p.load(Relaxed);
        // (saturating: the slice's processes can write anything into their file)
        if per == 0 || gap > per.saturating_mul(4) {
            // The first gap, or the service paused: the rhythm starts again.
            p.store(gap, Relaxed);
            j.store(gap / 4, Relaxed);
            return;
        }
        p.store(per.saturating_mul(7).saturating_add(gap) / 8, Relaxed);
        j.store(j.load(Relaxed).saturating_mul(7).saturating_add(gap.abs_diff(per)) / 8, Relaxed);
    }

    /// Slice device `dev`'s rhythm of bursts (None before two).
    pub fn rhythm(&self, dev: usize) -> Option<Rhythm> {
        let m = self.map;
        let period = m.period.get(dev)?.load(Relaxed);
        // Another tenant writes these: a rhythm is at most a second long, and strays by at most
        // its length (a period of 3600 s with a jitter of 449 s held a neighbour for 35 s).
        let jitter = m.jitter[dev].load(Relaxed).min(period);
        (period > 0 && period <= MAX_PERIOD_NS).then(|| Rhythm { last: m.burst[dev].load(Relaxed), period, jitter })
    }

    /// Forgets slice device `dev`'s queued work and rhythm (the agent, for a slice with no live
    /// process: a dead process's queued work went with it, and its requests will not come).
    pub fn clear(&self, dev: usize) {
        let m = self.map;
        for a in [&m.until, &m.burst, &m.period, &m.jitter] {
            if let Some(x) = a.get(dev) {
                x.store(0, Relaxed);
            }
        }
    }

    /// Whether the file was truncated under the mapping (it then reads zeros).
    pub fn faulted(&self) -> bool {
        self.guard.is_some_and(crate::shrink::faulted)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if let Some(g) = self.guard {
            crate::shrink::unregister(g);
        }
        // SAFETY: the mapping made by `open`, owned by this value alone; no borrow of it outlives it.
        unsafe { libc::munmap(self.map as *const Activity as *mut libc::c_void, SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queued_work_adds_up_and_readers_see_it() {
        let p = std::env::temp_dir().join(format!("vgpu-activity-{}", std::process::id()));
        create(&p).unwrap();
        let w = Mapped::open(&p, true).unwrap();
        let r = Mapped::open(&p, false).unwrap();
        assert_eq!(w.note(1, 1000, 500), (0, 1500));
        assert_eq!(w.note(1, 1200, 500), (1500, 2000), "after what was queued");
        assert_eq!(w.note(1, 5000, 100), (2000, 5100), "idle meanwhile: from now");
        w.add(1, 50);
        assert_eq!(r.until(1), 5150, "busy: added");
        w.add(MAX_DEVICES, 50);
        // Bursts every 10 ms, 1 ms off at times: the rhythm follows.
        assert_eq!(r.rhythm(0), None);
        for (i, off) in [0u64, 0, 1, 0, 0, 0, 1, 0].iter().enumerate() {
            w.note_burst(0, 1_000_000_000 + i as u64 * 10_000_000 + off * 1_000_000);
        }
        let rh = r.rhythm(0).unwrap();
        assert!(rh.period.abs_diff(10_000_000) < 1_000_000 && rh.jitter < 2_000_000, "{rh:?}");
        assert_eq!(rh.last, 1_070_000_000);
        assert_eq!((r.until(0), r.until(1)), (0, 5150));
        assert_eq!(r.until(MAX_DEVICES), 0, "no such device");
        std::fs::write(&p, b"short").unwrap();
        assert!(Mapped::open(&p, false).is_none(), "a truncated file is not mapped");
        std::fs::remove_file(&p).ok();
    }

    #[test]
    fn a_file_truncated_under_a_guarded_mapping_reads_zeros() {
        crate::shrink::enable().unwrap();
        let p = std::env::temp_dir().join(format!("vgpu-activity-cut-{}", std::process::id()));
        create(&p).unwrap();
        let w = Mapped::open(&p, true).unwrap();
        let r = Mapped::open(&p, false).unwrap();
        w.note(0, 1000, 1000);
        assert_eq!(r.until(0), 2000);
        // What a hostile tenant can do to its own file: the readers of it live on.
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
        assert_eq!(r.until(0), 0);
        assert!(r.faulted());
        std::fs::remove_file(&p).ok();
    }

    #[test]
    fn a_rhythm_written_over_by_its_own_slice_does_not_break_the_next_burst() {
        let p = std::env::temp_dir().join(format!("vgpu-activity-wild-{}", std::process::id()));
        create(&p).unwrap();
        let w = Mapped::open(&p, true).unwrap();
        // Any value a process of the slice may have written (its file is its own).
        for wild in [u64::MAX, u64::MAX / 4, u64::MAX / 7 + 1] {
            w.map.burst[0].store(1, Relaxed);
            w.map.period[0].store(wild, Relaxed);
            w.map.jitter[0].store(wild, Relaxed);
            w.note_burst(0, 1_000_000_000);
            // No rhythm of more than a second is believed.
            assert_eq!(w.rhythm(0), None);
        }
        // A slow or wild one written outright: none either; a steady one, bounded.
        for (period, jitter, some) in [(3_600_000_000_000, 449_000_000_000, false), (10_000_000, u64::MAX, true)] {
            w.map.period[0].store(period, Relaxed);
            w.map.jitter[0].store(jitter, Relaxed);
            let rh = w.rhythm(0);
            assert_eq!(rh.is_some(), some, "{rh:?}");
            assert!(rh.is_none_or(|r| r.period <= MAX_PERIOD_NS && r.jitter <= r.period), "{rh:?}");
        }
        std::fs::remove_file(&p).ok();
    }
}

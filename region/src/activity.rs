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
    /// what was queued and now, plus the cost. Returns the new estimate.
    #[inline]
    pub fn note(&self, dev: usize, now: u64, cost_ns: u64) -> u64 {
        let Some(u) = self.map.until.get(dev) else { return 0 };
        let mut cur = u.load(Relaxed);
        loop {
            let next = cur.max(now).saturating_add(cost_ns);
            match u.compare_exchange_weak(cur, next, Relaxed, Relaxed) {
                Ok(_) => return next,
                Err(x) => cur = x,
            }
        }
    }

    /// Sets slice device `dev`'s estimate (the agent clears a slice's when none of its processes
    /// lives: a dead process's queued work went with it).
    pub fn set(&self, dev: usize, until: u64) {
        if let Some(u) = self.map.until.get(dev) {
            u.store(until, Relaxed);
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
        assert_eq!(w.note(1, 1000, 500), 1500);
        assert_eq!(w.note(1, 1200, 500), 2000, "after what was queued");
        assert_eq!(w.note(1, 5000, 100), 5100, "idle meanwhile: from now");
        assert_eq!((r.until(0), r.until(1)), (0, 5100));
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
}

//! The per-container shared region: one fixed-size file that every process of a container maps, and
//! that the node agent and `vgpuctl` read and write.
//!
//! * **Exact memory accounting without a lock or a window.** A process's usage per device lives only
//!   in its own slot. To reserve, a process adds to its slot, then sums every slot: if the sum exceeds
//!   the limit it takes its addition back. Adds and loads are sequentially consistent, so of any two
//!   concurrent reservations at least one sees the other (Dekker): the sum of admitted reservations
//!   never exceeds the limit. A process killed at any instruction leaves its slot holding exactly what
//!   it reserved, and reclaiming the slot releases exactly that.
//! * **Liveness without PIDs.** A process holds an open-file-description record lock on one byte per
//!   slot for its whole life; the kernel drops it when the process dies, however it dies. A slot
//!   whose lock can be taken is dead. PID reuse cannot fool this and no process scan is needed.
//! * **Limits** are per device and can change at any time; readers load them on every check.
#![deny(clippy::too_many_lines)]

pub mod activity;
mod layout;
mod measurer;
pub mod shrink;

pub use layout::*;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::*};

/// Why a region cannot be used. Messages are meant for one stderr line.
#[derive(Debug)]
pub enum RegionError {
    Io {
        path: PathBuf,
        action: &'static str,
        source: io::Error,
    },
    Truncated {
        path: PathBuf,
        len: u64,
    },
    BadMagic {
        path: PathBuf,
    },
    Version {
        path: PathBuf,
        found: u32,
    },
    Layout {
        path: PathBuf,
    },
    NoSlot {
        path: PathBuf,
    },
    ReadOnly {
        path: PathBuf,
    },
    /// Not a regular file (a symbolic link, a device, a FIFO...), refused by [`Region::open_strict`].
    NotAFile {
        path: PathBuf,
    },
    /// Every guarded mapping slot is taken ([`shrink::CAPACITY`]).
    TooMany {
        path: PathBuf,
    },
}

impl std::fmt::Display for RegionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegionError::Io { path, action, source } => {
                write!(f, "cannot {action} region {}: {source}", path.display())
            }
            RegionError::Truncated { path, len } => {
                write!(f, "region {} is truncated or resized: {len} bytes, expected {TOTAL_SIZE}", path.display())
            }
            RegionError::BadMagic { path } => write!(f, "{} is not a vgpu region (bad magic)", path.display()),
            RegionError::Version { path, found } => write!(
                f,
                "region {} has ABI version {found}; this build understands version {ABI_VERSION}",
                path.display()
            ),
            RegionError::Layout { path } => {
                write!(f, "region {} has a different layout (layout hash mismatch); refusing it", path.display())
            }
            RegionError::NoSlot { path } => {
                write!(f, "region {}: all {MAX_SLOTS} process slots are in use", path.display())
            }
            RegionError::ReadOnly { path } => write!(f, "region {} is open read-only", path.display()),
            RegionError::NotAFile { path } => {
                write!(f, "{} is not a regular file (a link or a special file); refusing it", path.display())
            }
            RegionError::TooMany { path } => write!(
                f,
                "cannot map region {}: {} regions are mapped already, the most this process guards",
                path.display(),
                shrink::CAPACITY
            ),
        }
    }
}

impl std::error::Error for RegionError {}

type Result<T> = std::result::Result<T, RegionError>;

/// What a new region holds (standalone creation or the agent).
#[derive(Clone, Debug, Default)]
pub struct Init {
    /// Per device: (UUID, memory limit in bytes, SM limit in percent).
    pub devices: Vec<(String, u64, u32)>,
    /// Created from a process's environment rather than by the agent.
    pub standalone: bool,
}

/// A mapped region.
pub struct Region {
    path: PathBuf,
    file: File,
    map: &'static Layout,
    /// The mapping's slot in the shrink guard (see [`shrink`]), where that is on.
    guard: Option<usize>,
    writable: bool,
    /// A second open file description for taking dead slots' locks (opened at the first reap and
    /// kept: a monitor reaps every pass).
    reap_fd: std::sync::OnceLock<OwnedFd>,
}

fn lock(fd: i32, byte: i64, cmd: i32, ty: i32) -> io::Result<bool> {
    // SAFETY: flock is plain data; fcntl with an OFD lock command and a valid pointer.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = byte;
    fl.l_len = 1;
    loop {
        // SAFETY: valid fd and flock struct.
        let r = unsafe { libc::fcntl(fd, cmd, &mut fl) };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) | Some(libc::EACCES) => return Ok(false),
            _ => return Err(e),
        }
    }
}

fn pack(s: &str, dst: &[AtomicU64; 8]) {
    let mut b = [0u8; 64];
    let n = s.len().min(63);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    for (w, c) in dst.iter().zip(b.chunks_exact(8)) {
        w.store(u64::from_le_bytes(c.try_into().unwrap()), Relaxed);
    }
}

fn unpack(src: &[AtomicU64; 8]) -> String {
    let b: Vec<u8> = src.iter().flat_map(|w| w.load(Relaxed).to_le_bytes()).take_while(|&c| c != 0).collect();
    String::from_utf8_lossy(&b).into_owned()
}

pub fn now_realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

impl Region {
    /// Opens the region at `path`, creating and initialising it from `init()` if it does not exist or
    /// is empty. Concurrent creators are serialised by a record lock that dies with its holder.
    pub fn open_or_create(path: &Path, init: impl FnOnce() -> Init) -> Result<Region> {
        Region::open_or_create_mode(path, 0o666, 0, init)
    }

    /// As [`open_or_create`](Self::open_or_create), for one user's own region (a process's region
    /// of its own, where none is named): made 0600, and never opened through a symbolic link.
    pub fn open_or_create_private(path: &Path, init: impl FnOnce() -> Init) -> Result<Region> {
        Region::open_or_create_mode(path, 0o600, libc::O_NOFOLLOW, init)
    }

    fn open_or_create_mode(path: &Path, mode: u32, flags: i32, init: impl FnOnce() -> Init) -> Result<Region> {
        let io = |action, source| RegionError::Io { path: path.to_owned(), action, source };
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                std::fs::create_dir_all(dir).map_err(|e| io("create the directory of", e))?;
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(mode)
            .custom_flags(libc::O_CLOEXEC | flags)
            .open(path)
            .map_err(|e| io("open", e))?;
        // A finished region is opened without the init lock: every process of a container starting
        // at once took it in turn, each holding it while it mapped and checked the file (the
        // serial part of a hundred starts). Finished means whole: its state is set (with release
        // ordering) only after everything else, under the lock, by its creator.
        if file.metadata().is_ok_and(|m| m.len() == TOTAL_SIZE as u64) {
            if let Ok((map, guard)) = validate(&file, path) {
                if map.header.state.load(Acquire) == 1 {
                    return Ok(Region {
                        path: path.to_owned(),
                        file,
                        map,
                        guard,
                        writable: true,
                        reap_fd: Default::default(),
                    });
                }
                unmap(map, guard);
            }
        }
        let fd = file.as_raw_fd();
        lock(fd, INIT_LOCK_BYTE, libc::F_OFD_SETLKW, libc::F_WRLCK).map_err(|e| io("lock", e))?;
        let r = (|| {
            let mut len = file.metadata().map_err(|e| io("stat", e))?.len();
            // A creator killed between reserving the file and finishing its header (it held the
            // init lock, which died with it) left a file without the magic, which is written
            // last but the state: made again, as an empty one is. Every creator holds that lock
            // until the header is whole, so holding it here, no one is still writing it.
            if len != 0 && unfinished(&file, len) {
                file.set_len(0).map_err(|e| io("truncate the unfinished", e))?;
                len = 0;
            }
            if len == 0 {
                // Make the file's permissions independent of the creator's umask.
                // SAFETY: fchmod on our open fd.
                unsafe { libc::fchmod(fd, mode) };
                // Blocks reserved now, not a sparse file: on a full file system a shared mapping of
                // a sparse file faults (SIGBUS) at the first write; this fails cleanly instead.
                // SAFETY: posix_fallocate on our open fd; it returns an errno value.
                let rc = unsafe { libc::posix_fallocate(fd, 0, TOTAL_SIZE as libc::off_t) };
                if rc != 0 {
                    let e = io::Error::from_raw_os_error(rc);
                    let _ = file.set_len(0);
                    return Err(io("reserve space for", e));
                }
                let (map, guard) = map(&file, path, true)?;
                let h = &map.header;
                let init = init();
                for (i, (uuid, mem, sm)) in init.devices.iter().take(MAX_DEVICES).enumerate() {
                    pack(uuid, &map.devices[i].uuid);
                    map.devices[i].mem_limit.store(*mem, Relaxed);
                    map.devices[i].sm_limit.store(*sm, Relaxed);
                }
                h.ndevices.store(init.devices.len().min(MAX_DEVICES) as u32, Relaxed);
                h.flags.store(if init.standalone { FLAG_STANDALONE } else { 0 }, Relaxed);
                h.creator_pid.store(std::process::id(), Relaxed);
                h.abi_version.store(ABI_VERSION, Relaxed);
                h.header_size.store(std::mem::size_of::<Header>() as u32, Relaxed);
                h.total_size.store(TOTAL_SIZE as u64, Relaxed);
                h.layout_hash.store(LAYOUT_HASH, Relaxed);
                h.magic.store(MAGIC, Relaxed);
                h.state.store(1, Release);
                Ok((map, guard))
            } else {
                validate(&file, path)
            }
        })();
        let _ = lock(fd, INIT_LOCK_BYTE, libc::F_OFD_SETLK, libc::F_UNLCK);
        let (map, guard) = r?;
        Ok(Region { path: path.to_owned(), file, map, guard, writable: true, reap_fd: Default::default() })
    }

    /// Opens an existing region, read-write or read-only, validating it.
    pub fn open(path: &Path, writable: bool) -> Result<Region> {
        Region::open_with(path, writable, 0)
    }

    /// Opens an existing region as [`open`](Self::open) does, but only a regular file, and not
    /// through a symbolic link as its last component (the agent, for files a container could have
    /// replaced).
    pub fn open_strict(path: &Path, writable: bool) -> Result<Region> {
        Region::open_with(path, writable, libc::O_NOFOLLOW | libc::O_NONBLOCK)
    }

    fn open_with(path: &Path, writable: bool, flags: i32) -> Result<Region> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(libc::O_CLOEXEC | flags)
            .open(path)
            .map_err(|source| match source.raw_os_error() {
                Some(libc::ELOOP) if flags & libc::O_NOFOLLOW != 0 => RegionError::NotAFile { path: path.to_owned() },
                _ => RegionError::Io { path: path.to_owned(), action: "open", source },
            })?;
        if flags != 0 {
            let regular = file.metadata().is_ok_and(|m| m.file_type().is_file());
            if !regular {
                return Err(RegionError::NotAFile { path: path.to_owned() });
            }
        }
        let (map, guard) = if writable { validate(&file, path)? } else { validate_ro(&file, path)? };
        Ok(Region { path: path.to_owned(), file, map, guard, writable, reap_fd: Default::default() })
    }

    /// Whether the file shrank under this mapping and the shrink guard replaced it with zeros
    /// ([`shrink`]): nothing read from it means anything any more; drop it and open the file again.
    pub fn faulted(&self) -> bool {
        self.guard.is_some_and(shrink::faulted)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn layout(&self) -> &Layout {
        self.map
    }

    /// The mapping with a `'static` lifetime, for a region that is never dropped (one held in a
    /// static for the life of the process, as the interposer's is).
    ///
    /// # Safety
    /// The region must outlive every use of the returned reference: dropping it unmaps the memory.
    pub unsafe fn layout_static(&self) -> &'static Layout {
        self.map
    }

    pub fn ndevices(&self) -> usize {
        (self.map.header.ndevices.load(Acquire) as usize).min(MAX_DEVICES)
    }

    pub fn device_uuid(&self, i: usize) -> String {
        unpack(&self.map.devices[i].uuid)
    }

    fn writable(&self) -> Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(RegionError::ReadOnly { path: self.path.clone() })
        }
    }

    /// Records a device (agent, or a standalone process seeing a device for the first time).
    /// Returns its index, or None when the region is full or read-only.
    pub fn add_device(&self, uuid: &str, mem_limit: u64, sm_limit: u32) -> Option<usize> {
        self.writable().ok()?;
        let g = self.init_guard();
        let n = self.ndevices();
        if let Some(i) = (0..n).find(|&i| self.device_uuid(i) == uuid) {
            return Some(i);
        }
        if n >= MAX_DEVICES {
            return None;
        }
        let d = &self.map.devices[n];
        pack(uuid, &d.uuid);
        d.mem_limit.store(mem_limit, Relaxed);
        d.sm_limit.store(sm_limit, Relaxed);
        self.map.header.ndevices.store(n as u32 + 1, Release);
        drop(g);
        Some(n)
    }

    /// Index of the device with this UUID.
    pub fn find_device(&self, uuid: &str) -> Option<usize> {
        (0..self.ndevices()).find(|&i| self.device_uuid(i) == uuid)
    }

    /// Binds a device UUID to a region index: the index it already has, else `preferred` if that index
    /// is free, else the first free index. New devices get the given limits.
    pub fn bind_device(&self, preferred: usize, uuid: &str, mem_limit: u64, sm_limit: u32) -> Option<usize> {
        self.writable().ok()?;
        let _g = self.init_guard();
        if let Some(i) = self.find_device(uuid) {
            return Some(i);
        }
        let free = |i: usize| unpack(&self.map.devices[i].uuid).is_empty();
        let i =
            if preferred < MAX_DEVICES && free(preferred) { preferred } else { (0..MAX_DEVICES).find(|&i| free(i))? };
        let d = &self.map.devices[i];
        pack(uuid, &d.uuid);
        d.mem_limit.store(mem_limit, Relaxed);
        d.sm_limit.store(sm_limit, Relaxed);
        self.map.header.ndevices.fetch_max(i as u32 + 1, AcqRel);
        Some(i)
    }

    fn init_guard(&self) -> impl Drop + '_ {
        struct G<'a>(&'a File);
        impl Drop for G<'_> {
            fn drop(&mut self) {
                let _ = lock(self.0.as_raw_fd(), INIT_LOCK_BYTE, libc::F_OFD_SETLK, libc::F_UNLCK);
            }
        }
        let _ = lock(self.file.as_raw_fd(), INIT_LOCK_BYTE, libc::F_OFD_SETLKW, libc::F_WRLCK);
        G(&self.file)
    }

    pub fn mem_limit(&self, dev: usize) -> u64 {
        self.map.devices[dev].mem_limit.load(Acquire)
    }

    /// Changes a device's memory limit (the agent, or an operator tool).
    pub fn set_mem_limit(&self, dev: usize, bytes: u64) -> Result<()> {
        self.writable()?;
        self.map.devices[dev].mem_limit.store(bytes, Release);
        self.map.header.limits_generation.fetch_add(1, AcqRel);
        Ok(())
    }

    pub fn sm_limit(&self, dev: usize) -> u32 {
        self.map.devices[dev].sm_limit.load(Acquire)
    }

    /// Whether allocations the GPU has no physical room for may be served as unified memory (set by
    /// the agent when the node's memory is oversubscribed).
    #[inline]
    pub fn oversubscribe(&self) -> bool {
        self.map.header.flags.load(Acquire) & FLAG_OVERSUBSCRIBE != 0
    }

    /// Whether a process created the region from its environment (no agent writes or watches it).
    #[inline]
    pub fn standalone(&self) -> bool {
        self.map.header.flags.load(Acquire) & FLAG_STANDALONE != 0
    }

    pub fn set_oversubscribe(&self, on: bool) -> Result<()> {
        self.set_flag(FLAG_OVERSUBSCRIBE, on)
    }

    /// Whether the slice's GPUs run MPS (set by the agent; see [`FLAG_MPS`]).
    #[inline]
    pub fn mps(&self) -> bool {
        self.map.header.flags.load(Acquire) & FLAG_MPS != 0
    }

    pub fn set_mps(&self, on: bool) -> Result<()> {
        self.set_flag(FLAG_MPS, on)
    }

    /// Whether the slice is a high-priority tenant of its GPUs (set by the agent).
    #[inline]
    pub fn priority_high(&self) -> bool {
        self.map.header.flags.load(Acquire) & FLAG_PRIORITY_HIGH != 0
    }

    pub fn set_priority_high(&self, on: bool) -> Result<()> {
        self.set_flag(FLAG_PRIORITY_HIGH, on)
    }

    /// The most GPU time a normal slice keeps queued beside a high-priority one (ns; 0: default).
    #[inline]
    pub fn priority_queue_ns(&self) -> u64 {
        self.map.header.priority_queue_ns.load(Relaxed)
    }

    pub fn set_priority_queue_ns(&self, ns: u64) -> Result<()> {
        self.writable()?;
        self.map.header.priority_queue_ns.store(ns, Relaxed);
        Ok(())
    }

    /// The share of each window (percent) in which a normal slice beside a high-priority one may
    /// launch whatever that slice claims (0: the interposer's default; read as at most 50).
    #[inline]
    pub fn priority_min_share(&self) -> u32 {
        self.map.header.priority_min_share.load(Relaxed).min(50) as u32
    }

    pub fn set_priority_min_share(&self, percent: u32) -> Result<()> {
        self.writable()?;
        self.map.header.priority_min_share.store(percent.min(50).into(), Relaxed);
        Ok(())
    }

    fn set_flag(&self, flag: u32, on: bool) -> Result<()> {
        self.writable()?;
        let f = &self.map.header.flags;
        if on {
            f.fetch_or(flag, AcqRel);
        } else {
            f.fetch_and(!flag, AcqRel);
        }
        Ok(())
    }

    pub fn set_sm_limit(&self, dev: usize, pct: u32) -> Result<()> {
        self.writable()?;
        self.map.devices[dev].sm_limit.store(pct, Release);
        self.map.header.limits_generation.fetch_add(1, AcqRel);
        Ok(())
    }

    /// Memory in use on `dev` by every live process of the container.
    #[inline]
    pub fn used(&self, dev: usize) -> u64 {
        let hw = (self.map.header.slots_hw.load(Acquire) as usize).min(MAX_SLOTS);
        // Saturating: a region a process of the container scribbled on must not wrap into a small
        // total (found by fuzzing; it would panic in debug builds and under-count in release).
        self.map.slots[..hw].iter().fold(0u64, |a, s| a.saturating_add(s.used[dev].load(SeqCst)))
    }

    /// Claims a process slot for the calling process. The returned [`Claim`] holds the slot's record
    /// lock; the slot is reclaimed when the process dies.
    pub fn claim(&self, pid: u32, host_pid: u32) -> Result<Claim> {
        self.writable()?;
        // A private open file description: the lock dies with this process and is not shared with a
        // forked child that re-claims (see `Claim::reclaim_after_fork`).
        let fd = reopen(&self.file, &self.path)?;
        // Slots marked exiting first (their process is going: taking one releases what it held),
        // then free ones, then the rest (a killed process's slot still reads live): each lock
        // attempt on a held slot is a system call on the file's one lock list, so trying them in
        // order made a hundred processes starting at once a hundred squared of them.
        let slot = |i: usize| &self.map.slots[i];
        let exiting = |i: &usize| slot(*i).state.load(Acquire) != 0 && slot(*i).exiting.load(Acquire) != 0;
        let free = |i: &usize| slot(*i).state.load(Acquire) == 0;
        let order = (0..MAX_SLOTS)
            .filter(exiting)
            .chain((0..MAX_SLOTS).filter(free))
            .chain((0..MAX_SLOTS).filter(|i| !exiting(i) && !free(i)));
        for i in order {
            let slot = &self.map.slots[i];
            let held = lock(fd.as_raw_fd(), SLOT_LOCK_BASE + i as i64, libc::F_OFD_SETLK, libc::F_WRLCK)
                .map_err(|source| RegionError::Io { path: self.path.clone(), action: "lock a slot of", source })?;
            if !held {
                continue; // a live process holds it
            }
            // Ours now. Whatever a dead predecessor held is released here.
            for u in &slot.used {
                u.store(0, SeqCst);
            }
            self.clear_exiting(slot);
            slot.pid.store(pid, Relaxed);
            slot.host_pid.store(host_pid, Relaxed);
            slot.claimed_ns.store(now_realtime_ns(), Relaxed);
            slot.state.store(1, Release);
            self.map.header.slots_hw.fetch_max(i as u32 + 1, AcqRel);
            return Ok(Claim { index: i, fd });
        }
        Err(RegionError::NoSlot { path: self.path.clone() })
    }

    /// Releases the slots of dead processes; returns the bytes released.
    pub fn reap(&self) -> u64 {
        self.reap_where(|_, _| true)
    }

    /// Marks `slot`, the calling process's, as exiting (its exit handler): whoever next reads the
    /// container's usage reclaims the slot once the process is gone, instead of counting it until a
    /// reservation meets the limit or a new process starts. Nothing is released here: the process
    /// still holds its memory until it is gone.
    pub fn mark_exiting(&self, slot: usize) {
        if !self.writable || slot >= MAX_SLOTS {
            return;
        }
        if self.map.slots[slot].exiting.swap(1, AcqRel) == 0 {
            self.map.header.exiting.fetch_add(1, AcqRel);
        }
    }

    /// Slots marked exiting and not yet reclaimed: one load, for readers of the usage.
    #[inline]
    pub fn exiting(&self) -> u32 {
        self.map.header.exiting.load(Acquire)
    }

    /// Releases the slots marked exiting whose processes are gone (a lock test for each of those
    /// only); returns the bytes released.
    pub fn reap_exited(&self) -> u64 {
        self.reap_slots(|s| s.exiting.load(Acquire) != 0)
    }

    /// [`reap`](Self::reap) of the slots whose process looks gone from the caller's PID namespace
    /// (no process of that PID), or marked exiting: a lock test for those only, instead of one per
    /// live process (what a process of the container does as it starts).
    pub fn reap_gone(&self) -> u64 {
        let gone = |pid: u32| {
            // SAFETY: kill with signal 0 only checks that the process exists; it sends nothing.
            pid == 0
                || unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
                    && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        };
        self.reap_slots(|s| s.state.load(Acquire) == 0 || s.exiting.load(Acquire) != 0 || gone(s.pid.load(Relaxed)))
    }

    fn clear_exiting(&self, slot: &Slot) {
        if slot.exiting.swap(0, AcqRel) != 0 {
            // Saturating: a scribbled counter must not wrap into a permanent lock test per read.
            let _ = self.map.header.exiting.fetch_update(AcqRel, Acquire, |n| Some(n.saturating_sub(1)));
        }
    }

    /// [`reap`](Self::reap) limited to the live-looking slots for which `check(pid, host_pid)` is
    /// true (a monitor that knows some processes are alive skips their lock test).
    pub fn reap_where(&self, check: impl Fn(u32, u32) -> bool) -> u64 {
        self.reap_where_each(check, |_, _, _| {})
    }

    /// [`reap_where`](Self::reap_where), telling `freed` the PID, host PID and bytes of each slot
    /// released (what the slot claimed: the container's word).
    pub fn reap_where_each(&self, check: impl Fn(u32, u32) -> bool, freed: impl FnMut(u32, u32, u64)) -> u64 {
        self.reap_slots_each(
            |s| s.state.load(Acquire) == 0 || check(s.pid.load(Relaxed), s.host_pid.load(Relaxed)),
            freed,
        )
    }

    /// Releases the slots that `select` picks (among those holding anything) and whose lock can be
    /// taken: their processes are gone.
    fn reap_slots(&self, select: impl Fn(&Slot) -> bool) -> u64 {
        self.reap_slots_each(select, |_, _, _| {})
    }

    /// The second open file description that tests (and takes) other processes' slot locks:
    /// opened at its first use and kept. None where it cannot be opened.
    fn lock_tester(&self) -> Option<&OwnedFd> {
        if let Some(fd) = self.reap_fd.get() {
            return Some(fd);
        }
        let fd = reopen(&self.file, &self.path).ok()?;
        Some(self.reap_fd.get_or_init(|| fd))
    }

    fn reap_slots_each(&self, select: impl Fn(&Slot) -> bool, mut each: impl FnMut(u32, u32, u64)) -> u64 {
        if !self.writable {
            return 0;
        }
        let Some(fd) = self.lock_tester() else { return 0 };
        let hw = (self.map.header.slots_hw.load(Acquire) as usize).min(MAX_SLOTS);
        let mut freed: u64 = 0;
        for (i, slot) in self.map.slots[..hw].iter().enumerate() {
            if slot.state.load(Acquire) == 0
                && slot.used.iter().all(|u| u.load(Relaxed) == 0)
                && slot.exiting.load(Relaxed) == 0
            {
                continue;
            }
            if !select(slot) {
                continue;
            }
            let byte = SLOT_LOCK_BASE + i as i64;
            if matches!(lock(fd.as_raw_fd(), byte, libc::F_OFD_SETLK, libc::F_WRLCK), Ok(true)) {
                let mut mine: u64 = 0;
                for u in &slot.used {
                    mine = mine.saturating_add(u.swap(0, SeqCst));
                }
                each(slot.pid.load(Relaxed), slot.host_pid.load(Relaxed), mine);
                freed = freed.saturating_add(mine);
                self.clear_exiting(slot);
                slot.state.store(0, Release);
                let _ = lock(fd.as_raw_fd(), byte, libc::F_OFD_SETLK, libc::F_UNLCK);
            }
        }
        freed
    }

    /// Adds `delta` bytes (negative: takes them back) to the usage of slot `slot` on device `dev`,
    /// if the slot still belongs to the live process `pid`: how the agent charges a process for
    /// device memory the driver holds for it beyond what the process charged itself. False, with
    /// nothing changed, when the slot is free or another process's (checked before and after).
    pub fn adjust_for(&self, slot: usize, pid: u32, dev: usize, delta: i64) -> bool {
        if !self.writable || slot >= MAX_SLOTS || dev >= MAX_DEVICES {
            return false;
        }
        let s = &self.map.slots[slot];
        let mine = || s.state.load(Acquire) == 1 && s.pid.load(Acquire) == pid;
        let apply = |d: i64| {
            if d >= 0 {
                s.used[dev].fetch_add(d as u64, SeqCst);
            } else {
                s.used[dev].fetch_sub(d.unsigned_abs(), SeqCst);
            }
        };
        if !mine() {
            return false;
        }
        apply(delta);
        if !mine() {
            apply(-delta);
            return false;
        }
        true
    }

    /// What slot `slot` holds on `dev` (0 for indices out of range).
    pub fn slot_used(&self, slot: usize, dev: usize) -> u64 {
        if slot >= MAX_SLOTS || dev >= MAX_DEVICES {
            return 0;
        }
        self.map.slots[slot].used[dev].load(SeqCst)
    }

    /// Records the host PID of the live process `pid` in its slot `slot`, learned after its claim
    /// (a process in a PID namespace). False, with nothing changed, if the slot is not `pid`'s.
    pub fn set_host_pid(&self, slot: usize, pid: u32, host_pid: u32) -> bool {
        if !self.writable || slot >= MAX_SLOTS {
            return false;
        }
        let s = &self.map.slots[slot];
        if s.state.load(Acquire) != 1 || s.pid.load(Acquire) != pid {
            return false;
        }
        s.host_pid.store(host_pid, Release);
        true
    }

    /// Live slots: (index, pid, host pid, per-device usage).
    pub fn slots(&self) -> Vec<(usize, u32, u32, Vec<u64>)> {
        let n = self.ndevices().max(1);
        let mut v = Vec::new();
        self.for_each_slot(|i, pid, host, used| v.push((i, pid, host, used[..n].to_vec())));
        v
    }

    /// The live slots without allocating: `f(index, pid, host_pid, bytes per device)` for each (all
    /// [`MAX_DEVICES`] entries; those past [`ndevices`](Self::ndevices) are 0). For the agent's pass.
    pub fn for_each_slot(&self, mut f: impl FnMut(usize, u32, u32, &[u64; MAX_DEVICES])) {
        let hw = (self.map.header.slots_hw.load(Acquire) as usize).min(MAX_SLOTS);
        let n = self.ndevices().clamp(1, MAX_DEVICES);
        for (i, s) in self.map.slots[..hw].iter().enumerate() {
            if s.state.load(Acquire) != 1 {
                continue;
            }
            let mut used = [0u64; MAX_DEVICES];
            for (u, a) in used[..n].iter_mut().zip(&s.used) {
                *u = a.load(Relaxed);
            }
            f(i, s.pid.load(Relaxed), s.host_pid.load(Relaxed), &used);
        }
    }
}

/// SM-time budget: a token bucket per container and device in the region, in ns of GPU time,
/// refilled by wall time at `pct` percent (times the agent's correction), capped at `burst_ns`, and
/// allowed to go into debt so that one long kernel is paid for by the launches after it.
impl Region {
    /// Charges `cost_ns` if the budget is positive, without looking at the clock. The budget is only
    /// ever refilled when it runs out ([`sm_admit`](Self::sm_admit)): refilling later loses nothing,
    /// since what a refill adds depends only on the time since the last one.
    #[inline]
    pub fn sm_try_charge(&self, dev: usize, cost_ns: u64) -> bool {
        let d = &self.map.devices[dev];
        if d.sm_tokens.load(Acquire) > 0 {
            d.sm_tokens.fetch_sub(cost_ns as i64, AcqRel);
            return true;
        }
        false
    }

    /// Refills the budget up to `now_ns` and, if it is positive, charges `cost_ns`. When the budget is
    /// in debt, returns how long to wait (ns) before trying again.
    pub fn sm_admit(&self, dev: usize, pct: u32, now_ns: u64, cost_ns: u64) -> std::result::Result<(), u64> {
        let d = &self.map.devices[dev];
        let ppm = match d.sm_rate_ppm.load(Relaxed) {
            0 => 1_000_000,
            x => x.min(10_000_000),
        };
        // GPU ns earned per wall ns, in parts per 10^8.
        let rate = (pct.clamp(1, 100) as u64 * ppm) as i64;
        let last = d.sm_refilled_to.load(Acquire);
        if now_ns > last && d.sm_refilled_to.compare_exchange(last, now_ns, AcqRel, Relaxed).is_ok() {
            let burst = SM_BURST_WALL_NS as i64 * rate / 100_000_000;
            let earned = if last == 0 { burst } else { ((now_ns - last) as i128 * rate as i128 / 100_000_000) as i64 };
            let t = d.sm_tokens.fetch_add(earned, AcqRel).saturating_add(earned);
            let mut kept = earned;
            if t > burst {
                let before = d.sm_tokens.fetch_min(burst, AcqRel);
                kept -= (before - burst).clamp(0, earned);
            }
            d.sm_earned_ns.fetch_add(kept.max(0) as u64, Relaxed);
        }
        let t = d.sm_tokens.load(Acquire);
        if t <= 0 {
            let wait = (-(t as i128) * 100_000_000 / rate.max(1) as i128).min(u64::MAX as i128) as u64;
            return Err(wait.max(100_000));
        }
        d.sm_tokens.fetch_sub(cost_ns as i64, AcqRel);
        Ok(())
    }

    /// Corrects the budget once a launch's GPU time is known (`delta` = charged - measured), and
    /// accounts the measured time.
    #[inline]
    pub fn sm_correct(&self, dev: usize, delta_ns: i64, measured_ns: u64) {
        let d = &self.map.devices[dev];
        d.sm_tokens.fetch_add(delta_ns, AcqRel);
        d.sm_charged_ns.fetch_add(measured_ns, Relaxed);
    }

    /// GPU ns the container's launches on `dev` have been charged in all, net of corrections, as
    /// far as the budget tells (refills kept less the budget left); the difference of two readings
    /// is what was charged between them.
    pub fn sm_accounted_ns(&self, dev: usize) -> i64 {
        let d = &self.map.devices[dev];
        let earned = d.sm_earned_ns.load(Acquire);
        (earned as i64).wrapping_sub(d.sm_tokens.load(Acquire))
    }

    /// Records a throttled launch that waited `ns`.
    /// Counts a launch that could not be timed with events (see `Device::sm_unmeasured`).
    pub fn note_unmeasured(&self, dev: usize) {
        if self.writable && dev < MAX_DEVICES {
            self.map.devices[dev].sm_unmeasured.fetch_add(1, Relaxed);
        }
    }

    pub fn sm_unmeasured(&self, dev: usize) -> u32 {
        self.map.devices.get(dev).map_or(0, |d| d.sm_unmeasured.load(Relaxed))
    }

    pub fn sm_note_wait(&self, dev: usize, ns: u64) {
        let d = &self.map.devices[dev];
        d.sm_throttled_ns.fetch_add(ns, Relaxed);
        d.sm_throttled_launches.fetch_add(1, Relaxed);
    }

    /// Bit 0 of the SM flags: the agent says another container uses this GPU.
    #[inline]
    pub fn sm_shared(&self, dev: usize) -> Option<bool> {
        let f = self.map.devices[dev].sm_flags.load(Relaxed);
        (f & 2 != 0).then_some(f & 1 != 0)
    }
}

/// The budget can bank at most this much wall time worth of GPU time (the bounded burst).
pub const SM_BURST_WALL_NS: u64 = 20_000_000;

/// Header flag: a process created the region from its environment (standalone), not the agent.
pub const FLAG_STANDALONE: u32 = 1;
/// Header flag: allocations the GPU has no physical room for may be served as unified memory.
pub const FLAG_OVERSUBSCRIBE: u32 = 2;
/// Header flag: the slice is a high-priority tenant of its GPUs.
pub const FLAG_PRIORITY_HIGH: u32 = 4;
/// Header flag: the slice's GPUs run MPS: its SM share is its MPS partition (the active thread
/// percentage its processes are held to), not a share of time.
pub const FLAG_MPS: u32 = 8;

/// Outcome of a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserve {
    Ok,
    /// The container's usage plus the request would exceed the limit.
    OverLimit,
}

/// A process's claimed slot.
pub struct Claim {
    pub index: usize,
    fd: OwnedFd,
}

impl Claim {
    /// After `fork`, the child shares its parent's lock; it drops that description and claims a
    /// slot of its own.
    pub fn reclaim_after_fork(self, region: &Region, pid: u32, host_pid: u32) -> Result<Claim> {
        // Closing our copy of the shared description does not release the parent's lock.
        drop(self.fd);
        region.claim(pid, host_pid)
    }
}

impl Region {
    /// Reserves `bytes` on `dev` for `slot`, unless the container would exceed `limit` (0: none).
    /// Lock-free; no interleaving of processes admits more than the limit.
    #[inline]
    pub fn reserve(&self, slot: usize, dev: usize, bytes: u64, limit: u64) -> Reserve {
        match self.reserve_seen(slot, dev, bytes, limit) {
            Some(_) => Reserve::Ok,
            None => Reserve::OverLimit,
        }
    }

    /// [`reserve`](Self::reserve), telling the container's usage on `dev` it saw with the
    /// reservation made (0 with no limit, where it does not look); None: over the limit.
    #[inline]
    pub fn reserve_seen(&self, slot: usize, dev: usize, bytes: u64, limit: u64) -> Option<u64> {
        let mine = &self.map.slots[slot].used[dev];
        if limit == 0 {
            mine.fetch_add(bytes, SeqCst);
            return Some(0);
        }
        for _ in 0..8 {
            mine.fetch_add(bytes, SeqCst);
            let total = self.used(dev);
            if total <= limit {
                let peak = &self.map.devices[dev].peak_used;
                if total > peak.load(Relaxed) {
                    peak.fetch_max(total, Relaxed);
                }
                return Some(total);
            }
            mine.fetch_sub(bytes, SeqCst);
            // No room even leaving concurrent reservations aside: refuse now. Otherwise another
            // process's transient reservation made us fail; try again.
            if self.used(dev).saturating_add(bytes) > limit {
                break;
            }
            std::hint::spin_loop();
        }
        self.map.devices[dev].oom_rejections.fetch_add(1, Relaxed);
        None
    }

    /// Gives back what [`reserve`](Self::reserve) took.
    #[inline]
    pub fn release(&self, slot: usize, dev: usize, bytes: u64) {
        self.map.slots[slot].used[dev].fetch_sub(bytes, SeqCst);
    }

    /// Records an allocation of `bytes` served as unified memory because the GPU had no room.
    pub fn note_spill(&self, dev: usize, bytes: u64) {
        let d = &self.map.devices[dev];
        d.spilled_allocs.fetch_add(1, Relaxed);
        d.spilled_bytes.fetch_add(bytes, Relaxed);
    }

    /// (allocations, bytes) served as unified memory on `dev`, ever.
    pub fn spilled(&self, dev: usize) -> (u64, u64) {
        let d = &self.map.devices[dev];
        (d.spilled_allocs.load(Relaxed), d.spilled_bytes.load(Relaxed))
    }

    /// A call is about to reserve `bytes` on `dev` and then ask the driver for them: counted in
    /// flight until [`end_in_flight`](Self::end_in_flight) (before the reservation, so that a reader
    /// who sees the reservation sees this too).
    #[inline]
    pub fn begin_in_flight(&self, dev: usize, bytes: u64) {
        self.map.devices[dev].in_flight.fetch_add(bytes, SeqCst);
    }

    /// The driver answered the call of [`begin_in_flight`](Self::begin_in_flight) (after its
    /// reservation was kept or given back).
    #[inline]
    pub fn end_in_flight(&self, dev: usize, bytes: u64) {
        self.map.devices[dev].in_flight.fetch_sub(bytes, SeqCst);
    }

    /// Bytes the container's processes have reserved on `dev` for calls the driver has not
    /// answered yet (0 if the count is below zero: see [`clear_in_flight`](Self::clear_in_flight)).
    pub fn in_flight(&self, dev: usize) -> u64 {
        let v = self.map.devices[dev].in_flight.load(SeqCst) as i64;
        v.max(0) as u64
    }

    /// Publishes the container's GPU utilisation on `dev` (percent of the GPU's time its kernels
    /// ran; None: not known), for [`utilization`](Self::utilization) to read until `valid_ms` from
    /// now.
    pub fn set_utilization(&self, dev: usize, pct: Option<u32>, valid_ms: u64) {
        let v = pct.map_or(0, |p| ((monotonic_ms() + valid_ms) << 8) | (p.min(100) as u64 + 1));
        self.map.devices[dev].utilization.store(v, Release);
    }

    /// The container's GPU utilisation on `dev` as last published, if it has not gone stale.
    pub fn utilization(&self, dev: usize) -> Option<u32> {
        let v = self.map.devices[dev].utilization.load(Acquire);
        let pct = (v & 0xff) as u32;
        (pct != 0 && monotonic_ms() <= v >> 8).then(|| (pct - 1).min(100))
    }

    /// Takes back what is counted in flight, if no slot is claimed: a process killed during a call
    /// left it. A process claims its slot before it counts anything, so what was read before the
    /// slots were found empty is all left by the dead; what a process counts since stays.
    pub fn clear_in_flight(&self) {
        let left: [u64; MAX_DEVICES] = std::array::from_fn(|dev| self.map.devices[dev].in_flight.load(SeqCst));
        let hw = (self.map.header.slots_hw.load(SeqCst) as usize).min(MAX_SLOTS);
        if self.map.slots[..hw].iter().any(|s| s.state.load(SeqCst) != 0) {
            return;
        }
        for (d, v) in self.map.devices.iter().zip(left) {
            if v != 0 {
                d.in_flight.fetch_sub(v, SeqCst);
            }
        }
    }
}

/// CLOCK_MONOTONIC in ns: one clock for every process of the host (containers included), the one
/// the region's and the activity files' times are in.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: an out-pointer to a local; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// [`monotonic_ns`] in ms.
fn monotonic_ms() -> u64 {
    monotonic_ns() / 1_000_000
}

fn reopen(file: &File, path: &Path) -> Result<OwnedFd> {
    // /proc/self/fd gives a new open file description of the same file, even if the path moved.
    let p = format!("/proc/self/fd/{}", file.as_raw_fd());
    let c = std::ffi::CString::new(p).unwrap();
    // SAFETY: valid C string; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    let fd = if fd < 0 {
        // read-only regions (or no /proc): fall back to the path, read-only is enough for locks
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: as above.
        unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
    } else {
        fd
    };
    if fd < 0 {
        return Err(RegionError::Io { path: path.to_owned(), action: "reopen", source: io::Error::last_os_error() });
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check_len(file: &File, path: &Path) -> Result<()> {
    let len =
        file.metadata().map_err(|source| RegionError::Io { path: path.to_owned(), action: "stat", source })?.len();
    if len != TOTAL_SIZE as u64 {
        return Err(other_size(file, path, len));
    }
    Ok(())
}

/// Whether the region file (`len` bytes) has its magic still zero, as far as the file goes: its
/// creator did not finish the header. Any other magic, a damaged one included, is left for
/// `validate` to judge.
fn unfinished(file: &File, len: u64) -> bool {
    use std::os::unix::fs::FileExt;
    const _: () = assert!(std::mem::offset_of!(Header, magic) == 0);
    let mut magic = [0u8; 8];
    let n = (len as usize).min(magic.len());
    file.read_exact_at(&mut magic[..n], 0).is_ok() && magic == [0; 8]
}

/// Why a file of another size than this build's regions is not one: another build's region (its
/// header says so: another ABI version or layout) or a truncated or damaged one.
fn other_size(file: &File, path: &Path, len: u64) -> RegionError {
    use std::mem::offset_of;
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; offset_of!(Header, layout_hash) + 8];
    let word = |h: &[u8], at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
    if file.read_exact_at(&mut h, 0).is_ok() && word(&h, offset_of!(Header, magic)) == MAGIC {
        let at = offset_of!(Header, abi_version);
        let found = u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        if found != ABI_VERSION {
            return RegionError::Version { path: path.to_owned(), found };
        }
        if word(&h, offset_of!(Header, layout_hash)) != LAYOUT_HASH {
            return RegionError::Layout { path: path.to_owned() };
        }
    }
    RegionError::Truncated { path: path.to_owned(), len }
}

fn check_header(map: &Layout, path: &Path) -> Result<()> {
    let h = &map.header;
    if h.magic.load(Acquire) != MAGIC {
        return Err(RegionError::BadMagic { path: path.to_owned() });
    }
    let v = h.abi_version.load(Acquire);
    if v != ABI_VERSION {
        return Err(RegionError::Version { path: path.to_owned(), found: v });
    }
    if h.layout_hash.load(Acquire) != LAYOUT_HASH
        || h.total_size.load(Acquire) != TOTAL_SIZE as u64
        || h.header_size.load(Acquire) != std::mem::size_of::<Header>() as u32
    {
        return Err(RegionError::Layout { path: path.to_owned() });
    }
    Ok(())
}

type Mapped = (&'static Layout, Option<usize>);

fn validate(file: &File, path: &Path) -> Result<Mapped> {
    check_len(file, path)?;
    checked(map(file, path, true)?, path)
}

fn validate_ro(file: &File, path: &Path) -> Result<Mapped> {
    check_len(file, path)?;
    checked(map(file, path, false)?, path)
}

/// The mapping if its header is valid (and it did not shrink while checked); otherwise unmapped (a
/// caller retrying a damaged region, as the agent's monitor does every pass, must not leak a
/// mapping per try).
fn checked((map, guard): Mapped, path: &Path) -> Result<Mapped> {
    let r = check_header(map, path).and_then(|()| match guard {
        Some(g) if shrink::faulted(g) => Err(RegionError::Truncated { path: path.to_owned(), len: 0 }),
        _ => Ok(()),
    });
    match r {
        Ok(()) => Ok((map, guard)),
        Err(e) => {
            unmap(map, guard);
            Err(e)
        }
    }
}

/// Leaves the shrink guard, then unmaps.
fn unmap(map: &'static Layout, guard: Option<usize>) {
    if let Some(g) = guard {
        shrink::unregister(g);
    }
    // SAFETY: the mapping was made by `map` for one owner (a Region, or `checked` before it hands
    // it out), which calls this once and keeps no reference to it afterwards.
    unsafe { libc::munmap(map as *const Layout as *mut libc::c_void, TOTAL_SIZE) };
}

fn map(file: &File, path: &Path, writable: bool) -> Result<Mapped> {
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    // SAFETY: maps exactly TOTAL_SIZE bytes of a file whose length was checked (or just set) to
    // TOTAL_SIZE. The mapping lives as long as the Region that owns it (unmapped by its Drop; the
    // reference never escapes a borrow of it except through `layout_static`, whose caller keeps the
    // Region forever), so the reference stays valid while used; every field is
    // an atomic, for which any bit pattern is valid. A read-only mapping is only ever read through
    // the loads of the returned reference (the writers of this crate require a writable region).
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), TOTAL_SIZE, prot, libc::MAP_SHARED, file.as_raw_fd(), 0);
        if p == libc::MAP_FAILED {
            return Err(RegionError::Io { path: path.to_owned(), action: "map", source: io::Error::last_os_error() });
        }
        match shrink::register(p as usize) {
            Ok(guard) => Ok((&*(p as *const Layout), guard)),
            Err(()) => {
                libc::munmap(p, TOTAL_SIZE);
                Err(RegionError::TooMany { path: path.to_owned() })
            }
        }
    }
}

#[cfg(test)]
mod tests;

impl Drop for Region {
    fn drop(&mut self) {
        // `map` is the mapping made for this region alone (each open maps anew); no reference to it
        // outlives the region (`layout` borrows it, `layout_static` is for regions that are never
        // dropped). Without this, every open leaked a mapping: an agent that creates and deletes
        // slices grew by one mapping per slice (found by the soak benchmark).
        unmap(self.map, self.guard);
    }
}

/// Entry points of the fuzz targets (`fuzz/`), also run over the stored corpora by the unit tests.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;
    use std::os::unix::fs::FileExt;
    use std::sync::OnceLock;

    /// One region for the whole run (one mapping per run, not per input), and its bytes as created.
    fn region() -> &'static (Region, Vec<u8>) {
        static R: OnceLock<(Region, Vec<u8>)> = OnceLock::new();
        R.get_or_init(|| {
            let p = std::env::temp_dir().join(format!("vgpu-region-fuzz-{}", std::process::id()));
            let _ = std::fs::remove_file(&p);
            let r = Region::open_or_create(&p, || Init {
                devices: vec![("GPU-fuzz".into(), 1 << 30, 50)],
                standalone: true,
            })
            .expect("a fuzzing region");
            let _ = std::fs::remove_file(&p); // the open file and mapping stay
            let mut pristine = vec![0u8; TOTAL_SIZE];
            r.file.read_exact_at(&mut pristine, 0).expect("read back");
            (r, pristine)
        })
    }

    /// Writes `data` over a fresh region (the first 8 bytes pick the offset, so the body is reached
    /// as well as the header), then validates it and, when it passes, runs every reader and the
    /// reservation path over it. Nothing may panic or hang whatever the bytes are.
    pub fn region_bytes(data: &[u8]) {
        let (r, pristine) = region();
        r.file.write_all_at(pristine, 0).expect("reset");
        let (off, body) = match data.split_first_chunk::<8>() {
            Some((o, b)) => ((u64::from_le_bytes(*o) % TOTAL_SIZE as u64) as usize, b),
            None => (0, data),
        };
        let body = &body[..body.len().min(TOTAL_SIZE - off)];
        r.file.write_all_at(body, off as u64).expect("write");
        if check_header(r.map, r.path()).is_err() {
            return;
        }
        let n = r.ndevices();
        for i in 0..MAX_DEVICES {
            let u = r.device_uuid(i);
            let _ = r.find_device(&u);
            let _ = (r.used(i), r.mem_limit(i), r.sm_limit(i), r.sm_shared(i), r.in_flight(i));
        }
        let _ = r.slots();
        if n > 0 {
            if let Ok(c) = r.claim(std::process::id(), 0) {
                r.begin_in_flight(0, 1 << 20);
                let _ = r.reserve(c.index, 0, 1 << 20, r.mem_limit(0));
                r.release(c.index, 0, 1 << 20);
                r.end_in_flight(0, 1 << 20);
                let _ = r.sm_try_charge(0, 1000);
                let _ = r.sm_admit(0, r.sm_limit(0), 1, 1000);
            }
        }
        let _ = r.reap();
        r.clear_in_flight();
    }

    #[cfg(test)]
    mod tests {
        /// Every stored fuzzing input (and the cases that once failed) still runs cleanly.
        #[test]
        fn the_fuzz_corpus_runs_cleanly() {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/region");
            let mut n = 0;
            for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                super::region_bytes(&std::fs::read(e.unwrap().path()).unwrap());
                n += 1;
            }
            assert!(n > 0, "no corpus in {}", dir.display());
        }
    }
}

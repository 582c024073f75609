//! The state of one simulated node, shared by every process that uses it.
//!
//! A fixed-size `#[repr(C)]` file (`node.state`) in the state directory, mapped `MAP_SHARED` by every
//! process. Counters that the hot paths touch are atomics (memory is charged without a lock, see
//! [`Node::try_charge`]); everything else changes only under the node lock: a process mutex plus `flock` on `node.lock`, which the kernel drops when its holder
//! dies, so a SIGKILLed process never wedges the node.
//!
//! Process liveness works like the real driver's free-at-exit: every process that opens the driver
//! holds an exclusive `flock` on `proc-<slot>.lock` for its whole life. The kernel releases it when
//! the process exits, however it exits, and before the process becomes a zombie; a slot whose lock can
//! be taken belongs to a dead process, and its memory is released. PID reuse cannot fool this.
//!
//! A driver names processes by their PIDs in the initial PID namespace. A process whose `/proc`
//! does not show its host PID (a container's own) records the PID it sees; it also holds a POSIX
//! record lock on its lock file, which `F_GETLK` reports with the holder's PID in the asker's
//! namespace, so the first process of the initial namespace that looks at the slots (any NVML
//! query, or a reap) records the host PID instead.

use crate::config::{Config, MAX_GPUS};
use crate::timeline::{Completion, Piece, Timeline, Who};
use std::cell::UnsafeCell;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering::*};

use std::sync::{Mutex, MutexGuard, OnceLock};

pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUSIM1");
pub const VERSION: u32 = 5;
pub const MAX_PROCS: usize = 512;
/// Kernel records kept per GPU (utilisation history).
pub const RING: usize = 1 << 15;
pub const MAX_FAULTS: usize = 32;
pub const MAX_XIDS: usize = 16;
pub const MAX_GI: usize = 8;
pub const MAX_CI: usize = 8;

#[repr(C)]
pub struct FaultRec {
    /// Function name, NUL padded, packed little-endian into words.
    pub name: [AtomicU64; 8],
    /// GPU index the fault applies to, or -1 for all.
    pub gpu: AtomicI32,
    /// Error code returned (0: only the latency is added).
    pub code: AtomicI32,
    /// Remaining hits; -1 forever; 0 the record is free.
    pub remaining: AtomicI64,
    pub latency_us: AtomicU64,
}

#[repr(C)]
pub struct XidRec {
    pub seq: AtomicU64,
    pub xid: AtomicU64,
    /// 0: the whole GPU; else (GPU instance + 1) | (compute instance + 1) << 32.
    pub scope: AtomicU64,
}

/// An XID event: its code and, on a GPU in MIG mode, the GPU and compute instance it is about
/// (`None`: the whole GPU, which NVML reports as instance IDs 0xFFFFFFFF).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Xid {
    pub code: u64,
    pub instance: Option<(u32, u32)>,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct CiRec {
    pub live: u32,
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GiRec {
    pub live: u32,
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    /// Which creation on this GPU made it (never reused, as a real MIG device's UUID is not: an
    /// instance made again gets a new UUID).
    pub serial: u32,
    pub cis: [CiRec; MAX_CI],
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct MigState {
    pub current: u32,
    pub pending: u32,
    pub gis: [GiRec; MAX_GI],
    /// The last `GiRec::serial` given.
    pub serials: u32,
}

#[repr(C)]
pub struct GpuShared {
    pub ring_head: AtomicU64,
    /// The kernel the newest record is of (a kernel's pieces run back to back are one record).
    last_recorded: AtomicU64,
    pub xid_head: AtomicU64,
    /// Non-zero: the GPU has fallen off the bus (NVML answers GPU_IS_LOST).
    pub lost: AtomicU32,
    pub _pad: u32,
    pub xids: [XidRec; MAX_XIDS],
    /// Changed only under the node lock; see [`Node::mig`].
    mig: UnsafeCell<MigState>,
}

#[repr(C)]
pub struct ProcSlot {
    /// 0 free, 1 live.
    pub state: AtomicU32,
    pub pid: AtomicU32,
    /// Contexts the process holds per GPU (it is a "running process" of a GPU while > 0).
    pub ctx: [AtomicU32; MAX_GPUS],
    /// Device memory the process holds per GPU, context overhead included.
    pub mem: [AtomicU64; MAX_GPUS],
    /// Per GPU, the MIG device the process's CUDA device is: its GPU instance id + 1 in the low 16
    /// bits, its compute instance id above; 0: the whole GPU. See [`ProcSlot::mig_at`].
    pub mig: [AtomicU32; MAX_GPUS],
    /// Its part in MPS: 0 none, [`MPS_SERVER`], else a client of the server in slot `mps - 1`.
    pub mps: AtomicU32,
    /// An MPS client's active thread percentage (its share of each GPU's SMs).
    pub mps_pct: AtomicU32,
    /// An MPS client's pinned device memory limit per GPU (0: none).
    pub mps_limit: [AtomicU64; MAX_GPUS],
}

/// [`ProcSlot::mps`] of an MPS server.
pub const MPS_SERVER: u32 = u32::MAX;

/// A process's part in MPS, from its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MpsRole {
    None,
    Server,
    /// A client of the server in this slot, with its active thread percentage.
    Client {
        server: usize,
        pct: u32,
    },
}

impl ProcSlot {
    /// Its part in MPS.
    pub fn mps_role(&self) -> MpsRole {
        match self.mps.load(Acquire) {
            0 => MpsRole::None,
            MPS_SERVER => MpsRole::Server,
            c => MpsRole::Client { server: c as usize - 1, pct: self.mps_pct.load(Acquire).clamp(1, 100) },
        }
    }

    /// The MIG device (GPU instance id, compute instance id) the process runs in on `gpu`, if any.
    pub fn mig_at(&self, gpu: usize) -> Option<(u32, u32)> {
        let v = self.mig[gpu].load(SeqCst);
        (v & 0xffff != 0).then(|| ((v & 0xffff) - 1, v >> 16))
    }
}

#[repr(C)]
pub struct KernelRec {
    /// 0 while being written, else ring index + 1.
    pub seq: AtomicU64,
    pub start: AtomicU64,
    pub end: AtomicU64,
    pub pid: AtomicU64,
}

#[repr(C)]
pub struct Shared {
    pub magic: AtomicU64,
    pub version: u32,
    pub ngpus: u32,
    pub fingerprint: u64,
    pub fault_count: AtomicU32,
    /// One past the highest slot index ever claimed.
    pub procs_hw: AtomicU32,
    pub faults: [FaultRec; MAX_FAULTS],
    pub gpus: [GpuShared; MAX_GPUS],
    pub procs: [ProcSlot; MAX_PROCS],
    pub rings: [[KernelRec; RING]; MAX_GPUS],
    /// Changed only under the GPU's timeline lock; see [`Node::timeline`].
    timelines: [UnsafeCell<Timeline>; MAX_GPUS],
    /// Per GPU, the lock of its timeline: a process-shared robust mutex (one whose holder died is
    /// handed to the next locker).
    timeline_locks: [UnsafeCell<libc::pthread_mutex_t>; MAX_GPUS],
}

// SAFETY: every field is an atomic except `GpuShared::mig`, which is only reached through
// `Node::mig`, which requires the node lock, `timelines`, only reached through `Node::timeline`,
// which holds the GPU's timeline lock, and those locks, process-shared pthread mutexes made for
// concurrent use.
unsafe impl Sync for Shared {}

pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until the monotonic clock reaches `deadline_ns`.
pub fn sleep_until(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    while now_ns() < deadline_ns {
        // SAFETY: ts is valid; an EINTR simply returns early and we loop.
        unsafe { libc::clock_nanosleep(libc::CLOCK_MONOTONIC, libc::TIMER_ABSTIME, &ts, std::ptr::null_mut()) };
    }
}

pub struct Node {
    pub cfg: Config,
    pub dir: PathBuf,
    shared: &'static Shared,
    lock_file: File,
    mutex: Mutex<()>,
    /// Process lock files this process has opened to check liveness, kept open (a monitor checks
    /// every process many times a second).
    liveness: Mutex<Vec<Option<File>>>,
}

/// Makes `m` a process-shared robust mutex.
fn init_robust_mutex(m: *mut libc::pthread_mutex_t) -> Result<(), String> {
    // SAFETY: `attr` is initialised before use and destroyed after; `m` points into the fresh
    // mapping, which nobody else sees yet.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        let ok = libc::pthread_mutexattr_init(&mut attr) == 0
            && libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED) == 0
            && libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST) == 0
            && libc::pthread_mutex_init(m, &attr) == 0;
        libc::pthread_mutexattr_destroy(&mut attr);
        if ok {
            Ok(())
        } else {
            Err("cannot make the timeline's process-shared mutex".into())
        }
    }
}

/// Proof that the node lock is held.
pub struct Locked<'a> {
    node: &'a Node,
    _m: MutexGuard<'a, ()>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: the fd is owned by the node and open for its whole life.
        unsafe { libc::flock(self.node.lock_file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// A POSIX record lock on byte 0 of `f`: `F_SETLK` takes it (None), `F_GETLK` reports the PID of
/// a process holding it, in this process's PID namespace (None: no one, or one this namespace does
/// not see).
fn posix_lock(f: &File, cmd: libc::c_int, ty: libc::c_int) -> std::io::Result<Option<u32>> {
    // SAFETY: flock is plain data.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ty as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_len = 1;
    // SAFETY: a valid descriptor and a pointer to a local flock.
    if unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cmd == libc::F_GETLK && fl.l_type != libc::F_UNLCK as _ && fl.l_pid > 0).then_some(fl.l_pid as u32))
}

/// Whether this process runs in the initial PID namespace (whose inode is the kernel's constant
/// 0xEFFFFFFC): the PIDs it sees are the ones a driver reports.
fn in_initial_pid_namespace() -> bool {
    static IN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IN.get_or_init(|| std::fs::read_link("/proc/self/ns/pid").is_ok_and(|l| l.as_os_str() == "pid:[4026531836]"))
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: f is an open file.
        if unsafe { libc::flock(f.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

static GLOBAL: OnceLock<Result<Node, String>> = OnceLock::new();

impl Node {
    /// The node of this process: `VGPU_SIM_CONFIG` and `VGPU_SIM_STATE`, opened once.
    pub fn global() -> Result<&'static Node, &'static str> {
        GLOBAL
            .get_or_init(|| Config::from_env().and_then(|c| Node::open(c, &crate::config::state_dir())))
            .as_ref()
            .map_err(|e| e.as_str())
    }

    /// Opens (creating if needed) the node in `dir`.
    pub fn open(cfg: Config, dir: &Path) -> Result<Node, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create state dir {}: {e}", dir.display()))?;
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_CLOEXEC)
            .open(dir.join("node.lock"))
            .map_err(|e| format!("cannot open {}/node.lock: {e}", dir.display()))?;
        flock(&lock_file, libc::LOCK_EX).map_err(|e| format!("cannot lock node: {e}"))?;
        let r = Self::open_locked(&cfg, dir);
        flock(&lock_file, libc::LOCK_UN).ok();
        let shared = r?;
        Ok(Node {
            cfg,
            dir: dir.to_owned(),
            shared,
            lock_file,
            mutex: Mutex::new(()),
            liveness: Mutex::new(Vec::new()),
        })
    }

    fn open_locked(cfg: &Config, dir: &Path) -> Result<&'static Shared, String> {
        let size = std::mem::size_of::<Shared>();
        let path = dir.join("node.state");
        if path.exists() {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            let len = f.metadata().map_err(|e| e.to_string())?.len();
            if len != size as u64 {
                return Err(format!(
                    "{} has size {len}, expected {size}: written by another simulator version; remove the state dir",
                    path.display()
                ));
            }
            let s = map(&f, size)?;
            if s.magic.load(Acquire) != MAGIC || s.version != VERSION {
                return Err(format!("{} is not a simulator state file of version {VERSION}", path.display()));
            }
            if s.fingerprint != cfg.fingerprint() || s.ngpus as usize != cfg.gpus.len() {
                return Err(format!(
                    "the simulated node in {} was created from a different node description; \
                     use another VGPU_SIM_STATE or wipe it (vgpu-sim wipe)",
                    dir.display()
                ));
            }
            return Ok(s);
        }
        let tmp = dir.join(format!("node.state.tmp.{}", std::process::id()));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
        f.set_len(size as u64).map_err(|e| format!("cannot size {}: {e}", tmp.display()))?;
        let s = map(&f, size)?;
        // The file is still private to us: plain initialisation is race-free.
        let p = s as *const Shared as *mut Shared;
        // SAFETY: p points to our fresh zeroed mapping which nobody else can see yet.
        unsafe {
            (*p).version = VERSION;
            (*p).ngpus = cfg.gpus.len() as u32;
            (*p).fingerprint = cfg.fingerprint();
        }
        for g in 0..MAX_GPUS {
            init_robust_mutex(s.timeline_locks[g].get())?;
            // SAFETY: as above: nobody else sees the mapping yet.
            unsafe { (*s.timelines[g].get()).init() };
        }
        s.magic.store(MAGIC, Release);
        std::fs::rename(&tmp, &path).map_err(|e| format!("cannot install {}: {e}", path.display()))?;
        Ok(s)
    }

    pub fn shared(&self) -> &'static Shared {
        self.shared
    }

    pub fn gpu(&self, i: usize) -> &'static GpuShared {
        &self.shared.gpus[i]
    }

    pub fn lock(&self) -> Locked<'_> {
        let m = self.mutex.lock().unwrap_or_else(|p| p.into_inner());
        // Cannot fail on a valid fd except by EINTR, which `flock` retries.
        flock(&self.lock_file, libc::LOCK_EX).expect("flock node.lock");
        Locked { node: self, _m: m }
    }

    /// The MIG state of GPU `i`; the guard proves exclusive access across processes.
    #[allow(clippy::mut_from_ref)]
    pub fn mig<'a>(&self, _g: &'a mut Locked<'_>, i: usize) -> &'a mut MigState {
        // SAFETY: the node lock serialises every access to `mig` across threads and processes, and
        // the `&mut Locked` borrow keeps this reference from outliving it or being duplicated.
        unsafe { &mut *self.shared.gpus[i].mig.get() }
    }

    // ----- processes -----

    fn proc_lock_path(&self, slot: usize) -> PathBuf {
        self.dir.join(format!("proc-{slot}.lock"))
    }

    /// Claims a process slot for this process; the returned file must stay open for its life.
    pub fn register_process(&self) -> Result<(usize, File), String> {
        let mut g = self.lock();
        self.reap_locked(&mut g);
        let s = self.shared;
        for (i, slot) in s.procs.iter().enumerate() {
            if slot.state.load(Acquire) != 0 {
                continue;
            }
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(libc::O_CLOEXEC)
                .open(self.proc_lock_path(i))
                .map_err(|e| format!("cannot open process lock: {e}"))?;
            if flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err() {
                continue; // a forked child of a dead process still holds it
            }
            // For the host PID's sake (see the module documentation); the file stays open for the
            // process's life, so the lock does too.
            let _ = posix_lock(&f, libc::F_SETLK, libc::F_WRLCK);
            for d in 0..MAX_GPUS {
                slot.ctx[d].store(0, Relaxed);
                slot.mem[d].store(0, Relaxed);
                slot.mig[d].store(0, Relaxed);
                slot.mps_limit[d].store(0, Relaxed);
            }
            slot.mps.store(0, Relaxed);
            slot.mps_pct.store(100, Relaxed);
            slot.pid.store(crate::host_pid(), Relaxed);
            slot.state.store(1, Release);
            s.procs_hw.fetch_max(i as u32 + 1, AcqRel);
            return Ok((i, f));
        }
        Err(format!("all {MAX_PROCS} simulated process slots are in use"))
    }

    /// Releases the slots of dead processes. Returns the bytes released.
    ///
    /// Liveness is tested before the node's lock is taken, and the lock (and the sweep under it
    /// that releases) taken only where a process looks gone: a test per live process under it
    /// made a hundred processes starting at once wait for each other's first NVML query, which no
    /// driver makes them do.
    pub fn reap(&self) -> u64 {
        if !self.any_gone() {
            return 0;
        }
        let mut g = self.lock();
        self.reap_locked(&mut g)
    }

    /// Whether any slot's process looks gone (its lock taken, then let go again at once).
    fn any_gone(&self) -> bool {
        let mut files = self.liveness.lock().unwrap_or_else(|p| p.into_inner());
        (0..self.shared.procs_hw.load(Acquire) as usize).any(|i| {
            let gone = self.looks_gone(i, &mut files);
            if let Some(f) = files.get(i).filter(|_| gone).and_then(Option::as_ref) {
                let _ = flock(f, libc::LOCK_UN);
            }
            gone
        })
    }

    /// [`reap`](Self::reap), at most every 50 ms per process.
    pub fn maybe_reap(&self) {
        static LAST: AtomicU64 = AtomicU64::new(0);
        Self::at_most_every(&LAST, 50_000_000, || {
            self.reap();
        });
    }

    /// [`reap`](Self::reap) for NVML queries: at most every 10 ms per process, so that a monitor
    /// asking about many GPUs in one pass checks process liveness once (a dead process's memory is
    /// still released within 10 ms of the next query, as a driver frees it asynchronously).
    pub fn reap_for_query(&self) {
        static LAST: AtomicU64 = AtomicU64::new(0);
        Self::at_most_every(&LAST, 10_000_000, || {
            self.reap();
        });
    }

    fn at_most_every(last: &AtomicU64, ns: u64, f: impl FnOnce()) {
        let now = now_ns();
        let l = last.load(Relaxed);
        if (l == 0 || now.saturating_sub(l) > ns) && last.compare_exchange(l, now, Relaxed, Relaxed).is_ok() {
            f();
        }
    }

    fn reap_locked(&self, _g: &mut Locked<'_>) -> u64 {
        let mut files = self.liveness.lock().unwrap_or_else(|p| p.into_inner());
        let mut freed = 0;
        for i in 0..self.shared.procs_hw.load(Acquire) as usize {
            if self.looks_gone(i, &mut files) {
                freed += self.release(i, &files);
            }
        }
        freed
    }

    /// Whether slot `i` is held by a process that is gone: its lock file's lock could be taken
    /// (and is held then, for [`release`](Self::release)). Refreshes the slot's PID as this
    /// namespace sees the holder.
    fn looks_gone(&self, i: usize, files: &mut Vec<Option<File>>) -> bool {
        let slot = &self.shared.procs[i];
        if slot.state.load(Acquire) != 1 {
            return false;
        }
        if files.len() <= i {
            files.resize_with(i + 1, || None);
        }
        if files[i].is_none() {
            files[i] = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(self.proc_lock_path(i)).ok();
        }
        let Some(f) = &files[i] else { return false };
        if in_initial_pid_namespace() {
            // The holder's PID as this namespace (the host's) sees it.
            if let Ok(Some(pid)) = posix_lock(f, libc::F_GETLK, libc::F_WRLCK) {
                if pid != slot.pid.load(Relaxed) {
                    slot.pid.store(pid, Relaxed);
                }
            }
        }
        flock(f, libc::LOCK_EX | libc::LOCK_NB).is_ok()
    }

    /// Releases slot `i`, whose process is gone (its lock file's lock held since
    /// [`looks_gone`](Self::looks_gone)); under the node's lock. The bytes it held.
    fn release(&self, i: usize, files: &[Option<File>]) -> u64 {
        let slot = &self.shared.procs[i];
        let mut freed = 0;
        for d in 0..MAX_GPUS {
            freed += slot.mem[d].swap(0, AcqRel);
            slot.ctx[d].store(0, Relaxed);
        }
        // Its queued work goes with its contexts.
        for g in 0..self.cfg.gpus.len() {
            self.timeline(g, |t, now, _| t.drop_channel(i as u32, now));
        }
        slot.state.store(0, Release);
        // The lock goes; the file stays open for next time.
        if let Some(f) = &files[i] {
            let _ = flock(f, libc::LOCK_UN);
        }
        freed
    }

    /// The PID the driver names the process of `slot` by (its host PID, once known).
    pub fn slot_pid(&self, slot: usize) -> u32 {
        self.shared.procs[slot].pid.load(Relaxed)
    }

    /// Live process slots (after the last reap).
    pub fn live_slots(&self) -> impl Iterator<Item = &'static ProcSlot> {
        let hw = self.shared.procs_hw.load(Acquire) as usize;
        self.shared.procs[..hw].iter().filter(|p| p.state.load(Acquire) == 1)
    }

    /// Device memory in use on GPU `gpu` by all live processes.
    pub fn mem_used(&self, gpu: usize) -> u64 {
        self.live_slots().map(|p| p.mem[gpu].load(SeqCst)).sum()
    }

    /// Charges `bytes` on `gpu` to `slot` unless that would exceed the GPU's memory.
    ///
    /// Lock-free and exact: add to the own slot, then sum every slot, and take the addition back if
    /// the sum is over. Of two concurrent charges at least one sees the other (sequentially consistent
    /// add-then-load), so the GPU is never over-committed; a process killed at any point leaves its
    /// slot holding exactly what it charged. Dead processes are reaped before giving up.
    /// An MPS client's charges stay within its pinned device memory limit, as the server refuses
    /// what would pass it.
    pub fn try_charge(&self, slot: usize, gpu: usize, bytes: u64) -> bool {
        let total = self.cfg.gpus[gpu].memory_bytes;
        let mine = &self.shared.procs[slot].mem[gpu];
        let limit = self.shared.procs[slot].mps_limit[gpu].load(Acquire);
        if limit != 0 && mine.load(SeqCst).saturating_add(bytes) > limit {
            return false;
        }
        for attempt in 0..8 {
            mine.fetch_add(bytes, SeqCst);
            if self.mem_used(gpu) <= total {
                return true;
            }
            mine.fetch_sub(bytes, SeqCst);
            let room = |n: &Node| n.mem_used(gpu).saturating_add(bytes) <= total;
            if !room(self) && (attempt > 0 || self.reap() == 0 || !room(self)) {
                return false;
            }
        }
        false
    }

    /// Memory the processes running in GPU instance `gi` of `gpu` hold.
    pub fn mig_mem_used(&self, gpu: usize, gi: u32) -> u64 {
        self.live_slots().filter(|p| p.mig_at(gpu).is_some_and(|(g, _)| g == gi)).map(|p| p.mem[gpu].load(SeqCst)).sum()
    }

    /// [`try_charge`](Self::try_charge) for a process running in GPU instance `gi` of `gpu`: what
    /// the instance's processes hold stays within its `cap` bytes, as the GPU's within its memory.
    pub fn try_charge_mig(&self, slot: usize, gpu: usize, gi: u32, cap: u64, bytes: u64) -> bool {
        let mine = &self.shared.procs[slot].mem[gpu];
        mine.fetch_add(bytes, SeqCst);
        if self.mig_mem_used(gpu, gi) <= cap {
            mine.fetch_sub(bytes, SeqCst);
            return self.try_charge(slot, gpu, bytes);
        }
        mine.fetch_sub(bytes, SeqCst);
        false
    }

    /// Marks `slot` as running in the MIG device (GPU instance, compute instance) `at` of `gpu`
    /// (None: the whole GPU).
    pub fn set_mig(&self, slot: usize, gpu: usize, at: Option<(u32, u32)>) {
        self.shared.procs[slot].mig[gpu].store(at.map_or(0, |(gi, ci)| (gi + 1) | ci << 16), SeqCst);
    }

    pub fn uncharge(&self, slot: usize, gpu: usize, bytes: u64) {
        self.shared.procs[slot].mem[gpu].fetch_sub(bytes, AcqRel);
    }

    /// True while some live process other than `except` holds a context on `gpu`.
    pub fn gpu_in_use(&self, gpu: usize, except_pid: Option<u32>) -> bool {
        self.live_slots().any(|p| p.ctx[gpu].load(Acquire) > 0 && Some(p.pid.load(Relaxed)) != except_pid)
    }

    // ----- the kernel timeline -----

    /// `f` on `gpu`'s timeline, under its lock, with the model run up to now first (the pieces of
    /// GPU time run meanwhile go to the kernel records).
    fn timeline<T>(&self, gpu: usize, f: impl FnOnce(&mut Timeline, u64, &mut dyn FnMut(Piece)) -> T) -> T {
        let m = self.shared.timeline_locks[gpu].get();
        // SAFETY: a process-shared robust mutex initialised with the state file and never moved;
        // EOWNERDEAD hands over the lock of a holder that died (the timeline is then as it left it,
        // which the model tolerates: a step leaves it consistent but for the kernel it ran).
        unsafe {
            if libc::pthread_mutex_lock(m) == libc::EOWNERDEAD {
                libc::pthread_mutex_consistent(m);
            }
        }
        // SAFETY: the timeline is only reached here, under its GPU's lock, so no other thread of
        // any process touches it meanwhile; the mapping lives forever.
        let t = unsafe { &mut *self.shared.timelines[gpu].get() };
        let now = now_ns();
        let mut out = |p: Piece| self.record(gpu, p);
        t.advance(now, self.cfg.slicing, &mut out);
        let r = f(t, now, &mut out);
        // SAFETY: locked above by this thread.
        unsafe { libc::pthread_mutex_unlock(m) };
        r
    }

    /// Queues kernels of `durs_ns`, in order, of process slot `slot` (PID `pid`) on `gpu`; the id
    /// of the last on the GPU's timeline (0 for none). Waits while the GPU's queue is full.
    /// An MPS client's kernels run in its server's context, on its partition (see `timeline`).
    pub fn launch(&self, gpu: usize, slot: usize, pid: u32, durs_ns: &[u64]) -> u64 {
        let (mut queued, mut last) = (0, 0);
        let s = self.cfg.slicing;
        let who = match self.shared.procs[slot].mps_role() {
            MpsRole::Client { server, pct } => Who { chan: slot as u32, group: server as u32, pct, pid },
            _ => Who::alone(slot as u32, pid),
        };
        while queued < durs_ns.len() {
            self.timeline(gpu, |t, now, out| {
                for &d in &durs_ns[queued..] {
                    let Some(id) = t.enqueue(now, who, d, s, &mut *out) else { break };
                    (queued, last) = (queued + 1, id);
                }
            });
            if queued < durs_ns.len() {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        last
    }

    /// When kernel `id` of `gpu` ends (see [`Completion`]).
    pub fn completion(&self, gpu: usize, id: u64) -> Completion {
        if id == 0 {
            return Completion::Done(0);
        }
        let s = self.cfg.slicing;
        self.timeline(gpu, |t, _, _| t.completion(id, s))
    }

    /// Drops every kernel queued on `gpu` (a reboot of an idle node).
    pub fn clear_timeline(&self, gpu: usize) {
        self.timeline(gpu, |t, now, _| t.clear(now));
    }

    /// Waits until kernel `id` of `gpu` has ended; when it did.
    pub fn wait_for(&self, gpu: usize, id: u64) -> u64 {
        loop {
            match self.completion(gpu, id) {
                Completion::Done(t) => return t,
                Completion::Pending(t) => sleep_until(t),
            }
        }
    }

    /// A piece of GPU time run, as a kernel record (a kernel preempted by time-slicing leaves one
    /// per slice it ran in).
    fn record(&self, gpu: usize, p: Piece) {
        let g = &self.shared.gpus[gpu];
        let head = g.ring_head.load(Acquire);
        if head > 0 && g.last_recorded.load(Relaxed) == p.id {
            let last = &self.shared.rings[gpu][((head - 1) as usize) % RING];
            if last.end.load(Relaxed) == p.start {
                // The same kernel ran on: its record grows.
                last.seq.store(0, Relaxed);
                fence(Release);
                last.end.store(p.end, Relaxed);
                last.seq.store(head, Release);
                return;
            }
        }
        g.last_recorded.store(p.id, Relaxed);
        let idx = g.ring_head.fetch_add(1, AcqRel);
        let rec = &self.shared.rings[gpu][(idx as usize) % RING];
        rec.seq.store(0, Relaxed);
        fence(Release);
        rec.start.store(p.start, Relaxed);
        rec.end.store(p.end, Relaxed);
        rec.pid.store(p.pid as u64, Relaxed);
        rec.seq.store(idx + 1, Release);
    }

    /// Kernel records (start, end, pid) of `gpu`, newest first, back to those ending after `t0`
    /// (the walk stops after 256 consecutive older records: starts are nearly ordered).
    pub fn kernels_since(&self, gpu: usize, t0: u64) -> Vec<(u64, u64, u32)> {
        // What ran up to now is recorded first.
        self.timeline(gpu, |_, _, _| ());
        let g = &self.shared.gpus[gpu];
        let head = g.ring_head.load(Acquire);
        let lo = head.saturating_sub(RING as u64);
        let mut out = Vec::new();
        let mut old = 0;
        let mut idx = head;
        while idx > lo {
            idx -= 1;
            let rec = &self.shared.rings[gpu][(idx as usize) % RING];
            let s1 = rec.seq.load(Acquire);
            let (start, end, pid) = (rec.start.load(Relaxed), rec.end.load(Relaxed), rec.pid.load(Relaxed));
            fence(Acquire);
            if s1 != idx + 1 || rec.seq.load(Relaxed) != s1 {
                continue; // being overwritten
            }
            if end <= t0 {
                old += 1;
                if old > 256 {
                    break;
                }
                continue;
            }
            old = 0;
            out.push((start, end, pid as u32));
        }
        out
    }

    /// Busy time of `gpu` inside [t0, t1): the total and per PID.
    pub fn busy(&self, gpu: usize, t0: u64, t1: u64) -> (u64, Vec<(u32, u64)>) {
        let mut total = 0;
        let mut per: Vec<(u32, u64)> = Vec::new();
        for (start, end, pid) in self.kernels_since(gpu, t0) {
            let ov = end.min(t1).saturating_sub(start.max(t0));
            if ov == 0 {
                continue;
            }
            total += ov;
            match per.iter_mut().find(|(p, _)| *p == pid) {
                Some(e) => e.1 += ov,
                None => per.push((pid, ov)),
            }
        }
        (total, per)
    }

    // ----- XID events -----

    pub fn inject_xid(&self, gpu: usize, xid: u64) {
        self.inject(gpu, Xid { code: xid, instance: None });
    }

    /// An XID event about GPU instance `gi` and compute instance `ci` of a GPU in MIG mode.
    pub fn inject_instance_xid(&self, gpu: usize, xid: u64, gi: u32, ci: u32) {
        self.inject(gpu, Xid { code: xid, instance: Some((gi, ci)) });
    }

    fn inject(&self, gpu: usize, x: Xid) {
        let g = &self.shared.gpus[gpu];
        let idx = g.xid_head.fetch_add(1, AcqRel);
        let rec = &g.xids[(idx as usize) % MAX_XIDS];
        rec.seq.store(0, Relaxed);
        fence(Release);
        rec.xid.store(x.code, Relaxed);
        let scope = x.instance.map_or(0, |(gi, ci)| (gi as u64 + 1) | (ci as u64 + 1) << 32);
        rec.scope.store(scope, Relaxed);
        rec.seq.store(idx + 1, Release);
    }

    /// XID events of `gpu` with sequence numbers at or after `from`; returns (next, events).
    pub fn xids_since(&self, gpu: usize, from: u64) -> (u64, Vec<Xid>) {
        let g = &self.shared.gpus[gpu];
        let head = g.xid_head.load(Acquire);
        let mut out = Vec::new();
        for idx in from.max(head.saturating_sub(MAX_XIDS as u64))..head {
            let rec = &g.xids[(idx as usize) % MAX_XIDS];
            let s = rec.seq.load(Acquire);
            let code = rec.xid.load(Relaxed);
            let scope = rec.scope.load(Relaxed);
            fence(Acquire);
            // Taken only if no writer began on the record meanwhile.
            if s == idx + 1 && rec.seq.load(Relaxed) == s {
                let instance =
                    (scope != 0).then(|| ((scope as u32).wrapping_sub(1), ((scope >> 32) as u32).wrapping_sub(1)));
                out.push(Xid { code, instance });
            }
        }
        (head, out)
    }

    // ----- fault injection -----

    /// Sets a fault on function `name`; `count` -1 means forever.
    pub fn set_fault(&self, name: &str, gpu: i32, code: i32, count: i64, latency_us: u64) -> Result<(), String> {
        let packed = pack_name(name).ok_or("function name longer than 63 bytes")?;
        let _g = self.lock();
        let s = self.shared;
        let slot = s
            .faults
            .iter()
            .find(|f| f.remaining.load(Acquire) != 0 && unpack_eq(f, &packed) && f.gpu.load(Relaxed) == gpu)
            .or_else(|| s.faults.iter().find(|f| f.remaining.load(Acquire) == 0))
            .ok_or("fault table full")?;
        for (w, v) in slot.name.iter().zip(packed) {
            w.store(v, Relaxed);
        }
        slot.gpu.store(gpu, Relaxed);
        slot.code.store(code, Relaxed);
        slot.latency_us.store(latency_us, Relaxed);
        slot.remaining.store(if count == 0 { -1 } else { count }, Release);
        s.fault_count.store(s.faults.iter().filter(|f| f.remaining.load(Acquire) != 0).count() as u32, Release);
        Ok(())
    }

    pub fn clear_faults(&self) {
        let _g = self.lock();
        for f in &self.shared.faults {
            f.remaining.store(0, Release);
        }
        self.shared.fault_count.store(0, Release);
    }

    /// Applies a configured fault: sleeps for its latency and returns its error code, if any.
    /// `gpu` None checks the faults set for every GPU, `Some(g)` those set for GPU `g` only.
    #[inline]
    pub fn fault(&self, name: &str, gpu: Option<usize>) -> Option<i32> {
        if self.shared.fault_count.load(Relaxed) == 0 {
            return None;
        }
        self.fault_slow(name, gpu)
    }

    #[cold]
    fn fault_slow(&self, name: &str, gpu: Option<usize>) -> Option<i32> {
        let packed = pack_name(name)?;
        for f in &self.shared.faults {
            let fg = f.gpu.load(Relaxed);
            // A call site checks node-wide faults (gpu None) and, once it knows its GPU, that
            // GPU's faults; each fault record therefore matches exactly one of the two checks.
            let applies = match gpu {
                None => fg < 0,
                Some(g) => fg >= 0 && fg as usize == g,
            };
            if f.remaining.load(Acquire) == 0 || !applies || !unpack_eq(f, &packed) {
                continue;
            }
            // Consume one hit.
            let mut r = f.remaining.load(Acquire);
            loop {
                if r == 0 {
                    return None;
                }
                if r < 0 {
                    break;
                }
                match f.remaining.compare_exchange(r, r - 1, AcqRel, Acquire) {
                    Ok(_) => break,
                    Err(x) => r = x,
                }
            }
            let lat = f.latency_us.load(Relaxed);
            if lat > 0 {
                std::thread::sleep(std::time::Duration::from_micros(lat));
            }
            let c = f.code.load(Relaxed);
            return (c != 0).then_some(c);
        }
        None
    }
}

fn map(f: &File, size: usize) -> Result<&'static Shared, String> {
    // SAFETY: mapping a regular file we opened read-write with the exact size of `Shared`. The mapping
    // is never unmapped, so the 'static reference stays valid. All-zero bytes are a valid `Shared`
    // (atomics and plain integers), and every concurrent access goes through atomics or the node lock.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(format!("cannot map node state: {}", std::io::Error::last_os_error()));
        }
        Ok(&*(p as *const Shared))
    }
}

fn pack_name(name: &str) -> Option<[u64; 8]> {
    let b = name.as_bytes();
    if b.len() > 63 {
        return None;
    }
    let mut buf = [0u8; 64];
    buf[..b.len()].copy_from_slice(b);
    let mut out = [0u64; 8];
    for (i, c) in buf.chunks_exact(8).enumerate() {
        out[i] = u64::from_le_bytes(c.try_into().unwrap());
    }
    Some(out)
}

fn unpack_eq(f: &FaultRec, packed: &[u64; 8]) -> bool {
    f.name.iter().zip(packed).all(|(a, b)| a.load(Relaxed) == *b)
}

/// Names of the fault records in use (for `vgpu-sim status`).
pub fn fault_names(s: &Shared) -> Vec<(String, i32, i32, i64, u64)> {
    s.faults
        .iter()
        .filter(|f| f.remaining.load(Acquire) != 0)
        .map(|f| {
            let bytes: Vec<u8> =
                f.name.iter().flat_map(|w| w.load(Relaxed).to_le_bytes()).take_while(|&b| b != 0).collect();
            (
                String::from_utf8_lossy(&bytes).into_owned(),
                f.gpu.load(Relaxed),
                f.code.load(Relaxed),
                f.remaining.load(Relaxed),
                f.latency_us.load(Relaxed),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> (Node, PathBuf) {
        let dir = std::env::temp_dir().join(format!("vgpu-sim-unit-{}-{}", std::process::id(), now_ns()));
        let cfg = Config::parse("[[gpu]]\nmodel='A30'\nmemory_mib=1024").unwrap();
        (Node::open(cfg, &dir).unwrap(), dir)
    }

    #[test]
    fn charge_respects_physical_memory() {
        let (n, dir) = node();
        let (slot, _f) = n.register_process().unwrap();
        assert!(n.try_charge(slot, 0, 1000 << 20));
        assert!(!n.try_charge(slot, 0, 25 << 20));
        assert!(n.try_charge(slot, 0, 24 << 20));
        assert_eq!(n.mem_used(0), 1024 << 20);
        n.uncharge(slot, 0, 1024 << 20);
        assert_eq!(n.mem_used(0), 0);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn reopening_with_another_config_is_refused() {
        let (n, dir) = node();
        drop(n);
        let other = Config::parse("[[gpu]]\nmodel='A30'").unwrap();
        let e = Node::open(other, &dir).err().unwrap();
        assert!(e.contains("different node description"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn the_timeline_runs_each_process_s_work_and_measures_it() {
        let (n, dir) = node();
        let t0 = now_ns();
        let a = n.launch(0, 3, 10, &[1_000_000]);
        let b = n.launch(0, 4, 11, &[3_000_000]);
        let (ea, eb) = (n.wait_for(0, a), n.wait_for(0, b));
        assert!(eb >= t0 + 4_000_000 && ea < eb, "{ea} {eb}: the GPU serves one at a time");
        let (total, per) = n.busy(0, t0, now_ns());
        assert_eq!(total, 4_000_000);
        assert!(per.contains(&(10, 1_000_000)) && per.contains(&(11, 3_000_000)), "{per:?}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn faults_count_down() {
        let (n, dir) = node();
        n.set_fault("nvmlDeviceGetCount_v2", -1, 999, 2, 0).unwrap();
        assert_eq!(n.fault("nvmlDeviceGetCount_v2", None), Some(999));
        assert_eq!(n.fault("nvmlInit_v2", None), None);
        assert_eq!(n.fault("nvmlDeviceGetCount_v2", Some(0)), None, "node-wide faults match the node-wide check only");
        assert_eq!(n.fault("nvmlDeviceGetCount_v2", None), Some(999));
        assert_eq!(n.fault("nvmlDeviceGetCount_v2", None), None, "count exhausted");
        n.set_fault("cuMemAlloc_v2", 1, 2, -1, 0).unwrap();
        assert_eq!(n.fault("cuMemAlloc_v2", Some(0)), None);
        assert_eq!(n.fault("cuMemAlloc_v2", None), None);
        assert_eq!(n.fault("cuMemAlloc_v2", Some(1)), Some(2));
        n.clear_faults();
        assert_eq!(n.fault("cuMemAlloc_v2", Some(1)), None);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn xids_are_delivered_in_order() {
        let (n, dir) = node();
        n.inject_xid(0, 79);
        n.inject_instance_xid(0, 94, 3, 0);
        n.inject_xid(0, 48);
        let (next, x) = n.xids_since(0, 0);
        let whole = |code| Xid { code, instance: None };
        assert_eq!((next, x), (3, vec![whole(79), Xid { code: 94, instance: Some((3, 0)) }, whole(48)]));
        assert_eq!(n.xids_since(0, next).1, vec![]);
        std::fs::remove_dir_all(dir).ok();
    }
}

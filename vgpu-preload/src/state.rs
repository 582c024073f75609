//! The process's state: configuration, its slot in the container's region, the device map and the
//! allocation tables. Created on the first call that needs it.
//!
//! The policies above it (the priority gate, the SM throttle, the pools, graph and VMM tables) use
//! it, so it cannot name them; what they do at its moments (made, forked) and what they can give
//! back when a reservation meets the limit is handed to it once, as the library loads
//! ([`connect`], from `lib.rs`).

use crate::config::Config;
use crate::drv::format_uuid;
use crate::log::{vlog, ERROR, INFO, WARN};
use crate::ptrmap::PtrMap;
use crate::real;
use crate::trueup::{Ledger, TrueUp};
use cuda_abi::*;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};
use vgpu_region::MAX_DEVICES;
use vgpu_region::{Claim, Init, Layout, Region, Reserve};

const MAX_ORDINALS: usize = 64;

pub struct State {
    pub cfg: Config,
    /// The container's region; None when running unaccounted (fail-open).
    pub region: Option<Region>,
    /// Fail-closed: the configuration or the region is unusable, refuse device allocations.
    pub refuse: bool,
    /// Where limits are read: the agent's read-only limits file, or the region itself.
    limits: Option<&'static Layout>,
    _limits_region: Option<Region>,
    slot: AtomicUsize,
    claim: Mutex<Option<Claim>>,
    /// CUDA ordinal -> region device index (-1: not resolved yet).
    devmap: [AtomicI32; MAX_ORDINALS],
    phys_total: [AtomicU64; MAX_DEVICES],
    pub primary_refs: [AtomicU32; MAX_ORDINALS],
    /// Each ordinal's primary context, as its first retain returned it (0: not seen).
    pub primary_ctx: [AtomicU64; MAX_ORDINALS],
    /// What each ordinal's primary context's limits (stack, printf FIFO, heap) are charged beyond
    /// their defaults (see `memory::set_limit`).
    pub primary_limits: [AtomicU64; MAX_ORDINALS],
    pub primary_lock: Mutex<()>,
    /// The contexts allocations were made in (see `contexts`).
    pub contexts: crate::contexts::Contexts,
    sm_any: AtomicBool,
    sm_seen_gen: AtomicU64,
    /// The region device, when the process sees exactly one CUDA device (-1 otherwise).
    only_dev: AtomicI32,
    /// Charges for device memory the driver holds beyond what the calls charged (standalone).
    pub trueup: TrueUp,
    /// An agent watches the region: reservations for calls in flight are counted there for its
    /// true-up (see [`State::in_flight`]).
    watched: bool,
    /// Device pointers -> (device, context id, bytes).
    pub ptrs: PtrMap,
    /// VMM handles, arrays, explicit contexts -> (device, context id, bytes).
    pub handles: PtrMap,
}

/// What [`State::assemble`] makes a state of.
struct Parts {
    cfg: Config,
    region: Option<Region>,
    limits_region: Option<Region>,
    claim: Option<Claim>,
    refuse: bool,
    trueup: TrueUp,
    watched: bool,
}

/// Bytes counted in flight by [`State::in_flight`], until dropped.
pub struct InFlight<'a>(&'a State, usize, u64);

impl Drop for InFlight<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.end_in_flight(self.1, self.2);
    }
}

static STATE: OnceLock<State> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);

/// What the policies above the state do at its moments (see the module's head).
pub struct Above {
    /// The state was made: before the call that made it goes on (the priority gate starts).
    pub made: fn(&State),
    /// In a forked child, in the fork itself (only what a child handler may do: stores).
    pub child: fn(),
    /// In a forked child, at its first call that needs the state, once it holds a slot of its own:
    /// the policies' tables are its parent's.
    pub forked: fn(),
    /// Bytes the policies give back on a device when a reservation there meets the limit.
    pub reclaim: fn(&State, usize) -> u64,
}

static ABOVE: OnceLock<Above> = OnceLock::new();
/// `Above::made` ran (or is running).
static MADE: AtomicBool = AtomicBool::new(false);

/// Hands the policies' parts to the state (once; later calls are ignored). Where the state was
/// made before (a library's constructor made a CUDA call before this one's ran), its `made` runs
/// now.
pub fn connect(above: Above) {
    let _ = ABOVE.set(above);
    fence(SeqCst);
    run_made(STATE.get());
}

/// Runs `Above::made` once, where both the state and the policies are there. [`connect`] and the
/// state's making each call it after their own store, so that one of them sees both.
#[cold]
fn run_made(st: Option<&State>) {
    if let (Some(st), Some(a)) = (st, ABOVE.get()) {
        if !MADE.swap(true, AcqRel) {
            (a.made)(st);
        }
    }
}

extern "C" fn child_after_fork() {
    FORKED.store(true, Release);
    // The forking thread is the child's only thread, and its SM credit is the parent's.
    if let Some(a) = ABOVE.get() {
        (a.child)();
    }
    crate::capture::after_fork();
    crate::guard::Calls::after_fork();
    crate::trueup::after_fork_in_child();
}

/// At exit (exit(3) or a return from main; not _exit or a signal): mark the slot exiting, so that
/// the container's other processes reclaim it as soon as this process is gone, the next time they
/// read the usage (`cuMemGetInfo`, NVML's memory figures), not only when a reservation meets the
/// limit. What it holds stays charged until then: the driver frees it only at the process's end.
extern "C" fn at_exit() {
    // A child forked without claiming a slot of its own (it made no CUDA call since) would mark
    // its parent's.
    if FORKED.load(Acquire) {
        return;
    }
    if let Some((r, slot)) = STATE.get().and_then(State::accounting) {
        r.mark_exiting(slot);
    }
}

/// The process state; the first call creates it.
#[inline]
pub fn state() -> &'static State {
    let s = match STATE.get() {
        Some(s) => s,
        None => make(),
    };
    if FORKED.load(Relaxed) {
        s.after_fork();
    }
    s
}

/// The state's first call: made (by one thread, the others wait), then the policies told.
#[cold]
fn make() -> &'static State {
    let s = STATE.get_or_init(State::init);
    fence(SeqCst);
    run_made(Some(s));
    s
}

#[cold]
fn reap_exited(r: &Region) {
    let freed = r.reap_exited();
    if freed > 0 {
        vlog!(INFO, "reclaimed {freed} bytes held by processes that exited");
    }
}

/// Whether the file at `path` belongs to this process's effective user.
/// Makes `dir`, a user's default regions' folder, or checks it: a folder of this user's that no one
/// else may write, not a link; anything else there (another user's, a planted link) is refused.
fn private_dir(dir: &str) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let _ = std::fs::DirBuilder::new().mode(0o700).create(dir);
    let md = std::fs::symlink_metadata(dir).map_err(|e| format!("{dir}: {e}"))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !md.file_type().is_dir() || md.uid() != me || md.mode() & 0o022 != 0 {
        return Err(format!(
            "{dir} is not a folder of this user's that only it may write (owner {}, mode {:o}, {}); \
             remove it, or name a region (CUDA_DEVICE_MEMORY_SHARED_CACHE)",
            md.uid(),
            md.mode() & 0o7777,
            if md.file_type().is_symlink() {
                "a link"
            } else if md.is_dir() {
                "a folder"
            } else {
                "a file"
            }
        ));
    }
    Ok(())
}

fn owned_by_us(path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    std::fs::metadata(path).is_ok_and(|m| m.uid() == unsafe { libc::geteuid() })
}

fn limit_error(cfg: &Config, what: String) -> bool {
    if cfg.fail_open {
        vlog!(ERROR, "{what}; VGPU_FAIL_OPEN is set: running without GPU memory limits");
        false
    } else if cfg.managed {
        vlog!(ERROR, "{what}; refusing GPU memory allocations (the agent's files in this container are unusable)");
        true
    } else {
        vlog!(ERROR, "{what}; refusing GPU memory allocations (set VGPU_FAIL_OPEN=1 to run unlimited instead)");
        true
    }
}

impl State {
    fn init() -> State {
        let cfg = Config::from_env();
        crate::log::LEVEL.store(cfg.log_level, Relaxed);
        let mut refuse = false;
        if !cfg.ignored.is_empty() {
            vlog!(WARN, "in a container the agent manages, ignored: {}", cfg.ignored.join("; "));
        }
        if !cfg.errors.is_empty() {
            refuse = limit_error(&cfg, format!("bad configuration: {}", cfg.errors.join("; ")));
        }
        let path = std::path::Path::new(&cfg.region_path);
        // A managed container's region is the agent's: opened as it is, never made here. One its
        // container truncated would otherwise become a fresh quota for each process started after
        // (fail closed: refused until the agent has repaired it).
        let init = || Init { devices: Vec::new(), standalone: true };
        let opened = if cfg.managed {
            Region::open(path, true).map_err(|e| e.to_string())
        } else if cfg.default_region {
            // A user's own region, where none is named: 0600, in a folder only that user writes,
            // never through a link (another local user could otherwise pre-make it, lock it or
            // change its limits).
            let dir = path.parent().map(|d| d.display().to_string()).unwrap_or_default();
            private_dir(&dir).and_then(|()| Region::open_or_create_private(path, init).map_err(|e| e.to_string()))
        } else {
            Region::open_or_create(path, init).map_err(|e| e.to_string())
        };
        let region = match opened {
            // The default path is in a directory every user writes: one another user made first
            // is not this user's quota.
            Ok(_) if cfg.default_region && !owned_by_us(&cfg.region_path) => {
                refuse |= limit_error(&cfg, format!("{} belongs to another user", cfg.region_path));
                None
            }
            Ok(r) => Some(r),
            Err(e) => {
                refuse |= limit_error(&cfg, e);
                None
            }
        };
        let limits_region = cfg.limits_path.as_ref().and_then(|p| match Region::open(std::path::Path::new(p), false) {
            Ok(r) => Some(r),
            Err(e) => {
                refuse |= limit_error(&cfg, format!("limits: {e}"));
                None
            }
        });
        let mut claim = None;
        let host_pid = host_pid();
        if let Some(r) = &region {
            // Only slots whose process looks gone are lock-tested here (a lock test per live
            // process made starts of many processes at once quadratic); a reservation that meets
            // the limit reaps the rest.
            let freed = r.reap_gone();
            if freed > 0 {
                vlog!(INFO, "reclaimed {freed} bytes held by dead processes");
            }
            match r.claim(std::process::id(), host_pid) {
                Ok(c) => claim = Some(c),
                Err(e) => refuse |= limit_error(&cfg, e.to_string()),
            }
        }
        // No agent watches a region a process created: each process trues itself up.
        let standalone = region.as_ref().is_some_and(|r| r.standalone()) && limits_region.is_none();
        let trueup = TrueUp::new(cfg.memory_true_up && standalone, cfg.memory_true_up && region.is_some(), host_pid);
        let watched = region.is_some() && !standalone;
        if trueup.measures() {
            crate::guard::Calls::track();
            trueup.warm_up(region.as_ref().zip(claim.as_ref().map(|c| c.index)));
        }
        // SAFETY: registering plain extern "C" handlers.
        unsafe {
            libc::pthread_atfork(None, None, Some(child_after_fork));
            if claim.is_some() {
                libc::atexit(at_exit);
            }
        }
        let st = State::assemble(Parts { cfg, region, limits_region, claim, refuse, trueup, watched });
        // Before the state is published, so that no other thread's call runs ahead of it (where the
        // policies were not connected yet, `make` runs it once they are).
        run_made(Some(&st));
        st
    }

    /// The state from its parts, the limits read from the limits region if there is one, else from
    /// the region itself.
    fn assemble(p: Parts) -> State {
        let Parts { cfg, region, limits_region, claim, refuse, trueup, watched } = p;
        // SAFETY: both regions move into the State, which lives in a static (or, in unit tests, is
        // leaked) and is never dropped.
        let limits = limits_region.as_ref().or(region.as_ref()).map(|r| unsafe { r.layout_static() });
        State {
            slot: AtomicUsize::new(claim.as_ref().map_or(usize::MAX, |c: &Claim| c.index)),
            claim: Mutex::new(claim),
            region,
            refuse,
            limits,
            _limits_region: limits_region,
            devmap: [const { AtomicI32::new(-1) }; MAX_ORDINALS],
            phys_total: [const { AtomicU64::new(0) }; MAX_DEVICES],
            primary_refs: [const { AtomicU32::new(0) }; MAX_ORDINALS],
            primary_ctx: [const { AtomicU64::new(0) }; MAX_ORDINALS],
            primary_limits: [const { AtomicU64::new(0) }; MAX_ORDINALS],
            primary_lock: Mutex::new(()),
            contexts: crate::contexts::Contexts::new(),
            sm_any: AtomicBool::new(false),
            sm_seen_gen: AtomicU64::new(0),
            only_dev: AtomicI32::new(-1),
            ptrs: PtrMap::new(16),
            handles: PtrMap::new(12),
            trueup,
            watched,
            cfg,
        }
    }

    /// A state over `region` (one this process claims a slot in) for the policies' unit tests:
    /// default configuration, no true-up, CUDA ordinal `o` bound to region device `o`.
    #[cfg(test)]
    pub fn for_test(region: Region) -> &'static State {
        let cfg = Config::from_lookup(|_| None);
        let claim = Some(region.claim(std::process::id(), host_pid()).expect("a free slot"));
        let trueup = TrueUp::new(false, false, host_pid());
        let st = State::assemble(Parts {
            cfg,
            region: Some(region),
            limits_region: None,
            claim,
            refuse: false,
            trueup,
            watched: true,
        });
        for (o, m) in st.devmap.iter().enumerate().take(MAX_DEVICES) {
            m.store(o as i32, Release);
        }
        Box::leak(Box::new(st))
    }

    /// A forked child claims its own slot and starts with no allocations of its own.
    #[cold]
    fn after_fork(&self) {
        let Ok(mut c) = self.claim.lock() else { return };
        if !FORKED.swap(false, AcqRel) {
            return;
        }
        if let (Some(r), Some(old)) = (&self.region, c.take()) {
            match old.reclaim_after_fork(r, std::process::id(), host_pid()) {
                Ok(n) => {
                    self.slot.store(n.index, Release);
                    *c = Some(n);
                }
                Err(e) => vlog!(ERROR, "after fork: {e}"),
            }
        }
        self.trueup.after_fork(host_pid());
        if let Some(a) = ABOVE.get() {
            (a.forked)();
        }
        crate::ctxlimits::after_fork();
        self.ptrs.clear();
        self.handles.clear();
        self.contexts.clear();
        for r in &self.primary_refs {
            r.store(0, Relaxed);
        }
        for c in self.primary_ctx.iter().chain(&self.primary_limits) {
            c.store(0, Relaxed);
        }
    }

    pub fn slot(&self) -> usize {
        self.slot.load(Acquire)
    }

    /// Counts `bytes` reserved on `dev` for a call the driver has not answered, in the region where
    /// an agent watches it, until the guard drops: NVML's figure for the process does not show them
    /// yet, and the agent's true-up must not take that for a smaller context (see
    /// `Region::begin_in_flight`). Taken before the reservation, dropped after the call.
    #[inline]
    pub fn in_flight(&self, dev: usize, bytes: u64) -> InFlight<'_> {
        self.begin_in_flight(dev, bytes);
        InFlight(self, dev, bytes)
    }

    /// [`in_flight`](Self::in_flight) without the guard: [`end_in_flight`](Self::end_in_flight)
    /// with the same figures follows.
    #[inline]
    pub fn begin_in_flight(&self, dev: usize, bytes: u64) {
        if let Some(r) = self.region.as_ref().filter(|_| self.watched && bytes > 0) {
            r.begin_in_flight(dev, bytes);
        }
    }

    #[inline]
    pub fn end_in_flight(&self, dev: usize, bytes: u64) {
        if let Some(r) = self.region.as_ref().filter(|_| self.watched && bytes > 0) {
            r.end_in_flight(dev, bytes);
        }
    }

    /// Accounting is on: a region and a slot.
    #[inline]
    pub fn accounting(&self) -> Option<(&Region, usize)> {
        let slot = self.slot();
        self.region.as_ref().filter(|_| slot != usize::MAX).map(|r| (r, slot))
    }

    /// SM percentage of `dev` (0: none).
    #[inline]
    pub fn sm_limit(&self, dev: usize) -> u32 {
        self.limits.map_or(0, |l| l.devices[dev].sm_limit.load(Acquire))
    }

    /// Whether any device of the container has an SM limit (re-read when the limits change).
    pub fn sm_any(&self) -> bool {
        let Some(l) = self.limits else { return false };
        let gen = l.header.limits_generation.load(Acquire) + 1;
        if self.sm_seen_gen.load(Relaxed) != gen {
            let n = (l.header.ndevices.load(Acquire) as usize).min(MAX_DEVICES);
            let any = l.devices[..n].iter().any(|d| matches!(d.sm_limit.load(Acquire), 1..=99));
            self.sm_any.store(any, Relaxed);
            self.sm_seen_gen.store(gen, Relaxed);
        }
        self.sm_any.load(Relaxed)
    }

    /// The limits' generation counter (for callers that cache what depends on the limits).
    pub fn limits_generation(&self) -> Option<&'static AtomicU64> {
        self.limits.map(|l| &l.header.limits_generation)
    }

    #[inline]
    pub fn mem_limit(&self, dev: usize) -> u64 {
        self.limits.map_or(0, |l| l.devices[dev].mem_limit.load(Acquire))
    }

    /// Whether the agent made this a high-priority slice: its limits file's flag (never the
    /// region's, which the container could write).
    #[inline]
    pub fn priority_high(&self) -> bool {
        self._limits_region.as_ref().is_some_and(|r| r.priority_high())
    }

    /// What a normal slice keeps queued beside a high-priority one (ns; 0: the default).
    pub fn priority_queue_ns(&self) -> u64 {
        self._limits_region.as_ref().map_or(0, |r| r.priority_queue_ns())
    }

    /// The share of each window in which a normal slice launches whatever a high-priority one
    /// claims (percent; 0: the default).
    pub fn priority_min_share(&self) -> u32 {
        self._limits_region.as_ref().map_or(0, |r| r.priority_min_share())
    }

    /// The agent's limits file, with the GPU UUID of each of its devices.
    pub fn limits_file(&self) -> Option<(&str, Vec<String>)> {
        let r = self._limits_region.as_ref()?;
        let path = self.cfg.limits_path.as_deref()?;
        Some((path, (0..r.ndevices()).map(|i| r.device_uuid(i)).collect()))
    }

    /// Whether the slice's GPU runs MPS (the agent's flag in the limits file, never the region's).
    pub fn mps(&self) -> bool {
        self._limits_region.as_ref().is_some_and(|r| r.mps())
    }

    /// Whether an allocation the GPU has no room for may be served as unified memory:
    /// `CUDA_OVERSUBSCRIBE`, or the agent's flag in the limits.
    pub fn oversubscribe(&self) -> bool {
        self.cfg.oversubscribe
            || self.limits.is_some_and(|l| l.header.flags.load(Acquire) & vgpu_region::FLAG_OVERSUBSCRIBE != 0)
    }

    /// Region device index of a CUDA device ordinal.
    #[inline]
    pub fn dev_of(&self, ordinal: CUdevice) -> Result<usize, CUresult> {
        let o = usize::try_from(ordinal).map_err(|_| CUresult::INVALID_DEVICE)?;
        let d = self.devmap.get(o).ok_or(CUresult::INVALID_DEVICE)?.load(Acquire);
        if d >= 0 {
            return Ok(d as usize);
        }
        self.resolve(o)
    }

    /// The current context's device.
    #[inline]
    pub fn current_dev(&self) -> Result<(CUdevice, usize), CUresult> {
        let f = real::driver().helpers.cuCtxGetDevice.ok_or(CUresult::NOT_INITIALIZED)?;
        let mut o = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { f(&mut o) };
        if r != CUresult::SUCCESS {
            return Err(r);
        }
        Ok((o, self.dev_of(o)?))
    }

    /// Whether the process sees one device (known once that device was first used).
    #[inline]
    pub fn sees_one_device(&self) -> bool {
        self.only_dev.load(Relaxed) >= 0
    }

    /// The CUDA ordinal bound to region device `d` (None: none is yet).
    pub fn ordinal_of(&self, d: usize) -> Option<CUdevice> {
        self.devmap.iter().position(|m| m.load(Acquire) == d as i32).map(|o| o as CUdevice)
    }

    /// The device a launch runs on: without asking the driver when the process sees one device.
    #[inline]
    pub fn launch_dev(&self) -> Result<usize, CUresult> {
        let d = self.only_dev.load(Relaxed);
        if d >= 0 {
            return Ok(d as usize);
        }
        self.current_dev().map(|(_, d)| d)
    }

    #[cold]
    fn resolve(&self, ordinal: usize) -> Result<usize, CUresult> {
        let h = &real::driver().helpers;
        let (Some(get), Some(uuid_of)) = (h.cuDeviceGet, h.cuDeviceGetUuid_v2) else {
            return Err(CUresult::NOT_INITIALIZED);
        };
        let (mut dev, mut u) = (0, CUuuid::default());
        // SAFETY: out-pointers to locals.
        unsafe {
            let r = get(&mut dev, ordinal as i32);
            if r != CUresult::SUCCESS {
                return Err(r);
            }
            let r = uuid_of(&mut u, dev);
            if r != CUresult::SUCCESS {
                return Err(r);
            }
        }
        let uuid = format_uuid(&u.bytes);
        if !crate::visible::allows(&uuid) {
            crate::visible::refused(ordinal, &uuid);
            return Err(CUresult::INVALID_DEVICE);
        }
        let idx = container_index(ordinal, &uuid, self.region.as_ref());
        let d = match &self.region {
            Some(r) => {
                let mem = self.cfg.mem_limit.get(idx).copied().unwrap_or(0);
                let sm = self.cfg.sm_limit.get(idx).copied().unwrap_or(0);
                let d = r.bind_device(idx, &uuid, mem, sm).ok_or(CUresult::INVALID_DEVICE)?;
                self.warn_if_other_limits(r, d, mem, sm);
                d
            }
            None => idx.min(MAX_DEVICES - 1),
        };
        if let Some(total) = real::driver().cuda.cuDeviceTotalMem_v2 {
            let mut t = 0usize;
            // SAFETY: out-pointer to a local; the real entry point.
            if unsafe { total(&mut t, dev) } == CUresult::SUCCESS {
                self.phys_total[d].store(t as u64, Release);
            }
        }
        vlog!(INFO, "CUDA device {ordinal} ({uuid}) is container device {d}, limit {}", limit_words(self.mem_limit(d)));
        // The devices it sees: its slice's where the runtime exposed more.
        if crate::visible::cuda_count() == Some(1) {
            self.only_dev.store(d as i32, Relaxed);
        }
        self.devmap[ordinal].store(d as i32, Release);
        Ok(d)
    }

    /// Binds the device NVML lists at `index` (the container's own enumeration) to the region, with
    /// the container index CUDA would give it: its position in a `CUDA_VISIBLE_DEVICES` of UUIDs, the
    /// index itself for one of numbers or none. None when CUDA would not see the device.
    #[cold]
    pub fn bind_nvml(&self, index: usize, uuid: &str) -> Option<usize> {
        let r = self.region.as_ref()?;
        let idx = nvml_container_index(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(), index, uuid)?;
        let mem = self.cfg.mem_limit.get(idx).copied().unwrap_or(0);
        let sm = self.cfg.sm_limit.get(idx).copied().unwrap_or(0);
        let d = r.bind_device(idx, uuid, mem, sm)?;
        self.warn_if_other_limits(r, d, mem, sm);
        vlog!(INFO, "NVML device {index} ({uuid}) is container device {d}, limit {}", limit_words(self.mem_limit(d)));
        Some(d)
    }

    /// Says so (at the default log level, once per device) when a region no agent manages holds
    /// other limits for a device than this process's environment gives: the region's apply, to
    /// every process that shares it, and nothing else would tell why.
    #[cold]
    fn warn_if_other_limits(&self, r: &Region, d: usize, mem: u64, sm: u32) {
        static WARNED: AtomicU32 = AtomicU32::new(0);
        if self.cfg.managed || self.cfg.limits_path.is_some() || !r.standalone() || d >= 32 {
            return;
        }
        let (have_mem, have_sm) = (r.mem_limit(d), r.sm_limit(d));
        if (have_mem, have_sm) != (mem, sm) && WARNED.fetch_or(1 << d, Relaxed) & (1 << d) == 0 {
            vlog!(
                WARN,
                "region {} holds other limits for device {d} (memory {have_mem} bytes, SM {have_sm} %) than this \
                 process's environment (memory {mem} bytes, SM {sm} %): the region's apply, as to every process \
                 sharing it; name another CUDA_DEVICE_MEMORY_SHARED_CACHE for other limits",
                self.cfg.region_path
            );
        }
    }

    pub fn phys_total(&self, dev: usize) -> u64 {
        self.phys_total[dev].load(Acquire)
    }

    /// Reserves `bytes` on `dev`; on the limit, reclaims dead processes and tries once more.
    /// Fail-closed refuses every allocation.
    #[inline]
    pub fn reserve(&self, dev: usize, bytes: u64) -> Result<(), CUresult> {
        if self.refuse {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        self.reserve_accounted(dev, bytes)
    }

    /// Reserves a context's overhead: contexts are created even when failing closed, so that an
    /// application gets its refusal at its first allocation, where it expects one.
    pub fn reserve_context(&self, dev: usize, bytes: u64) -> Result<(), CUresult> {
        self.reserve_accounted(dev, bytes)
    }

    #[inline]
    fn reserve_accounted(&self, dev: usize, bytes: u64) -> Result<(), CUresult> {
        let Some((r, slot)) = self.accounting() else { return Ok(()) };
        let limit = self.mem_limit(dev);
        // A context's true-up still measuring on its own thread: an allocation that would come
        // within its margin of the limit is admitted on its figure.
        self.trueup.settle(self, dev, || {
            limit != 0 && r.used(dev).saturating_add(bytes) > limit.saturating_sub(crate::trueup::CONTEXT_MARGIN)
        });
        match r.reserve_seen(slot, dev, bytes, limit) {
            // Within min(limit / 4, 1 GiB) of the limit, where no agent watches: what the driver
            // holds beyond the process's calls may be what takes the container over (see `trueup`).
            Some(total) if limit != 0 && total > limit - (limit / 4).min(1 << 30) && self.trueup.on() => {
                self.reserve_near(r, slot, dev, bytes, limit)
            }
            Some(_) => Ok(()),
            None => self.reserve_slow(r, slot, dev, bytes),
        }
    }

    /// A reservation that brought the container near its limit: true up this process's charge,
    /// and keep the reservation only if the container is still within the limit.
    #[cold]
    fn reserve_near(&self, r: &Region, slot: usize, dev: usize, bytes: u64, limit: u64) -> Result<(), CUresult> {
        if self.trueup.near_limit(self, dev, false, bytes) && r.used(dev) > limit {
            r.release(slot, dev, bytes);
            if r.reserve(slot, dev, bytes, limit) == Reserve::Ok {
                return Ok(());
            }
            return self.reserve_slow(r, slot, dev, bytes);
        }
        Ok(())
    }

    #[cold]
    fn reserve_slow(&self, r: &Region, slot: usize, dev: usize, bytes: u64) -> Result<(), CUresult> {
        if r.reap() > 0 && r.reserve(slot, dev, bytes, self.mem_limit(dev)) == Reserve::Ok {
            return Ok(());
        }
        // Pools may have given memory back since they were last settled.
        if ABOVE.get().is_some_and(|a| (a.reclaim)(self, dev) > 0)
            && r.reserve(slot, dev, bytes, self.mem_limit(dev)) == Reserve::Ok
        {
            return Ok(());
        }
        // What the true-up charges may have gone (a context or module the driver let go).
        if self.trueup.added(dev) > 0
            && self.trueup.near_limit(self, dev, true, 0)
            && r.reserve(slot, dev, bytes, self.mem_limit(dev)) == Reserve::Ok
        {
            return Ok(());
        }
        vlog!(
            INFO,
            "device {dev}: {bytes} bytes refused: container limit {} bytes, {} in use",
            self.mem_limit(dev),
            r.used(dev)
        );
        Err(CUresult::OUT_OF_MEMORY)
    }

    /// Charges memory the driver already holds for this process (it cannot be refused any more).
    pub fn charge_held(&self, dev: usize, bytes: u64) {
        if let Some((r, slot)) = self.accounting() {
            r.reserve(slot, dev, bytes, 0);
        }
    }

    #[inline]
    pub fn release(&self, dev: usize, bytes: u64) {
        if let Some((r, slot)) = self.accounting() {
            r.release(slot, dev, bytes);
        }
    }

    /// Container usage on `dev`, after reclaiming the slots of processes that exited since the
    /// last look (one load when there are none).
    #[inline]
    /// Reclaims the slots of processes that died without exiting (SIGKILL, a crash) at most once
    /// per 100 ms, where no agent does it every pass: what `cuMemGetInfo` reports free then
    /// recovers as fast as an allocation would (which reclaims at the limit). A lock test per live
    /// slot: for the paths that read the usage, not for allocations.
    #[cold]
    pub fn reap_dead_every_100ms(&self) {
        static LAST_NS: AtomicU64 = AtomicU64::new(0);
        let Some(r) = self.region.as_ref().filter(|_| !self.watched) else { return };
        let now = crate::clock::now_coarse();
        let last = LAST_NS.load(Relaxed);
        if now.saturating_sub(last) < 100_000_000 || LAST_NS.compare_exchange(last, now, Relaxed, Relaxed).is_err() {
            return;
        }
        let freed = r.reap();
        if freed > 0 {
            vlog!(INFO, "reclaimed {freed} bytes held by dead processes");
        }
    }

    pub fn used(&self, dev: usize) -> u64 {
        let Some(r) = self.region.as_ref() else { return 0 };
        if r.exiting() != 0 {
            reap_exited(r);
        }
        r.used(dev)
    }
}

impl Ledger for State {
    fn region(&self) -> Option<&Region> {
        self.region.as_ref()
    }
    fn accounting(&self) -> Option<(&Region, usize)> {
        State::accounting(self)
    }
    fn mem_limit(&self, dev: usize) -> u64 {
        State::mem_limit(self, dev)
    }
    fn used(&self, dev: usize) -> u64 {
        State::used(self, dev)
    }
    fn true_up(&self) -> &TrueUp {
        &self.trueup
    }
}

/// The container-visible index of a process's CUDA ordinal: by UUID in an existing region, through
/// a numeric CUDA_VISIBLE_DEVICES, else the ordinal itself.
fn container_index(ordinal: usize, uuid: &str, region: Option<&Region>) -> usize {
    if let Some(i) = region.and_then(|r| r.find_device(uuid)) {
        return i;
    }
    visible_index(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(), ordinal)
}

/// The index a numeric `CUDA_VISIBLE_DEVICES` (`visible`) gives CUDA's `ordinal`, else the ordinal.
fn visible_index(visible: Option<&str>, ordinal: usize) -> usize {
    let item = visible.and_then(|v| v.split(',').map(str::trim).nth(ordinal));
    item.and_then(|s| s.parse::<usize>().ok()).unwrap_or(ordinal)
}

/// The container index CUDA would give the device NVML lists at `index` with `uuid`, under
/// `CUDA_VISIBLE_DEVICES` (`visible`): the index itself where unset or a list of numbers naming it,
/// its position in a list of UUIDs (or UUID prefixes); None where CUDA would not see it.
fn nvml_container_index(visible: Option<&str>, index: usize, uuid: &str) -> Option<usize> {
    let Some(v) = visible else { return Some(index) };
    let items: Vec<&str> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if items.iter().all(|s| s.parse::<usize>().is_ok()) {
        items.iter().any(|s| s.parse::<usize>() == Ok(index)).then_some(index)
    } else {
        items.iter().position(|s| uuid == *s || (s.starts_with("GPU-") && uuid.starts_with(s)))
    }
}

/// The initial PID namespace as `/proc/self/ns/pid` names it (its inode is the kernel's constant
/// `PROC_PID_INIT_INO`, 0xEFFFFFFC).
const INIT_PID_NS: &str = "pid:[4026531836]";

/// The host PID when it can be known from inside (no PID namespace: the PID itself), else 0. A
/// container has a PID namespace of its own and a /proc of its own, whose `NSpid` shows one PID,
/// the container's: not the host's. So the namespace is asked first; only where that cannot be
/// read does a single `NSpid` entry stand for "no namespace".
fn host_pid() -> u32 {
    match std::fs::read_link("/proc/self/ns/pid") {
        Ok(ns) if ns.as_os_str() == INIT_PID_NS => return std::process::id(),
        Ok(_) => return 0,
        Err(_) => {}
    }
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    let ns: Vec<u32> = s
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|l| l.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default();
    if ns.len() == 1 {
        ns[0]
    } else {
        0
    }
}

/// A device's memory limit as the log says it: `8.0 GiB (8589934592 bytes)`, or `none`.
fn limit_words(limit: u64) -> String {
    if limit == 0 || limit == u64::MAX {
        "none".to_string()
    } else {
        format!("{} ({limit} bytes)", vgpu_units::human(limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A state over a new region of two devices limited to `limit` bytes each, watched.
    fn limited(limit: u64) -> &'static State {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path =
            std::env::temp_dir().join(format!("vgpu-state-test-{}-{}", std::process::id(), N.fetch_add(1, Relaxed)));
        let _ = std::fs::remove_file(&path);
        let init = || Init { devices: vec![("GPU-a".into(), limit, 0), ("GPU-b".into(), limit, 0)], standalone: false };
        let region = Region::open_or_create(&path, init).expect("region");
        let _ = std::fs::remove_file(&path);
        State::for_test(region)
    }

    #[test]
    fn reservations_stop_at_each_device_s_limit_and_releases_make_room() {
        let st = limited(8 * MIB);
        assert_eq!(st.reserve(0, 6 * MIB), Ok(()));
        assert_eq!(st.reserve(0, 3 * MIB), Err(CUresult::OUT_OF_MEMORY));
        assert_eq!(st.used(0), 6 * MIB, "a refusal charges nothing");
        assert_eq!(st.reserve(1, 8 * MIB), Ok(()), "each device has its own limit");
        st.release(0, 4 * MIB);
        assert_eq!(st.reserve(0, 6 * MIB), Ok(()), "up to the limit exactly");
        assert_eq!((st.used(0), st.used(1)), (8 * MIB, 8 * MIB));
        // Memory the driver already holds is charged past the limit: it cannot be refused.
        st.charge_held(0, MIB);
        assert_eq!(st.used(0), 9 * MIB);
    }

    #[test]
    fn limits_changed_under_a_running_process_apply_to_its_next_reservation() {
        let st = limited(4 * MIB);
        let r = st.region.as_ref().unwrap();
        assert_eq!(st.reserve(0, 3 * MIB), Ok(()));
        r.set_mem_limit(0, 2 * MIB).unwrap();
        assert_eq!(st.mem_limit(0), 2 * MIB);
        assert_eq!(st.reserve(0, MIB), Err(CUresult::OUT_OF_MEMORY), "lowered below what it holds");
        r.set_mem_limit(0, 16 * MIB).unwrap();
        assert_eq!(st.reserve(0, 10 * MIB), Ok(()), "raised");
        assert!(!st.sm_any());
        r.set_sm_limit(1, 30).unwrap();
        assert_eq!((st.sm_any(), st.sm_limit(1)), (true, 30), "an SM limit seen at the new generation");
        r.set_sm_limit(1, 100).unwrap();
        assert!(!st.sm_any(), "100 % is no limit");
    }

    #[test]
    fn a_numeric_cuda_visible_devices_maps_an_ordinal_to_the_container_s_index() {
        assert_eq!(visible_index(None, 1), 1);
        assert_eq!(visible_index(Some("3, 5"), 1), 5);
        assert_eq!(visible_index(Some("3,5"), 2), 2, "past the list: the ordinal");
        assert_eq!(visible_index(Some("GPU-aa,GPU-bb"), 1), 1, "UUIDs: the ordinal");
    }

    #[test]
    fn an_nvml_device_is_bound_where_cuda_would_see_it() {
        let uuid = "GPU-5eed0000-1000-4000-8000-0000c0de0001";
        assert_eq!(nvml_container_index(None, 3, uuid), Some(3), "unset: every device, as NVML lists them");
        assert_eq!(nvml_container_index(Some("0,3"), 3, uuid), Some(3));
        assert_eq!(nvml_container_index(Some("0,2"), 3, uuid), None, "a device CUDA does not see");
        assert_eq!(nvml_container_index(Some("0,,3,"), 3, uuid), Some(3), "empty items are ignored");
        let other = "GPU-5eed0000-1000-4000-8000-0000c0de0000";
        assert_eq!(nvml_container_index(Some(&format!("{other},{uuid}")), 0, uuid), Some(1), "a UUID's position");
        assert_eq!(nvml_container_index(Some("GPU-ffff, GPU-5eed0000-1000"), 0, uuid), Some(1), "a UUID prefix");
        assert_eq!(nvml_container_index(Some("MIG-5eed0000"), 0, uuid), None);
    }

    #[test]
    fn uuids_and_limits_read_as_nvidia_smi_and_people_write_them() {
        let b = [0x5e, 0xed, 0, 0, 0x10, 0, 0x40, 0, 0x80, 0, 0, 0, 0xc0, 0xde, 0, 0x01];
        assert_eq!(format_uuid(&b), "GPU-5eed0000-1000-4000-8000-0000c0de0001");
        assert_eq!(limit_words(0), "none");
        assert_eq!(limit_words(u64::MAX), "none");
        assert_eq!(limit_words(8 << 30), "8.0 GiB (8589934592 bytes)");
    }
}

//! SM-time quotas: every launch path passes through [`admit`], which charges the container's shared
//! budget (a token bucket in the region, in ns of GPU time) with the launch's estimated GPU time and
//! sleeps while the budget is in debt. Estimates come from the GPU itself: one launch in
//! `SAMPLE_EVERY` per kernel (and every kernel's first) is bracketed by events, read later without
//! blocking, and the budget is corrected by the difference.
#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::capture::{self, ptsz};
use crate::config::CorePolicy;
use crate::real::{cuda_fns as f, driver};
use crate::state::{state, State};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::*};
use std::sync::Mutex;

/// One launch in this many of each kernel is measured (and its first): often at first, then less, as
/// the estimate settles.
const SAMPLE_EVERY_EARLY: u64 = 16;
const SAMPLE_EVERY: u64 = 128;
const EARLY_LAUNCHES: u64 = 1024;
/// Charge for a kernel never measured yet.
const FIRST_GUESS_NS: u64 = 100_000;
/// Longest single sleep; the budget is re-read after each.
const MAX_SLEEP_NS: u64 = 20_000_000;

pub(crate) fn now_coarse() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; the clock always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Per-process estimates of a kernel's (or graph's) GPU time, keyed by function and grid (see
/// [`kernel_key`]) or by graph handle.
///
/// An estimate is the smallest of the kernel's last `WINDOW` measurements: a bracket of events can
/// only be inflated (by queueing behind other work on the GPU), so the minimum of a few recent ones is
/// close to the kernel's own time, while a kernel that really became slower is followed within
/// `WINDOW` measurements.
struct Estimates {
    /// Per entry: key, launch count, estimate, next ring position, then the ring of measurements.
    slots: Box<[[AtomicU64; 4 + WINDOW]]>,
}

const WINDOW: usize = 8;
/// log2 of the number of entries: 8192 (768 KiB, allocated at the first limited launch). One
/// function launched with many grids takes one entry per grid.
const TABLE_BITS: u32 = 13;

impl Estimates {
    fn new() -> Estimates {
        Estimates { slots: (0..1 << TABLE_BITS).map(|_| std::array::from_fn(|_| AtomicU64::new(0))).collect() }
    }

    #[inline]
    fn entry(&self, key: u64, insert: bool) -> Option<&[AtomicU64; 4 + WINDOW]> {
        let mask = self.slots.len() - 1;
        let h = ((key >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - TABLE_BITS)) as usize;
        for i in 0..32 {
            let s = &self.slots[(h + i) & mask];
            let k = s[0].load(Acquire);
            if k == key || (insert && k == 0 && s[0].compare_exchange(0, key, AcqRel, Acquire).is_ok()) {
                return Some(s);
            }
            if k == 0 {
                return None;
            }
        }
        None
    }

    /// (estimate in ns, 0 when unknown; launch count of this kernel before this one). A full table
    /// measures every launch of the kernels it cannot hold.
    #[inline]
    fn get(&self, key: u64) -> (u64, u64) {
        let Some(s) = self.entry(key, true) else { return (0, 0) };
        (s[2].load(Relaxed), s[1].fetch_add(1, Relaxed))
    }

    /// Folds a measurement in; returns the new estimate.
    fn learn(&self, key: u64, ns: u64) -> u64 {
        let ns = ns.max(1);
        let Some(s) = self.entry(key, false) else { return ns };
        let pos = s[3].fetch_add(1, Relaxed) as usize % WINDOW;
        s[4 + pos].store(ns, Relaxed);
        let est = s[4..].iter().map(|x| x.load(Relaxed)).filter(|&x| x > 0).min().unwrap_or(ns);
        s[2].store(est, Relaxed);
        est
    }
}

/// The estimate key of a kernel launch: its function and its grid. A kernel's GPU time mostly
/// follows its grid (a GEMM's or an attention kernel's grid grows with the batch and the sequence),
/// and an estimate is the smallest recent measurement, so one estimate for every grid of a function
/// would charge each launch as if it were the smallest. Never 0 (the table's empty key).
#[inline]
fn kernel_key(f: CUfunction, gx: u32, gy: u32, gz: u32) -> u64 {
    let grid = gx as u64 ^ ((gy as u64) << 24) ^ ((gz as u64) << 44);
    ((f as u64) ^ grid.wrapping_mul(0x9E37_79B9_7F4A_7C15)).max(1)
}

struct Sample {
    // Event handles are plain pointers owned by this module; samples move between threads only
    // under the PENDING lock.
    key: u64,
    dev: usize,
    charged: u64,
    start: CUevent,
    end: CUevent,
}

// SAFETY: a Sample holds event handles created by this process; CUDA events may be queried and
// destroyed from any thread, and samples only move between threads under the PENDING lock.
unsafe impl Send for Sample {}

/// Measurements in flight (process-wide; touched only by measured launches and collections).
static PENDING: Mutex<Vec<Sample>> = Mutex::new(Vec::new());
static PENDING_N: AtomicU64 = AtomicU64::new(0);
/// Events ready for reuse (as addresses).
static SPARE_EVENTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn estimates() -> &'static Estimates {
    static E: std::sync::OnceLock<Estimates> = std::sync::OnceLock::new();
    E.get_or_init(Estimates::new)
}

/// The SM percentage that applies to `dev` now, or None.
#[inline]
fn applies(st: &State, dev: usize) -> Option<u32> {
    let pct = st.sm_limit(dev);
    if pct == 0 || pct >= 100 {
        return None;
    }
    match st.cfg.core_policy {
        CorePolicy::Disable => None,
        CorePolicy::Force => Some(pct),
        // With an agent, only while another container shares the GPU; standalone, always.
        CorePolicy::Default => match st.region.as_ref().and_then(|r| r.sm_shared(dev)) {
            Some(false) => None,
            _ => Some(pct),
        },
    }
}

fn event() -> Option<CUevent> {
    if let Some(e) = SPARE_EVENTS.lock().ok().and_then(|mut s| s.pop()) {
        return Some(e as CUevent);
    }
    let create = driver().helpers.cuEventCreate?;
    let mut e = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; default flags (timing enabled).
    (unsafe { create(&mut e, 0) } == CUresult::SUCCESS).then_some(e)
}

fn spare(events: [CUevent; 2]) {
    if let Ok(mut s) = SPARE_EVENTS.lock() {
        s.extend(events.map(|e| e as usize));
    }
}

/// Reads finished measurements without blocking and corrects the budget.
fn collect(st: &State) {
    let h = &driver().helpers;
    let (Some(query), Some(elapsed)) = (h.cuEventQuery, h.cuEventElapsedTime) else { return };
    if capture::any_open() {
        return;
    }
    let Ok(mut p) = PENDING.try_lock() else { return };
    let mut i = 0;
    while i < p.len() {
        let s = &p[i];
        // SAFETY: events we created and recorded.
        let q = unsafe { query(s.end) };
        if q == CUresult::NOT_READY {
            i += 1;
            continue;
        }
        let mut ms = 0f32;
        // SAFETY: as above; both recorded on the same stream. Any other answer than success (an
        // event that cannot be timed) drops the measurement; the launch keeps its charge.
        let ok = q == CUresult::SUCCESS && unsafe { elapsed(&mut ms, s.start, s.end) } == CUresult::SUCCESS;
        let s = p.swap_remove(i);
        PENDING_N.fetch_sub(1, Relaxed);
        if ok {
            // The launch is charged what the updated estimate says, not the raw measurement,
            // which includes any time spent queued behind other work.
            let ns = estimates().learn(s.key, (ms as f64 * 1e6) as u64);
            if let Some(r) = st.region.as_ref() {
                r.sm_correct(s.dev, s.charged as i64 - ns as i64, ns);
            }
        }
        spare([s.start, s.end]);
    }
}

static GEN: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
static SEEN: AtomicU64 = AtomicU64::new(u64::MAX);
static ANY: AtomicBool = AtomicBool::new(false);

/// Whether any device of the container has an SM limit; the launch hooks skip everything else when
/// not. Cached process-wide and re-evaluated only when the limits' generation changes, so the
/// common answer costs two loads.
#[inline]
pub fn engaged() -> bool {
    let g = GEN.load(Acquire);
    // SAFETY: GEN only ever holds a pointer into the limits mapping of the process's State, whose
    // regions live in a static and are never dropped (so never unmapped).
    if !g.is_null() && unsafe { &*g }.load(Relaxed) == SEEN.load(Relaxed) {
        return ANY.load(Relaxed);
    }
    engaged_slow()
}

#[cold]
fn engaged_slow() -> bool {
    let st = state();
    let any = st.sm_any();
    if let Some(g) = st.limits_generation() {
        ANY.store(any, Relaxed);
        SEEN.store(g.load(Acquire), Relaxed);
        GEN.store(g as *const AtomicU64 as *mut AtomicU64, Release);
    }
    any
}

/// Admits one launch of `key` on `stream` (waiting while the budget is in debt), then runs `launch`.
#[inline]
fn admit(key: u64, stream: CUstream, launch: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
    let Ok(dev) = st.launch_dev() else { return launch() };
    let (Some(pct), Some(region)) = (applies(st, dev), st.region.as_ref()) else { return launch() };
    if capture::capturing(stream) {
        return launch(); // becomes a graph node; charged when the graph is launched
    }
    // While any capture is open, no timing events are recorded or queried (see `capture`).
    let open = capture::any_open();
    let (est, n) = estimates().get(key);
    let every = if n < EARLY_LAUNCHES { SAMPLE_EVERY_EARLY } else { SAMPLE_EVERY };
    let sample = !open && (est == 0 || n % every == 0);
    let cost = if est == 0 { FIRST_GUESS_NS } else { est };
    if !region.sm_try_charge(dev, cost) {
        // The slow path sleeps and reads the clock; a panic in it must not unwind into C.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| throttle(st, region, dev, pct, cost))).is_err() {
            crate::log::vlog!(crate::log::ERROR, "internal error while throttling; launching unthrottled");
        }
    }
    let res = if sample {
        let mut res = CUresult::UNKNOWN;
        let mut launch = Some(launch);
        let measured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            res = measure(region, key, dev, cost, stream, launch.take().unwrap());
        }));
        match (measured, launch) {
            (Err(_), Some(l)) => l(),
            _ => res,
        }
    } else {
        let res = launch();
        if res != CUresult::SUCCESS {
            region.sm_correct(dev, cost as i64, 0);
        }
        res
    };
    if !open && (sample || n % SAMPLE_EVERY_EARLY == SAMPLE_EVERY_EARLY / 2) && PENDING_N.load(Relaxed) > 0 {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| collect(st)));
    }
    res
}

/// Waits (sleeping) until the budget admits a launch of `cost`.
fn throttle(st: &State, region: &vgpu_region::Region, dev: usize, pct: u32, cost: u64) {
    let mut waited = 0;
    while let Err(wait) = region.sm_admit(dev, pct, now_coarse(), cost) {
        // Measurements that finished while we wait may pay the debt back sooner.
        collect(st);
        let w = wait.min(MAX_SLEEP_NS);
        std::thread::sleep(std::time::Duration::from_nanos(w));
        waited += w;
        if applies(st, dev).is_none() {
            break; // the limit was lifted meanwhile
        }
    }
    region.sm_note_wait(dev, waited);
}

/// Runs `launch` between two events and queues the measurement.
fn measure(
    region: &vgpu_region::Region,
    key: u64,
    dev: usize,
    cost: u64,
    stream: CUstream,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    let rec = driver().helpers.cuEventRecord;
    let bracket = rec.and_then(|r| Some((r, event()?, event()?)));
    if let Some((r, e0, _)) = bracket {
        // SAFETY: recording our own event on the caller's stream, before its launch.
        unsafe { r(e0, stream) };
    }
    let res = launch();
    if res != CUresult::SUCCESS {
        region.sm_correct(dev, cost as i64, 0);
    }
    if let Some((r, e0, e1)) = bracket {
        // SAFETY: as above, after the launch.
        if res == CUresult::SUCCESS && unsafe { r(e1, stream) } == CUresult::SUCCESS {
            if let Ok(mut p) = PENDING.lock() {
                p.push(Sample { key, dev, charged: cost, start: e0, end: e1 });
                PENDING_N.fetch_add(1, Relaxed);
            }
        } else {
            spare([e0, e1]);
        }
    }
    res
}

pub unsafe fn launch_kernel(
    real: f::cuLaunchKernel,
    k: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shm: u32,
    s: CUstream,
    p: *mut *mut c_void,
    e: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(kernel_key(k, gx, gy, gz), s, || unsafe { real(k, gx, gy, gz, bx, by, bz, shm, s, p, e) })
}

pub unsafe fn launch_kernel_ptsz(
    real: f::cuLaunchKernel_ptsz,
    k: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shm: u32,
    s: CUstream,
    p: *mut *mut c_void,
    e: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(kernel_key(k, gx, gy, gz), ptsz(s), || unsafe { real(k, gx, gy, gz, bx, by, bz, shm, s, p, e) })
}

pub unsafe fn launch_kernel_ex(
    real: f::cuLaunchKernelEx,
    c: *const CUlaunchConfig,
    k: CUfunction,
    p: *mut *mut c_void,
    e: *mut *mut c_void,
) -> CUresult {
    // SAFETY: optional input pointer from the caller.
    let (s, key) = match unsafe { c.as_ref() } {
        Some(c) => (c.hStream, kernel_key(k, c.gridDimX, c.gridDimY, c.gridDimZ)),
        None => (std::ptr::null_mut(), kernel_key(k, 0, 0, 0)),
    };
    admit(key, s, || unsafe { real(c, k, p, e) })
}

pub unsafe fn launch_kernel_ex_ptsz(
    real: f::cuLaunchKernelEx_ptsz,
    c: *const CUlaunchConfig,
    k: CUfunction,
    p: *mut *mut c_void,
    e: *mut *mut c_void,
) -> CUresult {
    // SAFETY: optional input pointer from the caller.
    let (s, key) = match unsafe { c.as_ref() } {
        Some(c) => (c.hStream, kernel_key(k, c.gridDimX, c.gridDimY, c.gridDimZ)),
        None => (std::ptr::null_mut(), kernel_key(k, 0, 0, 0)),
    };
    admit(key, ptsz(s), || unsafe { real(c, k, p, e) })
}

pub unsafe fn launch_cooperative(
    real: f::cuLaunchCooperativeKernel,
    k: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shm: u32,
    s: CUstream,
    p: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(kernel_key(k, gx, gy, gz), s, || unsafe { real(k, gx, gy, gz, bx, by, bz, shm, s, p) })
}

pub unsafe fn launch_cooperative_ptsz(
    real: f::cuLaunchCooperativeKernel_ptsz,
    k: CUfunction,
    gx: u32,
    gy: u32,
    gz: u32,
    bx: u32,
    by: u32,
    bz: u32,
    shm: u32,
    s: CUstream,
    p: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(kernel_key(k, gx, gy, gz), ptsz(s), || unsafe { real(k, gx, gy, gz, bx, by, bz, shm, s, p) })
}

/// The multi-device cooperative launch is charged as one launch of its first kernel on the current
/// device (the form is deprecated; every device's kernel runs the same time in a cooperative launch).
pub unsafe fn launch_cooperative_multi(
    real: f::cuLaunchCooperativeKernelMultiDevice,
    list: *mut CUDA_LAUNCH_PARAMS,
    n: u32,
    flags: u32,
) -> CUresult {
    // SAFETY: optional input pointer from the caller.
    let Some(first) = (unsafe { list.as_ref() }) else { return unsafe { real(list, n, flags) } };
    let key = kernel_key(first.function, first.gridDimX, first.gridDimY, first.gridDimZ);
    admit(key, first.hStream, || unsafe { real(list, n, flags) })
}

/// The deprecated launches run on the default stream (`cuLaunch`: a 1 x 1 grid), or on `s`.
pub unsafe fn launch_legacy(real: f::cuLaunch, k: CUfunction) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(kernel_key(k, 1, 1, 1), std::ptr::null_mut(), || unsafe { real(k) })
}

pub unsafe fn launch_grid(real: f::cuLaunchGrid, k: CUfunction, w: i32, h: i32) -> CUresult {
    // SAFETY: as above.
    admit(kernel_key(k, w as u32, h as u32, 1), std::ptr::null_mut(), || unsafe { real(k, w, h) })
}

pub unsafe fn launch_grid_async(real: f::cuLaunchGridAsync, k: CUfunction, w: i32, h: i32, s: CUstream) -> CUresult {
    // SAFETY: as above.
    admit(kernel_key(k, w as u32, h as u32, 1), s, || unsafe { real(k, w, h, s) })
}

pub unsafe fn graph_launch(real: f::cuGraphLaunch, g: CUgraphExec, s: CUstream) -> CUresult {
    admit(g as u64, s, || unsafe { real(g, s) })
}

pub unsafe fn graph_launch_ptsz(real: f::cuGraphLaunch_ptsz, g: CUgraphExec, s: CUstream) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    admit(g as u64, ptsz(s), || unsafe { real(g, s) })
}

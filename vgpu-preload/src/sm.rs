//! SM-time quotas: every launch path passes through [`admit`], which charges the container's shared
//! budget (a token bucket in the region, in ns of GPU time) with the launch's estimated GPU time and
//! sleeps while the budget is in debt. Estimates come from the GPU itself: one launch in
//! `SAMPLE_EVERY` per kernel (and every kernel's first) is bracketed by events, read later without
//! blocking, and the budget is corrected by the difference.
#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::capture::{self, ptsz};
use crate::config::CorePolicy;
use crate::graphmem;
use crate::real::{cuda_fns as f, driver};
use crate::state::{state, State};
use cuda_abi::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::*};
use std::sync::Mutex;
use vgpu_region::MAX_DEVICES;

/// One launch in this many of each kernel is measured (and its first): often at first, then less, as
/// the estimate settles.
const SAMPLE_EVERY_EARLY: u64 = 16;
const SAMPLE_EVERY: u64 = 128;
const EARLY_LAUNCHES: u64 = 1024;
/// Launches estimated at this much GPU time or more are measured one in `SAMPLE_EVERY_LONG`: two
/// event records cost nothing next to them, and the 8 measurements an estimate is the smallest of
/// then span 32 launches, so a kernel or graph that keeps getting longer (a decode step's attention
/// as the context grows) is followed closely.
const LONG_NS: u64 = 200_000;
const SAMPLE_EVERY_LONG: u64 = 4;
/// Charge for a kernel never measured yet.
const FIRST_GUESS_NS: u64 = 100_000;
/// Most measurements in flight per process; launches beyond are charged their estimate unmeasured.
const MAX_PENDING: u64 = 256;
/// Longest single sleep; the budget is re-read after each.
const MAX_SLEEP_NS: u64 = 20_000_000;
/// GPU time a thread charges to the shared budget ahead of its launches (see [`Credit`]).
const PREPAY_NS: u64 = 50_000;

use crate::clock::{now_coarse, now_precise};

/// Per-process estimates of a kernel's (or graph's) GPU time, keyed by function and grid (see
/// [`kernel_key`]) or by graph handle.
///
/// An estimate is the smallest of the kernel's last `WINDOW` measurements: a bracket of events can
/// only be inflated (by queueing behind other work on the GPU), so the minimum of a few recent ones is
/// close to the kernel's own time, while a kernel that really became slower is followed within
/// `WINDOW` measurements.
///
/// A long-running server can launch more (function, grid) pairs than the table holds (an attention
/// kernel's grid follows the batch and the longest sequence), so an entry not used for a while is
/// given to a new key when the new key's probe window has no free entry: the least recently used of
/// the window that has not been launched for two epochs of about a second (the epoch is the coarse
/// clock's seconds, advanced when measurements are collected: a cold path).
struct Estimates {
    /// Per entry: key, launch count, estimate, next ring position, epoch of last use, then the ring
    /// of measurements.
    slots: Box<[Entry]>,
    epoch: AtomicU64,
}

type Entry = [AtomicU64; RING + WINDOW];
const WINDOW: usize = 8;
/// Index of the ring's first measurement in an entry.
const RING: usize = 5;
/// log2 of the number of entries: 8192 (832 KiB, allocated at the first limited launch). One
/// function launched with many grids takes one entry per grid.
const TABLE_BITS: u32 = 13;
/// Entries a key may occupy: this many from its hash on.
const PROBES: usize = 32;
/// An entry is given to another key only when unused for more than this many epochs (2^30 ns each).
const IDLE_EPOCHS: u64 = 2;

impl Estimates {
    fn new() -> Estimates {
        Estimates {
            slots: (0..1 << TABLE_BITS).map(|_| std::array::from_fn(|_| AtomicU64::new(0))).collect(),
            epoch: AtomicU64::new(0),
        }
    }

    #[inline]
    fn entry(&self, key: u64, insert: bool) -> Option<&Entry> {
        let mask = self.slots.len() - 1;
        let h = ((key >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - TABLE_BITS)) as usize;
        for i in 0..PROBES {
            let s = &self.slots[(h + i) & mask];
            let k = s[0].load(Acquire);
            if k == key || (insert && k == 0 && s[0].compare_exchange(0, key, AcqRel, Acquire).is_ok()) {
                return Some(s);
            }
            if k == 0 {
                return None;
            }
        }
        if insert {
            self.evict_for(key, h)
        } else {
            None
        }
    }

    /// Gives `key` the least recently used entry of its probe window, if one is idle.
    #[cold]
    fn evict_for(&self, key: u64, h: usize) -> Option<&Entry> {
        let mask = self.slots.len() - 1;
        let now = self.epoch.load(Relaxed);
        let s = (0..PROBES).map(|i| &self.slots[(h + i) & mask]).min_by_key(|s| s[4].load(Relaxed))?;
        let old = s[0].load(Acquire);
        if s[4].load(Relaxed) + IDLE_EPOCHS >= now || s[0].compare_exchange(old, key, AcqRel, Acquire).is_err() {
            return None;
        }
        // The entry is this key's now: start it afresh. (A measurement of the old key that was
        // being folded in at this very moment may land in the new ring: one sample among 8.)
        for x in &s[1..] {
            x.store(0, Relaxed);
        }
        s[4].store(now, Relaxed);
        Some(s)
    }

    /// (estimate in ns, 0 when unknown; launch count of this kernel before this one). A key the
    /// table cannot hold (its window busy) is unknown at every launch.
    #[inline]
    fn get(&self, key: u64) -> (u64, u64) {
        let Some(s) = self.entry(key, true) else { return (0, 0) };
        let now = self.epoch.load(Relaxed);
        if s[4].load(Relaxed) != now {
            s[4].store(now, Relaxed);
        }
        // The count only paces the sampling: a plain load and store (no locked instruction), as an
        // increment lost to another thread's launch of the same kernel changes nothing that matters.
        let n = s[1].load(Relaxed);
        s[1].store(n + 1, Relaxed);
        (s[2].load(Relaxed), n)
    }

    /// Folds a measurement in; returns the new estimate.
    fn learn(&self, key: u64, ns: u64) -> u64 {
        let ns = ns.max(1);
        let Some(s) = self.entry(key, false) else { return ns };
        let pos = s[3].fetch_add(1, Relaxed) as usize % WINDOW;
        s[RING + pos].store(ns, Relaxed);
        let est = s[RING..].iter().map(|x| x.load(Relaxed)).filter(|&x| x > 0).min().unwrap_or(ns);
        s[2].store(est, Relaxed);
        est
    }

    /// Forgets `key`'s estimate, count and measurements (the entry stays the key's, so that the keys
    /// probed past it are still found): its next launch is measured as if it were its first.
    fn forget(&self, key: u64) {
        if let Some(s) = self.entry(key, false) {
            Self::reset(s);
        }
    }

    /// Forgets every estimate (the entries keep their keys and epochs, as above).
    fn forget_all(&self) {
        self.slots.iter().for_each(Self::reset);
    }

    fn reset(s: &Entry) {
        for (i, x) in s.iter().enumerate() {
            if i != 0 && i != 4 {
                x.store(0, Relaxed);
            }
        }
    }

    /// Advances the epoch to `now` (monotonic ns) when measurements are collected.
    fn tick(&self, now: u64) {
        self.epoch.fetch_max(now >> 30, Relaxed);
    }
}

/// The estimate key of a kernel launch: its function and its grid. A kernel's GPU time mostly
/// follows its grid (a GEMM's or an attention kernel's grid grows with the batch and the sequence),
/// and an estimate is the smallest recent measurement, so one estimate for every grid of a function
/// would charge each launch as if it were the smallest. The grid's dimensions are packed without
/// overlap (x < 2^31, y and z < 2^16 on every GPU) and multiplied by an odd constant, so two grids of
/// one function never share a key. Never 0 (the table's empty key).
#[inline]
fn kernel_key(f: CUfunction, gx: u32, gy: u32, gz: u32) -> u64 {
    let grid = (gx as u64 & 0x7FFF_FFFF) | (gy as u64 & 0xFFFF) << 31 | (gz as u64 & 0xFFFF) << 47;
    ((f as u64) ^ grid.wrapping_mul(0x9E37_79B9_7F4A_7C15)).max(1)
}

/// Stream and estimate key of a `cuLaunchKernelEx` launch (its configuration may be NULL, which the
/// driver refuses).
fn ex_launch(c: *const CUlaunchConfig, k: CUfunction) -> (CUstream, u64) {
    // SAFETY: an optional input pointer from the caller.
    match unsafe { c.as_ref() } {
        Some(c) => (c.hStream, kernel_key(k, c.gridDimX, c.gridDimY, c.gridDimZ)),
        None => (std::ptr::null_mut(), kernel_key(k, 0, 0, 0)),
    }
}

struct Sample {
    // Event handles are plain pointers owned by this module; samples move between threads only
    // under the PENDING lock.
    key: u64,
    dev: usize,
    charged: u64,
    stream: CUstream,
    /// The context the events were made in (the stream's).
    ctx: u64,
    start: CUevent,
    end: CUevent,
    /// Host ns from the start event's record to the launch call's return, where the stream had no
    /// work left when the start event was recorded (see [`kernel_ns`]); 0 otherwise.
    idle_gap: u64,
}

// SAFETY: a Sample holds event handles created by this process; CUDA events may be queried and
// destroyed from any thread, and samples only move between threads under the PENDING lock.
unsafe impl Send for Sample {}

/// Measurements in flight (process-wide; touched only by measured launches and collections).
static PENDING: Mutex<Vec<Sample>> = Mutex::new(Vec::new());
static PENDING_N: AtomicU64 = AtomicU64::new(0);
/// Events ready for reuse, each with the context it was made in (an event can be recorded only on a
/// stream of its own context, and goes with that context), as addresses.
static SPARE_EVENTS: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());
/// A child forked from a process that measured launches: it inherited events (and possibly locks
/// held by threads it does not have) from a CUDA it cannot use, so it measures nothing.
static NO_MEASURING: AtomicBool = AtomicBool::new(false);
/// Timing events failed for this process (an event could not be timed): launches are timed by
/// their stream's completion from then on.
static EVENTS_FAIL: AtomicBool = AtomicBool::new(false);

static ESTIMATES: std::sync::OnceLock<Estimates> = std::sync::OnceLock::new();

fn estimates() -> &'static Estimates {
    ESTIMATES.get_or_init(Estimates::new)
}

/// Forgets the estimate of `key` (an executable graph whose work changed, see `stale`), with its
/// measurements still in flight: they timed the old work. Under the measurements' lock, which every
/// folding-in holds, so none of them lands after the reset.
pub fn forget(key: u64) {
    forget_where(|e| e.forget(key), |k| k == key);
}

/// Forgets every estimate (a module was unloaded, see `stale`), with every measurement in flight.
pub fn forget_all() {
    forget_where(Estimates::forget_all, |_| true);
}

fn forget_where(reset: impl FnOnce(&Estimates), dropped: impl Fn(u64) -> bool) {
    let Some(e) = ESTIMATES.get() else { return }; // nothing launched under a limit yet
    let mut p = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    reset(e);
    let before = p.len();
    let mut events = Vec::new();
    p.retain(|s| {
        let keep = !dropped(s.key);
        if !keep {
            events.push((s.ctx, s.start as usize));
            events.push((s.ctx, s.end as usize));
        }
        keep
    });
    PENDING_N.fetch_sub((before - p.len()) as u64, Relaxed);
    drop(p);
    if let Ok(mut s) = SPARE_EVENTS.lock() {
        s.extend(events);
    }
}

/// The events of a context about to end (see `memory::Going`), spare and in measurements in flight,
/// taken out before the driver is asked: once it has ended the context, they are dangling handles
/// (the driver destroyed them with it), and the same context handle may at once name another
/// thread's new context, which must not be given them, nor have a collection ask about them.
#[derive(Default)]
pub struct Events {
    spare: Vec<(u64, usize)>,
    pending: Vec<Sample>,
}

/// Takes the events of context `ctx` (0: a context this process cannot name, whose events cannot be
/// told from the others': every event) out of use.
#[cold]
pub fn take_events(ctx: u64) -> Events {
    let mut out = Events::default();
    // None made yet; or a forked child, whose events are its parent's CUDA's (and whose locks a
    // thread it does not have may hold).
    if ESTIMATES.get().is_none() || NO_MEASURING.load(Relaxed) {
        return out;
    }
    let mine = |c: u64| ctx == 0 || c == ctx;
    // PENDING before SPARE_EVENTS, the order a collection takes them in.
    let mut p = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    let (gone, kept) = p.drain(..).partition(|s| mine(s.ctx));
    (out.pending, *p) = (gone, kept);
    PENDING_N.fetch_sub(out.pending.len() as u64, Relaxed);
    let mut s = SPARE_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    let (gone, kept) = s.drain(..).partition(|&(c, _)| mine(c));
    (out.spare, *s) = (gone, kept);
    out
}

/// The driver refused to end the context: its events are still good.
#[cold]
pub fn put_back(e: Events) {
    if e.spare.is_empty() && e.pending.is_empty() {
        return;
    }
    let mut p = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    PENDING_N.fetch_add(e.pending.len() as u64, Relaxed);
    p.extend(e.pending);
    SPARE_EVENTS.lock().unwrap_or_else(|p| p.into_inner()).extend(e.spare);
}

/// GPU time (ns, per device) the thread has charged to the container's budget for launches it has
/// not made yet. The budget in the region is shared by every thread of every process of the
/// container, so charging it is a locked instruction on a shared cache line, the largest single cost
/// of the limited launch path; a thread whose credit does not cover a launch while the budget is
/// positive charges the launch and the next `PREPAY_NS` at once, and launches within that credit
/// touch nothing shared. What it changes: up to `PREPAY_NS` per thread and device is charged early
/// (nothing is charged twice or lost, so the share over any window longer than that is the same),
/// and a thread may spend its credit while the budget is in debt (it was paid while it was not).
/// What a thread leaves unspent goes back to the budget when it exits (not when its process ends
/// while it runs: that credit was charged and is not used); a forked child starts with none (see
/// [`after_fork`]).
struct Credit {
    ns: [Cell<u64>; MAX_DEVICES],
    /// The budget the credit was charged to (the process's region, which is never unmapped).
    region: Cell<Option<&'static vgpu_region::Region>>,
}

impl Drop for Credit {
    fn drop(&mut self) {
        let Some(region) = self.region.get() else { return };
        for (dev, c) in self.ns.iter().enumerate() {
            if c.get() > 0 {
                region.sm_correct(dev, c.replace(0) as i64, 0);
            }
        }
    }
}

thread_local! {
    static CREDIT: Credit = const { Credit { ns: [const { Cell::new(0) }; MAX_DEVICES], region: Cell::new(None) } };
}

/// Charges a launch of `cost` on `dev` to the thread's credit or, when that does not cover it and
/// the budget is positive, tops the credit up from the budget. False: the budget is in debt.
#[inline]
fn charge(region: &'static vgpu_region::Region, dev: usize, cost: u64) -> bool {
    CREDIT
        .try_with(|c| {
            let ns = &c.ns[dev];
            let have = ns.get();
            if have >= cost {
                ns.set(have - cost);
                true
            } else if region.sm_try_charge(dev, cost - have + PREPAY_NS) {
                ns.set(PREPAY_NS);
                c.region.set(Some(region));
                true
            } else {
                false
            }
        })
        // The thread is exiting (its credit already went back): the launch alone.
        .unwrap_or_else(|_| region.sm_try_charge(dev, cost))
}

/// A forked child: the forking thread's credit was paid by the parent (and goes back there).
pub fn after_fork() {
    let _ = CREDIT.try_with(|c| c.ns.iter().for_each(|x| x.set(0)));
    if ESTIMATES.get().is_some() {
        NO_MEASURING.store(true, Relaxed);
    }
}

/// The SM percentage that applies to `dev` now, or None.
#[inline]
fn applies(st: &State, dev: usize) -> Option<u32> {
    let pct = st.sm_limit(dev);
    // An MPS client's share is its partition, which MPS holds it to (see `mps`).
    if pct == 0 || pct >= 100 || crate::mps::client() {
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

/// An event of context `ctx`: a spare one, else a new one (made with `ctx` current, as events are
/// made in the current context). None when neither can be had: the launch is not measured.
fn event(ctx: u64) -> Option<CUevent> {
    if ctx == 0 {
        return None;
    }
    if let Ok(mut s) = SPARE_EVENTS.lock() {
        if let Some(i) = s.iter().rposition(|&(c, _)| c == ctx) {
            return Some(s.swap_remove(i).1 as CUevent);
        }
    }
    let create = driver().helpers.cuEventCreate?;
    let mut e = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; default flags (timing enabled).
    let made = crate::drv::with_context(ctx, || unsafe { create(&mut e, 0) })?;
    (made == CUresult::SUCCESS).then_some(e)
}

fn spare(ctx: u64, events: &[CUevent]) {
    if let Ok(mut s) = SPARE_EVENTS.lock() {
        s.extend(events.iter().filter(|e| !e.is_null()).map(|&e| (ctx, e as usize)));
    }
}

/// Counts a launch that could not be timed with events (the agent shows the count) and says why,
/// once per process, at the default log level: the limit then rests on synchronising the stream
/// around the measured launches (see [`by_synchronising`]), which costs the measured launches
/// their overlap with earlier work but keeps the limit.
#[cold]
fn unmeasured(region: &vgpu_region::Region, dev: usize, why: &str) {
    static SAID: AtomicBool = AtomicBool::new(false);
    region.note_unmeasured(dev);
    if !SAID.swap(true, Relaxed) {
        crate::log::vlog!(
            crate::log::WARN,
            "SM limit: a launch on device {dev} could not be timed with events ({why}); measured launches are \
             timed by synchronising their stream instead"
        );
    }
}

/// Nothing times launches (events and stream synchronisation both fail): each is charged
/// [`BLIND_NS`] at least.
static BLIND: AtomicBool = AtomicBool::new(false);
/// What a launch is charged at least when nothing can time it: a long kernel's time, so that the
/// limit errs toward holding the container back.
const BLIND_NS: u64 = 2_000_000;

/// Times a launch that events cannot: the stream is drained first, then the launch runs and the
/// stream is drained again; the time between is the launch's (its call's host time included, an
/// upper bound). Where synchronising fails too, nothing measures: launches are charged at least
/// [`BLIND_NS`] from then on, and that is said once.
#[cold]
fn by_synchronising(
    region: &vgpu_region::Region,
    key: u64,
    dev: usize,
    cost: u64,
    stream: CUstream,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    let sync = driver().cuda.cuStreamSynchronize;
    // SAFETY: the caller's stream, as the launch itself is given it.
    let drained = sync.is_some_and(|f| unsafe { f(stream) } == CUresult::SUCCESS);
    let since = now_precise();
    let res = launch();
    if res != CUresult::SUCCESS {
        region.sm_correct(dev, cost as i64, 0);
        return res;
    }
    // SAFETY: the caller's stream again, which the launch was just given.
    if drained && sync.is_some_and(|f| unsafe { f(stream) } == CUresult::SUCCESS) {
        let ns = estimates().learn(key, now_precise().saturating_sub(since));
        region.sm_correct(dev, cost as i64 - ns as i64, ns);
    } else if !BLIND.swap(true, Relaxed) {
        crate::log::vlog!(
            crate::log::WARN,
            "SM limit: launches can be timed neither with events nor by synchronising their stream; each is \
             charged at least {} us of GPU time",
            BLIND_NS / 1000
        );
    }
    res
}

/// Reads finished measurements without blocking and corrects the budget.
fn collect(st: &State) {
    let h = &driver().helpers;
    let (Some(query), Some(elapsed)) = (h.cuEventQuery, h.cuEventElapsedTime) else { return };
    if capture::any_open() || NO_MEASURING.load(Relaxed) {
        return;
    }
    let Ok(mut p) = PENDING.try_lock() else { return };
    estimates().tick(now_coarse());
    let before = p.len();
    sweep(
        &mut p,
        // SAFETY: events we created and recorded.
        |s| unsafe { query(s.end) },
        |s, q| {
            let mut ms = 0f32;
            // SAFETY: events we created and recorded, both on the same stream, and an out-pointer
            // to a local.
            let e = if q == CUresult::SUCCESS { unsafe { elapsed(&mut ms, s.start, s.end) } } else { q };
            if let Some(r) = st.region.as_ref() {
                if e == CUresult::SUCCESS {
                    // The launch is charged what the updated estimate says, not the raw
                    // measurement, which includes any time spent queued behind other work.
                    let ns = estimates().learn(s.key, kernel_ns((ms as f64 * 1e6) as u64, s.idle_gap));
                    r.sm_correct(s.dev, s.charged as i64 - ns as i64, ns);
                } else {
                    // The events cannot be timed: measured launches synchronise from now on.
                    EVENTS_FAIL.store(true, Relaxed);
                    unmeasured(r, s.dev, "cuEventQuery or cuEventElapsedTime failed");
                }
            }
            spare(s.ctx, &[s.start, s.end]);
        },
    );
    PENDING_N.fetch_sub((before - p.len()) as u64, Relaxed);
}

/// The least GPU time a measured launch is taken to occupy once its stream's idle time is taken out
/// of the measurement: what a GPU takes to start and finish the smallest kernel.
const MIN_KERNEL_NS: u64 = 1_000;

/// The GPU time of a launch from its bracket of events (`bracket` ns between them). Where its stream
/// was idle when the start event was recorded (`idle_gap` > 0), the GPU reached that event at once
/// and then waited for the launch's own work, which the driver queued only by the end of the
/// launch call: a tiny kernel whose call takes 3 us of host time measured as 3 us longer than it
/// ran (on an H200, a stream of small launches was charged more GPU time than wall time passed, so
/// a 99 % limit throttled it). That wait is at most the host time from the start event's record
/// to the call's return (`idle_gap`) and is taken out, down to `MIN_KERNEL_NS`. Where the stream
/// was busy, the start event waited behind earlier work and the launch was queued by then: the
/// bracket stands.
fn kernel_ns(bracket: u64, idle_gap: u64) -> u64 {
    if idle_gap == 0 {
        return bracket;
    }
    bracket.saturating_sub(idle_gap).max(MIN_KERNEL_NS.min(bracket))
}

/// A collection stops asking once this many streams have answered "not ready".
const MAX_BUSY_STREAMS: usize = 16;

/// Takes the measurements whose end event is done out of `pending`, oldest first and keeping the
/// order of the rest, and hands each to `done` with the driver's answer. It asks the driver as
/// little as it can: a stream runs its work in order, so once one of its events is not done, its
/// later ones are not asked about; and after `MAX_BUSY_STREAMS` streams have said "not ready", the
/// pass ends. (Before, every measurement in flight was asked about at every collection, one in 16
/// launches: up to 256 driver calls where the GPU's queue is deep.) A stream is told by its context
/// and handle: every context's default stream has the same handle. Two threads' per-thread default
/// streams of one context share a handle too, so one of them may wait for the other's event: a
/// delay, never a wrong measurement.
fn sweep(
    pending: &mut Vec<Sample>,
    mut query: impl FnMut(&Sample) -> CUresult,
    mut done: impl FnMut(&Sample, CUresult),
) {
    let mut busy = [(0, std::ptr::null_mut()); MAX_BUSY_STREAMS];
    let mut n = 0;
    pending.retain(|s| {
        if n == MAX_BUSY_STREAMS || busy[..n].contains(&(s.ctx, s.stream)) {
            return true;
        }
        let q = query(s);
        if q == CUresult::NOT_READY {
            busy[n] = (s.ctx, s.stream);
            n += 1;
            return true;
        }
        done(s, q);
        false
    });
}

static GEN: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());
static SEEN: AtomicU64 = AtomicU64::new(u64::MAX);
static ANY: AtomicBool = AtomicBool::new(false);

/// Whether any device of the container has an SM limit, or a priority gate applies; the launch
/// hooks skip everything else when not. Cached process-wide and re-evaluated only when the limits' generation changes, so the
/// common answer costs two loads.
#[inline]
pub fn engaged() -> bool {
    if crate::priority::engaged() {
        return true;
    }
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

/// Whether a launch is measured: a kernel's first (estimate unknown), then one in
/// `SAMPLE_EVERY_EARLY` of its first `EARLY_LAUNCHES`, one in `SAMPLE_EVERY` afterwards, and one in
/// `SAMPLE_EVERY_LONG` while it is estimated at `LONG_NS` or more (`n`: its launches before this one);
/// never while `MAX_PENDING` measurements are in flight (each collection queries every one of them).
#[inline]
fn sampled(est: u64, n: u64, pending: u64) -> bool {
    let every = if est >= LONG_NS {
        SAMPLE_EVERY_LONG
    } else if n < EARLY_LAUNCHES {
        SAMPLE_EVERY_EARLY
    } else {
        SAMPLE_EVERY
    };
    (est == 0 || n.is_multiple_of(every)) && pending < MAX_PENDING
}

/// The device whose budget a launch into `stream` is charged to: the stream's
/// (`locate::stream_dev`: a stream the process made is asked for its context once per thread, and
/// it need not be the current one, as a context-independent `CUkernel` may be launched into a
/// stream of any context); without a driver call when the process sees one device.
#[inline]
fn launch_dev(st: &State, stream: CUstream) -> Result<usize, CUresult> {
    if st.sees_one_device() {
        return st.launch_dev();
    }
    crate::locate::stream_dev(st, stream).map(|(_, d)| d)
}

/// Admits one launch of `key` on `stream` (waiting while the budget is in debt), then runs `launch`.
#[inline]
fn admit(key: u64, stream: CUstream, launch: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
    let Ok(dev) = launch_dev(st, stream) else { return launch() };
    let pct = applies(st, dev);
    let gate = crate::priority::role(st, dev);
    let Some(region) = st.region.as_ref() else { return launch() };
    if pct.is_none() && matches!(gate, crate::priority::Role::Free) {
        return launch();
    }
    if capture::capturing(stream) {
        return launch(); // becomes a graph node; charged when the graph is launched
    }
    // While any capture is open, no timing events are recorded or queried (see `capture`).
    let open = capture::any_open();
    let (est, n) = estimates().get(key);
    let sample = !open && sampled(est, n, PENDING_N.load(Relaxed)) && !NO_MEASURING.load(Relaxed);
    let cost = if est == 0 { FIRST_GUESS_NS } else { est };
    let cost = if BLIND.load(Relaxed) { cost.max(BLIND_NS) } else { cost };
    if let Some(pct) = pct {
        if !charge(region, dev, cost) {
            // The slow path sleeps and reads the clock; a panic in it must not unwind into C.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| throttle(st, region, dev, pct, cost))).is_err()
            {
                crate::log::vlog!(crate::log::ERROR, "internal error while throttling; launching unthrottled");
            }
        }
    }
    match gate {
        crate::priority::Role::Normal(own) => {
            // Sleeps and reads the clock; a panic in it must not unwind into C.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                crate::priority::wait_normal(st, own, dev, cost)
            }));
        }
        crate::priority::Role::High(own) => crate::priority::note_high(own, dev, cost),
        crate::priority::Role::Free => {}
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
        if res != CUresult::SUCCESS && pct.is_some() {
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

/// Runs `launch` between two events and queues the measurement. Where events cannot be had or
/// recorded (the stream's context unknown, an event refused), or timing them failed before, the
/// launch is timed by synchronising its stream instead ([`by_synchronising`]), and counted.
fn measure(
    region: &vgpu_region::Region,
    key: u64,
    dev: usize,
    cost: u64,
    stream: CUstream,
    launch: impl FnOnce() -> CUresult,
) -> CUresult {
    let h = &driver().helpers;
    let rec = h.cuEventRecord;
    // The events must be of the stream's context, which need not be the current one; where the
    // driver cannot say which that is, the current one (most streams are of it).
    let ctx = match crate::drv::stream_ctx(stream) {
        0 => crate::drv::current_ctx(),
        c => c,
    };
    let bracket = rec.filter(|_| !EVENTS_FAIL.load(Relaxed)).and_then(|r| {
        let e0 = event(ctx)?;
        match event(ctx) {
            Some(e1) => Some((r, e0, e1)),
            None => {
                spare(ctx, &[e0]);
                None
            }
        }
    });
    let Some((r, e0, e1)) = bracket else {
        let why = if EVENTS_FAIL.load(Relaxed) {
            "timing events failed before"
        } else {
            "no timing event for the stream's context: cuStreamGetCtx, cuCtxGetCurrent or cuEventCreate failed"
        };
        unmeasured(region, dev, why);
        return by_synchronising(region, key, dev, cost, stream, launch);
    };
    // Whether the stream has no work left (then the start event fires at once and the measurement
    // includes the launch call's host time; see `kernel_ns`). Asked only for launches shorter than
    // `LONG_NS`: next to longer ones that time is noise.
    // SAFETY: the caller's stream, as the launch itself is given it.
    let idle = cost < LONG_NS && h.cuStreamQuery.is_some_and(|q| unsafe { q(stream) } == CUresult::SUCCESS);
    // SAFETY: recording our own event on the caller's stream, before its launch.
    if unsafe { r(e0, stream) } != CUresult::SUCCESS {
        spare(ctx, &[e0, e1]);
        EVENTS_FAIL.store(true, Relaxed);
        unmeasured(region, dev, "cuEventRecord failed");
        return by_synchronising(region, key, dev, cost, stream, launch);
    }
    let recorded = if idle { now_precise() } else { 0 };
    let res = launch();
    let idle_gap = if idle { now_precise().saturating_sub(recorded).max(1) } else { 0 };
    if res != CUresult::SUCCESS {
        region.sm_correct(dev, cost as i64, 0);
        spare(ctx, &[e0, e1]);
        return res;
    }
    // SAFETY: recording our own event on the caller's stream, after its launch.
    if unsafe { r(e1, stream) } == CUresult::SUCCESS {
        if let Ok(mut p) = PENDING.lock() {
            p.push(Sample { key, dev, charged: cost, stream, ctx, start: e0, end: e1, idle_gap });
            PENDING_N.fetch_add(1, Relaxed);
        }
    } else {
        spare(ctx, &[e0, e1]);
        EVENTS_FAIL.store(true, Relaxed);
        unmeasured(region, dev, "cuEventRecord failed");
    }
    res
}

/// The stream a launch runs on as the policy sees it: a `_ptsz` twin's (`PER_THREAD`) default
/// stream is the calling thread's.
#[inline]
fn on<const PER_THREAD: bool>(s: CUstream) -> CUstream {
    if PER_THREAD {
        ptsz(s)
    } else {
        s
    }
}

/// `cuLaunchKernel` and its `_ptsz` twin.
pub unsafe fn launch_kernel<const PER_THREAD: bool>(
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
    admit(kernel_key(k, gx, gy, gz), on::<PER_THREAD>(s), || forward!(real, k, gx, gy, gz, bx, by, bz, shm, s, p, e))
}

/// `cuLaunchKernelEx` and its `_ptsz` twin.
pub unsafe fn launch_kernel_ex<const PER_THREAD: bool>(
    real: f::cuLaunchKernelEx,
    c: *const CUlaunchConfig,
    k: CUfunction,
    p: *mut *mut c_void,
    e: *mut *mut c_void,
) -> CUresult {
    let (s, key) = ex_launch(c, k);
    admit(key, on::<PER_THREAD>(s), || forward!(real, c, k, p, e))
}

/// `cuLaunchCooperativeKernel` and its `_ptsz` twin.
pub unsafe fn launch_cooperative<const PER_THREAD: bool>(
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
    admit(kernel_key(k, gx, gy, gz), on::<PER_THREAD>(s), || forward!(real, k, gx, gy, gz, bx, by, bz, shm, s, p))
}

/// The multi-device cooperative launch is charged as one launch of its first kernel on the current
/// device (the form is deprecated; every device's kernel runs the same time in a cooperative launch).
pub unsafe fn launch_cooperative_multi(
    real: f::cuLaunchCooperativeKernelMultiDevice,
    list: *mut CUDA_LAUNCH_PARAMS,
    n: u32,
    flags: u32,
) -> CUresult {
    // SAFETY: optional input pointer from the caller, NULL or valid for reads (the hook's contract).
    let first = unsafe { list.as_ref() };
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point.
    let launch = || unsafe { real(list, n, flags) };
    let Some(first) = first else { return launch() };
    let key = kernel_key(first.function, first.gridDimX, first.gridDimY, first.gridDimZ);
    admit(key, first.hStream, launch)
}

/// The deprecated launches run on the default stream (`cuLaunch`: a 1 x 1 grid), or on `s`.
pub unsafe fn launch_legacy(real: f::cuLaunch, k: CUfunction) -> CUresult {
    admit(kernel_key(k, 1, 1, 1), std::ptr::null_mut(), || forward!(real, k))
}

pub unsafe fn launch_grid(real: f::cuLaunchGrid, k: CUfunction, w: i32, h: i32) -> CUresult {
    admit(kernel_key(k, w as u32, h as u32, 1), std::ptr::null_mut(), || forward!(real, k, w, h))
}

pub unsafe fn launch_grid_async(real: f::cuLaunchGridAsync, k: CUfunction, w: i32, h: i32, s: CUstream) -> CUresult {
    admit(kernel_key(k, w as u32, h as u32, 1), s, || forward!(real, k, w, h, s))
}

/// `cuGraphLaunch` and its `_ptsz` twin: throttled where an SM limit is set, and charged for what
/// the graph allocates (see `graphmem`).
pub unsafe fn graph_launch<const PER_THREAD: bool>(real: f::cuGraphLaunch, g: CUgraphExec, s: CUstream) -> CUresult {
    let mine = on::<PER_THREAD>(s);
    let launch = || forward!(real, g, s);
    graphmem::launched(g, mine, || if engaged() { admit(g as u64, mine, launch) } else { launch() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that set or depend on `NO_MEASURING`, a process-wide flag.
    static FORKED: Mutex<()> = Mutex::new(());

    fn key(i: u64) -> u64 {
        kernel_key(0x7f00_0000_1000 as CUfunction, i as u32, (i >> 32) as u32, 1)
    }

    /// A region with one device and `tokens` in its budget, for the life of the test process.
    fn budget(name: &str, tokens: i64) -> &'static vgpu_region::Region {
        let p = std::env::temp_dir().join(format!("vgpu-sm-credit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = vgpu_region::Region::open_or_create(&p, || vgpu_region::Init {
            devices: vec![("GPU-credit".into(), 1 << 30, 50)],
            standalone: true,
        })
        .unwrap();
        let _ = std::fs::remove_file(&p);
        let r: &'static vgpu_region::Region = Box::leak(Box::new(r));
        let t = &r.layout().devices[0].sm_tokens;
        t.store(tokens, Relaxed);
        r
    }

    fn tokens(r: &vgpu_region::Region) -> i64 {
        r.layout().devices[0].sm_tokens.load(Relaxed)
    }

    #[test]
    fn launches_are_paid_from_a_prepaid_credit_and_what_is_left_goes_back_when_the_thread_exits() {
        let r = budget("exit", 1_000_000);
        std::thread::spawn(move || {
            assert!(charge(r, 0, 1000));
            assert_eq!(tokens(r), 1_000_000 - 1000 - PREPAY_NS as i64, "the launch and the credit");
            for _ in 0..(PREPAY_NS / 1000) {
                assert!(charge(r, 0, 1000));
            }
            assert_eq!(tokens(r), 1_000_000 - 1000 - PREPAY_NS as i64, "launches within the credit");
            assert!(charge(r, 0, 1000));
            assert_eq!(tokens(r), 1_000_000 - 2000 - 2 * PREPAY_NS as i64, "topped up once spent");
            // A long launch: the credit goes to it, the rest is charged, and a new credit.
            assert!(charge(r, 0, 3 * PREPAY_NS));
            assert_eq!(tokens(r), 1_000_000 - 2000 - 5 * PREPAY_NS as i64);
            assert!(charge(r, 0, 400));
        })
        .join()
        .unwrap();
        // Every launch was charged once, and nothing else.
        let launched = 1000 + PREPAY_NS + 1000 + 3 * PREPAY_NS + 400;
        assert_eq!(tokens(r), 1_000_000 - launched as i64, "the credit left went back at exit");
    }

    #[test]
    fn a_budget_in_debt_admits_only_launches_the_credit_covers() {
        let r = budget("debt", 1);
        std::thread::spawn(move || {
            assert!(charge(r, 0, 10_000), "positive: admitted");
            r.layout().devices[0].sm_tokens.store(-5, Relaxed);
            assert!(charge(r, 0, PREPAY_NS - 1000), "within the credit paid while it was positive");
            assert!(!charge(r, 0, 2000), "beyond it, in debt");
            assert_eq!(tokens(r), -5, "a refused launch charges nothing");
        })
        .join()
        .unwrap();
        assert_eq!(tokens(r), -5 + 1000);
    }

    #[test]
    fn a_forked_child_does_not_spend_its_parents_credit() {
        let _g = FORKED.lock().unwrap_or_else(|p| p.into_inner());
        let r = budget("fork", 1_000_000);
        std::thread::spawn(move || {
            assert!(charge(r, 0, 1000));
            // In the child the thread's memory is a copy: that credit is the parent's. The parent
            // measured launches, so its events are in the child too, of a CUDA the child cannot
            // use: the child measures nothing.
            estimates();
            after_fork();
            assert!(NO_MEASURING.load(Relaxed));
            assert!(charge(r, 0, 1000));
            assert_eq!(tokens(r), 1_000_000 - 2000 - 2 * PREPAY_NS as i64, "the child paid for its own");
        })
        .join()
        .unwrap();
        assert_eq!(tokens(r), 1_000_000 - 2000 - PREPAY_NS as i64);
        NO_MEASURING.store(false, Relaxed); // this process is no child
    }

    #[test]
    fn an_idle_stream_s_wait_for_the_launch_is_not_charged() {
        // A busy stream: the bracket is the kernel's.
        assert_eq!(kernel_ns(5_000, 0), 5_000);
        // Idle: 3.3 us of the 4.9 us were the call's host time before its work was queued.
        assert_eq!(kernel_ns(4_900, 3_300), 1_600);
        // Never below what the smallest kernel takes, nor above the bracket itself.
        assert_eq!(kernel_ns(4_000, 3_900), MIN_KERNEL_NS);
        assert_eq!(kernel_ns(4_000, 9_000), MIN_KERNEL_NS);
        assert_eq!(kernel_ns(600, 900), 600);
        // A long kernel keeps nearly all of its bracket.
        assert_eq!(kernel_ns(150_000, 3_000), 147_000);
    }

    #[test]
    fn a_collection_asks_only_about_events_that_can_be_done() {
        let st = |i: usize| i as CUstream;
        // (context, stream, end event): stream 1's first event is not done, so neither is its
        // second; stream 1 of context 2 (the same handle, as every context's default stream has)
        // is another stream.
        let mut p: Vec<Sample> = [(1, 1, 10), (1, 2, 20), (1, 1, 11), (1, 3, 30), (1, 2, 21), (2, 1, 40)]
            .iter()
            .map(|&(c, s, e)| Sample {
                key: e,
                dev: 0,
                charged: 1,
                stream: st(s),
                ctx: c,
                start: std::ptr::null_mut(),
                end: e as CUevent,
                idle_gap: 0,
            })
            .collect();
        let mut asked = Vec::new();
        let mut finished = Vec::new();
        sweep(
            &mut p,
            |s| {
                asked.push(s.end as usize);
                if s.end as usize == 10 {
                    CUresult::NOT_READY
                } else {
                    CUresult::SUCCESS
                }
            },
            |s, q| finished.push((s.key, q)),
        );
        assert_eq!(asked, [10, 20, 30, 21, 40], "11 is behind 10 on its stream");
        assert_eq!(
            finished,
            [(20, CUresult::SUCCESS), (30, CUresult::SUCCESS), (21, CUresult::SUCCESS), (40, CUresult::SUCCESS)]
        );
        let left: Vec<u64> = p.iter().map(|s| s.key).collect();
        assert_eq!(left, [10, 11], "the rest in their order");

        // Many busy streams: the pass ends after MAX_BUSY_STREAMS answers of "not ready".
        let mut p: Vec<Sample> = (0..100)
            .map(|i| Sample {
                key: i,
                dev: 0,
                charged: 1,
                stream: st(i as usize + 1),
                ctx: 1,
                start: std::ptr::null_mut(),
                end: std::ptr::null_mut(),
                idle_gap: 0,
            })
            .collect();
        let mut asked = 0;
        sweep(
            &mut p,
            |_| {
                asked += 1;
                CUresult::NOT_READY
            },
            |_, _| unreachable!(),
        );
        assert_eq!(asked, MAX_BUSY_STREAMS);
        assert_eq!(p.len(), 100);
    }

    #[test]
    fn an_estimate_is_the_smallest_of_the_last_measurements() {
        let e = Estimates::new();
        assert_eq!(e.get(key(1)), (0, 0));
        for ns in [500, 300, 900] {
            e.learn(key(1), ns);
        }
        assert_eq!(e.get(key(1)), (300, 1));
        for _ in 0..WINDOW {
            e.learn(key(1), 800);
        }
        assert_eq!(e.get(key(1)).0, 800, "the 300 left the window");
        // Another grid of the same function is another estimate.
        assert_eq!(e.get(key(2)).0, 0);
        assert_ne!(key(1), key(2));
        assert_ne!(kernel_key(0x1000 as CUfunction, 1, 1, 1), kernel_key(0x2000 as CUfunction, 1, 1, 1));
        // Grids that differ in any dimension, also where x is large (a 1-D grid of many blocks).
        let f = 0x7f00_0000_1000 as CUfunction;
        let grids = [
            (1, 1, 1),
            (2, 1, 1),
            (1, 2, 1),
            (1, 1, 2),
            ((1 << 24) + 5, 2, 1),
            (5, 3, 1),
            ((1 << 31) - 1, 65535, 65535),
        ];
        for (i, a) in grids.iter().enumerate() {
            for b in &grids[i + 1..] {
                assert_ne!(kernel_key(f, a.0, a.1, a.2), kernel_key(f, b.0, b.1, b.2), "{a:?} and {b:?}");
            }
        }
    }

    #[test]
    fn launches_are_sampled_by_their_estimate_and_count_while_few_are_in_flight() {
        let picked = |est, from: u64, to: u64| (from..to).filter(|&n| sampled(est, n, 0)).count();
        assert!((0..10).all(|n| sampled(0, n, 0)), "unknown: every launch until one is measured");
        assert_eq!(picked(1_000, 0, EARLY_LAUNCHES), (EARLY_LAUNCHES / SAMPLE_EVERY_EARLY) as usize);
        assert_eq!(picked(1_000, EARLY_LAUNCHES, EARLY_LAUNCHES + 1280), 10);
        assert_eq!(picked(LONG_NS, EARLY_LAUNCHES, EARLY_LAUNCHES + 1280), 320, "long: one in 4");
        assert_eq!(picked(LONG_NS - 1, 0, 64), 4);
        // The cap on measurements in flight holds for every kind of launch, a first one included.
        for (est, n) in [(0, 0), (1_000, 0), (LONG_NS, 4096)] {
            assert!(sampled(est, n, MAX_PENDING - 1));
            assert!(!sampled(est, n, MAX_PENDING), "{est} {n}");
        }
    }

    #[test]
    fn a_forgotten_key_starts_afresh_and_its_measurements_in_flight_are_dropped() {
        let _g = FORKED.lock().unwrap_or_else(|p| p.into_inner());
        let e = Estimates::new();
        let (a, b) = (key(7), key(8));
        for k in [a, b] {
            e.get(k);
            e.learn(k, 500);
        }
        e.forget(a);
        assert_eq!(e.get(a), (0, 0), "unknown again, its next launch measured as a first");
        e.learn(a, 900);
        assert_eq!(e.get(a).0, 900, "the old 500 is not in the window any more");
        assert_eq!(e.get(b), (500, 1), "another key keeps its estimate");
        e.forget(key(9)); // never seen: nothing happens

        // The process-wide form also drops the key's measurements in flight (they timed the old
        // work) and keeps their events for reuse.
        let g = 0x5eed_0000_u64;
        estimates().get(g);
        estimates().learn(g, 2_000);
        let sample = |key, ev: usize| Sample {
            key,
            dev: 0,
            charged: 1,
            stream: std::ptr::null_mut(),
            ctx: 0xc1,
            start: ev as CUevent,
            end: (ev + 1) as CUevent,
            idle_gap: 0,
        };
        let spare_before = SPARE_EVENTS.lock().unwrap().len();
        {
            let mut p = PENDING.lock().unwrap();
            p.push(sample(g, 0x100));
            p.push(sample(g + 1, 0x200));
            p.push(sample(g, 0x300));
            PENDING_N.fetch_add(3, Relaxed);
        }
        forget(g);
        assert_eq!(estimates().get(g).0, 0);
        let left: Vec<u64> = PENDING.lock().unwrap().iter().map(|s| s.key).collect();
        assert_eq!(left, [g + 1]);
        assert_eq!(PENDING_N.load(Relaxed), 1);
        let spare = SPARE_EVENTS.lock().unwrap().split_off(spare_before);
        assert_eq!(spare, [(0xc1, 0x100), (0xc1, 0x101), (0xc1, 0x300), (0xc1, 0x301)]);
        // Every estimate and measurement at once (a module was unloaded).
        estimates().learn(g, 3_000);
        PENDING.lock().unwrap().push(sample(g, 0x400));
        PENDING_N.fetch_add(1, Relaxed);
        let h = 0x5eed_1000_u64;
        estimates().get(h);
        estimates().learn(h, 4_000);
        forget_all();
        assert_eq!((estimates().get(g).0, estimates().get(h).0), (0, 0));
        assert!(PENDING.lock().unwrap().is_empty());
        assert_eq!(PENDING_N.load(Relaxed), 0);
        let spare = SPARE_EVENTS.lock().unwrap().split_off(spare_before);
        assert_eq!(spare.len(), 4, "{spare:x?}");

        // Events are handed out only for their own context, and a context about to end gives up
        // its events, spare and in flight (the driver destroys them with it), but not another's.
        super::spare(0xc1, &[0x500 as CUevent, 0x501 as CUevent]);
        super::spare(0xc2, &[0x600 as CUevent]);
        assert_eq!(event(0xc2), Some(0x600 as CUevent));
        assert_eq!(event(0xc1), Some(0x501 as CUevent));
        assert_eq!(event(0), None, "a stream whose context is unknown is not measured");
        super::spare(0xc2, &[0x600 as CUevent]);
        {
            let mut p = PENDING.lock().unwrap();
            p.push(sample(g, 0x700));
            p.push(Sample { ctx: 0xc2, ..sample(g, 0x800) });
            PENDING_N.fetch_add(2, Relaxed);
        }
        let taken = take_events(0xc1);
        let ends = |p: &[Sample]| p.iter().map(|s| s.end as usize).collect::<Vec<_>>();
        assert_eq!((taken.spare.as_slice(), ends(&taken.pending)), (&[(0xc1, 0x500)][..], vec![0x701]));
        assert_eq!(event(0xc1), None, "none of its events is given out while it ends");
        assert_eq!(ends(&PENDING.lock().unwrap()), [0x801], "nor asked about");
        assert_eq!(PENDING_N.load(Relaxed), 1);
        // The driver refused: they are back.
        put_back(taken);
        assert_eq!(PENDING_N.load(Relaxed), 2);
        assert_eq!(event(0xc1), Some(0x500 as CUevent));
        // It went: its events are gone for good, the other context's are kept.
        super::spare(0xc1, &[0x500 as CUevent]);
        drop(take_events(0xc1));
        forget_all();
        let left = SPARE_EVENTS.lock().unwrap().split_off(spare_before);
        assert_eq!(left, [(0xc2, 0x600), (0xc2, 0x800), (0xc2, 0x801)], "{left:x?}");
        assert_eq!(PENDING_N.load(Relaxed), 0);
        // A context this process cannot name takes every event with it.
        super::spare(0xc2, &[0x600 as CUevent]);
        assert!(take_events(0).spare.contains(&(0xc2, 0x600)));
        assert!(SPARE_EVENTS.lock().unwrap().is_empty());
        // A forked child has no events of its own to give up (its parent's are of a CUDA it cannot
        // use, and it takes none of the locks a thread it does not have may hold).
        super::spare(0xc2, &[0x600 as CUevent]);
        NO_MEASURING.store(true, Relaxed);
        assert!(take_events(0xc2).spare.is_empty());
        assert!(SPARE_EVENTS.lock().unwrap().contains(&(0xc2, 0x600)));
        NO_MEASURING.store(false, Relaxed);
        drop(take_events(0));
    }

    #[test]
    fn a_full_table_gives_idle_entries_to_new_keys_and_keeps_used_ones() {
        let e = Estimates::new();
        let hot = key(u64::MAX >> 1);
        e.get(hot);
        e.learn(hot, 1234);
        // Many more keys than entries, all in one epoch: the table fills and then takes no more,
        // and a key it cannot hold stays unknown (its measurement is not kept anywhere).
        let n = 16u64 << TABLE_BITS;
        for i in 0..n {
            e.get(key(i));
        }
        assert!(e.slots.iter().all(|s| s[0].load(Relaxed) != 0), "every entry taken");
        let outside = (0..n).map(key).find(|&k| e.entry(k, false).is_none()).expect("a key the table could not hold");
        assert_eq!(e.get(outside), (0, 0));
        e.learn(outside, 10);
        assert_eq!(e.get(outside), (0, 0), "not held, so still unknown");
        // Time passes; the hot key keeps being launched, the others are not.
        for sec in 1..=IDLE_EPOCHS + 1 {
            e.tick(sec << 30);
            e.get(hot);
        }
        // Now new keys take idle entries, fresh (not the estimate of the key they replace)...
        assert_eq!(e.get(outside), (0, 0));
        e.learn(outside, 10);
        assert_eq!(e.get(outside), (10, 1));
        for i in n..2 * n {
            let (est, _) = e.get(key(i));
            assert_eq!(est, 0, "a new key starts unknown");
        }
        // ... and the key in use kept its entry and its estimate.
        assert_eq!(e.get(hot).0, 1234);
    }
}

//! Stream-ordered memory pools (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`): a pool holds
//! physical memory beyond what its live allocations asked for. It reserves in chunks, and what is
//! freed into it stays reserved until the driver trims the pool, at a synchronisation (down to its
//! release threshold, 0 by default) or on `cuMemPoolTrimTo`. With a high threshold (PyTorch's
//! `cudaMallocAsync` backend sets it to the maximum, RAPIDS' pools to their size) freed memory
//! stays held for good. So each pool is charged its reservation as the driver reports it
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), kept as three figures per pool:
//!
//! * `live`: the requested bytes of its live allocations, charged when allocated;
//! * `slack`: bytes freed into the pool and still held by it, charged too;
//! * `held`: what else the pool holds as of the last settle (chunk rounding, growth the
//!   allocations did not account for), charged too.
//!
//! A free moves its bytes from `live` to `slack` (the memory stays in the pool); an allocation
//! takes from `slack` first and reserves on the quota only the rest, so memory reused from the
//! pool is never charged twice. Where the driver may have trimmed or grown the pool (after
//! synchronisations (`cuStreamSynchronize`, `cuEventSynchronize`, `cuCtxSynchronize` and its
//! `_v2`) that follow a change, after `cuMemPoolTrimTo` and `cuMemPoolDestroy`, when a context
//! ends, and before an allocation is refused) the pool is settled: what it holds beyond `live`
//! becomes `slack` (never more than it was) plus `held`. Each operation moves the region and the figures by the same
//! amount, so the region always holds live + slack + held, and a settle sets that to what the pool
//! really holds.
//!
//! Only frees add to `slack`, the part allocations may take without a reservation. A settle that
//! runs while other threads allocate and free reads `live` and the reservation at slightly
//! different moments and may see more than the pool holds (an allocation the driver made that
//! `live` does not show yet); had that excess become `slack`, later allocations would have taken
//! it without a reservation while the driver grew the pool for them, past the limit (16 threads
//! allocating and freeing on their own streams grew a pool to 3.6-8.1 GiB under 1 GiB). As
//! `held` it is charged until the next settle, and no allocation can spend it.
//!
//! The hot paths (allocation and free) are a few atomic operations on process-local figures; the
//! driver is asked only when settling.
#![allow(clippy::missing_safety_doc)]

use crate::real::{cuda_fns as f, driver};
use crate::state::{state, State};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};

const OK: CUresult = CUresult::SUCCESS;

/// Pools tracked per process; beyond that, allocations are charged at their requested size.
const MAX_POOLS: usize = 64;
/// The context byte (see `ptrmap::pack_in`) of an allocation from pool `i` is `POOL_TAG | i`:
/// context ids are below 64, and the context sweep ignores larger values.
pub const POOL_TAG: u64 = 0x80;
const MAX_ORDINALS: usize = 64;
/// The `dev` of a pool of host memory (`CU_MEM_LOCATION_TYPE_HOST*`): nothing of it is charged.
pub const HOST: usize = usize::MAX;
/// The `dev` of a free entry, and of a new one until its creator has stored the device: the
/// allocation that reads it is charged on the current device, as one that made the entry would be.
pub const UNKNOWN: usize = usize::MAX - 1;

struct Pool {
    /// The pool's handle (0: a free entry).
    handle: AtomicU64,
    /// Its region device: where its memory is, as learned when the pool was made or named for a
    /// device, else the current device at its first allocation; [`HOST`] for host memory.
    dev: AtomicUsize,
    live: AtomicU64,
    slack: AtomicU64,
    held: AtomicU64,
    /// Destroyed by the application: what its allocations free goes back at once.
    destroyed: AtomicBool,
}

static POOLS: [Pool; MAX_POOLS] = [const {
    Pool {
        handle: AtomicU64::new(0),
        dev: AtomicUsize::new(UNKNOWN),
        live: AtomicU64::new(0),
        slack: AtomicU64::new(0),
        held: AtomicU64::new(0),
        destroyed: AtomicBool::new(false),
    }
}; MAX_POOLS];

/// A pool changed since the last settle (an allocation grew it or a free returned to it).
static DIRTY: AtomicBool = AtomicBool::new(false);
/// Each CUDA ordinal's current pool, which `cuMemAllocAsync` draws from (0: not asked yet).
static CURRENT: [AtomicU64; MAX_ORDINALS] = [const { AtomicU64::new(0) }; MAX_ORDINALS];

/// The pool `cuMemAllocAsync` on `ordinal` draws from (0: unknown).
#[inline]
pub fn current(ordinal: CUdevice) -> u64 {
    let Some(c) = usize::try_from(ordinal).ok().and_then(|o| CURRENT.get(o)) else { return 0 };
    match c.load(Relaxed) {
        0 => current_slow(ordinal, c),
        p => p,
    }
}

#[cold]
fn current_slow(ordinal: CUdevice, c: &AtomicU64) -> u64 {
    let Some(get) = driver().helpers.cuDeviceGetMemPool else { return 0 };
    let mut p: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    if unsafe { get(&mut p, ordinal) } != OK {
        return 0;
    }
    c.store(p as u64, Relaxed);
    p as u64
}

/// The entry of pool `handle` on region device `d`, made on first use (None: no room, or 0).
#[inline]
pub fn index(handle: u64, d: usize) -> Option<usize> {
    if handle == 0 {
        return None;
    }
    for (i, p) in POOLS.iter().enumerate() {
        let h = p.handle.load(Acquire);
        // A destroyed pool's entry lives on while allocations from it do, but its handle may
        // already name a new pool, which gets an entry of its own.
        if h == handle && !p.destroyed.load(Acquire) {
            return Some(i);
        }
        if h == 0 {
            if p.handle.compare_exchange(0, handle, AcqRel, Acquire).is_ok() {
                p.dev.store(d, Release);
                return Some(i);
            }
            if p.handle.load(Acquire) == handle {
                return Some(i);
            }
        }
    }
    None
}

/// The region device whose memory pool `i` holds ([`HOST`]: none; [`UNKNOWN`]: being made).
#[inline]
pub fn dev(i: usize) -> usize {
    POOLS[i].dev.load(Acquire)
}

/// Frees entry `p`: its device first, so that whoever finds the entry's next handle reads that
/// pool's device or [`UNKNOWN`], never this one's.
fn release(p: &Pool) {
    p.dev.store(UNKNOWN, Relaxed);
    p.destroyed.store(false, Relaxed);
    p.handle.store(0, Release);
}

/// Notes that pool `handle` holds the memory of region device `d` ([`HOST`]: host memory), for a
/// pool not yet in use: allocations from it are charged there, whatever device is current.
fn located(handle: u64, d: usize) {
    let _ = index(handle, d);
}

/// Where a pool of these properties keeps its memory: a region device, [`HOST`], or None (unknown,
/// or a device the region cannot name).
fn location(st: &State, l: &CUmemLocation) -> Option<usize> {
    match l.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => st.dev_of(l.id).ok(),
        CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => {
            Some(HOST)
        }
        _ => None,
    }
}

/// Where a pool of allocation type `kind` at `l` keeps the memory the quota counts: as [`location`],
/// except that a managed pool (CUDA 13.0) not placed on a device is charged on the device where it
/// is used, as `cuMemAllocManaged` is (unified memory may live on any GPU).
fn pool_location(st: &State, kind: i32, l: &CUmemLocation) -> Option<usize> {
    if charged_where_used(kind, l) {
        None
    } else {
        location(st, l)
    }
}

/// Whether a pool of allocation type `kind` at `l` is charged on the device where it is used.
fn charged_where_used(kind: i32, l: &CUmemLocation) -> bool {
    kind == CU_MEM_ALLOCATION_TYPE_MANAGED && l.type_ != CU_MEM_LOCATION_TYPE_DEVICE
}

/// Takes up to `size` bytes of pool `i`'s charged slack for a new allocation; returns how many.
#[inline]
pub fn take(i: usize, size: u64) -> u64 {
    let s = &POOLS[i].slack;
    if s.load(Relaxed) == 0 {
        return 0;
    }
    match s.fetch_update(AcqRel, Acquire, |x| Some(x - x.min(size))) {
        Ok(old) => old.min(size),
        Err(_) => 0,
    }
}

/// Gives back what [`take`] took (the allocation failed).
#[inline]
pub fn untake(i: usize, took: u64) {
    if took > 0 {
        POOLS[i].slack.fetch_add(took, AcqRel);
    }
}

/// An allocation of `size` from pool `i` succeeded; `grew`: part of it was charged anew (the pool
/// may have reserved more than asked).
#[inline]
pub fn allocated(i: usize, size: u64, grew: bool) {
    POOLS[i].live.fetch_add(size, AcqRel);
    if grew {
        DIRTY.store(true, Relaxed);
    }
}

/// An allocation of `bytes` from pool `i` was freed: its memory stays in the pool, charged as
/// slack (unless the pool was destroyed: then it goes back, and `true` says to release it).
#[inline]
pub fn freed(i: usize, bytes: u64) -> bool {
    let p = &POOLS[i];
    p.live.fetch_sub(bytes.min(p.live.load(Relaxed)), AcqRel);
    if p.destroyed.load(Acquire) {
        if p.live.load(Acquire) == 0 {
            release(p);
        }
        return true;
    }
    p.slack.fetch_add(bytes, AcqRel);
    DIRTY.store(true, Relaxed);
    false
}

/// The pools whose live allocations the driver no longer has, as a mask of entries: it reports
/// nothing in use while some are charged as live (their context went and took them).
pub fn emptied() -> u64 {
    let mut mask = 0u64;
    for (i, p) in POOLS.iter().enumerate() {
        let h = p.handle.load(Acquire);
        if h != 0 && p.live.load(Acquire) > 0 && attr(h, CU_MEMPOOL_ATTR_USED_MEM_CURRENT) == Some(0) {
            mask |= 1 << i;
        }
    }
    mask
}

/// An allocation of `bytes` from pool `i` went with its context: it will never be freed.
pub fn lost(i: usize, bytes: u64) {
    let l = &POOLS[i].live;
    let _ = l.fetch_update(AcqRel, Acquire, |x| Some(x.saturating_sub(bytes)));
}

/// A pool attribute (`CU_MEMPOOL_ATTR_*`, 64-bit ones), if the driver answers.
fn attr(handle: u64, which: i32) -> Option<u64> {
    let get = driver().helpers.cuMemPoolGetAttribute?;
    let mut v = 0u64;
    // SAFETY: the attributes read here are 64-bit values, written to a local.
    (unsafe { get(handle as CUmemoryPool, which, &mut v as *mut u64 as *mut c_void) } == OK).then_some(v)
}

/// Sets what pool `i` is charged beyond its live bytes to what its reservation holds beyond them
/// (0 if the driver no longer answers for it): `slack`, lowered if the pool holds less, and `held`
/// for the rest; moves the region by the difference and returns the bytes released.
pub fn settle(st: &State, i: usize) -> u64 {
    let p = &POOLS[i];
    let h = p.handle.load(Acquire);
    if h == 0 {
        return 0;
    }
    let d = p.dev.load(Acquire);
    if d == HOST || d == UNKNOWN {
        return 0;
    }
    let reserved =
        || if p.destroyed.load(Acquire) { 0 } else { attr(h, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT).unwrap_or(0) };
    settle_figures(p, reserved, |b| st.charge_held(d, b), |b| st.release(d, b))
}

/// [`settle`] on one pool's figures, with the driver's reservation read by `reserved` and the
/// region moved by `charge` and `release`, never below what the figures say (see `charged`).
fn settle_figures(p: &Pool, reserved: impl Fn() -> u64, charge: impl Fn(u64), release: impl Fn(u64)) -> u64 {
    for _ in 0..8 {
        // In this order: the slack (an allocation or free that changes it before the exchange makes
        // it fail), the live bytes, then the driver's figure. An allocation calls the driver before
        // it adds to `live`, so one seen in `live` is also in the reservation read after it: what
        // the pool holds beyond `live` is never under-stated. It may be over-stated, by allocations
        // the driver made that `live` does not show yet, or a free between its two steps; that
        // goes to `held`, which the next settle corrects.
        let old = p.slack.load(Acquire);
        let live = p.live.load(Acquire);
        let beyond = reserved().saturating_sub(live);
        let slack = beyond.min(old);
        if p.slack.compare_exchange(old, slack, AcqRel, Acquire).is_err() {
            continue;
        }
        // Only settles write `held`: what it replaced is what the region holds for it.
        let held = beyond - slack;
        let before = crate::charged::replace(&p.held, held, &charge, &release);
        if old > slack {
            release(old - slack);
        }
        return (old - slack + before).saturating_sub(held);
    }
    0
}

/// Settles every pool (on device `dev` only, if given); returns the bytes released.
pub fn settle_all(st: &State, dev: Option<usize>) -> u64 {
    DIRTY.store(false, Relaxed);
    let mut released = 0;
    for (i, p) in POOLS.iter().enumerate() {
        if p.handle.load(Acquire) != 0 && dev.is_none_or(|d| p.dev.load(Relaxed) == d) {
            released += settle(st, i);
        }
    }
    released
}

/// After a synchronisation: the driver may have trimmed the pools that changed since (and grown
/// the graph pool, see `graphmem`).
#[inline]
fn synced(r: CUresult) -> CUresult {
    if r == OK {
        crate::priority::synced();
        if DIRTY.load(Relaxed) {
            let _ = settle_all(state(), None);
        }
        if crate::graphmem::any() {
            crate::graphmem::synced(state());
        }
    }
    r
}

/// Forgets which pool each device draws from, to ask the driver again at the next allocation
/// (a context went: whatever the driver made of the devices' current pools, it answers for it).
pub fn forget_current() {
    for c in &CURRENT {
        c.store(0, Relaxed);
    }
}

/// A forked child has no pools of its own yet.
pub fn after_fork() {
    for p in &POOLS {
        p.dev.store(UNKNOWN, Relaxed);
        p.destroyed.store(false, Relaxed);
        p.handle.store(0, Relaxed);
        p.live.store(0, Relaxed);
        p.slack.store(0, Relaxed);
        p.held.store(0, Relaxed);
    }
    forget_current();
    DIRTY.store(false, Relaxed);
}

/// What pools are charged beyond their live allocations, counted in flight (per device) while a call
/// runs in which the driver may let it go (a trim, a synchronisation), until the settle after it
/// takes it off the charge: in between, NVML's figure for the process is smaller than its charge by
/// that much, which the agent's true-up must not take for a smaller context.
struct Releasing([u64; vgpu_region::MAX_DEVICES]);

impl Releasing {
    fn of<'a>(st: &State, pools: impl IntoIterator<Item = &'a Pool>) -> Releasing {
        let mut by_dev = [0u64; vgpu_region::MAX_DEVICES];
        for p in pools {
            if p.handle.load(Acquire) == 0 {
                continue;
            }
            let d = p.dev.load(Acquire);
            if d < vgpu_region::MAX_DEVICES {
                by_dev[d] += p.slack.load(Acquire) + p.held.load(Acquire);
            }
        }
        for (d, &b) in by_dev.iter().enumerate() {
            st.begin_in_flight(d, b);
        }
        Releasing(by_dev)
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        let st = state();
        for (d, &b) in self.0.iter().enumerate() {
            st.end_in_flight(d, b);
        }
    }
}

/// Around a synchronisation: the pools changed since the last settle may be trimmed in it.
#[inline]
fn releasing_if_dirty() -> Option<Releasing> {
    DIRTY.load(Relaxed).then(|| Releasing::of(state(), &POOLS))
}

// ----- hooks -----

pub unsafe fn stream_sync(real: f::cuStreamSynchronize, s: CUstream) -> CUresult {
    let _releasing = releasing_if_dirty();
    synced(forward!(real, s))
}

pub unsafe fn ctx_sync(real: f::cuCtxSynchronize) -> CUresult {
    let _releasing = releasing_if_dirty();
    synced(forward!(real))
}

/// `cuCtxSynchronize_v2` (CUDA 13.0): a context named rather than the current one.
pub unsafe fn ctx_sync_v2(real: f::cuCtxSynchronize_v2, ctx: CUcontext) -> CUresult {
    let _releasing = releasing_if_dirty();
    synced(forward!(real, ctx))
}

pub unsafe fn event_sync(real: f::cuEventSynchronize, e: CUevent) -> CUresult {
    let _releasing = releasing_if_dirty();
    synced(forward!(real, e))
}

pub unsafe fn trim_to(real: f::cuMemPoolTrimTo, pool: CUmemoryPool, keep: usize) -> CUresult {
    let st = state();
    let i = POOLS.iter().position(|p| p.handle.load(Acquire) == pool as u64);
    let _releasing = Releasing::of(st, i.map(|i| &POOLS[i]));
    let r = forward!(real, pool, keep);
    if r == OK {
        if let Some(i) = i {
            let _ = settle(st, i);
        }
    }
    r
}

/// The pool's entry is marked destroyed before the driver is asked: once the driver has destroyed
/// it, the same handle value may name another thread's new pool at once, which must not be taken
/// for this one (its memory would be released as this one's). Unmarked if the driver refuses.
pub unsafe fn destroy(real: f::cuMemPoolDestroy, pool: CUmemoryPool) -> CUresult {
    let i = POOLS.iter().position(|p| p.handle.load(Acquire) == pool as u64 && !p.destroyed.load(Acquire));
    if let Some(i) = i {
        POOLS[i].destroyed.store(true, Release);
    }
    let r = forward!(real, pool);
    // Still this pool's entry (a free that emptied it meanwhile gave it up).
    let entry = i.filter(|&i| POOLS[i].handle.load(Acquire) == pool as u64);
    if r != OK {
        if let Some(i) = entry {
            // Frees meanwhile released their bytes at once, and a settle may have taken the pool
            // for empty: a settle now charges again what it still holds.
            POOLS[i].destroyed.store(false, Release);
            let _ = settle(state(), i);
        }
        return r;
    }
    // A device whose current pool this was draws from its default pool from now on.
    for c in &CURRENT {
        let _ = c.compare_exchange(pool as u64, 0, Relaxed, Relaxed);
    }
    if let Some(i) = entry {
        let _ = settle(state(), i); // the slack goes: the driver frees what no allocation uses
        if POOLS[i].live.load(Acquire) == 0 {
            release(&POOLS[i]);
        }
    }
    r
}

pub unsafe fn create(real: f::cuMemPoolCreate, pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult {
    let r = forward!(real, pool, props);
    if r == OK {
        // SAFETY: the driver accepted both pointers: it wrote the new pool's handle, and read the
        // properties.
        let (handle, props) = unsafe { (*pool as u64, &*props) };
        if let Some(d) = pool_location(state(), props.allocType, &props.location) {
            located(handle, d);
        }
    }
    r
}

/// `cuDeviceGetDefaultMemPool` and `cuDeviceGetMemPool`: the pool named (the driver wrote it to
/// the caller's `pool` if it succeeded) holds `dev`'s memory.
fn named(r: CUresult, pool: Option<&mut CUmemoryPool>, dev: CUdevice) -> CUresult {
    if let (OK, Some(pool)) = (r, pool) {
        if let Ok(d) = state().dev_of(dev) {
            located(*pool as u64, d);
        }
    }
    r
}

pub unsafe fn get_default(real: f::cuDeviceGetDefaultMemPool, pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    named(forward!(real, pool, dev), out_ref!(pool), dev)
}

pub unsafe fn get_current(real: f::cuDeviceGetMemPool, pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    named(forward!(real, pool, dev), out_ref!(pool), dev)
}

pub unsafe fn set_current(real: f::cuDeviceSetMemPool, dev: CUdevice, pool: CUmemoryPool) -> CUresult {
    let r = forward!(real, dev, pool);
    if r == OK {
        made_current(dev, pool);
    }
    r
}

/// `pool` is now what `cuMemAllocAsync` on `ordinal` draws from.
fn made_current(ordinal: CUdevice, pool: CUmemoryPool) {
    if let Some(c) = usize::try_from(ordinal).ok().and_then(|o| CURRENT.get(o)) {
        c.store(pool as u64, Relaxed);
    }
}

/// `cuMemSetMemPool` (CUDA 13.0): for a device's pinned memory, `cuDeviceSetMemPool` by another
/// name; the current pools of host locations and of managed memory are not what `cuMemAllocAsync`
/// draws from.
pub unsafe fn mem_set_current(
    real: f::cuMemSetMemPool,
    loc: *mut CUmemLocation,
    kind: i32,
    pool: CUmemoryPool,
) -> CUresult {
    let r = forward!(real, loc, kind, pool);
    if r == OK && kind == CU_MEM_ALLOCATION_TYPE_PINNED {
        // SAFETY: the driver succeeded, so `loc` pointed at a location it read.
        let l = unsafe { *loc };
        if l.type_ == CU_MEM_LOCATION_TYPE_DEVICE {
            made_current(l.id, pool);
        }
    }
    r
}

/// `cuMemGetDefaultMemPool` and `cuMemGetMemPool` (CUDA 13.0): the pool named (written to the
/// caller's `pool` if the driver succeeded) holds the memory of the location asked about.
fn named_at(r: CUresult, pool: Option<&mut CUmemoryPool>, loc: Option<&CUmemLocation>, kind: i32) -> CUresult {
    if let (OK, Some(pool), Some(l)) = (r, pool, loc) {
        if let Some(d) = pool_location(state(), kind, l) {
            located(*pool as u64, d);
        }
    }
    r
}

pub unsafe fn mem_get_default(
    real: f::cuMemGetDefaultMemPool,
    pool: *mut CUmemoryPool,
    loc: *mut CUmemLocation,
    kind: i32,
) -> CUresult {
    named_at(forward!(real, pool, loc, kind), out_ref!(pool), in_ref!(loc), kind)
}

pub unsafe fn mem_get_current(
    real: f::cuMemGetMemPool,
    pool: *mut CUmemoryPool,
    loc: *mut CUmemLocation,
    kind: i32,
) -> CUresult {
    named_at(forward!(real, pool, loc, kind), out_ref!(pool), in_ref!(loc), kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managed_pools_off_a_device_are_charged_where_used() {
        let at = |type_| CUmemLocation { type_, id: 0 };
        assert!(!charged_where_used(CU_MEM_ALLOCATION_TYPE_PINNED, &at(CU_MEM_LOCATION_TYPE_DEVICE)));
        assert!(!charged_where_used(CU_MEM_ALLOCATION_TYPE_PINNED, &at(CU_MEM_LOCATION_TYPE_HOST)));
        assert!(!charged_where_used(CU_MEM_ALLOCATION_TYPE_MANAGED, &at(CU_MEM_LOCATION_TYPE_DEVICE)));
        assert!(charged_where_used(CU_MEM_ALLOCATION_TYPE_MANAGED, &at(CU_MEM_LOCATION_TYPE_HOST)));
        assert!(charged_where_used(CU_MEM_ALLOCATION_TYPE_MANAGED, &at(0)), "no preferred location");
    }

    fn pool(live: u64, slack: u64, held: u64) -> Pool {
        Pool {
            handle: AtomicU64::new(1),
            dev: AtomicUsize::new(0),
            live: AtomicU64::new(live),
            slack: AtomicU64::new(slack),
            held: AtomicU64::new(held),
            destroyed: AtomicBool::new(false),
        }
    }

    /// Two settles race: one that over-states what the pool holds beyond `live` (an allocation
    /// that took from the slack is in the driver's figure, not yet in `live`) and one after that
    /// allocation, run while the first moves the region. The region must never hold less than the
    /// driver does: an allocation admitted then would grow the pool past the limit.
    #[test]
    fn a_settle_charges_what_it_adds_before_another_can_release_it() {
        use std::cell::Cell;
        const DRIVER: u64 = 900;
        let p = pool(400, 400, 0);
        // 100 of 500 bytes of slack taken by an allocation the driver has made (in DRIVER).
        let (region, limbo) = (Cell::new(900u64), Cell::new(100u64));
        let check = |when: &str| {
            let figures = p.live.load(Relaxed) + p.slack.load(Relaxed) + p.held.load(Relaxed) + limbo.get();
            assert!(region.get() >= figures, "{when}: the region {} under the figures {figures}", region.get());
            assert!(region.get() >= DRIVER, "{when}: the region {} under what the driver holds", region.get());
        };
        let release = |b: u64| {
            region.set(region.get() - b);
            check("after a release");
        };
        let nested = Cell::new(false);
        let charge = |b: u64| {
            check("before a charge");
            region.set(region.get() + b);
            if !nested.replace(true) {
                // The allocation adds to `live`, and another thread settles.
                p.live.fetch_add(100, Relaxed);
                limbo.set(0);
                settle_figures(&p, || DRIVER, |b| region.set(region.get() + b), release);
                check("after the other settle");
            }
        };
        settle_figures(&p, || DRIVER, charge, release);
        check("after both");
        // Charged 100 more than the pool holds until the next settle, which gives it back.
        assert_eq!(region.get(), 1000);
        assert_eq!(settle_figures(&p, || DRIVER, |_| unreachable!("nothing to add"), release), 100);
        assert_eq!((region.get(), p.slack.load(Relaxed), p.held.load(Relaxed)), (DRIVER, 400, 0));
    }

    // The one test that touches the process-wide table.
    #[test]
    fn slack_is_taken_before_the_quota_and_frees_return_to_it() {
        let i = index(0xabc0, 0).unwrap();
        assert_eq!(index(0xabc0, 0), Some(i), "found again");
        assert_eq!(take(i, 100), 0, "no slack yet");
        allocated(i, 100, true);
        assert!(!freed(i, 100));
        assert_eq!((POOLS[i].live.load(Relaxed), POOLS[i].slack.load(Relaxed)), (0, 100));
        assert_eq!(take(i, 30), 30);
        assert_eq!(take(i, 500), 70, "only what there is");
        assert_eq!(take(i, 1), 0);
        untake(i, 70);
        assert_eq!(POOLS[i].slack.load(Relaxed), 70);
        // A destroyed pool's frees go back at once, and the entry is freed with its last allocation.
        allocated(i, 40, false);
        POOLS[i].destroyed.store(true, Relaxed);
        assert!(freed(i, 40));
        assert_eq!(POOLS[i].handle.load(Relaxed), 0);
        assert_eq!(index(0, 0), None, "0 is no pool");
    }
}

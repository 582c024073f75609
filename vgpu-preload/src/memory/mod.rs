//! Memory policies: every device allocator reserves on the container's region before the real call
//! and commits or rolls back after; every free releases exactly what its allocation charged.
//! Over the limit the call returns CUDA_ERROR_OUT_OF_MEMORY and the driver is not called.
//!
//! The policies here are safe functions over the process's [`State`]: the driver's side of each
//! call comes in as a closure (`call`), which reports what the driver made (a pointer, a handle) or
//! its refusal. `edge` turns the exported entry points' raw arguments into those closures, once per
//! call; the unit tests below pass fakes instead.

mod edge;

pub use edge::*;

use crate::drv;
use crate::locate::{self, streams_changed};
use crate::log::{vlog, INFO};
use crate::pools;
use crate::ptrmap::{ctx_of, pack, pack_in, unpack};
use crate::state::State;
use cuda_abi::*;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};

const OK: CUresult = CUresult::SUCCESS;

/// What a driver call made (a pointer, a handle), or its refusal.
pub(crate) type Made<T> = Result<T, CUresult>;

/// Reserve `bytes` on `dev`, run `call`, and keep the reservation only if it succeeded.
#[inline]
fn charged<T>(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> Made<T>) -> Made<T> {
    let _flight = st.in_flight(dev, bytes);
    st.reserve(dev, bytes)?;
    commit(st, dev, bytes, call)
}

/// [`charged`] for a context's overhead.
fn context_charged<T>(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> Made<T>) -> Made<T> {
    let _flight = st.in_flight(dev, bytes);
    st.reserve_context(dev, bytes)?;
    commit(st, dev, bytes, call)
}

#[inline]
fn commit<T>(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> Made<T>) -> Made<T> {
    let r = call();
    if r.is_err() {
        st.release(dev, bytes);
    }
    r
}

#[inline]
fn current(st: &State) -> Made<(CUdevice, usize)> {
    st.current_dev()
}

/// `cuStreamDestroy` and `_v2`: the handle may name another stream (of another context) once the
/// driver has let it go, so every thread's remembered answer goes, before and after (an answer
/// taken while the driver destroys the stream is not kept either).
/// A capture open on the stream ends with it (see `capture::destroyed`).
pub(crate) fn destroy_stream(s: CUstream, call: impl FnOnce() -> CUresult) -> CUresult {
    streams_changed();
    let capturing = crate::capture::destroying(s);
    let r = call();
    streams_changed();
    if r == OK {
        crate::capture::destroyed(s, capturing);
    }
    r
}

/// A context about to go, taken out of the bookkeeping before the driver is asked: once the driver
/// has destroyed it, the same handle value may name another thread's new context at once, whose
/// allocations (and overhead) a retire after the call would take for this one's.
struct Going {
    ctx: u64,
    /// Its entries in `State::contexts`, retired, and their region device.
    ids: u64,
    dev: usize,
    /// Its overhead's entry in `State::handles` (a context of its own).
    overhead: Option<u64>,
    /// What its limits are charged up to (`ctxlimits`): a new context at its handle starts afresh.
    limits: Option<[usize; 3]>,
    /// Its timing events (`sm`), which the driver destroys with it.
    events: crate::sm::Events,
    /// Captures open on its streams, which end with it.
    captures: Vec<(usize, u64)>,
}

impl Going {
    #[cold]
    fn new(st: &State, ctx: u64, own: bool) -> Going {
        let dev = st.contexts.lookup(ctx).map_or(0, |(d, _)| d);
        let ids = if ctx == 0 { 0 } else { st.contexts.retire(ctx) };
        let overhead = if own { st.handles.remove(ctx | CTX_TAG) } else { None };
        let limits = crate::ctxlimits::context_gone(ctx);
        let events = crate::sm::take_events(ctx);
        let captures = crate::capture::take_context(ctx);
        Going { ctx, ids, dev, overhead, limits, events, captures }
    }

    /// The driver refused: the context is still there, and so is what it holds.
    #[cold]
    fn stays(self, st: &State) {
        st.contexts.restore(self.ids, self.ctx, self.dev);
        if let Some(v) = self.overhead {
            st.handles.insert(self.ctx | CTX_TAG, v);
        }
        if let Some(l) = self.limits {
            crate::ctxlimits::put_back(self.ctx, l);
        }
        crate::sm::put_back(self.events);
        crate::capture::put_back(self.captures);
    }
}

/// A context went (destroyed, its primary context released for the last time, or reset), and the
/// driver freed what was allocated in it: release those allocations (of its entries, retired in
/// `going`) from the container's usage.
#[cold]
fn context_gone(st: &State, going: Going) {
    let Going { ids, .. } = going;
    // Its streams went with it, and so did its modules, graphs and events: their handles may come
    // back naming other work. (Its timing events were taken out of use in `going`, before the
    // driver was asked: not here, when a new context may have its handle and events of its own.)
    streams_changed();
    crate::sm::forget_all();
    crate::graphmem::context_gone(st);
    pools::forget_current();
    // Stream-ordered allocations carry their pool, not their context: those of a pool the driver
    // now reports unused went with it too.
    let emptied = pools::emptied();
    if ids != 0 || emptied != 0 {
        let (mut n, mut bytes) = (0u64, 0u64);
        let gone = |v: u64| match ctx_of(v) {
            c if c & pools::POOL_TAG != 0 => (emptied >> (c & !pools::POOL_TAG)) & 1 == 1,
            c => 1u64.checked_shl(c as u32).is_some_and(|bit| ids & bit != 0),
        };
        for map in [&st.ptrs, &st.handles] {
            map.take_where(gone, |v| {
                let (d, b) = unpack(v);
                let c = ctx_of(v);
                if c & pools::POOL_TAG != 0 {
                    pools::lost((c & !pools::POOL_TAG) as usize, b);
                }
                st.release(d, b);
                n += 1;
                bytes += b;
            });
        }
        if ids != 0 {
            st.contexts.free(ids);
        }
        if n > 0 {
            vlog!(INFO, "a context went: released {bytes} bytes of {n} allocations the driver freed with it");
        }
    }
    let _ = pools::settle_all(st, None);
}

// ----- linear memory -----

/// A linear allocation of `size` bytes that `call` makes, on the device and in the context `at`
/// names (region device, context id; context 0: not tracked): charged, and its pointer remembered
/// with what it charged. Size 0 is the driver's to answer.
#[inline]
pub(crate) fn linear(
    st: &State,
    size: u64,
    at: impl FnOnce() -> Made<(usize, u64)>,
    call: impl FnOnce() -> Made<u64>,
) -> Made<u64> {
    if size == 0 {
        return call();
    }
    let (d, ctx) = at()?;
    let p = charged(st, d, size, call)?;
    st.ptrs.insert(p, pack_in(d, ctx, size));
    Ok(p)
}

/// `CUDA_OVERSUBSCRIBE` (or the agent's flag): the driver refused `size` bytes that are within the
/// container's limit (the caller holds their reservation) for want of physical memory. Serve them as
/// unified memory, which a GPU that pages on demand (concurrent managed access: Linux, Pascal and
/// later) keeps between itself and the host; where unified memory must fit on the GPU, the driver
/// refuses it too and the refusal stands. The pointer is freed by `cuMemFree` like any other.
#[cold]
pub(crate) fn spill(st: &State, size: usize) -> Made<u64> {
    let refused = CUresult::OUT_OF_MEMORY;
    let Ok((_, region_dev)) = current(st) else { return Err(refused) };
    let p = drv::alloc_managed(size).unwrap_or(Err(refused))?;
    if let Some((region, _)) = st.accounting() {
        region.note_spill(region_dev, size as u64);
    }
    vlog!(INFO, "device {region_dev}: the GPU is full: {size} bytes served as unified memory (CUDA_OVERSUBSCRIBE)");
    Ok(p)
}

/// A pitched allocation of `width` bytes by `height` rows that `call` makes, reporting the pointer
/// and the pitch: an estimate (rows padded to 512 bytes) is reserved first, then settled on the
/// real size; `free` gives the allocation back if the real size does not fit. A zero extent is the
/// driver's to answer.
pub(crate) fn pitched(
    st: &State,
    (width, height): (u64, u64),
    at: impl FnOnce() -> Made<(usize, u64)>,
    call: impl FnOnce() -> Made<(u64, u64)>,
    free: impl FnOnce(u64),
) -> Made<(u64, u64)> {
    if width == 0 || height == 0 {
        return call();
    }
    let (d, ctx) = at()?;
    let Some(estimate) = width.div_ceil(512).checked_mul(512).and_then(|p| p.checked_mul(height)) else {
        return Err(CUresult::OUT_OF_MEMORY);
    };
    let (p, pitch) = charged(st, d, estimate, call)?;
    let bytes = settle(st, d, estimate, pitch.saturating_mul(height), || free(p)).ok_or(CUresult::OUT_OF_MEMORY)?;
    st.ptrs.insert(p, pack_in(d, ctx, bytes));
    Ok((p, pitch))
}

/// Moves a reservation from `estimate` to `actual`. If the extra does not fit, `undo` releases the
/// allocation and None is returned.
fn settle(st: &State, d: usize, estimate: u64, actual: u64, undo: impl FnOnce()) -> Option<u64> {
    if actual > estimate {
        if st.reserve(d, actual - estimate).is_err() {
            undo();
            st.release(d, estimate);
            return None;
        }
    } else if actual < estimate {
        st.release(d, estimate - actual);
    }
    Some(actual)
}

/// A free of `dptr` through `call`: after it succeeds, releases exactly what the allocation charged
/// (an allocation from a pool leaves its memory charged to the pool, see `pools`). The entry is
/// taken out before the driver frees: from then on the driver may hand the address to another
/// thread's allocation, whose entry must not meet this one (a remove after the free could take the
/// other's, and release its bytes for these). Put back if the driver refuses the free.
#[inline]
pub(crate) fn freeing(st: &State, dptr: CUdeviceptr, call: impl FnOnce() -> CUresult) -> CUresult {
    let entry = if dptr != 0 { st.ptrs.remove(dptr) } else { None };
    let r = call();
    if let Some(v) = entry {
        if r != OK {
            st.ptrs.insert(dptr, v);
            return r;
        }
        let (d, b) = unpack(v);
        let tag = ctx_of(v);
        if tag & pools::POOL_TAG == 0 || pools::freed((tag & !pools::POOL_TAG) as usize, b) {
            st.release(d, b);
        }
    }
    r
}

// ----- stream-ordered allocator: the pools' reservations are charged (see `pools`) -----
// Pools belong to a device (or the host), not to a context: their allocations carry their pool,
// and a context's end releases them only once the driver reports their pool unused (see
// `context_gone`), so it cannot make memory the pool still uses uncounted.

/// A stream-ordered allocation of `size` bytes from `pool` (None: the current device's current
/// pool) on `stream`, made by `call`: the pool's charged slack is used first, the quota for the
/// rest. Into a capturing stream it makes an allocation node of the graph, not memory: the graph's
/// launches are charged for it (see `graphmem`).
#[inline]
pub(crate) fn pooled(
    st: &State,
    size: u64,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    call: impl FnOnce() -> Made<u64>,
) -> Made<u64> {
    if size == 0 || crate::capture::captures(stream) {
        return call();
    }
    // `cuMemAllocAsync` draws from the current pool of the stream's device, which need not be the
    // current context's; `cuMemAllocFromPoolAsync`'s pool says where its memory is.
    let (ordinal, here) = if pool.is_none() { locate::stream_dev(st, stream) } else { current(st) }?;
    let handle = pool.map_or_else(|| pools::current(ordinal), |p| p as u64);
    let Some(i) = pools::index(handle, here) else {
        return linear(st, size, || Ok((here, 0)), call);
    };
    // The pool's memory may be another device's (`cuMemAllocFromPoolAsync` takes a pool of any
    // device), or the host's (not charged).
    let d = match pools::dev(i) {
        pools::HOST => return call(),
        pools::UNKNOWN => here,
        d => d,
    };
    let (took, need, _flight) = pool_reserve(st, i, d, size)?;
    let p = match call() {
        Ok(p) => p,
        Err(e) => {
            st.release(d, need);
            pools::untake(i, took);
            return Err(e);
        }
    };
    pools::allocated(i, size, need > 0);
    st.ptrs.insert(p, pack_in(d, pools::POOL_TAG | i as u64, size));
    Ok(p)
}

/// Takes what pool `i` (on region device `d`) holds spare for `size` bytes and reserves the rest:
/// (taken from the pool, reserved, the reservation counted in flight). Inlined: it is the stream-ordered
/// allocation's hot path.
#[inline(always)]
fn pool_reserve(st: &State, i: usize, d: usize, size: u64) -> Made<(u64, u64, crate::state::InFlight<'_>)> {
    let mut settled = false;
    loop {
        let took = pools::take(i, size);
        let need = size - took;
        if need == 0 {
            return Ok((took, 0, st.in_flight(d, 0)));
        }
        let flight = st.in_flight(d, need);
        match st.reserve(d, need) {
            Ok(()) => return Ok((took, need, flight)),
            Err(e) => {
                pools::untake(i, took);
                // The refusal's own settling ran while this allocation held `took` out of the
                // pool's slack: settled again without it, and tried once more if that gave
                // anything back.
                if settled || pools::settle(st, i) == 0 {
                    return Err(e);
                }
                settled = true;
            }
        }
    }
}

// ----- VMM: the physical handle is charged, rounded up to the allocation granularity, until its
// memory goes (see `vmm`) -----

/// A physical allocation of `size` bytes on device `ordinal` that `call` makes, charged rounded up
/// to the allocation granularity (`granularity`, asked only when it is charged).
pub(crate) fn physical(
    st: &State,
    ordinal: CUdevice,
    size: u64,
    granularity: impl FnOnce() -> u64,
    call: impl FnOnce() -> Made<u64>,
) -> Made<u64> {
    if size == 0 {
        return call();
    }
    let d = st.dev_of(ordinal)?;
    let gran = granularity().max(1);
    let bytes = size.div_ceil(gran) * gran;
    let h = charged(st, d, bytes, call)?;
    crate::vmm::created(h, d, bytes);
    Ok(h)
}

/// Handle-kind tags keep arrays and contexts apart in one table.
const ARRAY_TAG: u64 = 1 << 62;
const CTX_TAG: u64 = 1 << 61;

// ----- arrays: an estimate first, then the size the driver reports -----

fn format_bytes(f: u32) -> u64 {
    match f {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        _ => 4,
    }
}

/// A conservative estimate: rows padded to 512 bytes, at least 2 MiB.
pub(crate) fn array_estimate(w: usize, h: usize, d: usize, format: u32, ch: u32) -> u64 {
    let row = (w as u64 * format_bytes(format) * ch.max(1) as u64).div_ceil(512) * 512;
    row.saturating_mul(h.max(1) as u64).saturating_mul(d.max(1) as u64).max(2 << 20)
}

/// An array that `create` makes, on the device and in the context `at` names (CUDA ordinal, region
/// device, context id): `estimate` reserved first, then settled on what `size_of` (handle, CUDA
/// ordinal) says it occupies; `destroy` gives it back if that does not fit.
pub(crate) fn array(
    st: &State,
    estimate: u64,
    at: impl FnOnce() -> Made<(CUdevice, usize, u64)>,
    create: impl FnOnce() -> Made<u64>,
    size_of: impl FnOnce(u64, CUdevice) -> Option<u64>,
    destroy: impl FnOnce(u64),
) -> Made<u64> {
    let (o, d, ctx) = at()?;
    let h = charged(st, d, estimate, create)?;
    let actual = size_of(h, o).unwrap_or(estimate);
    let b = settle(st, d, estimate, actual, || destroy(h)).ok_or(CUresult::OUT_OF_MEMORY)?;
    st.handles.insert(h | ARRAY_TAG, pack_in(d, ctx, b));
    Ok(h)
}

/// What a mipmapped array of `levels` levels, each half the one before, is estimated to occupy.
pub(crate) fn mipmapped_estimate(x: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u64 {
    let (mut w, mut h, mut dd, mut est) = (x.Width, x.Height, x.Depth, 0u64);
    for _ in 0..levels.min(32) {
        est = est.saturating_add(array_estimate(w, h, dd, x.Format, x.NumChannels));
        w = (w / 2).max(1);
        h = if h == 0 { 0 } else { (h / 2).max(1) };
        dd = if dd == 0 { 0 } else { (dd / 2).max(1) };
    }
    est
}

/// An array's destruction through `call`: its entry taken out first and put back if the driver
/// refuses (as for a free, see `freeing`: the driver may hand the handle out again at once).
pub(crate) fn destroy_array(st: &State, handle: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let key = handle | ARRAY_TAG;
    let entry = st.handles.remove(key);
    let r = call();
    if let Some(v) = entry {
        if r == OK {
            let (d, b) = unpack(v);
            st.release(d, b);
        } else {
            st.handles.insert(key, v);
        }
    }
    r
}

// ----- contexts: each costs `VGPU_CONTEXT_OVERHEAD` of device memory -----

/// `cuDevicePrimaryCtxRetain` of device `ordinal` through `call` (which reports the context): the
/// first retain creates the context and is charged its overhead.
pub(crate) fn retain_primary(st: &'static State, ordinal: CUdevice, call: impl FnOnce() -> Made<u64>) -> Made<u64> {
    let d = st.dev_of(ordinal)?;
    let Some(refs) = st.primary_refs.get(ordinal as usize) else { return call() };
    let _g = st.primary_lock.lock().unwrap_or_else(|p| p.into_inner());
    if refs.load(Acquire) > 0 {
        let c = call()?;
        refs.fetch_add(1, AcqRel);
        return Ok(c);
    }
    let before = st.trueup.before_context(st, d);
    let c = context_charged(st, d, st.cfg.context_overhead, call)?;
    refs.store(1, Release);
    if let Some(p) = st.primary_ctx.get(ordinal as usize) {
        p.store(c, Release);
    }
    st.trueup.after_context(st, d, before);
    Ok(c)
}

/// `cuCtxSetLimit(limit, value)` through `set` (which sets a value of that limit): a larger stack
/// (per thread, for every thread the GPU holds at once: SMs x threads per SM), printf FIFO or malloc
/// heap is device memory the driver takes for the current context at once (the stack can reach
/// gigabytes). Reserved before the driver is asked (refused over the limit, as the driver refuses
/// what it has no room for), settled on the value the driver set (it may round), and released when
/// the context goes. A lowered limit keeps its charge until then (the driver need not give the
/// memory back), so a raise charges only what lies above the highest value charged (`ctxlimits`),
/// and one thread at a time charges.
pub(crate) fn set_limit(st: &State, limit: i32, value: usize, set: impl Fn(usize) -> CUresult) -> CUresult {
    const STACK: i32 = 0; // CU_LIMIT_STACK_SIZE; 1 and 2: the printf FIFO and the malloc heap
    if !(0..=2).contains(&limit) || st.accounting().is_none() {
        return set(value);
    }
    let Ok((ordinal, d)) = current(st) else { return set(value) };
    let per = if limit == STACK {
        let sms = drv::device_attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal).unwrap_or(0);
        let threads = drv::device_attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, ordinal).unwrap_or(0);
        sms.max(0) as u64 * threads.max(0) as u64
    } else {
        1
    };
    let _turn = crate::ctxlimits::Turn::take();
    let (Some(old), ctx) = (drv::ctx_limit(limit), drv::current_ctx()) else { return set(value) };
    // Charged from the value the driver has, or from the highest one charged if it was lowered.
    let from = old.max(crate::ctxlimits::charged_to(ctx, limit as usize));
    if per == 0 || ctx == 0 || value <= from {
        return set(value);
    }
    let held = |v: usize| (v.saturating_sub(from) as u64).saturating_mul(per);
    let estimate = held(value);
    let r = charged(st, d, estimate, || match set(value) {
        OK => Ok(()),
        e => Err(e),
    });
    if let Err(e) = r {
        return e;
    }
    // What the driver set (it may round); if it does not say, what was asked.
    let now = drv::ctx_limit(limit).unwrap_or(value);
    // The value the driver had is set back if what it set does not fit.
    let Some(bytes) = settle(st, d, estimate, held(now), || {
        set(old);
    }) else {
        return CUresult::OUT_OF_MEMORY;
    };
    crate::ctxlimits::set_charged_to(ctx, limit as usize, now.max(from));
    // Charged to the context, released when it goes.
    if st.primary_ctx.get(ordinal as usize).is_some_and(|p| p.load(Acquire) == ctx) {
        st.primary_limits[ordinal as usize].fetch_add(bytes, AcqRel);
    } else if let Some(v) = st.handles.remove(ctx | CTX_TAG) {
        let (hd, hb) = unpack(v);
        st.handles.insert(ctx | CTX_TAG, pack(hd, hb + bytes));
    }
    OK
}

/// What the primary context of `ordinal` was charged for its limits, released (it went, or was
/// reset to its defaults).
fn primary_limits_gone(st: &State, ordinal: CUdevice, d: usize) {
    if let Some(b) = st.primary_limits.get(ordinal as usize) {
        st.release(d, b.swap(0, AcqRel));
    }
}

/// `cuDevicePrimaryCtxRelease` of device `ordinal` through `call`: the last release destroys the
/// primary context, and what was allocated in it.
pub(crate) fn release_primary(st: &State, ordinal: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let (Ok(d), Some(refs)) = (st.dev_of(ordinal), st.primary_refs.get(ordinal as usize)) else { return call() };
    let _g = st.primary_lock.lock().unwrap_or_else(|p| p.into_inner());
    let last = refs.load(Acquire) == 1;
    let going = last.then(|| Going::new(st, st.primary_ctx[ordinal as usize].load(Acquire), false));
    let r = call();
    if r != OK {
        if let Some(g) = going {
            g.stays(st);
        }
        return r;
    }
    if let Some(g) = going {
        st.release(d, st.cfg.context_overhead);
        primary_limits_gone(st, ordinal, d);
        context_gone(st, g);
        st.trueup.context_gone(st, d);
    }
    let _ = refs.fetch_update(AcqRel, Acquire, |x| x.checked_sub(1));
    r
}

/// Resetting a primary context (through `call`) frees every allocation made in it; the context
/// stays retained.
pub(crate) fn reset_primary(st: &State, ordinal: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let ctx = st.primary_ctx.get(ordinal as usize).map(|c| c.load(Acquire));
    // Its timing events go with the reset: out of use before the driver is asked, so that no other
    // thread's collection asks about them once they are gone.
    let events = ctx.map(crate::sm::take_events);
    let r = call();
    if r != OK {
        if let Some(e) = events {
            crate::sm::put_back(e);
        }
        return r;
    }
    if let Some(c) = ctx {
        // The rest is taken out after the driver's call: a reset context stays, so its handle cannot
        // name another one meanwhile, and what its threads allocated until the reset went with it.
        context_gone(st, Going::new(st, c, false));
    }
    if let Ok(d) = st.dev_of(ordinal) {
        primary_limits_gone(st, ordinal, d);
    }
    r
}

/// A new (non-primary) context on device `ordinal` that `call` creates: its overhead charged,
/// remembered until it is destroyed.
pub(crate) fn context_created(st: &'static State, ordinal: CUdevice, call: impl FnOnce() -> Made<u64>) -> Made<u64> {
    let d = st.dev_of(ordinal)?;
    let bytes = st.cfg.context_overhead;
    let before = st.trueup.before_context(st, d);
    let c = context_charged(st, d, bytes, call)?;
    st.handles.insert(c | CTX_TAG, pack(d, bytes));
    st.trueup.after_context(st, d, before);
    Ok(c)
}

/// `cuCtxDestroy` of `ctx` through `call`: its overhead and what was allocated in it released.
pub(crate) fn destroy_context(st: &State, ctx: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let going = Going::new(st, ctx, true);
    let r = call();
    if r != OK {
        going.stays(st);
        return r;
    }
    let dev = going.overhead.map(|v| {
        let (d, b) = unpack(v);
        st.release(d, b);
        d
    });
    context_gone(st, going);
    if let Some(d) = dev {
        st.trueup.context_gone(st, d);
    }
    r
}

// ----- what the container sees -----

/// (free, total) of the current device as the container sees it, or None to ask the driver.
#[inline]
fn visible_info(st: &State) -> Result<Option<(u64, u64)>, CUresult> {
    let (_, d) = current(st)?;
    let limit = st.mem_limit(d);
    if limit == 0 {
        return Ok(None);
    }
    // A context's true-up still measuring: what is free is told after it.
    st.trueup.settle(st, d, || true);
    // What the driver took since the last measurement (modules loaded lazily at a kernel's first
    // launch, say) is charged before the answer, at most once per 100 ms (see `trueup`): what an
    // application reads here is what it can allocate.
    if st.trueup.on() {
        st.trueup.near_limit(st, d, false, 0);
    }
    st.reap_dead_every_100ms();
    let phys = st.phys_total(d);
    let total = if phys == 0 { limit } else { limit.min(phys) };
    Ok(Some((total.saturating_sub(st.used(d)), total)))
}

/// What device `ordinal` is said to hold when the driver says `reported`: at most the container's
/// limit on it.
pub(crate) fn visible_total(st: &State, ordinal: CUdevice, reported: u64) -> u64 {
    match st.dev_of(ordinal).map(|d| st.mem_limit(d)) {
        Ok(l) if l != 0 => reported.min(l),
        _ => reported,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use vgpu_region::{Init, Region};

    const MIB: u64 = 1 << 20;
    const OOM: CUresult = CUresult::OUT_OF_MEMORY;

    /// A state over a new region of one device limited to `limit` bytes, watched (no true-up).
    fn limited(limit: u64) -> &'static State {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path =
            std::env::temp_dir().join(format!("vgpu-memory-test-{}-{}", std::process::id(), N.fetch_add(1, Relaxed)));
        let _ = std::fs::remove_file(&path);
        let init = || Init { devices: vec![("GPU-test".into(), limit, 0)], standalone: false };
        let region = Region::open_or_create(&path, init).expect("region");
        let _ = std::fs::remove_file(&path);
        State::for_test(region)
    }

    fn used(st: &State) -> u64 {
        st.used(0)
    }

    fn on_dev0() -> Made<(usize, u64)> {
        Ok((0, 0))
    }

    fn never<T>() -> Made<T> {
        panic!("the driver must not be asked")
    }

    #[test]
    fn an_allocation_over_the_limit_is_refused_before_the_driver_is_asked() {
        let st = limited(4 * MIB);
        assert_eq!(linear(st, 3 * MIB, on_dev0, || Ok(0x1000)), Ok(0x1000));
        assert_eq!(used(st), 3 * MIB);
        assert_eq!(linear(st, 2 * MIB, on_dev0, never), Err(OOM));
        assert_eq!(used(st), 3 * MIB, "a refusal charges nothing");
        assert_eq!(linear(st, MIB, on_dev0, || Ok(0x2000)), Ok(0x2000), "up to the limit exactly");
        assert_eq!(used(st), 4 * MIB);
    }

    #[test]
    fn a_reservation_is_given_back_when_the_driver_refuses() {
        let st = limited(4 * MIB);
        assert_eq!(linear(st, 3 * MIB, on_dev0, || Err(CUresult::UNKNOWN)), Err(CUresult::UNKNOWN));
        assert_eq!(used(st), 0);
        assert_eq!(freeing(st, 0x1000, || OK), OK);
        assert_eq!(used(st), 0, "nothing was remembered for the refused allocation");
        assert_eq!(linear(st, 4 * MIB, on_dev0, || Ok(0x1000)), Ok(0x1000), "the whole limit is there");
        // The site of the allocation cannot be told: refused as the driver refused it, uncharged.
        assert_eq!(linear(st, MIB, || Err(CUresult::INVALID_CONTEXT), never), Err(CUresult::INVALID_CONTEXT));
        assert_eq!(used(st), 4 * MIB);
    }

    #[test]
    fn a_refused_free_keeps_its_charge_and_a_free_releases_exactly_once() {
        let st = limited(4 * MIB);
        linear(st, MIB, on_dev0, || Ok(0x2000)).unwrap();
        assert_eq!(freeing(st, 0x2000, || CUresult::INVALID_VALUE), CUresult::INVALID_VALUE);
        assert_eq!(used(st), MIB, "the driver still holds it");
        assert_eq!(freeing(st, 0x2000, || OK), OK);
        assert_eq!(used(st), 0);
        assert_eq!(freeing(st, 0x2000, || OK), OK);
        assert_eq!(used(st), 0, "a second free of the address releases nothing");
    }

    #[test]
    fn limits_changed_under_a_running_process_apply_from_its_next_allocation() {
        let st = limited(4 * MIB);
        let region = st.region.as_ref().unwrap();
        linear(st, 3 * MIB, on_dev0, || Ok(0x1000)).unwrap();
        region.set_mem_limit(0, 2 * MIB).unwrap();
        assert_eq!(linear(st, MIB, on_dev0, never), Err(OOM), "over the lowered limit");
        assert_eq!(freeing(st, 0x1000, || OK), OK);
        assert_eq!(linear(st, MIB, on_dev0, || Ok(0x3000)), Ok(0x3000));
        assert_eq!(linear(st, 2 * MIB, on_dev0, never), Err(OOM));
        region.set_mem_limit(0, 8 * MIB).unwrap();
        assert_eq!(linear(st, 7 * MIB, on_dev0, || Ok(0x4000)), Ok(0x4000), "within the raised limit");
        assert_eq!(used(st), 8 * MIB);
    }

    #[test]
    fn a_pitched_allocation_settles_on_its_real_size_or_is_given_back() {
        let st = limited(MIB);
        // 1000 bytes by 100 rows: 1024 x 100 reserved, settled on the driver's pitch of 1000.
        let made = pitched(st, (1000, 100), on_dev0, || Ok((0x1000, 1000)), |_| panic!("it fits"));
        assert_eq!(made, Ok((0x1000, 1000)));
        assert_eq!(used(st), 100_000);
        // A pitch wider than the estimate that does not fit: the allocation is freed and refused.
        let freed = std::cell::Cell::new(0);
        let made = pitched(st, (1000, 900), on_dev0, || Ok((0x2000, 1100)), |p| freed.set(p));
        assert_eq!((made, freed.get()), (Err(OOM), 0x2000));
        assert_eq!(used(st), 100_000, "nothing of it stays charged");
        assert_eq!(pitched(st, (0, 10), on_dev0, || Ok((0, 0)), |_| ()), Ok((0, 0)), "a zero extent is the driver's");
    }

    #[test]
    fn an_array_is_charged_what_the_driver_says_it_occupies() {
        let st = limited(8 * MIB);
        let ok = array(st, 2 * MIB, || Ok((0, 0, 0)), || Ok(0x10), |_, _| Some(3 * MIB), |_| panic!("it fits"));
        assert_eq!(ok, Ok(0x10));
        assert_eq!(used(st), 3 * MIB);
        let gone = std::cell::Cell::new(0);
        let refused = array(st, 2 * MIB, || Ok((0, 0, 0)), || Ok(0x20), |_, _| Some(6 * MIB), |h| gone.set(h));
        assert_eq!((refused, gone.get()), (Err(OOM), 0x20), "destroyed when its real size does not fit");
        assert_eq!(destroy_array(st, 0x10, || CUresult::INVALID_HANDLE), CUresult::INVALID_HANDLE);
        assert_eq!(used(st), 3 * MIB);
        assert_eq!(destroy_array(st, 0x10, || OK), OK);
        assert_eq!(used(st), 0);
    }

    #[test]
    fn the_container_is_shown_its_limit_as_the_device_size() {
        let st = limited(4 * MIB);
        assert_eq!(visible_total(st, 0, 80 << 30), 4 * MIB);
        assert_eq!(visible_total(st, 0, MIB), MIB, "a smaller device stays itself");
        assert_eq!(visible_total(st, -1, 80 << 30), 80 << 30, "not a device of the container");
    }

    static CALLED: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn fake_alloc(_: *mut CUdeviceptr, _: usize) -> CUresult {
        CALLED.fetch_add(1, Relaxed);
        OK
    }

    #[test]
    fn a_null_out_pointer_is_refused_at_the_edge() {
        // SAFETY: a NULL out-pointer, which the edge refuses before anything else.
        let r = unsafe { edge::alloc_v2(fake_alloc, std::ptr::null_mut(), MIB as usize) };
        assert_eq!((r, CALLED.load(Relaxed)), (CUresult::INVALID_VALUE, 0));
    }
}

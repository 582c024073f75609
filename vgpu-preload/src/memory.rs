//! Memory policies: every device allocator reserves on the container's region before the real call
//! and commits or rolls back after; every free releases exactly what its allocation charged.
//! Over the limit the call returns CUDA_ERROR_OUT_OF_MEMORY and the driver is not called.
#![allow(clippy::missing_safety_doc)]

use crate::log::{vlog, INFO};
use crate::pools;
use crate::ptrmap::{ctx_of, pack, pack_in, unpack};
use crate::real::{cuda_fns as f, driver};
use crate::state::{state, State};
use cuda_abi::*;
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{
    AtomicU64,
    Ordering::{AcqRel, Acquire},
};

const OK: CUresult = CUresult::SUCCESS;

/// Reserve `bytes` on `dev`, run `call`, and keep the reservation only if it succeeded.
#[inline]
fn charged(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let _flight = st.in_flight(dev, bytes);
    if let Err(e) = st.reserve(dev, bytes) {
        return e;
    }
    commit(st, dev, bytes, call)
}

/// [`charged`] for a context's overhead.
fn context_charged(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let _flight = st.in_flight(dev, bytes);
    if let Err(e) = st.reserve_context(dev, bytes) {
        return e;
    }
    commit(st, dev, bytes, call)
}

#[inline]
fn commit(st: &State, dev: usize, bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let r = call();
    if r != OK {
        st.release(dev, bytes);
    }
    r
}

#[inline]
fn current(st: &State) -> Result<(CUdevice, usize), CUresult> {
    st.current_dev()
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return e,
        }
    };
}

/// The current context's handle (0: none, or the driver lacks the call).
#[inline]
pub(crate) fn current_ctx() -> u64 {
    let Some(get) = driver().helpers.cuCtxGetCurrent else { return 0 };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    if unsafe { get(&mut c) } != OK {
        return 0;
    }
    c as u64
}

/// The context of `stream` (0: the driver cannot say): the current one for the default streams.
/// For a stream of a green context, the primary context of its device (`cuStreamGetCtx_v2`, CUDA
/// 12.5 and later; the first form refuses such streams).
#[inline]
pub(crate) fn stream_ctx(stream: CUstream) -> u64 {
    if stream as usize <= CU_STREAM_PER_THREAD {
        return current_ctx();
    }
    let h = &driver().helpers;
    let mut c: CUcontext = std::ptr::null_mut();
    let r = match (h.cuStreamGetCtx_v2, h.cuStreamGetCtx) {
        (Some(get), _) => {
            let mut green: *mut c_void = std::ptr::null_mut();
            // SAFETY: the caller's stream handle and out-pointers to locals.
            unsafe { get(stream, &mut c, &mut green) }
        }
        // SAFETY: as above.
        (None, Some(get)) => unsafe { get(stream, &mut c) },
        (None, None) => return 0,
    };
    if r != OK {
        return 0;
    }
    c as u64
}

/// Runs `f` with context `ctx` current on this thread (pushed, then popped), unless it is already;
/// None if it could not be made current. `ctx` is a primary or a regular context, which may be
/// current on several threads at once.
#[cold]
pub(crate) fn with_context<T>(ctx: u64, f: impl FnOnce() -> T) -> Option<T> {
    if ctx == current_ctx() {
        return Some(f());
    }
    let h = &driver().helpers;
    let (Some(push), Some(pop)) = (h.cuCtxPushCurrent_v2, h.cuCtxPopCurrent_v2) else { return None };
    // SAFETY: a context handle the driver returned; pushed for `f` and popped after it.
    if unsafe { push(ctx as CUcontext) } != OK {
        return None;
    }
    let v = f();
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; pops what was pushed above.
    unsafe { pop(&mut popped) };
    Some(v)
}

/// Where an allocation is made: the current context's region device and the context's id (0: not
/// tracked). One driver call, as `current` is, once the context is known.
#[inline]
fn site(st: &State) -> Result<(usize, u64), CUresult> {
    let ctx = current_ctx();
    if ctx != 0 {
        if let Some(found) = st.contexts.lookup(ctx) {
            return Ok(found);
        }
    }
    let (_, d) = current(st)?;
    Ok((d, if ctx == 0 { 0 } else { st.contexts.add(ctx, d) }))
}

/// Raised whenever a stream handle may stop naming the stream it named: before a stream is
/// destroyed, and when a context goes (with its streams). A thread's remembered stream is good only
/// under the generation it was asked under.
static STREAMS_GEN: AtomicU64 = AtomicU64::new(0);

/// Per thread: the stream last asked for its device, the generation it was asked under, and the
/// answer (CUDA ordinal, region device). A thread launching into a stream of its own asks once.
#[derive(Clone, Copy)]
struct LastStream {
    stream: usize,
    gen: u64,
    ordinal: CUdevice,
    dev: usize,
}

thread_local! {
    static LAST_STREAM: Cell<LastStream> = const { Cell::new(LastStream { stream: 0, gen: u64::MAX, ordinal: 0, dev: 0 }) };
}

/// Stream handles may be reused from now on for other streams: forget every thread's answer.
pub(crate) fn streams_changed() {
    STREAMS_GEN.fetch_add(1, AcqRel);
}

/// `cuStreamDestroy` and `_v2`: the handle may name another stream (of another context) once the
/// driver has let it go, so every thread's remembered answer goes, before and after (an answer
/// taken while the driver destroys the stream is not kept either).
/// A capture open on the stream ends with it (see `capture::destroyed`).
pub unsafe fn stream_destroy(real: f::cuStreamDestroy, s: CUstream) -> CUresult {
    streams_changed();
    let capturing = crate::capture::destroying(s);
    // SAFETY: the caller's argument, forwarded unchanged (the hook's contract).
    let r = unsafe { real(s) };
    streams_changed();
    if r == OK {
        crate::capture::destroyed(s, capturing);
    }
    r
}

/// The device of `stream` (CUDA ordinal, region device). The default streams are the current
/// context's, and so is every stream of a process that sees one device; any other stream is asked
/// for its context (one driver call, as `current` is), looked up in the context table, and the
/// answer kept for the thread's next call on the same stream while no stream or context went.
#[inline]
pub(crate) fn stream_dev(st: &State, stream: CUstream) -> Result<(CUdevice, usize), CUresult> {
    if st.sees_one_device() || stream as usize <= CU_STREAM_PER_THREAD {
        return current(st);
    }
    let gen = STREAMS_GEN.load(Acquire);
    let last = LAST_STREAM.with(Cell::get);
    if last.stream == stream as usize && last.gen == gen {
        return Ok((last.ordinal, last.dev));
    }
    let ctx = stream_ctx(stream);
    if ctx == 0 {
        // A bad stream (the driver's own call refuses it too), or a driver without the call.
        return current(st);
    }
    let known = st.contexts.lookup(ctx);
    let (ordinal, dev) = match known.and_then(|(d, _)| Some((st.ordinal_of(d)?, d))) {
        Some(found) => found,
        None => context_dev(st, ctx, known.is_some())?,
    };
    // Under the generation read before asking: a stream destroyed meanwhile makes it stale.
    LAST_STREAM.with(|c| c.set(LastStream { stream: stream as usize, gen, ordinal, dev }));
    Ok((ordinal, dev))
}

/// The device of context `ctx`, which the table does not know yet (or not with an ordinal): asked
/// of the driver with the context pushed for the question (unless it is current), and added to the
/// table unless it is there (`known`).
#[cold]
fn context_dev(st: &State, ctx: u64, known: bool) -> Result<(CUdevice, usize), CUresult> {
    let (o, d) = with_context(ctx, || current(st)).unwrap_or_else(|| current(st))?;
    if !known {
        st.contexts.add(ctx, d);
    }
    Ok((o, d))
}

/// The id of the current context, a context of region device `d` (0: not tracked).
fn ctx_id(st: &State, d: usize) -> u64 {
    match current_ctx() {
        0 => 0,
        ctx => st.contexts.lookup(ctx).map_or_else(|| st.contexts.add(ctx, d), |(_, id)| id),
    }
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

/// The common shape of a linear allocator: charge `size` on the current device, call the driver,
/// remember the pointer it wrote to `dptr`. `counted` false (or a NULL `dptr`, or size 0) forwards.
/// `scoped`: the allocation belongs to the current context and goes with it.
#[inline]
unsafe fn linear(
    dptr: *mut CUdeviceptr,
    size: usize,
    counted: bool,
    scoped: bool,
    call: impl Fn() -> CUresult,
) -> CUresult {
    let st = state();
    if dptr.is_null() || size == 0 || !counted {
        return call();
    }
    let (d, ctx) = if scoped { tri!(site(st)) } else { (tri!(current(st)).1, 0) };
    let r = charged(st, d, size as u64, &call);
    if r == OK {
        // SAFETY: the driver just wrote the new pointer through dptr.
        st.ptrs.insert(unsafe { *dptr }, pack_in(d, ctx, size as u64));
    }
    r
}

pub unsafe fn alloc_v2(real: f::cuMemAlloc_v2, dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's
    // contract); `spill` gets the same out-pointer and size.
    unsafe {
        linear(dptr, size, true, true, || match real(dptr, size) {
            CUresult::OUT_OF_MEMORY if state().oversubscribe() => spill(state(), dptr, size),
            r => r,
        })
    }
}

/// `CUDA_OVERSUBSCRIBE` (or the agent's flag): the driver refused `size` bytes that are within the
/// container's limit (the caller holds their reservation) for want of physical memory. Serve them as
/// unified memory, which a GPU that pages on demand (concurrent managed access: Linux, Pascal and
/// later) keeps between itself and the host; where unified memory must fit on the GPU, the driver
/// refuses it too and the refusal stands. The pointer is freed by `cuMemFree` like any other.
///
/// # Safety
/// `dptr` is the caller's out-pointer (NULL is refused).
#[cold]
unsafe fn spill(st: &State, dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let refused = CUresult::OUT_OF_MEMORY;
    let Some(managed) = driver().cuda.cuMemAllocManaged.filter(|_| !dptr.is_null()) else { return refused };
    let Ok((_, region_dev)) = current(st) else { return refused };
    // SAFETY: the caller's out-pointer and size (see above).
    let r = unsafe { managed(dptr, size, CU_MEM_ATTACH_GLOBAL) };
    if r == OK {
        if let Some((region, _)) = st.accounting() {
            region.note_spill(region_dev, size as u64);
        }
        vlog!(INFO, "device {region_dev}: the GPU is full: {size} bytes served as unified memory (CUDA_OVERSUBSCRIBE)");
    }
    r
}

pub unsafe fn alloc_v1(real: f::cuMemAlloc, dptr: *mut u32, size: u32) -> CUresult {
    let st = state();
    if dptr.is_null() || size == 0 {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        return unsafe { real(dptr, size) };
    }
    let (d, ctx) = tri!(site(st));
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = charged(st, d, size as u64, || unsafe { real(dptr, size) });
    if r == OK {
        // SAFETY: the driver returned success, so it wrote the caller's out-pointer(s).
        st.ptrs.insert(unsafe { *dptr } as u64, pack_in(d, ctx, size as u64));
    }
    r
}

pub unsafe fn alloc_managed(real: f::cuMemAllocManaged, dptr: *mut CUdeviceptr, size: usize, flags: u32) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { linear(dptr, size, state().cfg.count_managed, true, || real(dptr, size, flags)) }
}

/// Pitched allocations reserve an estimate (rows padded to 512 bytes), then settle on the real size.
pub unsafe fn alloc_pitch(
    real: f::cuMemAllocPitch_v2,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's
    // contract); the out-pointers are read only after the driver reported success.
    unsafe {
        pitched(
            if dptr.is_null() || pitch.is_null() { (0, 0) } else { (width as u64, height as u64) },
            || real(dptr, pitch, width, height, elem),
            || (*dptr, *pitch as u64),
        )
    }
}

/// The original `cuMemAllocPitch` (32-bit pointer, pitch and extents), as `alloc_pitch`.
pub unsafe fn alloc_pitch_v1(
    real: f::cuMemAllocPitch,
    dptr: *mut u32,
    pitch: *mut u32,
    width: u32,
    height: u32,
    elem: u32,
) -> CUresult {
    // SAFETY: as in `alloc_pitch`.
    unsafe {
        pitched(
            if dptr.is_null() || pitch.is_null() { (0, 0) } else { (width as u64, height as u64) },
            || real(dptr, pitch, width, height, elem),
            || (*dptr as u64, *pitch as u64),
        )
    }
}

/// A pitched allocation of `width` bytes by `height` rows made by `call`; `read` gives the pointer
/// and pitch the driver wrote. A zero extent (or a NULL out-pointer, passed as zero) forwards
/// unchanged.
///
/// # Safety
/// `read` may be called only after `call` succeeded.
unsafe fn pitched(
    (width, height): (u64, u64),
    call: impl Fn() -> CUresult,
    read: impl FnOnce() -> (u64, u64),
) -> CUresult {
    let st = state();
    if width == 0 || height == 0 {
        return call();
    }
    let (d, ctx) = tri!(site(st));
    let Some(estimate) = width.div_ceil(512).checked_mul(512).and_then(|p| p.checked_mul(height)) else {
        return CUresult::OUT_OF_MEMORY;
    };
    let r = charged(st, d, estimate, call);
    if r != OK {
        return r;
    }
    let (p, pitch) = read();
    // SAFETY: freeing the allocation the driver just made, if its size does not fit.
    let bytes = settle(st, d, estimate, pitch.saturating_mul(height), || unsafe {
        if let Some(free) = driver().helpers.cuMemFree_v2 {
            free(p);
        }
    });
    match bytes {
        Some(b) => {
            st.ptrs.insert(p, pack_in(d, ctx, b));
            OK
        }
        None => CUresult::OUT_OF_MEMORY,
    }
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
fn freeing(dptr: CUdeviceptr, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
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

pub unsafe fn free_v2(real: f::cuMemFree_v2, dptr: CUdeviceptr) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    freeing(dptr, || unsafe { real(dptr) })
}

pub unsafe fn free_v1(real: f::cuMemFree, dptr: u32) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    freeing(dptr as u64, || unsafe { real(dptr) })
}

// ----- stream-ordered allocator: the pools' reservations are charged (see `pools`) -----
// Pools belong to a device (or the host), not to a context: their allocations carry their pool,
// and a context's end releases them only once the driver reports their pool unused (see
// `context_gone`), so it cannot make memory the pool still uses uncounted.

/// A stream-ordered allocation from `pool` (None: the current device's current pool) on `stream`:
/// the pool's charged slack is used first, the quota for the rest. Into a capturing stream it makes
/// an allocation node of the graph, not memory: the graph's launches are charged for it (see
/// `graphmem`).
#[inline]
unsafe fn pooled(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
    call: impl Fn() -> CUresult,
) -> CUresult {
    if dptr.is_null() || size == 0 || crate::capture::captures(stream) {
        return call();
    }
    let st = state();
    // `cuMemAllocAsync` draws from the current pool of the stream's device, which need not be the
    // current context's; `cuMemAllocFromPoolAsync`'s pool says where its memory is.
    let (ordinal, here) = tri!(if pool.is_none() { stream_dev(st, stream) } else { current(st) });
    let handle = pool.map_or_else(|| pools::current(ordinal), |p| p as u64);
    let Some(i) = pools::index(handle, here) else {
        // SAFETY: the caller's out-pointer (`linear` writes nothing else).
        return unsafe { linear(dptr, size, true, false, call) };
    };
    // The pool's memory may be another device's (`cuMemAllocFromPoolAsync` takes a pool of any
    // device), or the host's (not charged).
    let d = match pools::dev(i) {
        pools::HOST => return call(),
        pools::UNKNOWN => here,
        d => d,
    };
    let size = size as u64;
    let (mut took, mut need);
    let mut settled = false;
    let mut _flight = st.in_flight(d, 0);
    loop {
        took = pools::take(i, size);
        need = size - took;
        if need == 0 {
            break;
        }
        _flight = st.in_flight(d, need);
        match st.reserve(d, need) {
            Ok(()) => break,
            Err(e) => {
                pools::untake(i, took);
                // The refusal's own settling ran while this allocation held `took` out of the
                // pool's slack: settled again without it, and tried once more if that gave
                // anything back.
                if settled || pools::settle(st, i) == 0 {
                    return e;
                }
                settled = true;
            }
        }
    }
    let r = call();
    if r != OK {
        st.release(d, need);
        pools::untake(i, took);
        return r;
    }
    pools::allocated(i, size, need > 0);
    // SAFETY: the driver just wrote the new pointer through dptr.
    st.ptrs.insert(unsafe { *dptr }, pack_in(d, pools::POOL_TAG | i as u64, size));
    r
}

pub unsafe fn alloc_async(real: f::cuMemAllocAsync, dptr: *mut CUdeviceptr, size: usize, s: CUstream) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { pooled(dptr, size, None, s, || real(dptr, size, s)) }
}

pub unsafe fn alloc_async_ptsz(
    real: f::cuMemAllocAsync_ptsz,
    dptr: *mut CUdeviceptr,
    size: usize,
    s: CUstream,
) -> CUresult {
    // SAFETY: as above.
    unsafe { pooled(dptr, size, None, crate::capture::ptsz(s), || real(dptr, size, s)) }
}

pub unsafe fn alloc_from_pool(
    real: f::cuMemAllocFromPoolAsync,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    // SAFETY: as above.
    unsafe { pooled(dptr, size, Some(pool), s, || real(dptr, size, pool, s)) }
}

pub unsafe fn alloc_from_pool_ptsz(
    real: f::cuMemAllocFromPoolAsync_ptsz,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    // SAFETY: as above.
    unsafe { pooled(dptr, size, Some(pool), crate::capture::ptsz(s), || real(dptr, size, pool, s)) }
}

pub unsafe fn free_async(real: f::cuMemFreeAsync, dptr: CUdeviceptr, s: CUstream) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    freeing(dptr, || unsafe { real(dptr, s) })
}

// ----- VMM: the physical handle is charged, rounded up to the allocation granularity, until its
// memory goes (see `vmm`) -----

pub unsafe fn vmm_create(
    real: f::cuMemCreate,
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let st = state();
    // SAFETY: optional input pointer from the caller.
    let Some(p) = (unsafe { prop.as_ref() }) else { return unsafe { real(handle, size, prop, flags) } };
    if handle.is_null() || size == 0 || p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return unsafe { real(handle, size, prop, flags) };
    }
    let d = tri!(st.dev_of(p.location.id));
    let mut g = 0usize;
    let gran = match driver().helpers.cuMemGetAllocationGranularity {
        // SAFETY: an out-pointer to a local and the caller's allocation properties.
        Some(gf) if unsafe { gf(&mut g, prop, 0) } == OK && g > 0 => g as u64,
        _ => 1,
    };
    let bytes = (size as u64).div_ceil(gran) * gran;
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = charged(st, d, bytes, || unsafe { real(handle, size, prop, flags) });
    if r == OK {
        // SAFETY: the driver returned success, so it wrote the caller's out-pointer(s).
        crate::vmm::created(unsafe { *handle }, d, bytes);
    }
    r
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
fn array_estimate(w: usize, h: usize, d: usize, format: u32, ch: u32) -> u64 {
    let row = (w as u64 * format_bytes(format) * ch.max(1) as u64).div_ceil(512) * 512;
    row.saturating_mul(h.max(1) as u64).saturating_mul(d.max(1) as u64).max(2 << 20)
}

/// Creates an array through `create`, reserving `estimate` first and settling on what the driver
/// reports afterwards. `estimate` None (no descriptor) or a NULL `out` forwards unchanged.
unsafe fn array_common(
    estimate: Option<u64>,
    out: *mut *mut std::ffi::c_void,
    create: impl Fn() -> CUresult,
    requirements: impl Fn(u64, CUdevice) -> Option<u64>,
    destroy: impl FnOnce(u64),
) -> CUresult {
    let st = state();
    let Some(estimate) = estimate.filter(|_| !out.is_null()) else { return create() };
    let (o, d) = tri!(current(st));
    let ctx = ctx_id(st, d);
    let r = charged(st, d, estimate, &create);
    if r != OK {
        return r;
    }
    // SAFETY: the driver just wrote the new handle through `out`.
    let h = unsafe { *out } as u64;
    let actual = requirements(h, o).unwrap_or(estimate);
    match settle(st, d, estimate, actual, || destroy(h)) {
        Some(b) => {
            st.handles.insert(h | ARRAY_TAG, pack_in(d, ctx, b));
            OK
        }
        None => CUresult::OUT_OF_MEMORY,
    }
}

fn array_req(h: u64, o: CUdevice) -> Option<u64> {
    let f = driver().helpers.cuArrayGetMemoryRequirements?;
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    // SAFETY: out-pointer to a local; h is the array just created.
    (unsafe { f(&mut req, h as CUarray, o) } == OK).then_some(req.size as u64)
}

fn mipmapped_req(h: u64, o: CUdevice) -> Option<u64> {
    let f = driver().helpers.cuMipmappedArrayGetMemoryRequirements?;
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    // SAFETY: as above.
    (unsafe { f(&mut req, h as CUmipmappedArray, o) } == OK).then_some(req.size as u64)
}

fn destroy_array(h: u64) {
    if let Some(f) = driver().helpers.cuArrayDestroy {
        // SAFETY: destroying the array we just created.
        unsafe { f(h as CUarray) };
    }
}

pub unsafe fn array_create(
    real: f::cuArrayCreate_v2,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    // SAFETY: optional input pointer.
    let est = unsafe { desc.as_ref() }.map(|x| array_estimate(x.Width, x.Height, 0, x.Format, x.NumChannels));
    unsafe { array_common(est, arr, || real(arr, desc), array_req, destroy_array) }
}

pub unsafe fn array3d_create(
    real: f::cuArray3DCreate_v2,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    // SAFETY: optional input pointer.
    let est = unsafe { desc.as_ref() }.map(|x| array_estimate(x.Width, x.Height, x.Depth, x.Format, x.NumChannels));
    unsafe { array_common(est, arr, || real(arr, desc), array_req, destroy_array) }
}

pub unsafe fn array_create_v1(
    real: f::cuArrayCreate,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR_v1,
) -> CUresult {
    // SAFETY: optional input pointer.
    let est = unsafe { desc.as_ref() }
        .map(|x| array_estimate(x.Width as usize, x.Height as usize, 0, x.Format, x.NumChannels));
    unsafe { array_common(est, arr, || real(arr, desc), array_req, destroy_array) }
}

pub unsafe fn array3d_create_v1(
    real: f::cuArray3DCreate,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1,
) -> CUresult {
    // SAFETY: optional input pointer.
    let est = unsafe { desc.as_ref() }
        .map(|x| array_estimate(x.Width as usize, x.Height as usize, x.Depth as usize, x.Format, x.NumChannels));
    unsafe { array_common(est, arr, || real(arr, desc), array_req, destroy_array) }
}

pub unsafe fn mipmapped_create(
    real: f::cuMipmappedArrayCreate,
    arr: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    // SAFETY: optional input pointer.
    let est = unsafe { desc.as_ref() }.filter(|_| levels > 0).map(|x| {
        let (mut w, mut h, mut dd, mut est) = (x.Width, x.Height, x.Depth, 0u64);
        for _ in 0..levels.min(32) {
            est = est.saturating_add(array_estimate(w, h, dd, x.Format, x.NumChannels));
            w = (w / 2).max(1);
            h = if h == 0 { 0 } else { (h / 2).max(1) };
            dd = if dd == 0 { 0 } else { (dd / 2).max(1) };
        }
        est
    });
    let destroy = |h: u64| {
        if let Some(f) = driver().helpers.cuMipmappedArrayDestroy {
            // SAFETY: destroying the array we just created.
            unsafe { f(h as CUmipmappedArray) };
        }
    };
    unsafe { array_common(est, arr, || real(arr, desc, levels), mipmapped_req, destroy) }
}

/// An array's destruction through `call`: its entry taken out first and put back if the driver
/// refuses (as for a free, see `freeing`: the driver may hand the handle out again at once).
fn destroying(key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
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

pub unsafe fn array_destroy(real: f::cuArrayDestroy, arr: CUarray) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    destroying(arr as u64 | ARRAY_TAG, || unsafe { real(arr) })
}

pub unsafe fn mipmapped_destroy(real: f::cuMipmappedArrayDestroy, arr: CUmipmappedArray) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    destroying(arr as u64 | ARRAY_TAG, || unsafe { real(arr) })
}

// ----- contexts: each costs `VGPU_CONTEXT_OVERHEAD` of device memory -----

pub unsafe fn primary_retain(real: f::cuDevicePrimaryCtxRetain, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let st = state();
    let d = tri!(st.dev_of(dev));
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let Some(refs) = st.primary_refs.get(dev as usize) else { return unsafe { real(pctx, dev) } };
    let _g = st.primary_lock.lock().unwrap_or_else(|p| p.into_inner());
    if refs.load(std::sync::atomic::Ordering::Acquire) > 0 {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        let r = unsafe { real(pctx, dev) };
        if r == OK {
            refs.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        return r;
    }
    let before = st.trueup.before_context(st, d);
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = context_charged(st, d, st.cfg.context_overhead, || unsafe { real(pctx, dev) });
    if r == OK {
        refs.store(1, std::sync::atomic::Ordering::Release);
        if let Some(c) = st.primary_ctx.get(dev as usize) {
            // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
            c.store(unsafe { *pctx } as u64, std::sync::atomic::Ordering::Release);
        }
        st.trueup.after_context(st, d, before);
    }
    r
}

/// `cuCtxSetLimit`: a larger stack (per thread, for every thread the GPU holds at once: SMs x
/// threads per SM), printf FIFO or malloc heap is device memory the driver takes for the current
/// context at once (the stack can reach gigabytes). Reserved before the driver is asked (refused
/// over the limit, as the driver refuses what it has no room for), settled on the value the driver
/// set (it may round), and released when the context goes. A lowered limit keeps its charge until
/// then (the driver need not give the memory back), so a raise charges only what lies above the
/// highest value charged (`ctxlimits`), and one thread at a time charges.
pub unsafe fn ctx_set_limit(real: f::cuCtxSetLimit, limit: i32, value: usize) -> CUresult {
    const STACK: i32 = 0; // CU_LIMIT_STACK_SIZE; 1 and 2: the printf FIFO and the malloc heap
    let st = state();
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the
    // hook's contract).
    let pass = || unsafe { real(limit, value) };
    let (Some(get), Some(attr), Some(cur)) =
        (driver().helpers.cuCtxGetLimit, driver().helpers.cuDeviceGetAttribute, driver().helpers.cuCtxGetCurrent)
    else {
        return pass();
    };
    if !(0..=2).contains(&limit) || st.accounting().is_none() {
        return pass();
    }
    let Ok((ordinal, d)) = current(st) else { return pass() };
    let per = if limit == STACK {
        let (mut sms, mut threads) = (0, 0);
        // SAFETY: out-pointers to locals, and the current context's device.
        unsafe {
            attr(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal);
            attr(&mut threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, ordinal);
        }
        sms.max(0) as u64 * threads.max(0) as u64
    } else {
        1
    };
    let _turn = crate::ctxlimits::Turn::take();
    let (mut old, mut ctx) = (0usize, std::ptr::null_mut());
    // SAFETY: out-pointers to locals.
    let known = unsafe { get(&mut old, limit) == OK && cur(&mut ctx) == OK };
    // Charged from the value the driver has, or from the highest one charged if it was lowered.
    let from = old.max(crate::ctxlimits::charged_to(ctx as u64, limit as usize));
    if per == 0 || !known || value <= from {
        return pass();
    }
    let held = |v: usize| (v.saturating_sub(from) as u64).saturating_mul(per);
    let estimate = held(value);
    let r = charged(st, d, estimate, pass);
    if r != OK {
        return r;
    }
    // What the driver set (it may round); if it does not say, what was asked.
    let mut now = value;
    // SAFETY: an out-pointer to a local.
    unsafe { get(&mut now, limit) };
    // SAFETY: setting back the value the driver had, if what it set does not fit.
    let Some(bytes) = settle(st, d, estimate, held(now), || unsafe {
        real(limit, old);
    }) else {
        return CUresult::OUT_OF_MEMORY;
    };
    crate::ctxlimits::set_charged_to(ctx as u64, limit as usize, now.max(from));
    // Charged to the context, released when it goes.
    if st.primary_ctx.get(ordinal as usize).is_some_and(|p| p.load(std::sync::atomic::Ordering::Acquire) == ctx as u64)
    {
        st.primary_limits[ordinal as usize].fetch_add(bytes, std::sync::atomic::Ordering::AcqRel);
    } else if let Some(v) = st.handles.remove(ctx as u64 | CTX_TAG) {
        let (hd, hb) = unpack(v);
        st.handles.insert(ctx as u64 | CTX_TAG, pack(hd, hb + bytes));
    }
    OK
}

/// What the primary context of `ordinal` was charged for its limits, released (it went, or was
/// reset to its defaults).
fn primary_limits_gone(st: &State, ordinal: CUdevice, d: usize) {
    if let Some(b) = st.primary_limits.get(ordinal as usize) {
        st.release(d, b.swap(0, std::sync::atomic::Ordering::AcqRel));
    }
}

pub unsafe fn primary_release(real: f::cuDevicePrimaryCtxRelease, dev: CUdevice) -> CUresult {
    let st = state();
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let call = || unsafe { real(dev) };
    let (Ok(d), Some(refs)) = (st.dev_of(dev), st.primary_refs.get(dev as usize)) else { return call() };
    let _g = st.primary_lock.lock().unwrap_or_else(|p| p.into_inner());
    // The last release destroys the primary context, and what was allocated in it.
    let last = refs.load(std::sync::atomic::Ordering::Acquire) == 1;
    let going =
        last.then(|| Going::new(st, st.primary_ctx[dev as usize].load(std::sync::atomic::Ordering::Acquire), false));
    let r = call();
    if r != OK {
        if let Some(g) = going {
            g.stays(st);
        }
        return r;
    }
    if let Some(g) = going {
        st.release(d, st.cfg.context_overhead);
        primary_limits_gone(st, dev, d);
        context_gone(st, g);
        st.trueup.context_gone(st, d);
    }
    let _ = refs
        .fetch_update(std::sync::atomic::Ordering::AcqRel, std::sync::atomic::Ordering::Acquire, |x| x.checked_sub(1));
    r
}

/// Resetting a primary context frees every allocation made in it; the context stays retained.
pub unsafe fn primary_reset(real: f::cuDevicePrimaryCtxReset, dev: CUdevice) -> CUresult {
    let st = state();
    let ctx = st.primary_ctx.get(dev as usize).map(|c| c.load(std::sync::atomic::Ordering::Acquire));
    // Its timing events go with the reset: out of use before the driver is asked, so that no other
    // thread's collection asks about them once they are gone.
    let events = ctx.map(crate::sm::take_events);
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(dev) };
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
    if let Ok(d) = st.dev_of(dev) {
        primary_limits_gone(st, dev, d);
    }
    r
}

pub unsafe fn ctx_create(real: f::cuCtxCreate_v2, pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { created(pctx, dev, || real(pctx, flags, dev)) }
}

/// `cuCtxCreate_v3` (execution affinity): charged as v2's.
pub unsafe fn ctx_create_v3(
    real: f::cuCtxCreate_v3,
    pctx: *mut CUcontext,
    params: *mut c_void,
    n: i32,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { created(pctx, dev, || real(pctx, params, n, flags, dev)) }
}

/// `cuCtxCreate_v4` (create parameters; what `cuCtxCreate` means from CUDA 13): charged as v2's.
pub unsafe fn ctx_create_v4(
    real: f::cuCtxCreate_v4,
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { created(pctx, dev, || real(pctx, params, flags, dev)) }
}

/// A new (non-primary) context on `dev` that `call` creates into `*pctx`: its overhead charged,
/// remembered until it is destroyed.
///
/// # Safety
/// `call` is the real entry point applied to the caller's arguments; `pctx` is the caller's.
unsafe fn created(pctx: *mut CUcontext, dev: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
    if pctx.is_null() {
        return call();
    }
    let d = tri!(st.dev_of(dev));
    let bytes = st.cfg.context_overhead;
    let before = st.trueup.before_context(st, d);
    let r = context_charged(st, d, bytes, call);
    if r == OK {
        // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
        st.handles.insert(unsafe { *pctx } as u64 | CTX_TAG, pack(d, bytes));
        st.trueup.after_context(st, d, before);
    }
    r
}

pub unsafe fn ctx_destroy(real: f::cuCtxDestroy_v2, ctx: CUcontext) -> CUresult {
    let st = state();
    let going = Going::new(st, ctx as u64, true);
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(ctx) };
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
    st.trueup.settle(d);
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

pub unsafe fn get_info_v2(real: f::cuMemGetInfo_v2, free: *mut usize, total: *mut usize) -> CUresult {
    if free.is_null() || total.is_null() {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        return unsafe { real(free, total) };
    }
    match tri!(visible_info(state())) {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        None => unsafe { real(free, total) },
        Some((f, t)) => {
            // SAFETY: non-null out-pointers from the caller.
            unsafe {
                *free = f as usize;
                *total = t as usize;
            }
            OK
        }
    }
}

pub unsafe fn get_info_v1(real: f::cuMemGetInfo, free: *mut u32, total: *mut u32) -> CUresult {
    if free.is_null() || total.is_null() {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        return unsafe { real(free, total) };
    }
    match tri!(visible_info(state())) {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        None => unsafe { real(free, total) },
        Some((f, t)) => {
            // SAFETY: non-null out-pointers from the caller.
            unsafe {
                *free = f.min(u32::MAX as u64) as u32;
                *total = t.min(u32::MAX as u64) as u32;
            }
            OK
        }
    }
}

pub unsafe fn total_mem_v2(real: f::cuDeviceTotalMem_v2, bytes: *mut usize, dev: CUdevice) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(bytes, dev) };
    if r == OK {
        let st = state();
        if let Ok(d) = st.dev_of(dev) {
            let l = st.mem_limit(d);
            if l != 0 {
                // SAFETY: the driver just wrote through it.
                unsafe { *bytes = (*bytes).min(l as usize) };
            }
        }
    }
    r
}

pub unsafe fn total_mem_v1(real: f::cuDeviceTotalMem, bytes: *mut u32, dev: CUdevice) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(bytes, dev) };
    if r == OK {
        let st = state();
        if let Ok(d) = st.dev_of(dev) {
            let l = st.mem_limit(d);
            if l != 0 {
                // SAFETY: the driver just wrote through it.
                unsafe { *bytes = (*bytes).min(l.min(u32::MAX as u64) as u32) };
            }
        }
    }
    r
}

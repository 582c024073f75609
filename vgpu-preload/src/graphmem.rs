//! Graph memory: allocations made by the nodes of a CUDA graph (`cuGraphAddMemAllocNode`, or
//! `cuMemAllocAsync` captured into a graph, as PyTorch's `cudaMallocAsync` backend does under
//! `torch.cuda.graph`).
//!
//! No call allocates them: a graph allocation's address is given when its node is made, and
//! physical memory backs it only while the graph runs, taken from the device's graph memory pool.
//! The driver grows that pool when a graph that allocates is launched (or uploaded), reuses it for
//! later launches of any graph, and gives it back only on `cuDeviceGraphMemTrim` or with the
//! context. So the pool is what is charged, at the figure the driver reports
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), not the allocations: graphs that run one after the
//! other share one pool, and a sum of their allocations would refuse memory the container never
//! holds.
//!
//! * At instantiation the graph's allocation nodes are read (bytes and device) and kept under the
//!   executable graph's handle.
//! * Before such a graph is launched or uploaded, room is reserved on the container's quota for
//!   what its allocations may add to the pool beyond the pool's spare memory; if the container has
//!   none, the launch is refused with `CUDA_ERROR_OUT_OF_MEMORY` (what the driver answers when the
//!   GPU is full) and the driver is not called. After the call this process's charge is set to the
//!   pool's new reservation and the hold is released.
//! * After `cuDeviceGraphMemTrim`, the destruction of such a graph, and a context's end, the charge
//!   follows the pool down; after a synchronisation it follows the pool either way (a driver that
//!   backs graph allocations as the graph runs, not at its launch, has grown the pool by then).
//!
//! Launches of graphs without memory nodes cost one load while no graph with memory nodes exists in
//! the process, one lock-free lookup otherwise. A stream-ordered allocation into a capturing stream
//! becomes an allocation node, not memory (see `memory::alloc_async`): it is not charged.
#![allow(clippy::missing_safety_doc)]

use crate::capture;
use crate::log::{vlog, INFO};
use crate::ptrmap::PtrMap;
use crate::real::{cuda_fns as f, driver};
use crate::state::{state, State};
use crate::MAX_DEVICES;
use cuda_abi::*;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;

const OK: CUresult = CUresult::SUCCESS;

/// Executable graphs with allocation nodes in this process.
static WITH_MEM: AtomicUsize = AtomicUsize::new(0);
/// This process's charge for each device's graph pool (what the region holds for it).
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// The CUDA ordinal of each region device whose pool was charged.
static ORDINAL: [AtomicI32; MAX_DEVICES] = [const { AtomicI32::new(-1) }; MAX_DEVICES];

/// Executable graph -> (region device, CUDA ordinal, bytes its allocation nodes allocate).
fn execs() -> &'static PtrMap {
    static M: OnceLock<PtrMap> = OnceLock::new();
    M.get_or_init(|| PtrMap::new(10))
}

const BYTES: u64 = (1 << 48) - 1;

fn pack(dev: usize, ordinal: CUdevice, bytes: u64) -> u64 {
    (dev as u64) << 56 | (ordinal as u64 & 0xff) << 48 | bytes.min(BYTES)
}

fn unpack(v: u64) -> (usize, CUdevice, u64) {
    ((v >> 56) as usize, ((v >> 48) & 0xff) as CUdevice, v & BYTES)
}

/// A device's graph pool attribute (`CU_GRAPH_MEM_ATTR_*`), if the driver answers.
fn attr(ordinal: CUdevice, which: i32) -> Option<u64> {
    let get = driver().helpers.cuDeviceGetGraphMemAttribute?;
    let mut v = 0u64;
    // SAFETY: the attributes read here are 64-bit values, written to a local.
    (unsafe { get(ordinal, which, &mut v as *mut u64 as *mut c_void) } == OK).then_some(v)
}

/// The bytes `graph`'s allocation nodes allocate, with the device of the first of them (None: it
/// has none, or the driver cannot say).
fn allocations(graph: CUgraph) -> Option<(CUdevice, u64)> {
    let h = &driver().helpers;
    let (nodes_of, type_of, params_of) = (h.cuGraphGetNodes?, h.cuGraphNodeGetType?, h.cuGraphMemAllocNodeGetParams?);
    let mut n = 0usize;
    // SAFETY: the caller's graph; a NULL array asks for the count only.
    if graph.is_null() || unsafe { nodes_of(graph, std::ptr::null_mut(), &mut n) } != OK || n == 0 {
        return None;
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    let mut got = n;
    // SAFETY: `nodes` has room for `got` handles.
    if unsafe { nodes_of(graph, nodes.as_mut_ptr(), &mut got) } != OK {
        return None;
    }
    nodes.truncate(got.min(n));
    let (mut dev, mut bytes) = (None, 0u64);
    for node in nodes {
        let mut ty = -1;
        // SAFETY: a node handle the driver just gave, and an out-pointer to a local.
        if unsafe { type_of(node, &mut ty) } != OK || ty != CU_GRAPH_NODE_TYPE_MEM_ALLOC {
            continue;
        }
        let mut p = std::mem::MaybeUninit::<CUDA_MEM_ALLOC_NODE_PARAMS>::zeroed();
        // SAFETY: an allocation node, and room for its parameters.
        if unsafe { params_of(node, p.as_mut_ptr()) } != OK {
            continue;
        }
        // SAFETY: zero is a valid value of every field, and the driver filled the rest.
        let p = unsafe { p.assume_init() };
        if p.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            continue;
        }
        // Allocations on other devices than the first (one graph spanning GPUs) are left to the
        // true-up.
        if *dev.get_or_insert(p.poolProps.location.id) == p.poolProps.location.id {
            bytes += p.bytesize as u64;
        }
    }
    dev.filter(|_| bytes > 0).map(|d| (d, bytes))
}

/// Keeps `exec`'s allocations once the driver instantiated it.
fn instantiated(r: CUresult, exec: *mut CUgraphExec, allocs: Option<(CUdevice, u64)>) -> CUresult {
    if r != OK || exec.is_null() {
        return r;
    }
    // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
    let e = unsafe { *exec } as u64;
    if execs().remove(e).is_some() {
        WITH_MEM.fetch_sub(1, AcqRel); // a handle the driver reused without our seeing it go
    }
    let Some((ordinal, bytes)) = allocs else { return r };
    let Ok(d) = state().dev_of(ordinal) else { return r };
    ORDINAL[d].store(ordinal, Relaxed);
    execs().insert(e, pack(d, ordinal, bytes));
    WITH_MEM.fetch_add(1, AcqRel);
    vlog!(INFO, "graph {e:#x}: allocation nodes of {bytes} bytes on device {d}");
    r
}

/// Runs `call`, which may grow `ordinal`'s graph pool by up to `bytes`, within the quota.
fn mapped(d: usize, ordinal: CUdevice, bytes: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state();
    let spare = match (
        attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
        attr(ordinal, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
    ) {
        (Some(r), Some(u)) => r.saturating_sub(u),
        _ => 0,
    };
    let hold = bytes.saturating_sub(spare);
    if hold > 0 {
        if let Err(e) = st.reserve(d, hold) {
            return e;
        }
    }
    ORDINAL[d].store(ordinal, Relaxed);
    let r = call();
    // The pool's new size is charged before the hold goes, so the container never shows less.
    settle(st, d, attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT));
    st.release(d, hold);
    r
}

/// Sets this process's charge for device `d`'s graph pool to `reserved` (None: left as it is).
/// Concurrent settles each apply the difference to what they replaced, so the region always holds
/// exactly `CHARGED`.
fn settle(st: &State, d: usize, reserved: Option<u64>) {
    let Some(now) = reserved else { return };
    let old = CHARGED[d].swap(now, AcqRel);
    if now > old {
        st.charge_held(d, now - old);
    } else if old > now {
        st.release(d, old - now);
    }
}

/// Settles the charge of every device a graph that allocates ran on to what the driver now reports
/// (0 where it no longer answers: the pool went with its context).
fn resettle(st: &State) {
    for (d, o) in ORDINAL.iter().enumerate() {
        let ordinal = o.load(Relaxed);
        if ordinal < 0 {
            continue;
        }
        settle(st, d, Some(attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT).unwrap_or(0)));
    }
}

/// Whether any executable graph of this process allocates (one load).
#[inline]
pub fn any() -> bool {
    WITH_MEM.load(Relaxed) > 0
}

/// A graph launch (`sm` calls this around the throttled launch).
#[inline]
pub fn launched(exec: CUgraphExec, stream: CUstream, launch: impl FnOnce() -> CUresult) -> CUresult {
    if WITH_MEM.load(Relaxed) == 0 {
        return launch();
    }
    launched_with_mem(exec, stream, launch)
}

#[inline(never)]
fn launched_with_mem(exec: CUgraphExec, stream: CUstream, launch: impl FnOnce() -> CUresult) -> CUresult {
    let Some((d, ordinal, bytes)) = execs().get(exec as u64).map(unpack) else { return launch() };
    if capture::captures(stream) {
        return launch(); // a child graph node of the captured graph: nothing runs now
    }
    mapped(d, ordinal, bytes, launch)
}

/// A context went (see `memory::context_gone`): the pool may have gone with it.
pub fn context_gone(st: &State) {
    resettle(st);
}

/// After a synchronisation (see `pools`): a driver that backs graph allocations as the graph runs,
/// rather than at its launch, has grown the pool by now.
pub fn synced(st: &State) {
    if any() {
        resettle(st);
    }
}

/// A forked child has no graphs and no charge of its own.
pub fn after_fork() {
    execs().clear();
    WITH_MEM.store(0, Release);
    for c in &CHARGED {
        c.store(0, Relaxed);
    }
    for o in &ORDINAL {
        o.store(-1, Relaxed);
    }
}

/// An executable graph was destroyed (see `stale::exec_destroy`).
pub fn destroyed(exec: CUgraphExec) {
    if WITH_MEM.load(Relaxed) == 0 {
        return;
    }
    let Some((d, ordinal, _)) = execs().remove(exec as u64).map(unpack) else { return };
    WITH_MEM.fetch_sub(1, AcqRel);
    // The driver keeps the pool for later graphs; if this one does give memory back, follow it.
    settle(state(), d, attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT));
}

// ----- hooks -----

pub unsafe fn instantiate(
    real: f::cuGraphInstantiate,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    err_node: *mut CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> CUresult {
    let allocs = allocations(graph);
    // SAFETY: the caller's arguments, forwarded unchanged (the hook's contract).
    instantiated(unsafe { real(exec, graph, err_node, log, size) }, exec, allocs)
}

pub unsafe fn instantiate_with_flags(
    real: f::cuGraphInstantiateWithFlags,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> CUresult {
    let allocs = allocations(graph);
    // SAFETY: as above.
    instantiated(unsafe { real(exec, graph, flags) }, exec, allocs)
}

/// With `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` the instantiation uploads too: it is charged as an
/// upload.
pub unsafe fn instantiate_with_params(
    real: f::cuGraphInstantiateWithParams,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CUresult {
    let allocs = allocations(graph);
    // SAFETY: the caller's arguments, forwarded unchanged (the hook's contract).
    let call = || unsafe { real(exec, graph, params) };
    // SAFETY: an optional input the caller provides per the CUDA contract.
    let upload = unsafe { params.as_ref() }.is_some_and(|p| p.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0);
    let r = match allocs {
        Some((ordinal, bytes)) if upload => match state().dev_of(ordinal) {
            Ok(d) => mapped(d, ordinal, bytes, call),
            Err(_) => call(),
        },
        _ => call(),
    };
    instantiated(r, exec, allocs)
}

pub unsafe fn upload(real: f::cuGraphUpload, exec: CUgraphExec, stream: CUstream) -> CUresult {
    // SAFETY: as above.
    let call = || unsafe { real(exec, stream) };
    if WITH_MEM.load(Relaxed) == 0 {
        return call();
    }
    match execs().get(exec as u64).map(unpack) {
        Some((d, ordinal, bytes)) => mapped(d, ordinal, bytes, call),
        None => call(),
    }
}

pub unsafe fn trim(real: f::cuDeviceGraphMemTrim, dev: CUdevice) -> CUresult {
    // SAFETY: as above.
    let r = unsafe { real(dev) };
    if r == OK {
        let st = state();
        if let Ok(d) = st.dev_of(dev) {
            settle(st, d, attr(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_values_round_trip() {
        for (d, o, b) in [(0, 0, 1), (3, 7, 123 << 30), (15, 255, BYTES)] {
            assert_eq!(unpack(pack(d, o, b)), (d, o, b));
        }
        assert_eq!(unpack(pack(1, 2, u64::MAX)).2, BYTES, "clamped, never spilling into the ordinal");
    }
}

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
//!   executable graph's handle, one entry per device the graph allocates on (a graph may span GPUs).
//! * Before such a graph is launched or uploaded, room is reserved on the container's quota of each
//!   of those devices for what its allocations may add to that device's pool beyond the pool's
//!   spare memory; if one of them has none, the launch is refused with `CUDA_ERROR_OUT_OF_MEMORY`
//!   (what the driver answers when the GPU is full) and the driver is not called. After the call
//!   this process's charge for each pool is set to its new reservation and the holds are released.
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
use cuda_abi::*;
use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::OnceLock;
use vgpu_region::MAX_DEVICES;

const OK: CUresult = CUresult::SUCCESS;

/// Executable graphs with allocation nodes in this process.
static WITH_MEM: AtomicUsize = AtomicUsize::new(0);
/// This process's charge for each device's graph pool (what the region holds for it).
static CHARGED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// Spare memory of each device's graph pool that launches in progress count as theirs (see
/// [`mapped`]).
static CLAIMED: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// The CUDA ordinal of each region device whose pool was charged.
static ORDINAL: [AtomicI32; MAX_DEVICES] = [const { AtomicI32::new(-1) }; MAX_DEVICES];

/// Executable graph -> (region device, CUDA ordinal, bytes its allocation nodes allocate there,
/// how many more devices it allocates on). The k-th more device's entry is under the key
/// [`more_key`]`(exec, k)` (handles are user-space addresses, below bit 56).
fn execs() -> &'static PtrMap {
    static M: OnceLock<PtrMap> = OnceLock::new();
    M.get_or_init(|| PtrMap::new(10))
}

const BYTES: u64 = (1 << 48) - 1;
const _: () = assert!(MAX_DEVICES <= 16, "a device and a count of devices take 4 bits each");

/// One device a graph allocates on: (region device, CUDA ordinal, bytes).
type Alloc = (usize, CUdevice, u64);

fn pack((dev, ordinal, bytes): Alloc, more: usize) -> u64 {
    (more as u64) << 60 | (dev as u64) << 56 | (ordinal as u64 & 0xff) << 48 | bytes.min(BYTES)
}

fn unpack(v: u64) -> (Alloc, usize) {
    ((((v >> 56) & 0xf) as usize, ((v >> 48) & 0xff) as CUdevice, v & BYTES), (v >> 60) as usize)
}

fn more_key(exec: u64, k: usize) -> u64 {
    exec | (k as u64) << 56
}

/// The devices `exec` allocates on (a copy on the stack: no allocation on the launch path), or
/// None for a graph without allocation nodes.
fn lookup(exec: u64) -> Option<([Alloc; MAX_DEVICES], usize)> {
    entries(exec, |k| execs().get(k))
}

/// Forgets `exec`'s entries, returning what they were.
fn forget(exec: u64) -> Option<([Alloc; MAX_DEVICES], usize)> {
    let r = entries(exec, |k| execs().remove(k));
    if r.is_some() {
        WITH_MEM.fetch_sub(1, AcqRel);
    }
    r
}

/// `exec`'s entries, each read with `op` (the map's `get` or `remove`).
fn entries(exec: u64, op: impl Fn(u64) -> Option<u64>) -> Option<([Alloc; MAX_DEVICES], usize)> {
    let (first, more) = unpack(op(exec)?);
    let mut v = [(0, 0, 0); MAX_DEVICES];
    v[0] = first;
    let mut n = 1;
    for k in 1..=more {
        if let Some(e) = op(more_key(exec, k)) {
            v[n] = unpack(e).0;
            n += 1;
        }
    }
    Some((v, n))
}

/// A device's graph pool attribute (`CU_GRAPH_MEM_ATTR_*`), if the driver answers.
fn attr(ordinal: CUdevice, which: i32) -> Option<u64> {
    let get = driver().helpers.cuDeviceGetGraphMemAttribute?;
    let mut v = 0u64;
    // SAFETY: the attributes read here are 64-bit values, written to a local.
    (unsafe { get(ordinal, which, &mut v as *mut u64 as *mut c_void) } == OK).then_some(v)
}

/// The bytes `graph`'s allocation nodes allocate on each device (CUDA ordinal, bytes), in the order
/// the devices first appear (empty: it has none, or the driver cannot say).
fn allocations(graph: CUgraph) -> Vec<(CUdevice, u64)> {
    let mut per_device: Vec<(CUdevice, u64)> = Vec::new();
    let h = &driver().helpers;
    let (Some(nodes_of), Some(type_of), Some(params_of)) =
        (h.cuGraphGetNodes, h.cuGraphNodeGetType, h.cuGraphMemAllocNodeGetParams)
    else {
        return per_device;
    };
    let mut n = 0usize;
    // SAFETY: the caller's graph; a NULL array asks for the count only.
    if graph.is_null() || unsafe { nodes_of(graph, std::ptr::null_mut(), &mut n) } != OK || n == 0 {
        return per_device;
    }
    let mut nodes = vec![std::ptr::null_mut(); n];
    let mut got = n;
    // SAFETY: `nodes` has room for `got` handles.
    if unsafe { nodes_of(graph, nodes.as_mut_ptr(), &mut got) } != OK {
        return per_device;
    }
    nodes.truncate(got.min(n));
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
        if p.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE || p.bytesize == 0 {
            continue;
        }
        let id = p.poolProps.location.id;
        match per_device.iter_mut().find(|(o, _)| *o == id) {
            Some((_, b)) => *b = b.saturating_add(p.bytesize as u64),
            None => per_device.push((id, p.bytesize as u64)),
        }
    }
    per_device
}

/// `allocations` on the devices of the region (the others have no quota here).
fn in_region(allocs: &[(CUdevice, u64)]) -> ([Alloc; MAX_DEVICES], usize) {
    let st = state();
    let mut v = [(0, 0, 0); MAX_DEVICES];
    let mut n = 0;
    for &(ordinal, bytes) in allocs {
        if let Ok(d) = st.dev_of(ordinal) {
            if n < MAX_DEVICES && !v[..n].iter().any(|a| a.0 == d) {
                v[n] = (d, ordinal, bytes);
                n += 1;
            }
        }
    }
    (v, n)
}

/// Keeps `exec`'s allocations once the driver instantiated it.
fn instantiated(r: CUresult, exec: *mut CUgraphExec, allocs: &[Alloc]) -> CUresult {
    if r != OK || exec.is_null() {
        return r;
    }
    // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
    let e = unsafe { *exec } as u64;
    forget(e); // a handle the driver reused without our seeing it go
    for &(d, ordinal, bytes) in allocs {
        ORDINAL[d].store(ordinal, Relaxed);
        vlog!(INFO, "graph {e:#x}: allocation nodes of {bytes} bytes on device {d}");
    }
    keep(e, allocs);
    r
}

/// Keeps `allocs` under `exec`'s handle.
fn keep(exec: u64, allocs: &[Alloc]) {
    let Some((&first, more)) = allocs.split_first() else { return };
    // The more devices first: a launch finds the handle's entries whole once it finds the first.
    for (k, &a) in more.iter().enumerate() {
        execs().insert(more_key(exec, k + 1), pack(a, 0));
    }
    execs().insert(exec, pack(first, more.len()));
    WITH_MEM.fetch_add(1, AcqRel);
}

/// Claims up to `bytes` of `spare` graph pool memory of device `d` that no other launch in progress
/// has claimed; what it got.
fn claim(d: usize, spare: u64, bytes: u64) -> u64 {
    let mut c = CLAIMED[d].load(Acquire);
    loop {
        let take = bytes.min(spare.saturating_sub(c));
        match CLAIMED[d].compare_exchange_weak(c, c + take, AcqRel, Acquire) {
            Ok(_) => return take,
            Err(now) => c = now,
        }
    }
}

/// Runs `call`, which may grow the graph pool of each device of `allocs` by up to its bytes, within
/// the quotas: all of them, or the call is refused. What a launch may take from the pool's spare
/// memory is claimed until its call has returned and the pool's new size is charged, so that
/// launches by several threads at once do not each count the same spare memory as theirs (the pool
/// grew by the spare more than they reserved: past the limit).
fn mapped(allocs: &[Alloc], call: impl FnOnce() -> CUresult) -> CUresult {
    // A graph launch charges outside the entry guard: counted here (see `guard::Calls`).
    let _call = crate::guard::Call::begin();
    let st = state();
    let (mut holds, mut claims) = ([0u64; MAX_DEVICES], [0u64; MAX_DEVICES]);
    // Gives back the holds and claims of the first `n` devices.
    let give_back = |n: usize, holds: &[u64], claims: &[u64]| {
        for ((&(d, ..), &h), &c) in allocs[..n].iter().zip(holds).zip(claims) {
            st.release(d, h);
            st.end_in_flight(d, h);
            CLAIMED[d].fetch_sub(c, AcqRel);
        }
    };
    for (i, &(d, ordinal, bytes)) in allocs.iter().enumerate() {
        let spare = match (
            attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
            attr(ordinal, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
        ) {
            (Some(r), Some(u)) => r.saturating_sub(u),
            _ => 0,
        };
        claims[i] = claim(d, spare, bytes);
        let hold = bytes - claims[i];
        if hold > 0 {
            // Counted in flight (where an agent watches) until the pool's new size is charged.
            st.begin_in_flight(d, hold);
            if let Err(e) = st.reserve(d, hold) {
                st.end_in_flight(d, hold);
                CLAIMED[d].fetch_sub(claims[i], AcqRel);
                give_back(i, &holds, &claims);
                return e;
            }
        }
        holds[i] = hold;
        ORDINAL[d].store(ordinal, Relaxed);
    }
    let r = call();
    // Each pool's new size is charged before its hold goes, so the container never shows less.
    for &(d, ordinal, _) in allocs {
        settle(st, d, attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT));
    }
    give_back(allocs.len(), &holds, &claims);
    r
}

/// Sets this process's charge for device `d`'s graph pool to `reserved` (None: left as it is).
/// Concurrent settles each apply the difference to what they replaced, so the region holds
/// `CHARGED` once they are done, and never less while they run.
fn settle(st: &State, d: usize, reserved: Option<u64>) {
    let Some(now) = reserved else { return };
    crate::charged::replace(&CHARGED[d], now, |b| st.charge_held(d, b), |b| st.release(d, b));
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
    let Some(v) = execs().get(exec as u64) else { return launch() };
    if capture::captures(stream) {
        return launch(); // a child graph node of the captured graph: nothing runs now
    }
    match unpack(v) {
        (first, 0) => mapped(&[first], launch),
        _ => match lookup(exec as u64) {
            Some((allocs, n)) => mapped(&allocs[..n], launch),
            None => launch(), // destroyed meanwhile
        },
    }
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
    for c in CHARGED.iter().chain(&CLAIMED) {
        c.store(0, Relaxed);
    }
    for o in &ORDINAL {
        o.store(-1, Relaxed);
    }
}

/// What an executable graph about to be destroyed allocates, taken out before the driver is asked
/// (see `stale::exec_destroy`): once the driver has destroyed it, the same handle may name another
/// thread's new graph, whose entries a removal after the call would take for this one's (and whose
/// launches would then reserve nothing).
pub struct Going(Option<([Alloc; MAX_DEVICES], usize)>);

pub fn going(exec: CUgraphExec) -> Going {
    Going(if WITH_MEM.load(Relaxed) == 0 { None } else { forget(exec as u64) })
}

impl Going {
    /// The driver refused: the graph is still there, and so are its allocations.
    pub fn stays(self, exec: CUgraphExec) {
        if let Some((allocs, n)) = self.0 {
            keep(exec as u64, &allocs[..n]);
        }
    }

    /// It was destroyed. The driver keeps the pools for later graphs; if this one does give memory
    /// back, the charge follows.
    pub fn destroyed(self) {
        let Some((allocs, n)) = self.0 else { return };
        for &(d, ordinal, _) in &allocs[..n] {
            settle(state(), d, attr(ordinal, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT));
        }
    }
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
    let (allocs, n) = in_region(&allocations(graph));
    instantiated(forward!(real, exec, graph, err_node, log, size), exec, &allocs[..n])
}

pub unsafe fn instantiate_with_flags(
    real: f::cuGraphInstantiateWithFlags,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> CUresult {
    let (allocs, n) = in_region(&allocations(graph));
    instantiated(forward!(real, exec, graph, flags), exec, &allocs[..n])
}

/// With `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` the instantiation uploads too: it is charged as an
/// upload.
pub unsafe fn instantiate_with_params(
    real: f::cuGraphInstantiateWithParams,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CUresult {
    let (allocs, n) = in_region(&allocations(graph));
    let call = || forward!(real, exec, graph, params);
    // SAFETY: an optional input the caller provides per the CUDA contract.
    let upload = unsafe { params.as_ref() }.is_some_and(|p| p.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0);
    let r = if upload && n > 0 { mapped(&allocs[..n], call) } else { call() };
    instantiated(r, exec, &allocs[..n])
}

pub unsafe fn upload(real: f::cuGraphUpload, exec: CUgraphExec, stream: CUstream) -> CUresult {
    let call = || forward!(real, exec, stream);
    if WITH_MEM.load(Relaxed) == 0 {
        return call();
    }
    match lookup(exec as u64) {
        Some((allocs, n)) => mapped(&allocs[..n], call),
        None => call(),
    }
}

pub unsafe fn trim(real: f::cuDeviceGraphMemTrim, dev: CUdevice) -> CUresult {
    let r = forward!(real, dev);
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
        for (a, more) in [((0, 0, 1), 0), ((3, 7, 123 << 30), 15), ((15, 255, BYTES), 1)] {
            assert_eq!(unpack(pack(a, more)), (a, more));
        }
        assert_eq!(unpack(pack((1, 2, u64::MAX), 3)), ((1, 2, BYTES), 3), "clamped, never spilling into the ordinal");
        assert_ne!(more_key(0x7fff_ffff_f000, 1), more_key(0x7fff_ffff_f000, 2));
        assert_eq!(more_key(0x7fff_ffff_f000, 1) & ((1 << 56) - 1), 0x7fff_ffff_f000);
    }

    #[test]
    fn a_graph_being_destroyed_is_out_of_the_table_and_back_if_the_driver_refuses() {
        let (e, other) = (0x7eed_0000_1000_u64, 0x7eed_0000_2000_u64);
        let allocs = [(0, 0, 100 << 20), (1, 1, 8 << 20)];
        keep(e, &allocs);
        keep(other, &allocs[..1]);
        let going = going(e as CUgraphExec);
        assert!(lookup(e).is_none(), "a graph made at its handle meanwhile is not taken for it");
        // A new graph at the same handle while the driver destroys the old one, and its launch.
        keep(e, &allocs[1..]);
        assert_eq!(lookup(e).map(|(v, n)| v[..n].to_vec()), Some(allocs[1..].to_vec()));
        forget(e);
        // The driver refused: both of its devices' entries are back, the other graph's untouched.
        going.stays(e as CUgraphExec);
        assert_eq!(lookup(e).map(|(v, n)| v[..n].to_vec()), Some(allocs.to_vec()));
        assert_eq!(lookup(other).map(|(v, n)| v[..n].to_vec()), Some(allocs[..1].to_vec()));
        forget(e);
        forget(other);
    }
}

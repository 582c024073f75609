//! Execution: modules and functions, streams, events, kernel launches, graphs and stream capture.
//!
//! Kernels run on the node's per-GPU timeline shared by every process (`vgpu_sim::timeline`: the
//! GPU time-slices between processes with work queued), each for the duration its name gives (see
//! `vgpu_sim::kernels::KernelKind`). A stream, a context and an event know the last kernel queued
//! before them; synchronisation sleeps until the timeline says it ended.

use crate::driver::{current, proc, Ctx, R};
use crate::mem::{GraphAlloc, MemOp};
use std::collections::HashMap;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering::*};
use std::sync::Mutex;
use vgpu_sim::abi::*;
use vgpu_sim::kernels::{parse_kernel_name, KernelKind};
use vgpu_sim::state::now_ns;
use vgpu_sim::timeline::Completion;

const STREAM_MAGIC: u64 = 0x5354_524d_5349_4d01;
const EVENT_MAGIC: u64 = 0x4556_4e54_5349_4d01;
const FUNC_MAGIC: u64 = 0x4655_4e43_5349_4d01;
const MODULE_MAGIC: u64 = 0x4d4f_4455_5349_4d01;
const GRAPH_MAGIC: u64 = 0x4752_4150_5349_4d01;
const EXEC_MAGIC: u64 = 0x4558_4543_5349_4d01;
const NODE_MAGIC: u64 = 0x4e4f_4445_5349_4d01;

/// Checks a handle's magic word. Handles are leaked boxes that are never freed (destroy clears the
/// magic), so reading through a once-valid handle is always defined.
fn obj<T>(h: *mut std::ffi::c_void, magic: u64) -> R<&'static T> {
    if h.is_null() {
        return Err(CUresult::INVALID_HANDLE);
    }
    // SAFETY: every handle of these kinds is a pointer to a leaked `T` whose first field is an
    // `AtomicU64` magic (all are #[repr(C)]).
    let m = unsafe { &*(h as *const AtomicU64) };
    if m.load(Acquire) != magic {
        return Err(CUresult::INVALID_HANDLE);
    }
    // SAFETY: as above; the magic proves the kind.
    Ok(unsafe { &*(h as *const T) })
}

/// Destroys a handle: clears its magic word (the memory stays, so stale handles are detected).
fn retire(h: *mut std::ffi::c_void, magic: u64) -> R<()> {
    obj::<AtomicU64>(h, magic)?.store(0, Release);
    Ok(())
}

fn leak<T>(t: T) -> *mut std::ffi::c_void {
    Box::into_raw(Box::new(t)) as *mut std::ffi::c_void
}

// ----- modules and functions -----

#[repr(C)]
pub struct Module {
    magic: AtomicU64,
    funcs: Mutex<HashMap<String, usize>>,
    /// The context it was loaded in, and the device memory it holds there.
    ctx: &'static Ctx,
    bytes: u64,
}

#[repr(C)]
pub struct Func {
    magic: AtomicU64,
    /// Set again when a retired function is reused (see `SPARE_FUNCS`).
    kind: Mutex<KernelKind>,
    /// What the deprecated launch API (`cuLaunch`, `cuLaunchGrid`, `cuLaunchGridAsync`) launches
    /// with, set by `cuFuncSetBlockShape` and `cuParamSet*`.
    legacy: Mutex<Legacy>,
}

#[derive(Default)]
struct Legacy {
    block: [u32; 3],
    /// The parameter buffer; kept 8-byte aligned so `param_ns` can read a u64 from offset 0.
    params: Vec<u64>,
    params_len: usize,
}

pub fn module_load() -> R<CUmodule> {
    let ctx = current()?;
    let bytes = proc()?.node.cfg.module_overhead_bytes;
    if bytes > 0 {
        proc()?.charge(ctx.gpu, bytes)?;
        ctx.module_bytes.fetch_add(bytes, AcqRel);
    }
    let m = leak(Module { magic: AtomicU64::new(MODULE_MAGIC), funcs: Mutex::new(HashMap::new()), ctx, bytes });
    ctx.modules.lock().unwrap().push(m as usize);
    Ok(m)
}

pub fn module_unload(h: CUmodule) -> R<()> {
    let m: &Module = obj(h, MODULE_MAGIC)?;
    m.ctx.modules.lock().unwrap().retain(|&x| x != h as usize);
    // Its memory, unless its context went (and took it) in the meantime.
    if m.bytes > 0 && m.ctx.module_bytes.fetch_update(AcqRel, Acquire, |b| b.checked_sub(m.bytes)).is_ok() {
        proc()?.uncharge(m.ctx.gpu, m.bytes);
    }
    retire_module(m);
    Ok(())
}

/// A context went (destroyed, or its primary context released for the last time or reset) and its
/// modules with it; their memory was released with the context's.
pub fn modules_gone(c: &Ctx) {
    let modules = std::mem::take(&mut *c.modules.lock().unwrap());
    for h in modules {
        if let Ok(m) = obj::<Module>(h as CUmodule, MODULE_MAGIC) {
            retire_module(m);
        }
    }
}

/// Invalidates a module and its functions; their handles may be given to later functions.
fn retire_module(m: &Module) {
    m.magic.store(0, Release);
    let funcs: Vec<usize> = m.funcs.lock().unwrap().values().copied().collect();
    for &f in &funcs {
        // SAFETY: values are leaked `Func` pointers created below.
        unsafe { &*(f as *const Func) }.magic.store(0, Release);
    }
    SPARE_FUNCS.lock().unwrap().extend(funcs);
}

/// Functions of unloaded modules, reused by the next `cuModuleGetFunction` the way a real driver's
/// allocator hands freed memory to the next object: the same handle then names another kernel.
static SPARE_FUNCS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn new_func(kind: KernelKind) -> usize {
    if let Some(f) = SPARE_FUNCS.lock().unwrap().pop() {
        // SAFETY: a retired Func (leaked, never freed); its magic is 0 until set below, so no other
        // call uses it meanwhile.
        let x = unsafe { &*(f as *const Func) };
        *x.kind.lock().unwrap() = kind;
        *x.legacy.lock().unwrap() = Legacy::default();
        x.magic.store(FUNC_MAGIC, Release);
        return f;
    }
    leak(Func { magic: AtomicU64::new(FUNC_MAGIC), kind: Mutex::new(kind), legacy: Mutex::default() }) as usize
}

/// `cuKernelGetFunction`: a simulated library's kernel is its function (see `cuLibraryLoadData`).
pub fn kernel_function(k: CUkernel) -> R<CUfunction> {
    obj::<Func>(k, FUNC_MAGIC)?;
    Ok(k)
}

pub fn module_get_function(h: CUmodule, name: &str) -> R<CUfunction> {
    let m: &Module = obj(h, MODULE_MAGIC)?;
    let kind = parse_kernel_name(name).ok_or(CUresult::NOT_FOUND)?;
    let mut funcs = m.funcs.lock().unwrap();
    let f = *funcs.entry(name.to_owned()).or_insert_with(|| new_func(kind));
    Ok(f as CUfunction)
}

// ----- streams -----

#[repr(C)]
pub struct Stream {
    magic: AtomicU64,
    ctx: AtomicPtr<Ctx>,
    /// The last kernel queued on it (its id on the GPU's timeline; 0: none).
    pub last: AtomicU64,
    capture: AtomicPtr<Graph>,
}

impl Stream {
    pub fn new(ctx: *const Ctx) -> Stream {
        Stream {
            magic: AtomicU64::new(STREAM_MAGIC),
            ctx: AtomicPtr::new(ctx as *mut Ctx),
            last: AtomicU64::new(0),
            capture: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
    pub fn set_ctx(&self, c: &Ctx) {
        self.ctx.store(c as *const Ctx as *mut Ctx, Release);
    }
    fn ctx(&self) -> &'static Ctx {
        // SAFETY: set at creation to a leaked, never-freed context.
        unsafe { &*self.ctx.load(Acquire) }
    }
}

/// A stream handle as given: NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are the current
/// context's default stream.
pub fn stream(h: CUstream) -> R<(&'static Ctx, &'static Stream)> {
    let hv = h as usize;
    if hv == 0 || hv == CU_STREAM_LEGACY || hv == CU_STREAM_PER_THREAD {
        let c = current()?;
        return Ok((c, &c.default_stream));
    }
    let s: &Stream = obj(h, STREAM_MAGIC)?;
    let c = s.ctx();
    if !c.live() {
        return Err(CUresult::INVALID_CONTEXT);
    }
    Ok((c, s))
}

/// Destroyed streams, reused by the next `cuStreamCreate` the way a real driver's allocator hands a
/// freed object's memory to the next one: the same handle then names another stream, perhaps of
/// another context, which the interposer must not mistake for the old one.
static SPARE_STREAMS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

pub fn stream_create() -> R<CUstream> {
    let c = current()?;
    if let Some(h) = SPARE_STREAMS.lock().unwrap().pop() {
        // SAFETY: a retired Stream (leaked, never freed); its magic is 0 until set below, so no
        // other call uses it meanwhile (every field is atomic).
        let s = unsafe { &*(h as *const Stream) };
        s.set_ctx(c);
        s.last.store(0, Release);
        s.capture.store(std::ptr::null_mut(), Release);
        s.magic.store(STREAM_MAGIC, Release);
        return Ok(h as CUstream);
    }
    Ok(leak(Stream::new(c)))
}

pub fn stream_destroy(h: CUstream) -> R<()> {
    let (_, s) = stream(h)?;
    if h as usize <= CU_STREAM_PER_THREAD {
        return Err(CUresult::INVALID_HANDLE);
    }
    if s.magic.compare_exchange(STREAM_MAGIC, 0, AcqRel, Acquire).is_ok() {
        SPARE_STREAMS.lock().unwrap().push(h as usize);
    }
    Ok(())
}

fn wait(c: &Ctx, kernel: u64) {
    if let Ok(p) = proc() {
        p.node.wait_for(c.gpu, kernel);
    }
    crate::mem::pools_sync(c.gpu);
}

/// The last kernel queued so far on `s`; the default stream waits for the whole context.
fn last_kernel(c: &Ctx, s: &Stream) -> u64 {
    if std::ptr::eq(s, &c.default_stream) {
        c.last.load(Acquire)
    } else {
        s.last.load(Acquire)
    }
}

/// Whether kernel `id` of `c`'s GPU has ended.
fn ended(c: &Ctx, id: u64) -> R<bool> {
    Ok(matches!(proc()?.node.completion(c.gpu, id), Completion::Done(_)))
}

pub fn stream_sync(h: CUstream) -> R<()> {
    let (c, s) = stream(h)?;
    wait(c, last_kernel(c, s));
    Ok(())
}

pub fn stream_query(h: CUstream) -> R<()> {
    let (c, s) = stream(h)?;
    if ended(c, last_kernel(c, s))? {
        Ok(())
    } else {
        Err(CUresult::NOT_READY)
    }
}

pub fn ctx_sync() -> R<()> {
    ctx_sync_of(current()?)
}

/// Waits for the work of context `c` (`cuCtxSynchronize_v2`).
pub fn ctx_sync_of(c: &Ctx) -> R<()> {
    wait(c, c.last.load(Acquire));
    Ok(())
}

// ----- events -----

#[repr(C)]
pub struct Event {
    magic: AtomicU64,
    /// When it was last recorded; 0 = never; `CAPTURED`: last recorded into a capture.
    ts: AtomicU64,
    /// The last kernel queued before it on its stream when it was recorded (0: none): it completes
    /// when that kernel ends, or at `ts` if that was later.
    kernel: AtomicU64,
    /// The context it was made in (a leaked, never-freed `Ctx`): it can be recorded only on that
    /// context's streams, and goes with the context.
    ctx: usize,
    /// `Ctx::ends` when it was made.
    ends: u64,
}

/// An event whose context is still there. A real driver destroys a context's events when the
/// context ends (destroyed, released for the last time, or reset), and their handles are then
/// dangling pointers: a later call with one is undefined behaviour, and the memory may already be
/// another object's (the simulated driver gives a destroyed context to the next one made). Here
/// such a call is a bug in the caller, reported and aborted on, so that a test shows it.
fn live_event(h: CUevent) -> R<&'static Event> {
    let e: &Event = obj(h, EVENT_MAGIC)?;
    // SAFETY: set at creation to a leaked, never-freed context.
    let c = unsafe { &*(e.ctx as *const Ctx) };
    if c.ends.load(Acquire) != e.ends {
        eprintln!("vgpu-sim: event {h:p} used after its context ended (a dangling handle for a real driver)");
        std::process::abort();
    }
    if !c.live() {
        return Err(CUresult::INVALID_HANDLE);
    }
    Ok(e)
}

/// `Event::ts` of an event last recorded in a capturing stream: it cannot be queried or timed.
const CAPTURED: u64 = u64::MAX;

pub fn event_create() -> R<CUevent> {
    let c = current()?;
    let (ts, ctx, ends) = (AtomicU64::new(0), c as *const Ctx as usize, c.ends.load(Acquire));
    Ok(leak(Event { magic: AtomicU64::new(EVENT_MAGIC), ts, kernel: AtomicU64::new(0), ctx, ends }))
}

pub fn event_destroy(h: CUevent) -> R<()> {
    live_event(h)?;
    retire(h, EVENT_MAGIC)
}

pub fn event_record(h: CUevent, st: CUstream) -> R<()> {
    let e = live_event(h)?;
    let (c, s) = stream(st)?;
    if c as *const Ctx as usize != e.ctx {
        return Err(CUresult::INVALID_HANDLE); // an event and a stream of different contexts
    }
    if !s.capture.load(Acquire).is_null() {
        e.ts.store(CAPTURED, Release); // an event node in the captured graph: nothing to time
        return Ok(());
    }
    e.kernel.store(last_kernel(c, s), Release);
    e.ts.store(now_ns().max(1), Release);
    Ok(())
}

/// The context an event was made in.
fn event_ctx(e: &Event) -> &'static Ctx {
    // SAFETY: set at creation to a leaked, never-freed context.
    unsafe { &*(e.ctx as *const Ctx) }
}

/// When a recorded event completed, or None while it has not.
fn event_time(e: &Event) -> R<Option<u64>> {
    let (ts, k) = (e.ts.load(Acquire), e.kernel.load(Acquire));
    Ok(match proc()?.node.completion(event_ctx(e).gpu, k) {
        // Ended so long ago that its time is forgotten: before the record, so the record's.
        Completion::Done(t) => Some(t.max(ts)),
        Completion::Pending(_) => None,
    })
}

pub fn event_query(h: CUevent) -> R<()> {
    let e = live_event(h)?;
    if e.ts.load(Acquire) == CAPTURED {
        return Err(CUresult::CAPTURED_EVENT);
    }
    match event_time(e)? {
        Some(_) => Ok(()),
        None => Err(CUresult::NOT_READY),
    }
}

pub fn event_sync(h: CUevent) -> R<()> {
    let e = live_event(h)?;
    let c = current()?;
    if e.ts.load(Acquire) == CAPTURED {
        return Err(CUresult::CAPTURED_EVENT);
    }
    proc()?.node.wait_for(event_ctx(e).gpu, e.kernel.load(Acquire));
    crate::mem::pools_sync(c.gpu);
    Ok(())
}

pub fn event_elapsed(a: CUevent, b: CUevent) -> R<f32> {
    let (a, b) = (live_event(a)?, live_event(b)?);
    let (ra, rb) = (a.ts.load(Acquire), b.ts.load(Acquire));
    if ra == CAPTURED || rb == CAPTURED {
        return Err(CUresult::CAPTURED_EVENT);
    }
    if ra == 0 || rb == 0 {
        return Err(CUresult::INVALID_HANDLE);
    }
    let (Some(ta), Some(tb)) = (event_time(a)?, event_time(b)?) else {
        return Err(CUresult::NOT_READY);
    };
    Ok((tb as f64 - ta as f64) as f32 / 1e6)
}

// ----- launches -----

pub struct Launch {
    pub f: CUfunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub params: *mut *mut std::ffi::c_void,
    pub cooperative: bool,
}

/// Simulated duration of a launch on `gpu`: `wave_` and `param_ns` kernels take a wave per SM's
/// worth of blocks (of the SMs an MPS client's partition holds), `sleep_` ones what their name says.
fn duration(l: &Launch, gpu: usize) -> R<u64> {
    let f: &Func = obj(l.f, FUNC_MAGIC)?;
    let blocks = l.grid.iter().map(|&x| x as u64).product::<u64>();
    let threads = l.block.iter().map(|&x| x as u64).product::<u64>();
    if blocks == 0 || threads == 0 || threads > 1024 {
        return Err(CUresult::INVALID_VALUE);
    }
    let cfg = proc()?.gpu_cfg(gpu);
    if l.cooperative && blocks * threads > cfg.sm_count as u64 * cfg.model.max_threads_per_sm as u64 {
        return Err(CUresult::COOPERATIVE_LAUNCH_TOO_LARGE);
    }
    let kind = *f.kind.lock().unwrap();
    // An MPS client's blocks run on its partition of the SMs.
    let p = proc()?;
    let sms = match p.node.shared().procs[p.slot].mps_role() {
        vgpu_sim::state::MpsRole::Client { pct, .. } => (cfg.sm_count as u64 * pct as u64 / 100).max(1),
        _ => cfg.sm_count as u64,
    };
    Ok(match kind {
        KernelKind::Fixed(d) => d,
        KernelKind::PerWave(d) => d * blocks.div_ceil(sms),
        KernelKind::Param => {
            if l.params.is_null() {
                return Err(CUresult::INVALID_VALUE);
            }
            // SAFETY: by the `param_ns` convention the first kernel parameter points to a u64.
            let per_wave = unsafe {
                let p0 = *l.params;
                if p0.is_null() {
                    return Err(CUresult::INVALID_VALUE);
                }
                *(p0 as *const u64)
            };
            per_wave * blocks.div_ceil(sms)
        }
    })
}

fn run_on(c: &Ctx, s: &Stream, durs: &[u64]) -> R<()> {
    let p = proc()?;
    let id = p.node.launch(c.gpu, p.slot, p.node.slot_pid(p.slot), durs);
    s.last.fetch_max(id, AcqRel);
    c.last.fetch_max(id, AcqRel);
    Ok(())
}

pub fn launch(l: &Launch, st: CUstream) -> R<()> {
    let (c, s) = stream(st)?;
    let d = duration(l, c.gpu)?;
    let cap = s.capture.load(Acquire);
    if !cap.is_null() {
        // SAFETY: the capture graph is a leaked Graph set by begin_capture.
        unsafe { &*cap }.push(cap as CUgraph, Node::kernels(CU_GRAPH_NODE_TYPE_KERNEL, vec![d]));
        return Ok(());
    }
    host_work()?;
    run_on(c, s, &[d])
}

/// The host time a launch call spends before its work is queued (`launch_host_us`): spent
/// spinning, as a driver's marshalling does (a sleep would take far longer than microseconds).
fn host_work() -> R<()> {
    let ns = proc()?.node.cfg.launch_host_ns;
    if ns > 0 {
        let until = now_ns() + ns;
        while now_ns() < until {
            std::hint::spin_loop();
        }
    }
    Ok(())
}

/// A valid function handle (`cuFuncSetSharedSize`, whose size the simulator does not use).
pub fn func_check(h: CUfunction) -> R<()> {
    obj::<Func>(h, FUNC_MAGIC).map(|_| ())
}

/// `cuFuncSetBlockShape`.
pub fn func_set_block_shape(h: CUfunction, x: i32, y: i32, z: i32) -> R<()> {
    let f: &Func = obj(h, FUNC_MAGIC)?;
    if x <= 0 || y <= 0 || z <= 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    f.legacy.lock().unwrap().block = [x as u32, y as u32, z as u32];
    Ok(())
}

/// `cuParamSetSize`.
pub fn param_set_size(h: CUfunction, n: u32) -> R<()> {
    let f: &Func = obj(h, FUNC_MAGIC)?;
    let mut l = f.legacy.lock().unwrap();
    l.params.resize((n as usize).div_ceil(8), 0);
    l.params_len = n as usize;
    Ok(())
}

/// `cuParamSetv` (and `cuParamSeti`): copies `bytes` into the parameter buffer at `offset`.
pub fn param_set(h: CUfunction, offset: i32, bytes: &[u8]) -> R<()> {
    let f: &Func = obj(h, FUNC_MAGIC)?;
    if offset < 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let mut l = f.legacy.lock().unwrap();
    let end = offset as usize + bytes.len();
    if end > l.params.len() * 8 {
        l.params.resize(end.div_ceil(8), 0);
    }
    l.params_len = l.params_len.max(end);
    // SAFETY: the buffer holds at least `end` bytes (resized above); u64 has no invalid bit patterns.
    let buf = unsafe { std::slice::from_raw_parts_mut(l.params.as_mut_ptr() as *mut u8, l.params.len() * 8) };
    buf[offset as usize..end].copy_from_slice(bytes);
    Ok(())
}

/// `cuLaunch`, `cuLaunchGrid` and `cuLaunchGridAsync`: a launch with the block shape and the
/// parameters set beforehand.
pub fn launch_legacy(h: CUfunction, grid: [i32; 2], st: CUstream) -> R<()> {
    let f: &Func = obj(h, FUNC_MAGIC)?;
    if grid[0] <= 0 || grid[1] <= 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let (block, mut p0) = {
        let l = f.legacy.lock().unwrap();
        let p0 = if l.params_len >= 8 { l.params[0] } else { 0 };
        (l.block, p0)
    };
    // `param_ns` reads its duration through the first parameter pointer, as for cuLaunchKernel.
    let mut arg = if p0 > 0 { &mut p0 as *mut u64 as *mut std::ffi::c_void } else { std::ptr::null_mut() };
    let l = Launch { f: h, grid: [grid[0] as u32, grid[1] as u32, 1], block, params: &mut arg, cooperative: false };
    launch(&l, st)
}

// ----- graphs -----

/// A node of a simulated graph: what it runs (`kernels`: one duration for a kernel node; a child
/// graph node's are its graph's, copied when added, as the driver clones it) or, for a memory
/// node, what it allocates or frees.
#[derive(Clone)]
struct Node {
    ty: i32,
    kernels: Vec<u64>,
    mem: Option<MemOp>,
}

impl Node {
    fn kernels(ty: i32, kernels: Vec<u64>) -> Node {
        Node { ty, kernels, mem: None }
    }
}

#[repr(C)]
pub struct Graph {
    magic: AtomicU64,
    /// Nodes in insertion order, with their handles.
    nodes: Mutex<Vec<(usize, Node)>>,
}

/// A node handle: its graph and its index there. Leaked, like every handle.
#[repr(C)]
struct NodeRef {
    magic: AtomicU64,
    graph: usize,
    index: usize,
}

impl Graph {
    fn push(&self, h: CUgraph, n: Node) -> CUgraphNode {
        let mut nodes = self.nodes.lock().unwrap();
        let r = leak(NodeRef { magic: AtomicU64::new(NODE_MAGIC), graph: h as usize, index: nodes.len() });
        nodes.push((r as usize, n));
        r
    }

    fn bodies(&self) -> Vec<Node> {
        self.nodes.lock().unwrap().iter().map(|(_, n)| n.clone()).collect()
    }
}

/// A node and its graph.
fn node_of(h: CUgraphNode) -> R<(&'static Graph, usize)> {
    let n: &NodeRef = obj(h, NODE_MAGIC)?;
    Ok((obj(n.graph as CUgraph, GRAPH_MAGIC)?, n.index))
}

#[repr(C)]
pub struct GraphExec {
    magic: AtomicU64,
    body: Mutex<ExecBody>,
}

/// What an executable graph runs. Its nodes are addressed by the node handles of the graph it was
/// instantiated from.
struct ExecBody {
    graph: usize,
    nodes: Vec<Node>,
    enabled: Vec<bool>,
    /// The enabled nodes' durations, as launched, and their memory nodes' work.
    durs: Vec<u64>,
    mem: Vec<MemOp>,
    /// `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`.
    auto_free: bool,
}

impl ExecBody {
    fn new(graph: usize, nodes: Vec<Node>, auto_free: bool) -> ExecBody {
        let mut b =
            ExecBody { graph, enabled: vec![true; nodes.len()], durs: Vec::new(), mem: Vec::new(), nodes, auto_free };
        b.refresh();
        b
    }

    fn refresh(&mut self) {
        let on: Vec<&Node> = self.nodes.iter().zip(&self.enabled).filter(|(_, &on)| on).map(|(n, _)| n).collect();
        self.durs = on.iter().flat_map(|n| n.kernels.iter().copied()).collect();
        self.mem = on.iter().filter_map(|n| n.mem).collect();
    }

    fn index(&self, node: CUgraphNode) -> R<usize> {
        let n: &NodeRef = obj(node, NODE_MAGIC)?;
        if n.graph == self.graph && n.index < self.nodes.len() {
            Ok(n.index)
        } else {
            Err(CUresult::INVALID_VALUE)
        }
    }
}

pub fn graph_create() -> R<CUgraph> {
    proc()?;
    Ok(leak(Graph { magic: AtomicU64::new(GRAPH_MAGIC), nodes: Mutex::new(Vec::new()) }))
}

pub fn graph_destroy(h: CUgraph) -> R<()> {
    retire(h, GRAPH_MAGIC)
}

pub fn graph_add_kernel(h: CUgraph, l: &Launch) -> R<CUgraphNode> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    let c = current()?;
    let d = duration(l, c.gpu)?;
    Ok(g.push(h, Node::kernels(CU_GRAPH_NODE_TYPE_KERNEL, vec![d])))
}

/// `cuGraphAddMemAllocNode`: the allocation's address is given now and fixed for the node's life.
pub fn graph_add_alloc(h: CUgraph, size: u64, ordinal: CUdevice) -> R<(CUgraphNode, u64)> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    let gpu = proc()?.gpu_of(ordinal)?;
    let a = crate::mem::graph_va(size, gpu, ordinal)?;
    let node = Node { ty: CU_GRAPH_NODE_TYPE_MEM_ALLOC, kernels: Vec::new(), mem: Some(MemOp::Alloc(a)) };
    Ok((g.push(h, node), a.ptr))
}

/// `cuGraphAddMemFreeNode`: frees a graph allocation.
pub fn graph_add_free(h: CUgraph, ptr: u64) -> R<CUgraphNode> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    if !crate::mem::is_graph_va(ptr) {
        return Err(CUresult::INVALID_VALUE);
    }
    Ok(g.push(h, Node { ty: CU_GRAPH_NODE_TYPE_MEM_FREE, kernels: Vec::new(), mem: Some(MemOp::Free(ptr)) }))
}

/// `cuGraphGetNodes`.
pub fn graph_nodes(h: CUgraph) -> R<Vec<CUgraphNode>> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    Ok(g.nodes.lock().unwrap().iter().map(|(r, _)| *r as CUgraphNode).collect())
}

/// `cuGraphNodeGetType`.
pub fn node_type(h: CUgraphNode) -> R<i32> {
    let (g, i) = node_of(h)?;
    Ok(g.nodes.lock().unwrap()[i].1.ty)
}

/// `cuGraphMemAllocNodeGetParams`.
pub fn alloc_node(h: CUgraphNode) -> R<GraphAlloc> {
    let (g, i) = node_of(h)?;
    match g.nodes.lock().unwrap()[i].1.mem {
        Some(MemOp::Alloc(a)) => Ok(a),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

/// Destroyed executable graphs, reused by the next instantiation the way a real driver's allocator
/// hands a freed object's memory to the next one: the same handle then names another graph, which
/// the interposer must not mistake for the old one.
static SPARE_EXECS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// `cuGraphInstantiate*`; with `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD` also uploaded.
pub fn graph_instantiate(h: CUgraph, flags: u64) -> R<CUgraphExec> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    let body = ExecBody::new(h as usize, g.bodies(), flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH != 0);
    if flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 {
        crate::mem::graph_upload(&body.mem, body.auto_free)?;
    }
    if let Some(e) = SPARE_EXECS.lock().unwrap().pop() {
        // SAFETY: a retired GraphExec (leaked, never freed); its magic is 0 until set below, so no
        // other call uses it meanwhile.
        let x = unsafe { &*(e as *const GraphExec) };
        *x.body.lock().unwrap() = body;
        x.magic.store(EXEC_MAGIC, Release);
        return Ok(e as CUgraphExec);
    }
    Ok(leak(GraphExec { magic: AtomicU64::new(EXEC_MAGIC), body: Mutex::new(body) }))
}

pub fn graph_exec_destroy(h: CUgraphExec) -> R<()> {
    retire(h, EXEC_MAGIC)?;
    SPARE_EXECS.lock().unwrap().push(h as usize);
    std::thread::sleep(std::time::Duration::from_nanos(proc()?.node.cfg.destroy_return_ns));
    Ok(())
}

/// `cuGraphExecUpdate`: the graph must have as many nodes as the executable one, and the same
/// memory nodes (their allocations cannot change).
pub fn graph_exec_update(h: CUgraphExec, g: CUgraph) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    let nodes = obj::<Graph>(g, GRAPH_MAGIC)?.bodies();
    let mut b = e.body.lock().unwrap();
    let same_mem = |a: &Node, b: &Node| match (a.mem, b.mem) {
        (None, None) => true,
        (Some(MemOp::Alloc(x)), Some(MemOp::Alloc(y))) => x.size == y.size && x.gpu == y.gpu,
        (Some(MemOp::Free(_)), Some(MemOp::Free(_))) => true,
        _ => false,
    };
    if nodes.len() != b.nodes.len() || !nodes.iter().zip(&b.nodes).all(|(x, y)| same_mem(x, y)) {
        return Err(CUresult::GRAPH_EXEC_UPDATE_FAILURE);
    }
    for (old, new) in b.nodes.iter_mut().zip(nodes) {
        if old.mem.is_none() {
            *old = new;
        }
    }
    b.refresh();
    Ok(())
}

/// `cuGraphExecKernelNodeSetParams` and the kernel form of `cuGraphExecNodeSetParams`.
pub fn graph_exec_set_kernel(h: CUgraphExec, node: CUgraphNode, l: &Launch) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    let d = duration(l, current()?.gpu)?;
    let mut b = e.body.lock().unwrap();
    let i = b.index(node)?;
    if b.nodes[i].ty != CU_GRAPH_NODE_TYPE_KERNEL {
        return Err(CUresult::INVALID_VALUE);
    }
    b.nodes[i] = Node::kernels(CU_GRAPH_NODE_TYPE_KERNEL, vec![d]);
    b.refresh();
    Ok(())
}

/// The kernels of a graph that may be a child graph: one with memory nodes may not (as in CUDA).
fn child_kernels(child: CUgraph) -> R<Vec<u64>> {
    let nodes = obj::<Graph>(child, GRAPH_MAGIC)?.bodies();
    if nodes.iter().any(|n| n.mem.is_some()) {
        return Err(CUresult::NOT_SUPPORTED);
    }
    Ok(nodes.into_iter().flat_map(|n| n.kernels).collect())
}

/// `cuGraphAddChildGraphNode`: the child's kernels, copied.
pub fn graph_add_child(h: CUgraph, child: CUgraph) -> R<CUgraphNode> {
    let g: &Graph = obj(h, GRAPH_MAGIC)?;
    let kernels = child_kernels(child)?;
    Ok(g.push(h, Node::kernels(CU_GRAPH_NODE_TYPE_GRAPH, kernels)))
}

/// `cuGraphExecChildGraphNodeSetParams`: the node runs that graph's kernels from now on.
pub fn graph_exec_set_child(h: CUgraphExec, node: CUgraphNode, child: CUgraph) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    let kernels = child_kernels(child)?;
    let mut b = e.body.lock().unwrap();
    let i = b.index(node)?;
    if b.nodes[i].ty != CU_GRAPH_NODE_TYPE_GRAPH {
        return Err(CUresult::INVALID_VALUE);
    }
    b.nodes[i] = Node::kernels(CU_GRAPH_NODE_TYPE_GRAPH, kernels);
    b.refresh();
    Ok(())
}

/// `cuGraphNodeSetEnabled` (kernel nodes, as in CUDA 11.6; memory nodes cannot be disabled).
pub fn graph_exec_enable(h: CUgraphExec, node: CUgraphNode, on: bool) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    let mut b = e.body.lock().unwrap();
    let i = b.index(node)?;
    if b.nodes[i].mem.is_some() {
        return Err(CUresult::INVALID_VALUE);
    }
    b.enabled[i] = on;
    b.refresh();
    Ok(())
}

pub fn graph_launch(h: CUgraphExec, st: CUstream) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    let (c, s) = stream(st)?;
    let (durs, mem, auto_free) = {
        let b = e.body.lock().unwrap();
        (b.durs.clone(), b.mem.clone(), b.auto_free)
    };
    let cap = s.capture.load(Acquire);
    if !cap.is_null() {
        if !mem.is_empty() {
            return Err(CUresult::NOT_SUPPORTED); // a graph with memory nodes cannot be a child
        }
        // SAFETY: see `launch`.
        unsafe { &*cap }.push(cap as CUgraph, Node::kernels(CU_GRAPH_NODE_TYPE_GRAPH, durs));
        return Ok(());
    }
    if !mem.is_empty() {
        std::thread::sleep(std::time::Duration::from_nanos(proc()?.node.cfg.graph_launch_ns));
        crate::mem::graph_run(c, &mem, auto_free)?;
    }
    host_work()?;
    run_on(c, s, &durs)
}

/// `cuGraphUpload`.
pub fn graph_upload(h: CUgraphExec, st: CUstream) -> R<()> {
    let e: &GraphExec = obj(h, EXEC_MAGIC)?;
    stream(st)?;
    let (mem, auto_free) = {
        let b = e.body.lock().unwrap();
        (b.mem.clone(), b.auto_free)
    };
    crate::mem::graph_upload(&mem, auto_free)
}

/// A stream-ordered allocation on a capturing stream: an allocation node of the captured graph
/// (None: the stream is not capturing).
pub fn capture_alloc(st: CUstream, size: u64) -> R<Option<u64>> {
    let (c, s) = stream(st)?;
    let cap = s.capture.load(Acquire);
    if cap.is_null() {
        return Ok(None);
    }
    let a = crate::mem::graph_va(size, c.gpu, c.ordinal)?;
    let node = Node { ty: CU_GRAPH_NODE_TYPE_MEM_ALLOC, kernels: Vec::new(), mem: Some(MemOp::Alloc(a)) };
    // SAFETY: see `launch`.
    unsafe { &*cap }.push(cap as CUgraph, node);
    Ok(Some(a.ptr))
}

/// A stream-ordered free on a capturing stream: a free node of the captured graph (false: the
/// stream is not capturing).
pub fn capture_free(st: CUstream, ptr: u64) -> R<bool> {
    let (_, s) = stream(st)?;
    let cap = s.capture.load(Acquire);
    if cap.is_null() {
        return Ok(false);
    }
    if !crate::mem::is_graph_va(ptr) {
        return Err(CUresult::INVALID_VALUE);
    }
    let node = Node { ty: CU_GRAPH_NODE_TYPE_MEM_FREE, kernels: Vec::new(), mem: Some(MemOp::Free(ptr)) };
    // SAFETY: see `launch`.
    unsafe { &*cap }.push(cap as CUgraph, node);
    Ok(true)
}

pub fn begin_capture(st: CUstream) -> R<()> {
    let (c, s) = stream(st)?;
    if std::ptr::eq(s, &c.default_stream) {
        return Err(CUresult::STREAM_CAPTURE_UNSUPPORTED);
    }
    let g = graph_create()? as *mut Graph;
    if s.capture.compare_exchange(std::ptr::null_mut(), g, AcqRel, Acquire).is_err() {
        return Err(CUresult::ILLEGAL_STATE);
    }
    Ok(())
}

pub fn end_capture(st: CUstream) -> R<CUgraph> {
    let (_, s) = stream(st)?;
    let g = s.capture.swap(std::ptr::null_mut(), AcqRel);
    if g.is_null() {
        return Err(CUresult::ILLEGAL_STATE);
    }
    Ok(g as CUgraph)
}

pub fn is_capturing(st: CUstream) -> R<bool> {
    let (_, s) = stream(st)?;
    Ok(!s.capture.load(Acquire).is_null())
}

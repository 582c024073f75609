//! Process-wide driver state: initialisation, visible devices, contexts.

use std::cell::Cell;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Mutex, OnceLock};
use vgpu_sim::abi::*;
use vgpu_sim::{Node, MAX_GPUS};

pub type R<T> = Result<T, CUresult>;

pub struct Proc {
    pub node: &'static Node,
    pub slot: usize,
    /// CUDA ordinal -> node GPU index (after CUDA_VISIBLE_DEVICES).
    pub visible: Vec<usize>,
    /// Per node GPU index: the MIG device this process's CUDA device on that GPU is, if it is one.
    pub mig: Vec<Option<MigDev>>,
    _liveness: File,
}

/// A MIG device as a CUDA device: its GPU instance, and the device as CUDA describes it (its own
/// UUID, memory and SMs; the parent's everything else).
#[derive(Clone, Copy)]
pub struct MigDev {
    pub gi: u32,
    pub ci: u32,
    pub cfg: &'static vgpu_sim::GpuConfig,
}

static PROC: OnceLock<R<Proc>> = OnceLock::new();
static FORKED: AtomicBool = AtomicBool::new(false);
static INIT_LOCK: Mutex<()> = Mutex::new(());

extern "C" fn after_fork_in_child() {
    FORKED.store(true, Relaxed);
}

/// `cuInit`.
pub fn init(flags: u32) -> CUresult {
    if flags != 0 {
        return CUresult::INVALID_VALUE;
    }
    if FORKED.load(Relaxed) {
        return CUresult::NOT_INITIALIZED;
    }
    let _g = INIT_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let r = PROC.get_or_init(|| {
        let node = Node::global().map_err(|e| {
            eprintln!("vgpu-sim libcuda: {e}");
            CUresult::NO_DEVICE
        })?;
        let (visible, mig) = parse_visible(node);
        let (slot, f) = node.register_process().map_err(|e| {
            eprintln!("vgpu-sim libcuda: {e}");
            CUresult::OUT_OF_MEMORY
        })?;
        for (g, m) in mig.iter().enumerate() {
            node.set_mig(slot, g, m.map(|m| (m.gi, m.ci)));
        }
        crate::mps::join(node, slot, &visible)?;
        // SAFETY: registering a plain extern "C" handler with no other callbacks.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
        Ok(Proc { node, slot, visible, mig, _liveness: f })
    });
    match r {
        Ok(p) if p.visible.is_empty() => CUresult::NO_DEVICE,
        Ok(_) => CUresult::SUCCESS,
        Err(e) => *e,
    }
}

/// CUDA_VISIBLE_DEVICES: indices, GPU UUIDs (prefixes allowed) or MIG device UUIDs; parsing stops at
/// the first entry that matches nothing, as in CUDA. A GPU in MIG mode is no CUDA device itself: a
/// MIG device UUID names one of its MIG devices, and an index or GPU UUID (or no variable) gives its
/// first MIG device, or nothing where it has none. Returns the visible GPUs and, per GPU, the MIG
/// device used there.
/// Only the GPUs the container runtime exposed count (`Node::exposed`): indices are positions among
/// them, as in a container.
fn parse_visible(node: &Node) -> (Vec<usize>, Vec<Option<MigDev>>) {
    let n = node.cfg.gpus.len();
    let exposed = node.exposed();
    let mut mig: Vec<Option<MigDev>> = vec![None; n];
    let mut out = Vec::new();
    let mut take = |i: usize, m: Option<Option<MigDev>>, out: &mut Vec<usize>| -> bool {
        // m: Some(..) where the GPU is in MIG mode (Some(None): no MIG device to use).
        match m {
            Some(None) => true,
            Some(Some(d)) if !out.contains(&i) => {
                mig[i] = Some(d);
                out.push(i);
                true
            }
            None if !out.contains(&i) => {
                out.push(i);
                true
            }
            _ => false,
        }
    };
    let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        for &i in exposed {
            take(i, mig_of(node, i, None), &mut out);
        }
        return (out, mig);
    };
    for item in v.split(',').map(str::trim) {
        let found = if let Ok(i) = item.parse::<usize>() {
            exposed.get(i).map(|&g| (g, mig_of(node, g, None)))
        } else if item.starts_with("GPU-") && item.len() > 4 {
            let m: Vec<usize> = exposed.iter().copied().filter(|&g| node.cfg.gpus[g].uuid.starts_with(item)).collect();
            (m.len() == 1).then(|| (m[0], mig_of(node, m[0], None)))
        } else if item.starts_with("MIG-") {
            exposed.iter().find_map(|&i| mig_of(node, i, Some(item)).flatten().map(|d| (i, Some(Some(d)))))
        } else {
            None
        };
        match found {
            Some((i, m)) if take(i, m, &mut out) => {}
            _ => break,
        }
    }
    (out, mig)
}

/// None: GPU `i` is not in MIG mode. Some(device): its MIG device named `uuid`, or its first one
/// (by GPU instance id) when no UUID is given; Some(None): no such device.
fn mig_of(node: &Node, i: usize, uuid: Option<&str>) -> Option<Option<MigDev>> {
    let cfg = &node.cfg.gpus[i];
    let st = {
        let mut l = node.lock();
        *node.mig(&mut l, i)
    };
    if st.current == 0 {
        return None;
    }
    let table = cfg.model.mig.as_ref()?;
    let mut gis: Vec<_> = st.gis.iter().filter(|g| g.live != 0).collect();
    gis.sort_by_key(|g| g.id);
    for g in gis {
        let Some(ci) = g.cis.iter().filter(|c| c.live != 0).min_by_key(|c| c.id) else { continue };
        let id = vgpu_sim::mig::mig_uuid(&cfg.uuid, g.serial, ci.id);
        if uuid.is_some_and(|u| u != id) {
            continue;
        }
        let Some(p) = table.by_id(g.profile_id) else { continue };
        let mut c = cfg.clone();
        c.uuid = id;
        c.memory_bytes = p.mib << 20;
        c.sm_count = p.sm;
        return Some(Some(MigDev { gi: g.id, ci: ci.id, cfg: Box::leak(Box::new(c)) }));
    }
    Some(None)
}

#[inline]
pub fn proc() -> R<&'static Proc> {
    match PROC.get() {
        Some(Ok(p)) if !FORKED.load(Relaxed) => Ok(p),
        _ => Err(CUresult::NOT_INITIALIZED),
    }
}

impl Proc {
    pub fn gpu_of(&self, ordinal: CUdevice) -> R<usize> {
        usize::try_from(ordinal).ok().and_then(|o| self.visible.get(o).copied()).ok_or(CUresult::INVALID_DEVICE)
    }

    /// The GPU as this process's CUDA device on it sees it (a MIG device's memory and SMs there).
    pub fn gpu_cfg(&self, gpu: usize) -> &'static vgpu_sim::GpuConfig {
        match self.mig.get(gpu).copied().flatten() {
            Some(m) => m.cfg,
            None => &self.node.cfg.gpus[gpu],
        }
    }

    /// Memory in use on this process's CUDA device on `gpu` (its MIG device's, where it is one).
    pub fn mem_used(&self, gpu: usize) -> u64 {
        match self.mig.get(gpu).copied().flatten() {
            Some(m) => self.node.mig_mem_used(gpu, m.gi),
            None => self.node.mem_used(gpu),
        }
    }

    pub fn charge(&self, gpu: usize, bytes: u64) -> R<()> {
        let fits = match self.mig.get(gpu).copied().flatten() {
            Some(m) => self.node.try_charge_mig(self.slot, gpu, m.gi, m.cfg.memory_bytes, bytes),
            None => self.node.try_charge(self.slot, gpu, bytes),
        };
        if fits {
            Ok(())
        } else {
            Err(CUresult::OUT_OF_MEMORY)
        }
    }

    pub fn uncharge(&self, gpu: usize, bytes: u64) {
        self.node.uncharge(self.slot, gpu, bytes);
    }

    fn attach(&self, gpu: usize) -> R<()> {
        self.charge(gpu, self.node.cfg.context_overhead_bytes)?;
        self.node.shared().procs[self.slot].ctx[gpu].fetch_add(1, AcqRel);
        Ok(())
    }

    fn detach(&self, gpu: usize) {
        self.uncharge(gpu, self.node.cfg.context_overhead_bytes);
        self.node.shared().procs[self.slot].ctx[gpu].fetch_sub(1, AcqRel);
    }
}

pub const CTX_MAGIC: u64 = 0x4354_5853_494d_0001;

pub struct Ctx {
    pub magic: AtomicU64,
    pub gpu: usize,
    pub ordinal: CUdevice,
    pub primary: bool,
    /// Primary context retain count.
    pub refs: AtomicU32,
    /// The last kernel queued in this context (its id on the GPU's timeline; 0: none).
    pub last: AtomicU64,
    /// Device memory its loaded modules hold (freed with it).
    pub module_bytes: AtomicU64,
    /// Its loaded modules (unloaded with it).
    pub modules: Mutex<Vec<usize>>,
    /// `CU_LIMIT_STACK_SIZE`, `_PRINTF_FIFO_SIZE`, `_MALLOC_HEAP_SIZE` (see [`set_limit`]).
    pub limits: Mutex<[u64; 3]>,
    /// Device memory those hold beyond their defaults' (freed with it).
    pub limit_bytes: AtomicU64,
    pub default_stream: crate::exec::Stream,
    /// How many times it ended (destroyed, released for the last time, reset): its events went
    /// each time, and an event made before is a dangling handle even once the context lives again
    /// (see `exec::live_event`).
    pub ends: AtomicU64,
}

/// The defaults of `CU_LIMIT_STACK_SIZE` (per thread), `_PRINTF_FIFO_SIZE` and `_MALLOC_HEAP_SIZE`,
/// whose memory is part of a context's overhead.
pub const LIMIT_DEFAULTS: [u64; 3] = [1024, 1 << 20, 8 << 20];

impl Ctx {
    fn new(gpu: usize, ordinal: CUdevice, primary: bool) -> &'static Ctx {
        let c: &'static Ctx = Box::leak(Box::new(Ctx {
            magic: AtomicU64::new(CTX_MAGIC),
            gpu,
            ordinal,
            primary,
            refs: AtomicU32::new(0),
            last: AtomicU64::new(0),
            module_bytes: AtomicU64::new(0),
            modules: Mutex::new(Vec::new()),
            limits: Mutex::new(LIMIT_DEFAULTS),
            limit_bytes: AtomicU64::new(0),
            default_stream: crate::exec::Stream::new(std::ptr::null()),
            ends: AtomicU64::new(0),
        }));
        c.default_stream.set_ctx(c);
        c
    }

    pub fn live(&self) -> bool {
        self.magic.load(Acquire) == CTX_MAGIC && (!self.primary || self.refs.load(Acquire) > 0)
    }
}

/// How deep a thread's context stack may go (`cuCtxPushCurrent` beyond it is refused).
const STACK_DEPTH: usize = 64;

/// A thread's context stack, in plain thread-local storage as the driver keeps it: a thread-local
/// with a destructor registers it (`__cxa_thread_atexit_impl`) under the loader's lock at its first
/// use, so a thread's first context waited for any `dlopen` another thread was running (libvgpu.so
/// loads NVML on a thread of its own at the first CUDA call), which the driver's does not.
struct CtxStack {
    depth: Cell<usize>,
    ctx: [Cell<Option<&'static Ctx>>; STACK_DEPTH],
}

impl CtxStack {
    fn top(&self) -> Option<&'static Ctx> {
        self.depth.get().checked_sub(1).and_then(|i| self.ctx[i].get())
    }

    fn push(&self, c: &'static Ctx) -> R<()> {
        let d = self.depth.get();
        let slot = self.ctx.get(d).ok_or(CUresult::OUT_OF_MEMORY)?;
        slot.set(Some(c));
        self.depth.set(d + 1);
        Ok(())
    }

    fn pop(&self) -> Option<&'static Ctx> {
        let c = self.top()?;
        self.depth.set(self.depth.get() - 1);
        Some(c)
    }

    /// Takes `c` out wherever it is in the stack (it was destroyed).
    fn remove(&self, c: &'static Ctx) {
        let mut kept = 0;
        for i in 0..self.depth.get() {
            let x = self.ctx[i].get();
            if !x.is_some_and(|x| std::ptr::eq(x, c)) {
                self.ctx[kept].set(x);
                kept += 1;
            }
        }
        self.depth.set(kept);
    }
}

thread_local! {
    static STACK: CtxStack = const { CtxStack { depth: Cell::new(0), ctx: [const { Cell::new(None) }; STACK_DEPTH] } };
}

/// The calling thread's current context.
#[inline]
pub fn current() -> R<&'static Ctx> {
    proc()?;
    STACK.with(CtxStack::top).filter(|c| c.live()).ok_or(CUresult::INVALID_CONTEXT)
}

pub fn ctx_from(h: CUcontext) -> R<&'static Ctx> {
    if h.is_null() {
        return Err(CUresult::INVALID_CONTEXT);
    }
    // SAFETY: context handles are leaked `Ctx` boxes that are never freed; the magic tells live ones.
    let c = unsafe { &*(h as *const Ctx) };
    if c.live() {
        Ok(c)
    } else {
        Err(CUresult::INVALID_CONTEXT)
    }
}

pub fn handle(c: &'static Ctx) -> CUcontext {
    c as *const Ctx as CUcontext
}

static PRIMARY: [OnceLock<&'static Ctx>; MAX_GPUS] = [const { OnceLock::new() }; MAX_GPUS];
static PRIMARY_LOCK: Mutex<()> = Mutex::new(());

pub fn primary_retain(ordinal: CUdevice) -> R<&'static Ctx> {
    let p = proc()?;
    let gpu = p.gpu_of(ordinal)?;
    let _g = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = *PRIMARY[ordinal as usize].get_or_init(|| Ctx::new(gpu, ordinal, true));
    if c.refs.load(Acquire) == 0 {
        p.node.reap();
        p.attach(gpu)?;
    }
    c.refs.fetch_add(1, AcqRel);
    Ok(c)
}

pub fn primary_release(ordinal: CUdevice) -> R<()> {
    let p = proc()?;
    let gpu = p.gpu_of(ordinal)?;
    let _g = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = PRIMARY[ordinal as usize].get().ok_or(CUresult::INVALID_CONTEXT)?;
    match c.refs.load(Acquire) {
        0 => Err(CUresult::INVALID_CONTEXT),
        1 => {
            crate::mem::release_context_memory(c);
            c.refs.store(0, Release);
            p.detach(gpu);
            Ok(())
        }
        _ => {
            c.refs.fetch_sub(1, AcqRel);
            Ok(())
        }
    }
}

/// `cuDevicePrimaryCtxReset`: frees everything allocated in the primary context; it stays retained.
pub fn primary_reset(ordinal: CUdevice) -> R<()> {
    let p = proc()?;
    p.gpu_of(ordinal)?;
    {
        let _g = PRIMARY_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = PRIMARY[ordinal as usize].get() {
            crate::mem::release_context_memory(c);
        }
    }
    std::thread::sleep(std::time::Duration::from_nanos(p.node.cfg.destroy_return_ns));
    Ok(())
}

pub fn primary_state(ordinal: CUdevice) -> R<(u32, bool)> {
    let p = proc()?;
    p.gpu_of(ordinal)?;
    Ok((0, PRIMARY[ordinal as usize].get().is_some_and(|c| c.refs.load(Acquire) > 0)))
}

/// Destroyed contexts, given to the next `cuCtxCreate` for their device (last gone, first given),
/// the way a real driver's allocator hands a freed object's memory to the next one: the same handle
/// then names another context.
static SPARE_CTXS: Mutex<Vec<&'static Ctx>> = Mutex::new(Vec::new());

pub fn ctx_create(ordinal: CUdevice) -> R<&'static Ctx> {
    let p = proc()?;
    let gpu = p.gpu_of(ordinal)?;
    p.node.reap();
    p.attach(gpu)?;
    let spare = {
        let mut s = SPARE_CTXS.lock().unwrap_or_else(|e| e.into_inner());
        s.iter().rposition(|c| c.gpu == gpu && c.ordinal == ordinal).map(|i| s.remove(i))
    };
    let c = match spare {
        Some(c) => {
            // Its modules went and its limits were set back when it was destroyed.
            c.magic.store(CTX_MAGIC, Release);
            c
        }
        None => Ctx::new(gpu, ordinal, false),
    };
    push(c)?;
    Ok(c)
}

pub fn ctx_destroy(c: &'static Ctx) -> R<()> {
    if c.primary {
        return Err(CUresult::INVALID_CONTEXT);
    }
    let p = proc()?;
    crate::mem::release_context_memory(c);
    c.magic.store(0, Release);
    STACK.with(|s| s.remove(c));
    p.detach(c.gpu);
    SPARE_CTXS.lock().unwrap_or_else(|e| e.into_inner()).push(c);
    std::thread::sleep(std::time::Duration::from_nanos(p.node.cfg.destroy_return_ns));
    Ok(())
}

/// `cuCtxGetLimit`.
pub fn get_limit(c: &Ctx, limit: i32) -> R<u64> {
    match limit {
        0..=2 => Ok(c.limits.lock().unwrap_or_else(|e| e.into_inner())[limit as usize]),
        3 => Ok(2),    // device runtime sync depth
        4 => Ok(2048), // device runtime pending launches
        5 | 6 => Ok(0),
        _ => Err(CUresult::UNSUPPORTED_LIMIT),
    }
}

/// `cuCtxSetLimit`, as the driver does it: a larger stack (for every thread the GPU holds at once),
/// printf FIFO or malloc heap takes its device memory at once (refused when there is no room, the
/// old value kept), a smaller one gives it back; the stack is rounded up to 16 bytes.
pub fn set_limit(c: &Ctx, limit: i32, value: u64) -> R<()> {
    if !(0..=2).contains(&limit) {
        return get_limit(c, limit).map(|_| ());
    }
    let p = proc()?;
    let g = p.gpu_cfg(c.gpu);
    let threads = g.sm_count as u64 * g.model.max_threads_per_sm as u64;
    let held = |l: &[u64; 3]| {
        l[0].saturating_sub(LIMIT_DEFAULTS[0]).saturating_mul(threads)
            + l[1].saturating_sub(LIMIT_DEFAULTS[1])
            + l[2].saturating_sub(LIMIT_DEFAULTS[2])
    };
    let mut l = c.limits.lock().unwrap_or_else(|e| e.into_inner());
    let mut next = *l;
    next[limit as usize] = if limit == 0 { value.div_ceil(16) * 16 } else { value };
    let (before, after) = (held(&l), held(&next));
    if after > before {
        p.charge(c.gpu, after - before)?;
        c.limit_bytes.fetch_add(after - before, AcqRel);
    } else {
        p.uncharge(c.gpu, before - after);
        c.limit_bytes.fetch_sub(before - after, AcqRel);
    }
    *l = next;
    Ok(())
}

pub fn push(c: &'static Ctx) -> R<()> {
    STACK.with(|s| s.push(c))
}

pub fn pop() -> R<&'static Ctx> {
    proc()?;
    STACK.with(CtxStack::pop).ok_or(CUresult::INVALID_CONTEXT)
}

/// `cuCtxSetCurrent`: replaces the top of the stack (NULL pops it).
pub fn set_current(c: Option<&'static Ctx>) -> R<()> {
    proc()?;
    STACK.with(|s| {
        s.pop();
        c.map_or(Ok(()), |c| s.push(c))
    })
}

pub fn get_current() -> R<Option<&'static Ctx>> {
    proc()?;
    Ok(STACK.with(CtxStack::top))
}

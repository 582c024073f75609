//! Device memory: linear allocations, VMM, stream-ordered pools, arrays, copies.
//!
//! Device pointers are addresses of private `MAP_NORESERVE` host mappings, so copies work and a large
//! device costs nothing until touched. Physical usage is charged to this process on the node; the
//! node refuses what exceeds the GPU's memory (CUDA_ERROR_OUT_OF_MEMORY). Managed (unified) memory
//! is resident on the GPU while it fits; beyond the GPU's free memory it is granted anyway and lives
//! on the host (not charged to the GPU), as unified memory on GPUs that page on demand does.

use crate::driver::{current, proc, Ctx, R};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use vgpu_sim::abi::*;

pub const GRANULARITY: u64 = 2 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Device,
    Managed,
    /// From a pool (the pool's reservation is what is charged).
    Pool(u64),
    /// A graph allocation, live between its allocation and its free (the device's graph pool is
    /// what is charged; the address belongs to the allocation node).
    Graph,
}

struct Alloc {
    size: u64,
    len: usize,
    gpu: usize,
    ctx: usize,
    kind: Kind,
    /// Charged to the GPU's memory (false: managed memory living on the host).
    charged: bool,
}

struct PhysHandle {
    gpu: usize,
    size: u64,
    fd: i32,
    maps: u32,
    /// References to the handle: 1 from `cuMemCreate`, one more per `cuMemRetainAllocationHandle`,
    /// one less per `cuMemRelease` (0: released).
    refs: u32,
}

struct Reservation {
    size: u64,
    /// offset -> (len, handle)
    maps: BTreeMap<u64, (u64, u64)>,
}

/// A graph allocation (see `exec`): a virtual range given when its node is made and fixed for the
/// node's life, backed by the device's graph memory pool while the allocation is live.
#[derive(Clone, Copy, Debug)]
pub struct GraphAlloc {
    pub ptr: u64,
    pub size: u64,
    pub gpu: usize,
    pub ordinal: CUdevice,
}

/// What an executable graph's memory nodes do when it runs, in order.
#[derive(Clone, Copy, Debug)]
pub enum MemOp {
    Alloc(GraphAlloc),
    Free(u64),
}

/// A device's graph memory pool in this process: physical memory reserved for graph allocations
/// (charged to the process), of which `used` backs live ones. It grows when a graph runs (or is
/// uploaded) and shrinks only by `cuDeviceGraphMemTrim`, or with its device's context.
#[derive(Default)]
struct GraphPool {
    reserved: u64,
    used: u64,
    high_reserved: u64,
    high_used: u64,
}

struct Pool {
    /// The GPU whose memory it holds (for a pool of host memory, the GPU it was made on: nothing of
    /// it is charged).
    gpu: usize,
    /// Host memory (`CU_MEM_LOCATION_TYPE_HOST*`): no GPU memory is charged for it.
    host: bool,
    reserved: u64,
    used: u64,
    high_reserved: u64,
    high_used: u64,
    threshold: u64,
    default: bool,
    destroyed: bool,
}

#[derive(Default)]
struct Mem {
    /// Unmapped-later backings of freed small allocations, by length, reused by the next allocation
    /// of the same length (saves an mmap/munmap pair; device memory is not zeroed by CUDA either).
    spare: HashMap<usize, Vec<u64>>,
    spare_bytes: usize,
    allocs: BTreeMap<u64, Alloc>,
    handles: HashMap<u64, PhysHandle>,
    /// Values of handles that went, given to the next `cuMemCreate` first (last gone, first given),
    /// the way a real driver's allocator hands a freed object's memory to the next one: the same
    /// value then names another allocation as soon as the driver has let it go.
    spare_handles: Vec<u64>,
    /// Values of pools that went, given to the next `cuMemPoolCreate` first, the same way.
    spare_pools: Vec<u64>,
    reserves: BTreeMap<u64, Reservation>,
    pools: HashMap<u64, Pool>,
    /// array handle -> (gpu, size)
    /// Array handle -> (GPU, bytes, context).
    arrays: HashMap<u64, (usize, u64, usize)>,
    /// Graph allocations by address (made by nodes; live ones are in `allocs` too).
    graph_vas: HashMap<u64, GraphAlloc>,
    /// Graph memory pools by GPU.
    graph_pools: HashMap<usize, GraphPool>,
    /// Growth of graph pools due at the next synchronisation (`graph_memory_mapped_at = "sync"`).
    graph_due: Vec<(usize, u64)>,
    next_id: u64,
}

static MEM: Mutex<Option<Mem>> = Mutex::new(None);

fn mem() -> MutexGuard<'static, Option<Mem>> {
    MEM.lock().unwrap_or_else(|p| p.into_inner())
}

macro_rules! with_mem {
    ($m:ident => $body:expr) => {{
        let mut g = mem();
        let $m = g.get_or_insert_with(|| Mem { next_id: 0x1000, ..Default::default() });
        $body
    }};
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn map_anon(len: usize) -> R<*mut u8> {
    // SAFETY: anonymous private mapping with no address hint; failure is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(CUresult::OUT_OF_MEMORY)
    } else {
        Ok(p as *mut u8)
    }
}

fn unmap(addr: u64, len: usize) {
    // SAFETY: (addr, len) is a mapping this module created and removes exactly once.
    unsafe { libc::munmap(addr as *mut libc::c_void, len.max(1)) };
}

fn ctx_key(c: &Ctx) -> usize {
    c as *const Ctx as usize
}

/// Allocates `size` bytes of device memory of `kind` in the current context.
pub fn alloc(size: u64, kind: Kind) -> R<CUdeviceptr> {
    let c = current()?;
    let p = proc()?;
    if size == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let charged = match kind {
        Kind::Device => p.charge(c.gpu, size).map(|_| true)?,
        // No room on the GPU: unified memory that pages on demand lives on the host.
        Kind::Managed if p.gpu_cfg(c.gpu).managed_paging => p.charge(c.gpu, size).is_ok(),
        Kind::Managed => p.charge(c.gpu, size).map(|_| true)?,
        Kind::Pool(_) | Kind::Graph => false,
    };
    let len = usize::try_from(size).map_err(|_| CUresult::OUT_OF_MEMORY)?;
    let ptr = match backing(len) {
        Ok(ptr) => ptr,
        Err(e) => {
            if charged {
                p.uncharge(c.gpu, size);
            }
            return Err(e);
        }
    };
    with_mem!(m => m.allocs.insert(ptr, Alloc { size, len, gpu: c.gpu, ctx: ctx_key(c), kind, charged }));
    Ok(ptr)
}

/// A host mapping of `len` bytes to back an allocation: a spare one of that length, or a new one.
fn backing(len: usize) -> R<u64> {
    let cached = with_mem!(m => {
        let p = m.spare.get_mut(&len).and_then(Vec::pop);
        if p.is_some() {
            m.spare_bytes -= len;
        }
        p
    });
    cached.map(Ok).unwrap_or_else(|| map_anon(len).map(|p| p as u64))
}

const SPARE_MAX_LEN: usize = 1 << 20;
const SPARE_MAX_BYTES: usize = 64 << 20;

/// Unmaps a linear allocation's backing, or keeps it for reuse when it is small.
fn retire(ptr: u64, len: usize) {
    let kept = len <= SPARE_MAX_LEN
        && with_mem!(m => {
            if m.spare_bytes + len > SPARE_MAX_BYTES {
                false
            } else {
                m.spare.entry(len).or_default().push(ptr);
                m.spare_bytes += len;
                true
            }
        });
    if !kept {
        unmap(ptr, len);
    }
}

pub fn alloc_pitch(width: usize, height: usize, elem: u32) -> R<(CUdeviceptr, usize)> {
    if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let pitch = round_up(width as u64, 512);
    let size = pitch.checked_mul(height as u64).ok_or(CUresult::OUT_OF_MEMORY)?;
    Ok((alloc(size, Kind::Device)?, pitch as usize))
}

/// `cuMemFree`: frees a linear allocation (not pool memory: use cuMemFreeAsync for that).
pub fn free(ptr: CUdeviceptr) -> R<()> {
    let p = proc()?;
    if ptr == 0 {
        return Ok(());
    }
    let a = with_mem!(m => {
        match m.allocs.get(&ptr) {
            Some(a) if a.kind == Kind::Graph => {
                graph_release(m, ptr);
                return Ok(());
            }
            Some(a) if !matches!(a.kind, Kind::Pool(_)) => m.allocs.remove(&ptr),
            _ => None,
        }
    })
    .ok_or(CUresult::INVALID_VALUE)?;
    retire(ptr, a.len);
    if a.charged {
        p.uncharge(a.gpu, a.size);
    }
    Ok(())
}

/// Frees every allocation of a context that is going away, like the driver does.
pub fn release_context_memory(c: &Ctx) {
    let Ok(p) = proc() else { return };
    let key = ctx_key(c);
    type Gone = (Vec<(u64, Alloc)>, Vec<(usize, u64)>);
    let (gone, arrays): Gone = with_mem!(m => {
        let ptrs: Vec<u64> = m.allocs.iter().filter(|(_, a)| a.ctx == key).map(|(k, _)| *k).collect();
        let arrays: Vec<u64> = m.arrays.iter().filter(|(_, a)| a.2 == key).map(|(h, _)| *h).collect();
        (
            ptrs.into_iter().filter_map(|k| m.allocs.remove(&k).map(|a| (k, a))).collect(),
            arrays.into_iter().filter_map(|h| m.arrays.remove(&h).map(|(gpu, size, _)| (gpu, size))).collect(),
        )
    });
    let pool_allocs: Vec<(u64, u64)> =
        gone.iter().filter_map(|(_, a)| if let Kind::Pool(id) = a.kind { Some((id, a.size)) } else { None }).collect();
    for (ptr, a) in gone {
        if a.kind != Kind::Graph {
            unmap(ptr, a.len); // a graph allocation's address stays its node's
        }
        if a.charged {
            p.uncharge(a.gpu, a.size);
        }
    }
    for (gpu, size) in arrays {
        p.uncharge(gpu, size);
    }
    // The device's graph memory pool goes with it (live graph allocations went above).
    let pool = with_mem!(m => m.graph_pools.remove(&c.gpu)).map_or(0, |g| g.reserved);
    p.uncharge(c.gpu, pool);
    // Stream-ordered allocations made in it went above too: their pools no longer use that memory,
    // and the device's pools give back all they hold.
    let freed = with_mem!(m => {
        for (id, size) in pool_allocs {
            if let Some(p) = m.pools.get_mut(&id) {
                p.used = p.used.saturating_sub(size);
            }
        }
        m.pools.values_mut().filter(|p| p.gpu == c.gpu).map(|p| trim(p, 0)).sum::<u64>()
    });
    p.uncharge(c.gpu, freed);
    // Its modules are unloaded with it (a reset context starts with none), and its limits are the
    // defaults again.
    p.uncharge(c.gpu, c.module_bytes.swap(0, std::sync::atomic::Ordering::AcqRel));
    *c.limits.lock().unwrap_or_else(|e| e.into_inner()) = crate::driver::LIMIT_DEFAULTS;
    p.uncharge(c.gpu, c.limit_bytes.swap(0, std::sync::atomic::Ordering::AcqRel));
    crate::exec::modules_gone(c);
    // And its events.
    c.ends.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
}

/// (free, total) of the current context's device.
pub fn get_info() -> R<(u64, u64)> {
    let c = current()?;
    let p = proc()?;
    p.node.maybe_reap();
    let total = p.gpu_cfg(c.gpu).memory_bytes;
    Ok((total.saturating_sub(p.mem_used(c.gpu)), total))
}

pub fn address_range(ptr: CUdeviceptr) -> R<(CUdeviceptr, u64)> {
    with_mem!(m => {
        m.allocs.range(..=ptr).next_back().filter(|(b, a)| ptr < *b + a.size).map(|(b, a)| (*b, a.size))
    })
    .ok_or(CUresult::NOT_FOUND)
}

/// Checks that [ptr, ptr+len) is device memory that can be read and written.
fn check_range(m: &Mem, ptr: u64, len: u64) -> bool {
    let end = match ptr.checked_add(len) {
        Some(e) => e,
        None => return false,
    };
    if let Some((b, a)) = m.allocs.range(..=ptr).next_back() {
        if end <= b + a.size {
            return true;
        }
    }
    if let Some((b, r)) = m.reserves.range(..=ptr).next_back() {
        if end <= b + r.size {
            // Every byte must be covered by a mapping.
            let mut at = ptr - b;
            let stop = end - b;
            for (off, (l, _)) in r.maps.range(..stop) {
                if *off > at {
                    return false;
                }
                at = at.max(off + l);
                if at >= stop {
                    return true;
                }
            }
            return at >= stop;
        }
    }
    false
}

pub enum Dir {
    HtoD,
    DtoH,
    DtoD,
}

/// Copies `len` bytes; device ranges are validated, host pointers trusted like the real driver.
pub fn copy(dst: u64, src: u64, len: usize, dir: Dir) -> R<()> {
    current()?;
    if len == 0 {
        return Ok(());
    }
    let ok = with_mem!(m => match dir {
        Dir::HtoD => check_range(m, dst, len as u64),
        Dir::DtoH => check_range(m, src, len as u64),
        Dir::DtoD => check_range(m, dst, len as u64) && check_range(m, src, len as u64),
    });
    if !ok || dst == 0 || src == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: device ranges were checked to lie inside live mappings of ours; host pointers are the
    // caller's contract, exactly as with the real cuMemcpy.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
    Ok(())
}

/// Unified copy: each side may be device or host memory.
pub fn copy_unified(dst: u64, src: u64, len: usize) -> R<()> {
    current()?;
    let (d, s) = with_mem!(m => (check_range(m, dst, len as u64), check_range(m, src, len as u64)));
    let dir = match (d, s) {
        (true, true) => Dir::DtoD,
        (true, false) => Dir::HtoD,
        (false, true) => Dir::DtoH,
        (false, false) => return Err(CUresult::INVALID_VALUE),
    };
    copy(dst, src, len, dir)
}

pub fn memset(dst: u64, value: u32, elem: usize, count: usize) -> R<()> {
    current()?;
    let len = count.checked_mul(elem).ok_or(CUresult::INVALID_VALUE)?;
    if !with_mem!(m => check_range(m, dst, len as u64)) {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: [dst, dst+len) lies inside one of our live read-write mappings.
    unsafe {
        match elem {
            1 => std::ptr::write_bytes(dst as *mut u8, value as u8, count),
            2 => std::slice::from_raw_parts_mut(dst as *mut u16, count).fill(value as u16),
            _ => std::slice::from_raw_parts_mut(dst as *mut u32, count).fill(value),
        }
    }
    Ok(())
}

// ----- host memory (never counted on the device) -----

pub fn alloc_host(size: usize) -> R<*mut libc::c_void> {
    proc()?;
    // SAFETY: malloc with a positive size; null is checked.
    let p = unsafe { libc::malloc(size.max(1)) };
    if p.is_null() {
        Err(CUresult::OUT_OF_MEMORY)
    } else {
        Ok(p)
    }
}

pub fn free_host(p: *mut libc::c_void) -> R<()> {
    proc()?;
    // SAFETY: p came from alloc_host (malloc), or is null.
    unsafe { libc::free(p) };
    Ok(())
}

// ----- VMM -----

pub fn granularity(prop: &CUmemAllocationProp) -> R<u64> {
    proc()?.gpu_of(prop.location.id)?;
    if prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CUresult::INVALID_VALUE);
    }
    Ok(GRANULARITY)
}

pub fn create(size: u64, prop: &CUmemAllocationProp) -> R<u64> {
    let p = proc()?;
    if prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(CUresult::INVALID_VALUE);
    }
    let gpu = p.gpu_of(prop.location.id)?;
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(CUresult::INVALID_VALUE);
    }
    p.charge(gpu, size)?;
    // SAFETY: memfd_create with a static C string; ftruncate on the fd we just got.
    let fd = unsafe {
        let fd = libc::memfd_create(c"vgpu-sim-vmm".as_ptr(), libc::MFD_CLOEXEC);
        if fd >= 0 && libc::ftruncate(fd, size as libc::off_t) != 0 {
            libc::close(fd);
            -1
        } else {
            fd
        }
    };
    if fd < 0 {
        p.uncharge(gpu, size);
        return Err(CUresult::OUT_OF_MEMORY);
    }
    Ok(with_mem!(m => {
        let h = reused_or_new(&mut m.spare_handles, &mut m.next_id);
        m.handles.insert(h, PhysHandle { gpu, size, fd, maps: 0, refs: 1 });
        h
    }))
}

/// The value that went last of `spare`, else a new one.
fn reused_or_new(spare: &mut Vec<u64>, next_id: &mut u64) -> u64 {
    spare.pop().unwrap_or_else(|| {
        *next_id += 1;
        *next_id
    })
}

fn drop_handle_if_done(m: &mut Mem, h: u64) {
    if let Some(ph) = m.handles.get(&h) {
        if ph.refs == 0 && ph.maps == 0 {
            let ph = m.handles.remove(&h).unwrap();
            m.spare_handles.push(h);
            // SAFETY: fd is the memfd owned by this handle, closed once.
            unsafe { libc::close(ph.fd) };
            if let Ok(p) = proc() {
                p.uncharge(ph.gpu, ph.size);
            }
        }
    }
}

/// `cuMemRelease`: the memory goes once the handle is released and unmapped everywhere.
pub fn release(h: u64) -> R<()> {
    proc()?;
    with_mem!(m => {
        let ph = m.handles.get_mut(&h).filter(|p| p.refs > 0).ok_or(CUresult::INVALID_VALUE)?;
        ph.refs -= 1;
        drop_handle_if_done(m, h);
        Ok(())
    })
}

/// `cuMemRetainAllocationHandle`: the handle mapped at `addr`, with one more reference to it.
pub fn retain(addr: u64) -> R<u64> {
    proc()?;
    with_mem!(m => {
        let (base, r) = m.reserves.range(..=addr).next_back().ok_or(CUresult::INVALID_VALUE)?;
        let off = addr - base;
        let h = r
            .maps
            .range(..=off)
            .next_back()
            .filter(|(o, (l, _))| off < *o + *l)
            .map(|(_, (_, h))| *h)
            .ok_or(CUresult::INVALID_VALUE)?;
        m.handles.get_mut(&h).ok_or(CUresult::INVALID_VALUE)?.refs += 1;
        Ok(h)
    })
}

pub fn address_reserve(size: u64, alignment: u64) -> R<CUdeviceptr> {
    proc()?;
    if size == 0 || !size.is_multiple_of(GRANULARITY) {
        return Err(CUresult::INVALID_VALUE);
    }
    let align = alignment.max(GRANULARITY);
    let span = size + align;
    // SAFETY: an inaccessible reservation; failure is checked. The unaligned head and tail are
    // returned to the system right away.
    let base = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            span as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        let start = p as u64;
        let aligned = round_up(start, align);
        if aligned > start {
            libc::munmap(p, (aligned - start) as usize);
        }
        let tail = start + span - (aligned + size);
        if tail > 0 {
            libc::munmap((aligned + size) as *mut libc::c_void, tail as usize);
        }
        aligned
    };
    with_mem!(m => m.reserves.insert(base, Reservation { size, maps: BTreeMap::new() }));
    Ok(base)
}

pub fn address_free(ptr: u64, size: u64) -> R<()> {
    proc()?;
    with_mem!(m => {
        match m.reserves.get(&ptr) {
            Some(r) if r.size == size && r.maps.is_empty() => {}
            _ => return Err(CUresult::INVALID_VALUE),
        }
        m.reserves.remove(&ptr);
        unmap(ptr, size as usize);
        Ok(())
    })
}

pub fn map(ptr: u64, size: u64, offset: u64, h: u64) -> R<()> {
    proc()?;
    with_mem!(m => {
        let (fd, hsize) = m.handles.get(&h).filter(|p| p.refs > 0).map(|p| (p.fd, p.size)).ok_or(CUresult::INVALID_HANDLE)?;
        if size == 0 || !size.is_multiple_of(GRANULARITY) || !offset.is_multiple_of(GRANULARITY) || offset + size > hsize {
            return Err(CUresult::INVALID_VALUE);
        }
        let (base, r) = m.reserves.range_mut(..=ptr).next_back().ok_or(CUresult::INVALID_VALUE)?;
        let off = ptr - base;
        if !off.is_multiple_of(GRANULARITY) || off + size > r.size {
            return Err(CUresult::INVALID_VALUE);
        }
        if r.maps.range(..off + size).next_back().is_some_and(|(o, (l, _))| o + l > off) {
            return Err(CUresult::INVALID_VALUE);
        }
        // SAFETY: [ptr, ptr+size) lies inside our own reservation and overlaps no other mapping.
        let p = unsafe {
            libc::mmap(ptr as *mut libc::c_void, size as usize, libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED, fd, offset as libc::off_t)
        };
        if p == libc::MAP_FAILED {
            return Err(CUresult::OUT_OF_MEMORY);
        }
        r.maps.insert(off, (size, h));
        m.handles.get_mut(&h).unwrap().maps += 1;
        Ok(())
    })
}

pub fn unmap_range(ptr: u64, size: u64) -> R<()> {
    proc()?;
    with_mem!(m => {
        let (base, r) = m.reserves.range_mut(..=ptr).next_back().ok_or(CUresult::INVALID_VALUE)?;
        let (base, off) = (*base, ptr - base);
        if off + size > r.size {
            return Err(CUresult::INVALID_VALUE);
        }
        let hit: Vec<u64> = r.maps.range(off..off + size).map(|(o, _)| *o).collect();
        if hit.is_empty() {
            return Err(CUresult::INVALID_VALUE);
        }
        let mut handles = Vec::new();
        for o in hit {
            let (l, h) = r.maps.remove(&o).unwrap();
            // SAFETY: replaces exactly one of our mappings with an inaccessible one again.
            unsafe {
                libc::mmap((base + o) as *mut libc::c_void, l as usize, libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED, -1, 0);
            }
            handles.push(h);
        }
        for h in handles {
            if let Some(ph) = m.handles.get_mut(&h) {
                ph.maps -= 1;
            }
            drop_handle_if_done(m, h);
        }
        Ok(())
    })
}

pub fn set_access(ptr: u64, size: u64, descs: &[CUmemAccessDesc]) -> R<()> {
    let p = proc()?;
    for d in descs {
        if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUresult::INVALID_VALUE);
        }
        p.gpu_of(d.location.id)?;
    }
    if with_mem!(m => check_range(m, ptr, size)) {
        Ok(())
    } else {
        Err(CUresult::INVALID_VALUE)
    }
}

// ----- stream-ordered pools -----

const DEFAULT_POOL_BASE: u64 = 0x7000;

pub fn default_pool(ordinal: CUdevice) -> R<u64> {
    let gpu = proc()?.gpu_of(ordinal)?;
    let id = DEFAULT_POOL_BASE + gpu as u64;
    with_mem!(m => {
        m.pools.entry(id).or_insert(Pool { gpu, host: false, reserved: 0, used: 0, high_reserved: 0, high_used: 0, threshold: 0, default: true, destroyed: false });
    });
    Ok(id)
}

/// Where pool `id` keeps its memory: its GPU, and whether it is a pool of host memory.
pub fn pool_place(id: u64) -> R<(usize, bool)> {
    proc()?;
    with_mem!(m => {
        let p = m.pools.get(&id).filter(|p| !p.destroyed).ok_or(CUresult::INVALID_VALUE)?;
        Ok((p.gpu, p.host))
    })
}

pub fn pool_create(props: &CUmemPoolProps) -> R<u64> {
    let host = matches!(
        props.location.type_,
        CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT
    );
    if props.allocType != CU_MEM_ALLOCATION_TYPE_PINNED
        || !(host || props.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE)
    {
        return Err(CUresult::INVALID_VALUE);
    }
    let gpu = if host { current()?.gpu } else { proc()?.gpu_of(props.location.id)? };
    Ok(with_mem!(m => {
        let id = reused_or_new(&mut m.spare_pools, &mut m.next_id);
        m.pools.insert(id, Pool { gpu, host, reserved: 0, used: 0, high_reserved: 0, high_used: 0, threshold: 0, default: false, destroyed: false });
        id
    }))
}

fn trim(p: &mut Pool, keep: u64) -> u64 {
    // `keep` may be the largest u64 (a release threshold meaning "never").
    let keep = keep.min(p.reserved);
    let target = round_up(p.used, GRANULARITY).max(round_up(keep, GRANULARITY)).min(p.reserved);
    let freed = p.reserved - target;
    p.reserved = target;
    if p.host {
        0
    } else {
        freed
    }
}

pub fn pool_destroy(id: u64) -> R<()> {
    let pr = proc()?;
    let (gpu, freed) = with_mem!(m => {
        let p = m.pools.get_mut(&id).filter(|p| !p.destroyed && !p.default).ok_or(CUresult::INVALID_VALUE)?;
        p.destroyed = true;
        let freed = trim(p, 0);
        let gpu = p.gpu;
        if p.used == 0 {
            m.pools.remove(&id);
            m.spare_pools.push(id);
        }
        Ok::<_, CUresult>((gpu, freed))
    })?;
    pr.uncharge(gpu, freed);
    std::thread::sleep(std::time::Duration::from_nanos(pr.node.cfg.destroy_return_ns));
    Ok(())
}

/// A stream-ordered allocation of `size` bytes from pool `id` (None: the default pool of `c`'s
/// device), made on a stream of context `c`.
pub fn pool_alloc(c: &'static Ctx, id: Option<u64>, size: u64) -> R<CUdeviceptr> {
    let pr = proc()?;
    if size == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let id = match id {
        Some(i) => i,
        None => default_pool(c.ordinal)?,
    };
    let gpu = with_mem!(m => {
        let p = m.pools.get_mut(&id).filter(|p| !p.destroyed).ok_or(CUresult::INVALID_VALUE)?;
        let spare = p.reserved - p.used;
        if size > spare {
            let grow = round_up(size - spare, GRANULARITY);
            if !p.host {
                pr.charge(p.gpu, grow)?;
            }
            p.reserved += grow;
            p.high_reserved = p.high_reserved.max(p.reserved);
        }
        p.used += size;
        p.high_used = p.high_used.max(p.used);
        Ok::<_, CUresult>(p.gpu)
    })?;
    let len = size as usize;
    match backing(len) {
        Ok(ptr) => {
            with_mem!(m => m.allocs.insert(ptr, Alloc { size, len, gpu, ctx: ctx_key(c), kind: Kind::Pool(id), charged: false }));
            Ok(ptr)
        }
        Err(e) => {
            with_mem!(m => if let Some(p) = m.pools.get_mut(&id) { p.used -= size; });
            Err(e)
        }
    }
}

/// `cuMemFreeAsync`: pool memory returns to its pool; other memory is freed at once.
pub fn free_async(ptr: CUdeviceptr) -> R<()> {
    let pr = proc()?;
    if with_mem!(m => graph_release(m, ptr)) {
        return Ok(());
    }
    let a = with_mem!(m => m.allocs.remove(&ptr)).ok_or(CUresult::INVALID_VALUE)?;
    retire(ptr, a.len);
    match a.kind {
        Kind::Pool(id) => {
            let freed = with_mem!(m => {
                let mut freed = 0;
                let mut gone = false;
                if let Some(p) = m.pools.get_mut(&id) {
                    p.used -= a.size;
                    if p.destroyed && p.used == 0 {
                        freed = if p.host { 0 } else { p.reserved };
                        gone = true;
                    }
                }
                if gone {
                    m.pools.remove(&id);
                    m.spare_pools.push(id);
                }
                freed
            });
            pr.uncharge(a.gpu, freed);
        }
        _ => pr.uncharge(a.gpu, a.size),
    }
    Ok(())
}

/// At synchronisation points pools give back what exceeds their release threshold (and graph
/// pools grow by what is due, where graph memory is mapped lazily).
pub fn pools_sync(gpu: usize) {
    let Ok(pr) = proc() else { return };
    let due: Vec<(usize, u64)> = with_mem!(m => {
        let (now, later) = m.graph_due.drain(..).partition(|&(g, _)| g == gpu);
        m.graph_due = later;
        now
    });
    for (g, bytes) in due {
        // The launch is long done: what does not fit is left unbacked (a real driver would have
        // failed the work).
        if pr.charge(g, bytes).is_ok() {
            with_mem!(m => {
                let p = m.graph_pools.entry(g).or_default();
                p.reserved += bytes;
                p.high_reserved = p.high_reserved.max(p.reserved);
            });
        }
    }
    let freed = with_mem!(m => {
        m.pools.values_mut().filter(|p| p.gpu == gpu).map(|p| { let t = p.threshold; trim(p, t) }).sum::<u64>()
    });
    if freed > 0 {
        pr.uncharge(gpu, freed);
    }
}

pub fn pool_trim(id: u64, keep: u64) -> R<()> {
    let pr = proc()?;
    let (gpu, freed) = with_mem!(m => {
        let p = m.pools.get_mut(&id).ok_or(CUresult::INVALID_VALUE)?;
        Ok::<_, CUresult>((p.gpu, trim(p, keep)))
    })?;
    pr.uncharge(gpu, freed);
    std::thread::sleep(std::time::Duration::from_nanos(pr.node.cfg.pool_trim_return_ns));
    Ok(())
}

pub fn pool_attr(id: u64, attr: i32, set: Option<u64>) -> R<u64> {
    proc()?;
    with_mem!(m => {
        let p = m.pools.get_mut(&id).ok_or(CUresult::INVALID_VALUE)?;
        let v = match (attr, set) {
            (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, Some(v)) => { p.threshold = v; v }
            (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, None) => p.threshold,
            (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, None) => p.reserved,
            (CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, None) => p.high_reserved,
            (CU_MEMPOOL_ATTR_USED_MEM_CURRENT, None) => p.used,
            (CU_MEMPOOL_ATTR_USED_MEM_HIGH, None) => p.high_used,
            (CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, Some(_)) => { p.high_reserved = p.reserved; 0 }
            (CU_MEMPOOL_ATTR_USED_MEM_HIGH, Some(_)) => { p.high_used = p.used; 0 }
            (1..=3, Some(v)) => v,
            (1..=3, None) => 1,
            _ => return Err(CUresult::INVALID_VALUE),
        };
        Ok(v)
    })
}

// ----- graph memory -----

/// A graph allocation node's address: a virtual range of `size` bytes on `gpu`, backed only while
/// the allocation is live.
pub fn graph_va(size: u64, gpu: usize, ordinal: CUdevice) -> R<GraphAlloc> {
    if size == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let len = usize::try_from(size).map_err(|_| CUresult::OUT_OF_MEMORY)?;
    let ptr = map_anon(len)? as u64;
    let a = GraphAlloc { ptr, size, gpu, ordinal };
    with_mem!(m => m.graph_vas.insert(ptr, a));
    Ok(a)
}

/// Whether `ptr` is a graph allocation's address (a free node may free only those).
pub fn is_graph_va(ptr: u64) -> bool {
    with_mem!(m => m.graph_vas.contains_key(&ptr))
}

/// Ends a live graph allocation: its memory returns to the graph pool. False if `ptr` is none.
fn graph_release(m: &mut Mem, ptr: u64) -> bool {
    match m.allocs.get(&ptr) {
        Some(a) if a.kind == Kind::Graph => {
            let a = m.allocs.remove(&ptr).unwrap();
            if let Some(g) = m.graph_pools.get_mut(&a.gpu) {
                g.used -= a.size;
            }
            true
        }
        _ => false,
    }
}

/// What `ops` need on top of each pool's spare memory: (GPU, bytes to add to its reservation).
fn graph_growth(m: &Mem, ops: &[MemOp], auto_free: bool) -> Vec<(usize, u64)> {
    // Per GPU: (used while the ops run, its peak).
    let mut run: HashMap<usize, (u64, u64)> = HashMap::new();
    let mut live: HashMap<u64, (usize, u64)> = HashMap::new();
    let used = |gpu: usize| m.graph_pools.get(&gpu).map_or(0, |g| g.used);
    for op in ops {
        match *op {
            MemOp::Alloc(a) => {
                let r = run.entry(a.gpu).or_insert_with(|| (used(a.gpu), used(a.gpu)));
                if auto_free && m.allocs.get(&a.ptr).is_some_and(|x| x.kind == Kind::Graph) {
                    r.0 -= a.size; // freed first, as the flag says
                }
                r.0 += a.size;
                r.1 = r.1.max(r.0);
                live.insert(a.ptr, (a.gpu, a.size));
            }
            MemOp::Free(p) => {
                let known = live
                    .remove(&p)
                    .or_else(|| m.allocs.get(&p).filter(|x| x.kind == Kind::Graph).map(|x| (x.gpu, x.size)));
                if let Some((gpu, size)) = known {
                    let r = run.entry(gpu).or_insert_with(|| (used(gpu), used(gpu)));
                    r.0 = r.0.saturating_sub(size);
                }
            }
        }
    }
    run.into_iter()
        .filter_map(|(gpu, (_, peak))| {
            let reserved = m.graph_pools.get(&gpu).map_or(0, |g| g.reserved);
            (peak > reserved).then(|| (gpu, round_up(peak - reserved, GRANULARITY)))
        })
        .collect()
}

/// Grows the graph pools by what `ops` need, charging the process; all or nothing. A driver that
/// maps graph memory lazily does it at the next synchronisation instead (see `graph_due`).
fn graph_reserve(m: &mut Mem, ops: &[MemOp], auto_free: bool) -> R<()> {
    let pr = proc()?;
    let grow = graph_growth(m, ops, auto_free);
    if pr.node.cfg.graph_memory_at_sync {
        // Launches before the synchronisation share the growth (they draw on one pool).
        for &(gpu, bytes) in &grow {
            match m.graph_due.iter_mut().find(|(g, _)| *g == gpu) {
                Some(due) => due.1 = due.1.max(bytes),
                None => m.graph_due.push((gpu, bytes)),
            }
        }
        return Ok(());
    }
    for (i, &(gpu, bytes)) in grow.iter().enumerate() {
        if let Err(e) = pr.charge(gpu, bytes) {
            for &(g, b) in &grow[..i] {
                pr.uncharge(g, b);
            }
            return Err(e);
        }
    }
    for (gpu, bytes) in grow {
        let g = m.graph_pools.entry(gpu).or_default();
        g.reserved += bytes;
        g.high_reserved = g.high_reserved.max(g.reserved);
    }
    Ok(())
}

/// Runs an executable graph's memory nodes (at its launch): the pools grow by what the launch
/// needs beyond their spare memory, or the launch fails with nothing done. An allocation still
/// live from an earlier launch fails it too, unless the graph frees it itself (auto-free).
pub fn graph_run(c: &Ctx, ops: &[MemOp], auto_free: bool) -> R<()> {
    with_mem!(m => {
        for op in ops {
            if let MemOp::Alloc(a) = op {
                if !auto_free && m.allocs.contains_key(&a.ptr) {
                    return Err(CUresult::INVALID_VALUE);
                }
            }
        }
        graph_reserve(m, ops, auto_free)?;
        for op in ops {
            match *op {
                MemOp::Alloc(a) => {
                    graph_release(m, a.ptr);
                    let g = m.graph_pools.entry(a.gpu).or_default();
                    g.used += a.size;
                    g.high_used = g.high_used.max(g.used);
                    let len = a.size as usize;
                    m.allocs.insert(a.ptr, Alloc { size: a.size, len, gpu: a.gpu, ctx: ctx_key(c), kind: Kind::Graph, charged: false });
                }
                MemOp::Free(p) => {
                    graph_release(m, p);
                }
            }
        }
        Ok(())
    })
}

/// `cuGraphUpload`: backs the graph's allocations ahead of its launch (the pools grow now).
pub fn graph_upload(ops: &[MemOp], auto_free: bool) -> R<()> {
    with_mem!(m => graph_reserve(m, ops, auto_free))
}

/// `cuDeviceGraphMemTrim`: the pool gives back what no live graph allocation uses.
pub fn graph_trim(gpu: usize) -> R<()> {
    let pr = proc()?;
    let freed = with_mem!(m => m.graph_pools.get_mut(&gpu).map_or(0, |g| {
        let keep = round_up(g.used, GRANULARITY).min(g.reserved);
        let freed = g.reserved - keep;
        g.reserved = keep;
        freed
    }));
    pr.uncharge(gpu, freed);
    Ok(())
}

/// `cuDeviceGetGraphMemAttribute` (`set`: `cuDeviceSetGraphMemAttribute`, which only resets the
/// high watermarks, with 0).
pub fn graph_attr(gpu: usize, attr: i32, set: Option<u64>) -> R<u64> {
    with_mem!(m => {
        let g = m.graph_pools.entry(gpu).or_default();
        Ok(match (attr, set) {
            (CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, None) => g.used,
            (CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, None) => g.high_used,
            (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, None) => g.reserved,
            (CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH, None) => g.high_reserved,
            (CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, Some(0)) => { g.high_used = g.used; 0 }
            (CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH, Some(0)) => { g.high_reserved = g.reserved; 0 }
            _ => return Err(CUresult::INVALID_VALUE),
        })
    })
}

// ----- arrays -----

pub const ARRAY_ALIGNMENT: u64 = 64 << 10;

fn format_bytes(f: u32) -> R<u64> {
    Ok(match f {
        CU_AD_FORMAT_UNSIGNED_INT8 | CU_AD_FORMAT_SIGNED_INT8 => 1,
        CU_AD_FORMAT_UNSIGNED_INT16 | CU_AD_FORMAT_SIGNED_INT16 | CU_AD_FORMAT_HALF => 2,
        CU_AD_FORMAT_UNSIGNED_INT32 | CU_AD_FORMAT_SIGNED_INT32 | CU_AD_FORMAT_FLOAT => 4,
        _ => return Err(CUresult::INVALID_VALUE),
    })
}

/// Bytes an array occupies: rows padded to 512 B, the whole rounded to 64 KiB.
pub fn array_size(w: usize, h: usize, d: usize, format: u32, channels: u32) -> R<u64> {
    if w == 0 || !matches!(channels, 1 | 2 | 4) {
        return Err(CUresult::INVALID_VALUE);
    }
    let row = round_up(w as u64 * format_bytes(format)? * channels as u64, 512);
    let total =
        row.checked_mul(h.max(1) as u64).and_then(|x| x.checked_mul(d.max(1) as u64)).ok_or(CUresult::INVALID_VALUE)?;
    Ok(round_up(total, ARRAY_ALIGNMENT))
}

pub fn mipmapped_size(desc: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> R<u64> {
    if levels == 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let (mut w, mut h, mut d) = (desc.Width, desc.Height, desc.Depth);
    let mut total = 0u64;
    for _ in 0..levels {
        total += array_size(w, h, d, desc.Format, desc.NumChannels)?;
        w = (w / 2).max(1);
        h = if h == 0 { 0 } else { (h / 2).max(1) };
        d = if d == 0 { 0 } else { (d / 2).max(1) };
    }
    Ok(total)
}

pub fn array_create(size: u64) -> R<u64> {
    let c = current()?;
    let p = proc()?;
    p.charge(c.gpu, size)?;
    Ok(with_mem!(m => {
        m.next_id += 1;
        let h = m.next_id;
        m.arrays.insert(h, (c.gpu, size, ctx_key(c)));
        h
    }))
}

pub fn array_destroy(h: u64) -> R<()> {
    let p = proc()?;
    let (gpu, size, _) = with_mem!(m => m.arrays.remove(&h)).ok_or(CUresult::INVALID_HANDLE)?;
    p.uncharge(gpu, size);
    Ok(())
}

pub fn array_requirements(h: u64) -> R<(u64, u64)> {
    proc()?;
    let (_, size, _) = with_mem!(m => m.arrays.get(&h).copied()).ok_or(CUresult::INVALID_HANDLE)?;
    Ok((size, ARRAY_ALIGNMENT))
}

//! The exported C ABI of the simulated `libcuda.so.1`: thin wrappers over the modules.
//!
//! Every export goes through [`entry`]: fault injection by function name, and no panic ever crosses
//! the C boundary. Like the real driver, pointers from the caller are trusted once checked for NULL.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::driver::{self, current, proc, R};
use crate::exec::{self, Launch};
use crate::mem::{self, Dir, Kind};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::OnceLock;
use vgpu_sim::abi::*;
use vgpu_sim::MAX_GPUS;

#[inline]
fn entry(name: &'static str, f: impl FnOnce() -> R<()>) -> CUresult {
    if let Ok(p) = proc() {
        if let Some(code) = p.node.fault(name, None) {
            return CUresult(code as u32);
        }
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUresult::SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUresult::UNKNOWN,
    }
}

/// Writes `v` through an out-pointer, refusing NULL.
fn out<T>(p: *mut T, v: T) -> R<()> {
    if p.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: non-null out-pointer supplied by the caller per the CUDA contract.
    unsafe { p.write(v) };
    Ok(())
}

fn in_ref<'a, T>(p: *const T) -> R<&'a T> {
    // SAFETY: non-null input pointer supplied by the caller per the CUDA contract.
    unsafe { p.as_ref() }.ok_or(CUresult::INVALID_VALUE)
}

fn cstr<'a>(p: *const c_char) -> R<&'a str> {
    if p.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    // SAFETY: NUL-terminated string from the caller.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| CUresult::INVALID_VALUE)
}

fn write_cstring(dst: *mut c_char, len: i32, s: &str) -> R<()> {
    if dst.is_null() || len <= 0 {
        return Err(CUresult::INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: dst has room for `len` bytes per the caller's contract; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst as *mut u8, n);
        *dst.add(n) = 0;
    }
    Ok(())
}

/// `cuCtxCreate*`: a new context on `dev`, current, into `*c`.
fn new_context(c: *mut CUcontext, dev: CUdevice) -> R<()> {
    if c.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    out(c, driver::handle(driver::ctx_create(dev)?))
}

/// `CUgraphExecUpdateResult` for an update's outcome.
fn update_result(r: &R<()>) -> i32 {
    match r {
        Ok(()) => CU_GRAPH_EXEC_UPDATE_SUCCESS,
        Err(e) if *e == CUresult::GRAPH_EXEC_UPDATE_FAILURE => CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED,
        Err(_) => CU_GRAPH_EXEC_UPDATE_ERROR,
    }
}

/// `cuGraphInstantiateWithParams`: the result is reported in the parameters too.
fn instantiate_with_params(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) -> R<()> {
    let x = *in_ref(p as *const CUDA_GRAPH_INSTANTIATE_PARAMS)?;
    if e.is_null() {
        return Err(CUresult::INVALID_VALUE);
    }
    if x.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 {
        exec::stream(x.hUploadStream)?;
    }
    let r = exec::graph_instantiate(g, x.flags);
    // SAFETY: checked non-null above (the caller's parameters, written back as the driver does).
    unsafe {
        (*p).hErrNode_out = std::ptr::null_mut();
        (*p).result_out = i32::from(r.is_err());
    }
    out(e, r?)
}

fn gpu(dev: CUdevice) -> R<(usize, &'static vgpu_sim::GpuConfig)> {
    let p = proc()?;
    let g = p.gpu_of(dev)?;
    Ok((g, p.gpu_cfg(g)))
}

fn uuid_bytes(uuid: &str) -> CUuuid {
    let hex: Vec<u8> = uuid
        .trim_start_matches("GPU-")
        .trim_start_matches("MIG-")
        .bytes()
        .filter(u8::is_ascii_hexdigit)
        .map(|b| (b as char).to_digit(16).unwrap() as u8)
        .collect();
    let mut u = CUuuid::default();
    for (i, pair) in hex.chunks(2).take(16).enumerate() {
        u.bytes[i] = pair[0] << 4 | pair.get(1).copied().unwrap_or(0);
    }
    u
}

fn attribute(attr: i32, dev: CUdevice) -> R<i32> {
    let (_, g) = gpu(dev)?;
    Ok(match attr {
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
        2 | 3 => 1024,
        4 => 64,
        5 => i32::MAX,
        6 | 7 => 65535,
        8 => 49152,
        CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
        CU_DEVICE_ATTRIBUTE_CLOCK_RATE => 1_755_000,
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => g.sm_count as i32,
        CU_DEVICE_ATTRIBUTE_INTEGRATED => 0,
        CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS => g.managed_paging as i32,
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID => g.pci_bus as i32,
        CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID => g.pci_device as i32,
        CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID => g.pci_domain as i32,
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR => g.model.max_threads_per_sm as i32,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => g.model.cc.0 as i32,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => g.model.cc.1 as i32,
        CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING
        | CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY
        | CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
        | CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        | CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => 1,
        a if (1..CU_DEVICE_ATTRIBUTE_MAX).contains(&a) => 0,
        _ => return Err(CUresult::INVALID_VALUE),
    })
}

fn error_cstrs(e: CUresult) -> Option<&'static (CString, CString)> {
    static T: OnceLock<Vec<(u32, (CString, CString))>> = OnceLock::new();
    let t = T.get_or_init(|| {
        (0..1000u32)
            .filter_map(|c| {
                CUresult(c).describe().map(|(n, d)| (c, (CString::new(n).unwrap(), CString::new(d).unwrap())))
            })
            .collect()
    });
    t.iter().find(|(c, _)| *c == e.0).map(|(_, s)| s)
}

/// Current memory pool per GPU (0: the default pool).
static CURRENT_POOL: [AtomicU64; MAX_GPUS] = [const { AtomicU64::new(0) }; MAX_GPUS];

/// The context of `s` and the pool `cuMemAllocAsync` on it draws from: the current pool of the
/// stream's device, which need not be the current context's.
fn stream_pool(s: CUstream) -> R<(&'static driver::Ctx, u64)> {
    let (c, _) = exec::stream(s)?;
    match CURRENT_POOL[c.gpu].load(Acquire) {
        0 => Ok((c, mem::default_pool(c.ordinal)?)),
        p => Ok((c, p)),
    }
}

fn launch_args(f: CUfunction, g: [u32; 3], b: [u32; 3], params: *mut *mut c_void, coop: bool) -> Launch {
    Launch { f, grid: g, block: b, params, cooperative: coop }
}

/// The pool `cuMemAllocAsync` on device `dev` draws from.
fn current_pool(dev: CUdevice) -> R<u64> {
    let (g, _) = gpu(dev)?;
    match CURRENT_POOL[g].load(Acquire) {
        0 => mem::default_pool(dev),
        p => Ok(p),
    }
}

/// Makes `pool` the current pool of device `dev`, which must be where its memory is.
fn set_current_pool(dev: CUdevice, pool: CUmemoryPool) -> R<()> {
    let (g, _) = gpu(dev)?;
    if mem::pool_place(pool as u64)? != (g, false) {
        return Err(CUresult::INVALID_VALUE);
    }
    CURRENT_POOL[g].store(pool as u64, Release);
    Ok(())
}

/// The device of a location and allocation type given to the pool calls of CUDA 13.0: pinned memory
/// of a device; host locations and managed pools are not simulated.
fn pinned_device(l: &CUmemLocation, kind: i32) -> R<CUdevice> {
    match (l.type_, kind) {
        (CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ALLOCATION_TYPE_PINNED) => Ok(l.id),
        (CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA, CU_MEM_ALLOCATION_TYPE_PINNED)
        | (_, CU_MEM_ALLOCATION_TYPE_MANAGED) => Err(CUresult::NOT_SUPPORTED),
        _ => Err(CUresult::INVALID_VALUE),
    }
}

fn loc_device(l: &CUmemLocation) -> R<()> {
    if l.type_ == CU_MEM_LOCATION_TYPE_DEVICE {
        proc()?.gpu_of(l.id).map(|_| ())
    } else {
        Ok(())
    }
}

macro_rules! exports {
    ($( fn $name:ident ( $($a:ident : $t:ty),* $(,)? ) $body:block )*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
                entry(stringify!($name), move || -> R<()> { $body })
            }
        )*
        /// The exported entry point called `name`.
        pub fn symbol(name: &str) -> Option<*mut c_void> {
            match name {
                $( stringify!($name) => Some($name as *mut c_void), )*
                _ => None,
            }
        }
    };
}

exports! {
    // ----- init, versions, errors -----
    fn cuInit(flags: u32) { match driver::init(flags) { CUresult::SUCCESS => Ok(()), e => Err(e) } }
    fn cuDriverGetVersion(v: *mut i32) {
        let cfg = vgpu_sim::Node::global().map(|n| n.cfg.cuda_version).unwrap_or(12040);
        out(v, cfg)
    }
    fn cuGetErrorString(e: CUresult, s: *mut *const c_char) {
        match error_cstrs(e) {
            Some((_, d)) => out(s, d.as_ptr()),
            None => { out(s, std::ptr::null())?; Err(CUresult::INVALID_VALUE) }
        }
    }
    fn cuGetErrorName(e: CUresult, s: *mut *const c_char) {
        match error_cstrs(e) {
            Some((n, _)) => out(s, n.as_ptr()),
            None => { out(s, std::ptr::null())?; Err(CUresult::INVALID_VALUE) }
        }
    }
    fn cuGetProcAddress(sym: *const c_char, pfn: *mut *mut c_void, ver: i32, flags: u64) {
        crate::procaddr::get(cstr(sym)?, pfn, ver, flags).0
    }
    fn cuGetProcAddress_v2(sym: *const c_char, pfn: *mut *mut c_void, ver: i32, flags: u64, status: *mut i32) {
        let (r, st) = crate::procaddr::get(cstr(sym)?, pfn, ver, flags);
        if !status.is_null() { out(status, st)?; }
        r
    }

    // ----- devices -----
    fn cuDeviceGetCount(n: *mut i32) { out(n, proc()?.visible.len() as i32) }
    fn cuDeviceGet(d: *mut CUdevice, ordinal: i32) { proc()?.gpu_of(ordinal)?; out(d, ordinal) }
    fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) { write_cstring(name, len, gpu(dev)?.1.model.name) }
    fn cuDeviceGetUuid(u: *mut CUuuid, dev: CUdevice) { out(u, uuid_bytes(&gpu(dev)?.1.uuid)) }
    fn cuDeviceGetUuid_v2(u: *mut CUuuid, dev: CUdevice) { out(u, uuid_bytes(&gpu(dev)?.1.uuid)) }
    fn cuDeviceTotalMem(b: *mut u32, dev: CUdevice) { out(b, gpu(dev)?.1.memory_bytes.min(u32::MAX as u64) as u32) }
    fn cuDeviceTotalMem_v2(b: *mut usize, dev: CUdevice) { out(b, gpu(dev)?.1.memory_bytes as usize) }
    fn cuDeviceGetAttribute(v: *mut i32, attr: i32, dev: CUdevice) { out(v, attribute(attr, dev)?) }
    fn cuDeviceGetPCIBusId(s: *mut c_char, len: i32, dev: CUdevice) { write_cstring(s, len, &gpu(dev)?.1.pci_bus_id) }
    fn cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) {
        let cc = gpu(dev)?.1.model.cc;
        out(major, cc.0 as i32)?;
        out(minor, cc.1 as i32)
    }
    fn cuDevicePrimaryCtxRetain(c: *mut CUcontext, dev: CUdevice) {
        if c.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(c, driver::handle(driver::primary_retain(dev)?))
    }
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) { driver::primary_release(dev) }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) { driver::primary_release(dev) }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) { driver::primary_reset(dev) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) { driver::primary_reset(dev) }
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut u32, active: *mut i32) {
        let (f, a) = driver::primary_state(dev)?;
        out(flags, f)?;
        out(active, a as i32)
    }
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, _flags: u32) { gpu(dev).map(|_| ()) }
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, _flags: u32) { gpu(dev).map(|_| ()) }

    // ----- contexts -----
    fn cuCtxCreate(c: *mut CUcontext, _flags: u32, dev: CUdevice) { new_context(c, dev) }
    fn cuCtxCreate_v2(c: *mut CUcontext, _flags: u32, dev: CUdevice) { new_context(c, dev) }
    // Execution affinity (v3) and create parameters (v4, what `cuCtxCreate` means from CUDA 13): not
    // simulated, a context like v2's.
    fn cuCtxCreate_v3(c: *mut CUcontext, _params: *mut c_void, _n: i32, _flags: u32, dev: CUdevice) { new_context(c, dev) }
    fn cuCtxCreate_v4(c: *mut CUcontext, _params: *mut c_void, _flags: u32, dev: CUdevice) { new_context(c, dev) }
    fn cuCtxDestroy(c: CUcontext) { driver::ctx_destroy(driver::ctx_from(c)?) }
    fn cuCtxDestroy_v2(c: CUcontext) { driver::ctx_destroy(driver::ctx_from(c)?) }
    fn cuCtxPushCurrent(c: CUcontext) { proc()?; driver::push(driver::ctx_from(c)?) }
    fn cuCtxPushCurrent_v2(c: CUcontext) { proc()?; driver::push(driver::ctx_from(c)?) }
    fn cuCtxPopCurrent(c: *mut CUcontext) {
        let x = driver::pop()?;
        if !c.is_null() { out(c, driver::handle(x))?; }
        Ok(())
    }
    fn cuCtxPopCurrent_v2(c: *mut CUcontext) {
        let x = driver::pop()?;
        if !c.is_null() { out(c, driver::handle(x))?; }
        Ok(())
    }
    fn cuCtxSetCurrent(c: CUcontext) {
        driver::set_current(if c.is_null() { None } else { Some(driver::ctx_from(c)?) })
    }
    fn cuCtxGetCurrent(c: *mut CUcontext) {
        out(c, driver::get_current()?.map_or(std::ptr::null_mut(), driver::handle))
    }
    fn cuCtxGetDevice(d: *mut CUdevice) { out(d, current()?.ordinal) }
    fn cuCtxSynchronize() { exec::ctx_sync() }
    // CUDA 13.0: a context named (NULL: the current one).
    fn cuCtxSynchronize_v2(c: CUcontext) {
        if c.is_null() { exec::ctx_sync() } else { exec::ctx_sync_of(driver::ctx_from(c)?) }
    }
    fn cuCtxGetLimit(v: *mut usize, limit: i32) { out(v, driver::get_limit(current()?, limit)? as usize) }
    fn cuCtxSetLimit(limit: i32, value: usize) { driver::set_limit(current()?, limit, value as u64) }

    // ----- linear memory -----
    fn cuMemAlloc(_d: *mut u32, _size: u32) { Err(CUresult::NOT_SUPPORTED) }
    fn cuMemAllocPitch(_d: *mut u32, _pitch: *mut u32, _w: u32, _h: u32, _elem: u32) { Err(CUresult::NOT_SUPPORTED) }
    fn cuMemAlloc_v2(d: *mut CUdeviceptr, size: usize) {
        if d.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(d, mem::alloc(size as u64, Kind::Device)?)
    }
    fn cuMemAllocPitch_v2(d: *mut CUdeviceptr, pitch: *mut usize, w: usize, h: usize, elem: u32) {
        if d.is_null() || pitch.is_null() { return Err(CUresult::INVALID_VALUE); }
        let (p, pi) = mem::alloc_pitch(w, h, elem)?;
        out(pitch, pi)?;
        out(d, p)
    }
    fn cuMemAllocManaged(d: *mut CUdeviceptr, size: usize, flags: u32) {
        if d.is_null() || !matches!(flags, 1 | 2) { return Err(CUresult::INVALID_VALUE); }
        out(d, mem::alloc(size as u64, Kind::Managed)?)
    }
    fn cuMemFree(_d: u32) { Err(CUresult::NOT_SUPPORTED) }
    fn cuMemFree_v2(d: CUdeviceptr) { mem::free(d) }
    fn cuMemGetInfo(free: *mut u32, total: *mut u32) {
        let (f, t) = mem::get_info()?;
        out(free, f.min(u32::MAX as u64) as u32)?;
        out(total, t.min(u32::MAX as u64) as u32)
    }
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (f, t) = mem::get_info()?;
        out(free, f as usize)?;
        out(total, t as usize)
    }
    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, d: CUdeviceptr) {
        let (b, s) = mem::address_range(d)?;
        if !base.is_null() { out(base, b)?; }
        if !size.is_null() { out(size, s as usize)?; }
        Ok(())
    }
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) {
        if pp.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(pp, mem::alloc_host(size)?)
    }
    fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, _flags: u32) {
        if pp.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(pp, mem::alloc_host(size)?)
    }
    fn cuMemFreeHost(p: *mut c_void) { mem::free_host(p) }
    fn cuMemAdvise(d: CUdeviceptr, n: usize, _advice: i32, _dev: CUdevice) {
        current()?;
        mem::address_range(d).map_err(|_| CUresult::INVALID_VALUE)?;
        let _ = n;
        Ok(())
    }
    fn cuMemAdvise_v2(d: CUdeviceptr, _n: usize, _advice: i32, loc: CUmemLocation) {
        loc_device(&loc)?;
        mem::address_range(d).map_err(|_| CUresult::INVALID_VALUE)?;
        Ok(())
    }
    fn cuMemPrefetchAsync(d: CUdeviceptr, _n: usize, _dev: CUdevice, s: CUstream) {
        exec::stream(s)?;
        mem::address_range(d).map(|_| ()).map_err(|_| CUresult::INVALID_VALUE)
    }
    fn cuMemPrefetchAsync_ptsz(d: CUdeviceptr, _n: usize, _dev: CUdevice, s: CUstream) {
        exec::stream(s)?;
        mem::address_range(d).map(|_| ()).map_err(|_| CUresult::INVALID_VALUE)
    }
    fn cuMemPrefetchAsync_v2(d: CUdeviceptr, _n: usize, loc: CUmemLocation, _flags: u32, s: CUstream) {
        loc_device(&loc)?;
        exec::stream(s)?;
        mem::address_range(d).map(|_| ()).map_err(|_| CUresult::INVALID_VALUE)
    }
    fn cuMemPrefetchAsync_v2_ptsz(d: CUdeviceptr, _n: usize, loc: CUmemLocation, _flags: u32, s: CUstream) {
        loc_device(&loc)?;
        exec::stream(s)?;
        mem::address_range(d).map(|_| ()).map_err(|_| CUresult::INVALID_VALUE)
    }

    // ----- copies and sets -----
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) { mem::copy(dst, src as u64, n, Dir::HtoD) }
    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) { mem::copy(dst, src as u64, n, Dir::HtoD) }
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) { mem::copy(dst as u64, src, n, Dir::DtoH) }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) { mem::copy(dst as u64, src, n, Dir::DtoH) }
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { mem::copy(dst, src, n, Dir::DtoD) }
    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { mem::copy(dst, src, n, Dir::DtoD) }
    fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { mem::copy_unified(dst, src, n) }
    fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { mem::copy_unified(dst, src, n) }
    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { exec::stream(s)?; mem::copy(dst, src as u64, n, Dir::HtoD) }
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { exec::stream(s)?; mem::copy(dst, src as u64, n, Dir::HtoD) }
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s)?; mem::copy(dst as u64, src, n, Dir::DtoH) }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s)?; mem::copy(dst as u64, src, n, Dir::DtoH) }
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s)?; mem::copy_unified(dst, src, n) }
    fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s)?; mem::copy_unified(dst, src, n) }
    fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) { mem::memset(dst, v as u32, 1, n) }
    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) { mem::memset(dst, v as u32, 1, n) }
    fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) { mem::memset(dst, v as u32, 2, n) }
    fn cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) { mem::memset(dst, v, 4, n) }
    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: u32, n: usize) { mem::memset(dst, v, 4, n) }
    fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { exec::stream(s)?; mem::memset(dst, v as u32, 1, n) }
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { exec::stream(s)?; mem::memset(dst, v as u32, 1, n) }
    fn cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { exec::stream(s)?; mem::memset(dst, v, 4, n) }
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { exec::stream(s)?; mem::memset(dst, v, 4, n) }

    // ----- virtual memory management -----
    fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _option: i32) {
        out(g, mem::granularity(in_ref(prop)?)? as usize)
    }
    fn cuMemCreate(h: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) {
        if h.is_null() || flags != 0 { return Err(CUresult::INVALID_VALUE); }
        out(h, mem::create(size as u64, in_ref(prop)?)?)
    }
    fn cuMemRelease(h: CUmemGenericAllocationHandle) { mem::release(h) }
    fn cuMemAddressReserve(p: *mut CUdeviceptr, size: usize, align: usize, _addr: CUdeviceptr, _flags: u64) {
        if p.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(p, mem::address_reserve(size as u64, align as u64)?)
    }
    fn cuMemAddressFree(p: CUdeviceptr, size: usize) { mem::address_free(p, size as u64) }
    fn cuMemMap(p: CUdeviceptr, size: usize, offset: usize, h: CUmemGenericAllocationHandle, flags: u64) {
        if flags != 0 { return Err(CUresult::INVALID_VALUE); }
        mem::map(p, size as u64, offset as u64, h)
    }
    fn cuMemUnmap(p: CUdeviceptr, size: usize) { mem::unmap_range(p, size as u64) }
    fn cuMemRetainAllocationHandle(h: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        if h.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(h, mem::retain(addr as u64)?)
    }
    fn cuMemSetAccess(p: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        if desc.is_null() || count == 0 { return Err(CUresult::INVALID_VALUE); }
        // SAFETY: the caller passes `count` descriptors.
        let d = unsafe { std::slice::from_raw_parts(desc, count) };
        mem::set_access(p, size as u64, d)
    }

    // ----- stream-ordered allocator -----
    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) { out(pool, mem::default_pool(dev)? as CUmemoryPool) }
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) { out(pool, current_pool(dev)? as CUmemoryPool) }
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) { set_current_pool(dev, pool) }
    // The forms of CUDA 13.0 that name a location and an allocation type: for a device's pinned
    // memory they are the ones above; the simulator has no current pools of other kinds.
    fn cuMemGetDefaultMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: i32) {
        out(pool, mem::default_pool(pinned_device(in_ref(loc)?, kind)?)? as CUmemoryPool)
    }
    fn cuMemGetMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: i32) {
        out(pool, current_pool(pinned_device(in_ref(loc)?, kind)?)? as CUmemoryPool)
    }
    fn cuMemSetMemPool(loc: *mut CUmemLocation, kind: i32, pool: CUmemoryPool) {
        set_current_pool(pinned_device(in_ref(loc)?, kind)?, pool)
    }
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        if pool.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(pool, mem::pool_create(in_ref(props)?)? as CUmemoryPool)
    }
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        mem::pool_destroy(pool as u64)?;
        // Destroying a device's current pool makes the device's default pool current again.
        for c in &CURRENT_POOL {
            let _ = c.compare_exchange(pool as u64, 0, AcqRel, Acquire);
        }
        Ok(())
    }
    fn cuMemAllocAsync(d: *mut CUdeviceptr, size: usize, s: CUstream) {
        if d.is_null() { return Err(CUresult::INVALID_VALUE); }
        if let Some(p) = exec::capture_alloc(s, size as u64)? { return out(d, p); }
        let (c, pool) = stream_pool(s)?;
        out(d, mem::pool_alloc(c, Some(pool), size as u64)?)
    }
    fn cuMemAllocAsync_ptsz(d: *mut CUdeviceptr, size: usize, s: CUstream) {
        if d.is_null() { return Err(CUresult::INVALID_VALUE); }
        if let Some(p) = exec::capture_alloc(s, size as u64)? { return out(d, p); }
        let (c, pool) = stream_pool(s)?;
        out(d, mem::pool_alloc(c, Some(pool), size as u64)?)
    }
    fn cuMemAllocFromPoolAsync(d: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        if d.is_null() { return Err(CUresult::INVALID_VALUE); }
        if let Some(p) = exec::capture_alloc(s, size as u64)? { return out(d, p); }
        out(d, mem::pool_alloc(exec::stream(s)?.0, Some(pool as u64), size as u64)?)
    }
    fn cuMemAllocFromPoolAsync_ptsz(d: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        if d.is_null() { return Err(CUresult::INVALID_VALUE); }
        if let Some(p) = exec::capture_alloc(s, size as u64)? { return out(d, p); }
        out(d, mem::pool_alloc(exec::stream(s)?.0, Some(pool as u64), size as u64)?)
    }
    fn cuMemFreeAsync(d: CUdeviceptr, s: CUstream) { if exec::capture_free(s, d)? { return Ok(()); } mem::free_async(d) }
    fn cuMemFreeAsync_ptsz(d: CUdeviceptr, s: CUstream) { if exec::capture_free(s, d)? { return Ok(()); } mem::free_async(d) }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) { mem::pool_trim(pool as u64, keep as u64) }
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: i32, v: *mut c_void) {
        if v.is_null() { return Err(CUresult::INVALID_VALUE); }
        // SAFETY: reuse attributes are ints, the others cuuint64_t, per cuda.h.
        let val = unsafe { if (1..=3).contains(&attr) { *(v as *const i32) as u64 } else { *(v as *const u64) } };
        mem::pool_attr(pool as u64, attr, Some(val)).map(|_| ())
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: i32, v: *mut c_void) {
        let val = mem::pool_attr(pool as u64, attr, None)?;
        if (1..=3).contains(&attr) { out(v as *mut i32, val as i32) } else { out(v as *mut u64, val) }
    }

    // ----- arrays -----
    fn cuArrayCreate_v2(a: *mut CUarray, d: *const CUDA_ARRAY_DESCRIPTOR) {
        if a.is_null() { return Err(CUresult::INVALID_VALUE); }
        let d = in_ref(d)?;
        let size = mem::array_size(d.Width, d.Height, 0, d.Format, d.NumChannels)?;
        out(a, mem::array_create(size)? as CUarray)
    }
    fn cuArray3DCreate_v2(a: *mut CUarray, d: *const CUDA_ARRAY3D_DESCRIPTOR) {
        if a.is_null() { return Err(CUresult::INVALID_VALUE); }
        let d = in_ref(d)?;
        let size = mem::array_size(d.Width, d.Height, d.Depth, d.Format, d.NumChannels)?;
        out(a, mem::array_create(size)? as CUarray)
    }
    // The original entry points: 32-bit extents, arrays all the same.
    fn cuArrayCreate(a: *mut CUarray, d: *const CUDA_ARRAY_DESCRIPTOR_v1) {
        if a.is_null() { return Err(CUresult::INVALID_VALUE); }
        let d = in_ref(d)?;
        let size = mem::array_size(d.Width as usize, d.Height as usize, 0, d.Format, d.NumChannels)?;
        out(a, mem::array_create(size)? as CUarray)
    }
    fn cuArray3DCreate(a: *mut CUarray, d: *const CUDA_ARRAY3D_DESCRIPTOR_v1) {
        if a.is_null() { return Err(CUresult::INVALID_VALUE); }
        let d = in_ref(d)?;
        let size = mem::array_size(d.Width as usize, d.Height as usize, d.Depth as usize, d.Format, d.NumChannels)?;
        out(a, mem::array_create(size)? as CUarray)
    }
    fn cuArrayDestroy(a: CUarray) { mem::array_destroy(a as u64) }
    fn cuArrayGetMemoryRequirements(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUarray, dev: CUdevice) {
        gpu(dev)?;
        let (size, align) = mem::array_requirements(a as u64)?;
        out(r, CUDA_ARRAY_MEMORY_REQUIREMENTS { size: size as usize, alignment: align as usize, reserved: [0; 4] })
    }
    fn cuMipmappedArrayCreate(a: *mut CUmipmappedArray, d: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32) {
        if a.is_null() { return Err(CUresult::INVALID_VALUE); }
        let size = mem::mipmapped_size(in_ref(d)?, levels)?;
        out(a, mem::array_create(size)? as CUmipmappedArray)
    }
    fn cuMipmappedArrayDestroy(a: CUmipmappedArray) { mem::array_destroy(a as u64) }
    fn cuMipmappedArrayGetMemoryRequirements(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUmipmappedArray, dev: CUdevice) {
        gpu(dev)?;
        let (size, align) = mem::array_requirements(a as u64)?;
        out(r, CUDA_ARRAY_MEMORY_REQUIREMENTS { size: size as usize, alignment: align as usize, reserved: [0; 4] })
    }

    // ----- modules -----
    fn cuModuleLoad(m: *mut CUmodule, fname: *const c_char) {
        if m.is_null() { return Err(CUresult::INVALID_VALUE); }
        if !std::path::Path::new(cstr(fname)?).is_file() { return Err(CUresult::FILE_NOT_FOUND); }
        out(m, exec::module_load()?)
    }
    fn cuModuleLoadData(m: *mut CUmodule, image: *const c_void) {
        if m.is_null() || image.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(m, exec::module_load()?)
    }
    fn cuModuleLoadDataEx(m: *mut CUmodule, image: *const c_void, _n: u32, _o: *mut i32, _v: *mut *mut c_void) {
        if m.is_null() || image.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(m, exec::module_load()?)
    }
    fn cuModuleLoadFatBinary(m: *mut CUmodule, image: *const c_void) {
        if m.is_null() || image.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(m, exec::module_load()?)
    }
    fn cuModuleUnload(m: CUmodule) { exec::module_unload(m) }
    fn cuModuleGetFunction(f: *mut CUfunction, m: CUmodule, name: *const c_char) {
        if f.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(f, exec::module_get_function(m, cstr(name)?)?)
    }
    // Libraries (CUDA 12): simulated as a module loaded in the current context, whose kernels are
    // its functions (a real library is loaded into each context as it is used).
    fn cuLibraryLoadData(l: *mut CUlibrary, code: *const c_void, _jo: *mut i32, _jv: *mut *mut c_void, _njo: u32, _lo: *mut i32, _lv: *mut *mut c_void, _nlo: u32) {
        if l.is_null() || code.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(l, exec::module_load()?)
    }
    fn cuLibraryUnload(l: CUlibrary) { exec::module_unload(l) }
    fn cuLibraryGetKernel(k: *mut CUkernel, l: CUlibrary, name: *const c_char) {
        if k.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(k, exec::module_get_function(l, cstr(name)?)?)
    }
    fn cuKernelGetFunction(f: *mut CUfunction, k: CUkernel) { out(f, exec::kernel_function(k)?) }
    fn cuFuncGetAttribute(v: *mut i32, attr: i32, f: CUfunction) {
        if f.is_null() { return Err(CUresult::INVALID_HANDLE); }
        out(v, if attr == 0 { 1024 } else { 0 })
    }

    // ----- streams -----
    fn cuStreamCreate(s: *mut CUstream, _flags: u32) { if s.is_null() { return Err(CUresult::INVALID_VALUE); } out(s, exec::stream_create()?) }
    fn cuStreamCreateWithPriority(s: *mut CUstream, _flags: u32, _prio: i32) { if s.is_null() { return Err(CUresult::INVALID_VALUE); } out(s, exec::stream_create()?) }
    fn cuStreamDestroy(s: CUstream) { exec::stream_destroy(s) }
    fn cuStreamDestroy_v2(s: CUstream) { exec::stream_destroy(s) }
    fn cuStreamSynchronize(s: CUstream) { exec::stream_sync(s) }
    fn cuStreamSynchronize_ptsz(s: CUstream) { exec::stream_sync(s) }
    fn cuStreamQuery(s: CUstream) { exec::stream_query(s) }
    fn cuStreamQuery_ptsz(s: CUstream) { exec::stream_query(s) }
    fn cuStreamBeginCapture(s: CUstream) { exec::begin_capture(s) }
    fn cuStreamBeginCapture_ptsz(s: CUstream) { exec::begin_capture(s) }
    fn cuStreamBeginCapture_v2(s: CUstream, _mode: i32) { exec::begin_capture(s) }
    fn cuStreamBeginCapture_v2_ptsz(s: CUstream, _mode: i32) { exec::begin_capture(s) }
    fn cuStreamEndCapture(s: CUstream, g: *mut CUgraph) { if g.is_null() { return Err(CUresult::INVALID_VALUE); } out(g, exec::end_capture(s)?) }
    fn cuStreamEndCapture_ptsz(s: CUstream, g: *mut CUgraph) { if g.is_null() { return Err(CUresult::INVALID_VALUE); } out(g, exec::end_capture(s)?) }
    fn cuStreamGetCtx(s: CUstream, c: *mut CUcontext) { out(c, driver::handle(exec::stream(s)?.0)) }
    fn cuStreamGetCtx_ptsz(s: CUstream, c: *mut CUcontext) { out(c, driver::handle(exec::stream(s)?.0)) }
    // CUDA 12.5: also the stream's green context (the simulator has none).
    fn cuStreamGetCtx_v2(s: CUstream, c: *mut CUcontext, g: *mut *mut c_void) {
        if c.is_null() || g.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(c, driver::handle(exec::stream(s)?.0))?;
        out(g, std::ptr::null_mut())
    }
    fn cuStreamGetCtx_v2_ptsz(s: CUstream, c: *mut CUcontext, g: *mut *mut c_void) {
        if c.is_null() || g.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(c, driver::handle(exec::stream(s)?.0))?;
        out(g, std::ptr::null_mut())
    }
    fn cuStreamIsCapturing(s: CUstream, st: *mut i32) {
        out(st, if exec::is_capturing(s)? { CU_STREAM_CAPTURE_STATUS_ACTIVE } else { CU_STREAM_CAPTURE_STATUS_NONE })
    }
    fn cuStreamIsCapturing_ptsz(s: CUstream, st: *mut i32) {
        out(st, if exec::is_capturing(s)? { CU_STREAM_CAPTURE_STATUS_ACTIVE } else { CU_STREAM_CAPTURE_STATUS_NONE })
    }

    // ----- events -----
    fn cuEventCreate(e: *mut CUevent, _flags: u32) { if e.is_null() { return Err(CUresult::INVALID_VALUE); } out(e, exec::event_create()?) }
    fn cuEventRecord(e: CUevent, s: CUstream) { exec::event_record(e, s) }
    fn cuEventRecord_ptsz(e: CUevent, s: CUstream) { exec::event_record(e, s) }
    fn cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: u32) { exec::event_record(e, s) }
    fn cuEventRecordWithFlags_ptsz(e: CUevent, s: CUstream, _flags: u32) { exec::event_record(e, s) }
    fn cuEventQuery(e: CUevent) { exec::event_query(e) }
    fn cuEventSynchronize(e: CUevent) { exec::event_sync(e) }
    fn cuEventElapsedTime(ms: *mut f32, a: CUevent, b: CUevent) { if ms.is_null() { return Err(CUresult::INVALID_VALUE); } out(ms, exec::event_elapsed(a, b)?) }
    fn cuEventDestroy(e: CUevent) { exec::event_destroy(e) }
    fn cuEventDestroy_v2(e: CUevent) { exec::event_destroy(e) }

    // ----- launches -----
    fn cuLaunchKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shm: u32, s: CUstream, p: *mut *mut c_void, _extra: *mut *mut c_void) {
        exec::launch(&launch_args(f, [gx, gy, gz], [bx, by, bz], p, false), s)
    }
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shm: u32, s: CUstream, p: *mut *mut c_void, _extra: *mut *mut c_void) {
        exec::launch(&launch_args(f, [gx, gy, gz], [bx, by, bz], p, false), s)
    }
    fn cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, p: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = in_ref(cfg)?;
        exec::launch(&launch_args(f, [c.gridDimX, c.gridDimY, c.gridDimZ], [c.blockDimX, c.blockDimY, c.blockDimZ], p, false), c.hStream)
    }
    fn cuLaunchKernelEx_ptsz(cfg: *const CUlaunchConfig, f: CUfunction, p: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = in_ref(cfg)?;
        exec::launch(&launch_args(f, [c.gridDimX, c.gridDimY, c.gridDimZ], [c.blockDimX, c.blockDimY, c.blockDimZ], p, false), c.hStream)
    }
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shm: u32, s: CUstream, p: *mut *mut c_void) {
        exec::launch(&launch_args(f, [gx, gy, gz], [bx, by, bz], p, true), s)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, _shm: u32, s: CUstream, p: *mut *mut c_void) {
        exec::launch(&launch_args(f, [gx, gy, gz], [bx, by, bz], p, true), s)
    }
    // The deprecated launch API: block shape and parameters set on the function beforehand.
    fn cuFuncSetBlockShape(f: CUfunction, x: i32, y: i32, z: i32) { exec::func_set_block_shape(f, x, y, z) }
    fn cuFuncSetSharedSize(f: CUfunction, _bytes: u32) { exec::func_check(f) }
    fn cuParamSetSize(f: CUfunction, n: u32) { exec::param_set_size(f, n) }
    fn cuParamSeti(f: CUfunction, offset: i32, v: u32) { exec::param_set(f, offset, &v.to_ne_bytes()) }
    fn cuParamSetv(f: CUfunction, offset: i32, p: *mut c_void, n: u32) {
        if p.is_null() && n > 0 { return Err(CUresult::INVALID_VALUE); }
        // SAFETY: the caller passes `n` readable bytes at `p`.
        let b = if n == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) } };
        exec::param_set(f, offset, b)
    }
    fn cuLaunch(f: CUfunction) { exec::launch_legacy(f, [1, 1], std::ptr::null_mut()) }
    fn cuLaunchGrid(f: CUfunction, w: i32, h: i32) { exec::launch_legacy(f, [w, h], std::ptr::null_mut()) }
    fn cuLaunchGridAsync(f: CUfunction, w: i32, h: i32, s: CUstream) { exec::launch_legacy(f, [w, h], s) }
    fn cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: u32, _flags: u32) {
        if list.is_null() || n == 0 { return Err(CUresult::INVALID_VALUE); }
        // SAFETY: the caller passes `n` launch descriptions.
        let l = unsafe { std::slice::from_raw_parts(list, n as usize) };
        for x in l {
            exec::launch(&launch_args(x.function, [x.gridDimX, x.gridDimY, x.gridDimZ], [x.blockDimX, x.blockDimY, x.blockDimZ], x.kernelParams, true), x.hStream)?;
        }
        Ok(())
    }

    // ----- graphs -----
    fn cuGraphCreate(g: *mut CUgraph, _flags: u32) { if g.is_null() { return Err(CUresult::INVALID_VALUE); } out(g, exec::graph_create()?) }
    fn cuGraphDestroy(g: CUgraph) { exec::graph_destroy(g) }
    fn cuGraphAddKernelNode(n: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _nd: usize, p: *const CUDA_KERNEL_NODE_PARAMS) {
        let x = in_ref(p)?;
        if n.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(n, exec::graph_add_kernel(g, &launch_args(x.func, [x.gridDimX, x.gridDimY, x.gridDimZ], [x.blockDimX, x.blockDimY, x.blockDimZ], x.kernelParams, false))?)
    }
    fn cuGraphAddKernelNode_v2(n: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _nd: usize, p: *const CUDA_KERNEL_NODE_PARAMS_v2) {
        let x = in_ref(p)?;
        if n.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(n, exec::graph_add_kernel(g, &launch_args(x.func, [x.gridDimX, x.gridDimY, x.gridDimZ], [x.blockDimX, x.blockDimY, x.blockDimZ], x.kernelParams, false))?)
    }
    // With `nodes`, as many handles as `count` says (NULL past the graph's), and `count` set to the
    // graph's number of nodes.
    fn cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) {
        let all = exec::graph_nodes(g)?;
        if !nodes.is_null() {
            let room = *in_ref(count)?;
            for i in 0..room {
                // SAFETY: the caller's array holds `room` handles.
                unsafe { nodes.add(i).write(all.get(i).copied().unwrap_or(std::ptr::null_mut())) };
            }
        }
        out(count, all.len())
    }
    fn cuGraphNodeGetType(n: CUgraphNode, ty: *mut i32) { out(ty, exec::node_type(n)?) }
    fn cuGraphAddMemAllocNode(n: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _nd: usize, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        let x = in_ref(p as *const CUDA_MEM_ALLOC_NODE_PARAMS)?;
        if n.is_null() || x.poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED || x.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUresult::INVALID_VALUE);
        }
        let (node, ptr) = exec::graph_add_alloc(g, x.bytesize as u64, x.poolProps.location.id)?;
        // SAFETY: checked non-null above; the driver writes the allocation's address back.
        unsafe { (*p).dptr = ptr };
        out(n, node)
    }
    fn cuGraphAddMemFreeNode(n: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _nd: usize, d: CUdeviceptr) {
        if n.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(n, exec::graph_add_free(g, d)?)
    }
    fn cuGraphMemAllocNodeGetParams(n: CUgraphNode, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        let a = exec::alloc_node(n)?;
        out(p, CUDA_MEM_ALLOC_NODE_PARAMS {
            poolProps: CUmemPoolProps::device(a.ordinal),
            accessDescs: std::ptr::null(),
            accessDescCount: 0,
            bytesize: a.size as usize,
            dptr: a.ptr,
        })
    }
    fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: i32, v: *mut c_void) {
        let (g, _) = gpu(dev)?;
        out(v as *mut u64, mem::graph_attr(g, attr, None)?)
    }
    fn cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: i32, v: *mut c_void) {
        let (g, _) = gpu(dev)?;
        let x = *in_ref(v as *const u64)?;
        mem::graph_attr(g, attr, Some(x)).map(|_| ())
    }
    fn cuDeviceGraphMemTrim(dev: CUdevice) { let (g, _) = gpu(dev)?; mem::graph_trim(g) }
    fn cuGraphInstantiate(e: *mut CUgraphExec, g: CUgraph, _en: *mut CUgraphNode, _log: *mut c_char, _sz: usize) {
        if e.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(e, exec::graph_instantiate(g, 0)?)
    }
    fn cuGraphInstantiate_v2(e: *mut CUgraphExec, g: CUgraph, _en: *mut CUgraphNode, _log: *mut c_char, _sz: usize) {
        if e.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(e, exec::graph_instantiate(g, 0)?)
    }
    fn cuGraphInstantiateWithFlags(e: *mut CUgraphExec, g: CUgraph, flags: u64) {
        if e.is_null() || flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 { return Err(CUresult::INVALID_VALUE); }
        out(e, exec::graph_instantiate(g, flags)?)
    }
    fn cuGraphInstantiateWithParams(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) {
        instantiate_with_params(e, g, p)
    }
    fn cuGraphInstantiateWithParams_ptsz(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) {
        instantiate_with_params(e, g, p)
    }
    fn cuGraphUpload(e: CUgraphExec, s: CUstream) { exec::graph_upload(e, s) }
    fn cuGraphUpload_ptsz(e: CUgraphExec, s: CUstream) { exec::graph_upload(e, s) }
    fn cuGraphLaunch(e: CUgraphExec, s: CUstream) { exec::graph_launch(e, s) }
    fn cuGraphLaunch_ptsz(e: CUgraphExec, s: CUstream) { exec::graph_launch(e, s) }
    fn cuGraphExecDestroy(e: CUgraphExec) { exec::graph_exec_destroy(e) }
    fn cuGraphExecUpdate(e: CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, result: *mut i32) {
        let r = exec::graph_exec_update(e, g);
        if !err_node.is_null() { out(err_node, std::ptr::null_mut())?; }
        if !result.is_null() { out(result, update_result(&r))?; }
        r
    }
    fn cuGraphExecUpdate_v2(e: CUgraphExec, g: CUgraph, info: *mut CUgraphExecUpdateResultInfo) {
        let r = exec::graph_exec_update(e, g);
        if !info.is_null() {
            out(info, CUgraphExecUpdateResultInfo { result: update_result(&r), errorNode: std::ptr::null_mut(), errorFromNode: std::ptr::null_mut() })?;
        }
        r
    }
    fn cuGraphExecKernelNodeSetParams(e: CUgraphExec, n: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS) {
        let x = in_ref(p)?;
        exec::graph_exec_set_kernel(e, n, &launch_args(x.func, [x.gridDimX, x.gridDimY, x.gridDimZ], [x.blockDimX, x.blockDimY, x.blockDimZ], x.kernelParams, false))
    }
    fn cuGraphExecKernelNodeSetParams_v2(e: CUgraphExec, n: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS_v2) {
        let x = in_ref(p)?;
        exec::graph_exec_set_kernel(e, n, &launch_args(x.func, [x.gridDimX, x.gridDimY, x.gridDimZ], [x.blockDimX, x.blockDimY, x.blockDimZ], x.kernelParams, false))
    }
    // Kernel nodes only (the simulated graphs have no other kind).
    fn cuGraphExecNodeSetParams(e: CUgraphExec, n: CUgraphNode, p: *mut CUgraphNodeParams) {
        let x = in_ref(p as *const CUgraphNodeParams)?;
        if x.type_ != CU_GRAPH_NODE_TYPE_KERNEL { return Err(CUresult::INVALID_VALUE); }
        // SAFETY: the kernel member, as the type says.
        let k = unsafe { x.u.kernel };
        exec::graph_exec_set_kernel(e, n, &launch_args(k.func, [k.gridDimX, k.gridDimY, k.gridDimZ], [k.blockDimX, k.blockDimY, k.blockDimZ], k.kernelParams, false))
    }
    fn cuGraphNodeSetEnabled(e: CUgraphExec, n: CUgraphNode, on: u32) { exec::graph_exec_enable(e, n, on != 0) }
    fn cuGraphAddChildGraphNode(n: *mut CUgraphNode, g: CUgraph, _deps: *const CUgraphNode, _nd: usize, child: CUgraph) {
        if n.is_null() { return Err(CUresult::INVALID_VALUE); }
        out(n, exec::graph_add_child(g, child)?)
    }
    fn cuGraphExecChildGraphNodeSetParams(e: CUgraphExec, n: CUgraphNode, child: CUgraph) { exec::graph_exec_set_child(e, n, child) }
}

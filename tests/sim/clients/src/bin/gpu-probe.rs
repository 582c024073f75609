//! The driver-API helper of the real-GPU suite (`tests/gpu/run.sh`): small, timed uses of the CUDA
//! driver through `dlopen("libcuda.so.1")` + `dlsym`, the same on a real GPU and on the simulated one.
//! Its one kernel is PTX (JIT-compiled by any driver): `param_ns(u64 ns)` spins on the GPU's global
//! timer for `ns` nanoseconds, which is also what the simulator's kernel of that name does.
//!
//! usage: gpu-probe info
//!        gpu-probe latency [--launches N] [--allocs N] [--size BYTES]
//!        gpu-probe alloc --size BYTES            (allocates, frees, reports)
//!        gpu-probe hold --size BYTES             (allocates, reports, sleeps until killed)
//!        gpu-probe fill --chunk BYTES [--pause] [--touch-last N --touch-bytes B]
//!                                                (allocates chunks until refused, reports, sleeps until
//!                                                killed; --pause: says "ready" with its context made and
//!                                                waits for a line on stdin first; --touch-last: before
//!                                                reporting, sets the first B bytes of each of the last N
//!                                                chunks on the GPU and reads them back)
//!        gpu-probe reset --size BYTES            (allocates, resets the primary context, allocates again)
//!        gpu-probe spin [--ns NS] [--seconds S] [--start-at UNIX_S] [--duty F] [--blocks-per-sm N]
//!                                                (--duty: keeps the GPU busy that fraction of the
//!                                                time by pausing after each batch, without any limit;
//!                                                --blocks-per-sm: a grid of N blocks per SM, which a
//!                                                partition of the SMs runs in more waves)
//!        gpu-probe pool --size BYTES [--threshold BYTES] [--destroyed-current | --own-current]
//!                                                (cuMemAllocAsync of BYTES from the device's pool,
//!                                                its release threshold set first; freed, synchronised,
//!                                                cuMemAlloc of BYTES tried, BYTES allocated from the
//!                                                pool again and freed, the pool trimmed, cuMemAlloc
//!                                                tried again; the threshold restored.
//!                                                --destroyed-current: first a new pool made the device's current one,
//!                                                1 MiB allocated from it and freed, the pool
//!                                                destroyed, and whether the default pool is current
//!                                                again. --own-current: first 1 MiB allocated from
//!                                                the default pool and freed, then a new pool made
//!                                                current with CUDA 13.0's cuMemSetMemPool, which
//!                                                the rest uses; "own_current": null where the
//!                                                driver lacks that call, and nothing else runs)
//!        gpu-probe pool-threads --size BYTES [--threads T] [--iters I] [--hold H] [--wait S]
//!                                                (T threads (16), each on its own stream,
//!                                                allocating BYTES from the device's pool I times
//!                                                (200), holding up to H (3) and synchronising every
//!                                                4th time; the pool's release threshold set to the
//!                                                maximum first and restored at the end; results per
//!                                                kind, then what the pool holds and held at most,
//!                                                cuMemGetInfo, and both after the pool is trimmed;
//!                                                --wait: S seconds (0) between the context and
//!                                                the first allocation)
//!        gpu-probe vmm --size BYTES                (cuMemCreate of BYTES, mapped; its handle
//!                                                released (the mapping keeps the memory), cuMemAlloc of
//!                                                BYTES tried; the handle retained from the address and
//!                                                the range unmapped (the reference keeps it), tried
//!                                                again; released, tried again)
//!        gpu-probe stack --bytes B --over BYTES   (the primary context's stack raised to B bytes a
//!                                                thread, then to as much more again as holds
//!                                                BYTES for every thread the GPU holds at once;
//!                                                cuMemGetInfo and the limit read back after each;
//!                                                the stack set back to its first value at the end)
//!        gpu-probe graph-mem --size BYTES [--graphs N] [--alloc BYTES]
//!                                                (N graphs of an allocation node of BYTES, a kernel
//!                                                and a free node, each launched once; then
//!                                                cuMemAlloc --alloc, the graphs destroyed, the graph
//!                                                pool trimmed, and cuMemAlloc --alloc again)
//! Each prints one JSON object; exit 1 on a driver error, 2 on bad usage.
use serde_json::{json, Value};
use std::ffi::{c_char, c_void, CStr};
use std::time::{Duration, Instant};
use vgpu_sim_clients::abi::*;

const PTX: &str = "
.version 6.4
.target sm_60
.address_size 64
.visible .entry param_ns(.param .u64 ns)
{
    .reg .pred %p;
    .reg .b64 %r<4>;
    ld.param.u64 %r0, [ns];
    mov.u64 %r1, %globaltimer;
    add.u64 %r2, %r1, %r0;
SPIN:
    mov.u64 %r3, %globaltimer;
    setp.lt.u64 %p, %r3, %r2;
    @%p bra SPIN;
    ret;
}
\0";

macro_rules! table {
    ($($name:ident : fn($($t:ty),*);)*) => {
        #[allow(non_snake_case)]
        struct Cuda { $($name: unsafe extern "C" fn($($t),*) -> CUresult,)* }
        fn bind() -> Result<Cuda, String> {
            let h = vgpu_sim_clients::dlopen_cuda()?;
            Ok(Cuda { $($name: {
                // SAFETY: a live dlopen handle and a NUL-terminated name.
                let p = unsafe { libc::dlsym(h, concat!(stringify!($name), "\0").as_ptr() as *const c_char) };
                if p.is_null() { return Err(format!("libcuda.so.1 has no {}", stringify!($name))); }
                // SAFETY: the driver's symbol of this name has this signature (cuda.h).
                unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> CUresult>(p) }
            },)* })
        }
    };
}

table! {
    cuInit: fn(u32);
    cuGetErrorName: fn(CUresult, *mut *const c_char);
    cuDriverGetVersion: fn(*mut i32);
    cuDeviceGet: fn(*mut CUdevice, i32);
    cuDeviceGetName: fn(*mut c_char, i32, CUdevice);
    cuDeviceTotalMem_v2: fn(*mut usize, CUdevice);
    cuDevicePrimaryCtxRetain: fn(*mut CUcontext, CUdevice);
    cuDevicePrimaryCtxReset_v2: fn(CUdevice);
    cuCtxSetCurrent: fn(CUcontext);
    cuCtxSynchronize: fn();
    cuMemGetInfo_v2: fn(*mut usize, *mut usize);
    cuMemAlloc_v2: fn(*mut CUdeviceptr, usize);
    cuMemFree_v2: fn(CUdeviceptr);
    cuMemsetD8_v2: fn(CUdeviceptr, u8, usize);
    cuMemcpyDtoH_v2: fn(*mut c_void, CUdeviceptr, usize);
    cuModuleLoadData: fn(*mut CUmodule, *const c_void);
    cuModuleGetFunction: fn(*mut CUfunction, CUmodule, *const c_char);
    cuLaunchKernel: fn(CUfunction, u32, u32, u32, u32, u32, u32, u32, CUstream, *mut *mut c_void, *mut *mut c_void);
    cuGraphCreate: fn(*mut CUgraph, u32);
    cuGraphAddMemAllocNode: fn(*mut CUgraphNode, CUgraph, *const CUgraphNode, usize, *mut CUDA_MEM_ALLOC_NODE_PARAMS);
    cuGraphAddKernelNode: fn(*mut CUgraphNode, CUgraph, *const CUgraphNode, usize, *const CUDA_KERNEL_NODE_PARAMS);
    cuGraphAddMemFreeNode: fn(*mut CUgraphNode, CUgraph, *const CUgraphNode, usize, CUdeviceptr);
    cuGraphInstantiateWithFlags: fn(*mut CUgraphExec, CUgraph, u64);
    cuGraphLaunch: fn(CUgraphExec, CUstream);
    cuGraphExecDestroy: fn(CUgraphExec);
    cuDeviceGetGraphMemAttribute: fn(CUdevice, i32, *mut c_void);
    cuDeviceGraphMemTrim: fn(CUdevice);
    cuMemAllocAsync: fn(*mut CUdeviceptr, usize, CUstream);
    cuMemFreeAsync: fn(CUdeviceptr, CUstream);
    cuStreamSynchronize: fn(CUstream);
    cuStreamCreate: fn(*mut CUstream, u32);
    cuDeviceGetMemPool: fn(*mut CUmemoryPool, CUdevice);
    cuDeviceGetDefaultMemPool: fn(*mut CUmemoryPool, CUdevice);
    cuDeviceSetMemPool: fn(CUdevice, CUmemoryPool);
    cuMemPoolCreate: fn(*mut CUmemoryPool, *const CUmemPoolProps);
    cuMemPoolDestroy: fn(CUmemoryPool);
    cuMemPoolSetAttribute: fn(CUmemoryPool, i32, *mut c_void);
    cuMemPoolGetAttribute: fn(CUmemoryPool, i32, *mut c_void);
    cuMemPoolTrimTo: fn(CUmemoryPool, usize);
    cuMemGetAllocationGranularity: fn(*mut usize, *const CUmemAllocationProp, i32);
    cuMemCreate: fn(*mut u64, usize, *const CUmemAllocationProp, u64);
    cuMemRelease: fn(u64);
    cuMemAddressReserve: fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64);
    cuMemAddressFree: fn(CUdeviceptr, usize);
    cuMemMap: fn(CUdeviceptr, usize, usize, u64, u64);
    cuMemUnmap: fn(CUdeviceptr, usize);
    cuMemSetAccess: fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize);
    cuMemRetainAllocationHandle: fn(*mut u64, *mut c_void);
    cuDeviceGetAttribute: fn(*mut i32, i32, CUdevice);
    cuCtxGetLimit: fn(*mut usize, i32);
    cuCtxSetLimit: fn(i32, usize);
}

struct Probe {
    cu: Cuda,
}

impl Probe {
    /// A cuMemAlloc of `size`, freed at once: the driver's result by name.
    fn alloc_result(&self, size: usize) -> String {
        let mut d = 0;
        // SAFETY: an out-pointer to a local.
        let r = unsafe { (self.cu.cuMemAlloc_v2)(&mut d, size) };
        if r == CUresult::SUCCESS {
            // SAFETY: the allocation just made.
            unsafe { (self.cu.cuMemFree_v2)(d) };
            return "CUDA_SUCCESS".into();
        }
        self.name(r)
    }

    fn name(&self, r: CUresult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: out-pointer to a local; the driver returns a static string or NULL.
        unsafe {
            if (self.cu.cuGetErrorName)(r, &mut s) == CUresult::SUCCESS && !s.is_null() {
                return CStr::from_ptr(s).to_string_lossy().into_owned();
            }
        }
        format!("CUresult({})", r.0)
    }

    fn ck(&self, r: CUresult, what: &str) -> Result<(), String> {
        if r == CUresult::SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.name(r)))
        }
    }

    /// cuInit, device 0, its primary context made current.
    fn open() -> Result<(Probe, CUdevice), String> {
        let p = Probe { cu: bind()? };
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        unsafe {
            p.ck((p.cu.cuInit)(0), "cuInit")?;
            p.ck((p.cu.cuDeviceGet)(&mut dev, 0), "cuDeviceGet")?;
            p.ck((p.cu.cuDevicePrimaryCtxRetain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            p.ck((p.cu.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent")?;
        }
        Ok((p, dev))
    }

    fn kernel(&self) -> Result<CUfunction, String> {
        let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a NUL-terminated PTX image and name; out-pointers to locals.
        unsafe {
            self.ck((self.cu.cuModuleLoadData)(&mut m, PTX.as_ptr() as *const c_void), "cuModuleLoadData")?;
            self.ck((self.cu.cuModuleGetFunction)(&mut f, m, c"param_ns".as_ptr()), "cuModuleGetFunction")?;
        }
        Ok(f)
    }

    fn launch(&self, f: CUfunction, ns: &mut u64) -> CUresult {
        self.launch_grid(f, 1, ns)
    }

    /// `grid` blocks of 32 threads, each spinning `ns`.
    fn launch_grid(&self, f: CUfunction, grid: u32, ns: &mut u64) -> CUresult {
        let mut arg = ns as *mut u64 as *mut c_void;
        // SAFETY: one kernel parameter (a u64) that lives across the call; the driver copies it.
        unsafe {
            (self.cu.cuLaunchKernel)(f, grid, 1, 1, 32, 1, 1, 0, std::ptr::null_mut(), &mut arg, std::ptr::null_mut())
        }
    }

    /// The device's SMs.
    fn sm_count(&self, dev: CUdevice) -> Result<u32, String> {
        let mut n = 0;
        // SAFETY: an out-pointer to a local and the device opened.
        let r = unsafe { (self.cu.cuDeviceGetAttribute)(&mut n, 16, dev) };
        self.ck(r, "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)")?;
        Ok(n.max(1) as u32)
    }

    fn sync(&self) -> Result<(), String> {
        // SAFETY: no arguments.
        self.ck(unsafe { (self.cu.cuCtxSynchronize)() }, "cuCtxSynchronize")
    }
}

fn opt(args: &[String], name: &str, default: f64) -> Result<f64, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse::<f64>().ok().or_else(|| vgpu_sim_clients::scenario::parse_size(v).map(|x| x as f64)))
            .ok_or_else(|| format!("{name} needs a number")),
    }
}

fn info() -> Result<Value, String> {
    let (p, dev) = Probe::open()?;
    let mut name = [0 as c_char; 128];
    let (mut total_dev, mut free, mut total, mut ver) = (0usize, 0usize, 0usize, 0i32);
    // SAFETY: out-pointers to locals; the name buffer holds 128 bytes.
    unsafe {
        p.ck((p.cu.cuDriverGetVersion)(&mut ver), "cuDriverGetVersion")?;
        p.ck((p.cu.cuDeviceGetName)(name.as_mut_ptr(), 128, dev), "cuDeviceGetName")?;
        p.ck((p.cu.cuDeviceTotalMem_v2)(&mut total_dev, dev), "cuDeviceTotalMem")?;
        p.ck((p.cu.cuMemGetInfo_v2)(&mut free, &mut total), "cuMemGetInfo")?;
    }
    // SAFETY: the driver wrote a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    Ok(json!({"name": name, "driver_version": ver, "device_total": total_dev, "mem_total": total, "mem_free": free,
        "dlvsym_reaches": dlvsym_reaches()?}))
}

/// The versions under which glibc's `dlvsym` hands out the driver's own `cuMemAlloc_v2` (libvgpu.so
/// overrides `dlsym`, not `dlvsym`, so any is a way around the limit). glibc's `dlvsym` accepts a
/// symbol defined without a version, whatever version is asked for, only from a library without
/// version information (no `.gnu.version`); a library that binds glibc's versioned symbols has it.
fn dlvsym_reaches() -> Result<Vec<String>, String> {
    let h = vgpu_sim_clients::dlopen_cuda()?;
    let glibc_base = if cfg!(target_arch = "aarch64") { c"GLIBC_2.17" } else { c"GLIBC_2.2.5" };
    let mut found = vec![];
    for v in [c"libcuda.so.1", c"libcuda.so", glibc_base] {
        // SAFETY: a live dlopen handle and NUL-terminated names.
        if !unsafe { libc::dlvsym(h, c"cuMemAlloc_v2".as_ptr(), v.as_ptr()) }.is_null() {
            found.push(v.to_string_lossy().into_owned());
        }
    }
    Ok(found)
}

/// Per-call CPU cost of launches and of alloc/free pairs: the best of 5 rounds (the least disturbed).
fn latency(args: &[String]) -> Result<Value, String> {
    let launches = opt(args, "--launches", 50_000.0)? as usize;
    let allocs = opt(args, "--allocs", 5_000.0)? as usize;
    let size = opt(args, "--size", (1 << 20) as f64)? as usize;
    let (p, _) = Probe::open()?;
    let f = p.kernel()?;
    let mut ns = 0u64;
    // Warm-up: first launches JIT and set things up.
    for _ in 0..256 {
        p.ck(p.launch(f, &mut ns), "cuLaunchKernel")?;
    }
    p.sync()?;
    let mut best_launch = f64::MAX;
    for _ in 0..5 {
        let mut spent = Duration::ZERO;
        let mut done = 0;
        while done < launches / 5 {
            // Batches short enough that the launch queue never fills (a full queue blocks the call).
            let t = Instant::now();
            for _ in 0..128 {
                p.ck(p.launch(f, &mut ns), "cuLaunchKernel")?;
            }
            spent += t.elapsed();
            done += 128;
            p.sync()?;
        }
        best_launch = best_launch.min(spent.as_nanos() as f64 / done as f64);
    }
    let (mut best_alloc, mut best_free) = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let (mut ta, mut tf) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..(allocs / 5).max(1) {
            let mut d = 0;
            let t = Instant::now();
            // SAFETY: out-pointer to a local; the pointer is freed right after.
            let r = unsafe { (p.cu.cuMemAlloc_v2)(&mut d, size) };
            ta += t.elapsed();
            p.ck(r, "cuMemAlloc")?;
            let t = Instant::now();
            // SAFETY: d was allocated just above.
            let r = unsafe { (p.cu.cuMemFree_v2)(d) };
            tf += t.elapsed();
            p.ck(r, "cuMemFree")?;
        }
        let n = (allocs / 5).max(1) as f64;
        if ta.as_nanos() as f64 / n + (tf.as_nanos() as f64 / n) < best_alloc + best_free {
            best_alloc = ta.as_nanos() as f64 / n;
            best_free = tf.as_nanos() as f64 / n;
        }
    }
    let mut v = json!({"launch_ns": best_launch, "alloc_ns": best_alloc, "free_ns": best_free, "alloc_size": size});
    // Under an SM limit: whether the launches waited for the budget (the limit throttled them)
    // or only paid the limited path's cost, from the container's region.
    if let Some(r) = std::env::var_os("CUDA_DEVICE_MEMORY_SHARED_CACHE")
        .and_then(|p| vgpu_region::Region::open(std::path::Path::new(&p), false).ok())
    {
        let d = &r.layout().devices[0];
        v["throttled_launches"] = json!(d.sm_throttled_launches.load(std::sync::atomic::Ordering::Relaxed));
        v["throttled_ns"] = json!(d.sm_throttled_ns.load(std::sync::atomic::Ordering::Relaxed));
    }
    Ok(v)
}

fn alloc(args: &[String], hold: bool) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)?;
    if size <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let t = Instant::now();
    let (p, _) = Probe::open()?;
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut d = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { (p.cu.cuMemAlloc_v2)(&mut d, size as usize) };
    let v = json!({"size": size as u64, "ok": r == CUresult::SUCCESS, "open_ms": open_ms,
        "result": if r == CUresult::SUCCESS { "CUDA_SUCCESS".to_string() } else { p.name(r) }});
    if hold && r == CUresult::SUCCESS {
        println!("{v}");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    if r == CUresult::SUCCESS {
        // SAFETY: allocated just above.
        p.ck(unsafe { (p.cu.cuMemFree_v2)(d) }, "cuMemFree")?;
    }
    Ok(v)
}

/// Allocates `--chunk` bytes at a time until the driver refuses one, reports, and holds it all until
/// killed (the suite reads what the process really holds meanwhile).
fn fill(args: &[String]) -> Result<Value, String> {
    let chunk = opt(args, "--chunk", -1.0)?;
    if chunk <= 0.0 {
        return Err("--chunk BYTES is required".into());
    }
    let (p, _) = Probe::open()?;
    if args.iter().any(|a| a == "--pause") {
        println!("{}", json!({"event": "ready"}));
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    }
    let mut chunks = Vec::new();
    let r = loop {
        let mut d = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { (p.cu.cuMemAlloc_v2)(&mut d, chunk as usize) };
        if r != CUresult::SUCCESS || chunks.len() >= 1 << 20 {
            break r;
        }
        chunks.push(d);
    };
    let n = chunks.len() as u64;
    let mut v = json!({"chunks": n, "allocated": n * chunk as u64, "result": p.name(r)});
    let last = opt(args, "--touch-last", 0.0)? as usize;
    if last > 0 {
        // Written by the GPU (cuMemsetD8 runs on it), read back through a copy: the memory works.
        let bytes = (opt(args, "--touch-bytes", chunk)? as usize).min(chunk as usize);
        let t = Instant::now();
        let touched = (|| -> Result<(), String> {
            for (k, &d) in chunks.iter().rev().take(last).enumerate() {
                let want = 0x40 + k as u8;
                // SAFETY: d is a live allocation of at least `bytes` bytes.
                p.ck(unsafe { (p.cu.cuMemsetD8_v2)(d, want, bytes) }, "cuMemsetD8")?;
                p.sync()?;
                let mut got = [0u8; 2];
                for (i, at) in [0, bytes - 1].into_iter().enumerate() {
                    p.ck(
                        // SAFETY: one byte into a local, from inside the allocation.
                        unsafe { (p.cu.cuMemcpyDtoH_v2)(got[i..].as_mut_ptr().cast(), d + at as u64, 1) },
                        "cuMemcpyDtoH",
                    )?;
                }
                if got != [want; 2] {
                    return Err(format!("chunk {} from the end read back {got:?}, not {want}", k + 1));
                }
            }
            Ok(())
        })();
        v["touched"] = json!(chunks.len().min(last));
        v["touch_bytes"] = json!(bytes);
        v["touch_seconds"] = json!(t.elapsed().as_secs_f64());
        v["touch_error"] = json!(touched.err());
    }
    println!("{v}");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// (free, total) of the current device as this process sees it.
fn mem_info(p: &Probe) -> Result<Value, String> {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    p.ck(unsafe { (p.cu.cuMemGetInfo_v2)(&mut f, &mut t) }, "cuMemGetInfo")?;
    Ok(json!({"free": f, "total": t}))
}

/// Allocates `--size`, resets the primary context (what `cudaDeviceReset` does: the driver frees
/// every allocation in it), retains it again and allocates `--size` once more.
fn reset(args: &[String]) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)?;
    if size <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let (p, dev) = Probe::open()?;
    let base = mem_info(&p)?;
    let (mut a, mut b, mut ctx) = (0, 0, std::ptr::null_mut());
    // SAFETY: out-pointers to locals; the device is the one opened.
    unsafe {
        p.ck((p.cu.cuMemAlloc_v2)(&mut a, size as usize), "cuMemAlloc")?;
        let during = mem_info(&p)?;
        p.ck((p.cu.cuDevicePrimaryCtxReset_v2)(dev), "cuDevicePrimaryCtxReset")?;
        p.ck((p.cu.cuDevicePrimaryCtxRetain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        p.ck((p.cu.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent")?;
        let after = mem_info(&p)?;
        let r = (p.cu.cuMemAlloc_v2)(&mut b, size as usize);
        let again = mem_info(&p)?;
        if r == CUresult::SUCCESS {
            p.ck((p.cu.cuMemFree_v2)(b), "cuMemFree")?;
        }
        Ok(
            json!({"size": size as u64, "base": base, "during": during, "after": after, "again_ok": r == CUresult::SUCCESS,
            "again": if r == CUresult::SUCCESS { "CUDA_SUCCESS".to_string() } else { p.name(r) }, "again_mem_info": again}),
        )
    }
}

/// Launches `ns`-long kernels for `seconds` (after `--start-at`, a UNIX time, if given) and reports
/// how many completed: the achieved share of the GPU's time is kernels x ns / elapsed.
///
/// With `--duty F` (0 < F < 1) it paces itself: after each batch it stays idle for as long again as
/// the batch took, times (1 - F) / F, so that the GPU is busy a fraction F of the time. What that
/// throughput is, relative to the unpaced run, is what a perfect F share of the GPU's time gives on
/// this GPU (one with power headroom runs faster while idle part of the time), the reference for
/// an SM limit of F.
fn spin(args: &[String]) -> Result<Value, String> {
    let mut ns = opt(args, "--ns", 1_000_000.0)? as u64;
    let seconds = opt(args, "--seconds", 3.0)?;
    let start_at = opt(args, "--start-at", 0.0)?;
    let duty = opt(args, "--duty", 1.0)?;
    if !(duty > 0.0 && duty <= 1.0) {
        return Err(format!("--duty must be above 0 and at most 1, not {duty}"));
    }
    let per_sm = opt(args, "--blocks-per-sm", 0.0)? as u32;
    let (p, dev) = Probe::open()?;
    let f = p.kernel()?;
    let grid = if per_sm == 0 { 1 } else { p.sm_count(dev)? * per_sm };
    p.ck(p.launch_grid(f, grid, &mut ns), "cuLaunchKernel")?;
    p.sync()?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    if start_at > now {
        std::thread::sleep(Duration::from_secs_f64(start_at - now));
    }
    let t = Instant::now();
    let end = t + Duration::from_secs_f64(seconds);
    let mut kernels = 0u64;
    // Batches of 16 between synchronisations, so that the host's turnaround after each (waking up,
    // launching again) idles the GPU for a small share of the time.
    while Instant::now() < end {
        let batch = Instant::now();
        for _ in 0..16 {
            p.ck(p.launch_grid(f, grid, &mut ns), "cuLaunchKernel")?;
        }
        p.sync()?;
        kernels += 16;
        if duty < 1.0 {
            std::thread::sleep(batch.elapsed().mul_f64((1.0 - duty) / duty));
        }
    }
    let elapsed = t.elapsed().as_secs_f64();
    Ok(json!({"kernels": kernels, "kernel_ns": ns, "grid": grid, "seconds": elapsed, "duty": duty,
        "per_s": kernels as f64 / elapsed, "busy": kernels as f64 * ns as f64 / 1e9 / elapsed}))
}

/// What the device's stream-ordered pool holds after an allocation is freed (see the usage).
fn pool(args: &[String]) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)?;
    if size <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let size = size as usize;
    let threshold = opt(args, "--threshold", u64::MAX as f64)? as u64;
    let (p, dev) = Probe::open()?;
    let s: CUstream = std::ptr::null_mut();
    // SAFETY: out-pointers to locals, 64-bit attribute values in locals, and handles the driver gave.
    unsafe {
        // The driver documents that destroying a device's current pool makes its default pool
        // current again; what cuMemAllocAsync draws from next must be charged as that pool.
        let mut default_current = Value::Null;
        if args.iter().any(|a| a == "--destroyed-current") {
            let mut own = std::ptr::null_mut();
            p.ck((p.cu.cuMemPoolCreate)(&mut own, &CUmemPoolProps::device(dev)), "cuMemPoolCreate")?;
            p.ck((p.cu.cuDeviceSetMemPool)(dev, own), "cuDeviceSetMemPool")?;
            let mut d = 0;
            p.ck((p.cu.cuMemAllocAsync)(&mut d, 1 << 20, s), "cuMemAllocAsync")?;
            p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
            p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            p.ck((p.cu.cuMemPoolDestroy)(own), "cuMemPoolDestroy")?;
            let (mut cur, mut def) = (std::ptr::null_mut(), std::ptr::null_mut());
            p.ck((p.cu.cuDeviceGetMemPool)(&mut cur, dev), "cuDeviceGetMemPool")?;
            p.ck((p.cu.cuDeviceGetDefaultMemPool)(&mut def, dev), "cuDeviceGetDefaultMemPool")?;
            default_current = json!(cur == def);
        }
        // CUDA 13.0's form of cuDeviceSetMemPool, made current after cuMemAllocAsync drew from the
        // default pool: what it draws from next must be charged as the new pool.
        let mut own_current = Value::Null;
        if args.iter().any(|a| a == "--own-current") {
            type Set = unsafe extern "C" fn(*mut CUmemLocation, i32, CUmemoryPool) -> CUresult;
            let h = vgpu_sim_clients::dlopen_cuda()?;
            let f = libc::dlsym(h, c"cuMemSetMemPool".as_ptr());
            if f.is_null() {
                return Ok(json!({"own_current": null}));
            }
            // SAFETY: the driver's cuMemSetMemPool has this signature (cuda.h, CUDA 13.0).
            let set = std::mem::transmute::<*mut c_void, Set>(f);
            let mut d = 0;
            p.ck((p.cu.cuMemAllocAsync)(&mut d, 1 << 20, s), "cuMemAllocAsync")?;
            p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
            p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            let mut own = std::ptr::null_mut();
            p.ck((p.cu.cuMemPoolCreate)(&mut own, &CUmemPoolProps::device(dev)), "cuMemPoolCreate")?;
            let mut at = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: dev };
            p.ck(set(&mut at, CU_MEM_ALLOCATION_TYPE_PINNED, own), "cuMemSetMemPool")?;
            let mut cur = std::ptr::null_mut();
            p.ck((p.cu.cuDeviceGetMemPool)(&mut cur, dev), "cuDeviceGetMemPool")?;
            own_current = json!(cur == own);
        }
        let mut pool = std::ptr::null_mut();
        p.ck((p.cu.cuDeviceGetMemPool)(&mut pool, dev), "cuDeviceGetMemPool")?;
        let get = |which: i32| -> Result<u64, String> {
            let mut v = 0u64;
            p.ck(
                (p.cu.cuMemPoolGetAttribute)(pool, which, &mut v as *mut u64 as *mut c_void),
                "cuMemPoolGetAttribute",
            )?;
            Ok(v)
        };
        let mut old = get(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)?;
        let mut t = threshold;
        p.ck(
            (p.cu.cuMemPoolSetAttribute)(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut t as *mut u64 as *mut c_void),
            "cuMemPoolSetAttribute",
        )?;
        let base = mem_info(&p)?;
        let mut d = 0;
        p.ck((p.cu.cuMemAllocAsync)(&mut d, size, s), "cuMemAllocAsync")?;
        let allocated = mem_info(&p)?;
        p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
        p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
        let (held, synced) = (get(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?, mem_info(&p)?);
        let alloc = p.alloc_result(size);
        // What the pool holds, allocated from it again: reused, not charged a second time.
        let mut d = 0;
        let r = (p.cu.cuMemAllocAsync)(&mut d, size, s);
        let again = if r == CUresult::SUCCESS { "CUDA_SUCCESS".to_string() } else { p.name(r) };
        if r == CUresult::SUCCESS {
            p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
            p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
        }
        p.ck((p.cu.cuMemPoolTrimTo)(pool, 0), "cuMemPoolTrimTo")?;
        let (held_after_trim, trimmed) = (get(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?, mem_info(&p)?);
        let alloc_after_trim = p.alloc_result(size);
        p.ck(
            (p.cu.cuMemPoolSetAttribute)(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut old as *mut u64 as *mut c_void),
            "cuMemPoolSetAttribute",
        )?;
        Ok(json!({"size": size, "threshold": threshold, "base": base, "allocated": allocated, "pool": held,
            "synchronised": synced, "alloc": alloc, "again": again, "pool_after_trim": held_after_trim,
            "trimmed": trimmed, "alloc_after_trim": alloc_after_trim,
            "default_current_after_destroy": default_current, "own_current": own_current}))
    }
}

/// Threads allocating and freeing stream-ordered memory from one pool that keeps what is freed into
/// it (see the usage): the pool must never hold more than the container's limit.
fn pool_threads(args: &[String]) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)?;
    if size <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let size = size as usize;
    let threads = opt(args, "--threads", 16.0)?.max(1.0) as usize;
    let iters = opt(args, "--iters", 200.0)?.max(1.0) as usize;
    let hold = opt(args, "--hold", 3.0)?.max(1.0) as usize;
    let wait = opt(args, "--wait", 0.0)?;
    let (p, dev) = Probe::open()?;
    // With the context made: time for an agent to measure it before the storm.
    std::thread::sleep(std::time::Duration::from_secs_f64(wait.max(0.0)));
    // SAFETY: (the whole block) out-pointers to locals, 64-bit attribute values in locals, and handles
    // the driver gave; each thread makes the primary context current before its calls.
    unsafe {
        let mut pool = std::ptr::null_mut();
        p.ck((p.cu.cuDeviceGetMemPool)(&mut pool, dev), "cuDeviceGetMemPool")?;
        let attr = |which: i32, set: Option<u64>| -> Result<u64, String> {
            let mut v = set.unwrap_or(0);
            let vp = &mut v as *mut u64 as *mut c_void;
            match set {
                Some(_) => p.ck((p.cu.cuMemPoolSetAttribute)(pool, which, vp), "cuMemPoolSetAttribute")?,
                None => p.ck((p.cu.cuMemPoolGetAttribute)(pool, which, vp), "cuMemPoolGetAttribute")?,
            }
            Ok(v)
        };
        let old = attr(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, None)?;
        attr(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, Some(u64::MAX))?;
        attr(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, Some(0))?; // the high-water mark starts here
        let base = mem_info(&p)?;
        let results: Vec<Result<Vec<String>, String>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    let p = &p;
                    sc.spawn(move || -> Result<Vec<String>, String> {
                        let mut ctx = std::ptr::null_mut();
                        p.ck((p.cu.cuDevicePrimaryCtxRetain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
                        p.ck((p.cu.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent")?;
                        let mut s: CUstream = std::ptr::null_mut();
                        p.ck((p.cu.cuStreamCreate)(&mut s, 0), "cuStreamCreate")?;
                        let (mut live, mut outcomes) = (std::collections::VecDeque::new(), Vec::new());
                        for i in 0..iters {
                            let mut d = 0;
                            let r = (p.cu.cuMemAllocAsync)(&mut d, size, s);
                            outcomes.push(p.name(r));
                            if r == CUresult::SUCCESS {
                                live.push_back(d);
                            }
                            if live.len() >= hold {
                                let d = live.pop_front().unwrap_or_default();
                                p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
                            }
                            if i % 4 == 3 {
                                p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
                            }
                        }
                        for d in live {
                            p.ck((p.cu.cuMemFreeAsync)(d, s), "cuMemFreeAsync")?;
                        }
                        p.ck((p.cu.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
                        Ok(outcomes)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into()))).collect()
        });
        let mut outcomes = serde_json::Map::new();
        for r in results {
            for name in r? {
                let n = outcomes.get(&name).and_then(Value::as_u64).unwrap_or(0);
                outcomes.insert(name, json!(n + 1));
            }
        }
        p.ck((p.cu.cuCtxSynchronize)(), "cuCtxSynchronize")?;
        let (held, high, synced) = (
            attr(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, None)?,
            attr(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, None)?,
            mem_info(&p)?,
        );
        p.ck((p.cu.cuMemPoolTrimTo)(pool, 0), "cuMemPoolTrimTo")?;
        let (held_after_trim, trimmed) = (attr(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, None)?, mem_info(&p)?);
        attr(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, Some(old))?;
        Ok(json!({"size": size, "threads": threads, "iters": iters, "hold": hold, "base": base,
            "outcomes": outcomes, "pool": held, "pool_high": high, "synchronised": synced,
            "pool_after_trim": held_after_trim, "trimmed": trimmed}))
    }
}

/// A physical allocation (cuMemCreate) kept by its mapping after its handle is released, then by a
/// handle retained from its address after the unmap: cuMemGetInfo after each step, and a
/// cuMemAlloc of the same size tried while it is kept and once it is gone.
fn vmm(args: &[String]) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)?;
    if size <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let (p, dev) = Probe::open()?;
    // SAFETY: out-pointers to locals, a property block and an access descriptor built here, and
    // handles and addresses the driver gave.
    unsafe {
        let prop = CUmemAllocationProp::device(dev);
        let mut g = 0;
        p.ck((p.cu.cuMemGetAllocationGranularity)(&mut g, &prop, 0), "cuMemGetAllocationGranularity")?;
        let size = (size as usize).div_ceil(g.max(1)) * g.max(1);
        let base = mem_info(&p)?;
        let (mut h, mut ptr) = (0u64, 0);
        p.ck((p.cu.cuMemCreate)(&mut h, size, &prop, 0), "cuMemCreate")?;
        p.ck((p.cu.cuMemAddressReserve)(&mut ptr, size, 0, 0, 0), "cuMemAddressReserve")?;
        p.ck((p.cu.cuMemMap)(ptr, size, 0, h, 0), "cuMemMap")?;
        let acc = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        p.ck((p.cu.cuMemSetAccess)(ptr, size, &acc, 1), "cuMemSetAccess")?;
        let mapped = mem_info(&p)?;
        p.ck((p.cu.cuMemRelease)(h), "cuMemRelease")?;
        let released = mem_info(&p)?;
        let alloc_while_mapped = p.alloc_result(size);
        let mut again = 0u64;
        p.ck((p.cu.cuMemRetainAllocationHandle)(&mut again, ptr as *mut c_void), "cuMemRetainAllocationHandle")?;
        p.ck((p.cu.cuMemUnmap)(ptr, size), "cuMemUnmap")?;
        let unmapped = mem_info(&p)?;
        let alloc_while_retained = p.alloc_result(size);
        p.ck((p.cu.cuMemRelease)(again), "cuMemRelease (retained)")?;
        p.ck((p.cu.cuMemAddressFree)(ptr, size), "cuMemAddressFree")?;
        let gone = mem_info(&p)?;
        let alloc_after = p.alloc_result(size);
        Ok(json!({"size": size, "base": base, "mapped": mapped, "released": released,
            "alloc_while_mapped": alloc_while_mapped, "unmapped_retained": unmapped,
            "alloc_while_retained": alloc_while_retained, "gone": gone, "alloc_after": alloc_after}))
    }
}

/// A context's stack, which the driver holds for every thread the GPU can hold at once (see the
/// usage).
fn stack(args: &[String]) -> Result<Value, String> {
    const STACK: i32 = 0; // CU_LIMIT_STACK_SIZE
    let bytes = opt(args, "--bytes", -1.0)?;
    let over = opt(args, "--over", -1.0)?;
    if bytes <= 0.0 || over <= 0.0 {
        return Err("--bytes B and --over BYTES are required".into());
    }
    let (p, dev) = Probe::open()?;
    let (mut sms, mut threads, mut first) = (0, 0, 0usize);
    // SAFETY: out-pointers to locals; the limits are those of the current (primary) context.
    unsafe {
        p.ck((p.cu.cuDeviceGetAttribute)(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "attribute")?;
        p.ck(
            (p.cu.cuDeviceGetAttribute)(&mut threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev),
            "attribute",
        )?;
        p.ck((p.cu.cuCtxGetLimit)(&mut first, STACK), "cuCtxGetLimit")?;
        let set = |v: usize| -> Result<(String, usize, Value), String> {
            let r = (p.cu.cuCtxSetLimit)(STACK, v);
            let mut now = 0;
            p.ck((p.cu.cuCtxGetLimit)(&mut now, STACK), "cuCtxGetLimit")?;
            Ok((p.name(r), now, mem_info(&p)?))
        };
        let base = mem_info(&p)?;
        let (raised, now, raised_info) = set(bytes as usize)?;
        let all = (sms.max(1) as u64 * threads.max(1) as u64) as f64;
        let too_big = now + (over / all).ceil() as usize;
        let (big, big_now, big_info) = set(too_big)?;
        let (restored, _, restored_info) = set(first)?;
        // Raised again after being lowered (as a library that raises the stack for one kernel does).
        let (again, _, again_info) = set(bytes as usize)?;
        set(first)?;
        Ok(json!({"sms": sms, "threads_per_sm": threads, "first": first, "base": base,
            "raised": raised, "now": now, "raised_info": raised_info,
            "too_big": too_big, "too_big_result": big, "too_big_now": big_now, "too_big_info": big_info,
            "restored": restored, "restored_info": restored_info, "again": again, "again_info": again_info}))
    }
}

/// Graphs that allocate in graph memory nodes (see the usage): what the device's graph pool and
/// cuMemGetInfo say after each step.
fn graph_mem(args: &[String]) -> Result<Value, String> {
    let size = opt(args, "--size", -1.0)? as usize;
    let graphs = opt(args, "--graphs", 1.0)? as usize;
    let probe = opt(args, "--alloc", 0.0)? as usize;
    if size == 0 || opt(args, "--size", -1.0)? <= 0.0 {
        return Err("--size BYTES is required".into());
    }
    let (p, dev) = Probe::open()?;
    let f = p.kernel()?;
    let pool = || -> Result<u64, String> {
        let mut v = 0u64;
        // SAFETY: the reserved-memory attribute is a 64-bit value written to a local.
        let r = unsafe {
            (p.cu.cuDeviceGetGraphMemAttribute)(
                dev,
                CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                &mut v as *mut u64 as *mut c_void,
            )
        };
        p.ck(r, "cuDeviceGetGraphMemAttribute")?;
        Ok(v)
    };
    let try_alloc = || -> String {
        if probe == 0 {
            return "not tried".into();
        }
        p.alloc_result(probe)
    };
    let base = mem_info(&p)?;
    let mut ns = 1000u64;
    let mut arg = &mut ns as *mut u64 as *mut c_void;
    let (mut execs, mut launches) = (Vec::new(), Vec::new());
    // SAFETY: out-pointers to locals, parameter blocks built here, and handles the driver gave.
    unsafe {
        for _ in 0..graphs {
            let mut g = std::ptr::null_mut();
            p.ck((p.cu.cuGraphCreate)(&mut g, 0), "cuGraphCreate")?;
            let mut a = CUDA_MEM_ALLOC_NODE_PARAMS {
                poolProps: CUmemPoolProps::device(dev),
                accessDescs: std::ptr::null(),
                accessDescCount: 0,
                bytesize: size,
                dptr: 0,
            };
            let (mut na, mut nk, mut nf) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
            p.ck((p.cu.cuGraphAddMemAllocNode)(&mut na, g, std::ptr::null(), 0, &mut a), "cuGraphAddMemAllocNode")?;
            let k = CUDA_KERNEL_NODE_PARAMS {
                func: f,
                gridDimX: 1,
                gridDimY: 1,
                gridDimZ: 1,
                blockDimX: 32,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: 0,
                kernelParams: &mut arg,
                extra: std::ptr::null_mut(),
            };
            p.ck((p.cu.cuGraphAddKernelNode)(&mut nk, g, &na, 1, &k), "cuGraphAddKernelNode")?;
            p.ck((p.cu.cuGraphAddMemFreeNode)(&mut nf, g, &nk, 1, a.dptr), "cuGraphAddMemFreeNode")?;
            let mut e = std::ptr::null_mut();
            p.ck((p.cu.cuGraphInstantiateWithFlags)(&mut e, g, 0), "cuGraphInstantiateWithFlags")?;
            execs.push(e);
        }
        for &e in &execs {
            launches.push(p.name((p.cu.cuGraphLaunch)(e, std::ptr::null_mut())));
            p.sync()?;
        }
        let (pool_launched, after_launch) = (pool()?, mem_info(&p)?);
        let alloc = try_alloc();
        for e in execs {
            p.ck((p.cu.cuGraphExecDestroy)(e), "cuGraphExecDestroy")?;
        }
        let after_destroy = mem_info(&p)?;
        p.ck((p.cu.cuDeviceGraphMemTrim)(dev), "cuDeviceGraphMemTrim")?;
        let (pool_trimmed, after_trim) = (pool()?, mem_info(&p)?);
        let alloc_after_trim = try_alloc();
        Ok(json!({"size": size, "graphs": graphs, "base": base, "launches": launches, "pool": pool_launched,
            "after_launch": after_launch, "alloc": alloc, "after_destroy": after_destroy, "pool_after_trim": pool_trimmed,
            "after_trim": after_trim, "alloc_after_trim": alloc_after_trim}))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("info") => info(),
        Some("latency") => latency(&args[1..]),
        Some("alloc") => alloc(&args[1..], false),
        Some("hold") => alloc(&args[1..], true),
        Some("fill") => fill(&args[1..]),
        Some("spin") => spin(&args[1..]),
        Some("reset") => reset(&args[1..]),
        Some("graph-mem") => graph_mem(&args[1..]),
        Some("pool") => pool(&args[1..]),
        Some("pool-threads") => pool_threads(&args[1..]),
        Some("vmm") => vmm(&args[1..]),
        Some("stack") => stack(&args[1..]),
        _ => {
            eprintln!("usage: gpu-probe info | latency [--launches N] [--allocs N] [--size B] | alloc --size B | hold --size B | fill --chunk B [--pause] [--touch-last N --touch-bytes B] | reset --size B | spin [--ns NS] [--seconds S] [--start-at T] [--duty F] [--blocks-per-sm N] | pool --size B [--threshold B] [--destroyed-current | --own-current] | pool-threads --size B [--threads T] [--iters I] [--hold H] [--wait S] | vmm --size B | stack --bytes B --over BYTES | graph-mem --size B [--graphs N] [--alloc B]");
            std::process::exit(2);
        }
    };
    match r {
        Ok(v) => println!("{v}"),
        Err(e) => {
            println!("{}", json!({"error": e}));
            eprintln!("gpu-probe: {e}");
            std::process::exit(1);
        }
    }
}

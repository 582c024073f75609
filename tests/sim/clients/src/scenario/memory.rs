//! Memory scenarios: every allocator, stream-ordered pools, physical (VMM) allocations, context
//! limits that hold memory, a refused free, and threads allocating at once.

use super::*;

/// Context limits that hold device memory (stack, heap).
#[derive(Args, Debug)]
pub struct LimitsArgs {
    #[arg(long, default_value = "200m", value_parser = size)]
    pub heap: u64,
    #[arg(long, default_value = "64k", value_parser = size)]
    pub too_big: u64,
}

/// A free the driver refuses, then the free that follows.
#[derive(Args, Debug)]
pub struct FreeRefusedArgs {
    #[arg(long, default_value = "64m", value_parser = size)]
    pub size: u64,
}

/// A physical allocation kept by its mapping, then by a retained reference.
#[derive(Args, Debug)]
pub struct VmmArgs {
    #[arg(long, default_value = "256m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub alloc: u64,
}

/// What a stream-ordered pool holds after each step.
#[derive(Args, Debug)]
pub struct PoolArgs {
    #[arg(long, default_value = "256m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub alloc: u64,
    #[arg(long)]
    pub destroyed_current: bool,
    #[arg(long)]
    pub own_current: bool,
    #[arg(long)]
    pub reset: bool,
    #[arg(long, default_value = "async")]
    pub allocator: String,
    #[arg(long, default_value = "stream")]
    pub sync: String,
    #[arg(long)]
    pub stream_on: Option<String>,
    #[arg(long)]
    pub pool_on: Option<String>,
    #[arg(long)]
    pub threshold: Option<String>,
}

/// Allocate --size bytes in chunks with one allocator until done or refused.
#[derive(Args, Debug)]
pub struct AllocArgs {
    #[arg(long, default_value = "1m", value_parser = size)]
    pub size: u64,
    #[arg(long, value_parser = size)]
    pub chunk: Option<u64>,
    #[arg(long, default_value = "0", value_parser = size)]
    pub modules: u64,
    #[arg(long)]
    pub hold: bool,
    #[arg(long)]
    pub no_free: bool,
    #[arg(long, default_value = "device")]
    pub allocator: String,
    #[arg(long)]
    pub delay_secs: Option<f64>,
    #[arg(long)]
    pub hold_secs: Option<f64>,
}

/// Copy --size bytes host to device and back.
#[derive(Args, Debug)]
pub struct MemcpyArgs {
    #[arg(long, default_value = "1m", value_parser = size)]
    pub size: u64,
}

/// Threads allocating and freeing at once.
#[derive(Args, Debug)]
pub struct ThreadsArgs {
    #[arg(long, default_value = "16", value_parser = size)]
    pub threads: u64,
    #[arg(long, default_value = "100", value_parser = size)]
    pub iters: u64,
    #[arg(long, default_value = "1m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "device")]
    pub allocator: String,
}

/// Context limits that hold device memory: each step reports what the driver answered, the limit
/// as it reads back, and the memory left.
pub(super) fn limits(api: &Api, dev: i32, a: &LimitsArgs) -> Res<()> {
    const STACK: i32 = 0;
    const HEAP: i32 = 2;
    setup(api, dev)?;
    let heap = a.heap as usize;
    let too_big = a.too_big as usize;
    let mut d = 0;
    let (mut sms, mut threads) = (0, 0);
    // SAFETY: out-pointers to locals.
    unsafe {
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        ck(api, (api.cuDeviceGetAttribute)(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d), "attribute")?;
        ck(
            api,
            (api.cuDeviceGetAttribute)(&mut threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, d),
            "attribute",
        )?;
    }
    let step = |what: &str, limit: i32, value: usize| -> Value {
        let mut now = 0usize;
        // SAFETY: as above.
        let (r, g) = unsafe { ((api.cuCtxSetLimit)(limit, value), (api.cuCtxGetLimit)(&mut now, limit)) };
        json!({"step": what, "result": error_name(api, r), "get": error_name(api, g), "now": now, "mem_info": mem_info(api)})
    };
    let mut steps = vec![json!({"step": "base", "mem_info": mem_info(api)})];
    steps.push(step("stack", STACK, 4001));
    steps.push(step("heap", HEAP, heap));
    steps.push(step("too big", STACK, too_big));
    steps.push(step("heap lowered", HEAP, 8 << 20));
    steps.push(step("heap raised again", HEAP, heap));
    // SAFETY: the primary context retained by `setup`.
    unsafe { ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")? };
    steps.push(json!({"step": "reset", "mem_info": mem_info(api)}));
    steps.push(step("stack again", STACK, 4001));
    // SAFETY: released once (the retain of `setup`), then retained and made current again.
    unsafe {
        ck(api, (api.cuDevicePrimaryCtxRelease_v2)(d), "cuDevicePrimaryCtxRelease")?;
        let mut c = std::ptr::null_mut();
        ck(api, (api.cuDevicePrimaryCtxRetain)(&mut c, d), "cuDevicePrimaryCtxRetain")?;
        ck(api, (api.cuCtxSetCurrent)(c), "cuCtxSetCurrent")?;
    }
    steps.push(json!({"step": "released and retained", "mem_info": mem_info(api)}));
    // A context of its own: the same, released when it is destroyed.
    let mut own = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; the context made here is destroyed once.
    unsafe { ck(api, (api.cuCtxCreate_v2)(&mut own, 0, d), "cuCtxCreate")? };
    steps.push(step("own context's stack", STACK, 4001));
    // SAFETY: as above.
    unsafe { ck(api, (api.cuCtxDestroy_v2)(own), "cuCtxDestroy")? };
    steps.push(json!({"step": "own context destroyed", "mem_info": mem_info(api)}));
    emit(json!({"event": "limits", "sms": sms, "threads_per_sm": threads, "steps": steps}));
    Ok(())
}

/// A free the driver refuses leaves the allocation charged, and the free that follows releases it.
pub(super) fn free_refused(api: &Api, dev: i32, a: &FreeRefusedArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let base = mem_info(api);
    let mut p = 0;
    // SAFETY: out-pointers to locals; the pointer freed is the one just allocated, and the stream
    // handle one the driver made and destroyed (it checks the handle before it frees anything).
    unsafe {
        let mut gone = std::ptr::null_mut();
        ck(api, (api.cuStreamCreate)(&mut gone, 0), "cuStreamCreate")?;
        ck(api, (api.cuStreamDestroy_v2)(gone), "cuStreamDestroy")?;
        ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")?;
        let allocated = mem_info(api);
        let refused = (api.cuMemFreeAsync)(p, gone);
        let after_refusal = mem_info(api);
        ck(api, (api.cuMemFree_v2)(p), "cuMemFree")?;
        emit(json!({"event": "freed", "base": base, "allocated": allocated,
            "refused": error_name(api, refused), "after_refusal": after_refusal, "freed": mem_info(api)}));
    }
    Ok(())
}

/// See USAGE: a physical allocation kept by its mapping, then by a retained reference.
pub(super) fn vmm_steps(api: &Api, dev: i32, a: &VmmArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let probe = a.alloc as usize;
    let step = |name: &str, r: CUresult| {
        emit(json!({"event": "vmm", "step": name, "result": error_name(api, r), "mem_info": mem_info(api)}));
        if r == CUresult::SUCCESS {
            Ok(())
        } else {
            Err(format!("{name}: {}", error_name(api, r)))
        }
    };
    let try_alloc = |name: &str| {
        let mut p = 0;
        // SAFETY: an out-pointer to a local.
        let r = unsafe { (api.cuMemAlloc_v2)(&mut p, probe) };
        emit(json!({"event": "vmm", "step": name, "result": error_name(api, r), "bytes": probe}));
        if r == CUresult::SUCCESS {
            // SAFETY: the allocation just made.
            unsafe { (api.cuMemFree_v2)(p) };
        }
    };
    // SAFETY: (the whole block) calls through the bound table with out-pointers to locals and a
    // property block built here; handles and addresses are the driver's.
    unsafe {
        let prop = CUmemAllocationProp::device(dev);
        let mut g = 0;
        ck(api, (api.cuMemGetAllocationGranularity)(&mut g, &prop, 0), "cuMemGetAllocationGranularity")?;
        let size = size.div_ceil(g) * g;
        let (mut h, mut ptr) = (0u64, 0);
        step("created", (api.cuMemCreate)(&mut h, size, &prop, 0))?;
        ck(api, (api.cuMemAddressReserve)(&mut ptr, size, 0, 0, 0), "cuMemAddressReserve")?;
        step("mapped", (api.cuMemMap)(ptr, size, 0, h, 0))?;
        let acc = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        ck(api, (api.cuMemSetAccess)(ptr, size, &acc, 1), "cuMemSetAccess")?;
        step("released", (api.cuMemRelease)(h))?;
        if probe > 0 {
            try_alloc("alloc-while-mapped");
        }
        let mut again = 0u64;
        step("retained", (api.cuMemRetainAllocationHandle)(&mut again, ptr as *mut c_void))?;
        step("unmapped", (api.cuMemUnmap)(ptr, size))?;
        if probe > 0 {
            try_alloc("alloc-while-retained");
        }
        step("released-again", (api.cuMemRelease)(again))?;
        ck(api, (api.cuMemAddressFree)(ptr, size), "cuMemAddressFree")?;
        if probe > 0 {
            try_alloc("alloc-after");
        }
    }
    Ok(())
}

/// See USAGE: what a stream-ordered pool holds after each step.
pub(super) fn pool_steps(api: &Api, dev: i32, a: &PoolArgs) -> Res<()> {
    let ctx = setup(api, dev)?;
    let kind = a.allocator.as_str();
    let size = a.size as usize;
    let probe = a.alloc as usize;
    let sync = a.sync.as_str();
    if !matches!(kind, "async" | "pool" | "default") || !matches!(sync, "stream" | "ctx" | "ctx-v2") {
        return Err(format!("pool: --allocator {kind:?} --sync {sync:?}?\n{USAGE}"));
    }
    // SAFETY: (the whole function) calls through the bound table with out-pointers to locals and
    // property blocks built here; handles are the driver's.
    unsafe {
        let (mut d, mut s) = device_and_stream(api, dev)?;
        // The stream on another device's primary context, this one current again.
        let mut stream_ctx = None;
        if let Some(n) = a.stream_on.as_ref() {
            let n = n.parse().map_err(|_| format!("--stream-on {n:?}: a device ordinal"))?;
            let here = setup(api, dev)?;
            let there = setup(api, n)?;
            ck(api, (api.cuDeviceGet)(&mut d, n), "cuDeviceGet (stream)")?;
            ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate (stream)")?;
            ck(api, (api.cuCtxSetCurrent)(here), "cuCtxSetCurrent")?;
            stream_ctx = Some((here, there));
        }
        let mut pool = std::ptr::null_mut();
        if a.destroyed_current {
            // A pool of the application's own made the device's current one, drawn from, then
            // destroyed: the driver makes the default pool current again.
            let props = CUmemPoolProps::device(d);
            let mut own = std::ptr::null_mut();
            ck(api, (api.cuMemPoolCreate)(&mut own, &props), "cuMemPoolCreate")?;
            ck(api, (api.cuDeviceSetMemPool)(d, own), "cuDeviceSetMemPool")?;
            let mut p = 0;
            ck(api, (api.cuMemAllocAsync)(&mut p, 1 << 20, s), "cuMemAllocAsync")?;
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            ck(api, (api.cuMemPoolDestroy)(own), "cuMemPoolDestroy")?;
        }
        let mut here = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: d };
        if a.own_current {
            // The device's current pool drawn from once (so that whoever follows it has learned it),
            // then a pool of the application's own made current by the call of CUDA 13.0.
            let mut p = 0;
            ck(api, (api.cuMemAllocAsync)(&mut p, 1 << 20, s), "cuMemAllocAsync")?;
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            let props = CUmemPoolProps::device(d);
            let mut own = std::ptr::null_mut();
            ck(api, (api.cuMemPoolCreate)(&mut own, &props), "cuMemPoolCreate")?;
            ck(api, (api.cuMemSetMemPool)(&mut here, CU_MEM_ALLOCATION_TYPE_PINNED, own), "cuMemSetMemPool")?;
        }
        // Where the pool of --allocator pool or default is: --device's memory, or --pool-on's.
        let mut at = here;
        match a.pool_on.as_deref() {
            None => {}
            Some("host") => at = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_HOST_NUMA, id: 0 },
            Some(n) => {
                let n = n.parse().map_err(|_| format!("--pool-on {n:?}: a device ordinal or host"))?;
                ck(api, (api.cuDeviceGet)(&mut at.id, n), "cuDeviceGet")?;
            }
        }
        if kind == "default" {
            ck(
                api,
                (api.cuMemGetDefaultMemPool)(&mut pool, &mut at, CU_MEM_ALLOCATION_TYPE_PINNED),
                "cuMemGetDefaultMemPool",
            )?;
        } else if kind == "pool" {
            let props = CUmemPoolProps { location: at, ..CUmemPoolProps::device(d) };
            ck(api, (api.cuMemPoolCreate)(&mut pool, &props), "cuMemPoolCreate")?;
        } else if a.own_current {
            ck(api, (api.cuMemGetMemPool)(&mut pool, &mut here, CU_MEM_ALLOCATION_TYPE_PINNED), "cuMemGetMemPool")?;
        } else {
            ck(api, (api.cuDeviceGetMemPool)(&mut pool, d), "cuDeviceGetMemPool")?;
        }
        if let Some(t) = a.threshold.as_ref() {
            let mut t = parse_size(t).ok_or("--threshold needs a size")?;
            ck(
                api,
                (api.cuMemPoolSetAttribute)(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut t as *mut u64 as *mut c_void),
                "cuMemPoolSetAttribute",
            )?;
        }
        let report = |step: &str, r: CUresult| {
            let mut held = 0u64;
            (api.cuMemPoolGetAttribute)(
                pool,
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                &mut held as *mut u64 as *mut c_void,
            );
            let mut v = json!({"event": "pool", "step": step, "result": error_name(api, r), "mem_info": mem_info(api), "pool": held});
            if let Some((here, there)) = stream_ctx {
                (api.cuCtxSetCurrent)(there);
                v["stream_mem_info"] = mem_info(api);
                (api.cuCtxSetCurrent)(here);
            }
            emit(v);
        };
        let alloc = |p: &mut CUdeviceptr| {
            if kind != "async" {
                (api.cuMemAllocFromPoolAsync)(p, size, pool, s)
            } else {
                (api.cuMemAllocAsync)(p, size, s)
            }
        };
        let mut p = 0;
        let r = alloc(&mut p);
        report("allocated", r);
        ck(api, r, "allocation")?;
        if a.reset {
            // What cudaDeviceReset does with the allocation outstanding: the driver frees it.
            ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")?;
            setup(api, dev)?;
            emit(json!({"event": "pool", "step": "reset", "mem_info": mem_info(api)}));
            let mut q = 0;
            let r = (api.cuMemAlloc_v2)(&mut q, probe.max(1));
            emit(json!({"event": "pool", "step": "alloc-after-reset", "result": error_name(api, r)}));
            return Ok(());
        }
        report("freed", (api.cuMemFreeAsync)(p, s));
        report(
            "synchronised",
            match sync {
                "ctx" => (api.cuCtxSynchronize)(),
                "ctx-v2" => (api.cuCtxSynchronize_v2)(ctx),
                _ => (api.cuStreamSynchronize)(s),
            },
        );
        if probe > 0 {
            let mut q = 0;
            let r = (api.cuMemAlloc_v2)(&mut q, probe);
            report("alloc", r);
            if r == CUresult::SUCCESS {
                (api.cuMemFree_v2)(q);
            }
        }
        let r = alloc(&mut p);
        report("allocated-again", r);
        if r == CUresult::SUCCESS {
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
        }
        report("trimmed", (api.cuMemPoolTrimTo)(pool, 0));
    }
    Ok(())
}

pub(super) enum Chunk {
    Ptr(CUdeviceptr),
    Vmm { ptr: CUdeviceptr, size: usize, h: u64 },
    Async(CUdeviceptr),
    Array(CUarray),
    Mipmap(CUmipmappedArray),
    Host(*mut c_void),
}

pub(super) struct Allocator<'a> {
    api: &'a Api,
    kind: String,
    dev: i32,
    stream: CUstream,
    pool: CUmemoryPool,
}

impl Allocator<'_> {
    /// Allocates about `size` bytes; returns the chunk and the bytes it really takes.
    unsafe fn alloc(&self, size: usize) -> Result<(Chunk, usize), CUresult> {
        let a = self.api;
        let r = |r: CUresult| {
            if r == CUresult::SUCCESS {
                Ok(())
            } else {
                Err(r)
            }
        };
        // SAFETY: calls with out-pointers to locals and descriptors built here.
        unsafe {
            match self.kind.as_str() {
                "device" => {
                    let mut p = 0;
                    r((a.cuMemAlloc_v2)(&mut p, size))?;
                    Ok((Chunk::Ptr(p), size))
                }
                "managed" => {
                    let mut p = 0;
                    r((a.cuMemAllocManaged)(&mut p, size, 1))?;
                    Ok((Chunk::Ptr(p), size))
                }
                "pitch" => {
                    let (mut p, mut pitch) = (0, 0);
                    let h = size.div_ceil(4096).max(1);
                    r((a.cuMemAllocPitch_v2)(&mut p, &mut pitch, 4096, h, 16))?;
                    Ok((Chunk::Ptr(p), pitch * h))
                }
                "vmm" => {
                    let prop = CUmemAllocationProp::device(self.dev);
                    let mut g = 0;
                    r((a.cuMemGetAllocationGranularity)(&mut g, &prop, 0))?;
                    let sz = size.div_ceil(g) * g;
                    let mut h = 0;
                    r((a.cuMemCreate)(&mut h, sz, &prop, 0))?;
                    let mut ptr = 0;
                    if let Err(e) = r((a.cuMemAddressReserve)(&mut ptr, sz, 0, 0, 0)) {
                        (a.cuMemRelease)(h);
                        return Err(e);
                    }
                    r((a.cuMemMap)(ptr, sz, 0, h, 0))?;
                    let acc = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
                    r((a.cuMemSetAccess)(ptr, sz, &acc, 1))?;
                    Ok((Chunk::Vmm { ptr, size: sz, h }, sz))
                }
                "async" => {
                    let mut p = 0;
                    r((a.cuMemAllocAsync)(&mut p, size, self.stream))?;
                    Ok((Chunk::Async(p), size))
                }
                "pool" => {
                    let mut p = 0;
                    r((a.cuMemAllocFromPoolAsync)(&mut p, size, self.pool, self.stream))?;
                    Ok((Chunk::Async(p), size))
                }
                "array" => {
                    let d = float_array(size);
                    let mut arr = std::ptr::null_mut();
                    r((a.cuArray3DCreate_v2)(&mut arr, &d))?;
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Array(arr), req.size))
                }
                "array-v1" | "array3d-v1" => {
                    // The original entry points (32-bit extents), by their exported names.
                    let d = float_array(size);
                    let width = u32::try_from(d.Width).map_err(|_| CUresult::INVALID_VALUE)?;
                    let name = if self.kind == "array-v1" { "cuArrayCreate" } else { "cuArray3DCreate" };
                    let f = crate::driver_symbol(name).unwrap_or(std::ptr::null_mut());
                    if f.is_null() {
                        return Err(CUresult::NOT_FOUND);
                    }
                    let mut arr = std::ptr::null_mut();
                    if self.kind == "array-v1" {
                        type Create = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult;
                        let d = CUDA_ARRAY_DESCRIPTOR_v1 { Width: width, Height: 0, Format: d.Format, NumChannels: 1 };
                        r(std::mem::transmute::<*mut c_void, Create>(f)(&mut arr, &d))?;
                    } else {
                        type Create = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult;
                        let d = CUDA_ARRAY3D_DESCRIPTOR_v1 {
                            Width: width,
                            Format: d.Format,
                            NumChannels: 1,
                            ..Default::default()
                        };
                        r(std::mem::transmute::<*mut c_void, Create>(f)(&mut arr, &d))?;
                    }
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Array(arr), req.size))
                }
                "mipmap" => {
                    // A square 2D float texture with a full mip chain of about `size` bytes.
                    let side = ((size as f64 * 0.75 / 4.0).sqrt() as usize).max(1);
                    let d = CUDA_ARRAY3D_DESCRIPTOR {
                        Width: side,
                        Height: side,
                        Depth: 0,
                        Format: CU_AD_FORMAT_FLOAT,
                        NumChannels: 1,
                        Flags: 0,
                    };
                    let mut arr = std::ptr::null_mut();
                    r((a.cuMipmappedArrayCreate)(&mut arr, &d, 4))?;
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuMipmappedArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Mipmap(arr), req.size))
                }
                "host" => {
                    let mut p = std::ptr::null_mut();
                    r((a.cuMemAllocHost_v2)(&mut p, size))?;
                    Ok((Chunk::Host(p), size))
                }
                _ => Err(CUresult::NOT_SUPPORTED),
            }
        }
    }

    unsafe fn free(&self, c: Chunk) -> CUresult {
        let a = self.api;
        // SAFETY: frees what `alloc` returned, once.
        unsafe {
            match c {
                Chunk::Ptr(p) => (a.cuMemFree_v2)(p),
                Chunk::Vmm { ptr, size, h } => {
                    (a.cuMemUnmap)(ptr, size);
                    (a.cuMemAddressFree)(ptr, size);
                    (a.cuMemRelease)(h)
                }
                Chunk::Async(p) => (a.cuMemFreeAsync)(p, self.stream),
                Chunk::Array(x) => (a.cuArrayDestroy)(x),
                Chunk::Mipmap(x) => (a.cuMipmappedArrayDestroy)(x),
                Chunk::Host(p) => (a.cuMemFreeHost)(p),
            }
        }
    }
}

pub(super) fn alloc(api: &Api, dev: i32, a: &AllocArgs) -> Res<()> {
    setup(api, dev)?;
    let kind = a.allocator.as_str().to_owned();
    let size = a.size as usize;
    let chunk = (a.chunk.unwrap_or(size as u64) as usize).max(1);
    let mut al = Allocator { api, kind: kind.clone(), dev, stream: std::ptr::null_mut(), pool: std::ptr::null_mut() };
    // SAFETY: out-pointers to locals; the pool properties are fully initialised.
    unsafe {
        if kind == "async" || kind == "pool" {
            ck(api, (api.cuStreamCreate)(&mut al.stream, 0), "cuStreamCreate")?;
        }
        if kind == "pool" {
            let props = CUmemPoolProps::device(dev);
            ck(api, (api.cuMemPoolCreate)(&mut al.pool, &props), "cuMemPoolCreate")?;
        }
    }
    // Modules loaded first (as a framework loads its kernels): driver memory no allocation call sees.
    for _ in 0..a.modules {
        let mut m = std::ptr::null_mut();
        ck(
            api,
            // SAFETY: an out-pointer to a local and a NUL-terminated image.
            unsafe { (api.cuModuleLoadData)(&mut m, c"vgpu-sim module".as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
    }
    if let Some(s) = a.delay_secs {
        emit(json!({"event": "waiting", "pid": std::process::id(), "mem_info": mem_info(api)}));
        std::thread::sleep(std::time::Duration::from_secs_f64(s));
    }
    let mut chunks = Vec::new();
    let (mut done, mut taken, mut error) = (0usize, 0usize, Value::Null);
    while done < size {
        let this = chunk.min(size - done);
        // SAFETY: see Allocator.
        match unsafe { al.alloc(this) } {
            Ok((c, bytes)) => {
                chunks.push(c);
                done += this;
                taken += bytes;
            }
            Err(e) => {
                error = json!(error_name(api, e));
                break;
            }
        }
    }
    emit(json!({"event": "allocated", "pid": std::process::id(), "allocator": kind, "requested": size,
        "allocated": done, "bytes": taken, "chunks": chunks.len(), "error": error, "mem_info": mem_info(api)}));
    if a.hold {
        hold_forever();
    }
    if let Some(s) = a.hold_secs {
        std::thread::sleep(std::time::Duration::from_secs_f64(s));
    }
    if a.no_free {
        return Ok(());
    }
    let n = chunks.len();
    let mut failures = 0;
    for c in chunks {
        // SAFETY: each chunk is freed once.
        if unsafe { al.free(c) } != CUresult::SUCCESS {
            failures += 1;
        }
    }
    // SAFETY: plain calls on handles created above.
    unsafe {
        if !al.stream.is_null() {
            ck(api, (api.cuStreamSynchronize)(al.stream), "cuStreamSynchronize")?;
        }
        if !al.pool.is_null() {
            ck(api, (api.cuMemPoolTrimTo)(al.pool, 0), "cuMemPoolTrimTo")?;
            ck(api, (api.cuMemPoolDestroy)(al.pool), "cuMemPoolDestroy")?;
        }
    }
    emit(json!({"event": "freed", "chunks": n, "failures": failures, "mem_info": mem_info(api)}));
    if failures > 0 {
        return Err(format!("{failures} frees failed"));
    }
    Ok(())
}

pub(super) fn memcpy(api: &Api, dev: i32, a: &MemcpyArgs) -> Res<()> {
    setup(api, dev)?;
    let n = a.size as usize;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let mut back = vec![0u8; n];
    // SAFETY: host buffers of n bytes; the device buffer is n bytes.
    let ok = unsafe {
        let mut d = 0;
        ck(api, (api.cuMemAlloc_v2)(&mut d, n), "cuMemAlloc")?;
        ck(api, (api.cuMemcpyHtoD_v2)(d, src.as_ptr() as *const c_void, n), "cuMemcpyHtoD")?;
        ck(api, (api.cuMemcpyDtoH_v2)(back.as_mut_ptr() as *mut c_void, d, n), "cuMemcpyDtoH")?;
        let same = back == src;
        ck(api, (api.cuMemsetD8_v2)(d, 0xab, n), "cuMemsetD8")?;
        ck(api, (api.cuMemcpyDtoH_v2)(back.as_mut_ptr() as *mut c_void, d, n), "cuMemcpyDtoH")?;
        let set = back.iter().all(|&b| b == 0xab);
        let oob = (api.cuMemcpyHtoD_v2)(d + n as u64, src.as_ptr() as *const c_void, 1);
        ck(api, (api.cuMemFree_v2)(d), "cuMemFree")?;
        emit(
            json!({"event": "memcpy", "bytes": n, "roundtrip_ok": same, "memset_ok": set, "out_of_bounds": error_name(api, oob)}),
        );
        same && set
    };
    if ok {
        Ok(())
    } else {
        Err("data mismatch".into())
    }
}

pub(super) fn threads(api: &Api, dev: i32, a: &ThreadsArgs) -> Res<()> {
    let ctx = setup(api, dev)? as usize;
    let t = a.threads;
    let iters = a.iters;
    let size = a.size as usize;
    // Allocators that need no stream or pool of their own.
    let kind = a.allocator.as_str();
    if !["device", "managed", "pitch", "vmm", "array"].contains(&kind) {
        return Err(format!("threads: allocator {kind:?} is not one of device, managed, pitch, vmm, array"));
    }
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..t)
            .map(|_| {
                s.spawn(move || {
                    let mut errs = Vec::new();
                    let al = Allocator {
                        api,
                        kind: kind.to_owned(),
                        dev,
                        stream: std::ptr::null_mut(),
                        pool: std::ptr::null_mut(),
                    };
                    // SAFETY: the primary context stays retained for the process; each chunk is
                    // freed once, by the allocator that made it.
                    unsafe {
                        (api.cuCtxSetCurrent)(ctx as CUcontext);
                        for _ in 0..iters {
                            let c = match al.alloc(size) {
                                Ok((c, _)) => c,
                                Err(r) => {
                                    errs.push(error_name(api, r));
                                    continue;
                                }
                            };
                            let r = al.free(c);
                            if r != CUresult::SUCCESS {
                                errs.push(error_name(api, r));
                            }
                        }
                    }
                    errs
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    emit(
        json!({"event": "threads", "threads": t, "iters": iters, "failures": errors.len(), "errors": errors, "mem_info": mem_info(api)}),
    );
    Ok(())
}

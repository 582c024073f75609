//! The intercepted API, declared once. Each line names an exported entry point, its C signature and
//! the policy function it routes to (`pass` forwards unchanged); a `_ptsz` twin routes to its
//! sibling's function with `::<true>` (its default stream is the calling thread's). From these lists the macros generate
//! the table of real driver functions, the exported hook symbols, and the name -> hook map used by
//! the `dlsym` and `cuGetProcAddress` hooks. Every symbol not listed passes through untouched.

/// CUDA driver entry points (return `CUresult`).
macro_rules! cuda_hooks {
    ($m:ident) => {
        $m! {
            // the slice's MPS settings, before the driver reads them (see `mps`)
            cuInit(flags: u32) => mps::init;
            // the devices the process sees: its slice's (see `visible`)
            cuDeviceGetCount(n: *mut i32) => visible::count;
            cuDeviceGet(dev: *mut CUdevice, ordinal: i32) => visible::get;
            // contexts (their memory overhead is charged)
            cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) => memory::primary_retain;
            cuDevicePrimaryCtxRelease(dev: CUdevice) => memory::primary_release;
            cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => memory::primary_release;
            cuDevicePrimaryCtxReset(dev: CUdevice) => memory::primary_reset;
            cuDevicePrimaryCtxReset_v2(dev: CUdevice) => memory::primary_reset;
            cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, dev: CUdevice) => memory::ctx_create;
            cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, n: i32, flags: u32, dev: CUdevice) => memory::ctx_create_v3;
            cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut c_void, flags: u32, dev: CUdevice) => memory::ctx_create_v4;
            cuCtxDestroy(ctx: CUcontext) => memory::ctx_destroy;
            cuCtxDestroy_v2(ctx: CUcontext) => memory::ctx_destroy;
            // context limits that hold device memory (stack, printf FIFO, malloc heap)
            cuCtxSetLimit(limit: i32, value: usize) => memory::ctx_set_limit;
            // streams (a launch's device is its stream's, remembered per thread until one goes)
            cuStreamDestroy(stream: CUstream) => memory::stream_destroy;
            cuStreamDestroy_v2(stream: CUstream) => memory::stream_destroy;
            // linear memory
            cuMemAlloc(dptr: *mut u32, size: u32) => memory::alloc_v1;
            cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => memory::alloc_v2;
            cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) => memory::alloc_pitch;
            cuMemAllocPitch(dptr: *mut u32, pitch: *mut u32, width: u32, height: u32, elem: u32) => memory::alloc_pitch_v1;
            cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: u32) => memory::alloc_managed;
            cuMemFree(dptr: u32) => memory::free_v1;
            cuMemFree_v2(dptr: CUdeviceptr) => memory::free_v2;
            // virtual memory management
            cuMemCreate(handle: *mut u64, size: usize, prop: *const CUmemAllocationProp, flags: u64) => memory::vmm_create;
            cuMemRelease(handle: u64) => vmm::release;
            cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, flags: u64) => vmm::map;
            cuMemUnmap(ptr: CUdeviceptr, size: usize) => vmm::unmap;
            cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) => vmm::retain;
            // stream-ordered allocator
            cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => memory::alloc_async::<false>;
            cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => memory::alloc_async::<true>;
            cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => memory::alloc_from_pool::<false>;
            cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => memory::alloc_from_pool::<true>;
            cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => memory::free_async;
            cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => memory::free_async;
            // what the pools hold beyond their allocations (see `pools`): settled where the driver
            // trims them, the pool `cuMemAllocAsync` draws from, and where each pool's memory is
            cuStreamSynchronize(stream: CUstream) => pools::stream_sync;
            cuStreamSynchronize_ptsz(stream: CUstream) => pools::stream_sync;
            cuCtxSynchronize() => pools::ctx_sync;
            cuCtxSynchronize_v2(ctx: CUcontext) => pools::ctx_sync_v2;
            cuEventSynchronize(event: CUevent) => pools::event_sync;
            cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) => pools::trim_to;
            cuMemPoolDestroy(pool: CUmemoryPool) => pools::destroy;
            cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) => pools::set_current;
            // where each pool's memory is (a device's, or the host's)
            cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) => pools::create;
            cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => pools::get_default;
            cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) => pools::get_current;
            // the same for a location and an allocation type (CUDA 13.0; a device's pinned memory
            // is what cuMemAllocAsync draws)
            cuMemSetMemPool(loc: *mut CUmemLocation, kind: i32, pool: CUmemoryPool) => pools::mem_set_current;
            cuMemGetDefaultMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: i32) => pools::mem_get_default;
            cuMemGetMemPool(pool: *mut CUmemoryPool, loc: *mut CUmemLocation, kind: i32) => pools::mem_get_current;
            // arrays
            cuArrayCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => memory::array_create;
            cuArray3DCreate_v2(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => memory::array3d_create;
            // the original entry points (32-bit extents), still exported beside the `_v2` ones
            cuArrayCreate(arr: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) => memory::array_create_v1;
            cuArray3DCreate(arr: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) => memory::array3d_create_v1;
            cuArrayDestroy(arr: CUarray) => memory::array_destroy;
            cuMipmappedArrayCreate(arr: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32) => memory::mipmapped_create;
            cuMipmappedArrayDestroy(arr: CUmipmappedArray) => memory::mipmapped_destroy;
            // what the container sees
            cuMemGetInfo(free: *mut u32, total: *mut u32) => memory::get_info_v1;
            cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => memory::get_info_v2;
            cuDeviceTotalMem(bytes: *mut u32, dev: CUdevice) => memory::total_mem_v1;
            cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) => memory::total_mem_v2;
            // entry points handed out by the driver
            cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) => procaddr::get_v1;
            cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) => procaddr::get_v2;
            // launches: throttled by the SM-time controller
            cuLaunchKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => sm::launch_kernel::<false>;
            cuLaunchKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => sm::launch_kernel::<true>;
            cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => sm::launch_kernel_ex::<false>;
            cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => sm::launch_kernel_ex::<true>;
            cuLaunchCooperativeKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, stream: CUstream, params: *mut *mut c_void) => sm::launch_cooperative::<false>;
            cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, stream: CUstream, params: *mut *mut c_void) => sm::launch_cooperative::<true>;
            cuLaunchCooperativeKernelMultiDevice(list: *mut CUDA_LAUNCH_PARAMS, n: u32, flags: u32) => sm::launch_cooperative_multi;
            // the deprecated launch API (block shape and parameters set on the function beforehand)
            cuLaunch(f: CUfunction) => sm::launch_legacy;
            cuLaunchGrid(f: CUfunction, w: i32, h: i32) => sm::launch_grid;
            cuLaunchGridAsync(f: CUfunction, w: i32, h: i32, stream: CUstream) => sm::launch_grid_async;
            cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => sm::graph_launch::<false>;
            cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => sm::graph_launch::<true>;
            // modules unloaded (their functions' handles may name other kernels later) and executable
            // graphs whose work changes: SM estimates are forgotten
            cuModuleUnload(m: CUmodule) => stale::module_unload;
            cuLibraryUnload(lib: CUlibrary) => stale::library_unload;
            cuGraphExecDestroy(exec: CUgraphExec) => stale::exec_destroy;
            cuGraphExecUpdate(exec: CUgraphExec, graph: CUgraph, err_node: *mut CUgraphNode, result: *mut i32) => stale::exec_update;
            cuGraphExecUpdate_v2(exec: CUgraphExec, graph: CUgraph, info: *mut CUgraphExecUpdateResultInfo) => stale::exec_update_v2;
            cuGraphExecKernelNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS) => stale::kernel_node_set;
            cuGraphExecKernelNodeSetParams_v2(exec: CUgraphExec, node: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS_v2) => stale::kernel_node_set_v2;
            cuGraphExecNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *mut CUgraphNodeParams) => stale::node_set;
            cuGraphExecChildGraphNodeSetParams(exec: CUgraphExec, node: CUgraphNode, child: CUgraph) => stale::child_graph_set;
            cuGraphNodeSetEnabled(exec: CUgraphExec, node: CUgraphNode, on: u32) => stale::node_enable;
            // graphs that allocate (graph memory nodes): the device's graph memory pool is charged
            cuGraphInstantiate(e: *mut CUgraphExec, g: CUgraph, err: *mut CUgraphNode, log: *mut c_char, n: usize) => graphmem::instantiate;
            cuGraphInstantiate_v2(e: *mut CUgraphExec, g: CUgraph, err: *mut CUgraphNode, log: *mut c_char, n: usize) => graphmem::instantiate;
            cuGraphInstantiateWithFlags(e: *mut CUgraphExec, g: CUgraph, flags: u64) => graphmem::instantiate_with_flags;
            cuGraphInstantiateWithParams(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) => graphmem::instantiate_with_params;
            cuGraphInstantiateWithParams_ptsz(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS) => graphmem::instantiate_with_params;
            cuGraphUpload(exec: CUgraphExec, stream: CUstream) => graphmem::upload;
            cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) => graphmem::upload;
            cuDeviceGraphMemTrim(dev: CUdevice) => graphmem::trim;
            // stream capture: launches into a graph being captured run nothing and are not charged
            cuStreamBeginCapture(stream: CUstream) => capture::begin_v1;
            cuStreamBeginCapture_ptsz(stream: CUstream) => capture::begin_v1;
            cuStreamBeginCapture_v2(stream: CUstream, mode: i32) => capture::begin;
            cuStreamBeginCapture_v2_ptsz(stream: CUstream, mode: i32) => capture::begin;
            cuStreamBeginCaptureToGraph(stream: CUstream, graph: CUgraph, deps: *const c_void, data: *const c_void, n: usize, mode: i32) => capture::begin_to_graph;
            cuStreamBeginCaptureToGraph_ptsz(stream: CUstream, graph: CUgraph, deps: *const c_void, data: *const c_void, n: usize, mode: i32) => capture::begin_to_graph;
            cuStreamEndCapture(stream: CUstream, graph: *mut CUgraph) => capture::end::<false>;
            cuStreamEndCapture_ptsz(stream: CUstream, graph: *mut CUgraph) => capture::end::<true>;
        }
    };
}

/// NVML entry points (return `nvmlReturn_t`).
macro_rules! nvml_hooks {
    ($m:ident) => {
        $m! {
            // the devices the process sees: its slice's (see `visible`)
            nvmlDeviceGetCount_v2(n: *mut u32) => visible::nvml_count;
            nvmlDeviceGetCount(n: *mut u32) => visible::nvml_count;
            nvmlDeviceGetHandleByIndex_v2(index: u32, dev: *mut NvmlDevice) => visible::nvml_by_index;
            nvmlDeviceGetHandleByIndex(index: u32, dev: *mut NvmlDevice) => visible::nvml_by_index;
            nvmlDeviceGetIndex(dev: NvmlDevice, index: *mut u32) => visible::nvml_index;
            nvmlDeviceGetHandleByUUID(uuid: *const c_char, dev: *mut NvmlDevice) => visible::nvml_by_uuid;
            nvmlDeviceGetHandleByPciBusId_v2(bus: *const c_char, dev: *mut NvmlDevice) => visible::nvml_by_pci;
            nvmlDeviceGetMemoryInfo(dev: NvmlDevice, mem: *mut NvmlMemory) => nvml::memory_info;
            nvmlDeviceGetMemoryInfo_v2(dev: NvmlDevice, mem: *mut NvmlMemoryV2) => nvml::memory_info_v2;
            nvmlDeviceGetUtilizationRates(dev: NvmlDevice, util: *mut NvmlUtilization) => nvml::utilization_rates;
            nvmlDeviceGetSamples(dev: NvmlDevice, kind: u32, last_seen: u64, value_type: *mut u32, count: *mut u32, samples: *mut NvmlSample) => nvml::samples;
            nvmlDeviceGetComputeRunningProcesses_v3(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetComputeRunningProcesses_v2(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetComputeRunningProcesses(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfoV1) => nvml::processes;
            nvmlDeviceGetGraphicsRunningProcesses_v3(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetGraphicsRunningProcesses_v2(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetGraphicsRunningProcesses(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfoV1) => nvml::processes;
            nvmlDeviceGetMPSComputeRunningProcesses_v3(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetMPSComputeRunningProcesses_v2(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfo) => nvml::processes;
            nvmlDeviceGetMPSComputeRunningProcesses(dev: NvmlDevice, count: *mut u32, infos: *mut NvmlProcessInfoV1) => nvml::processes;
            nvmlDeviceGetRunningProcessDetailList(dev: NvmlDevice, list: *mut NvmlProcessDetailList) => nvml::process_details;
            nvmlDeviceGetProcessUtilization(dev: NvmlDevice, samples: *mut NvmlProcessUtilizationSample, count: *mut u32, last_seen: u64) => nvml::process_utilization;
            nvmlDeviceGetProcessesUtilizationInfo(dev: NvmlDevice, info: *mut NvmlProcessesUtilizationInfo) => nvml::processes_utilization;
            nvmlInternalGetExportTable(table: *mut *const c_void, id: *const c_void) => smi::export_table;
        }
    };
}

/// Driver functions the policies call that are not intercepted.
macro_rules! cuda_helpers {
    ($m:ident) => {
        $m! {
            cuCtxGetDevice(dev: *mut CUdevice);
            cuCtxGetCurrent(ctx: *mut CUcontext);
            cuCtxGetLimit(v: *mut usize, limit: i32);
            cuDeviceGetAttribute(v: *mut i32, attr: i32, dev: CUdevice);
            cuDeviceGetCount(n: *mut i32);
            cuDeviceGet(dev: *mut CUdevice, ordinal: i32);
            cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice);
            cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, option: i32);
            cuArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, arr: CUarray, dev: CUdevice);
            cuMipmappedArrayGetMemoryRequirements(req: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, arr: CUmipmappedArray, dev: CUdevice);
            cuArrayDestroy(arr: CUarray);
            cuMipmappedArrayDestroy(arr: CUmipmappedArray);
            cuMemFree_v2(dptr: CUdeviceptr);
            cuEventCreate(e: *mut CUevent, flags: u32);
            cuEventRecord(e: CUevent, stream: CUstream);
            cuEventQuery(e: CUevent);
            cuStreamQuery(stream: CUstream);
            cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent);
            cuStreamIsCapturing(stream: CUstream, status: *mut i32);
            cuStreamGetCtx(stream: CUstream, ctx: *mut CUcontext);
            cuStreamGetCtx_v2(stream: CUstream, ctx: *mut CUcontext, green: *mut *mut c_void);
            cuCtxPushCurrent_v2(ctx: CUcontext);
            cuCtxPopCurrent_v2(ctx: *mut CUcontext);
            cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, n: *mut usize);
            cuGraphNodeGetType(node: CUgraphNode, ty: *mut i32);
            cuGraphMemAllocNodeGetParams(node: CUgraphNode, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS);
            cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: i32, v: *mut c_void);
            cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice);
            cuMemPoolGetAttribute(pool: CUmemoryPool, attr: i32, v: *mut c_void);
        }
    };
}

pub(crate) use {cuda_helpers, cuda_hooks, nvml_hooks};

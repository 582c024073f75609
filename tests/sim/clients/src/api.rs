//! The driver entry points the clients use, declared once (an x-macro): each binding path builds its
//! function table from this one list.

/// Calls `$cb!` with every entry point as `symbol = "base name" : fn(args);`.
#[macro_export]
macro_rules! with_cuda_api {
    ($cb:ident) => {
        $cb! {
            cuInit = "cuInit" : fn(flags: u32);
            cuDriverGetVersion = "cuDriverGetVersion" : fn(v: *mut i32);
            cuGetErrorName = "cuGetErrorName" : fn(e: CUresult, s: *mut *const c_char);
            cuDeviceGetCount = "cuDeviceGetCount" : fn(n: *mut i32);
            cuDeviceGet = "cuDeviceGet" : fn(d: *mut CUdevice, ordinal: i32);
            cuDeviceGetName = "cuDeviceGetName" : fn(name: *mut c_char, len: i32, d: CUdevice);
            cuDeviceGetUuid_v2 = "cuDeviceGetUuid" : fn(u: *mut CUuuid, d: CUdevice);
            cuDeviceTotalMem_v2 = "cuDeviceTotalMem" : fn(b: *mut usize, d: CUdevice);
            cuDeviceGetAttribute = "cuDeviceGetAttribute" : fn(v: *mut i32, attr: i32, d: CUdevice);
            cuDeviceGetPCIBusId = "cuDeviceGetPCIBusId" : fn(s: *mut c_char, len: i32, d: CUdevice);
            cuDevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain" : fn(c: *mut CUcontext, d: CUdevice);
            cuDevicePrimaryCtxRelease_v2 = "cuDevicePrimaryCtxRelease" : fn(d: CUdevice);
            cuDevicePrimaryCtxReset_v2 = "cuDevicePrimaryCtxReset" : fn(d: CUdevice);
            cuCtxCreate_v2 = "cuCtxCreate" : fn(c: *mut CUcontext, flags: u32, d: CUdevice);
            cuCtxDestroy_v2 = "cuCtxDestroy" : fn(c: CUcontext);
            cuCtxSetCurrent = "cuCtxSetCurrent" : fn(c: CUcontext);
            cuCtxSynchronize = "cuCtxSynchronize" : fn();
            cuCtxSynchronize_v2 = "cuCtxSynchronize_v2" : fn(c: CUcontext);
            cuCtxGetLimit = "cuCtxGetLimit" : fn(v: *mut usize, limit: i32);
            cuCtxSetLimit = "cuCtxSetLimit" : fn(limit: i32, v: usize);
            cuMemAlloc_v2 = "cuMemAlloc" : fn(d: *mut CUdeviceptr, size: usize);
            cuMemAllocPitch_v2 = "cuMemAllocPitch" : fn(d: *mut CUdeviceptr, pitch: *mut usize, w: usize, h: usize, elem: u32);
            cuMemAllocManaged = "cuMemAllocManaged" : fn(d: *mut CUdeviceptr, size: usize, flags: u32);
            cuMemFree_v2 = "cuMemFree" : fn(d: CUdeviceptr);
            cuMemGetInfo_v2 = "cuMemGetInfo" : fn(free: *mut usize, total: *mut usize);
            cuMemAllocHost_v2 = "cuMemAllocHost" : fn(p: *mut *mut c_void, size: usize);
            cuMemFreeHost = "cuMemFreeHost" : fn(p: *mut c_void);
            cuMemcpyHtoD_v2 = "cuMemcpyHtoD" : fn(dst: CUdeviceptr, src: *const c_void, n: usize);
            cuMemcpyDtoH_v2 = "cuMemcpyDtoH" : fn(dst: *mut c_void, src: CUdeviceptr, n: usize);
            cuMemsetD8_v2 = "cuMemsetD8" : fn(dst: CUdeviceptr, v: u8, n: usize);
            cuMemGetAllocationGranularity = "cuMemGetAllocationGranularity" : fn(g: *mut usize, p: *const CUmemAllocationProp, o: i32);
            cuMemCreate = "cuMemCreate" : fn(h: *mut u64, size: usize, p: *const CUmemAllocationProp, flags: u64);
            cuMemRelease = "cuMemRelease" : fn(h: u64);
            cuMemAddressReserve = "cuMemAddressReserve" : fn(p: *mut CUdeviceptr, size: usize, align: usize, addr: CUdeviceptr, flags: u64);
            cuMemAddressFree = "cuMemAddressFree" : fn(p: CUdeviceptr, size: usize);
            cuMemMap = "cuMemMap" : fn(p: CUdeviceptr, size: usize, off: usize, h: u64, flags: u64);
            cuMemUnmap = "cuMemUnmap" : fn(p: CUdeviceptr, size: usize);
            cuMemRetainAllocationHandle = "cuMemRetainAllocationHandle" : fn(h: *mut u64, addr: *mut c_void);
            cuMemSetAccess = "cuMemSetAccess" : fn(p: CUdeviceptr, size: usize, d: *const CUmemAccessDesc, n: usize);
            cuMemPoolCreate = "cuMemPoolCreate" : fn(p: *mut CUmemoryPool, props: *const CUmemPoolProps);
            cuMemPoolDestroy = "cuMemPoolDestroy" : fn(p: CUmemoryPool);
            cuMemPoolTrimTo = "cuMemPoolTrimTo" : fn(p: CUmemoryPool, keep: usize);
            cuMemPoolSetAttribute = "cuMemPoolSetAttribute" : fn(p: CUmemoryPool, attr: i32, v: *mut c_void);
            cuMemPoolGetAttribute = "cuMemPoolGetAttribute" : fn(p: CUmemoryPool, attr: i32, v: *mut c_void);
            cuDeviceGetMemPool = "cuDeviceGetMemPool" : fn(p: *mut CUmemoryPool, d: CUdevice);
            cuDeviceSetMemPool = "cuDeviceSetMemPool" : fn(d: CUdevice, p: CUmemoryPool);
            cuMemGetDefaultMemPool = "cuMemGetDefaultMemPool" : fn(p: *mut CUmemoryPool, l: *mut CUmemLocation, kind: i32);
            cuMemGetMemPool = "cuMemGetMemPool" : fn(p: *mut CUmemoryPool, l: *mut CUmemLocation, kind: i32);
            cuMemSetMemPool = "cuMemSetMemPool" : fn(l: *mut CUmemLocation, kind: i32, p: CUmemoryPool);
            cuMemAllocAsync = "cuMemAllocAsync" : fn(d: *mut CUdeviceptr, size: usize, s: CUstream);
            cuMemAllocFromPoolAsync = "cuMemAllocFromPoolAsync" : fn(d: *mut CUdeviceptr, size: usize, p: CUmemoryPool, s: CUstream);
            cuMemFreeAsync = "cuMemFreeAsync" : fn(d: CUdeviceptr, s: CUstream);
            cuArray3DCreate_v2 = "cuArray3DCreate" : fn(a: *mut CUarray, d: *const CUDA_ARRAY3D_DESCRIPTOR);
            cuArrayDestroy = "cuArrayDestroy" : fn(a: CUarray);
            cuArrayGetMemoryRequirements = "cuArrayGetMemoryRequirements" : fn(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUarray, d: CUdevice);
            cuMipmappedArrayCreate = "cuMipmappedArrayCreate" : fn(a: *mut CUmipmappedArray, d: *const CUDA_ARRAY3D_DESCRIPTOR, levels: u32);
            cuMipmappedArrayDestroy = "cuMipmappedArrayDestroy" : fn(a: CUmipmappedArray);
            cuMipmappedArrayGetMemoryRequirements = "cuMipmappedArrayGetMemoryRequirements" : fn(r: *mut CUDA_ARRAY_MEMORY_REQUIREMENTS, a: CUmipmappedArray, d: CUdevice);
            cuModuleLoadData = "cuModuleLoadData" : fn(m: *mut CUmodule, image: *const c_void);
            cuModuleUnload = "cuModuleUnload" : fn(m: CUmodule);
            cuModuleGetFunction = "cuModuleGetFunction" : fn(f: *mut CUfunction, m: CUmodule, name: *const c_char);
            cuLibraryLoadData = "cuLibraryLoadData" : fn(l: *mut CUlibrary, code: *const c_void, jo: *mut i32, jv: *mut *mut c_void, njo: u32, lo: *mut i32, lv: *mut *mut c_void, nlo: u32);
            cuLibraryUnload = "cuLibraryUnload" : fn(l: CUlibrary);
            cuLibraryGetKernel = "cuLibraryGetKernel" : fn(k: *mut CUkernel, l: CUlibrary, name: *const c_char);
            cuStreamCreate = "cuStreamCreate" : fn(s: *mut CUstream, flags: u32);
            cuStreamDestroy_v2 = "cuStreamDestroy" : fn(s: CUstream);
            cuStreamSynchronize = "cuStreamSynchronize" : fn(s: CUstream);
            cuStreamBeginCapture_v2 = "cuStreamBeginCapture" : fn(s: CUstream, mode: i32);
            cuStreamEndCapture = "cuStreamEndCapture" : fn(s: CUstream, g: *mut CUgraph);
            cuEventCreate = "cuEventCreate" : fn(e: *mut CUevent, flags: u32);
            cuEventRecord = "cuEventRecord" : fn(e: CUevent, s: CUstream);
            cuEventElapsedTime = "cuEventElapsedTime" : fn(ms: *mut f32, a: CUevent, b: CUevent);
            cuLaunchKernel = "cuLaunchKernel" : fn(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, s: CUstream, p: *mut *mut c_void, extra: *mut *mut c_void);
            cuLaunchKernelEx = "cuLaunchKernelEx" : fn(c: *const CUlaunchConfig, f: CUfunction, p: *mut *mut c_void, extra: *mut *mut c_void);
            cuLaunchCooperativeKernel = "cuLaunchCooperativeKernel" : fn(f: CUfunction, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, shm: u32, s: CUstream, p: *mut *mut c_void);
            cuFuncSetBlockShape = "cuFuncSetBlockShape" : fn(f: CUfunction, x: i32, y: i32, z: i32);
            cuParamSetSize = "cuParamSetSize" : fn(f: CUfunction, n: u32);
            cuParamSetv = "cuParamSetv" : fn(f: CUfunction, offset: i32, p: *mut c_void, n: u32);
            cuLaunch = "cuLaunch" : fn(f: CUfunction);
            cuLaunchGrid = "cuLaunchGrid" : fn(f: CUfunction, w: i32, h: i32);
            cuLaunchGridAsync = "cuLaunchGridAsync" : fn(f: CUfunction, w: i32, h: i32, s: CUstream);
            cuGraphCreate = "cuGraphCreate" : fn(g: *mut CUgraph, flags: u32);
            cuGraphAddKernelNode_v2 = "cuGraphAddKernelNode" : fn(n: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, nd: usize, p: *const CUDA_KERNEL_NODE_PARAMS_v2);
            cuGraphInstantiateWithFlags = "cuGraphInstantiate" : fn(e: *mut CUgraphExec, g: CUgraph, flags: u64);
            cuGraphInstantiateWithParams = "cuGraphInstantiateWithParams" : fn(e: *mut CUgraphExec, g: CUgraph, p: *mut CUDA_GRAPH_INSTANTIATE_PARAMS);
            cuGraphAddMemAllocNode = "cuGraphAddMemAllocNode" : fn(n: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, nd: usize, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS);
            cuGraphAddMemFreeNode = "cuGraphAddMemFreeNode" : fn(n: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, nd: usize, d: CUdeviceptr);
            cuGraphUpload = "cuGraphUpload" : fn(e: CUgraphExec, s: CUstream);
            cuDeviceGraphMemTrim = "cuDeviceGraphMemTrim" : fn(d: CUdevice);
            cuDeviceGetGraphMemAttribute = "cuDeviceGetGraphMemAttribute" : fn(d: CUdevice, attr: i32, v: *mut c_void);
            cuGraphLaunch = "cuGraphLaunch" : fn(e: CUgraphExec, s: CUstream);
            cuGraphExecDestroy = "cuGraphExecDestroy" : fn(e: CUgraphExec);
            cuGraphExecUpdate = "cuGraphExecUpdate" : fn(e: CUgraphExec, g: CUgraph, err: *mut CUgraphNode, result: *mut i32);
            cuGraphExecUpdate_v2 = "cuGraphExecUpdate" : fn(e: CUgraphExec, g: CUgraph, info: *mut CUgraphExecUpdateResultInfo);
            cuGraphExecKernelNodeSetParams = "cuGraphExecKernelNodeSetParams" : fn(e: CUgraphExec, n: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS);
            cuGraphExecKernelNodeSetParams_v2 = "cuGraphExecKernelNodeSetParams" : fn(e: CUgraphExec, n: CUgraphNode, p: *const CUDA_KERNEL_NODE_PARAMS_v2);
            cuGraphExecNodeSetParams = "cuGraphExecNodeSetParams" : fn(e: CUgraphExec, n: CUgraphNode, p: *mut CUgraphNodeParams);
            cuGraphNodeSetEnabled = "cuGraphNodeSetEnabled" : fn(e: CUgraphExec, n: CUgraphNode, on: u32);
            cuGraphAddChildGraphNode = "cuGraphAddChildGraphNode" : fn(n: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, nd: usize, child: CUgraph);
            cuGraphExecChildGraphNodeSetParams = "cuGraphExecChildGraphNodeSetParams" : fn(e: CUgraphExec, n: CUgraphNode, child: CUgraph);
        }
    };
}

/// Defines [`Api`] and its loader from the list.
#[macro_export]
#[doc(hidden)]
macro_rules! define_api {
    ($($name:ident = $base:literal : fn($($a:ident : $t:ty),*);)*) => {
        /// The entry points, however they were bound.
        #[allow(non_snake_case)]
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($t),*) -> CUresult,)*
        }

        impl Api {
            /// Builds the table from `get(symbol, base_name)`, which returns an entry point or NULL.
            ///
            /// # Safety
            /// `get` must return pointers to functions with the declared C signatures.
            pub unsafe fn load(mut get: impl FnMut(&str, &str) -> *mut c_void) -> Result<Api, String> {
                Ok(Api {
                    $($name: {
                        let p = get(stringify!($name), $base);
                        if p.is_null() {
                            return Err(format!("cannot resolve {} ({})", stringify!($name), $base));
                        }
                        // SAFETY: the caller guarantees p is this entry point.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($t),*) -> CUresult>(p) }
                    },)*
                })
            }

            /// Every (symbol, base name) of the table.
            pub const NAMES: &'static [(&'static str, &'static str)] = &[$((stringify!($name), $base)),*];
        }
    };
}

/// Declares the entry points as link-time imports and builds an [`Api`] from them (used by the
/// client that links `libcuda.so.1` directly).
#[macro_export]
macro_rules! define_direct {
    ($($name:ident = $base:literal : fn($($a:ident : $t:ty),*);)*) => {
        #[allow(non_snake_case, clippy::too_many_arguments)]
        mod imports {
            use $crate::abi::*;
            use std::ffi::{c_char, c_void};
            extern "C" {
                $(pub fn $name($($a: $t),*) -> CUresult;)*
            }
        }
        fn direct_api() -> $crate::Api {
            $crate::Api { $($name: imports::$name,)* }
        }
    };
}

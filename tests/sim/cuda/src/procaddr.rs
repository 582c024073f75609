//! `cuGetProcAddress`: which exported entry point answers a (name, CUDA version, flags) request.
//!
//! Each base name lists the versioned symbols by the CUDA version that introduced them, and the
//! per-thread-default-stream variants. The highest version not above the request wins, as in the
//! real driver (e.g. `cuMemAdvise` at 12000 is the v1 entry point, at 12020 `cuMemAdvise_v2`).

use crate::driver::R;
use std::ffi::c_void;
use vgpu_sim::abi::*;

type Versions = &'static [(i32, &'static str)];

/// (base name, default-stream symbols, per-thread-stream symbols)
static TABLE: &[(&str, Versions, Versions)] = &[
    ("cuInit", &[(2000, "cuInit")], &[]),
    ("cuDriverGetVersion", &[(2020, "cuDriverGetVersion")], &[]),
    ("cuGetErrorString", &[(6000, "cuGetErrorString")], &[]),
    ("cuGetErrorName", &[(6000, "cuGetErrorName")], &[]),
    ("cuGetProcAddress", &[(11030, "cuGetProcAddress"), (12000, "cuGetProcAddress_v2")], &[]),
    ("cuDeviceGetCount", &[(2000, "cuDeviceGetCount")], &[]),
    ("cuDeviceGet", &[(2000, "cuDeviceGet")], &[]),
    ("cuDeviceGetName", &[(2000, "cuDeviceGetName")], &[]),
    ("cuDeviceGetUuid", &[(9020, "cuDeviceGetUuid"), (11040, "cuDeviceGetUuid_v2")], &[]),
    ("cuDeviceTotalMem", &[(2000, "cuDeviceTotalMem"), (3020, "cuDeviceTotalMem_v2")], &[]),
    ("cuDeviceGetAttribute", &[(2000, "cuDeviceGetAttribute")], &[]),
    ("cuDeviceGetPCIBusId", &[(4010, "cuDeviceGetPCIBusId")], &[]),
    ("cuDeviceComputeCapability", &[(2000, "cuDeviceComputeCapability")], &[]),
    ("cuDevicePrimaryCtxRetain", &[(7000, "cuDevicePrimaryCtxRetain")], &[]),
    ("cuDevicePrimaryCtxRelease", &[(7000, "cuDevicePrimaryCtxRelease"), (11000, "cuDevicePrimaryCtxRelease_v2")], &[]),
    ("cuDevicePrimaryCtxReset", &[(7000, "cuDevicePrimaryCtxReset"), (11000, "cuDevicePrimaryCtxReset_v2")], &[]),
    ("cuDevicePrimaryCtxGetState", &[(7000, "cuDevicePrimaryCtxGetState")], &[]),
    (
        "cuDevicePrimaryCtxSetFlags",
        &[(7000, "cuDevicePrimaryCtxSetFlags"), (11000, "cuDevicePrimaryCtxSetFlags_v2")],
        &[],
    ),
    (
        "cuCtxCreate",
        &[(2000, "cuCtxCreate"), (3020, "cuCtxCreate_v2"), (11040, "cuCtxCreate_v3"), (12050, "cuCtxCreate_v4")],
        &[],
    ),
    ("cuCtxDestroy", &[(2000, "cuCtxDestroy"), (4000, "cuCtxDestroy_v2")], &[]),
    ("cuCtxPushCurrent", &[(2000, "cuCtxPushCurrent"), (4000, "cuCtxPushCurrent_v2")], &[]),
    ("cuCtxPopCurrent", &[(2000, "cuCtxPopCurrent"), (4000, "cuCtxPopCurrent_v2")], &[]),
    ("cuCtxSetCurrent", &[(4000, "cuCtxSetCurrent")], &[]),
    ("cuCtxGetCurrent", &[(4000, "cuCtxGetCurrent")], &[]),
    ("cuCtxGetDevice", &[(2000, "cuCtxGetDevice")], &[]),
    ("cuCtxSynchronize", &[(2000, "cuCtxSynchronize")], &[]),
    ("cuCtxSynchronize_v2", &[(13000, "cuCtxSynchronize_v2")], &[]),
    ("cuCtxGetLimit", &[(3010, "cuCtxGetLimit")], &[]),
    ("cuCtxSetLimit", &[(3010, "cuCtxSetLimit")], &[]),
    ("cuMemAlloc", &[(2000, "cuMemAlloc"), (3020, "cuMemAlloc_v2")], &[]),
    ("cuMemAllocPitch", &[(2000, "cuMemAllocPitch"), (3020, "cuMemAllocPitch_v2")], &[]),
    ("cuMemAllocManaged", &[(6000, "cuMemAllocManaged")], &[]),
    ("cuMemFree", &[(2000, "cuMemFree"), (3020, "cuMemFree_v2")], &[]),
    ("cuMemGetInfo", &[(2000, "cuMemGetInfo"), (3020, "cuMemGetInfo_v2")], &[]),
    ("cuMemGetAddressRange", &[(3020, "cuMemGetAddressRange_v2")], &[]),
    ("cuMemAllocHost", &[(3020, "cuMemAllocHost_v2")], &[]),
    ("cuMemHostAlloc", &[(2020, "cuMemHostAlloc")], &[]),
    ("cuMemFreeHost", &[(2000, "cuMemFreeHost")], &[]),
    ("cuMemAdvise", &[(8000, "cuMemAdvise"), (12020, "cuMemAdvise_v2")], &[]),
    (
        "cuMemPrefetchAsync",
        &[(8000, "cuMemPrefetchAsync"), (12020, "cuMemPrefetchAsync_v2")],
        &[(8000, "cuMemPrefetchAsync_ptsz"), (12020, "cuMemPrefetchAsync_v2_ptsz")],
    ),
    ("cuMemcpyHtoD", &[(3020, "cuMemcpyHtoD_v2")], &[(7000, "cuMemcpyHtoD_v2_ptds")]),
    ("cuMemcpyDtoH", &[(3020, "cuMemcpyDtoH_v2")], &[(7000, "cuMemcpyDtoH_v2_ptds")]),
    ("cuMemcpyDtoD", &[(3020, "cuMemcpyDtoD_v2")], &[(7000, "cuMemcpyDtoD_v2_ptds")]),
    ("cuMemcpy", &[(4000, "cuMemcpy")], &[(7000, "cuMemcpy_ptds")]),
    ("cuMemcpyHtoDAsync", &[(3020, "cuMemcpyHtoDAsync_v2")], &[(7000, "cuMemcpyHtoDAsync_v2_ptsz")]),
    ("cuMemcpyDtoHAsync", &[(3020, "cuMemcpyDtoHAsync_v2")], &[(7000, "cuMemcpyDtoHAsync_v2_ptsz")]),
    ("cuMemcpyAsync", &[(4000, "cuMemcpyAsync")], &[(7000, "cuMemcpyAsync_ptsz")]),
    ("cuMemsetD8", &[(3020, "cuMemsetD8_v2")], &[(7000, "cuMemsetD8_v2_ptds")]),
    ("cuMemsetD16", &[(3020, "cuMemsetD16_v2")], &[]),
    ("cuMemsetD32", &[(3020, "cuMemsetD32_v2")], &[(7000, "cuMemsetD32_v2_ptds")]),
    ("cuMemsetD8Async", &[(3020, "cuMemsetD8Async")], &[(7000, "cuMemsetD8Async_ptsz")]),
    ("cuMemsetD32Async", &[(3020, "cuMemsetD32Async")], &[(7000, "cuMemsetD32Async_ptsz")]),
    ("cuMemGetAllocationGranularity", &[(10020, "cuMemGetAllocationGranularity")], &[]),
    ("cuMemCreate", &[(10020, "cuMemCreate")], &[]),
    ("cuMemRelease", &[(10020, "cuMemRelease")], &[]),
    ("cuMemAddressReserve", &[(10020, "cuMemAddressReserve")], &[]),
    ("cuMemAddressFree", &[(10020, "cuMemAddressFree")], &[]),
    ("cuMemMap", &[(10020, "cuMemMap")], &[]),
    ("cuMemUnmap", &[(10020, "cuMemUnmap")], &[]),
    ("cuMemRetainAllocationHandle", &[(11000, "cuMemRetainAllocationHandle")], &[]),
    ("cuMemSetAccess", &[(10020, "cuMemSetAccess")], &[]),
    ("cuDeviceGetDefaultMemPool", &[(11020, "cuDeviceGetDefaultMemPool")], &[]),
    ("cuDeviceGetMemPool", &[(11020, "cuDeviceGetMemPool")], &[]),
    ("cuDeviceSetMemPool", &[(11020, "cuDeviceSetMemPool")], &[]),
    ("cuMemGetDefaultMemPool", &[(13000, "cuMemGetDefaultMemPool")], &[]),
    ("cuMemGetMemPool", &[(13000, "cuMemGetMemPool")], &[]),
    ("cuMemSetMemPool", &[(13000, "cuMemSetMemPool")], &[]),
    ("cuMemPoolCreate", &[(11020, "cuMemPoolCreate")], &[]),
    ("cuMemPoolDestroy", &[(11020, "cuMemPoolDestroy")], &[]),
    ("cuMemAllocAsync", &[(11020, "cuMemAllocAsync")], &[(11020, "cuMemAllocAsync_ptsz")]),
    ("cuMemAllocFromPoolAsync", &[(11020, "cuMemAllocFromPoolAsync")], &[(11020, "cuMemAllocFromPoolAsync_ptsz")]),
    ("cuMemFreeAsync", &[(11020, "cuMemFreeAsync")], &[(11020, "cuMemFreeAsync_ptsz")]),
    ("cuMemPoolTrimTo", &[(11020, "cuMemPoolTrimTo")], &[]),
    ("cuMemPoolSetAttribute", &[(11020, "cuMemPoolSetAttribute")], &[]),
    ("cuMemPoolGetAttribute", &[(11020, "cuMemPoolGetAttribute")], &[]),
    ("cuArrayCreate", &[(2000, "cuArrayCreate"), (3020, "cuArrayCreate_v2")], &[]),
    ("cuArray3DCreate", &[(2000, "cuArray3DCreate"), (3020, "cuArray3DCreate_v2")], &[]),
    ("cuArrayDestroy", &[(2000, "cuArrayDestroy")], &[]),
    ("cuArrayGetMemoryRequirements", &[(11060, "cuArrayGetMemoryRequirements")], &[]),
    ("cuMipmappedArrayCreate", &[(5000, "cuMipmappedArrayCreate")], &[]),
    ("cuMipmappedArrayDestroy", &[(5000, "cuMipmappedArrayDestroy")], &[]),
    ("cuMipmappedArrayGetMemoryRequirements", &[(11060, "cuMipmappedArrayGetMemoryRequirements")], &[]),
    ("cuModuleLoad", &[(2000, "cuModuleLoad")], &[]),
    ("cuModuleLoadData", &[(2000, "cuModuleLoadData")], &[]),
    ("cuModuleLoadDataEx", &[(2010, "cuModuleLoadDataEx")], &[]),
    ("cuModuleLoadFatBinary", &[(2000, "cuModuleLoadFatBinary")], &[]),
    ("cuModuleUnload", &[(2000, "cuModuleUnload")], &[]),
    ("cuModuleGetFunction", &[(2000, "cuModuleGetFunction")], &[]),
    ("cuLibraryLoadData", &[(12000, "cuLibraryLoadData")], &[]),
    ("cuLibraryUnload", &[(12000, "cuLibraryUnload")], &[]),
    ("cuLibraryGetKernel", &[(12000, "cuLibraryGetKernel")], &[]),
    ("cuKernelGetFunction", &[(12000, "cuKernelGetFunction")], &[]),
    ("cuFuncGetAttribute", &[(2020, "cuFuncGetAttribute")], &[]),
    ("cuStreamCreate", &[(2000, "cuStreamCreate")], &[]),
    ("cuStreamCreateWithPriority", &[(5050, "cuStreamCreateWithPriority")], &[]),
    ("cuStreamDestroy", &[(2000, "cuStreamDestroy"), (4000, "cuStreamDestroy_v2")], &[]),
    ("cuStreamSynchronize", &[(2000, "cuStreamSynchronize")], &[(7000, "cuStreamSynchronize_ptsz")]),
    ("cuStreamQuery", &[(2000, "cuStreamQuery")], &[(7000, "cuStreamQuery_ptsz")]),
    (
        "cuStreamBeginCapture",
        &[(10000, "cuStreamBeginCapture"), (10010, "cuStreamBeginCapture_v2")],
        &[(10000, "cuStreamBeginCapture_ptsz"), (10010, "cuStreamBeginCapture_v2_ptsz")],
    ),
    ("cuStreamEndCapture", &[(10000, "cuStreamEndCapture")], &[(10000, "cuStreamEndCapture_ptsz")]),
    (
        "cuStreamGetCtx",
        &[(9020, "cuStreamGetCtx"), (12050, "cuStreamGetCtx_v2")],
        &[(9020, "cuStreamGetCtx_ptsz"), (12050, "cuStreamGetCtx_v2_ptsz")],
    ),
    ("cuStreamIsCapturing", &[(10000, "cuStreamIsCapturing")], &[(10000, "cuStreamIsCapturing_ptsz")]),
    ("cuEventCreate", &[(2000, "cuEventCreate")], &[]),
    ("cuEventRecord", &[(2000, "cuEventRecord")], &[(7000, "cuEventRecord_ptsz")]),
    ("cuEventRecordWithFlags", &[(11010, "cuEventRecordWithFlags")], &[(11010, "cuEventRecordWithFlags_ptsz")]),
    ("cuEventQuery", &[(2000, "cuEventQuery")], &[]),
    ("cuEventSynchronize", &[(2000, "cuEventSynchronize")], &[]),
    ("cuEventElapsedTime", &[(2000, "cuEventElapsedTime")], &[]),
    ("cuEventDestroy", &[(2000, "cuEventDestroy"), (4000, "cuEventDestroy_v2")], &[]),
    ("cuLaunchKernel", &[(4000, "cuLaunchKernel")], &[(7000, "cuLaunchKernel_ptsz")]),
    ("cuLaunchKernelEx", &[(11060, "cuLaunchKernelEx")], &[(11060, "cuLaunchKernelEx_ptsz")]),
    ("cuLaunchCooperativeKernel", &[(9000, "cuLaunchCooperativeKernel")], &[(9000, "cuLaunchCooperativeKernel_ptsz")]),
    ("cuLaunchCooperativeKernelMultiDevice", &[(9000, "cuLaunchCooperativeKernelMultiDevice")], &[]),
    ("cuLaunch", &[(2000, "cuLaunch")], &[]),
    ("cuLaunchGrid", &[(2000, "cuLaunchGrid")], &[]),
    ("cuLaunchGridAsync", &[(2000, "cuLaunchGridAsync")], &[]),
    ("cuFuncSetBlockShape", &[(2000, "cuFuncSetBlockShape")], &[]),
    ("cuFuncSetSharedSize", &[(2000, "cuFuncSetSharedSize")], &[]),
    ("cuParamSetSize", &[(2000, "cuParamSetSize")], &[]),
    ("cuParamSeti", &[(2000, "cuParamSeti")], &[]),
    ("cuParamSetv", &[(2000, "cuParamSetv")], &[]),
    ("cuGraphCreate", &[(10000, "cuGraphCreate")], &[]),
    ("cuGraphDestroy", &[(10000, "cuGraphDestroy")], &[]),
    ("cuGraphAddKernelNode", &[(10000, "cuGraphAddKernelNode"), (12000, "cuGraphAddKernelNode_v2")], &[]),
    ("cuGraphGetNodes", &[(10000, "cuGraphGetNodes")], &[]),
    (
        "cuGraphInstantiate",
        &[(10000, "cuGraphInstantiate"), (11000, "cuGraphInstantiate_v2"), (12000, "cuGraphInstantiateWithFlags")],
        &[],
    ),
    ("cuGraphInstantiateWithFlags", &[(11040, "cuGraphInstantiateWithFlags")], &[]),
    (
        "cuGraphInstantiateWithParams",
        &[(12000, "cuGraphInstantiateWithParams")],
        &[(12000, "cuGraphInstantiateWithParams_ptsz")],
    ),
    ("cuGraphUpload", &[(11010, "cuGraphUpload")], &[(11010, "cuGraphUpload_ptsz")]),
    ("cuGraphNodeGetType", &[(10000, "cuGraphNodeGetType")], &[]),
    ("cuGraphAddMemAllocNode", &[(11040, "cuGraphAddMemAllocNode")], &[]),
    ("cuGraphAddMemFreeNode", &[(11040, "cuGraphAddMemFreeNode")], &[]),
    ("cuGraphMemAllocNodeGetParams", &[(11040, "cuGraphMemAllocNodeGetParams")], &[]),
    ("cuDeviceGetGraphMemAttribute", &[(11040, "cuDeviceGetGraphMemAttribute")], &[]),
    ("cuDeviceSetGraphMemAttribute", &[(11040, "cuDeviceSetGraphMemAttribute")], &[]),
    ("cuDeviceGraphMemTrim", &[(11040, "cuDeviceGraphMemTrim")], &[]),
    ("cuGraphLaunch", &[(10000, "cuGraphLaunch")], &[(10000, "cuGraphLaunch_ptsz")]),
    ("cuGraphExecDestroy", &[(10000, "cuGraphExecDestroy")], &[]),
    ("cuGraphExecUpdate", &[(10020, "cuGraphExecUpdate"), (12000, "cuGraphExecUpdate_v2")], &[]),
    (
        "cuGraphExecKernelNodeSetParams",
        &[(10010, "cuGraphExecKernelNodeSetParams"), (12000, "cuGraphExecKernelNodeSetParams_v2")],
        &[],
    ),
    ("cuGraphExecNodeSetParams", &[(12020, "cuGraphExecNodeSetParams")], &[]),
    ("cuGraphNodeSetEnabled", &[(11060, "cuGraphNodeSetEnabled")], &[]),
    ("cuGraphAddChildGraphNode", &[(10000, "cuGraphAddChildGraphNode")], &[]),
    ("cuGraphExecChildGraphNodeSetParams", &[(11010, "cuGraphExecChildGraphNodeSetParams")], &[]),
];

fn pick(v: Versions, ver: i32) -> Option<&'static str> {
    v.iter().filter(|(min, _)| *min <= ver).max_by_key(|(min, _)| *min).map(|(_, s)| *s)
}

/// Resolves `name` for CUDA `ver` and `flags`; returns (result, CUdriverProcAddressQueryResult).
pub fn get(name: &str, pfn: *mut *mut c_void, ver: i32, flags: u64) -> (R<()>, i32) {
    if pfn.is_null() || flags > CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM {
        return (Err(CUresult::INVALID_VALUE), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    }
    // SAFETY: pfn is non-null per the check above.
    unsafe { *pfn = std::ptr::null_mut() };
    let Some((_, def, ptds)) = TABLE.iter().find(|(b, _, _)| *b == name) else {
        return (Err(CUresult::NOT_FOUND), CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    };
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let sym = if per_thread { pick(ptds, ver).or_else(|| pick(def, ver)) } else { pick(def, ver) };
    let Some(sym) = sym else {
        return (Err(CUresult::NOT_FOUND), CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    };
    let f = crate::exports::symbol(sym).expect("procaddr table names an exported symbol");
    // SAFETY: as above.
    unsafe { *pfn = f };
    (Ok(()), CU_GET_PROC_ADDRESS_SUCCESS)
}

/// Every symbol the table names.
#[cfg(test)]
fn all_symbols() -> impl Iterator<Item = &'static str> {
    TABLE.iter().flat_map(|(_, a, b)| a.iter().chain(b.iter()).map(|(_, s)| *s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_symbol_is_exported() {
        for s in all_symbols() {
            assert!(crate::exports::symbol(s).is_some(), "{s} is in the table but not exported");
        }
    }

    #[test]
    fn versions_and_flags() {
        let mut p = std::ptr::null_mut();
        let sym = |name: &str, ver, flags| {
            let mut p = std::ptr::null_mut();
            let (r, st) = get(name, &mut p, ver, flags);
            r.map(|_| p).map_err(|e| (e, st))
        };
        assert_eq!(sym("cuMemAdvise", 12000, 0), Ok(crate::exports::symbol("cuMemAdvise").unwrap()));
        assert_eq!(sym("cuMemAdvise", 12020, 0), Ok(crate::exports::symbol("cuMemAdvise_v2").unwrap()));
        assert_eq!(sym("cuLaunchKernel", 12000, 2), Ok(crate::exports::symbol("cuLaunchKernel_ptsz").unwrap()));
        assert_eq!(sym("cuLaunchKernel", 12000, 1), Ok(crate::exports::symbol("cuLaunchKernel").unwrap()));
        assert_eq!(sym("cuMemAlloc", 12000, 2), Ok(crate::exports::symbol("cuMemAlloc_v2").unwrap()));
        assert_eq!(
            sym("cuMemAllocAsync", 11000, 0),
            Err((CUresult::NOT_FOUND, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT))
        );
        assert_eq!(sym("cuNoSuchThing", 12000, 0), Err((CUresult::NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)));
        assert_eq!(get("cuInit", &mut p, 12000, 7).0, Err(CUresult::INVALID_VALUE));
    }
}

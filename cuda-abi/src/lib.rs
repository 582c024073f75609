//! CUDA driver API types and constants, as laid out in `cuda.h` (only what the simulator, its test
//! clients and the interposer use). Result codes and enums are open integers: a value from a newer
//! driver is not UB. [`header`] is generated from the real `cuda.h` (`scripts/gen-cuda-abi.py`):
//! every entry point's parameters by kind and width, against which the interposer's declarations
//! are checked at compile time ([`abi`]).
#![allow(non_camel_case_types, non_snake_case)]
#![deny(clippy::too_many_lines)]

use std::ffi::c_void;

pub mod abi;
pub mod nvml;
#[rustfmt::skip]
pub mod header;

#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CUresult(pub u32);

impl CUresult {
    pub const SUCCESS: Self = Self(0);
    pub const INVALID_VALUE: Self = Self(1);
    pub const UNSUPPORTED_LIMIT: Self = Self(215);
    pub const OUT_OF_MEMORY: Self = Self(2);
    pub const NOT_INITIALIZED: Self = Self(3);
    pub const DEINITIALIZED: Self = Self(4);
    pub const NO_DEVICE: Self = Self(100);
    pub const INVALID_DEVICE: Self = Self(101);
    pub const INVALID_IMAGE: Self = Self(200);
    pub const INVALID_CONTEXT: Self = Self(201);
    pub const CONTEXT_ALREADY_CURRENT: Self = Self(202);
    pub const FILE_NOT_FOUND: Self = Self(301);
    pub const INVALID_HANDLE: Self = Self(400);
    pub const ILLEGAL_STATE: Self = Self(401);
    pub const NOT_FOUND: Self = Self(500);
    pub const NOT_READY: Self = Self(600);
    pub const ILLEGAL_ADDRESS: Self = Self(700);
    pub const LAUNCH_OUT_OF_RESOURCES: Self = Self(701);
    pub const COOPERATIVE_LAUNCH_TOO_LARGE: Self = Self(720);
    pub const NOT_PERMITTED: Self = Self(800);
    pub const NOT_SUPPORTED: Self = Self(801);
    pub const MPS_CONNECTION_FAILED: Self = Self(805);
    pub const STREAM_CAPTURE_UNSUPPORTED: Self = Self(900);
    pub const STREAM_CAPTURE_INVALIDATED: Self = Self(901);
    pub const STREAM_CAPTURE_UNMATCHED: Self = Self(903);
    pub const CAPTURED_EVENT: Self = Self(907);
    pub const GRAPH_EXEC_UPDATE_FAILURE: Self = Self(910);
    pub const UNKNOWN: Self = Self(999);

    pub fn is_ok(self) -> bool {
        self == Self::SUCCESS
    }

    /// (name, description) as `cuGetErrorName` / `cuGetErrorString` give them.
    pub fn describe(self) -> Option<(&'static str, &'static str)> {
        Some(match self.0 {
            0 => ("CUDA_SUCCESS", "no error"),
            1 => ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
            2 => ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
            3 => ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
            4 => ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
            100 => ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
            101 => ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
            200 => ("CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"),
            201 => ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
            202 => ("CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"),
            215 => ("CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"),
            301 => ("CUDA_ERROR_FILE_NOT_FOUND", "file not found"),
            400 => ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
            401 => ("CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"),
            500 => ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
            600 => ("CUDA_ERROR_NOT_READY", "device not ready"),
            700 => ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"),
            701 => ("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"),
            720 => ("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"),
            800 => ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
            801 => ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
            805 => (
                "CUDA_ERROR_MPS_CONNECTION_FAILED",
                "MPS client failed to connect to the MPS control daemon or the MPS server",
            ),
            900 => ("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"),
            901 => ("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"),
            907 => {
                ("CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream")
            }
            903 => (
                "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
                "operation would make the legacy stream depend on a capturing blocking stream",
            ),
            910 => ("CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the executable graph cannot be updated from that graph"),
            999 => ("CUDA_ERROR_UNKNOWN", "unknown error"),
            _ => return None,
        })
    }
}

pub type CUdevice = i32;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUlibrary = *mut c_void;
pub type CUkernel = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphNode = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

pub const CU_STREAM_LEGACY: usize = 0x1;
pub const CU_STREAM_PER_THREAD: usize = 0x2;

pub const CU_GET_PROC_ADDRESS_DEFAULT: u64 = 0;
pub const CU_GET_PROC_ADDRESS_LEGACY_STREAM: u64 = 1;
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
pub const CU_GET_PROC_ADDRESS_SUCCESS: i32 = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: i32 = 1;
pub const CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT: i32 = 2;

// cuDeviceGetAttribute
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: i32 = 1;
pub const CU_DEVICE_ATTRIBUTE_WARP_SIZE: i32 = 10;
pub const CU_DEVICE_ATTRIBUTE_CLOCK_RATE: i32 = 13;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: i32 = 16;
pub const CU_DEVICE_ATTRIBUTE_INTEGRATED: i32 = 18;
pub const CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: i32 = 33;
pub const CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: i32 = 34;
pub const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
pub const CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: i32 = 41;
pub const CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: i32 = 50;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: i32 = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: i32 = 76;
pub const CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: i32 = 83;
pub const CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: i32 = 89;
pub const CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: i32 = 95;
pub const CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: i32 = 102;
pub const CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: i32 = 115;
pub const CU_DEVICE_ATTRIBUTE_MAX: i32 = 140;

/// `cuMemAllocManaged` flag: accessible from any stream on any device.
pub const CU_MEM_ATTACH_GLOBAL: u32 = 1;

// Memory-pool attributes
pub const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: i32 = 4;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: i32 = 5;
pub const CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: i32 = 6;
pub const CU_MEMPOOL_ATTR_USED_MEM_CURRENT: i32 = 7;
pub const CU_MEMPOOL_ATTR_USED_MEM_HIGH: i32 = 8;

pub const CU_MEM_ALLOCATION_TYPE_PINNED: i32 = 1;
/// Managed (unified) memory, for the managed memory pools of CUDA 13.0.
pub const CU_MEM_ALLOCATION_TYPE_MANAGED: i32 = 2;
pub const CU_MEM_LOCATION_TYPE_DEVICE: i32 = 1;
/// Host memory (CUDA 12.2 and later): pools and physical allocations may live there.
pub const CU_MEM_LOCATION_TYPE_HOST: i32 = 2;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA: i32 = 3;
pub const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: i32 = 4;
pub const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: i32 = 3;

// CUarray_format
pub const CU_AD_FORMAT_UNSIGNED_INT8: u32 = 0x01;
pub const CU_AD_FORMAT_UNSIGNED_INT16: u32 = 0x02;
pub const CU_AD_FORMAT_UNSIGNED_INT32: u32 = 0x03;
pub const CU_AD_FORMAT_SIGNED_INT8: u32 = 0x08;
pub const CU_AD_FORMAT_SIGNED_INT16: u32 = 0x09;
pub const CU_AD_FORMAT_SIGNED_INT32: u32 = 0x0a;
pub const CU_AD_FORMAT_HALF: u32 = 0x10;
pub const CU_AD_FORMAT_FLOAT: u32 = 0x20;

pub const CU_STREAM_CAPTURE_STATUS_NONE: i32 = 0;
pub const CU_STREAM_CAPTURE_STATUS_ACTIVE: i32 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: u32,
    pub NumChannels: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: u32,
    pub NumChannels: u32,
    pub Flags: u32,
}

/// The descriptor of the original (pre-3.2) `cuArrayCreate`: 32-bit extents. The driver still
/// exports that entry point beside `cuArrayCreate_v2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_DESCRIPTOR_v1 {
    pub Width: u32,
    pub Height: u32,
    pub Format: u32,
    pub NumChannels: u32,
}

/// The descriptor of the original `cuArray3DCreate`: 32-bit extents.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY3D_DESCRIPTOR_v1 {
    pub Width: u32,
    pub Height: u32,
    pub Depth: u32,
    pub Format: u32,
    pub NumChannels: u32,
    pub Flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUDA_ARRAY_MEMORY_REQUIREMENTS {
    pub size: usize,
    pub alignment: usize,
    pub reserved: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemLocation {
    pub type_: i32,
    pub id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemAllocationPropAllocFlags {
    pub compressionType: u8,
    pub gpuDirectRDMACapable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemAllocationProp {
    pub type_: i32,
    pub requestedHandleTypes: i32,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: CUmemAllocationPropAllocFlags,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUmemPoolProps {
    pub allocType: i32,
    pub handleTypes: i32,
    pub location: CUmemLocation,
    pub win32SecurityAttributes: *mut c_void,
    pub maxSize: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

impl CUmemAllocationProp {
    /// Pinned device memory on CUDA device `ordinal`, no shareable handles: a plain `cuMemCreate`.
    pub fn device(ordinal: CUdevice) -> CUmemAllocationProp {
        CUmemAllocationProp {
            type_: CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: 0,
            location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: Default::default(),
        }
    }
}

impl CUmemPoolProps {
    /// Pinned device memory on CUDA device `ordinal`, no shareable handles: what the default pool
    /// of a device and graph allocations have.
    pub fn device(ordinal: CUdevice) -> CUmemPoolProps {
        CUmemPoolProps {
            allocType: CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: 0,
            location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUlaunchConfig {
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub hStream: CUstream,
    pub attrs: *mut c_void,
    pub numAttrs: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS {
    pub func: CUfunction,
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub kernelParams: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_KERNEL_NODE_PARAMS_v2 {
    pub func: CUfunction,
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub kernelParams: *mut *mut c_void,
    pub extra: *mut *mut c_void,
    pub kern: *mut c_void,
    pub ctx: CUcontext,
}

/// `cuGraphExecUpdate_v2`'s report (`CUgraphExecUpdateResultInfo`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUgraphExecUpdateResultInfo {
    pub result: i32,
    pub errorNode: CUgraphNode,
    pub errorFromNode: CUgraphNode,
}

pub const CU_GRAPH_EXEC_UPDATE_SUCCESS: i32 = 0;
pub const CU_GRAPH_EXEC_UPDATE_ERROR: i32 = 1;
pub const CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED: i32 = 2;
pub const CU_GRAPH_NODE_TYPE_KERNEL: i32 = 0;
pub const CU_GRAPH_NODE_TYPE_GRAPH: i32 = 4;
pub const CU_GRAPH_NODE_TYPE_MEM_ALLOC: i32 = 10;
pub const CU_GRAPH_NODE_TYPE_MEM_FREE: i32 = 11;

/// `CUgraphMem_attribute`: the device's graph memory pool (`cuDeviceGetGraphMemAttribute`).
pub const CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: i32 = 0;
pub const CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: i32 = 1;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: i32 = 2;
pub const CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: i32 = 3;

/// `CUgraphInstantiate_flags`.
pub const CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: u64 = 1;
pub const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (`_v1`): a graph allocation node; `dptr` is written by the driver.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub poolProps: CUmemPoolProps,
    pub accessDescs: *const CUmemAccessDesc,
    pub accessDescCount: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (`cuGraphInstantiateWithParams`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_GRAPH_INSTANTIATE_PARAMS {
    pub flags: u64,
    pub hUploadStream: CUstream,
    pub hErrNode_out: CUgraphNode,
    pub result_out: i32,
}

/// `CUgraphNodeParams` (CUDA 12.2): a node type and a union of per-type parameters, of which only
/// the kernel's is spelled out here (`CUDA_KERNEL_NODE_PARAMS_v3` has the layout of `_v2`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUgraphNodeParams {
    pub type_: i32,
    pub reserved0: [i32; 3],
    pub u: CUgraphNodeParamsUnion,
    pub reserved2: i64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union CUgraphNodeParamsUnion {
    pub reserved1: [i64; 29],
    pub kernel: CUDA_KERNEL_NODE_PARAMS_v2,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUDA_LAUNCH_PARAMS {
    pub function: CUfunction,
    pub gridDimX: u32,
    pub gridDimY: u32,
    pub gridDimZ: u32,
    pub blockDimX: u32,
    pub blockDimY: u32,
    pub blockDimZ: u32,
    pub sharedMemBytes: u32,
    pub hStream: CUstream,
    pub kernelParams: *mut *mut c_void,
}

// Layouts as in cuda.h on x86-64.
const _: () = {
    assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
    assert!(std::mem::size_of::<CUmemPoolProps>() == 88);
    assert!(std::mem::size_of::<CUlaunchConfig>() == 56);
    assert!(std::mem::size_of::<CUDA_KERNEL_NODE_PARAMS>() == 56);
    assert!(std::mem::size_of::<CUDA_KERNEL_NODE_PARAMS_v2>() == 72);
    assert!(std::mem::size_of::<CUgraphExecUpdateResultInfo>() == 24);
    assert!(std::mem::size_of::<CUgraphNodeParams>() == 256);
    assert!(std::mem::size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>() == 120);
    assert!(std::mem::offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize) == 104);
    assert!(std::mem::size_of::<CUDA_GRAPH_INSTANTIATE_PARAMS>() == 32);
    assert!(std::mem::offset_of!(CUgraphNodeParams, u) == 16);
    assert!(std::mem::size_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 40);
    assert!(std::mem::size_of::<CUDA_ARRAY_DESCRIPTOR_v1>() == 16);
    assert!(std::mem::size_of::<CUDA_ARRAY3D_DESCRIPTOR_v1>() == 24);
    assert!(std::mem::size_of::<CUDA_ARRAY_MEMORY_REQUIREMENTS>() == 32);
};

//! NVML's types and return codes, as laid out in `nvml.h` (what the interposer uses): the ABI
//! beside CUDA's, below everything that calls NVML.
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_void;

pub type NvmlReturn = u32;
pub type NvmlDevice = *mut c_void;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlUtilization_t`: percent of the last sample period a kernel ran, and memory was read or
/// written.
#[repr(C)]
pub struct NvmlUtilization {
    pub gpu: u32,
    pub memory: u32,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlSample_t`: a CPU timestamp (us) and an `nvmlValue_t` (a union of 8 bytes; utilization
/// samples are its `unsigned int` member, the first 4 bytes).
#[repr(C)]
pub struct NvmlSample {
    pub timestamp: u64,
    pub value: NvmlValue,
}

/// `nvmlValue_t`: the member read here, and the widest (which gives the union its 8 bytes).
#[repr(C)]
pub union NvmlValue {
    pub ui: u32,
    pub ull: u64,
}

/// `nvmlProcessInfo_v1_t`: what the unversioned `nvmlDevice*RunningProcesses` fill.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessInfoV1 {
    pub pid: u32,
    pub used_gpu_memory: u64,
}

/// `nvmlProcessInfo_t` (`_v2` and `_v3` fill the same layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessInfo {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

/// `nvmlProcessDetail_v1_t` (`nvmlDeviceGetRunningProcessDetailList`, R550+).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessDetail {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub used_gpu_cc_protected_memory: u64,
}

/// `nvmlProcessDetailList_v1_t`.
#[repr(C)]
pub struct NvmlProcessDetailList {
    pub version: u32,
    pub mode: u32,
    pub num_proc_array_entries: u32,
    pub proc_array: *mut NvmlProcessDetail,
}

/// `nvmlProcessUtilizationSample_t` (`nvmlDeviceGetProcessUtilization`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessUtilizationSample {
    pub pid: u32,
    pub time_stamp: u64,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
}

/// `nvmlProcessUtilizationInfo_v1_t` (`nvmlDeviceGetProcessesUtilizationInfo`, R550+).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct NvmlProcessUtilizationInfo {
    pub time_stamp: u64,
    pub pid: u32,
    pub sm_util: u32,
    pub mem_util: u32,
    pub enc_util: u32,
    pub dec_util: u32,
    pub jpg_util: u32,
    pub ofa_util: u32,
}

/// `nvmlProcessesUtilizationInfo_v1_t`.
#[repr(C)]
pub struct NvmlProcessesUtilizationInfo {
    pub version: u32,
    pub process_samples_count: u32,
    pub last_seen_time_stamp: u64,
    pub proc_util_array: *mut NvmlProcessUtilizationInfo,
}

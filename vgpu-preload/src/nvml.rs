//! NVML inside the container: memory info shows the container's slice, and the process list shows
//! the container's processes (so `nvidia-smi` in the container shows its slice). Devices are matched
//! to the region by UUID; devices without a limit, and MIG devices, pass through.
#![allow(clippy::missing_safety_doc)]

use crate::real::{nvml, nvml_fns as f};
use crate::state::state;
use std::ffi::{c_char, c_void, CStr};

pub type NvmlReturn = u32;
pub type NvmlDevice = *mut c_void;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;
pub const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: u32,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct NvmlProcessInfo {
    pub pid: u32,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
}

const _: () = assert!(std::mem::size_of::<NvmlProcessInfo>() == 24 && std::mem::size_of::<NvmlMemoryV2>() == 40);

/// The region device of an NVML handle, if it has a limit.
fn limited_device(dev: NvmlDevice) -> Option<(usize, u64)> {
    let st = state();
    let r = st.region.as_ref()?;
    let get = nvml().nvmlDeviceGetUUID?;
    let mut buf = [0 as c_char; 96];
    // SAFETY: buffer of 96 bytes as declared.
    if unsafe { get(dev, buf.as_mut_ptr(), 96) } != NVML_SUCCESS {
        return None;
    }
    // SAFETY: NVML wrote a NUL-terminated string.
    let uuid = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().ok()?;
    let d = match r.find_device(uuid) {
        Some(d) => d,
        // Not used through CUDA in this container yet (nvidia-smi before any CUDA process, or a
        // process that only uses NVML): bound like CUDA would bind it.
        None => {
            let mut index = 0u32;
            // SAFETY: out-pointer to a local.
            if unsafe { nvml().nvmlDeviceGetIndex?(dev, &mut index) } != NVML_SUCCESS {
                return None;
            }
            st.bind_nvml(index as usize, uuid)?
        }
    };
    let limit = st.mem_limit(d);
    (limit != 0).then_some((d, limit))
}

/// The slice's (total, used) to answer a memory query of `dev` with: when the device is limited and
/// NVML answered `r` (the GPU's `total`, read only after a success), or has no memory figures for
/// it (a unified-memory GPU, GB10, answers NOT_SUPPORTED: the slice is then all the container has,
/// and it is told so).
fn sliced(r: NvmlReturn, dev: NvmlDevice, total: impl FnOnce() -> u64) -> Option<(u64, u64)> {
    let total = match r {
        NVML_SUCCESS => total(),
        NVML_ERROR_NOT_SUPPORTED => u64::MAX,
        _ => return None,
    };
    let (d, limit) = limited_device(dev)?;
    let t = total.min(limit);
    Some((t, state().used(d).min(t)))
}

pub unsafe fn memory_info(real: f::nvmlDeviceGetMemoryInfo, dev: NvmlDevice, m: *mut NvmlMemory) -> NvmlReturn {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(dev, m) };
    if m.is_null() {
        return r;
    }
    // SAFETY: m is non-null, and NVML filled it if it reported success.
    let Some((t, u)) = sliced(r, dev, || unsafe { (*m).total }) else { return r };
    // SAFETY: as above.
    let m = unsafe { &mut *m };
    (m.total, m.used, m.free) = (t, u, t - u);
    NVML_SUCCESS
}

pub unsafe fn memory_info_v2(real: f::nvmlDeviceGetMemoryInfo_v2, dev: NvmlDevice, m: *mut NvmlMemoryV2) -> NvmlReturn {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let r = unsafe { real(dev, m) };
    if m.is_null() {
        return r;
    }
    // SAFETY: m is non-null, and NVML filled it if it reported success.
    let Some((t, u)) = sliced(r, dev, || unsafe { (*m).total }) else { return r };
    // SAFETY: as above.
    let m = unsafe { &mut *m };
    (m.total, m.reserved, m.used, m.free) = (t, 0, u, t - u);
    NVML_SUCCESS
}

/// The running processes, restricted to the container's own (by PID as recorded in the region).
pub unsafe fn processes(
    real: f::nvmlDeviceGetComputeRunningProcesses_v3,
    dev: NvmlDevice,
    count: *mut u32,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    if count.is_null() || limited_device(dev).is_none() {
        // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
        return unsafe { real(dev, count, infos) };
    }
    let st = state();
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    let Some(region) = st.region.as_ref() else { return unsafe { real(dev, count, infos) } };
    // SAFETY: the real entry point and the caller's handle.
    let mut buf = match unsafe { list_processes(real, dev) } {
        Ok(b) => b,
        Err(r) => return r,
    };
    // NVML lists host PIDs: a slot's host PID where known (its inner PID, in a PID namespace, may be
    // another process's host PID), else its PID (no namespace, or it could not be told).
    let ours: Vec<u32> =
        region.slots().iter().map(|(_, p, h, _)| if *h != 0 { *h } else { *p }).filter(|p| *p != 0).collect();
    buf.retain(|p| ours.contains(&p.pid));
    // SAFETY: count is non-null.
    let cap = unsafe { *count } as usize;
    unsafe { *count = buf.len() as u32 };
    if buf.is_empty() {
        return NVML_SUCCESS;
    }
    if infos.is_null() || cap < buf.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: infos holds cap >= buf.len() entries.
    unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), infos, buf.len()) };
    NVML_SUCCESS
}

/// Every process `real` lists for `dev`, into a buffer grown as NVML asks.
pub unsafe fn list_processes(
    real: f::nvmlDeviceGetComputeRunningProcesses_v3,
    dev: NvmlDevice,
) -> Result<Vec<NvmlProcessInfo>, NvmlReturn> {
    let mut buf: Vec<NvmlProcessInfo> = Vec::new();
    let mut n = 0u32;
    // SAFETY: a count query (NULL array) through the real entry point.
    let mut r = unsafe { real(dev, &mut n, std::ptr::null_mut()) };
    for _ in 0..4 {
        if r != NVML_ERROR_INSUFFICIENT_SIZE {
            break;
        }
        n += 8;
        buf.resize(
            n as usize,
            NvmlProcessInfo { pid: 0, used_gpu_memory: 0, gpu_instance_id: 0, compute_instance_id: 0 },
        );
        // SAFETY: buf holds n entries, as the count says.
        r = unsafe { real(dev, &mut n, buf.as_mut_ptr()) };
    }
    if r != NVML_SUCCESS {
        return Err(r);
    }
    buf.truncate(n as usize);
    Ok(buf)
}

//! NVML's own answers, as the interposer asks them for itself (the true-up, the device filter,
//! `nvidia-smi`'s process table): a device's UUID, a process list in a buffer grown as NVML asks.
//! Below the process state: nothing here knows the container.

use crate::real::nvml;
use cuda_abi::nvml::*;
use std::ffi::{c_char, CStr};

/// The UUID of an NVML handle, as the real NVML gives it.
pub fn device_uuid(dev: NvmlDevice) -> Option<String> {
    let get = nvml().nvmlDeviceGetUUID?;
    let mut buf = [0 as c_char; 96];
    // SAFETY: buffer of 96 bytes as declared.
    if unsafe { get(dev, buf.as_mut_ptr(), 96) } != NVML_SUCCESS {
        return None;
    }
    // SAFETY: NVML wrote a NUL-terminated string.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().ok().map(str::to_string)
}

/// An entry of an NVML list that names a process.
pub trait Listed: Copy + Default {
    fn pid(&self) -> u32;
    fn set_pid(&mut self, pid: u32);
}

/// Every list entry type names its process in a field `pid`.
macro_rules! listed {
    ($($t:ty),*) => {$(
        impl Listed for $t {
            fn pid(&self) -> u32 {
                self.pid
            }
            fn set_pid(&mut self, pid: u32) {
                self.pid = pid;
            }
        }
    )*};
}
listed!(
    NvmlProcessInfoV1,
    NvmlProcessInfo,
    NvmlProcessDetail,
    NvmlProcessUtilizationSample,
    NvmlProcessUtilizationInfo
);

/// A list query as NVML shapes it: the device, the count (capacity in, entries out) and the array.
pub type ListFn<T> = unsafe extern "C" fn(NvmlDevice, *mut u32, *mut T) -> NvmlReturn;

/// Every process `real` lists for `dev`, into a buffer grown as NVML asks.
///
/// # Safety
/// `real` is one of NVML's process-list entry points and `dev` a handle NVML gave.
pub unsafe fn list_processes<T: Listed>(real: ListFn<T>, dev: NvmlDevice) -> Result<Vec<T>, NvmlReturn> {
    // SAFETY: the real entry point, with a count and buffer grown as it asks.
    unsafe { grown(|n, p| real(dev, n, p)) }
}

/// Calls `query(count, array)` with a buffer grown while it answers INSUFFICIENT_SIZE (a count
/// query first, with a null array); the entries it filled, or what it answered otherwise.
///
/// # Safety
/// `query` reads and writes `*count`, and writes at most that many entries to the array when it
/// is not null.
pub(crate) unsafe fn grown<T: Listed>(
    mut query: impl FnMut(*mut u32, *mut T) -> NvmlReturn,
) -> Result<Vec<T>, NvmlReturn> {
    let mut buf: Vec<T> = Vec::new();
    let mut n = 0u32;
    let mut r = query(&mut n, std::ptr::null_mut());
    for _ in 0..4 {
        if r != NVML_ERROR_INSUFFICIENT_SIZE {
            break;
        }
        n += 8;
        buf.resize(n as usize, T::default());
        r = query(&mut n, buf.as_mut_ptr());
    }
    if r != NVML_SUCCESS {
        return Err(r);
    }
    buf.truncate(n as usize);
    Ok(buf)
}

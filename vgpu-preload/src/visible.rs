//! The GPUs a process of a slice may use: the slice's, by UUID, whatever the container runtime
//! exposed. Where the agent's limits file names the slice's GPUs, CUDA and NVML enumerate only those
//! (renumbered from 0, in the driver's order) and a context on any other device is refused with one
//! error line: a runtime that left another GPU visible (no NVIDIA runtime, a wrong
//! `NVIDIA_VISIBLE_DEVICES`) must not mean a GPU without limits. Without a limits file (standalone,
//! HAMi's or Volcano's own device plugins) every device the runtime exposed passes.
//!
//! Not hot: enumeration happens at a process's start, and the refusal where a device is first bound
//! (`State::resolve`).

use crate::config::Config;
use crate::drv::format_uuid;
use crate::log::{vlog, ERROR, WARN};
use crate::nvquery::device_uuid;
use crate::real::{self, cuda_fns as f, nvml_fns as nf};
use cuda_abi::nvml::{NvmlDevice, NvmlReturn, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND, NVML_SUCCESS};
use cuda_abi::*;
use std::ffi::c_char;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// The slice's device UUIDs, from the agent's limits file (None: no limits file; every device
/// passes). Read once, without creating the process's state.
pub fn slice_gpus() -> Option<&'static [String]> {
    static GPUS: OnceLock<Option<Vec<String>>> = OnceLock::new();
    GPUS.get_or_init(|| {
        let path = Config::limits_path_from_env()?;
        let r = vgpu_region::Region::open(std::path::Path::new(&path), false).ok()?;
        let v: Vec<String> = (0..r.ndevices()).map(|i| r.device_uuid(i)).filter(|u| !u.is_empty()).collect();
        (!v.is_empty()).then_some(v)
    })
    .as_deref()
}

/// The 32 hex digits of a device UUID: CUDA's UUIDs are formatted `GPU-...` here, NVML and the
/// agent write a MIG device's `MIG-...`.
fn digits(u: &str) -> &str {
    u.strip_prefix("GPU-").or_else(|| u.strip_prefix("MIG-")).unwrap_or(u)
}

/// Whether `uuid` is in `slice` (prefix-insensitive, any case).
fn in_slice(slice: &[String], uuid: &str) -> bool {
    slice.iter().any(|s| digits(s).eq_ignore_ascii_case(digits(uuid)))
}

/// Whether the process may use the device with this UUID.
pub fn allows(uuid: &str) -> bool {
    slice_gpus().is_none_or(|s| in_slice(s, uuid))
}

/// Says once per ordinal why a device outside the slice was refused.
#[cold]
pub fn refused(ordinal: usize, uuid: &str) {
    static SAID: AtomicU64 = AtomicU64::new(0);
    let bit = 1u64 << ordinal.min(63);
    if SAID.fetch_or(bit, Relaxed) & bit == 0 {
        vlog!(
            ERROR,
            "CUDA device {ordinal} ({uuid}) is not a GPU of this container's slice ({}): refused; the container \
             runtime exposed a GPU the scheduler did not give this container",
            slice_gpus().unwrap_or_default().join(", ")
        );
    }
}

/// The slice's devices (`keep`) kept in `cell` for the life of the process; the first to keep them
/// says once which devices of `what` the runtime exposed outside the slice (`hidden`).
#[cold]
fn keep_once<T>(cell: &'static OnceLock<Vec<T>>, what: &str, keep: Vec<T>, hidden: &[String]) -> &'static [T] {
    let mut first = false;
    let v = cell.get_or_init(|| {
        first = true;
        keep
    });
    if first && !hidden.is_empty() {
        vlog!(
            WARN,
            "{what} devices outside this container's slice are hidden ({}); the slice's: {}",
            hidden.join(", "),
            slice_gpus().unwrap_or_default().join(", ")
        );
    }
    v
}

/// The real ordinals of the slice's CUDA devices, in the driver's order (None: every device
/// passes). Err: the driver's own answer (not initialised yet), asked again next time.
fn cuda_devices() -> Result<Option<&'static [i32]>, CUresult> {
    static DEVS: OnceLock<Vec<i32>> = OnceLock::new();
    let Some(slice) = slice_gpus() else { return Ok(None) };
    if let Some(v) = DEVS.get() {
        return Ok(Some(v));
    }
    let h = &real::driver().helpers;
    let (Some(count), Some(get), Some(uuid_of)) = (h.cuDeviceGetCount, h.cuDeviceGet, h.cuDeviceGetUuid_v2) else {
        return Err(CUresult::NOT_INITIALIZED);
    };
    let mut n = 0;
    // SAFETY: out-pointer to a local; the real entry point.
    let r = unsafe { count(&mut n) };
    if r != CUresult::SUCCESS {
        return Err(r);
    }
    let (mut keep, mut hidden) = (Vec::new(), Vec::new());
    for o in 0..n {
        let (mut d, mut u) = (0, CUuuid::default());
        // SAFETY: out-pointers to locals; the real entry points, with an ordinal below their count.
        let ok = unsafe { get(&mut d, o) == CUresult::SUCCESS && uuid_of(&mut u, d) == CUresult::SUCCESS };
        let uuid = format_uuid(&u.bytes);
        match ok && in_slice(slice, &uuid) {
            true => keep.push(o),
            false => hidden.push(format!("CUDA device {o} ({uuid})")),
        }
    }
    Ok(Some(keep_once(&DEVS, "CUDA", keep, &hidden)))
}

/// How many CUDA devices the process sees: the slice's, or the driver's count.
pub fn cuda_count() -> Option<i32> {
    match cuda_devices() {
        Ok(Some(v)) => Some(v.len() as i32),
        Ok(None) => {
            let count = real::driver().helpers.cuDeviceGetCount?;
            let mut n = 0;
            // SAFETY: out-pointer to a local; the real entry point.
            (unsafe { count(&mut n) } == CUresult::SUCCESS).then_some(n)
        }
        Err(_) => None,
    }
}

/// `cuDeviceGetCount`: the slice's devices.
pub unsafe fn count(real: f::cuDeviceGetCount, n: *mut i32) -> CUresult {
    match cuda_devices() {
        Ok(Some(v)) => {
            // SAFETY: the caller's out-pointer, checked for null.
            let Some(n) = (unsafe { n.as_mut() }) else { return CUresult::INVALID_VALUE };
            *n = v.len() as i32;
            CUresult::SUCCESS
        }
        // SAFETY: the caller's argument, forwarded unchanged to the driver's own entry point.
        Ok(None) => unsafe { real(n) },
        Err(e) => e,
    }
}

/// `cuDeviceGet`: the slice's `ordinal`-th device (the driver's handle of it).
pub unsafe fn get(real: f::cuDeviceGet, dev: *mut CUdevice, ordinal: i32) -> CUresult {
    match cuda_devices() {
        Ok(Some(v)) => match usize::try_from(ordinal).ok().and_then(|o| v.get(o)) {
            // SAFETY: the caller's out-pointer and the driver's ordinal of that device.
            Some(&o) => unsafe { real(dev, o) },
            None => CUresult::INVALID_DEVICE,
        },
        Ok(None) => forward!(real, dev, ordinal),
        Err(e) => e,
    }
}

/// The real indices of the slice's NVML devices (None: every device passes, as where the slice
/// holds MIG devices: NVML lists their parents, which the limits file does not name).
fn nvml_devices() -> Result<Option<&'static [u32]>, NvmlReturn> {
    static DEVS: OnceLock<Vec<u32>> = OnceLock::new();
    let Some(slice) = slice_gpus().filter(|s| s.iter().all(|u| !u.starts_with("MIG-"))) else { return Ok(None) };
    if let Some(v) = DEVS.get() {
        return Ok(Some(v));
    }
    let n = real::nvml();
    let (Some(count), Some(by_index)) = (n.nvmlDeviceGetCount_v2, n.nvmlDeviceGetHandleByIndex_v2) else {
        return Ok(None);
    };
    let mut c = 0u32;
    // SAFETY: out-pointer to a local; the real entry point.
    let r = unsafe { count(&mut c) };
    if r != NVML_SUCCESS {
        return Err(r);
    }
    let (mut keep, mut hidden) = (Vec::new(), Vec::new());
    for i in 0..c {
        let mut h: NvmlDevice = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; an index below the count.
        let uuid = (unsafe { by_index(i, &mut h) } == NVML_SUCCESS).then(|| device_uuid(h)).flatten();
        match uuid {
            Some(u) if in_slice(slice, &u) => keep.push(i),
            u => hidden.push(format!("NVML device {i} ({})", u.unwrap_or_default())),
        }
    }
    Ok(Some(keep_once(&DEVS, "NVML", keep, &hidden)))
}

/// `nvmlDeviceGetCount` (both versions): the slice's devices.
pub unsafe fn nvml_count(real: nf::nvmlDeviceGetCount_v2, n: *mut u32) -> NvmlReturn {
    match nvml_devices() {
        Ok(Some(v)) => {
            // SAFETY: the caller's out-pointer, checked for null.
            let Some(n) = (unsafe { n.as_mut() }) else { return NVML_ERROR_INVALID_ARGUMENT };
            *n = v.len() as u32;
            NVML_SUCCESS
        }
        // SAFETY: the caller's argument, forwarded unchanged.
        Ok(None) => unsafe { real(n) },
        Err(e) => e,
    }
}

/// `nvmlDeviceGetHandleByIndex` (both versions): the slice's `index`-th device.
pub unsafe fn nvml_by_index(real: nf::nvmlDeviceGetHandleByIndex_v2, index: u32, dev: *mut NvmlDevice) -> NvmlReturn {
    match nvml_devices() {
        Ok(Some(v)) => match v.get(index as usize) {
            // SAFETY: the caller's out-pointer and the driver's index of that device.
            Some(&i) => unsafe { real(i, dev) },
            None => NVML_ERROR_INVALID_ARGUMENT,
        },
        Ok(None) => forward!(real, index, dev),
        Err(e) => e,
    }
}

/// `nvmlDeviceGetIndex`: the device's place among the slice's.
pub unsafe fn nvml_index(real: nf::nvmlDeviceGetIndex, dev: NvmlDevice, index: *mut u32) -> NvmlReturn {
    let r = forward!(real, dev, index);
    let (NVML_SUCCESS, Ok(Some(v))) = (r, nvml_devices()) else { return r };
    // SAFETY: the driver filled the caller's out-pointer (null would not have succeeded).
    let Some(i) = (unsafe { index.as_mut() }) else { return r };
    match v.iter().position(|&x| x == *i) {
        Some(p) => {
            *i = p as u32;
            NVML_SUCCESS
        }
        None => NVML_ERROR_NOT_FOUND,
    }
}

/// A handle NVML found by a name of the device (UUID, PCI bus id): not found when it is outside
/// the slice.
fn nvml_found(r: NvmlReturn, dev: *mut NvmlDevice) -> NvmlReturn {
    if r != NVML_SUCCESS {
        return r;
    }
    // SAFETY: the caller's out-pointer, which the driver filled (it succeeded).
    let Some(h) = (unsafe { dev.as_ref() }) else { return r };
    match (slice_gpus(), nvml_devices()) {
        (Some(s), Ok(Some(_))) if !device_uuid(*h).is_some_and(|u| in_slice(s, &u)) => NVML_ERROR_NOT_FOUND,
        _ => r,
    }
}

/// `nvmlDeviceGetHandleByUUID`.
pub unsafe fn nvml_by_uuid(
    real: nf::nvmlDeviceGetHandleByUUID,
    uuid: *const c_char,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    nvml_found(forward!(real, uuid, dev), dev)
}

/// `nvmlDeviceGetHandleByPciBusId_v2`.
pub unsafe fn nvml_by_pci(
    real: nf::nvmlDeviceGetHandleByPciBusId_v2,
    bus: *const c_char,
    dev: *mut NvmlDevice,
) -> NvmlReturn {
    nvml_found(forward!(real, bus, dev), dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_match_by_their_digits_whatever_the_prefix_or_case() {
        let slice = vec!["GPU-5eed0000-1000-4000-8000-0000c0de0002".to_string()];
        assert!(in_slice(&slice, "GPU-5eed0000-1000-4000-8000-0000c0de0002"));
        assert!(in_slice(&slice, "GPU-5EED0000-1000-4000-8000-0000C0DE0002"));
        assert!(!in_slice(&slice, "GPU-5eed0000-1000-4000-8000-0000c0de0001"), "another GPU");
        let mig = vec!["MIG-11112222-3333-4444-5555-666677778888".to_string()];
        assert!(in_slice(&mig, "GPU-11112222-3333-4444-5555-666677778888"), "CUDA formats a MIG device's UUID as GPU-");
        assert!(!in_slice(&[], "GPU-11112222-3333-4444-5555-666677778888"));
    }
}

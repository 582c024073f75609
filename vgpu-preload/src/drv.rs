//! The driver calls the policies make themselves (not on behalf of an intercepted call), as safe
//! functions: each takes and returns plain values, and its one `unsafe` block states why the call is
//! sound. With the hooks' edges (`memory::edge`, ...) this is where the crate meets the driver.

use crate::real::driver;
use cuda_abi::*;
use std::ffi::c_void;

const OK: CUresult = CUresult::SUCCESS;

/// The current context's handle (0: none, or the driver lacks the call).
#[inline]
pub(crate) fn current_ctx() -> u64 {
    let Some(get) = driver().helpers.cuCtxGetCurrent else { return 0 };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    if unsafe { get(&mut c) } != OK {
        return 0;
    }
    c as u64
}

/// The context of `stream` (0: the driver cannot say): the current one for the default streams.
/// For a stream of a green context, the primary context of its device (`cuStreamGetCtx_v2`, CUDA
/// 12.5 and later; the first form refuses such streams).
#[inline]
pub(crate) fn stream_ctx(stream: CUstream) -> u64 {
    if stream as usize <= CU_STREAM_PER_THREAD {
        return current_ctx();
    }
    let h = &driver().helpers;
    let mut c: CUcontext = std::ptr::null_mut();
    let r = match (h.cuStreamGetCtx_v2, h.cuStreamGetCtx) {
        (Some(get), _) => {
            let mut green: *mut c_void = std::ptr::null_mut();
            // SAFETY: the caller's stream handle (the driver refuses a bad one) and out-pointers to
            // locals.
            unsafe { get(stream, &mut c, &mut green) }
        }
        // SAFETY: the caller's stream handle (the driver refuses a bad one), an out-pointer to a
        // local.
        (None, Some(get)) => unsafe { get(stream, &mut c) },
        (None, None) => return 0,
    };
    if r != OK {
        return 0;
    }
    c as u64
}

/// Runs `f` with context `ctx` current on this thread (pushed, then popped), unless it is already;
/// None if it could not be made current. `ctx` is a primary or a regular context, which may be
/// current on several threads at once.
#[cold]
pub(crate) fn with_context<T>(ctx: u64, f: impl FnOnce() -> T) -> Option<T> {
    if ctx == current_ctx() {
        return Some(f());
    }
    let h = &driver().helpers;
    let (Some(push), Some(pop)) = (h.cuCtxPushCurrent_v2, h.cuCtxPopCurrent_v2) else { return None };
    // SAFETY: a context handle the driver returned (it refuses one that went); popped after `f`.
    if unsafe { push(ctx as CUcontext) } != OK {
        return None;
    }
    let v = f();
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; pops what was pushed above.
    unsafe { pop(&mut popped) };
    Some(v)
}

/// What the driver says array `h` occupies on device `ordinal` (None: it cannot say).
pub(crate) fn array_size(h: u64, ordinal: CUdevice) -> Option<u64> {
    let f = driver().helpers.cuArrayGetMemoryRequirements?;
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    // SAFETY: out-pointer to a local; `h` is an array handle (the driver refuses another).
    (unsafe { f(&mut req, h as CUarray, ordinal) } == OK).then_some(req.size as u64)
}

/// [`array_size`] for a mipmapped array.
pub(crate) fn mipmapped_size(h: u64, ordinal: CUdevice) -> Option<u64> {
    let f = driver().helpers.cuMipmappedArrayGetMemoryRequirements?;
    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
    // SAFETY: out-pointer to a local; `h` is a mipmapped array's handle (the driver refuses another).
    (unsafe { f(&mut req, h as CUmipmappedArray, ordinal) } == OK).then_some(req.size as u64)
}

/// Destroys array `h` (one a policy just created and cannot keep).
pub(crate) fn destroy_array(h: u64) {
    if let Some(f) = driver().helpers.cuArrayDestroy {
        // SAFETY: a handle value; the driver refuses one that names no array.
        unsafe { f(h as CUarray) };
    }
}

/// [`destroy_array`] for a mipmapped array.
pub(crate) fn destroy_mipmapped(h: u64) {
    if let Some(f) = driver().helpers.cuMipmappedArrayDestroy {
        // SAFETY: a handle value; the driver refuses one that names no mipmapped array.
        unsafe { f(h as CUmipmappedArray) };
    }
}

/// Frees device pointer `p` (an allocation a policy just made and cannot keep).
pub(crate) fn free(p: u64) {
    if let Some(f) = driver().helpers.cuMemFree_v2 {
        // SAFETY: a pointer value; the driver refuses one it did not allocate.
        unsafe { f(p) };
    }
}

/// `size` bytes of unified memory, attached globally (None: the driver lacks the call).
pub(crate) fn alloc_managed(size: usize) -> Option<Result<u64, CUresult>> {
    let f = driver().cuda.cuMemAllocManaged?;
    let mut p: CUdeviceptr = 0;
    // SAFETY: an out-pointer to a local.
    let r = unsafe { f(&mut p, size, CU_MEM_ATTACH_GLOBAL) };
    Some(if r == OK { Ok(p) } else { Err(r) })
}

/// The allocation granularity for `prop` (1 when the driver cannot say).
pub(crate) fn granularity(prop: &CUmemAllocationProp) -> u64 {
    let mut g = 0usize;
    match driver().helpers.cuMemGetAllocationGranularity {
        // SAFETY: an out-pointer to a local and a reference to the properties.
        Some(f) if unsafe { f(&mut g, prop, 0) } == OK && g > 0 => g as u64,
        _ => 1,
    }
}

/// The current context's value of limit `limit` (None: the driver cannot say).
pub(crate) fn ctx_limit(limit: i32) -> Option<usize> {
    let f = driver().helpers.cuCtxGetLimit?;
    let mut v = 0usize;
    // SAFETY: an out-pointer to a local.
    (unsafe { f(&mut v, limit) } == OK).then_some(v)
}

/// Attribute `attr` of device `ordinal` (None: the driver cannot say).
pub(crate) fn device_attr(attr: i32, ordinal: CUdevice) -> Option<i32> {
    let f = driver().helpers.cuDeviceGetAttribute?;
    let mut v = 0;
    // SAFETY: an out-pointer to a local.
    (unsafe { f(&mut v, attr, ordinal) } == OK).then_some(v)
}

/// A GPU's UUID as NVML and the agent write it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
pub fn format_uuid(b: &[u8; 16]) -> String {
    format!(
        "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]
    )
}

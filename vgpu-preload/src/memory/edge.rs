//! The memory hooks' edge: each exported entry point's raw arguments become references and closures
//! here, once per call, and the policy in `memory` runs on them. A NULL out-pointer is answered
//! with CUDA_ERROR_INVALID_VALUE (as the driver answers it); a NULL optional input (a descriptor,
//! allocation properties) is the driver's to answer, so the call is forwarded unchanged.
//!
//! The `_ptsz` twins share one function: `PER_THREAD` says that the default stream is the calling
//! thread's (see `capture::ptsz`).
//!
//! # Safety
//! Every function here is called by the generated export with the caller's arguments and the real
//! entry point, under the CUDA driver API's contract: each pointer is NULL or valid for what the
//! call reads or writes through it, for the duration of the call.
#![allow(clippy::missing_safety_doc)]

use super::{Made, OK};
use crate::locate::site;
use crate::real::cuda_fns as f;
use crate::state::state;
use cuda_abi::*;
use std::ffi::c_void;

const INVALID: CUresult = CUresult::INVALID_VALUE;

/// The driver's answer as a [`Made`]: `read` gives what it made once it succeeded.
#[inline]
fn made<T>(r: CUresult, read: impl FnOnce() -> T) -> Made<T> {
    if r == OK {
        Ok(read())
    } else {
        Err(r)
    }
}

/// A policy's answer as the entry point's status.
#[inline]
fn status<T>(r: Made<T>) -> CUresult {
    r.err().unwrap_or(OK)
}

#[inline]
fn stream<const PER_THREAD: bool>(s: CUstream) -> CUstream {
    if PER_THREAD {
        crate::capture::ptsz(s)
    } else {
        s
    }
}

pub unsafe fn stream_destroy(real: f::cuStreamDestroy, s: CUstream) -> CUresult {
    super::destroy_stream(s, || forward!(real, s))
}

// ----- linear memory -----

pub unsafe fn alloc_v2(real: f::cuMemAlloc_v2, dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let Some(out) = out_ref!(dptr) else { return INVALID };
    let st = state();
    status(super::linear(
        st,
        size as u64,
        || site(st),
        || {
            // SAFETY: the caller's size and out-pointer, now a reference.
            match unsafe { real(out, size) } {
                OK => Ok(*out),
                CUresult::OUT_OF_MEMORY if st.oversubscribe() => super::spill(st, size).inspect(|p| *out = *p),
                e => Err(e),
            }
        },
    ))
}

pub unsafe fn alloc_v1(real: f::cuMemAlloc, dptr: *mut u32, size: u32) -> CUresult {
    let Some(out) = out_ref!(dptr) else { return INVALID };
    let st = state();
    status(super::linear(st, size as u64, || site(st), || made(forward!(real, out, size), || *out as u64)))
}

pub unsafe fn alloc_managed(real: f::cuMemAllocManaged, dptr: *mut CUdeviceptr, size: usize, flags: u32) -> CUresult {
    let Some(out) = out_ref!(dptr) else { return INVALID };
    let st = state();
    let mut call = || made(forward!(real, out, size, flags), || *out);
    if !st.cfg.count_managed {
        return status(call());
    }
    status(super::linear(st, size as u64, || site(st), call))
}

pub unsafe fn alloc_pitch(
    real: f::cuMemAllocPitch_v2,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: u32,
) -> CUresult {
    // SAFETY: as in `alloc_v2`, for both out-pointers.
    let (Some(out), Some(pitch)) = (unsafe { dptr.as_mut() }, unsafe { pitch.as_mut() }) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointers now references.
    let call = |o: &mut CUdeviceptr, p: &mut usize| unsafe { real(o, p, width, height, elem) };
    pitched(out, pitch, (width as u64, height as u64), call, |o, p| (o, p as u64))
}

/// The original `cuMemAllocPitch` (32-bit pointer, pitch and extents), as `alloc_pitch`.
pub unsafe fn alloc_pitch_v1(
    real: f::cuMemAllocPitch,
    dptr: *mut u32,
    pitch: *mut u32,
    width: u32,
    height: u32,
    elem: u32,
) -> CUresult {
    // SAFETY: as in `alloc_pitch`.
    let (Some(out), Some(pitch)) = (unsafe { dptr.as_mut() }, unsafe { pitch.as_mut() }) else { return INVALID };
    // SAFETY: as in `alloc_pitch`.
    let call = |o: &mut u32, p: &mut u32| unsafe { real(o, p, width, height, elem) };
    pitched(out, pitch, (width as u64, height as u64), call, |o, p| (o as u64, p as u64))
}

/// Both pitched forms: `call` makes the allocation into `out` and `pitch` (of the form's widths),
/// `read` widens what it wrote.
#[inline]
fn pitched<P: Copy, Q: Copy>(
    out: &mut P,
    pitch: &mut Q,
    extent: (u64, u64),
    call: impl FnOnce(&mut P, &mut Q) -> CUresult,
    read: impl FnOnce(P, Q) -> (u64, u64),
) -> CUresult {
    let st = state();
    let made = || made(call(out, pitch), || read(*out, *pitch));
    status(super::pitched(st, extent, || site(st), made, crate::drv::free))
}

pub unsafe fn free_v2(real: f::cuMemFree_v2, dptr: CUdeviceptr) -> CUresult {
    super::freeing(state(), dptr, || forward!(real, dptr))
}

pub unsafe fn free_v1(real: f::cuMemFree, dptr: u32) -> CUresult {
    super::freeing(state(), dptr as u64, || forward!(real, dptr))
}

// ----- stream-ordered allocator -----

pub unsafe fn alloc_async<const PER_THREAD: bool>(
    real: f::cuMemAllocAsync,
    dptr: *mut CUdeviceptr,
    size: usize,
    s: CUstream,
) -> CUresult {
    let Some(out) = out_ref!(dptr) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    let call = || made(unsafe { real(out, size, s) }, || *out);
    status(super::pooled(state(), size as u64, None, stream::<PER_THREAD>(s), call))
}

pub unsafe fn alloc_from_pool<const PER_THREAD: bool>(
    real: f::cuMemAllocFromPoolAsync,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    let Some(out) = out_ref!(dptr) else { return INVALID };
    // SAFETY: as in `alloc_async`.
    let call = || made(unsafe { real(out, size, pool, s) }, || *out);
    status(super::pooled(state(), size as u64, Some(pool), stream::<PER_THREAD>(s), call))
}

pub unsafe fn free_async(real: f::cuMemFreeAsync, dptr: CUdeviceptr, s: CUstream) -> CUresult {
    super::freeing(state(), dptr, || forward!(real, dptr, s))
}

// ----- VMM -----

pub unsafe fn vmm_create(
    real: f::cuMemCreate,
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    // SAFETY: the caller's optional input, NULL or valid for reads (the module's contract).
    let props = unsafe { prop.as_ref() };
    // SAFETY: as in `alloc_v2`.
    let (Some(out), Some(p)) = (unsafe { handle.as_mut() }, props) else {
        return forward!(real, handle, size, prop, flags);
    };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    let mut call = || made(unsafe { real(out, size, p, flags) }, || *out);
    if p.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return status(call());
    }
    status(super::physical(state(), p.location.id, size as u64, || crate::drv::granularity(p), call))
}

// ----- arrays -----

/// An array made by `real` into `arr` (NULL: INVALID_VALUE), `estimate` None (no descriptor)
/// forwarding unchanged.
#[inline]
fn array<H>(
    arr: Option<&mut *mut H>,
    estimate: Option<u64>,
    create: impl FnOnce(&mut *mut H) -> CUresult,
    size_of: impl FnOnce(u64, CUdevice) -> Option<u64>,
    destroy: impl FnOnce(u64),
) -> CUresult {
    let Some(out) = arr else { return INVALID };
    let Some(estimate) = estimate else { return create(out) };
    let st = state();
    let at = || {
        let (o, d) = st.current_dev()?;
        Ok((o, d, crate::locate::ctx_id(st, d)))
    };
    status(super::array(st, estimate, at, || made(create(out), || *out as u64), size_of, destroy))
}

pub unsafe fn array_create(
    real: f::cuArrayCreate_v2,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    // SAFETY: the caller's optional input and out-pointer (the module's contract).
    let (out, desc) = unsafe { (arr.as_mut(), desc.as_ref()) };
    let est = desc.map(|x| super::array_estimate(x.Width, x.Height, 0, x.Format, x.NumChannels));
    // SAFETY: the caller's descriptor (NULL only when `est` is None, forwarded) and out-pointer.
    let create = |o: &mut CUarray| unsafe { real(o, desc.map_or(std::ptr::null(), |d| d as *const _)) };
    array(out, est, create, crate::drv::array_size, crate::drv::destroy_array)
}

pub unsafe fn array3d_create(
    real: f::cuArray3DCreate_v2,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    // SAFETY: as in `array_create`.
    let (out, desc) = unsafe { (arr.as_mut(), desc.as_ref()) };
    let est = desc.map(|x| super::array_estimate(x.Width, x.Height, x.Depth, x.Format, x.NumChannels));
    // SAFETY: as in `array_create`.
    let create = |o: &mut CUarray| unsafe { real(o, desc.map_or(std::ptr::null(), |d| d as *const _)) };
    array(out, est, create, crate::drv::array_size, crate::drv::destroy_array)
}

pub unsafe fn array_create_v1(
    real: f::cuArrayCreate,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR_v1,
) -> CUresult {
    // SAFETY: as in `array_create`.
    let (out, desc) = unsafe { (arr.as_mut(), desc.as_ref()) };
    let est = desc.map(|x| super::array_estimate(x.Width as usize, x.Height as usize, 0, x.Format, x.NumChannels));
    // SAFETY: as in `array_create`.
    let create = |o: &mut CUarray| unsafe { real(o, desc.map_or(std::ptr::null(), |d| d as *const _)) };
    array(out, est, create, crate::drv::array_size, crate::drv::destroy_array)
}

pub unsafe fn array3d_create_v1(
    real: f::cuArray3DCreate,
    arr: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1,
) -> CUresult {
    // SAFETY: as in `array_create`.
    let (out, desc) = unsafe { (arr.as_mut(), desc.as_ref()) };
    let est = desc
        .map(|x| super::array_estimate(x.Width as usize, x.Height as usize, x.Depth as usize, x.Format, x.NumChannels));
    // SAFETY: as in `array_create`.
    let create = |o: &mut CUarray| unsafe { real(o, desc.map_or(std::ptr::null(), |d| d as *const _)) };
    array(out, est, create, crate::drv::array_size, crate::drv::destroy_array)
}

pub unsafe fn mipmapped_create(
    real: f::cuMipmappedArrayCreate,
    arr: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> CUresult {
    // SAFETY: as in `array_create`.
    let (out, desc) = unsafe { (arr.as_mut(), desc.as_ref()) };
    let est = desc.filter(|_| levels > 0).map(|x| super::mipmapped_estimate(x, levels));
    // SAFETY: as in `array_create`.
    let create =
        |o: &mut CUmipmappedArray| unsafe { real(o, desc.map_or(std::ptr::null(), |d| d as *const _), levels) };
    array(out, est, create, crate::drv::mipmapped_size, crate::drv::destroy_mipmapped)
}

pub unsafe fn array_destroy(real: f::cuArrayDestroy, arr: CUarray) -> CUresult {
    super::destroy_array(state(), arr as u64, || forward!(real, arr))
}

pub unsafe fn mipmapped_destroy(real: f::cuMipmappedArrayDestroy, arr: CUmipmappedArray) -> CUresult {
    super::destroy_array(state(), arr as u64, || forward!(real, arr))
}

// ----- contexts -----

pub unsafe fn primary_retain(real: f::cuDevicePrimaryCtxRetain, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let Some(out) = out_ref!(pctx) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    status(super::retain_primary(state(), dev, || made(unsafe { real(out, dev) }, || *out as u64)))
}

pub unsafe fn primary_release(real: f::cuDevicePrimaryCtxRelease, dev: CUdevice) -> CUresult {
    super::release_primary(state(), dev, || forward!(real, dev))
}

pub unsafe fn primary_reset(real: f::cuDevicePrimaryCtxReset, dev: CUdevice) -> CUresult {
    super::reset_primary(state(), dev, || forward!(real, dev))
}

pub unsafe fn ctx_set_limit(real: f::cuCtxSetLimit, limit: i32, value: usize) -> CUresult {
    // SAFETY: the caller's limit, with its value or the one the driver had (the module's contract).
    super::set_limit(state(), limit, value, |v| unsafe { real(limit, v) })
}

pub unsafe fn ctx_create(real: f::cuCtxCreate_v2, pctx: *mut CUcontext, flags: u32, dev: CUdevice) -> CUresult {
    let Some(out) = out_ref!(pctx) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    status(super::context_created(state(), dev, || made(unsafe { real(out, flags, dev) }, || *out as u64)))
}

/// `cuCtxCreate_v3` (execution affinity): charged as v2's.
pub unsafe fn ctx_create_v3(
    real: f::cuCtxCreate_v3,
    pctx: *mut CUcontext,
    params: *mut c_void,
    n: i32,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    let Some(out) = out_ref!(pctx) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    status(super::context_created(state(), dev, || made(unsafe { real(out, params, n, flags, dev) }, || *out as u64)))
}

/// `cuCtxCreate_v4` (create parameters; what `cuCtxCreate` means from CUDA 13): charged as v2's.
pub unsafe fn ctx_create_v4(
    real: f::cuCtxCreate_v4,
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: u32,
    dev: CUdevice,
) -> CUresult {
    let Some(out) = out_ref!(pctx) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    status(super::context_created(state(), dev, || made(unsafe { real(out, params, flags, dev) }, || *out as u64)))
}

pub unsafe fn ctx_destroy(real: f::cuCtxDestroy_v2, ctx: CUcontext) -> CUresult {
    super::destroy_context(state(), ctx as u64, || forward!(real, ctx))
}

// ----- what the container sees -----

pub unsafe fn get_info_v2(real: f::cuMemGetInfo_v2, free: *mut usize, total: *mut usize) -> CUresult {
    // SAFETY: as in `alloc_v2`, for both out-pointers.
    let (Some(f), Some(t)) = (unsafe { free.as_mut() }, unsafe { total.as_mut() }) else { return INVALID };
    match super::visible_info(state()) {
        Err(e) => e,
        // SAFETY: the caller's out-pointers, now references.
        Ok(None) => unsafe { real(f, t) },
        Ok(Some((fv, tv))) => {
            (*f, *t) = (fv as usize, tv as usize);
            OK
        }
    }
}

pub unsafe fn get_info_v1(real: f::cuMemGetInfo, free: *mut u32, total: *mut u32) -> CUresult {
    // SAFETY: as in `get_info_v2`.
    let (Some(f), Some(t)) = (unsafe { free.as_mut() }, unsafe { total.as_mut() }) else { return INVALID };
    match super::visible_info(state()) {
        Err(e) => e,
        // SAFETY: as in `get_info_v2`.
        Ok(None) => unsafe { real(f, t) },
        Ok(Some((fv, tv))) => {
            (*f, *t) = (fv.min(u32::MAX as u64) as u32, tv.min(u32::MAX as u64) as u32);
            OK
        }
    }
}

pub unsafe fn total_mem_v2(real: f::cuDeviceTotalMem_v2, bytes: *mut usize, dev: CUdevice) -> CUresult {
    let Some(out) = out_ref!(bytes) else { return INVALID };
    // SAFETY: the caller's arguments, the out-pointer now a reference.
    let r = unsafe { real(out, dev) };
    if r == OK {
        *out = super::visible_total(state(), dev, *out as u64) as usize;
    }
    r
}

pub unsafe fn total_mem_v1(real: f::cuDeviceTotalMem, bytes: *mut u32, dev: CUdevice) -> CUresult {
    let Some(out) = out_ref!(bytes) else { return INVALID };
    // SAFETY: as in `total_mem_v2`.
    let r = unsafe { real(out, dev) };
    if r == OK {
        *out = super::visible_total(state(), dev, *out as u64).min(u32::MAX as u64) as u32;
    }
    r
}

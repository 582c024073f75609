//! `cuGetProcAddress` and `_v2`: ask the real driver first, with the caller's symbol, version and
//! flags; then hand back our hook for exactly the entry point the driver returned (identified by its
//! address, never by guessing suffixes). Entry points we do not intercept are returned unchanged.
#![allow(clippy::missing_safety_doc)]

use crate::real::cuda_fns as f;
use cuda_abi::*;
use std::ffi::{c_char, c_void};

unsafe fn rewrite(r: CUresult, pfn: *mut *mut c_void) -> CUresult {
    if r == CUresult::SUCCESS && !pfn.is_null() {
        // SAFETY: the driver just wrote a function pointer through pfn.
        unsafe {
            if let Some(h) = super::hook_for_real(*pfn) {
                *pfn = h;
            }
        }
    }
    r
}

pub unsafe fn get_v1(
    real: f::cuGetProcAddress,
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: i32,
    flags: u64,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { rewrite(real(sym, pfn, ver, flags), pfn) }
}

pub unsafe fn get_v2(
    real: f::cuGetProcAddress_v2,
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: i32,
    flags: u64,
    status: *mut i32,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    unsafe { rewrite(real(sym, pfn, ver, flags, status), pfn) }
}

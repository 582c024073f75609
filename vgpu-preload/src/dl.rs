//! `dlsym`: the real one, and the exported override that hands out our hooks for the driver's own
//! entry points (applications and the CUDA runtime that `dlopen` the driver privately).
//!
//! The override is a naked tail-jumping trampoline (x86-64 and AArch64): glibc's `dlsym` resolves
//! `RTLD_NEXT` relative to its caller's return address, so anything we do not answer ourselves must
//! reach the real `dlsym` with the original caller's return address (the stack slot on x86-64, the
//! link register on AArch64) untouched. On other architectures `dlsym` is not overridden: code that
//! looks the driver up with `dlsym` gets the driver's entry points (only `cuGetProcAddress` and
//! symbol binding are intercepted there).

use crate::real::real_dlsym;
use std::ffi::{c_char, c_void, CStr};

/// Decides whether `dlsym(handle, name)` is answered with one of our hooks. Returns NULL to let the
/// real `dlsym` answer. Runs for every `dlsym` in the process: cheap, allocation-free when declining.
extern "C" fn filter(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    crate::real::real_dlsym_addr();
    if name.is_null() || crate::guard::inside() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's contract: a NUL-terminated name.
    let n = unsafe { CStr::from_ptr(name) }.to_bytes();
    if !(n.starts_with(b"cu") || n.starts_with(b"nvml")) {
        return std::ptr::null_mut();
    }
    let Ok(n) = std::str::from_utf8(n) else { return std::ptr::null_mut() };
    let Some(hook) = crate::hooks::hook(n) else { return std::ptr::null_mut() };
    if handle == libc::RTLD_DEFAULT || handle == libc::RTLD_NEXT {
        return hook;
    }
    // A real handle: replace only the driver's (or NVML's) own entry point.
    // SAFETY: the caller's handle and name, as given to dlsym.
    let r = unsafe { real_dlsym(handle, name) };
    if !r.is_null() && crate::hooks::real_address(n) == Some(r as usize) {
        hook
    } else {
        std::ptr::null_mut()
    }
}

#[cfg(all(not(test), any(target_arch = "x86_64", target_arch = "aarch64")))]
mod export {
    /// The exported `dlsym`: asks [`filter`](super::filter), else tail-jumps to glibc's `dlsym` with
    /// the caller's return address (x86-64: on the stack; AArch64: the link register) as it came.
    ///
    /// # Safety
    /// As `dlsym(3)`.
    #[unsafe(naked)]
    #[no_mangle]
    pub unsafe extern "C" fn dlsym(
        handle: *mut std::ffi::c_void,
        name: *const std::ffi::c_char,
    ) -> *mut std::ffi::c_void {
        #[cfg(target_arch = "x86_64")]
        std::arch::naked_asm!(
            "push rdi",
            "push rsi",
            "sub rsp, 8",
            "call {filter}",
            "add rsp, 8",
            "pop rsi",
            "pop rdi",
            "test rax, rax",
            "jnz 2f",
            "jmp qword ptr [rip + {real}]",
            "2:",
            "ret",
            filter = sym super::filter,
            real = sym crate::real::REAL_DLSYM,
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::naked_asm!(
            // A frame (keeps sp 16-byte aligned) holding fp, lr and the two arguments.
            "stp x29, x30, [sp, #-32]!",
            "mov x29, sp",
            "stp x0, x1, [sp, #16]",
            "bl {filter}",
            "cbnz x0, 2f",
            "ldp x0, x1, [sp, #16]",
            "ldp x29, x30, [sp], #32",
            // x16 is the intra-procedure-call scratch register: free to use in a tail call.
            "adrp x16, {real}",
            "ldr x16, [x16, :lo12:{real}]",
            "br x16",
            "2:",
            "ldp x29, x30, [sp], #32",
            "ret",
            filter = sym super::filter,
            real = sym crate::real::REAL_DLSYM,
        );
    }
}

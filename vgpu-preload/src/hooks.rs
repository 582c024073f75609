//! The exported hook symbols, generated from the lists in `api.rs`, and the maps from names and real
//! addresses to hooks that `dlsym` and `cuGetProcAddress` use.

use crate::api::{cuda_hooks, nvml_hooks};
use crate::nvml::*;
use crate::real;
use cuda_abi::*;
#[allow(unused_imports)]
use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

/// `cuGetProcAddress` answered with our hooks (part of the hook table: it hands them out).
mod procaddr;

#[cfg(not(test))]
mod exports {
    use super::procaddr;
    use super::*;
    #[allow(unused_imports)]
    use crate::{capture, graphmem, memory, mps, nvml, pools, sm, smi, stale, visible, vmm};

    macro_rules! cuda_exports {
        ($($name:ident($($a:ident: $t:ty),*) => $p:tt $(:: $q:ident $(::<$g:tt>)?)?;)*) => {
            $(
                #[no_mangle]
                pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
                    let Some(real) = real::driver().cuda.$name else { return CUresult::NOT_SUPPORTED };
                    body!($p $(:: $q $(::<$g>)?)?, real, $($a),*)
                }
            )*
            pub fn cuda_hook(name: &str) -> Option<*mut c_void> {
                match name {
                    $(stringify!($name) => Some($name as *mut c_void),)*
                    _ => None,
                }
            }
        };
    }

    /// `pass` hooks forward at once (nothing that could panic or re-enter runs in between); the
    /// others run their policy inside the entry guard, counted as calls in flight (see `guard`).
    macro_rules! body {
        (pass, $real:ident, $($a:ident),*) => {
            // SAFETY: forwarding the caller's arguments unchanged to the real entry point.
            unsafe { $real($($a),*) }
        };
        // Launches go straight to the driver unless an SM limit is configured for the container. The
        // SM path cannot panic on its fast path and guards its slow path itself (see `sm`), so it
        // runs without the entry guard. Graph launches also take that path while a graph of the
        // process allocates memory (see `graphmem`), limited or not.
        (sm :: graph_launch::<$g:tt>, $real:ident, $($a:ident),*) => {
            if crate::sm::engaged() || crate::graphmem::any() {
                // SAFETY: the policy receives the caller's arguments and the real entry point.
                unsafe { crate::sm::graph_launch::<$g>($real, $($a),*) }
            } else {
                // SAFETY: as for `pass`.
                unsafe { $real($($a),*) }
            }
        };
        (sm :: $f:ident $(::<$g:tt>)?, $real:ident, $($a:ident),*) => {
            if crate::sm::engaged() {
                // SAFETY: the policy receives the caller's arguments and the real entry point.
                unsafe { crate::sm::$f $(::<$g>)? ($real, $($a),*) }
            } else {
                // SAFETY: as for `pass`.
                unsafe { $real($($a),*) }
            }
        };
        ($p:path, $real:ident, $($a:ident),*) => {
            crate::guard::run_counted(
                // SAFETY: the policy receives the caller's arguments and the real entry point.
                || unsafe { $p($real, $($a),*) },
                CUresult::UNKNOWN,
            )
            // SAFETY: as for `pass` (a call made from inside a hook goes straight on, see `guard`).
            .unwrap_or_else(|| unsafe { $real($($a),*) })
        };
    }

    cuda_hooks!(cuda_exports);

    macro_rules! nvml_exports {
        ($($name:ident($($a:ident: $t:ty),*) => $p:path;)*) => {
            $(
                #[no_mangle]
                pub unsafe extern "C" fn $name($($a: $t),*) -> NvmlReturn {
                    let Some(real) = real::nvml().$name else { return NVML_ERROR_FUNCTION_NOT_FOUND };
                    crate::guard::run(
                        // SAFETY: the policy receives the caller's arguments and the real entry point.
                        || unsafe { $p(real, $($a),*) },
                        NVML_ERROR_UNKNOWN,
                    )
                    // SAFETY: as for `pass` (a call made from inside a hook goes straight on, see `guard`).
                    .unwrap_or_else(|| unsafe { real($($a),*) })
                }
            )*
            pub fn nvml_hook(name: &str) -> Option<*mut c_void> {
                match name {
                    $(stringify!($name) => Some($name as *mut c_void),)*
                    _ => None,
                }
            }
        };
    }
    nvml_hooks!(nvml_exports);
}

/// Our hook for an exported driver or NVML entry point name.
pub fn hook(name: &str) -> Option<*mut c_void> {
    #[cfg(not(test))]
    {
        exports::cuda_hook(name).or_else(|| exports::nvml_hook(name))
    }
    #[cfg(test)]
    {
        let _ = name;
        None
    }
}

/// (real address, hook address) of the driver's intercepted entry points, sorted by real address.
/// (`cuGetProcAddress` only hands out driver entry points, so NVML is not loaded for this.)
fn by_real() -> &'static [(usize, usize)] {
    static T: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    T.get_or_init(|| {
        let mut v: Vec<(usize, usize)> =
            real::driver().cuda.addresses().into_iter().filter_map(|(n, a)| hook(n).map(|h| (a, h as usize))).collect();
        v.sort_unstable();
        v
    })
}

/// The real driver's (or NVML's) address of an intercepted entry point.
pub fn real_address(name: &str) -> Option<usize> {
    if name.starts_with("nvml") {
        real::nvml().address(name)
    } else {
        real::driver().cuda.address(name)
    }
}

/// The hook for exactly the entry point at `addr`, if it is one we intercept.
pub fn hook_for_real(addr: *mut c_void) -> Option<*mut c_void> {
    let t = by_real();
    t.binary_search_by_key(&(addr as usize), |(r, _)| *r).ok().map(|i| t[i].1 as *mut c_void)
}

//! The real driver libraries and their entry points, resolved once.

use crate::api::{cuda_helpers, cuda_hooks, nvml_hooks};
use crate::log::{vlog, ERROR};
use cuda_abi::nvml::*;
use cuda_abi::*;
use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::OnceLock;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Address of glibc's `dlsym` (read by the trampoline).
pub(crate) static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn real_dlsym_addr() -> usize {
    let a = REAL_DLSYM.load(Acquire);
    if a != 0 {
        return a;
    }
    // dlvsym is not intercepted. GLIBC_2.34 moved dlsym into libc; older glibc has GLIBC_2.2.5.
    let mut p = std::ptr::null_mut();
    for v in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
        // SAFETY: RTLD_NEXT lookup of a libc symbol with static C strings.
        p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) };
        if !p.is_null() {
            break;
        }
    }
    REAL_DLSYM.store(p as usize, Release);
    p as usize
}

/// The real `dlsym`.
///
/// # Safety
/// As `dlsym(3)`: a valid handle and a NUL-terminated name.
pub unsafe fn real_dlsym(h: *mut c_void, name: *const c_char) -> *mut c_void {
    let a = real_dlsym_addr();
    if a == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: a is glibc's dlsym.
    unsafe { std::mem::transmute::<usize, DlsymFn>(a)(h, name) }
}

/// `dlopen` a library, preferring an already loaded copy; never through our own `dlsym`.
fn open(names: &[String]) -> *mut c_void {
    let dlopen = |n: &String, flags| {
        let c = CString::new(n.as_str()).unwrap_or_default();
        // SAFETY: dlopen with a valid C string.
        unsafe { libc::dlopen(c.as_ptr(), flags) }
    };
    let loaded = names.iter().map(|n| dlopen(n, libc::RTLD_NOW | libc::RTLD_NOLOAD)).find(|h| !h.is_null());
    loaded
        .or_else(|| names.iter().map(|n| dlopen(n, libc::RTLD_NOW | libc::RTLD_LOCAL)).find(|h| !h.is_null()))
        .unwrap_or(std::ptr::null_mut())
}

/// Looks `name` (NUL-terminated) up in `h` with the real dlsym.
pub fn sym(h: *mut c_void, name: &str) -> *mut c_void {
    if h.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: h is a live handle and name is NUL-terminated (checked by the callers' concat!).
    unsafe { real_dlsym(h, name.as_ptr() as *const c_char) }
}

macro_rules! define_real {
    ($($name:ident($($a:ident: $t:ty),*) => $p:tt $(:: $q:ident $(::<$g:tt>)?)?;)*) => {
        /// Function-pointer types of the intercepted entry points.
        #[allow(non_camel_case_types)]
        pub mod cuda_fns {
            use super::*;
            $(pub type $name = unsafe extern "C" fn($($t),*) -> CUresult;)*
        }
        /// The real driver's intercepted entry points (None: this driver lacks it).
        #[allow(non_snake_case)]
        pub struct Cuda {
            $(pub $name: Option<cuda_fns::$name>,)*
        }
        impl Cuda {
            fn load(h: *mut c_void) -> Cuda {
                Cuda {
                    $($name: {
                        let p = sym(h, concat!(stringify!($name), "\0"));
                        // SAFETY: the driver's symbol of this name has this signature (cuda.h).
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, cuda_fns::$name>(p) })
                    },)*
                }
            }
            /// (name, real address) of every intercepted entry point the driver has.
            pub fn addresses(&self) -> Vec<(&'static str, usize)> {
                let mut v = Vec::new();
                $(if let Some(f) = self.$name { v.push((stringify!($name), f as usize)); })*
                v
            }
            /// The real address of the intercepted entry point `name`, if the driver has it.
            pub fn address(&self, name: &str) -> Option<usize> {
                match name {
                    $(stringify!($name) => self.$name.map(|f| f as usize),)*
                    _ => None,
                }
            }
        }
    };
}
cuda_hooks!(define_real);

macro_rules! define_helpers {
    ($($name:ident($($a:ident: $t:ty),*);)*) => {
        #[allow(non_camel_case_types)]
        pub mod helper_fns {
            use super::*;
            $(pub type $name = unsafe extern "C" fn($($t),*) -> CUresult;)*
        }
        /// Driver functions the policies need.
        #[allow(non_snake_case)]
        pub struct Helpers {
            $(pub $name: Option<helper_fns::$name>,)*
        }
        impl Helpers {
            fn load(h: *mut c_void) -> Helpers {
                Helpers {
                    $($name: {
                        let p = sym(h, concat!(stringify!($name), "\0"));
                        // SAFETY: as for `Cuda::load`.
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, helper_fns::$name>(p) })
                    },)*
                }
            }
        }
    };
}
cuda_helpers!(define_helpers);

macro_rules! define_real_nvml {
    ($($name:ident($($a:ident: $t:ty),*) => $p:path;)*) => {
        define_real_nvml!(@ [$($name($($t),*))*] [
            // Not intercepted; what the NVML hooks and the standalone true-up call themselves.
            nvmlInit_v2(),
            nvmlDeviceGetUUID(NvmlDevice, *mut c_char, u32),
            nvmlSystemGetDriverVersion(*mut c_char, u32),
        ]);
    };
    (@ [$($name:ident($($t:ty),*))*] [$($x:ident($($xt:ty),*),)*]) => {
        #[allow(non_camel_case_types)]
        pub mod nvml_fns {
            use super::*;
            $(pub type $name = unsafe extern "C" fn($($t),*) -> NvmlReturn;)*
            $(pub type $x = unsafe extern "C" fn($($xt),*) -> NvmlReturn;)*
        }
        #[allow(non_snake_case)]
        pub struct Nvml {
            $(pub $name: Option<nvml_fns::$name>,)*
            $(pub $x: Option<nvml_fns::$x>,)*
        }
        impl Nvml {
            fn load(h: *mut c_void) -> Nvml {
                Nvml {
                    $($name: {
                        let p = sym(h, concat!(stringify!($name), "\0"));
                        // SAFETY: NVML's symbol of this name has this signature (nvml.h).
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, nvml_fns::$name>(p) })
                    },)*
                    $($x: {
                        let p = sym(h, concat!(stringify!($x), "\0"));
                        // SAFETY: NVML's symbol of this name has the signature listed above (nvml.h).
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, nvml_fns::$x>(p) })
                    },)*
                }
            }
            /// The real address of the intercepted entry point `name`, if NVML has it.
            pub fn address(&self, name: &str) -> Option<usize> {
                match name {
                    $(stringify!($name) => self.$name.map(|f| f as usize),)*
                    _ => None,
                }
            }
        }
    };
}
nvml_hooks!(define_real_nvml);

pub struct Driver {
    pub cuda: Cuda,
    pub helpers: Helpers,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();
static NVML: OnceLock<Nvml> = OnceLock::new();

fn lib_names(var: &str, default: &str) -> Vec<String> {
    match std::env::var(var) {
        Ok(p) if !p.is_empty() => vec![p],
        _ => vec![default.to_string()],
    }
}

/// The real CUDA driver (`VGPU_REAL_LIBCUDA` or `libcuda.so.1`).
pub fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| {
        let h = open(&lib_names("VGPU_REAL_LIBCUDA", "libcuda.so.1"));
        if h.is_null() {
            vlog!(ERROR, "cannot load the CUDA driver (libcuda.so.1); set VGPU_REAL_LIBCUDA for unusual installs");
        }
        Driver { cuda: Cuda::load(h), helpers: Helpers::load(h) }
    })
}

/// The real NVML (`VGPU_REAL_LIBNVML` or `libnvidia-ml.so.1`).
pub fn nvml() -> &'static Nvml {
    NVML.get_or_init(|| Nvml::load(open(&lib_names("VGPU_REAL_LIBNVML", "libnvidia-ml.so.1"))))
}

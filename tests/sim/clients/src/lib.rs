//! Clients that use the (simulated or real) CUDA driver the way applications do, through three
//! binding paths, and run scenarios chosen on the command line, printing JSON lines.
//!
//! * `cuda-rt-app`: like the CUDA runtime: `dlopen("libcuda.so.1", RTLD_LOCAL)` and every entry
//!   point through `cuGetProcAddress_v2` (CUDA version and per-thread flag selectable);
//! * `cuda-direct-app`: linked against `libcuda.so.1` at build time;
//! * `cuda-dlsym-app`: `dlopen` + `dlsym` of each versioned symbol.

pub mod accuracy;
pub mod api;
pub mod bench;
pub mod scenario;

use abi::*;
use std::ffi::{c_char, c_void, CStr, CString};
pub use vgpu_sim::abi;

with_cuda_api!(define_api);

/// Global options shared by all clients.
#[derive(Clone, Debug)]
pub struct Binding {
    /// CUDA version passed to cuGetProcAddress (runtime client only).
    pub cuda_version: i32,
    /// Ask for per-thread-default-stream entry points (runtime client only).
    pub per_thread: bool,
}

pub fn dlopen_cuda() -> Result<*mut c_void, String> {
    let name = std::env::var("VGPU_CLIENT_LIBCUDA").unwrap_or_else(|_| "libcuda.so.1".into());
    let c = CString::new(name.clone()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen with a valid C string; failure is reported through dlerror.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a C string or NULL.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "unknown".into()
        } else {
            // SAFETY: a C string dlerror just returned, read before any other dl call.
            unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
        };
        return Err(format!("cannot load {name}: {msg}"));
    }
    Ok(h)
}

/// An entry point of the driver by its exported name (`dlsym` on a private handle), or NULL.
pub fn driver_symbol(name: &str) -> Result<*mut c_void, String> {
    Ok(dlsym(dlopen_cuda()?, name))
}

fn dlsym(h: *mut c_void, name: &str) -> *mut c_void {
    let c = CString::new(name).unwrap();
    // SAFETY: h is a live dlopen handle; c is a valid C string.
    unsafe { libc::dlsym(h, c.as_ptr()) }
}

/// Binds every entry point with `dlsym` on a private handle.
pub fn bind_dlsym() -> Result<Api, String> {
    let h = dlopen_cuda()?;
    // SAFETY: the symbols of libcuda.so.1 have the signatures declared in the list.
    unsafe { Api::load(|sym, _| dlsym(h, sym)) }
}

type GetProcAddressV2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> CUresult;

/// Binds like the CUDA runtime: only `cuGetProcAddress_v2` is looked up by name.
pub fn bind_runtime(b: &Binding) -> Result<Api, String> {
    let h = dlopen_cuda()?;
    let g = dlsym(h, "cuGetProcAddress_v2");
    if g.is_null() {
        return Err("libcuda.so.1 has no cuGetProcAddress_v2".into());
    }
    // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h.
    let get: GetProcAddressV2 = unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(g) };
    let flags =
        if b.per_thread { CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM } else { CU_GET_PROC_ADDRESS_LEGACY_STREAM };
    let mut err = None;
    // SAFETY: the driver returns entry points with the declared signatures for these names.
    let api = unsafe {
        Api::load(|name, base| {
            let mut p = std::ptr::null_mut();
            let mut st = 0;
            let c = CString::new(base).unwrap();
            let version = match (abi_version(name), introduced(name)) {
                (Some(v), _) => v.min(b.cuda_version),
                (None, Some(v)) => v,
                _ => b.cuda_version,
            };
            let r = get(c.as_ptr(), &mut p, version, flags, &mut st);
            if r != CUresult::SUCCESS && err.is_none() {
                err = Some(format!("cuGetProcAddress_v2({base}, {version}) = {} status {st}", r.0));
            }
            p
        })
    };
    api.map_err(|e| err.unwrap_or(e))
}

/// The CUDA version whose ABI the table's entry `name` has, where later versions changed the
/// signature behind the same base name (as the runtime asks for `PFN_cuCtxCreate_v3020`).
fn abi_version(name: &str) -> Option<i32> {
    match name {
        "cuCtxCreate_v2" => Some(3020),
        "cuGraphExecUpdate" => Some(10020),
        "cuGraphExecKernelNodeSetParams" => Some(10010),
        _ => None,
    }
}

/// Entries asked for at the CUDA version that introduced them, whatever the binding's version (a
/// client emulating an older runtime still binds its whole table; it does not call these).
fn introduced(name: &str) -> Option<i32> {
    match name {
        "cuGraphExecUpdate_v2" | "cuGraphExecKernelNodeSetParams_v2" => Some(12000),
        "cuLibraryLoadData" | "cuLibraryUnload" | "cuLibraryGetKernel" => Some(12000),
        "cuGraphExecNodeSetParams" => Some(12020),
        "cuGraphNodeSetEnabled" => Some(11060),
        "cuGraphExecChildGraphNodeSetParams" | "cuGraphUpload" => Some(11010),
        "cuGraphInstantiateWithFlags" | "cuGraphInstantiateWithParams" => Some(12000),
        "cuGraphAddMemAllocNode" | "cuGraphAddMemFreeNode" => Some(11040),
        "cuDeviceGraphMemTrim" | "cuDeviceGetGraphMemAttribute" => Some(11040),
        "cuMemGetDefaultMemPool" | "cuMemGetMemPool" | "cuMemSetMemPool" | "cuCtxSynchronize_v2" => Some(13000),
        _ => None,
    }
}

/// A CUDA error as its name (CUDA_ERROR_OUT_OF_MEMORY), through the bound table.
pub fn error_name(api: &Api, r: CUresult) -> String {
    let mut s: *const c_char = std::ptr::null();
    // SAFETY: out-pointer to a local; the driver returns a static string or NULL.
    unsafe {
        if (api.cuGetErrorName)(r, &mut s) == CUresult::SUCCESS && !s.is_null() {
            return CStr::from_ptr(s).to_string_lossy().into_owned();
        }
    }
    format!("CUresult({})", r.0)
}

/// Entry point shared by the client binaries: parses the command line, binds, runs the scenario.
pub fn client_main(kind: &'static str, bind: impl FnOnce(&Binding) -> Result<Api, String>) -> ! {
    use clap::{CommandFactory, FromArgMatches};
    let matches = scenario::Cli::command().name(kind).get_matches();
    let cli = scenario::Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(p) = &cli.map_file {
        // Kept mapped until the process ends.
        match vgpu_region::Region::open(p, false) {
            Ok(r) => std::mem::forget(r),
            Err(e) => {
                eprintln!("{kind}: cannot map {}: {e}", p.display());
                std::process::exit(3);
            }
        }
    }
    let b = Binding { cuda_version: cli.cuda_version, per_thread: cli.per_thread };
    if let scenario::Scenario::Procaddr { names } = &cli.scenario {
        match procaddr(&b, names) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("{kind}: {e}");
                std::process::exit(1);
            }
        }
    }
    let api = match bind(&b) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{kind}: {e}");
            std::process::exit(3);
        }
    };
    match scenario::run(&api, &cli) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("{kind}: {e}");
            std::process::exit(1);
        }
    }
}

/// `procaddr SYMBOL...`: asks `cuGetProcAddress_v2` for each base name at the chosen CUDA version and
/// flags, and names the exported symbol the returned pointer belongs to (via `dladdr`).
fn procaddr(b: &Binding, names: &[String]) -> Result<(), String> {
    let h = dlopen_cuda()?;
    let g = dlsym(h, "cuGetProcAddress_v2");
    if g.is_null() {
        return Err("libcuda.so.1 has no cuGetProcAddress_v2".into());
    }
    // SAFETY: cuGetProcAddress_v2 has this signature in cuda.h.
    let get: GetProcAddressV2 = unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(g) };
    let flags = if b.per_thread { CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM } else { CU_GET_PROC_ADDRESS_DEFAULT };
    for name in names {
        let c = CString::new(name.as_str()).map_err(|e| e.to_string())?;
        let (mut p, mut st) = (std::ptr::null_mut(), -1);
        // SAFETY: valid C string and out-pointers to locals.
        let r = unsafe { get(c.as_ptr(), &mut p, b.cuda_version, flags, &mut st) };
        let (mut resolved, mut library) = (serde_json::Value::Null, serde_json::Value::Null);
        if !p.is_null() {
            // SAFETY: dladdr with a code address and an out-struct; the strings it returns are
            // NUL-terminated and owned by the loader.
            unsafe {
                let mut info: libc::Dl_info = std::mem::zeroed();
                if libc::dladdr(p, &mut info) != 0 {
                    if !info.dli_sname.is_null() {
                        resolved = serde_json::json!(CStr::from_ptr(info.dli_sname).to_string_lossy());
                    }
                    if !info.dli_fname.is_null() {
                        library = serde_json::json!(CStr::from_ptr(info.dli_fname).to_string_lossy());
                    }
                }
            }
        }
        println!(
            "{}",
            serde_json::json!({"event": "procaddr", "symbol": name, "version": b.cuda_version,
            "flags": flags, "ret": r.0, "status": st, "resolved": resolved, "library": library})
        );
    }
    Ok(())
}

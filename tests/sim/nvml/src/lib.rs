//! Simulated `libnvidia-ml.so.1`: NVML as `nvml-wrapper` and the NVIDIA tools use it, over the
//! simulated node shared with the simulated `libcuda.so.1`.
//!
//! Handles are addresses inside one static table, so they are stable, distinct and decodable.
//! Every export goes through [`entry`] (initialisation check, fault injection, no unwinding into C).
#![allow(non_snake_case, non_upper_case_globals, clippy::missing_safety_doc)]

use nvml_wrapper_sys::bindings::*;
use std::cell::Cell;
use std::ffi::{c_char, c_uint, c_ulong, CStr};
use std::sync::atomic::{AtomicU32, Ordering::*};
use vgpu_sim::mig::{self, MigErr};
use vgpu_sim::state::{GiRec, MigState, MAX_CI, MAX_GI};
use vgpu_sim::{now_ns, GpuConfig, Node, MAX_GPUS};

type Ret = nvmlReturn_t;
type R<T> = Result<T, Ret>;

const OK: Ret = nvmlReturn_enum_NVML_SUCCESS;
const UNINIT: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NO_PERMISSION: Ret = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
const NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const RESET_REQUIRED: Ret = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const IN_USE: Ret = nvmlReturn_enum_NVML_ERROR_IN_USE;
const INSUFFICIENT_RESOURCES: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

fn mig_err(e: MigErr) -> Ret {
    match e {
        MigErr::InvalidArgument => INVALID,
        MigErr::NotSupported => NOT_SUPPORTED,
        MigErr::InUse => IN_USE,
        MigErr::InsufficientResources => INSUFFICIENT_RESOURCES,
        MigErr::NotFound => NOT_FOUND,
    }
}

static INITS: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static CALL: Cell<&'static str> = const { Cell::new("") };
}

fn node() -> R<&'static Node> {
    if INITS.load(Acquire) == 0 {
        return Err(UNINIT);
    }
    Node::global().map_err(|_| UNINIT)
}

#[inline]
fn entry(name: &'static str, f: impl FnOnce() -> R<()>) -> Ret {
    CALL.with(|c| c.set(name));
    if let Ok(n) = Node::global() {
        if let Some(code) = n.fault(name, None) {
            return code as Ret;
        }
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => OK,
        Ok(Err(e)) => e,
        Err(_) => UNKNOWN,
    }
}

fn out<T>(p: *mut T, v: T) -> R<()> {
    if p.is_null() {
        return Err(INVALID);
    }
    // SAFETY: non-null out-pointer from the caller, per the NVML contract.
    unsafe { p.write(v) };
    Ok(())
}

fn write_str(dst: *mut c_char, len: c_uint, s: &str) -> R<()> {
    if dst.is_null() {
        return Err(INVALID);
    }
    if (len as usize) < s.len() + 1 {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: dst has room for len >= s.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst as *mut u8, s.len());
        *dst.add(s.len()) = 0;
    }
    Ok(())
}

fn fill_chars<const N: usize>(dst: &mut [c_char; N], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().take(N - 1)) {
        *d = b as c_char;
    }
}

/// Writes `items` into a caller array of capacity `*count`, NVML style.
fn write_list<T: Copy>(arr: *mut T, count: *mut c_uint, items: &[T]) -> R<()> {
    if count.is_null() {
        return Err(INVALID);
    }
    // SAFETY: count is non-null.
    let cap = unsafe { *count } as usize;
    out(count, items.len() as c_uint)?;
    if items.is_empty() {
        return Ok(());
    }
    if arr.is_null() || cap < items.len() {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: arr holds at least cap >= items.len() elements.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), arr, items.len()) };
    Ok(())
}

// ----- handles -----

const GI_IDS: usize = MAX_GI + 1;
const N_DEV: usize = MAX_GPUS;
const N_GI: usize = MAX_GPUS * GI_IDS;
const N_CI: usize = N_GI * MAX_CI;
static HANDLES: [u8; N_DEV + N_GI + 2 * N_CI] = [0; N_DEV + N_GI + 2 * N_CI];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum H {
    Dev(usize),
    Gi(usize, u32),
    Ci(usize, u32, u32),
    Mig(usize, u32, u32),
}

fn base() -> usize {
    HANDLES.as_ptr() as usize
}

fn encode(h: H) -> usize {
    base()
        + match h {
            H::Dev(g) => g,
            H::Gi(g, gi) => N_DEV + g * GI_IDS + gi as usize,
            H::Ci(g, gi, ci) => N_DEV + N_GI + (g * GI_IDS + gi as usize) * MAX_CI + ci as usize,
            H::Mig(g, gi, ci) => N_DEV + N_GI + N_CI + (g * GI_IDS + gi as usize) * MAX_CI + ci as usize,
        }
}

fn decode(p: usize) -> R<H> {
    let off = p.checked_sub(base()).ok_or(INVALID)?;
    let h = if off < N_DEV {
        H::Dev(off)
    } else if off < N_DEV + N_GI {
        let o = off - N_DEV;
        H::Gi(o / GI_IDS, (o % GI_IDS) as u32)
    } else if off < N_DEV + N_GI + N_CI {
        let o = off - N_DEV - N_GI;
        H::Ci(o / MAX_CI / GI_IDS, ((o / MAX_CI) % GI_IDS) as u32, (o % MAX_CI) as u32)
    } else if off < N_DEV + N_GI + 2 * N_CI {
        let o = off - N_DEV - N_GI - N_CI;
        H::Mig(o / MAX_CI / GI_IDS, ((o / MAX_CI) % GI_IDS) as u32, (o % MAX_CI) as u32)
    } else {
        return Err(INVALID);
    };
    Ok(h)
}

fn dev_handle(g: usize) -> nvmlDevice_t {
    encode(H::Dev(g)) as nvmlDevice_t
}

/// A handle's GPU, after its per-GPU faults.
fn gpu_of(n: &'static Node, g: usize) -> R<&'static GpuConfig> {
    let cfg = n.cfg.gpus.get(g).ok_or(INVALID)?;
    if let Some(code) = n.fault(CALL.with(Cell::get), Some(g)) {
        return Err(code as Ret);
    }
    Ok(cfg)
}

/// A physical GPU handle.
fn phys(d: nvmlDevice_t) -> R<(&'static Node, usize, &'static GpuConfig)> {
    let n = node()?;
    match decode(d as usize)? {
        H::Dev(g) => Ok((n, g, gpu_of(n, g)?)),
        _ => Err(INVALID),
    }
}

/// MIG state snapshot of GPU `g`.
fn mig_state(n: &Node, g: usize) -> MigState {
    let mut l = n.lock();
    *n.mig(&mut l, g)
}

/// (GPU instance slot, compute instance slot) for a MIG handle that is still live.
fn find_ci(st: &MigState, gi: u32, ci: u32) -> R<(usize, usize)> {
    let gs = mig::gi_by_id(st, gi).ok_or(NOT_FOUND)?;
    let cs = st.gis[gs].cis.iter().position(|c| c.live != 0 && c.id == ci).ok_or(NOT_FOUND)?;
    Ok((gs, cs))
}

fn gi_profile(cfg: &GpuConfig, g: &GiRec) -> R<&'static vgpu_sim::models::GiProfile> {
    cfg.model.mig.as_ref().and_then(|t| t.by_id(g.profile_id)).ok_or(UNKNOWN)
}

fn privileged() -> R<()> {
    if std::env::var_os("VGPU_SIM_UNPRIVILEGED").is_some_and(|v| v == "1") {
        Err(NO_PERMISSION)
    } else {
        Ok(())
    }
}

fn realtime_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

macro_rules! exports {
    ($( fn $name:ident ( $($a:ident : $t:ty),* $(,)? ) $body:block )*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($a: $t),*) -> nvmlReturn_t {
                entry(stringify!($name), move || -> R<()> { $body })
            }
        )*
    };
}

/// `nvmlErrorString` returns a string, not a code, so it is written out by hand.
#[no_mangle]
pub extern "C" fn nvmlErrorString(r: nvmlReturn_t) -> *const c_char {
    let s: &'static CStr = match r {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        10 => c"Timeout",
        13 => c"Function Not Found",
        15 => c"GPU is lost",
        16 => c"GPU requires reset",
        19 => c"In use by another client",
        23 => c"Insufficient resources",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

exports! {
    // ----- init -----
    fn nvmlInit_v2() {
        Node::global().map_err(|e| { eprintln!("vgpu-sim libnvidia-ml: {e}"); nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED })?;
        INITS.fetch_add(1, AcqRel);
        Ok(())
    }
    fn nvmlInit() {
        Node::global().map_err(|_| nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED)?;
        INITS.fetch_add(1, AcqRel);
        Ok(())
    }
    fn nvmlInitWithFlags(_flags: c_uint) {
        Node::global().map_err(|_| nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED)?;
        INITS.fetch_add(1, AcqRel);
        Ok(())
    }
    fn nvmlShutdown() {
        INITS.fetch_update(AcqRel, Acquire, |n| n.checked_sub(1)).map(|_| ()).map_err(|_| UNINIT)
    }

    // ----- system -----
    fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) { write_str(buf, len, &node()?.cfg.driver_version) }
    fn nvmlSystemGetNVMLVersion(buf: *mut c_char, len: c_uint) {
        let n = node()?;
        write_str(buf, len, &format!("{}.{}", n.cfg.cuda_version / 1000, n.cfg.driver_version))
    }
    fn nvmlSystemGetCudaDriverVersion(v: *mut i32) { out(v, node()?.cfg.cuda_version) }
    fn nvmlSystemGetCudaDriverVersion_v2(v: *mut i32) { out(v, node()?.cfg.cuda_version) }
    fn nvmlSystemGetProcessName(pid: c_uint, buf: *mut c_char, len: c_uint) {
        node()?;
        let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).map_err(|_| NOT_FOUND)?;
        write_str(buf, len, name.trim_end())
    }

    // ----- enumeration -----
    // Only the GPUs the container runtime exposed (`Node::exposed`), indexed among them.
    fn nvmlDeviceGetCount_v2(n: *mut c_uint) { let node = node()?; out(n, node.exposed().len() as c_uint) }
    fn nvmlDeviceGetCount(n: *mut c_uint) { let node = node()?; out(n, node.exposed().len() as c_uint) }
    fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, d: *mut nvmlDevice_t) {
        let n = node()?;
        let g = *n.exposed().get(i as usize).ok_or(INVALID)?;
        gpu_of(n, g)?;
        out(d, dev_handle(g))
    }
    fn nvmlDeviceGetHandleByIndex(i: c_uint, d: *mut nvmlDevice_t) {
        let n = node()?;
        let g = *n.exposed().get(i as usize).ok_or(INVALID)?;
        gpu_of(n, g)?;
        out(d, dev_handle(g))
    }
    fn nvmlDeviceGetHandleByUUID(u: *const c_char, d: *mut nvmlDevice_t) {
        let n = node()?;
        if u.is_null() { return Err(INVALID); }
        // SAFETY: NUL-terminated string from the caller.
        let u = unsafe { CStr::from_ptr(u) }.to_str().map_err(|_| INVALID)?;
        if u.starts_with("MIG-") {
            // A MIG device's UUID names its handle, as the driver's does.
            for (g, cfg) in n.cfg.gpus.iter().enumerate() {
                let st = mig_state(n, g);
                for gi in st.gis.iter().filter(|x| x.live != 0) {
                    for ci in gi.cis.iter().filter(|c| c.live != 0) {
                        if mig::mig_uuid(&cfg.uuid, gi.serial, ci.id) == u && n.exposed().contains(&g) {
                            return out(d, encode(H::Mig(g, gi.id, ci.id)) as nvmlDevice_t);
                        }
                    }
                }
            }
            return Err(NOT_FOUND);
        }
        let g = n.cfg.gpus.iter().find(|g| g.uuid == u && n.exposed().contains(&(g.index as usize))).ok_or(NOT_FOUND)?;
        out(d, dev_handle(g.index as usize))
    }
    fn nvmlDeviceGetHandleByPciBusId_v2(b: *const c_char, d: *mut nvmlDevice_t) {
        let n = node()?;
        if b.is_null() { return Err(INVALID); }
        // SAFETY: NUL-terminated string from the caller.
        let b = unsafe { CStr::from_ptr(b) }.to_str().map_err(|_| INVALID)?.to_ascii_lowercase();
        let g = n.cfg.gpus.iter().find(|g| b.ends_with(&g.pci_bus_id) && n.exposed().contains(&(g.index as usize))).ok_or(NOT_FOUND)?;
        out(d, dev_handle(g.index as usize))
    }
    fn nvmlDeviceGetIndex(d: nvmlDevice_t, i: *mut c_uint) {
        let (n, g, _) = phys(d)?;
        out(i, n.exposed().iter().position(|&x| x == g).ok_or(NOT_FOUND)? as c_uint)
    }
    fn nvmlDeviceGetMinorNumber(d: nvmlDevice_t, i: *mut c_uint) { out(i, phys(d)?.1 as c_uint) }

    // ----- identity -----
    fn nvmlDeviceGetName(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) {
        let n = node()?;
        match decode(d as usize)? {
            H::Dev(g) => write_str(buf, len, gpu_of(n, g)?.model.name),
            H::Mig(g, gi, ci) => {
                let cfg = gpu_of(n, g)?;
                let st = mig_state(n, g);
                let (gs, _) = find_ci(&st, gi, ci)?;
                write_str(buf, len, &format!("{} MIG {}", cfg.model.name, gi_profile(cfg, &st.gis[gs])?.name))
            }
            _ => Err(INVALID),
        }
    }
    fn nvmlDeviceGetUUID(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) {
        let n = node()?;
        match decode(d as usize)? {
            H::Dev(g) => write_str(buf, len, &gpu_of(n, g)?.uuid),
            H::Mig(g, gi, ci) => {
                let cfg = gpu_of(n, g)?;
                let st = mig_state(n, g);
                let (gs, _) = find_ci(&st, gi, ci)?;
                write_str(buf, len, &mig::mig_uuid(&cfg.uuid, st.gis[gs].serial, ci))
            }
            _ => Err(INVALID),
        }
    }
    fn nvmlDeviceGetSerial(d: nvmlDevice_t, buf: *mut c_char, len: c_uint) {
        let (_, g, _) = phys(d)?;
        write_str(buf, len, &format!("{:013}", 1_650_000_000_000u64 + g as u64))
    }
    fn nvmlDeviceGetPciInfo_v3(d: nvmlDevice_t, p: *mut nvmlPciInfo_t) {
        let (_, _, c) = phys(d)?;
        // SAFETY: nvmlPciInfo_t is plain old data; all-zero is valid.
        let mut info: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        fill_chars(&mut info.busIdLegacy, &format!("{:04X}:{:02X}:{:02X}.0", c.pci_domain, c.pci_bus, c.pci_device));
        fill_chars(&mut info.busId, &format!("{:08X}:{:02X}:{:02X}.0", c.pci_domain, c.pci_bus, c.pci_device));
        info.domain = c.pci_domain;
        info.bus = c.pci_bus;
        info.device = c.pci_device;
        info.pciDeviceId = c.model.pci_device_id;
        info.pciSubSystemId = 0x1_6310DE;
        out(p, info)
    }
    fn nvmlDeviceGetCudaComputeCapability(d: nvmlDevice_t, major: *mut i32, minor: *mut i32) {
        let (_, _, c) = phys(d)?;
        out(major, c.model.cc.0 as i32)?;
        out(minor, c.model.cc.1 as i32)
    }
    fn nvmlDeviceGetArchitecture(d: nvmlDevice_t, a: *mut nvmlDeviceArchitecture_t) {
        let (_, _, c) = phys(d)?;
        out(a, match c.model.arch {
            vgpu_sim::models::Arch::Ampere => NVML_DEVICE_ARCH_AMPERE,
            vgpu_sim::models::Arch::Ada => NVML_DEVICE_ARCH_ADA,
            vgpu_sim::models::Arch::Hopper => NVML_DEVICE_ARCH_HOPPER,
        })
    }
    fn nvmlDeviceGetAttributes_v2(d: nvmlDevice_t, a: *mut nvmlDeviceAttributes_t) {
        let n = node()?;
        match decode(d as usize)? {
            H::Dev(g) => {
                let c = gpu_of(n, g)?;
                out(a, nvmlDeviceAttributes_t {
                    multiprocessorCount: c.sm_count, sharedCopyEngineCount: 7, sharedDecoderCount: 5,
                    sharedEncoderCount: 0, sharedJpegCount: 1, sharedOfaCount: 1,
                    gpuInstanceSliceCount: 0, computeInstanceSliceCount: 0, memorySizeMB: c.memory_bytes >> 20,
                })
            }
            H::Mig(g, gi, ci) => {
                let c = gpu_of(n, g)?;
                let st = mig_state(n, g);
                let (gs, cs) = find_ci(&st, gi, ci)?;
                let p = gi_profile(c, &st.gis[gs])?;
                let cslices = st.gis[gs].cis[cs].size;
                out(a, nvmlDeviceAttributes_t {
                    multiprocessorCount: p.sm * cslices / p.g, sharedCopyEngineCount: p.ce, sharedDecoderCount: p.dec,
                    sharedEncoderCount: p.enc, sharedJpegCount: p.jpeg, sharedOfaCount: p.ofa,
                    gpuInstanceSliceCount: p.g, computeInstanceSliceCount: cslices, memorySizeMB: p.mib,
                })
            }
            _ => Err(INVALID),
        }
    }

    // ----- memory, processes, utilisation -----
    fn nvmlDeviceGetMemoryInfo(d: nvmlDevice_t, m: *mut nvmlMemory_t) {
        let (total, used) = memory(d)?;
        out(m, nvmlMemory_t { total, free: total - used, used })
    }
    fn nvmlDeviceGetMemoryInfo_v2(d: nvmlDevice_t, m: *mut nvmlMemory_v2_t) {
        if m.is_null() { return Err(INVALID); }
        let (total, used) = memory(d)?;
        // SAFETY: m is non-null; the caller set `version`.
        let version = unsafe { (*m).version };
        out(m, nvmlMemory_v2_t { version, total, reserved: 0, free: total - used, used })
    }
    fn nvmlDeviceGetComputeRunningProcesses_v3(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        write_list(infos, count, &process_infos(d, List::Compute)?)
    }
    fn nvmlDeviceGetComputeRunningProcesses_v2(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) {
        write_list(infos, count, &process_infos(d, List::Compute)?)
    }
    fn nvmlDeviceGetComputeRunningProcesses(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        write_list(infos, count, &process_infos_v1(d, List::Compute)?)
    }
    fn nvmlDeviceGetGraphicsRunningProcesses_v3(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        write_list(infos, count, &process_infos(d, List::Graphics)?)
    }
    fn nvmlDeviceGetGraphicsRunningProcesses_v2(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) {
        write_list(infos, count, &process_infos(d, List::Graphics)?)
    }
    fn nvmlDeviceGetGraphicsRunningProcesses(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        write_list(infos, count, &process_infos_v1(d, List::Graphics)?)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) {
        write_list(infos, count, &process_infos(d, List::Mps)?)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v2_t) {
        write_list(infos, count, &process_infos(d, List::Mps)?)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses(d: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_v1_t) {
        write_list(infos, count, &process_infos_v1(d, List::Mps)?)
    }
    fn nvmlDeviceGetRunningProcessDetailList(d: nvmlDevice_t, l: *mut nvmlProcessDetailList_t) {
        let l = v1_struct(l)?;
        let which = match l.mode { 0 => List::Compute, 1 => List::Graphics, 2 => List::Mps, _ => return Err(INVALID) };
        let list: Vec<nvmlProcessDetail_v1_t> = listed(d, which)?.into_iter()
            .map(|p| nvmlProcessDetail_v1_t {
                pid: p.pid, usedGpuMemory: p.bytes, gpuInstanceId: p.gi(), computeInstanceId: p.ci(),
                usedGpuCcProtectedMemory: 0,
            })
            .collect();
        write_list(l.procArray, &mut l.numProcArrayEntries, &list)
    }
    fn nvmlDeviceGetUtilizationRates(d: nvmlDevice_t, u: *mut nvmlUtilization_t) {
        let (n, g, _) = phys(d)?;
        let now = now_ns();
        let w = n.cfg.util_window_ns;
        let (busy, _) = n.busy(g, now.saturating_sub(w), now);
        let pct = share_pct(busy, w);
        out(u, nvmlUtilization_t { gpu: pct, memory: pct / 2 })
    }
    // Sensors (what HAMi's monitor reads per scrape): a GPU warms by 0.4 degrees and draws 3 W
    // more per percent it is busy over the utilisation window, from 30 degrees and 60 W idle; its
    // ECC counts stay zero.
    fn nvmlDeviceGetTemperature(d: nvmlDevice_t, sensor: nvmlTemperatureSensors_t, t: *mut c_uint) {
        if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
            return Err(INVALID);
        }
        out(t, 30 + busy_pct(d)? * 2 / 5)
    }
    fn nvmlDeviceGetPowerUsage(d: nvmlDevice_t, mw: *mut c_uint) {
        out(mw, 60_000 + busy_pct(d)? * 3_000)
    }
    fn nvmlDeviceGetTotalEccErrors(
        d: nvmlDevice_t, _kind: nvmlMemoryErrorType_t, _counter: nvmlEccCounterType_t, n: *mut u64,
    ) {
        phys(d)?;
        out(n, 0u64)
    }
    fn nvmlDeviceGetSamples(
        d: nvmlDevice_t, kind: nvmlSamplingType_t, last_seen: u64, vt: *mut nvmlValueType_t, count: *mut c_uint,
        s: *mut nvmlSample_t,
    ) {
        let (n, g, _) = phys(d)?;
        let memory = match kind {
            nvmlSamplingType_enum_NVML_GPU_UTILIZATION_SAMPLES => false,
            nvmlSamplingType_enum_NVML_MEMORY_UTILIZATION_SAMPLES => true,
            _ => return Err(NOT_SUPPORTED),
        };
        if count.is_null() {
            return Err(INVALID);
        }
        out(vt, nvmlValueType_enum_NVML_VALUE_TYPE_UNSIGNED_INT)?;
        let list = utilization_samples(n, g, last_seen, memory);
        if list.is_empty() {
            out(count, 0)?;
            return Err(NOT_FOUND);
        }
        if s.is_null() {
            return out(count, list.len() as c_uint);
        }
        // As many as the array holds, the newest, oldest first.
        // SAFETY: count is non-null.
        let k = (unsafe { *count } as usize).min(list.len());
        // SAFETY: s holds *count >= k entries.
        unsafe { std::ptr::copy_nonoverlapping(list[list.len() - k..].as_ptr(), s, k) };
        out(count, k as c_uint)
    }
    fn nvmlDeviceGetProcessUtilization(d: nvmlDevice_t, s: *mut nvmlProcessUtilizationSample_t, count: *mut c_uint, last_seen: u64) {
        let samples = process_samples(d, last_seen);
        if let Err(NOT_FOUND) = samples {
            if !count.is_null() { out(count, 0)?; }
        }
        write_list(s, count, &samples?)
    }
    fn nvmlDeviceGetProcessesUtilizationInfo(d: nvmlDevice_t, info: *mut nvmlProcessesUtilizationInfo_t) {
        let info = v1_struct(info)?;
        let samples = match process_samples(d, info.lastSeenTimeStamp) {
            Err(NOT_FOUND) => {
                info.processSamplesCount = 0;
                return Err(NOT_FOUND);
            }
            r => r?,
        };
        let list: Vec<nvmlProcessUtilizationInfo_v1_t> = samples.iter()
            .map(|s| nvmlProcessUtilizationInfo_v1_t {
                timeStamp: s.timeStamp, pid: s.pid, smUtil: s.smUtil, memUtil: s.memUtil, encUtil: s.encUtil,
                decUtil: s.decUtil, jpgUtil: 0, ofaUtil: 0,
            })
            .collect();
        write_list(info.procUtilArray, &mut info.processSamplesCount, &list)
    }

    // ----- topology -----
    fn nvmlDeviceGetNumaNodeId(d: nvmlDevice_t, node_id: *mut c_uint) { out(node_id, phys(d)?.2.numa_node as c_uint) }
    fn nvmlDeviceGetCpuAffinity(d: nvmlDevice_t, size: c_uint, set: *mut c_ulong) {
        let (n, _, c) = phys(d)?;
        cpu_set(n, c.numa_node, size, set)
    }
    fn nvmlDeviceGetCpuAffinityWithinScope(d: nvmlDevice_t, size: c_uint, set: *mut c_ulong, _scope: nvmlAffinityScope_t) {
        let (n, _, c) = phys(d)?;
        cpu_set(n, c.numa_node, size, set)
    }
    fn nvmlDeviceGetMemoryAffinity(d: nvmlDevice_t, size: c_uint, set: *mut c_ulong, _scope: nvmlAffinityScope_t) {
        let (_, _, c) = phys(d)?;
        if set.is_null() || size == 0 { return Err(INVALID); }
        // SAFETY: set holds `size` words.
        let s = unsafe { std::slice::from_raw_parts_mut(set, size as usize) };
        s.fill(0);
        let bit = c.numa_node.max(0) as usize;
        if bit / 64 < s.len() { s[bit / 64] |= 1 << (bit % 64); }
        Ok(())
    }
    fn nvmlDeviceGetTopologyCommonAncestor(a: nvmlDevice_t, b: nvmlDevice_t, level: *mut nvmlGpuTopologyLevel_t) {
        let (_, ga, ca) = phys(a)?;
        let (_, gb, cb) = phys(b)?;
        out(level, if ga == gb { nvmlGpuLevel_enum_NVML_TOPOLOGY_INTERNAL }
            else if ca.numa_node == cb.numa_node { nvmlGpuLevel_enum_NVML_TOPOLOGY_NODE }
            else { nvmlGpuLevel_enum_NVML_TOPOLOGY_SYSTEM })
    }
    fn nvmlDeviceGetP2PStatus(a: nvmlDevice_t, b: nvmlDevice_t, idx: nvmlGpuP2PCapsIndex_t, st: *mut nvmlGpuP2PStatus_t) {
        let (_, ga, ca) = phys(a)?;
        let (_, gb, cb) = phys(b)?;
        let linked = ga != gb && ca.nvlink_domain.is_some() && ca.nvlink_domain == cb.nvlink_domain;
        // Over NVLink only between linked GPUs; reads and writes also through PCIe within a NUMA node.
        let same_numa = ga != gb && ca.numa_node == cb.numa_node && idx != nvmlGpuP2PCapsIndex_enum_NVML_P2P_CAPS_INDEX_NVLINK;
        out(st, if linked || same_numa { nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_OK } else { nvmlGpuP2PStatus_enum_NVML_P2P_STATUS_NOT_SUPPORTED })
    }

    // ----- events (XID) -----
    fn nvmlDeviceGetSupportedEventTypes(d: nvmlDevice_t, t: *mut u64) { phys(d)?; out(t, nvmlEventTypeXidCriticalError as u64) }
    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) {
        node()?;
        out(set, Box::into_raw(Box::new(EventSet { devs: std::sync::Mutex::new(Vec::new()) })) as nvmlEventSet_t)
    }
    fn nvmlDeviceRegisterEvents(d: nvmlDevice_t, types: u64, set: nvmlEventSet_t) {
        let (n, g, _) = phys(d)?;
        if set.is_null() { return Err(INVALID); }
        if types & !(nvmlEventTypeXidCriticalError as u64) != 0 { return Err(NOT_SUPPORTED); }
        // SAFETY: event sets are boxes made by nvmlEventSetCreate and freed only by nvmlEventSetFree.
        let es = unsafe { &*(set as *const EventSet) };
        let next = n.xids_since(g, u64::MAX).0;
        es.devs.lock().unwrap().push((g, next));
        Ok(())
    }
    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) {
        let n = node()?;
        if set.is_null() || data.is_null() { return Err(INVALID); }
        // SAFETY: see nvmlDeviceRegisterEvents.
        let es = unsafe { &*(set as *const EventSet) };
        let deadline = now_ns() + timeout_ms as u64 * 1_000_000;
        loop {
            {
                let mut devs = es.devs.lock().unwrap();
                for (g, next) in devs.iter_mut() {
                    let (_, x) = n.xids_since(*g, *next);
                    if let Some(x) = x.first() {
                        *next += 1;
                        let (gi, ci) = x.instance.unwrap_or((u32::MAX, u32::MAX));
                        return out(data, nvmlEventData_t { device: dev_handle(*g), eventType: nvmlEventTypeXidCriticalError as u64,
                            eventData: x.code, gpuInstanceId: gi, computeInstanceId: ci });
                    }
                }
            }
            let now = now_ns();
            if now >= deadline { return Err(TIMEOUT); }
            // Events arrive within 25 ms (a watcher of many GPUs must not spin).
            std::thread::sleep(std::time::Duration::from_nanos((deadline - now).min(25_000_000)));
        }
    }
    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        node()?;
        if set.is_null() { return Err(INVALID); }
        // SAFETY: made by nvmlEventSetCreate; the caller frees it once.
        drop(unsafe { Box::from_raw(set as *mut EventSet) });
        Ok(())
    }

    // ----- MIG -----
    fn nvmlDeviceGetMigMode(d: nvmlDevice_t, cur: *mut c_uint, pend: *mut c_uint) {
        let (n, g, c) = phys(d)?;
        c.model.mig.ok_or(NOT_SUPPORTED)?;
        let st = mig_state(n, g);
        out(cur, st.current)?;
        out(pend, st.pending)
    }
    fn nvmlDeviceSetMigMode(d: nvmlDevice_t, mode: c_uint, status: *mut nvmlReturn_t) {
        let (n, g, c) = phys(d)?;
        privileged()?;
        if status.is_null() { return Err(INVALID); }
        n.reap();
        let in_use = n.gpu_in_use(g, None);
        let mut l = n.lock();
        let a = mig::set_mode(n.mig(&mut l, g), c.model, mode, in_use).map_err(mig_err)?;
        out(status, match a { mig::Activation::Done => OK, mig::Activation::ResetRequired => RESET_REQUIRED })
    }
    fn nvmlDeviceGetMaxMigDeviceCount(d: nvmlDevice_t, c: *mut c_uint) {
        let (_, _, cfg) = phys(d)?;
        out(c, cfg.model.mig.ok_or(NOT_SUPPORTED)?.compute_slices)
    }
    fn nvmlDeviceGetGpuInstanceProfileInfo(d: nvmlDevice_t, idx: c_uint, info: *mut nvmlGpuInstanceProfileInfo_t) {
        let p = profile_by_idx(d, idx)?;
        out(info, nvmlGpuInstanceProfileInfo_t { id: p.id, isP2pSupported: 0, sliceCount: p.g, instanceCount: p.max,
            multiprocessorCount: p.sm, copyEngineCount: p.ce, decoderCount: p.dec, encoderCount: p.enc,
            jpegCount: p.jpeg, ofaCount: p.ofa, memorySizeMB: p.mib })
    }
    fn nvmlDeviceGetGpuInstanceProfileInfoV(d: nvmlDevice_t, idx: c_uint, info: *mut nvmlGpuInstanceProfileInfo_v2_t) {
        let p = profile_by_idx(d, idx)?;
        if info.is_null() { return Err(INVALID); }
        // SAFETY: info is non-null; the caller set `version`.
        let version = unsafe { (*info).version };
        let mut v = nvmlGpuInstanceProfileInfo_v2_t { version, id: p.id, isP2pSupported: 0, sliceCount: p.g,
            instanceCount: p.max, multiprocessorCount: p.sm, copyEngineCount: p.ce, decoderCount: p.dec,
            encoderCount: p.enc, jpegCount: p.jpeg, ofaCount: p.ofa, memorySizeMB: p.mib, name: [0; 96] };
        fill_chars(&mut v.name, &format!("MIG {}", p.name));
        out(info, v)
    }
    fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(d: nvmlDevice_t, pid: c_uint, pl: *mut nvmlGpuInstancePlacement_t, count: *mut c_uint) {
        let (_, _, c) = phys(d)?;
        let v: Vec<nvmlGpuInstancePlacement_t> = mig::placements(c.model, pid).map_err(mig_err)?
            .into_iter().map(|(start, size)| nvmlGpuInstancePlacement_t { start, size }).collect();
        if pl.is_null() { return out(count, v.len() as c_uint); }
        write_list(pl, count, &v)
    }
    fn nvmlDeviceGetGpuInstanceRemainingCapacity(d: nvmlDevice_t, pid: c_uint, count: *mut c_uint) {
        let (n, g, c) = phys(d)?;
        out(count, mig::remaining_gi(&mig_state(n, g), c.model, pid).map_err(mig_err)?)
    }
    fn nvmlDeviceCreateGpuInstance(d: nvmlDevice_t, pid: c_uint, gi: *mut nvmlGpuInstance_t) {
        create_gi(d, pid, None, gi)
    }
    fn nvmlDeviceCreateGpuInstanceWithPlacement(d: nvmlDevice_t, pid: c_uint, pl: *const nvmlGpuInstancePlacement_t, gi: *mut nvmlGpuInstance_t) {
        // SAFETY: optional input pointer from the caller.
        let p = unsafe { pl.as_ref() }.ok_or(INVALID)?;
        create_gi(d, pid, Some((p.start, p.size)), gi)
    }
    fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) {
        let (n, g, id) = gi_handle(gi)?;
        privileged()?;
        let mut l = n.lock();
        let st = n.mig(&mut l, g);
        let slot = mig::gi_by_id(st, id).ok_or(INVALID)?;
        mig::destroy_gi(st, slot).map_err(mig_err)
    }
    fn nvmlDeviceGetGpuInstances(d: nvmlDevice_t, pid: c_uint, gis: *mut nvmlGpuInstance_t, count: *mut c_uint) {
        let (n, g, c) = phys(d)?;
        c.model.mig.ok_or(NOT_SUPPORTED)?.by_id(pid).ok_or(INVALID)?;
        let st = mig_state(n, g);
        let v: Vec<nvmlGpuInstance_t> = st.gis.iter().filter(|x| x.live != 0 && x.profile_id == pid)
            .map(|x| encode(H::Gi(g, x.id)) as nvmlGpuInstance_t).collect();
        if gis.is_null() { return Err(INVALID); }
        // NVML expects room for instanceCount entries and writes the count.
        // SAFETY: gis holds at least the profile's instanceCount entries per the API contract.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), gis, v.len()) };
        out(count, v.len() as c_uint)
    }
    fn nvmlDeviceGetGpuInstanceById(d: nvmlDevice_t, id: c_uint, gi: *mut nvmlGpuInstance_t) {
        let (n, g, _) = phys(d)?;
        mig::gi_by_id(&mig_state(n, g), id).ok_or(NOT_FOUND)?;
        out(gi, encode(H::Gi(g, id)) as nvmlGpuInstance_t)
    }
    fn nvmlGpuInstanceGetInfo(gi: nvmlGpuInstance_t, info: *mut nvmlGpuInstanceInfo_t) {
        let (n, g, id) = gi_handle(gi)?;
        let st = mig_state(n, g);
        let x = &st.gis[mig::gi_by_id(&st, id).ok_or(INVALID)?];
        out(info, nvmlGpuInstanceInfo_t { device: dev_handle(g), id, profileId: x.profile_id,
            placement: nvmlGpuInstancePlacement_t { start: x.start, size: x.size } })
    }
    fn nvmlGpuInstanceGetComputeInstanceProfileInfo(gi: nvmlGpuInstance_t, prof: c_uint, eng: c_uint, info: *mut nvmlComputeInstanceProfileInfo_t) {
        let (sm, p) = ci_profile_info(gi, prof, eng)?;
        out(info, nvmlComputeInstanceProfileInfo_t { id: prof, sliceCount: p.0, instanceCount: p.1, multiprocessorCount: sm,
            sharedCopyEngineCount: 0, sharedDecoderCount: 0, sharedEncoderCount: 0, sharedJpegCount: 0, sharedOfaCount: 0 })
    }
    fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(gi: nvmlGpuInstance_t, prof: c_uint, eng: c_uint, info: *mut nvmlComputeInstanceProfileInfo_v2_t) {
        let (sm, p) = ci_profile_info(gi, prof, eng)?;
        if info.is_null() { return Err(INVALID); }
        // SAFETY: non-null; the caller set `version`.
        let version = unsafe { (*info).version };
        let mut v = nvmlComputeInstanceProfileInfo_v2_t { version, id: prof, sliceCount: p.0, instanceCount: p.1,
            multiprocessorCount: sm, sharedCopyEngineCount: 0, sharedDecoderCount: 0, sharedEncoderCount: 0,
            sharedJpegCount: 0, sharedOfaCount: 0, name: [0; 96] };
        fill_chars(&mut v.name, &format!("{}c", p.0));
        out(info, v)
    }
    fn nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi: nvmlGpuInstance_t, prof: c_uint, pl: *mut nvmlComputeInstancePlacement_t, count: *mut c_uint) {
        let (n, g, id) = gi_handle(gi)?;
        let st = mig_state(n, g);
        let x = &st.gis[mig::gi_by_id(&st, id).ok_or(INVALID)?];
        let (size, _, starts) = mig::ci_profile(n.cfg.gpus[g].model, x, prof).map_err(mig_err)?;
        let v: Vec<_> = starts.into_iter().map(|start| nvmlComputeInstancePlacement_t { start, size }).collect();
        if pl.is_null() { return out(count, v.len() as c_uint); }
        write_list(pl, count, &v)
    }
    fn nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi: nvmlGpuInstance_t, prof: c_uint, count: *mut c_uint) {
        let (n, g, id) = gi_handle(gi)?;
        let st = mig_state(n, g);
        let slot = mig::gi_by_id(&st, id).ok_or(INVALID)?;
        out(count, mig::remaining_ci(&st, n.cfg.gpus[g].model, slot, prof).map_err(mig_err)?)
    }
    fn nvmlGpuInstanceCreateComputeInstance(gi: nvmlGpuInstance_t, prof: c_uint, ci: *mut nvmlComputeInstance_t) {
        create_ci(gi, prof, None, ci)
    }
    fn nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi: nvmlGpuInstance_t, prof: c_uint, pl: *const nvmlComputeInstancePlacement_t, ci: *mut nvmlComputeInstance_t) {
        // SAFETY: optional input pointer from the caller.
        let p = unsafe { pl.as_ref() }.ok_or(INVALID)?;
        create_ci(gi, prof, Some(p.start), ci)
    }
    fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) {
        let n = node()?;
        let H::Ci(g, gi, cid) = decode(ci as usize)? else { return Err(INVALID) };
        privileged()?;
        let mut l = n.lock();
        let st = n.mig(&mut l, g);
        let (gs, cs) = find_ci(st, gi, cid).map_err(|_| INVALID)?;
        mig::destroy_ci(st, gs, cs).map_err(mig_err)
    }
    fn nvmlGpuInstanceGetComputeInstances(gi: nvmlGpuInstance_t, prof: c_uint, cis: *mut nvmlComputeInstance_t, count: *mut c_uint) {
        let (n, g, id) = gi_handle(gi)?;
        let st = mig_state(n, g);
        let x = &st.gis[mig::gi_by_id(&st, id).ok_or(INVALID)?];
        let v: Vec<nvmlComputeInstance_t> = x.cis.iter().filter(|c| c.live != 0 && c.profile_id == prof)
            .map(|c| encode(H::Ci(g, id, c.id)) as nvmlComputeInstance_t).collect();
        if cis.is_null() { return Err(INVALID); }
        // SAFETY: cis holds at least the profile's instanceCount entries per the API contract.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), cis, v.len()) };
        out(count, v.len() as c_uint)
    }
    fn nvmlGpuInstanceGetComputeInstanceById(gi: nvmlGpuInstance_t, id: c_uint, ci: *mut nvmlComputeInstance_t) {
        let (n, g, gid) = gi_handle(gi)?;
        find_ci(&mig_state(n, g), gid, id)?;
        out(ci, encode(H::Ci(g, gid, id)) as nvmlComputeInstance_t)
    }
    fn nvmlComputeInstanceGetInfo_v2(ci: nvmlComputeInstance_t, info: *mut nvmlComputeInstanceInfo_t) {
        let n = node()?;
        let H::Ci(g, gi, cid) = decode(ci as usize)? else { return Err(INVALID) };
        let st = mig_state(n, g);
        let (gs, cs) = find_ci(&st, gi, cid).map_err(|_| INVALID)?;
        let c = &st.gis[gs].cis[cs];
        out(info, nvmlComputeInstanceInfo_t { device: dev_handle(g), gpuInstance: encode(H::Gi(g, gi)) as nvmlGpuInstance_t,
            id: cid, profileId: c.profile_id, placement: nvmlComputeInstancePlacement_t { start: c.start, size: c.size } })
    }
    fn nvmlDeviceGetMigDeviceHandleByIndex(d: nvmlDevice_t, idx: c_uint, m: *mut nvmlDevice_t) {
        let (n, g, _) = phys(d)?;
        let st = mig_state(n, g);
        let (gs, cs) = *mig::mig_devices(&st).get(idx as usize).ok_or(NOT_FOUND)?;
        out(m, encode(H::Mig(g, st.gis[gs].id, st.gis[gs].cis[cs].id)) as nvmlDevice_t)
    }
    fn nvmlDeviceIsMigDeviceHandle(d: nvmlDevice_t, is: *mut c_uint) {
        node()?;
        out(is, matches!(decode(d as usize)?, H::Mig(..)) as c_uint)
    }
    fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m: nvmlDevice_t, d: *mut nvmlDevice_t) {
        node()?;
        let H::Mig(g, ..) = decode(m as usize)? else { return Err(INVALID) };
        out(d, dev_handle(g))
    }
    fn nvmlDeviceGetGpuInstanceId(m: nvmlDevice_t, id: *mut c_uint) {
        node()?;
        let H::Mig(_, gi, _) = decode(m as usize)? else { return Err(NOT_SUPPORTED) };
        out(id, gi)
    }
    fn nvmlDeviceGetComputeInstanceId(m: nvmlDevice_t, id: *mut c_uint) {
        node()?;
        let H::Mig(_, _, ci) = decode(m as usize)? else { return Err(NOT_SUPPORTED) };
        out(id, ci)
    }
}

struct EventSet {
    devs: std::sync::Mutex<Vec<(usize, u64)>>,
}

/// (total, used) bytes of a physical or MIG device.
fn memory(d: nvmlDevice_t) -> R<(u64, u64)> {
    let n = node()?;
    match decode(d as usize)? {
        H::Dev(g) => {
            let c = gpu_of(n, g)?;
            if !c.nvml_memory_info {
                return Err(NOT_SUPPORTED); // a unified-memory GPU
            }
            n.reap_for_query();
            Ok((c.memory_bytes, n.mem_used(g).min(c.memory_bytes)))
        }
        H::Mig(g, gi, ci) => {
            let c = gpu_of(n, g)?;
            let st = mig_state(n, g);
            let (gs, _) = find_ci(&st, gi, ci)?;
            Ok((gi_profile(c, &st.gis[gs])?.mib << 20, 0))
        }
        _ => Err(INVALID),
    }
}

/// Whether `pid` is an MPS server (`comm` keeps 15 characters of `nvidia-cuda-mps-server`).
fn mps_server(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == "nvidia-cuda-mps")
}

/// `busy` ns of a `span` ns long as a rounded percentage (at most 100), as NVML reports shares.
/// The share of the utilisation window GPU `d` was busy, in percent.
fn busy_pct(d: nvmlDevice_t) -> R<c_uint> {
    let (n, g, _) = phys(d)?;
    let now = now_ns();
    let w = n.cfg.util_window_ns;
    Ok(share_pct(n.busy(g, now.saturating_sub(w), now).0, w))
}

fn share_pct(busy: u64, span: u64) -> c_uint {
    ((busy * 100 + span / 2) / span).min(100) as c_uint
}

/// The wall clock (us) at CLOCK_MONOTONIC `mono` (ns), the same in every call of this process.
fn wall_us_at(mono: u64) -> u64 {
    static OFFSET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    mono / 1000 + *OFFSET.get_or_init(|| realtime_us().saturating_sub(now_ns() / 1000))
}

/// The samples NVML keeps of a GPU's utilization (`nvmlDeviceGetSamples`): one per sixth of the
/// utilization window (the figure `nvmlDeviceGetUtilizationRates` averages over), the last 20, each
/// the share of its period a kernel ran (halved for the memory's, as that query's), timestamped at
/// its period's end; those after `last_seen`, oldest first.
fn utilization_samples(n: &Node, g: usize, last_seen: u64, memory: bool) -> Vec<nvmlSample_t> {
    let period = (n.cfg.util_window_ns / 6).max(1_000_000);
    let mono = now_ns();
    let end = mono - mono % period;
    (0..20u64)
        .rev()
        .filter_map(|i| {
            let t = end.checked_sub(i * period)?;
            let (busy, _) = n.busy(g, t.saturating_sub(period), t);
            let pct = share_pct(busy, period);
            let timeStamp = wall_us_at(t);
            let v = if memory { pct / 2 } else { pct };
            (timeStamp > last_seen).then_some(nvmlSample_t { timeStamp, sampleValue: nvmlValue_t { uiVal: v } })
        })
        .collect()
}

/// The per-process SM samples since `last_seen` (NVML's wall clock, µs; 0: the last window);
/// NOT_FOUND when there are none.
fn process_samples(d: nvmlDevice_t, last_seen: u64) -> R<Vec<nvmlProcessUtilizationSample_t>> {
    let (n, g, _) = phys(d)?;
    if n.cfg.process_util == vgpu_sim::config::ProcessUtil::None {
        return Err(NOT_SUPPORTED);
    }
    let (mut mono, mut real) = (now_ns(), realtime_us());
    // Sampled at a period: the newest sample is the last period's end.
    if let Some(p) = Some(n.cfg.process_sample_ns).filter(|&p| p > 0) {
        mono -= mono % p;
        real = wall_us_at(mono);
        if last_seen >= real {
            return Err(NOT_FOUND);
        }
    }
    let w = n.cfg.util_window_ns;
    let since = if last_seen == 0 || last_seen >= real {
        mono.saturating_sub(w)
    } else {
        mono.saturating_sub((real - last_seen).saturating_mul(1000)).max(mono.saturating_sub(w))
    };
    let span = (mono - since).max(1);
    let (total, per) = n.busy(g, since, mono);
    let whole = n.cfg.process_util == vgpu_sim::config::ProcessUtil::Gpu;
    let samples: Vec<nvmlProcessUtilizationSample_t> = per
        .into_iter()
        .map(|(pid, b)| (pid, if whole { total } else { b }))
        .map(|(pid, b)| nvmlProcessUtilizationSample_t {
            pid,
            timeStamp: real,
            smUtil: share_pct(b, span),
            memUtil: 0,
            encUtil: 0,
            decUtil: 0,
        })
        .collect();
    if samples.is_empty() {
        return Err(NOT_FOUND);
    }
    Ok(samples)
}

/// NVML's process lists.
#[derive(Clone, Copy, PartialEq)]
enum List {
    Compute,
    Graphics,
    Mps,
}

/// The processes a list shows: the compute list holds the MPS servers and every process that is no
/// MPS client, the MPS list the clients. A process named `nvidia-cuda-mps-server` counts as a server
/// with `mps = true` in the node description (and every other process as its client). The graphics
/// list holds all with `graphics = true`.
fn listed(d: nvmlDevice_t, which: List) -> R<Vec<Listed>> {
    use vgpu_sim::state::MpsRole;
    let all = processes(d)?;
    let cfg = &node()?.cfg;
    if which == List::Graphics {
        return Ok(if cfg.graphics { all } else { Vec::new() });
    }
    let named = cfg.mps && all.iter().any(|p| mps_server(p.pid));
    let client = |p: &Listed| match p.mps {
        MpsRole::Client { .. } => true,
        MpsRole::Server => false,
        MpsRole::None => named && !mps_server(p.pid),
    };
    Ok(all.into_iter().filter(|p| client(p) == (which == List::Mps)).collect())
}

/// [`listed`] as `nvmlProcessInfo_v1_t` (the unversioned calls).
fn process_infos_v1(d: nvmlDevice_t, which: List) -> R<Vec<nvmlProcessInfo_v1_t>> {
    Ok(listed(d, which)?.into_iter().map(|p| nvmlProcessInfo_v1_t { pid: p.pid, usedGpuMemory: p.bytes }).collect())
}

/// NVML's `NVML_STRUCT_VERSION(name, 1)`.
const fn struct_v1<T>() -> c_uint {
    std::mem::size_of::<T>() as c_uint | 1 << 24
}

/// The caller's versioned structure, if it is version 1 of `T` (every versioned NVML structure
/// begins with its `unsigned int version`).
fn v1_struct<'a, T>(p: *mut T) -> R<&'a mut T> {
    if p.is_null() {
        return Err(INVALID);
    }
    // SAFETY: p is non-null and begins with the version word.
    if unsafe { *(p as *const c_uint) } != struct_v1::<T>() {
        return Err(nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    // SAFETY: non-null; the caller owns the structure for the call.
    Ok(unsafe { &mut *p })
}

/// [`listed`] as `nvmlProcessInfo_t` (v2 and v3 share the layout).
fn process_infos(d: nvmlDevice_t, which: List) -> R<Vec<nvmlProcessInfo_t>> {
    Ok(listed(d, which)?
        .into_iter()
        .map(|p| nvmlProcessInfo_t {
            pid: p.pid,
            usedGpuMemory: p.bytes,
            gpuInstanceId: p.gi(),
            computeInstanceId: p.ci(),
        })
        .collect())
}

/// A process holding a context on a GPU: its PID, bytes and, on a GPU in MIG mode, the MIG device
/// (GPU instance, compute instance) it runs in.
#[derive(Clone, Copy)]
struct Listed {
    pid: u32,
    bytes: u64,
    mig: Option<(u32, u32)>,
    mps: vgpu_sim::state::MpsRole,
}

impl Listed {
    fn gi(&self) -> u32 {
        self.mig.map_or(u32::MAX, |m| m.0)
    }
    fn ci(&self) -> u32 {
        self.mig.map_or(u32::MAX, |m| m.1)
    }
}

/// The processes holding a context on a GPU, as the driver lists them: a physical GPU's handle
/// gives every one (each with its GPU and compute instance in MIG mode), a MIG device's handle the
/// processes running in that MIG device.
fn processes(d: nvmlDevice_t) -> R<Vec<Listed>> {
    let n = node()?;
    let (g, only) = match decode(d as usize)? {
        H::Dev(g) => (g, None),
        H::Mig(g, gi, ci) => (g, Some((gi, ci))),
        _ => return Err(INVALID),
    };
    gpu_of(n, g)?;
    n.reap_for_query();
    Ok(n.live_slots()
        .filter(|p| p.ctx[g].load(Acquire) > 0)
        .map(|p| Listed {
            pid: p.pid.load(Relaxed),
            bytes: p.mem[g].load(Acquire),
            mig: p.mig_at(g),
            mps: p.mps_role(),
        })
        .filter(|p| only.is_none() || p.mig == only)
        .collect())
}

fn cpu_set(_n: &Node, numa: i32, size: c_uint, set: *mut c_ulong) -> R<()> {
    if set.is_null() || size == 0 {
        return Err(INVALID);
    }
    // SAFETY: set holds `size` words per the API contract.
    let s = unsafe { std::slice::from_raw_parts_mut(set, size as usize) };
    s.fill(0);
    // Simulated NUMA node k owns CPUs [32k, 32k + 32).
    let first = numa.max(0) as usize * 32;
    for cpu in first..first + 32 {
        if cpu / 64 < s.len() {
            s[cpu / 64] |= 1 << (cpu % 64);
        }
    }
    Ok(())
}

fn profile_by_idx(d: nvmlDevice_t, idx: c_uint) -> R<&'static vgpu_sim::models::GiProfile> {
    let (_, _, c) = phys(d)?;
    if idx >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return Err(INVALID);
    }
    c.model.mig.as_ref().ok_or(NOT_SUPPORTED)?.by_idx(idx).ok_or(NOT_SUPPORTED)
}

fn create_gi(d: nvmlDevice_t, pid: c_uint, pl: Option<(u32, u32)>, out_gi: *mut nvmlGpuInstance_t) -> R<()> {
    let (n, g, c) = phys(d)?;
    privileged()?;
    if out_gi.is_null() {
        return Err(INVALID);
    }
    if let Some((_, size)) = pl {
        let p = c.model.mig.as_ref().ok_or(NOT_SUPPORTED)?.by_id(pid).ok_or(INVALID)?;
        if size != p.size {
            return Err(INVALID);
        }
    }
    let mut l = n.lock();
    let st = n.mig(&mut l, g);
    let slot = mig::create_gi(st, c.model, pid, pl.map(|p| p.0)).map_err(mig_err)?;
    out(out_gi, encode(H::Gi(g, st.gis[slot].id)) as nvmlGpuInstance_t)
}

fn gi_handle(gi: nvmlGpuInstance_t) -> R<(&'static Node, usize, u32)> {
    let n = node()?;
    match decode(gi as usize)? {
        H::Gi(g, id) if g < n.cfg.gpus.len() => Ok((n, g, id)),
        _ => Err(INVALID),
    }
}

fn ci_profile_info(gi: nvmlGpuInstance_t, prof: c_uint, eng: c_uint) -> R<(u32, (u32, u32))> {
    let (n, g, id) = gi_handle(gi)?;
    if eng != 0 {
        return Err(INVALID);
    }
    let c = &n.cfg.gpus[g];
    let st = mig_state(n, g);
    let x = &st.gis[mig::gi_by_id(&st, id).ok_or(INVALID)?];
    let (size, max, _) = mig::ci_profile(c.model, x, prof).map_err(mig_err)?;
    let p = gi_profile(c, x)?;
    Ok((p.sm * size / p.g, (size, max)))
}

fn create_ci(gi: nvmlGpuInstance_t, prof: c_uint, start: Option<u32>, out_ci: *mut nvmlComputeInstance_t) -> R<()> {
    let (n, g, id) = gi_handle(gi)?;
    privileged()?;
    if out_ci.is_null() {
        return Err(INVALID);
    }
    let mut l = n.lock();
    let st = n.mig(&mut l, g);
    let gs = mig::gi_by_id(st, id).ok_or(INVALID)?;
    let cs = mig::create_ci(st, n.cfg.gpus[g].model, gs, prof, start).map_err(mig_err)?;
    out(out_ci, encode(H::Ci(g, id, st.gis[gs].cis[cs].id)) as nvmlComputeInstance_t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip() {
        for h in [H::Dev(0), H::Dev(15), H::Gi(3, 1), H::Gi(15, 8), H::Ci(2, 4, 7), H::Mig(1, 8, 0), H::Mig(15, 8, 7)] {
            assert_eq!(decode(encode(h)), Ok(h));
        }
        assert_eq!(decode(0), Err(INVALID));
        assert_eq!(decode(base() + HANDLES.len()), Err(INVALID));
    }
}

// ----- the private table `nvidia-smi` lists processes through -----
//
// `nvidia-smi` (R535 and later) does not list a GPU's processes with the public calls but through
// entry points of a private table that `nvmlInternalGetExportTable` hands out for one GUID. What
// is publicly known of it (from driver 580.65.06), and what the simulator gives: the table's first
// word is its size in bytes; entries 213, 214 and 215 (taken here as the compute, graphics and MPS
// lists) are `fn(nvmlDevice_t, unsigned int *count, entry *array)`, the count the array's capacity
// on entry and the entries written on return; an entry is 4128 bytes: the PID (u32) at 0, the bytes
// used (u64) at 8, the GPU and compute instance IDs (u32) at 16 and 20, protected memory (u64) at
// 24 and the process's name (NUL-terminated) at 32. The table's other entries answer NOT_SUPPORTED.

/// The GUID of the table, as its 16 bytes are laid out in memory.
const PROCESS_TABLE_GUID: [u8; 16] =
    [0xc4, 0xfe, 0x3e, 0x6c, 0xc9, 0x8f, 0x6c, 0x4e, 0xa3, 0x27, 0xee, 0x69, 0x6e, 0x12, 0xf7, 0xc4];
const TABLE_WORDS: usize = 256;
const FIRST_LIST: usize = 213;
const ENTRY_BYTES: usize = 4128;
const NAME_AT: usize = 32;

unsafe extern "C" fn private_unsupported() -> nvmlReturn_t {
    NOT_SUPPORTED
}

unsafe extern "C" fn private_compute(d: nvmlDevice_t, count: *mut c_uint, array: *mut u8) -> nvmlReturn_t {
    entry("private process list", || write_private(d, List::Compute, count, array))
}

unsafe extern "C" fn private_graphics(d: nvmlDevice_t, count: *mut c_uint, array: *mut u8) -> nvmlReturn_t {
    entry("private process list", || write_private(d, List::Graphics, count, array))
}

unsafe extern "C" fn private_mps(d: nvmlDevice_t, count: *mut c_uint, array: *mut u8) -> nvmlReturn_t {
    entry("private process list", || write_private(d, List::Mps, count, array))
}

fn write_private(d: nvmlDevice_t, which: List, count: *mut c_uint, array: *mut u8) -> R<()> {
    if count.is_null() {
        return Err(INVALID);
    }
    let list = listed(d, which)?;
    // SAFETY: count is non-null; the caller's capacity.
    let cap = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = list.len() as c_uint };
    if list.len() > cap || (array.is_null() && !list.is_empty()) {
        return Err(INSUFFICIENT_SIZE);
    }
    for (k, p) in list.iter().enumerate() {
        let (pid, bytes) = (&p.pid, &p.bytes);
        let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let name = name.trim_end().as_bytes();
        let name = &name[..name.len().min(ENTRY_BYTES - NAME_AT - 1)];
        // SAFETY: the array holds `cap` > k entries of ENTRY_BYTES (the table's contract).
        unsafe {
            let e = array.add(k * ENTRY_BYTES);
            std::ptr::write_bytes(e, 0, ENTRY_BYTES);
            (e as *mut u32).write_unaligned(*pid);
            (e.add(8) as *mut u64).write_unaligned(*bytes);
            (e.add(16) as *mut u32).write_unaligned(p.gi());
            (e.add(20) as *mut u32).write_unaligned(p.ci());
            std::ptr::copy_nonoverlapping(name.as_ptr(), e.add(NAME_AT), name.len());
        }
    }
    Ok(())
}

struct Table([usize; TABLE_WORDS]);

static PRIVATE_TABLE: std::sync::OnceLock<Table> = std::sync::OnceLock::new();

exports! {
    fn nvmlInternalGetExportTable(table: *mut *const std::ffi::c_void, id: *const std::ffi::c_void) {
        if table.is_null() || id.is_null() {
            return Err(INVALID);
        }
        // SAFETY: a GUID is 16 bytes.
        if unsafe { *(id as *const [u8; 16]) } != PROCESS_TABLE_GUID {
            return Err(NOT_SUPPORTED);
        }
        let t = PRIVATE_TABLE.get_or_init(|| {
            let mut w = [private_unsupported as *const () as usize; TABLE_WORDS];
            w[0] = TABLE_WORDS * std::mem::size_of::<usize>();
            w[FIRST_LIST] = private_compute as *const () as usize;
            w[FIRST_LIST + 1] = private_graphics as *const () as usize;
            w[FIRST_LIST + 2] = private_mps as *const () as usize;
            Table(w)
        });
        out(table, t.0.as_ptr() as *const std::ffi::c_void)
    }
}

//! GPU discovery through NVML (nvml-wrapper, with the library path configurable): the node's
//! inventory as domain types. MIG calls nvml-wrapper lacks go through its raw function table.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::*;
use serde::Serialize;
use std::path::Path;

/// Why NVML could not be opened, or the GPUs read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "cannot initialise NVML from {library}: {source} (name the NVML library with --nvml-library or \
         VGPU_AGENT_NVML_LIBRARY; on the simulated GPU, target/release/sim-lib/libnvidia-ml.so.1)"
    )]
    Open { library: String, source: nvml_wrapper::error::NvmlError },
    #[error("{what}: {source}")]
    Read { what: String, source: nvml_wrapper::error::NvmlError },
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Inventory {
    pub driver_version: String,
    /// CUDA version the driver supports, e.g. 12040.
    pub cuda_version: i32,
    pub gpus: Vec<Gpu>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub memory_total: u64,
    pub memory_used: u64,
    /// A unified-memory GPU (GB10): NVML has no memory figures for it, so `memory_total` is the
    /// host's memory and `memory_used` what its processes hold (see [`memory`]).
    pub unified_memory: bool,
    /// Streaming multiprocessors, when NVML reports them.
    pub sm_count: Option<u32>,
    pub compute_capability: (i32, i32),
    pub numa_node: Option<u32>,
    /// Common ancestor level towards every GPU (index order), as NVML names it.
    pub topology: Vec<String>,
    /// NVLink peer-to-peer towards every GPU (index order; false to itself).
    pub nvlink: Vec<bool>,
    pub processes: Vec<(u32, u64)>,
    /// None: the GPU does not support MIG.
    pub mig: Option<Mig>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Mig {
    pub enabled: bool,
    /// A mode change waits for a GPU reset (Ampere).
    pub pending: bool,
    pub gpu_instances: Vec<GpuInstance>,
    pub devices: Vec<MigDevice>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GpuInstance {
    pub id: u32,
    pub profile_id: u32,
    pub start: u32,
    pub size: u32,
    pub compute_instances: Vec<(u32, u32)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct MigDevice {
    /// The GPU instance this MIG device is.
    pub gpu_instance_id: Option<u32>,
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
}

/// Opens NVML from `library` (None: the system's).
pub fn open(library: Option<&Path>) -> Result<Nvml, DiscoveryError> {
    let mut b = Nvml::builder();
    if let Some(l) = library {
        b.lib_path(l.as_os_str());
    }
    b.init().map_err(|e| {
        let lib = library.map_or("libnvidia-ml.so.1".into(), |l| l.display().to_string());
        DiscoveryError::Open { library: lib.to_string(), source: e }
    })
}

/// (total, used, unified) memory of a GPU. A unified-memory GPU (GB10: its memory is the host's)
/// answers NVML's memory queries with NOT_SUPPORTED but lists its processes' usage: its total is
/// the host's memory (`host_total`), its use what its processes hold.
pub fn memory(
    d: &Device,
    processes: &[(u32, u64)],
    host_total: impl FnOnce() -> Option<u64>,
) -> Result<(u64, u64, bool), nvml_wrapper::error::NvmlError> {
    match d.memory_info() {
        Ok(m) => Ok((m.total, m.used, false)),
        Err(nvml_wrapper::error::NvmlError::NotSupported) => {
            let total = host_total().ok_or(nvml_wrapper::error::NvmlError::NotSupported)?;
            let used: u64 = processes.iter().map(|p| p.1).sum();
            Ok((total, used.min(total), true))
        }
        Err(e) => Err(e),
    }
}

/// The node's GPUs as NVML sees them now.
pub fn discover(nvml: &Nvml) -> Result<Inventory, DiscoveryError> {
    let err = |what: &str, source| DiscoveryError::Read { what: what.to_string(), source };
    let n = nvml.device_count().map_err(|e| err("device count", e))?;
    let devices: Vec<Device> =
        (0..n).map(|i| nvml.device_by_index(i).map_err(|e| err(&format!("GPU {i}"), e))).collect::<Result<_, _>>()?;
    let mut gpus = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let ctx = |what: &str| format!("GPU {i}: {what}");
        let cc = d.cuda_compute_capability().map_err(|e| err(&ctx("compute capability"), e))?;
        let topology = (0..n)
            .map(|j| {
                nvml.device_by_index(j)
                    .and_then(|o| d.topology_common_ancestor(o))
                    .map_or_else(|e| format!("unknown ({e})"), |l| format!("{l:?}"))
            })
            .collect();
        let nvlink = devices
            .iter()
            .enumerate()
            .map(|(j, o)| {
                j != i
                    && d.p2p_status(o, nvml_wrapper::enum_wrappers::device::P2pCapabilitiesIndex::NvLink)
                        .is_ok_and(|s| s == nvml_wrapper::enum_wrappers::device::P2pStatus::Ok)
            })
            .collect();
        let processes: Vec<(u32, u64)> = d
            .running_compute_processes()
            .map(|ps| {
                ps.into_iter()
                    .map(|p| (p.pid, if let UsedGpuMemory::Used(b) = p.used_gpu_memory { b } else { 0 }))
                    .collect()
            })
            .unwrap_or_default();
        let (memory_total, memory_used, unified_memory) =
            memory(d, &processes, crate::procfs::mem_total).map_err(|e| err(&ctx("memory"), e))?;
        gpus.push(Gpu {
            index: i as u32,
            uuid: d.uuid().map_err(|e| err(&ctx("uuid"), e))?,
            name: d.name().map_err(|e| err(&ctx("name"), e))?,
            pci_bus_id: d.pci_info().map_err(|e| err(&ctx("pci info"), e))?.bus_id,
            memory_total,
            memory_used,
            unified_memory,
            sm_count: d.attributes().ok().map(|a| a.multiprocessor_count),
            compute_capability: (cc.major, cc.minor),
            numa_node: d.numa_node_id().ok(),
            topology,
            nvlink,
            processes,
            mig: mig(nvml, d),
        });
    }
    Ok(Inventory {
        driver_version: nvml.sys_driver_version().map_err(|e| err("driver version", e))?,
        cuda_version: nvml.sys_cuda_driver_version().map_err(|e| err("CUDA version", e))?,
        gpus,
    })
}

/// Every GPU-instance profile id NVML can report (read back from the profile table per device).
fn profile_ids(nvml: &Nvml, dev: nvmlDevice_t) -> Vec<u32> {
    let lib = nvml.lib();
    (0..NVML_GPU_INSTANCE_PROFILE_COUNT)
        .filter_map(|idx| {
            // SAFETY: zeroed POD out-struct; a valid device handle.
            let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: a valid device handle and an out-pointer to the local above.
            (unsafe { lib.nvmlDeviceGetGpuInstanceProfileInfo(dev, idx, &mut info) } == 0).then_some(info.id)
        })
        .collect()
}

fn mig(nvml: &Nvml, d: &Device) -> Option<Mig> {
    let mode = d.mig_mode().ok()?;
    let lib = nvml.lib();
    // SAFETY: nvml-wrapper's handle stays valid while `nvml` lives.
    let dev = unsafe { d.handle() };
    let mut gpu_instances = Vec::new();
    if mode.current == 1 {
        for pid in profile_ids(nvml, dev) {
            let mut arr = [std::ptr::null_mut(); 8];
            let mut n = 0;
            // SAFETY: room for 8 >= any instanceCount.
            if unsafe { lib.nvmlDeviceGetGpuInstances(dev, pid, arr.as_mut_ptr(), &mut n) } != 0 {
                continue;
            }
            for gi in &arr[..(n as usize).min(8)] {
                // SAFETY: zeroed POD out-struct; a handle NVML just gave us.
                let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: a handle NVML just listed and an out-pointer to the local above.
                if unsafe { lib.nvmlGpuInstanceGetInfo(*gi, &mut info) } != 0 {
                    continue;
                }
                let mut compute_instances = Vec::new();
                for cp in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
                    let mut cis = [std::ptr::null_mut(); 8];
                    let mut m = 0;
                    // SAFETY: as above.
                    if unsafe { lib.nvmlGpuInstanceGetComputeInstances(*gi, cp, cis.as_mut_ptr(), &mut m) } != 0 {
                        continue;
                    }
                    for ci in &cis[..(m as usize).min(8)] {
                        // SAFETY: as above.
                        let mut ci_info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                        // SAFETY: as above.
                        if unsafe { lib.nvmlComputeInstanceGetInfo_v2(*ci, &mut ci_info) } == 0 {
                            compute_instances.push((ci_info.id, ci_info.profileId));
                        }
                    }
                }
                gpu_instances.push(GpuInstance {
                    id: info.id,
                    profile_id: info.profileId,
                    start: info.placement.start,
                    size: info.placement.size,
                    compute_instances,
                });
            }
        }
        gpu_instances.sort_by_key(|g| g.id);
    }
    let devices = (0..d.mig_device_count().unwrap_or(0))
        .filter_map(|i| d.mig_device_by_index(i).ok())
        .map(|m| MigDevice {
            gpu_instance_id: {
                let mut id = 0;
                // SAFETY: a MIG device handle nvml-wrapper just gave us; `id` is a valid out-pointer.
                (unsafe { lib.nvmlDeviceGetGpuInstanceId(m.handle(), &mut id) } == 0).then_some(id)
            },
            uuid: m.uuid().unwrap_or_default(),
            name: m.name().unwrap_or_default(),
            memory_total: m.memory_info().map_or(0, |x| x.total),
        })
        .collect();
    Some(Mig { enabled: mode.current == 1, pending: mode.pending != mode.current, gpu_instances, devices })
}

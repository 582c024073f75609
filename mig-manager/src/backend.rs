//! Where MIG changes happen: the [`MigBackend`] trait, and its NVML implementation. nvml-wrapper
//! covers the MIG mode; GPU and compute instances, profiles, placements and capacities go through
//! its raw function table (nvml-wrapper 0.13's `possible_placements` returns an empty list).

use crate::model::{Gpu, Instance, Profile};
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::*;
use std::sync::Arc;

/// Why a MIG action failed: one variant per failed step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigError {
    /// An NVML call refused (its return code by name).
    #[error("{what}: {code}")]
    Nvml { what: String, code: String },
    /// NVML could not say how many GPUs there are.
    #[error("{0}")]
    Count(String),
    /// NVML could not answer a question about a GPU.
    #[error("GPU {gpu}: {what}{error}")]
    Query { gpu: u32, what: &'static str, error: String },
    #[error("GPU {gpu}: no profile {profile}")]
    NoProfile { gpu: u32, profile: u32 },
    #[error("GPU {gpu}: no compute-instance profile spans {profile}")]
    NoComputeProfile { gpu: u32, profile: String },
    #[error("cannot write {}: {error}", path.display())]
    Write { path: std::path::PathBuf, error: String },
    #[error("cannot create {}: {error}", path.display())]
    CreateDir { path: std::path::PathBuf, error: String },
    #[error("no GPU {0} on this node")]
    NoGpu(String),
    /// The desired layout does not fit the GPU's profiles.
    #[error("{0}")]
    Desired(String),
    /// No plan or placement reaches what is asked.
    #[error("{label}: {error}")]
    Plan { label: String, error: String },
    #[error("{0}")]
    Placement(String),
    #[error("{label}: MIG mode cannot change while processes run on the GPU ({count} of them: PIDs {pids}); stop them first")]
    Busy { label: String, count: usize, pids: String },
    /// The driver refused the mode switch itself; `state` says what the GPU is now.
    #[error("{label}: {what}")]
    ModeRefused { label: String, what: String },
    #[error("GPU {gpu} ({name}): MIG mode is off")]
    MigOff { gpu: u32, name: String },
    #[error("GPU {gpu}: GPU instance {gi} is in use (processes run on it, or it is given out)")]
    InUse { gpu: u32, gi: u32 },
}

/// What a mode change did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ModeChange {
    /// Already so.
    Unchanged,
    /// In effect now (Hopper and later).
    Applied,
    /// Waits for a GPU reset (Ampere); clients holding the GPU block the reset.
    PendingReset,
}

/// The operations the applier needs. `gpu` is the NVML index of a physical GPU.
pub trait MigBackend {
    fn gpu_count(&self) -> Result<u32, MigError>;
    /// The GPU with its profiles (from NVML), mode and instances. `busy` marks instances with
    /// processes on them as NVML reports, and (`NvmlBackend::with_held`) those given to workloads.
    fn gpu(&self, gpu: u32) -> Result<Gpu, MigError>;
    fn set_mode(&self, gpu: u32, enabled: bool) -> Result<ModeChange, MigError>;
    /// Creates a GPU instance at an explicit placement and one compute instance spanning it; returns
    /// the GPU instance id.
    fn create(&self, gpu: u32, profile: u32, start: u32) -> Result<u32, MigError>;
    /// Destroys a GPU instance and its compute instances.
    fn destroy(&self, gpu: u32, gi: u32) -> Result<(), MigError>;
    /// PCI device id (`0xDDDDVVVV`, as mig-parted's `device-filter` writes it).
    fn pci_device_id(&self, gpu: u32) -> Result<String, MigError>;
    /// PIDs of the processes running on the GPU (any of them blocks a MIG mode change).
    fn processes(&self, gpu: u32) -> Result<Vec<u32>, MigError> {
        let _ = gpu;
        Ok(Vec::new())
    }
}

pub struct NvmlBackend {
    nvml: Arc<Nvml>,
    /// MIG device UUIDs given out to workloads (which may have no process on them yet): busy.
    held: std::collections::BTreeSet<String>,
}

/// Whether any of `processes` (a physical GPU's list) runs in GPU instance `gi`.
fn runs_in(processes: &[nvml_wrapper::struct_wrappers::device::ProcessInfo], gi: u32) -> bool {
    processes.iter().any(|p| p.gpu_instance_id == Some(gi))
}

fn ret_name(r: nvmlReturn_t) -> String {
    match r {
        2 => "INVALID_ARGUMENT".into(),
        3 => "NOT_SUPPORTED".into(),
        4 => "NO_PERMISSION".into(),
        6 => "NOT_FOUND".into(),
        19 => "IN_USE".into(),
        23 => "INSUFFICIENT_RESOURCES".into(),
        r => format!("NVML error {r}"),
    }
}

fn check(what: impl FnOnce() -> String, r: nvmlReturn_t) -> Result<(), MigError> {
    if r == 0 {
        Ok(())
    } else {
        Err(MigError::Nvml { what: what(), code: ret_name(r) })
    }
}

impl NvmlBackend {
    pub fn new(nvml: Arc<Nvml>) -> NvmlBackend {
        NvmlBackend { nvml, held: Default::default() }
    }

    /// A backend that reports the instances of these MIG devices busy whether or not a process runs
    /// on them: they were given to a workload (a DRA claim, a container), which the planner must not
    /// take them from.
    pub fn with_held(nvml: Arc<Nvml>, held: impl IntoIterator<Item = String>) -> NvmlBackend {
        NvmlBackend { nvml, held: held.into_iter().collect() }
    }

    fn handle(&self, gpu: u32) -> Result<nvmlDevice_t, MigError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| MigError::Query { gpu, what: "", error: e.to_string() })?;
        // SAFETY: the handle stays valid while `self.nvml` lives.
        Ok(unsafe { d.handle() })
    }

    fn gi_handle(&self, dev: nvmlDevice_t, gpu: u32, gi: u32) -> Result<nvmlGpuInstance_t, MigError> {
        let mut h = std::ptr::null_mut();
        // SAFETY: valid device handle, out-pointer to a local.
        check(|| format!("GPU {gpu}: GPU instance {gi}"), unsafe {
            self.nvml.lib().nvmlDeviceGetGpuInstanceById(dev, gi, &mut h)
        })?;
        Ok(h)
    }

    fn profiles(&self, dev: nvmlDevice_t) -> Vec<Profile> {
        let lib = self.nvml.lib();
        let mut v = Vec::new();
        for idx in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: zeroed POD out-struct with its version set; valid device handle.
            let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = (std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>() as u32) | (2 << 24);
            // SAFETY: a device handle NVML gave us and an out-pointer to the local above.
            if unsafe { lib.nvmlDeviceGetGpuInstanceProfileInfoV(dev, idx, &mut info) } != 0 {
                continue;
            }
            let name = {
                let b: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                String::from_utf8_lossy(&b).trim_start_matches("MIG ").to_string()
            };
            let mut pl = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 16];
            let mut n = pl.len() as u32;
            // SAFETY: room for `n` placements.
            let r = unsafe { lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, info.id, pl.as_mut_ptr(), &mut n) };
            if r != 0 || n == 0 {
                continue;
            }
            let pl = &pl[..(n as usize).min(16)];
            v.push(Profile {
                id: info.id,
                name,
                compute: info.sliceCount,
                memory_slices: pl[0].size,
                memory_mib: info.memorySizeMB,
                sms: info.multiprocessorCount,
                decoders: info.decoderCount,
                encoders: info.encoderCount,
                jpegs: info.jpegCount,
                ofas: info.ofaCount,
                max: info.instanceCount,
                starts: pl.iter().map(|p| p.start).collect(),
            });
        }
        v.sort_by_key(|p| (p.memory_slices, p.compute, p.id));
        v
    }

    /// The compute-instance profile spanning a GPU instance of `compute` slices.
    fn full_ci_profile(&self, gi: nvmlGpuInstance_t, compute: u32) -> Option<u32> {
        let lib = self.nvml.lib();
        (0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT).find_map(|idx| {
            // SAFETY: zeroed POD out-struct; valid GPU-instance handle.
            let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: a GPU-instance handle NVML gave us and an out-pointer to the local above.
            let r = unsafe {
                lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi,
                    idx,
                    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &mut info,
                )
            };
            (r == 0 && info.sliceCount == compute).then_some(info.id)
        })
    }

    fn compute_instances(&self, gi: nvmlGpuInstance_t) -> Vec<(u32, u32, nvmlComputeInstance_t)> {
        let lib = self.nvml.lib();
        let mut v = Vec::new();
        for cp in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            let mut arr = [std::ptr::null_mut(); 8];
            let mut n = 0;
            // SAFETY: room for 8 >= any instance count.
            if unsafe { lib.nvmlGpuInstanceGetComputeInstances(gi, cp, arr.as_mut_ptr(), &mut n) } != 0 {
                continue;
            }
            for ci in &arr[..(n as usize).min(8)] {
                // SAFETY: zeroed POD out-struct; a handle NVML just gave us.
                let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: a compute-instance handle NVML just listed and an out-pointer to the local above.
                if unsafe { lib.nvmlComputeInstanceGetInfo_v2(*ci, &mut info) } == 0 {
                    v.push((info.id, info.profileId, *ci));
                }
            }
        }
        v
    }
}

impl MigBackend for NvmlBackend {
    fn gpu_count(&self) -> Result<u32, MigError> {
        self.nvml.device_count().map_err(|e| MigError::Count(e.to_string()))
    }

    fn gpu(&self, gpu: u32) -> Result<Gpu, MigError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| MigError::Query { gpu, what: "", error: e.to_string() })?;
        let mode = d.mig_mode().map_err(|e| MigError::Query { gpu, what: "MIG mode: ", error: e.to_string() })?;
        let dev = self.handle(gpu)?;
        let lib = self.nvml.lib();
        let profiles = self.profiles(dev);
        let mut instances = Vec::new();
        if mode.current == 1 {
            for p in &profiles {
                let mut arr = [std::ptr::null_mut(); 8];
                let mut n = 0;
                // SAFETY: room for 8 >= any instance count.
                if unsafe { lib.nvmlDeviceGetGpuInstances(dev, p.id, arr.as_mut_ptr(), &mut n) } != 0 {
                    continue;
                }
                for gi in &arr[..(n as usize).min(8)] {
                    // SAFETY: zeroed POD out-struct; a handle NVML just gave us.
                    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
                    // SAFETY: a GPU-instance handle NVML just listed and an out-pointer to the local above.
                    if unsafe { lib.nvmlGpuInstanceGetInfo(*gi, &mut info) } != 0 {
                        continue;
                    }
                    instances.push(Instance {
                        gi: info.id,
                        profile: info.profileId,
                        start: info.placement.start,
                        size: info.placement.size,
                        compute_instances: self.compute_instances(*gi).into_iter().map(|(i, p, _)| (i, p)).collect(),
                        busy: false,
                        uuid: None,
                    });
                }
            }
            // Busy: a process on the instance by either of NVML's lists (the parent GPU's carries
            // each process's GPU instance; a MIG device's lists its own), or given to a workload.
            let on_parent = d.running_compute_processes().unwrap_or_default();
            for inst in instances.iter_mut() {
                inst.busy = runs_in(&on_parent, inst.gi);
            }
            for i in 0..d.mig_device_count().unwrap_or(0) {
                let Ok(m) = d.mig_device_by_index(i) else { continue };
                let mut id = 0;
                // SAFETY: a MIG device handle; out-pointer to a local.
                if unsafe { lib.nvmlDeviceGetGpuInstanceId(m.handle(), &mut id) } != 0 {
                    continue;
                }
                if let Some(inst) = instances.iter_mut().find(|x| x.gi == id) {
                    inst.uuid = m.uuid().ok();
                    let held = inst.uuid.as_ref().is_some_and(|u| self.held.contains(u));
                    inst.busy |= held || m.running_compute_processes().is_ok_and(|p| !p.is_empty());
                }
            }
            instances.sort_by_key(|i| (i.start, i.gi));
        }
        let memory_slices =
            profiles.iter().flat_map(|p| p.starts.iter().map(move |s| s + p.memory_slices)).max().unwrap_or(0);
        Ok(Gpu {
            index: gpu,
            uuid: d.uuid().unwrap_or_default(),
            name: d.name().unwrap_or_default(),
            memory_slices,
            profiles,
            mig_enabled: mode.current == 1,
            mode_pending: mode.pending != mode.current,
            instances,
        })
    }

    fn set_mode(&self, gpu: u32, enabled: bool) -> Result<ModeChange, MigError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| MigError::Query { gpu, what: "", error: e.to_string() })?;
        let want = u32::from(enabled);
        let m = d.mig_mode().map_err(|e| MigError::Query { gpu, what: "MIG mode: ", error: e.to_string() })?;
        if m.current == want && m.pending == want {
            return Ok(ModeChange::Unchanged);
        }
        let dev = self.handle(gpu)?;
        let mut activation = 0;
        // SAFETY: valid device handle, out-pointer to a local.
        check(|| format!("GPU {gpu}: set MIG mode {want}"), unsafe {
            self.nvml.lib().nvmlDeviceSetMigMode(dev, want, &mut activation)
        })?;
        let m = d.mig_mode().map_err(|e| MigError::Query { gpu, what: "MIG mode: ", error: e.to_string() })?;
        Ok(if m.current == want { ModeChange::Applied } else { ModeChange::PendingReset })
    }

    fn create(&self, gpu: u32, profile: u32, start: u32) -> Result<u32, MigError> {
        let dev = self.handle(gpu)?;
        let lib = self.nvml.lib();
        let g = self.gpu(gpu)?;
        let p = g.profile(profile).ok_or(MigError::NoProfile { gpu, profile })?;
        let mut gi = std::ptr::null_mut();
        let placement = nvmlGpuInstancePlacement_t { start, size: p.memory_slices };
        // SAFETY: valid handle, placement and out-pointer.
        check(|| format!("GPU {gpu}: create {} at slice {start}", p.name), unsafe {
            lib.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, &placement, &mut gi)
        })?;
        // SAFETY: zeroed POD out-struct; the handle just created.
        let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: the GPU-instance handle just created and an out-pointer to the local above.
        check(|| format!("GPU {gpu}: new GPU instance"), unsafe { lib.nvmlGpuInstanceGetInfo(gi, &mut info) })?;
        let ci_profile = self
            .full_ci_profile(gi, p.compute)
            .ok_or_else(|| MigError::NoComputeProfile { gpu, profile: p.name.clone() })?;
        let mut ci = std::ptr::null_mut();
        // SAFETY: valid GPU-instance handle, out-pointer to a local.
        let r = unsafe { lib.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile, &mut ci) };
        if r != 0 {
            // Leave nothing half-made.
            // SAFETY: the GPU instance created above, without compute instances.
            unsafe { lib.nvmlGpuInstanceDestroy(gi) };
            check(|| format!("GPU {gpu}: compute instance in {}", p.name), r)?;
        }
        Ok(info.id)
    }

    fn destroy(&self, gpu: u32, gi: u32) -> Result<(), MigError> {
        let dev = self.handle(gpu)?;
        let h = self.gi_handle(dev, gpu, gi)?;
        let lib = self.nvml.lib();
        for (id, _, ci) in self.compute_instances(h) {
            // SAFETY: a compute-instance handle NVML just listed.
            check(|| format!("GPU {gpu}: destroy compute instance {id} of GPU instance {gi}"), unsafe {
                lib.nvmlComputeInstanceDestroy(ci)
            })?;
        }
        // SAFETY: a GPU-instance handle NVML just gave us.
        check(|| format!("GPU {gpu}: destroy GPU instance {gi}"), unsafe { lib.nvmlGpuInstanceDestroy(h) })
    }

    fn processes(&self, gpu: u32) -> Result<Vec<u32>, MigError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| MigError::Query { gpu, what: "", error: e.to_string() })?;
        let mut pids: Vec<u32> = d
            .running_compute_processes()
            .map_err(|e| MigError::Query { gpu, what: "processes: ", error: e.to_string() })?
            .into_iter()
            .chain(d.running_graphics_processes().unwrap_or_default())
            .map(|p| p.pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    fn pci_device_id(&self, gpu: u32) -> Result<String, MigError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| MigError::Query { gpu, what: "", error: e.to_string() })?;
        let p = d.pci_info().map_err(|e| MigError::Query { gpu, what: "PCI info: ", error: e.to_string() })?;
        Ok(format!("0x{:08X}", p.pci_device_id))
    }
}

#[cfg(test)]
mod tests {
    use super::runs_in;
    use nvml_wrapper::enums::device::UsedGpuMemory;
    use nvml_wrapper::struct_wrappers::device::ProcessInfo;

    fn process(pid: u32, gi: Option<u32>) -> ProcessInfo {
        ProcessInfo { pid, used_gpu_memory: UsedGpuMemory::Used(1 << 20), gpu_instance_id: gi, compute_instance_id: gi }
    }

    #[test]
    fn a_parent_process_marks_its_gpu_instance_busy() {
        let list = [process(10, Some(3)), process(11, None)];
        assert!(runs_in(&list, 3));
        assert!(!runs_in(&list, 5), "a process of another instance");
        assert!(!runs_in(&list[1..], 0), "a process with no instance id is on none");
    }
}

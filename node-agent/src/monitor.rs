//! One monitoring pass: reclaim dead processes' slots, attribute NVML-measured GPU processes to
//! slices, tell each slice's interposers whether its GPUs are shared (the default SM policy limits
//! only then), and report escapes: GPU processes that belong to no slice on a GPU that slices share,
//! and slices whose NVML-measured memory exceeds their limit.

use crate::slices::{Slice, SliceStore};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use vgpu_region::Region;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Escape {
    /// A GPU process that belongs to no slice, on a GPU that slices use.
    Unaccounted { gpu: String, pid: u32, memory: u64 },
    /// A slice holds more device memory than its limit, as NVML measures it.
    OverLimit { slice: String, gpu: String, measured: u64, limit: u64 },
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct SliceUsage {
    pub slice: String,
    pub gpu: String,
    /// What the slice's interposers account.
    pub accounted: u64,
    /// What NVML measures for the slice's processes.
    pub measured: u64,
    pub pids: Vec<u32>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Bytes released from dead processes' slots.
    pub reclaimed: u64,
    pub usage: Vec<SliceUsage>,
    pub escapes: Vec<Escape>,
}

/// SM flags in the region: bit 0 shared, bit 1 managed by the agent.
const SM_SHARED: u64 = 1;
const SM_MANAGED: u64 = 2;

/// One pass over every slice and GPU.
pub fn tick(nvml: &Nvml, store: &SliceStore) -> Result<Report, String> {
    let slices: Vec<Slice> = store.list().map_err(|e| e.to_string())?;
    let mut report = Report::default();
    // pid -> slice name; regions by slice
    let mut owner: HashMap<u32, String> = HashMap::new();
    let mut regions: HashMap<String, Region> = HashMap::new();
    for s in &slices {
        let r = Region::open(&store.dir(&s.name).join("region"), true).map_err(|e| e.to_string())?;
        report.reclaimed += r.reap();
        for (_, pid, host, _) in r.slots() {
            owner.insert(if host != 0 { host } else { pid }, s.name.clone());
        }
        regions.insert(s.name.clone(), r);
    }
    let n = nvml.device_count().map_err(|e| e.to_string())?;
    for i in 0..n {
        let d = nvml.device_by_index(i).map_err(|e| e.to_string())?;
        let uuid = d.uuid().map_err(|e| e.to_string())?;
        let users: Vec<&Slice> = slices.iter().filter(|s| s.gpus.iter().any(|g| g.uuid == uuid)).collect();
        if users.is_empty() {
            continue;
        }
        let procs: Vec<(u32, u64)> = d
            .running_compute_processes()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|p| (p.pid, if let UsedGpuMemory::Used(b) = p.used_gpu_memory { b } else { 0 }))
            .collect();
        let mut foreign = false;
        for &(pid, mem) in &procs {
            if !owner.contains_key(&pid) {
                foreign = true;
                report.escapes.push(Escape::Unaccounted { gpu: uuid.clone(), pid, memory: mem });
            }
        }
        let shared = users.len() > 1 || foreign;
        for s in users {
            let r = &regions[&s.name];
            let dev = s.gpus.iter().position(|g| g.uuid == uuid).unwrap();
            let flags = &r.layout().devices[dev].sm_flags;
            flags.store(SM_MANAGED | if shared { SM_SHARED } else { 0 }, Relaxed);
            let pids: Vec<u32> = procs.iter().filter(|(p, _)| owner.get(p) == Some(&s.name)).map(|(p, _)| *p).collect();
            let measured: u64 = procs.iter().filter(|(p, _)| pids.contains(p)).map(|(_, m)| m).sum();
            let limit = s.gpus[dev].memory;
            if limit > 0 && measured > limit {
                report.escapes.push(Escape::OverLimit { slice: s.name.clone(), gpu: uuid.clone(), measured, limit });
            }
            report.usage.push(SliceUsage {
                slice: s.name.clone(),
                gpu: uuid.clone(),
                accounted: r.used(dev),
                measured,
                pids,
            });
        }
    }
    Ok(report)
}

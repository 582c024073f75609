//! The node description (`VGPU_SIM_CONFIG`, TOML) and the state directory (`VGPU_SIM_STATE`).

use crate::models::{self, Model};
use serde::Deserialize;
use std::path::PathBuf;

pub const MAX_GPUS: usize = 16;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    cuda_version: Option<i32>,
    driver_version: Option<String>,
    context_overhead_mib: Option<u64>,
    module_overhead_mib: Option<u64>,
    util_window_ms: Option<u64>,
    process_util: Option<String>,
    process_sample_ms: Option<u64>,
    mps: Option<bool>,
    graphics: Option<bool>,
    graph_memory_mapped_at: Option<String>,
    pool_trim_return_ms: Option<u64>,
    destroy_return_ms: Option<u64>,
    graph_launch_ms: Option<u64>,
    launch_host_us: Option<u64>,
    timeslice_us: Option<u64>,
    context_switch_us: Option<u64>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    model: String,
    uuid: Option<String>,
    pci_bus_id: Option<String>,
    numa_node: Option<i32>,
    memory_mib: Option<u64>,
    sm_count: Option<u32>,
    nvlink_domain: Option<u32>,
    managed_paging: Option<bool>,
    nvml_memory_info: Option<bool>,
}

/// One simulated GPU, every field resolved.
#[derive(Clone, Debug)]
pub struct GpuConfig {
    pub index: u32,
    pub model: &'static Model,
    pub uuid: String,
    /// `0000:1b:00.0` form, as CUDA prints it (NVML uses an 8-digit domain).
    pub pci_bus_id: String,
    pub pci_domain: u32,
    pub pci_bus: u32,
    pub pci_device: u32,
    pub numa_node: i32,
    pub memory_bytes: u64,
    pub sm_count: u32,
    pub nvlink_domain: Option<u32>,
    /// Unified memory pages on demand (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS): managed
    /// memory beyond the GPU's free memory is granted and lives on the host. Without it, managed
    /// memory must fit on the GPU.
    pub managed_paging: bool,
    /// NVML gives the GPU's memory figures (`nvmlDeviceGetMemoryInfo`). Unified-memory GPUs, whose
    /// memory is the host's (GB10), answer NOT_SUPPORTED there and still list per-process usage.
    pub nvml_memory_info: bool,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// `cuMemPoolTrimTo` returns this long after it let the memory go (a driver's unmapping and
    /// freeing take time; meanwhile NVML already shows the process without it).
    pub pool_trim_return_ns: u64,
    /// `cuCtxDestroy`, `cuDevicePrimaryCtxReset`, `cuMemPoolDestroy` and `cuGraphExecDestroy`
    /// return this long after the context (or what it held), pool or graph went (its handle may name
    /// the next one made meanwhile).
    pub destroy_return_ns: u64,
    /// `cuGraphLaunch` of a graph with memory nodes backs them this long after it was called (a
    /// driver's launch call takes time, and other threads launch meanwhile).
    pub graph_launch_ns: u64,
    /// Host time a kernel or graph launch call spends before its work reaches the GPU's queue (a
    /// driver marshals the arguments and writes the command buffer first: microseconds). Work
    /// recorded on the stream just before it (an event) is ahead of it by that much on an idle GPU.
    pub launch_host_ns: u64,
    /// How a GPU time-slices between the processes that have work queued (`timeline.rs`).
    pub slicing: crate::timeline::Slicing,
    pub cuda_version: i32,
    pub driver_version: String,
    pub context_overhead_bytes: u64,
    /// Device memory each loaded module holds in its context (code, constants), until it is
    /// unloaded or its context goes. Not allocated through any call an interposer sees.
    pub module_overhead_bytes: u64,
    pub util_window_ns: u64,
    /// How NVML's per-process SM samples credit processes.
    pub process_util: ProcessUtil,
    /// Per-process samples are taken at this period (0: whenever asked, over the time since the
    /// last one read). A real driver samples every 1/6 s or so.
    pub process_sample_ns: u64,
    /// While a process named `nvidia-cuda-mps-server` holds a context on a GPU, NVML's compute list
    /// there shows only it and its MPS client list every other process (their memory stays theirs).
    pub mps: bool,
    /// Every process holding a context also holds a graphics context (a CUDA application that
    /// draws with OpenGL or Vulkan): NVML's graphics list shows it as well as its compute list.
    pub graphics: bool,
    /// When a graph's allocations grow the device's graph pool: at its launch (or upload), or at
    /// the next synchronisation after it (a driver that maps graph memory lazily).
    pub graph_memory_at_sync: bool,
    pub gpus: Vec<GpuConfig>,
}

/// How `nvmlDeviceGetProcessUtilization` credits processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessUtil {
    /// Each process its own kernels' share of the window (they add up to the GPU's utilisation).
    Own,
    /// Each process that ran in the window the GPU's whole busy share, as an H200 with two
    /// time-sliced processes reported them (92 % and 93 % with the GPU 99 % busy).
    Gpu,
    /// No per-process samples: the call answers NOT_SUPPORTED, as on GPUs and MIG instances
    /// without them.
    None,
}

pub const DEFAULT_CONFIG: &str = r#"
# Two H100 80GB GPUs on two NUMA nodes.
[[gpu]]
model = "H100-80GB"
[[gpu]]
model = "H100-80GB"
"#;

impl Config {
    /// Reads `VGPU_SIM_CONFIG` (a path to a TOML file) or falls back to the default node.
    pub fn from_env() -> Result<Config, String> {
        match std::env::var_os("VGPU_SIM_CONFIG") {
            Some(p) if !p.is_empty() => {
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| format!("cannot read VGPU_SIM_CONFIG {}: {e}", p.to_string_lossy()))?;
                Config::parse(&text).map_err(|e| format!("{}: {e}", p.to_string_lossy()))
            }
            _ => Config::parse(DEFAULT_CONFIG),
        }
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if raw.gpu.is_empty() {
            return Err("the node has no [[gpu]] entries".into());
        }
        if raw.gpu.len() > MAX_GPUS {
            return Err(format!("{} GPUs configured; at most {MAX_GPUS}", raw.gpu.len()));
        }
        let n = raw.gpu.len() as u32;
        let mut gpus = Vec::new();
        for (i, g) in raw.gpu.into_iter().enumerate() {
            let i = i as u32;
            let model = models::model(&g.model).ok_or_else(|| {
                let known: Vec<_> = models::MODELS.iter().map(|m| m.key).collect();
                format!("gpu {i}: unknown model {:?} (known: {})", g.model, known.join(", "))
            })?;
            let uuid = g.uuid.unwrap_or_else(|| default_uuid(i));
            if !uuid.starts_with("GPU-") {
                return Err(format!("gpu {i}: uuid must start with GPU-"));
            }
            let bus = g.pci_bus_id.unwrap_or_else(|| format!("0000:{:02x}:00.0", 0x18 + (i % 8) * 0x10 + i / 8));
            let (dom, b, d) = parse_bus_id(&bus).ok_or_else(|| format!("gpu {i}: bad pci_bus_id {bus:?}"))?;
            let memory_mib = g.memory_mib.unwrap_or(model.memory_mib);
            if memory_mib == 0 {
                return Err(format!("gpu {i}: memory_mib must be positive"));
            }
            gpus.push(GpuConfig {
                index: i,
                model,
                uuid,
                pci_bus_id: format!("{dom:04x}:{b:02x}:{d:02x}.0"),
                pci_domain: dom,
                pci_bus: b,
                pci_device: d,
                numa_node: g.numa_node.unwrap_or(if n > 1 { (i * 2 / n) as i32 } else { 0 }),
                memory_bytes: memory_mib << 20,
                sm_count: g.sm_count.unwrap_or(model.sm_count),
                managed_paging: g.managed_paging.unwrap_or(true),
                nvml_memory_info: g.nvml_memory_info.unwrap_or(true),
                nvlink_domain: g.nvlink_domain,
            });
        }
        let process_util = match raw.process_util.as_deref() {
            None | Some("own") => ProcessUtil::Own,
            Some("gpu") => ProcessUtil::Gpu,
            Some("none") => ProcessUtil::None,
            Some(x) => return Err(format!("process_util = {x:?}: \"own\", \"gpu\" or \"none\"")),
        };
        let graph_memory_at_sync = match raw.graph_memory_mapped_at.as_deref() {
            None | Some("launch") => false,
            Some("sync") => true,
            Some(x) => return Err(format!("graph_memory_mapped_at = {x:?}: \"launch\" or \"sync\"")),
        };
        Ok(Config {
            pool_trim_return_ns: raw.pool_trim_return_ms.unwrap_or(0) * 1_000_000,
            destroy_return_ns: raw.destroy_return_ms.unwrap_or(0) * 1_000_000,
            graph_launch_ns: raw.graph_launch_ms.unwrap_or(0) * 1_000_000,
            launch_host_ns: raw.launch_host_us.unwrap_or(0) * 1_000,
            slicing: crate::timeline::Slicing {
                timeslice_ns: raw.timeslice_us.unwrap_or(0) * 1_000,
                switch_ns: raw.context_switch_us.unwrap_or(0) * 1_000,
            },
            cuda_version: raw.cuda_version.unwrap_or(12040),
            driver_version: raw.driver_version.unwrap_or_else(|| "550.54.15".into()),
            context_overhead_bytes: raw.context_overhead_mib.unwrap_or(256) << 20,
            module_overhead_bytes: raw.module_overhead_mib.unwrap_or(0) << 20,
            util_window_ns: raw.util_window_ms.unwrap_or(1000).max(1) * 1_000_000,
            process_util,
            process_sample_ns: raw.process_sample_ms.unwrap_or(0) * 1_000_000,
            mps: raw.mps.unwrap_or(false),
            graphics: raw.graphics.unwrap_or(false),
            graph_memory_at_sync,
            gpus,
        })
    }

    /// A stable fingerprint: processes sharing one state directory must agree on the node.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        h.write(self.driver_version.as_bytes());
        h.write(&self.cuda_version.to_le_bytes());
        h.write(&self.context_overhead_bytes.to_le_bytes());
        h.write(&self.module_overhead_bytes.to_le_bytes());
        h.write(&self.slicing.timeslice_ns.to_le_bytes());
        h.write(&self.slicing.switch_ns.to_le_bytes());
        for g in &self.gpus {
            h.write(g.model.key.as_bytes());
            h.write(g.uuid.as_bytes());
            h.write(g.pci_bus_id.as_bytes());
            h.write(&g.memory_bytes.to_le_bytes());
            h.write(&g.sm_count.to_le_bytes());
            h.write(&g.numa_node.to_le_bytes());
        }
        h.0
    }
}

/// The state directory shared by every process of one simulated node.
pub fn state_dir() -> PathBuf {
    match std::env::var_os("VGPU_SIM_STATE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        // SAFETY: getuid has no preconditions and cannot fail.
        _ => PathBuf::from(format!("/tmp/vgpu-sim-{}", unsafe { libc::getuid() })),
    }
}

fn default_uuid(i: u32) -> String {
    let x = 0x5eed_0000_u32 + i;
    format!("GPU-{x:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}", i * 17 + 0x1000, i, i * 3, 0xc0de_0000_u64 + i as u64)
}

fn parse_bus_id(s: &str) -> Option<(u32, u32, u32)> {
    let mut it = s.split(':');
    let dom = u32::from_str_radix(it.next()?, 16).ok()?;
    let bus = u32::from_str_radix(it.next()?, 16).ok()?;
    let rest = it.next()?;
    if it.next().is_some() {
        return None;
    }
    let (dev, func) = rest.split_once('.')?;
    let dev = u32::from_str_radix(dev, 16).ok()?;
    func.parse::<u32>().ok()?;
    (bus < 256 && dev < 32).then_some((dom, bus, dev))
}

#[derive(Default)]
struct Fnv(u64);
impl Fnv {
    fn write(&mut self, b: &[u8]) {
        if self.0 == 0 {
            self.0 = 0xcbf2_9ce4_8422_2325;
        }
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
        self.write_sep();
    }
    fn write_sep(&mut self) {
        self.0 = self.0.wrapping_mul(0x100_0000_01b3) ^ 0xff;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_node_parses() {
        let c = Config::parse(DEFAULT_CONFIG).unwrap();
        assert_eq!(c.gpus.len(), 2);
        assert_eq!(c.gpus[1].numa_node, 1);
        assert_ne!(c.gpus[0].uuid, c.gpus[1].uuid);
        assert_eq!(c.gpus[0].pci_bus_id, "0000:18:00.0");
    }

    #[test]
    fn bad_configs_are_rejected_with_reason() {
        assert!(Config::parse("").unwrap_err().contains("no [[gpu]]"));
        assert!(Config::parse("[[gpu]]\nmodel='X1'").unwrap_err().contains("unknown model"));
        assert!(Config::parse("[[gpu]]\nmodel='A30'\ncolour=1").is_err());
        assert!(Config::parse("[[gpu]]\nmodel='A30'\npci_bus_id='zz'").unwrap_err().contains("pci_bus_id"));
        let e = Config::parse("process_util='mine'\n[[gpu]]\nmodel='A30'").unwrap_err();
        assert!(e.contains("process_util = \"mine\""), "{e}");
        let c = Config::parse("process_util='gpu'\nprocess_sample_ms=150\n[[gpu]]\nmodel='A30'").unwrap();
        assert_eq!((c.process_util, c.process_sample_ns), (ProcessUtil::Gpu, 150_000_000));
        assert_eq!(Config::parse("process_util='none'\n[[gpu]]\nmodel='A30'").unwrap().process_util, ProcessUtil::None);
    }

    #[test]
    fn overrides_apply_and_change_fingerprint() {
        let a = Config::parse("[[gpu]]\nmodel='a30'").unwrap();
        let b = Config::parse("[[gpu]]\nmodel='A30'\nmemory_mib=1024\nsm_count=8").unwrap();
        assert_eq!(b.gpus[0].memory_bytes, 1 << 30);
        assert_eq!(b.gpus[0].sm_count, 8);
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint(), Config::parse("[[gpu]]\nmodel='A30'").unwrap().fingerprint());
    }
}

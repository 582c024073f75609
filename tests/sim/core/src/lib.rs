//! The simulated GPU node's core: one library that the fake `libcuda.so.1`, the fake
//! `libnvidia-ml.so.1` and the `vgpu-sim` tool share, so that both driver libraries see one node.

pub use cuda_abi as abi;
pub mod config;
pub mod kernels;
pub mod mig;
pub mod models;
pub mod mps;
pub mod runtime;
pub mod state;
pub mod timeline;

pub use config::{Config, GpuConfig, MAX_GPUS};
pub use state::{now_ns, Node};

/// The calling process's PID as the host sees it. A GPU driver knows processes by their PID in the
/// initial PID namespace (NVML reports those), whatever namespace the process runs in; the
/// simulator reads it from `/proc/self/status` (`NSpid`, first entry), which names it whenever the
/// mounted `/proc` belongs to the host's namespace, and falls back to `getpid()`.
pub fn host_pid() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("NSpid:")?.split_whitespace().next()?.parse().ok()))
        .unwrap_or_else(std::process::id)
}

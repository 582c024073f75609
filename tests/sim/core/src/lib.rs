//! The simulated GPU node's core: one library that the fake `libcuda.so.1`, the fake
//! `libnvidia-ml.so.1` and the `vgpu-sim` tool share, so that both driver libraries see one node.

pub use cuda_abi as abi;
pub mod config;
pub mod kernels;
pub mod mig;
pub mod models;
pub mod state;

pub use config::{Config, GpuConfig, MAX_GPUS};
pub use state::{now_ns, Node};

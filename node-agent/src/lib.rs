//! The vgpu node agent's library: configuration and GPU discovery through NVML. The daemon's other
//! responsibilities (slices, monitoring, API, metrics) arrive with their issue.

pub mod config;
pub mod discovery;
pub mod monitor;
pub mod slices;

//! The vgpu node agent's library: configuration, GPU discovery through NVML, slices, the monitoring
//! pass and the main loop. The gRPC API and metrics arrive with their issue.

pub mod config;
pub mod daemon;
pub mod discovery;
pub mod monitor;
pub mod slices;

//! The vgpu node agent's library: configuration, GPU discovery and health through NVML, slices,
//! the monitoring pass, the gRPC API, metrics and the daemon. `vgpuctl` is built from it too.

pub mod agent;
pub mod api;
pub mod capacity;
pub mod cdi;
pub mod config;
pub mod ctl;
pub mod daemon;
pub mod deviceplugin;
pub mod discovery;
pub mod hami;
pub mod health;
pub mod k8s;
pub mod metrics;
pub mod mig;
pub mod monitor;
pub mod procfs;
pub mod report;
pub mod slices;

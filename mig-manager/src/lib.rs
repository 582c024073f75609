//! MIG geometry for vgpu.
//!
//! * [`model`]: what a GPU offers (profiles with their placements, read from NVML at run time) and
//!   what it has (GPU instances, with whether a workload uses them).
//! * [`planner`]: pure functions. Given a GPU, its instances and a target, the minimal set of
//!   destroy/create steps with explicit placements that never touches a busy instance unless forced,
//!   or why the target is impossible; and for a dynamic request, the best-fitting profile and the
//!   placement that keeps large placements free.
//! * [`backend`]: the [`backend::MigBackend`] trait and its NVML implementation (nvml-wrapper, plus
//!   raw calls through the loaded library for what the wrapper lacks).
//! * [`apply`]: carrying a plan out, with a journal so that an interrupted apply resumes on restart.
//! * [`config`]: the mig-parted v1 configuration format.

pub mod apply;
pub mod backend;
pub mod config;
pub mod model;
pub mod planner;

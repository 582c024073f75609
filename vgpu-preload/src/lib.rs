//! `libvgpu.so`: the CUDA driver-API interposer. Loaded into every GPU process of a container
//! (LD_PRELOAD or /etc/ld.so.preload), it enforces the container's GPU memory quota exactly, across
//! all its processes, and makes the container see its slice as its GPU.
//!
//! Layout: `api` declares the intercepted entry points once; `hooks` generates the exported symbols
//! from it; `dl` overrides `dlsym`; `procaddr` rewrites `cuGetProcAddress` answers; `memory` and
//! `nvml` are the policies; `state` holds the process's slot in the container's region.

// Unit-test builds have no exported hooks, so most of the crate is unreachable there.
#![cfg_attr(test, allow(dead_code, unused_imports))]

mod api;
mod capture;
mod config;
mod dl;
mod guard;
mod hooks;
mod log;
mod memory;
mod nvml;
mod procaddr;
mod ptrmap;
mod real;
mod sm;
mod state;

pub(crate) const MAX_DEVICES: usize = vgpu_region::MAX_DEVICES;

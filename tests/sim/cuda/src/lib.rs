//! Simulated `libcuda.so.1`: the CUDA driver API with the real C ABI and symbol names, over the
//! simulated node shared by every process (see the `vgpu-sim` crate). Built as a cdylib linked with
//! `-Bsymbolic`, like the real driver binds its internal calls to itself.

mod driver;
mod exec;
mod exports;
mod mem;
mod mps;
mod procaddr;

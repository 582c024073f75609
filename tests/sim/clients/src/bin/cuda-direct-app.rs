//! Linked against libcuda.so.1 at build time (through a stub, like the CUDA toolkit's
//! `stubs/libcuda.so`); the dynamic loader binds the real (or simulated) driver at run time.
use vgpu_sim_clients::{define_direct, with_cuda_api};

with_cuda_api!(define_direct);

fn main() {
    vgpu_sim_clients::client_main("cuda-direct-app", |_| Ok(direct_api()))
}

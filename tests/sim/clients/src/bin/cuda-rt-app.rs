//! Binds like the CUDA runtime: private dlopen, every entry point through cuGetProcAddress_v2.
fn main() {
    vgpu_sim_clients::client_main("cuda-rt-app", vgpu_sim_clients::bind_runtime)
}

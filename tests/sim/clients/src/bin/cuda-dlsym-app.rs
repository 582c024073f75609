//! Binds with dlopen + dlsym of each versioned symbol.
fn main() {
    vgpu_sim_clients::client_main("cuda-dlsym-app", |_| vgpu_sim_clients::bind_dlsym())
}

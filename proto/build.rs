//! Compiles `vgpu/**/*.proto` with protox (a pure-Rust protobuf compiler) and generates prost
//! messages and tonic clients and servers.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "vgpu/v1/agent.proto",
        "vgpu/scheduler/v1/scheduler.proto",
        "k8s/deviceplugin/v1beta1/api.proto",
        "k8s/podresources/v1/api.proto",
        "k8s/dra/v1/api.proto",
        "k8s/dra/v1beta1/api.proto",
        "k8s/pluginregistration/v1/api.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // JSON output (`vgpuctl --json`) serialises the messages as they are.
        .type_attribute(".", "#[derive(serde::Serialize)]")
        .compile_fds(fds)?;
    Ok(())
}

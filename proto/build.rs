//! Compiles `vgpu/**/*.proto` with protox (a pure-Rust protobuf compiler) and generates prost
//! messages and tonic clients and servers.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "vgpu/v1/agent.proto",
        "vgpu/scheduler/v1/scheduler.proto",
        "k8s/deviceplugin/v1beta1/api.proto",
        "k8s/podresources/v1/api.proto",
        "k8s/pluginregistration/v1/api.proto",
        "k8s/drahealth/v1alpha1/api.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    // The kubelet DRA API: one text, written for each version with its package.
    let dra = "k8s/dra/api.proto.in";
    println!("cargo:rerun-if-changed={dra}");
    let template = std::fs::read_to_string(dra)?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("protos");
    let mut all: Vec<String> = files.iter().map(|f| f.to_string()).collect();
    for version in ["v1", "v1beta1"] {
        let rel = format!("k8s/dra/{version}/api.proto");
        std::fs::create_dir_all(out.join(format!("k8s/dra/{version}")))?;
        std::fs::write(out.join(&rel), template.replace("VERSION", version))?;
        all.push(out.join(&rel).display().to_string());
    }
    let fds = protox::compile(&all, [std::path::Path::new("."), out.as_path()])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // JSON output (`vgpuctl --json`) serialises the messages as they are.
        .type_attribute(".", "#[derive(serde::Serialize)]")
        // Enums by name in JSON ("UNACCOUNTED"), not by number.
        .field_attribute("vgpu.v1.Escape.kind", "#[serde(serialize_with = \"crate::escape_kind\")]")
        .field_attribute("vgpu.v1.SliceStatus.priority", "#[serde(serialize_with = \"crate::priority\")]")
        .field_attribute("vgpu.v1.SliceDetail.priority", "#[serde(serialize_with = \"crate::priority\")]")
        .field_attribute("vgpu.v1.CreateSliceRequest.priority", "#[serde(serialize_with = \"crate::priority\")]")
        .compile_fds(fds)?;
    Ok(())
}

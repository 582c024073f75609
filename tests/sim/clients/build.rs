//! Builds a link-time stub `libcuda.so` (soname libcuda.so.1) for `cuda-direct-app`, exactly like the
//! CUDA toolkit's `stubs/libcuda.so`: the binary records a dependency on libcuda.so.1 and the dynamic
//! loader binds whatever driver is installed at run time. Symbol names come from `src/api.rs`.
//! Also builds `cuda-start` (tests/c-probe/start.c), the client whose start sim-bench times.
use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let api = fs::read_to_string("src/api.rs").unwrap();
    let mut c = String::new();
    for line in api.lines() {
        let t = line.trim_start();
        if let Some((name, rest)) = t.split_once(" = \"") {
            if rest.contains("\" : fn(") && name.starts_with("cu") {
                c.push_str(&format!("void {name}(void) {{}}\n"));
            }
        }
    }
    let src = out.join("libcuda_stub.c");
    fs::write(&src, c).unwrap();
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let so = out.join("libcuda.so");
    let st = Command::new(&cc)
        .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} to build the libcuda stub: {e}"));
    assert!(st.success(), "building the libcuda link stub failed");
    // The cheapest CUDA client, whose start sim-bench times: nothing in it but the driver's start.
    let start = out.join("cuda-start");
    let st = Command::new(&cc)
        .args(["-O2", "-o"])
        .arg(&start)
        .arg("../../c-probe/start.c")
        .arg("-ldl")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} to build cuda-start: {e}"));
    assert!(st.success(), "building cuda-start failed");
    println!("cargo:rustc-env=VGPU_CUDA_START={}", start.display());
    println!("cargo:rerun-if-changed=../../c-probe/start.c");
    println!("cargo:rustc-link-arg-bin=cuda-direct-app=-L{}", out.display());
    println!("cargo:rustc-link-arg-bin=cuda-direct-app=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg-bin=cuda-direct-app=-lcuda");
    println!("cargo:rerun-if-changed=src/api.rs");
    println!("cargo:rerun-if-changed=build.rs");
}

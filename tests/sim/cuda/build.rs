fn main() {
    // Like the real driver libraries: the right soname, and internal calls bound to this library so
    // that a preloaded interposer cannot capture the driver's own calls.
    let soname =
        if std::env::var("CARGO_PKG_NAME").unwrap() == "vgpu-sim-cuda" { "libcuda.so.1" } else { "libnvidia-ml.so.1" };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rerun-if-changed=build.rs");
}

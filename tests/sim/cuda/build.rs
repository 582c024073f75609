fn main() {
    // Like the real driver libraries: the right soname, and internal calls bound to this library so
    // that a preloaded interposer cannot capture the driver's own calls.
    let soname =
        if std::env::var("CARGO_PKG_NAME").unwrap() == "vgpu-sim-cuda" { "libcuda.so.1" } else { "libnvidia-ml.so.1" };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    // And what it needs from the C library: NVIDIA's libcuda.so.1 is linked against libm, libdl,
    // libpthread and librt (an old glibc's split), so on a node a process that loads the driver
    // loads those four as well. A start measured against this driver pays for them as it does
    // there. (Named by file: since glibc 2.34 the last three are stubs with no link-time library of
    // their own.) Only for the machine's own target: the cross builds link against zig's stubs, and
    // nothing there measures a start.
    if std::env::var("TARGET").ok() == std::env::var("HOST").ok() {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--no-as-needed");
        for lib in ["libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1"] {
            println!("cargo:rustc-cdylib-link-arg=-l:{lib}");
        }
        println!("cargo:rustc-cdylib-link-arg=-Wl,--as-needed");
    }
    println!("cargo:rerun-if-changed=build.rs");
}

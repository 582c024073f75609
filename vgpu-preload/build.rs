//! Link settings of libvgpu.so.

fn main() {
    // The library's own references to its exported hooks (the hook tables hand out their
    // addresses) are bound here, at link time, rather than looked up by name in the process's
    // global scope as each process loads it: 123 of its 222 symbolic relocations were those, and an
    // application that defined a `cu*` function of its own would otherwise have had its function
    // handed out as our hook.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
}

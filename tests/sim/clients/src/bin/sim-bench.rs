//! Call costs of the simulated driver itself: the denominators of the interposer's overhead ratios.
//! Usage: sim-bench [--quick] [--json]
//!
//! Loads `libcuda.so.1` from LD_LIBRARY_PATH, or the simulator built next to this binary, and runs on
//! a private simulated node unless VGPU_SIM_STATE is set.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("VGPU_CLIENT_LIBCUDA").is_none() && std::env::var_os("LD_LIBRARY_PATH").is_none() {
        if let Some(lib) =
            std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join("libcuda.so"))).filter(|l| l.exists())
        {
            std::env::set_var("VGPU_CLIENT_LIBCUDA", lib);
        }
    }
    let private = std::env::var_os("VGPU_SIM_STATE").is_none().then(|| {
        let d = std::env::temp_dir().join(format!("vgpu-sim-bench-{}", std::process::id()));
        std::env::set_var("VGPU_SIM_STATE", &d);
        d
    });
    let scale = if args.iter().any(|a| a == "--quick") { 10 } else { 1 };
    let api = match vgpu_sim_clients::bind_dlsym() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("sim-bench: {e}");
            std::process::exit(3);
        }
    };
    let f = vgpu_sim_clients::bench::measure(&api, scale);
    if let Some(d) = private {
        let _ = std::fs::remove_dir_all(d);
    }
    if args.iter().any(|a| a == "--json") {
        println!(
            "{}",
            serde_json::json!({"launch_ns": f.launch_ns, "alloc_free_ns": f.alloc_free_ns,
                "alloc_free_30k_live_ns": f.alloc_free_30k_ns, "get_info_ns": f.get_info_ns})
        );
        return;
    }
    println!("| call | median ns |\n|---|---|");
    println!("| cuLaunchKernel (sleep_0ns, stream) | {:.0} |", f.launch_ns);
    println!("| cuMemAlloc_v2 + cuMemFree_v2 (4 KiB) | {:.0} |", f.alloc_free_ns);
    println!("| cuMemAlloc_v2 + cuMemFree_v2 with {} live | {:.0} |", 30_000 / scale, f.alloc_free_30k_ns);
    println!("| cuMemGetInfo_v2 | {:.0} |", f.get_info_ns);
}

//! Call costs of the simulated driver itself: the denominators of the interposer's overhead ratios.
//! Usage: sim-bench [--quick] [--json]
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale = if args.iter().any(|a| a == "--quick") {
        10
    } else {
        1
    };
    let api = match vgpu_sim_clients::bind_dlsym() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("sim-bench: {e}");
            std::process::exit(3);
        }
    };
    let f = vgpu_sim_clients::bench::measure(&api, scale);
    if args.iter().any(|a| a == "--json") {
        println!(
            "{}",
            serde_json::json!({"launch_ns": f.launch_ns, "alloc_free_ns": f.alloc_free_ns,
                "alloc_free_30k_live_ns": f.alloc_free_30k_ns, "get_info_ns": f.get_info_ns})
        );
        return;
    }
    println!("| call | median ns |\n|---|---|");
    println!(
        "| cuLaunchKernel (sleep_0ns, stream) | {:.0} |",
        f.launch_ns
    );
    println!(
        "| cuMemAlloc_v2 + cuMemFree_v2 (4 KiB) | {:.0} |",
        f.alloc_free_ns
    );
    println!(
        "| cuMemAlloc_v2 + cuMemFree_v2 with {} live | {:.0} |",
        30_000 / scale,
        f.alloc_free_30k_ns
    );
    println!("| cuMemGetInfo_v2 | {:.0} |", f.get_info_ns);
}

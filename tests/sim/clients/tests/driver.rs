//! The simulated libcuda.so.1 through real processes and all three binding paths; the simulator's
//! own view (`vgpu-sim status`) and NVML are the ground truth.

mod common;
use common::*;
use serde_json::Value;

/// A 1 GiB A100 and an L4; 64 MiB per context; 5 s utilisation window.
const SMALL: &str = r#"
context_overhead_mib = 64
util_window_ms = 5000
[[gpu]]
model = "A100-40GB"
memory_mib = 1024
[[gpu]]
model = "L4"
"#;

fn used(s: &Sim, gpu: usize) -> u64 {
    s.status()["gpus"][gpu]["memory_used"].as_u64().unwrap()
}

fn proc_mem(s: &Sim, pid: u32, gpu: usize) -> Option<u64> {
    s.status()["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .map(|p| p["memory"][gpu].as_u64().unwrap())
}

#[test]
fn each_binding_path_allocates_launches_and_synchronises() {
    let s = Sim::new(Some(SMALL));
    for bin in [RT, DIRECT, DLSYM] {
        let info = s.run1(bin, &["info"]);
        assert_eq!(info["devices"].as_array().unwrap().len(), 2, "{bin}");
        assert_eq!(info["devices"][0]["name"], "NVIDIA A100-SXM4-40GB");
        assert_eq!(info["devices"][1]["sm_count"], 58);
        assert_eq!(info["devices"][0]["total_mem"], 1024 * MIB);
        assert_eq!(info["mem_info"]["free"], (1024 - 64) * MIB, "{bin}: context overhead charged");

        let v = s.run(bin, &["alloc", "--size", "256m", "--chunk", "64m"]);
        assert_eq!(v[0]["allocated"], 256 * MIB, "{bin}");
        assert_eq!(v[0]["mem_info"]["free"], (1024 - 64 - 256) * MIB, "{bin}");
        assert_eq!(v[1]["mem_info"]["free"], (1024 - 64) * MIB, "{bin}: freed");

        let l = s.run1(bin, &["launch", "--kernel", "sleep_2ms", "--count", "10"]);
        let ms = l["gpu_ms"].as_f64().unwrap();
        assert!((20.0..25.0).contains(&ms), "{bin}: 10 x 2 ms took {ms} ms of GPU time");
        assert!(l["wall_ms"].as_f64().unwrap() >= 20.0, "{bin}: synchronize waits for completion");

        let m = s.run1(bin, &["memcpy", "--size", "3m"]);
        assert_eq!((m["roundtrip_ok"].as_bool(), m["memset_ok"].as_bool()), (Some(true), Some(true)), "{bin}");
        assert_eq!(m["out_of_bounds"], "CUDA_ERROR_INVALID_VALUE");
    }
    // Per-thread default stream entry points work the same.
    let l = s.run1(RT, &["--per-thread", "launch", "--kernel", "sleep_1ms", "--count", "5"]);
    assert_eq!(l["kernels"], 5);
    assert_eq!(used(&s, 0), 0, "every process released everything at exit");
}

fn procaddr(s: &Sim, version: &str, per_thread: bool, names: &[&str]) -> Vec<Value> {
    let mut args = vec!["--cuda-version", version];
    if per_thread {
        args.push("--per-thread");
    }
    args.push("procaddr");
    args.extend_from_slice(names);
    s.run(RT, &args)
}

#[test]
fn get_proc_address_answers_per_version_and_flags() {
    let s = Sim::new(Some(SMALL));
    let cases: &[(&str, &str, bool, Option<&str>)] = &[
        ("cuMemAdvise", "12000", false, Some("cuMemAdvise")),
        ("cuMemAdvise", "12020", false, Some("cuMemAdvise_v2")),
        ("cuMemAlloc", "3010", false, Some("cuMemAlloc")),
        ("cuMemAlloc", "12040", false, Some("cuMemAlloc_v2")),
        ("cuMemAlloc", "12040", true, Some("cuMemAlloc_v2")),
        ("cuLaunchKernel", "12040", false, Some("cuLaunchKernel")),
        ("cuLaunchKernel", "12040", true, Some("cuLaunchKernel_ptsz")),
        ("cuMemcpyHtoD", "12040", true, Some("cuMemcpyHtoD_v2_ptds")),
        ("cuStreamBeginCapture", "10000", true, Some("cuStreamBeginCapture_ptsz")),
        ("cuStreamBeginCapture", "12040", true, Some("cuStreamBeginCapture_v2_ptsz")),
        ("cuGraphInstantiate", "11000", false, Some("cuGraphInstantiate_v2")),
        ("cuGraphInstantiate", "12000", false, Some("cuGraphInstantiateWithFlags")),
        ("cuGraphLaunch", "12040", true, Some("cuGraphLaunch_ptsz")),
        ("cuGetProcAddress", "12000", false, Some("cuGetProcAddress_v2")),
        ("cuMemAllocAsync", "11000", false, None),
    ];
    for &(name, ver, pt, want) in cases {
        let r = &procaddr(&s, ver, pt, &[name])[0];
        match want {
            Some(sym) => {
                assert_eq!((r["ret"].as_u64(), r["status"].as_i64()), (Some(0), Some(0)), "{name}@{ver}");
                assert_eq!(r["resolved"], sym, "{name}@{ver} per_thread={pt}");
            }
            None => {
                assert_eq!(r["ret"], 500, "{name}@{ver}: CUDA_ERROR_NOT_FOUND");
                assert_eq!(r["status"], 2, "{name}@{ver}: CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT");
                assert_eq!(r["resolved"], Value::Null);
            }
        }
    }
    let r = &procaddr(&s, "12040", false, &["cuNoSuchFunction"])[0];
    assert_eq!((r["ret"].as_u64(), r["status"].as_i64()), (Some(500), Some(1)));

    // The runtime-like client cannot bind an entry point newer than the CUDA version it asks for.
    let o = s.output(RT, &["--cuda-version", "11000", "info"]);
    assert_eq!(o.status.code(), Some(3));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("cuMemPoolCreate, 11000) = 500 status 2"),
        "version not sufficient for a CUDA 11.2 entry point: {e}"
    );
}

#[test]
fn every_allocator_is_counted_then_released() {
    let mut s = Sim::new(Some(SMALL));
    for a in ["device", "pitch", "managed", "vmm", "async", "pool", "array"] {
        let (pid, v) = s.spawn(RT, &["alloc", "--allocator", a, "--size", "100m", "--chunk", "10m", "--hold"]);
        assert_eq!(v["error"], Value::Null, "{a}");
        let bytes = v["bytes"].as_u64().unwrap();
        assert!(bytes >= 100 * MIB, "{a}: {bytes}");
        assert_eq!(proc_mem(&s, pid, 0), Some(64 * MIB + bytes), "{a}: charged to the process");
        assert_eq!(used(&s, 0), 64 * MIB + bytes, "{a}");
        assert_eq!(v["mem_info"]["free"], 1024 * MIB - 64 * MIB - bytes, "{a}: cuMemGetInfo");
        s.kill(pid);
        assert_eq!(used(&s, 0), 0, "{a}: released after SIGKILL");

        let v = s.run(RT, &["alloc", "--allocator", a, "--size", "100m", "--chunk", "10m"]);
        assert_eq!(v[1]["failures"], 0, "{a}");
        assert_eq!(v[1]["mem_info"]["free"], (1024 - 64) * MIB, "{a}: every free returns what was charged");
    }
    // Host memory is not device memory.
    let (pid, v) = s.spawn(RT, &["alloc", "--allocator", "host", "--size", "2g", "--chunk", "512m", "--hold"]);
    assert_eq!(v["allocated"], 2048 * MIB);
    assert_eq!(proc_mem(&s, pid, 0), Some(64 * MIB));
}

#[test]
fn physical_memory_is_exhausted_exactly() {
    let mut s = Sim::new(Some(SMALL));
    let v = s.run1(DIRECT, &["alloc", "--size", "2g", "--chunk", "100m"]);
    assert_eq!(v["allocated"], 900 * MIB);
    assert_eq!(v["error"], "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(v["mem_info"]["free"], (1024 - 64 - 900) * MIB);

    // Two processes share the GPU's memory.
    let (a, _) = s.spawn(RT, &["alloc", "--size", "600m", "--hold"]);
    let v = s.run1(DLSYM, &["alloc", "--size", "600m", "--chunk", "100m"]);
    assert_eq!(v["allocated"], 200 * MIB, "64+600 + 64+200 fits in 1024, one more 100m does not");
    assert_eq!(v["error"], "CUDA_ERROR_OUT_OF_MEMORY");

    // SIGKILL gives the memory back, like the driver does at process exit.
    s.kill(a);
    let v = s.run1(DLSYM, &["alloc", "--size", "900m"]);
    assert_eq!(v["error"], Value::Null);
    assert_eq!(used(&s, 0), 0);
}

#[test]
fn many_threads_allocate_free_and_launch() {
    let s = Sim::new(Some(SMALL));
    let v = s.run1(RT, &["threads", "--threads", "16", "--iters", "50", "--size", "8m"]);
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["mem_info"]["free"], (1024 - 64) * MIB);
    let v = s.run1(DIRECT, &["launch", "--threads", "4", "--kernel", "sleep_1ms", "--count", "25"]);
    assert_eq!(v["kernels"], 100);
    let busy: Value =
        serde_json::from_slice(&s.output(SIM, &["util", "--gpu", "0", "--window-ms", "5000"]).stdout).unwrap();
    assert!((busy["busy"].as_f64().unwrap() - 0.02).abs() < 1e-4, "100 x 1 ms from 4 threads: {busy}");
}

#[test]
fn explicit_contexts_cost_memory_and_release_theirs() {
    let s = Sim::new(Some(SMALL));
    let v = s.run1(DLSYM, &["contexts", "--size", "100m"]);
    let free = |k: &str| v[k]["free"].as_u64().unwrap();
    assert_eq!(free("before"), (1024 - 64) * MIB, "{v}");
    assert_eq!(free("with_context"), (1024 - 128) * MIB, "a second context costs its overhead");
    assert_eq!(free("during"), (1024 - 228) * MIB);
    assert_eq!(free("after"), (1024 - 64) * MIB, "destroying a context frees its allocations");
    assert_eq!(v["free_after_destroy"], "CUDA_ERROR_INVALID_VALUE");
}

#[test]
fn kernels_of_two_processes_share_one_timeline() {
    let s = Sim::new(Some(SMALL));
    let spawn = |bin: &str| {
        s.cmd(bin)
            .args(["launch", "--kernel", "sleep_5ms", "--count", "60"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(RT), spawn(DIRECT));
    let (pa, pb) = (a.id(), b.id());
    let (oa, ob) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(oa.status.success() && ob.status.success());
    assert_eq!(lines(&oa.stdout)[0]["kernels"], 60);
    assert_eq!(lines(&ob.stdout)[0]["kernels"], 60);

    let u: Value =
        serde_json::from_slice(&s.output(SIM, &["util", "--gpu", "0", "--window-ms", "5000"]).stdout).unwrap();
    let busy = u["busy"].as_f64().unwrap();
    assert!((busy - 0.12).abs() < 1e-3, "600 ms of kernels in a 5 s window: {u}");
    for p in [pa, pb] {
        let share = u["per_pid"][p.to_string()].as_f64().unwrap();
        assert!((share - 0.06).abs() < 1e-3, "pid {p}: {u}");
    }
    // The timeline: 120 kernels of 5 ms, none overlapping another.
    let t: Vec<(u64, u64, u32)> =
        serde_json::from_slice(&s.output(SIM, &["timeline", "--gpu", "0", "--window-ms", "5000"]).stdout).unwrap();
    assert_eq!(t.len(), 120);
    for k in &t {
        assert_eq!(k.1 - k.0, 5_000_000);
    }
    let mut sorted = t.clone();
    sorted.sort();
    for w in sorted.windows(2) {
        assert!(w[1].0 >= w[0].1, "kernels overlap: {w:?}");
    }
    assert_eq!(t.iter().filter(|k| k.2 == pa).count(), 60);

    // NVML reports the same utilisation from the same timeline.
    let n = s.nvml();
    let g = &n["gpus"][0];
    assert_eq!(g["utilization"]["gpu"], 12, "{g}");
    let samples = g["process_utilization"].as_array().unwrap();
    for p in [pa, pb] {
        let smp = samples.iter().find(|x| x["pid"] == p).unwrap_or_else(|| panic!("no sample for {p}: {g}"));
        assert_eq!(smp["sm"], 6);
    }
}

/// A 1 ms kernel queued beside another process's 200 ms backlog: on a first-come GPU
/// (`timeslice_us = 0`) it waits for the backlog; on a time-slicing one it waits for at most
/// the rest of the neighbour's 2 ms slice, then shares the GPU (the backlog ends 1 ms later).
#[test]
fn a_time_slicing_gpu_serves_a_short_kernel_beside_a_backlog() {
    // (timeslice, the short kernel's time from its launch, the backlog's time)
    // (the backlog's launches may straggle on a loaded machine: its figure has slack)
    for (slice_us, short, long) in [(0u64, 100.0..260.0, 200.0..215.0), (2000, 1.0..4.5, 201.0..216.0)] {
        let s = Sim::new(Some(&format!("timeslice_us = {slice_us}\n{SMALL}")));
        let backlog = s
            .cmd(RT)
            .args(["launch", "--kernel", "sleep_5ms", "--count", "40"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Its context made (on a loaded machine that took longer than the 20 ms given alone), then
        // time for its launches (on a loaded machine a fifth of the backlog may have run by then).
        let t = std::time::Instant::now();
        while s.status()["gpus"][0]["memory_used"] == 0 && t.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        let v = s.run1(DIRECT, &["launch", "--kernel", "sleep_1ms", "--count", "1"]);
        let waited = v["gpu_ms"].as_f64().unwrap();
        assert!(short.contains(&waited), "timeslice {slice_us} us: the 1 ms kernel took {waited} ms");
        let o = backlog.wait_with_output().unwrap();
        let b = &lines(&o.stdout)[0];
        let took = b["gpu_ms"].as_f64().unwrap();
        assert!(long.contains(&took), "timeslice {slice_us} us: the backlog took {took} ms: {b}");
    }
}

#[test]
fn every_launch_path_runs_on_the_timeline() {
    let s = Sim::new(Some(SMALL));
    for (path, extra, kernels) in [
        ("kernel", vec![], 4),
        ("ex", vec![], 4),
        ("coop", vec![], 4),
        ("graph", vec!["--nodes", "5"], 20),
        ("capture", vec!["--nodes", "5"], 20),
        ("legacy", vec![], 4),
        ("legacy-default", vec![], 4),
    ] {
        let mut args = vec!["launch", "--kernel", "sleep_2ms", "--count", "4", "--path", path];
        args.extend(extra);
        let v = s.run1(RT, &args);
        assert_eq!(v["kernels"], kernels, "{path}");
        let ms = v["gpu_ms"].as_f64().unwrap();
        let want = 2.0 * kernels as f64;
        assert!(ms >= want && ms < want + 5.0, "{path}: {ms} ms for {kernels} x 2 ms");
    }
    // wave_: one block per SM per wave; 324 blocks on 108 SMs = 3 waves of 1 ms.
    let v = s.run1(RT, &["launch", "--kernel", "wave_1ms", "--grid", "324", "--count", "2"]);
    assert!((6.0..9.0).contains(&v["gpu_ms"].as_f64().unwrap()), "{v}");
    // param_ns: the first kernel parameter is the duration.
    let v = s.run1(DLSYM, &["launch", "--kernel", "param_ns", "--duration-ns", "3000000", "--count", "2"]);
    assert!((6.0..9.0).contains(&v["gpu_ms"].as_f64().unwrap()), "{v}");
    // ... also when set with cuParamSetv for the deprecated launch API.
    let v = s.run1(
        DLSYM,
        &["launch", "--path", "legacy", "--kernel", "param_ns", "--duration-ns", "3000000", "--count", "2"],
    );
    assert!((6.0..9.0).contains(&v["gpu_ms"].as_f64().unwrap()), "{v}");
    // A cooperative grid larger than the GPU can hold at once is refused.
    let o = s.output(
        RT,
        &["launch", "--device", "1", "--path", "coop", "--grid", "1000", "--block", "1024", "--count", "1"],
    );
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"));
    // Unknown kernels are not found, like a missing symbol in a module.
    let o = s.output(RT, &["launch", "--kernel", "gemm", "--count", "1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("CUDA_ERROR_NOT_FOUND"));
}

/// Executable graphs change as the driver documents: updated from another graph of as many nodes,
/// their kernel nodes given other parameters, nodes disabled and enabled; a destroyed one's handle is
/// given to the next graph instantiated (as a real driver's allocator does), and so are the functions
/// of an unloaded module.
#[test]
fn changed_graphs_and_reloaded_modules_run_their_new_work() {
    let s = Sim::new(Some(SMALL));
    for how in ["update", "update-v1", "reinstantiate", "set-params", "set-params-v1", "node-params", "child", "enable"]
    {
        // 5 launches of 4 x 100 us, then 5 of 4 x 1 ms (or 40 x 100 us nodes, 4 of them enabled, then all).
        let args = ["launch", "--path", "graph", "--kernel", "param_ns", "--duration-ns", "100000", "--nodes", "4"];
        let more = ["--count", "10", "--regraph-after", "5", "--regraph-how", how];
        let v = s.run1(RT, &[&args[..], &more[..]].concat());
        let ms = v["gpu_ms"].as_f64().unwrap();
        assert!((22.0..26.0).contains(&ms), "{how}: {ms} ms, want 5 x 0.4 + 5 x 4 = 22");
    }
    // Bad options are refused with the reason.
    let o = s.output(RT, &["launch", "--path", "kernel", "--regraph-after", "1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--regraph-after needs --path graph"));
    // A module unloaded (or the primary context reset) and another loaded: its function (given the
    // freed handle) runs its own time. (A reset destroys the events that time the run too: new ones
    // time what runs after it.)
    for (loader, how, want) in [("module", "unload", 11.0), ("library", "unload", 11.0), ("module", "reset", 10.0)] {
        let args = ["launch", "--kernel", "sleep_100us", "--count", "20", "--reload-after", "10", "--loader", loader];
        let more = ["--reload-kernel", "sleep_1ms", "--reload-how", how];
        let ms = s.run1(RT, &[&args[..], &more[..]].concat())["gpu_ms"].as_f64().unwrap();
        assert!(
            (want..want + 3.0).contains(&ms),
            "{loader} {how}: {ms} ms, want {want} (10 x 0.1 before, 10 x 1 after)"
        );
    }
}

#[test]
fn graphs_that_allocate_draw_on_one_pool_per_device() {
    // Graph memory nodes (explicit or captured) are backed when the graph runs, from the device's
    // graph pool, which later launches of any graph reuse and only a trim gives back.
    let mut s = Sim::new(Some(SMALL));
    for how in ["explicit", "capture"] {
        let (pid, _) = s.spawn_until(
            s.cmd(RT),
            &["graph-mem", "--how", how, "--size", "600m", "--graphs", "2", "--hold"],
            Some("ready"),
        );
        assert_eq!(proc_mem(&s, pid, 0), Some((64 + 600) << 20), "{how}: one 600 MiB pool for both graphs");
        s.kill(pid);
        let v = s.run(RT, &["graph-mem", "--how", how, "--size", "600m", "--trim", "--launches", "1"]);
        let t = v.iter().find(|x| x["step"] == "trimmed").unwrap();
        assert_eq!(t["pool"], 0, "{how}: {t}");
        // More than the GPU has: the launch fails and nothing is taken.
        let v = s.run(RT, &["graph-mem", "--how", how, "--size", "1200m", "--launches", "1"]);
        let l = v.iter().find(|x| x["step"] == "launched").unwrap();
        assert_eq!(
            (&l["result"], &l["pool"]),
            (&Value::from("CUDA_ERROR_OUT_OF_MEMORY"), &Value::from(0)),
            "{how}: {l}"
        );
    }
    assert_eq!(used(&s, 0), 0);
}

#[test]
fn visible_devices_remap_ordinals() {
    let s = Sim::new(Some(SMALL));
    let uuid1 = s.status()["gpus"][1]["uuid"].as_str().unwrap().to_owned();
    let one = |v: &str| {
        let o = s.cmd(RT).env("CUDA_VISIBLE_DEVICES", v).arg("info").output().unwrap();
        (o.status.success(), lines(&o.stdout))
    };
    let (ok, v) = one("1");
    assert!(ok);
    assert_eq!(v[0]["devices"].as_array().unwrap().len(), 1);
    assert_eq!(v[0]["devices"][0]["name"], "NVIDIA L4");
    let (_, v) = one(&uuid1[..12]);
    assert_eq!(v[0]["devices"][0]["uuid"], uuid1.as_str());
    let (_, v) = one("1,0");
    assert_eq!(v[0]["devices"][1]["name"], "NVIDIA A100-SXM4-40GB");
    let (_, v) = one("0,7,1");
    assert_eq!(v[0]["devices"].as_array().unwrap().len(), 1, "parsing stops at the first invalid entry");
    let (ok, _) = one("");
    assert!(!ok, "no visible device: cuInit fails");
}

#[test]
fn faults_and_bad_configuration_are_reported() {
    let s = Sim::new(Some(SMALL));
    assert!(s.output(SIM, &["fault", "set", "cuMemAlloc_v2", "--code", "2", "--count", "1"]).status.success());
    let v = s.run1(RT, &["alloc", "--size", "1m"]);
    assert_eq!(v["error"], "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(v["allocated"], 0);
    let v = s.run1(RT, &["alloc", "--size", "1m"]);
    assert_eq!(v["error"], Value::Null, "the fault fired once");

    // Another node description on the same state directory is refused with the reason.
    let other = s.state.with_extension("other.toml");
    std::fs::write(&other, "[[gpu]]\nmodel = \"A30\"\n").unwrap();
    let o = s.cmd(RT).env("VGPU_SIM_CONFIG", &other).arg("info").output().unwrap();
    std::fs::remove_file(&other).ok();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("different node description") && e.contains("CUDA_ERROR_NO_DEVICE"), "{e}");

    let bad = s.state.with_extension("bad.toml");
    std::fs::write(&bad, "[[gpu]]\nmodel = \"Z9\"\n").unwrap();
    let o = s.cmd(SIM).env("VGPU_SIM_CONFIG", &bad).arg("status").output().unwrap();
    std::fs::remove_file(&bad).ok();
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown model \"Z9\""));
}

/// A preloaded library that defines `cuMemAlloc_v2` captures applications linked against libcuda,
/// but not entry points obtained through `dlsym` on a private handle or through `cuGetProcAddress`:
/// the driver binds its own symbols to itself (`-Bsymbolic`). This is the situation the interposer's
/// `dlsym` and `cuGetProcAddress` hooks exist for, and proves the simulator behaves like the driver.
#[test]
fn a_preloaded_symbol_captures_only_link_time_bindings() {
    let s = Sim::new(Some(SMALL));
    let src = s.state.join("shim.c");
    let so = s.state.join("libshim.so");
    std::fs::write(
        &src,
        "unsigned int cuMemAlloc_v2(unsigned long long *p, unsigned long n) { (void)p; (void)n; return 12345; }\n",
    )
    .unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = std::process::Command::new(cc).args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&src).status().unwrap();
    assert!(st.success());
    let alloc = |bin: &str| {
        let o = s.cmd(bin).env("LD_PRELOAD", &so).args(["alloc", "--size", "1m"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        lines(&o.stdout)[0]["error"].clone()
    };
    assert_eq!(alloc(DIRECT), "CUresult(12345)", "link-time binding goes to the preloaded symbol");
    assert_eq!(alloc(DLSYM), Value::Null, "dlsym on a private handle reaches the driver itself");
    assert_eq!(alloc(RT), Value::Null, "cuGetProcAddress hands out the driver's own entry point");
}

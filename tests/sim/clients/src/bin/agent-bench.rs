//! The node agent's cost at scale: a simulated node with 16 GPUs, 128 slices (8 per GPU) each with a
//! live process holding memory, the agent monitoring every 100 ms. Measures the agent's resident
//! memory and CPU share over a window, and `vgpuctl status` end to end (process start, connect, RPC,
//! render), against the budgets (30 MiB, 1 % of one core, 50 ms).
//!
//! usage: agent-bench [--quick] [--seconds N] [--gpus N] [--slices N] [--soak SECONDS]
//!
//! `--soak S` replaces the measurement with a soak: S seconds of churn (processes killed and
//! replaced, slices deleted and made again, four changes a second) with the agent's memory, CPU and
//! open files sampled every 30 s, and a check that no slice directory or region slot leaked.
//!
//! The agent's CPU includes what its NVML calls cost, here the simulator's (which checks process
//! liveness on every query, where a driver already knows). To tell the two apart, the same run also
//! measures a process that makes only the agent's NVML calls at the same rate (per GPU and pass:
//! memory, utilisation, processes, process utilisation; plus a thread waiting for XID events), and
//! prints the agent's own share as the difference.
//!
//! Uses `vgpu-node-agent`, `vgpuctl`, `cuda-rt-app`, `libvgpu.so` and the simulated libraries built
//! next to this binary (cargo build --release -p vgpu-node-agent -p vgpu-preload -p vgpu-sim-cuda
//! -p vgpu-sim-nvml -p vgpu-sim-clients).
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect("a number"))
}

use vgpu_sim_clients::bench::need;

/// (utime + stime) in clock ticks, and VmRSS / VmHWM in bytes, of `pid`.
fn usage(pid: u32) -> (u64, u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = |k: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
            * 1024
    };
    (ticks, kb("VmRSS:"), kb("VmHWM:"))
}

/// The NVML calls of the agent's passes and XID watcher, alone, until killed.
fn nvml_loop(lib: &str, interval_ms: u64) -> ! {
    use nvml_wrapper::bitmasks::event::EventTypes;
    let nvml =
        std::sync::Arc::new(nvml_wrapper::Nvml::builder().lib_path(std::ffi::OsStr::new(lib)).init().expect("NVML"));
    let n = nvml.clone();
    std::thread::spawn(move || {
        let mut set = n.create_event_set().unwrap();
        for i in 0..n.device_count().unwrap() {
            set = n.device_by_index(i).unwrap().register_events(EventTypes::CRITICAL_XID_ERROR, set).unwrap();
        }
        loop {
            let _ = set.wait(200);
        }
    });
    let mut seen = vec![0u64; nvml.device_count().unwrap() as usize];
    loop {
        let t = Instant::now();
        for (i, last) in seen.iter_mut().enumerate() {
            let d = nvml.device_by_index(i as u32).unwrap();
            let _ = (d.uuid(), d.memory_info(), d.utilization_rates(), d.running_compute_processes());
            if let Some(t) = d.process_utilization_stats(*last).ok().and_then(|v| v.iter().map(|s| s.timestamp).max()) {
                *last = t;
            }
        }
        std::thread::sleep(Duration::from_millis(interval_ms).saturating_sub(t.elapsed()));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--nvml-loop") {
        nvml_loop(&args[1], 100);
    }
    let quick = args.iter().any(|a| a == "--quick");
    let seconds = arg(&args, "--seconds", if quick { 5 } else { 30 });
    let ngpus = arg(&args, "--gpus", 16) as usize;
    let nslices = arg(&args, "--slices", 128) as usize;
    let dir = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let agent_bin = need(dir.join("vgpu-node-agent"));
    let ctl = need(dir.join("vgpuctl"));
    let app = need(dir.join("cuda-rt-app"));
    let libvgpu = need(dir.join("libvgpu.so"));
    let libs = vgpu_sim_clients::bench::sim_libs(&dir);
    let work = std::env::temp_dir().join(format!("vgpu-agent-bench-{}", std::process::id()));
    std::fs::create_dir_all(work.join("node")).unwrap();
    let mut cfg = String::from("context_overhead_mib = 16\n");
    for _ in 0..ngpus {
        cfg.push_str("[[gpu]]\nmodel = \"H100-80GB\"\n");
    }
    std::fs::write(work.join("node.toml"), cfg).unwrap();
    let socket = work.join("agent.sock");
    let env = |c: &mut Command| {
        c.env("LD_LIBRARY_PATH", &libs)
            .env("VGPU_SIM_STATE", work.join("node"))
            .env("VGPU_SIM_CONFIG", work.join("node.toml"))
            .env("VGPU_SOCKET", &socket)
            .env_remove("CUDA_VISIBLE_DEVICES");
    };
    let mut c = Command::new(&agent_bin);
    env(&mut c);
    c.env("VGPU_AGENT_LIBRARY", &libvgpu)
        .env("VGPU_AGENT_CDI_DIR", work.join("cdi"))
        .env("VGPU_AGENT_KUBELET_DIR", work.join("kubelet"))
        .args(["--state-dir", work.join("state").to_str().unwrap(), "--socket", socket.to_str().unwrap()])
        .args(["--metrics-address", "127.0.0.1:0", "--nvml-library"])
        .arg(libs.join("libnvidia-ml.so.1"))
        .arg("run")
        .stderr(std::fs::File::create(work.join("agent.log")).unwrap());
    let mut agent = c.spawn().unwrap();
    let status = |json: bool| {
        let mut c = Command::new(&ctl);
        env(&mut c);
        c.arg("status");
        if json {
            c.arg("--json");
        }
        let t = Instant::now();
        let o = c.output().unwrap();
        (t.elapsed(), o)
    };
    let t = Instant::now();
    while !status(false).1.status.success() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the agent did not start: see {}",
            work.join("agent.log").display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Slices and their processes.
    let uuids: Vec<String> = {
        let v: serde_json::Value = serde_json::from_slice(&status(true).1.stdout).unwrap();
        v["gpus"].as_array().unwrap().iter().map(|g| g["uuid"].as_str().unwrap().to_string()).collect()
    };
    // A process in slice i as its container would run it, and vgpuctl that must succeed.
    let spawn = |i: usize, size: &str| -> Child {
        let sd = work.join("state/slices").join(format!("s{i:03}"));
        let mut p = Command::new(&app);
        env(&mut p);
        p.env("LD_PRELOAD", &libvgpu)
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", sd.join("region"))
            .env("VGPU_LIMITS_FILE", sd.join("limits"))
            .env("CUDA_VISIBLE_DEVICES", &uuids[i % ngpus])
            .args(["alloc", "--size", size, "--hold"])
            .stdout(Stdio::null());
        p.spawn().unwrap()
    };
    let ctl_ok = |args: &[&str]| {
        let mut c = Command::new(&ctl);
        env(&mut c);
        let o = c.args(args).output().unwrap();
        assert!(o.status.success(), "vgpuctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    let t = Instant::now();
    let mut procs: Vec<Child> = Vec::new();
    for i in 0..nslices {
        let (name, gpu) = (format!("s{i:03}"), (i % ngpus).to_string());
        ctl_ok(&["slice", "create", "--name", &name, "--gpu", &gpu, "--memory", "4GiB", "--sm", "10"]);
        procs.push(spawn(i, "64m"));
    }
    let setup = t.elapsed();
    // Wait until the agent sees every process.
    let t = Instant::now();
    loop {
        let v: serde_json::Value = serde_json::from_slice(&status(true).1.stdout).unwrap_or_default();
        let live = v["slices"]
            .as_array()
            .map_or(0, |s| s.iter().filter(|s| s["gpus"][0]["memory_used"].as_u64().unwrap_or(0) > 0).count());
        if live == nslices {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "only {live} of {nslices} slices show usage");
        std::thread::sleep(Duration::from_millis(100));
    }

    if let Some(i) = args.iter().position(|a| a == "--soak") {
        let secs: u64 = args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(600);
        soak(agent.id(), secs, nslices, &mut procs, &spawn, &ctl_ok, &work, ngpus);
        for mut p in procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
        let _ = agent.wait();
        let _ = std::fs::remove_dir_all(&work);
        return;
    }

    // The window.
    let pid = agent.id();
    let (t0, _, _) = usage(pid);
    let w = Instant::now();
    std::thread::sleep(Duration::from_secs(seconds));
    let (t1, rss, hwm) = usage(pid);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu = (t1 - t0) as f64 / hz / w.elapsed().as_secs_f64() * 100.0;

    // The NVML calls alone, on the same node with the same processes, over the same window.
    let mut base = Command::new(std::env::current_exe().unwrap());
    env(&mut base);
    let mut base = base.arg("--nvml-loop").arg(libs.join("libnvidia-ml.so.1")).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (b0, _, _) = usage(base.id());
    let bw = Instant::now();
    std::thread::sleep(Duration::from_secs(seconds));
    let (b1, _, _) = usage(base.id());
    let nvml_cpu = (b1 - b0) as f64 / hz / bw.elapsed().as_secs_f64() * 100.0;
    let _ = base.kill();
    let _ = base.wait();

    let mut lat: Vec<Duration> = (0..if quick { 10 } else { 30 }).map(|_| status(false).0).collect();
    let mut lat_json: Vec<Duration> = (0..if quick { 10 } else { 30 }).map(|_| status(true).0).collect();
    lat.sort();
    lat_json.sort();
    let v: serde_json::Value = serde_json::from_slice(&status(true).1.stdout).unwrap();
    let loop_us = v["agent"]["loop_us"].as_u64().unwrap_or(0);
    let passes = v["agent"]["passes"].as_u64().unwrap_or(0);

    println!("agent-bench: {ngpus} GPUs, {nslices} slices, {nslices} live processes, monitor every 100 ms, {seconds} s window");
    println!("  setup: {nslices} x (vgpuctl slice create + process start) in {:.2} s", setup.as_secs_f64());
    let ok = |b: bool| if b { "within budget" } else { "OVER BUDGET" };
    println!(
        "  agent resident memory: {:.1} MiB (peak {:.1} MiB)  budget 30 MiB: {}",
        rss as f64 / 1048576.0,
        hwm as f64 / 1048576.0,
        ok(hwm < 30 << 20)
    );
    println!("  agent CPU: {cpu:.2} % of one core in all; its NVML calls alone (simulated driver): {nvml_cpu:.2} %");
    println!(
        "  agent's own CPU (difference): {:.2} % of one core  budget 1 %: {}",
        cpu - nvml_cpu,
        ok(cpu - nvml_cpu < 1.0)
    );
    println!("  monitoring pass: {:.2} ms (last of {passes})", loop_us as f64 / 1000.0);
    let med = |v: &[Duration]| v[v.len() / 2].as_secs_f64() * 1000.0;
    let max = |v: &[Duration]| v[v.len() - 1].as_secs_f64() * 1000.0;
    println!(
        "  vgpuctl status (table): median {:.1} ms, max {:.1} ms  budget 50 ms: {}",
        med(&lat),
        max(&lat),
        ok(med(&lat) < 50.0)
    );
    println!("  vgpuctl status --json: median {:.1} ms, max {:.1} ms", med(&lat_json), max(&lat_json));

    for mut p in procs {
        let _ = p.kill();
        let _ = p.wait();
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = agent.wait();
    let _ = std::fs::remove_dir_all(&work);
}

/// Open file descriptors of a process.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The soak: for `secs`, four times a second one slice's process is SIGKILLed and replaced (with
/// another allocation size), and every other time the slice itself is deleted and made again; the
/// agent's memory, CPU and open files are sampled every 30 s. At the end every slice must have
/// exactly its one live process accounted, and the state directory exactly the slices.
#[allow(clippy::too_many_arguments)]
fn soak(
    pid: u32,
    secs: u64,
    nslices: usize,
    procs: &mut [Child],
    spawn: &dyn Fn(usize, &str) -> Child,
    ctl_ok: &dyn Fn(&[&str]),
    work: &std::path::Path,
    ngpus: usize,
) {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let start = Instant::now();
    let (mut last_ticks, rss0, _) = usage(pid);
    let fd0 = fds(pid);
    let mut last = Instant::now();
    let mut samples = Vec::new();
    let mut churn = 0u64;
    println!("soak: {nslices} slices on {ngpus} GPUs, one process each, churn 4/s, {secs} s");
    println!("  {:>6}  {:>9}  {:>8}  {:>5}  {:>8}", "t (s)", "RSS (MiB)", "CPU (%)", "fds", "churned");
    println!("  {:>6}  {:>9.1}  {:>8}  {:>5}  {:>8}", 0, rss0 as f64 / 1048576.0, "-", fd0, 0);
    while start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(250));
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % nslices as u64) as usize;
        let _ = procs[i].kill();
        let _ = procs[i].wait();
        if churn % 2 == 1 {
            let name = format!("s{i:03}");
            ctl_ok(&["slice", "delete", &name, "--force"]);
            let gpu = (i % ngpus).to_string();
            ctl_ok(&["slice", "create", "--name", &name, "--gpu", &gpu, "--memory", "4GiB", "--sm", "10"]);
        }
        procs[i] = spawn(i, &format!("{}m", 16 + (x >> 20) % 64));
        churn += 1;
        if last.elapsed() >= Duration::from_secs(30) {
            let (ticks, rss, _) = usage(pid);
            let cpu = (ticks - last_ticks) as f64 / hz / last.elapsed().as_secs_f64() * 100.0;
            last_ticks = ticks;
            last = Instant::now();
            let f = fds(pid);
            println!(
                "  {:>6.0}  {:>9.1}  {:>8.2}  {:>5}  {:>8}",
                start.elapsed().as_secs_f64(),
                rss as f64 / 1048576.0,
                cpu,
                f,
                churn
            );
            samples.push((rss, cpu, f));
        }
    }
    // Let the agent see the last changes, then check what is on disk and in the regions.
    std::thread::sleep(Duration::from_secs(2));
    let dirs = std::fs::read_dir(work.join("state/slices")).unwrap().count();
    let mut extra_slots = 0;
    for i in 0..nslices {
        let r = vgpu_region::Region::open(&work.join("state/slices").join(format!("s{i:03}/region")), true).unwrap();
        r.reap();
        extra_slots += r.slots().len().saturating_sub(1);
    }
    let (first, lastv) = (samples.first().copied(), samples.last().copied());
    println!("  {churn} processes killed and replaced, {} slices deleted and made again", churn / 2);
    println!(
        "  slice directories: {dirs} (expected {nslices}); slots held by dead processes after reaping: {extra_slots}"
    );
    if let (Some(a), Some(b)) = (first, lastv) {
        let cpus: Vec<f64> = samples.iter().map(|s| s.1).collect();
        println!(
            "  RSS {:.1} -> {:.1} MiB over the run ({:+.1} MiB from the first sample); CPU {:.2}-{:.2} %; open files {} -> {}",
            a.0 as f64 / 1048576.0,
            b.0 as f64 / 1048576.0,
            (b.0 as f64 - a.0 as f64) / 1048576.0,
            cpus.iter().cloned().fold(f64::MAX, f64::min),
            cpus.iter().cloned().fold(0.0, f64::max),
            a.2,
            b.2
        );
    }
    assert_eq!(dirs, nslices, "leaked or lost slice directories");
    assert_eq!(extra_slots, 0, "slots of dead processes left");
}

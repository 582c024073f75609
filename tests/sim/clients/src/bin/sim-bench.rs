//! Call costs of the simulated driver, and the interposer's overhead measured against it in the same
//! run.
//!
//! usage: sim-bench [--quick] [--json]            the simulator alone
//!        sim-bench --interposer PATH [--quick]   bare vs LD_PRELOAD=PATH, side by side, plus process
//!                                                start and 100 processes starting at once
//!
//! Loads `libcuda.so.1` from LD_LIBRARY_PATH, or the simulator built next to this binary, and runs on
//! a private simulated node unless VGPU_SIM_STATE is set.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().unwrap().to_path_buf();
    if std::env::var_os("VGPU_CLIENT_LIBCUDA").is_none() && std::env::var_os("LD_LIBRARY_PATH").is_none() {
        if let Some(lib) = Some(dir.join("libcuda.so")).filter(|l| l.exists()) {
            std::env::set_var("VGPU_CLIENT_LIBCUDA", lib);
        }
    }
    let private = std::env::var_os("VGPU_SIM_STATE").is_none().then(|| {
        let d = std::env::temp_dir().join(format!("vgpu-sim-bench-{}", std::process::id()));
        std::env::set_var("VGPU_SIM_STATE", &d);
        let cfg = d.with_extension("toml");
        std::fs::write(&cfg, "context_overhead_mib = 1\n[[gpu]]\nmodel = \"H100-80GB\"\n").unwrap();
        std::env::set_var("VGPU_SIM_CONFIG", &cfg);
        d
    });
    if let Some(i) = args.iter().position(|a| a == "--interposer") {
        let lib = PathBuf::from(args.get(i + 1).expect("--interposer needs a path"));
        compare(&exe, &dir, &lib, quick);
    } else {
        own(quick, args.iter().any(|a| a == "--json"));
    }
    if let Some(d) = private {
        let _ = std::fs::remove_dir_all(&d);
        let _ = std::fs::remove_file(d.with_extension("toml"));
    }
}

fn own(quick: bool, as_json: bool) {
    let api = vgpu_sim_clients::bind_dlsym().unwrap_or_else(|e| {
        eprintln!("sim-bench: {e}");
        std::process::exit(3)
    });
    let f = vgpu_sim_clients::bench::measure(&api, if quick { 10 } else { 1 });
    if as_json {
        println!(
            "{}",
            serde_json::json!({"launch_ns": f.launch_ns, "alloc_free_ns": f.alloc_free_ns,
                "alloc_free_30k_live_ns": f.alloc_free_30k_ns, "get_info_ns": f.get_info_ns,
                "graph_launch_ns": f.graph_launch_ns, "graph_mem_launch_ns": f.graph_mem_launch_ns,
                "async_pair_ns": f.async_pair_ns, "deep_launch_ns": f.deep_launch_ns})
        );
        return;
    }
    println!("| call | median ns |\n|---|---|");
    println!("| cuLaunchKernel (sleep_0ns, stream) | {:.0} |", f.launch_ns);
    println!("| cuLaunchKernel (sleep_1us, up to 20 000 queued) | {:.0} |", f.deep_launch_ns);
    println!("| cuMemAlloc_v2 + cuMemFree_v2 (4 KiB) | {:.0} |", f.alloc_free_ns);
    println!(
        "| cuMemAlloc_v2 + cuMemFree_v2 with {} live | {:.0} |",
        if quick { 3000 } else { 30_000 },
        f.alloc_free_30k_ns
    );
    println!("| cuMemGetInfo_v2 | {:.0} |", f.get_info_ns);
    println!("| cuMemAllocAsync + cuMemFreeAsync (4 KiB) | {:.0} |", f.async_pair_ns);
    println!("| cuGraphLaunch (one kernel node) | {:.0} |", f.graph_launch_ns);
    println!("| cuGraphLaunch (4 KiB allocated and freed in graph memory nodes) | {:.0} |", f.graph_mem_launch_ns);
}

/// Processes started at once in the burst measurement.
const BURST: usize = 100;

/// `BURST` copies of `program` with `args` and this process's environment plus `env`, started at
/// once: the time from their release until the last one's first allocation (the moment each stamps
/// on its line `ok <ns>`), in ms. They are forked first and held at a gate (a pipe they read until
/// it closes) before their exec: spawned one by one, as `Command` does, their starts spread over the
/// time the spawning took (0.5 ms each here), which hid most of what a start costs when a hundred
/// race for the machine.
fn burst_of(program: &Path, args: &[&str], env: &[(std::ffi::OsString, std::ffi::OsString)]) -> f64 {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |b: &[u8]| CString::new(b).expect("no NUL");
    let mut vars: Vec<(std::ffi::OsString, std::ffi::OsString)> =
        std::env::vars_os().filter(|(k, _)| !env.iter().any(|(e, _)| e == k)).collect();
    vars.extend(env.iter().cloned());
    let envp: Vec<CString> = vars.iter().map(|(k, v)| c(&[k.as_bytes(), b"=", v.as_bytes()].concat())).collect();
    let path = c(program.as_os_str().as_bytes());
    let argv: Vec<CString> = std::iter::once(path.clone()).chain(args.iter().map(|a| c(a.as_bytes()))).collect();
    let mut envp_p: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_p.push(std::ptr::null());
    let mut argv_p: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let pipe = || {
        let mut fds = [0; 2];
        // SAFETY: fds is a valid array of two descriptors for pipe2 to fill.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe2");
        fds
    };
    let gate = pipe();
    let mut kids = Vec::new();
    for _ in 0..BURST {
        let out = pipe();
        // SAFETY: the child calls only async-signal-safe functions (dup2, close, read, execve,
        // _exit) on memory prepared before the fork, as a child of a process with threads must.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: as above; argv_p and envp_p are NULL-terminated arrays of C strings.
            unsafe {
                libc::dup2(out[1], 1);
                libc::close(gate[1]);
                let mut b = 0u8;
                while libc::read(gate[0], (&raw mut b).cast(), 1) != 0 {}
                libc::execve(path.as_ptr(), argv_p.as_ptr(), envp_p.as_ptr());
                libc::_exit(127);
            }
        }
        // SAFETY: out[1] is this process's copy of the child's stdout, no longer needed here;
        // out[0] becomes the File's own descriptor.
        let read = unsafe {
            libc::close(out[1]);
            <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(out[0])
        };
        kids.push((pid, read));
    }
    let t = mono_ns();
    // SAFETY: closing this process's ends of the gate releases the children (they see its end).
    unsafe {
        libc::close(gate[1]);
        libc::close(gate[0]);
    }
    // Each child's line is read in turn: the moments are the children's own, so a reader that gets
    // to a line late changes nothing, and no reader thread competes with the children for a CPU.
    let mut last = t;
    let mut ok = 0;
    let mut pids = Vec::new();
    for (pid, out) in kids {
        use std::io::BufRead;
        use std::os::fd::AsRawFd;
        let mut line = String::new();
        let mut ready = libc::pollfd { fd: out.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; a child that says nothing in 30 s counts as not allocated.
        if unsafe { libc::poll(&mut ready, 1, 30_000) } == 1 {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        if let Some(at) = allocated_at(&line) {
            ok += 1;
            last = last.max(at);
        }
        pids.push(pid);
    }
    for pid in pids {
        let mut st = 0;
        // SAFETY: pid is a child of this process; st is a valid out-pointer.
        unsafe { libc::waitpid(pid, &mut st, 0) };
    }
    assert_eq!(ok, BURST, "every process allocated");
    (last - t) as f64 / 1e6
}

/// CLOCK_MONOTONIC in ns, the clock `cuda-start` stamps its first allocation with.
fn mono_ns() -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer for clock_gettime.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// The moment `cuda-start` (with CUDA_START_STAMP) says its first allocation returned, from its
/// line `ok <ns>`; None for any other line.
fn allocated_at(line: &str) -> Option<i64> {
    line.strip_prefix("ok ")?.trim_end().parse().ok()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Environment of a process "in a container": the interposer with a limit that is never reached.
fn contained(c: &mut Command, lib: &Path, region: &Path) {
    c.env("LD_PRELOAD", lib)
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", region)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "60g")
        .env("VGPU_CONTEXT_OVERHEAD", "1m");
}

fn compare(exe: &Path, dir: &Path, lib: &Path, quick: bool) {
    let region = std::env::temp_dir().join(format!("vgpu-bench-{}.region", std::process::id()));
    // A node of two GPUs, where a stream-ordered allocation on a stream the process made asks the
    // driver for the stream's device.
    let two = std::env::temp_dir().join(format!("vgpu-bench-{}-two-gpus", std::process::id()));
    let two_cfg = two.with_extension("toml");
    std::fs::write(
        &two_cfg,
        "context_overhead_mib = 1\n[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n",
    )
    .unwrap();
    // sim-bench itself, in JSON, quick where this run is.
    let bench = || {
        let mut c = Command::new(exe);
        c.arg("--json");
        if quick {
            c.arg("--quick");
        }
        c
    };
    let output = |mut c: Command| -> serde_json::Value {
        let o = c.output().expect("run sim-bench");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("json")
    };
    // `region`: the interposer preloaded, with that region (None: the bare simulator); `sm`: with
    // an SM limit; `two_gpus`: on the node of two GPUs.
    let run_on = |region: Option<&Path>, sm: bool, two_gpus: bool| -> serde_json::Value {
        let mut c = bench();
        if let Some(r) = region {
            contained(&mut c, lib, r);
        }
        if sm {
            c.env("CUDA_DEVICE_SM_LIMIT", "99");
        }
        if two_gpus {
            c.env("VGPU_SIM_STATE", &two).env("VGPU_SIM_CONFIG", &two_cfg);
        }
        output(c)
    };
    let run = |region: Option<&Path>, sm: bool| run_on(region, sm, false);
    // A region at `path` made as the agent makes a slice's (not standalone: allocations are counted
    // in flight for the agent's true-up, and the process does not true itself up), for the GPU the
    // first contained run recorded.
    let agent_region = |path: &Path| {
        let uuid = vgpu_region::Region::open(&region, false).expect("the contained run's region").device_uuid(0);
        let init = || vgpu_region::Init { devices: vec![(uuid, 60 << 30, 0)], standalone: false };
        vgpu_region::Region::open_or_create(path, init).expect("an agent-made region")
    };
    // A high-priority slice as the agent makes it: a limits file flagged high beside its activity
    // file; its launches note their time for the gate (docs/priority.md).
    let prio = region.with_extension("prio");
    let high_run = || -> serde_json::Value {
        if !prio.join("limits").exists() {
            std::fs::create_dir_all(&prio).unwrap();
            agent_region(&prio.join("limits")).set_priority_high(true).unwrap();
            vgpu_region::activity::create(&prio.join("activity")).unwrap();
        }
        let mut c = bench();
        contained(&mut c, lib, &prio.join("region"));
        c.env("VGPU_LIMITS_FILE", prio.join("limits"));
        output(c)
    };
    let agents = region.with_extension("agent");
    let agent_made = || -> &Path {
        if !agents.exists() {
            agent_region(&agents);
        }
        &agents
    };
    let rounds = if quick { 3 } else { 5 };
    let (mut bare, mut with, mut limited, mut watched) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut high = Vec::new();
    let (mut bare_two, mut with_two, mut limited_two) = (Vec::new(), Vec::new(), Vec::new());
    let sm_region = region.with_extension("sm");
    let two_region = region.with_extension("two");
    let two_sm_region = region.with_extension("two-sm");
    for _ in 0..rounds {
        bare.push(run(None, false));
        with.push(run(Some(&region), false));
        limited.push(run(Some(&sm_region), true));
        watched.push(run(Some(agent_made()), false));
        high.push(high_run());
        bare_two.push(run_on(None, false, true));
        with_two.push(run_on(Some(&two_region), false, true));
        limited_two.push(run_on(Some(&two_sm_region), true, true));
    }
    let _ = (std::fs::remove_file(&agents), std::fs::remove_file(&sm_region), std::fs::remove_file(&two_region));
    let _ = std::fs::remove_file(&two_sm_region);
    let _ = (std::fs::remove_dir_all(&two), std::fs::remove_file(&two_cfg), std::fs::remove_dir_all(&prio));
    let m = |v: &[serde_json::Value], k: &str| median(v.iter().map(|x| x[k].as_f64().unwrap()).collect());
    println!("| measure | bare simulator | with libvgpu.so | added | budget |\n|---|---|---|---|---|");
    let live = if quick {
        "the same pair with 3 000 live allocations (ns)"
    } else {
        "the same pair with 30 000 live allocations (ns)"
    };
    for (k, what, budget) in [
        ("launch_ns", "cuLaunchKernel, no SM limit (ns)", "+10 ns"),
        ("alloc_free_ns", "cuMemAlloc_v2 + cuMemFree_v2 (ns)", "+150 ns"),
        ("alloc_free_30k_live_ns", live, "+150 ns"),
        ("async_pair_ns", "cuMemAllocAsync + cuMemFreeAsync (ns)", "+150 ns"),
        ("graph_launch_ns", "cuGraphLaunch, one kernel node, no SM limit (ns)", "+10 ns"),
        ("graph_mem_launch_ns", "cuGraphLaunch of a graph with memory nodes (ns)", "-"),
    ] {
        let (b, w) = (m(&bare, k), m(&with, k));
        println!("| {what} | {b:.0} | {w:.0} | {:+.0} | {budget} |", w - b);
    }
    // The rows measured against another set of runs than `with`: (bare runs, runs, key, row, budget).
    for (b, w, k, what, budget) in [
        (&bare, &watched, "alloc_free_ns", "cuMemAlloc_v2 + cuMemFree_v2, in a region the agent made (ns)", "+150 ns"),
        (
            &bare,
            &watched,
            "async_pair_ns",
            "cuMemAllocAsync + cuMemFreeAsync, in a region the agent made (ns)",
            "+150 ns",
        ),
        (
            &bare_two,
            &with_two,
            "launch_ns",
            "cuLaunchKernel, no SM limit, a process that sees two GPUs (the device asked; ns)",
            "+10 ns",
        ),
        (
            &bare_two,
            &with_two,
            "async_pair_ns",
            "cuMemAllocAsync + cuMemFreeAsync, a process that sees two GPUs (the stream asked for its device; ns)",
            "+150 ns",
        ),
        (&bare, &limited, "launch_ns", "cuLaunchKernel with an SM limit (99 %), budget available (ns)", "+30 ns"),
        (&bare, &high, "launch_ns", "cuLaunchKernel of a high-priority slice, no SM limit (ns)", "+30 ns"),
        (
            &bare_two,
            &limited_two,
            "launch_ns",
            "the same, a process that sees two GPUs (the stream asked for its device; ns)",
            "+30 ns",
        ),
        (
            &bare,
            &limited,
            "deep_launch_ns",
            "the same, a 1 us kernel with up to 20 000 queued (measurements in flight; ns)",
            "-",
        ),
        (&bare, &with, "get_info_ns", "cuMemGetInfo_v2 with a limit (ns, answered by libvgpu)", "100 ns in total"),
    ] {
        let (b, w) = (m(b, k), m(w, k));
        println!("| {what} | {b:.0} | {w:.0} | {:+.0} | {budget} |", w - b);
    }

    // Near the limit: another process of the container holds 59 of its 60 GiB, so every allocation
    // is within the true-up's margin (1 GiB) and measures NVML at most every 100 ms.
    let mut hog = Command::new(dir.join("cuda-rt-app"));
    hog.args(["alloc", "--size", "59g", "--hold"]).stdout(Stdio::piped());
    contained(&mut hog, lib, &region);
    let mut hog = hog.spawn().expect("spawn the holder");
    {
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(hog.stdout.take().unwrap()).read_line(&mut line);
        assert!(line.contains("\"error\":null"), "the holder: {line}");
    }
    let near = |true_up: bool| -> serde_json::Value {
        let mut c = Command::new(exe);
        c.arg("--json");
        if quick {
            c.arg("--quick");
        }
        contained(&mut c, lib, &region);
        c.env("VGPU_MEMORY_TRUE_UP", if true_up { "1" } else { "0" });
        let o = c.output().expect("run sim-bench");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("json")
    };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        off.push(near(false));
        on.push(near(true));
    }
    let _ = hog.kill();
    let _ = hog.wait();
    let live_near = if quick { "with 3 000 live" } else { "with 30 000 live" };
    for (k, what) in [("alloc_free_ns", "the pair"), ("alloc_free_30k_live_ns", live_near)] {
        let (b, f, n) = (m(&bare, k), m(&off, k), m(&on, k));
        println!(
            "| {what}, the container within 1 GiB of its limit: true-up off / on (ns) | {b:.0} | {f:.0} / {n:.0} | {:+.0} / {:+.0} | +150 ns |",
            f - b,
            n - b
        );
    }

    // Process start: from spawn to the first allocation of `cuda-start`, a C client that does
    // nothing else, by the moment the client stamps on its allocation's return (its exit is not
    // timed: an exit waits for whatever the process still loads).
    // The interposer finds the simulated NVML as it finds the driver's on a node, so its true-up
    // measures the first context (VGPU_MEMORY_TRUE_UP=0: without).
    let start_app = Path::new(env!("VGPU_CUDA_START"));
    let nvml = dir.join("libnvidia_ml.so");
    let client = |pre: bool, true_up: bool, hold: Option<&str>| -> Command {
        let mut c = Command::new(start_app);
        c.args(hold).stdout(Stdio::piped()).env("CUDA_START_STAMP", "1");
        if pre {
            contained(&mut c, lib, &region);
            c.env("VGPU_REAL_LIBNVML", &nvml).env("VGPU_MEMORY_TRUE_UP", if true_up { "1" } else { "0" });
        }
        c
    };
    let first_line = |c: &mut std::process::Child| -> Option<i64> {
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(c.stdout.take().unwrap()).read_line(&mut line);
        allocated_at(&line)
    };
    let start = |pre: bool, true_up: bool| -> f64 {
        let t = mono_ns();
        let mut c = client(pre, true_up, None).spawn().expect("run cuda-start");
        let at = first_line(&mut c).expect("cuda-start allocated");
        assert!(c.wait().expect("cuda-start").success());
        (at - t) as f64 / 1e6
    };
    // A start's figure moves by a tenth of a millisecond from one to the next: enough of them for
    // a median that holds to a few hundredths (a start takes 2 ms).
    let n = if quick { 100 } else { 300 };
    let (mut b, mut w, mut f) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        b.push(start(false, false));
        w.push(start(true, true));
        f.push(start(true, false));
    }
    let (b, w, f) = (median(b), median(w), median(f));
    println!(
        "| process start to first allocation (ms; true-up off) | {b:.2} | {w:.2} ({f:.2}) | {:+.2} ({:+.2}) | +0.3 ms |",
        w - b,
        f - b
    );

    // 100 processes at once: the time until the last one has its first allocation.
    let burst = |pre: bool| -> f64 {
        let c = client(pre, true, Some("3"));
        let env: Vec<_> = c.get_envs().filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned()))).collect();
        burst_of(start_app, &["3"], &env)
    };
    // The median of five bursts each, in turn (one burst's figure moves by tens of ms).
    let (mut bs, mut ws) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        bs.push(burst(false));
        ws.push(burst(true));
    }
    let (b, w) = (median(bs), median(ws));
    println!(
        "| {BURST} processes started at once: last first allocation (ms) | {b:.0} | {w:.0} | {:+.0} (x{:.2}) | x1.5 |",
        w - b,
        w / b
    );
    let _ = std::fs::remove_file(&region);
}

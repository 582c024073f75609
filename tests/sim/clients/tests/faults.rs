//! Fault injection with real signals: processes SIGKILLed at random points while they allocate and
//! free, and the agent SIGKILLed at random points while slices are created, changed and deleted.
//! Afterwards the accounting must be exact again, nothing may be stuck, and the agent must come back
//! consistent. `VGPU_FAULT_ITERATIONS` sets the number of kills (CI runs the default; the long run
//! uses 1000: `VGPU_FAULT_ITERATIONS=1000 cargo test -p vgpu-sim-clients --test faults`).

mod common;
use common::agent::{bin, Agent};
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vgpu_region::Region;

const MIB: u64 = 1 << 20;

fn iterations(default: usize) -> usize {
    std::env::var("VGPU_FAULT_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A small xorshift for the kill points (seeded from the clock; printed, so a failure can be rerun).
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        let seed = std::env::var("VGPU_FAULT_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
        });
        eprintln!("fault injection seed: VGPU_FAULT_SEED={seed}");
        Rng(seed)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Waits for a child, killing it (and failing) past `limit`: a hang is a failure, not a stuck test.
fn wait_bounded(mut c: Child, limit: Duration, what: &str) -> std::process::Output {
    let t = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return c.wait_with_output().unwrap();
        }
        if t.elapsed() > limit {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            panic!("{what} did not finish within {limit:?} (a deadlock?): {}", String::from_utf8_lossy(&o.stderr));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn processes_killed_while_allocating_and_freeing_leave_exact_accounting() {
    let s = Sim::new(Some("context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let limit = [("CUDA_DEVICE_MEMORY_LIMIT", "2g")];
    let mut rng = Rng::new();
    let n = iterations(40);
    for i in 0..n {
        // Four threads allocating and freeing 1-16 MiB as fast as they can, killed somewhere in
        // start-up, context creation, or the middle of an allocation or a free.
        let size = format!("{}m", 1 + rng.below(16));
        let mut c = s.limited(RT, &limit);
        c.args(["threads", "--threads", "4", "--iters", "1000000", "--size", &size])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = c.spawn().unwrap();
        std::thread::sleep(Duration::from_micros(500 + rng.below(30_000)));
        child.kill().unwrap();
        child.wait().unwrap();
        // A sibling can still use the whole quota at once: the dead process's share came back (the
        // interposer reclaims at its first refusal), and nothing is left locked.
        let mut c = s.limited(RT, &limit);
        c.args(["alloc", "--size", "1920m", "--chunk", "1920m"]).stdout(Stdio::piped()).stderr(Stdio::piped());
        let o = wait_bounded(c.spawn().unwrap(), Duration::from_secs(20), "the next process");
        let v = lines(&o.stdout).into_iter().find(|v| v["event"] == "allocated").unwrap_or_default();
        assert_eq!(
            v["allocated"].as_u64(),
            Some(1920 * MIB),
            "iteration {i} (size {size}): the whole quota less one context is allocatable: {v}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // Every process is gone: the region and the simulated driver both account nothing.
    let r = Region::open(&s.region_path(), true).unwrap();
    r.reap();
    assert_eq!(r.used(0), 0, "the region after {n} kills");
    assert!(r.slots().is_empty());
    let t = Instant::now();
    while s.status()["gpus"][0]["memory_used"].as_u64() != Some(0) {
        assert!(t.elapsed() < Duration::from_secs(5), "the driver still holds memory: {}", s.status());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_agent_killed_during_slice_changes_comes_back_consistent() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let mut a = Agent::start(&s, &[]);
    let mut rng = Rng::new();
    let names = ["s0", "s1", "s2", "s3"];
    for i in 0..iterations(8).min(100) {
        // vgpuctl changing slices in a loop, as fast as the agent answers.
        let socket = a.socket.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let st = stop.clone();
        let churn = std::thread::spawn(move || {
            let mut k = 0u64;
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let name = names[(k % 4) as usize];
                let mem = format!("{}GiB", 1 + k % 7);
                let args: Vec<&str> = match k % 3 {
                    0 => vec!["slice", "create", "--name", name, "--gpu", "0", "--memory", &mem, "--sm", "20"],
                    1 => vec!["slice", "update", name, "--gpu", "0", "--memory", &mem, "--sm", "30"],
                    _ => vec!["slice", "delete", name],
                };
                let _ = Command::new(bin("vgpuctl")).env("VGPU_SOCKET", &socket).args(&args).output();
                k += 1;
            }
        });
        std::thread::sleep(Duration::from_millis(20 + rng.below(200)));
        a.sigkill();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
        a.spawn(&s);
        // After the restart: every directory is a slice, and every slice's files agree with its record.
        let listed = a.ctl_ok(&["--json", "slice", "list"]);
        let listed: Vec<serde_json::Value> = serde_json::from_str(&listed).unwrap();
        let root = a.state.join("slices");
        for e in std::fs::read_dir(&root).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let rec = listed.iter().find(|d| d["name"] == name.as_str());
            assert!(rec.is_some(), "iteration {i}: {name} is a directory but not a slice\n{}", a.log_text());
            let rec = rec.unwrap();
            for f in ["limits", "region"] {
                let r = Region::open(&e.path().join(f), false)
                    .unwrap_or_else(|err| panic!("iteration {i}: {name}/{f}: {err}\n{}", a.log_text()));
                assert_eq!(r.mem_limit(0), rec["gpus"][0]["memory"].as_u64().unwrap(), "iteration {i}: {name}/{f}");
                assert_eq!(r.sm_limit(0) as u64, rec["gpus"][0]["sm"].as_u64().unwrap(), "iteration {i}: {name}/{f}");
            }
        }
        // Every name can be made again (nothing half-made blocks it).
        for n in names {
            let _ = a.ctl(&["slice", "delete", n]);
            a.ctl_ok(&["slice", "create", "--name", n, "--gpu", "0", "--memory", "1GiB"]);
            a.ctl_ok(&["slice", "delete", n]);
        }
    }
}

/// Sets a process's file-size limit (bytes; `None`: unlimited): writes past it fail with EFBIG, the
/// way they fail with ENOSPC on a full disk.
fn file_size_limit(pid: u32, bytes: Option<u64>) {
    let v = bytes.unwrap_or(libc::RLIM_INFINITY);
    let lim = libc::rlimit { rlim_cur: v, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: a valid rlimit for our own child; the old value is not asked for.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_FSIZE, &lim, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
}

#[test]
fn a_full_state_directory_fails_slice_changes_cleanly() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "before", "--gpu", "0", "--memory", "2GiB", "--sm", "20"]);
    let pid = a.pid();
    // Too little room for a region: the create fails, says why, and leaves nothing behind.
    file_size_limit(pid, Some(64 << 10));
    let o = a.ctl(&["slice", "create", "--name", "full", "--gpu", "0", "--memory", "1GiB"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("File too large") || err.contains("space"), "{err}");
    assert!(!a.state.join("slices/full").exists(), "a failed create leaves no directory");
    // No room even for a record: an update fails before anything changes.
    file_size_limit(pid, Some(0));
    let o = a.ctl(&["slice", "update", "before", "--gpu", "0", "--memory", "3GiB", "--sm", "20"]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    let r = Region::open(&a.state.join("slices/before/limits"), false).unwrap();
    assert_eq!(r.mem_limit(0), 2 << 30, "the limits did not change without their record");
    // The agent kept serving, and works again once there is room.
    assert!(a.status().is_some(), "{}", a.log_text());
    file_size_limit(pid, None);
    a.ctl_ok(&["slice", "create", "--name", "full", "--gpu", "0", "--memory", "1GiB"]);
    a.ctl_ok(&["slice", "update", "before", "--gpu", "0", "--memory", "3GiB", "--sm", "20"]);
    assert_eq!(Region::open(&a.state.join("slices/before/limits"), false).unwrap().mem_limit(0), 3 << 30);
}

/// A small tmpfs mounted at a path for the length of a test (root only), unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    /// None (the test skips) without root or mount(8), except where CI requires it
    /// (VGPU_REQUIRE_RUNC, set by .ci/run, which runs as root).
    fn mount(at: &std::path::Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(at).unwrap();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let ok = root
            && Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "vgpu-test-full"])
                .arg(at)
                .status()
                .is_ok_and(|s| s.success());
        if !ok {
            assert!(std::env::var_os("VGPU_REQUIRE_RUNC").is_none(), "cannot mount a tmpfs (root: {root})");
            skipped("needs root to mount a tmpfs");
            return None;
        }
        Some(Tmpfs(at.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_really_full_file_system_fails_slice_changes_cleanly_and_running_slices_keep_working() {
    let s = Sim::new(Some("context_overhead_mib = 64\n[[gpu]]\nmodel = \"H100-80GB\"\n"));
    // The agent's state directory on a file system of its own: room for its copy of libvgpu.so and
    // 4 MiB more.
    let room = std::fs::metadata(libvgpu()).unwrap().len() / 1024 + 4096;
    let Some(_fs) = Tmpfs::mount(&s.state.join("agent"), &format!("{room}k")) else { return };
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "before", "--gpu", "0", "--memory", "2GiB", "--sm", "20"]);
    // Fill it.
    let filler = a.state.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    let chunk = vec![0u8; 64 << 10];
    let err = loop {
        if let Err(e) = std::io::Write::write_all(&mut f, &chunk) {
            break e;
        }
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    let _ = std::io::Write::flush(&mut f);
    // A process starting in the existing slice claims a slot and accounts its memory in the mapped
    // region: its blocks were reserved when the slice was made, so no write faults (SIGBUS).
    let dir = a.state.join("slices/before");
    let o = s.in_slice(RT, &dir, "64m").args(["alloc", "--size", "3g", "--chunk", "100m"]).output().unwrap();
    assert!(o.status.success(), "{:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    assert_eq!(lines(&o.stdout)[0]["allocated"], 1900 * MIB, "the slice's 2 GiB, on a full disk");
    // A new slice: refused with the file system's own error, nothing left behind.
    let o = a.ctl(&["slice", "create", "--name", "full", "--gpu", "0", "--memory", "1GiB"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!a.state.join("slices/full").exists(), "a failed create leaves no directory");
    // A change: refused, the limits unchanged.
    let o = a.ctl(&["slice", "update", "before", "--gpu", "0", "--memory", "3GiB", "--sm", "20"]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(Region::open(&dir.join("limits"), false).unwrap().mem_limit(0), 2 << 30);
    // The agent kept serving; with room again, both work.
    assert!(a.status().is_some(), "{}", a.log_text());
    drop(f);
    std::fs::remove_file(&filler).unwrap();
    a.ctl_ok(&["slice", "create", "--name", "full", "--gpu", "0", "--memory", "1GiB"]);
    a.ctl_ok(&["slice", "update", "before", "--gpu", "0", "--memory", "3GiB", "--sm", "20"]);
    assert_eq!(Region::open(&dir.join("limits"), false).unwrap().mem_limit(0), 3 << 30);
    drop(a);
}

#[test]
fn the_agent_survives_nvml_failing_and_slow() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"L4\"\n"));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "j", "--gpu", "0", "--memory", "2GiB"]);
    let fault = |args: &[&str]| assert!(s.output(SIM, args).status.success());
    // NVML fails for GPU 0: it is unhealthy, with the reason; GPU 1 and the API are unaffected.
    fault(&["fault", "set", "nvmlDeviceGetMemoryInfo_v2", "--gpu", "0", "--code", "15"]);
    let st = a.wait("GPU 0 unhealthy", |v| v["gpus"][0]["healthy"] == false);
    assert!(st["gpus"][0]["health_reason"].as_str().unwrap().contains("NVML"), "{st}");
    assert_eq!(st["gpus"][1]["healthy"], true);
    let cap: serde_json::Value = serde_json::from_str(&a.ctl_ok(&["capacity", "--json"])).unwrap();
    assert_eq!(cap["capacity"]["gpus"][0]["memory_allocatable"], 0, "nothing to offer on a failing GPU");
    a.ctl_ok(&["slice", "create", "--name", "k", "--gpu", "1", "--memory", "1GiB"]);
    fault(&["fault", "clear"]);
    a.wait("GPU 0 healthy again once NVML answers", |v| v["gpus"][0]["healthy"] == true);
    // NVML answers slowly (every process query takes 3 s): passes slow down, the API does not wait
    // for them.
    fault(&["fault", "set", "nvmlDeviceGetComputeRunningProcesses_v3", "--code", "0", "--latency-us", "3000000"]);
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let out = a.ctl_ok(&["slice", "create", "--name", "during-slow-nvml", "--gpu", "1", "--sm", "20"]);
    assert!(out.contains("during-slow-nvml"));
    assert!(a.status().is_some());
    assert!(t.elapsed() < Duration::from_secs(3), "the API waited for a slow pass: {:?}", t.elapsed());
    fault(&["fault", "clear"]);
}

/// The systemd notifications the agent sends, as systemd reads them: one datagram per call,
/// newline-separated assignments.
struct Notifications(std::os::unix::net::UnixDatagram);

impl Notifications {
    /// Every datagram that arrives within `d`.
    fn during(&self, d: Duration) -> Vec<String> {
        let t = Instant::now();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while t.elapsed() < d {
            self.0.set_read_timeout(Some((d - t.elapsed()).max(Duration::from_millis(1)))).unwrap();
            if let Ok(n) = self.0.recv(&mut buf) {
                out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        out
    }
}

/// An NVML call that does not return for seconds stalls the monitoring: `/livez` fails and says
/// why, the gRPC health is not live (`vgpuctl doctor`), `vgpuctl status` and the metrics carry a
/// warning, the age of the last pass grows, and the systemd watchdog is no longer pinged; once NVML
/// answers, all is well again. And systemd's protocol as such: READY=1 after the first pass,
/// WATCHDOG=1 every third of WATCHDOG_USEC, STATUS= lines, STOPPING=1 at SIGTERM.
#[test]
fn a_stalled_monitoring_fails_liveness_and_starves_the_watchdog() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let cfg = s.state.join("agent.toml");
    std::fs::write(&cfg, "stall_after_s = 1\n").unwrap();
    let path = s.state.join("notify.sock");
    let n = Notifications(std::os::unix::net::UnixDatagram::bind(&path).unwrap());
    let mut a = Agent::start(
        &s,
        &[
            ("VGPU_AGENT_CONFIG", cfg.to_str().unwrap()),
            ("NOTIFY_SOCKET", path.to_str().unwrap()),
            ("WATCHDOG_USEC", "600000"),
        ],
    );
    let got = n.during(Duration::from_millis(1500));
    let all = got.join("\n");
    assert!(all.contains("READY=1") && all.contains("STATUS=1 GPUs, 0 slices"), "{got:?}");
    let pings = |m: &[String]| m.iter().filter(|m| m.lines().any(|l| l == "WATCHDOG=1")).count();
    assert!(pings(&got) >= 4, "a ping every 200 ms: {got:?}");
    assert_eq!(a.scrape("/livez"), ("HTTP/1.1 200 OK".to_string(), "ok\n".to_string()));

    // Every process query takes 8 s: no pass completes for longer than a second (and what follows
    // is done well before the first such call returns and a pass completes).
    let fault = |args: &[&str]| assert!(s.output(SIM, args).status.success());
    fault(&["fault", "set", "nvmlDeviceGetComputeRunningProcesses_v3", "--code", "0", "--latency-us", "8000000"]);
    let t = Instant::now();
    let stalled = loop {
        let (code, body) = a.scrape("/livez");
        if code.contains("503") {
            break body;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "/livez still {code}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(stalled.starts_with("monitoring stalled: no pass completed for "), "{stalled}");
    // (What was sent before the stall was seen, up to a tick after, is still queued.)
    let before = n.during(Duration::from_millis(300));
    let got = n.during(Duration::from_millis(700));
    assert_eq!(pings(&got), 0, "no watchdog ping while stalled: {got:?}");
    assert!([before, got].concat().join("\n").contains("STATUS=monitoring stalled"));
    let table = a.ctl_ok(&["status"]);
    assert!(table.contains("monitoring stalled: no pass completed for"), "{table}");
    // The chart's liveness probe, over the agent's socket: not live, with the reason.
    let live = a.ctl(&["live"]);
    assert_eq!(live.status.code(), Some(1), "{live:?}");
    assert!(String::from_utf8_lossy(&live.stderr).contains("not live: monitoring stalled"), "{live:?}");
    let doctor = a.ctl(&["--config", cfg.to_str().unwrap(), "doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(text.contains("agent not live: monitoring stalled"), "{text}");
    let (_, metrics) = a.scrape("/metrics");
    let value = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(value("vgpu_agent_last_pass_age_seconds") > 1.0, "{metrics}");
    assert!(value("vgpu_warnings_active") >= 1.0, "{metrics}");

    // NVML answers again: the next pass completes, and with it liveness and the watchdog.
    fault(&["fault", "clear"]);
    let t = Instant::now();
    while a.scrape("/livez").0.contains("503") {
        assert!(t.elapsed() < Duration::from_secs(20), "still stalled after NVML answers again");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(pings(&n.during(Duration::from_millis(700))) >= 2);
    assert!(!a.ctl_ok(&["status"]).contains("monitoring stalled"));
    let st = a.sigterm();
    assert!(st.success(), "{st:?}");
    assert!(n.during(Duration::from_millis(300)).join("\n").contains("STOPPING=1"));
}

#[test]
fn the_agent_killed_during_a_mig_apply_never_leaves_half_a_layout() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let cfg = s.state.join("mig.yaml");
    std::fs::write(
        &cfg,
        "version: v1\nmig-configs:\n  seven:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n  mixed:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 1\n        \"2g.20gb\": 1\n        \"1g.10gb\": 2\n",
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap().to_string();
    let mut a = Agent::start(&s, &[]);
    a.ctl_ok(&["mig", "apply", "-f", &cfg, "--name", "seven"]);
    let mut rng = Rng::new();
    let holds = |a: &Agent, name: &str| a.ctl(&["mig", "assert", "-f", &cfg, "--name", name]).status.success();
    for i in 0..iterations(6).min(50) {
        let target = if i % 2 == 0 { "mixed" } else { "seven" };
        let apply = Command::new(bin("vgpuctl"))
            .env("VGPU_SOCKET", &a.socket)
            .args(["mig", "apply", "-f", &cfg, "--name", target])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        a.sigkill();
        wait_bounded(apply, Duration::from_secs(20), "vgpuctl mig apply");
        a.spawn(&s);
        // Either the apply never started, or the restarted agent finished it from its journal.
        let (new, old) = (holds(&a, target), holds(&a, if target == "mixed" { "seven" } else { "mixed" }));
        assert!(new || old, "iteration {i}: neither layout holds after the restart\n{}", a.log_text());
        if !new {
            a.ctl_ok(&["mig", "apply", "-f", &cfg, "--name", target]);
        }
    }
}

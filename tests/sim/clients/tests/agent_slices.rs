//! Slices made by the agent's slice store, used by real processes with libvgpu.so on the simulated
//! GPU: limits come from the read-only limits file, change live, and a container that rewrites its
//! own (read-write) region cannot raise them.

mod common;
use common::*;

use vgpu_agent::slices::{SliceGpu, SliceStore};
use vgpu_region::Region;

/// The monitoring test changes this process's environment; the tests of this file run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const NODE: &str = "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n";

#[test]
fn agent_slices_limit_processes_and_cannot_be_raised_from_inside() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let s = Sim::new(Some(NODE));
    let uuid = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let store = SliceStore::open(&s.state.join("agent")).unwrap();
    store.create("job1", vec![SliceGpu { uuid: uuid.clone(), memory: 1 << 30, sm: 0 }]).unwrap();
    let dir = store.dir("job1");
    let run = |size: &str| {
        let o = s
            .cmd(RT)
            .env("LD_PRELOAD", libvgpu())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("region"))
            .env("VGPU_LIMITS_FILE", dir.join("limits"))
            .env("VGPU_CONTEXT_OVERHEAD", "64m")
            .args(["alloc", "--size", size, "--chunk", "100m"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        lines(&o.stdout).remove(0)
    };
    assert_eq!(run("2g")["allocated"], 900 * MIB, "1 GiB from the agent's limits file");

    // The container rewrites the limit in its own region: it does not count.
    let region = Region::open(&dir.join("region"), true).unwrap();
    region.set_mem_limit(0, 100 << 30).unwrap();
    assert_eq!(run("2g")["allocated"], 900 * MIB, "the read-only limits file wins");

    // The agent raises the limit: the next process gets it.
    store.update("job1", &[SliceGpu { uuid, memory: 2 << 30, sm: 0 }]).unwrap();
    let v = run("3g");
    assert_eq!(v["allocated"], 1900 * MIB);
    assert_eq!(v["mem_info"]["total"], 2048 * MIB);
}

#[test]
fn a_monitoring_pass_attributes_reclaims_and_catches_escapes() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut s = Sim::new(Some(NODE));
    let uuid = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let store = SliceStore::open(&s.state.join("agent")).unwrap();
    store.create("job1", vec![SliceGpu { uuid: uuid.clone(), memory: 1 << 30, sm: 0 }]).unwrap();
    let dir = store.dir("job1");
    let c = inside(&s, &dir, "64m");
    let (pin, _) = s.spawn_cmd(c, &["alloc", "--size", "300m", "--hold"]);
    let (pout, _) = s.spawn(RT, &["alloc", "--size", "500m", "--hold"]);

    // This test alone loads NVML in this process: point it at this test's simulated node.
    std::env::set_var("VGPU_SIM_STATE", &s.state);
    std::env::set_var("VGPU_SIM_CONFIG", s.config.as_ref().unwrap());
    let nvml = vgpu_agent::discovery::open(Some(&s.libs.join("libnvidia-ml.so.1"))).unwrap();
    let r = vgpu_agent::monitor::tick(&nvml, &store).unwrap();
    assert_eq!(r.usage.len(), 1);
    let u = &r.usage[0];
    assert_eq!((u.slice.as_str(), u.pids.clone()), ("job1", vec![pin]));
    assert_eq!((u.accounted, u.measured), (364 * MIB, 364 * MIB), "the interposer's account matches NVML");
    assert_eq!(
        r.escapes,
        vec![vgpu_agent::monitor::Escape::Unaccounted { gpu: uuid.clone(), pid: pout, memory: 564 * MIB }]
    );
    let region = Region::open(&dir.join("region"), true).unwrap();
    assert_eq!(
        region.layout().devices[0].sm_flags.load(std::sync::atomic::Ordering::Relaxed),
        3,
        "shared, agent-managed"
    );

    // A dead process is reclaimed within one pass; without the outsider the GPU is not shared.
    s.kill(pin);
    s.kill(pout);
    let r = vgpu_agent::monitor::tick(&nvml, &store).unwrap();
    assert_eq!(r.reclaimed, 364 * MIB);
    assert!(r.escapes.is_empty(), "{:?}", r.escapes);
    assert_eq!(region.layout().devices[0].sm_flags.load(std::sync::atomic::Ordering::Relaxed), 2);

    // A slice process whose context is not accounted (overhead set to 0) ends up over its limit as
    // NVML measures it: reported.
    let c = inside(&s, &dir, "0");
    let (p, _) = s.spawn_cmd(c, &["alloc", "--size", "1000m", "--hold"]);
    let r = vgpu_agent::monitor::tick(&nvml, &store).unwrap();
    assert_eq!(
        r.escapes,
        vec![vgpu_agent::monitor::Escape::OverLimit {
            slice: "job1".into(),
            gpu: uuid,
            measured: 1064 * MIB,
            limit: 1 << 30
        }]
    );
    s.kill(p);
}

/// A client inside the slice at `dir` (what the agent's injection gives a container).
fn inside(s: &Sim, dir: &std::path::Path, overhead: &str) -> std::process::Command {
    let mut c = s.cmd(RT);
    c.env("LD_PRELOAD", libvgpu())
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("region"))
        .env("VGPU_LIMITS_FILE", dir.join("limits"))
        .env("VGPU_CONTEXT_OVERHEAD", overhead);
    c
}

#[test]
fn the_agent_daemon_monitors_slices_reclaims_and_stops_cleanly() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut s = Sim::new(Some(NODE));
    let uuid = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let state = s.state.join("agent");
    let store = SliceStore::open(&state).unwrap();
    store.create("job1", vec![SliceGpu { uuid, memory: 1 << 30, sm: 0 }]).unwrap();
    let agent_bin = std::path::Path::new(RT).parent().unwrap().join("vgpu-node-agent");
    assert!(agent_bin.exists(), "{} is built with the workspace", agent_bin.display());
    let agent = s
        .cmd(agent_bin.to_str().unwrap())
        .env("VGPU_AGENT_MONITOR_INTERVAL_MS", "50")
        .env("VGPU_AGENT_LOG_FORMAT", "json")
        .args(["--state-dir", state.to_str().unwrap(), "--nvml-library"])
        .arg(s.libs.join("libnvidia-ml.so.1"))
        .arg("run")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = || -> Option<serde_json::Value> {
        serde_json::from_slice(&std::fs::read(state.join("status.json")).ok()?).ok()
    };
    let wait_for = |what: &str, f: &dyn Fn(&serde_json::Value) -> bool| {
        let t = std::time::Instant::now();
        loop {
            if let Some(v) = status() {
                if f(&v) {
                    return v;
                }
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(10), "timed out waiting for {what}: {:?}", status());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let c = inside(&s, &store.dir("job1"), "64m");
    let (pin, _) = s.spawn_cmd(c, &["alloc", "--size", "300m", "--hold"]);
    let v = wait_for("the slice's usage", &|v| v["report"]["usage"][0]["measured"] == 364 * MIB);
    assert_eq!(v["slices"][0]["name"], "job1");
    assert_eq!(v["report"]["usage"][0]["pids"][0], pin);
    assert!(v["loop_us"].as_u64().unwrap() < 50_000);
    s.kill(pin);
    // Reclaimed within a pass or two: the slot is gone from the region.
    let t = std::time::Instant::now();
    let region = Region::open(&store.dir("job1").join("region"), true).unwrap();
    while !region.slots().is_empty() {
        assert!(t.elapsed() < std::time::Duration::from_secs(2), "dead slot not reclaimed");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(region.used(0), 0);
    // SIGTERM: a clean exit, logged.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let out = agent.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("\"recovered slices\"") && log.contains("\"shutting down\""), "{log}");
    assert!(log.contains("reclaimed memory of dead processes"), "{log}");
}

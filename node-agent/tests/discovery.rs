//! Discovery against the simulated GPU through nvml-wrapper loading the simulator's
//! `libnvidia-ml.so.1` by path, in-process and through the agent binary.

use std::path::{Path, PathBuf};
use std::process::Command;
use vgpu_agent::discovery;

const AGENT: &str = env!("CARGO_BIN_EXE_vgpu-node-agent");

const NODE: &str = r#"
[[gpu]]
model = "A100-40GB"
[[gpu]]
model = "H100-80GB"
numa_node = 1
[[gpu]]
model = "L4"
numa_node = 0
"#;

fn nvml_lib() -> PathBuf {
    let p = Path::new(AGENT).parent().unwrap().join("deps").join("libnvidia_ml.so");
    assert!(p.exists(), "{} missing: build the workspace", p.display());
    p
}

#[test]
fn the_agent_sees_every_gpu_and_mig_instance() {
    let dir = std::env::temp_dir().join(format!("vgpu-agent-discovery-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("node.toml"), NODE).unwrap();
    // The only test of this binary: the simulated node is chosen through the environment, once.
    std::env::set_var("VGPU_SIM_STATE", dir.join("state"));
    std::env::set_var("VGPU_SIM_CONFIG", dir.join("node.toml"));

    let nvml = discovery::open(Some(&nvml_lib())).unwrap();
    // Give the H100 a MIG layout: a 3g.40gb instance at slot 4 with a 3-slice compute instance.
    {
        let lib = nvml.lib();
        let d = nvml.device_by_index(1).unwrap();
        // SAFETY: raw NVML calls with a valid handle and out-pointers to locals.
        unsafe {
            let h = d.handle();
            let mut st = 0;
            assert_eq!(lib.nvmlDeviceSetMigMode(h, 1, &mut st), 0);
            let mut gi = std::ptr::null_mut();
            let pl = nvml_wrapper_sys::bindings::nvmlGpuInstancePlacement_t { start: 4, size: 4 };
            assert_eq!(lib.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, &pl, &mut gi), 0);
            let mut ci = std::ptr::null_mut();
            assert_eq!(lib.nvmlGpuInstanceCreateComputeInstance(gi, 2, &mut ci), 0);
        }
    }
    let inv = discovery::discover(&nvml).unwrap();
    assert_eq!((inv.driver_version.as_str(), inv.cuda_version), ("550.54.15", 12040));
    assert_eq!(inv.gpus.len(), 3);
    let (a, h, l) = (&inv.gpus[0], &inv.gpus[1], &inv.gpus[2]);
    assert_eq!(a.name, "NVIDIA A100-SXM4-40GB");
    assert_eq!(a.memory_total, 40537 << 20);
    assert_eq!(a.sm_count, Some(108));
    assert_eq!(a.compute_capability, (8, 0));
    assert!(a.uuid.starts_with("GPU-") && a.pci_bus_id.ends_with(":18:00.0"), "{a:?}");
    assert_eq!((a.numa_node, h.numa_node, l.numa_node), (Some(0), Some(1), Some(0)));
    assert_eq!(a.topology, vec!["Internal", "System", "Node"]);
    let am = a.mig.as_ref().unwrap();
    assert!(!am.enabled && am.gpu_instances.is_empty());
    let hm = h.mig.as_ref().unwrap();
    assert!(hm.enabled && !hm.pending);
    assert_eq!(hm.gpu_instances.len(), 1);
    let gi = &hm.gpu_instances[0];
    assert_eq!((gi.profile_id, gi.start, gi.size), (9, 4, 4));
    assert_eq!(gi.compute_instances.len(), 1);
    assert_eq!(gi.compute_instances[0].1, 2);
    assert_eq!(hm.devices.len(), 1);
    assert!(hm.devices[0].uuid.starts_with("MIG-"));
    assert_eq!(hm.devices[0].memory_total, 40448 << 20);
    assert!(l.mig.is_none(), "the L4 has no MIG");
    assert_eq!(h.sm_count, Some(132));

    // The binary: the same inventory as JSON; bad configuration and a missing NVML are reported.
    let o = Command::new(AGENT).args(["--nvml-library", nvml_lib().to_str().unwrap(), "discover"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["gpus"][1]["mig"]["gpu_instances"][0]["profile_id"], 9);
    assert_eq!(v["gpus"][2]["name"], "NVIDIA L4");

    let bad = dir.join("agent.toml");
    std::fs::write(&bad, "monitor_interval_ms = 1\n").unwrap();
    let o = Command::new(AGENT).args(["--config", bad.to_str().unwrap(), "discover"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("monitor_interval_ms: 1 is not from 10 to 60000"));
    let o =
        Command::new(AGENT).args(["--nvml-library", "/nonexistent/libnvidia-ml.so.1", "discover"]).output().unwrap();
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot initialise NVML from /nonexistent"));
    std::fs::remove_dir_all(dir).ok();
}

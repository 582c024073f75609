//! The simulated libnvidia-ml.so.1 through nvml-wrapper in real processes: agreement with the driver
//! side, MIG rules (NVIDIA's placement tables), mode switching, faults and XID events.

mod common;
use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};

const NODE: &str = r#"
context_overhead_mib = 64
[[gpu]]
model = "A100-40GB"
[[gpu]]
model = "H100-80GB"
numa_node = 1
[[gpu]]
model = "L4"
numa_node = 0
"#;

#[test]
fn nvml_agrees_with_the_driver() {
    let mut s = Sim::new(Some(NODE));
    let (p0, _) = s.spawn(RT, &["alloc", "--size", "200m", "--hold"]);
    let (p1, _) = s.spawn(DIRECT, &["alloc", "--device", "1", "--size", "100m", "--hold"]);
    let info = s.run1(DLSYM, &["info"]);
    let n = s.nvml();
    assert_eq!(n["driver_version"], "550.54.15");
    assert_eq!(n["cuda_version"], 12040);
    for (i, (pid, mib)) in [(p0, 264u64), (p1, 164)].into_iter().enumerate() {
        let g = &n["gpus"][i];
        let d = &info["devices"][i];
        assert_eq!(g["uuid"], d["uuid"], "gpu {i}");
        assert_eq!(g["name"], d["name"]);
        assert_eq!(g["memory"]["total"], d["total_mem"]);
        assert_eq!(g["cc"], d["cc"]);
        assert!(g["pci"]["bus_id"].as_str().unwrap().to_lowercase().ends_with(d["pci_bus_id"].as_str().unwrap()));
        assert_eq!(g["memory"]["used"], mib * MIB, "gpu {i}: NVML used = the processes' memory");
        assert_eq!(g["memory"]["free"].as_u64().unwrap() + mib * MIB, g["memory"]["total"].as_u64().unwrap());
        let procs = g["processes"]["Ok"].as_array().unwrap();
        assert_eq!(procs.len(), 1, "gpu {i}: {procs:?}");
        assert_eq!(procs[0]["pid"], pid);
        assert_eq!(procs[0]["used"], mib * MIB);
    }
    assert_eq!(n["gpus"][2]["processes"]["Ok"], Value::Array(vec![]), "the L4 has no process");
    // Topology: GPU 0 and the L4 share NUMA node 0; GPU 1 is on node 1.
    assert_eq!(n["gpus"][0]["numa_node"], 0);
    assert_eq!(n["gpus"][1]["numa_node"], 1);
    assert_eq!(n["gpus"][0]["topology"], serde_json::json!(["Internal", "System", "Node"]));
    assert_eq!(n["gpus"][0]["cpu_affinity"][0], 0xffff_ffffu64);
    assert_eq!(n["gpus"][1]["cpu_affinity"][0], 0xffff_ffffu64 << 32);
    assert_eq!(n["gpus"][2]["max_mig_devices"], Value::Null, "no MIG on the L4");
    assert_eq!(
        n["gpus"][2]["mig_mode"]["Err"].as_str().map(|e| e.contains("not available")),
        Some(true),
        "{}",
        n["gpus"][2]["mig_mode"]
    );

    s.kill(p0);
    let n = s.nvml();
    assert_eq!(n["gpus"][0]["memory"]["used"], 0, "a SIGKILLed process's memory is gone");
    assert_eq!(n["gpus"][0]["processes"]["Ok"], Value::Array(vec![]));
}

fn ret(v: &Value) -> u64 {
    v["ret"].as_u64().unwrap()
}

#[test]
fn ampere_mig_mode_waits_for_a_reset_that_clients_block() {
    let mut s = Sim::new(Some(NODE));
    let r = s.mig(0, &["mode:1"]);
    assert_eq!((ret(&r[0]), r[0]["activation"].as_u64()), (0, Some(16)), "NVML_ERROR_RESET_REQUIRED");
    let n = s.nvml();
    assert_eq!(n["gpus"][0]["mig_mode"]["Ok"], serde_json::json!({"current": 0, "pending": 1}));
    assert_eq!(ret(&s.mig(0, &["create:19@0"])[0]), 3, "no instances before the mode is active");

    let (holder, _) = s.spawn(RT, &["hold"]);
    let o = s.output(SIM, &["reset", "--gpu", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("in use"));
    s.kill(holder);
    assert!(s.output(SIM, &["reset", "--gpu", "0"]).status.success());
    assert_eq!(s.nvml()["gpus"][0]["mig_mode"]["Ok"], serde_json::json!({"current": 1, "pending": 1}));
    assert_eq!(ret(&s.mig(0, &["create:19@0"])[0]), 0);
    assert!(s.output(SIM, &["reboot"]).status.success());
    let n = s.nvml();
    assert_eq!(
        n["gpus"][0]["mig_mode"]["Ok"],
        serde_json::json!({"current": 1, "pending": 1}),
        "Ampere keeps MIG mode"
    );
    assert_eq!(s.mig(0, &["list"])[0]["gpu_instances"], Value::Array(vec![]), "a reboot wipes instances");
}

#[test]
fn hopper_mig_mode_switches_at_once_and_is_lost_at_reboot() {
    let mut s = Sim::new(Some(NODE));
    let (holder, _) = s.spawn(RT, &["hold", "--device", "1"]);
    assert_eq!(ret(&s.mig(1, &["mode:1"])[0]), 19, "NVML_ERROR_IN_USE while a process holds the GPU");
    s.kill(holder);
    let r = s.mig(1, &["mode:1", "create:0"]);
    assert_eq!((ret(&r[0]), r[0]["activation"].as_u64()), (0, Some(0)));
    assert_eq!(ret(&r[1]), 0, "7g instance right away");
    assert_eq!(ret(&s.mig(1, &["mode:0"])[0]), 19, "cannot disable with instances present");
    assert!(s.output(SIM, &["reboot"]).status.success());
    assert_eq!(s.nvml()["gpus"][1]["mig_mode"]["Ok"], serde_json::json!({"current": 0, "pending": 0}));
    // Non-MIG card.
    assert_eq!(ret(&s.mig(2, &["mode:1"])[0]), 3);
}

fn enable_a100(s: &Sim) {
    assert_eq!(ret(&s.mig(0, &["mode:1"])[0]), 0);
    assert!(s.output(SIM, &["reset", "--gpu", "0"]).status.success());
}

#[test]
fn mig_placement_rules_and_return_codes() {
    let s = Sim::new(Some(NODE));
    enable_a100(&s);
    let r = s.mig(
        0,
        &[
            "create:19@7", // 1g at slot 7: not a valid placement
            "create:14@6", // 2g at 6: not a valid placement
            "create:9@0",  // 3g@0
            "create:5@0",  // 4g@0 overlaps the 3g
            "destroy-all",
            "create:5@0", // 4g@0 + 3g@4 is valid
            "create:9@4",
            "remaining:19",
            "destroy-all",
            "create:20@0", // 1g+me
            "create:20@3", // a second +me
            "remaining:19",
            "create:99",
        ],
    );
    let codes: Vec<u64> = r.iter().map(ret).collect();
    assert_eq!(codes, vec![2, 2, 0, 23, 0, 0, 0, 0, 0, 0, 23, 0, 2], "{r:?}");
    assert_eq!(r[7]["count"], 0, "4g + 3g fill the GPU");
    assert_eq!(r[11]["count"], 6, "six more 1g next to a 1g+me");

    // Compute instances, IN_USE on destroy, MIG device handles.
    let r = s.mig(0, &["destroy-all", "create:0", "list"]);
    let gi = r[2]["gpu_instances"][0]["id"].as_u64().unwrap().to_string();
    let r = s.mig(0, &[&format!("ci:{gi}:4"), &format!("destroy:{gi}"), "devices"]);
    assert_eq!((ret(&r[0]), ret(&r[1])), (0, 19), "{r:?}");
    let devs = r[2]["mig_devices"].as_array().unwrap();
    assert_eq!(devs.len(), 1);
    assert!(devs[0]["uuid"].as_str().unwrap().starts_with("MIG-"));
    assert_eq!(devs[0]["name"], "NVIDIA A100-SXM4-40GB MIG 7g.40gb");
    assert_eq!(devs[0]["memory"], 40448 * MIB);
    assert_eq!(devs[0]["is_mig"], true);
    let ci = r[0]["id"].as_u64().unwrap();
    let r = s.mig(0, &[&format!("destroyci:{gi}:{ci}"), &format!("destroy:{gi}"), "list"]);
    assert_eq!((ret(&r[0]), ret(&r[1])), (0, 0));
    assert_eq!(r[2]["gpu_instances"], Value::Array(vec![]));

    // Profile info by NVML profile index.
    let r = s.mig(0, &["profile:0", "profile:9", "profile:4", "profile:5", "profile:40"]);
    assert_eq!((r[0]["id"].as_u64(), r[0]["count"].as_u64(), r[0]["mib"].as_u64()), (Some(19), Some(7), Some(4864)));
    assert_eq!((r[1]["id"].as_u64(), r[1]["slices"].as_u64()), (Some(15), Some(1)), "1g.10gb");
    assert_eq!((r[2]["id"].as_u64(), r[2]["sm"].as_u64()), (Some(0), Some(98)));
    assert_eq!(ret(&r[3]), 3, "no 8-slice profile on the A100");
    assert_eq!(ret(&r[4]), 2, "index beyond the profile range");
}

/// Every maximal layout of the A100's {1g, 2g, 3g, 4g, 7g} profiles, found from the placements NVML
/// reports and the documented rules (no overlap, at most 7 compute slices, instance counts).
fn maximal_layouts(s: &Sim) -> Vec<Vec<(u64, u64)>> {
    let profiles = [(19u64, 0u64), (14, 1), (9, 2), (5, 3), (0, 4)]; // (id, NVML index)
    let mut cands = Vec::new(); // (profile id, start, size, compute slices, max)
    for (id, idx) in profiles {
        let r = s.mig(0, &[&format!("placements:{id}"), &format!("profile:{idx}")]);
        for p in r[0]["placements"].as_array().unwrap() {
            cands.push((
                id,
                p[0].as_u64().unwrap(),
                p[1].as_u64().unwrap(),
                r[1]["slices"].as_u64().unwrap(),
                r[1]["count"].as_u64().unwrap(),
            ));
        }
    }
    fn fits(l: &[(u64, u64, u64, u64, u64)], c: &(u64, u64, u64, u64, u64)) -> bool {
        l.iter().map(|x| x.3).sum::<u64>() + c.3 <= 7
            && (l.iter().filter(|x| x.0 == c.0).count() as u64) < c.4
            && l.iter().all(|x| c.1 + c.2 <= x.1 || x.1 + x.2 <= c.1)
    }
    fn rec(
        l: &mut Vec<(u64, u64, u64, u64, u64)>,
        from: usize,
        c: &[(u64, u64, u64, u64, u64)],
        out: &mut Vec<Vec<(u64, u64)>>,
    ) {
        if !c.iter().any(|x| fits(l, x)) {
            let mut v: Vec<_> = l.iter().map(|x| (x.0, x.1)).collect();
            v.sort_by_key(|x| x.1);
            out.push(v);
            return;
        }
        for i in from..c.len() {
            if fits(l, &c[i]) {
                l.push(c[i]);
                rec(l, i + 1, c, out);
                l.pop();
            }
        }
    }
    let mut out = Vec::new();
    rec(&mut Vec::new(), 0, &cands, &mut out);
    out.sort();
    out.dedup();
    out
}

#[test]
fn all_nineteen_maximal_a100_layouts_are_creatable_with_placements() {
    let s = Sim::new(Some(NODE));
    enable_a100(&s);
    let layouts = maximal_layouts(&s);
    assert_eq!(layouts.len(), 19, "{layouts:?}");
    for l in &layouts {
        let mut ops = vec!["destroy-all".to_string()];
        ops.extend(l.iter().map(|(id, start)| format!("create:{id}@{start}")));
        ops.extend(["remaining:19", "remaining:14", "remaining:9", "remaining:5", "remaining:0"].map(String::from));
        let refs: Vec<&str> = ops.iter().map(String::as_str).collect();
        let r = s.mig(0, &refs);
        for (op, v) in ops.iter().zip(&r) {
            assert_eq!(ret(v), 0, "layout {l:?}: {op} -> {v}");
            if op.starts_with("remaining") {
                assert_eq!(v["count"], 0, "layout {l:?} is maximal: {op}");
            }
        }
    }
}

#[test]
fn hopper_and_a30_tables() {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H200-141GB\"\n[[gpu]]\nmodel = \"A30\"\n"));
    let r =
        s.mig(0, &["mode:1", "profile:4", "create:15@6", "create:15@0", "create:14@2", "create:9@4", "remaining:19"]);
    assert_eq!(r[1]["mib"], 143104);
    assert_eq!(r[1]["sm"], 132);
    let codes: Vec<u64> = r.iter().map(ret).collect();
    assert_eq!(codes, vec![0, 0, 0, 0, 0, 23, 0], "1g.35gb@6 + 1g.35gb@0 + 2g@2 leave no room for 3g@4: {r:?}");
    assert_eq!(r[6]["count"], 2, "memory slices 4 and 5 are free, 3 compute slices left");
    assert_eq!(ret(&s.mig(1, &["mode:1"])[0]), 0);
    assert!(s.output(SIM, &["reset", "--gpu", "1"]).status.success());
    let r = s.mig(1, &["create:0@0", "remaining:14", "destroy-all", "create:5@2", "create:5@0", "create:6@0"]);
    let codes: Vec<u64> = r.iter().map(ret).collect();
    assert_eq!(codes, vec![0, 0, 0, 0, 0, 23], "A30: 4g fills it; 2g@0 + 2g@2; +me has no room left: {r:?}");
    assert_eq!(r[1]["count"], 0);
}

#[test]
fn nvml_faults_and_xid_events() {
    let s = Sim::new(Some(NODE));
    let lib = s.libs.join("libnvidia-ml.so.1");
    let lib = lib.to_str().unwrap();
    assert!(s.output(SIM, &["fault", "set", "nvmlDeviceGetCount_v2", "--code", "15", "--count", "1"]).status.success());
    let o = s.output(NVML, &["--lib", lib, "snapshot"]);
    assert!(!o.status.success(), "the first call fails");
    assert!(String::from_utf8_lossy(&o.stderr).contains("fell off the bus"), "{}", String::from_utf8_lossy(&o.stderr));
    s.nvml(); // then it works again

    // A fault on one GPU leaves the others alone.
    assert!(s
        .output(SIM, &["fault", "set", "nvmlDeviceGetMemoryInfo_v2", "--gpu", "1", "--code", "15"])
        .status
        .success());
    let n = s.nvml();
    assert!(n["gpus"][0]["memory"].is_object());
    assert!(n["gpus"][1]["memory"].is_null());
    let st = s.status();
    assert_eq!(st["faults"][0]["function"], "nvmlDeviceGetMemoryInfo_v2");
    assert!(s.output(SIM, &["fault", "clear"]).status.success());
    assert!(s.nvml()["gpus"][1]["memory"].is_object());

    // Latency injection.
    assert!(s
        .output(
            SIM,
            &["fault", "set", "nvmlDeviceGetCount_v2", "--code", "0", "--latency-us", "300000", "--count", "1"]
        )
        .status
        .success());
    let t = std::time::Instant::now();
    s.nvml();
    assert!(t.elapsed() >= std::time::Duration::from_millis(300));

    // XID events reach a waiting NVML client.
    let mut child = s
        .cmd(NVML)
        .args(["--lib", lib, "events", "--gpu", "1", "--timeout-ms", "10000"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("registered"), "{line}");
    assert!(s.output(SIM, &["xid", "--gpu", "0", "--code", "31"]).status.success(), "another GPU's event");
    assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
    line.clear();
    out.read_line(&mut line).unwrap();
    child.wait().unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["xid"], 79, "{v}");
    assert_eq!(v["uuid"], s.status()["gpus"][1]["uuid"]);
}

/// MIG devices as the driver has them (issue: a MIG device's UUID came from its GPU instance id,
/// so an instance made again with another profile got the old UUID; a CUDA process asking for a
/// MIG device got no device; a plain process on a GPU in MIG mode saw the whole GPU): each instance
/// made gets a new UUID; CUDA sees a MIG device, named or the GPU's first, with its own memory and
/// SMs, and a process in it is held to its memory; a GPU in MIG mode with no instance is no device.
#[test]
fn mig_devices_are_cuda_devices_with_their_own_memory_and_new_uuids() {
    let s = Sim::new(Some(NODE));
    let devices = |r: &[Value]| r.last().unwrap()["mig_devices"].as_array().unwrap().clone();
    let r = s.mig(1, &["mode:1", "create:19", "ci:1:0", "devices"]);
    assert!(r[..3].iter().all(|x| ret(x) == 0), "{r:?}");
    let first = devices(&r)[0]["uuid"].as_str().unwrap().to_string();
    let r = s.mig(1, &["destroyci:1:0", "destroy:1", "create:14", "ci:1:1", "devices"]);
    assert!(r[..4].iter().all(|x| ret(x) == 0), "{r:?}");
    let d = devices(&r)[0].clone();
    let uuid = d["uuid"].as_str().unwrap().to_string();
    let mem = d["memory"].as_u64().unwrap();
    assert_ne!(uuid, first, "GPU instance 1 made again: a new MIG device, a new UUID");
    // Named by its UUID: CUDA's one device is the MIG device, with its memory and SMs.
    let named = s.cmd(RT).env("CUDA_VISIBLE_DEVICES", &uuid).arg("info").output().unwrap();
    let info = &lines(&named.stdout)[0];
    let devs = info["devices"].as_array().unwrap_or_else(|| panic!("{info}"));
    assert_eq!(devs.len(), 1, "{info}");
    assert_eq!(devs[0]["total_mem"].as_u64().unwrap(), mem, "{info}");
    assert!(devs[0]["sm_count"].as_u64().unwrap() < 132, "a 2g instance has fewer SMs than the GPU: {info}");
    // CUDA gives the UUID's bytes (the application prints them with its own prefix).
    let hex = |u: &str| u.split_once('-').map(|x| x.1.to_string()).unwrap_or_default();
    assert_eq!(hex(devs[0]["uuid"].as_str().unwrap()), hex(&uuid));
    // A process in it is held to its memory (by the driver, whatever it asks).
    let o = s
        .cmd(RT)
        .env("CUDA_VISIBLE_DEVICES", &uuid)
        .args(["alloc", "--size", &(mem + (4 << 30)).to_string(), "--chunk", "1g"])
        .output()
        .unwrap();
    let v = &lines(&o.stdout)[0];
    assert!(v["allocated"].as_u64().unwrap() < mem && v["error"] == "CUDA_ERROR_OUT_OF_MEMORY", "{v}");
    // No variable: the GPU in MIG mode is its first MIG device, the others whole.
    let all = s.run1(RT, &["info"]);
    let devs = all["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 3, "{all}");
    assert_eq!(
        (hex(devs[1]["uuid"].as_str().unwrap()), devs[1]["total_mem"].as_u64()),
        (hex(&uuid), Some(mem)),
        "{all}"
    );
    // MIG on and no instance: no CUDA device on that GPU.
    assert_eq!(ret(&s.mig(1, &["destroy-all"])[0]), 0);
    let none = s.run1(RT, &["info"]);
    assert_eq!(none["devices"].as_array().unwrap().len(), 2, "{none}");
}

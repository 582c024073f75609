//! The real-GPU suite (tests/gpu/run.sh) run on the simulated GPU: its options, its report, and every
//! check that has a driver-API form, with the helpers (gpu-probe, nvml-probe), libvgpu.so, the agent
//! and vgpuctl as built. The PyTorch checks run against a stand-in for PyTorch over the simulated
//! driver (tests/sim/torch): that proves the suite's handling of them and libvgpu.so under the
//! driver calls PyTorch makes, not PyTorch itself, which only a machine with an NVIDIA GPU does
//! (docs/gpu-validation.md).

mod common;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run_sh() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../gpu/run.sh")
}

fn suite(s: &Sim, args: &[&str]) -> Output {
    let mut c: Command = s.cmd(run_sh().to_str().unwrap());
    c.arg("--lib").arg(libvgpu()).arg("--bin-dir").arg(Path::new(RT).parent().unwrap()).args(args);
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn options_are_checked_and_checks_listed() {
    let s = Sim::new(None);
    let o = suite(&s, &["--list"]);
    assert!(o.status.success(), "{}", text(&o));
    let listed: Vec<String> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| l.split_whitespace().next().unwrap().to_string()).collect();
    for c in [
        "load",
        "mem-info",
        "oom",
        "oom-expandable",
        "train",
        "shared-quota",
        "context-reset",
        "vmm-hold",
        "ctx-stack",
        "pool-hold",
        "pool-threads",
        "graph-mem",
        "torch-async",
        "nvml",
        "cuda-graph",
        "graph-recapture",
        "sm-30",
        "sm-60",
        "sm-grids",
        "sm-25-75",
        "true-up",
        "oversubscribe",
        "agent",
        "oom-agent",
        "pool-threads-agent",
        "agent-sm",
        "priority",
        "mps",
        "priority-mps",
    ] {
        assert!(listed.iter().any(|l| l == c), "{c} not listed: {listed:?}");
    }
    for (args, want) in [
        (vec!["--only", "nope"], "unknown check nope"),
        (vec!["--limit", "lots"], "not a size"),
        (vec!["--lib", "/nonexistent/libvgpu.so"], "no such library"),
    ] {
        let mut c = s.cmd(run_sh().to_str().unwrap());
        if args[0] != "--lib" {
            c.arg("--lib").arg(libvgpu());
        }
        let o = c.args(&args).arg("--bin-dir").arg(Path::new(RT).parent().unwrap()).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
}

/// The SM checks' verdict, on the H200's figures of 2026-11-30 (a 60 % limit: 71.3 % of the
/// unlimited throughput, NVML 59.7 %, 54.0 % at equal clocks) and made-up paced references.
#[test]
fn a_charge_that_rises_in_steps_has_not_fallen() {
    let dir = run_sh().parent().unwrap().to_path_buf();
    let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
import suite
M = 1 << 20
# The H200's pool-threads-agent readings of 2026-12-04 (second run): 30 MiB, then 518 MiB: a rise.
assert suite.fell([0, 30 * M, 518 * M, 518 * M], 64 * M) is None
assert suite.fell([14 * M, 518 * M, 470 * M], 64 * M) is None
# Taken back: 518 MiB, then 30 MiB.
assert suite.fell([0, 518 * M, 518 * M, 30 * M, 518 * M], 64 * M) == 3
assert suite.fell([], 64 * M) is None
print("ok")
"#;
    let o = Command::new("python3").arg("-c").arg(script).arg(&dir).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "ok", "{}", text(&o));
}

#[test]
fn sm_throughput_is_judged_against_the_workload_paced_to_the_same_share_of_time() {
    let dir = run_sh().parent().unwrap().to_path_buf();
    let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
import suite

class S:
    def __init__(self, ref, nv):
        self.r = (ref, {"mean_gpu": nv} if nv is not None else None)
    def paced(self, kind, target):
        return self.r

# A perfect 60 % of time gives 71.0 % of the throughput: 71.3 % limited is 60.3 % of the time.
share, v, text = suite.paced_share(S(71.0, 59.5), "torch:matmul", 60, 71.3)
assert abs(share - 60.25) < 0.01, share
assert "60.3 % of the GPU's time by throughput" in text, text
assert v["paced_throughput_pct"] == 71.0
assert suite.sm_verdict(71.3, 54.0, 59.7, 60, share)
# Too much time (80 % of the throughput where 60 % of the time gives 71 %): fails, and the
# equal-clock figure no longer rescues it once the reference is usable.
share, _, _ = suite.paced_share(S(71.0, 59.5), "torch:matmul", 60, 80.0)
assert not suite.sm_verdict(80.0, 60.0, 59.7, 60, share)
# NVML outside 5 points fails whatever the throughput says.
assert not suite.sm_verdict(71.3, 54.0, 66.0, 60, 60.2)
# A paced run that missed its own target is no reference: equal clocks decide, as before.
share, _, text = suite.paced_share(S(60.0, 48.0), "torch:matmul", 60, 71.3)
assert share is None and "no usable reference" in text, text
assert not suite.sm_verdict(71.3, 54.0, 59.7, 60, share)
assert suite.sm_verdict(71.3, 57.0, 59.7, 60, share)
# A paced run that failed leaves the check to judge as before.
class Broken:
    def paced(self, kind, target):
        raise suite.Fail("torch_worker.py exited (1)")
share, v, text = suite.paced_share(Broken(), "torch:matmul", 60, 71.3)
assert share is None and "paced reference failed" in text and "exited" in v["paced_error"], text
# Without NVML figures the reference stands on its own.
share, _, _ = suite.paced_share(S(35.0, None), "probe", 30, 35.9)
assert abs(share - 30.77) < 0.01 and suite.sm_verdict(35.9, None, None, 30, share)
print("ok")
"#;
    let o = Command::new("python3").arg("-c").arg(script).arg(&dir).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).trim() == "ok", "{}", text(&o));
}

#[test]
fn the_suite_passes_on_the_simulated_gpu() {
    // CUDA contexts as big as PyTorch's on an H200 (610 MiB), more than libvgpu.so charges for one
    // (256 MiB): the agent's checks must then rely on its true-up. A 580 driver, as the lent
    // H200 had (nvidia-smi's private process lists are restricted on that branch).
    let s = Sim::new(Some(
        "driver_version = \"580.95.05\"\ncontext_overhead_mib = 640\nutil_window_ms = 200\n[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n",
    ));
    let out = s.state.join("results");
    let o = suite(&s, &["--no-torch", "--quick", "--out", out.to_str().unwrap()]);
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap_or_default();
    let r: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap())
        .unwrap_or_else(|e| panic!("results.json: {e}\n{}", text(&o)));
    let status = |name: &str| -> (String, Value) {
        let c = r["checks"].as_array().unwrap().iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("{name}"));
        (c["status"].as_str().unwrap().to_string(), c.clone())
    };
    for name in [
        "load",
        "mem-info",
        "oom",
        "shared-quota",
        "context-reset",
        "vmm-hold",
        "ctx-stack",
        "pool-hold",
        "graph-mem",
        "nvml",
        "sm-30",
        "sm-60",
        "true-up",
        "oversubscribe",
        "agent",
        "oom-agent",
        "mps",
        "pool-threads",
        "pool-threads-agent",
    ] {
        let (st, c) = status(name);
        assert_eq!(st, "pass", "{name}: {c}\n{}\n{}", text(&o), &log[log.len().saturating_sub(6000)..]);
    }
    // The agent's log gives each change of a correction: the storm's context charged from nothing.
    let (_, c) = status("pool-threads-agent");
    let changes = c["values"]["agent_corrections"].as_array().cloned().unwrap_or_default();
    assert!(changes.iter().any(|x| x.as_str().is_some_and(|x| x.contains(" 0->640 MiB"))), "{c}");
    for name in ["oom-expandable", "train", "cuda-graph", "graph-recapture", "sm-grids", "torch-async"] {
        assert_eq!(status(name).0, "skip", "{name} needs PyTorch");
    }
    // `true-up` tells the two apart here: with it off, the process really holds more than the limit
    // (640 MiB contexts charged 256). As root (CI) its PID-namespace run must have happened too.
    // The SM checks' reference: the probe pacing itself to the target share of time (no limit).
    // Its kernels take the same time whatever the clock, so its throughput is about that share.
    for (name, target) in [("sm-30", 30.0), ("sm-60", 60.0)] {
        let (_, c) = status(name);
        let v = &c["values"];
        let paced = v["paced_throughput_pct"].as_f64().unwrap_or(-1.0);
        assert!((paced - target).abs() < 10.0, "{name}: paced reference {paced}: {c}");
        assert!(v["share_by_paced_pct"].as_f64().is_some(), "{name}: no usable paced reference: {c}");
    }
    // Every NVML query that names processes was asked in the container (3 lists in 3 versions, the
    // detail list's 3 modes, 2 utilization queries, the private table's 3 lists), and its process
    // was named.
    let (_, c) = status("nvml");
    let p = &c["values"]["processes"];
    assert_eq!(p["inside"].as_object().map(|m| m.len()), Some(17), "{c}");
    assert_eq!(p["inside"]["nvmlDeviceGetComputeRunningProcesses"], json!([p["container_pid"]]), "{c}");
    assert_eq!(p["inside"]["private:213"], json!([p["container_pid"]]), "{c}");
    // And in a container with an SM limit alone, its own process.
    assert_eq!(p["inside_sm_only"]["nvmlDeviceGetComputeRunningProcesses"], json!([p["sm_only_container_pid"]]), "{c}");
    // The simulated driver has CUDA 13.0's cuMemSetMemPool: pool-hold's third run took place.
    let (_, c) = status("pool-hold");
    assert_eq!(c["values"]["own_current"]["own_current"], true, "{c}");
    let (_, c) = status("true-up");
    let v = &c["values"];
    assert!(v["nvml_off"].as_u64() > v["limit"].as_u64(), "{c}");
    if std::env::var_os("VGPU_REQUIRE_RUNC").is_some() {
        assert!(v["nvml_pid_namespace"].as_u64().is_some(), "{c}");
    }
    // Timed against each other on a shared machine: reported, not asserted (a debug build here).
    let (_, c) = status("overhead");
    assert!(c["values"]["launch_ratio"].as_f64().is_some_and(|x| x > 0.0), "{c}");
    // Whether the limited launches found the budget in debt, read from their container's region.
    assert!(c["values"]["limited_throttled_launches"].as_u64().is_some(), "{c}");
    // The first context without libvgpu.so and with it (true-up off and on), for the start budget.
    for k in ["bare", "true_up_off", "true_up_on"] {
        assert!(c["values"]["first_context_ms"][k].as_f64().is_some_and(|x| x > 0.0), "{k}: {c}");
    }
    let (_, c) = status("sm-25-75");
    assert!(c["values"]["a_pct"].as_f64().is_some_and(|x| x > 5.0 && x < 50.0), "{c}");
    // Two unlimited processes share the simulated GPU's one timeline: together about one alone
    // (on a time-sliced real GPU, less by what the switches cost).
    assert!(c["values"]["pair_unlimited_pct"].as_f64().is_some_and(|x| x > 70.0 && x < 130.0), "{c}");
    let (_, c) = status("agent-sm");
    assert!(c["values"]["low_pct"].as_f64().is_some_and(|x| x > 5.0 && x < 50.0), "{c}");
    // NVML in each slice showed the slice's own utilisation, not the GPU's.
    let shown = &c["values"]["nvml_in_slices"][0];
    let pct = |k: &str| shown[k].as_u64().unwrap_or_else(|| panic!("{k}: {c}"));
    assert!(pct("low") < pct("high") && pct("high") <= pct("gpu"), "{shown}");
    // NVML's utilization samples there too: each slice's no higher than its share of the GPU.
    assert!(pct("low_samples") <= pct("high_samples") && pct("high_samples") <= pct("gpu_samples"), "{shown}");
    assert!(
        c["values"]["statuses"].as_array().is_some_and(|v| !v.is_empty()),
        "the agent's status during the run: {c}"
    );
    // The report: one row per check, the environment first.
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| check | result | measured |"), "{md}");
    assert!(md.contains("- gpu: NVIDIA"), "{md}");
    for c in r["checks"].as_array().unwrap() {
        let row = format!("| {} | {} |", c["name"].as_str().unwrap(), c["status"].as_str().unwrap().to_uppercase());
        assert!(md.contains(&row), "{row} missing:\n{md}");
    }
    assert_eq!((&r["complete"], r["not_run"].as_array().map(Vec::len)), (&Value::Bool(true), Some(0)));
    assert!(!md.contains("NOT RUN"), "{md}");
    let failed = r["checks"].as_array().unwrap().iter().any(|c| c["status"] == "fail");
    assert_eq!(o.status.code(), Some(if failed { 1 } else { 0 }), "{}", text(&o));
}

#[test]
fn results_are_written_after_every_check_so_a_run_cut_short_keeps_its_figures() {
    // `load` takes a moment, `sm-30` seconds: while the second runs, the first's results are on disk.
    let s = Sim::new(None);
    let out = s.state.join("results");
    let mut c = s.cmd(run_sh().to_str().unwrap());
    c.arg("--lib").arg(libvgpu()).arg("--bin-dir").arg(Path::new(RT).parent().unwrap());
    c.args(["--no-torch", "--quick", "--only", "load,sm-30", "--out", out.to_str().unwrap()]);
    use std::os::unix::process::CommandExt;
    // In a process group of its own, so that the workload it is running goes with it.
    let mut child =
        c.process_group(0).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // Both files are written after each check, one after the other: wait for the pair that has it.
    let (partial, md) = loop {
        if let Ok(b) = std::fs::read(out.join("results.json")) {
            if let Ok(v) = serde_json::from_slice::<Value>(&b) {
                let md = std::fs::read_to_string(out.join("results.md")).unwrap_or_default();
                if md.contains("| load |") {
                    break (v, md);
                }
            }
        }
        assert!(std::time::Instant::now() < deadline, "no results.json and results.md within 60 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before writing its results");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // SAFETY: kill(2) of the process group made above.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
    assert_eq!(partial["complete"], false, "{partial}");
    assert_eq!(partial["not_run"], serde_json::json!(["sm-30"]), "{partial}");
    let checks = partial["checks"].as_array().unwrap();
    assert_eq!(
        (checks.len(), &checks[0]["name"], &checks[0]["status"]),
        (1, &"load".into(), &"pass".into()),
        "{partial}"
    );
    assert!(md.contains("| load | PASS |") && md.contains("| sm-30 | NOT RUN |"), "{md}");
}

/// A stand-in for `nvidia-smi` over the simulated NVML, for the queries the suite makes: its process
/// list comes from NVML's private table (`nvml-probe lists`, "private:213"), as the real one's does,
/// and what libvgpu.so logs reaches its stderr. With `VGPU_TEST_SMI_AROUND` set, its process list
/// is taken around libvgpu.so (without `LD_PRELOAD`), as a tool that reached NVML some other way would.
const NVIDIA_SMI: &str = r#"#!/usr/bin/env python3
import json, os, subprocess, sys

def ask(*a, around=False):
    env = {k: v for k, v in os.environ.items() if not (around and k == "LD_PRELOAD")}
    o = subprocess.run([os.environ["VGPU_TEST_NVML_PROBE"], *a], stdout=subprocess.PIPE, text=True, env=env)
    if o.returncode:
        sys.exit(o.returncode)
    return json.loads(o.stdout)

q = next((a.split("=", 1) for a in sys.argv[1:] if a.startswith("--query-")), None)
if q is None:
    print("NVIDIA-SMI (stand-in)  Driver Version: %s  CUDA Version: 12.4" % ask("snapshot")["driver_version"])
elif q[0] == "--query-compute-apps":
    listed = ask("lists", around="VGPU_TEST_SMI_AROUND" in os.environ)["gpus"][0]["lists"]["private:213"]
    print("\n".join(str(p) for p in listed) if isinstance(listed, list) else "")
else:
    s = ask("snapshot")
    g = s["gpus"][0]
    v = {"memory.total": g["memory"]["total"] >> 20, "memory.used": g["memory"]["used"] >> 20,
         "name": g["name"], "driver_version": s["driver_version"]}
    print(", ".join(str(v[k]) for k in q[1].split(",")))
"#;

/// The suite's `nvml` check with `nvidia-smi` (the stand-in) on the PATH, on a driver of `branch`;
/// `around`: its process list taken around libvgpu.so.
fn nvml_check_with_nvidia_smi(branch: &str, around: bool) -> (Value, Output) {
    let s = Sim::new(Some(&format!("driver_version = \"{branch}.95.05\"\n[[gpu]]\nmodel = \"H100-80GB\"\n")));
    let bin = s.state.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    std::fs::write(&smi, NVIDIA_SMI).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = s.state.join("results");
    let mut c = s.cmd(run_sh().to_str().unwrap());
    c.arg("--lib").arg(libvgpu()).arg("--bin-dir").arg(Path::new(RT).parent().unwrap());
    c.args(["--no-torch", "--quick", "--only", "nvml", "--out", out.to_str().unwrap()]);
    c.env("PATH", path).env("VGPU_TEST_NVML_PROBE", Path::new(RT).parent().unwrap().join("nvml-probe"));
    if around {
        c.env("VGPU_TEST_SMI_AROUND", "1");
    }
    let o = c.output().unwrap();
    let r: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap())
        .unwrap_or_else(|e| panic!("results.json: {e}\n{}", text(&o)));
    (r["checks"][0].clone(), o)
}

#[test]
fn nvidia_smi_in_a_container_names_its_processes_and_where_it_cannot_the_check_says_why() {
    // The 580 branch: nvidia-smi's list in each container is its process; what libvgpu.so did
    // with the list is recorded.
    let (c, o) = nvml_check_with_nvidia_smi("580", false);
    assert_eq!((&c["name"], &c["status"]), (&json!("nvml"), &json!("pass")), "{c}\n{}", text(&o));
    assert_eq!(c["values"]["tool"], "nvidia-smi", "{c}");
    let p = &c["values"]["processes"];
    assert_eq!(p["nvidia_smi_apps"]["memory"], json!([p["container_pid"]]), "{c}");
    assert_eq!(p["nvidia_smi_apps"]["SM-only"], json!([p["sm_only_container_pid"]]), "{c}");
    assert_eq!(p["nvidia_smi_apps"]["outside"].as_array().map(Vec::len), Some(3), "{c}");
    let said = p["nvidia_smi_vgpu_said"]["memory"].to_string();
    assert!(said.contains("1 of its 3 entries are the container's"), "{c}");
    // Another branch: the private table is passed through, nvidia-smi names every process, and
    // the verdict quotes libvgpu.so's reason.
    let (c, o) = nvml_check_with_nvidia_smi("550", false);
    assert_eq!(c["status"], "fail", "{c}\n{}", text(&o));
    let summary = c["summary"].as_str().unwrap();
    assert!(summary.contains("nvidia-smi's compute apps in the memory container"), "{summary}");
    assert!(summary.contains("libvgpu.so said: ") && summary.contains("on driver branch 550"), "{summary}");
    // A list taken around the library: it says nothing, and the verdict gives where the dynamic
    // linker bound NVML's private entry point (here straight to the driver's library).
    let (c, o) = nvml_check_with_nvidia_smi("580", true);
    assert_eq!(c["status"], "fail", "{c}\n{}", text(&o));
    let summary = c["summary"].as_str().unwrap();
    assert!(summary.contains("libvgpu.so said nothing; its NVML bindings: "), "{summary}");
    assert!(summary.contains("libnvidia-ml.so.1 -> libnvidia-ml.so.1: nvmlInternalGetExportTable"), "{summary}");
}

#[test]
fn the_load_check_fails_where_dlvsym_reaches_the_driver() {
    // A driver library without version information answers dlvsym under any version: here a
    // stand-in of its own `cuMemAlloc_v2`, built without version information, that needs the
    // simulated driver for everything else (a dlopen handle's lookups reach its dependencies).
    let s = Sim::new(None);
    let dir = s.state.join("fake-driver");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fake.c"), "int cuMemAlloc_v2(void *p, unsigned long n) { (void)p; (void)n; return 2; }\n")
        .unwrap();
    let lib = dir.join("libfakecuda.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let o = Command::new(&cc)
        .args(["-shared", "-fPIC", "-nostdlib", "-o"])
        .arg(&lib)
        .arg(dir.join("fake.c"))
        .arg("-Wl,--no-as-needed")
        .arg(format!("-L{}", s.libs.display()))
        .arg("-l:libcuda.so.1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
    assert!(o.status.success(), "{}", text(&o));
    let out = s.state.join("results");
    let mut c = s.cmd(run_sh().to_str().unwrap());
    c.arg("--lib").arg(libvgpu()).arg("--bin-dir").arg(Path::new(RT).parent().unwrap());
    c.args(["--no-torch", "--only", "load", "--out", out.to_str().unwrap()]).env("VGPU_CLIENT_LIBCUDA", &lib);
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let load = &r["checks"][0];
    assert_eq!(load["status"], "fail", "{load}");
    let summary = load["summary"].as_str().unwrap();
    assert!(summary.contains("driver_api: ok") && summary.contains("a way around the limit"), "{summary}");
    let base = if cfg!(target_arch = "aarch64") { "GLIBC_2.17" } else { "GLIBC_2.2.5" };
    assert_eq!(
        load["values"]["dlvsym"],
        format!("reaches the driver under libcuda.so.1, libcuda.so, {base}"),
        "{load}"
    );
}

#[test]
fn the_pytorch_checks_pass_against_a_stand_in_for_pytorch_on_the_simulated_gpu() {
    // Contexts as big as PyTorch's on an H200 (610 MiB): the standalone true-up must keep `oom`
    // within its limit, and the agent's true-up `oom-agent`.
    let s = Sim::new(Some("context_overhead_mib = 640\nutil_window_ms = 200\n[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let out = s.state.join("results-torch");
    let stand_in = Path::new(env!("CARGO_MANIFEST_DIR")).join("../torch");
    let checks =
        "load,mem-info,oom,oom-expandable,torch-async,cuda-graph,graph-recapture,sm-30,sm-grids,agent,oom-agent";
    let mut c: Command = s.cmd(run_sh().to_str().unwrap());
    c.env("PYTHONPATH", &stand_in).arg("--lib").arg(libvgpu()).arg("--bin-dir").arg(Path::new(RT).parent().unwrap());
    let o = c.args(["--quick", "--only", checks, "--out", out.to_str().unwrap()]).output().unwrap();
    let log = std::fs::read_to_string(out.join("log.txt")).unwrap_or_default();
    let r: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap())
        .unwrap_or_else(|e| panic!("results.json: {e}\n{}", text(&o)));
    assert_eq!(r["environment"]["torch"], "0.0.0+vgpu.sim", "{}", text(&o));
    let checks: Vec<&Value> = r["checks"].as_array().unwrap().iter().collect();
    assert_eq!(checks.len(), 11, "{}", text(&o));
    for c in &checks {
        assert_eq!(c["status"], "pass", "{c}\n{}\n{}", text(&o), &log[log.len().saturating_sub(6000)..]);
    }
    let get = |name: &str| checks.iter().find(|c| c["name"] == name).unwrap()["values"].clone();
    // The PyTorch forms ran: the matmul workload, torch's out-of-memory error, the async backend.
    assert_eq!(get("sm-30")["workload"], "torch:matmul");
    assert_eq!(get("sm-grids")["workload"], "torch:mixed");
    assert_eq!(get("load")["torch_ld_preload"], "ok");
    assert_eq!(get("oom-agent")["oom_error"], "OutOfMemoryError", "the PyTorch worker ran under the agent");
    let oom = get("oom-expandable");
    assert_eq!(oom["oom_error"], "OutOfMemoryError");
    assert!(oom["nvml_used_at_oom"].as_u64().is_some_and(|u| u <= oom["limit"].as_u64().unwrap()), "{oom}");
    let a = get("torch-async");
    assert_eq!(
        (&a["backend"], &a["beside"]),
        (&Value::from("cudaMallocAsync"), &Value::from("CUDA_ERROR_OUT_OF_MEMORY"))
    );
    // The destroyed graph's memory stays with the driver, charged, until the trim gives it back.
    let kept = a["base"].as_u64().unwrap() - a["emptied"].as_u64().unwrap();
    // (The base had the pool holding the first small tensor's block: the trims free that too.)
    assert_eq!(kept, a["graph_bytes"].as_u64().unwrap(), "{a}");
    assert!(a["trimmed"].as_u64() >= a["base"].as_u64(), "{a}");
    for name in ["cuda-graph", "graph-recapture", "sm-30", "sm-grids"] {
        assert!(get(name)["share_by_paced_pct"].as_f64().is_some(), "{name}: no usable paced reference");
    }
}

//! The agent's MPS mode (docs/mps.md) on the simulated GPU and its stand-in MPS: a control daemon
//! per GPU the configuration names, supervised; slices on it as MPS clients held to their
//! partitions, whatever they ask for.

mod common;
use common::agent::*;
use common::*;

use serde_json::Value;
use std::process::Command;

const CONTROL: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const NODE: &str =
    "context_overhead_mib = 64\ntimeslice_us = 2000\n[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n";

fn mps_agent(s: &Sim) -> Agent {
    Agent::start(s, &[("VGPU_AGENT_MPS_GPUS", "0"), ("VGPU_AGENT_MPS_CONTROL", CONTROL)])
}

/// `args` of the client run in slice `name` through `vgpuctl run`, after `pre` (an `env`
/// assignment the process makes itself, say).
fn in_slice(a: &Agent, s: &Sim, name: &str, pre: &[&str], args: &[&str]) -> Command {
    let mut c = s.cmd(&bin("vgpuctl"));
    c.env("VGPU_SOCKET", &a.socket).env_remove("VGPU_AGENT_CONFIG").args(["run", name, "--", "env"]);
    c.args(pre).arg(RT).args(args);
    c
}

fn launched(mut c: Command) -> Value {
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    lines(&o.stdout).into_iter().find(|v| v["event"] == "launched").expect("a launched line")
}

/// 1320 blocks of `wave_1ms`: ten waves on the whole GPU, `1320 / SMs` on a partition.
const KERNELS: [&str; 7] = ["launch", "--kernel", "wave_1ms", "--grid", "1320", "--block", "128"];

#[test]
fn slices_on_an_mps_gpu_are_clients_held_to_their_partitions() {
    let mut s = Sim::new(Some(NODE));
    let a = mps_agent(&s);
    let v = a.wait("GPU 0's daemon", |v| v["gpus"][0]["mps"]["running"] == true);
    assert!(v["gpus"][1].get("mps").is_none_or(Value::is_null), "GPU 1 runs no MPS: {v}");
    let pipe = v["gpus"][0]["mps"]["pipe_dir"].as_str().unwrap().to_string();
    let text = a.ctl_ok(&["status"]);
    assert!(text.contains(&format!("GPU 0 MPS: daemon running (no server yet), pipe directory {pipe}")), "{text}");
    assert!(pipe.starts_with(a.state.to_str().unwrap()), "under the agent's state directory: {pipe}");
    for (name, sm, mem) in [("m30", "30", "2GiB"), ("m70", "70", "4GiB")] {
        a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--sm", sm, "--memory", mem]);
    }
    let limits = vgpu_region::Region::open(&a.state.join("slices/m30/limits"), false).unwrap();
    assert!(limits.mps(), "the slice's limits file says MPS");
    // A slice reaches one daemon: one GPU.
    let o = a.ctl(&["slice", "create", "--name", "both", "--gpu", "0,1"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("runs MPS"), "{o:?}");

    // Together, at once, in proportion to their partitions (39 and 92 of 132 SMs: 34 and 15 waves).
    let run = |name: &'static str| {
        let c = in_slice(&a, &s, name, &[], &[&KERNELS[..], &["--seconds", "2"]].concat());
        std::thread::spawn(move || launched(c))
    };
    let (k30, k70) = (run("m30"), run("m70"));
    let (k30, k70) = (k30.join().unwrap(), k70.join().unwrap());
    let ratio = k70["kernels"].as_f64().unwrap() / k30["kernels"].as_f64().unwrap();
    assert!((2.0..2.6).contains(&ratio), "70 % against 30 %: {k30} {k70}");

    // A process asking for the whole GPU still gets its slice's 30 %: 34 ms a kernel, not 10.
    let raised = launched(in_slice(
        &a,
        &s,
        "m30",
        &["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100"],
        &[&KERNELS[..], &["--count", "3"]].concat(),
    ));
    let per = raised["gpu_ms"].as_f64().unwrap() / 3.0;
    assert!((33.0..37.0).contains(&per), "held to 30 %: {raised}");

    // NVML lists the slice's process as a client of the GPU's MPS server.
    let (client, _) = s.spawn_cmd(in_slice(&a, &s, "m70", &[], &[]), &["alloc", "--size", "100m", "--hold"]);
    let g = &s.nvml()["gpus"][0];
    let mps: Vec<u64> =
        g["mps_processes"]["Ok"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
    assert!(mps.contains(&(client as u64)), "an MPS client: {g}");
    s.kill(client);

    // A high-priority slice on half the SMs: the normal slices' partitions shrink to fit the half
    // it leaves (30 and 70 of 100 into 50: 15 and 35), so a new process of m30 gets 19 SMs.
    a.ctl_ok(&["slice", "create", "--name", "svc", "--gpu", "0", "--sm", "50", "--priority", "high"]);
    let shrunk = launched(in_slice(&a, &s, "m30", &[], &[&KERNELS[..], &["--count", "2"]].concat()));
    let per = shrunk["gpu_ms"].as_f64().unwrap() / 2.0;
    assert!((68.0..73.0).contains(&per), "70 waves on 19 SMs: {shrunk}");
}

#[test]
fn a_daemon_that_stops_is_started_again_and_an_agent_restart_keeps_it() {
    let s = Sim::new(Some(NODE));
    let mut a = mps_agent(&s);
    let v = a.wait("the daemon", |v| v["gpus"][0]["mps"]["running"] == true);
    let (pipe, log) =
        (v["gpus"][0]["mps"]["pipe_dir"].as_str().unwrap(), v["gpus"][0]["mps"]["log_dir"].as_str().unwrap());
    let ask = |cmd: &str| {
        use std::io::Write;
        let mut c = s.cmd(CONTROL);
        c.env("CUDA_MPS_PIPE_DIRECTORY", pipe).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        child.stdin.take().unwrap().write_all(cmd.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    assert!(ask("quit\n").status.success());
    let v = a.wait("started again", |v| v["gpus"][0]["mps"]["restarts"] == 1 && v["gpus"][0]["mps"]["running"] == true);
    assert_eq!(v["gpus"][0]["mps"]["last_error"], "", "{v}");
    assert!(a.log_text().contains("stopped answering"), "{}", a.log_text());
    let started =
        std::fs::read_to_string(format!("{log}/control.log")).unwrap().matches("Starting control daemon").count();
    assert_eq!(started, 2, "the agent's first start and its restart");
    // The agent restarts; the daemon (in the background) stays, and the new agent takes it over.
    a.sigterm();
    a.spawn(&s);
    let v = a.wait("taken over", |v| v["gpus"][0]["mps"]["running"] == true);
    assert_eq!(v["gpus"][0]["mps"]["restarts"], 0, "not started again: {v}");
    let started =
        std::fs::read_to_string(format!("{log}/control.log")).unwrap().matches("Starting control daemon").count();
    assert_eq!(started, 2, "the running daemon was kept");
    assert!(ask("quit\n").status.success());
}

#[test]
fn a_control_program_that_cannot_run_is_said_in_the_status() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[("VGPU_AGENT_MPS_GPUS", "all"), ("VGPU_AGENT_MPS_CONTROL", "/nonexistent/mps-control")]);
    let v = a.wait("the error", |v| v["gpus"][1]["mps"]["last_error"].as_str().is_some_and(|e| !e.is_empty()));
    let e = v["gpus"][0]["mps"]["last_error"].as_str().unwrap();
    assert!(e.contains("/nonexistent/mps-control"), "{e}");
    assert_eq!(v["gpus"][0]["mps"]["running"], false);
    let text = a.ctl_ok(&["status"]);
    assert!(text.contains("GPU 1 MPS: daemon DOWN: ") && text.contains("/nonexistent/mps-control"), "{text}");
}

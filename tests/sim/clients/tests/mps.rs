//! The simulated node's MPS (docs/design-the-simulated-gpu.md, "MPS"): the stand-in control daemon
//! and server, clients on partitions of the SMs, the pinned memory limit, NVML's lists.

mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

const CONTROL: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
const NODE: &str = "context_overhead_mib = 64\ntimeslice_us = 2000\n[[gpu]]\nmodel = \"H100-80GB\"\n";

/// An MPS control daemon of the node, its pipe and log directories in the node's scratch
/// directory; asked to quit when dropped.
struct Daemon {
    pipe: PathBuf,
    log: PathBuf,
    cmd: Box<dyn Fn() -> Command>,
}

impl Daemon {
    fn start(s: &Sim) -> Daemon {
        let (pipe, log) = (s.state.join("mps-pipe"), s.state.join("mps-log"));
        let (p, l, base) = (pipe.clone(), log.clone(), s.cmd(CONTROL));
        let env: Vec<(String, String)> =
            base.get_envs().filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string()))).collect();
        let cmd = Box::new(move || {
            let mut c = Command::new(CONTROL);
            c.envs(env.iter().map(|(k, v)| (k, v)))
                .env("CUDA_MPS_PIPE_DIRECTORY", &p)
                .env("CUDA_MPS_LOG_DIRECTORY", &l);
            c
        });
        let st = cmd().arg("-d").status().unwrap();
        assert!(st.success(), "the daemon started");
        Daemon { pipe, log, cmd }
    }

    /// Runs control commands; their output.
    fn ask(&self, commands: &str) -> String {
        use std::io::Write;
        let mut c = (self.cmd)();
        c.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        child.stdin.take().unwrap().write_all(commands.as_bytes()).unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{commands}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    /// `bin` as an MPS client of this daemon, with these settings of its own.
    fn client(&self, s: &Sim, bin: &str, env: &[(&str, &str)]) -> Command {
        let mut c = s.cmd(bin);
        c.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe).envs(env.iter().copied());
        c
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.ask("quit\n");
    }
}

fn launched(c: &mut Command, args: &[&str]) -> Value {
    let o = c.args(args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    lines(&o.stdout).into_iter().find(|v| v["event"] == "launched").expect("a launched line")
}

/// Kernels of 1320 blocks of `wave_1ms` (ten waves on the whole GPU) for `secs`.
const WAVES: [&str; 8] = ["launch", "--kernel", "wave_1ms", "--grid", "1320", "--block", "128", "--seconds"];

#[test]
fn clients_run_at_once_each_on_its_share_of_the_sms() {
    let s = Sim::new(Some(NODE));
    let alone = launched(&mut s.cmd(RT), &[&WAVES[..], &["1"]].concat());
    let d = Daemon::start(&s);
    let run = |pct: &'static str| {
        let mut c = d.client(&s, RT, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", pct)]);
        std::thread::spawn(move || launched(&mut c, &[&WAVES[..], &["2"]].concat()))
    };
    let (a, b) = (run("30"), run("70"));
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    let per_s = |v: &Value, secs: f64| v["kernels"].as_f64().unwrap() / secs;
    let (whole, k30, k70) = (per_s(&alone, 1.0), per_s(&a, 2.0), per_s(&b, 2.0));
    // 30 % of 132 SMs is 39 (34 waves a kernel), 70 % is 92 (15 waves): at once, not in turns.
    assert!((2.0..2.6).contains(&(k70 / k30)), "in proportion to the partitions: {a} {b}");
    assert!((0.85..1.15).contains(&((k30 + k70) / whole)), "together about the whole GPU's work: {alone} {a} {b}");
    let log = std::fs::read_to_string(d.log.join("control.log")).unwrap();
    assert_eq!(log.matches("Starting new server").count(), 1, "one server for both: {log}");
    assert_eq!(log.matches("New client").count(), 2, "{log}");
}

#[test]
fn a_client_cannot_raise_its_share_or_memory_above_the_daemon_s() {
    let s = Sim::new(Some(NODE));
    let d = Daemon::start(&s);
    assert_eq!(
        d.ask("set_default_active_thread_percentage 50\nget_default_active_thread_percentage\n"),
        "50.0\n50.0\n"
    );
    d.ask("set_default_device_pinned_mem_limit 0 512M\n");
    // Asking for 100 % of the SMs still gets 50 %: 66 SMs, 20 waves a kernel.
    let v = launched(
        &mut d.client(&s, RT, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")]),
        &["launch", "--kernel", "wave_1ms", "--grid", "1320", "--block", "128", "--count", "5"],
    );
    let per_kernel = v["gpu_ms"].as_f64().unwrap() / 5.0;
    assert!((19.0..22.0).contains(&per_kernel), "20 ms a kernel on half the SMs: {v}");
    // Its own lower setting holds: 25 % is 33 SMs, 40 waves.
    let v = launched(
        &mut d.client(&s, RT, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")]),
        &["launch", "--kernel", "wave_1ms", "--grid", "1320", "--block", "128", "--count", "2"],
    );
    assert!((39.0..43.0).contains(&(v["gpu_ms"].as_f64().unwrap() / 2.0)), "{v}");
    // Memory: the daemon's 512 MiB, whatever the client asks; its own lower limit holds too.
    let allocated = |env: &[(&str, &str)]| {
        let o = d.client(&s, RT, env).args(["alloc", "--size", "2g", "--chunk", "64m"]).output().unwrap();
        let v = lines(&o.stdout);
        v.iter().find_map(|l| l["allocated"].as_u64()).unwrap_or_else(|| panic!("{v:?}"))
    };
    assert_eq!(allocated(&[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4G")]), 448 * MIB, "512 MiB less its context");
    assert_eq!(allocated(&[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "256M")]), 192 * MIB);
}

#[test]
fn nvml_lists_the_server_as_the_gpu_s_process_and_the_clients_as_its_own() {
    let mut s = Sim::new(Some(NODE));
    let d = Daemon::start(&s);
    let (client, _) = s.spawn_cmd(d.client(&s, RT, &[]), &["alloc", "--size", "100m", "--hold"]);
    let (other, _) = s.spawn(RT, &["alloc", "--size", "50m", "--hold"]);
    let server: u32 = d.ask("get_server_list\n").trim().parse().unwrap();
    assert_eq!(d.ask(&format!("get_client_list {server}\n")).trim(), client.to_string());
    let g = &s.nvml()["gpus"][0];
    let pids = |k: &str| -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = g[k]["Ok"]
            .as_array()
            .unwrap_or_else(|| panic!("{k}: {g}"))
            .iter()
            .map(|p| (p["pid"].as_u64().unwrap(), p["used"].as_u64().unwrap()))
            .collect();
        v.sort();
        v
    };
    let mut compute = vec![(server as u64, 64 * MIB), (other as u64, 114 * MIB)];
    compute.sort();
    assert_eq!(pids("processes"), compute, "the server (its context) and the process outside MPS: {g}");
    assert_eq!(pids("mps_processes"), vec![(client as u64, 164 * MIB)], "{g}");
    s.kill(client);
    s.kill(other);
}

//! Priority tenants on a simulated GPU that time-slices between processes (2 ms slices): a service
//! issuing requests at a fixed rate or at random (each one kernel, then a synchronisation) alone, beside a
//! best-effort training-like loop (short kernels, 50 queued between synchronisations) without
//! priority, and beside it with the service's slice at high priority. Per case: the requests' P50,
//! P99 and P99.9 latency and their inflation over the service alone, the loop's kernels a second,
//! and the share of the GPU time the service leaves idle that the loop used. Printed as a Markdown
//! table (docs/benchmarks.md records it).
//!
//! With `--mps`, a second GPU runs MPS (the simulator's stand-in daemon, supervised by the agent):
//! the service and the loop each on a partition of its SMs (`--mps-share`), every kernel a
//! throughput-bound one (`wave_`, one block per SM of the whole GPU, so that a partition takes a
//! wave per its share), and the table adds the service alone in its partition and beside the loop
//! there, with the loop's rate against its partition's alone.
//!
//! usage: priority-bench [--quick] [--seconds S] [--queue-us N] [--mps [--mps-share P]]
//! [--case RATE,KERNEL,LOOP_KERNEL[,poisson]]... (`--help` says more).
//!
//! Uses `vgpu-node-agent`, `vgpuctl`, `cuda-rt-app`, `libvgpu.so` and the simulated libraries built
//! next to this binary (cargo build --release -p vgpu-node-agent -p vgpu-preload -p vgpu-sim-cuda
//! -p vgpu-sim-nvml -p vgpu-sim-clients).
use clap::Parser;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_sim_clients::bench::need;

/// Priority tenants on a time-slicing simulated GPU: a service's request latency alone, beside a
/// best-effort loop, and beside it at high priority.
#[derive(Parser)]
struct Args {
    /// The first standard case only, 1.5 s (CI)
    #[arg(long)]
    quick: bool,
    /// How long each run of a case lasts [default: 8, 1.5 with --quick]
    #[arg(long)]
    seconds: Option<f64>,
    /// The agent's priority_queue_us: what a normal slice keeps queued beside a high-priority one
    #[arg(long, default_value = "100")]
    queue_us: u32,
    /// A case to run instead of the standard ones (repeatable), e.g. 100,sleep_500us,sleep_100us;
    /// `poisson`: requests arrive at random at that mean rate
    #[arg(long = "case", value_name = "RATE,KERNEL,LOOP_KERNEL[,poisson]", value_parser = parse_case)]
    cases: Vec<Case>,
    /// Also run each case on a second GPU under MPS, the service and the loop on partitions
    #[arg(long)]
    mps: bool,
    /// With --mps: the service's share of the SMs (percent); the loop has the rest
    #[arg(long, default_value = "50", value_parser = clap::value_parser!(u32).range(1..100))]
    mps_share: u32,
}

/// The simulated GPU's SMs (an H100): a `wave_` kernel of this many blocks takes its nominal time
/// on the whole GPU.
const SMS: u32 = 132;

/// How long a simulator kernel of that name runs, in seconds.
fn kernel_s(name: &str) -> f64 {
    let digits: String = name.chars().filter(char::is_ascii_digit).collect();
    let n: f64 = digits.parse().expect("a kernel of a duration");
    n * if name.ends_with("us") { 1e-6 } else { 1e-3 }
}

struct Node {
    work: PathBuf,
    libs: PathBuf,
    ctl: PathBuf,
    app: PathBuf,
    agent: Child,
    /// Kernels as `wave_` ones of a block per SM (`--mps`), rather than as named.
    waves: bool,
}

/// `bin` on the simulated node in `work`, with the simulated libraries in `libs`.
fn on_node(bin: &Path, work: &Path, libs: &Path) -> Command {
    let mut c = Command::new(bin);
    c.env("LD_LIBRARY_PATH", libs)
        .env("VGPU_SIM_STATE", work.join("node"))
        .env("VGPU_SIM_CONFIG", work.join("node.toml"))
        .env("VGPU_SOCKET", work.join("agent.sock"))
        .env_remove("CUDA_VISIBLE_DEVICES");
    c
}

impl Node {
    fn cmd(&self, bin: &Path) -> Command {
        on_node(bin, &self.work, &self.libs)
    }

    fn ctl(&self, args: &[&str]) -> String {
        let o = self.cmd(&self.ctl).args(args).output().unwrap();
        assert!(o.status.success(), "vgpuctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    /// `cuda-rt-app ARGS` in slice `slice`, on this host.
    fn run_in(&self, slice: &str, args: &[&str]) -> Command {
        let mut c = self.cmd(&self.ctl);
        c.args(["run", slice, "--"]).arg(&self.app).args(args).stdout(Stdio::piped());
        c
    }

    /// A kernel's name and grid as run: a `wave_` kernel of a block per SM where kernels are waves.
    fn kernel(&self, name: &str) -> (String, String) {
        if self.waves {
            (name.replacen("sleep_", "wave_", 1), SMS.to_string())
        } else {
            (name.to_string(), "1".into())
        }
    }

    /// The best-effort loop in slice `batch` for `secs`: `kernel`s, 50 queued between
    /// synchronisations.
    fn batch_loop(&self, batch: &str, kernel: &str, secs: f64) -> Child {
        let (secs, (kernel, grid)) = (secs.to_string(), self.kernel(kernel));
        let args = ["launch", "--kernel", &kernel, "--grid", &grid, "--seconds", &secs, "--sync-every", "50"];
        self.run_in(batch, &args).spawn().unwrap()
    }
}

/// The kernels a second a finished loop ran.
fn kernels_per_s(c: Child) -> f64 {
    let v = last(c);
    v["kernels"].as_f64().unwrap() / (v["wall_ms"].as_f64().unwrap() / 1e3)
}

fn start(queue_us: u32, mps_share: Option<u32>) -> Node {
    let dir = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let (agent_bin, ctl, app) =
        (need(dir.join("vgpu-node-agent")), need(dir.join("vgpuctl")), need(dir.join("cuda-rt-app")));
    let libvgpu = need(dir.join("libvgpu.so"));
    let libs = vgpu_sim_clients::bench::sim_libs(&dir);
    let work = std::env::temp_dir().join(format!("vgpu-priority-bench-{}", std::process::id()));
    std::fs::create_dir_all(work.join("node")).unwrap();
    let gpu = "[[gpu]]\nmodel = \"H100-80GB\"\n";
    let gpus = if mps_share.is_some() { format!("{gpu}{gpu}") } else { gpu.to_string() };
    std::fs::write(work.join("node.toml"), format!("timeslice_us = 2000\ncontext_overhead_mib = 64\n{gpus}")).unwrap();
    let mut c = on_node(&agent_bin, &work, &libs);
    // No device plugin: a kubelet on this machine (the Kubernetes test's) is not this agent's.
    c.env("VGPU_AGENT_LIBRARY", &libvgpu)
        .env("VGPU_AGENT_DEVICE_PLUGIN", "off")
        .env("VGPU_AGENT_PRIORITY_QUEUE_US", queue_us.to_string())
        .env("VGPU_AGENT_CDI_DIR", work.join("cdi"))
        .args(["--state-dir", work.join("state").to_str().unwrap()])
        .args(["--socket", work.join("agent.sock").to_str().unwrap(), "--metrics-address", "off", "--nvml-library"])
        .arg(libs.join("libnvidia-ml.so.1"))
        .arg("run")
        .stderr(std::fs::File::create(work.join("agent.log")).unwrap());
    if mps_share.is_some() {
        c.env("VGPU_AGENT_MPS_GPUS", "1").env("VGPU_AGENT_MPS_CONTROL", need(dir.join("nvidia-cuda-mps-control")));
    }
    let n = Node { agent: c.spawn().unwrap(), work, libs, ctl, app, waves: mps_share.is_some() };
    let t = Instant::now();
    while !n.cmd(&n.ctl).arg("status").output().unwrap().status.success() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the agent did not start: {}",
            n.work.join("agent.log").display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    n.ctl(&["slice", "create", "--name", "svc", "--gpu", "0"]);
    n.ctl(&["slice", "create", "--name", "batch", "--gpu", "0"]);
    if let Some(share) = mps_share {
        let wait = Instant::now();
        while !n.ctl(&["status"]).contains("GPU 1 MPS: daemon running") {
            assert!(wait.elapsed() < Duration::from_secs(10), "no MPS daemon: {}", n.work.join("agent.log").display());
            std::thread::sleep(Duration::from_millis(50));
        }
        n.ctl(&["slice", "create", "--name", "svc-mps", "--gpu", "1", "--sm", &share.to_string()]);
        n.ctl(&["slice", "create", "--name", "batch-mps", "--gpu", "1", "--sm", &(100 - share).to_string()]);
    }
    n
}

impl Drop for Node {
    /// The agent goes with the benchmark, however it ends.
    fn drop(&mut self) {
        let _ = self.agent.kill();
        let _ = self.agent.wait();
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// The last JSON line a process printed.
fn last(c: Child) -> Value {
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    serde_json::from_str(out.lines().last().expect("a result line")).unwrap()
}

/// One comparison: the service's requests (a rate, their kernel, how they arrive) beside the loop's
/// kernel.
#[derive(Clone)]
struct Case {
    rate: f64,
    kernel: String,
    loop_kernel: String,
    poisson: bool,
}

impl Case {
    fn new(rate: f64, kernel: &str, loop_kernel: &str, poisson: bool) -> Case {
        Case { rate, kernel: kernel.into(), loop_kernel: loop_kernel.into(), poisson }
    }

    /// The rate column: the rate, and "poisson" for random arrivals.
    fn requests(&self) -> String {
        format!("{}/s{}", self.rate, if self.poisson { " poisson" } else { "" })
    }
}

/// The service's latencies over `secs` for case `c`, beside the loop or alone; and the loop's
/// kernels a second.
/// `(svc, batch)` are the slices (the time-sliced GPU's, or the MPS one's).
fn run_case(n: &Node, c: &Case, (svc, batch): (&str, &str), with_loop: bool, secs: f64) -> (Value, f64) {
    let be = with_loop.then(|| n.batch_loop(batch, &c.loop_kernel, secs + 1.0));
    if be.is_some() {
        std::thread::sleep(Duration::from_millis(500));
    }
    let arrivals = if c.poisson { "poisson" } else { "fixed" };
    let (rate, secs, (kernel, grid)) = (c.rate.to_string(), secs.to_string(), n.kernel(&c.kernel));
    let args =
        ["serve", "--rate", &rate, "--seconds", &secs, "--kernel", &kernel, "--grid", &grid, "--arrivals", arrivals];
    let svc = n.run_in(svc, &args).spawn().unwrap();
    let served = last(svc);
    (served, be.map_or(0.0, kernels_per_s))
}

/// `RATE,KERNEL,LOOP_KERNEL[,poisson]` of `--case`.
fn parse_case(v: &str) -> Result<Case, String> {
    let parts: Vec<&str> = v.split(',').collect();
    let kernel_ok = |k: &str| {
        (k.starts_with("sleep_") || k.starts_with("wave_"))
            && (k.ends_with("us") || k.ends_with("ms"))
            && k.chars().any(|c| c.is_ascii_digit())
    };
    let rate_ok = |r: &str| r.parse::<f64>().is_ok_and(|r| r > 0.0);
    match parts[..] {
        [r, k, b] if rate_ok(r) && kernel_ok(k) && kernel_ok(b) => Ok(Case::new(r.parse().unwrap(), k, b, false)),
        [r, k, b, "poisson"] if rate_ok(r) && kernel_ok(k) && kernel_ok(b) => {
            Ok(Case::new(r.parse().unwrap(), k, b, true))
        }
        _ => Err("not RATE,KERNEL,LOOP_KERNEL[,poisson] (a rate in requests a second over 0, kernels as \
                  sleep_<N>us|ms or wave_<N>us|ms, e.g. 100,sleep_500us,sleep_100us)"
            .into()),
    }
}

/// The standard cases: fixed-rate requests at two rates and two kernel sizes beside loops of three
/// kernel sizes, and random arrivals beside the shortest and the longest loop kernels.
fn standard(quick: bool) -> Vec<Case> {
    if quick {
        return vec![Case::new(100.0, "sleep_500us", "sleep_100us", false)];
    }
    vec![
        Case::new(100.0, "sleep_500us", "sleep_100us", false),
        Case::new(400.0, "sleep_500us", "sleep_100us", false),
        Case::new(100.0, "sleep_2ms", "sleep_100us", false),
        Case::new(100.0, "sleep_500us", "sleep_50us", false),
        Case::new(100.0, "sleep_500us", "sleep_500us", false),
        Case::new(100.0, "sleep_500us", "sleep_50us", true),
        Case::new(100.0, "sleep_500us", "sleep_500us", true),
    ]
}

/// The cases the MPS comparison adds: random arrivals of 50 and 100 requests a second, of 500 us
/// and 2 ms, beside loops of 100 us, 1 ms and 10 ms kernels.
fn mps_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for rate in [50.0, 100.0] {
        for kernel in ["sleep_500us", "sleep_2ms"] {
            for loop_kernel in ["sleep_100us", "sleep_1ms", "sleep_10ms"] {
                v.push(Case::new(rate, kernel, loop_kernel, true));
            }
        }
    }
    v
}

/// One row of the table.
struct Row<'a> {
    case: &'a Case,
    name: &'a str,
    served: &'a Value,
    /// The service's P99 alone on the whole GPU, and alone in its partition (MPS rows).
    whole_p99: f64,
    part_p99: Option<f64>,
    loop_col: String,
    share_col: String,
}

fn print_row(r: &Row) {
    let q = |k: &str| r.served[k].as_f64().unwrap();
    let vs = |base: f64| format!("{:+.1} %", 100.0 * (q("p99_us") / base - 1.0));
    println!(
        "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} |",
        r.case.requests(),
        r.case.kernel,
        r.case.loop_kernel,
        r.name,
        q("p50_us"),
        q("p99_us"),
        q("p999_us"),
        vs(r.whole_p99),
        r.part_p99.map_or("-".into(), vs),
        r.loop_col,
        r.share_col,
    );
}

/// Case `c`'s rows: alone, beside the loop without and with priority on the time-sliced GPU, and
/// (with `mps`) alone in its partition and beside the loop in the other on the MPS GPU.
fn run_rows(n: &Node, c: &Case, secs: f64, mps: bool) {
    // The loop alone, for its full rate.
    let full = kernels_per_s(n.batch_loop("batch", &c.loop_kernel, secs));
    let idle = (1.0 - c.rate * kernel_s(&c.kernel)).max(0.0);
    let plain = ("svc", "batch");
    n.ctl(&["slice", "update", "svc", "--priority", "normal"]);
    let (alone, _) = run_case(n, c, plain, false, secs);
    let (shared, be_shared) = run_case(n, c, plain, true, secs);
    n.ctl(&["slice", "update", "svc", "--priority", "high"]);
    std::thread::sleep(Duration::from_millis(100));
    let (gated, be_gated) = run_case(n, c, plain, true, secs);
    let whole_p99 = alone["p99_us"].as_f64().unwrap();
    let share_of_idle = |r: f64| format!("{:.0} % of the idle time", 100.0 * r / full / idle.max(1e-9));
    let row = |name, served, loop_col, share_col, part_p99| {
        print_row(&Row { case: c, name, served, whole_p99, part_p99, loop_col, share_col })
    };
    row("alone", &alone, format!("({full:.0} alone)"), "-".into(), None);
    row("no priority", &shared, format!("{be_shared:.0}"), share_of_idle(be_shared), None);
    row("high priority", &gated, format!("{be_gated:.0}"), share_of_idle(be_gated), None);
    if mps {
        let parts = ("svc-mps", "batch-mps");
        let part_full = kernels_per_s(n.batch_loop("batch-mps", &c.loop_kernel, secs));
        let (part_alone, _) = run_case(n, c, parts, false, secs);
        let (beside, be) = run_case(n, c, parts, true, secs);
        let part_p99 = part_alone["p99_us"].as_f64();
        let of_part = format!("{:.0} % of its partition alone", 100.0 * be / part_full.max(1e-9));
        row("MPS: alone in its partition", &part_alone, format!("({part_full:.0} alone)"), "-".into(), part_p99);
        row("MPS: beside the loop", &beside, format!("{be:.0}"), of_part, part_p99);
        // The service's slice at high priority too: its launch gate on the loop, beside the
        // partitions (which already keep the loop off the service's SMs).
        n.ctl(&["slice", "update", "svc-mps", "--priority", "high"]);
        std::thread::sleep(Duration::from_millis(100));
        let (gated, be) = run_case(n, c, parts, true, secs);
        n.ctl(&["slice", "update", "svc-mps", "--priority", "normal"]);
        let of_part = format!("{:.0} % of its partition alone", 100.0 * be / part_full.max(1e-9));
        row("MPS: beside, high priority", &gated, format!("{be:.0}"), of_part, part_p99);
    }
}

fn main() {
    let args = Args::parse();
    let secs = args.seconds.unwrap_or(if args.quick { 1.5 } else { 8.0 });
    let queue_us = args.queue_us;
    let standard_run = args.cases.is_empty();
    let mut cases = if standard_run { standard(args.quick) } else { args.cases };
    if args.mps && standard_run && !args.quick {
        cases.extend(mps_cases());
    }
    let n = start(queue_us, args.mps.then_some(args.mps_share));
    print!("simulated GPU, 2 ms timeslice; normal slices' queue bound {queue_us} us; {secs} s per case");
    if args.mps {
        print!(
            "; MPS on a second GPU: the service's partition {} % of the SMs, the loop's {} %; every kernel \
             `wave_` of {SMS} blocks",
            args.mps_share,
            100 - args.mps_share
        );
    }
    println!("\n");
    println!("| requests | request kernel | loop kernel | case | P50 us | P99 us | P99.9 us | P99 vs alone | P99 vs alone in its partition | loop kernels/s | loop's share |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for c in &cases {
        run_rows(&n, c, secs, args.mps);
    }
}

//! The SM-limit accuracy harness: runs "containers" (processes with libvgpu.so preloaded, one region
//! each) on a private simulated node and measures what each achieved from the simulator's kernel
//! timeline, in simulated device time (no host timing).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use vgpu_sim::{now_ns, Config, Node};

#[derive(Clone, Debug)]
pub struct Container {
    /// SM percent per GPU (index = GPU).
    pub limits: Vec<u32>,
    pub processes: usize,
    /// Client arguments after `launch` (kernel, path, device...).
    pub args: Vec<String>,
    pub policy: Option<&'static str>,
}

#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: String,
    pub containers: Vec<Container>,
    pub seconds: f64,
    /// Change container 0's limit on GPU 0 to this value at `change_at` seconds.
    pub change: Option<(f64, u32)>,
}

#[derive(Clone, Debug)]
pub struct Outcome {
    /// Per container and GPU: share over the measured period (after the first second).
    pub overall: Vec<Vec<f64>>,
    /// Per container and GPU: shares of each whole 1 s window after the first second.
    pub windows: Vec<Vec<Vec<f64>>>,
}

pub struct Harness {
    pub bin_dir: PathBuf,
    pub libvgpu: PathBuf,
    pub lib_dir: PathBuf,
    pub dir: PathBuf,
    /// The node description (`NODE`, or with settings of the test's before it).
    node: String,
}

const NODE: &str =
    "context_overhead_mib = 1\nutil_window_ms = 1000\n[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n";

impl Harness {
    pub fn new(bin_dir: &Path, libvgpu: &Path, lib_dir: &Path) -> Harness {
        Harness::with_node(bin_dir, libvgpu, lib_dir, "")
    }

    /// A harness whose simulated node also has `settings` (top-level lines of the node
    /// description, such as `launch_host_us = 40`).
    pub fn with_node(bin_dir: &Path, libvgpu: &Path, lib_dir: &Path, settings: &str) -> Harness {
        let dir = std::env::temp_dir().join(format!("vgpu-accuracy-{}-{}", std::process::id(), now_ns()));
        std::fs::create_dir_all(&dir).unwrap();
        let node = format!("{settings}\n{NODE}");
        std::fs::write(dir.join("node.toml"), &node).unwrap();
        Harness { bin_dir: bin_dir.into(), libvgpu: libvgpu.into(), lib_dir: lib_dir.into(), dir, node }
    }

    fn node(&self) -> Node {
        Node::open(Config::parse(&self.node).unwrap(), &self.dir.join("state")).unwrap()
    }

    pub fn run(&self, sc: &Scenario, index: usize) -> Outcome {
        let node = self.node();
        let start = now_ns();
        let mut kids: Vec<(usize, Child)> = Vec::new();
        for (ci, c) in sc.containers.iter().enumerate() {
            let region = self.dir.join(format!("s{index}-c{ci}.region"));
            let _ = std::fs::remove_file(&region);
            for p in 0..c.processes {
                let mut cmd =
                    Command::new(self.bin_dir.join(if p % 2 == 0 { "cuda-rt-app" } else { "cuda-direct-app" }));
                cmd.env("LD_LIBRARY_PATH", &self.lib_dir)
                    .env("VGPU_SIM_STATE", self.dir.join("state"))
                    .env("VGPU_SIM_CONFIG", self.dir.join("node.toml"))
                    .env("LD_PRELOAD", &self.libvgpu)
                    .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &region)
                    .env("VGPU_CONTEXT_OVERHEAD", "1m")
                    .stdout(Stdio::null());
                for (g, l) in c.limits.iter().enumerate() {
                    cmd.env(format!("CUDA_DEVICE_SM_LIMIT_{g}"), l.to_string());
                }
                if let Some(p) = c.policy {
                    cmd.env("GPU_CORE_UTILIZATION_POLICY", p);
                }
                cmd.arg("launch").args(&c.args).args(["--seconds", &sc.seconds.to_string()]);
                kids.push((ci, cmd.spawn().expect("spawn client")));
            }
        }
        if let Some((at, pct)) = sc.change {
            std::thread::sleep(Duration::from_secs_f64(at));
            let r = vgpu_region::Region::open(&self.dir.join(format!("s{index}-c0.region")), true).unwrap();
            r.set_sm_limit(0, pct).unwrap();
        }
        let pids: Vec<(usize, u32)> = kids.iter().map(|(c, k)| (*c, k.id())).collect();
        // The timeline is a ring: collect it while the clients run, so fast kernels are not lost.
        let mut seen: [std::collections::BTreeMap<(u64, u32), u64>; 2] = Default::default();
        let mut collect = |node: &Node| {
            for (gpu, m) in seen.iter_mut().enumerate() {
                let from = m.keys().next_back().map_or(start, |(s, _)| s.saturating_sub(50_000_000));
                for (s, e, p) in node.kernels_since(gpu, from) {
                    m.insert((s, p), e);
                }
            }
        };
        loop {
            std::thread::sleep(Duration::from_millis(200));
            collect(&node);
            if kids.iter_mut().all(|(_, k)| k.try_wait().ok().flatten().is_some()) {
                break;
            }
        }
        collect(&node);
        let t0 = start + 1_000_000_000;
        let end = start + (sc.seconds * 1e9) as u64;
        let n = sc.containers.len();
        let mut overall = vec![vec![0.0; 2]; n];
        let mut windows = vec![vec![Vec::new(); 2]; n];
        for gpu in 0..2 {
            let k: Vec<(u64, u64, u32)> = seen[gpu].iter().map(|((s, p), e)| (*s, *e, *p)).collect();
            let busy = |ci: usize, a: u64, b: u64| -> f64 {
                let ours: Vec<u32> = pids.iter().filter(|(c, _)| *c == ci).map(|(_, p)| *p).collect();
                let t: u64 = k
                    .iter()
                    .filter(|(_, _, p)| ours.contains(p))
                    .map(|(s, e, _)| (*e).min(b).saturating_sub((*s).max(a)))
                    .sum();
                t as f64 / (b - a) as f64
            };
            for ci in 0..n {
                overall[ci][gpu] = busy(ci, t0, end);
                let mut w = t0;
                while w + 1_000_000_000 <= end {
                    windows[ci][gpu].push(busy(ci, w, w + 1_000_000_000));
                    w += 1_000_000_000;
                }
            }
        }
        Outcome { overall, windows }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn container(limit: u32, kernel: &str, extra: &[&str]) -> Container {
    let mut args = vec!["--kernel".to_string(), kernel.to_string()];
    args.extend(extra.iter().map(|s| s.to_string()));
    Container { limits: vec![limit, 0], processes: 1, args, policy: None }
}

//! Helpers for process tests against the simulated GPU: a private node per test (state directory and
//! node description), the simulated libraries on LD_LIBRARY_PATH, JSON-speaking clients.
#![allow(dead_code)]

pub mod agent;
pub mod kubeapi;
pub mod kubelet;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

pub const RT: &str = env!("CARGO_BIN_EXE_cuda-rt-app");
pub const DIRECT: &str = env!("CARGO_BIN_EXE_cuda-direct-app");
pub const DLSYM: &str = env!("CARGO_BIN_EXE_cuda-dlsym-app");
pub const SIM: &str = env!("CARGO_BIN_EXE_vgpu-sim");
pub const NVML: &str = env!("CARGO_BIN_EXE_nvml-probe");
/// The C client that only starts: a context, one 1 MiB allocation, "ok", an optional hold.
pub const START: &str = env!("VGPU_CUDA_START");

/// Directory holding `libcuda.so.1` and `libnvidia-ml.so.1` (symlinks to the freshly built cdylibs).
pub fn lib_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(make_lib_dir).clone()
}

fn make_lib_dir() -> PathBuf {
    let bin = Path::new(RT).parent().unwrap().to_path_buf();
    let dir = bin.join("sim-lib");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, file) in [("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia_ml.so")] {
        let target = bin.join("deps").join(file);
        assert!(
            target.exists(),
            "{} is missing: build the workspace (cargo test --workspace builds it)",
            target.display()
        );
        let tmp = dir.join(format!("{name}.{}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
    dir
}

/// The built interposer.
pub fn libvgpu() -> PathBuf {
    let p = Path::new(RT).parent().unwrap().join("deps").join("libvgpu.so");
    assert!(p.exists(), "{} is missing: build the workspace", p.display());
    p
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// One simulated node, private to a test.
pub struct Sim {
    pub state: PathBuf,
    pub config: Option<PathBuf>,
    pub libs: PathBuf,
    children: Vec<Child>,
}

impl Sim {
    pub fn new(config: Option<&str>) -> Sim {
        let state = std::env::temp_dir().join(format!(
            "vgpu-sim-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).unwrap();
        let config = config.map(|c| {
            let p = state.with_extension("toml");
            std::fs::write(&p, c).unwrap();
            p
        });
        Sim { state, config, libs: lib_dir(), children: Vec::new() }
    }

    /// `bin` on this node. An agent started this way has a kubelet directory of its own under the
    /// node's (a test may name another): never the host's, where a real kubelet may be listening.
    pub fn cmd(&self, bin: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("LD_LIBRARY_PATH", &self.libs).env("VGPU_SIM_STATE", &self.state).env_remove("CUDA_VISIBLE_DEVICES");
        c.env("VGPU_AGENT_KUBELET_DIR", self.kubelet_dir()).env_remove("NVIDIA_VISIBLE_DEVICES");
        match &self.config {
            Some(p) => c.env("VGPU_SIM_CONFIG", p),
            None => c.env_remove("VGPU_SIM_CONFIG"),
        };
        c
    }

    /// The device-plugin directory of this node's kubelet (made by the tests that serve one).
    pub fn kubelet_dir(&self) -> PathBuf {
        self.state.join("kubelet").join("device-plugins")
    }

    /// The container's region file for this node.
    pub fn region_path(&self) -> PathBuf {
        self.state.join("container.region")
    }

    /// `bin` as a process of the agent's slice whose directory is `dir` (what the agent's injection
    /// gives a container: libvgpu.so, the slice's region and read-only limits), charging `overhead`
    /// per context.
    pub fn in_slice(&self, bin: &str, dir: &Path, overhead: &str) -> Command {
        let mut c = self.cmd(bin);
        c.env("LD_PRELOAD", libvgpu())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("region"))
            .env("VGPU_LIMITS_FILE", dir.join("limits"))
            .env("VGPU_CONTEXT_OVERHEAD", overhead);
        c
    }

    /// [`in_slice`](Self::in_slice) for a process that charges nothing for its context and does
    /// not true itself up at its creation: all that its context holds is the agent's to charge.
    pub fn in_slice_uncharged(&self, bin: &str, dir: &Path) -> Command {
        let mut c = self.in_slice(bin, dir, "0");
        c.env("VGPU_MEMORY_TRUE_UP", "0");
        c
    }

    /// A client inside a "container": libvgpu.so preloaded, the region, and the given environment.
    pub fn limited(&self, bin: &str, env: &[(&str, &str)]) -> Command {
        let mut c = self.cmd(bin);
        c.env("LD_PRELOAD", libvgpu())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", self.region_path())
            .env("VGPU_CONTEXT_OVERHEAD", "64m")
            .env_remove("CUDA_DEVICE_MEMORY_LIMIT")
            .env_remove("LIBCUDA_LOG_LEVEL")
            .env_remove("VGPU_FAIL_OPEN");
        for (k, v) in env {
            c.env(k, v);
        }
        c
    }

    pub fn output(&self, bin: &str, args: &[&str]) -> Output {
        self.cmd(bin).args(args).output().unwrap()
    }

    /// Runs a client to completion, expecting success; returns its JSON lines.
    pub fn run(&self, bin: &str, args: &[&str]) -> Vec<Value> {
        let o = self.output(bin, args);
        assert!(
            o.status.success(),
            "{bin} {args:?} failed: {}\nstdout: {}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        lines(&o.stdout)
    }

    /// The single JSON line of a client run.
    pub fn run1(&self, bin: &str, args: &[&str]) -> Value {
        let mut v = self.run(bin, args);
        assert!(!v.is_empty(), "{bin} {args:?} printed nothing");
        v.remove(0)
    }

    /// Starts a client and waits for its first JSON line (e.g. `alloc --hold`).
    pub fn spawn(&mut self, bin: &str, args: &[&str]) -> (u32, Value) {
        let c = self.cmd(bin);
        self.spawn_cmd(c, args)
    }

    /// Starts a prepared command and waits for its first JSON line.
    pub fn spawn_cmd(&mut self, cmd: Command, args: &[&str]) -> (u32, Value) {
        self.spawn_until(cmd, args, None)
    }

    /// [`spawn_cmd`](Self::spawn_cmd), reading lines until one whose `event` is `event` (None: the
    /// first line), which it returns.
    pub fn spawn_until(&mut self, mut cmd: Command, args: &[&str], event: Option<&str>) -> (u32, Value) {
        let mut child = cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let mut out: BufReader<ChildStdout> = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            out.read_line(&mut line).unwrap();
            assert!(!line.is_empty(), "{cmd:?} {args:?} exited before printing {event:?}");
            let v: Value = serde_json::from_str(&line).unwrap();
            if event.is_none_or(|e| v["event"] == e) {
                break;
            }
        }
        let pid = child.id();
        self.children.push(child);
        // Keep the pipe open (the child may print more) by leaking the reader into a thread.
        std::thread::spawn(move || for _ in out.lines() {});
        (pid, serde_json::from_str(&line).unwrap())
    }

    /// SIGKILLs a spawned child and reaps it.
    pub fn kill(&mut self, pid: u32) {
        let i = self.children.iter().position(|c| c.id() == pid).expect("not a child");
        let mut c = self.children.remove(i);
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn status(&self) -> Value {
        serde_json::from_slice(&self.output(SIM, &["status"]).stdout).unwrap()
    }

    pub fn nvml(&self) -> Value {
        let lib = self.libs.join("libnvidia-ml.so.1");
        let o = self.output(NVML, &["--lib", lib.to_str().unwrap(), "snapshot"]);
        assert!(o.status.success(), "nvml-probe: {}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    }

    /// Runs MIG operations on GPU `gpu` through NVML; returns one JSON object per operation.
    pub fn mig(&self, gpu: u32, ops: &[&str]) -> Vec<Value> {
        let lib = self.libs.join("libnvidia-ml.so.1");
        let g = gpu.to_string();
        let mut args = vec!["--lib", lib.to_str().unwrap(), "mig", "--gpu", &g];
        args.extend_from_slice(ops);
        self.run(NVML, &args)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.state);
        if let Some(c) = &self.config {
            let _ = std::fs::remove_file(c);
        }
    }
}

pub fn lines(b: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(b)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON {l:?}: {e}")))
        .collect()
}

pub const MIB: u64 = 1 << 20;

/// Says that a check could not run on this machine: on stderr, and as a line of the file named by
/// `VGPU_SKIP_LOG` (what `scripts/test.sh` counts as skipped, never as passed).
pub fn skipped(what: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    eprintln!("SKIPPED: {what}");
    if let Some(log) = std::env::var_os("VGPU_SKIP_LOG") {
        use std::io::Write;
        // One write of the whole line: appends from tests running at once do not interleave.
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(format!("{} {test}: {what}\n", env!("CARGO_CRATE_NAME")).as_bytes());
        }
    }
}

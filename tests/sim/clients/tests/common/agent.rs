//! The agent as a process for tests: started on a test's simulated node, driven with `vgpuctl`,
//! scraped over HTTP, killed and restarted.

use super::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub fn bin(name: &str) -> String {
    let p = Path::new(RT).parent().unwrap().join(name);
    assert!(p.exists(), "{} is built with the workspace", p.display());
    p.display().to_string()
}

pub struct Agent {
    child: Option<Child>,
    pub state: PathBuf,
    pub socket: PathBuf,
    pub metrics: String,
    pub log: PathBuf,
    pub env: Vec<(String, String)>,
    /// The open-file limit (soft and hard) the agent starts with; None: this process's.
    pub nofile: Option<u64>,
}

impl Agent {
    pub fn start(s: &Sim, env: &[(&str, &str)]) -> Agent {
        Agent::start_with_nofile(s, env, None)
    }

    /// [`start`](Self::start) with an open-file limit of `nofile` (soft and hard).
    pub fn start_with_nofile(s: &Sim, env: &[(&str, &str)], nofile: Option<u64>) -> Agent {
        let state = s.state.join("agent");
        let mut a = Agent {
            child: None,
            socket: s.state.join("run").join("agent.sock"),
            // Port 0: the agent takes a free port, asked for once it is ready, and keeps it across
            // restarts (a port found free and then handed over could be taken in between).
            metrics: "127.0.0.1:0".to_string(),
            log: s.state.join("agent.log"),
            state,
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            nofile,
        };
        a.spawn(s);
        a
    }

    pub fn spawn(&mut self, s: &Sim) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut c = s.cmd(&bin("vgpu-node-agent"));
        c.env("VGPU_AGENT_MONITOR_INTERVAL_MS", "50")
            .env("VGPU_AGENT_LOG_FORMAT", "json")
            .env("VGPU_AGENT_LIBRARY", libvgpu())
            .env("VGPU_AGENT_CDI_DIR", self.state.join("cdi"))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .args(["--state-dir", self.state.to_str().unwrap(), "--socket", self.socket.to_str().unwrap()])
            .args(["--metrics-address", &self.metrics, "--nvml-library"])
            .arg(s.libs.join("libnvidia-ml.so.1"))
            .arg("run")
            .stderr(log);
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                c.pre_exec(move || {
                    let l = libc::rlimit { rlim_cur: n, rlim_max: n };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &l) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        self.child = Some(c.spawn().unwrap());
        self.wait("ready", |v| v["sequence"].as_u64().unwrap_or(0) > 0);
        if self.metrics.ends_with(":0") {
            self.metrics = self.bound_metrics();
        }
    }

    /// The address the agent serves its metrics on, as its health answer says.
    fn bound_metrics(&self) -> String {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let h = rt.block_on(async {
            let mut c = vgpu_agent::api::connect(&self.socket).await.expect("the agent's socket");
            c.health(vgpu_proto::v1::HealthRequest {}).await.expect("the agent's health").into_inner()
        });
        assert!(!h.metrics_address.is_empty(), "the agent serves no metrics:\n{}", self.log_text());
        h.metrics_address
    }

    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(bin("vgpuctl"))
            .env("VGPU_SOCKET", &self.socket)
            .env_remove("VGPU_AGENT_CONFIG")
            .args(args)
            .output()
            .unwrap()
    }

    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let o = self.ctl(args);
        assert!(o.status.success(), "vgpuctl {args:?}: {}\n{}", String::from_utf8_lossy(&o.stderr), self.log_text());
        String::from_utf8(o.stdout).unwrap()
    }

    pub fn status(&self) -> Option<Value> {
        let o = self.ctl(&["status", "--json"]);
        o.status.success().then(|| serde_json::from_slice(&o.stdout).unwrap())
    }

    pub fn wait(&self, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let t = Instant::now();
        loop {
            if let Some(v) = self.status() {
                if f(&v) {
                    return v;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "timed out waiting for {what}: {:?}\n{}",
                self.status(),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn sigkill(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().unwrap();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait().unwrap()
    }

    pub fn scrape(&self, path: &str) -> (String, String) {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&self.metrics).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        c.read_to_string(&mut r).unwrap();
        let (head, body) = r.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_string(), body.to_string())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A command in a slice as a container would run: the injection's environment, with container
/// paths mapped back through its mounts (the test runs on the host).
pub fn in_slice(s: &Sim, detail: &Value, bin: &str) -> Command {
    let mut c = s.cmd(bin);
    let mounts = detail["mounts"].as_array().unwrap();
    let cp = |m: &Value| m["container_path"].as_str().unwrap().to_string();
    let hp = |m: &Value| m["host_path"].as_str().unwrap().to_string();
    let host = |v: &str| -> String {
        if let Some(m) = mounts.iter().filter(|m| v.starts_with(cp(m).as_str())).max_by_key(|m| cp(m).len()) {
            return v.replacen(&cp(m), &hp(m), 1);
        }
        // A folder that holds mounts (the gates: one per GPU of the slice): their host folder.
        mounts
            .iter()
            .find_map(|m| {
                let (c, h) = (cp(m), hp(m));
                let rest = c.strip_prefix(v)?.strip_prefix('/')?;
                h.strip_suffix(rest).map(|p| p.trim_end_matches('/').to_string())
            })
            .unwrap_or_else(|| v.to_string())
    };
    for (k, v) in detail["env"].as_object().unwrap() {
        // The container runtime turns NVIDIA_VISIBLE_DEVICES into the devices the container sees.
        let k = if k == "NVIDIA_VISIBLE_DEVICES" { "CUDA_VISIBLE_DEVICES" } else { k };
        c.env(k, host(v.as_str().unwrap()));
    }
    c.env("VGPU_CONTEXT_OVERHEAD", "64m");
    c
}

/// The slice of that name in a status (Null when absent).
pub fn slice_of<'a>(st: &'a Value, name: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    st["slices"].as_array().and_then(|a| a.iter().find(|s| s["name"] == name)).unwrap_or(&NULL)
}

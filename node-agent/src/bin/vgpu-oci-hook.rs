//! vgpu-oci-hook: puts containers of plain runc/containerd hosts into slices.
//!
//! Configure it as a `createRuntime` hook (`vgpu-oci-hook [--socket PATH]`) and a `poststop` hook
//! (`vgpu-oci-hook [--socket PATH] poststop`). It reads the OCI state on stdin and the container's
//! `config.json`; a container that asks for nothing (`VGPU_MEMORY`, `VGPU_SM`, `VGPU_SLICE`, KAI's
//! `GPU_PORTION`, or KAI's pod annotations below), or whose `/usr/local/vgpu` is already mounted (a
//! device plugin put it in a slice), is left alone. Otherwise it asks the agent for a slice
//! (`VGPU_SLICE`: an existing one, where the hook runs with `--allow-join`; else `oci-<container id>`
//! with `VGPU_MEMORY` and `VGPU_SM` on `VGPU_GPUS` or `NVIDIA_VISIBLE_DEVICES`, default GPU 0, of
//! `VGPU_PRIORITY` (`normal`, the default, or `high` where the hook runs with `--allow-priority`); for
//! KAI's GPU sharing (see [`kai_memory`]) each GPU in `NVIDIA_VISIBLE_DEVICES`, the GPU KAI
//! reserved, held to the pod's `gpu-memory` or `gpu-fraction`) and bind-mounts, inside the
//! container's mount namespace and resolved inside its root (see [`within`]), the slice directory at
//! `/usr/local/vgpu`, its limits file and the versioned `libvgpu.so` read-only, and
//! `/etc/ld.so.preload`. The environment is the tenant's: what it asks beyond the hook's arguments
//! (the administrator's) is refused. A hook cannot change the container's environment: the
//! interposer finds the mounted region and limits by their paths. `poststop` deletes the slice it
//! made. Errors go to stderr and fail the hook (the runtime then refuses to start the container).
#![deny(clippy::too_many_lines)]

use serde_json::Value;
use std::ffi::CString;
use std::io::Read;
use std::path::{Path, PathBuf};
use vgpu_proto::v1 as pb;

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("vgpu-oci-hook: {msg}");
    std::process::exit(1)
}

fn slice_name(id: &str) -> String {
    let clean: String = id
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '-' })
        .take(59)
        .collect();
    format!("oci-{}", clean.trim_start_matches('.'))
}

type Env = std::collections::HashMap<String, String>;

/// What KAI asked for a pod that shares a GPU: its pod annotations, which containerd copies into the
/// OCI spec's annotations where its runtime's `pod_annotations` names them (KAI passes no limit
/// anywhere else; the `GPU_PORTION` it sets is rounded up to two decimals: a `gpu-memory: 2000`
/// pod got 0.03 of an 80 GB GPU).
struct KaiAsk {
    /// `gpu-memory`: MiB on each GPU.
    memory_mib: Option<u64>,
    /// `gpu-fraction`: of each GPU's memory (0 < f <= 1).
    fraction: Option<f64>,
}

impl KaiAsk {
    fn from_annotations(a: &Value) -> Result<Option<KaiAsk>, String> {
        let get = |k: &str| a[k].as_str().map(str::trim).filter(|v| !v.is_empty());
        let memory_mib = get("gpu-memory")
            .map(|v| v.parse::<u64>().ok().filter(|&m| m > 0).ok_or(format!("gpu-memory={v:?} is not a number of MiB")))
            .transpose()?;
        let fraction = get("gpu-fraction")
            .map(|v| fraction(v).ok_or(format!("gpu-fraction={v:?} is not a fraction of a GPU (0 < f <= 1)")))
            .transpose()?;
        Ok((memory_mib.is_some() || fraction.is_some()).then_some(KaiAsk { memory_mib, fraction }))
    }
}

fn fraction(v: &str) -> Option<f64> {
    v.trim().parse::<f64>().ok().filter(|p| *p > 0.0 && *p <= 1.0)
}

/// The memory limit on one GPU (of `total` bytes) of a container KAI placed, in whole MiB: the pod's
/// `gpu-memory` or exact `gpu-fraction` (its annotations), else `CUDA_DEVICE_MEMORY_LIMIT` (or `_0`)
/// where something set it, else `GPU_PORTION` (0 < p <= 1, as KAI rounded it) of the GPU's memory.
fn kai_memory(ask: Option<&KaiAsk>, env: &Env, total: u64) -> Result<u64, String> {
    let of = |p: f64| ((total as f64 * p) as u64) & !((1 << 20) - 1);
    match ask {
        Some(KaiAsk { memory_mib: Some(m), .. }) => return Ok((m << 20).min(total)),
        Some(KaiAsk { fraction: Some(f), .. }) => return Ok(of(*f)),
        _ => {}
    }
    if let Some(v) = env.get("CUDA_DEVICE_MEMORY_LIMIT_0").or(env.get("CUDA_DEVICE_MEMORY_LIMIT")) {
        return vgpu_units::parse_size(v).map_err(|e| format!("CUDA_DEVICE_MEMORY_LIMIT: {e}"));
    }
    let v = env.get("GPU_PORTION").map_or("", |v| v.trim());
    fraction(v).map(of).ok_or_else(|| format!("GPU_PORTION={v:?} is not a fraction of a GPU (0 < p <= 1)"))
}

/// The slice's GPUs for a container KAI placed: each GPU its `NVIDIA_VISIBLE_DEVICES` names (the
/// one KAI reserved, or `gpu-fraction-num-devices` of them), held to [`kai_memory`].
fn kai_gpus(
    gpus: &str,
    ask: Option<&KaiAsk>,
    env: &Env,
    node: &[pb::GpuStatus],
    sm: u32,
) -> Result<Vec<pb::SliceGpuLimit>, String> {
    let list: Vec<&str> = gpus.split(',').map(str::trim).filter(|g| !g.is_empty()).collect();
    let named = !list.is_empty() && !list.iter().any(|g| matches!(*g, "all" | "none" | "void"));
    if ask.is_none() && (!named || list.len() != 1) {
        return Err(format!("GPU_PORTION is a fraction of one GPU, but NVIDIA_VISIBLE_DEVICES is {gpus:?}"));
    }
    if !named {
        return Err(format!("KAI's share is of the GPUs it reserved, but NVIDIA_VISIBLE_DEVICES is {gpus:?}"));
    }
    list.iter()
        .map(|gpu| {
            let g = node
                .iter()
                .find(|g| g.uuid == *gpu || g.index.to_string() == *gpu)
                .ok_or_else(|| format!("GPU {gpu} (NVIDIA_VISIBLE_DEVICES) is not on this node"))?;
            Ok(pb::SliceGpuLimit { gpu: g.uuid.clone(), memory: kai_memory(ask, env, g.memory_total)?, sm })
        })
        .collect()
}

/// The slice's labels: its source and container ID, and where containerd's CRI named them in the
/// spec's annotations, the pod's namespace and name and the container's name (as a device plugin's
/// slices are labelled, so that `vgpuctl status` and the metrics name the workload).
fn labels(id: &str, annotations: &Value) -> std::collections::HashMap<String, String> {
    let mut labels: std::collections::HashMap<String, String> =
        [("container_id".to_string(), id.to_string()), ("source".to_string(), "oci-hook".to_string())].into();
    for (label, key) in [
        ("namespace", "io.kubernetes.cri.sandbox-namespace"),
        ("pod", "io.kubernetes.cri.sandbox-name"),
        ("container", "io.kubernetes.cri.container-name"),
    ] {
        if let Some(v) = annotations[key].as_str().filter(|v| !v.is_empty()) {
            labels.insert(label.to_string(), v.to_string());
        }
    }
    labels
}

/// Whether the container already has `/usr/local/vgpu` or a file in it among its mounts (a device
/// plugin mounts the slice's region and limits files there).
fn already_in_a_slice(cfg: &Value) -> bool {
    cfg["mounts"].as_array().is_some_and(|m| {
        m.iter().any(|m| {
            m["destination"].as_str().is_some_and(|d| {
                let d = d.trim_end_matches('/');
                d == "/usr/local/vgpu" || d.starts_with("/usr/local/vgpu/")
            })
        })
    })
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap_or_else(|_| die(format!("bad path {}", p.display())))
}

/// `path`, a path in the container, as the container will resolve it under `rootfs`: the image's
/// symbolic links are followed inside the root (an absolute target starts again at the root, `..`
/// stops there), never out to the host's files, as runc resolves its own mount targets. What does not
/// exist yet is kept as it is (the hook then makes it inside the root). Nothing in the container runs
/// yet (a createRuntime hook), so the links cannot change between this and the mount.
fn within(rootfs: &Path, path: &str) -> Result<PathBuf, String> {
    use std::path::Component;
    let mut pending: Vec<std::ffi::OsString> =
        Path::new(path).components().rev().map(|c| c.as_os_str().to_owned()).collect();
    let mut at = PathBuf::new();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        match Path::new(&part).components().next() {
            None | Some(Component::RootDir | Component::CurDir | Component::Prefix(_)) => continue,
            Some(Component::ParentDir) => {
                at.pop();
                continue;
            }
            Some(Component::Normal(_)) => {}
        }
        let next = at.join(&part);
        match std::fs::read_link(rootfs.join(&next)) {
            Ok(target) => {
                links += 1;
                if links > 40 {
                    return Err(format!("{path}: more than 40 symbolic links in the image"));
                }
                if target.is_absolute() {
                    at = PathBuf::new();
                }
                pending.extend(target.components().rev().map(|c| c.as_os_str().to_owned()));
            }
            Err(_) => at = next,
        }
    }
    Ok(rootfs.join(at))
}

/// In a fresh single-threaded process: enter the container's mount namespace and make the mounts
/// (`setns` into a mount namespace needs a single-threaded caller).
fn inject(pid: &str, rootfs: &Path, mounts: &[(String, String, bool)]) {
    let ns = c(Path::new(&format!("/proc/{pid}/ns/mnt")));
    // SAFETY: plain syscalls with valid C strings; the fd is closed by the process's exit.
    unsafe {
        let fd = libc::open(ns.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 || libc::setns(fd, libc::CLONE_NEWNS) != 0 {
            die(format!("cannot enter the mount namespace of {pid}: {}", std::io::Error::last_os_error()));
        }
    }
    for (host, container, ro) in mounts {
        let target = within(rootfs, container).unwrap_or_else(|e| die(e));
        let is_dir = Path::new(host).is_dir();
        if is_dir {
            std::fs::create_dir_all(&target).unwrap_or_else(|e| die(format!("mkdir {}: {e}", target.display())));
        } else if !target.exists() {
            if let Some(d) = target.parent() {
                std::fs::create_dir_all(d).unwrap_or_else(|e| die(format!("mkdir {}: {e}", d.display())));
            }
            std::fs::write(&target, b"").unwrap_or_else(|e| die(format!("cannot create {}: {e}", target.display())));
        }
        let (src, dst) = (c(Path::new(host)), c(&target));
        // SAFETY: valid C strings; a bind mount, then (read-only) a remount of the same target.
        unsafe {
            if libc::mount(src.as_ptr(), dst.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) != 0 {
                die(format!("mount {host} on {}: {}", target.display(), std::io::Error::last_os_error()));
            }
            if *ro {
                let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                if libc::mount(std::ptr::null(), dst.as_ptr(), std::ptr::null(), flags, std::ptr::null()) != 0 {
                    die(format!("remount {} read-only: {}", target.display(), std::io::Error::last_os_error()));
                }
            }
        }
    }
}

/// What the runtime's administrator lets a container's environment ask for (the hook's arguments):
/// by default a container gets only a slice made for it, of normal priority.
#[derive(Default)]
struct Policy {
    /// `--allow-join`: `VGPU_SLICE` may name an existing slice to join.
    join: bool,
    /// `--allow-priority`: `VGPU_PRIORITY=high` may make a high-priority slice.
    priority: bool,
}

impl Policy {
    /// Refuses what the environment asks beyond the policy, naming the variable and the argument.
    fn check(&self, env: &Env) -> Result<(), String> {
        if let Some(name) = env.get("VGPU_SLICE").filter(|_| !self.join) {
            return Err(format!(
                "VGPU_SLICE={name:?}: joining an existing slice is not allowed here (the runtime's hook \
                 configuration allows it with --allow-join)"
            ));
        }
        if env.get("VGPU_PRIORITY").is_some_and(|v| v.trim() == "high") && !self.priority {
            return Err("VGPU_PRIORITY=high: a container may not make its slice high-priority here (the \
                        runtime's hook configuration allows it with --allow-priority)"
                .to_string());
        }
        Ok(())
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut policy = Policy::default();
    let mut socket = PathBuf::from(std::env::var("VGPU_SOCKET").unwrap_or_else(|_| "/run/vgpu/agent.sock".into()));
    let mut stage = "createRuntime".to_string();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => socket = args.next().unwrap_or_else(|| die("--socket needs a path")).into(),
            "--allow-join" => policy.join = true,
            "--allow-priority" => policy.priority = true,
            "--inject" => {
                // Internal: --inject PID ROOTFS MOUNTS-JSON
                let (pid, rootfs, json) = (args.next(), args.next(), args.next());
                let (Some(pid), Some(rootfs), Some(json)) = (pid, rootfs, json) else {
                    die("--inject PID ROOTFS JSON")
                };
                let m: Vec<(String, String, bool)> = serde_json::from_str(&json).unwrap_or_else(|e| die(e));
                inject(&pid, Path::new(&rootfs), &m);
                return;
            }
            "createRuntime" | "prestart" | "poststop" => stage = a,
            "-h" | "--help" => {
                println!(
                    "usage: vgpu-oci-hook [--socket PATH] [--allow-join] [--allow-priority] \
                     [createRuntime|poststop]  (OCI state on stdin)"
                );
                return;
            }
            _ => die(format!("unknown argument {a:?}")),
        }
    }
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input).unwrap_or_else(|e| die(format!("reading the OCI state: {e}")));
    let state: Value = serde_json::from_str(&input).unwrap_or_else(|e| die(format!("bad OCI state: {e}")));
    let id = state["id"].as_str().unwrap_or_else(|| die("OCI state without id")).to_string();
    let bundle = PathBuf::from(state["bundle"].as_str().unwrap_or_else(|| die("OCI state without bundle")));
    let cfg_text = std::fs::read_to_string(bundle.join("config.json"))
        .unwrap_or_else(|e| die(format!("{}/config.json: {e}", bundle.display())));
    let cfg: Value = serde_json::from_str(&cfg_text).unwrap_or_else(|e| die(format!("config.json: {e}")));
    let env: Env = cfg["process"]["env"]
        .as_array()
        .map(|a| {
            a.iter().filter_map(|e| e.as_str()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))).collect()
        })
        .unwrap_or_default();
    // KAI's ask, where containerd passed its pod annotations; only its GPU container has the GPU it
    // reserved in NVIDIA_VISIBLE_DEVICES (the others share the pod's annotations).
    let kai = KaiAsk::from_annotations(&cfg["annotations"])
        .unwrap_or_else(|e| die(e))
        .filter(|_| env.get("NVIDIA_VISIBLE_DEVICES").is_some_and(|v| v.contains("GPU-") || v.contains("MIG-")));
    let asks =
        kai.is_some() || ["VGPU_MEMORY", "VGPU_SM", "VGPU_SLICE", "GPU_PORTION"].iter().any(|k| env.contains_key(*k));
    if !asks || already_in_a_slice(&cfg) {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| die(e));
    let name = env.get("VGPU_SLICE").cloned().unwrap_or_else(|| slice_name(&id));
    if stage == "poststop" {
        if !env.contains_key("VGPU_SLICE") {
            rt.block_on(async {
                if let Ok(mut c) = vgpu_agent::api::connect(&socket).await {
                    let _ = c.delete_slice(pb::DeleteSliceRequest { name: name.clone(), force: true }).await;
                }
            });
        }
        return;
    }
    policy.check(&env).unwrap_or_else(|e| die(e));
    let pid = state["pid"].as_u64().unwrap_or_else(|| die("OCI state without pid")).to_string();
    let detail = rt.block_on(async {
        let mut c = vgpu_agent::api::connect(&socket).await.unwrap_or_else(|e| die(e));
        if env.contains_key("VGPU_SLICE") {
            return c
                .get_slice(pb::GetSliceRequest { name: name.clone() })
                .await
                .unwrap_or_else(|e| die(e.message()))
                .into_inner();
        }
        let gpus = env.get("VGPU_GPUS").or(env.get("NVIDIA_VISIBLE_DEVICES")).cloned().unwrap_or_else(|| "0".into());
        let memory = env
            .get("VGPU_MEMORY")
            .map_or(0, |v| vgpu_units::parse_size(v).unwrap_or_else(|e| die(format!("VGPU_MEMORY: {e}"))));
        let percent = |k: &str| {
            env.get(k)
                .map(|v| v.trim().parse::<u32>().unwrap_or_else(|_| die(format!("{k}={v:?} is not a percentage"))))
        };
        let sm = percent("VGPU_SM").unwrap_or(0);
        let limits = if memory == 0 && (kai.is_some() || env.contains_key("GPU_PORTION")) {
            // HAMi's convention: 0 or 100 and more is no limit.
            let sm = percent("CUDA_DEVICE_SM_LIMIT").filter(|&p| sm == 0 && p < 100).unwrap_or(sm);
            // KAI: its share of each GPU it reserved for the pod.
            let status = c.status(pb::StatusRequest {}).await.unwrap_or_else(|e| die(e.message())).into_inner();
            kai_gpus(&gpus, kai.as_ref(), &env, &status.gpus, sm).unwrap_or_else(|e| die(e))
        } else {
            gpus.split(',')
                .filter(|g| !g.is_empty())
                .map(|g| pb::SliceGpuLimit { gpu: g.trim().into(), memory, sm })
                .collect()
        };
        let req = pb::CreateSliceRequest {
            name: name.clone(),
            gpus: limits,
            labels: labels(&id, &cfg["annotations"]),
            priority: match env.get("VGPU_PRIORITY").map(|v| v.trim()) {
                None | Some("normal") => pb::SlicePriority::PriorityNormal as i32,
                Some("high") => pb::SlicePriority::PriorityHigh as i32,
                Some(v) => die(format!("VGPU_PRIORITY={v:?} is not high or normal")),
            },
        };
        match c.create_slice(req).await {
            Ok(r) => r.into_inner(),
            // A restarted container keeps its slice.
            Err(e) if e.code() == tonic::Code::AlreadyExists => c
                .get_slice(pb::GetSliceRequest { name: name.clone() })
                .await
                .unwrap_or_else(|e| die(e.message()))
                .into_inner(),
            Err(e) => die(e.message()),
        }
    });
    drop(rt);
    let root = cfg["root"]["path"].as_str().unwrap_or("rootfs");
    let rootfs = if root.starts_with('/') { PathBuf::from(root) } else { bundle.join(root) };
    let mut mounts: Vec<(String, String, bool)> =
        detail.mounts.iter().map(|m| (m.host_path.clone(), m.container_path.clone(), m.read_only)).collect();
    let template = Path::new(&detail.state_dir).parent().and_then(|p| p.parent()).map(|s| s.join("ld.so.preload"));
    if let Some(t) = template.filter(|t| t.exists()) {
        mounts.push((t.display().to_string(), "/etc/ld.so.preload".into(), true));
    }
    let me = std::env::current_exe().unwrap_or_else(|e| die(e));
    let st = std::process::Command::new(me)
        .args(["--inject", &pid, &rootfs.display().to_string(), &serde_json::to_string(&mounts).expect("serialisable")])
        .status()
        .unwrap_or_else(|e| die(e));
    if !st.success() {
        std::process::exit(1);
    }
}

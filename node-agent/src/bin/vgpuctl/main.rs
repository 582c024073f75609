//! vgpuctl: the operator's command line for the vgpu node agent (over its Unix socket).
//! Exit codes: 0 success, 1 the operation failed (or `doctor` found a failure), 2 usage error,
//! 3 the agent cannot be reached.
#![deny(clippy::too_many_lines)]

mod doctor;
mod render;
mod update;

use clap::{Args, Parser, Subcommand};
use render::Style;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use vgpu_agent::config::{Config, Flags};
use vgpu_proto::v1 as pb;

#[derive(Parser)]
#[command(name = "vgpuctl", version, about = "Operate the vgpu node agent: status, slices, diagnosis")]
struct Cli {
    /// The agent's socket [default: the agent configuration's, or /run/vgpu/agent.sock]
    #[arg(long, global = true, env = "VGPU_SOCKET")]
    socket: Option<PathBuf>,
    /// The agent's configuration file (for defaults and `doctor`)
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// How to print: table, wide (tables with whole UUIDs), json or yaml
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// The same as `-o json`
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Table,
    Wide,
    Json,
    Yaml,
}

/// The output chosen on the command line (set once, at start).
static OUTPUT: std::sync::OnceLock<Output> = std::sync::OnceLock::new();

/// Whether tables print whole UUIDs (`-o wide`).
fn wide() -> bool {
    OUTPUT.get() == Some(&Output::Wide)
}

/// Which of a status's GPUs and slices to show (`status --pod/--namespace/--gpu`).
#[derive(Args, Clone, Default)]
struct StatusFilter {
    /// Only the slices of this pod (its `pod` label)
    #[arg(long)]
    pod: Option<String>,
    /// Only the slices of this namespace (their `namespace` label)
    #[arg(long)]
    namespace: Option<String>,
    /// Only this GPU (its index, or the start of its UUID), and the slices on it
    #[arg(long)]
    gpu: Option<String>,
}

impl StatusFilter {
    /// Whether a slice's labels pass `--pod` and `--namespace`.
    fn labels_match(&self, labels: &std::collections::HashMap<String, String>) -> bool {
        let label = |k: &str, want: &Option<String>| want.as_ref().is_none_or(|w| labels.get(k) == Some(w));
        label("pod", &self.pod) && label("namespace", &self.namespace)
    }

    /// Whether a GPU passes `--gpu` (its index, or at least four leading characters of its UUID).
    fn gpu_matches(&self, index: u32, uuid: &str) -> bool {
        self.gpu.as_ref().is_none_or(|g| index.to_string() == *g || (g.len() >= 4 && uuid.starts_with(g.as_str())))
    }

    /// The status with what the filter leaves out removed.
    fn apply(&self, mut st: pb::NodeStatus) -> pb::NodeStatus {
        st.slices.retain(|s| self.labels_match(&s.labels));
        if self.gpu.is_some() {
            st.gpus.retain(|x| self.gpu_matches(x.index, &x.uuid));
            let uuids: Vec<String> = st.gpus.iter().map(|x| x.uuid.clone()).collect();
            st.slices.retain(|s| s.gpus.iter().any(|x| uuids.contains(&x.uuid)));
            st.escapes.retain(|e| uuids.contains(&e.gpu));
        }
        st
    }

    /// The slices of `list` that pass the filter (`gpus`: the node's, to resolve `--gpu`).
    fn apply_to_list(&self, slices: &mut Vec<pb::SliceDetail>, gpus: &[pb::GpuStatus]) {
        slices.retain(|d| self.labels_match(&d.labels));
        if self.gpu.is_some() {
            let uuids: Vec<&str> =
                gpus.iter().filter(|x| self.gpu_matches(x.index, &x.uuid)).map(|x| x.uuid.as_str()).collect();
            slices.retain(|d| d.gpus.iter().any(|x| uuids.contains(&x.gpu.as_str())));
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// GPUs and slices on this node
    Status {
        #[command(flatten)]
        filter: StatusFilter,
        /// Keep printing as the agent's status changes
        #[arg(long)]
        watch: bool,
        /// With --watch: at most one update per this many milliseconds
        #[arg(long, default_value_t = 1000)]
        interval: u32,
    },
    /// Create, change, delete and list slices (for hosts without Kubernetes)
    #[command(subcommand)]
    Slice(SliceCmd),
    /// One slice: limits, environment, mounts, usage
    Inspect { name: String },
    /// Run a command on this host in a slice: the slice's environment with host paths (a container
    /// gets it from `slice create`'s flags instead)
    Run {
        name: String,
        /// The command and its arguments (after `--`)
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Check NVML, the driver, the library, the state directory, the agent, kubelet and CDI
    Doctor,
    /// MIG layouts: status, and mig-parted configs planned, applied and asserted
    #[command(subcommand)]
    Mig(MigCmd),
    /// What this node reports to the central scheduler, and the connection's state
    Capacity,
    /// Whether the agent is live (exit 0), its monitoring stalled (1, with the reason) or it does
    /// not answer (3): over its socket, as the chart's liveness probe asks, whatever its metrics
    /// port suffers
    Live,
    /// The cluster view of a capacity receiver (vgpu-receiver or a scheduler serving vgpu.scheduler.v1)
    #[command(subcommand)]
    Cluster(ClusterCmd),
}

#[derive(Args)]
struct Receiver {
    /// The receiver: https://host:port or unix:///path
    #[arg(long, env = "VGPU_CLUSTER_SERVER")]
    server: String,
    /// PEM file of the CA that signed the receiver's certificate (https)
    #[arg(long, env = "VGPU_CLUSTER_CA")]
    ca: Option<PathBuf>,
    /// File holding the bearer token
    #[arg(long, env = "VGPU_CLUSTER_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Name to check the receiver's certificate against [default: the server's host]
    #[arg(long)]
    server_name: Option<String>,
    /// PEM client certificate, for a receiver that requires mutual TLS (with --key)
    #[arg(long, env = "VGPU_CLUSTER_CERT", requires = "key")]
    cert: Option<PathBuf>,
    /// PEM key of the client certificate
    #[arg(long, env = "VGPU_CLUSTER_KEY", requires = "cert")]
    key: Option<PathBuf>,
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Every node and GPU the receiver knows, with its free capacity
    Status {
        #[command(flatten)]
        receiver: Receiver,
        /// Only this node
        #[arg(long)]
        node: Option<String>,
    },
}

#[derive(Args)]
struct MigArgs {
    /// A mig-parted v1 configuration file
    #[arg(long, short = 'f')]
    file: PathBuf,
    /// Which of its mig-configs (as in the nvidia.com/mig.config label)
    #[arg(long)]
    name: String,
    /// Only these GPU indices [default: every GPU the config selects]
    #[arg(long, value_delimiter = ',')]
    gpu: Vec<u32>,
    /// Destroy busy instances where the target needs it
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand)]
enum MigCmd {
    /// Mode, instances and recorded layout of every MIG-capable GPU
    Status,
    /// What applying a config would do (nothing changes)
    Plan(MigArgs),
    /// Apply a config incrementally (recorded: re-applied after a reboot)
    Apply(MigArgs),
    /// Exit 0 if the GPUs are as the config says, 1 otherwise
    Assert(MigArgs),
    /// The geometries HAMi's and Volcano's schedulers may cut each GPU into (their MIG mode), as the
    /// knownMigGeometries of their device configuration
    Geometries {
        /// HAMi's form (bare lists, referred to by index) instead of Volcano's (named groups)
        #[arg(long)]
        hami: bool,
    },
}

#[derive(Args)]
struct Limits {
    /// GPU index or UUID; repeat or separate with commas for several GPUs
    #[arg(long, value_delimiter = ',', required_unless_present = "priority")]
    gpu: Vec<String>,
    /// Memory limit per GPU, e.g. 8GiB, 512m, or none [create: none; update: kept]
    #[arg(long, value_parser = parse_memory)]
    memory: Option<u64>,
    /// SM-time limit per GPU in percent, 1-100, or none [create: none; update: kept]
    #[arg(long, value_parser = parse_sm)]
    sm: Option<u32>,
    /// high: latency first, the normal slices of its GPUs yield to it [create: normal; update: kept]
    #[arg(long, value_enum)]
    priority: Option<PriorityArg>,
}

/// A slice's priority on the command line.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PriorityArg {
    Normal,
    High,
}

impl PriorityArg {
    fn pb(self) -> i32 {
        match self {
            PriorityArg::Normal => pb::SlicePriority::PriorityNormal as i32,
            PriorityArg::High => pb::SlicePriority::PriorityHigh as i32,
        }
    }
}

/// A memory limit, or `none` (0: no limit).
fn parse_memory(s: &str) -> Result<u64, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(0);
    }
    render::parse_size(s)
}

/// An SM limit in percent (1-100), or `none` (0: no limit).
fn parse_sm(s: &str) -> Result<u32, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(0);
    }
    match s.trim().parse::<u32>() {
        Ok(v) if (1..=100).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a percentage from 1 to 100, or none")),
    }
}

#[derive(Subcommand)]
enum SliceCmd {
    /// Create a slice and print how to run a container in it
    Create {
        #[arg(long)]
        name: String,
        #[command(flatten)]
        limits: Limits,
        /// Owner labels, key=value (e.g. namespace=ml)
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Change a slice's limits (running processes follow at once); a limit not given is kept
    Update {
        name: String,
        #[command(flatten)]
        limits: Limits,
        /// Accept a memory limit below what the slice's processes hold now
        #[arg(long)]
        force: bool,
    },
    /// Delete a slice (refused while its processes run, unless --force)
    Delete {
        name: String,
        #[arg(long)]
        force: bool,
    },
    /// List slices
    List {
        #[command(flatten)]
        filter: StatusFilter,
    },
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not key=value"))
}

/// SIGPIPE: when standard output is a pipe whose reader went, end as the default action would;
/// otherwise (a socket) return, and the write fails with EPIPE, reported like any error.
extern "C" fn on_sigpipe(_: libc::c_int) {
    let mut p = libc::pollfd { fd: 1, events: 0, revents: 0 };
    // SAFETY: poll on one valid pollfd with no wait; a sigset made and used on the stack; poll,
    // signal, pthread_sigmask, raise and _exit are async-signal-safe.
    unsafe {
        if libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLERR != 0 {
            // Blocked while its handler runs: unblocked, so that the default action ends the process.
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(libc::SIGPIPE);
            libc::_exit(141);
        }
    }
}

fn die(code: i32, msg: impl std::fmt::Display) -> ! {
    eprintln!("vgpuctl: {msg}");
    std::process::exit(code)
}

fn grpc_err(s: tonic::Status) -> ! {
    let code = match s.code() {
        tonic::Code::Unavailable => 3,
        _ => 1,
    };
    die(code, s.message())
}

/// `v` as JSON (pretty), or as YAML with `-o yaml`.
fn json<T: serde::Serialize>(v: &T) -> String {
    if OUTPUT.get() == Some(&Output::Yaml) {
        return yaml_serde::to_string(v).expect("serialisable").trim_end().to_string();
    }
    serde_json::to_string_pretty(v).expect("serialisable")
}

fn limits(l: &Limits) -> Vec<pb::SliceGpuLimit> {
    l.gpu
        .iter()
        .map(|g| pb::SliceGpuLimit { gpu: g.clone(), memory: l.memory.unwrap_or(0), sm: l.sm.unwrap_or(0) })
        .collect()
}

/// The agent's gRPC client.
type Client = pb::agent_client::AgentClient<tonic::transport::Channel>;

/// `vgpuctl status --watch`: each status the agent publishes, until the reader goes.
async fn watch(c: &mut Client, interval: u32, json_out: bool, style: Style) {
    let mut s = c
        .watch_status(pb::WatchStatusRequest { min_interval_ms: interval })
        .await
        .unwrap_or_else(|e| grpc_err(e))
        .into_inner();
    let mut out = std::io::stdout();
    while let Some(st) = s.message().await.unwrap_or_else(|e| grpc_err(e)) {
        let text = if json_out {
            format!("{}\n", serde_json::to_string(&st).expect("serialisable"))
        } else if style.colour {
            format!("\x1b[H\x1b[2J{}", render::render_status(&st, style))
        } else {
            format!("{}\n", render::render_status(&st, style))
        };
        if out.write_all(text.as_bytes()).and_then(|_| out.flush()).is_err() {
            return; // the reader went away
        }
    }
}

/// A slice's environment as a process on this host needs it: each value under a container path
/// mapped back through the slice's mounts to the host path, and the GPUs a container runtime would
/// give it (`NVIDIA_VISIBLE_DEVICES`) as CUDA_VISIBLE_DEVICES. A value naming the container
/// folder that holds mounts (the gates: `gates/<GPU UUID>` each mounted by itself) is the host
/// folder that holds them alike.
fn host_env(d: &pb::SliceDetail) -> Vec<(String, String)> {
    let host = |v: &str| -> String {
        let under = d
            .mounts
            .iter()
            .filter(|m| v.starts_with(m.container_path.as_str()))
            .max_by_key(|m| m.container_path.len())
            .map(|m| v.replacen(&m.container_path, &m.host_path, 1));
        let holding = || {
            d.mounts.iter().find_map(|m| {
                let rest = m.container_path.strip_prefix(v)?.strip_prefix('/')?;
                Some(m.host_path.strip_suffix(rest)?.strip_suffix('/')?.to_string())
            })
        };
        under.or_else(holding).unwrap_or_else(|| v.to_string())
    };
    let mut env: Vec<(String, String)> = d
        .env
        .iter()
        .map(|(k, v)| {
            if k == "NVIDIA_VISIBLE_DEVICES" {
                ("CUDA_VISIBLE_DEVICES".into(), v.clone())
            } else {
                (k.clone(), host(v))
            }
        })
        .collect();
    env.sort();
    env
}

/// `vgpuctl run NAME -- CMD...`: CMD in slice NAME on this host (exec'd; returns only on failure).
async fn run_in(c: &mut Client, name: String, command: Vec<String>) -> ! {
    use std::os::unix::process::CommandExt;
    let d = c.get_slice(pb::GetSliceRequest { name: name.clone() }).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
    let env = host_env(&d);
    if let Some((_, lib)) = env.iter().find(|(k, _)| k == "LD_PRELOAD") {
        if !std::path::Path::new(lib).is_file() {
            eprintln!(
                "vgpuctl: warning: {lib} (the slice's libvgpu.so) is not there: the command runs without its limits"
            );
        }
    }
    let e = std::process::Command::new(&command[0]).args(&command[1..]).envs(env).exec();
    die(1, format!("cannot run {}: {e}", command[0]))
}

/// `vgpuctl inspect NAME`: a slice's limits and injection, and its usage now.
async fn inspect(c: &mut Client, name: String, json_out: bool) {
    let d = c.get_slice(pb::GetSliceRequest { name: name.clone() }).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
    let st = c.status(pb::StatusRequest {}).await.ok().map(|r| r.into_inner());
    let usage = st.and_then(|s| s.slices.into_iter().find(|s| s.name == name));
    if json_out {
        println!("{}", json(&serde_json::json!({ "slice": d, "status": usage })));
    } else {
        print!("{}", render::render_slice(&d));
        if let Some(u) = usage {
            for g in &u.gpus {
                println!(
                    "usage on {}: memory {} of {} (NVML {}; peak {}), SM {}% of {}%, throttled {:.1}s in {} launches, {} OOM refusals",
                    g.uuid,
                    vgpu_agent::describe::human(g.memory_used),
                    vgpu_agent::describe::human(g.memory_limit),
                    vgpu_agent::describe::human(g.memory_measured),
                    vgpu_agent::describe::human(g.memory_peak),
                    g.sm_used,
                    g.sm_limit,
                    g.throttled_ns as f64 / 1e9,
                    g.throttled_launches,
                    g.oom_rejections
                );
            }
            for p in &u.processes {
                println!(
                    "process {} (host {}) on {}: {}",
                    p.pid,
                    p.host_pid,
                    p.gpu,
                    vgpu_agent::describe::human(p.memory)
                );
            }
        }
    }
}

/// `vgpuctl mig plan|apply|assert`: exits 1 when the layout is not (or would not be) as asked.
async fn mig_operation(c: &mut Client, cmd: MigCmd, json_out: bool) {
    let (a, op) = match &cmd {
        MigCmd::Plan(a) => (a, "plan"),
        MigCmd::Apply(a) => (a, "apply"),
        MigCmd::Assert(a) => (a, "assert"),
        MigCmd::Status | MigCmd::Geometries { .. } => unreachable!("handled above"),
    };
    let text = std::fs::read_to_string(&a.file).unwrap_or_else(|e| die(2, format!("{}: {e}", a.file.display())));
    let req = pb::MigRequest { config_yaml: text, config_name: a.name.clone(), gpus: a.gpu.clone(), force: a.force };
    let r = match op {
        "plan" => c.mig_plan(req).await,
        "apply" => c.mig_apply(req).await,
        _ => c.mig_assert(req).await,
    }
    .unwrap_or_else(|e| grpc_err(e))
    .into_inner();
    if json_out {
        println!("{}", json(&r));
    } else {
        print!("{}", render::render_mig_report(&r, op));
    }
    let failed =
        r.gpus.iter().any(|g| !g.error.is_empty() || (op != "plan" && !g.differences.is_empty() && !g.pending_reset));
    std::process::exit(i32::from(failed));
}

fn main() {
    // Like any Unix filter: when the reader of its output goes (`vgpuctl status | head`), end quietly
    // by SIGPIPE rather than report a failed write. Only for standard output: a connection the peer
    // closed (a receiver refusing the TLS handshake) is an error to report, not a reason to die
    // silently (see `on_sigpipe`).
    // SAFETY: installs a handler with the plain signal-handler signature before any thread starts.
    unsafe { libc::signal(libc::SIGPIPE, on_sigpipe as *const () as libc::sighandler_t) };
    let mut cli = Cli::parse();
    if cli.json {
        cli.output = Output::Json;
    }
    cli.json = matches!(cli.output, Output::Json | Output::Yaml);
    let _ = OUTPUT.set(cli.output);
    let flags = Flags { config: cli.config.clone(), socket: cli.socket.clone(), ..Default::default() };
    let cfg = vgpu_agent::config::check_environment()
        .and_then(|()| Config::load(&flags, |k| std::env::var(k).ok()))
        .unwrap_or_else(|e| die(2, e));
    let style = Style { colour: std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none() };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| die(1, e));
    rt.block_on(async {
        if let Cmd::Doctor = cli.cmd {
            let health = match vgpu_agent::api::connect(&cfg.socket).await {
                Ok(mut c) => c.health(pb::HealthRequest {}).await.map(|r| r.into_inner()).map_err(|e| e.message().to_string()),
                Err(e) => Err(e.to_string()),
            };
            // A running agent's own state directory and library are what is checked (a configuration
            // file, or none, may say otherwise).
            let mut cfg = cfg;
            if let Ok(h) = &health {
                if !h.state_dir.is_empty() {
                    cfg.state_dir = h.state_dir.clone().into();
                }
                if !h.library.is_empty() {
                    cfg.library = h.library.clone().into();
                }
            }
            let checks = tokio::task::spawn_blocking(move || doctor::doctor(&cfg, health)).await.unwrap_or_else(|e| die(1, e));
            if cli.json {
                println!("{}", json(&checks));
            } else {
                print!("{}", doctor::render_doctor(&checks, style));
            }
            std::process::exit(if checks.iter().any(|c| c.level == "fail") { 1 } else { 0 });
        }
        if let Cmd::Cluster(ClusterCmd::Status { receiver: r, node }) = &cli.cmd {
            let st = cluster_status(r, node.clone().unwrap_or_default()).await;
            if cli.json {
                println!("{}", json(&st));
            } else {
                print!("{}", render::render_cluster(&st, style));
            }
            return;
        }
        let mut c = vgpu_agent::api::connect(&cfg.socket).await.unwrap_or_else(|e| die(3, e));
        match cli.cmd {
            Cmd::Status { watch: false, filter, .. } => {
                let st = c.status(pb::StatusRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                let st = filter.apply(st);
                if cli.json {
                    println!("{}", json(&st));
                } else {
                    print!("{}", render::render_status(&st, style));
                }
            }
            Cmd::Status { watch: true, interval, .. } => watch(&mut c, interval, cli.json, style).await,
            Cmd::Slice(SliceCmd::Create { name, limits: l, labels }) => {
                if l.gpu.is_empty() {
                    die(2, "a slice needs --gpu (an index or UUID, or several)");
                }
                let priority = l.priority.map_or(0, PriorityArg::pb);
                let req =
                    pb::CreateSliceRequest { name, gpus: limits(&l), labels: labels.into_iter().collect(), priority };
                let d = c.create_slice(req).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                println!("{}", if cli.json { json(&d) } else { render::render_slice(&d) });
            }
            Cmd::Slice(SliceCmd::Update { name, limits: l, force }) => {
                if l.memory.is_none() && l.sm.is_none() && l.priority.is_none() {
                    die(2, "nothing to change: give --memory, --sm, --priority or several (none removes a limit)");
                }
                let cur = c.get_slice(pb::GetSliceRequest { name: name.clone() }).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                let st = c.status(pb::StatusRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                let mut plan = update::UpdatePlan::default();
                if l.memory.is_some() || l.sm.is_some() {
                    plan = update::plan_update(&cur, &st, &l.gpu, l.memory, l.sm, force).unwrap_or_else(|e| die(2, e));
                }
                let priority = l.priority.map(PriorityArg::pb);
                if let Some(p) = priority.filter(|&p| p != cur.priority) {
                    plan.changes.push(format!("priority: {} -> {}", render::priority_name(cur.priority), render::priority_name(p)));
                }
                let req = pb::UpdateSliceRequest { name, gpus: plan.gpus, priority };
                let d = c.update_slice(req).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                if cli.json {
                    println!("{}", json(&d));
                } else {
                    for line in plan.changes.iter().chain(&plan.warnings) {
                        println!("{line}");
                    }
                }
            }
            Cmd::Slice(SliceCmd::Delete { name, force }) => {
                c.delete_slice(pb::DeleteSliceRequest { name: name.clone(), force }).await.unwrap_or_else(|e| grpc_err(e));
                if !cli.json {
                    println!("slice {name} deleted");
                }
            }
            Cmd::Slice(SliceCmd::List { filter }) => {
                let mut l = c.list_slices(pb::ListSlicesRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                if filter.gpu.is_some() {
                    let st = c.status(pb::StatusRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                    filter.apply_to_list(&mut l.slices, &st.gpus);
                } else {
                    filter.apply_to_list(&mut l.slices, &[]);
                }
                if cli.json {
                    println!("{}", json(&l.slices));
                } else {
                    print!("{}", render::render_slice_list(&l.slices));
                }
            }
            Cmd::Inspect { name } => inspect(&mut c, name, cli.json).await,
            Cmd::Run { name, command } => run_in(&mut c, name, command).await,
            Cmd::Doctor | Cmd::Cluster(_) => unreachable!("handled above"),
            Cmd::Live => live(&mut c).await,
            Cmd::Capacity => {
                let r = c.capacity(pb::CapacityRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                if cli.json {
                    println!("{}", json(&r));
                } else {
                    print!("{}", render::render_capacity(&r, style));
                }
            }
            Cmd::Mig(MigCmd::Status) => {
                let st = c.mig_status(pb::MigStatusRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                if cli.json {
                    println!("{}", json(&st));
                } else {
                    print!("{}", render::render_mig_status(&st));
                }
            }
            Cmd::Mig(MigCmd::Geometries { hami }) => {
                let st = c.mig_status(pb::MigStatusRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
                if cli.json {
                    let v: Vec<_> = st
                        .gpus
                        .iter()
                        .map(|g| serde_json::json!({"index": g.index, "uuid": g.uuid, "model": g.model, "geometries": g.geometries}))
                        .collect();
                    println!("{}", json(&v));
                } else {
                    print!("{}", render::render_mig_geometries(&st, hami));
                }
            }
            Cmd::Mig(cmd) => mig_operation(&mut c, cmd, cli.json).await,
        }
    });
}

/// `vgpuctl live`: "live", or exit 1 with why not (the chart's liveness probe).
async fn live(c: &mut Client) {
    let h = c.health(pb::HealthRequest {}).await.unwrap_or_else(|e| grpc_err(e)).into_inner();
    if !h.live {
        let why: Vec<&str> = h.problems.iter().map(String::as_str).filter(|p| p.contains("stalled")).collect();
        die(1, format!("not live: {}", if why.is_empty() { "the agent says so".to_string() } else { why.join("; ") }));
    }
    println!("live");
}

/// The receiver's refusal, with its causes; a connection it dropped during the TLS handshake
/// without a client certificate most often means it requires mutual TLS: said, with the options.
fn refused(r: &Receiver, endpoint: &vgpu_agent::report::Endpoint, s: tonic::Status) -> ! {
    let text = vgpu_agent::report::status_text(&s);
    let tls = matches!(endpoint, vgpu_agent::report::Endpoint::Https { .. });
    if tls && r.cert.is_none() && ["transport error", "CertificateRequired"].iter().any(|w| text.contains(w)) {
        die(
            if s.code() == tonic::Code::Unavailable { 3 } else { 1 },
            format!(
                "{}: {text}; if the receiver requires mutual TLS, give its client certificate and key \
                 (--cert and --key, or VGPU_CLUSTER_CERT and VGPU_CLUSTER_KEY)",
                r.server
            ),
        )
    }
    grpc_err(s)
}

async fn cluster_status(r: &Receiver, node: String) -> vgpu_proto::scheduler::v1::ClusterStatus {
    use vgpu_agent::report;
    let endpoint = report::Endpoint::parse(&r.server).unwrap_or_else(|e| die(2, e));
    let token = match &r.token_file {
        Some(p) => report::read_token(p).unwrap_or_else(|e| die(2, e)),
        None => None,
    };
    let identity = r.cert.as_deref().zip(r.key.as_deref());
    let ch = report::channel_with(&endpoint, r.ca.as_deref(), r.server_name.as_deref(), identity)
        .await
        .unwrap_or_else(|e| die(3, e));
    let mut client = vgpu_proto::scheduler::v1::cluster_client::ClusterClient::new(ch);
    // Page by page (a page is at most about 1 MiB, whatever the nodes hold).
    let mut all = vgpu_proto::scheduler::v1::ClusterStatus::default();
    loop {
        let mut req = tonic::Request::new(vgpu_proto::scheduler::v1::ClusterStatusRequest {
            node: node.clone(),
            after: all.next_after.clone(),
            page_size: 0,
        });
        if let Some(t) = &token {
            let v = format!("Bearer {t}")
                .parse()
                .unwrap_or_else(|_| die(2, "the token holds characters not allowed in a header"));
            req.metadata_mut().insert("authorization", v);
        }
        let page = client.status(req).await.unwrap_or_else(|e| refused(r, &endpoint, e)).into_inner();
        all.nodes.extend(page.nodes);
        all.next_after = page.next_after;
        if all.next_after.is_empty() {
            return all;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slice_s_environment_is_mapped_to_the_host_s_paths() {
        let mount = |host: &str, container: &str| pb::Mount {
            host_path: host.into(),
            container_path: container.into(),
            read_only: true,
        };
        let d = pb::SliceDetail {
            env: [
                ("VGPU_LIMITS_FILE", "/usr/local/vgpu/limits"),
                ("VGPU_GATES_DIR", "/usr/local/vgpu/gates"),
                ("NVIDIA_VISIBLE_DEVICES", "GPU-1"),
                ("LIBCUDA_LOG_LEVEL", "2"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            mounts: vec![
                mount("/var/lib/vgpu/slices/a/limits", "/usr/local/vgpu/limits"),
                mount("/var/lib/vgpu/gates/GPU-1", "/usr/local/vgpu/gates/GPU-1"),
            ],
            ..Default::default()
        };
        let env: std::collections::BTreeMap<String, String> = host_env(&d).into_iter().collect();
        assert_eq!(env["VGPU_LIMITS_FILE"], "/var/lib/vgpu/slices/a/limits");
        assert_eq!(env["VGPU_GATES_DIR"], "/var/lib/vgpu/gates", "the folder that holds the gates");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(env["LIBCUDA_LOG_LEVEL"], "2");
    }
}

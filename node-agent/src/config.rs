//! Agent configuration: a TOML file, then environment (`VGPU_AGENT_*`), then command-line flags, each
//! overriding the one before; validated once, with messages that name the file, key and problem.

pub mod peer;
pub mod scheduler;

use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    state_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
    nvml_library: Option<PathBuf>,
    monitor_interval_ms: Option<u64>,
    log_format: Option<String>,
    log_level: Option<String>,
    escape_action: Option<String>,
    memory_true_up: Option<bool>,
    pod_events: Option<bool>,
    library: Option<PathBuf>,
    metrics_address: Option<String>,
    health_recovery_s: Option<u64>,
    stall_after_s: Option<u64>,
    max_slices: Option<usize>,
    device_plugin: Option<String>,
    kubelet_dir: Option<PathBuf>,
    kubelet_root_dir: Option<PathBuf>,
    pod_resources_socket: Option<String>,
    slice_gc_grace_s: Option<u64>,
    split_count: Option<u32>,
    resource_name: Option<String>,
    cdi_dir: Option<String>,
    compat: Option<String>,
    kube_api: Option<String>,
    node_name: Option<String>,
    register_interval_s: Option<u64>,
    hami_register_format: Option<String>,
    memory_factor: Option<u32>,
    memory_scaling: Option<f64>,
    priority_queue_us: Option<u64>,
    priority_min_share: Option<u32>,
    priority_namespaces: Option<Vec<String>>,
    scheduler_endpoint: Option<String>,
    scheduler_ca: Option<PathBuf>,
    scheduler_token_file: Option<PathBuf>,
    scheduler_server_name: Option<String>,
    scheduler_client_cert: Option<PathBuf>,
    scheduler_client_key: Option<PathBuf>,
    scheduler_heartbeat_s: Option<u64>,
    metrics_tls_cert: Option<PathBuf>,
    metrics_tls_key: Option<PathBuf>,
    metrics_token_file: Option<PathBuf>,
    metrics_insecure: Option<bool>,
    metrics_hami_legacy: Option<bool>,
    dra: Option<String>,
    dra_driver: Option<String>,
    dra_sharing: Option<String>,
    dra_mig: Option<String>,
    mig_geometries_file: Option<PathBuf>,
    hami_node_config_file: Option<PathBuf>,
    mps_gpus: Option<Vec<String>>,
    mps_control: Option<PathBuf>,
    /// `[[node]]` sections: keys for some nodes only.
    node: Option<Vec<NodeSection>>,
}

/// A `[[node]]` section: keys that apply on the nodes it names instead of the file's (one
/// configuration for a DaemonSet over unlike nodes, as HAMi's per-node device plugin configuration).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeSection {
    /// Node names; a trailing `*` matches any rest (`gpu-a100-*`).
    names: Vec<String>,
    split_count: Option<u32>,
    memory_scaling: Option<f64>,
    mps_gpus: Option<Vec<String>>,
}

impl NodeSection {
    fn names(&self, node: &str) -> bool {
        self.names.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => node.starts_with(prefix),
            None => p == node,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// What the agent does with a process that escapes its quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EscapeAction {
    Report,
    Kill,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    /// NVML library to load; None: the system's `libnvidia-ml.so.1`.
    pub nvml_library: Option<PathBuf>,
    pub monitor_interval_ms: u64,
    pub log_format: LogFormat,
    /// What is logged: a level (`info`) or `RUST_LOG`-style directives (`warn,vgpu_agent::monitor=debug`).
    pub log_level: String,
    pub escape_action: EscapeAction,
    /// Charge slice processes for what the driver holds beyond their own account (see `monitor`).
    pub memory_true_up: bool,
    /// Post Kubernetes Events on the pods (or DRA claims) whose allocations the quota refused.
    pub pod_events: bool,
    /// Serve HAMi's legacy metric names beside its current ones (HAMi's `--legacy-metrics`).
    pub metrics_hami_legacy: bool,
    /// The `libvgpu.so` to install for containers (copied under a versioned, content-addressed name).
    pub library: PathBuf,
    /// Prometheus endpoint (`host:port`); None: no metrics endpoint.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// TLS and a bearer token for the metrics endpoint (required off loopback unless insecure).
    pub metrics_tls: Option<(PathBuf, PathBuf)>,
    pub metrics_token_file: Option<PathBuf>,
    /// A GPU marked unhealthy by a critical XID becomes healthy again after this many seconds
    /// without another one (and NVML answering for it).
    pub health_recovery_s: u64,
    /// The monitoring counts as stalled (liveness fails, a warning is shown) when no pass has
    /// completed for this many seconds beyond its interval.
    pub stall_after_s: u64,
    /// The most slices this node holds (each costs two file descriptors and a region mapping).
    pub max_slices: usize,
    /// Serve the kubelet device plugin API (when kubelet's socket is there).
    pub device_plugin: bool,
    /// Kubelet's device-plugin directory (its `kubelet.sock`, and where the plugin's socket goes).
    pub kubelet_dir: PathBuf,
    /// Kubelet's `--root-dir`: its `plugins_registry` and `plugins` (the DRA driver's sockets) and
    /// `pod-resources`. The device-plugin directory is fixed in kubelet whatever its root, so a
    /// kubelet with another root (k0s, a test cluster) needs this said.
    pub kubelet_root_dir: PathBuf,
    /// Kubelet's pod resources API (which devices each container holds), for removing the slices of
    /// replicas no container holds any more; None: not used.
    pub pod_resources_socket: Option<PathBuf>,
    /// How long a replica slice must have gone unallocated before it can be removed.
    pub slice_gc_grace_s: u64,
    /// Devices advertised per GPU; a container given k of them gets k/split of the GPU's memory and time.
    pub split_count: u32,
    pub resource_name: String,
    /// Where CDI specs for slices go; None: none written.
    pub cdi_dir: Option<PathBuf>,
    /// What Allocate follows: the replicas kubelet gives (`Replicas`), or HAMi's scheduler's pod
    /// annotations (`Hami`).
    pub compat: Compat,
    /// The Kubernetes API server URL; None: in-cluster configuration or kubeconfig.
    pub kube_api: Option<String>,
    /// This node's name in Kubernetes.
    pub node_name: String,
    /// How often the node's register annotation is refreshed and dead pods' slices collected.
    pub register_interval_s: u64,
    /// HAMi's v2.7 text register annotation with its handshake, instead of v2.8 JSON.
    pub hami_text_register: bool,
    /// Volcano mode: MiB per `volcano.sh/vgpu-memory` device (Volcano's `gpuMemoryFactor`; its
    /// scheduler must use the same).
    pub memory_factor: u32,
    /// What each GPU's memory counts as for slices, the device plugin and capacity reports (HAMi's
    /// `deviceMemoryScaling`): above 1 the slices' limits may add up to more than the GPU has, and
    /// what a container's allocations find no physical room for is served as unified memory.
    pub memory_scaling: f64,
    /// The most GPU time (µs) a normal slice keeps queued on a GPU beside a high-priority slice:
    /// the longest the high-priority slice's work waits behind it (docs/priority.md).
    pub priority_queue_us: u64,
    /// The share (percent of every 100 ms) in which a normal slice beside a high-priority one
    /// launches whatever the high-priority slice claims to have queued (docs/priority.md).
    pub priority_min_share: u32,
    /// The namespaces whose pods and claims may have high priority (`*`: every one). Priority is
    /// the administrator's grant: what a tenant writes (HAMi's `nvidia.com/priority`, a DRA claim's
    /// parameters) asks for it; elsewhere the slice is made normal, and the status says so.
    pub priority_namespaces: Vec<String>,
    /// Capacity reporting to the central scheduler; None: off.
    pub scheduler: Option<scheduler::ReportConfig>,
    /// The kubelet DRA plugin (resource.k8s.io): its driver name; None: off.
    pub dra: Option<String>,
    /// How the DRA plugin offers each GPU.
    pub dra_sharing: DraSharing,
    /// How the DRA plugin offers a GPU in MIG mode.
    pub dra_mig: DraMig,
    /// HAMi and Volcano modes: the MIG geometries of the scheduler's configuration
    /// (`knownMigGeometries`); empty: each GPU's own, from its profile table.
    pub mig_geometries: Vec<peer::KnownMigGeometries>,
    /// The same file's other settings the agent must agree with (its `nvidia` section), if any.
    pub scheduler_settings: Option<peer::SchedulerSettings>,
    /// The `[[node]]` section that applies to this node (its index and names), if any.
    pub node_section: Option<(usize, Vec<String>)>,
    /// Whether HAMi's per-node configuration (`hami_node_config_file`) has an entry for this node.
    pub hami_node_entry: bool,
    /// The GPUs that run MPS, each with a control daemon the agent supervises (docs/mps.md).
    pub mps: Mps,
}

/// The MPS settings: which GPUs, and the control daemon's program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mps {
    pub gpus: MpsGpus,
    /// `nvidia-cuda-mps-control`: a path, or a name looked up on `PATH`.
    pub control: PathBuf,
}

/// Which GPUs run MPS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MpsGpus {
    None,
    All,
    /// By index or GPU UUID.
    Some(Vec<String>),
}

impl MpsGpus {
    /// Whether the GPU of `index` and `uuid` runs MPS.
    pub fn has(&self, index: u32, uuid: &str) -> bool {
        match self {
            MpsGpus::None => false,
            MpsGpus::All => true,
            MpsGpus::Some(v) => v.iter().any(|g| *g == uuid || g.parse() == Ok(index)),
        }
    }
}

/// How the DRA plugin offers a GPU in MIG mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraMig {
    /// Its MIG devices as they are (the layout is `vgpuctl mig`'s), each whole.
    Existing,
    /// Every placement of every profile, as partitionable devices that consume the GPU's memory
    /// slices (KEP 4815); the instance is made when a claim is prepared and destroyed when it is
    /// unprepared.
    Dynamic,
}

/// How the DRA plugin offers a GPU in the ResourceSlice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraSharing {
    /// `split_count` devices per GPU, each an equal share; a claim takes whole devices.
    Replicas,
    /// One device per GPU that many claims share, each consuming the `memory` and `cores` it asks
    /// for (consumable capacity, KEP 5075).
    Capacity,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compat {
    Replicas,
    Hami,
    Volcano,
}

/// Overrides from the command line.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub config: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub nvml_library: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub metrics_address: Option<String>,
}

/// Why the configuration cannot be used: where the bad value came from, and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("environment variable {var}: its value {shown} is not UTF-8")]
    NotUtf8 { var: String, shown: String },
    #[error("configuration: {0}")]
    Toml(String),
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// A setting with a bad value, set by its environment variable.
    #[error("environment variable {var}: {message}")]
    Variable { var: String, message: String },
    /// A setting with a bad value, set in the file (or on the command line).
    #[error("{source_name}: {key}: {message}")]
    Setting { source_name: String, key: String, message: String },
}

/// Where the agent keeps its state unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/vgpu";

/// The highest `max_slices`: the agent maps each slice's region once, and guards at most
/// [`vgpu_region::shrink::CAPACITY`] mappings (half of them left for the ones it opens briefly).
pub const MAX_SLICES_CEILING: usize = vgpu_region::shrink::CAPACITY / 2;

/// Refuses a `VGPU_AGENT_*` (or `NODE_NAME`) variable whose value is not UTF-8, naming it: reading
/// the environment as text would otherwise skip it silently.
pub fn check_environment() -> Result<(), ConfigError> {
    for (k, v) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if (k.starts_with("VGPU_AGENT_") || k == "NODE_NAME") && v.to_str().is_none() {
            return Err(ConfigError::NotUtf8 { var: k.to_string(), shown: crate::slices::shown(&v.to_string_lossy()) });
        }
    }
    Ok(())
}

pub const DEFAULT_CONFIG_PATH: &str = "/etc/vgpu/agent.toml";
/// Where `scripts/install.sh` and the container image put the library.
pub const DEFAULT_LIBRARY: &str = "/usr/local/lib/vgpu/libvgpu.so";

impl Config {
    /// Loads the configuration: `flags.config` (or `VGPU_AGENT_CONFIG`, or the default path if it
    /// exists), then the environment, then the flags.
    pub fn load(flags: &Flags, env: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let path = flags.config.clone().or_else(|| env("VGPU_AGENT_CONFIG").map(PathBuf::from));
        let file = match &path {
            Some(p) => Self::read(p)?,
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => Self::read(Path::new(DEFAULT_CONFIG_PATH))?,
            None => FileConfig::default(),
        };
        Self::build(file, path.as_deref(), flags, env)
    }

    /// The configuration a TOML text gives alone (no environment, no flags).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let file: FileConfig =
            toml::from_str(text).map_err(|e| ConfigError::Toml(e.to_string().trim_end().to_string()))?;
        Self::build(file, None, &Flags::default(), |_| None)
    }

    fn build(
        mut file: FileConfig,
        path: Option<&Path>,
        flags: &Flags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let src = Sources { env: &env, where_: path.map_or("configuration".to_string(), |p| p.display().to_string()) };
        let bad = |key: &str, msg: String| src.bad(key, msg);

        let node_name = env("NODE_NAME").or(file.node_name.take()).unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string()
        });
        let (hami_node_entry, sections, node_section) = node_overrides(&mut file, &node_name, &src)?;
        let mps = mps_settings(&mut file, &src)?;
        let (metrics_address, metrics_tls, metrics_token_file) = metrics_settings(&mut file, flags, &src)?;
        let dra = dra_driver(&mut file, &src)?;
        let scheduler = report_settings(&mut file, &node_name, &src)?;
        let Paths {
            state_dir,
            socket,
            nvml_library,
            library,
            kubelet_dir,
            kubelet_root_dir,
            pod_resources_socket,
            cdi_dir,
        } = paths(&mut file, flags, &src)?;
        let (mig_geometries, scheduler_settings) = peer_device_config(&mut file, &src)?;

        let monitor_interval_ms =
            src.number("monitor_interval_ms", file.monitor_interval_ms.unwrap_or(100), 10..=60_000)?;
        let (priority_queue_us, priority_min_share, priority_namespaces) = priority_settings(&mut file, &src)?;
        let log_level = env("VGPU_AGENT_LOG_LEVEL").or(file.log_level.take()).unwrap_or_else(|| "info".into());
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&log_level) {
            return Err(bad(
                "log_level",
                format!(
                    "{log_level:?} is not a level (error, warn, info, debug, trace) or RUST_LOG-style directives: {e}"
                ),
            ));
        }
        let log_format =
            src.choice("log_format", file.log_format, &[("text", LogFormat::Text), ("json", LogFormat::Json)])?;
        let escape_action = src.choice(
            "escape_action",
            file.escape_action,
            &[("report", EscapeAction::Report), ("kill", EscapeAction::Kill)],
        )?;
        let memory_true_up = src.switch("memory_true_up", file.memory_true_up.unwrap_or(true))?;
        let pod_events = src.switch("pod_events", file.pod_events.unwrap_or(true))?;
        let metrics_hami_legacy = src.switch("metrics_hami_legacy", file.metrics_hami_legacy.unwrap_or(false))?;
        let health_recovery_s = src.within("health_recovery_s", file.health_recovery_s.unwrap_or(60), 1..=86_400)?;
        let stall_after_s = src.number("stall_after_s", file.stall_after_s.unwrap_or(60), 1..=86_400)?;
        let max_slices = src.number(
            "max_slices",
            file.max_slices.unwrap_or(crate::slices::DEFAULT_MAX_SLICES),
            1..=MAX_SLICES_CEILING,
        )?;
        let device_plugin =
            src.choice("device_plugin", file.device_plugin, &[("auto", true), ("off", false), ("on", true)])?;
        let dra_sharing = src.choice(
            "dra_sharing",
            file.dra_sharing,
            &[("replicas", DraSharing::Replicas), ("capacity", DraSharing::Capacity)],
        )?;
        let dra_mig =
            src.choice("dra_mig", file.dra_mig, &[("existing", DraMig::Existing), ("dynamic", DraMig::Dynamic)])?;
        let slice_gc_grace_s = match env("VGPU_AGENT_SLICE_GC_GRACE_S") {
            Some(v) => v.parse().map_err(|_| bad("slice_gc_grace_s", format!("{v:?} is not a number of seconds")))?,
            None => file.slice_gc_grace_s.unwrap_or(60),
        };
        if !(1..=86_400).contains(&slice_gc_grace_s) {
            return Err(bad("slice_gc_grace_s", format!("{slice_gc_grace_s} is not from 1 to 86400")));
        }
        let split_count = src.within("split_count", file.split_count.unwrap_or(10), 1..=100)?;
        let resource_name = file.resource_name.unwrap_or_else(|| "nvidia.com/gpu".into());
        if !resource_name.contains('/') || resource_name.len() > 63 + 254 {
            return Err(bad("resource_name", format!("{resource_name:?} is not of the form domain/name")));
        }
        let compat = src.choice(
            "compat",
            file.compat,
            &[("replicas", Compat::Replicas), ("hami", Compat::Hami), ("volcano", Compat::Volcano)],
        )?;
        let (memory_factor, memory_scaling) =
            memory_settings((file.memory_factor, file.memory_scaling), scheduler_settings.as_ref(), &src)?;
        let kube_api = env("VGPU_AGENT_KUBE_API").or(file.kube_api).filter(|s| !s.is_empty());
        let register_interval_s =
            src.within("register_interval_s", file.register_interval_s.unwrap_or(30), 1..=3600)?;
        let hami_text_register = match file.hami_register_format.as_deref() {
            None | Some("json") => false,
            Some("text") => true,
            Some(v) => return Err(bad("hami_register_format", format!("{v:?} is not json or text"))),
        };
        if dra.is_some() && device_plugin {
            return Err(bad(
                "dra",
                "set device_plugin = \"off\" with it: the device plugin would offer the same GPUs to the scheduler again".into(),
            ));
        }
        if dra.is_some() && cdi_dir.is_none() {
            return Err(bad(
                "dra",
                "the DRA plugin hands containers their slices as CDI devices: cdi_dir must not be off".into(),
            ));
        }
        Ok(Config {
            node_section: node_section.map(|i| (i, sections[i].names.clone())),
            hami_node_entry,
            mps,
            mig_geometries,
            scheduler_settings,
            dra,
            dra_sharing,
            dra_mig,
            scheduler,
            memory_factor,
            priority_queue_us,
            priority_min_share,
            priority_namespaces,
            memory_scaling,
            compat,
            kube_api,
            node_name,
            register_interval_s,
            hami_text_register,
            cdi_dir,
            device_plugin,
            kubelet_dir,
            kubelet_root_dir,
            pod_resources_socket,
            slice_gc_grace_s,
            split_count,
            resource_name,
            state_dir,
            socket,
            nvml_library,
            monitor_interval_ms,
            log_format,
            log_level,
            escape_action,
            memory_true_up,
            pod_events,
            metrics_hami_legacy,
            library,
            metrics_address,
            metrics_tls,
            metrics_token_file,
            health_recovery_s,
            stall_after_s,
            max_slices,
        })
    }

    fn read(p: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.to_owned(), source })?;
        toml::from_str(&text)
            .map_err(|e| ConfigError::File { path: p.to_owned(), message: e.to_string().trim_end().to_string() })
    }
}

/// The node's paths: the agent's own, the libraries', kubelet's and CDI's.
struct Paths {
    state_dir: PathBuf,
    socket: PathBuf,
    nvml_library: Option<PathBuf>,
    library: PathBuf,
    kubelet_dir: PathBuf,
    kubelet_root_dir: PathBuf,
    pod_resources_socket: Option<PathBuf>,
    cdi_dir: Option<PathBuf>,
}

fn paths(file: &mut FileConfig, flags: &Flags, src: &Sources) -> Result<Paths, ConfigError> {
    let state_dir = flags
        .state_dir
        .clone()
        .or_else(|| (src.env)("VGPU_AGENT_STATE_DIR").map(PathBuf::from))
        .or(file.state_dir.take())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
    let socket = flags
        .socket
        .clone()
        .or_else(|| (src.env)("VGPU_AGENT_SOCKET").map(PathBuf::from))
        .or(file.socket.take())
        .unwrap_or_else(|| PathBuf::from("/run/vgpu/agent.sock"));
    for (k, p) in [("state_dir", &state_dir), ("socket", &socket)] {
        if !p.is_absolute() {
            return Err(src.bad(k, format!("{} is not an absolute path", p.display())));
        }
    }
    let nvml_library = flags
        .nvml_library
        .clone()
        .or_else(|| (src.env)("VGPU_AGENT_NVML_LIBRARY").map(PathBuf::from))
        .or(file.nvml_library.take());
    let library = (src.env)("VGPU_AGENT_LIBRARY")
        .map(PathBuf::from)
        .or(file.library.take())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_LIBRARY));
    let kubelet_dir = (src.env)("VGPU_AGENT_KUBELET_DIR")
        .map(PathBuf::from)
        .or(file.kubelet_dir.take())
        .unwrap_or_else(|| PathBuf::from("/var/lib/kubelet/device-plugins"));
    // By default the device-plugin directory's parent, as kubelet lays them out with its default
    // root.
    let kubelet_root_dir = (src.env)("VGPU_AGENT_KUBELET_ROOT_DIR")
        .map(PathBuf::from)
        .or(file.kubelet_root_dir.take())
        .unwrap_or_else(|| kubelet_dir.parent().unwrap_or(Path::new("/")).to_path_buf());
    if !kubelet_root_dir.is_absolute() {
        return Err(src.bad("kubelet_root_dir", format!("{} is not an absolute path", kubelet_root_dir.display())));
    }
    let pod_resources_socket =
        match (src.env)("VGPU_AGENT_POD_RESOURCES_SOCKET").or(file.pod_resources_socket.take()).as_deref() {
            None => Some(kubelet_root_dir.join("pod-resources/kubelet.sock")),
            Some("" | "off") => None,
            Some(p) if p.starts_with('/') => Some(PathBuf::from(p)),
            Some(p) => return Err(src.bad("pod_resources_socket", format!("{p} is not an absolute path (or \"off\")"))),
        };
    let cdi_dir = match (src.env)("VGPU_AGENT_CDI_DIR").or(file.cdi_dir.take()).as_deref() {
        // The container runtime's directory for the node's agent; an agent run with a state
        // directory of its own (by hand, a test) keeps its specs there too.
        None if state_dir == Path::new(DEFAULT_STATE_DIR) => Some(PathBuf::from("/var/run/cdi")),
        None => Some(state_dir.join("cdi")),
        Some("" | "off") => None,
        Some(p) if p.starts_with('/') => Some(PathBuf::from(p)),
        Some(p) => return Err(src.bad("cdi_dir", format!("{p} is not an absolute path (or \"off\")"))),
    };
    Ok(Paths { state_dir, socket, nvml_library, library, kubelet_dir, kubelet_root_dir, pod_resources_socket, cdi_dir })
}

/// The peer scheduler's device configuration, when a file is named (an empty value, the chart's
/// default, names none): its MIG geometries and its settings.
fn peer_device_config(
    file: &mut FileConfig,
    src: &Sources,
) -> Result<(Vec<peer::KnownMigGeometries>, Option<peer::SchedulerSettings>), ConfigError> {
    Ok(
        match (src.env)("VGPU_AGENT_MIG_GEOMETRIES_FILE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .or(file.mig_geometries_file.take())
        {
            None => (Vec::new(), None),
            Some(p) => {
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| src.bad("mig_geometries_file", format!("cannot read {}: {e}", p.display())))?;
                let file_err =
                    |e: peer::PeerConfigError| src.bad("mig_geometries_file", format!("{}: {e}", p.display()));
                (
                    peer::parse_mig_geometries(&text).map_err(file_err)?,
                    peer::parse_scheduler_settings(&text).map_err(file_err)?,
                )
            }
        },
    )
}

/// Where the settings come from while the configuration is built: the environment, and the file
/// (named in errors).
struct Sources<'a> {
    env: &'a dyn Fn(&str) -> Option<String>,
    where_: String,
}

impl Sources<'_> {
    /// `VGPU_AGENT_<KEY>` from the environment, else `file`: one of `choices` by name (the first
    /// when neither is set; a later name for the same value is an alias). Refused naming the
    /// accepted names, aliases left out.
    fn choice<T: Copy + PartialEq>(
        &self,
        key: &str,
        file: Option<String>,
        choices: &[(&str, T)],
    ) -> Result<T, ConfigError> {
        let var = format!("VGPU_AGENT_{}", key.to_ascii_uppercase());
        let Some(v) = (self.env)(&var).or(file) else { return Ok(choices[0].1) };
        if let Some((_, t)) = choices.iter().find(|(name, _)| *name == v) {
            return Ok(*t);
        }
        let names: Vec<&str> = choices
            .iter()
            .enumerate()
            .filter(|(i, (_, t))| !choices[..*i].iter().any(|(_, u)| u == t))
            .map(|(_, (name, _))| *name)
            .collect();
        let expected = match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.join(""),
        };
        Err(self.bad(key, format!("{v:?} is not {expected}")))
    }

    /// `VGPU_AGENT_<KEY>` as `true`/`1` or `false`/`0`, else `file`.
    fn switch(&self, key: &str, file: bool) -> Result<bool, ConfigError> {
        let var = format!("VGPU_AGENT_{}", key.to_ascii_uppercase());
        match (self.env)(&var).as_deref() {
            None => Ok(file),
            Some("1" | "true") => Ok(true),
            Some("0" | "false") => Ok(false),
            Some(v) => Err(self.bad(key, format!("{v:?} is not true or false"))),
        }
    }

    /// `VGPU_AGENT_<KEY>` as a number, else `file`, within `range`.
    fn number<T>(&self, key: &str, file: T, range: std::ops::RangeInclusive<T>) -> Result<T, ConfigError>
    where
        T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
    {
        let var = format!("VGPU_AGENT_{}", key.to_ascii_uppercase());
        let n = match (self.env)(&var) {
            Some(v) => v.trim().parse().map_err(|_| self.bad(key, format!("{v:?} is not a number")))?,
            None => file,
        };
        self.within(key, n, range)
    }

    /// `n`, if within `range`.
    fn within<T: PartialOrd + std::fmt::Display>(
        &self,
        key: &str,
        n: T,
        range: std::ops::RangeInclusive<T>,
    ) -> Result<T, ConfigError> {
        if range.contains(&n) {
            Ok(n)
        } else {
            Err(self.bad(key, format!("{n} is not from {} to {}", range.start(), range.end())))
        }
    }

    /// An error about setting `key`: blamed on its environment variable when that is set, else on
    /// the file.
    fn bad(&self, key: &str, msg: String) -> ConfigError {
        let var = format!("VGPU_AGENT_{}", key.to_ascii_uppercase());
        match (self.env)(&var) {
            Some(_) => ConfigError::Variable { var, message: msg },
            None => ConfigError::Setting { source_name: self.where_.to_string(), key: key.to_string(), message: msg },
        }
    }
}

/// `priority_queue_us`, `priority_min_share` and `priority_namespaces` (the last from
/// `VGPU_AGENT_PRIORITY_NAMESPACES`, comma-separated, else the file's; each a namespace's name or
/// `*`).
fn priority_settings(file: &mut FileConfig, src: &Sources) -> Result<(u64, u32, Vec<String>), ConfigError> {
    let queue_us = src.number("priority_queue_us", file.priority_queue_us.unwrap_or(100), 50..=1_000_000)?;
    let min_share = src.number("priority_min_share", file.priority_min_share.unwrap_or(10), 1..=50)?;
    let list: Vec<String> = match (src.env)("VGPU_AGENT_PRIORITY_NAMESPACES") {
        Some(v) => v.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect(),
        None => file.priority_namespaces.take().unwrap_or_default(),
    };
    match list.iter().find(|n| *n != "*" && !dns_label(n)) {
        Some(n) => Err(src.bad(
            "priority_namespaces",
            format!("{} is not a namespace name (a DNS label) or *", crate::slices::shown(n)),
        )),
        None => Ok((queue_us, min_share, list)),
    }
}

/// A DNS label (RFC 1123: 1 to 63 of a-z, 0-9 and `-`, neither first nor last a `-`): a
/// namespace's name, a part of a DRA driver's.
fn dns_label(l: &str) -> bool {
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !l.is_empty()
        && l.len() <= 63
        && l.bytes().all(|b| ok(b) || b == b'-')
        && l.bytes().next().is_some_and(ok)
        && l.bytes().last().is_some_and(ok)
}

impl Config {
    /// Whether the pods and claims of `namespace` may have high priority (`priority_namespaces`).
    pub fn may_have_priority(&self, namespace: &str) -> bool {
        self.priority_namespaces.iter().any(|n| n == "*" || n == namespace)
    }
}

/// This node's entry in HAMi's per-node configuration, then the first `[[node]]` section naming it:
/// their keys replace the file's. Whether HAMi's file had an entry, the sections, and which one
/// names the node.
fn node_overrides(
    file: &mut FileConfig,
    node_name: &str,
    src: &Sources,
) -> Result<(bool, Vec<NodeSection>, Option<usize>), ConfigError> {
    let hami_node = (src.env)("VGPU_AGENT_HAMI_NODE_CONFIG_FILE")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .or(file.hami_node_config_file.take());
    let mut hami_node_entry = false;
    if let Some(p) = hami_node {
        let text = std::fs::read_to_string(&p)
            .map_err(|e| src.bad("hami_node_config_file", format!("cannot read {}: {e}", p.display())))?;
        let entry = peer::hami_node_entry(&text, node_name)
            .map_err(|e| src.bad("hami_node_config_file", format!("{}: {e}", p.display())))?;
        if let Some(e) = entry {
            file.split_count = e.split_count.or(file.split_count);
            file.memory_scaling = e.memory_scaling.or(file.memory_scaling);
            if e.mps {
                file.mps_gpus = Some(vec!["all".into()]);
            }
            hami_node_entry = true;
        }
    }
    let sections = file.node.take().unwrap_or_default();
    for (i, n) in sections.iter().enumerate() {
        if n.names.is_empty() || n.names.iter().any(|p| p.is_empty() || p.strip_suffix('*').unwrap_or(p).contains('*'))
        {
            return Err(
                src.bad(&format!("node[{i}]"), "names must list node names (a `*` only at the end of one)".into())
            );
        }
    }
    let node_section = sections.iter().position(|n| n.names(node_name));
    if let Some(n) = node_section.map(|i| &sections[i]) {
        file.split_count = n.split_count.or(file.split_count);
        file.memory_scaling = n.memory_scaling.or(file.memory_scaling);
        file.mps_gpus = n.mps_gpus.clone().or(file.mps_gpus.take());
    }
    Ok((hami_node_entry, sections, node_section))
}

/// `memory_factor` and `memory_scaling`. Volcano's scheduler reads a pod's
/// volcano.sh/vgpu-memory in units of its gpuMemoryFactor MiB, 1 unless configured (as Volcano
/// documents it): unset, the agent takes the scheduler's (from its device configuration, where
/// given) or 1.
fn memory_settings(
    (factor, scaling): (Option<u32>, Option<f64>),
    scheduler: Option<&peer::SchedulerSettings>,
    src: &Sources,
) -> Result<(u32, f64), ConfigError> {
    let scheduler_factor = scheduler.and_then(|s| s.gpu_memory_factor).filter(|&f| f > 0);
    let memory_factor = src.number("memory_factor", factor.or(scheduler_factor).unwrap_or(1), 1..=1 << 20)?;
    let memory_scaling = match (src.env)("VGPU_AGENT_MEMORY_SCALING") {
        Some(v) => v.trim().parse().map_err(|_| src.bad("memory_scaling", format!("{v:?} is not a number")))?,
        None => scaling.unwrap_or(1.0),
    };
    if !(memory_scaling > 0.0 && memory_scaling <= 10.0) {
        return Err(src.bad("memory_scaling", format!("{memory_scaling} is not above 0 and at most 10")));
    }
    Ok((memory_factor, memory_scaling))
}

/// `mps_gpus` (`VGPU_AGENT_MPS_GPUS`, comma-separated, else the file's list): `all`, or GPU
/// indices and UUIDs; `mps_control` (`VGPU_AGENT_MPS_CONTROL`).
fn mps_settings(file: &mut FileConfig, src: &Sources) -> Result<Mps, ConfigError> {
    let list = match (src.env)("VGPU_AGENT_MPS_GPUS") {
        Some(v) => v.split(',').map(|g| g.trim().to_string()).filter(|g| !g.is_empty()).collect(),
        None => file.mps_gpus.take().unwrap_or_default(),
    };
    let gpus = match &list[..] {
        [] => MpsGpus::None,
        [all] if all == "all" => MpsGpus::All,
        _ => {
            for g in &list {
                if g.parse::<u32>().is_err() && !(g.starts_with("GPU-") && g.len() > 4) {
                    return Err(src.bad(
                        "mps_gpus",
                        format!("{g:?} is not a GPU index or UUID (GPU-...); the list is \"all\" or GPUs"),
                    ));
                }
            }
            MpsGpus::Some(list)
        }
    };
    let control = (src.env)("VGPU_AGENT_MPS_CONTROL")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or(file.mps_control.take())
        .unwrap_or_else(|| PathBuf::from("nvidia-cuda-mps-control"));
    Ok(Mps { gpus, control })
}

/// Where metrics are served, and with what TLS and token. The endpoint is the agent's only TCP
/// listener: off loopback it needs TLS and a token, unless plain HTTP is asked for explicitly.
#[allow(clippy::type_complexity)]
fn metrics_settings(
    file: &mut FileConfig,
    flags: &Flags,
    src: &Sources,
) -> Result<(Option<std::net::SocketAddr>, Option<(PathBuf, PathBuf)>, Option<PathBuf>), ConfigError> {
    let metrics_address = match flags
        .metrics_address
        .clone()
        .or_else(|| (src.env)("VGPU_AGENT_METRICS_ADDRESS"))
        .or(file.metrics_address.take())
        .as_deref()
    {
        None => Some(std::net::SocketAddr::from(([127, 0, 0, 1], 9394))),
        Some("" | "off") => None,
        Some(v) => Some(v.parse().map_err(|_| {
            src.bad("metrics_address", format!("{v:?} is not an address such as 0.0.0.0:9394 (or \"off\")"))
        })?),
    };
    // The metrics endpoint is the agent's only TCP listener: off loopback it needs TLS and a
    // token, unless plain HTTP is asked for explicitly (a port a NetworkPolicy protects).
    let metrics_tls = match (file.metrics_tls_cert.take(), file.metrics_tls_key.take()) {
        (Some(c), Some(k)) => {
            for (key, p) in [("metrics_tls_cert", &c), ("metrics_tls_key", &k)] {
                if !p.is_file() {
                    return Err(src.bad(key, format!("{} is not a readable file", p.display())));
                }
            }
            Some((c, k))
        }
        (None, None) => None,
        _ => return Err(src.bad("metrics_tls_cert", "and metrics_tls_key go together".into())),
    };
    let metrics_token_file = file.metrics_token_file.take();
    if let Some(p) = &metrics_token_file {
        if !p.is_file() {
            return Err(src.bad("metrics_token_file", format!("{} is not a readable file", p.display())));
        }
    }
    if let Some(a) = metrics_address {
        let secured = metrics_tls.is_some() && metrics_token_file.is_some();
        if !a.ip().is_loopback() && !secured && !file.metrics_insecure.unwrap_or(false) {
            return Err(src.bad(
                "metrics_address",
                format!(
                    "{a} is reachable from the network: give metrics_tls_cert, metrics_tls_key and \
                     metrics_token_file, bind it to 127.0.0.1, or set metrics_insecure = true (plain HTTP, \
                     e.g. behind a NetworkPolicy)"
                ),
            ));
        }
    }
    Ok((metrics_address, metrics_tls, metrics_token_file))
}

/// The DRA driver's name when DRA is on (a DNS subdomain: it is one in every ResourceSlice).
fn dra_driver(file: &mut FileConfig, src: &Sources) -> Result<Option<String>, ConfigError> {
    Ok(match (src.env)("VGPU_AGENT_DRA").or(file.dra.take()).as_deref() {
        None | Some("off") => None,
        Some("on") => {
            let driver =
                (src.env)("VGPU_AGENT_DRA_DRIVER").or(file.dra_driver.take()).unwrap_or_else(|| "gpu.vgpu.io".into());
            // A DNS subdomain (the driver name is one in every ResourceSlice and claim result).
            if driver.len() > 63 || !driver.split('.').all(dns_label) {
                return Err(
                    src.bad("dra_driver", format!("{driver:?} is not a DNS subdomain of at most 63 characters"))
                );
            }
            Some(driver)
        }
        Some(v) => return Err(src.bad("dra", format!("{v:?} is not on or off"))),
    })
}

/// How to reach the central scheduler that capacity is reported to, when one is set.
fn report_settings(
    file: &mut FileConfig,
    node_name: &str,
    src: &Sources,
) -> Result<Option<scheduler::ReportConfig>, ConfigError> {
    Ok(match (src.env)("VGPU_AGENT_SCHEDULER_ENDPOINT").or(file.scheduler_endpoint.take()).as_deref() {
        None | Some("" | "off") => None,
        Some(e) => {
            let endpoint = scheduler::Endpoint::parse(e).map_err(|m| src.bad("scheduler_endpoint", m.to_string()))?;
            let mut r = scheduler::ReportConfig::new(endpoint, node_name.to_string());
            r.ca = (src.env)("VGPU_AGENT_SCHEDULER_CA").map(PathBuf::from).or(file.scheduler_ca.take());
            r.token_file =
                (src.env)("VGPU_AGENT_SCHEDULER_TOKEN_FILE").map(PathBuf::from).or(file.scheduler_token_file.take());
            r.server_name = file.scheduler_server_name.take();
            // An empty value is unset (the Helm chart always passes these two).
            let nonempty = |v: Option<String>| v.filter(|s| !s.is_empty()).map(PathBuf::from);
            let cert = nonempty((src.env)("VGPU_AGENT_SCHEDULER_CLIENT_CERT")).or(file.scheduler_client_cert.take());
            let key = nonempty((src.env)("VGPU_AGENT_SCHEDULER_CLIENT_KEY")).or(file.scheduler_client_key.take());
            r.identity = match (cert, key) {
                (None, None) => None,
                (Some(c), Some(k)) => {
                    if !matches!(r.endpoint, scheduler::Endpoint::Https { .. }) {
                        return Err(
                            src.bad("scheduler_client_cert", "a client certificate is for https endpoints".into())
                        );
                    }
                    for (name, p) in [("scheduler_client_cert", &c), ("scheduler_client_key", &k)] {
                        if !p.is_file() {
                            return Err(src.bad(name, format!("{} is not a readable file", p.display())));
                        }
                    }
                    Some((c, k))
                }
                _ => {
                    return Err(src.bad(
                        "scheduler_client_cert",
                        "scheduler_client_cert and scheduler_client_key go together".into(),
                    ))
                }
            };
            let hb = file.scheduler_heartbeat_s.unwrap_or(10);
            if !(1..=3600).contains(&hb) {
                return Err(src.bad("scheduler_heartbeat_s", format!("{hb} is not from 1 to 3600")));
            }
            r.heartbeat = std::time::Duration::from_secs(hb);
            if matches!(r.endpoint, scheduler::Endpoint::Https { .. }) {
                for (k, v) in [("scheduler_ca", &r.ca), ("scheduler_token_file", &r.token_file)] {
                    match v {
                        None => return Err(src.bad(k, format!("is required for {e} (TLS and a bearer token)"))),
                        Some(p) if !p.is_file() => {
                            return Err(src.bad(k, format!("{} is not a readable file", p.display())))
                        }
                        Some(_) => {}
                    }
                }
            }
            Some(r)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn load(file: Option<&str>, env: &[(&str, &str)], flags: Flags) -> Result<Config, ConfigError> {
        let mut flags = flags;
        let dir = std::env::temp_dir().join(format!(
            "vgpu-agent-cfg-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(f) = file {
            let p = dir.join("agent.toml");
            std::fs::write(&p, f).unwrap();
            flags.config = Some(p);
        }
        let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let r = Config::load(&flags, |k| env.get(k).cloned());
        std::fs::remove_dir_all(dir).ok();
        r
    }

    #[test]
    fn mps_gpus_are_all_or_indices_and_uuids() {
        let c = load(Some("mps_gpus = [\"0\", \"GPU-5eed\"]\n"), &[], Flags::default()).unwrap();
        assert!(c.mps.gpus.has(0, "GPU-x") && c.mps.gpus.has(3, "GPU-5eed") && !c.mps.gpus.has(1, "GPU-y"));
        assert_eq!(c.mps.control, PathBuf::from("nvidia-cuda-mps-control"));
        let c = load(None, &[("VGPU_AGENT_MPS_GPUS", "all"), ("VGPU_AGENT_MPS_CONTROL", "/opt/mps")], Flags::default());
        let c = c.unwrap();
        assert_eq!((c.mps.gpus, c.mps.control), (MpsGpus::All, PathBuf::from("/opt/mps")));
        assert_eq!(load(None, &[], Flags::default()).unwrap().mps.gpus, MpsGpus::None);
        let e = load(Some("mps_gpus = [\"first\"]\n"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("mps_gpus") && e.contains("\"first\" is not a GPU index or UUID"), "{e}");
        let f = "[[node]]\nnames = [\"n1\"]\nmps_gpus = [\"all\"]\n";
        assert_eq!(load(Some(f), &[("NODE_NAME", "n1")], Flags::default()).unwrap().mps.gpus, MpsGpus::All);
    }

    #[test]
    fn each_bad_setting_is_refused_naming_its_source_and_what_is_accepted() {
        let refused = |file: &str, env: &[(&str, &str)]| {
            load(Some(file), env, Flags::default()).map(|_| ()).unwrap_err().to_string()
        };
        let from_env = |k: &str, v: &str| refused("", &[(k, v)]);
        let cases = [
            (
                from_env("VGPU_AGENT_DEVICE_PLUGIN", "maybe"),
                "environment variable VGPU_AGENT_DEVICE_PLUGIN: \"maybe\" is not auto or off",
            ),
            (refused("compat = \"x\"\n", &[]), "compat: \"x\" is not replicas, hami or volcano"),
            (refused("log_format = \"xml\"\n", &[]), "log_format: \"xml\" is not text or json"),
            (from_env("VGPU_AGENT_ESCAPE_ACTION", "stop"), "\"stop\" is not report or kill"),
            (from_env("VGPU_AGENT_DRA_SHARING", "all"), "\"all\" is not replicas or capacity"),
            (from_env("VGPU_AGENT_DRA_MIG", "some"), "\"some\" is not existing or dynamic"),
            (from_env("VGPU_AGENT_POD_EVENTS", "yes"), "VGPU_AGENT_POD_EVENTS: \"yes\" is not true or false"),
            (from_env("VGPU_AGENT_MEMORY_TRUE_UP", "on"), "\"on\" is not true or false"),
            (
                from_env("VGPU_AGENT_MONITOR_INTERVAL_MS", "5"),
                "VGPU_AGENT_MONITOR_INTERVAL_MS: 5 is not from 10 to 60000",
            ),
            (from_env("VGPU_AGENT_MAX_SLICES", "many"), "VGPU_AGENT_MAX_SLICES: \"many\" is not a number"),
            (refused("stall_after_s = 0\n", &[]), "stall_after_s: 0 is not from 1 to 86400"),
            (refused("health_recovery_s = 90000\n", &[]), "health_recovery_s: 90000 is not from 1 to 86400"),
            (refused("memory_factor = 0\n", &[]), "memory_factor: 0 is not from 1 to 1048576"),
            (refused("register_interval_s = 0\n", &[]), "register_interval_s: 0 is not from 1 to 3600"),
        ];
        for (got, want) in cases {
            assert!(got.contains(want), "{got:?} should say {want:?}");
        }
        // Aliases and defaults.
        let c = load(Some(""), &[("VGPU_AGENT_DEVICE_PLUGIN", "on"), ("VGPU_AGENT_POD_EVENTS", "0")], Flags::default());
        let c = c.unwrap();
        assert!(c.device_plugin && !c.pod_events && c.memory_true_up);
        assert_eq!((c.compat, c.log_format, c.monitor_interval_ms), (Compat::Replicas, LogFormat::Text, 100));
    }

    #[test]
    fn node_sections_give_some_nodes_their_own_keys() {
        let f = "split_count = 10\nmemory_scaling = 1.5\n[[node]]\nnames = [\"gpu-l4-*\", \"edge-1\"]\nsplit_count = 2\n[[node]]\nnames = [\"gpu-*\"]\nsplit_count = 7\nmemory_scaling = 1\n";
        let on = |node: &str| load(Some(f), &[("NODE_NAME", node)], Flags::default()).unwrap();
        // The first section naming the node wins; what it leaves out stays the file's.
        let c = on("gpu-l4-03");
        assert_eq!((c.split_count, c.memory_scaling), (2, 1.5));
        assert_eq!(c.node_section, Some((0, vec!["gpu-l4-*".to_string(), "edge-1".to_string()])));
        assert_eq!((on("edge-1").split_count, on("edge-10").split_count), (2, 10), "exact without a *");
        let c = on("gpu-a100-1");
        assert_eq!((c.split_count, c.memory_scaling, c.node_section.map(|s| s.0)), (7, 1.0, Some(1)));
        let c = on("cpu-1");
        assert_eq!((c.split_count, c.memory_scaling, c.node_section), (10, 1.5, None));
        // The environment still wins over a section; a section's values are checked as the file's.
        let c = load(Some(f), &[("NODE_NAME", "gpu-a100-1"), ("VGPU_AGENT_MEMORY_SCALING", "2")], Flags::default());
        assert_eq!(c.unwrap().memory_scaling, 2.0);
        let e = load(Some("[[node]]\nnames = [\"n1\"]\nsplit_count = 0\n"), &[("NODE_NAME", "n1")], Flags::default());
        assert!(e.unwrap_err().to_string().contains("split_count: 0 is not from 1 to 100"));
        for bad in ["names = []", "names = [\"\"]", "names = [\"g*pu\"]"] {
            let e = load(Some(&format!("[[node]]\n{bad}\n")), &[], Flags::default()).unwrap_err().to_string();
            assert!(e.contains("node[0]: names must list node names"), "{bad}: {e}");
        }
        let e = load(Some("[[node]]\nnames = [\"n1\"]\ncompat = \"hami\"\n"), &[], Flags::default()).unwrap_err();
        assert!(e.to_string().contains("unknown field `compat`"), "{e}");
    }

    #[test]
    fn hami_s_per_node_configuration_is_read_for_this_node() {
        let dir = std::env::temp_dir().join(format!("vgpu-agent-haminode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("config.json");
        // As HAMi's chart writes it: one entry per node, keys in lower case.
        std::fs::write(
            &json,
            r#"{"nodeconfig": [
            {"name": "gpu-1", "operatingmode": "hami-core", "devicememoryscaling": 1.8, "devicesplitcount": 20,
             "preconfigureddevicememory": 0, "migstrategy": "none", "filterdevices": {"uuid": [], "index": []}},
            {"name": "gpu-2", "devicesplitcount": 5},
            {"name": "gpu-3", "filterdevices": {"index": [1]}},
            {"name": "gpu-4", "operatingmode": "mps"},
            {"name": "gpu-5", "operatingmode": "vgpu"}]}"#,
        )
        .unwrap();
        let f = format!("split_count = 10\nhami_node_config_file = {:?}\n", json.to_str().unwrap());
        let on = |node: &str, extra: &str| load(Some(&format!("{f}{extra}")), &[("NODE_NAME", node)], Flags::default());
        let c = on("gpu-1", "").unwrap();
        assert_eq!((c.split_count, c.memory_scaling, c.hami_node_entry), (20, 1.8, true));
        let c = on("gpu-2", "").unwrap();
        assert_eq!((c.split_count, c.memory_scaling), (5, 1.0), "what the entry leaves out stays the file's");
        let c = on("gpu-9", "").unwrap();
        assert_eq!((c.split_count, c.hami_node_entry), (10, false), "no entry: the file's");
        // A [[node]] section naming the node comes after it.
        assert_eq!(on("gpu-1", "[[node]]\nnames = [\"gpu-1\"]\nsplit_count = 3\n").unwrap().split_count, 3);
        // What the agent cannot do as HAMi's plugin would is refused, naming the node.
        let e = on("gpu-3", "").unwrap_err().to_string();
        assert!(e.contains("hami_node_config_file") && e.contains("node gpu-3: filterdevices is not supported"), "{e}");
        assert_eq!(on("gpu-4", "").unwrap().mps.gpus, MpsGpus::All, "operatingmode mps: every GPU runs MPS");
        assert_eq!(on("gpu-1", "").unwrap().mps.gpus, MpsGpus::None);
        let e = on("gpu-5", "").unwrap_err().to_string();
        assert!(e.contains("node gpu-5: operatingmode \"vgpu\" is not hami-core, mig or mps"), "{e}");
        std::fs::write(&json, "{\"nodes\": []}").unwrap();
        let e = on("gpu-1", "").unwrap_err().to_string();
        assert!(e.contains("missing field `nodeconfig`"), "{e}");
        // The chart's empty variable is no file.
        let c = load(Some("split_count = 6"), &[("VGPU_AGENT_HAMI_NODE_CONFIG_FILE", "")], Flags::default()).unwrap();
        assert_eq!(c.split_count, 6);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn metrics_off_loopback_need_tls_and_a_token_or_an_explicit_opt_out() {
        let e = load(Some("metrics_address = \"0.0.0.0:9394\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("reachable from the network") && e.contains("metrics_insecure"), "{e}");
        let c =
            load(Some("metrics_address = \"0.0.0.0:9394\"\nmetrics_insecure = true"), &[], Flags::default()).unwrap();
        assert!(c.metrics_tls.is_none());
        let f = "metrics_address = \"0.0.0.0:9394\"\nmetrics_tls_cert = \"/etc/hostname\"\nmetrics_tls_key = \"/etc/hostname\"\nmetrics_token_file = \"/etc/hostname\"";
        assert!(load(Some(f), &[], Flags::default()).unwrap().metrics_tls.is_some());
        let e = load(Some("metrics_tls_cert = \"/etc/hostname\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("go together"), "{e}");
    }

    #[test]
    fn the_pod_resources_socket_sits_beside_the_device_plugin_directory() {
        let c = load(None, &[], Flags::default()).unwrap();
        assert_eq!(c.pod_resources_socket.as_deref(), Some(Path::new("/var/lib/kubelet/pod-resources/kubelet.sock")));
        assert_eq!(c.slice_gc_grace_s, 60);
        let c = load(None, &[("VGPU_AGENT_KUBELET_DIR", "/k/device-plugins")], Flags::default()).unwrap();
        assert_eq!(c.pod_resources_socket.as_deref(), Some(Path::new("/k/pod-resources/kubelet.sock")));
        // A kubelet with a root of its own: its sockets there, the device plugins where they are.
        let c = load(Some("kubelet_root_dir = \"/var/lib/k0s/kubelet\""), &[], Flags::default()).unwrap();
        assert_eq!(
            c.pod_resources_socket.as_deref(),
            Some(Path::new("/var/lib/k0s/kubelet/pod-resources/kubelet.sock"))
        );
        assert_eq!(c.kubelet_dir, Path::new("/var/lib/kubelet/device-plugins"));
        let e = load(Some("kubelet_root_dir = \"k\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("kubelet_root_dir") && e.contains("absolute"), "{e}");
        let c = load(Some("pod_resources_socket = \"off\"\nslice_gc_grace_s = 5"), &[], Flags::default()).unwrap();
        assert_eq!((c.pod_resources_socket, c.slice_gc_grace_s), (None, 5));
        let e = load(Some("pod_resources_socket = \"kubelet.sock\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("pod_resources_socket") && e.contains("absolute"), "{e}");
        let e = load(None, &[("VGPU_AGENT_SLICE_GC_GRACE_S", "0")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("VGPU_AGENT_SLICE_GC_GRACE_S") && e.contains("is not from 1 to 86400"), "{e}");
    }

    #[test]
    fn scheduler_reporting_needs_tls_material_for_https() {
        assert!(load(None, &[], Flags::default()).unwrap().scheduler.is_none());
        let e = load(Some("scheduler_endpoint = \"http://s:1\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("scheduler_endpoint") && e.contains("plain http"), "{e}");
        let e = load(Some("scheduler_endpoint = \"https://s:1\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("scheduler_ca: is required"), "{e}");
        let f = "scheduler_endpoint = \"https://s:1\"\nscheduler_ca = \"/nonexistent/ca.pem\"\nscheduler_token_file = \"/etc/hostname\"";
        let e = load(Some(f), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/ca.pem is not a readable file"), "{e}");
        let c = load(
            None,
            &[("VGPU_AGENT_SCHEDULER_ENDPOINT", "unix:///run/s.sock"), ("NODE_NAME", "n1")],
            Flags::default(),
        )
        .unwrap()
        .scheduler
        .unwrap();
        assert_eq!((c.endpoint.to_string(), c.node.as_str()), ("unix:///run/s.sock".to_string(), "n1"));
        let e = load(Some("scheduler_endpoint = \"unix:///s\"\nscheduler_heartbeat_s = 0"), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("scheduler_heartbeat_s"), "{e}");
        let https = "scheduler_endpoint = \"https://s:1\"\nscheduler_ca = \"/etc/hostname\"\nscheduler_token_file = \"/etc/hostname\"\n";
        let e = load(Some(&format!("{https}scheduler_client_cert = \"/etc/hostname\"")), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("go together"), "{e}");
        let both = "scheduler_client_cert = \"/etc/hostname\"\nscheduler_client_key = \"/etc/hostname\"";
        let c = load(Some(&format!("{https}{both}")), &[], Flags::default()).unwrap().scheduler.unwrap();
        assert_eq!(c.identity, Some((PathBuf::from("/etc/hostname"), PathBuf::from("/etc/hostname"))));
        let e = load(Some(&format!("scheduler_endpoint = \"unix:///s\"\n{both}")), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("for https"), "{e}");
        let empty = [("VGPU_AGENT_SCHEDULER_CLIENT_CERT", ""), ("VGPU_AGENT_SCHEDULER_CLIENT_KEY", "")];
        let c = load(Some(https), &empty, Flags::default()).unwrap().scheduler.unwrap();
        assert_eq!(c.identity, None, "empty values (the Helm chart's default) are unset");
    }

    #[test]
    fn defaults_and_precedence() {
        let c = load(None, &[], Flags::default()).unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/vgpu"));
        assert_eq!(c.cdi_dir.as_deref(), Some(Path::new("/var/run/cdi")), "the runtime's, for the node's agent");
        let mine = load(Some("state_dir = \"/tmp/mine\""), &[], Flags::default()).unwrap();
        assert_eq!(mine.cdi_dir.as_deref(), Some(Path::new("/tmp/mine/cdi")), "an agent of its own keeps its specs");
        assert_eq!(
            (c.monitor_interval_ms, c.log_format, c.escape_action),
            (100, LogFormat::Text, EscapeAction::Report)
        );
        let c = load(
            Some("state_dir = \"/srv/a\"\nmonitor_interval_ms = 250\nescape_action = \"kill\"\nnvml_library = \"/x/nvml.so\""),
            &[("VGPU_AGENT_STATE_DIR", "/srv/b"), ("VGPU_AGENT_LOG_FORMAT", "json")],
            Flags { state_dir: Some("/srv/c".into()), ..Default::default() },
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/srv/c"), "flags over environment over file");
        assert_eq!((c.monitor_interval_ms, c.log_format, c.escape_action), (250, LogFormat::Json, EscapeAction::Kill));
        assert!(c.memory_true_up, "on by default");
        let off = load(Some("memory_true_up = false"), &[], Flags::default()).unwrap();
        assert!(!off.memory_true_up);
        let on = load(Some("memory_true_up = false"), &[("VGPU_AGENT_MEMORY_TRUE_UP", "1")], Flags::default()).unwrap();
        assert!(on.memory_true_up, "the environment over the file");
        assert!(c.pod_events, "pod events on by default");
        let quiet = load(Some("pod_events = false"), &[], Flags::default()).unwrap();
        assert!(!quiet.pod_events);
        let e = load(None, &[("VGPU_AGENT_POD_EVENTS", "maybe")], Flags::default()).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Variable { var, .. } if var == "VGPU_AGENT_POD_EVENTS"),
            "blamed on the variable, not a file: {e}"
        );
        let e = load(None, &[("VGPU_AGENT_MEMORY_TRUE_UP", "maybe")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("VGPU_AGENT_MEMORY_TRUE_UP"), "{e}");
        assert_eq!(c.nvml_library, Some(PathBuf::from("/x/nvml.so")));
        assert_eq!(c.metrics_address, Some("127.0.0.1:9394".parse().unwrap()));
        let c = load(
            Some("metrics_address = \"127.0.0.1:9500\""),
            &[("VGPU_AGENT_METRICS_ADDRESS", "off")],
            Flags::default(),
        )
        .unwrap();
        assert_eq!(c.metrics_address, None, "the environment switches metrics off");
    }

    #[test]
    fn the_dra_driver_needs_a_dns_name_cdi_and_no_device_plugin() {
        let ok = load(Some("dra = \"on\"\ndevice_plugin = \"off\""), &[], Flags::default()).unwrap();
        assert_eq!(ok.dra.as_deref(), Some("gpu.vgpu.io"));
        assert_eq!(load(None, &[], Flags::default()).unwrap().dra, None, "off unless asked for");
        let e = load(Some("dra = \"on\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("dra: set device_plugin = \"off\""), "{e}");
        let e = load(Some("dra = \"on\"\ndevice_plugin = \"off\"\ndra_driver = \"GPU_x\""), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("dra_driver: \"GPU_x\" is not a DNS subdomain"), "{e}");
        assert_eq!(ok.dra_sharing, DraSharing::Replicas, "replicas by default");
        let c = load(Some("dra = \"on\"\ndevice_plugin = \"off\"\ndra_sharing = \"capacity\""), &[], Flags::default())
            .unwrap();
        assert_eq!(c.dra_sharing, DraSharing::Capacity);
        let e = load(None, &[("VGPU_AGENT_DRA_SHARING", "shared")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("VGPU_AGENT_DRA_SHARING: \"shared\" is not replicas or capacity"), "{e}");
        assert_eq!(ok.dra_mig, DraMig::Existing, "existing MIG devices by default");
        let c = load(None, &[("VGPU_AGENT_DRA_MIG", "dynamic")], Flags::default()).unwrap();
        assert_eq!(c.dra_mig, DraMig::Dynamic);
        // The scheduler's MIG geometries: read and checked at start, errors naming the file.
        assert!(ok.mig_geometries.is_empty(), "each GPU's own geometries by default");
        let dir = std::env::temp_dir().join(format!("vgpu-agent-geo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let geo = dir.join("geo.yaml");
        std::fs::write(&geo, "- models: [A30]\n  allowedGeometries:\n  - - {name: 1g.6gb, memory: 6144, count: 4}\n")
            .unwrap();
        let c =
            load(Some(&format!("mig_geometries_file = {:?}", geo.to_str().unwrap())), &[], Flags::default()).unwrap();
        assert_eq!(c.mig_geometries[0].models, ["A30"]);
        std::fs::write(&geo, "- models: [A30]\n  allowedGeometries:\n  - - {name: 1g.6gb, memory: 6144}\n").unwrap();
        let e = load(None, &[("VGPU_AGENT_MIG_GEOMETRIES_FILE", geo.to_str().unwrap())], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("VGPU_AGENT_MIG_GEOMETRIES_FILE:") && e.contains("geo.yaml: entry 0 (A30): geometry 0"),
            "{e}"
        );
        let e = load(Some("mig_geometries_file = \"/nonexistent/geo.yaml\""), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("mig_geometries_file: cannot read /nonexistent/geo.yaml"), "{e}");
        // The chart's empty variable is no file (each GPU's own geometries).
        let c = load(None, &[("VGPU_AGENT_MIG_GEOMETRIES_FILE", "")], Flags::default()).unwrap();
        assert!(c.mig_geometries.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
        let e = load(Some("dra_mig = \"auto\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("dra_mig: \"auto\" is not existing or dynamic"), "{e}");
        let e = load(Some("dra = \"on\"\ndevice_plugin = \"off\"\ncdi_dir = \"off\""), &[], Flags::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cdi_dir must not be off"), "{e}");
        let e = load(Some("dra = \"yes\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("dra: \"yes\" is not on or off"), "{e}");
    }

    #[test]
    fn bad_files_are_rejected_precisely() {
        let e = load(Some("monitor_interval_ms = 5"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("monitor_interval_ms: 5 is not from"), "{e}");
        let e = load(Some("colour = 1"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("unknown field `colour`"), "{e}");
        let e = load(Some("state_dir = \"relative\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("state_dir: relative is not an absolute path"), "{e}");
        let e = load(Some("escape_action = \"shout\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("escape_action: \"shout\""), "{e}");
        let e = load(Some("monitor_interval_ms = \"x\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("agent.toml") && e.contains("monitor_interval_ms"), "{e}");
        let e = load(Some("metrics_address = \"localhost\""), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("metrics_address: \"localhost\" is not an address"), "{e}");
        let e = load(Some("health_recovery_s = 0"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("health_recovery_s: 0 is not from"), "{e}");
        let e = load(Some("stall_after_s = 0"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("stall_after_s: 0 is not from"), "{e}");
        let e = load(None, &[("VGPU_AGENT_STALL_AFTER_S", "soon")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("environment variable VGPU_AGENT_STALL_AFTER_S: \"soon\" is not a number"), "{e}");
        assert_eq!(load(None, &[], Flags::default()).unwrap().log_level, "info");
        let c = load(Some("log_level = \"warn,vgpu_agent::monitor=debug\""), &[], Flags::default()).unwrap();
        assert_eq!(c.log_level, "warn,vgpu_agent::monitor=debug");
        let e = load(None, &[("VGPU_AGENT_LOG_LEVEL", "monitor=verbose")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("VGPU_AGENT_LOG_LEVEL: \"monitor=verbose\" is not a level"), "{e}");
        let e = load(Some("max_slices = 0"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("max_slices: 0 is not from 1 to 8192"), "{e}");
        assert_eq!(load(None, &[], Flags::default()).unwrap().max_slices, crate::slices::DEFAULT_MAX_SLICES);
        assert_eq!(load(None, &[], Flags::default()).unwrap().stall_after_s, 60);
        // Priority: granted to the namespaces named, each a namespace's name or *.
        let c = load(Some("priority_namespaces = [\"serving\", \"ml-1\"]"), &[], Flags::default()).unwrap();
        assert!(c.may_have_priority("ml-1") && !c.may_have_priority("ml"));
        assert!(!load(None, &[], Flags::default()).unwrap().may_have_priority("default"), "none by default");
        let c = load(None, &[("VGPU_AGENT_PRIORITY_NAMESPACES", "*")], Flags::default()).unwrap();
        assert!(c.may_have_priority("anything"));
        let e = load(Some("priority_namespaces = [\"Team_A\"]"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("priority_namespaces: \"Team_A\" is not a namespace name"), "{e}");
        let e = load(Some("priority_min_share = 90"), &[], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("priority_min_share: 90 is not from 1 to 50"), "{e}");
        for v in ["0", "-1", "11", "nan"] {
            let e = load(Some(&format!("memory_scaling = {v}")), &[], Flags::default()).unwrap_err().to_string();
            assert!(e.contains("memory_scaling:") && e.contains("is not above 0 and at most 10"), "{v}: {e}");
        }
        let c = load(Some("memory_scaling = 1.5"), &[], Flags::default()).unwrap();
        assert_eq!(c.memory_scaling, 1.5);
        assert_eq!(load(None, &[], Flags::default()).unwrap().memory_scaling, 1.0);
        let c = load(Some("memory_scaling = 1.5"), &[("VGPU_AGENT_MEMORY_SCALING", "2")], Flags::default()).unwrap();
        assert_eq!(c.memory_scaling, 2.0, "the environment wins");
        let e = load(None, &[("VGPU_AGENT_MONITOR_INTERVAL_MS", "soon")], Flags::default()).unwrap_err().to_string();
        assert!(e.contains("\"soon\" is not a number"), "{e}");
    }
}

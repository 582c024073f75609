//! The agent's shared state: configuration, the slice record (kept in memory, persisted by the
//! store), the inventory, GPU health, counters and the latest status, which the monitoring thread
//! publishes after every pass and the API and metrics endpoints read.

use crate::config::Config;
use crate::describe::{exact, priority_pb};
use crate::discovery::Inventory;
use crate::health::Health;
use crate::monitor::Pass;
use crate::slices::{Injection, Priority, Slice, SliceError, SliceGpu, SliceStore};
use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::watch;
use vgpu_proto::v1 as pb;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Default)]
pub struct Stats {
    pub passes: AtomicU64,
    pub reclaimed_bytes: AtomicU64,
    pub escapes_total: AtomicU64,
    pub escapes_unaccounted: AtomicU64,
    pub escapes_over_limit: AtomicU64,
    pub escapes_bypass: AtomicU64,
    pub loop_us: AtomicU64,
    pub loop_max_us: AtomicU64,
    pub loop_us_total: AtomicU64,
    /// When the last monitoring pass completed: milliseconds since the agent started, plus one (0:
    /// none yet).
    pub last_pass_ms: AtomicU64,
    /// Replica slices removed because no container holds their devices any more.
    pub slices_collected: AtomicU64,
}

/// Something a monitoring pass saw happen, for the Kubernetes Events (see `events`).
#[derive(Clone, Debug, PartialEq)]
pub enum Notice {
    /// An escape seen for the first time (with the action taken).
    Escape(pb::Escape),
    /// A GPU became unhealthy (with why) or healthy again.
    Health { gpu: String, index: u32, healthy: bool, reason: String },
    /// A MIG device (`device`, its UUID) of GPU instance `gpu_instance` became unhealthy (with
    /// why) or healthy again while its GPU stayed as it was.
    MigHealth { gpu: String, index: u32, device: String, gpu_instance: u32, healthy: bool, reason: String },
}

/// The most notices kept for the Events task (the oldest go first).
pub const NOTICES_KEPT: usize = 256;

pub struct Agent {
    pub cfg: Config,
    pub store: SliceStore,
    slices: RwLock<BTreeMap<String, Slice>>,
    /// The same, as the monitoring thread reads it every pass (rebuilt on change).
    snapshot: RwLock<Arc<Vec<Slice>>>,
    /// Serialises slice changes (the record on disk and in memory change together).
    changing: Mutex<()>,
    pub library: Option<PathBuf>,
    pub inventory: RwLock<Inventory>,
    pub health: Arc<Health>,
    pub stats: Stats,
    pub ready: AtomicBool,
    status: watch::Sender<Arc<pb::NodeStatus>>,
    started: Instant,
    hostname: String,
    /// Bound metrics address (after binding port 0, the real port).
    pub metrics_address: RwLock<Option<std::net::SocketAddr>>,
    /// NVML, once opened (the MIG operations use it).
    pub nvml: std::sync::OnceLock<Arc<nvml_wrapper::Nvml>>,
    /// The MIG applier's records (`<state_dir>/mig`), and one MIG operation at a time.
    pub mig: Mutex<vgpu_mig::apply::Store>,
    /// Resident memory, read every tenth pass.
    rss: AtomicU64,
    /// Wakes the monitoring thread for a pass now (after a slice change).
    kick: (std::sync::Mutex<bool>, std::sync::Condvar),
    /// Notified after every published pass and every drain change (the capacity reporter waits on it).
    pub capacity_changed: tokio::sync::Notify,
    /// GPUs the scheduler drained (by UUID); the capacity reporter loads and keeps them.
    pub drained: RwLock<std::collections::BTreeSet<String>>,
    /// MIG profile tables by GPU UUID (they never change), read once from NVML.
    pub mig_profiles: Mutex<std::collections::HashMap<String, Vec<vgpu_mig::model::Profile>>>,
    /// Who holds each MIG device given out whole (by MIG UUID), as each feature that gives them out
    /// (the DRA driver, HAMi mode) last said; see [`Agent::set_mig_holders`].
    mig_holders: RwLock<BTreeMap<&'static str, BTreeMap<String, String>>>,
    /// The containers HAMi mode gave MIG devices to, by MIG UUID (see [`Agent::set_mig_containers`]).
    mig_containers: RwLock<BTreeMap<String, pb::MigContainer>>,
    /// The DRA claims prepared with admin access, as the monitoring pass knows their containers'
    /// processes; see [`Agent::refresh_admitted`].
    pub admitted: RwLock<Arc<Vec<crate::monitor::Admitted>>>,
    /// Conditions an operator must act on, by their source (see [`Agent::warn`]).
    warnings: RwLock<BTreeMap<String, String>>,
    /// What happened that Kubernetes Events report (see `events`), kept only once something takes
    /// them (`notices_wanted`), at most [`NOTICES_KEPT`].
    pub notices: Mutex<std::collections::VecDeque<Notice>>,
    pub notices_wanted: AtomicBool,
    /// The MPS control daemons, by GPU UUID, as the supervisor last found them (see `mps`).
    pub mps: RwLock<BTreeMap<String, pb::MpsStatus>>,
}

/// Why the agent's records could not be loaded at start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The slice records.
    #[error("{0}")]
    Slices(#[from] SliceError),
    /// The MIG applier's records.
    #[error("{0}")]
    Mig(String),
}

/// A slice API error: what gRPC status it maps to, and the message.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Exists(String),
    #[error("{0}")]
    Busy(String),
    /// A node-wide bound is reached (`max_slices`).
    #[error("{0}")]
    Full(String),
    #[error("{0}")]
    Internal(String),
}

impl From<SliceError> for ApiError {
    fn from(e: SliceError) -> ApiError {
        use crate::slices::ErrorKind as K;
        let m = e.msg;
        match e.kind {
            K::Exists => ApiError::Exists(m),
            K::NotFound => ApiError::NotFound(m),
            K::Busy => ApiError::Busy(m),
            K::Invalid => ApiError::Invalid(m),
            K::Full => ApiError::Full(m),
            K::Io => ApiError::Internal(m),
        }
    }
}

impl Agent {
    pub fn new(cfg: Config, store: SliceStore, library: Option<PathBuf>) -> Result<Agent, LoadError> {
        let node_name = cfg.node_name.clone();
        let listing = store.list()?;
        let list = listing.slices;
        let mut warnings = BTreeMap::new();
        for (name, why) in listing.quarantined {
            tracing::error!(slice = %name, error = %why, "slice quarantined: its record cannot be read");
            warnings.insert(quarantine_source(&name), quarantine_text(&name, &why));
        }
        let snapshot = RwLock::new(Arc::new(list.clone()));
        let slices = list.into_iter().map(|s| (s.name.clone(), s)).collect();
        let health = Arc::new(Health::new(std::time::Duration::from_secs(cfg.health_recovery_s)));
        let mig = Mutex::new(
            vgpu_mig::apply::Store::open(&cfg.state_dir.join("mig")).map_err(|e| LoadError::Mig(e.to_string()))?,
        );
        Ok(Agent {
            cfg,
            store,
            slices: RwLock::new(slices),
            snapshot,
            changing: Mutex::new(()),
            library,
            inventory: RwLock::new(Inventory::default()),
            health,
            stats: Stats::default(),
            ready: AtomicBool::new(false),
            status: watch::Sender::new(Arc::new(pb::NodeStatus::default())),
            started: Instant::now(),
            // The node's name as everything else has it (the metrics, the capacity report, the
            // Kubernetes objects): `NODE_NAME`, else the host's name. In a pod the host name is the
            // pod's.
            hostname: node_name,
            metrics_address: RwLock::new(None),
            kick: (std::sync::Mutex::new(false), std::sync::Condvar::new()),
            rss: AtomicU64::new(0),
            nvml: std::sync::OnceLock::new(),
            mig,
            capacity_changed: tokio::sync::Notify::new(),
            drained: RwLock::new(Default::default()),
            mig_profiles: Mutex::new(Default::default()),
            mig_holders: RwLock::new(Default::default()),
            mig_containers: RwLock::new(Default::default()),
            admitted: RwLock::new(Default::default()),
            warnings: RwLock::new(warnings),
            notices: Mutex::new(Default::default()),
            notices_wanted: AtomicBool::new(false),
            mps: RwLock::new(BTreeMap::new()),
        })
    }

    /// Sleeps until `timeout` passes or a pass is asked for.
    pub fn sleep(&self, timeout: std::time::Duration) {
        let (m, c) = &self.kick;
        let g = m.lock().unwrap_or_else(|p| p.into_inner());
        let (mut g, _) = c.wait_timeout_while(g, timeout, |k| !*k).unwrap_or_else(|p| p.into_inner());
        *g = false;
    }

    /// Asks for a pass now and waits (up to a second) until one has been published, so that a status
    /// read after a slice change shows it.
    pub fn refresh(&self) {
        if !self.ready.load(Acquire) {
            return;
        }
        let seq = self.status().sequence;
        let (m, c) = &self.kick;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
        c.notify_all();
        let t = Instant::now();
        // Two passes: the one running when asked may have started before the change.
        while self.status().sequence < seq + 2 && t.elapsed() < std::time::Duration::from_secs(1) {
            *m.lock().unwrap_or_else(|p| p.into_inner()) = true;
            c.notify_all();
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Every slice, in name order.
    pub fn slices(&self) -> Arc<Vec<Slice>> {
        self.snapshot.read().clone()
    }

    fn resnapshot(&self) {
        *self.snapshot.write() = Arc::new(self.slices.read().values().cloned().collect());
    }

    pub fn status(&self) -> Arc<pb::NodeStatus> {
        self.status.borrow().clone()
    }

    /// How long ago the last monitoring pass completed; None before the first.
    pub fn pass_age(&self) -> Option<std::time::Duration> {
        let done = self.stats.last_pass_ms.load(Relaxed);
        let since_start = self.started.elapsed();
        (done > 0).then(|| since_start.saturating_sub(std::time::Duration::from_millis(done - 1)))
    }

    /// Whether the monitoring has stalled: no pass completed for `stall_after_s` beyond its interval
    /// (an NVML call that does not return, most often). Then, why.
    pub fn stalled(&self) -> Option<String> {
        let age = self.pass_age()?;
        let limit = std::time::Duration::from_secs(self.cfg.stall_after_s)
            + std::time::Duration::from_millis(self.cfg.monitor_interval_ms);
        (age > limit).then(|| {
            format!(
                "monitoring stalled: no pass completed for {} s (an NVML call not returning?); the status shown is from \
                 the last one",
                age.as_secs()
            )
        })
    }

    /// The status to show now: the last pass's, with a warning added while the monitoring has stalled
    /// (so that `vgpuctl status` and the metrics say so, not only an old timestamp).
    pub fn live_status(&self) -> Arc<pb::NodeStatus> {
        let st = self.status();
        match self.stalled() {
            None => st,
            Some(why) => {
                let mut s = (*st).clone();
                s.warnings.push(why);
                Arc::new(s)
            }
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<pb::NodeStatus>> {
        self.status.subscribe()
    }

    /// What a GPU of `total` bytes counts as for slices, the device plugin and capacity reports:
    /// `total` times `memory_scaling`, in whole MiB (`total` itself at 1).
    pub fn scaled(&self, total: u64) -> u64 {
        scaled(total, self.cfg.memory_scaling)
    }

    /// Resolves a GPU given as a node index or a UUID (or a unique UUID prefix).
    pub fn resolve_gpu(&self, gpu: &str) -> Result<(String, u64), ApiError> {
        let inv = self.inventory.read();
        let g = if let Ok(i) = gpu.parse::<u32>() {
            inv.gpus.iter().find(|g| g.index == i)
        } else {
            let m: Vec<_> = inv.gpus.iter().filter(|g| g.uuid.starts_with(gpu)).collect();
            if m.len() > 1 {
                return Err(ApiError::Invalid(format!("GPU {gpu:?} matches {} GPUs; give more of the UUID", m.len())));
            }
            m.first().copied()
        };
        let g = g.ok_or_else(|| {
            ApiError::Invalid(match inv.gpus.len() {
                0 => format!("no GPU {} on this node (it has no GPU)", crate::slices::shown(gpu)),
                1 => format!("no GPU {} on this node (it has 1 GPU: index 0, or its UUID)", crate::slices::shown(gpu)),
                n => format!(
                    "no GPU {} on this node (it has {n} GPUs: indices 0 to {}, or their UUIDs)",
                    crate::slices::shown(gpu),
                    n - 1
                ),
            })
        })?;
        Ok((g.uuid.clone(), g.memory_total))
    }

    fn limits(&self, gpus: &[pb::SliceGpuLimit]) -> Result<Vec<SliceGpu>, ApiError> {
        let mut v: Vec<SliceGpu> = Vec::new();
        for g in gpus {
            let (uuid, total) = self.resolve_gpu(&g.gpu)?;
            let cap = self.scaled(total);
            if g.memory > cap {
                let scaling =
                    if cap == total { String::new() } else { format!(", memory_scaling {}", self.cfg.memory_scaling) };
                return Err(ApiError::Invalid(format!(
                    "memory limit {} is more than GPU {} has ({}{scaling})",
                    exact(g.memory, cap),
                    g.gpu,
                    exact(cap, g.memory)
                )));
            }
            if v.iter().any(|x| x.uuid == uuid) {
                return Err(ApiError::Invalid(format!("GPU {} given twice", g.gpu)));
            }
            v.push(SliceGpu { uuid, memory: g.memory, sm: g.sm });
        }
        Ok(v)
    }

    pub fn create_slice(&self, req: pb::CreateSliceRequest) -> Result<pb::SliceDetail, ApiError> {
        if req.gpus.is_empty() {
            return Err(ApiError::Invalid("a slice needs at least one GPU".into()));
        }
        let gpus = self.limits(&req.gpus)?;
        let priority = priority_of(req.priority)?;
        let _g = self.changing.lock();
        let s = self.store.create_with(&req.name, gpus, req.labels.into_iter().collect(), priority)?;
        tracing::info!(slice = %s.name, gpus = s.gpus.len(), labels = ?s.labels, ?priority, "slice created");
        self.write_cdi(&s.name);
        self.slices.write().insert(s.name.clone(), s.clone());
        self.resnapshot();
        drop(_g);
        self.refresh();
        self.detail(&s)
    }

    pub fn update_slice(&self, req: pb::UpdateSliceRequest) -> Result<pb::SliceDetail, ApiError> {
        let gpus = self.limits(&req.gpus)?;
        let priority = req.priority.map(priority_of).transpose()?;
        let _g = self.changing.lock();
        let mut s = self.store.update(&req.name, &gpus)?;
        if let Some(p) = priority.filter(|&p| p != s.priority) {
            s = self.store.set_priority(&req.name, p)?;
            tracing::info!(slice = %s.name, priority = ?p, "slice priority changed");
        }
        tracing::info!(slice = %s.name, "slice limits changed");
        self.slices.write().insert(s.name.clone(), s.clone());
        self.resnapshot();
        drop(_g);
        self.refresh();
        self.detail(&s)
    }

    /// Sets `labels` on a slice (merged into those it has); nothing is written when none changes.
    pub fn label_slice(&self, name: &str, labels: &[(&str, &str)]) -> Result<(), ApiError> {
        let _g = self.changing.lock();
        let Some(cur) = self.slices.read().get(name).cloned() else {
            return Err(ApiError::NotFound(format!("no slice named {}", crate::slices::shown(name))));
        };
        if labels.iter().all(|(k, v)| cur.labels.get(*k).map(String::as_str) == Some(*v)) {
            return Ok(());
        }
        let mut merged = cur.labels.clone();
        for (k, v) in labels {
            merged.insert(k.to_string(), v.to_string());
        }
        let s = self.store.set_labels(name, merged)?;
        tracing::info!(slice = %name, labels = ?labels, "slice labelled");
        self.slices.write().insert(s.name.clone(), s);
        self.resnapshot();
        Ok(())
    }

    pub fn delete_slice(&self, name: &str, force: bool) -> Result<(), ApiError> {
        let _g = self.changing.lock();
        let quarantined = self.warnings.read().contains_key(&quarantine_source(name));
        if quarantined && !force {
            return Err(ApiError::Busy(format!(
                "slice {name} is quarantined (its record cannot be read); delete it with force"
            )));
        }
        self.store.delete(name, force)?;
        for source in [quarantine_source(name), format!("restored:{name}"), format!("suspended:{name}")] {
            self.warn(&source, None);
        }
        if let Some(d) = &self.cfg.cdi_dir {
            crate::cdi::remove(d, name);
        }
        self.slices.write().remove(name);
        self.resnapshot();
        tracing::info!(slice = %name, force, "slice deleted");
        drop(_g);
        self.refresh();
        self.prune_libraries();
        Ok(())
    }

    /// Removes the library installs no container can need any more (see
    /// [`crate::slices::prune_libraries`]): at start, after a slice goes, and with each inventory
    /// refresh.
    pub fn prune_libraries(&self) {
        let Some(current) = &self.library else { return };
        let Some(dir) = current.parent() else { return };
        let slices: Vec<Slice> = self.slices.read().values().cloned().collect();
        for p in crate::slices::prune_libraries(dir, current, &slices) {
            tracing::info!(library = %p.display(), "older libvgpu.so removed: no slice predates the current one, no process maps it");
        }
    }

    /// Brings the CDI specs in line with the slices (at start).
    pub fn reconcile_cdi(&self) {
        let Some(dir) = &self.cfg.cdi_dir else { return };
        let slices: Vec<_> = self
            .slices()
            .iter()
            .filter_map(|s| Some((s.name.clone(), self.store.injection(&s.name, self.library.as_deref()).ok()?)))
            .collect();
        for change in crate::cdi::reconcile(dir, &slices) {
            tracing::warn!(%change, "CDI specs brought in line with the slices");
        }
    }

    /// Writes the slice's CDI spec (when a CDI directory is configured); failures are logged, the
    /// environment and mounts still work without it.
    pub fn write_cdi(&self, name: &str) {
        let Some(dir) = &self.cfg.cdi_dir else { return };
        match self.store.injection(name, self.library.as_deref()) {
            Ok(inj) => {
                if let Err(e) = crate::cdi::write(dir, name, &inj) {
                    tracing::warn!(slice = %name, dir = %dir.display(), error = %e, "cannot write the CDI spec");
                }
            }
            Err(e) => tracing::warn!(slice = %name, error = %e, "no injection for the CDI spec"),
        }
    }

    pub fn get_slice(&self, name: &str) -> Result<pb::SliceDetail, ApiError> {
        let s = self
            .slices
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| ApiError::NotFound(format!("no slice named {}", crate::slices::shown(name))))?;
        self.detail(&s)
    }

    pub fn detail(&self, s: &Slice) -> Result<pb::SliceDetail, ApiError> {
        let Injection { env, mounts } = self.store.injection_of(s, self.library.as_deref())?;
        Ok(pb::SliceDetail {
            priority: priority_pb(s.priority) as i32,
            name: s.name.clone(),
            labels: s.labels.clone().into_iter().collect(),
            created_unix: s.created,
            gpus: s
                .gpus
                .iter()
                .map(|g| pb::SliceGpuLimit { gpu: g.uuid.clone(), memory: g.memory, sm: g.sm })
                .collect(),
            env: env.into_iter().collect(),
            mounts: mounts
                .into_iter()
                .map(|m| pb::Mount {
                    host_path: m.host.display().to_string(),
                    container_path: m.container,
                    read_only: m.read_only,
                })
                .collect(),
            state_dir: self.store.dir(&s.name).display().to_string(),
            cdi_device: if self.cfg.cdi_dir.is_some() { crate::cdi::device_name(&s.name) } else { String::new() },
        })
    }

    /// Sets who holds the MIG devices that `source` gave out (MIG UUID -> holder, as status shows
    /// it), replacing what it said before. The features call it at start and after every change.
    pub fn set_mig_holders(&self, source: &'static str, held: BTreeMap<String, String>) {
        self.mig_holders.write().insert(source, held);
    }

    /// Sets the containers HAMi mode gave MIG devices to (MIG UUID -> container), as the status and
    /// HAMi's `hami_mig_device_info` name them.
    pub fn set_mig_containers(&self, containers: BTreeMap<String, pb::MigContainer>) {
        *self.mig_containers.write() = containers;
    }

    /// Who holds MIG device `uuid`, if a feature gave it out whole.
    pub fn mig_holder(&self, uuid: &str) -> Option<String> {
        self.mig_holders.read().values().find_map(|m| m.get(uuid).cloned())
    }

    /// Who holds each MIG device given out whole, whichever feature gave it.
    pub fn mig_holders(&self) -> BTreeMap<String, String> {
        self.mig_holders.read().values().flat_map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone()))).collect()
    }

    /// Sets (Some) or clears (None) the warning of `source`, shown in the status (`warnings`) from the
    /// next pass until cleared. Whether that changed it.
    pub fn warn(&self, source: &str, text: Option<String>) -> bool {
        let mut w = self.warnings.write();
        let old = match &text {
            Some(t) => w.insert(source.to_string(), t.clone()),
            None => w.remove(source),
        };
        old != text
    }

    /// The priority a pod's or claim's slice gets: high only where `priority_namespaces` grants it
    /// to `namespace`; asked and not granted, normal, said in the log and the status's warnings.
    pub fn grant_priority(&self, asked: Priority, namespace: &str, who: &str) -> Priority {
        if asked != Priority::High || self.cfg.may_have_priority(namespace) {
            return asked;
        }
        let text = format!(
            "{who} asked for high priority; namespace {} may not have it (priority_namespaces): made normal",
            crate::slices::shown(namespace)
        );
        tracing::warn!(who = %who, namespace = %namespace, "high priority asked for and not granted (priority_namespaces): made normal");
        self.warn(&format!("priority:{who}"), Some(text));
        Priority::Normal
    }

    /// Limits or gates rewritten behind the agent's back (a container that remounted its
    /// read-only files), put back by a pass: said in the log and kept in the status's warnings.
    /// Likewise the high-priority slices whose priority the pass suspended (`suspended`).
    fn note_restored(&self, restored: &[(String, String)], suspended: &[(String, String)]) {
        // A suspension that has run out is no longer a problem to show.
        self.warnings
            .write()
            .retain(|k, _| k.strip_prefix("suspended:").is_none_or(|slice| self.store.priority_suspended(slice)));
        for (slice, why) in suspended {
            tracing::warn!(slice = %slice, why = %why, "a high-priority slice's claims are not borne out: priority suspended");
            self.warn(&format!("suspended:{slice}"), Some(format!("slice {slice}: {why}")));
        }
        for (slice, what) in restored {
            tracing::error!(slice = %slice, what = %what, "a slice's files were rewritten outside the agent; put back");
            let text = match slice.as_str() {
                "" => format!("{what} (rewritten outside the agent)"),
                s => format!("slice {s}: {what}: rewritten outside the agent, by its container?"),
            };
            self.warn(&format!("restored:{slice}"), Some(text));
        }
    }

    pub fn health_response(&self) -> pb::HealthResponse {
        let ready = self.ready.load(Acquire);
        let mut problems = Vec::new();
        if !ready {
            problems.push("no monitoring pass completed yet".to_string());
        }
        if self.library.is_none() {
            problems.push(format!("libvgpu.so not installed: {} is missing", self.cfg.library.display()));
        }
        let st = self.status();
        for g in &st.gpus {
            if !g.healthy {
                problems.push(format!("GPU {} ({}) unhealthy: {}", g.index, g.uuid, g.health_reason));
            }
            for i in g.mig.iter().flat_map(|m| &m.instances).filter(|i| i.unhealthy) {
                problems.push(format!(
                    "GPU {} MIG device {} (GPU instance {}) unhealthy: {}",
                    g.index, i.uuid, i.gpu_instance_id, i.health_reason
                ));
            }
        }
        // What an operator must act on: escapes and the status's warnings.
        for g in &st.gpus {
            if let Some(m) = g.mps.as_ref().filter(|m| !m.running) {
                problems.push(format!("GPU {} ({}) MPS control daemon down: {}", g.index, g.uuid, m.last_error));
            }
        }
        problems.extend(st.escapes.iter().map(|e| format!("escape: {}", crate::describe::escape_line(e))));
        problems.extend(st.warnings.iter().cloned());
        let stalled = self.stalled();
        problems.extend(stalled.clone());
        pb::HealthResponse {
            live: stalled.is_none(),
            ready,
            problems,
            metrics_address: self.metrics_address.read().map(|a| a.to_string()).unwrap_or_default(),
            state_dir: self.cfg.state_dir.display().to_string(),
            library: self.cfg.library.display().to_string(),
        }
    }

    /// A GPU's status from its sample in a pass and the inventory.
    fn gpu_status(&self, g: &crate::monitor::GpuSample, inv: &Inventory) -> pb::GpuStatus {
        let info = inv.gpus.iter().find(|x| x.uuid == g.uuid || (g.uuid.is_empty() && x.index == g.index));
        let uuid = info.map_or(g.uuid.as_str(), |i| i.uuid.as_str());
        let (healthy, health_reason) = self.health.check(uuid, g.error.as_deref());
        let xids = self.health.xids(uuid);
        let mig = info.and_then(|i| i.mig.as_ref());
        let mode = if mig.is_some_and(|m| m.enabled) {
            "mig"
        } else if g.slices > 1 || (g.outsiders && g.slices > 0) {
            "shared"
        } else {
            "exclusive"
        };
        pb::GpuStatus {
            index: g.index,
            uuid: info.map_or(g.uuid.clone(), |i| i.uuid.clone()),
            model: info.map(|i| i.name.clone()).unwrap_or_default(),
            mode: mode.into(),
            memory_used: g.memory_used,
            memory_total: g.memory_total,
            unified_memory: g.unified_memory,
            utilization: g.utilization,
            sm_feedback_held: g.sm_feedback_held,
            admin_processes: g.admin_processes.clone(),
            healthy,
            health_reason,
            critical_xids: xids.critical,
            application_xids: xids.application,
            last_critical_xid: xids.last_critical as u32,
            last_critical_xid_at: xids.last_critical_at,
            mps: self.mps.read().get(uuid).cloned(),
            sm_count: info.and_then(|i| i.sm_count).unwrap_or(0),
            numa_node: info.and_then(|i| i.numa_node).map_or(-1, |n| n as i32),
            pci_bus_id: info.map(|i| i.pci_bus_id.clone()).unwrap_or_default(),
            mig: Some(pb::MigStatus {
                supported: mig.is_some(),
                enabled: mig.is_some_and(|m| m.enabled),
                pending: mig.is_some_and(|m| m.pending),
                instances: mig
                    .map(|m| {
                        m.gpu_instances
                            .iter()
                            .map(|gi| (gi, m.devices.iter().find(|d| d.gpu_instance_id == Some(gi.id))))
                            .map(|(gi, dev)| {
                                let bad = self.health.instance(uuid, gi.id);
                                pb::MigInstance {
                                    unhealthy: bad.is_some(),
                                    health_reason: bad.unwrap_or_default(),
                                    gpu_instance_id: gi.id,
                                    profile_id: gi.profile_id,
                                    start: gi.start,
                                    size: gi.size,
                                    uuid: dev.map(|d| d.uuid.clone()).unwrap_or_default(),
                                    name: dev.map(|d| d.name.clone()).unwrap_or_default(),
                                    memory_total: dev.map_or(0, |d| d.memory_total),
                                    compute_instances: gi.compute_instances.len() as u32,
                                    holder: dev.and_then(|d| self.mig_holder(&d.uuid)).unwrap_or_default(),
                                    compute_instance_id: gi.compute_instances.first().map_or(0, |c| c.0),
                                    container: dev.and_then(|d| self.mig_containers.read().get(&d.uuid).cloned()),
                                }
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }),
        }
    }

    /// Folds a monitoring pass into the counters and publishes the node's status.
    pub fn publish(&self, pass: Pass, loop_us: u64) {
        let st = &self.stats;
        let passes = st.passes.fetch_add(1, Relaxed) + 1;
        st.reclaimed_bytes.fetch_add(pass.reclaimed, Relaxed);
        st.escapes_total.fetch_add(pass.new_escapes.iter().sum(), Relaxed);
        st.escapes_unaccounted.fetch_add(pass.new_escapes[pb::escape::Kind::Unaccounted as usize], Relaxed);
        st.escapes_over_limit.fetch_add(pass.new_escapes[pb::escape::Kind::OverLimit as usize], Relaxed);
        st.escapes_bypass.fetch_add(pass.new_escapes[pb::escape::Kind::Bypass as usize], Relaxed);
        st.loop_us.store(loop_us, Relaxed);
        st.loop_max_us.fetch_max(loop_us, Relaxed);
        st.loop_us_total.fetch_add(loop_us, Relaxed);
        st.last_pass_ms.store(self.started.elapsed().as_millis() as u64 + 1, Relaxed);
        if pass.reclaimed > 0 {
            tracing::info!(bytes = pass.reclaimed, "reclaimed memory of dead processes");
        }
        self.note_restored(&pass.restored, &pass.suspended);
        let inv = self.inventory.read();
        let gpus = pass.gpus.iter().map(|g| self.gpu_status(g, &inv)).collect();
        let status = pb::NodeStatus {
            hostname: self.hostname.clone(),
            agent_version: VERSION.into(),
            driver_version: inv.driver_version.clone(),
            cuda_version: inv.cuda_version,
            timestamp_ms: SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            sequence: passes,
            gpus,
            slices: pass.slices,
            escapes: pass.escapes,
            warnings: self.warnings.read().values().cloned().collect(),
            agent: Some(pb::AgentStats {
                loop_us,
                loop_max_us: st.loop_max_us.load(Relaxed),
                passes,
                reclaimed_bytes: st.reclaimed_bytes.load(Relaxed),
                escapes_total: st.escapes_total.load(Relaxed),
                resident_bytes: if passes % 10 == 1 {
                    let r = crate::procfs::self_rss();
                    self.rss.store(r, Relaxed);
                    r
                } else {
                    self.rss.load(Relaxed)
                },
                uptime_s: self.started.elapsed().as_secs(),
            }),
        };
        drop(inv);
        if self.notices_wanted.load(Relaxed) {
            let old = self.status();
            let mut q = self.notices.lock();
            q.extend(pass.fresh.into_iter().map(Notice::Escape));
            for g in &status.gpus {
                if old.gpus.iter().any(|o| o.uuid == g.uuid && o.healthy != g.healthy) {
                    q.push_back(Notice::Health {
                        gpu: g.uuid.clone(),
                        index: g.index,
                        healthy: g.healthy,
                        reason: g.health_reason.clone(),
                    });
                }
                let before =
                    old.gpus.iter().filter(|o| o.uuid == g.uuid).flat_map(|o| &o.mig).flat_map(|m| &m.instances);
                for i in g.mig.iter().flat_map(|m| &m.instances) {
                    if before.clone().any(|b| b.gpu_instance_id == i.gpu_instance_id && b.unhealthy != i.unhealthy) {
                        q.push_back(Notice::MigHealth {
                            gpu: g.uuid.clone(),
                            index: g.index,
                            device: i.uuid.clone(),
                            gpu_instance: i.gpu_instance_id,
                            healthy: !i.unhealthy,
                            reason: i.health_reason.clone(),
                        });
                    }
                }
            }
            while q.len() > NOTICES_KEPT {
                q.pop_front();
            }
        }
        self.status.send_replace(Arc::new(status));
        self.ready.store(true, Release);
        self.capacity_changed.notify_one();
    }
}

/// `total` bytes times `scaling`, in whole MiB; `total` itself at 1.
fn quarantine_source(name: &str) -> String {
    format!("slice/{name}")
}

fn quarantine_text(name: &str, why: &str) -> String {
    format!(
        "slice {name} is quarantined: its record cannot be read ({}); `vgpuctl slice delete --force {name}` removes it",
        crate::slices::printable(why)
    )
}

pub fn scaled(total: u64, scaling: f64) -> u64 {
    if scaling == 1.0 {
        total
    } else {
        ((total >> 20) as f64 * scaling) as u64 * (1 << 20)
    }
}

/// A slice priority of the API, as the store keeps it.
pub fn priority_of(p: i32) -> Result<Priority, ApiError> {
    match pb::SlicePriority::try_from(p) {
        Ok(pb::SlicePriority::PriorityNormal) => Ok(Priority::Normal),
        Ok(pb::SlicePriority::PriorityHigh) => Ok(Priority::High),
        Err(_) => Err(ApiError::Invalid(format!("priority {p} is not 0 (normal) or 1 (high)"))),
    }
}

#[cfg(test)]
mod scaling_tests {
    #[test]
    fn scaled_memory_is_whole_mib() {
        assert_eq!(super::scaled(80 << 30, 1.0), 80 << 30);
        assert_eq!(super::scaled((80 << 30) + 5, 1.0), (80 << 30) + 5, "unchanged at 1");
        assert_eq!(super::scaled(80 << 30, 1.5), 120 << 30);
        assert_eq!(super::scaled(1000 << 20, 0.333), 333 << 20);
    }
}

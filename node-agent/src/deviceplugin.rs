//! The kubelet device plugin (API v1beta1), first part: registration, re-registration when kubelet
//! restarts, ListAndWatch with health, GetPreferredAllocation, and Allocate in *replica* mode: each
//! GPU is advertised as `split_count` devices (`<GPU-UUID>-<n>`), and a container given k of one GPU's
//! devices gets a slice with k/split of its memory and of its time. The HAMi and Volcano
//! annotation protocols (limits decided by their schedulers) build on this.
//!
//! Kubelet restarts delete plugin sockets and recreate `kubelet.sock`: the plugin watches both and
//! serves and registers again at once; so it does when another process replaces its socket, and when
//! kubelet drops its ListAndWatch stream for good (another plugin registered the resource). The
//! server it replaces ends its streams and closes its socket. The gRPC server starts before
//! registration (kubelet dials back as soon as it accepts).
//!
//! Replica slices outlive their containers (a restarted container gets the same slice); once no
//! container holds a slice's devices any more, as kubelet's pod resources API tells, the slice is
//! removed (see [`collect`]).

use crate::agent::Agent;
use crate::sockets::inode;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use vgpu_proto::deviceplugin as dp;
use vgpu_proto::podresources as pr;

/// The plugin's socket file name in kubelet's directory.
pub const SOCKET: &str = "vgpu.sock";
/// Kubelet's gRPC message limit is 4 MiB; stay well under it.
const MAX_LIST_BYTES: usize = 3 << 20;

#[derive(Clone)]
pub struct Plugin {
    agent: Arc<Agent>,
    kind: Kind,
    recent: Recent,
    /// HAMi and Volcano modes' client of the API server, once connected.
    kube: crate::k8s::KubeCell,
    /// ListAndWatch streams open now (kubelet keeps one while it uses the plugin).
    watchers: Arc<AtomicUsize>,
    /// Set when this server is replaced: its streams end, so that it can stop.
    down: tokio::sync::watch::Receiver<bool>,
}

/// Counts an open ListAndWatch stream while it lives.
struct Watching(Arc<AtomicUsize>);

impl Watching {
    fn new(n: &Arc<AtomicUsize>) -> Watching {
        n.fetch_add(1, Ordering::AcqRel);
        Watching(n.clone())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long kubelet may go without a ListAndWatch stream, once it had one, before the plugin
/// registers again: kubelet drops the stream of a plugin when another registers the same resource,
/// and never asks that plugin again.
const UNWATCHED: Duration = Duration::from_secs(5);

/// When each replica slice was last handed to a container (by this run of the agent).
type Recent = Arc<Mutex<HashMap<String, Instant>>>;

/// The slice of a container given these replica devices: named after them, so the same devices get
/// the same slice.
pub fn slice_name(ids: &[String]) -> String {
    let mut sorted = ids.to_vec();
    sorted.sort();
    let digest = crate::slices::fnv1a(sorted.join(",").bytes());
    format!("k8s-{digest:016x}")
}

/// What a registered resource counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `split_count` shares per GPU; the resource Allocate acts on.
    Replicas,
    /// Volcano's `vgpu-memory`: one device per `memory_factor` MiB.
    Memory,
    /// Volcano's `vgpu-cores`: 100 per GPU.
    Cores,
}

/// The resources to register: (resource name, socket file name, kind).
pub fn resources(cfg: &crate::config::Config) -> Vec<(String, String, Kind)> {
    match cfg.compat {
        crate::config::Compat::Volcano => vec![
            ("volcano.sh/vgpu-number".into(), SOCKET.into(), Kind::Replicas),
            ("volcano.sh/vgpu-memory".into(), "vgpu-memory.sock".into(), Kind::Memory),
            ("volcano.sh/vgpu-cores".into(), "vgpu-cores.sock".into(), Kind::Cores),
        ],
        _ => vec![(cfg.resource_name.clone(), SOCKET.into(), Kind::Replicas)],
    }
}

/// The devices of a resource now: per GPU (not in MIG mode), with its health and NUMA node.
pub fn devices(agent: &Agent, kind: Kind) -> Vec<dp::Device> {
    devices_at(agent, kind, agent.cfg.memory_factor)
}

/// [`devices`], with memory devices of `memory_factor` MiB each.
fn devices_at(agent: &Agent, kind: Kind, memory_factor: u32) -> Vec<dp::Device> {
    let st = agent.status();
    let inv = agent.inventory.read();
    let split = agent.cfg.split_count;
    let mut v = Vec::new();
    for g in &inv.gpus {
        if g.mig.as_ref().is_some_and(|m| m.enabled) {
            continue;
        }
        let healthy = st.gpus.iter().find(|x| x.uuid == g.uuid).is_none_or(|x| x.healthy);
        let topology = g.numa_node.map(|n| dp::TopologyInfo { nodes: vec![dp::NumaNode { id: n as i64 }] });
        let (n_devices, tag) = match kind {
            Kind::Replicas => (split as u64, ""),
            Kind::Memory => ((agent.scaled(g.memory_total) >> 20) / memory_factor.max(1) as u64, "mem-"),
            Kind::Cores => (100, "core-"),
        };
        for n in 0..n_devices {
            v.push(dp::Device {
                id: format!("{}-{tag}{n}", g.uuid),
                health: if healthy { "Healthy" } else { "Unhealthy" }.into(),
                topology: topology.clone(),
            });
        }
    }
    v
}

/// The limits of `k` of a GPU's `split_count` shares: k/split of its (scaled) memory, rounded down
/// to a MiB, and of its time (no SM limit for the whole GPU).
pub fn share(agent: &Agent, g: &crate::discovery::Gpu, k: u64) -> vgpu_proto::v1::SliceGpuLimit {
    let split = agent.cfg.split_count.max(1) as u64;
    let memory = (agent.scaled(g.memory_total) / split * k) >> 20 << 20;
    let sm = (100 * k / split) as u32;
    vgpu_proto::v1::SliceGpuLimit { gpu: g.uuid.clone(), memory, sm: if sm >= 100 { 0 } else { sm } }
}

/// The GPU UUID of a replica device ID.
fn gpu_of(id: &str) -> &str {
    id.rsplit_once('-').map_or(id, |(g, _)| g)
}

impl Plugin {
    /// A container's slice: limits from the replicas it was given, named after them (a container
    /// restart gets the same answer and the same files).
    fn allocate_one(&self, ids: &[String]) -> Result<dp::ContainerAllocateResponse, Status> {
        let a = &self.agent;
        let mut per_gpu: BTreeMap<String, u64> = BTreeMap::new();
        for id in ids {
            *per_gpu.entry(gpu_of(id).to_string()).or_default() += 1;
        }
        let inv = a.inventory.read().clone();
        let mut gpus = Vec::new();
        for (uuid, k) in &per_gpu {
            let g = inv
                .gpus
                .iter()
                .find(|g| &g.uuid == uuid)
                .ok_or_else(|| Status::invalid_argument(format!("device of unknown GPU {uuid}")))?;
            gpus.push(share(a, g, *k));
        }
        let name = slice_name(ids);
        self.recent.lock().insert(name.clone(), Instant::now());
        let labels =
            [("source".to_string(), "kubelet".to_string()), ("devices".to_string(), ids.len().to_string())].into();
        let detail = match a.get_slice(&name) {
            Ok(d) => d,
            Err(_) => a
                .create_slice(vgpu_proto::v1::CreateSliceRequest { name: name.clone(), gpus, labels, priority: 0 })
                .map_err(Status::from)?,
        };
        Ok(response(a, detail))
    }
}

/// A container's answer from its slice: the slice's environment and mounts, with
/// `/etc/ld.so.preload` instead of `LD_PRELOAD` (as HAMi's device plugin does).
fn response(a: &Agent, detail: vgpu_proto::v1::SliceDetail) -> dp::ContainerAllocateResponse {
    let mut envs: std::collections::HashMap<String, String> = detail.env.into_iter().collect();
    envs.remove("LD_PRELOAD");
    let mut mounts: Vec<dp::Mount> = detail
        .mounts
        .into_iter()
        .map(|m| dp::Mount { container_path: m.container_path, host_path: m.host_path, read_only: m.read_only })
        .collect();
    mounts.push(dp::Mount {
        container_path: "/etc/ld.so.preload".into(),
        host_path: a.cfg.state_dir.join("ld.so.preload").display().to_string(),
        read_only: true,
    });
    // The same edits are in the slice's CDI spec; naming the CDI device here as well would make a
    // CDI-enabled runtime apply the mounts twice.
    dp::ContainerAllocateResponse { envs, mounts, ..Default::default() }
}

#[tonic::async_trait]
impl dp::device_plugin_server::DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<dp::Empty>,
    ) -> Result<Response<dp::DevicePluginOptions>, Status> {
        Ok(Response::new(dp::DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = ReceiverStream<Result<dp::ListAndWatchResponse, Status>>;

    async fn list_and_watch(&self, _: Request<dp::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let agent = self.agent.clone();
        let kind = self.kind;
        let mut rx = agent.subscribe();
        let (tx, out) = tokio::sync::mpsc::channel(2);
        let watching = Watching::new(&self.watchers);
        let mut down = self.down.clone();
        tokio::spawn(async move {
            let _watching = watching;
            let mut last: Option<Vec<dp::Device>> = None;
            loop {
                let now = devices(&agent, kind);
                if last.as_ref() != Some(&now) {
                    let msg = dp::ListAndWatchResponse { devices: now.clone() };
                    if prost::Message::encoded_len(&msg) > MAX_LIST_BYTES {
                        let fix = if kind == Kind::Memory { "raise memory_factor" } else { "lower split_count" };
                        tracing::error!(devices = now.len(), "device list over the kubelet message limit: {fix}");
                    }
                    if tx.send(Ok(msg)).await.is_err() {
                        return;
                    }
                    last = Some(now);
                }
                // Ends with kubelet's side of the stream, or this server.
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                    _ = down.wait_for(|d| *d) => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(out)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<dp::PreferredAllocationRequest>,
    ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
        // Replicas of as few GPUs as possible, preferring the GPU with the most replicas available
        // (packing keeps other GPUs whole).
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            let mut chosen: Vec<String> = c.must_include_device_i_ds.clone();
            let mut by_gpu: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
            for id in &c.available_device_i_ds {
                if !chosen.contains(id) {
                    by_gpu.entry(gpu_of(id)).or_default().push(id);
                }
            }
            let mut gpus: Vec<(&str, Vec<&String>)> = by_gpu.into_iter().collect();
            gpus.sort_by_key(|(g, v)| {
                (std::cmp::Reverse(chosen.iter().filter(|c| gpu_of(c) == *g).count()), std::cmp::Reverse(v.len()))
            });
            for (_, ids) in gpus {
                for id in ids {
                    if chosen.len() >= c.allocation_size.max(0) as usize {
                        break;
                    }
                    chosen.push(id.clone());
                }
            }
            out.push(dp::ContainerPreferredAllocationResponse { device_i_ds: chosen });
        }
        Ok(Response::new(dp::PreferredAllocationResponse { container_responses: out }))
    }

    async fn allocate(&self, req: Request<dp::AllocateRequest>) -> Result<Response<dp::AllocateResponse>, Status> {
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            let r = if self.kind != Kind::Replicas {
                // Volcano's memory and cores resources only count; the number resource allocates.
                dp::ContainerAllocateResponse::default()
            } else if self.agent.cfg.compat != crate::config::Compat::Replicas {
                let kube = self
                    .kube
                    .get()
                    .cloned()
                    .ok_or_else(|| Status::unavailable("not connected to the Kubernetes API"))?;
                match kube.allocate(self.agent.clone(), c.devices_ids.len()).await.map_err(|e| e.status())? {
                    crate::k8s::Allocated::Slice(detail, preload) => {
                        let mut r = response(&self.agent, *detail);
                        if !preload {
                            r.mounts.retain(|m| m.container_path != "/etc/ld.so.preload");
                        }
                        r
                    }
                    // MIG: the instance is the isolation; only the device is named (as HAMi does).
                    crate::k8s::Allocated::Mig(uuids) => dp::ContainerAllocateResponse {
                        envs: [("NVIDIA_VISIBLE_DEVICES".to_string(), uuids.join(","))].into(),
                        ..Default::default()
                    },
                }
            } else {
                let me = self.clone();
                tokio::task::spawn_blocking(move || me.allocate_one(&c.devices_ids))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))??
            };
            out.push(r);
        }
        Ok(Response::new(dp::AllocateResponse { container_responses: out }))
    }

    async fn pre_start_container(
        &self,
        _: Request<dp::PreStartContainerRequest>,
    ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
        Ok(Response::new(dp::PreStartContainerResponse {}))
    }
}

/// Who holds a slice: namespace, pod, container.
pub type Holder = (String, String, String);

/// The slices kubelet's containers hold now (one per container given devices of `resource`), and
/// who holds each.
pub fn held_slices(list: &pr::ListPodResourcesResponse, resource: &str) -> HashMap<String, Holder> {
    let mut held = HashMap::new();
    for p in &list.pod_resources {
        for c in &p.containers {
            let ids: Vec<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.iter().cloned())
                .collect();
            if !ids.is_empty() {
                held.insert(slice_name(&ids), (p.namespace.clone(), p.name.clone(), c.name.clone()));
            }
        }
    }
    held
}

/// What kubelet's pod resources API lists now.
/// Why talking to the kubelet failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("cannot reach the kubelet: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("{what}: {}", status.message())]
    Call { what: &'static str, status: tonic::Status },
    #[error("no answer within 10 s")]
    Timeout,
}

async fn list_pod_resources(sock: &Path) -> Result<pr::ListPodResourcesResponse, KubeletError> {
    let call = async move {
        let ch = crate::sockets::unix_channel(sock).await?;
        pr::pod_resources_lister_client::PodResourcesListerClient::new(ch)
            .max_decoding_message_size(64 << 20)
            .list(pr::ListPodResourcesRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|status| KubeletError::Call { what: "List failed", status })
    };
    tokio::time::timeout(Duration::from_secs(10), call).await.map_err(|_| KubeletError::Timeout)?
}

/// Labels replica slices with the pod and container holding them (`namespace`, `pod`, `container`:
/// what `vgpuctl status` and the metrics show), and removes those no container holds any more. A
/// slice goes when kubelet's pod resources API has not listed its devices for two looks in a row, it
/// was not handed out within the grace period (`slice_gc_grace_s`; after an agent restart, counted
/// from the restart), and no process of it lives (a live one keeps it until it exits). While the API
/// cannot be read (or kubelet's own socket is absent) nothing is removed.
pub async fn collect(agent: Arc<Agent>, sock: PathBuf, recent: Recent, mut stop: tokio::sync::watch::Receiver<bool>) {
    let grace = Duration::from_secs(agent.cfg.slice_gc_grace_s);
    let every = (grace / 2).clamp(Duration::from_secs(1), Duration::from_secs(10));
    let started = Instant::now();
    let mut missing_before: HashSet<String> = HashSet::new();
    let mut unavailable = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        // Not a Kubernetes node (or kubelet is down): nothing to ask, nothing to report.
        if !agent.cfg.kubelet_dir.join("kubelet.sock").exists() {
            missing_before.clear();
            continue;
        }
        let list = match list_pod_resources(&sock).await {
            Ok(l) => {
                if unavailable {
                    tracing::info!(socket = %sock.display(), "kubelet pod resources API answers again");
                    unavailable = false;
                }
                l
            }
            Err(e) => {
                if !unavailable {
                    tracing::warn!(socket = %sock.display(), error = %e,
                        "kubelet pod resources API unavailable: slices of removed containers are kept until it answers");
                    unavailable = true;
                }
                missing_before.clear();
                continue;
            }
        };
        let held = held_slices(&list, &agent.cfg.resource_name);
        let mut missing = HashSet::new();
        for s in agent.slices().iter() {
            if s.labels.get("source").map(String::as_str) != Some("kubelet") {
                continue;
            }
            if let Some((ns, pod, container)) = held.get(&s.name) {
                let labels = [("namespace", ns.as_str()), ("pod", pod.as_str()), ("container", container.as_str())];
                if let Err(e) = agent.label_slice(&s.name, &labels) {
                    tracing::warn!(slice = %s.name, error = ?e, "cannot label the slice with its pod");
                }
                continue;
            }
            let last = recent.lock().get(&s.name).copied().unwrap_or(started);
            if last.elapsed() < grace {
                continue;
            }
            if !missing_before.contains(&s.name) {
                missing.insert(s.name.clone());
                continue;
            }
            let (a, name) = (agent.clone(), s.name.clone());
            match tokio::task::spawn_blocking(move || a.delete_slice(&name, false)).await {
                Ok(Ok(())) => {
                    tracing::info!(slice = %s.name, "replica slice removed: no container holds its devices");
                    recent.lock().remove(&s.name);
                    agent.stats.slices_collected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(Err(e)) => {
                    tracing::debug!(slice = %s.name, error = ?e, "replica slice kept for now");
                    missing.insert(s.name.clone());
                }
                Err(e) => tracing::warn!(slice = %s.name, error = %e, "replica slice removal failed"),
            }
        }
        missing_before = missing;
    }
}

async fn register(dir: &Path, resource: &str, socket: &str) -> Result<(), KubeletError> {
    let ch = crate::sockets::unix_channel(&dir.join("kubelet.sock")).await?;
    dp::registration_client::RegistrationClient::new(ch)
        .register(dp::RegisterRequest {
            version: "v1beta1".into(),
            endpoint: socket.into(),
            resource_name: resource.into(),
            options: Some(dp::DevicePluginOptions {
                pre_start_required: false,
                get_preferred_allocation_available: true,
            }),
        })
        .await
        .map_err(|status| KubeletError::Call { what: "kubelet refused the registration", status })?;
    Ok(())
}

/// Serves and registers every resource for as long as the agent runs, again whenever kubelet restarts.
pub async fn run(agent: Arc<Agent>, kube: crate::k8s::KubeCell, stop: tokio::sync::watch::Receiver<bool>) {
    let recent = Recent::default();
    let mut tasks: Vec<_> = resources(&agent.cfg)
        .into_iter()
        .map(|(resource, socket, kind)| {
            tokio::spawn(serve(agent.clone(), resource, socket, kind, recent.clone(), kube.clone(), stop.clone()))
        })
        .collect();
    if agent.cfg.compat == crate::config::Compat::Replicas {
        if let Some(sock) = agent.cfg.pod_resources_socket.clone() {
            tasks.push(tokio::spawn(collect(agent.clone(), sock, recent, stop.clone())));
        }
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn serve(
    agent: Arc<Agent>,
    resource: String,
    socket: String,
    kind: Kind,
    recent: Recent,
    kube: crate::k8s::KubeCell,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let dir: PathBuf = agent.cfg.kubelet_dir.clone();
    let kubelet = dir.join("kubelet.sock");
    let ours = dir.join(&socket);
    loop {
        // Wait for kubelet.
        while inode(&kubelet).is_none() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return,
            }
        }
        let kubelet_ino = inode(&kubelet);
        let _ = std::fs::remove_file(&ours);
        let listener = match crate::sockets::bind(&ours) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "device plugin: cannot listen");
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
        };
        let our_ino = inode(&ours);
        let (down_tx, down_rx) = tokio::sync::watch::channel(false);
        let watchers = Arc::new(AtomicUsize::new(0));
        let plugin = Plugin {
            agent: agent.clone(),
            kind,
            recent: recent.clone(),
            kube: kube.clone(),
            watchers: watchers.clone(),
            down: down_rx.clone(),
        };
        let mut shutdown = down_rx;
        let mut server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(dp::device_plugin_server::DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(crate::sockets::incoming(listener), async move {
                    let _ = shutdown.wait_for(|d| *d).await;
                }),
        );
        register_until_accepted(&dir, &resource, &socket, &ours, &kubelet, kubelet_ino).await;
        let stopped = watch_registration(&kubelet, &ours, (kubelet_ino, our_ino), &watchers, &mut stop).await;
        // Streams end on the signal, so the server stops and closes its socket; one that has not
        // within 2 s is aborted: a replaced server never lingers on the path.
        let _ = down_tx.send(true);
        if tokio::time::timeout(Duration::from_secs(2), &mut server).await.is_err() {
            server.abort();
        }
        if stopped {
            let _ = std::fs::remove_file(&ours);
            return;
        }
    }
}

/// Registers `resource` (served on `socket`) until kubelet accepts, or until kubelet restarts.
async fn register_until_accepted(
    dir: &Path,
    resource: &str,
    socket: &str,
    ours: &Path,
    kubelet: &Path,
    kubelet_ino: Option<u64>,
) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match register(dir, resource, socket).await {
            Ok(()) => {
                tracing::info!(resource = %resource, socket = %ours.display(), "registered with kubelet");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "device plugin registration failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                if inode(kubelet) != kubelet_ino {
                    return;
                }
            }
        }
    }
}

/// Watches a registration until it must be made again: kubelet restarted (its socket recreated,
/// ours removed), another process replaced our socket, or kubelet stopped watching the plugin for
/// [`UNWATCHED`] after it had. True when the agent stops instead.
async fn watch_registration(
    kubelet: &Path,
    ours: &Path,
    (kubelet_ino, our_ino): (Option<u64>, Option<u64>),
    watchers: &AtomicUsize,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    let (mut watched, mut unwatched_since) = (false, Instant::now());
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.changed() => return true,
        }
        let (now_kubelet, now_ours) = (inode(kubelet), inode(ours));
        if now_kubelet == kubelet_ino && now_ours.is_some() && now_ours != our_ino {
            // Not a kubelet restart (which removes the plugins' sockets and makes its own
            // again): another process bound our socket's path.
            tracing::warn!(socket = %ours.display(),
                "another process replaced the device plugin socket (a second agent on this node?); \
                 serving and registering again");
            return false;
        }
        if now_kubelet != kubelet_ino || now_ours != our_ino {
            tracing::info!("kubelet restarted: serving and registering again");
            return false;
        }
        if watchers.load(Ordering::Acquire) > 0 {
            (watched, unwatched_since) = (true, Instant::now());
        } else if watched && unwatched_since.elapsed() >= UNWATCHED {
            tracing::warn!(socket = %ours.display(),
                "kubelet stopped watching the device plugin (another plugin registered the same resource?); \
                 serving and registering again");
            return false;
        }
    }
}

/// Where the agent's configuration disagrees with the scheduler's settings, each with whether it
/// breaks placement outright (a resource pods ask for that the agent does not serve, or memory
/// counted in other units: `true`) or only makes the two count differently (`false`).
pub fn settings_mismatches(
    s: &crate::config::peer::SchedulerSettings,
    cfg: &crate::config::Config,
) -> Vec<(bool, String)> {
    let mut v = Vec::new();
    let served = resources(cfg);
    let volcano = cfg.compat == crate::config::Compat::Volcano;
    // HAMi's memory and core resources are the scheduler's alone (no device plugin serves them).
    let names = [
        ("resourceCountName", &s.resource_count_name, Kind::Replicas),
        ("resourceMemoryName", &s.resource_memory_name, Kind::Memory),
        ("resourceCoreName", &s.resource_core_name, Kind::Cores),
    ];
    for (key, want, kind) in names {
        let Some(want) = want.as_deref().filter(|w| !w.is_empty()) else { continue };
        match served.iter().find(|(_, _, k)| *k == kind) {
            Some((name, _, _)) if name != want => v.push((
                true,
                format!("{key} is {want}, but the agent serves {name}: pods asking for {want} fit no node"),
            )),
            _ => {}
        }
    }
    // HAMi's device plugin takes the replicas and the scaling from this configuration (Volcano's from
    // its own flags, so there they say nothing), unless the node has its own (HAMi's per-node
    // configuration, or a [[node]] section: deliberate).
    if !volcano && !cfg.hami_node_entry && cfg.node_section.is_none() {
        if let Some(n) = s.device_split_count.filter(|&n| n > 0 && n != cfg.split_count) {
            v.push((
                false,
                format!("deviceSplitCount is {n}, but the agent registers {} per GPU (split_count)", cfg.split_count),
            ));
        }
        if let Some(x) = s.device_memory_scaling.filter(|&x| x > 0.0 && (x - cfg.memory_scaling).abs() > 1e-9) {
            v.push((
                false,
                format!(
                    "deviceMemoryScaling is {x}, but the agent scales memory by {} (memory_scaling)",
                    cfg.memory_scaling
                ),
            ));
        }
    }
    // Volcano's scheduler reads memory requests in units of this factor.
    if volcano {
        if let Some(f) = s.gpu_memory_factor.filter(|&f| f > 0 && f != cfg.memory_factor) {
            v.push((
                true,
                format!(
                    "gpuMemoryFactor is {f} MiB, but the agent counts memory in {} MiB units (memory_factor)",
                    cfg.memory_factor
                ),
            ));
        }
    }
    v
}

/// Why an agent in Volcano mode must not start: a pod's `volcano.sh/vgpu-memory` would not mean here
/// what it means to the scheduler (whose `gpuMemoryFactor` differs from `memory_factor`), or the
/// kubelet could not take the memory device list at this factor (one device per `memory_factor`
/// MiB). None where it may start, and outside Volcano mode.
pub fn volcano_memory_refusal(agent: &Agent) -> Option<String> {
    let cfg = &agent.cfg;
    if cfg.compat != crate::config::Compat::Volcano {
        return None;
    }
    let factor = cfg.memory_factor;
    let scheduler = cfg.scheduler_settings.as_ref().and_then(|s| s.gpu_memory_factor).filter(|&f| f > 0);
    if let Some(f) = scheduler.filter(|&f| f != factor) {
        return Some(format!(
            "Volcano's scheduler counts volcano.sh/vgpu-memory in units of {f} MiB (gpuMemoryFactor in its \
             device configuration), but memory_factor is {factor} MiB: a pod asking for 1000 would be placed \
             for {} and limited to {} here. Set memory_factor = {f} (chart: memoryFactor), or leave it unset \
             to follow the scheduler",
            crate::describe::human((u64::from(f) * 1000) << 20),
            crate::describe::human((u64::from(factor) * 1000) << 20),
        ));
    }
    let list = |f: u32| dp::ListAndWatchResponse { devices: devices_at(agent, Kind::Memory, f) };
    let at_factor = list(factor);
    let (bytes, n) = (prost::Message::encoded_len(&at_factor), at_factor.devices.len());
    if bytes <= MAX_LIST_BYTES {
        return None;
    }
    let mut fits = factor.next_power_of_two().max(2);
    while fits < 1 << 20 && prost::Message::encoded_len(&list(fits)) > MAX_LIST_BYTES {
        fits *= 2;
    }
    Some(format!(
        "at memory_factor {factor} MiB (Volcano's default unit) this node's volcano.sh/vgpu-memory is {n} devices, \
         a list of {} where the kubelet takes at most {}: set gpuMemoryFactor: {fits} in the scheduler's device \
         configuration (ConfigMap volcano-vgpu-device-config, its nvidia section) and memory_factor = {fits} here \
         (chart: memoryFactor), or leave memory_factor unset and give the agent that configuration \
         (mig_geometries_file); pods then ask for volcano.sh/vgpu-memory in units of {fits} MiB",
        crate::describe::human(bytes as u64),
        crate::describe::human(MAX_LIST_BYTES as u64),
    ))
}

/// [`settings_mismatches`] as one line: each difference, `; ` between.
pub fn mismatches_text(m: &[(bool, String)]) -> String {
    m.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(devs: &[(&str, &[&str])]) -> pr::ContainerResources {
        pr::ContainerResources {
            name: "c".into(),
            devices: devs
                .iter()
                .map(|(r, ids)| pr::ContainerDevices {
                    resource_name: r.to_string(),
                    device_ids: ids.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn held_slices_are_named_by_each_containers_devices_of_our_resource() {
        let v = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(slice_name(&v(&["G-1", "G-0"])), slice_name(&v(&["G-0", "G-1"])), "order does not matter");
        assert_ne!(slice_name(&v(&["G-0"])), slice_name(&v(&["G-0", "G-1"])));
        let list = pr::ListPodResourcesResponse {
            pod_resources: vec![pr::PodResources {
                name: "p".into(),
                namespace: "n".into(),
                containers: vec![
                    // Devices of one resource may come in several entries.
                    container(&[
                        ("nvidia.com/gpu", &["G-1"]),
                        ("example.com/nic", &["N-0"]),
                        ("nvidia.com/gpu", &["G-0"]),
                    ]),
                    container(&[("example.com/nic", &["G-2"])]),
                    container(&[]),
                ],
            }],
        };
        let held = held_slices(&list, "nvidia.com/gpu");
        let holder = ("n".to_string(), "p".to_string(), "c".to_string());
        assert_eq!(held, [(slice_name(&v(&["G-0", "G-1"])), holder)].into_iter().collect());
        assert!(held_slices(&list, "other/res").is_empty());
    }
}

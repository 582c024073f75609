//! The Kubernetes side of HAMi compatibility (kube-rs): this node's register annotation, the
//! pending pod's device assignment at Allocate time (with the bind-phase protocol and the node lock),
//! and slices removed once their pod is gone. Every annotation patch carries the object's
//! `resourceVersion`, so a concurrent writer makes it fail rather than be overwritten.

use crate::agent::Agent;
use crate::hami::{self, ContainerDevice, RegisteredDevice};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::sync::Arc;
use vgpu_proto::v1 as pb;

pub struct Kube {
    client: kube::Client,
    pub node: String,
    pub proto: &'static hami::Protocol,
}

/// What a HAMi- or Volcano-mode action against the API server failed at. The kubelet's Allocate
/// gets the gRPC status of the variant ([`K8sError::status`]).
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    /// No client: the API URL does not parse, or no configuration is found.
    #[error("{0}")]
    Config(String),
    /// The API server refused a request, or did not answer it.
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: Box<kube::Error>,
    },
    /// The scheduler's annotations do not allow the allocation asked for.
    #[error("{0}")]
    Refused(String),
    /// The slice or MIG instance of an allocation could not be made or removed.
    #[error("{0}")]
    Devices(String),
    /// An annotation the agent read changed before its patch could be written (the conflict was
    /// retried on the object as it now is, and what the patch depends on no longer holds).
    #[error("{what}: {key} changed while the agent wrote its answer")]
    Changed { what: String, key: String },
    /// A blocking task of the allocation panicked.
    #[error("internal: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl K8sError {
    /// The status the kubelet is answered with: the scheduler's or the node's state refuses the
    /// allocation (FailedPrecondition), or the API server could not be asked (Unavailable).
    pub fn status(&self) -> tonic::Status {
        match self {
            K8sError::Refused(_) | K8sError::Devices(_) | K8sError::Changed { .. } => {
                tonic::Status::failed_precondition(self.to_string())
            }
            K8sError::Config(_) | K8sError::Api { .. } => tonic::Status::unavailable(self.to_string()),
            K8sError::Task(_) => tonic::Status::internal(self.to_string()),
        }
    }
}

/// Why the MIG instances of a scheduler's assignment could not be made or released.
#[derive(Debug, thiserror::Error)]
pub enum MigAllocationError {
    #[error("NVML is not open yet")]
    NoNvml,
    #[error(transparent)]
    Assignment(#[from] hami::AssignmentError),
    #[error("no GPU {0}")]
    NoGpu(String),
    #[error("device {device}: {gpu} has no MIG geometry {geometry:?} (it has {known})")]
    NoGeometry { device: String, gpu: String, geometry: String, known: String },
    #[error("device {device}: geometry {geometry} has no position {position}")]
    NoPosition { device: String, geometry: String, position: u32 },
    #[error("device {device}: geometry {geometry} names MIG profile {profile}, which {gpu} lacks")]
    NoProfile { device: String, geometry: String, profile: String, gpu: String },
    #[error("{gpu} has no MIG profile {profile} of {size} memory slices placed at slice {start}")]
    NoPlacement { gpu: String, profile: String, start: u32, size: u32 },
    #[error(transparent)]
    Mig(#[from] vgpu_mig::backend::MigError),
    #[error("recording the MIG instances in {}: {error}", path.display())]
    Record { path: std::path::PathBuf, error: std::io::Error },
}

fn err(what: &str) -> impl Fn(kube::Error) -> K8sError + '_ {
    move |source| K8sError::Api { what: what.to_string(), source: Box::new(source) }
}

fn ann(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, k: &str) -> Option<String> {
    meta.annotations.as_ref()?.get(k).cloned()
}

/// A merge patch of annotations (None removes one), guarded by `resource_version`.
fn annotation_patch(resource_version: Option<&str>, set: &[(&str, Option<String>)]) -> serde_json::Value {
    let mut a = serde_json::Map::new();
    for (k, v) in set {
        a.insert(k.to_string(), v.clone().map_or(serde_json::Value::Null, serde_json::Value::String));
    }
    let mut meta = serde_json::json!({ "annotations": a });
    if let Some(rv) = resource_version {
        meta["resourceVersion"] = rv.into();
    }
    serde_json::json!({ "metadata": meta })
}

/// A slice name for a pod's container entry (DNS-label sized; long names end in a digest).
fn slice_name(ns: &str, pod: &str, idx: usize) -> String {
    let full = format!("{ns}-{pod}-{idx}");
    let clean: String = full
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c.to_ascii_lowercase() } else { '-' })
        .collect();
    if clean.len() <= 63 {
        return clean;
    }
    let digest = crate::slices::fnv1a(full.bytes());
    format!("{}-{digest:016x}", &clean[..46])
}

/// How long the agent waits for a connection to the API server, or for its answer to a request.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A client of the API server at `api` (tests, or outside a cluster without kubeconfig); None:
/// in-cluster configuration or the kubeconfig, as kubectl finds them.
pub async fn client(api: Option<&str>) -> Result<kube::Client, K8sError> {
    let mut config = match api {
        Some(url) => kube::Config::new(url.parse().map_err(|e| K8sError::Config(format!("kube_api {url:?}: {e}")))?),
        None => {
            kube::Config::infer().await.map_err(|e| K8sError::Config(format!("no Kubernetes configuration: {e}")))?
        }
    };
    // The agent never watches: every request is a short get, list or patch, and some run inside a
    // kubelet's Allocate. One the API server does not answer within 10 s is given up (and sent again
    // by `retried`) rather than stalling the kubelet for kube's default of 295 s.
    config.read_timeout = Some(REQUEST_TIMEOUT);
    config.connect_timeout = Some(REQUEST_TIMEOUT);
    kube::Client::try_from(config).map_err(|e| K8sError::Config(format!("Kubernetes client: {e}")))
}

/// A request the API server never answered (the connection refused, or closed under a pooled
/// connection before the request went out) is tried again, three times in all, 100 and 400 ms
/// apart: a connection that the server, a load balancer or the pod network dropped while idle must
/// not fail a kubelet's Allocate. (Seen against a real API server from a pod: `client error
/// (SendRequest)` on the first request after a minute idle.) A patch is safe to send again: it
/// carries the resourceVersion it was made from, so one that did land is refused as a conflict.
pub async fn retried<T, F, Fut>(mut call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut delay = std::time::Duration::from_millis(100);
    for _ in 0..2 {
        match call().await {
            Err(e) if unanswered(&e) => {
                tracing::debug!(error = %e, "the API server did not answer; trying again");
                tokio::time::sleep(delay).await;
                delay *= 4;
            }
            r => return r,
        }
    }
    call().await
}

/// How often an annotation patch that meets a conflict (409) is written again on the object as it
/// now is.
const CONFLICT_RETRIES: usize = 5;

/// Whether the API server refused a write because the object changed since it was read.
fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Whether a request failed before the API server answered it.
fn unanswered(e: &kube::Error) -> bool {
    matches!(e, kube::Error::HyperError(_) | kube::Error::Service(_))
}

/// What a container's spec asks of its devices beyond the scheduler's annotation.
#[derive(Clone, Copy)]
struct CtrSpec {
    /// `CUDA_DISABLE_CONTROL=true`: no preload file.
    disable_control: bool,
    /// HAMi's task priority of the container.
    priority: crate::slices::Priority,
}

impl Kube {
    /// Connects as [`client`] does.
    pub async fn connect(api: Option<&str>, node: &str, proto: &'static hami::Protocol) -> Result<Kube, K8sError> {
        Ok(Kube { client: client(api).await?, node: node.to_string(), proto })
    }

    async fn pods(&self) -> Result<Vec<Pod>, K8sError> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        Ok(retried(|| api.list(&lp)).await.map_err(err("listing this node's pods"))?.items)
    }

    /// Patches a pod's annotations at the version read. On a conflict (409: the pod changed
    /// since), the pod is read again and the patch written at its new version, as long as the
    /// annotations in `keep` still hold what they held when read (else [`K8sError::Changed`]); at
    /// most [`CONFLICT_RETRIES`] times.
    async fn patch_pod(&self, pod: &Pod, set: &[(&str, Option<String>)], keep: &[&str]) -> Result<(), K8sError> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let what = format!("patching pod {ns}/{name}");
        let mut version = pod.metadata.resource_version.clone();
        for attempt in 0.. {
            let p = annotation_patch(version.as_deref(), set);
            let (pp, patch) = (PatchParams::default(), Patch::Merge(&p));
            match retried(|| api.patch(&name, &pp, &patch)).await {
                Ok(_) => return Ok(()),
                Err(e) if conflict(&e) && attempt < CONFLICT_RETRIES => {
                    let now = retried(|| api.get(&name)).await.map_err(err(&what))?;
                    if let Some(k) = keep.iter().find(|k| ann(&now.metadata, k) != ann(&pod.metadata, k)) {
                        return Err(K8sError::Changed { what: format!("pod {ns}/{name}"), key: k.to_string() });
                    }
                    tracing::debug!(pod = %format!("{ns}/{name}"), attempt, "annotation patch conflicted; written again");
                    version = now.metadata.resource_version;
                }
                Err(e) => return Err(err(&what)(e)),
            }
        }
        unreachable!("the loop returns")
    }

    /// Patches the node's annotations at the version read, retrying conflicts as [`Kube::patch_pod`]
    /// does while the annotations in `keep` hold what they held.
    async fn patch_node(&self, node: &Node, set: &[(&str, Option<String>)], keep: &[&str]) -> Result<(), K8sError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let what = format!("patching node {}", self.node);
        let mut version = node.metadata.resource_version.clone();
        for attempt in 0.. {
            let p = annotation_patch(version.as_deref(), set);
            let (pp, patch) = (PatchParams::default(), Patch::Merge(&p));
            match retried(|| api.patch(&self.node, &pp, &patch)).await {
                Ok(_) => return Ok(()),
                Err(e) if conflict(&e) && attempt < CONFLICT_RETRIES => {
                    let now = self.get_node().await?;
                    if let Some(k) = keep.iter().find(|k| ann(&now.metadata, k) != ann(&node.metadata, k)) {
                        return Err(K8sError::Changed { what: format!("node {}", self.node), key: k.to_string() });
                    }
                    tracing::debug!(node = %self.node, attempt, "annotation patch conflicted; written again");
                    version = now.metadata.resource_version;
                }
                Err(e) => return Err(err(&what)(e)),
            }
        }
        unreachable!("the loop returns")
    }

    async fn get_node(&self) -> Result<Node, K8sError> {
        let api: Api<Node> = Api::all(self.client.clone());
        retried(|| api.get(&self.node)).await.map_err(err(&format!("reading node {}", self.node)))
    }

    /// Writes this node's GPUs in HAMi's register annotation, when it changed (v2.8 JSON, or the v2.7
    /// text form with its handshake).
    pub async fn register(&self, agent: &Agent, text_format: bool) -> Result<bool, K8sError> {
        let node = self.get_node().await?;
        let st = agent.status();
        let inv = agent.inventory.read().clone();
        let devs: Vec<RegisteredDevice> = inv
            .gpus
            .iter()
            .map(|g| RegisteredDevice {
                // The geometries a scheduler may cut a GPU in MIG mode into (HAMi's scheduler places
                // MIG requests only on GPUs that name some).
                mig_template: match g.mig.as_ref().is_some_and(|m| m.enabled) {
                    true => agent.mig_geometries(g).into_iter().flatten().map(|x| x.templates).collect(),
                    false => {
                        // Its geometries' warning, if any, is no longer about a GPU in MIG mode.
                        agent.warn(&geometries_warning(&g.uuid), None);
                        Vec::new()
                    }
                },
                id: g.uuid.clone(),
                index: g.index,
                count: agent.cfg.split_count,
                devmem: (agent.scaled(g.memory_total) >> 20) as u32,
                devcore: 100,
                ty: format!("NVIDIA-{}", g.name),
                numa: g.numa_node.unwrap_or(0),
                // HAMi's modes: a pod's `nvidia.com/vgpu-mode` picks GPUs by it.
                mode: if g.mig.as_ref().is_some_and(|m| m.enabled) {
                    "mig"
                } else if agent.cfg.mps.gpus.has(g.index, &g.uuid) {
                    "mps"
                } else {
                    "hami-core"
                }
                .into(),
                health: st.gpus.iter().find(|x| x.uuid == g.uuid).is_none_or(|x| x.healthy),
            })
            .collect();
        let volcano = self.proto.name == hami::VOLCANO.name;
        let value = if volcano {
            hami::register_volcano(&devs, agent.cfg.memory_factor)
        } else if text_format {
            hami::register_text(&devs)
        } else {
            hami::register_json(&devs)
        };
        let mut set = Vec::new();
        if ann(&node.metadata, self.proto.register).as_deref() != Some(value.as_str()) {
            set.push((self.proto.register, Some(value)));
        }
        if text_format && !volcano {
            set.push((hami::NODE_HANDSHAKE, Some(format!("Reported {}", chrono_like_now()))));
        }
        if volcano {
            // Volcano's scheduler (v1.15.1) builds a node's vGPU devices only on a node event after
            // its deviceshare plugin came on: a node it cached before that has no GPUs for it, and a
            // pod asking vGPU is bound without device annotations (the Allocate then fails). Its own
            // device plugin's periodic handshake is such an event every interval; so is this.
            set.push((hami::VOLCANO_HANDSHAKE, Some(format!("Reported {}", chrono_like_now()))));
        }
        if set.is_empty() {
            return Ok(false);
        }
        // The register annotation is this agent's own: written over whatever changed meanwhile.
        self.patch_node(&node, &set, &[]).await?;
        Ok(true)
    }

    /// The pod whose devices kubelet is allocating. HAMi: the one the node lock names (the scheduler
    /// locks the node for the pod it binds, and no other pod may be given devices; HAMi's own
    /// plugin dropped falling back to the oldest pending pod, which can hand one pod's devices to
    /// another). Volcano, whose lock names no pod: the pending pod bound first, as its plugin does.
    fn pending_pod<'a>(&self, node: &Node, pods: &'a [Pod]) -> Result<&'a Pod, K8sError> {
        let p = self.proto;
        let pending = |x: &&Pod| {
            ann(&x.metadata, p.bind_phase).as_deref() == Some("allocating") && ann(&x.metadata, p.to_allocate).is_some()
        };
        let none = || {
            K8sError::Refused(format!(
                "no pod on node {} is waiting for its GPUs (bind phase \"allocating\")",
                self.node
            ))
        };
        if !p.lock_names_owner {
            let bound =
                |x: &&Pod| ann(&x.metadata, p.bind_time).and_then(|t| t.parse::<u64>().ok()).unwrap_or(u64::MAX);
            return pods.iter().filter(pending).min_by_key(bound).ok_or_else(none);
        }
        let Some(lock) = ann(&node.metadata, p.lock) else {
            return Err(K8sError::Refused(format!(
                "node {} has no {} annotation: the scheduler locks the node for the pod it binds, and no pod \
                 holds the lock (none was bound here, or its lock was released or expired)",
                self.node, p.lock
            )));
        };
        let (ns, name) = match lock.split(',').collect::<Vec<_>>()[..] {
            [_, ns, name, ..] => (ns.to_string(), name.to_string()),
            _ => {
                return Err(K8sError::Refused(format!(
                    "node {}: lock {:?} names no pod (expected <time>,<namespace>,<pod>)",
                    self.node, lock
                )))
            }
        };
        let named = |x: &&Pod| {
            x.metadata.namespace.as_deref() == Some(ns.as_str()) && x.metadata.name.as_deref() == Some(name.as_str())
        };
        pods.iter().filter(named).find(pending).ok_or_else(|| {
            K8sError::Refused(format!(
                "node {}: the lock names {ns}/{name}, which is not waiting for its GPUs (bind phase \"allocating\"): \
                 the lock is stale",
                self.node
            ))
        })
    }

    /// Allocate in HAMi mode, for one container asking for `count` devices: the pending pod (the
    /// node lock's owner, else the oldest pod on this node in bind phase "allocating"), its first
    /// container entry not yet consumed, a slice with that entry's limits; the entry is then marked
    /// consumed, and once none is left the pod's bind phase becomes "success" and the node lock is
    /// released. On a mismatch the bind phase becomes "failed".
    pub async fn allocate(&self, agent: Arc<Agent>, count: usize) -> Result<Allocated, K8sError> {
        let node = self.get_node().await?;
        let p = self.proto;
        let pods = self.pods().await?;
        let pod = self.pending_pod(&node, &pods)?;
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        // The allocation refused (Refused) or its devices not made (Devices): the pod's bind phase
        // becomes "failed" and the lock is released.
        let fail = |e: K8sError| async move {
            let _ =
                self.patch_pod(pod, &[(self.proto.bind_phase, Some("failed".into()))], &[self.proto.bind_phase]).await;
            let _ = self.release_lock(&ns_name(pod)).await;
            Err::<Allocated, K8sError>(e)
        };
        let refused = |msg: String| K8sError::Refused(format!("pod {ns}/{name}: {msg}"));
        let mut entries =
            match hami::decode(&ann(&pod.metadata, p.to_allocate).unwrap_or_default(), p.trailing_separator) {
                Ok(e) => e,
                Err(e) => return fail(refused(format!("{}: {e}", p.to_allocate))).await,
            };
        let Some(idx) = entries.iter().position(|e| !e.is_empty()) else {
            return fail(refused("every container's devices are already allocated".into())).await;
        };
        if entries[idx].len() != count {
            return fail(refused(format!(
                "kubelet asks for {count} device(s), the scheduler assigned {} (device number not matched)",
                entries[idx].len()
            )))
            .await;
        }
        let mut devices: Vec<ContainerDevice> = std::mem::take(&mut entries[idx]);
        if p.memory_in_factor_units {
            let unit = u64::from(agent.cfg.memory_factor.max(1));
            for d in &mut devices {
                d.mem_mib = d.mem_mib.saturating_mul(unit);
            }
        }
        // Container names in annotation order: init containers first.
        let spec = pod.spec.clone().unwrap_or_default();
        let ctr_names: Vec<String> =
            spec.init_containers.unwrap_or_default().into_iter().chain(spec.containers).map(|c| c.name).collect();
        let container = ctr_names.get(idx).cloned().unwrap_or_else(|| idx.to_string());
        // `CUDA_DISABLE_CONTROL=true` in the container's spec: no preload file (HAMi's convention).
        let spec2 = pod.spec.clone().unwrap_or_default();
        let ctr = spec2.init_containers.unwrap_or_default().into_iter().chain(spec2.containers).nth(idx);
        let disable_control = ctr.as_ref().and_then(|c| c.env.as_ref()).is_some_and(|env| {
            env.iter().any(|e| e.name == "CUDA_DISABLE_CONTROL" && e.value.as_deref() == Some("true"))
        });
        let asked = ctr.as_ref().map_or(crate::slices::Priority::Normal, hami::task_priority);
        let priority = agent.grant_priority(asked, &ns, &format!("pod {ns}/{name} container {idx}"));
        let spec = CtrSpec { disable_control, priority };
        let slice = slice_name(&ns, &name, idx);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let owner = MigOwner { pod_uid: uid, namespace: ns.clone(), pod: name.clone(), container };
        // HAMi v2.10: the MIG devices its scheduler reserved, each to be made exactly.
        let mut reserved =
            match hami::decode_mig_allocations(&ann(&pod.metadata, hami::MIG_ALLOCATIONS).unwrap_or_default()) {
                Ok(r) => r,
                Err(e) => return fail(refused(e.to_string())).await,
            };
        let mut placed: Vec<hami::MigAllocation> =
            reserved.iter().filter(|a| a.container_index == idx).cloned().collect();
        placed.sort_by_key(|a| a.device_index);
        let allocated = match self.make_devices(&agent, &devices, &slice, owner, spec, placed).await {
            Ok(a) => a,
            Err(e) => return fail(e).await,
        };
        let done = entries.iter().all(|e| e.is_empty());
        let encoded = if p.trailing_separator { hami::encode(&entries) } else { hami::encode_joined(&entries) };
        let mut set = vec![(p.to_allocate, Some(encoded))];
        if done {
            set.push((p.bind_phase, Some("success".into())));
        }
        // What was made for HAMi's reservations, written back into them.
        if let (Allocated::Mig(uuids), true) = (&allocated, reserved.iter().any(|a| a.container_index == idx)) {
            fill_identities(&agent, &mut reserved, idx, uuids);
            set.push((hami::MIG_ALLOCATIONS, Some(serde_json::to_string(&reserved).expect("serialisable"))));
        }
        // The assignment written back only while it is the one read: what a container's devices are is
        // the scheduler's, and a pod whose assignment changed meanwhile is allocated again.
        if let Err(e) = self.patch_pod(pod, &set, &[p.to_allocate, p.bind_phase, hami::MIG_ALLOCATIONS]).await {
            self.undo(&agent, &allocated, &slice).await;
            return fail(e).await;
        }
        // The pod has its devices: a lock that cannot be released now is not the pod's failure (the
        // scheduler lets an old lock expire).
        if done {
            if let Err(e) = self.release_lock(&ns_name(pod)).await {
                tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "the node lock was not released; the scheduler lets it expire");
            }
        }
        tracing::info!(pod = %format!("{ns}/{name}"), allocation = %slice, done, protocol = p.name, "allocation from the scheduler's annotations");
        Ok(allocated)
    }

    /// Makes what a container's devices from the scheduler are: a MIG instance per device on GPUs
    /// in MIG mode, else a slice of whole GPUs (`slice`, labelled with its owner).
    async fn make_devices(
        &self,
        agent: &Arc<Agent>,
        devices: &[ContainerDevice],
        slice: &str,
        owner: MigOwner,
        spec: CtrSpec,
        placed: Vec<hami::MigAllocation>,
    ) -> Result<Allocated, K8sError> {
        let CtrSpec { disable_control, priority } = spec;
        let who = format!("pod {}/{}", owner.namespace, owner.pod);
        let refused = |msg: String| K8sError::Refused(format!("{who}: {msg}"));
        let devices_err = |msg: String| K8sError::Devices(format!("{who}: {msg}"));
        let inv = agent.inventory.read().clone();
        // A device on a GPU in MIG mode: its UUID, or its UUID with a position in a MIG geometry.
        let on_mig = |d: &ContainerDevice| {
            let base = hami::split_device_id(&d.uuid).map_or(d.uuid.as_str(), |(b, _)| b);
            inv.gpus.iter().any(|g| g.uuid == base && g.mig.as_ref().is_some_and(|m| m.enabled))
        };
        if devices.iter().all(on_mig) {
            // MIG GPUs: an instance per device, made for this container.
            let (a, devs, key) = (agent.clone(), devices.to_vec(), slice.to_string());
            if !placed.is_empty() && placed.len() != devs.len() {
                return Err(refused(format!(
                    "{} reserves {} MIG devices for the container, its devices are {}",
                    hami::MIG_ALLOCATIONS,
                    placed.len(),
                    devs.len()
                )));
            }
            let made = tokio::task::spawn_blocking(move || {
                if placed.is_empty() {
                    mig_allocate(&a, &key, owner, devs.len(), |b, inv, i| make_instance(&a, b, inv, &devs[i]))
                } else {
                    mig_allocate(&a, &key, owner, placed.len(), |b, inv, i| make_placed(b, inv, &placed[i]))
                }
            })
            .await?;
            return match made {
                Ok(m) => Ok(Allocated::Mig(m.into_iter().filter_map(|a| a.uuid).collect())),
                Err(e) => Err(devices_err(e.to_string())),
            };
        }
        if devices.iter().any(on_mig) {
            return Err(refused("a container mixes MIG and whole GPUs".into()));
        }
        if let Some(d) = devices.iter().find(|d| hami::split_device_id(&d.uuid).map_or(true, |(_, p)| p.is_some())) {
            // A MIG position on a GPU that is not (or no longer) in MIG mode, or an ID that does not parse.
            let why = hami::split_device_id(&d.uuid)
                .err()
                .map_or_else(|| "a MIG geometry position, on a GPU not in MIG mode".into(), |e| e.to_string());
            return Err(refused(format!("device {}: {why}", d.uuid)));
        }
        let req = pb::CreateSliceRequest {
            name: slice.to_string(),
            gpus: devices
                .iter()
                .map(|d| pb::SliceGpuLimit {
                    gpu: d.uuid.clone(),
                    memory: d.mem_mib << 20,
                    sm: if d.cores >= 100 { 0 } else { d.cores },
                })
                .collect(),
            labels: [
                ("source".to_string(), self.proto.name.to_string()),
                ("namespace".to_string(), owner.namespace),
                ("pod".to_string(), owner.pod),
                ("container".to_string(), owner.container),
                ("pod-uid".to_string(), owner.pod_uid),
            ]
            .into(),
            priority: crate::describe::priority_pb(priority) as i32,
        };
        let (a, key) = (agent.clone(), slice.to_string());
        let made = tokio::task::spawn_blocking(move || match a.create_slice(req) {
            Ok(d) => Ok(d),
            // A container restarted by kubelet: its slice is there.
            Err(crate::agent::ApiError::Exists(_)) => a.get_slice(&key).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        })
        .await?;
        match made {
            Ok(d) => Ok(Allocated::Slice(Box::new(d), !disable_control)),
            Err(e) => Err(devices_err(e)),
        }
    }

    /// Removes what [`Kube::make_devices`] made for an allocation that could not be recorded in
    /// the pod's annotations: nothing is left that no annotation names.
    async fn undo(&self, agent: &Arc<Agent>, allocated: &Allocated, slice: &str) {
        let (a, key) = (agent.clone(), slice.to_string());
        let mig = matches!(allocated, Allocated::Mig(_));
        let undone = tokio::task::spawn_blocking(move || {
            if !mig {
                return a.delete_slice(&key, false).map_err(|e| e.to_string());
            }
            match mig_records(&a).into_iter().find(|(k, _)| *k == key) {
                Some((k, rec)) => mig_release(&a, &k, &rec).map_err(|e| e.to_string()),
                None => Ok(()),
            }
        })
        .await;
        match undone {
            Ok(Ok(())) => tracing::info!(allocation = %slice, "devices of an allocation that was not recorded removed"),
            Ok(Err(e)) => {
                tracing::warn!(allocation = %slice, error = %e, "devices of an unrecorded allocation not removed")
            }
            Err(e) => {
                tracing::warn!(allocation = %slice, error = %e, "devices of an unrecorded allocation not removed")
            }
        }
    }

    /// Removes the node lock if `owner` (namespace/name) holds it (Volcano's names no owner: removed).
    async fn release_lock(&self, owner: &str) -> Result<(), K8sError> {
        let node = self.get_node().await?;
        let Some(l) = ann(&node.metadata, self.proto.lock) else { return Ok(()) };
        let f: Vec<&str> = l.split(',').collect();
        if !self.proto.lock_names_owner || (f.len() >= 3 && format!("{}/{}", f[1], f[2]) == owner) {
            self.patch_node(&node, &[(self.proto.lock, None)], &[self.proto.lock]).await?;
        }
        Ok(())
    }

    /// Deletes slices made for pods that no longer exist on this node: those made from either
    /// scheduler's annotations (a node switched from one protocol to the other keeps its slices
    /// until their pods go).
    pub async fn collect(&self, agent: &Agent) -> Result<usize, K8sError> {
        let pods = self.pods().await?;
        let uids: std::collections::HashSet<String> = pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
        let protocols = [crate::hami::HAMI.name, crate::hami::VOLCANO.name];
        let mut n = 0;
        for s in agent.slices().iter() {
            let Some(uid) = s.labels.get("pod-uid") else { continue };
            if s.labels.get("source").is_some_and(|src| protocols.contains(&src.as_str()))
                && !uids.contains(uid)
                && agent.delete_slice(&s.name, false).is_ok()
            {
                tracing::info!(slice = %s.name, "slice of a deleted pod removed");
                n += 1;
            }
        }
        // MIG instances made for pods that are gone.
        for (key, rec) in mig_records(agent) {
            if !uids.contains(&rec.owner.pod_uid) {
                if let Err(e) = mig_release(agent, &key, &rec) {
                    tracing::warn!(allocation = %key, error = %e, "MIG instance of a deleted pod not released");
                } else {
                    tracing::info!(allocation = %key, "MIG instance of a deleted pod released");
                    n += 1;
                }
            }
        }
        Ok(n)
    }
}

/// The Kubernetes client of HAMi or Volcano mode once it has connected, shared by the task that
/// connects and the device plugin's Allocate.
pub type KubeCell = Arc<std::sync::OnceLock<Arc<Kube>>>;

/// What Allocate gives a container: a slice, or MIG devices.
pub enum Allocated {
    /// The slice, and whether to mount `/etc/ld.so.preload`.
    Slice(Box<pb::SliceDetail>, bool),
    Mig(Vec<String>),
}

/// A container's MIG instances, recorded so that a container restart gets the same ones and a deleted
/// pod's are destroyed.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct MigRecord {
    #[serde(flatten)]
    owner: MigOwner,
    pub allocations: Vec<vgpu_mig::apply::Allocation>,
}

/// The container a HAMi-mode MIG allocation is for (records written before its names were kept
/// have the pod's UID alone).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct MigOwner {
    pod_uid: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    pod: String,
    #[serde(default)]
    container: String,
}

fn mig_dir(agent: &Agent) -> std::path::PathBuf {
    agent.cfg.state_dir.join("mig").join("allocations")
}

/// Tells the agent who holds the MIG devices made for containers in HAMi mode (from their
/// records). Called at start and after every change.
pub fn refresh_mig_holders(agent: &Agent) {
    let mut held = std::collections::BTreeMap::new();
    let mut containers = std::collections::BTreeMap::new();
    for (key, rec) in mig_records(agent) {
        for (i, u) in rec.allocations.into_iter().filter_map(|a| a.uuid).enumerate() {
            held.insert(u.clone(), format!("container {key}"));
            let o = &rec.owner;
            if !o.pod.is_empty() {
                let c = pb::MigContainer {
                    namespace: o.namespace.clone(),
                    pod: o.pod.clone(),
                    container: o.container.clone(),
                    device_index: i as u32,
                };
                containers.insert(u, c);
            }
        }
    }
    agent.set_mig_holders("hami", held);
    agent.set_mig_containers(containers);
}

/// HAMi mode's records of containers' MIG instances, by container key.
pub(crate) fn mig_records(agent: &Agent) -> Vec<(String, MigRecord)> {
    let Ok(rd) = std::fs::read_dir(mig_dir(agent)) else { return Vec::new() };
    rd.flatten()
        .filter_map(|e| {
            let key = e.path().file_stem()?.to_string_lossy().into_owned();
            Some((key, serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok()?))
        })
        .collect()
}

/// Makes `n` MIG instances for a container (the `i`th by `make`), or none: every instance made so
/// far goes again if a later one, or the record, cannot be made. A container restarted by kubelet
/// gets the ones its record names.
fn mig_allocate(
    agent: &Agent,
    key: &str,
    owner: MigOwner,
    n: usize,
    make: impl Fn(
        &vgpu_mig::backend::NvmlBackend,
        &crate::discovery::Inventory,
        usize,
    ) -> Result<vgpu_mig::apply::Allocation, MigAllocationError>,
) -> Result<Vec<vgpu_mig::apply::Allocation>, MigAllocationError> {
    let path = mig_dir(agent).join(format!("{key}.json"));
    if let Ok(rec) = serde_json::from_slice::<MigRecord>(&std::fs::read(&path).unwrap_or_default()) {
        return Ok(rec.allocations);
    }
    let nvml = agent.nvml.get().cloned().ok_or(MigAllocationError::NoNvml)?;
    let b = vgpu_mig::backend::NvmlBackend::new(nvml.clone());
    let _g = agent.mig.lock();
    let inv = agent.inventory.read().clone();
    let mut made = Vec::new();
    // Every instance made so far goes again if a later one, or the record, cannot be made: nothing
    // is left that no record names.
    let rollback = |made: &[vgpu_mig::apply::Allocation]| {
        for a in made {
            let _ = vgpu_mig::apply::release(&b, a.gpu, a.gi);
        }
    };
    for i in 0..n {
        match make(&b, &inv, i) {
            Ok(a) => made.push(a),
            Err(e) => {
                rollback(&made);
                return Err(e);
            }
        }
    }
    let rec = MigRecord { owner, allocations: made };
    if let Err(error) = std::fs::create_dir_all(mig_dir(agent))
        .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(&rec).expect("serialisable")))
    {
        rollback(&rec.allocations);
        return Err(MigAllocationError::Record { path, error });
    }
    refresh_mig_holders(agent);
    if let Ok(inv) = crate::discovery::discover(&nvml) {
        *agent.inventory.write() = inv;
    }
    Ok(rec.allocations)
}

/// Fills in the MIG device made for each of container `idx`'s reservations (in device order, as
/// `uuids` are): its UUID, GPU instance and compute instance, as the inventory now knows them.
fn fill_identities(agent: &Agent, reserved: &mut [hami::MigAllocation], idx: usize, uuids: &[String]) {
    let inv = agent.inventory.read();
    let mut mine: Vec<&mut hami::MigAllocation> = reserved.iter_mut().filter(|a| a.container_index == idx).collect();
    mine.sort_by_key(|a| a.device_index);
    for (a, uuid) in mine.into_iter().zip(uuids) {
        let found = inv.gpus.iter().filter_map(|g| g.mig.as_ref()).find_map(|m| {
            let gi = m.devices.iter().find(|d| &d.uuid == uuid)?.gpu_instance_id?;
            let ci = m.gpu_instances.iter().find(|i| i.id == gi)?.compute_instances.first()?.0;
            Some((gi, ci))
        });
        if let Some((gi, ci)) = found {
            (a.mig_uuid, a.gpu_instance_id, a.compute_instance_id) = (uuid.clone(), Some(gi), Some(ci));
        }
    }
}

/// The MIG instance HAMi's scheduler reserved (v2.10's [`hami::MIG_ALLOCATIONS`]): its profile at
/// its placement on its GPU, exactly.
fn make_placed(
    b: &vgpu_mig::backend::NvmlBackend,
    inv: &crate::discovery::Inventory,
    a: &hami::MigAllocation,
) -> Result<vgpu_mig::apply::Allocation, MigAllocationError> {
    use vgpu_mig::backend::MigBackend;
    let g =
        inv.gpus.iter().find(|g| g.uuid == a.gpu_uuid).ok_or_else(|| MigAllocationError::NoGpu(a.gpu_uuid.clone()))?;
    let gpu = b.gpu(g.index)?;
    let p = gpu
        .profile_named(&a.profile)
        .filter(|p| p.memory_slices == a.placement.size && p.starts.contains(&a.placement.start))
        .ok_or_else(|| MigAllocationError::NoPlacement {
            gpu: g.name.clone(),
            profile: a.profile.clone(),
            start: a.placement.start,
            size: a.placement.size,
        })?;
    let gi = b.create(g.index, p.id, a.placement.start)?;
    let uuid = b.gpu(g.index)?.instances.into_iter().find(|i| i.gi == gi).and_then(|i| i.uuid);
    Ok(vgpu_mig::apply::Allocation { gpu: g.index, gi, profile: p.name.clone(), start: a.placement.start, uuid })
}

/// One MIG instance for a device of a scheduler's assignment: at a position of a geometry, or (a
/// GPU's UUID alone) the best fit for the memory and cores asked.
fn make_instance(
    agent: &Agent,
    b: &vgpu_mig::backend::NvmlBackend,
    inv: &crate::discovery::Inventory,
    d: &ContainerDevice,
) -> Result<vgpu_mig::apply::Allocation, MigAllocationError> {
    let (base, position) = hami::split_device_id(&d.uuid)?;
    let g = inv.gpus.iter().find(|g| g.uuid == base).ok_or_else(|| MigAllocationError::NoGpu(base.to_string()))?;
    let gpu = vgpu_mig::backend::MigBackend::gpu(b, g.index)?;
    match position {
        // A position in a geometry (HAMi's and Volcano's MIG mode): an instance of its template's
        // profile, placed so that the rest of the geometry still fits.
        Some((geo, pos)) => {
            let geometries = agent.mig_geometries(g).unwrap_or_default();
            let geometry = hami::find_geometry(&geometries, geo).ok_or_else(|| MigAllocationError::NoGeometry {
                device: d.uuid.clone(),
                gpu: g.name.clone(),
                geometry: geo.to_string(),
                known: geometries.iter().map(|x| x.group.as_str()).collect::<Vec<_>>().join(", "),
            })?;
            let t = geometry.template_at(pos).ok_or_else(|| MigAllocationError::NoPosition {
                device: d.uuid.clone(),
                geometry: geometry.group.clone(),
                position: pos,
            })?;
            let id = |name: &str| {
                gpu.profile_named(name).map(|p| p.id).ok_or_else(|| MigAllocationError::NoProfile {
                    device: d.uuid.clone(),
                    geometry: geometry.group.clone(),
                    profile: name.to_string(),
                    gpu: g.name.clone(),
                })
            };
            let ids = geometry
                .templates
                .iter()
                .map(|x| Ok((id(&x.name)?, x.count)))
                .collect::<Result<Vec<_>, MigAllocationError>>()?;
            Ok(vgpu_mig::apply::allocate_in_geometry(b, g.index, &ids, id(&t.name)?)?)
        }
        None => {
            let full = gpu.profiles.iter().map(|p| p.compute).max().unwrap_or(7);
            let compute = if (1..100).contains(&d.cores) { (d.cores * full).div_ceil(100) } else { 0 };
            let req = vgpu_mig::planner::Request { memory_mib: d.mem_mib, compute, sms: 0, media: false };
            Ok(vgpu_mig::apply::allocate(b, g.index, &req)?)
        }
    }
}

/// The source of a GPU's warning about its configured MIG geometries ([`Agent::warn`]).
fn geometries_warning(uuid: &str) -> String {
    format!("mig-geometries {uuid}")
}

impl Agent {
    /// The MIG geometries of a GPU (HAMi and Volcano modes): the configured ones for its model, else
    /// those its profile table gives. None while NVML has not answered its profiles.
    ///
    /// Configured geometries left out for naming a profile the GPU lacks are a warning (logged once,
    /// and in the status's `warnings` while it lasts): the scheduler may place requests in them.
    pub(crate) fn mig_geometries(&self, g: &crate::discovery::Gpu) -> Option<Vec<hami::MigGeometry>> {
        let profiles = self.profiles(&g.uuid, g.index)?;
        let geometries = hami::gpu_geometries(&self.cfg.mig_geometries, &g.name, &profiles);
        let text = hami::configured_geometries(&self.cfg.mig_geometries, &g.name).and_then(|k| {
            let left = hami::left_out_geometries(k, &g.name, &profiles);
            (!left.is_empty()).then(|| {
                format!(
                    "GPU {} ({}): {} of the {} MIG geometries mig_geometries_file gives it name profiles it lacks and are left out: {}{}",
                    g.index,
                    g.name,
                    left.len(),
                    k.geometries.len(),
                    hami::left_out_text(&left),
                    if geometries.is_empty() { "; none is left, so no MIG request can be placed on it" } else { "" }
                )
            })
        });
        if self.warn(&geometries_warning(&g.uuid), text.clone()) {
            if let Some(t) = text {
                tracing::warn!("{t}");
            }
        }
        Some(geometries)
    }
}

fn mig_release(agent: &Agent, key: &str, rec: &MigRecord) -> Result<(), MigAllocationError> {
    let nvml = agent.nvml.get().cloned().ok_or(MigAllocationError::NoNvml)?;
    let b = vgpu_mig::backend::NvmlBackend::new(nvml.clone());
    let _g = agent.mig.lock();
    for a in &rec.allocations {
        // An instance already gone is released too.
        vgpu_mig::apply::release(&b, a.gpu, a.gi)?;
    }
    let _ = std::fs::remove_file(mig_dir(agent).join(format!("{key}.json")));
    refresh_mig_holders(agent);
    if let Ok(inv) = crate::discovery::discover(&nvml) {
        *agent.inventory.write() = inv;
    }
    Ok(())
}

fn ns_name(p: &Pod) -> String {
    format!("{}/{}", p.metadata.namespace.as_deref().unwrap_or(""), p.metadata.name.as_deref().unwrap_or(""))
}

/// `YYYY-MM-DD HH:MM:SS` (UTC), as HAMi's handshake writes times.
fn chrono_like_now() -> String {
    let s = crate::health::rfc3339_now();
    s.replacen('T', " ", 1).trim_end_matches('Z').to_string()
}

/// Registers the node now and every 30 s, and removes slices of deleted pods, until the agent stops.
pub async fn run(agent: Arc<Agent>, kube: Arc<Kube>, text_format: bool, mut stop: tokio::sync::watch::Receiver<bool>) {
    loop {
        match kube.register(&agent, text_format).await {
            Ok(true) => tracing::info!(node = %kube.node, "HAMi node annotation written"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "HAMi node registration failed"),
        }
        if let Err(e) = kube.collect(&agent).await {
            tracing::warn!(error = %e, "slice collection failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(agent.cfg.register_interval_s)) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_names_and_patches() {
        assert_eq!(slice_name("ml", "Train_1", 2), "ml-train-1-2");
        let long = slice_name(&"n".repeat(40), &"p".repeat(40), 0);
        assert!(long.len() <= 63, "{long}");
        let p = annotation_patch(Some("42"), &[("a", Some("b".into())), ("c", None)]);
        assert_eq!(p, serde_json::json!({"metadata": {"resourceVersion": "42", "annotations": {"a": "b", "c": null}}}));
    }
}

//! Dynamic Resource Allocation (`resource.k8s.io/v1`, GA since Kubernetes 1.34, or the `v1beta2`
//! and `v1beta1` of 1.33 and 1.32: see [`ApiVersion`]): the agent as a DRA driver (`dra = "on"`,
//! named `dra_driver`).
//!
//! - **Devices**: one pool per node (named after the node), in ResourceSlices `<node>-<driver>`,
//!   `<node>-<driver>-1`, ... of at most 128 devices each (the API's limit), owned by the Node
//!   object. Each healthy GPU not in MIG mode has attributes `uuid`, `productName`, `index`, `mig`
//!   (false), `mps` (whether it runs MPS) and capacities `memory` and `cores`. With `dra_sharing = "replicas"` it is
//!   `split_count` devices `gpu-<index>-<n>`, each an equal share; with `"capacity"` it is one
//!   device `gpu-<index>` that allows multiple allocations, whose `memory` (default: all of it, in
//!   steps of 1 MiB) and `cores` (default 0: no SM limit, in steps of 1) each claim consumes as it
//!   asks (consumable capacity, KEP 5075). A healthy GPU in MIG mode offers each of its MIG devices
//!   whole, as `mig-<MIG UUID>` with `uuid` (the MIG device's), `parentUUID`, `productName`,
//!   `index`, `mig` (true), `profile` and `memory`; with `dra_mig = "dynamic"` it offers every
//!   placement of every profile instead, `gpu-<index>-mig-<profile>-<start>`, as partitionable
//!   devices consuming the counters of the GPU's counter set `gpu-<index>-mig` (KEP 4815), which go
//!   in ResourceSlices of their own before the devices'. The pool is written at start and again when its
//!   devices change (a GPU's health, a MIG layout), every slice with the generation raised; an API
//!   server that drops fields it does not serve (consumable capacity before its feature gate) is not
//!   written again for that.
//! - **Kubelet**: the registration service on `plugins_registry/<driver>-reg.sock@localhost` and the DRA
//!   service (`v1.DRAPlugin` and `v1beta1.DRAPlugin`, the same calls) with device health
//!   (`v1alpha1.DRAResourceHealth`: every device with its GPU's health, for pods' status) on
//!   `plugins/<driver>/dra.sock`, both beside the device-plugin directory. A socket removed (a
//!   kubelet clean-up) is served again.
//! - **NodePrepareResources**: reads the claim (`resourceclaims` get), takes the devices allocated
//!   from this node's pool by this driver, and makes the claim's slice `dra-<claim UID>` with k/split
//!   of each GPU's memory and time for k of its replica devices, as replica mode does, and for a
//!   shared device the capacity the allocation consumed (`consumedCapacity`; none recorded: the
//!   whole GPU, as a scheduler without consumable capacity allocates it); the answer names the
//!   slice's CDI device (`vgpu.io/slice=dra-<UID>`) once per request, whose spec injects the slice.
//!   A claim's MIG devices get no slice (MIG isolates them): a record under
//!   `<state_dir>/dra-mig/` and the CDI device `vgpu.io/mig=dra-<UID>`, which sets
//!   `NVIDIA_VISIBLE_DEVICES`; a partition's instance is made then (destroyed again if the claim
//!   cannot be prepared whole); a MIG device another prepared claim holds is refused, as is a claim
//!   of MIG devices and shares together. A claim allocated with admin access (monitoring beside the
//!   claims that hold the devices) gets no slice either: a record under `<state_dir>/dra-admin/`,
//!   and the CDI device `vgpu.io/admin=dra-<UID>`, which sets `NVIDIA_VISIBLE_DEVICES` to its
//!   devices' GPUs and mounts the record at `/run/vgpu-admin/`, by which the monitoring pass tells
//!   its processes from escapes. A claim that a container of one of its pods uses together with
//!   another claim of this driver's devices on this node is refused (the two injections would not
//!   compose). Preparing a claim again returns the same; a claim whose UID changed (deleted and
//!   made again) is refused.
//! - **NodeUnprepareResources**: removes the claim's slice (refused while processes of it live), or
//!   its record and spec of devices given whole, destroying the MIG instances made for it (refused
//!   while processes run on one).
//! - **Collection**: a claim's slice whose claim is gone (or made again under its name), which
//!   kubelet never unprepared (its state lost with the node's), is removed once no process of it
//!   lives, and a gone claim's record and spec of devices given whole at once; checked every
//!   `slice_gc_grace_s / 2` (1-10 s).

mod devices;
mod gc;
mod kubelet;
mod prepare;
mod publish;

pub use devices::*;
use gc::*;
pub use kubelet::*;
pub use prepare::*;
pub use publish::*;

use crate::agent::{Agent, ApiError};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};
use vgpu_proto::dra::{health as hp, registration as reg, v1, v1beta1};
use vgpu_proto::v1 as pb;

/// The version of `resource.k8s.io` the driver speaks to the API server: the newest it serves of
/// those the driver knows, found once (at the first publication or preparation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiVersion {
    /// GA, Kubernetes 1.34 and later.
    V1,
    /// Beta, Kubernetes 1.33 (and served beside `v1` later): `v1`'s shape.
    V1beta2,
    /// Beta, Kubernetes 1.32 (and 1.33): a device's fields but its name are under `basic`.
    V1beta1,
}

impl ApiVersion {
    /// Newest first, as the driver prefers them.
    pub const ALL: [ApiVersion; 3] = [ApiVersion::V1, ApiVersion::V1beta2, ApiVersion::V1beta1];

    pub fn name(self) -> &'static str {
        match self {
            ApiVersion::V1 => "v1",
            ApiVersion::V1beta2 => "v1beta2",
            ApiVersion::V1beta1 => "v1beta1",
        }
    }

    /// The newest version the driver knows of those `served` (an API group's `versions[].version`).
    pub fn newest<'a>(served: impl IntoIterator<Item = &'a str> + Clone) -> Option<ApiVersion> {
        Self::ALL.into_iter().find(|v| served.clone().into_iter().any(|s| s == v.name()))
    }

    /// Whether the version carries MIG partitions as the driver publishes them (counter sets in
    /// ResourceSlices of their own, which `v1` brought; before it the scheduler looked for a
    /// device's counters in its own ResourceSlice).
    pub fn partitions(self) -> bool {
        self == ApiVersion::V1
    }

    /// A ResourceSlice spec of `v1`'s shape in this version's.
    pub fn slice_spec(self, mut spec: Value) -> Value {
        if self == ApiVersion::V1beta1 {
            for d in spec.get_mut("devices").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Value::Object(m) = d {
                    let name = m.remove("name");
                    let basic = std::mem::take(m);
                    m.extend(name.map(|n| ("name".to_string(), n)));
                    m.insert("basic".into(), Value::Object(basic));
                }
            }
        }
        spec
    }

    /// A ResourceSlice spec of this version in `v1`'s shape (as [`ApiVersion::slice_spec`] undone).
    pub fn v1_spec(self, spec: &Value) -> Value {
        let mut spec = spec.clone();
        if self == ApiVersion::V1beta1 {
            for d in spec.get_mut("devices").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Value::Object(m) = d {
                    if let Some(Value::Object(basic)) = m.remove("basic") {
                        m.extend(basic);
                    }
                }
            }
        }
        spec
    }

    fn resource(self, kind: &str, plural: &str) -> ApiResource {
        ApiResource {
            group: "resource.k8s.io".into(),
            version: self.name().into(),
            api_version: format!("resource.k8s.io/{}", self.name()),
            kind: kind.into(),
            plural: plural.into(),
        }
    }
}

/// Why `dra_mig = "dynamic"` offers MIG devices as they are.
const NO_PARTITIONS: &str = "DRA: dra_mig = \"dynamic\" needs resource.k8s.io/v1 (Kubernetes 1.34), where a pool's \
                             counter sets have ResourceSlices of their own; GPUs in MIG mode offer their MIG devices \
                             as they are";

/// Why a DRA action failed: one variant per failed step (kubelet is told its text per claim).
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error("listing the API server's API groups: {0}")]
    ListGroups(#[source] Box<kube::Error>),
    #[error(
        "the API server serves {0} of resource.k8s.io; the driver needs v1 (Kubernetes 1.34), v1beta2 (1.33) or \
         v1beta1 (1.32), with DRA enabled"
    )]
    NoVersion(String),
    #[error("{what} ResourceSlice {name}: {source}")]
    Slice { what: &'static str, name: String, source: Box<kube::Error> },
    #[error("reading claim {claim}: {source}")]
    ReadClaim { claim: String, source: Box<kube::Error> },
    #[error("claim {claim} is {found}, not {uid} (it was made again)")]
    Replaced { claim: String, found: String, uid: String },
    #[error("claim {0} is not allocated")]
    NotAllocated(String),
    #[error(
        "claim {0} has requests with admin access and without, which cannot be given to one container together \
         (NVIDIA_VISIBLE_DEVICES): put them in separate claims"
    )]
    MixedAdmin(String),
    #[error(
        "claim {0} has MIG devices and GPU shares, which cannot be given to one container together \
         (NVIDIA_VISIBLE_DEVICES): put them in separate claims"
    )]
    MixedMigAndShares(String),
    #[error("{0} is not a device of this driver")]
    NotOurs(String),
    #[error("{0} is not a device of this node")]
    NotHere(String),
    #[error("{device}: consumed {key} {value} is not a whole quantity")]
    BadQuantity { device: String, key: String, value: String },
    #[error("{device}: consumed cores {cores}")]
    BadCores { device: String, cores: u64 },
    #[error("claim UID {0:?} cannot name a slice")]
    BadUid(String),
    #[error("the claim's configuration for this driver gives priority {0}: \"high\" or \"normal\" is accepted")]
    BadPriority(String),
    /// A container of the claim's pod also uses another claim of this driver on this node.
    #[error("{0}")]
    SharedContainer(String),
    #[error("no GPU {0} on this node")]
    NoGpu(u32),
    #[error("the claim consumes {} of GPU {index}'s memory, which offers {}", crate::describe::exact(*bytes, *offers), crate::describe::exact(*offers, *bytes))]
    TooMuchMemory { bytes: u64, index: u32, offers: u64 },
    #[error("making slice {slice}: {source}")]
    MakeSlice { slice: String, source: crate::agent::ApiError },
    #[error("removing the claim's slice: {0}")]
    DeleteSlice(#[source] crate::agent::ApiError),
    #[error("NVML is not open yet")]
    NoNvml,
    #[error("writing {}: {source}", path.display())]
    Write { path: std::path::PathBuf, source: std::io::Error },
    #[error("MIG device {uuid}: {source}")]
    Release { uuid: String, source: vgpu_mig::backend::MigError },
    #[error(transparent)]
    Mig(#[from] vgpu_mig::backend::MigError),
    #[error("{0}: no such MIG device on this node (the GPU's layout changed)")]
    NoMigDevice(String),
    #[error("{0}: no MIG instance there (one is made when a claim is prepared for it)")]
    NoPartitionInstance(String),
    #[error("{device}: no GPU {index} on this node")]
    DeviceNoGpu { device: String, index: u32 },
    #[error("MIG device {device} is prepared for claim {claim} ({uid})")]
    MigDeviceHeld { device: String, claim: String, uid: String },
    #[error("{device}: {source}")]
    DeviceGpu { device: String, source: vgpu_mig::backend::MigError },
    #[error("{device}: GPU {index} is not in MIG mode")]
    NotMigMode { device: String, index: u32 },
    #[error("{device}: GPU {index} has no MIG profile {label} placed at memory slice {start}")]
    NoProfile { device: String, index: u32, label: String, start: u32 },
    #[error("{device}: making a {profile} instance at memory slice {start}: {source}")]
    MakeInstance { device: String, profile: String, start: u32, source: vgpu_mig::backend::MigError },
    #[error("{device}: the new {profile} instance has no MIG device UUID")]
    NoUuid { device: String, profile: String },
}

/// Which version of `resource.k8s.io` the API server serves that the driver knows, newest first.
async fn discover(client: &kube::Client) -> Result<ApiVersion, DraError> {
    let groups = client.list_api_groups().await.map_err(|e| DraError::ListGroups(Box::new(e)))?;
    let served: Vec<String> = groups
        .groups
        .iter()
        .filter(|g| g.name == "resource.k8s.io")
        .flat_map(|g| g.versions.iter().map(|v| v.version.clone()))
        .collect();
    ApiVersion::newest(served.iter().map(String::as_str)).ok_or_else(|| {
        DraError::NoVersion(if served.is_empty() { "no version".to_string() } else { served.join(", ") })
    })
}

#[derive(Clone)]
pub struct Driver {
    agent: Arc<Agent>,
    driver: String,
    node: String,
    client: kube::Client,
    /// The version of `resource.k8s.io` spoken to the API server, once found.
    version: Arc<tokio::sync::OnceCell<ApiVersion>>,
    /// One preparation or removal of devices given whole at a time (the check that no other claim
    /// holds a MIG device).
    whole_lock: Arc<parking_lot::Mutex<()>>,
}

impl Driver {
    /// The version of `resource.k8s.io` to speak, asked of the API server the first time.
    async fn version(&self) -> Result<ApiVersion, DraError> {
        let v = self
            .version
            .get_or_try_init(|| async {
                let v = discover(&self.client).await?;
                tracing::info!(version = %format!("resource.k8s.io/{}", v.name()), "DRA: the API version spoken");
                if self.agent.cfg.dra_mig == crate::config::DraMig::Dynamic && !v.partitions() {
                    tracing::warn!("{}", NO_PARTITIONS);
                }
                Ok::<_, DraError>(v)
            })
            .await?;
        Ok(*v)
    }

    /// The claims of a namespace, in the version spoken.
    async fn claims(&self, namespace: &str) -> Result<Api<DynamicObject>, DraError> {
        let v = self.version().await?;
        Ok(Api::namespaced_with(self.client.clone(), namespace, &v.resource("ResourceClaim", "resourceclaims")))
    }
}

/// Serves kubelet and keeps the ResourceSlice current for as long as the agent runs.
pub async fn run(agent: Arc<Agent>, driver: String, mut stop: tokio::sync::watch::Receiver<bool>) {
    let client = match crate::k8s::client(agent.cfg.kube_api.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "DRA driver off: no Kubernetes API");
            return;
        }
    };
    let d = Driver {
        agent: agent.clone(),
        driver: driver.clone(),
        node: agent.cfg.node_name.clone(),
        client,
        version: Default::default(),
        whole_lock: Default::default(),
    };
    let (reg_sock, dra_sock) = sockets(&agent.cfg, &driver);
    let _ = std::fs::remove_file(former_registration_socket(&agent.cfg, &driver));
    let registrar = Registrar { driver: driver.clone(), endpoint: dra_sock.clone() };
    let mut owner = None;
    let mut written: Written = Vec::new();
    // What the API server kept is forgotten now and then, so a feature gate turned on since is seen
    // (at worst one write of unchanged devices per period).
    let mut written_since = tokio::time::Instant::now();
    let mut next_publish = tokio::time::Instant::now();
    let collect_every =
        (Duration::from_secs(agent.cfg.slice_gc_grace_s) / 2).clamp(Duration::from_secs(1), Duration::from_secs(10));
    let mut next_collect = tokio::time::Instant::now() + collect_every;
    let mut serving: Option<(Option<u64>, Option<u64>, tokio::sync::watch::Sender<bool>)> = None;
    loop {
        // (Re)serve when a socket is missing: the DRA service first, so kubelet can call it as soon as
        // it learns of it from the registration socket.
        let up = serving
            .as_ref()
            .is_some_and(|(r, s, _)| crate::sockets::inode(&reg_sock) == *r && crate::sockets::inode(&dra_sock) == *s);
        if !up {
            if let Some((_, _, down)) = serving.take() {
                let _ = down.send(true);
            }
            let (down_tx, down_rx) = tokio::sync::watch::channel(false);
            let _ = std::fs::remove_file(&dra_sock);
            let _ = std::fs::remove_file(&reg_sock);
            match (crate::sockets::bind(&dra_sock), crate::sockets::bind(&reg_sock)) {
                (Ok(dl), Ok(rl)) => {
                    let (mut r1, mut r2) = (down_rx.clone(), down_rx);
                    tokio::spawn(
                        tonic::transport::Server::builder()
                            .add_service(v1::dra_plugin_server::DraPluginServer::new(d.clone()))
                            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(d.clone()))
                            .add_service(hp::dra_resource_health_server::DraResourceHealthServer::new(d.clone()))
                            .serve_with_incoming_shutdown(crate::sockets::incoming(dl), async move {
                                let _ = r1.wait_for(|x| *x).await;
                            }),
                    );
                    tokio::spawn(
                        tonic::transport::Server::builder()
                            .add_service(reg::registration_server::RegistrationServer::new(registrar.clone()))
                            .serve_with_incoming_shutdown(crate::sockets::incoming(rl), async move {
                                let _ = r2.wait_for(|x| *x).await;
                            }),
                    );
                    tracing::info!(driver = %driver, registration = %reg_sock.display(), service = %dra_sock.display(), "serving the DRA driver");
                    serving = Some((crate::sockets::inode(&reg_sock), crate::sockets::inode(&dra_sock), down_tx));
                }
                (a, b) => {
                    for e in [a.err(), b.err()].into_iter().flatten() {
                        tracing::error!(error = %e, "DRA driver: cannot listen; retrying");
                    }
                }
            }
        }
        if tokio::time::Instant::now() >= next_publish {
            if owner.is_none() {
                owner = node_owner(&d.client, &d.node).await;
            }
            if written_since.elapsed() >= WRITTEN_KEPT {
                written.clear();
                written_since = tokio::time::Instant::now();
            }
            next_publish = tokio::time::Instant::now()
                + match publish(&d, &owner, &mut written).await {
                    Ok(changed) => {
                        if changed {
                            tracing::info!(node = %d.node, driver = %driver, "ResourceSlices written");
                        }
                        agent.warn("dra-publish", None);
                        Duration::from_secs(2)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot publish the ResourceSlice; retrying");
                        agent.warn("dra-publish", Some(format!("DRA: cannot publish the ResourceSlices: {e}")));
                        Duration::from_secs(5)
                    }
                };
        }
        if tokio::time::Instant::now() >= next_collect {
            collect(&d).await;
            next_collect = tokio::time::Instant::now() + collect_every;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => break,
        }
    }
    if let Some((_, _, down)) = serving {
        let _ = down.send(true);
    }
    let _ = std::fs::remove_file(&dra_sock);
    let _ = std::fs::remove_file(&reg_sock);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_others_are_not_ours() {
        assert_eq!(device_name(3, 7), "gpu-3-7");
        assert_eq!(parse_device(&device_name(3, 7)), Some(Dev::Replica(3, 7)));
        assert_eq!(parse_device(&shared_device_name(3)), Some(Dev::Shared(3)));
        assert_eq!(shared_device_name(3), "gpu-3");
        for other in ["nic-0-1", "gpu-x-1", "gpu-", "gpu-1-", "gpu-+1", "gpu-1-+2", "gpu-1-2-3", "gpu"] {
            assert_eq!(parse_device(other), None, "{other}");
        }
        assert_eq!(slice_name("7C1A-uid"), "dra-7c1a-uid");
        assert!(crate::slices::valid_name(&slice_name("0b7f3f4e-5d0a-4d4a-9f0e-3c2b1a0f9e8d")));
        assert_eq!(resource_slice_name("node-a", "gpu.vgpu.io"), "node-a-gpu.vgpu.io");
        assert_eq!(pool_slice_name("node-a", "gpu.vgpu.io", 0), "node-a-gpu.vgpu.io");
        assert_eq!(pool_slice_name("node-a", "gpu.vgpu.io", 2), "node-a-gpu.vgpu.io-2");
        // MIG devices by UUID, as DNS labels (the old form names the parent and the instances).
        let m = mig_device_name("MIG-7F1D2C3B-0A1B-5C2D-8E9F-00112233AABB");
        assert_eq!(m, "mig-7f1d2c3b-0a1b-5c2d-8e9f-00112233aabb");
        assert_eq!(parse_device(&m), Some(Dev::Mig(m.clone())));
        let old = mig_device_name("MIG-GPU-5f3b1c2d-0a1b-4c2d-8e9f-00112233aabb/3/0");
        assert_eq!(old, "mig-gpu-5f3b1c2d-0a1b-4c2d-8e9f-00112233aabb-3-0");
        let long = mig_device_name(&format!("MIG-{}", "a-".repeat(40)));
        assert!(long.len() <= 63 && !long.ends_with('-'), "{long}");
        // Partitions: the profile as a label, and the placement.
        assert_eq!(partition_device_name(1, "1g.10gb+me", 6), "gpu-1-mig-1g-10gb-me-6");
        assert_eq!(parse_device("gpu-1-mig-1g-10gb-me-6"), Some(Dev::Partition(1, "1g-10gb-me".into(), 6)));
        assert_eq!(parse_device("gpu-12-mig-7g-80gb-0"), Some(Dev::Partition(12, "7g-80gb".into(), 0)));
        for other in ["gpu-1-mig-", "gpu-1-mig-3g", "gpu-1-mig--0", "gpu-x-mig-3g-0", "gpu-1-mig-3g-x"] {
            assert_eq!(parse_device(other), None, "{other}");
        }
        assert_eq!(counter_set_name(3), "gpu-3-mig");
    }

    #[test]
    fn the_newest_api_version_served_is_spoken_in_its_shape() {
        use ApiVersion::*;
        assert_eq!(ApiVersion::newest(["v1beta1", "v1", "v1beta2"]), Some(V1));
        assert_eq!(ApiVersion::newest(["v1beta1", "v1beta2"]), Some(V1beta2));
        assert_eq!(ApiVersion::newest(["v1alpha3", "v1beta1"]), Some(V1beta1));
        assert_eq!(ApiVersion::newest(["v1alpha3"]), None);
        assert_eq!(ApiVersion::newest([]), None);
        assert!(V1.partitions() && !V1beta2.partitions() && !V1beta1.partitions());
        assert_eq!(V1beta2.resource("ResourceSlice", "resourceslices").api_version, "resource.k8s.io/v1beta2");

        let spec = json!({
            "driver": "gpu.vgpu.io",
            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": "gpu-0-0", "attributes": {"index": {"int": 0}}, "capacity": {"memory": {"value": "1Gi"}}},
                {"name": "gpu-0-1", "allowMultipleAllocations": true},
            ],
        });
        // v1 and v1beta2 as they are; v1beta1 with all but the name under `basic`, and back.
        assert_eq!(V1.slice_spec(spec.clone()), spec);
        assert_eq!(V1beta2.slice_spec(spec.clone()), spec);
        let beta1 = V1beta1.slice_spec(spec.clone());
        assert_eq!(
            beta1["devices"][0],
            json!({"name": "gpu-0-0", "basic": {"attributes": {"index": {"int": 0}}, "capacity": {"memory": {"value": "1Gi"}}}})
        );
        assert_eq!(beta1["devices"][1], json!({"name": "gpu-0-1", "basic": {"allowMultipleAllocations": true}}));
        assert_eq!(beta1["pool"], spec["pool"]);
        assert_eq!(V1beta1.v1_spec(&beta1), spec);
        assert_eq!(V1.v1_spec(&spec), spec);
        // A counter-set slice has no devices to reshape.
        let counters = json!({"sharedCounters": [{"name": "c", "counters": {}}]});
        assert_eq!(V1beta1.slice_spec(counters.clone()), counters);
    }

    #[test]
    fn a_pool_is_counter_sets_then_devices_within_the_api_s_limits() {
        let dev = |n: usize, counted: bool| {
            (0..n)
                .map(|i| {
                    let mut d = json!({"name": format!("d{i}")});
                    if counted {
                        d["consumesCounters"] = json!([{"counterSet": "c", "counters": {}}]);
                    }
                    d
                })
                .collect::<Vec<_>>()
        };
        let sets = |n: usize| (0..n).map(|i| json!({"name": format!("c{i}")})).collect::<Vec<_>>();
        let sizes = |parts: &[Value]| -> Vec<(String, usize)> {
            parts
                .iter()
                .map(|p| {
                    let (k, v) = p.as_object().unwrap().iter().next().unwrap();
                    (k.clone(), v.as_array().unwrap().len())
                })
                .collect()
        };
        let empty = pool_parts(Pool::default());
        assert_eq!(sizes(&empty), [("devices".into(), 0)]);
        let plain = pool_parts(Pool { devices: dev(200, false), counters: Vec::new() });
        assert_eq!(sizes(&plain), [("devices".into(), 128), ("devices".into(), 72)]);
        let counted = pool_parts(Pool { devices: dev(200, true), counters: sets(9) });
        assert_eq!(
            sizes(&counted),
            [
                ("sharedCounters".into(), 8),
                ("sharedCounters".into(), 1),
                ("devices".into(), 64),
                ("devices".into(), 64),
                ("devices".into(), 64),
                ("devices".into(), 8)
            ]
        );
    }

    #[test]
    fn capacities_compare_by_value_in_any_form_the_api_server_writes() {
        assert_eq!(quantity("8589934592"), Some(8 << 30));
        assert_eq!(quantity("8Gi"), Some(8 << 30));
        assert_eq!(quantity("858993k"), Some(858_993_000));
        assert_eq!(quantity("1e3"), Some(1000));
        assert_eq!(quantity("10"), Some(10));
        assert_eq!((quantity("1.5Gi"), quantity("x"), quantity("")), (None, None, None));
        let devices = |d: Value| json!({"devices": d});
        let ours = devices(
            json!([{"name": "gpu-0-0", "capacity": {"memory": {"value": "8589934592"}, "cores": {"value": "10"}}}]),
        );
        let back =
            devices(json!([{"name": "gpu-0-0", "capacity": {"memory": {"value": "8Gi"}, "cores": {"value": "10"}}}]));
        assert!(same_part(&ours, &back));
        let other =
            devices(json!([{"name": "gpu-0-0", "capacity": {"memory": {"value": "4Gi"}, "cores": {"value": "10"}}}]));
        assert!(!same_part(&ours, &other));
        assert!(!same_part(&ours, &devices(json!([]))));
        assert!(same_part(&devices(json!([])), &json!({"driver": "x"})), "an empty list and none alike");
        // A shared device's request policy comes back canonical too.
        let policy = |d: &str, min: &str| {
            devices(json!([{"name": "gpu-0", "allowMultipleAllocations": true, "capacity": {"memory": {"value": "8Gi",
                "requestPolicy": {"default": d, "validRange": {"min": min, "step": "1048576"}}}}}]))
        };
        assert!(same_part(&policy("8589934592", "1048576"), &policy("8Gi", "1Mi")));
        assert!(!same_part(&policy("8589934592", "1048576"), &policy("4Gi", "1Mi")));
        // Counter sets, and what devices consume of them.
        let counters =
            |v: &str| json!({"sharedCounters": [{"name": "gpu-0-mig", "counters": {"compute": {"value": v}}}]});
        assert!(same_part(&counters("7"), &counters("7")));
        assert!(!same_part(&counters("7"), &counters("6")));
        assert!(!same_part(&counters("7"), &ours), "counters are not devices");
        let consumes = |v: &str| {
            devices(json!([{"name": "gpu-0-mig-1g-10gb-0", "consumesCounters": [{"counterSet": "gpu-0-mig",
                "counters": {"compute": {"value": v}}}]}]))
        };
        assert!(same_part(&consumes("1"), &consumes("1")) && !same_part(&consumes("1"), &consumes("2")));
    }
}

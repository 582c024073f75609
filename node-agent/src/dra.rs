//! Dynamic Resource Allocation (`resource.k8s.io/v1`, GA since Kubernetes 1.34, or the `v1beta2`
//! and `v1beta1` of 1.33 and 1.32: see [`ApiVersion`]): the agent as a DRA driver (`dra = "on"`,
//! named `dra_driver`).
//!
//! - **Devices**: one pool per node (named after the node), in ResourceSlices `<node>-<driver>`,
//!   `<node>-<driver>-1`, ... of at most 128 devices each (the API's limit), owned by the Node
//!   object. Each healthy GPU not in MIG mode has attributes `uuid`, `productName`, `index`, `mig`
//!   (false) and capacities `memory` and `cores`. With `dra_sharing = "replicas"` it is
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

/// Which version of `resource.k8s.io` the API server serves that the driver knows, newest first.
async fn discover(client: &kube::Client) -> Result<ApiVersion, String> {
    let groups = client.list_api_groups().await.map_err(|e| format!("listing the API server's API groups: {e}"))?;
    let served: Vec<String> = groups
        .groups
        .iter()
        .filter(|g| g.name == "resource.k8s.io")
        .flat_map(|g| g.versions.iter().map(|v| v.version.clone()))
        .collect();
    ApiVersion::newest(served.iter().map(String::as_str)).ok_or_else(|| {
        format!(
            "the API server serves {} of resource.k8s.io; the driver needs v1 (Kubernetes 1.34), v1beta2 (1.33) or \
             v1beta1 (1.32), with DRA enabled",
            if served.is_empty() { "no version".to_string() } else { served.join(", ") }
        )
    })
}

/// The name of replica `n` of the GPU at NVML index `index`.
pub fn device_name(index: u32, n: u32) -> String {
    format!("gpu-{index}-{n}")
}

/// The name of the shared device of the GPU at NVML index `index` (`dra_sharing = "capacity"`).
pub fn shared_device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The device name of a MIG device: its UUID as a DNS label (`mig-<uuid without "MIG-">`), so a
/// claim allocated an instance that has since been destroyed and made again is not given the new one.
pub fn mig_device_name(uuid: &str) -> String {
    let id = uuid.strip_prefix("MIG-").unwrap_or(uuid).to_ascii_lowercase();
    let mut n: String = format!("mig-{id}").chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    n.truncate(63);
    n.trim_end_matches('-').to_string()
}

/// A MIG profile's name as part of a device name (`1g.10gb+me` -> `1g-10gb-me`).
fn profile_label(profile: &str) -> String {
    profile.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

/// The name of the partitionable device that makes an instance of MIG profile `profile` at memory
/// slice `start` of the GPU at NVML index `index` (`dra_mig = "dynamic"`).
pub fn partition_device_name(index: u32, profile: &str, start: u32) -> String {
    format!("gpu-{index}-mig-{}-{start}", profile_label(profile))
}

/// The counter set of the GPU at NVML index `index` that its partitionable devices consume.
pub fn counter_set_name(index: u32) -> String {
    format!("gpu-{index}-mig")
}

/// One of this driver's device names.
#[derive(Debug, PartialEq)]
enum Dev {
    /// Replica `n` of GPU `index`.
    Replica(u32, u32),
    /// The shared device of GPU `index`.
    Shared(u32),
    /// A MIG device, by its device name.
    Mig(String),
    /// A MIG instance to make on GPU `index`: its profile's label and its start (memory slice).
    Partition(u32, String, u32),
}

fn parse_device(name: &str) -> Option<Dev> {
    if name.starts_with("mig-") {
        return Some(Dev::Mig(name.to_string()));
    }
    let rest = name.strip_prefix("gpu-")?;
    // Digits only: `u32::from_str` would take a sign.
    let num = |s: &str| if s.bytes().all(|b| b.is_ascii_digit()) { s.parse().ok() } else { None };
    if let Some((i, p)) = rest.split_once("-mig-") {
        let (label, start) = p.rsplit_once('-')?;
        if label.is_empty() {
            return None;
        }
        return Some(Dev::Partition(num(i)?, label.to_string(), num(start)?));
    }
    Some(match rest.split_once('-') {
        Some((i, n)) => Dev::Replica(num(i)?, num(n)?),
        None => Dev::Shared(num(rest)?),
    })
}

/// The slice a claim's containers share.
pub fn slice_name(claim_uid: &str) -> String {
    format!("dra-{}", claim_uid.to_ascii_lowercase())
}

/// The node's ResourceSlice object name (a DNS subdomain: the node name and the driver's).
pub fn resource_slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

const MIB: u64 = 1 << 20;

/// What a GPU's shared device offers of its memory: all of it (scaled), in whole MiB.
fn shared_memory(agent: &Agent, g: &crate::discovery::Gpu) -> u64 {
    agent.scaled(g.memory_total) / MIB * MIB
}

/// What the node's pool offers now, as ResourceSlice entries.
#[derive(Debug, Default)]
pub struct Pool {
    pub devices: Vec<Value>,
    /// Counter sets (`sharedCounters`) the devices consume from.
    pub counters: Vec<Value>,
}

/// A GPU in MIG mode with `dra_mig = "dynamic"`: a counter set of its memory slices (one counter
/// each), its compute slices and its media extensions (one), and a device per placement of every
/// profile that consumes what an instance there takes. Placements that instances not made for a
/// claim overlap (made with `vgpuctl mig` or by hand) are left out; the scheduler keeps the books of
/// the ones it gave to claims.
fn partitions(agent: &Agent, g: &crate::discovery::Gpu, mig: &crate::discovery::Mig, pool: &mut Pool) {
    let Some(profiles) = agent.profiles(&g.uuid, g.index) else { return };
    let ours: Vec<u32> = whole_claims(agent, Whole::Mig)
        .into_iter()
        .flat_map(|(_, c)| c.made)
        .filter(|m| m.gpu == g.index)
        .map(|m| m.gi)
        .collect();
    let taken: Vec<(u32, u32)> =
        mig.gpu_instances.iter().filter(|i| !ours.contains(&i.id)).map(|i| (i.start, i.start + i.size)).collect();
    let slices = profiles.iter().flat_map(|p| p.starts.iter().map(|s| s + p.memory_slices)).max().unwrap_or(0);
    let compute = profiles.iter().map(|p| p.compute).max().unwrap_or(0);
    let one = json!({"value": "1"});
    let mut all = serde_json::Map::new();
    for k in 0..slices {
        all.insert(format!("memory-slice-{k}"), one.clone());
    }
    all.insert("compute".into(), json!({"value": compute.to_string()}));
    all.insert("media".into(), one.clone());
    pool.counters.push(json!({"name": counter_set_name(g.index), "counters": all}));
    for p in &profiles {
        for &start in &p.starts {
            let end = start + p.memory_slices;
            if taken.iter().any(|&(a, b)| start < b && a < end) {
                continue;
            }
            let mut c = serde_json::Map::new();
            for k in start..end {
                c.insert(format!("memory-slice-{k}"), one.clone());
            }
            c.insert("compute".into(), json!({"value": p.compute.to_string()}));
            if p.media_extended() {
                c.insert("media".into(), one.clone());
            }
            pool.devices.push(json!({
                "name": partition_device_name(g.index, &p.name, start),
                "attributes": {
                    "parentUUID": {"string": g.uuid},
                    "productName": {"string": g.name},
                    "index": {"int": g.index},
                    "mig": {"bool": true},
                    "profile": {"string": p.name},
                    "placement": {"int": start},
                },
                "capacity": {"memory": {"value": (p.memory_mib * MIB).to_string()}},
                "consumesCounters": [{"counterSet": counter_set_name(g.index), "counters": c}],
            }));
        }
    }
}

/// The devices the node offers now, as ResourceSlice device entries (in `v1`'s shape), and the
/// counter sets they consume: those of every healthy GPU, as API version `v` can carry them.
pub fn pool(agent: &Agent, v: ApiVersion) -> Pool {
    let st = agent.status();
    let inv = agent.inventory.read();
    let mut pool = Pool::default();
    for g in &inv.gpus {
        let gst = st.gpus.iter().find(|x| x.uuid == g.uuid);
        if gst.is_some_and(|x| !x.healthy) {
            continue;
        }
        let mut p = Pool::default();
        gpu_devices(agent, g, v, &mut p);
        let bad = unhealthy_instances(gst);
        pool.devices.extend(p.devices.into_iter().filter(|d| !on_unhealthy_instance(d, &bad)));
        pool.counters.extend(p.counters);
    }
    pool
}

/// The health of every device of this driver on the node, by name: each GPU's devices as it would
/// offer them (a failed GPU's too, which the pool leaves out but claims may hold), with the GPU's
/// health, and a MIG device's also with its GPU instance's.
pub fn device_health(agent: &Agent, v: ApiVersion) -> Vec<(String, bool)> {
    let st = agent.status();
    let inv = agent.inventory.read();
    let mut all = Vec::new();
    for g in &inv.gpus {
        let gst = st.gpus.iter().find(|x| x.uuid == g.uuid);
        let healthy = gst.is_none_or(|x| x.healthy);
        let bad = unhealthy_instances(gst);
        let mut p = Pool::default();
        gpu_devices(agent, g, v, &mut p);
        all.extend(
            p.devices
                .iter()
                .filter_map(|d| Some((d["name"].as_str()?.to_string(), healthy && !on_unhealthy_instance(d, &bad)))),
        );
    }
    all
}

/// The GPU instances of a GPU that a critical XID about them made unhealthy.
fn unhealthy_instances(st: Option<&pb::GpuStatus>) -> Vec<pb::MigInstance> {
    st.and_then(|s| s.mig.as_ref())
        .map(|m| m.instances.iter().filter(|i| i.unhealthy).cloned().collect())
        .unwrap_or_default()
}

/// Whether device `d` (a ResourceSlice entry) is on one of the unhealthy instances `bad`: the MIG
/// device of one, or a partition whose memory slices overlap one's.
fn on_unhealthy_instance(d: &Value, bad: &[pb::MigInstance]) -> bool {
    let uuid = d["attributes"]["uuid"]["string"].as_str();
    let slices: Vec<u32> = d["consumesCounters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["counters"].as_object())
        .flat_map(|c| c.keys().filter_map(|k| k.strip_prefix("memory-slice-")?.parse().ok()))
        .collect();
    bad.iter().any(|i| {
        (!i.uuid.is_empty() && uuid == Some(i.uuid.as_str()))
            || slices.iter().any(|&k| (i.start..i.start + i.size).contains(&k))
    })
}

/// Whether MIG partitions are offered (`dra_mig = "dynamic"`, and an API version that carries them).
fn partitioned(agent: &Agent, v: ApiVersion) -> bool {
    agent.cfg.dra_mig == crate::config::DraMig::Dynamic && v.partitions()
}

/// The devices one GPU offers (and its counter set, for MIG partitions).
fn gpu_devices(agent: &Agent, g: &crate::discovery::Gpu, v: ApiVersion, pool: &mut Pool) {
    let split = agent.cfg.split_count.max(1);
    if let Some(mig) = g.mig.as_ref().filter(|m| m.enabled) {
        if partitioned(agent, v) {
            partitions(agent, g, mig, pool);
            return;
        }
        // The GPU's MIG devices as they are (the layout is `vgpuctl mig`'s), each whole.
        for m in &mig.devices {
            let profile = mig_profile(&m.name);
            pool.devices.push(json!({
                "name": mig_device_name(&m.uuid),
                "attributes": {
                    "uuid": {"string": m.uuid},
                    "parentUUID": {"string": g.uuid},
                    "productName": {"string": g.name},
                    "index": {"int": g.index},
                    "mig": {"bool": true},
                    "profile": {"string": profile},
                },
                "capacity": {"memory": {"value": m.memory_total.to_string()}},
            }));
        }
        return;
    }
    let attributes = json!({
        "uuid": {"string": g.uuid},
        "productName": {"string": g.name},
        "index": {"int": g.index},
        "mig": {"bool": false},
    });
    if agent.cfg.dra_sharing == crate::config::DraSharing::Capacity {
        // Memory: a claim that does not say takes all of it (as a whole device would be); the
        // scheduler rounds a request up to whole MiB. Cores: a claim that does not say takes
        // none, and runs without an SM limit (HAMi's default); one that does is limited to it.
        let memory = shared_memory(agent, g).to_string();
        pool.devices.push(json!({
            "name": shared_device_name(g.index),
            "allowMultipleAllocations": true,
            "attributes": attributes,
            "capacity": {
                "memory": {
                    "value": memory,
                    "requestPolicy": {"default": memory, "validRange": {"min": MIB.to_string(), "step": MIB.to_string()}},
                },
                "cores": {
                    "value": "100",
                    "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}},
                },
            },
        }));
        return;
    }
    // Whole MiB, as a slice's limit is: the capacity a claim is allocated is what its tenant gets.
    let memory = agent.scaled(g.memory_total) / split as u64 / MIB * MIB;
    for n in 0..split {
        pool.devices.push(json!({
            "name": device_name(g.index, n),
            "attributes": attributes.clone(),
            "capacity": {
                "memory": {"value": memory.to_string()},
                "cores": {"value": (100 / split).to_string()},
            },
        }));
    }
}

/// The value of a Kubernetes quantity without a fraction (`8589934592`, `8Gi`, `858993k`, `1e3`), which
/// is how capacities come back from the API server: it rewrites them in its canonical form.
pub fn quantity(q: &str) -> Option<u128> {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (digits, suffix) = q.split_at(split);
    let n: u128 = digits.parse().ok()?;
    let scale: u128 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        e => 10u128.checked_pow(e.strip_prefix(['e', 'E'])?.parse().ok()?)?,
    };
    n.checked_mul(scale)
}

/// Whether two ResourceSlice specs (or parts of one) offer the same: their `devices` and their
/// `sharedCounters` (absent and empty alike), the quantities of capacities (values and request
/// policies) and of counters compared by value.
pub fn same_part(a: &Value, b: &Value) -> bool {
    fn quantities(v: &mut Value) {
        match v {
            Value::String(q) => {
                if let Some(n) = quantity(q) {
                    *q = n.to_string();
                }
            }
            Value::Array(a) => a.iter_mut().for_each(quantities),
            Value::Object(m) => m.values_mut().for_each(quantities),
            _ => {}
        }
    }
    fn norm(v: &Value, key: &str) -> Value {
        let mut v = match &v[key] {
            Value::Array(a) if !a.is_empty() => Value::Array(a.clone()),
            _ => return Value::Null,
        };
        for d in v.as_array_mut().into_iter().flatten() {
            match key {
                "devices" => {
                    for k in ["capacity", "consumesCounters"] {
                        if let Some(c) = d.get_mut(k) {
                            quantities(c);
                        }
                    }
                }
                _ => quantities(d),
            }
        }
        v
    }
    ["devices", "sharedCounters"].iter().all(|k| norm(a, k) == norm(b, k))
}

/// What a claim's preparation answers, before it is put in one API version's messages.
#[derive(Debug, PartialEq)]
pub struct Prepared {
    pub request: String,
    pub pool: String,
    pub device: String,
    pub cdi: Vec<String>,
}

/// What a claim was allocated of one GPU.
#[derive(Default)]
struct Want {
    /// Replica devices.
    replicas: u64,
    /// Allocations of its shared device: the memory (None: all) and cores each consumed.
    shares: Vec<(Option<u64>, u32)>,
}

/// How a claim is given devices whole, with no slice: a record under the state directory says which
/// claim has which (and what to remove when the claim goes), and a CDI spec sets
/// `NVIDIA_VISIBLE_DEVICES` to them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Whole {
    /// MIG devices (MIG isolates them): one claim at a time holds each.
    Mig,
    /// Any devices, allocated with admin access (`adminAccess`: monitoring and diagnostics beside
    /// the claims that hold them): seen whole, unlimited, held by no one.
    Admin,
}

impl Whole {
    /// Its name in the record directory (`<state_dir>/dra-<name>/`) and CDI spec files
    /// (`vgpu-<name>-dra-<UID>.json`).
    fn name(self) -> &'static str {
        match self {
            Whole::Mig => "mig",
            Whole::Admin => "admin",
        }
    }

    /// The directory of its records, under the state directory.
    fn dir(self) -> String {
        format!("dra-{}", self.name())
    }

    fn cdi_kind(self) -> &'static str {
        match self {
            Whole::Mig => crate::cdi::MIG_KIND,
            Whole::Admin => crate::cdi::ADMIN_KIND,
        }
    }
}

/// Where a container given devices with admin access finds its claim's record (bind-mounted
/// read-only): the monitoring pass knows such a process by it, and does not take it for an escape.
pub const ADMIN_MOUNT_DIR: &str = "/run/vgpu-admin";

/// Where the record at `record` (of a claim with admin access) is mounted in its containers.
pub(crate) fn admin_mount(record: &Path) -> PathBuf {
    Path::new(ADMIN_MOUNT_DIR).join(record.file_name().unwrap_or_default())
}

/// A claim given devices whole (see [`Whole`]).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct WholeClaim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// Device UUIDs (of GPUs or MIG devices).
    pub devices: Vec<String>,
    /// MIG instances made for the claim (`dra_mig = "dynamic"`), destroyed when it is unprepared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub made: Vec<Made>,
}

/// A MIG instance made for a claim.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Made {
    /// The GPU's NVML index.
    pub gpu: u32,
    /// The GPU instance id.
    pub gi: u32,
    /// The MIG device's UUID.
    pub uuid: String,
}

/// A MIG device's profile, from its name (`NVIDIA A100-SXM4-40GB MIG 3g.20gb` -> `3g.20gb`).
pub fn mig_profile(name: &str) -> &str {
    name.rsplit_once(" MIG ").map_or(name, |(_, p)| p)
}

/// The claims of kind `w` this node has prepared, with their records' paths.
pub(crate) fn whole_claims(agent: &Agent, w: Whole) -> Vec<(PathBuf, WholeClaim)> {
    std::fs::read_dir(agent.cfg.state_dir.join(w.dir()))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| Some((p.clone(), serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?)))
        .collect()
}

/// The claims whose MIG devices this node has prepared (their records under `<state_dir>/dra-mig/`).
pub(crate) fn mig_claims(agent: &Agent) -> Vec<WholeClaim> {
    whole_claims(agent, Whole::Mig).into_iter().map(|(_, c)| c).collect()
}

/// Tells the agent who holds the MIG devices this node's claims were given whole (from their
/// records). Called at start and after every change.
pub fn refresh_mig_holders(agent: &Agent) {
    let mut held = BTreeMap::new();
    for c in mig_claims(agent) {
        for d in c.devices {
            held.insert(d, format!("claim {}/{}", c.namespace, c.name));
        }
    }
    agent.set_mig_holders("dra", held);
}

/// Reads again the records of claims with admin access (`<state_dir>/dra-admin/`) into what the
/// monitoring pass admits: each record's identity, where its containers see it, and the GPUs it
/// covers (a MIG device's parent with it). Called at start and after every change.
pub fn refresh_admitted(agent: &Agent) {
    let inv = agent.inventory.read();
    let v = whole_claims(agent, Whole::Admin)
        .into_iter()
        .filter_map(|(path, c)| {
            let file = crate::procfs::file_id(&path)?;
            let mut gpus = c.devices.clone();
            for g in &inv.gpus {
                let mig = g.mig.iter().flat_map(|m| &m.devices);
                if mig.into_iter().any(|m| c.devices.contains(&m.uuid)) {
                    gpus.push(g.uuid.clone());
                }
            }
            Some(crate::monitor::Admitted {
                claim: format!("{}/{}", c.namespace, c.name),
                path: admin_mount(&path),
                file,
                gpus,
            })
        })
        .collect();
    *agent.admitted.write() = std::sync::Arc::new(v);
}

/// The CDI device that gives a claim its devices whole.
pub fn whole_cdi_name(w: Whole, claim_uid: &str) -> String {
    format!("{}={}", w.cdi_kind(), slice_name(claim_uid))
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
    async fn version(&self) -> Result<ApiVersion, String> {
        let v = self
            .version
            .get_or_try_init(|| async {
                let v = discover(&self.client).await?;
                tracing::info!(version = %format!("resource.k8s.io/{}", v.name()), "DRA: the API version spoken");
                if self.agent.cfg.dra_mig == crate::config::DraMig::Dynamic && !v.partitions() {
                    tracing::warn!("{}", NO_PARTITIONS);
                }
                Ok::<_, String>(v)
            })
            .await?;
        Ok(*v)
    }

    /// The claims of a namespace, in the version spoken.
    async fn claims(&self, namespace: &str) -> Result<Api<DynamicObject>, String> {
        let v = self.version().await?;
        Ok(Api::namespaced_with(self.client.clone(), namespace, &v.resource("ResourceClaim", "resourceclaims")))
    }

    /// The slice's per-GPU limits for the devices a claim was allocated (by NVML index): k/split of
    /// a GPU for k of its replicas, plus what the claim consumed of its shared device.
    fn limits(&self, wants: &BTreeMap<u32, Want>) -> Result<Vec<vgpu_proto::v1::SliceGpuLimit>, String> {
        let inv = self.agent.inventory.read();
        wants
            .iter()
            .map(|(index, w)| {
                let g = inv
                    .gpus
                    .iter()
                    .find(|g| g.index == *index)
                    .ok_or_else(|| format!("no GPU {index} on this node"))?;
                let (mut memory, mut sm, mut unlimited) = (0u64, 0u32, false);
                if w.replicas > 0 {
                    let s = crate::deviceplugin::share(&self.agent, g, w.replicas);
                    memory += s.memory;
                    if s.sm == 0 {
                        unlimited = true;
                    }
                    sm += s.sm;
                }
                for (m, cores) in &w.shares {
                    let whole = shared_memory(&self.agent, g);
                    let m = m.unwrap_or(whole);
                    // (A limit of 0 would be none: the request policy's minimum is 1 MiB.)
                    if m == 0 || m > whole {
                        return Err(format!(
                            "the claim consumes {m} bytes of GPU {index}'s memory, which offers {whole}"
                        ));
                    }
                    memory += m;
                    // 0 cores: the claim asked for no share of the GPU's time, and runs unlimited.
                    if *cores == 0 {
                        unlimited = true;
                    }
                    sm = sm.saturating_add(*cores);
                }
                let sm = if unlimited || sm >= 100 { 0 } else { sm };
                Ok(vgpu_proto::v1::SliceGpuLimit { gpu: g.uuid.clone(), memory, sm })
            })
            .collect()
    }

    /// Prepares one claim: its slice, and what kubelet is told.
    pub async fn prepare(&self, namespace: &str, name: &str, uid: &str) -> Result<Vec<Prepared>, String> {
        let api = self.claims(namespace).await?;
        let claim = crate::k8s::retried(|| api.get(name))
            .await
            .map_err(|e| format!("reading claim {namespace}/{name}: {e}"))?;
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Err(format!(
                "claim {namespace}/{name} is {}, not {uid} (it was made again)",
                claim.metadata.uid.as_deref().unwrap_or("?")
            ));
        }
        let results = claim.data["status"]["allocation"]["devices"]["results"]
            .as_array()
            .ok_or_else(|| format!("claim {namespace}/{name} is not allocated"))?;
        let ours: Vec<(&str, &str, &Value)> = results
            .iter()
            .filter(|r| r["driver"] == self.driver.as_str() && r["pool"] == self.node.as_str())
            .filter_map(|r| Some((r["request"].as_str()?, r["device"].as_str()?, r)))
            .collect();
        if ours.is_empty() {
            return Ok(Vec::new());
        }
        let admin = ours.iter().filter(|(_, _, r)| r["adminAccess"] == true).count();
        if admin > 0 && admin < ours.len() {
            return Err(format!(
                "claim {namespace}/{name} has requests with admin access and without, which cannot be given to one \
                 container together (NVIDIA_VISIBLE_DEVICES): put them in separate claims"
            ));
        }
        let mut wants: BTreeMap<u32, Want> = BTreeMap::new();
        let mut whole: Vec<String> = Vec::new();
        let mut parts: Vec<(String, u32, String, u32)> = Vec::new();
        for (_, device, result) in &ours {
            let dev = parse_device(device).ok_or_else(|| format!("{device} is not a device of this driver"))?;
            if let Dev::Replica(_, n) = dev {
                if n >= self.agent.cfg.split_count {
                    return Err(format!("{device} is not a device of this node"));
                }
            }
            match dev {
                // Admin access: the devices' GPUs (or MIG devices) whole, beside their claims.
                _ if admin > 0 => whole.push(self.uuid_of(device, &dev)?),
                Dev::Mig(_) => whole.push(self.uuid_of(device, &dev)?),
                Dev::Partition(index, label, start) => parts.push((device.to_string(), index, label, start)),
                Dev::Replica(index, _) => wants.entry(index).or_default().replicas += 1,
                Dev::Shared(index) => {
                    let consumed = &result["consumedCapacity"];
                    let read = |k: &str| -> Result<Option<u64>, String> {
                        match &consumed[k] {
                            Value::Null => Ok(None),
                            q => q
                                .as_str()
                                .and_then(quantity)
                                .and_then(|n| u64::try_from(n).ok())
                                .map(Some)
                                .ok_or_else(|| format!("{device}: consumed {k} {q} is not a whole quantity")),
                        }
                    };
                    // Nothing recorded (a scheduler without consumable capacity allocated the device
                    // to this claim alone): all of the memory, and no SM limit.
                    let cores = read("cores")?.unwrap_or(0);
                    let cores = u32::try_from(cores).map_err(|_| format!("{device}: consumed cores {cores}"))?;
                    wants.entry(index).or_default().shares.push((read("memory")?, cores));
                }
            }
        }
        let slice = slice_name(uid);
        if !crate::slices::valid_name(&slice) {
            return Err(format!("claim UID {uid:?} cannot name a slice"));
        }
        if let Some(e) = self.shared_container(namespace, name, &claim).await {
            return Err(e);
        }
        let cdi = if !whole.is_empty() || !parts.is_empty() {
            if !wants.is_empty() {
                return Err(format!(
                    "claim {namespace}/{name} has MIG devices and GPU shares, which cannot be given to one container \
                     together (NVIDIA_VISIBLE_DEVICES): put them in separate claims"
                ));
            }
            let w = if admin > 0 { Whole::Admin } else { Whole::Mig };
            let claim = WholeClaim {
                namespace: namespace.into(),
                name: name.into(),
                uid: uid.into(),
                devices: whole,
                made: Vec::new(),
            };
            if parts.is_empty() {
                self.prepare_whole(w, claim)?;
            } else {
                self.prepare_partitions(claim, &parts)?;
            }
            whole_cdi_name(w, uid)
        } else {
            // The pod it is reserved for, when one: what `vgpuctl status` and the metrics name.
            let pods: Vec<(&str, &str)> = claim.data["status"]["reservedFor"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["resource"] == "pods")
                .filter_map(|r| Some((r["name"].as_str()?, r["uid"].as_str().unwrap_or_default())))
                .collect();
            let pod = match pods[..] {
                [one] => Some(one),
                _ => None,
            };
            self.prepare_slice(namespace, name, uid, pod, &wants)?;
            crate::cdi::device_name(&slice)
        };
        let mut named = std::collections::HashSet::new();
        Ok(ours
            .into_iter()
            .map(|(request, device, _)| Prepared {
                request: request.to_string(),
                pool: self.node.clone(),
                device: device.to_string(),
                // Once per request: a container given the request's devices gets the slice once.
                cdi: if named.insert(request) { vec![cdi.clone()] } else { Vec::new() },
            })
            .collect())
    }

    /// The UUID of what a device gives whole: a GPU's (of its shares), or a MIG device's.
    fn uuid_of(&self, device: &str, dev: &Dev) -> Result<String, String> {
        let inv = self.agent.inventory.read();
        match dev {
            Dev::Mig(n) => inv
                .gpus
                .iter()
                .filter_map(|g| g.mig.as_ref())
                .flat_map(|m| &m.devices)
                .find(|m| mig_device_name(&m.uuid) == *n)
                .map(|m| m.uuid.clone())
                .ok_or_else(|| format!("{device}: no such MIG device on this node (the GPU's layout changed)")),
            // Admin access to a partition: the instance a claim had made there.
            Dev::Partition(index, label, start) => inv
                .gpus
                .iter()
                .filter(|g| g.index == *index)
                .filter_map(|g| g.mig.as_ref())
                .flat_map(|m| {
                    let at: Vec<u32> = m.gpu_instances.iter().filter(|i| i.start == *start).map(|i| i.id).collect();
                    m.devices.iter().filter(move |d| d.gpu_instance_id.is_some_and(|gi| at.contains(&gi)))
                })
                .find(|d| profile_label(mig_profile(&d.name)) == *label)
                .map(|d| d.uuid.clone())
                .ok_or_else(|| {
                    format!("{device}: no MIG instance there (one is made when a claim is prepared for it)")
                }),
            Dev::Replica(index, _) | Dev::Shared(index) => inv
                .gpus
                .iter()
                .find(|g| g.index == *index)
                .map(|g| g.uuid.clone())
                .ok_or_else(|| format!("{device}: no GPU {index} on this node")),
        }
    }

    /// Why the claim cannot be prepared because a container of a pod it is reserved for also uses
    /// another claim with devices of this driver on this node: each claim's CDI device sets the same
    /// environment (`NVIDIA_VISIBLE_DEVICES`, the slice's limits) and mounts, so the container would
    /// get only one claim's. None when no container does, or when that cannot be read now.
    async fn shared_container(&self, namespace: &str, name: &str, claim: &DynamicObject) -> Option<String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let claims = self.claims(namespace).await.ok()?;
        for r in claim.data["status"]["reservedFor"].as_array().into_iter().flatten() {
            let Some(pod) = r["name"].as_str().filter(|_| r["resource"] == "pods") else { continue };
            let pod = match pods.get_opt(pod).await {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(pod = %format!("{namespace}/{pod}"), error = %e, "cannot read a claim's pod");
                    continue;
                }
            };
            let pod_name = pod.metadata.name.clone().unwrap_or_default();
            let spec = pod.spec.unwrap_or_default();
            // The pod's claim entries by name -> the ResourceClaim each stands for.
            let generated = pod.status.and_then(|s| s.resource_claim_statuses).unwrap_or_default();
            let object = |entry: &str| -> Option<String> {
                let c = spec.resource_claims.iter().flatten().find(|c| c.name == entry)?;
                c.resource_claim_name
                    .clone()
                    .or_else(|| generated.iter().find(|g| g.name == entry)?.resource_claim_name.clone())
            };
            let containers = spec.init_containers.iter().flatten().chain(&spec.containers);
            for c in containers {
                let used: Vec<String> = {
                    let mut v: Vec<String> = c
                        .resources
                        .iter()
                        .flat_map(|r| r.claims.iter().flatten())
                        .filter_map(|u| object(&u.name))
                        .collect();
                    v.sort();
                    v.dedup();
                    v
                };
                if !used.iter().any(|u| u == name) {
                    continue;
                }
                for other in used.iter().filter(|u| *u != name) {
                    let Ok(Some(o)) = claims.get_opt(other).await else { continue };
                    let ours = o.data["status"]["allocation"]["devices"]["results"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|r| r["driver"] == self.driver.as_str() && r["pool"] == self.node.as_str());
                    if ours {
                        return Some(format!(
                            "container {} of pod {namespace}/{pod_name} uses claims {name} and {other}, both with \
                             devices of {} on this node: a container can be given one such claim (put the \
                             requests in one claim)",
                            c.name, self.driver
                        ));
                    }
                }
            }
        }
        None
    }

    /// The claim's slice, made if it is not there; labelled with its pod (name, UID) when one pod
    /// holds the claim.
    fn prepare_slice(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        pod: Option<(&str, &str)>,
        wants: &BTreeMap<u32, Want>,
    ) -> Result<(), String> {
        let slice = slice_name(uid);
        if self.agent.get_slice(&slice).is_err() {
            let mut labels: std::collections::HashMap<String, String> = [
                ("source".to_string(), "dra".to_string()),
                ("namespace".to_string(), namespace.to_string()),
                ("claim".to_string(), name.to_string()),
                ("claim-uid".to_string(), uid.to_string()),
            ]
            .into();
            if let Some((pod, pod_uid)) = pod {
                labels.insert("pod".to_string(), pod.to_string());
                labels.insert("pod-uid".to_string(), pod_uid.to_string());
            }
            let gpus = self.limits(wants)?;
            let req = vgpu_proto::v1::CreateSliceRequest { name: slice.clone(), gpus, labels };
            match self.agent.create_slice(req) {
                Ok(_) | Err(ApiError::Exists(_)) => {}
                Err(e) => return Err(format!("making slice {slice}: {}", Status::from(e).message())),
            }
        }
        Ok(())
    }

    /// Prepares a claim of MIG partitions (with any MIG devices it has too): makes an instance for
    /// each (or, prepared before, keeps the ones made then) and records them with the claim, all
    /// under the agent's MIG lock, so that no layout change sees them before they are held.
    fn prepare_partitions(&self, mut claim: WholeClaim, parts: &[(String, u32, String, u32)]) -> Result<(), String> {
        let r = {
            let _mig = self.agent.mig.lock();
            let before = whole_claims(&self.agent, Whole::Mig)
                .into_iter()
                .map(|(_, c)| c)
                .find(|c| c.uid == claim.uid && !c.made.is_empty());
            let (made, fresh) = match before {
                // Prepared before (kubelet asks again): the same instances.
                Some(c) if c.made.len() == parts.len() => (c.made, false),
                // An agent stopped while it made them: those it made go, and all are made again.
                Some(c) => {
                    tracing::warn!(claim = %format!("{}/{}", c.namespace, c.name), made = c.made.len(), of = parts.len(),
                        "a claim's MIG instances were made in part (the agent stopped); making them again");
                    self.destroy_made(&c)?;
                    (self.make(&claim, parts)?, true)
                }
                None => (self.make(&claim, parts)?, true),
            };
            let uid = claim.uid.clone();
            claim.devices.extend(made.iter().map(|m| m.uuid.clone()));
            claim.made = made.clone();
            let r = self.prepare_whole(Whole::Mig, claim);
            if r.is_err() && fresh {
                if let Some(nvml) = self.agent.nvml.get() {
                    unmake(&vgpu_mig::backend::NvmlBackend::new(nvml.clone()), &made);
                }
                let _ = std::fs::remove_file(self.whole_paths(Whole::Mig, &uid).0);
            }
            r
        };
        self.agent.rediscover();
        r
    }

    /// Makes the instances of `parts` (device name, GPU index, profile label, start) for `claim`, or
    /// none. Each is recorded with the claim as soon as it is made, so that an agent killed
    /// meanwhile leaves nothing it does not know of: unpreparing the claim destroys what the record
    /// names, and preparing it again makes what is missing.
    fn make(&self, claim: &WholeClaim, parts: &[(String, u32, String, u32)]) -> Result<Vec<Made>, String> {
        let nvml = self.agent.nvml.get().cloned().ok_or("NVML is not open yet")?;
        let b = vgpu_mig::backend::NvmlBackend::new(nvml);
        let (record, _) = self.whole_paths(Whole::Mig, &claim.uid);
        let mut made = Vec::new();
        for (device, index, label, start) in parts {
            let r = make_one(&b, device, *index, label, *start).and_then(|m| {
                made.push(m);
                let mut c = claim.clone();
                c.devices.extend(made.iter().map(|m| m.uuid.clone()));
                c.made = made.clone();
                crate::cdi::write_spec(&record, &serde_json::to_value(&c).expect("serialisable"))
                    .map_err(|e| format!("writing {}: {e}", record.display()))
            });
            if let Err(e) = r {
                unmake(&b, &made);
                let _ = std::fs::remove_file(&record);
                return Err(e);
            }
        }
        Ok(made)
    }

    /// Destroys the instances made for a claim, unless processes run on one (then nothing more is
    /// destroyed, and kubelet asks again). One gone already, or replaced since, is done.
    fn destroy_made(&self, c: &WholeClaim) -> Result<bool, String> {
        let nvml = self.agent.nvml.get().cloned().ok_or("NVML is not open yet")?;
        let held: Vec<String> = self.agent.mig_holders().into_keys().filter(|u| !c.devices.contains(u)).collect();
        let b = vgpu_mig::backend::NvmlBackend::with_held(nvml, held);
        let mut any = false;
        for m in &c.made {
            let g = vgpu_mig::backend::MigBackend::gpu(&b, m.gpu).map_err(|e| e.0)?;
            if !g.instances.iter().any(|i| i.gi == m.gi && i.uuid.as_deref() == Some(m.uuid.as_str())) {
                continue;
            }
            vgpu_mig::apply::release(&b, m.gpu, m.gi).map_err(|e| format!("MIG device {}: {e}", m.uuid))?;
            tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), gpu = m.gpu, gi = m.gi, uuid = %m.uuid, "MIG instance of a DRA claim destroyed");
            any = true;
        }
        Ok(any)
    }

    /// Where a claim given devices whole is recorded, and its CDI spec.
    fn whole_paths(&self, w: Whole, uid: &str) -> (PathBuf, PathBuf) {
        let file = format!("{}.json", slice_name(uid));
        let cdi = self.agent.cfg.cdi_dir.clone().unwrap_or_default();
        (self.agent.cfg.state_dir.join(w.dir()).join(&file), cdi.join(format!("vgpu-{}-{file}", w.name())))
    }

    /// Tells the agent its records of `w` changed (MIG holders, or the claims with admin access).
    fn records_changed(&self, w: Whole) {
        match w {
            Whole::Mig => refresh_mig_holders(&self.agent),
            Whole::Admin => refresh_admitted(&self.agent),
        }
    }

    /// Records a claim given devices whole (MIG devices: refused if another claim has one of them)
    /// and writes the CDI spec that gives them to its containers (with admin access, with the
    /// record mounted, by which the agent knows the containers' processes).
    fn prepare_whole(&self, w: Whole, mut claim: WholeClaim) -> Result<(), String> {
        claim.devices.sort();
        claim.devices.dedup();
        let _one = self.whole_lock.lock();
        if w == Whole::Mig {
            for other in mig_claims(&self.agent).iter().filter(|c| c.uid != claim.uid) {
                if let Some(d) = claim.devices.iter().find(|d| other.devices.contains(d)) {
                    return Err(format!(
                        "MIG device {d} is prepared for claim {}/{} ({})",
                        other.namespace, other.name, other.uid
                    ));
                }
            }
        }
        let (record, spec) = self.whole_paths(w, &claim.uid);
        let name = slice_name(&claim.uid);
        let mut inj = crate::slices::Injection {
            env: vec![("NVIDIA_VISIBLE_DEVICES".into(), claim.devices.join(","))],
            mounts: Vec::new(),
        };
        if w == Whole::Admin {
            inj.mounts.push(crate::slices::Mount {
                host: record.clone(),
                container: admin_mount(&record).display().to_string(),
                read_only: true,
            });
        }
        // The record first: the spec mounts it.
        crate::cdi::write_spec(&record, &serde_json::to_value(&claim).expect("serialisable"))
            .map_err(|e| format!("writing {}: {e}", record.display()))?;
        crate::cdi::write_spec(&spec, &crate::cdi::spec_of(w.cdi_kind(), &name, &inj))
            .map_err(|e| format!("writing {}: {e}", spec.display()))?;
        self.records_changed(w);
        Ok(())
    }

    /// Undoes `prepare`: the claim's slice goes (if there is one), or the record and spec of the
    /// devices it was given whole.
    pub fn unprepare(&self, uid: &str) -> Result<(), String> {
        let slice = slice_name(uid);
        if !crate::slices::valid_name(&slice) {
            return Ok(());
        }
        let mut destroyed = false;
        {
            let _mig = self.agent.mig.lock();
            let _one = self.whole_lock.lock();
            for w in [Whole::Mig, Whole::Admin] {
                let (record, spec) = self.whole_paths(w, uid);
                let claim: Option<WholeClaim> =
                    std::fs::read(&record).ok().and_then(|b| serde_json::from_slice(&b).ok());
                if let Some(c) = claim.filter(|c| !c.made.is_empty()) {
                    destroyed = self.destroy_made(&c)?;
                }
                let _ = std::fs::remove_file(spec);
                if std::fs::remove_file(record).is_ok() {
                    self.records_changed(w);
                }
            }
        }
        if destroyed {
            self.agent.rediscover();
        }
        match self.agent.delete_slice(&slice, false) {
            Ok(()) | Err(ApiError::NotFound(_)) => Ok(()),
            Err(e) => Err(Status::from(e).message().to_string()),
        }
    }

    async fn prepare_all(
        &self,
        claims: Vec<(String, String, String)>,
    ) -> BTreeMap<String, Result<Vec<Prepared>, String>> {
        let mut out = BTreeMap::new();
        for (namespace, uid, name) in claims {
            let r = self.prepare(&namespace, &name, &uid).await;
            match &r {
                Ok(d) => {
                    tracing::info!(claim = %format!("{namespace}/{name}"), uid = %uid, devices = d.len(), "DRA claim prepared")
                }
                Err(e) => {
                    tracing::warn!(claim = %format!("{namespace}/{name}"), uid = %uid, error = %e, "DRA claim not prepared")
                }
            }
            out.insert(uid, r);
        }
        out
    }
}

// The two API versions have the same messages; each is answered from the neutral form.
macro_rules! dra_service {
    ($m:ident) => {
        #[tonic::async_trait]
        impl $m::dra_plugin_server::DraPlugin for Driver {
            async fn node_prepare_resources(
                &self,
                req: Request<$m::NodePrepareResourcesRequest>,
            ) -> Result<Response<$m::NodePrepareResourcesResponse>, Status> {
                let claims = req.into_inner().claims.into_iter().map(|c| (c.namespace, c.uid, c.name)).collect();
                let claims = self
                    .prepare_all(claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let resp = match r {
                            Ok(devices) => $m::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|p| $m::Device {
                                        request_names: vec![p.request],
                                        pool_name: p.pool,
                                        device_name: p.device,
                                        cdi_device_ids: p.cdi,
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(error) => $m::NodePrepareResourceResponse { devices: Vec::new(), error },
                        };
                        (uid, resp)
                    })
                    .collect();
                Ok(Response::new($m::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$m::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$m::NodeUnprepareResourcesResponse>, Status> {
                let claims = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| {
                        let error = self.unprepare(&c.uid).err().unwrap_or_default();
                        if !error.is_empty() {
                            tracing::warn!(uid = %c.uid, error = %error, "DRA claim not unprepared");
                        }
                        (c.uid, $m::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($m::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}
dra_service!(v1);
dra_service!(v1beta1);

/// How often the whole list goes to kubelet again when nothing changed: kubelet holds a report for
/// a while, then takes its devices' health as unknown.
const HEALTH_RESEND: Duration = Duration::from_secs(5);

type HealthStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<hp::NodeWatchResourcesResponse, Status>> + Send>>;

/// Device health for kubelet (KEP 4680: a pod's status shows the health of the devices its claims
/// hold): every device of the driver on the node with its GPU's health, at once, on every change
/// (checked every 500 ms) and every [`HEALTH_RESEND`].
#[tonic::async_trait]
impl hp::dra_resource_health_server::DraResourceHealth for Driver {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<hp::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let d = self.clone();
        tokio::spawn(async move {
            let mut last: Option<Vec<(String, bool)>> = None;
            let mut sent = tokio::time::Instant::now();
            loop {
                let a = d.agent.clone();
                // (Until the API version is known, the devices as `v1` would carry them.)
                let v = d.version.get().copied().unwrap_or(ApiVersion::V1);
                let Ok(now) = tokio::task::spawn_blocking(move || device_health(&a, v)).await else { break };
                if last.as_ref() != Some(&now) || sent.elapsed() >= HEALTH_RESEND {
                    let t = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |t| t.as_secs() as i64);
                    let devices = now
                        .iter()
                        .map(|(name, healthy)| hp::DeviceHealth {
                            device: Some(hp::DeviceIdentifier { pool_name: d.node.clone(), device_name: name.clone() }),
                            health: if *healthy { hp::HealthStatus::Healthy } else { hp::HealthStatus::Unhealthy }
                                as i32,
                            last_updated_time: t,
                        })
                        .collect();
                    if tx.send(Ok(hp::NodeWatchResourcesResponse { devices })).await.is_err() {
                        break;
                    }
                    last = Some(now);
                    sent = tokio::time::Instant::now();
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = tx.closed() => break,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// What the plugin tells kubelet's plugin watcher.
#[derive(Clone)]
struct Registrar {
    driver: String,
    endpoint: PathBuf,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registrar {
    async fn get_info(&self, _: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![
                "v1.DRAPlugin".into(),
                "v1beta1.DRAPlugin".into(),
                "v1alpha1.DRAResourceHealth".into(),
            ],
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with kubelet as a DRA driver");
        } else {
            tracing::error!(driver = %self.driver, error = %s.error, "kubelet refused the DRA driver");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Makes one MIG instance of profile `label` at memory slice `start` of GPU `index` (with one
/// compute instance spanning it), for device `device`.
fn make_one(
    b: &vgpu_mig::backend::NvmlBackend,
    device: &str,
    index: u32,
    label: &str,
    start: u32,
) -> Result<Made, String> {
    use vgpu_mig::backend::MigBackend;
    let g = b.gpu(index).map_err(|e| format!("{device}: {e}"))?;
    if !g.mig_enabled {
        return Err(format!("{device}: GPU {index} is not in MIG mode"));
    }
    let p =
        g.profiles.iter().find(|p| profile_label(&p.name) == label && p.starts.contains(&start)).ok_or_else(|| {
            format!("{device}: GPU {index} has no MIG profile {label} placed at memory slice {start}")
        })?;
    let gi = b
        .create(index, p.id, start)
        .map_err(|e| format!("{device}: making a {} instance at memory slice {start}: {e}", p.name))?;
    match b.gpu(index).ok().and_then(|g| g.instances.into_iter().find(|i| i.gi == gi)?.uuid) {
        Some(uuid) => {
            tracing::info!(gpu = index, gi, profile = %p.name, start, uuid = %uuid, "MIG instance made for a DRA claim");
            Ok(Made { gpu: index, gi, uuid })
        }
        None => {
            let _ = b.destroy(index, gi);
            Err(format!("{device}: the new {} instance has no MIG device UUID", p.name))
        }
    }
}

/// Destroys instances just made (a preparation that failed after making them).
fn unmake(b: &vgpu_mig::backend::NvmlBackend, made: &[Made]) {
    use vgpu_mig::backend::MigBackend;
    for m in made {
        if let Err(e) = b.destroy(m.gpu, m.gi) {
            tracing::warn!(gpu = m.gpu, gi = m.gi, error = %e, "cannot destroy a MIG instance made for a claim that failed");
        }
    }
}

/// Whether the claim is gone (or made again under its name); false when that cannot be known now.
async fn claim_gone(d: &Driver, ns: &str, name: &str, uid: &str) -> bool {
    let api = match d.claims(ns).await {
        Ok(api) => api,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read prepared DRA claims");
            return false;
        }
    };
    match api.get_opt(name).await {
        Ok(None) => true,
        Ok(Some(c)) => c.metadata.uid.as_deref() != Some(uid),
        Err(e) => {
            tracing::debug!(claim = %format!("{ns}/{name}"), error = %e, "cannot read a prepared DRA claim");
            false
        }
    }
}

/// Removes the slices, and the records of devices given whole, of claims that are gone; returns how many.
async fn collect(d: &Driver) -> usize {
    let mut removed = 0;
    for c in whole_claims(&d.agent, Whole::Mig).into_iter().chain(whole_claims(&d.agent, Whole::Admin)).map(|(_, c)| c)
    {
        if claim_gone(d, &c.namespace, &c.name, &c.uid).await && d.unprepare(&c.uid).is_ok() {
            tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), devices = ?c.devices, "DRA claim's devices released: the claim is gone");
            removed += 1;
        }
    }
    for s in d.agent.slices().iter() {
        if s.labels.get("source").map(String::as_str) != Some("dra") {
            continue;
        }
        let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        let (ns, name, uid) = (label("namespace"), label("claim"), label("claim-uid"));
        if !claim_gone(d, &ns, &name, &uid).await {
            continue;
        }
        let (a, n) = (d.agent.clone(), s.name.clone());
        match tokio::task::spawn_blocking(move || a.delete_slice(&n, false)).await {
            Ok(Ok(())) => {
                tracing::info!(slice = %s.name, claim = %format!("{ns}/{name}"), "DRA slice removed: its claim is gone");
                d.agent.stats.slices_collected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                removed += 1;
            }
            Ok(Err(e)) => tracing::debug!(slice = %s.name, error = ?e, "DRA slice of a gone claim kept for now"),
            Err(e) => tracing::warn!(slice = %s.name, error = %e, "DRA slice removal failed"),
        }
    }
    removed
}

/// Kubelet's plugin directories: `plugins_registry` and `plugins`, under its root directory.
///
/// The registration socket's name ends in `@localhost`. Kubelet's plugin watcher dials it with
/// grpc-go, which sends the socket's path, percent-encoded, as the HTTP/2 `:authority`; a
/// percent-encoded host is not a valid authority, and the HTTP/2 server under tonic resets every
/// such stream (kubelet logs `RST_STREAM with error code: PROTOCOL_ERROR`). With the `@`, the path
/// becomes the authority's user information and `localhost` its host, which RFC 3986 allows.
pub fn sockets(cfg: &crate::config::Config, driver: &str) -> (PathBuf, PathBuf) {
    let root = &cfg.kubelet_root_dir;
    (
        root.join("plugins_registry").join(format!("{driver}-reg.sock@localhost")),
        root.join("plugins").join(driver).join("dra.sock"),
    )
}

/// The registration socket earlier versions made, which kubelet could not use; removed at start.
fn former_registration_socket(cfg: &crate::config::Config, driver: &str) -> PathBuf {
    cfg.kubelet_root_dir.join("plugins_registry").join(format!("{driver}-reg.sock"))
}

/// The most devices one ResourceSlice may list (the API's limit); a pool with more spans several.
pub const SLICE_DEVICES: usize = 128;

/// The same, where devices consume counters.
pub const SLICE_DEVICES_WITH_COUNTERS: usize = 64;

/// The most counter sets one ResourceSlice may list; a ResourceSlice lists devices or counter
/// sets, not both.
pub const SLICE_COUNTER_SETS: usize = 8;

/// The node's pool as the parts of its ResourceSlices' specs: counter sets first (at most
/// [`SLICE_COUNTER_SETS`] a slice), then devices (at most [`SLICE_DEVICES`] a slice, or
/// [`SLICE_DEVICES_WITH_COUNTERS`] where they consume counters); one empty list of devices for an
/// empty pool.
pub fn pool_parts(pool: Pool) -> Vec<Value> {
    let per = if pool.devices.iter().any(|d| d.get("consumesCounters").is_some()) {
        SLICE_DEVICES_WITH_COUNTERS
    } else {
        SLICE_DEVICES
    };
    let mut parts: Vec<Value> =
        pool.counters.chunks(SLICE_COUNTER_SETS).map(|c| json!({"sharedCounters": c})).collect();
    parts.extend(pool.devices.chunks(per).map(|c| json!({"devices": c})));
    if parts.is_empty() {
        parts.push(json!({"devices": []}));
    }
    parts
}

/// The name of ResourceSlice `k` of the node's pool (`<node>-<driver>`, then `-1`, `-2`, ...).
pub fn pool_slice_name(node: &str, driver: &str, k: usize) -> String {
    let base = resource_slice_name(node, driver);
    if k == 0 {
        base
    } else {
        format!("{base}-{k}")
    }
}

/// How long what the API server kept of the pool is trusted (see [`Written`]).
const WRITTEN_KEPT: Duration = Duration::from_secs(300);

/// Per ResourceSlice of the pool, the part last written and the spec the API server stored of it:
/// a server that drops fields it does not serve (consumable capacity without its feature gate) must
/// not make every pass a write.
type Written = Vec<(Value, Value)>;

/// Writes the node's pool (its ResourceSlices, see [`pool_parts`]) when it differs from what the
/// API server has: every slice with the generation raised, and the slices a smaller pool no longer
/// needs removed.
async fn publish(d: &Driver, owner: &Option<Value>, written: &mut Written) -> Result<bool, String> {
    let v = d.version().await?;
    let unpartitioned = d.agent.cfg.dra_mig == crate::config::DraMig::Dynamic && !v.partitions();
    d.agent.warn("dra-partitions", unpartitioned.then(|| NO_PARTITIONS.to_string()));
    let slices = v.resource("ResourceSlice", "resourceslices");
    let api: Api<DynamicObject> = Api::all_with(d.client.clone(), &slices);
    let chunks = pool_parts(pool(&d.agent, v));
    let name = |k: usize| pool_slice_name(&d.node, &d.driver, k);
    let get = |k: usize| {
        let api = api.clone();
        let n = name(k);
        async move { api.get_opt(&n).await.map_err(|e| format!("reading ResourceSlice {n}: {e}")) }
    };
    // What the pool is now: its first slice says how many there are.
    let first = get(0).await?;
    let count =
        first.as_ref().and_then(|o| o.data["spec"]["pool"]["resourceSliceCount"].as_u64()).unwrap_or(1) as usize;
    let generation = first.as_ref().and_then(|o| o.data["spec"]["pool"]["generation"].as_i64()).unwrap_or(0);
    let mut existing = vec![first];
    for k in 1..count.max(chunks.len()) {
        existing.push(get(k).await?);
    }
    let current = count == chunks.len()
        && chunks.iter().enumerate().all(|(k, want)| {
            existing[k].as_ref().is_some_and(|o| {
                let have = &v.v1_spec(&o.data["spec"]);
                have["driver"] == d.driver.as_str()
                    && have["pool"]["generation"].as_i64() == Some(generation)
                    && (same_part(have, want)
                        || written.get(k).is_some_and(|(sent, back)| same_part(sent, want) && same_part(back, have)))
            })
        });
    if current {
        return Ok(false);
    }
    let generation = generation + 1;
    let mut now = Vec::new();
    for (k, part) in chunks.iter().enumerate() {
        let mut spec = json!({
            "driver": d.driver,
            "nodeName": d.node,
            "pool": {"name": d.node, "generation": generation, "resourceSliceCount": chunks.len()},
        });
        for (key, value) in part.as_object().into_iter().flatten() {
            spec[key] = value.clone();
        }
        let spec = v.slice_spec(spec);
        let n = name(k);
        let stored = match existing[k].take() {
            Some(mut o) => {
                o.data["spec"] = spec;
                api.replace(&n, &PostParams::default(), &o)
                    .await
                    .map_err(|e| format!("updating ResourceSlice {n}: {e}"))?
            }
            None => {
                let mut o = DynamicObject::new(&n, &slices);
                o.data = json!({"spec": spec});
                if let Some(owner) = owner {
                    o.metadata.owner_references = serde_json::from_value(json!([owner])).ok();
                }
                api.create(&PostParams::default(), &o).await.map_err(|e| format!("creating ResourceSlice {n}: {e}"))?
            }
        };
        now.push((part.clone(), v.v1_spec(&stored.data["spec"])));
    }
    for (k, _) in existing.iter().enumerate().skip(chunks.len()).filter(|(_, o)| o.is_some()) {
        let n = name(k);
        api.delete(&n, &Default::default()).await.map_err(|e| format!("removing ResourceSlice {n}: {e}"))?;
    }
    // What the API server dropped of what was sent: a feature gate it lacks.
    let any = |f: &dyn Fn(&Value) -> bool, v: &Value| v["devices"].as_array().is_some_and(|v| v.iter().any(f));
    let dropped = |f: &dyn Fn(&Value) -> bool| {
        now.iter().any(|(sent, _)| any(f, sent)) && !now.iter().any(|(_, back)| any(f, back))
    };
    let gates = [
        (
            "dra-consumable-capacity",
            dropped(&|d: &Value| d["allowMultipleAllocations"] == true),
            "DRA: the API server dropped allowMultipleAllocations: consumable capacity needs the \
             DRAConsumableCapacity feature gate (API server and scheduler); until then each GPU goes to one claim \
             at a time, whole",
        ),
        (
            "dra-partitionable-devices",
            dropped(&|d: &Value| d.get("consumesCounters").is_some()),
            "DRA: the API server dropped consumesCounters: MIG partitions (dra_mig = \"dynamic\") need the \
             DRAPartitionableDevices feature gate (API server and scheduler); until then overlapping placements \
             may be allocated together, and their preparation fails",
        ),
    ];
    for (source, on, text) in gates {
        if on {
            tracing::warn!(resource_slice = %name(0), "{text}");
        }
        d.agent.warn(source, on.then(|| text.to_string()));
    }
    *written = now;
    Ok(true)
}

/// The Node object as the ResourceSlice's owner (the slice goes with the node).
async fn node_owner(client: &kube::Client, node: &str) -> Option<Value> {
    let n = Api::<Node>::all(client.clone()).get(node).await.ok()?;
    Some(json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": n.metadata.uid?, "controller": true}))
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
                    let e = a.err().or(b.err()).unwrap_or_default();
                    tracing::error!(error = %e, "DRA driver: cannot listen; retrying");
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

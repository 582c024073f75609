//! The device model: what the node offers as DRA devices (replicas, shared devices, MIG devices
//! whole and MIG partitions), their names, and capacities compared by value.

use super::*;

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
pub(super) fn profile_label(profile: &str) -> String {
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
pub(super) enum Dev {
    /// Replica `n` of GPU `index`.
    Replica(u32, u32),
    /// The shared device of GPU `index`.
    Shared(u32),
    /// A MIG device, by its device name.
    Mig(String),
    /// A MIG instance to make on GPU `index`: its profile's label and its start (memory slice).
    Partition(u32, String, u32),
}

pub(super) fn parse_device(name: &str) -> Option<Dev> {
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

pub(super) const MIB: u64 = 1 << 20;

/// What a GPU's shared device offers of its memory: all of it (scaled), in whole MiB.
pub(super) fn shared_memory(agent: &Agent, g: &crate::discovery::Gpu) -> u64 {
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
pub(super) fn partitions(agent: &Agent, g: &crate::discovery::Gpu, mig: &crate::discovery::Mig, pool: &mut Pool) {
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
pub(super) fn unhealthy_instances(st: Option<&pb::GpuStatus>) -> Vec<pb::MigInstance> {
    st.and_then(|s| s.mig.as_ref())
        .map(|m| m.instances.iter().filter(|i| i.unhealthy).cloned().collect())
        .unwrap_or_default()
}

/// Whether device `d` (a ResourceSlice entry) is on one of the unhealthy instances `bad`: the MIG
/// device of one, or a partition whose memory slices overlap one's.
pub(super) fn on_unhealthy_instance(d: &Value, bad: &[pb::MigInstance]) -> bool {
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
pub(super) fn partitioned(agent: &Agent, v: ApiVersion) -> bool {
    agent.cfg.dra_mig == crate::config::DraMig::Dynamic && v.partitions()
}

/// The devices one GPU offers (and its counter set, for MIG partitions).
pub(super) fn gpu_devices(agent: &Agent, g: &crate::discovery::Gpu, v: ApiVersion, pool: &mut Pool) {
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
    // `mps`: the GPU runs MPS (docs/mps.md), so a claim's devices there are MPS clients on their
    // share of the SMs; a class or request selects such GPUs, or others, by it.
    let attributes = json!({
        "uuid": {"string": g.uuid},
        "productName": {"string": g.name},
        "index": {"int": g.index},
        "mig": {"bool": false},
        "mps": {"bool": agent.cfg.mps.gpus.has(g.index, &g.uuid)},
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

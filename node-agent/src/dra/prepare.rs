//! Preparing and unpreparing claims: a claim's slice, or its devices given whole (MIG devices,
//! partitions made for it, admin access) with their records, and what the agent is told of them.

use super::*;

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
pub(super) struct Want {
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
    pub(super) fn name(self) -> &'static str {
        match self {
            Whole::Mig => "mig",
            Whole::Admin => "admin",
        }
    }

    /// The directory of its records, under the state directory.
    pub(super) fn dir(self) -> String {
        format!("dra-{}", self.name())
    }

    pub(super) fn cdi_kind(self) -> &'static str {
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

impl Driver {
    /// The slice's per-GPU limits for the devices a claim was allocated (by NVML index): k/split of
    /// a GPU for k of its replicas, plus what the claim consumed of its shared device.
    pub(super) fn limits(&self, wants: &BTreeMap<u32, Want>) -> Result<Vec<vgpu_proto::v1::SliceGpuLimit>, DraError> {
        let inv = self.agent.inventory.read();
        wants
            .iter()
            .map(|(index, w)| {
                let g = inv.gpus.iter().find(|g| g.index == *index).ok_or(DraError::NoGpu(*index))?;
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
                        return Err(DraError::TooMuchMemory { bytes: m, index: *index, offers: whole });
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
    pub async fn prepare(&self, namespace: &str, name: &str, uid: &str) -> Result<Vec<Prepared>, DraError> {
        let api = self.claims(namespace).await?;
        let claim = crate::k8s::retried(|| api.get(name))
            .await
            .map_err(|e| DraError::ReadClaim { claim: format!("{namespace}/{name}"), source: Box::new(e) })?;
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Err(DraError::Replaced {
                claim: format!("{namespace}/{name}"),
                found: claim.metadata.uid.as_deref().unwrap_or("?").to_string(),
                uid: uid.to_string(),
            });
        }
        let results = claim.data["status"]["allocation"]["devices"]["results"]
            .as_array()
            .ok_or_else(|| DraError::NotAllocated(format!("{namespace}/{name}")))?;
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
            return Err(DraError::MixedAdmin(format!("{namespace}/{name}")));
        }
        let mut wants: BTreeMap<u32, Want> = BTreeMap::new();
        let mut whole: Vec<String> = Vec::new();
        let mut parts: Vec<(String, u32, String, u32)> = Vec::new();
        for (_, device, result) in &ours {
            let dev = parse_device(device).ok_or_else(|| DraError::NotOurs(device.to_string()))?;
            if let Dev::Replica(_, n) = dev {
                if n >= self.agent.cfg.split_count {
                    return Err(DraError::NotHere(device.to_string()));
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
                    let read = |k: &str| -> Result<Option<u64>, DraError> {
                        match &consumed[k] {
                            Value::Null => Ok(None),
                            q => {
                                q.as_str().and_then(quantity).and_then(|n| u64::try_from(n).ok()).map(Some).ok_or_else(
                                    || DraError::BadQuantity {
                                        device: device.to_string(),
                                        key: k.to_string(),
                                        value: q.to_string(),
                                    },
                                )
                            }
                        }
                    };
                    // Nothing recorded (a scheduler without consumable capacity allocated the device
                    // to this claim alone): all of the memory, and no SM limit.
                    let cores = read("cores")?.unwrap_or(0);
                    let cores =
                        u32::try_from(cores).map_err(|_| DraError::BadCores { device: device.to_string(), cores })?;
                    wants.entry(index).or_default().shares.push((read("memory")?, cores));
                }
            }
        }
        let slice = slice_name(uid);
        if !crate::slices::valid_name(&slice) {
            return Err(DraError::BadUid(uid.to_string()));
        }
        if let Some(e) = self.shared_container(namespace, name, &claim).await {
            return Err(DraError::SharedContainer(e));
        }
        let cdi = if !whole.is_empty() || !parts.is_empty() {
            if !wants.is_empty() {
                return Err(DraError::MixedMigAndShares(format!("{namespace}/{name}")));
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
            let asked = claim_priority(&claim.data, &self.driver)?;
            let priority = self.agent.grant_priority(asked, namespace, &format!("claim {namespace}/{name}"));
            self.prepare_slice(namespace, name, uid, pod, &wants, priority)?;
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
    pub(super) fn uuid_of(&self, device: &str, dev: &Dev) -> Result<String, DraError> {
        let inv = self.agent.inventory.read();
        match dev {
            Dev::Mig(n) => inv
                .gpus
                .iter()
                .filter_map(|g| g.mig.as_ref())
                .flat_map(|m| &m.devices)
                .find(|m| mig_device_name(&m.uuid) == *n)
                .map(|m| m.uuid.clone())
                .ok_or_else(|| DraError::NoMigDevice(device.to_string())),
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
                .ok_or_else(|| DraError::NoPartitionInstance(device.to_string())),
            Dev::Replica(index, _) | Dev::Shared(index) => inv
                .gpus
                .iter()
                .find(|g| g.index == *index)
                .map(|g| g.uuid.clone())
                .ok_or_else(|| DraError::DeviceNoGpu { device: device.to_string(), index: *index }),
        }
    }

    /// Why the claim cannot be prepared because a container of a pod it is reserved for also uses
    /// another claim with devices of this driver on this node: each claim's CDI device sets the same
    /// environment (`NVIDIA_VISIBLE_DEVICES`, the slice's limits) and mounts, so the container would
    /// get only one claim's. None when no container does, or when that cannot be read now.
    pub(super) async fn shared_container(&self, namespace: &str, name: &str, claim: &DynamicObject) -> Option<String> {
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
    pub(super) fn prepare_slice(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        pod: Option<(&str, &str)>,
        wants: &BTreeMap<u32, Want>,
        priority: crate::slices::Priority,
    ) -> Result<(), DraError> {
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
            let priority = crate::describe::priority_pb(priority) as i32;
            let req = vgpu_proto::v1::CreateSliceRequest { name: slice.clone(), gpus, labels, priority };
            match self.agent.create_slice(req) {
                Ok(_) | Err(ApiError::Exists(_)) => {}
                Err(source) => return Err(DraError::MakeSlice { slice, source }),
            }
        }
        Ok(())
    }

    /// Prepares a claim of MIG partitions (with any MIG devices it has too): makes an instance for
    /// each (or, prepared before, keeps the ones made then) and records them with the claim, all
    /// under the agent's MIG lock, so that no layout change sees them before they are held.
    pub(super) fn prepare_partitions(
        &self,
        mut claim: WholeClaim,
        parts: &[(String, u32, String, u32)],
    ) -> Result<(), DraError> {
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
    pub(super) fn make(&self, claim: &WholeClaim, parts: &[(String, u32, String, u32)]) -> Result<Vec<Made>, DraError> {
        let nvml = self.agent.nvml.get().cloned().ok_or(DraError::NoNvml)?;
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
                    .map_err(|source| DraError::Write { path: record.clone(), source })
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
    pub(super) fn destroy_made(&self, c: &WholeClaim) -> Result<bool, DraError> {
        let nvml = self.agent.nvml.get().cloned().ok_or(DraError::NoNvml)?;
        let held: Vec<String> = self.agent.mig_holders().into_keys().filter(|u| !c.devices.contains(u)).collect();
        let b = vgpu_mig::backend::NvmlBackend::with_held(nvml, held);
        let mut any = false;
        for m in &c.made {
            let g = vgpu_mig::backend::MigBackend::gpu(&b, m.gpu)?;
            if !g.instances.iter().any(|i| i.gi == m.gi && i.uuid.as_deref() == Some(m.uuid.as_str())) {
                continue;
            }
            vgpu_mig::apply::release(&b, m.gpu, m.gi)
                .map_err(|source| DraError::Release { uuid: m.uuid.clone(), source })?;
            tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), gpu = m.gpu, gi = m.gi, uuid = %m.uuid, "MIG instance of a DRA claim destroyed");
            any = true;
        }
        Ok(any)
    }

    /// Where a claim given devices whole is recorded, and its CDI spec.
    pub(super) fn whole_paths(&self, w: Whole, uid: &str) -> (PathBuf, PathBuf) {
        let file = format!("{}.json", slice_name(uid));
        let cdi = self.agent.cfg.cdi_dir.clone().unwrap_or_default();
        (self.agent.cfg.state_dir.join(w.dir()).join(&file), cdi.join(format!("vgpu-{}-{file}", w.name())))
    }

    /// Tells the agent its records of `w` changed (MIG holders, or the claims with admin access).
    pub(super) fn records_changed(&self, w: Whole) {
        match w {
            Whole::Mig => refresh_mig_holders(&self.agent),
            Whole::Admin => refresh_admitted(&self.agent),
        }
    }

    /// Records a claim given devices whole (MIG devices: refused if another claim has one of them)
    /// and writes the CDI spec that gives them to its containers (with admin access, with the
    /// record mounted, by which the agent knows the containers' processes).
    pub(super) fn prepare_whole(&self, w: Whole, mut claim: WholeClaim) -> Result<(), DraError> {
        claim.devices.sort();
        claim.devices.dedup();
        let _one = self.whole_lock.lock();
        if w == Whole::Mig {
            for other in mig_claims(&self.agent).iter().filter(|c| c.uid != claim.uid) {
                if let Some(d) = claim.devices.iter().find(|d| other.devices.contains(d)) {
                    return Err(DraError::MigDeviceHeld {
                        device: d.clone(),
                        claim: format!("{}/{}", other.namespace, other.name),
                        uid: other.uid.clone(),
                    });
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
            .map_err(|source| DraError::Write { path: record.clone(), source })?;
        crate::cdi::write_spec(&spec, &crate::cdi::spec_of(w.cdi_kind(), &name, &inj))
            .map_err(|source| DraError::Write { path: spec.clone(), source })?;
        self.records_changed(w);
        Ok(())
    }

    /// Undoes `prepare`: the claim's slice goes (if there is one), or the record and spec of the
    /// devices it was given whole.
    pub fn unprepare(&self, uid: &str) -> Result<(), DraError> {
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
            Err(e) => Err(DraError::DeleteSlice(e)),
        }
    }

    pub(super) async fn prepare_all(
        &self,
        claims: Vec<(String, String, String)>,
    ) -> BTreeMap<String, Result<Vec<Prepared>, DraError>> {
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

/// Makes one MIG instance of profile `label` at memory slice `start` of GPU `index` (with one
/// compute instance spanning it), for device `device`.
pub(super) fn make_one(
    b: &vgpu_mig::backend::NvmlBackend,
    device: &str,
    index: u32,
    label: &str,
    start: u32,
) -> Result<Made, DraError> {
    use vgpu_mig::backend::MigBackend;
    let g = b.gpu(index).map_err(|source| DraError::DeviceGpu { device: device.to_string(), source })?;
    if !g.mig_enabled {
        return Err(DraError::NotMigMode { device: device.to_string(), index });
    }
    let p =
        g.profiles.iter().find(|p| profile_label(&p.name) == label && p.starts.contains(&start)).ok_or_else(|| {
            DraError::NoProfile { device: device.to_string(), index, label: label.to_string(), start }
        })?;
    let gi = b.create(index, p.id, start).map_err(|source| DraError::MakeInstance {
        device: device.to_string(),
        profile: p.name.clone(),
        start,
        source,
    })?;
    match b.gpu(index).ok().and_then(|g| g.instances.into_iter().find(|i| i.gi == gi)?.uuid) {
        Some(uuid) => {
            tracing::info!(gpu = index, gi, profile = %p.name, start, uuid = %uuid, "MIG instance made for a DRA claim");
            Ok(Made { gpu: index, gi, uuid })
        }
        None => {
            let _ = b.destroy(index, gi);
            Err(DraError::NoUuid { device: device.to_string(), profile: p.name.clone() })
        }
    }
}

/// Destroys instances just made (a preparation that failed after making them).
pub(super) fn unmake(b: &vgpu_mig::backend::NvmlBackend, made: &[Made]) {
    use vgpu_mig::backend::MigBackend;
    for m in made {
        if let Err(e) = b.destroy(m.gpu, m.gi) {
            tracing::warn!(gpu = m.gpu, gi = m.gi, error = %e, "cannot destroy a MIG instance made for a claim that failed");
        }
    }
}

/// A claim's slice priority: `priority` (`high` or `normal`) in the opaque parameters of its
/// allocation's configuration for this driver (what the claim, or its DeviceClass, gave as
/// `config[].opaque.parameters`); normal without one.
fn claim_priority(claim: &Value, driver: &str) -> Result<crate::slices::Priority, DraError> {
    let configs = claim["status"]["allocation"]["devices"]["config"].as_array().into_iter().flatten();
    let mut priority = crate::slices::Priority::Normal;
    for c in configs.filter(|c| c["opaque"]["driver"] == driver) {
        match &c["opaque"]["parameters"]["priority"] {
            Value::Null => {}
            v => priority = serde_json::from_value(v.clone()).map_err(|_| DraError::BadPriority(v.to_string()))?,
        }
    }
    Ok(priority)
}

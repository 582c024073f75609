//! The agent as the capacity reporter's [`Source`]: what the node can still give (per GPU: memory and
//! SM share not promised to slices, MIG instances and the room for more, topology, health, drain),
//! and the scheduler's requests carried out (slices, MIG instances, drains).

use crate::agent::{Agent, ApiError};
use crate::report::Source;
use std::collections::BTreeSet;
use std::path::Path;
use vgpu_mig::backend::MigBackend;
use vgpu_proto::scheduler::v1 as sp;
use vgpu_proto::v1 as pb;

const DRAINED: &str = "drained.json";

/// The drained GPUs recorded in `state_dir` (none when the file is missing or unreadable).
pub fn load_drained(state_dir: &Path) -> BTreeSet<String> {
    std::fs::read(state_dir.join(DRAINED)).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

fn save_drained(state_dir: &Path, set: &BTreeSet<String>) -> Result<(), RequestError> {
    let p = state_dir.join(DRAINED);
    let tmp = p.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(set).expect("serialisable"))
        .and_then(|_| std::fs::rename(&tmp, &p))
        .map_err(|source| RequestError::Save { path: p, source })
}

/// Why a scheduler's request was not carried out; its text goes back in the request's result.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The slice API refused it (no such GPU, no room, a slice of that name with other limits).
    #[error(transparent)]
    Slice(#[from] ApiError),
    #[error("GPU {0} is drained")]
    Drained(String),
    #[error("GPU {0} is in MIG mode: ask for a MIG instance instead")]
    MigMode(String),
    /// No MIG instance could be placed, made or destroyed as asked.
    #[error("{0}")]
    Mig(String),
    #[error("NVML is not open yet")]
    NoNvml,
    #[error("cannot write {}: {source}", path.display())]
    Save { path: std::path::PathBuf, source: std::io::Error },
    #[error("unknown request (from a newer scheduler?)")]
    Unknown,
}

impl Agent {
    /// The MIG profile table of a GPU (read from NVML once it lists one, then cached).
    pub(crate) fn profiles(&self, uuid: &str, index: u32) -> Option<Vec<vgpu_mig::model::Profile>> {
        if let Some(p) = self.mig_profiles.lock().get(uuid) {
            return Some(p.clone());
        }
        let nvml = self.nvml.get()?.clone();
        let g = vgpu_mig::backend::NvmlBackend::new(nvml).gpu(index).ok()?;
        // None yet (asked again next time) where NVML lists none, as with MIG mode off.
        if g.profiles.is_empty() {
            return None;
        }
        self.mig_profiles.lock().insert(uuid.to_string(), g.profiles.clone());
        Some(g.profiles)
    }

    /// The node's capacity now.
    pub fn node_capacity(&self) -> sp::NodeCapacity {
        let inv = self.inventory.read().clone();
        let status = self.status();
        let slices = self.slices();
        let drained = self.drained.read().clone();
        let gpus = inv
            .gpus
            .iter()
            .map(|g| {
                let st = status.gpus.iter().find(|s| s.uuid == g.uuid);
                let healthy = st.is_none_or(|s| s.healthy);
                let mine: Vec<_> = slices.iter().flat_map(|s| s.gpus.iter()).filter(|x| x.uuid == g.uuid).collect();
                // What the GPU's memory counts as (memory_scaling), and what the slices were promised.
                let memory_capacity = self.scaled(g.memory_total);
                let memory_promised: u64 =
                    mine.iter().map(|x| if x.memory == 0 { memory_capacity } else { x.memory }).sum();
                let sm_promised: u32 = mine.iter().map(|x| if x.sm == 0 { 100 } else { x.sm }).sum();
                let draining = drained.contains(&g.uuid);
                let mig_on = g.mig.as_ref().is_some_and(|m| m.enabled);
                let open = healthy && !draining;
                let mig = g.mig.as_ref().map(|m| {
                    let profiles = self.profiles(&g.uuid, g.index).unwrap_or_default();
                    let name =
                        |id: u32| profiles.iter().find(|p| p.id == id).map(|p| p.name.clone()).unwrap_or_default();
                    let used = m.gpu_instances.iter().fold(0u64, |a, i| a | vgpu_mig::model::mask(i.start, i.size));
                    sp::MigCapacity {
                        enabled: m.enabled,
                        pending: m.pending,
                        instances: m
                            .gpu_instances
                            .iter()
                            .map(|i| {
                                // The instance's health as this pass's status has it.
                                let bad = st
                                    .and_then(|s| s.mig.as_ref())
                                    .and_then(|m| m.instances.iter().find(|x| x.gpu_instance_id == i.id))
                                    .filter(|x| x.unhealthy);
                                sp::MigInstance {
                                    unhealthy: bad.is_some(),
                                    health_reason: bad.map(|x| x.health_reason.clone()).unwrap_or_default(),
                                    gpu_instance_id: i.id,
                                    profile: name(i.profile_id),
                                    start: i.start,
                                    size: i.size,
                                    uuid: m
                                        .devices
                                        .iter()
                                        .find(|d| d.gpu_instance_id == Some(i.id))
                                        .map(|d| d.uuid.clone())
                                        .unwrap_or_default(),
                                    memory_mib: profiles
                                        .iter()
                                        .find(|p| p.id == i.profile_id)
                                        .map_or(0, |p| p.memory_mib),
                                }
                            })
                            .collect(),
                        room: if m.enabled && open {
                            profiles
                                .iter()
                                .filter(|p| {
                                    (m.gpu_instances.iter().filter(|i| i.profile_id == p.id).count() as u32) < p.max
                                })
                                .map(|p| sp::MigRoom {
                                    profile: p.name.clone(),
                                    memory_mib: p.memory_mib,
                                    compute_slices: p.compute,
                                    starts: p
                                        .starts
                                        .iter()
                                        .copied()
                                        .filter(|&s| used & vgpu_mig::model::mask(s, p.memory_slices) == 0)
                                        .collect(),
                                })
                                .filter(|r| !r.starts.is_empty())
                                .collect()
                        } else {
                            Vec::new()
                        },
                    }
                });
                sp::GpuCapacity {
                    uuid: g.uuid.clone(),
                    index: g.index,
                    model: g.name.clone(),
                    memory_total: g.memory_total,
                    memory_allocatable: if open && !mig_on {
                        memory_capacity.saturating_sub(memory_promised)
                    } else {
                        0
                    },
                    sm_allocatable: if open && !mig_on { 100u32.saturating_sub(sm_promised) } else { 0 },
                    slices: mine.len() as u32,
                    healthy,
                    health_reason: st.map(|s| s.health_reason.clone()).unwrap_or_default(),
                    draining,
                    numa_node: g.numa_node.map_or(-1, |n| n as i32),
                    pci_bus_id: g.pci_bus_id.clone(),
                    sm_count: g.sm_count.unwrap_or(0),
                    peers: inv
                        .gpus
                        .iter()
                        .enumerate()
                        .filter(|(_, o)| o.uuid != g.uuid)
                        .map(|(j, o)| sp::Peer {
                            uuid: o.uuid.clone(),
                            nvlink: g.nvlink.get(j).copied().unwrap_or(false),
                            pcie: g.topology.get(j).cloned().unwrap_or_default(),
                        })
                        .collect(),
                    mig,
                }
            })
            .collect();
        sp::NodeCapacity {
            node: self.cfg.node_name.clone(),
            driver_version: inv.driver_version.clone(),
            cuda_version: inv.cuda_version,
            gpus,
            ..Default::default()
        }
    }

    /// Reads the GPUs again (after a MIG change) and tells the reporter.
    pub(crate) fn rediscover(&self) {
        if let Some(nvml) = self.nvml.get() {
            if let Ok(inv) = crate::discovery::discover(nvml) {
                *self.inventory.write() = inv;
            }
        }
        self.capacity_changed.notify_one();
    }

    fn set_drained(&self, gpu: &str, on: bool) -> Result<(), RequestError> {
        let (uuid, _) = self.resolve_gpu(gpu)?;
        let mut set = self.drained.write();
        let changed = if on { set.insert(uuid.clone()) } else { set.remove(&uuid) };
        if changed {
            save_drained(&self.cfg.state_dir, &set)?;
            tracing::info!(gpu = %uuid, drained = on, "GPU drain changed by the scheduler");
        }
        drop(set);
        self.capacity_changed.notify_one();
        Ok(())
    }

    fn open_gpu(&self, gpu: &str) -> Result<String, RequestError> {
        let (uuid, _) = self.resolve_gpu(gpu)?;
        if self.drained.read().contains(&uuid) {
            return Err(RequestError::Drained(uuid));
        }
        Ok(uuid)
    }

    fn create_slice_for(&self, c: &sp::CreateSlice) -> Result<sp::RequestResult, RequestError> {
        let uuid = self.open_gpu(&c.gpu)?;
        if self.inventory.read().gpus.iter().any(|g| g.uuid == uuid && g.mig.as_ref().is_some_and(|m| m.enabled)) {
            return Err(RequestError::MigMode(uuid));
        }
        let req = pb::CreateSliceRequest {
            name: c.name.clone(),
            gpus: vec![pb::SliceGpuLimit { gpu: uuid.clone(), memory: c.memory, sm: c.sm }],
            labels: c.labels.clone(),
            priority: 0,
        };
        let d = match self.create_slice(req) {
            Ok(d) => d,
            // The same slice already made (a retry after the agent restarted): the same answer.
            Err(ApiError::Exists(m)) => {
                let d = self.get_slice(&c.name)?;
                let same =
                    d.gpus.len() == 1 && d.gpus[0].gpu == uuid && d.gpus[0].memory == c.memory && d.gpus[0].sm == c.sm;
                if !same {
                    return Err(ApiError::Exists(m).into());
                }
                d
            }
            Err(e) => return Err(e.into()),
        };
        Ok(sp::RequestResult {
            ok: true,
            detail: Some(sp::request_result::Detail::Slice(sp::SliceCreated {
                name: d.name,
                gpu_uuid: uuid,
                env: d.env,
                cdi_device: d.cdi_device,
            })),
            ..Default::default()
        })
    }

    fn create_mig_for(&self, c: &sp::CreateMigInstance) -> Result<sp::RequestResult, RequestError> {
        let nvml = self.nvml.get().cloned().ok_or(RequestError::NoNvml)?;
        let b = vgpu_mig::backend::NvmlBackend::new(nvml);
        let _g = self.mig.lock();
        let inv = self.inventory.read().clone();
        // The GPUs to consider: the one asked for, or every MIG-enabled, undrained one.
        let candidates: Vec<u32> = if c.gpu.is_empty() {
            let drained = self.drained.read();
            inv.gpus
                .iter()
                .filter(|g| g.mig.as_ref().is_some_and(|m| m.enabled) && !drained.contains(&g.uuid))
                .map(|g| g.index)
                .collect()
        } else {
            let uuid = self.open_gpu(&c.gpu)?;
            inv.gpus.iter().filter(|g| g.uuid == uuid).map(|g| g.index).collect()
        };
        let models: Vec<vgpu_mig::model::Gpu> = candidates
            .iter()
            .map(|&i| b.gpu(i))
            .collect::<Result<_, _>>()
            .map_err(|e| RequestError::Mig(e.to_string()))?;
        if models.is_empty() {
            return Err(RequestError::Mig("no MIG-enabled GPU to place the instance on".into()));
        }
        let req = if c.profile.is_empty() {
            vgpu_mig::planner::Request { memory_mib: c.memory_mib, compute: c.compute_slices, sms: 0, media: c.media }
        } else {
            let p = models[0]
                .profile_named(&c.profile)
                .ok_or_else(|| RequestError::Mig(format!("{} has no MIG profile {:?}", models[0].name, c.profile)))?;
            vgpu_mig::planner::Request {
                memory_mib: p.memory_mib,
                compute: p.compute,
                sms: 0,
                media: p.media_extended(),
            }
        };
        let (i, placed) = vgpu_mig::planner::choose_on(&models, &req).map_err(|e| RequestError::Mig(e.to_string()))?;
        let g = &models[i];
        let name = g.profile(placed.profile).map(|p| p.name.clone()).unwrap_or_default();
        if !c.profile.is_empty() && !name.eq_ignore_ascii_case(c.profile.trim_start_matches("MIG ")) {
            return Err(RequestError::Mig(format!(
                "no room for {} on {}: its free slices fit {name} at best",
                c.profile, g.name
            )));
        }
        let a = vgpu_mig::apply::allocate(&b, g.index, &req).map_err(|e| RequestError::Mig(e.to_string()))?;
        drop(_g);
        tracing::info!(gpu = %g.uuid, gi = a.gi, profile = %a.profile, "MIG instance created for the scheduler");
        self.rediscover();
        Ok(sp::RequestResult {
            ok: true,
            detail: Some(sp::request_result::Detail::MigInstance(sp::MigCreated {
                gpu_uuid: g.uuid.clone(),
                gpu_instance_id: a.gi,
                profile: a.profile,
                start: a.start,
                mig_uuid: a.uuid.unwrap_or_default(),
            })),
            ..Default::default()
        })
    }

    fn delete_mig_for(&self, d: &sp::DeleteMigInstance) -> Result<sp::RequestResult, RequestError> {
        let nvml = self.nvml.get().cloned().ok_or(RequestError::NoNvml)?;
        let (uuid, _) = self.resolve_gpu(&d.gpu)?;
        let index = self.inventory.read().gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index);
        let index = index.ok_or_else(|| ApiError::NotFound(format!("no GPU {uuid} on this node")))?;
        let r = {
            let _g = self.mig.lock();
            // Not one given to a DRA claim or a HAMi-mode container, idle or not.
            let b = vgpu_mig::backend::NvmlBackend::with_held(nvml, self.mig_holders().into_keys());
            vgpu_mig::apply::release(&b, index, d.gpu_instance_id)
        };
        // Already gone (a retry) is done too.
        r.map_err(|e| RequestError::Mig(e.to_string()))?;
        self.rediscover();
        Ok(sp::RequestResult { ok: true, ..Default::default() })
    }
}

impl Source for Agent {
    fn capacity(&self) -> sp::NodeCapacity {
        self.node_capacity()
    }

    fn changed(&self) -> &tokio::sync::Notify {
        &self.capacity_changed
    }

    fn handle(&self, req: &sp::NodeRequest) -> sp::RequestResult {
        use sp::node_request::Op;
        let r = match &req.op {
            Some(Op::CreateSlice(c)) => self.create_slice_for(c),
            Some(Op::DeleteSlice(d)) => match self.delete_slice(&d.name, d.force) {
                Ok(()) | Err(ApiError::NotFound(_)) => Ok(sp::RequestResult { ok: true, ..Default::default() }),
                Err(e) => Err(e.into()),
            },
            Some(Op::CreateMigInstance(c)) => self.create_mig_for(c),
            Some(Op::DeleteMigInstance(d)) => self.delete_mig_for(d),
            Some(Op::DrainGpu(d)) => {
                self.set_drained(&d.gpu, true).map(|_| sp::RequestResult { ok: true, ..Default::default() })
            }
            Some(Op::UndrainGpu(d)) => {
                self.set_drained(&d.gpu, false).map(|_| sp::RequestResult { ok: true, ..Default::default() })
            }
            None => Err(RequestError::Unknown),
        };
        let mut r = r.unwrap_or_else(|error| {
            tracing::warn!(id = %req.id, %error, "scheduler request failed");
            sp::RequestResult { ok: false, error: error.to_string(), ..Default::default() }
        });
        r.id = req.id.clone();
        r
    }
}

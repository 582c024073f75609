//! MIG through the agent: status, and mig-parted configs planned, applied (recorded, so they come
//! back after a reboot) and asserted, on the agent's NVML. One MIG operation at a time.

use crate::agent::{Agent, ApiError};
use nvml_wrapper::Nvml;
use std::sync::Arc;
use vgpu_mig::apply::{self, Store};
use vgpu_mig::backend::{MigBackend, ModeChange, NvmlBackend};
use vgpu_mig::config::{self, Desired};
use vgpu_mig::planner::Step;
use vgpu_proto::v1 as pb;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Plan,
    Apply,
    Assert,
}

/// A MIG operation (plan, apply, assert) on the agent's NVML; after an apply, the inventory is read
/// again and a pass published, so the status stream shows the new layout.
pub fn operate(agent: &Agent, req: Option<pb::MigRequest>, op: Op) -> Result<pb::MigReport, ApiError> {
    let nvml = agent.nvml.get().cloned().ok_or_else(|| ApiError::Internal("NVML is not open yet".into()))?;
    let store = agent.mig.lock();
    let held = agent.mig_holders().into_keys().collect();
    let r = run(nvml.clone(), &store, held, &req.unwrap_or_default(), op);
    drop(store);
    if op == Op::Apply {
        if let Ok(inv) = crate::discovery::discover(&nvml) {
            *agent.inventory.write() = inv;
        }
        agent.refresh();
    }
    r
}

/// The MIG status of the agent's GPUs, with who holds each MIG device.
pub fn agent_status(agent: &Agent) -> Result<pb::MigStatusResponse, ApiError> {
    let nvml = agent.nvml.get().cloned().ok_or_else(|| ApiError::Internal("NVML is not open yet".into()))?;
    status(nvml, &agent.mig.lock(), &agent.mig_holders(), &agent.cfg.mig_geometries)
}

/// MIG status of every capable GPU; `holders`: who holds which MIG device (by UUID).
pub fn status(
    nvml: Arc<Nvml>,
    store: &Store,
    holders: &std::collections::BTreeMap<String, String>,
    known: &[crate::hami::KnownMigGeometries],
) -> Result<pb::MigStatusResponse, ApiError> {
    let b = NvmlBackend::new(nvml);
    let n = b.gpu_count().map_err(|e| ApiError::Internal(e.to_string()))?;
    let in_progress = store.in_progress();
    let mut gpus = Vec::new();
    for i in 0..n {
        let Ok(g) = b.gpu(i) else { continue };
        if g.profiles.is_empty() {
            continue; // not MIG-capable
        }
        gpus.push(pb::MigGpu {
            index: g.index,
            uuid: g.uuid.clone(),
            model: g.name.clone(),
            enabled: g.mig_enabled,
            pending_reset: g.mode_pending,
            memory_slices: g.memory_slices,
            profiles: g
                .profiles
                .iter()
                .map(|p| pb::MigProfileInfo {
                    id: p.id,
                    name: p.name.clone(),
                    compute_slices: p.compute,
                    memory_slices: p.memory_slices,
                    memory_mib: p.memory_mib,
                    max: p.max,
                    starts: p.starts.clone(),
                })
                .collect(),
            instances: g
                .instances
                .iter()
                .map(|i| pb::MigInstance {
                    gpu_instance_id: i.gi,
                    profile_id: i.profile,
                    start: i.start,
                    size: i.size,
                    uuid: i.uuid.clone().unwrap_or_default(),
                    name: g.profile(i.profile).map(|p| p.name.clone()).unwrap_or_default(),
                    memory_total: g.profile(i.profile).map_or(0, |p| p.memory_mib << 20),
                    compute_instances: i.compute_instances.len() as u32,
                    holder: i.uuid.as_ref().and_then(|u| holders.get(u).cloned()).unwrap_or_default(),
                    ..Default::default()
                })
                .collect(),
            desired: store.desired(&g.uuid).map(|d| describe(&d)).unwrap_or_default(),
            in_progress: in_progress.contains(&g.uuid),
            geometries: crate::hami::gpu_geometries(known, &g.name, &g.profiles)
                .into_iter()
                .map(|x| pb::MigGeometry {
                    group: x.group,
                    templates: x
                        .templates
                        .into_iter()
                        .map(|t| pb::MigTemplate { name: t.name, core: t.core, memory_mib: t.memory, count: t.count })
                        .collect(),
                })
                .collect(),
        });
    }
    Ok(pb::MigStatusResponse { gpus })
}

fn describe(d: &Desired) -> Vec<String> {
    if !d.mig_enabled {
        return vec!["MIG disabled".into()];
    }
    match (d.exact, d.devices.is_empty()) {
        (true, true) => vec!["MIG enabled, no instances".into()],
        // The mode alone: instances are made per request (dynamic MIG).
        (false, true) => vec!["MIG enabled, instances made per request (no layout)".into()],
        _ => d.devices.iter().map(|(k, v)| format!("{k}: {v}")).collect(),
    }
}

/// Plans, applies or asserts a mig-parted config on the GPUs it selects (or `req.gpus`).
/// A MIG operation; `held`: the MIG devices given out (to DRA claims, HAMi-mode containers), which a
/// layout change keeps as it keeps those with processes (unless forced).
pub fn run(
    nvml: Arc<Nvml>,
    store: &Store,
    held: Vec<String>,
    req: &pb::MigRequest,
    op: Op,
) -> Result<pb::MigReport, ApiError> {
    let file = config::File::parse(&req.config_yaml).map_err(|e| ApiError::Invalid(e.to_string()))?;
    if !file.mig_configs.contains_key(&req.config_name) {
        return Err(ApiError::Invalid(format!(
            "no mig-config named {:?} (have: {})",
            req.config_name,
            file.mig_configs.keys().cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    let b = NvmlBackend::with_held(nvml, held);
    let n = b.gpu_count().map_err(|e| ApiError::Internal(e.to_string()))?;
    if let Some(g) = req.gpus.iter().find(|&&g| g >= n) {
        return Err(ApiError::Invalid(format!("no GPU {g} on this node (it has {n})")));
    }
    let mut out = Vec::new();
    for i in 0..n {
        if !req.gpus.is_empty() && !req.gpus.contains(&i) {
            continue;
        }
        let pci = b.pci_device_id(i).map_err(|e| ApiError::Internal(e.to_string()))?;
        let Some(d) = file.desired(&req.config_name, i, &pci).map_err(|e| ApiError::Invalid(e.to_string()))? else {
            continue;
        };
        let mut r = pb::MigGpuReport { gpu: i, ..Default::default() };
        let g = match b.gpu(i) {
            Ok(g) => g,
            Err(e) => {
                r.error = e.to_string();
                out.push(r);
                continue;
            }
        };
        r.uuid = g.uuid.clone();
        if g.profiles.is_empty() {
            r.error = format!("GPU {i} ({}) does not support MIG", g.name);
            out.push(r);
            continue;
        }
        r.mode_change = match (g.mig_enabled, d.mig_enabled) {
            (false, true) => "enable".into(),
            (true, false) => "disable".into(),
            _ => String::new(),
        };
        let name = |id: u32| g.profile(id).map_or(format!("profile {id}"), |p| p.name.clone());
        let describe_steps = |steps: &[Step]| -> Vec<String> {
            steps
                .iter()
                .map(|s| match s {
                    Step::Destroy { gi, profile, start } => {
                        format!("destroy {} (GPU instance {gi}) at slice {start}", name(*profile))
                    }
                    Step::Create { profile, start } => format!("create {} at slice {start}", name(*profile)),
                })
                .collect()
        };
        match op {
            Op::Assert => match apply::check(&b, i, &d) {
                Ok(diffs) => r.differences = diffs,
                Err(e) => r.error = e.to_string(),
            },
            Op::Plan => {
                // Everything the apply would do, the mode change and the instances it destroys
                // included; refused exactly where the apply would be.
                match apply::transition(&b, i, &d, req.force) {
                    Ok(t) => {
                        // The mode change is `mode_change` (shown and counted as a step of its own).
                        let mut steps = t.destroy_first.as_ref().map_or(Vec::new(), |p| describe_steps(&p.steps));
                        if let Some(p) = &t.plan {
                            steps.extend(describe_steps(&p.steps));
                            r.kept = p.keep.len() as u32;
                        }
                        debug_assert_eq!(steps.len() + usize::from(t.mode.is_some()), t.step_count());
                        r.steps = steps;
                    }
                    Err(e) => r.error = e.to_string(),
                }
                r.pending_reset = g.mode_pending;
            }
            Op::Apply => match apply::apply_gpu(&b, store, i, &d, req.force) {
                Ok(o) => {
                    r.pending_reset = o.pending_reset;
                    if o.mode == ModeChange::Unchanged {
                        r.mode_change.clear();
                    }
                    if let Some(p) = o.plan {
                        r.steps = describe_steps(&p.steps);
                        r.kept = p.keep.len() as u32;
                    }
                    if !o.pending_reset {
                        r.differences = apply::check(&b, i, &d).unwrap_or_default();
                    }
                    tracing::info!(gpu = i, config = %req.config_name, steps = r.steps.len(), pending_reset = r.pending_reset, "MIG layout applied");
                }
                Err(e) => r.error = e.to_string(),
            },
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(ApiError::Invalid(format!("mig-config {:?} selects no GPU of this node", req.config_name)));
    }
    Ok(pb::MigReport { gpus: out })
}

/// After start-up: removes GPU instances left without a compute instance, finishes interrupted
/// applies and re-applies recorded layouts that no longer hold (after a reboot or driver reload),
/// keeping the MIG devices given out (`held`).
pub fn reconcile(nvml: Arc<Nvml>, store: &Store, held: Vec<String>) {
    let b = NvmlBackend::with_held(nvml, held);
    // First what an apply or a request cut short left: the layouts below are then made whole.
    for r in apply::remove_half_made(&b) {
        match r {
            Ok(what) => tracing::warn!(instance = %what, "a GPU instance without a compute instance removed"),
            Err(e) => tracing::warn!(error = %e, "a GPU instance without a compute instance could not be removed"),
        }
    }
    for r in apply::reconcile(&b, store) {
        match r {
            Ok(o) => tracing::info!(gpu = o.gpu, pending_reset = o.pending_reset, "MIG layout restored"),
            Err(e) => tracing::warn!(error = %e, "MIG layout could not be restored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_recorded_layout_says_what_it_is() {
        let d = |mig_enabled, exact, devices: &[(&str, u32)]| Desired {
            mig_enabled,
            exact,
            devices: devices.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        };
        assert_eq!(describe(&d(false, false, &[])), ["MIG disabled"]);
        assert_eq!(describe(&d(true, true, &[])), ["MIG enabled, no instances"]);
        assert_eq!(describe(&d(true, false, &[])), ["MIG enabled, instances made per request (no layout)"]);
        assert_eq!(describe(&d(true, true, &[("1g.10gb", 2)])), ["1g.10gb: 2"]);
    }
}

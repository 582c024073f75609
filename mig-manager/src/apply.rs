//! Carrying targets out on a backend, safely:
//! * the desired state of every GPU is recorded (`<dir>/desired/<uuid>.json`) before anything
//!   changes, so that [`reconcile`] re-applies it after a reboot or driver reload (Hopper loses the
//!   mode and every instance; Ampere keeps the mode and loses the instances at a reset);
//! * an apply in progress is journalled (`<dir>/journal/<uuid>.json`) and removed when done; an
//!   apply interrupted half-way (crash, kill, power) is resumed by [`reconcile`]: planning is
//!   idempotent, so re-planning from what exists towards the journalled target finishes the job;
//! * a mode change that waits for a GPU reset is reported as pending, never pretended.

use crate::backend::{MigBackend, MigError, ModeChange};
use crate::config::{wants, Desired};
use crate::model::Gpu;
use crate::planner::{self, Plan, Step};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Record {
    gpu_uuid: String,
    desired: Desired,
    force: bool,
}

/// The applier's files.
pub struct Store {
    dir: PathBuf,
}

fn write_atomic(path: &Path, data: &[u8]) -> Result<(), MigError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| MigError::Write { path: path.to_owned(), error: e.to_string() })
}

impl Store {
    pub fn open(dir: &Path) -> Result<Store, MigError> {
        for d in ["desired", "journal"] {
            std::fs::create_dir_all(dir.join(d))
                .map_err(|e| MigError::CreateDir { path: dir.to_owned(), error: e.to_string() })?;
        }
        Ok(Store { dir: dir.to_owned() })
    }

    fn path(&self, kind: &str, uuid: &str) -> PathBuf {
        self.dir.join(kind).join(format!("{uuid}.json"))
    }

    fn put(&self, kind: &str, r: &Record) -> Result<(), MigError> {
        write_atomic(&self.path(kind, &r.gpu_uuid), &serde_json::to_vec_pretty(r).expect("serialisable"))
    }

    fn list(&self, kind: &str) -> Vec<Record> {
        let Ok(rd) = std::fs::read_dir(self.dir.join(kind)) else { return Vec::new() };
        rd.flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
            .collect()
    }

    /// The recorded desired state of a GPU.
    pub fn desired(&self, uuid: &str) -> Option<Desired> {
        self.list("desired").into_iter().find(|r| r.gpu_uuid == uuid).map(|r| r.desired)
    }

    /// GPUs with an apply in progress (what a restart resumes).
    pub fn in_progress(&self) -> Vec<String> {
        self.list("journal").into_iter().map(|r| r.gpu_uuid).collect()
    }

    /// Forgets a GPU's journal (an apply that can no longer be carried out).
    pub fn drop_journal(&self, uuid: &str) {
        let _ = std::fs::remove_file(self.path("journal", uuid));
    }
}

/// What an apply did to one GPU.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Outcome {
    pub gpu: u32,
    pub mode: ModeChange,
    /// The mode change waits for a GPU reset: the layout is applied after it.
    pub pending_reset: bool,
    pub plan: Option<Plan>,
}

fn find_gpu(b: &dyn MigBackend, uuid: &str) -> Result<Gpu, MigError> {
    for i in 0..b.gpu_count()? {
        let g = b.gpu(i)?;
        if g.uuid == uuid {
            return Ok(g);
        }
    }
    Err(MigError::NoGpu(uuid.to_string()))
}

/// Runs a plan's steps.
pub fn execute(b: &dyn MigBackend, gpu: u32, plan: &Plan) -> Result<(), MigError> {
    for s in &plan.steps {
        match s {
            Step::Destroy { gi, .. } => b.destroy(gpu, *gi)?,
            Step::Create { profile, start } => {
                b.create(gpu, *profile, *start)?;
            }
        }
    }
    Ok(())
}

/// The plan that would bring GPU `gpu` to `d` (None: only the mode changes, or nothing).
pub fn plan_gpu(b: &dyn MigBackend, gpu: u32, d: &Desired, force: bool) -> Result<Option<Plan>, MigError> {
    let g = b.gpu(gpu)?;
    // MIG on with no layout named: the mode only; instances are made per request (dynamic mode).
    if !d.mig_enabled || !g.mig_enabled || !d.has_layout() {
        return Ok(None);
    }
    let w = wants(&g, d).map_err(|e| MigError::Desired(e.to_string()))?;
    planner::plan(&g, &w, force)
        .map(Some)
        .map_err(|e| MigError::Plan { label: format!("GPU {gpu} ({})", g.name), error: e.to_string() })
}

/// Everything an apply would do to one GPU, in order, worked out before anything is done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// With MIG going off: the instances destroyed first.
    pub destroy_first: Option<Plan>,
    /// The mode switched to (None: it stays).
    pub mode: Option<bool>,
    /// The layout's plan once the mode is as wanted (with MIG coming on: from an empty GPU).
    pub plan: Option<Plan>,
}

impl Transition {
    /// The steps, the mode change included.
    pub fn step_count(&self) -> usize {
        self.destroy_first.as_ref().map_or(0, |p| p.steps.len())
            + usize::from(self.mode.is_some())
            + self.plan.as_ref().map_or(0, |p| p.steps.len())
    }
}

/// Works out whether GPU `gpu` can be brought to `d`, and how, for every mode transition: an
/// impossible layout, busy instances (unless `force`) and processes that would block a mode change
/// are refused here, before anything is recorded or changed.
pub fn transition(b: &dyn MigBackend, gpu: u32, d: &Desired, force: bool) -> Result<Transition, MigError> {
    let g = b.gpu(gpu)?;
    let label = format!("GPU {gpu} ({})", g.name);
    let mode_changes = g.mig_enabled != d.mig_enabled || g.mode_pending;
    if mode_changes {
        let pids = b.processes(gpu)?;
        if !pids.is_empty() {
            let shown: Vec<String> = pids.iter().take(8).map(u32::to_string).collect();
            return Err(MigError::Busy { label, count: pids.len(), pids: shown.join(", ") });
        }
    }
    let destroy_first = if g.mig_enabled && !d.mig_enabled {
        Some(planner::plan(&g, &[], force).map_err(|e| MigError::Plan { label: label.clone(), error: e.to_string() })?)
    } else {
        None
    };
    let plan = if !d.mig_enabled || !d.has_layout() {
        None
    } else {
        // From the instances there are, or from none where MIG is coming on.
        let mut from = g.clone();
        if !g.mig_enabled {
            from.instances.clear();
            from.mig_enabled = true;
        }
        let w = wants(&from, d).map_err(|e| MigError::Desired(e.to_string()))?;
        Some(
            planner::plan(&from, &w, force)
                .map_err(|e| MigError::Plan { label: label.clone(), error: e.to_string() })?,
        )
    };
    let mode = (g.mig_enabled != d.mig_enabled).then_some(d.mig_enabled);
    Ok(Transition { destroy_first, mode, plan })
}

/// Brings GPU `gpu` to `d`: checks that it can ([`transition`]) before anything else, then
/// records it, switches the mode if needed and applies the minimal plan. A refused change leaves
/// no record behind, so nothing carries it out later.
pub fn apply_gpu(b: &dyn MigBackend, store: &Store, gpu: u32, d: &Desired, force: bool) -> Result<Outcome, MigError> {
    let g = b.gpu(gpu)?;
    transition(b, gpu, d, force)?;
    let before = store.list("desired").into_iter().find(|r| r.gpu_uuid == g.uuid);
    let rec = Record { gpu_uuid: g.uuid.clone(), desired: d.clone(), force };
    store.put("desired", &rec)?;
    store.put("journal", &rec)?;
    let r = run(b, gpu, d, force);
    match &r {
        Ok(_) => store.drop_journal(&g.uuid),
        // The driver refused the mode itself: what was destroyed for it is back, so the change is
        // refused as a whole and nothing replays it at the next start.
        Err(MigError::ModeRefused { .. }) => {
            store.drop_journal(&g.uuid);
            match before {
                Some(r) => store.put("desired", &r)?,
                None => {
                    let _ = std::fs::remove_file(store.path("desired", &g.uuid));
                }
            }
        }
        Err(_) => {}
    }
    r
}

/// After the driver refused a mode switch (`error`), makes again the instances destroyed for it
/// (`destroyed`, as the plan named them), and says exactly what state the GPU is in.
fn mode_refused(b: &dyn MigBackend, g: &Gpu, destroyed: &[Step], want: bool, error: MigError) -> MigError {
    let mut lost = Vec::new();
    for s in destroyed {
        if let Step::Destroy { profile, start, .. } = s {
            if let Err(e) = b.create(g.index, *profile, *start) {
                let name = g.profile(*profile).map_or("?".to_string(), |p| p.name.clone());
                lost.push(format!("{name} at slice {start} ({e})"));
            }
        }
    }
    let state = match b.gpu(g.index) {
        Ok(now) => {
            let names: Vec<String> = now
                .instances
                .iter()
                .map(|i| format!("{} at slice {}", now.profile(i.profile).map_or("?", |p| p.name.as_str()), i.start))
                .collect();
            let pending = if now.mode_pending { ", a mode change pending a reset" } else { "" };
            let layout = if names.is_empty() { "no instances".to_string() } else { names.join(", ") };
            format!("MIG is {}{pending}, with {layout}", on(now.mig_enabled))
        }
        Err(e) => format!("its state cannot be read ({e})"),
    };
    let again = match (destroyed.len(), lost.is_empty()) {
        (0, _) => String::new(),
        (n, true) => format!("; the {n} instances destroyed for it were made again (new UUIDs)"),
        (n, false) => {
            format!("; of the {n} instances destroyed for it, these could not be made again: {}", lost.join("; "))
        }
    };
    MigError::ModeRefused {
        label: format!("GPU {} ({})", g.index, g.name),
        what: format!("switching MIG {} failed ({error}); the change is dropped: {state}{again}", on(want)),
    }
}

fn run(b: &dyn MigBackend, gpu: u32, d: &Desired, force: bool) -> Result<Outcome, MigError> {
    let g = b.gpu(gpu)?;
    let mut mode = ModeChange::Unchanged;
    if g.mig_enabled != d.mig_enabled || g.mode_pending {
        let mut destroyed = Vec::new();
        if !d.mig_enabled && g.mig_enabled {
            // Instances go before the mode: destroy them (busy ones only when forced; `transition`
            // made sure no process blocks the mode change).
            let p = planner::plan(&g, &[], force)
                .map_err(|e| MigError::Plan { label: format!("GPU {gpu}"), error: e.to_string() })?;
            execute(b, gpu, &p)?;
            destroyed = p.steps;
        }
        mode = b.set_mode(gpu, d.mig_enabled).map_err(|e| mode_refused(b, &g, &destroyed, d.mig_enabled, e))?;
        if mode == ModeChange::PendingReset {
            return Ok(Outcome { gpu, mode, pending_reset: true, plan: None });
        }
    }
    let plan = plan_gpu(b, gpu, d, force)?;
    if let Some(p) = &plan {
        execute(b, gpu, p)?;
    }
    Ok(Outcome { gpu, mode, pending_reset: false, plan })
}

/// Whether GPU `gpu` is as `d` says: the mode, and the multiset of profiles.
pub fn check(b: &dyn MigBackend, gpu: u32, d: &Desired) -> Result<Vec<String>, MigError> {
    let g = b.gpu(gpu)?;
    let mut diffs = Vec::new();
    if g.mig_enabled != d.mig_enabled {
        diffs.push(format!("MIG mode is {}, wanted {}", on(g.mig_enabled), on(d.mig_enabled)));
    }
    if g.mode_pending {
        diffs.push("a MIG mode change is pending a GPU reset".into());
    }
    if g.mig_enabled && d.mig_enabled {
        for (name, &n) in &d.devices {
            let have =
                g.profile_named(name).map_or(0, |p| g.instances.iter().filter(|i| i.profile == p.id).count() as u32);
            if have != n {
                diffs.push(format!("{have} x {name}, wanted {n}"));
            }
        }
        // `mig-devices: {}` names a layout too: no instances at all.
        for i in g.instances.iter().filter(|_| d.has_layout()) {
            let name = g.profile(i.profile).map_or("?".to_string(), |p| p.name.clone());
            if !d.devices.keys().any(|k| g.profile_named(k).is_some_and(|p| p.id == i.profile)) {
                diffs.push(format!("unwanted {name} at slice {}", i.start));
            }
        }
    }
    // A GPU instance with no compute instance (an apply cut short between the two) is of no use
    // to CUDA: it never counts as done.
    for i in g.instances.iter().filter(|i| i.compute_instances.is_empty()) {
        let name = g.profile(i.profile).map_or("?".to_string(), |p| p.name.clone());
        diffs.push(format!("{name} at slice {} has no compute instance", i.start));
    }
    Ok(diffs)
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// GPU instances without a compute instance (an apply or a request cut short between the two
/// creations, or a `nvidia-smi mig -cgi` without `-C`): of no use to CUDA, and a placement nothing
/// could use. Each is destroyed (nothing can run on it, so nothing is lost); returns what was
/// removed (`GPU <index>: <profile> at slice <start>`) and what could not be.
pub fn remove_half_made(b: &dyn MigBackend) -> Vec<Result<String, MigError>> {
    let mut out = Vec::new();
    for index in 0..b.gpu_count().unwrap_or(0) {
        let Ok(g) = b.gpu(index) else { continue };
        for i in g.instances.iter().filter(|i| g.mig_enabled && i.compute_instances.is_empty()) {
            let name = g.profile(i.profile).map_or("?".to_string(), |p| p.name.clone());
            out.push(b.destroy(index, i.gi).map(|()| format!("GPU {index}: {name} at slice {}", i.start)));
        }
    }
    out
}

/// After a restart, a reboot or a driver reload: finishes journalled applies, then re-applies every
/// recorded desired state that no longer holds. Returns what it did per GPU.
pub fn reconcile(b: &dyn MigBackend, store: &Store) -> Vec<Result<Outcome, MigError>> {
    let mut out = Vec::new();
    let journal: Vec<Record> = store.list("journal");
    for r in store.list("desired") {
        let g = match find_gpu(b, &r.gpu_uuid) {
            Ok(g) => g,
            Err(e) => {
                out.push(Err(e));
                continue;
            }
        };
        let interrupted = journal.iter().any(|j| j.gpu_uuid == r.gpu_uuid);
        let holds = check(b, g.index, &r.desired).map(|d| d.is_empty()).unwrap_or(false);
        if interrupted || !holds {
            let force = journal.iter().find(|j| j.gpu_uuid == r.gpu_uuid).is_some_and(|j| j.force);
            out.push(apply_gpu(b, store, g.index, &r.desired, force));
        }
    }
    out
}

/// A GPU instance made for one request (dynamic mode).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Allocation {
    pub gpu: u32,
    pub gi: u32,
    pub profile: String,
    pub start: u32,
    /// The MIG device to give the workload (`NVIDIA_VISIBLE_DEVICES`).
    pub uuid: Option<String>,
}

/// Dynamic mode: makes the best-fitting GPU instance for `req` on GPU `gpu`, at the placement that
/// keeps the most room (see [`planner::choose`]), with its compute instance. A GPU is managed either
/// dynamically or declaratively: a recorded layout naming devices would remove dynamic instances at
/// the next [`reconcile`]; a config with `mig-enabled: true` and no `mig-devices` sets the mode only.
pub fn allocate(b: &dyn MigBackend, gpu: u32, req: &planner::Request) -> Result<Allocation, MigError> {
    let g = b.gpu(gpu)?;
    if !g.mig_enabled {
        return Err(MigError::MigOff { gpu, name: g.name.clone() });
    }
    let p = planner::choose(&g, req).map_err(|e| MigError::Placement(e.to_string()))?;
    make(b, gpu, &g, p)
}

/// Makes one more instance of `profile` on GPU `gpu`, partitioned as `geometry` (HAMi's and
/// Volcano's MIG templates): at a placement that keeps room for the rest of the geometry (see
/// [`planner::choose_in_geometry`]).
pub fn allocate_in_geometry(
    b: &dyn MigBackend,
    gpu: u32,
    geometry: &[(u32, u32)],
    profile: u32,
) -> Result<Allocation, MigError> {
    let g = b.gpu(gpu)?;
    if !g.mig_enabled {
        return Err(MigError::MigOff { gpu, name: g.name.clone() });
    }
    let p = planner::choose_in_geometry(&g, geometry, profile).map_err(|e| MigError::Placement(e.to_string()))?;
    make(b, gpu, &g, p)
}

fn make(b: &dyn MigBackend, gpu: u32, g: &crate::model::Gpu, p: crate::model::Placed) -> Result<Allocation, MigError> {
    let gi = b.create(gpu, p.profile, p.start)?;
    let after = b.gpu(gpu)?;
    let inst = after.instances.iter().find(|i| i.gi == gi);
    Ok(Allocation {
        gpu,
        gi,
        profile: g.profile(p.profile).map_or(String::new(), |x| x.name.clone()),
        start: p.start,
        uuid: inst.and_then(|i| i.uuid.clone()),
    })
}

/// Dynamic mode: destroys an allocation's GPU instance once idle (refused while it is busy: processes
/// run on it, or the backend reports it given to a workload). False when it was already gone (a
/// retry): released all the same.
pub fn release(b: &dyn MigBackend, gpu: u32, gi: u32) -> Result<bool, MigError> {
    let g = b.gpu(gpu)?;
    let Some(inst) = g.instances.iter().find(|i| i.gi == gi) else { return Ok(false) };
    if inst.busy {
        return Err(MigError::InUse { gpu, gi });
    }
    b.destroy(gpu, gi).map(|()| true)
}

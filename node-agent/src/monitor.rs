//! The monitoring pass, every `monitor_interval_ms`:
//! * reclaim what dead processes held (their slots' record locks are free);
//! * read every GPU's memory, utilisation, processes and per-process SM samples from NVML;
//! * attribute each GPU process to a slice: by the host PID the interposer recorded, else by which
//!   slice's region file the process has mapped (`/proc/<pid>/maps`, matched by device and inode,
//!   which works across PID and mount namespaces) with its PID inside the container from `NSpid`;
//! * tell each slice's interposers whether their GPU is shared (the default SM policy limits only
//!   then) and correct their SM budgets' refill rate from the measured utilisation;
//! * report escapes (a GPU process outside every slice on a GPU that slices use; a slice whose
//!   NVML-measured memory exceeds its limit) and act on them as configured.

use crate::config::EscapeAction;
use crate::procfs::{self, FileId};
use crate::slices::{Slice, SliceStore};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
// A fast hash for the pass's many small maps (SipHash showed in its profile); keys are ours.
use foldhash::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use vgpu_proto::v1 as pb;
use vgpu_region::Region;

/// SM flags in the region: bit 0 shared, bit 1 managed by the agent.
const SM_SHARED: u64 = 1;
const SM_MANAGED: u64 = 2;

/// Bounds of the agent's correction of an SM budget's refill rate (parts per million).
pub const RATE_MIN_PPM: u64 = 250_000;
pub const RATE_MAX_PPM: u64 = 4_000_000;

struct Cached {
    region: Region,
    /// The slice's creation time: a slice made again under the same name is another region.
    created_ns: u64,
    id: Option<FileId>,
    throttled_launches: [u64; vgpu_region::MAX_DEVICES],
    /// Smoothed measured SM share per device (percent; NaN before the first sample).
    sm_ewma: [f64; vgpu_region::MAX_DEVICES],
    /// The same, over the current run of throttled passes only (what the controller acts on).
    sm_ctl: [f64; vgpu_region::MAX_DEVICES],
    /// Consecutive passes in which the slice was throttled on the device.
    streak: [u32; vgpu_region::MAX_DEVICES],
}

/// Throttled passes in a row before the controller acts (a second at 100 ms): a workload starting,
/// stopping or changing phase is not corrected for.
const CONTROL_AFTER: u32 = 10;

/// A live slot: (PID in the container, host PID or 0, bytes per device).
type LiveSlot = (u32, u32, Vec<u64>);
/// A slice's process as NVML reports it on one GPU: (host PID, PID in the container, bytes).
type GpuProc = (u32, u32, u64);

struct ProcOwner {
    start: u64,
    /// (slice, PID inside the container)
    owner: Option<(String, u32)>,
}

/// What one GPU looked like in a pass.
#[derive(Clone, Debug, Default)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub memory_used: u64,
    pub memory_total: u64,
    pub utilization: u32,
    /// Slices using it, and whether processes outside every slice use it.
    pub slices: u32,
    pub outsiders: bool,
    /// NVML failed for this GPU in this pass.
    pub error: Option<String>,
}

/// The result of a pass.
#[derive(Clone, Debug, Default)]
pub struct Pass {
    pub gpus: Vec<GpuSample>,
    pub slices: Vec<pb::SliceStatus>,
    /// Escapes seen in this pass (with the action taken on the new ones).
    pub escapes: Vec<pb::Escape>,
    /// Escapes not seen in the pass before, by `pb::escape::Kind`.
    pub new_escapes: [u64; 3],
    /// Bytes released from dead processes' slots.
    pub reclaimed: u64,
}

pub struct Monitor {
    regions: HashMap<String, Cached>,
    procs: HashMap<u32, ProcOwner>,
    util_seen: HashMap<u32, u64>,
    active: HashSet<String>,
    action: EscapeAction,
    passes: u64,
    /// Slices whose region could not be opened, and when to try again (every 10 s, logged once
    /// per try instead of every pass).
    unopened: HashMap<String, std::time::Instant>,
}

/// The SM controller: the refill rate's new correction, from the old one, the limit and the measured
/// share (percent), applied only while the slice is being throttled (its demand exceeds its budget;
/// otherwise a share below the limit is the workload's own choice and must not wind the rate up).
pub fn corrected_rate(ppm: u64, limit: u32, measured: f64) -> u64 {
    let ppm = if ppm == 0 { 1_000_000 } else { ppm };
    let err = (limit as f64 - measured) / limit.max(1) as f64;
    // 3 % of the relative error per pass: a time constant of about 3 s at 100 ms, slower than the
    // half-second smoothing of the measurement, so the loop does not overshoot.
    let next = ppm as f64 * (1.0 + 0.03 * err.clamp(-1.0, 1.0));
    (next as u64).clamp(RATE_MIN_PPM, RATE_MAX_PPM)
}

/// An escape's identity across passes: a process for an unaccounted one, the slice and GPU for an
/// over-limit one.
fn escape_key(e: &pb::Escape) -> String {
    let pid = if e.kind == pb::escape::Kind::Unaccounted as i32 { e.pid } else { 0 };
    format!("{}/{}/{}/{pid}", e.kind, e.gpu, e.slice)
}

fn nvml_err(what: &str, e: NvmlError) -> String {
    format!("{what}: {e}")
}

impl Monitor {
    pub fn new(action: EscapeAction) -> Monitor {
        Monitor {
            regions: HashMap::default(),
            procs: HashMap::default(),
            util_seen: HashMap::default(),
            active: HashSet::default(),
            action,
            passes: 0,
            unopened: HashMap::default(),
        }
    }

    /// One pass over `slices` (the agent's record) and every GPU NVML reports.
    pub fn pass(&mut self, nvml: &Nvml, store: &SliceStore, slices: &[Slice]) -> Pass {
        let mut pass = Pass::default();
        // A slice deleted and made again between two passes is a new region file: drop the old one.
        let current: HashMap<&str, u64> = slices.iter().map(|s| (s.name.as_str(), s.created_ns)).collect();
        self.regions.retain(|name, c| current.get(name.as_str()) == Some(&c.created_ns));
        self.unopened.retain(|name, _| current.contains_key(name.as_str()));
        for s in slices {
            if !self.regions.contains_key(&s.name)
                && self.unopened.get(&s.name).is_none_or(|t| *t <= std::time::Instant::now())
            {
                let path = store.dir(&s.name).join("region");
                match Region::open(&path, true) {
                    Ok(region) => {
                        let c = Cached {
                            region,
                            created_ns: s.created_ns,
                            id: procfs::file_id(&path),
                            throttled_launches: [0; vgpu_region::MAX_DEVICES],
                            sm_ewma: [f64::NAN; vgpu_region::MAX_DEVICES],
                            sm_ctl: [f64::NAN; vgpu_region::MAX_DEVICES],
                            streak: [0; vgpu_region::MAX_DEVICES],
                        };
                        self.regions.insert(s.name.clone(), c);
                        self.unopened.remove(&s.name);
                    }
                    Err(e) => {
                        tracing::error!(slice = %s.name, error = %e, "cannot open the slice's region (next try in 10 s)");
                        let next = std::time::Instant::now() + std::time::Duration::from_secs(10);
                        self.unopened.insert(s.name.clone(), next);
                    }
                }
            }
        }
        // NVML first: which processes hold contexts now.
        let count = nvml.device_count().unwrap_or(0);
        let mut queried = Vec::with_capacity(count as usize);
        // GPUs whose utilisation samples cover exactly the time since the last pass.
        let mut fresh = HashSet::default();
        for i in 0..count {
            let mut g = GpuSample { index: i, ..Default::default() };
            let sample = (|| -> Result<_, String> {
                let d = nvml.device_by_index(i).map_err(|e| nvml_err("handle", e))?;
                g.uuid = d.uuid().map_err(|e| nvml_err("uuid", e))?;
                let m = d.memory_info().map_err(|e| nvml_err("memory", e))?;
                (g.memory_used, g.memory_total) = (m.used, m.total);
                g.utilization = d.utilization_rates().map(|u| u.gpu).unwrap_or(0);
                let procs: Vec<(u32, u64)> = d
                    .running_compute_processes()
                    .map_err(|e| nvml_err("processes", e))?
                    .into_iter()
                    .map(|p| (p.pid, if let UsedGpuMemory::Used(b) = p.used_gpu_memory { b } else { 0 }))
                    .collect();
                let last = self.util_seen.get(&i).copied().unwrap_or(0);
                let samples = match d.process_utilization_stats(last) {
                    Ok(v) => v,
                    Err(NvmlError::NotFound) | Err(NvmlError::NotSupported) => Vec::new(),
                    Err(e) => return Err(nvml_err("process utilisation", e)),
                };
                Ok((procs, samples))
            })();
            let (procs, samples) = match sample {
                Ok(x) => x,
                Err(e) => {
                    g.error = Some(e);
                    queried.push((g, Vec::new(), Vec::new()));
                    continue;
                }
            };
            if let Some(t) = samples.iter().map(|s| s.timestamp).max() {
                // The first call covers NVML's whole sample window, not one pass.
                if self.util_seen.insert(i, t).is_some() {
                    fresh.insert(i);
                }
            }
            queried.push((g, procs, samples));
        }
        self.passes += 1;
        let full = self.passes % 10 == 1;
        let alive: HashSet<u32> = queried.iter().flat_map(|(_, p, _)| p.iter().map(|x| x.0)).collect();
        let alive_inner: HashSet<(&str, u32)> = self
            .procs
            .iter()
            .filter(|(host, _)| alive.contains(host))
            .filter_map(|(_, o)| o.owner.as_ref().map(|(s, p)| (s.as_str(), *p)))
            .collect();
        // Slots: reclaim the dead, index the living by host PID.
        let mut by_host: HashMap<u32, (String, u32)> = HashMap::default();
        let mut slots: HashMap<&str, Vec<LiveSlot>> = HashMap::default();
        for s in slices {
            let Some(c) = self.regions.get(&s.name) else { continue };
            // A process NVML lists (by host PID, or as last attributed) is alive: no lock test, except
            // in every tenth pass (a PID reused within a pass cannot hide a death for long).
            let freed = c.region.reap_where(|pid, host| {
                full || !((host != 0 && alive.contains(&host)) || alive_inner.contains(&(s.name.as_str(), pid)))
            });
            pass.reclaimed = pass.reclaimed.saturating_add(freed);
            let live: Vec<LiveSlot> = c.region.slots().into_iter().map(|(_, p, h, u)| (p, h, u)).collect();
            for (pid, host, _) in &live {
                if *host != 0 {
                    by_host.insert(*host, (s.name.clone(), *pid));
                }
            }
            slots.insert(&s.name, live);
        }
        let by_file: Vec<(FileId, String)> =
            self.regions.iter().filter_map(|(n, c)| Some((c.id?, n.clone()))).collect();

        // Per slice and device: (host pid, container pid, NVML memory), and SM samples.
        // Keyed by (slice name, GPU index).
        let mut nvml_procs: HashMap<(&str, u32), Vec<GpuProc>> = HashMap::default();
        let mut sm_used: HashMap<(&str, u32), u32> = HashMap::default();
        let by_name: HashMap<&str, &Slice> = slices.iter().map(|s| (s.name.as_str(), s)).collect();
        let mut gpu_users: HashMap<&str, u32> = HashMap::default();
        for s in slices {
            for g in &s.gpus {
                *gpu_users.entry(g.uuid.as_str()).or_default() += 1;
            }
        }
        let mut seen_pids = HashSet::default();
        for (mut g, procs, samples) in queried {
            if g.error.is_some() {
                pass.gpus.push(g);
                continue;
            }
            let users = gpu_users.get(g.uuid.as_str()).copied().unwrap_or(0);
            g.slices = users;
            for (pid, mem) in procs {
                seen_pids.insert(pid);
                let owner = self.owner(pid, &by_host, &by_file);
                match owner {
                    // A slice's process on a GPU that is not the slice's.
                    Some((slice, _))
                        if !by_name.get(slice.as_str()).is_some_and(|s| s.gpus.iter().any(|x| x.uuid == g.uuid)) =>
                    {
                        g.outsiders = true;
                        pass.escapes.push(pb::Escape {
                            kind: pb::escape::Kind::Unaccounted as i32,
                            gpu: g.uuid.clone(),
                            slice,
                            pid,
                            measured: mem,
                            ..Default::default()
                        });
                    }
                    Some((slice, inner)) => {
                        let sm = samples.iter().filter(|s| s.pid == pid).map(|s| s.sm_util).max().unwrap_or(0);
                        let Some(s) = by_name.get(slice.as_str()) else { continue };
                        *sm_used.entry((s.name.as_str(), g.index)).or_default() += sm;
                        nvml_procs.entry((s.name.as_str(), g.index)).or_default().push((pid, inner, mem));
                    }
                    None if users > 0 => {
                        g.outsiders = true;
                        pass.escapes.push(pb::Escape {
                            kind: pb::escape::Kind::Unaccounted as i32,
                            gpu: g.uuid.clone(),
                            pid,
                            measured: mem,
                            ..Default::default()
                        });
                    }
                    None => {}
                }
            }
            pass.gpus.push(g);
        }
        self.procs.retain(|pid, _| seen_pids.contains(pid));

        // Per slice: usage, processes, SM flags and rate, over-limit escapes.
        let gpu_at: HashMap<&str, usize> = pass.gpus.iter().enumerate().map(|(i, g)| (g.uuid.as_str(), i)).collect();
        for s in slices {
            let Some(c) = self.regions.get_mut(&s.name) else { continue };
            let layout = c.region.layout();
            let mut st = pb::SliceStatus {
                name: s.name.clone(),
                labels: s.labels.clone().into_iter().collect(),
                created_unix: s.created,
                ..Default::default()
            };
            let live = slots.get(s.name.as_str()).cloned().unwrap_or_default();
            for (dev, sg) in s.gpus.iter().enumerate() {
                let gpu = gpu_at.get(sg.uuid.as_str()).map(|&i| &pass.gpus[i]);
                let d = &layout.devices[dev];
                let key = (s.name.as_str(), gpu.map_or(u32::MAX, |g| g.index));
                let mine = nvml_procs.get(&key).cloned().unwrap_or_default();
                let measured: u64 = mine.iter().map(|p| p.2).sum();
                if let Some(g) = gpu {
                    let shared = g.slices > 1 || g.outsiders;
                    d.sm_flags.store(SM_MANAGED | if shared { SM_SHARED } else { 0 }, Relaxed);
                }
                let sm = sm_used.get(&key).copied().unwrap_or(0).min(100) as f64;
                let e = &mut c.sm_ewma[dev];
                *e = if e.is_nan() { sm } else { 0.8 * *e + 0.2 * sm };
                let throttled = d.sm_throttled_launches.load(Relaxed);
                // The controller: only while the slice is throttled (its demand exceeds its budget),
                // from samples of full passes, after a second of it, outside a 1-point dead band.
                let limit = c.region.sm_limit(dev).min(sg.sm.max(1));
                let sampled = gpu.is_some_and(|g| fresh.contains(&g.index));
                if throttled > c.throttled_launches[dev] && sampled && (1..100).contains(&sg.sm) {
                    c.streak[dev] += 1;
                    let e = &mut c.sm_ctl[dev];
                    *e = if e.is_nan() { sm } else { 0.8 * *e + 0.2 * sm };
                    if c.streak[dev] >= CONTROL_AFTER && (c.sm_ctl[dev] - limit as f64).abs() >= 1.0 {
                        let old = d.sm_rate_ppm.load(Relaxed);
                        let new = corrected_rate(old, limit, c.sm_ctl[dev]);
                        if new != old {
                            d.sm_rate_ppm.store(new, Relaxed);
                        }
                    }
                } else {
                    c.streak[dev] = 0;
                    c.sm_ctl[dev] = f64::NAN;
                }
                c.throttled_launches[dev] = throttled;
                if sg.memory > 0 && measured > sg.memory {
                    pass.escapes.push(pb::Escape {
                        kind: pb::escape::Kind::OverLimit as i32,
                        gpu: sg.uuid.clone(),
                        slice: s.name.clone(),
                        // The process most over its own account: the likely culprit.
                        pid: mine
                            .iter()
                            .max_by_key(|(host, inner, mem)| {
                                let acct = live
                                    .iter()
                                    .find(|(p, h, _)| *h == *host || *p == *inner)
                                    .map_or(0, |(_, _, u)| u[dev]);
                                mem.saturating_sub(acct)
                            })
                            .map_or(0, |p| p.0),
                        measured,
                        limit: sg.memory,
                        ..Default::default()
                    });
                }
                let rate = d.sm_rate_ppm.load(Relaxed);
                st.gpus.push(pb::SliceGpuStatus {
                    uuid: sg.uuid.clone(),
                    gpu_index: gpu.map_or(u32::MAX, |g| g.index),
                    memory_limit: sg.memory,
                    memory_used: c.region.used(dev),
                    memory_measured: measured,
                    sm_limit: sg.sm,
                    // Smoothed over about half a second (one pass alone is a noisy 100 ms sample).
                    sm_used: c.sm_ewma[dev].round() as u32,
                    throttled_ns: d.sm_throttled_ns.load(Relaxed),
                    throttled_launches: throttled,
                    oom_rejections: d.oom_rejections.load(Relaxed),
                    memory_peak: d.peak_used.load(Relaxed),
                    sm_rate_ppm: if rate == 0 { 1_000_000 } else { rate },
                });
                for (pid, host, used) in &live {
                    let host_pid = if *host != 0 {
                        *host
                    } else {
                        mine.iter().find(|(_, inner, _)| inner == pid).map_or(0, |p| p.0)
                    };
                    if used[dev] > 0 || mine.iter().any(|p| p.0 == host_pid && host_pid != 0) {
                        st.processes.push(pb::ProcessStatus {
                            host_pid,
                            pid: *pid,
                            gpu: sg.uuid.clone(),
                            memory: used[dev],
                        });
                    }
                }
            }
            for (pid, host, used) in &live {
                if used.iter().all(|&u| u == 0) && !st.processes.iter().any(|p| p.pid == *pid) {
                    st.processes.push(pb::ProcessStatus { host_pid: *host, pid: *pid, ..Default::default() });
                }
            }
            pass.slices.push(st);
        }

        // New escapes: counted, logged and acted on once; ongoing ones are only reported.
        let mut now = HashSet::default();
        for e in &mut pass.escapes {
            let key = escape_key(e);
            let new = !self.active.contains(&key);
            now.insert(key);
            e.action = "reported".into();
            if !new {
                continue;
            }
            pass.new_escapes[(e.kind as usize).min(2)] += 1;
            if self.action == EscapeAction::Kill && e.pid != 0 {
                // SAFETY: kill(2) with a PID NVML reported in this pass and a valid signal.
                let r = unsafe { libc::kill(e.pid as libc::pid_t, libc::SIGKILL) };
                e.action = if r == 0 { "killed".into() } else { "kill failed".into() };
                // Killed: the next pass sees the process gone; its next escape is a new one.
                now.remove(&escape_key(e));
            }
            if e.kind == pb::escape::Kind::Unaccounted as i32 && !e.slice.is_empty() {
                tracing::warn!(gpu = %e.gpu, pid = e.pid, slice = %e.slice, memory = e.measured, action = %e.action,
                    "slice process on a GPU outside its slice");
            } else if e.kind == pb::escape::Kind::Unaccounted as i32 {
                tracing::warn!(gpu = %e.gpu, pid = e.pid, memory = e.measured, action = %e.action, "GPU process outside every slice");
            } else {
                tracing::warn!(slice = %e.slice, gpu = %e.gpu, measured = e.measured, limit = e.limit, pid = e.pid,
                    action = %e.action, "slice over its memory limit as NVML measures it");
            }
        }
        self.active = now;
        pass
    }

    /// The slice (and the PID inside its container) of GPU process `pid` (host PID).
    fn owner(
        &mut self,
        pid: u32,
        by_host: &HashMap<u32, (String, u32)>,
        by_file: &[(FileId, String)],
    ) -> Option<(String, u32)> {
        if let Some(o) = by_host.get(&pid) {
            return Some(o.clone());
        }
        let start = procfs::start_time(pid)?;
        if let Some(c) = self.procs.get(&pid) {
            if c.start == start {
                // A cached owner must still exist (the slice may have been deleted).
                return c.owner.clone().filter(|(s, _)| by_file.iter().any(|(_, n)| n == s));
            }
        }
        let owner = procfs::mapped(pid, by_file).map(|slice| {
            let inner = procfs::ns_pids(pid).and_then(|v| v.last().copied()).unwrap_or(pid);
            (slice.clone(), inner)
        });
        self.procs.insert(pid, ProcOwner { start, owner: owner.clone() });
        owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sm_controller_moves_toward_the_limit_and_stays_bounded() {
        assert_eq!(corrected_rate(0, 30, 30.0), 1_000_000, "on target: no change");
        assert!(corrected_rate(1_000_000, 30, 36.0) < 1_000_000, "over the limit: slower refill");
        assert!(corrected_rate(1_000_000, 30, 24.0) > 1_000_000, "under the limit while throttled: faster");
        let mut r = 1_000_000;
        for _ in 0..3000 {
            r = corrected_rate(r, 50, 100.0);
        }
        assert_eq!(r, RATE_MIN_PPM);
        for _ in 0..3000 {
            r = corrected_rate(r, 50, 0.0);
        }
        assert_eq!(r, RATE_MAX_PPM);
        // A plant whose share is proportional to the rate (measured = 1.2 x limit x rate) converges.
        let mut r = 1_000_000u64;
        let mut m = 0.0;
        for _ in 0..200 {
            m = 36.0 * r as f64 / 1e6;
            r = corrected_rate(r, 30, m);
        }
        assert!((m - 30.0).abs() < 0.5, "converged to {m}");
    }
}

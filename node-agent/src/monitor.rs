//! The monitoring pass, every `monitor_interval_ms`:
//! * reclaim what dead processes held (their slots' record locks are free);
//! * read every GPU's memory, utilisation, processes and per-process SM samples from NVML;
//! * attribute each GPU process to a slice: by the host PID the interposer recorded, else by which
//!   slice's region file the process has mapped (`/proc/<pid>/maps`, matched by device and inode,
//!   which works across PID and mount namespaces) with its PID inside the container from `NSpid`;
//! * tell each slice's interposers whether their GPU is shared (the default SM policy limits only
//!   then) and correct their SM budgets' refill rate from the measured utilisation;
//! * report escapes (a GPU process outside every slice on a GPU that slices use in two passes in a
//!   row, unless it is an MPS server or in a container of a DRA claim with admin access to the GPU;
//!   a slice whose NVML-measured memory exceeds its limit) and act on them as configured.

use crate::config::EscapeAction;
use crate::procfs::{self, FileId};
use crate::slices::{Slice, SliceStore};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
// A fast hash for the pass's many small maps (SipHash showed in its profile); keys are ours.
use foldhash::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
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
    /// Its activity file (see `vgpu_region::activity`): cleared while none of its processes lives,
    /// so that a killed high-priority process holds the normal slices of its GPUs back for at most
    /// one pass.
    activity: Option<vgpu_region::activity::Mapped>,
    /// The slice's creation time: a slice made again under the same name is another region.
    created_ns: u64,
    id: Option<FileId>,
    /// In the current pass: its live slots, a range of `Monitor::live`.
    live: std::ops::Range<usize>,
    /// In the current pass: where each of its devices is in the pass's GPUs (`usize::MAX`: not seen).
    gpu_pos: [usize; vgpu_region::MAX_DEVICES],
    /// In the current pass: its processes as NVML lists them, with their SM share (kept allocated
    /// from pass to pass).
    nvml: Vec<NvmlProc>,
    /// What NVML last listed for each of its processes on each GPU, kept until the process's slot
    /// goes: a slot found dead is reclaimed up to what NVML last saw
    /// of its process, which the pass that finds it (a full one, where a scribbled slot names a
    /// living host PID) may no longer list.
    last_seen: Vec<NvmlProc>,
    /// In the current pass, with the true-up on: each live slot's usage (slot, PID, per device) read
    /// just before NVML's figures, to tell a process whose charge moved meanwhile (in slot order;
    /// kept allocated).
    before_nvml: Vec<(usize, u32, [u64; vgpu_region::MAX_DEVICES])>,
    /// Likewise, the bytes its processes had reserved for calls the driver had not answered yet.
    in_flight_before: [u64; vgpu_region::MAX_DEVICES],
    /// Per device: the container's refused allocations as the last true-up read them.
    refusals: [u64; vgpu_region::MAX_DEVICES],
    throttled_launches: [u64; vgpu_region::MAX_DEVICES],
    /// Smoothed measured SM share per device (percent; NaN before the first sample).
    sm_ewma: [f64; vgpu_region::MAX_DEVICES],
    /// The same, over the new samples of the current run of throttled passes only (what the
    /// controller acts on).
    sm_ctl: [f64; vgpu_region::MAX_DEVICES],
    /// New samples in the current run of passes in which the slice was throttled on the device.
    streak: [u32; vgpu_region::MAX_DEVICES],
    /// Per device: the GPU time its launches were charged in all, when the last pass read it
    /// (monotonic ns), and that share of the time since the previous reading, smoothed (percent).
    sm_acct: [(i64, u64); vgpu_region::MAX_DEVICES],
    sm_acct_ewma: [f64; vgpu_region::MAX_DEVICES],
    /// Per device: wall-clock ms of the slice's latest kernel seen (0: none yet), and since when the
    /// agent has watched the slice (0 until its first pass).
    last_kernel_ms: [u64; vgpu_region::MAX_DEVICES],
    watched_since_ms: u64,
    /// Per live process (slot, PID): what the agent added to its usage so that it matches what the
    /// driver holds for it (see [`true_up`]), and the excess the last pass saw.
    trued: HashMap<(usize, u32), TrueUp>,
    /// Per device, a high-priority slice's passes in a row claiming queued work that the GPU time
    /// NVML measures for it does not bear out (see [`unfounded_claims`]).
    claim_strikes: [u8; vgpu_region::MAX_DEVICES],
    /// Per device: the GPU time its launches noted in its activity file in all, and when the last
    /// pass read it (monotonic ns); that share of the time since, smoothed (percent).
    noted: [(u64, u64); vgpu_region::MAX_DEVICES],
    noted_ewma: [f64; vgpu_region::MAX_DEVICES],
    /// Per device: passes in a row in which NVML measured far more GPU time than its launches
    /// accounted for (see [`Cached::bypass`]).
    bypass_strikes: [u8; vgpu_region::MAX_DEVICES],
}

/// Passes in a row of GPU time beyond what a slice's launches account for before it is an escape.
const BYPASS_STRIKES: u8 = 20;

/// Whether `measured` GPU time (percent) is more than launches that account for `accounted` can
/// take: twice that and 20 points (estimates per launch are coarse; time-slicing adds switches).
fn beyond_account(measured: f64, accounted: f64) -> bool {
    measured > 2.0 * accounted + 20.0
}

/// How long a high-priority slice whose claims were unfounded holds no normal slice back.
pub const PRIORITY_SUSPENSION: std::time::Duration = std::time::Duration::from_secs(10);
/// A high-priority slice's claim of queued work is looked at once it reaches this far ahead.
const CLAIM_AHEAD_NS: u64 = 50_000_000;
/// Below this share of the GPU as NVML measures its processes (percent), the claim is unfounded.
const CLAIM_MIN_SM: f64 = 5.0;
/// Passes in a row of unfounded claims before the slice's priority is suspended.
const CLAIM_STRIKES: u8 = 5;

/// A high-priority slice's claims of queued work that what the GPU does for it does not bear out:
/// on each device, work queued more than [`CLAIM_AHEAD_NS`] ahead while NVML measures its
/// processes at under [`CLAIM_MIN_SM`] % of the GPU, [`CLAIM_STRIKES`] passes in a row (a tenant
/// writing its activity file to hold its neighbours back; a genuinely busy slice is measured busy).
/// Returns (device, claimed ns ahead, measured %) of each device found so; the claim is cleared.
fn unfounded_claims(c: &mut Cached, ndev: usize) -> Vec<(usize, u64, f64)> {
    let Some(a) = &c.activity else { return Vec::new() };
    let now = vgpu_region::monotonic_ns();
    let mut out = Vec::new();
    for d in 0..ndev.min(vgpu_region::MAX_DEVICES) {
        let ahead = a.until(d).saturating_sub(now);
        let sm = c.sm_ewma[d];
        // (NaN, before NVML's first sample of it, is no measured work)
        let idle = sm.is_nan() || sm < CLAIM_MIN_SM;
        c.claim_strikes[d] = if ahead > CLAIM_AHEAD_NS && idle { c.claim_strikes[d].saturating_add(1) } else { 0 };
        if c.claim_strikes[d] >= CLAIM_STRIKES {
            c.claim_strikes[d] = 0;
            a.clear(d);
            out.push((d, ahead, if sm.is_nan() { 0.0 } else { sm }));
        }
    }
    out
}

impl Cached {
    /// Device `dev`'s GPU time as NVML measures it against what the slice's launches through
    /// libvgpu.so account for, where they account for it: beside a high-priority slice (`gated`:
    /// each launch notes its estimate in the activity file) or under an SM share that applies
    /// (`limited`: each launch is charged). A process that skips the interposer (while mapping the
    /// region, so that it passes for one of the slice's) is held by neither and accounts nothing.
    /// Some((measured, accounted)) once that has lasted [`BYPASS_STRIKES`] passes, and while it lasts.
    fn bypass(&mut self, dev: usize, now_ns: u64, gated: bool, limited: bool) -> Option<(f64, f64)> {
        let noted = self.activity.as_ref().map_or(0, |a| a.noted(dev));
        let (last, last_at) = self.noted[dev];
        if last_at > 0 && now_ns > last_at {
            let share = (noted.wrapping_sub(last) as f64 * 100.0 / (now_ns - last_at) as f64).clamp(0.0, 100.0);
            self.noted_ewma[dev] = 0.8 * self.noted_ewma[dev] + 0.2 * share;
        }
        self.noted[dev] = (noted, now_ns);
        let accounted = match (gated, limited) {
            (false, false) => {
                self.bypass_strikes[dev] = 0;
                return None;
            }
            (true, false) => self.noted_ewma[dev],
            (false, true) => self.sm_acct_ewma[dev],
            (true, true) => self.noted_ewma[dev].max(self.sm_acct_ewma[dev]),
        };
        let measured = if self.sm_ewma[dev].is_nan() { 0.0 } else { self.sm_ewma[dev] };
        let s = &mut self.bypass_strikes[dev];
        *s = if beyond_account(measured, accounted) { s.saturating_add(1) } else { 0 };
        (*s >= BYPASS_STRIKES).then_some((measured, accounted))
    }

    /// One GPU of the slice, after NVML was read: marks it shared or not for the interposer,
    /// smooths its processes' SM samples and what its launches were charged, dates its latest
    /// kernel, publishes its utilisation and corrects its SM rate while it is throttled. The
    /// throttled launches so far.
    fn follow_sm(
        &mut self,
        dev: usize,
        sm_share: u32,
        gpu: Option<&GpuSample>,
        fresh: bool,
        clock: Clock,
        publish_ms: u64,
    ) -> u64 {
        let layout = self.region.layout();
        let d = &layout.devices[dev];
        let gpu_index = gpu.map_or(u32::MAX, |g| g.index);
        let nv = &self.nvml;
        let mine = || nv.iter().filter(move |p| p.gpu_index == gpu_index);
        if let Some(g) = gpu {
            let shared = g.slices > 1 || g.outsiders;
            d.sm_flags.store(SM_MANAGED | if shared { SM_SHARED } else { 0 }, Relaxed);
        }
        let sm = mine().map(|p| p.sm).sum::<u32>().min(100) as f64;
        let e = &mut self.sm_ewma[dev];
        *e = if e.is_nan() { sm } else { 0.8 * *e + 0.2 * sm };
        // What the interposers charged since the last pass, as a share of the time between.
        let (acct, at) = (self.region.sm_accounted_ns(dev), clock.now_ns);
        let (last, last_at) = self.sm_acct[dev];
        // The slice's latest kernel: launches charged since the last pass (the budget moves
        // only with launches), or NVML's newest sample of its processes above 0 (the only
        // sign while no SM limit applies). Samples are dated by NVML; never in the future.
        let sampled_at = mine().filter(|p| p.sm > 0).map(|p| (p.sm_at_us / 1000).min(clock.wall_ms)).max();
        let charged = last_at > 0 && acct != last;
        let lk = &mut self.last_kernel_ms[dev];
        *lk = (*lk).max(sampled_at.unwrap_or(0)).max(if charged { clock.wall_ms } else { 0 });
        if last_at > 0 && at > last_at {
            let share = (acct.wrapping_sub(last) as f64 * 100.0 / (at - last_at) as f64).max(0.0);
            let e = &mut self.sm_acct_ewma[dev];
            *e = 0.8 * *e + 0.2 * share;
        }
        self.sm_acct[dev] = (acct, at);
        // The slice's utilisation, for NVML in its containers (libvgpu answers
        // nvmlDeviceGetUtilizationRates with it): its processes' samples where the GPU's
        // add up; else, under an SM limit, what its launches were charged; else not known
        // (NVML there shows the GPU's).
        let util = if gpu.is_some_and(|g| !g.sm_feedback_held && !g.sm_samples_fail) {
            Some(self.sm_ewma[dev].round() as u32)
        } else if (1..100).contains(&self.region.sm_limit(dev)) && last_at > 0 {
            Some(self.sm_acct_ewma[dev].round() as u32)
        } else {
            None
        };
        self.region.set_utilization(dev, util, publish_ms);
        let throttled = d.sm_throttled_launches.load(Relaxed);
        // The controller: only while the slice is throttled (its demand exceeds its budget),
        // from new samples (not the first, which covers NVML's whole window), after ten of
        // them, outside a 1-point dead band, and not while the GPU's samples do not add up
        // (a pass where they do not restarts the count).
        let limit = self.region.sm_limit(dev).min(sm_share.max(1));
        let held = gpu.is_none_or(|g| g.sm_feedback_held || g.sm_samples_fail);
        let sampled = fresh && mine().any(|p| p.sm_new);
        if throttled <= self.throttled_launches[dev] || held || !(1..100).contains(&sm_share) {
            self.streak[dev] = 0;
            self.sm_ctl[dev] = f64::NAN;
        } else if sampled {
            self.streak[dev] += 1;
            let e = &mut self.sm_ctl[dev];
            *e = if e.is_nan() { sm } else { 0.8 * *e + 0.2 * sm };
            if self.streak[dev] >= CONTROL_AFTER && (self.sm_ctl[dev] - limit as f64).abs() >= 1.0 {
                let old = d.sm_rate_ppm.load(Relaxed);
                let new = corrected_rate(old, limit, self.sm_ctl[dev]);
                if new != old {
                    d.sm_rate_ppm.store(new, Relaxed);
                }
            }
        }
        // Throttled, but no new sample in this pass: the run goes on.
        self.throttled_launches[dev] = throttled;
        throttled
    }
}

/// When a pass runs: monotonic ns (never 0) and wall-clock ms.
#[derive(Clone, Copy)]
struct Clock {
    now_ns: u64,
    wall_ms: u64,
}

/// What NVML said of each GPU in a pass: the sample and its processes (PID, bytes).
type Queried = Vec<(GpuSample, Vec<(u32, u64)>)>;

/// The agent's part of a process's charge on a device after a pass: `added` now; `up`, the excess
/// (NVML's figure less the process's own account) this pass and the last; `down`, the most the
/// excess can be this pass and the two before: the excess plus what the container had reserved for
/// allocations the driver had not made yet, or `u64::MAX` for a pass during which the process's
/// charge moved. None: unchanged. A measurement can be off either way for a moment: right after a
/// free NVML can still report the old usage (too much), and while the process's calls are between
/// their charge and the driver's work it shows too little: an allocation is charged before the
/// driver makes it (the region counts those bytes in flight), a free released after the driver
/// freed it and a pool's shrinking at a synchronisation charged after it (those the agent sees only
/// as a charge that moved while NVML measured). So the part rises once two passes in a row saw
/// more, to the smaller of the two, and falls once three in a row saw less, to the largest of the
/// three (a pass after which the container was refused an allocation cannot show less: see
/// [`true_up`]). Moves under 8 MiB are left alone, except to nothing.
fn corrected(added: u64, up: [u64; 2], down: [u64; 3]) -> Option<u64> {
    let up = up[0].min(up[1]);
    let down = down[0].max(down[1]).max(down[2]);
    let target = if up > added {
        up
    } else if down < added {
        down
    } else {
        return None;
    };
    (target.abs_diff(added) >= TRUE_UP_STEP || target == 0).then_some(target)
}

/// The agent's share of one process's accounted usage, per device.
#[derive(Clone, Copy, Default)]
struct TrueUp {
    added: [u64; vgpu_region::MAX_DEVICES],
    /// The excess the last pass saw; and as [`corrected`] takes them (`u64::MAX` for a pass that
    /// cannot show less), the last two.
    last_excess: [u64; vgpu_region::MAX_DEVICES],
    last_less: [[u64; 2]; vgpu_region::MAX_DEVICES],
    /// Seen in the current pass.
    seen: bool,
}

/// Changes smaller than this are left alone (NVML's figures move by a few MiB on their own).
const TRUE_UP_STEP: u64 = 8 << 20;

/// Charges each live process of a slice for what the driver holds for it beyond what it charged
/// itself (NVML's per-process figure minus its own accounting): memory the interposer cannot see,
/// such as a CUDA context bigger than `VGPU_CONTEXT_OVERHEAD`, or modules loaded later. The agent's
/// part is kept per process and moved as the excess moves (see [`corrected`]); it goes when the
/// process's slot does.
fn true_up(c: &mut Cached, slice: &str, live: &mut [LiveSlot], live_slot: &[usize], gpu_index: &[Option<u32>]) {
    // Bytes reserved for calls the driver had not answered, at most, while NVML measured: NVML's
    // figures may not show them yet. (A process killed during such a call leaves its bytes counted:
    // cleared once the slice has no process left.)
    if c.live.is_empty() {
        c.region.clear_in_flight();
    }
    let in_flight: [u64; vgpu_region::MAX_DEVICES] =
        std::array::from_fn(|dev| c.in_flight_before[dev].max(c.region.in_flight(dev)));
    // Whether the container was refused an allocation on the device since the last pass: it is at
    // its limit with calls being made, pools settled while other threads' allocations are in
    // flight (a settle can charge a pool for one of them twice until the next), and its charge is
    // no steady ground to lower a correction on. (On an H200, 16 threads refused 15 920 times in a
    // 4 GiB slice saw the agent's correction of their context fall from 518 MiB to 14 MiB.) Where
    // a wrong lowering costs most, then, it waits for three passes without refusals.
    let refusing: [bool; vgpu_region::MAX_DEVICES] = std::array::from_fn(|dev| {
        let now = c.region.layout().devices[dev].oom_rejections.load(Relaxed);
        std::mem::replace(&mut c.refusals[dev], now) != now
    });
    for j in c.live.clone() {
        let ((pid, host, used), slot) = (&mut live[j], live_slot[j]);
        // Its charge as read just before NVML's figures (None: a process new since).
        let before = c.before_nvml.binary_search_by_key(&slot, |b| b.0).ok().map(|k| c.before_nvml[k]);
        let before = before.filter(|b| b.1 == *pid).map(|b| b.2);
        // What NVML says the process holds beyond its own account, per device (most processes:
        // nothing, and then no entry is made or looked for again).
        let mut excess = [0u64; vgpu_region::MAX_DEVICES];
        let mut steady = [false; vgpu_region::MAX_DEVICES];
        let t = c.trued.get_mut(&(slot, *pid));
        for (dev, gi) in gpu_index.iter().enumerate() {
            let Some(gi) = *gi else { continue };
            let measured: u64 = c
                .nvml
                .iter()
                .filter(|p| p.gpu_index == gi && ((*host != 0 && p.host_pid == *host) || p.pid == *pid))
                .map(|p| p.bytes)
                .sum();
            // The larger of the two readings: what its calls charged is no more than that while
            // NVML measured (barring a charge that came and went in between).
            let charged = before.map_or(used[dev], |b| b[dev].max(used[dev]));
            steady[dev] = before.is_some_and(|b| b[dev] == used[dev]) && !refusing[dev];
            let own = charged.saturating_sub(t.as_ref().map_or(0, |t| t.added[dev]));
            excess[dev] = measured.saturating_sub(own);
        }
        let t = match t {
            Some(t) => t,
            None if excess.iter().all(|&e| e == 0) => continue,
            None => c.trued.entry((slot, *pid)).or_default(),
        };
        t.seen = true;
        for dev in 0..gpu_index.len() {
            let less = if steady[dev] { excess[dev].saturating_add(in_flight[dev]) } else { u64::MAX };
            let [l1, l2] = t.last_less[dev];
            let up = [excess[dev], t.last_excess[dev]];
            (t.last_excess[dev], t.last_less[dev]) = (excess[dev], [less, l1]);
            let added = t.added[dev];
            if let Some(target) = corrected(added, up, [less, l1, l2]) {
                let delta = target as i64 - added as i64;
                if c.region.adjust_for(slot, *pid, dev, delta) {
                    // Each change, with what it was made on: the figures to tell a wrong one by.
                    tracing::info!(
                        slice,
                        pid = *pid,
                        host_pid = *host,
                        device = dev,
                        from_mib = added >> 20,
                        to_mib = target >> 20,
                        beyond_calls_mib = excess[dev] >> 20,
                        steady = steady[dev],
                        refusing = refusing[dev],
                        "memory the driver holds beyond a process's calls: its correction changed"
                    );
                    t.added[dev] = target;
                    used[dev] = used[dev].saturating_add_signed(delta);
                }
            }
        }
    }
    // Entries of processes gone, or whose excess is gone and was given back, are dropped.
    c.trued.retain(|_, t| {
        std::mem::take(&mut t.seen) && (t.added.iter().any(|&a| a > 0) || t.last_excess.iter().any(|&e| e > 0))
    });
}

/// New samples, in a run of throttled passes, before the controller acts (a second when every 100 ms
/// pass brings one): a workload starting, stopping or changing phase is not corrected for.
const CONTROL_AFTER: u32 = 10;

/// A process's latest NVML SM sample counts for this many passes after it arrived: NVML samples each
/// process on its own period (about 1/6 s on recent GPUs, so not in every 100 ms pass), and the last
/// value stands for the process until a newer one comes. A process whose samples stop (it went idle)
/// counts as 0 after that.
const SAMPLE_STALE_PASSES: u64 = 20;

/// Per-process SM samples of a GPU that add up to more than 100 %, or to more than the GPU's own
/// utilisation while that is steady, by more than this (points) are not shares of its time. An H200
/// with two time-sliced processes reported 92 % and 93 % for them while the GPU was 99 % busy and
/// their throughputs were 27 % and 67 % of one alone: each process was credited nearly the whole
/// GPU. Acting on that would drive both budgets to the controller's floor. The margin covers the
/// different windows of the two figures; the GPU's figure is only compared with while steady (it
/// trails the per-process samples when a workload starts, by up to its window of up to a second).
const OVERLAP_MARGIN: u32 = 25;

/// Passes over which the GPU's utilisation must stay within `OVERLAP_MARGIN` points to count as steady.
const STEADY_PASSES: usize = 10;

/// How long a GPU's samples must fail to add up without a break before the GPU is reported as held
/// (status, metric, log): longer than a workload's start, when the GPU's figure (a window of up to a
/// second) trails its processes' samples. The controller itself skips every pass that fails.
const HELD_AFTER_NS: u64 = 2_000_000_000;

/// How long a GPU stays reported as held after its samples last failed to add up.
const HELD_FOR_NS: u64 = 1_000_000_000;

/// Per GPU: what the check that its processes' SM samples add up keeps between passes.
struct Feedback {
    /// Its utilisation in the last `STEADY_PASSES` passes (a ring; `u32::MAX` not yet seen).
    util: [u32; STEADY_PASSES],
    /// Since when (monotonic ns) its samples have failed to add up, without a break.
    failing_since: Option<u64>,
    /// Reported held until then (monotonic ns), and whether it was in the last pass.
    held_until: u64,
    held: bool,
}

/// A process's latest NVML SM sample on one GPU.
#[derive(Clone, Copy)]
struct SmSample {
    sm: u32,
    /// NVML's timestamp (us).
    timestamp: u64,
    /// The pass that read it.
    pass: u64,
}

/// A live slot: (PID in the container, host PID or 0, bytes per device).
type LiveSlot = (u32, u32, [u64; vgpu_region::MAX_DEVICES]);

/// A slice's process as NVML reports it on one GPU.
#[derive(Clone, Copy, Debug)]
struct NvmlProc {
    gpu_index: u32,
    host_pid: u32,
    /// Its PID inside the container.
    pid: u32,
    bytes: u64,
    /// Its latest SM sample (percent; 0 when none is current).
    sm: u32,
    /// Whether that sample arrived in this pass.
    sm_new: bool,
    /// NVML's timestamp of that sample (wall-clock us; 0 when none).
    sm_at_us: u64,
}

struct ProcOwner {
    start: u64,
    /// (slice, PID inside the container)
    owner: Option<(String, u32)>,
    /// The list of slices it was judged against ([`Monitor::lists`]): no owner is believed only
    /// while that list stands (the process may map a slice newer than the pass's list).
    list: u64,
}

/// What one GPU looked like in a pass.
#[derive(Clone, Debug, Default)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub memory_used: u64,
    pub memory_total: u64,
    /// NVML has no memory figures for it (see [`crate::discovery::memory`]).
    pub unified_memory: bool,
    pub utilization: u32,
    /// Its processes' SM samples have not added up for a while (see [`OVERLAP_MARGIN`],
    /// [`HELD_AFTER_NS`]): the SM controller holds its corrections for the slices on it.
    pub sm_feedback_held: bool,
    /// They do not add up in this pass: the controller skips it.
    pub sm_samples_fail: bool,
    /// Slices using it, and whether processes outside every slice use it.
    pub slices: u32,
    pub outsiders: bool,
    /// Outsiders in containers of DRA claims with admin access to it (not escapes).
    pub admin_processes: Vec<pb::AdminProcess>,
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
    pub new_escapes: [u64; 4],
    /// Those escapes, with the action taken on each.
    pub fresh: Vec<pb::Escape>,
    /// Bytes released from dead processes' slots.
    pub reclaimed: u64,
    /// (slice, what) put back to the records this pass: limits or gates a container rewrote.
    pub restored: Vec<(String, String)>,
    /// (slice, why) of the high-priority slices whose priority this pass suspended.
    pub suspended: Vec<(String, String)>,
}

/// The monitor's state between passes. What it keeps per slice is aligned with the agent's list of
/// slices (realigned only when that list changes), and the per-pass indexes are kept (cleared, not
/// dropped) and keyed by position in that list: a pass at 16 GPUs x 128 slices otherwise spent most
/// of its own time allocating, freeing and hashing (measured with perf; docs/benchmarks.md).
pub struct Monitor {
    /// Per slice of `list`, in its order: its open region and what the pass keeps for it.
    regions: Vec<Option<Cached>>,
    /// The agent's list of slices that `regions` is aligned with.
    list: Option<Arc<Vec<Slice>>>,
    /// Slice name -> position in `list`.
    index: HashMap<String, usize>,
    /// The GPUs' UUIDs in the last pass, in NVML's order (the slices' `gpu_pos` refer to them).
    gpu_uuids: Vec<String>,
    procs: HashMap<u32, ProcOwner>,
    /// Lists of slices seen (each realignment counts one).
    lists: u64,
    /// (GPU index, host PID) of the processes outside every slice in the last pass: one is an
    /// escape when the next pass, with its own list of slices, finds it outside every slice again
    /// (a container started between a pass's list and its NVML query is not one).
    suspects: HashSet<(u32, u32)>,
    util_seen: HashMap<u32, u64>,
    /// (GPU index, host PID) -> that process's latest SM sample.
    sm_samples: HashMap<(u32, u32), SmSample>,
    /// GPU index -> the check of its per-process samples.
    feedback: HashMap<u32, Feedback>,
    /// The origin of the pass's monotonic timestamps.
    epoch: std::time::Instant,
    active: HashSet<String>,
    /// Escape key -> (PID, who runs it), read from /proc when the escape (or its culprit) was first
    /// seen.
    owners: HashMap<String, (u32, procfs::Owner, String)>,
    action: EscapeAction,
    passes: u64,
    /// Per pass: the GPUs with a high-priority slice whose priority stands, by their UUID's hash
    /// (kept allocated from pass to pass).
    gated: HashSet<u64>,
    /// Slices whose region could not be opened, and when to try again (every 10 s, logged once
    /// per try instead of every pass).
    unopened: HashMap<String, std::time::Instant>,
    /// Per pass: every slice's live slots (each slice's range is in its `Cached`).
    live: Vec<LiveSlot>,
    /// Per pass: the slot index of each entry of `live`.
    live_slot: Vec<usize>,
    /// Per pass: host PID -> (slice index, PID inside the container), from the slots.
    by_host: HashMap<u32, (usize, u32)>,
    /// Per pass: region file -> slice index.
    by_file: Vec<(FileId, usize)>,
    /// Per pass: host PIDs NVML lists on some GPU; (slice index, PID inside) of those attributed.
    alive: HashSet<u32>,
    alive_inner: HashSet<(usize, u32)>,
    /// Per pass: GPUs whose utilisation samples cover exactly the time since the last pass.
    fresh: HashSet<u32>,
    /// Slices per GPU (by position in `gpu_uuids`).
    users: Vec<u32>,
    /// Whether to charge processes for what the driver holds beyond their own account.
    true_up: bool,
    /// How long a slice's published utilisation stays good (three passes, at least 2 s): what
    /// NVML in the container shows while the agent runs, and not long after it stops.
    publish_ms: u64,
    /// GPU indices where the last pass saw an MPS server: their MPS client lists are read too.
    mps: HashSet<u32>,
    /// The DRA claims with admin access: their containers' processes are not escapes.
    admitted: Arc<Vec<Admitted>>,
}

/// A DRA claim prepared with admin access (monitoring and diagnostics beside the claims that hold
/// the devices): its containers use its GPUs outside every slice, and are not escapes. A process is
/// one of them when the claim's record, bind-mounted into its containers, is the same file at
/// `path` in the process's mount namespace: a process elsewhere cannot have that mount.
#[derive(Clone, Debug)]
pub struct Admitted {
    /// `namespace/name`.
    pub claim: String,
    /// Where its containers see the record.
    pub path: std::path::PathBuf,
    /// The record's identity.
    pub file: FileId,
    /// UUIDs of the GPUs it covers (of a MIG device, its parent's too).
    pub gpus: Vec<String>,
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
            regions: Vec::new(),
            list: None,
            index: HashMap::default(),
            gpu_uuids: Vec::new(),
            procs: HashMap::default(),
            lists: 0,
            suspects: HashSet::default(),
            util_seen: HashMap::default(),
            sm_samples: HashMap::default(),
            feedback: HashMap::default(),
            owners: HashMap::default(),
            epoch: std::time::Instant::now(),
            active: HashSet::default(),
            action,
            passes: 0,
            gated: HashSet::default(),
            unopened: HashMap::default(),
            live: Vec::new(),
            live_slot: Vec::new(),
            by_host: HashMap::default(),
            by_file: Vec::new(),
            alive: HashSet::default(),
            alive_inner: HashSet::default(),
            fresh: HashSet::default(),
            users: Vec::new(),
            true_up: true,
            publish_ms: 2000,
            mps: HashSet::default(),
            admitted: Default::default(),
        }
    }

    /// The DRA claims with admin access now (the agent's list, shared).
    pub fn set_admitted(&mut self, admitted: Arc<Vec<Admitted>>) {
        self.admitted = admitted;
    }

    /// "<namespace>/<name>" of the pod with UID `uid`, where a slice belongs to it: by the slice's
    /// `pod-uid` label (HAMi and Volcano modes), else by the pod UID in the cgroup of one of the
    /// slice's live processes (any mode that labels slices with their pod). Empty otherwise.
    fn pod_named(&self, slices: &[Slice], uid: &str) -> String {
        if uid.is_empty() {
            return String::new();
        }
        let name = |s: &Slice| {
            let get = |k: &str| s.labels.get(k).map_or("", String::as_str);
            format!("{}/{}", get("namespace"), get("pod"))
        };
        if let Some(s) = slices.iter().find(|s| s.labels.get("pod-uid").is_some_and(|u| u == uid)) {
            return name(s);
        }
        let mut asked = HashSet::default();
        // Processes attributed by the region they map (not by what a slot says).
        let verified =
            self.procs.iter().filter_map(|(&host, o)| Some((host, *self.index.get(o.owner.as_ref()?.0.as_str())?)));
        for (host, i) in verified {
            let Some(s) = slices.get(i).filter(|s| s.labels.contains_key("pod")) else { continue };
            if asked.insert(i) && procfs::owner(host).pod_uid == uid {
                return name(s);
            }
        }
        String::new()
    }

    /// The claim with admin access to GPU `gpu` in whose container process `pid` is, if any.
    fn admitted(&self, pid: u32, gpu: &str) -> Option<String> {
        self.admitted
            .iter()
            .find(|a| {
                a.gpus.iter().any(|g| g == gpu) && procfs::file_id(&procfs::in_root(pid, &a.path)) == Some(a.file)
            })
            .map(|a| a.claim.clone())
    }

    /// One pass over `slices` (the agent's record, as shared by the agent: a new list is recognised
    /// by its address) and every GPU NVML reports.
    /// Turns the true-up of what the driver holds beyond each process's account on or off (on by
    /// default; the agent's `memory_true_up`).
    pub fn with_true_up(mut self, on: bool) -> Monitor {
        self.true_up = on;
        self
    }

    /// Passes run every `ms`: what the slices' published utilisation is good for follows.
    pub fn with_interval(mut self, ms: u64) -> Monitor {
        self.publish_ms = ms.saturating_mul(3).max(2000);
        self
    }

    pub fn pass(&mut self, nvml: &Nvml, store: &SliceStore, slices: &Arc<Vec<Slice>>) -> Pass {
        let mut pass = Pass::default();
        let changed = self.reopen(store, slices);
        let slices: &[Slice] = slices;
        if self.true_up {
            self.note_before_nvml();
        }
        // NVML first: which processes hold contexts now.
        self.passes += 1;
        let queried = self.query(nvml);
        let full = self.passes % 10 == 1;
        if full {
            for s in slices {
                for (file, len) in store.bound_files(&s.name) {
                    tracing::warn!(slice = %s.name, file, bytes = len, "a container grew its slice's file; cut back to its size");
                }
            }
            pass.restored = store.check();
        }
        self.note_alive(&queried);
        self.place(slices, &queried, changed);
        self.reap(slices, &queried, full, &mut pass);
        // Monotonic ns (never 0) of this pass.
        let now_ns = self.epoch.elapsed().as_nanos() as u64 + 1;
        self.attribute(slices, queried, now_ns, &mut pass);
        self.gated.clear();
        for s in slices.iter().filter(|s| s.priority == crate::slices::Priority::High) {
            if !store.priority_suspended(&s.name) {
                self.gated.extend(s.gpus.iter().map(|g| crate::slices::fnv1a(g.uuid.bytes())));
            }
        }
        self.account(slices, now_ns, &mut pass);
        for (name, _) in &pass.suspended {
            store.suspend_priority(name, PRIORITY_SUSPENSION);
        }
        self.act_on_escapes(slices, &mut pass);
        pass
    }

    /// Aligns with a new slice list, drops the regions that shrank under their mapping and opens
    /// those not open: whether any slice's region changed.
    fn reopen(&mut self, store: &SliceStore, slices: &Arc<Vec<Slice>>) -> bool {
        let realigned = !self.list.as_ref().is_some_and(|l| Arc::ptr_eq(l, slices));
        if realigned {
            self.realign(slices);
        }
        let now = std::time::Instant::now();
        let mut opened = false;
        // A region that shrank under its mapping (its container truncated it) reads as zeros from
        // then on: dropped, made whole in place (the same file, which the container has mounted:
        // its next processes share the slice's quota again) and opened again; where it cannot be
        // repaired, tried again in 10 s (libvgpu.so refuses the container's allocations meanwhile).
        for (c, s) in self.regions.iter_mut().zip(slices.iter()) {
            if c.as_ref().is_some_and(|c| c.region.faulted()) {
                tracing::error!(slice = %s.name, "the slice's region shrank under the agent (truncated by its container?); dropped");
                *c = None;
                self.procs.retain(|_, p| p.owner.as_ref().is_none_or(|(n, _)| *n != s.name));
                match store.repair_region(&s.name) {
                    Ok(()) => tracing::warn!(slice = %s.name, "the slice's region repaired in place"),
                    Err(e) => {
                        tracing::error!(slice = %s.name, error = %e, "the slice's region could not be repaired");
                        self.unopened.insert(s.name.clone(), now + std::time::Duration::from_secs(10));
                    }
                }
            }
        }
        for (i, s) in slices.iter().enumerate() {
            if self.regions[i].is_none() && self.unopened.get(&s.name).is_none_or(|t| *t <= now) {
                self.regions[i] = self.open(store, s);
                opened |= self.regions[i].is_some();
            }
        }
        realigned || opened
    }

    /// What each slot said it held before NVML was read (the true-up compares).
    fn note_before_nvml(&mut self) {
        for c in self.regions.iter_mut().flatten() {
            let before = &mut c.before_nvml;
            before.clear();
            c.in_flight_before = std::array::from_fn(|dev| c.region.in_flight(dev));
            c.region.for_each_slot(|slot, pid, _, used| before.push((slot, pid, *used)));
        }
    }

    /// Every GPU's memory, utilisation, compute processes and per-process SM samples.
    fn query(&mut self, nvml: &Nvml) -> Queried {
        let count = nvml.device_count().unwrap_or(0);
        let mut queried = Vec::with_capacity(count as usize);
        self.fresh.clear();
        for i in 0..count {
            let mut g = GpuSample { index: i, ..Default::default() };
            let sample = (|| -> Result<_, String> {
                let d = nvml.device_by_index(i).map_err(|e| nvml_err("handle", e))?;
                g.uuid = d.uuid().map_err(|e| nvml_err("uuid", e))?;
                g.utilization = d.utilization_rates().map(|u| u.gpu).unwrap_or(0);
                let used = |p: nvml_wrapper::struct_wrappers::device::ProcessInfo| {
                    (p.pid, if let UsedGpuMemory::Used(b) = p.used_gpu_memory { b } else { 0 })
                };
                let mut procs: Vec<(u32, u64)> = d
                    .running_compute_processes()
                    .map_err(|e| nvml_err("processes", e))?
                    .into_iter()
                    .map(used)
                    .collect();
                // Where an MPS server runs, its clients' work is in its context: each client is in
                // NVML's MPS list, with its own memory, and is attributed like any process.
                if self.mps.contains(&i) {
                    let clients: Vec<(u32, u64)> =
                        d.mps_running_compute_processes().unwrap_or_default().into_iter().map(used).collect();
                    procs.retain(|(pid, _)| !clients.iter().any(|(c, _)| c == pid));
                    procs.extend(clients);
                }
                // A unified-memory GPU's total is the host's memory, read once.
                static HOST_MEMORY: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
                (g.memory_total, g.memory_used, g.unified_memory) =
                    crate::discovery::memory(&d, &procs, || *HOST_MEMORY.get_or_init(procfs::mem_total))
                        .map_err(|e| nvml_err("memory", e))?;
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
                    queried.push((g, Vec::new()));
                    continue;
                }
            };
            if let Some(t) = samples.iter().map(|s| s.timestamp).max() {
                // The first call covers NVML's whole sample window, not one pass.
                if self.util_seen.insert(i, t).is_some() {
                    self.fresh.insert(i);
                }
            }
            for x in &samples {
                let e = self.sm_samples.entry((i, x.pid)).or_insert(SmSample { sm: 0, timestamp: 0, pass: 0 });
                if x.timestamp >= e.timestamp {
                    *e = SmSample { sm: x.sm_util, timestamp: x.timestamp, pass: self.passes };
                }
            }
            queried.push((g, procs));
        }
        queried
    }

    /// The processes NVML lists, by host PID and as their slices know them.
    fn note_alive(&mut self, queried: &Queried) {
        self.alive.clear();
        self.alive.extend(queried.iter().flat_map(|(_, p)| p.iter().map(|x| x.0)));
        self.alive_inner.clear();
        for (host, o) in &self.procs {
            if let (true, Some((slice, pid))) = (self.alive.contains(host), &o.owner) {
                if let Some(&i) = self.index.get(slice.as_str()) {
                    self.alive_inner.insert((i, *pid));
                }
            }
        }
    }

    /// Which GPUs each slice uses: worked out again when the slices, their regions or the GPUs
    /// changed.
    fn place(&mut self, slices: &[Slice], queried: &Queried, changed: bool) {
        let gpus_changed =
            self.gpu_uuids.len() != queried.len() || self.gpu_uuids.iter().zip(queried).any(|(u, (g, _))| *u != g.uuid);
        if changed || gpus_changed {
            self.gpu_uuids = queried.iter().map(|(g, _)| g.uuid.clone()).collect();
            let gpu_at: HashMap<&str, usize> =
                queried.iter().enumerate().map(|(k, (g, _))| (g.uuid.as_str(), k)).collect();
            for (c, s) in self.regions.iter_mut().zip(slices) {
                let Some(c) = c else { continue };
                c.gpu_pos = [usize::MAX; vgpu_region::MAX_DEVICES];
                for (dev, sg) in s.gpus.iter().enumerate().take(vgpu_region::MAX_DEVICES) {
                    c.gpu_pos[dev] = gpu_at.get(sg.uuid.as_str()).copied().unwrap_or(usize::MAX);
                }
            }
            self.users.clear();
            // Every slice counts as a user of its GPUs, whether or not its region could be opened.
            self.users.resize(queried.len(), 0);
            for sg in slices.iter().flat_map(|s| &s.gpus) {
                if let Some(&k) = gpu_at.get(sg.uuid.as_str()) {
                    self.users[k] += 1;
                }
            }
        }
    }

    /// Slots: reclaims the dead (a full lock test every tenth pass) and indexes the living.
    fn reap(&mut self, slices: &[Slice], queried: &Queried, full: bool, pass: &mut Pass) {
        self.live.clear();
        self.live_slot.clear();
        self.by_host.clear();
        for (i, c) in self.regions.iter_mut().enumerate() {
            let Some(c) = c else { continue };
            // A process NVML lists (by host PID, or as last attributed) is alive: no lock test, except
            // in every tenth pass (a PID reused within a pass cannot hide a death for long).
            let (alive, alive_inner) = (&self.alive, &self.alive_inner);
            // What a slot said it held is the container's word: what counts as reclaimed is what
            // NVML last measured for its process, at most (a scribbled slot added up to the
            // slice's limit to the node's counter on each scribble).
            let last_seen = &mut c.last_seen;
            let mut confirmed: u64 = 0;
            c.region.reap_where_each(
                |pid, host| full || !((host != 0 && alive.contains(&host)) || alive_inner.contains(&(i, pid))),
                |pid, host, bytes| {
                    let its = |p: &NvmlProc| (host != 0 && p.host_pid == host) || p.pid == pid;
                    let seen: u64 = last_seen.iter().filter(|p| its(p)).map(|p| p.bytes).fold(0, u64::saturating_add);
                    confirmed = confirmed.saturating_add(bytes.min(seen));
                    last_seen.retain(|p| !its(p));
                },
            );
            // And no more than the slice's GPUs have.
            let total =
                |dev: usize| c.gpu_pos.get(dev).and_then(|&k| queried.get(k)).map_or(0, |(g, _)| g.memory_total);
            let cap: u64 = slices[i]
                .gpus
                .iter()
                .enumerate()
                .map(|(dev, g)| if g.memory > 0 { g.memory } else { total(dev) })
                .fold(0, u64::saturating_add);
            pass.reclaimed = pass.reclaimed.saturating_add(confirmed.min(cap));
            let start = self.live.len();
            let (live, live_slot, by_host) = (&mut self.live, &mut self.live_slot, &mut self.by_host);
            c.region.for_each_slot(|slot, pid, host, used| {
                if host != 0 {
                    by_host.insert(host, (i, pid));
                }
                live.push((pid, host, *used));
                live_slot.push(slot);
            });
            c.live = start..self.live.len();
            // Only processes with a slot are remembered.
            let slots = &self.live[c.live.clone()];
            c.last_seen.retain(|p| slots.iter().any(|l| l.0 == p.pid));
            c.nvml.clear();
        }
        self.by_file.clear();
        self.by_file.extend(self.regions.iter().enumerate().filter_map(|(i, c)| Some((c.as_ref()?.id?, i))));
    }

    /// Each GPU process: its slice's (with its SM share), an MPS server, or an escape.
    fn attribute(&mut self, slices: &[Slice], queried: Queried, now_ns: u64, pass: &mut Pass) {
        let mut seen_pids = HashSet::default();
        let mut mps = HashSet::default();
        let mut suspects = HashSet::default();
        // Samples older than a few passes no longer stand for their process.
        let passes = self.passes;
        self.sm_samples.retain(|_, x| x.pass + SAMPLE_STALE_PASSES >= passes);
        for (k, (mut g, procs)) in queried.into_iter().enumerate() {
            if g.error.is_some() {
                pass.gpus.push(g);
                continue;
            }
            g.slices = self.users[k];
            // Do the GPU's per-process samples add up to (no more than) its utilisation?
            let (mut sum, mut active) = (0u32, 0u32);
            for (pid, _) in &procs {
                if let Some(x) = self.sm_samples.get(&(g.index, *pid)).filter(|x| x.sm > 0) {
                    sum += x.sm;
                    active += 1;
                }
            }
            let f = self.feedback.entry(g.index).or_insert(Feedback {
                util: [u32::MAX; STEADY_PASSES],
                failing_since: None,
                held_until: 0,
                held: false,
            });
            f.util[passes as usize % STEADY_PASSES] = g.utilization;
            let (lo, hi) = f.util.iter().fold((u32::MAX, 0), |(lo, hi), &u| (lo.min(u), hi.max(u)));
            let steady = hi != u32::MAX && hi - lo <= OVERLAP_MARGIN;
            let fail = active >= 2 && (sum > 100 + OVERLAP_MARGIN || (steady && sum > g.utilization + OVERLAP_MARGIN));
            f.failing_since = if fail { Some(f.failing_since.unwrap_or(now_ns)) } else { None };
            if f.failing_since.is_some_and(|t| now_ns - t >= HELD_AFTER_NS) {
                f.held_until = now_ns + HELD_FOR_NS;
            }
            let held = now_ns < f.held_until;
            if held && !f.held {
                tracing::warn!(gpu = %g.uuid, processes_sum = sum, utilization = g.utilization,
                    "per-process SM samples add up to more than the GPU's utilisation; SM feedback held");
            } else if !held && f.held {
                tracing::info!(gpu = %g.uuid, "per-process SM samples add up again; SM feedback resumed");
            }
            f.held = held;
            (g.sm_feedback_held, g.sm_samples_fail) = (held, fail);
            for (pid, mem) in procs {
                seen_pids.insert(pid);
                match self.owner(pid, slices) {
                    // A slice's process on a GPU that is not the slice's.
                    Some((i, _)) if !self.regions[i].as_ref().is_some_and(|c| c.gpu_pos.contains(&k)) => {
                        g.outsiders = true;
                        pass.escapes.push(pb::Escape {
                            kind: pb::escape::Kind::Unaccounted as i32,
                            gpu: g.uuid.clone(),
                            slice: slices[i].name.clone(),
                            pid,
                            measured: mem,
                            ..Default::default()
                        });
                    }
                    Some((i, inner)) => {
                        let x = self.sm_samples.get(&(g.index, pid));
                        let (sm, sm_new, sm_at_us) = x.map_or((0, false, 0), |x| (x.sm, x.pass == passes, x.timestamp));
                        if let Some(c) = &mut self.regions[i] {
                            let p = NvmlProc {
                                gpu_index: g.index,
                                host_pid: pid,
                                pid: inner,
                                bytes: mem,
                                sm,
                                sm_new,
                                sm_at_us,
                            };
                            c.nvml.push(p);
                            match c.last_seen.iter_mut().find(|x| x.pid == inner && x.gpu_index == g.index) {
                                Some(x) => *x = p,
                                None => c.last_seen.push(p),
                            }
                            // A process that could not name itself to NVML (in a PID namespace): its
                            // host PID goes into its slot, where NVML's process list inside the
                            // container (nvidia-smi) and the next passes find it.
                            if let Some(j) = c.live.clone().find(|&j| self.live[j].0 == inner && self.live[j].1 == 0) {
                                if c.region.set_host_pid(self.live_slot[j], inner, pid) {
                                    self.live[j].1 = pid;
                                }
                            }
                        }
                    }
                    // An MPS server runs its clients' work, theirs to account: not an escape.
                    None if g.slices > 0 && procfs::is_mps_server(pid) => {
                        mps.insert(g.index);
                    }
                    // Outside every slice: in a container of a DRA claim with admin access (beside
                    // the slices by design; it does share the GPU), or an escape.
                    None if g.slices > 0 => {
                        g.outsiders = true;
                        match self.admitted(pid, &g.uuid) {
                            Some(claim) => g.admin_processes.push(pb::AdminProcess { pid, claim, memory: mem }),
                            None => {
                                suspects.insert((g.index, pid));
                                if self.suspects.contains(&(g.index, pid)) {
                                    pass.escapes.push(pb::Escape {
                                        kind: pb::escape::Kind::Unaccounted as i32,
                                        gpu: g.uuid.clone(),
                                        pid,
                                        measured: mem,
                                        ..Default::default()
                                    });
                                }
                            }
                        }
                    }
                    None => {}
                }
            }
            pass.gpus.push(g);
        }
        self.procs.retain(|pid, _| seen_pids.contains(pid));
        self.mps = mps;
        self.suspects = suspects;
    }

    /// Per slice: usage, processes, SM flags and rate, over-limit escapes.
    fn account(&mut self, slices: &[Slice], now_ns: u64, pass: &mut Pass) {
        pass.slices.reserve(slices.len());
        let wall_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        for (c, s) in self.regions.iter_mut().zip(slices) {
            let Some(c) = c else { continue };
            if c.watched_since_ms == 0 {
                c.watched_since_ms = wall_ms;
            }
            let gpus = &pass.gpus;
            let gpu_index = |dev: usize| gpus.get(c.gpu_pos[dev]).map(|g| g.index);
            let gpu_index: [Option<u32>; vgpu_region::MAX_DEVICES] = std::array::from_fn(gpu_index);
            if self.true_up {
                let gpus = &gpu_index[..s.gpus.len().min(vgpu_region::MAX_DEVICES)];
                true_up(c, &s.name, &mut self.live, &self.live_slot, gpus);
            }
            let mut st = pb::SliceStatus {
                name: s.name.clone(),
                labels: s.labels.clone().into_iter().collect(),
                created_unix: s.created,
                watched_since_unix_ms: c.watched_since_ms,
                priority: crate::describe::priority_pb(s.priority) as i32,
                ..Default::default()
            };
            let (live, live_slot) = (&self.live[c.live.clone()], &self.live_slot[c.live.clone()]);
            for (dev, sg) in s.gpus.iter().enumerate().take(vgpu_region::MAX_DEVICES) {
                let gpu = pass.gpus.get(c.gpu_pos[dev]);
                let fresh = gpu.is_some_and(|g| self.fresh.contains(&g.index));
                let clock = Clock { now_ns, wall_ms };
                let throttled = c.follow_sm(dev, sg.sm, gpu, fresh, clock, self.publish_ms);
                let gated = s.priority == crate::slices::Priority::Normal
                    && self.gated.contains(&crate::slices::fnv1a(sg.uuid.bytes()));
                let limited = (1..100).contains(&sg.sm) && gpu.is_some_and(|g| g.slices > 1 || g.outsiders);
                let bypass = c.bypass(dev, now_ns, gated, limited);
                let layout = c.region.layout();
                let d = &layout.devices[dev];
                let gpu_index = gpu.map_or(u32::MAX, |g| g.index);
                let nv = &c.nvml;
                let mine = || nv.iter().filter(move |p| p.gpu_index == gpu_index);
                let measured: u64 = mine().map(|p| p.bytes).sum();
                if sg.memory > 0 && measured > sg.memory {
                    pass.escapes.push(pb::Escape {
                        kind: pb::escape::Kind::OverLimit as i32,
                        gpu: sg.uuid.clone(),
                        slice: s.name.clone(),
                        // The process most over its own account: the likely culprit.
                        pid: mine()
                            .max_by_key(|p| {
                                let acct = live
                                    .iter()
                                    .find(|(pid, host, _)| *host == p.host_pid || *pid == p.pid)
                                    .map_or(0, |(_, _, u)| u[dev]);
                                p.bytes.saturating_sub(acct)
                            })
                            .map_or(0, |p| p.host_pid),
                        measured,
                        limit: sg.memory,
                        ..Default::default()
                    });
                }
                if let Some((measured, accounted)) = bypass {
                    pass.escapes.push(pb::Escape {
                        kind: pb::escape::Kind::Bypass as i32,
                        gpu: sg.uuid.clone(),
                        slice: s.name.clone(),
                        // The process NVML measures busiest: the likely one.
                        pid: mine().max_by_key(|p| p.sm).map_or(0, |p| p.host_pid),
                        measured: measured.round() as u64,
                        limit: accounted.round() as u64,
                        ..Default::default()
                    });
                }
                let rate = d.sm_rate_ppm.load(Relaxed);
                let (spilled_allocations, spilled_bytes) = c.region.spilled(dev);
                st.gpus.push(pb::SliceGpuStatus {
                    uuid: sg.uuid.clone(),
                    gpu_index,
                    memory_limit: sg.memory,
                    // (the slots' sum, the container's word: no more than the GPU has)
                    memory_used: c
                        .region
                        .used(dev)
                        .min(gpu.map(|g| g.memory_total).filter(|&t| t > 0).unwrap_or(u64::MAX)),
                    memory_measured: measured,
                    sm_limit: sg.sm,
                    // Smoothed over about half a second (one pass alone is a noisy 100 ms sample).
                    sm_used: c.sm_ewma[dev].round() as u32,
                    throttled_ns: d.sm_throttled_ns.load(Relaxed),
                    throttled_launches: throttled,
                    sm_unmeasured_launches: d.sm_unmeasured.load(Relaxed) as u64,
                    oom_rejections: d.oom_rejections.load(Relaxed),
                    memory_peak: d.peak_used.load(Relaxed),
                    sm_rate_ppm: if rate == 0 { 1_000_000 } else { rate },
                    sm_accounted: c.sm_acct_ewma[dev].round() as u32,
                    last_kernel_unix_ms: c.last_kernel_ms[dev],
                    spilled_allocations,
                    spilled_bytes,
                });
                for ((pid, host, used), slot) in live.iter().zip(live_slot) {
                    // A host PID the slot names is shown only where NVML's process, attributed by the
                    // region it maps, confirms it (a container can write any PID into its slots).
                    let host_pid = if *host != 0 && mine().any(|p| p.host_pid == *host) {
                        *host
                    } else {
                        mine().find(|p| p.pid == *pid).map_or(0, |p| p.host_pid)
                    };
                    if used[dev] > 0 || (host_pid != 0 && mine().any(|p| p.host_pid == host_pid)) {
                        st.processes.push(pb::ProcessStatus {
                            host_pid,
                            pid: *pid,
                            gpu: sg.uuid.clone(),
                            memory: used[dev],
                            memory_beyond_calls: c.trued.get(&(*slot, *pid)).map_or(0, |t| t.added[dev]),
                        });
                    }
                }
            }
            for (pid, host, used) in live {
                if used.iter().all(|&u| u == 0) && !st.processes.iter().any(|p| p.pid == *pid) {
                    let host = if c.nvml.iter().any(|p| p.host_pid == *host) { *host } else { 0 };
                    st.processes.push(pb::ProcessStatus { host_pid: host, pid: *pid, ..Default::default() });
                }
            }
            if s.priority == crate::slices::Priority::High {
                for (d, ahead, sm) in unfounded_claims(c, s.gpus.len()) {
                    let why = format!(
                        "claimed {} ms of queued GPU work on its GPU {d} while NVML measured its processes at {sm:.1} % \
                         for {CLAIM_STRIKES} passes: high priority suspended for {} s",
                        ahead / 1_000_000,
                        PRIORITY_SUSPENSION.as_secs()
                    );
                    pass.suspended.push((s.name.clone(), why));
                }
            }
            if let Some(a) = &c.activity {
                // What its dead processes queued went with them; and no slice holds the normal
                // slices of a GPU back for more than 10 s of work it claims to have queued.
                let horizon = vgpu_region::monotonic_ns().saturating_add(10_000_000_000);
                for d in 0..s.gpus.len().min(vgpu_region::MAX_DEVICES) {
                    let idle = live.is_empty() && (a.until(d) != 0 || a.rhythm(d).is_some());
                    if idle || a.until(d) > horizon {
                        if !idle {
                            tracing::warn!(slice = %s.name, "its activity file claims more than 10 s of queued GPU work: cleared");
                        }
                        a.clear(d);
                    }
                }
            }
            pass.slices.push(st);
        }
    }

    /// New escapes: counted, logged and acted on once; ongoing ones are only reported.
    fn act_on_escapes(&mut self, slices: &[Slice], pass: &mut Pass) {
        let mut now = HashSet::default();
        let mut owners = HashMap::default();
        for e in &mut pass.escapes {
            let key = escape_key(e);
            let new = !self.active.contains(&key);
            // Who runs it, read before any kill; kept while the escape lasts.
            let (owner, pod) = match self.owners.remove(&key) {
                Some((pid, o, pod)) if pid == e.pid => (o, pod),
                _ => {
                    let o = procfs::owner(e.pid);
                    let pod = self.pod_named(slices, &o.pod_uid);
                    (o, pod)
                }
            };
            e.command.clone_from(&owner.command);
            e.pod_uid.clone_from(&owner.pod_uid);
            e.container_id.clone_from(&owner.container_id);
            e.pod.clone_from(&pod);
            owners.insert(key.clone(), (e.pid, owner, pod));
            now.insert(key);
            e.action = "reported".into();
            if !new {
                continue;
            }
            pass.new_escapes[(e.kind as usize).min(3)] += 1;
            if self.action == EscapeAction::Kill && e.pid != 0 {
                // SAFETY: kill(2) with a PID NVML reported in this pass and a valid signal.
                let r = unsafe { libc::kill(e.pid as libc::pid_t, libc::SIGKILL) };
                e.action = if r == 0 { "killed".into() } else { "kill failed".into() };
                // Killed: the next pass sees the process gone; its next escape is a new one (and
                // its PID, if reused, another process's).
                now.remove(&escape_key(e));
                owners.remove(&escape_key(e));
            }
            pass.fresh.push(e.clone());
            if e.kind == pb::escape::Kind::Unaccounted as i32 && !e.slice.is_empty() {
                tracing::warn!(gpu = %e.gpu, pid = e.pid, command = %e.command, slice = %e.slice, memory = e.measured, action = %e.action,
                    "slice process on a GPU outside its slice");
            } else if e.kind == pb::escape::Kind::Unaccounted as i32 {
                tracing::warn!(gpu = %e.gpu, pid = e.pid, command = %e.command, pod_uid = %e.pod_uid, pod = %e.pod,
                    container = %e.container_id, memory = e.measured, action = %e.action, "GPU process outside every slice");
            } else if e.kind == pb::escape::Kind::Bypass as i32 {
                tracing::warn!(slice = %e.slice, gpu = %e.gpu, measured_pct = e.measured, accounted_pct = e.limit, pid = e.pid,
                    command = %e.command, action = %e.action, "slice uses GPU time its launches through libvgpu.so do not account for");
            } else {
                tracing::warn!(slice = %e.slice, gpu = %e.gpu, measured = e.measured, limit = e.limit, pid = e.pid,
                    action = %e.action, "slice over its memory limit as NVML measures it");
            }
        }
        self.active = now;
        self.owners = owners;
    }

    /// Aligns what is kept per slice with a new list of slices: a slice in both keeps its region and
    /// state; a deleted one, or one deleted and made again (a new region file), loses them.
    fn realign(&mut self, slices: &Arc<Vec<Slice>>) {
        let mut old: HashMap<String, Cached> = HashMap::default();
        if let Some(list) = self.list.take() {
            for (c, s) in self.regions.drain(..).zip(list.iter()) {
                if let Some(c) = c {
                    old.insert(s.name.clone(), c);
                }
            }
        }
        self.regions = slices.iter().map(|s| old.remove(&s.name).filter(|c| c.created_ns == s.created_ns)).collect();
        self.index = slices.iter().enumerate().map(|(i, s)| (s.name.clone(), i)).collect();
        self.lists += 1;
        self.unopened.retain(|name, _| self.index.contains_key(name));
        self.list = Some(slices.clone());
    }

    /// Opens a slice's region (a failure is logged and tried again in 10 s).
    fn open(&mut self, store: &SliceStore, s: &Slice) -> Option<Cached> {
        let path = store.dir(&s.name).join("region");
        match Region::open_strict(&path, true) {
            Ok(region) => {
                self.unopened.remove(&s.name);
                Some(Cached {
                    region,
                    activity: vgpu_region::activity::Mapped::open(&store.dir(&s.name).join("activity"), true),
                    created_ns: s.created_ns,
                    id: procfs::file_id(&path),
                    live: 0..0,
                    // Not known yet: worked out in this pass.
                    gpu_pos: [usize::MAX; vgpu_region::MAX_DEVICES],
                    nvml: Vec::new(),
                    last_seen: Vec::new(),
                    before_nvml: Vec::new(),
                    in_flight_before: [0; vgpu_region::MAX_DEVICES],
                    refusals: [0; vgpu_region::MAX_DEVICES],
                    throttled_launches: [0; vgpu_region::MAX_DEVICES],
                    sm_ewma: [f64::NAN; vgpu_region::MAX_DEVICES],
                    sm_ctl: [f64::NAN; vgpu_region::MAX_DEVICES],
                    streak: [0; vgpu_region::MAX_DEVICES],
                    sm_acct: [(0, 0); vgpu_region::MAX_DEVICES],
                    sm_acct_ewma: [0.0; vgpu_region::MAX_DEVICES],
                    last_kernel_ms: [0; vgpu_region::MAX_DEVICES],
                    watched_since_ms: 0,
                    trued: HashMap::default(),
                    claim_strikes: [0; vgpu_region::MAX_DEVICES],
                    noted: [(0, 0); vgpu_region::MAX_DEVICES],
                    noted_ewma: [0.0; vgpu_region::MAX_DEVICES],
                    bypass_strikes: [0; vgpu_region::MAX_DEVICES],
                })
            }
            Err(e) => {
                tracing::error!(slice = %s.name, error = %e, "cannot open the slice's region (next try in 10 s)");
                let next = std::time::Instant::now() + std::time::Duration::from_secs(10);
                self.unopened.insert(s.name.clone(), next);
                None
            }
        }
    }

    /// The slice (its index in `slices`, the pass's list) and the PID inside its container of GPU
    /// process `pid` (host PID).
    ///
    /// Which region a process maps is what decides (its `/proc/<pid>/maps`, read once per process
    /// and cached by its start time); a host PID that a slot names is the container's word and is
    /// not believed.
    fn owner(&mut self, pid: u32, slices: &[Slice]) -> Option<(usize, u32)> {
        // Where a slot names this host PID and the process was already attributed to that slot's
        // slice by the region it maps, that stands without reading /proc again, except every tenth
        // pass (a PID reused meanwhile is caught within a second). A slot that names a PID the maps
        // gave to another slice (or none) is not believed: the full path below decides.
        if self.passes % 10 != 1 {
            if let (Some(&(i, inner)), Some(c)) = (self.by_host.get(&pid), self.procs.get(&pid)) {
                let agrees = c
                    .owner
                    .as_ref()
                    .is_some_and(|(slice, cached)| *cached == inner && slices.get(i).is_some_and(|s| s.name == *slice));
                if agrees && self.regions[i].is_some() {
                    return Some((i, inner));
                }
            }
        }
        let start = procfs::start_time(pid)?;
        if let Some(c) = self.procs.get(&pid) {
            if c.start == start && (c.owner.is_some() || c.list == self.lists) {
                // A cached owner must still exist (the slice may have been deleted).
                let (slice, inner) = c.owner.as_ref()?;
                return self.index.get(slice.as_str()).filter(|&&i| self.regions[i].is_some()).map(|&i| (i, *inner));
            }
        }
        let owner = procfs::mapped(pid, &self.by_file).map(|&i| {
            let inner = procfs::ns_pids(pid).and_then(|v| v.last().copied()).unwrap_or(pid);
            (i, inner)
        });
        let cached = owner.map(|(i, inner)| (slices[i].name.clone(), inner));
        self.procs.insert(pid, ProcOwner { start, owner: cached, list: self.lists });
        owner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_correction_rises_after_two_passes_and_falls_after_three_steady_ones() {
        const M: u64 = 1 << 20;
        const MOVED: u64 = u64::MAX;
        // A first sighting charges nothing; a second, the smaller of the two.
        assert_eq!(corrected(0, [576 * M, 0], [576 * M, MOVED, MOVED]), None);
        assert_eq!(corrected(0, [600 * M, 576 * M], [600 * M, 576 * M, MOVED]), Some(576 * M));
        // A figure NVML has not brought down yet after a free: one pass, not charged.
        assert_eq!(corrected(576 * M, [900 * M, 576 * M], [900 * M, 576 * M, 576 * M]), None);
        // Calls in flight during a pass or two make the excess look smaller: kept.
        assert_eq!(corrected(576 * M, [192 * M, 576 * M], [192 * M, 576 * M, 576 * M]), None);
        assert_eq!(corrected(576 * M, [192 * M, 64 * M], [192 * M, 64 * M, 576 * M]), None);
        // Three passes in a row saw less, but the charge moved during one of them: kept.
        assert_eq!(corrected(576 * M, [192 * M, 64 * M], [192 * M, MOVED, 100 * M]), None);
        // Three steady passes in a row saw less: down to the largest of them.
        assert_eq!(corrected(576 * M, [192 * M, 64 * M], [192 * M, 64 * M, 100 * M]), Some(192 * M));
        // The context went: all of it, once three steady passes agree.
        assert_eq!(corrected(576 * M, [0, 0], [0, 0, 576 * M]), None);
        assert_eq!(corrected(576 * M, [0, 0], [0, 0, 0]), Some(0));
        // A rise needs no steady pass (what a moving charge hides can only make it smaller).
        assert_eq!(corrected(0, [600 * M, 576 * M], [MOVED, MOVED, MOVED]), Some(576 * M));
        // Moves under 8 MiB are noise.
        assert_eq!(corrected(576 * M, [580 * M, 581 * M], [580 * M, 581 * M, 0]), None);
        assert_eq!(corrected(576 * M, [570 * M, 571 * M], [570 * M, 571 * M, 572 * M]), None);
        assert_eq!(corrected(0, [0, 0], [0, 0, 0]), None);
    }

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

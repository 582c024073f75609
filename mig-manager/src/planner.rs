//! Pure planning: no NVML, no I/O.
//!
//! Validity of a layout, as NVML enforces it: every GPU instance sits at one of its profile's
//! placements, memory ranges never overlap, and no profile has more instances than its count.
//! A plan keeps as many existing instances as the target allows (each kept instance saves a destroy
//! and a create), never touches a busy one unless forced, and names every placement explicitly: a
//! driver left to choose can pick one that blocks later profiles.

use crate::model::{mask, Gpu, Instance, Placed, Profile};
use serde::{Deserialize, Serialize};

/// One GPU instance of a target layout: a profile, and optionally a fixed placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Want {
    pub profile: u32,
    pub start: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    /// Destroy a GPU instance (its compute instances first).
    Destroy { gi: u32, profile: u32, start: u32 },
    /// Create a GPU instance at an explicit placement, with one compute instance spanning it.
    Create { profile: u32, start: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Instances kept as they are.
    pub keep: Vec<u32>,
    pub steps: Vec<Step>,
    /// The layout after the plan, in start order.
    pub layout: Vec<Placed>,
}

/// Why no instance can be placed as asked (dynamic and geometry modes).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoPlacement {
    #[error("no MIG profile of {gpu} offers {}", wanted(request))]
    NoProfile { gpu: String, request: Request },
    #[error("no room on {gpu} for {}: its free memory slices cannot hold a fitting profile", wanted(request))]
    NoRoom { gpu: String, request: Request },
    #[error("no GPUs")]
    NoGpus,
    #[error("{gpu} has no MIG profile {profile}")]
    UnknownProfile { gpu: String, profile: u32 },
    #[error("{gpu} holds a {profile} instance (GPU instance {gi} at slice {start}) that the geometry has no room for")]
    Foreign { gpu: String, profile: String, gi: u32, start: u32 },
    #[error("the geometry has {count} {profile} instances, and all of them are made")]
    GeometryFull { count: u32, profile: String },
    #[error("no placement of {profile} on {gpu} leaves room for the rest of the geometry")]
    NoRest { profile: String, gpu: String },
}

/// What a request asks for, as an error names it.
fn wanted(r: &Request) -> String {
    let mut parts = Vec::new();
    if r.memory_mib > 0 || (r.compute == 0 && r.sms == 0) {
        parts.push(format!("{} MiB", r.memory_mib));
    }
    if r.compute > 0 {
        parts.push(format!("{} compute slices", r.compute));
    }
    if r.sms > 0 {
        parts.push(format!("{} SMs", r.sms));
    }
    format!("{}{}", parts.join(", "), if r.media { ", media engines" } else { "" })
}

/// Why a target cannot be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Impossible {
    UnknownProfile(u32),
    BadPlacement {
        profile: String,
        start: u32,
        valid: Vec<u32>,
    },
    TooMany {
        profile: String,
        wanted: u32,
        max: u32,
    },
    /// A busy instance is not part of the target (or its slices are needed).
    Busy {
        gi: u32,
        profile: String,
        start: u32,
    },
    /// The profiles do not fit together on this GPU, whatever the placements.
    NoFit {
        wanted: Vec<String>,
        slices: u32,
    },
}

impl std::fmt::Display for Impossible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Impossible::UnknownProfile(p) => write!(f, "the GPU has no MIG profile with id {p}"),
            Impossible::BadPlacement { profile, start, valid } => {
                write!(f, "{profile} cannot start at memory slice {start} (valid starts: {valid:?})")
            }
            Impossible::TooMany { profile, wanted, max } => {
                write!(f, "{wanted} x {profile} wanted, but the GPU allows at most {max}")
            }
            Impossible::Busy { gi, profile, start } => write!(
                f,
                "GPU instance {gi} ({profile} at slice {start}) is in use and the target does not keep it \
                 (stop its workload, or force)"
            ),
            Impossible::NoFit { wanted, slices } => write!(
                f,
                "{} do not fit together in the GPU's {slices} memory slices with any valid placements",
                wanted.join(" + ")
            ),
        }
    }
}

impl std::error::Error for Impossible {}

fn name(gpu: &Gpu, id: u32) -> String {
    gpu.profile(id).map_or(format!("profile {id}"), |p| p.name.clone())
}

/// Checks what can be checked without a search.
fn validate(gpu: &Gpu, want: &[Want]) -> Result<(), Impossible> {
    for w in want {
        let p = gpu.profile(w.profile).ok_or(Impossible::UnknownProfile(w.profile))?;
        if let Some(s) = w.start {
            if !p.starts.contains(&s) {
                return Err(Impossible::BadPlacement { profile: p.name.clone(), start: s, valid: p.starts.clone() });
            }
        }
    }
    for p in &gpu.profiles {
        let n = want.iter().filter(|w| w.profile == p.id).count() as u32;
        if n > p.max {
            return Err(Impossible::TooMany { profile: p.name.clone(), wanted: n, max: p.max });
        }
    }
    let slices: u32 = want.iter().filter_map(|w| gpu.profile(w.profile)).map(|p| p.memory_slices).sum();
    if slices > gpu.memory_slices {
        return Err(no_fit(gpu, want));
    }
    Ok(())
}

fn no_fit(gpu: &Gpu, want: &[Want]) -> Impossible {
    Impossible::NoFit { wanted: want.iter().map(|w| name(gpu, w.profile)).collect(), slices: gpu.memory_slices }
}

struct Search<'a> {
    gpu: &'a Gpu,
    want: Vec<(Want, &'a Profile)>,
    /// Instances the plan may not destroy.
    pinned: Vec<&'a Instance>,
    best: Option<(usize, u64, Vec<Choice>)>,
}

#[derive(Clone, Copy, Debug)]
enum Choice {
    Reuse(usize),
    New(u32),
}

impl Search<'_> {
    /// Depth-first over the wanted instances (largest first), each either reusing an existing
    /// instance or placed anew; keeps the choice that reuses most, then leaves the most room.
    fn go(&mut self, i: usize, used: u64, reused: usize, taken: &mut Vec<bool>, path: &mut Vec<Choice>) {
        if let Some((best, _, _)) = &self.best {
            // Even reusing every remaining wanted instance cannot beat the best.
            if reused + (self.want.len() - i) < *best {
                return;
            }
        }
        if i == self.want.len() {
            if taken
                .iter()
                .enumerate()
                .any(|(k, t)| !t && self.pinned.iter().any(|p| std::ptr::eq(*p, &self.gpu.instances[k])))
            {
                return;
            }
            let room = room_score(self.gpu, used);
            let better = match &self.best {
                None => true,
                Some((r, s, _)) => reused > *r || (reused == *r && room > *s),
            };
            if better {
                self.best = Some((reused, room, path.clone()));
            }
            return;
        }
        let (w, p) = self.want[i];
        // Reuse an existing instance of the profile.
        for k in 0..self.gpu.instances.len() {
            let inst = &self.gpu.instances[k];
            if taken[k] || inst.profile != w.profile || w.start.is_some_and(|s| s != inst.start) {
                continue;
            }
            let m = mask(inst.start, inst.size);
            if used & m != 0 {
                continue;
            }
            taken[k] = true;
            path.push(Choice::Reuse(k));
            self.go(i + 1, used | m, reused + 1, taken, path);
            path.pop();
            taken[k] = false;
        }
        // Or a new one, off the slices of instances that must stay.
        let pinned_mask = self.pinned.iter().fold(0, |m, x| m | mask(x.start, x.size));
        let starts: Vec<u32> = match w.start {
            Some(s) => vec![s],
            None => p.starts.clone(),
        };
        for s in starts {
            let m = mask(s, p.memory_slices);
            if used & m != 0 || pinned_mask & m != 0 {
                continue;
            }
            path.push(Choice::New(s));
            self.go(i + 1, used | m, reused, taken, path);
            path.pop();
        }
    }
}

/// How much room a set of used slices leaves: for every profile, how many more instances could still
/// be placed, weighted by the square of their size (a free 4-slice placement is worth more than four
/// scattered single slices).
pub fn room_score(gpu: &Gpu, used: u64) -> u64 {
    gpu.profiles
        .iter()
        .map(|p| {
            let free = p.starts.iter().filter(|&&s| used & mask(s, p.memory_slices) == 0).count() as u64;
            free * (p.memory_slices as u64).pow(2)
        })
        .sum()
}

/// The minimal plan from the GPU's instances to `want`. Busy instances are kept unless `force`.
pub fn plan(gpu: &Gpu, want: &[Want], force: bool) -> Result<Plan, Impossible> {
    validate(gpu, want)?;
    let mut w: Vec<(Want, &Profile)> = want.iter().map(|w| (*w, gpu.profile(w.profile).expect("validated"))).collect();
    // Largest and fixed first: prunes early.
    w.sort_by_key(|(x, p)| (std::cmp::Reverse(p.memory_slices), x.start.is_none(), x.start));
    let pinned: Vec<&Instance> = if force { Vec::new() } else { gpu.instances.iter().filter(|i| i.busy).collect() };
    // A busy instance that no wanted instance can keep makes the target impossible.
    for b in &pinned {
        if !want.iter().any(|x| x.profile == b.profile && x.start.is_none_or(|s| s == b.start)) {
            return Err(Impossible::Busy { gi: b.gi, profile: name(gpu, b.profile), start: b.start });
        }
    }
    let mut s = Search { gpu, want: w, pinned, best: None };
    let mut taken = vec![false; gpu.instances.len()];
    s.go(0, 0, 0, &mut taken, &mut Vec::new());
    let Some((_, _, choice)) = s.best.take() else {
        if let Some(b) = s.pinned.first() {
            // It fits on an empty GPU but not around the busy instances.
            let mut empty = gpu.clone();
            empty.instances.clear();
            if plan(&empty, want, false).is_ok() {
                return Err(Impossible::Busy { gi: b.gi, profile: name(gpu, b.profile), start: b.start });
            }
        }
        return Err(no_fit(gpu, want));
    };
    let mut keep = Vec::new();
    let mut layout = Vec::new();
    let mut creates = Vec::new();
    for ((x, _), c) in s.want.iter().zip(&choice) {
        match c {
            Choice::Reuse(k) => {
                let inst = &gpu.instances[*k];
                keep.push(inst.gi);
                layout.push(Placed { profile: inst.profile, start: inst.start });
            }
            Choice::New(st) => {
                creates.push(Step::Create { profile: x.profile, start: *st });
                layout.push(Placed { profile: x.profile, start: *st });
            }
        }
    }
    let mut steps: Vec<Step> = gpu
        .instances
        .iter()
        .filter(|i| !keep.contains(&i.gi))
        .map(|i| Step::Destroy { gi: i.gi, profile: i.profile, start: i.start })
        .collect();
    creates.sort_by_key(|c| if let Step::Create { start, .. } = c { *start } else { 0 });
    steps.extend(creates);
    keep.sort_unstable();
    layout.sort_by_key(|p| p.start);
    Ok(Plan { keep, steps, layout })
}

/// Every valid layout of the given profiles to which no instance of them can be added (for an A100
/// with 1g, 2g, 3g, 4g and 7g: the 19 layouts of NVIDIA's MIG guide).
pub fn maximal_layouts(gpu: &Gpu, profiles: &[u32]) -> Vec<Vec<Placed>> {
    fn go(gpu: &Gpu, profiles: &[u32], cur: &mut Vec<Placed>, out: &mut Vec<Vec<Placed>>) {
        let size = |id: u32| gpu.profile(id).map_or(0, |p| p.memory_slices);
        let used = cur.iter().fold(0, |m, p| m | mask(p.start, size(p.profile)));
        let mut extended = false;
        for &id in profiles {
            let Some(p) = gpu.profile(id) else { continue };
            if cur.iter().filter(|x| x.profile == id).count() as u32 >= p.max {
                continue;
            }
            for &s in &p.starts {
                if used & mask(s, p.memory_slices) != 0 {
                    continue;
                }
                extended = true;
                // Instances in start order: each layout is built once.
                if cur.last().is_some_and(|l| l.start >= s) {
                    continue;
                }
                cur.push(Placed { profile: id, start: s });
                go(gpu, profiles, cur, out);
                cur.pop();
            }
        }
        if !extended {
            out.push(cur.clone());
        }
    }
    let mut out = Vec::new();
    go(gpu, profiles, &mut Vec::new(), &mut out);
    out.sort();
    out.dedup();
    out
}

/// A dynamic request: what a workload needs, not a profile name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub memory_mib: u64,
    /// Compute slices (0: any).
    pub compute: u32,
    /// Streaming multiprocessors (0: any).
    pub sms: u32,
    /// Needs the media engines (JPEG and OFA), as `+me` profiles and full GPUs have.
    pub media: bool,
}

/// The best-fitting profile for `req` and the placement that leaves the most room, given the GPU's
/// instances now. Best fit: the fewest memory slices, then the fewest compute slices, then the least
/// memory; this picks double-memory profiles (`1g.10gb` on an A100 40GB) over wider ones and `+me`
/// profiles only when media engines are asked for.
pub fn choose(gpu: &Gpu, req: &Request) -> Result<Placed, NoPlacement> {
    let fits = |p: &Profile| {
        p.memory_mib >= req.memory_mib
            && p.compute >= req.compute
            && p.sms >= req.sms
            && (!req.media || (p.jpegs > 0 && p.ofas > 0))
            && (req.media || !p.media_extended())
    };
    let mut candidates: Vec<&Profile> = gpu.profiles.iter().filter(|p| fits(p)).collect();
    if candidates.is_empty() {
        return Err(NoPlacement::NoProfile { gpu: gpu.name.clone(), request: *req });
    }
    candidates.sort_by_key(|p| (p.memory_slices, p.compute, p.memory_mib, p.id));
    let used = gpu.used_mask();
    for p in candidates {
        let count = gpu.instances.iter().filter(|i| i.profile == p.id).count() as u32;
        if count >= p.max {
            continue;
        }
        let best = p
            .starts
            .iter()
            .filter(|&&s| used & mask(s, p.memory_slices) == 0)
            .map(|&s| (room_score(gpu, used | mask(s, p.memory_slices)), std::cmp::Reverse(s)))
            .max();
        if let Some((_, std::cmp::Reverse(start))) = best {
            return Ok(Placed { profile: p.id, start });
        }
    }
    Err(NoPlacement::NoRoom { gpu: gpu.name.clone(), request: *req })
}

/// Node-level dynamic choice: the GPU (and placement) where the request costs the least room, so
/// that small instances gather on GPUs already cut up and whole GPUs stay whole for large ones.
/// Ties go to the lowest index.
pub fn choose_on(gpus: &[Gpu], req: &Request) -> Result<(usize, Placed), NoPlacement> {
    let mut best: Option<(u64, u32, usize, Placed)> = None;
    let mut last_err = NoPlacement::NoGpus;
    for (i, g) in gpus.iter().enumerate() {
        if !g.mig_enabled {
            continue;
        }
        match choose(g, req) {
            Ok(p) => {
                let used = g.used_mask();
                let size = g.profile(p.profile).map_or(0, |x| x.memory_slices);
                let loss = room_score(g, used) - room_score(g, used | mask(p.start, size));
                // Fewer slices first (a best fit), then the least room lost.
                let key = (loss, size);
                if best.as_ref().is_none_or(|b| (key.1, key.0) < (b.1, b.0)) {
                    best = Some((loss, size, i, p));
                }
            }
            Err(e) => last_err = e,
        }
    }
    best.map(|(_, _, i, p)| (i, p)).ok_or(last_err)
}

/// The greedy placer of the benchmark's baseline (HAMi-like): among the profiles without media
/// extension or double memory, the smallest by memory that fits, at the lowest free placement.
pub fn choose_greedy(gpu: &Gpu, req: &Request) -> Option<Placed> {
    // A double-memory profile has the compute of another with fewer memory slices.
    let double = |p: &Profile| {
        gpu.profiles.iter().any(|q| !q.media_extended() && q.compute == p.compute && q.memory_slices < p.memory_slices)
    };
    let mut c: Vec<&Profile> = gpu
        .profiles
        .iter()
        .filter(|p| !p.media_extended() && !double(p))
        .filter(|p| p.memory_mib >= req.memory_mib && p.compute >= req.compute)
        .collect();
    c.sort_by_key(|p| (p.memory_mib, p.compute));
    let used = gpu.used_mask();
    for p in c {
        if gpu.instances.iter().filter(|i| i.profile == p.id).count() as u32 >= p.max {
            continue;
        }
        if let Some(&s) = p.starts.iter().find(|&&s| used & mask(s, p.memory_slices) == 0) {
            return Some(Placed { profile: p.id, start: s });
        }
    }
    None
}

/// Free memory slices that the largest still-placeable profile cannot use, as a share of the free
/// slices (0: the free space is one usable block; 1: none of it can be used).
pub fn fragmentation(gpu: &Gpu) -> f64 {
    let used = gpu.used_mask();
    let free = gpu.memory_slices - used.count_ones().min(gpu.memory_slices);
    if free == 0 {
        return 0.0;
    }
    let largest = gpu
        .profiles
        .iter()
        .filter(|p| gpu.instances.iter().filter(|i| i.profile == p.id).count() < p.max as usize)
        .filter(|p| p.starts.iter().any(|&s| used & mask(s, p.memory_slices) == 0))
        .map(|p| p.memory_slices)
        .max()
        .unwrap_or(0);
    1.0 - largest as f64 / free as f64
}

/// A MIG geometry as HAMi's and Volcano's schedulers model one: a whole-GPU partition named by how
/// many instances of which profiles it holds (`[(1g.10gb, 7)]`, `[(2g.20gb, 3), (1g.10gb, 1)]`).
/// The schedulers hand out positions in a geometry; the node makes the instances.
pub type Geometry = Vec<(u32, u32)>;

/// A profile with a `+` suffix (`+me`, `+gfx`, ...): one that extends another with an engine.
fn extended(p: &Profile) -> bool {
    p.name.contains('+')
}

/// The geometries a GPU offers by default, derived from its profile table alone: one per profile
/// without a suffix, with as many instances of it as fit (at its placements in order, up to its
/// maximum), the slices left over then filled with the widest profiles that still fit (profiles with
/// double memory for their compute are left out of the filling). In order of the first profile's
/// memory, then compute: a scheduler that tries them in turn picks the smallest that holds a request.
pub fn default_geometries(gpu: &Gpu) -> Vec<Geometry> {
    let double = |p: &Profile| {
        gpu.profiles.iter().any(|q| !extended(q) && q.compute == p.compute && q.memory_slices < p.memory_slices)
    };
    let mut fill: Vec<&Profile> = gpu.profiles.iter().filter(|p| !extended(p) && !double(p)).collect();
    fill.sort_by_key(|p| (std::cmp::Reverse(p.memory_slices), std::cmp::Reverse(p.compute), p.id));
    let mut mains: Vec<&Profile> = gpu.profiles.iter().filter(|p| !extended(p)).collect();
    mains.sort_by_key(|p| (p.memory_mib, p.compute, p.id));
    let mut out: Vec<Geometry> = Vec::new();
    for main in mains {
        let mut used = 0u64;
        let mut g: Geometry = Vec::new();
        let place = |p: &Profile, used: &mut u64, g: &mut Geometry| -> bool {
            let have = g.iter().find(|(id, _)| *id == p.id).map_or(0, |(_, n)| *n);
            if have >= p.max {
                return false;
            }
            let Some(&s) = p.starts.iter().find(|&&s| *used & mask(s, p.memory_slices) == 0) else { return false };
            *used |= mask(s, p.memory_slices);
            match g.iter_mut().find(|(id, _)| *id == p.id) {
                Some(e) => e.1 += 1,
                None => g.push((p.id, 1)),
            }
            true
        };
        while place(main, &mut used, &mut g) {}
        'filling: loop {
            for p in &fill {
                if place(p, &mut used, &mut g) {
                    continue 'filling;
                }
            }
            break;
        }
        if !g.is_empty() && !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// Where to make one more instance of `profile` on a GPU partitioned as `geometry`: a free placement
/// of it after which the instances the geometry still lacks can all be placed too. The GPU's
/// instances must all belong to the geometry (each one takes one of its entries).
pub fn choose_in_geometry(gpu: &Gpu, geometry: &[(u32, u32)], profile: u32) -> Result<Placed, NoPlacement> {
    let name = |id: u32| gpu.profile(id).map_or_else(|| format!("profile {id}"), |p| p.name.clone());
    let p = gpu.profile(profile).ok_or_else(|| NoPlacement::UnknownProfile { gpu: gpu.name.clone(), profile })?;
    let mut left: Vec<(u32, u32)> = geometry.to_vec();
    for i in &gpu.instances {
        match left.iter_mut().find(|(id, n)| *id == i.profile && *n > 0) {
            Some(e) => e.1 -= 1,
            None => {
                return Err(NoPlacement::Foreign {
                    gpu: gpu.name.clone(),
                    profile: name(i.profile),
                    gi: i.gi,
                    start: i.start,
                })
            }
        }
    }
    match left.iter_mut().find(|(id, n)| *id == profile && *n > 0) {
        Some(e) => e.1 -= 1,
        None => {
            let n = geometry.iter().filter(|(id, _)| *id == profile).map(|(_, n)| n).sum::<u32>();
            return Err(NoPlacement::GeometryFull { count: n, profile: p.name.clone() });
        }
    }
    // The rest, widest first: prunes early.
    let mut rest: Vec<&Profile> = left
        .iter()
        .flat_map(|&(id, n)| gpu.profile(id).into_iter().flat_map(move |q| std::iter::repeat_n(q, n as usize)))
        .collect();
    rest.sort_by_key(|q| (std::cmp::Reverse(q.memory_slices), q.id));
    fn fits(rest: &[&Profile], used: u64) -> bool {
        let Some((q, tail)) = rest.split_first() else { return true };
        q.starts.iter().any(|&s| used & mask(s, q.memory_slices) == 0 && fits(tail, used | mask(s, q.memory_slices)))
    }
    let used = gpu.used_mask();
    let mut starts: Vec<u32> = p.starts.iter().copied().filter(|&s| used & mask(s, p.memory_slices) == 0).collect();
    // Of the placements that work, the one that leaves the most room (as [`choose`]).
    starts.sort_by_key(|&s| (std::cmp::Reverse(room_score(gpu, used | mask(s, p.memory_slices))), s));
    starts
        .into_iter()
        .find(|&s| fits(&rest, used | mask(s, p.memory_slices)))
        .map(|start| Placed { profile, start })
        .ok_or_else(|| NoPlacement::NoRest { profile: p.name.clone(), gpu: gpu.name.clone() })
}

#[cfg(test)]
mod tests;

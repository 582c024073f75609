//! MIG rules: mode changes, GPU and compute instances with NVIDIA's placement rules.
//!
//! Pure functions over [`MigState`]; the NVML library maps [`MigErr`] to NVML return codes.

use crate::models::{ci_max, Arch, MigTable, Model, CI_PROFILE_SLICES};
use crate::state::{CiRec, GiRec, MigState, MAX_CI, MAX_GI};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigErr {
    /// NVML_ERROR_INVALID_ARGUMENT
    InvalidArgument,
    /// NVML_ERROR_NOT_SUPPORTED
    NotSupported,
    /// NVML_ERROR_IN_USE
    InUse,
    /// NVML_ERROR_INSUFFICIENT_RESOURCES
    InsufficientResources,
    /// NVML_ERROR_NOT_FOUND
    NotFound,
}

/// What a mode change did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// In force now.
    Done,
    /// Pending until a GPU reset (Ampere).
    ResetRequired,
}

fn table(m: &Model) -> Result<&MigTable, MigErr> {
    m.mig.as_ref().ok_or(MigErr::NotSupported)
}

pub fn set_mode(st: &mut MigState, m: &Model, mode: u32, gpu_in_use: bool) -> Result<Activation, MigErr> {
    table(m)?;
    if mode > 1 {
        return Err(MigErr::InvalidArgument);
    }
    if mode == 0 && st.gis.iter().any(|g| g.live != 0) {
        return Err(MigErr::InUse);
    }
    match m.arch {
        Arch::Ampere => {
            st.pending = mode;
            Ok(if st.current == mode { Activation::Done } else { Activation::ResetRequired })
        }
        _ => {
            if gpu_in_use && st.current != mode {
                return Err(MigErr::InUse);
            }
            st.current = mode;
            st.pending = mode;
            Ok(Activation::Done)
        }
    }
}

/// A GPU reset (`nvidia-smi -r`): refused while clients hold the GPU; applies a pending mode and wipes
/// every instance.
pub fn reset(st: &mut MigState, gpu_in_use: bool) -> Result<(), MigErr> {
    if gpu_in_use {
        return Err(MigErr::InUse);
    }
    st.current = st.pending;
    st.gis = Default::default();
    Ok(())
}

/// A reboot or driver reload: Ampere keeps its (pending) mode, Hopper and later lose it.
pub fn reboot(st: &mut MigState, m: &Model) {
    if m.arch == Arch::Ampere {
        st.current = st.pending;
    } else {
        st.current = 0;
        st.pending = 0;
    }
    st.gis = Default::default();
}

fn live_gis(st: &MigState) -> impl Iterator<Item = &GiRec> {
    st.gis.iter().filter(|g| g.live != 0)
}

fn gi_fits(st: &MigState, t: &MigTable, p: &crate::models::GiProfile, start: u32) -> bool {
    let used_compute: u32 = live_gis(st).map(|g| t.by_id(g.profile_id).map_or(0, |q| q.g)).sum();
    if used_compute + p.g > t.compute_slices {
        return false;
    }
    live_gis(st).all(|g| start + p.size <= g.start || g.start + g.size <= start)
}

pub fn placements(m: &Model, profile_id: u32) -> Result<Vec<(u32, u32)>, MigErr> {
    let t = table(m)?;
    let p = t.by_id(profile_id).ok_or(MigErr::InvalidArgument)?;
    Ok(p.starts.iter().map(|&s| (s, p.size)).collect())
}

/// Creates a GPU instance; `start` None lets the "driver" pick the lowest free placement.
/// Returns the index of the record in `st.gis`.
pub fn create_gi(st: &mut MigState, m: &Model, profile_id: u32, start: Option<u32>) -> Result<usize, MigErr> {
    let t = table(m)?;
    if st.current != 1 {
        return Err(MigErr::NotSupported);
    }
    let p = t.by_id(profile_id).ok_or(MigErr::InvalidArgument)?;
    if let Some(s) = start {
        if !p.starts.contains(&s) {
            return Err(MigErr::InvalidArgument);
        }
    }
    if live_gis(st).filter(|g| g.profile_id == profile_id).count() as u32 >= p.max {
        return Err(MigErr::InsufficientResources);
    }
    let start = match start {
        Some(s) if gi_fits(st, t, p, s) => s,
        Some(_) => return Err(MigErr::InsufficientResources),
        None => *p.starts.iter().find(|&&s| gi_fits(st, t, p, s)).ok_or(MigErr::InsufficientResources)?,
    };
    let slot = st.gis.iter().position(|g| g.live == 0).ok_or(MigErr::InsufficientResources)?;
    let id = (1..).find(|id| live_gis(st).all(|g| g.id != *id)).unwrap();
    st.serials = st.serials.wrapping_add(1);
    st.gis[slot] =
        GiRec { live: 1, id, profile_id, start, size: p.size, serial: st.serials, cis: [CiRec::default(); MAX_CI] };
    Ok(slot)
}

pub fn gi_by_id(st: &MigState, id: u32) -> Option<usize> {
    st.gis.iter().position(|g| g.live != 0 && g.id == id)
}

pub fn destroy_gi(st: &mut MigState, slot: usize) -> Result<(), MigErr> {
    let g = st.gis.get_mut(slot).filter(|g| g.live != 0).ok_or(MigErr::NotFound)?;
    if g.cis.iter().any(|c| c.live != 0) {
        return Err(MigErr::InUse);
    }
    *g = GiRec::default();
    Ok(())
}

/// How many more instances of `profile_id` could be created now.
pub fn remaining_gi(st: &MigState, m: &Model, profile_id: u32) -> Result<u32, MigErr> {
    let t = table(m)?;
    let p = t.by_id(profile_id).ok_or(MigErr::InvalidArgument)?;
    if st.current != 1 {
        return Ok(0);
    }
    let mut tmp = *st;
    let mut n = 0;
    while create_gi(&mut tmp, m, profile_id, None).is_ok() {
        n += 1;
    }
    debug_assert!(n <= p.max);
    Ok(n)
}

/// Compute-slice count of a GPU instance.
pub fn gi_slices(m: &Model, g: &GiRec) -> u32 {
    m.mig.as_ref().and_then(|t| t.by_id(g.profile_id)).map_or(0, |p| p.g)
}

/// (slices, instanceCount, valid starts) of compute-instance profile `ci_profile` in GPU instance `g`.
pub fn ci_profile(m: &Model, g: &GiRec, ci_profile: u32) -> Result<(u32, u32, Vec<u32>), MigErr> {
    let gs = gi_slices(m, g);
    let size = *CI_PROFILE_SLICES.get(ci_profile as usize).ok_or(MigErr::InvalidArgument)?;
    let max = ci_max(gs, size).ok_or(MigErr::NotSupported)?;
    let starts: Vec<u32> = (0..gs).step_by(size as usize).filter(|s| s + size <= gs).collect();
    Ok((size, max, starts))
}

pub fn create_ci(
    st: &mut MigState,
    m: &Model,
    gi: usize,
    ci_profile_id: u32,
    start: Option<u32>,
) -> Result<usize, MigErr> {
    let g = st.gis.get(gi).filter(|g| g.live != 0).ok_or(MigErr::NotFound)?;
    let (size, max, starts) = ci_profile(m, g, ci_profile_id)?;
    let live = || g.cis.iter().filter(|c| c.live != 0);
    if live().filter(|c| c.profile_id == ci_profile_id).count() as u32 >= max {
        return Err(MigErr::InsufficientResources);
    }
    let fits = |s: u32| live().all(|c| s + size <= c.start || c.start + c.size <= s);
    let start = match start {
        Some(s) if !starts.contains(&s) => return Err(MigErr::InvalidArgument),
        Some(s) if fits(s) => s,
        Some(_) => return Err(MigErr::InsufficientResources),
        None => *starts.iter().find(|&&s| fits(s)).ok_or(MigErr::InsufficientResources)?,
    };
    let slot = g.cis.iter().position(|c| c.live == 0).ok_or(MigErr::InsufficientResources)?;
    let id = (0..).find(|id| live().all(|c| c.id != *id)).unwrap();
    st.gis[gi].cis[slot] = CiRec { live: 1, id, profile_id: ci_profile_id, start, size };
    Ok(slot)
}

pub fn remaining_ci(st: &MigState, m: &Model, gi: usize, ci_profile_id: u32) -> Result<u32, MigErr> {
    let mut tmp = *st;
    let g = st.gis.get(gi).filter(|g| g.live != 0).ok_or(MigErr::NotFound)?;
    ci_profile(m, g, ci_profile_id)?;
    let mut n = 0;
    while create_ci(&mut tmp, m, gi, ci_profile_id, None).is_ok() {
        n += 1;
    }
    Ok(n)
}

pub fn destroy_ci(st: &mut MigState, gi: usize, ci: usize) -> Result<(), MigErr> {
    let c = st
        .gis
        .get_mut(gi)
        .filter(|g| g.live != 0)
        .and_then(|g| g.cis.get_mut(ci))
        .filter(|c| c.live != 0)
        .ok_or(MigErr::NotFound)?;
    *c = CiRec::default();
    Ok(())
}

/// MIG devices (GPU instance slot, compute instance slot) in enumeration order.
pub fn mig_devices(st: &MigState) -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for (gi, g) in st.gis.iter().enumerate().filter(|(_, g)| g.live != 0) {
        for (ci, _) in g.cis.iter().enumerate().filter(|(_, c)| c.live != 0) {
            v.push((gi, ci));
        }
    }
    v.sort_by_key(|&(gi, ci)| (st.gis[gi].id, st.gis[gi].cis[ci].id));
    v
}

pub const _ASSERT_SIZES: () = assert!(MAX_GI >= 7 && MAX_CI >= 7);

/// The UUID of the MIG device of compute instance `ci` in the GPU instance made as creation
/// `serial` on the GPU `gpu_uuid`: new for every creation, as the driver's are.
pub fn mig_uuid(gpu_uuid: &str, serial: u32, ci: u32) -> String {
    let h = gpu_uuid.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let m = (h ^ (serial as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0x100_0000_01b3);
    format!(
        "MIG-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        (h >> 32) as u32,
        serial & 0xffff,
        ci,
        (m >> 16) as u16,
        m & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model;

    fn enabled(key: &str) -> (MigState, &'static Model) {
        let m = model(key).unwrap();
        let mut st = MigState::default();
        set_mode(&mut st, m, 1, false).unwrap();
        if m.arch == Arch::Ampere {
            reset(&mut st, false).unwrap();
        }
        (st, m)
    }

    #[test]
    fn ampere_mode_waits_for_reset_and_hopper_switches_at_once() {
        let a = model("A100-40GB").unwrap();
        let mut st = MigState::default();
        assert_eq!(set_mode(&mut st, a, 1, true), Ok(Activation::ResetRequired));
        assert_eq!((st.current, st.pending), (0, 1));
        assert_eq!(create_gi(&mut st, a, 19, Some(0)), Err(MigErr::NotSupported));
        assert_eq!(reset(&mut st, true), Err(MigErr::InUse));
        reset(&mut st, false).unwrap();
        assert_eq!(st.current, 1);
        reboot(&mut st, a);
        assert_eq!(st.current, 1, "Ampere keeps MIG mode across reboot");

        let h = model("H100-80GB").unwrap();
        let mut st = MigState::default();
        assert_eq!(set_mode(&mut st, h, 1, true), Err(MigErr::InUse));
        assert_eq!(set_mode(&mut st, h, 1, false), Ok(Activation::Done));
        assert_eq!(st.current, 1);
        reboot(&mut st, h);
        assert_eq!(st.current, 0, "Hopper loses MIG mode at reboot");

        let l4 = model("L4").unwrap();
        assert_eq!(set_mode(&mut MigState::default(), l4, 1, false), Err(MigErr::NotSupported));
    }

    #[test]
    fn placement_rules() {
        let (mut st, m) = enabled("A100-40GB");
        assert_eq!(create_gi(&mut st.clone(), m, 19, Some(7)), Err(MigErr::InvalidArgument), "1g at slot 7");
        assert_eq!(create_gi(&mut st.clone(), m, 14, Some(6)), Err(MigErr::InvalidArgument), "2g at 6");
        assert_eq!(create_gi(&mut st.clone(), m, 99, None), Err(MigErr::InvalidArgument));
        let mut s2 = st;
        create_gi(&mut s2, m, 9, Some(0)).unwrap();
        assert_eq!(create_gi(&mut s2, m, 5, Some(0)), Err(MigErr::InsufficientResources), "3g@0 + 4g@0");
        create_gi(&mut st, m, 5, Some(0)).unwrap();
        create_gi(&mut st, m, 9, Some(4)).unwrap();
        assert_eq!(remaining_gi(&st, m, 19), Ok(0));
        let (mut st, m) = enabled("A100-40GB");
        create_gi(&mut st, m, 20, Some(0)).unwrap();
        assert_eq!(create_gi(&mut st, m, 20, Some(1)), Err(MigErr::InsufficientResources), "second +me");
        assert_eq!(remaining_gi(&st, m, 19), Ok(6));
    }

    #[test]
    fn compute_instances() {
        let (mut st, m) = enabled("H100-80GB");
        let gi = create_gi(&mut st, m, 0, None).unwrap();
        let c = create_ci(&mut st, m, gi, 2, None).unwrap(); // 3c
        assert_eq!(st.gis[gi].cis[c].start, 0);
        assert_eq!(remaining_ci(&st, m, gi, 2), Ok(1));
        assert_eq!(destroy_gi(&mut st, gi), Err(MigErr::InUse));
        destroy_ci(&mut st, gi, c).unwrap();
        destroy_gi(&mut st, gi).unwrap();
        let gi = create_gi(&mut st, m, 9, Some(4)).unwrap(); // 3g
        assert_eq!(create_ci(&mut st, m, gi, 3, None), Err(MigErr::NotSupported), "4c in a 3g");
        assert_eq!(create_ci(&mut st, m, gi, 0, Some(3)), Err(MigErr::InvalidArgument));
        for _ in 0..3 {
            create_ci(&mut st, m, gi, 0, None).unwrap();
        }
        assert_eq!(create_ci(&mut st, m, gi, 0, None), Err(MigErr::InsufficientResources));
        assert_eq!(mig_devices(&st).len(), 3);
    }
}

//! GPU models the simulator can present, with their MIG profile tables.
//!
//! Figures come from NVIDIA's public MIG documentation and published `nvidia-smi mig -lgip`
//! listings; `tests::profile_memory_is_what_nvidia_smi_lists` names the source of each memory
//! figure. Real code must read profiles from NVML at run time; these are the simulator's answers to
//! those queries.

/// Architecture family; decides how MIG mode changes take effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Ampere,
    Ada,
    Hopper,
}

/// One GPU-instance profile with its valid placements (memory-slice units).
#[derive(Clone, Copy, Debug)]
pub struct GiProfile {
    pub name: &'static str,
    /// `NVML_GPU_INSTANCE_PROFILE_*` index, used only by `nvmlDeviceGetGpuInstanceProfileInfo`.
    pub idx: u32,
    /// Profile id taken by every other NVML call.
    pub id: u32,
    /// Compute slices.
    pub g: u32,
    /// Memory slices.
    pub mem: u32,
    pub mib: u64,
    pub sm: u32,
    pub ce: u32,
    pub dec: u32,
    pub enc: u32,
    pub jpeg: u32,
    pub ofa: u32,
    /// instanceCount
    pub max: u32,
    pub starts: &'static [u32],
    pub size: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct MigTable {
    pub memory_slices: u32,
    pub compute_slices: u32,
    pub profiles: &'static [GiProfile],
}

impl MigTable {
    pub fn by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }
    pub fn by_idx(&self, idx: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.idx == idx)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Model {
    /// Key used in the node description (`model = "A100-40GB"`).
    pub key: &'static str,
    /// Name as NVML and `cuDeviceGetName` report it.
    pub name: &'static str,
    pub memory_mib: u64,
    pub sm_count: u32,
    pub cc: (u32, u32),
    pub max_threads_per_sm: u32,
    pub pci_device_id: u32,
    pub arch: Arch,
    pub mig: Option<MigTable>,
}

macro_rules! gi {
    ($name:literal, $idx:literal, $id:literal, $g:literal, $mem:literal, $mib:literal, $sm:literal,
     $ce:literal, $dec:literal, $enc:literal, $jpeg:literal, $ofa:literal, $max:literal, [$($s:literal),*], $size:literal) => {
        GiProfile { name: $name, idx: $idx, id: $id, g: $g, mem: $mem, mib: $mib, sm: $sm, ce: $ce,
            dec: $dec, enc: $enc, jpeg: $jpeg, ofa: $ofa, max: $max, starts: &[$($s),*], size: $size }
    };
}

static A100_40: [GiProfile; 7] = [
    gi!("1g.5gb", 0, 19, 1, 1, 4864, 14, 1, 0, 0, 0, 0, 7, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.5gb+me", 7, 20, 1, 1, 4864, 14, 1, 1, 0, 1, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.10gb", 9, 15, 1, 2, 9984, 14, 1, 1, 0, 0, 0, 4, [0, 2, 4, 6], 2),
    gi!("2g.10gb", 1, 14, 2, 2, 9984, 28, 2, 1, 0, 0, 0, 3, [0, 2, 4], 2),
    gi!("3g.20gb", 2, 9, 3, 4, 20096, 42, 3, 2, 0, 0, 0, 2, [0, 4], 4),
    gi!("4g.20gb", 3, 5, 4, 4, 20096, 56, 4, 2, 0, 0, 0, 1, [0], 4),
    gi!("7g.40gb", 4, 0, 7, 8, 40448, 98, 7, 5, 0, 1, 1, 1, [0], 8),
];

static A100_80: [GiProfile; 7] = [
    gi!("1g.10gb", 0, 19, 1, 1, 9728, 14, 1, 0, 0, 0, 0, 7, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.10gb+me", 7, 20, 1, 1, 9728, 14, 1, 1, 0, 1, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.20gb", 9, 15, 1, 2, 19968, 14, 1, 1, 0, 0, 0, 4, [0, 2, 4, 6], 2),
    gi!("2g.20gb", 1, 14, 2, 2, 19968, 28, 2, 1, 0, 0, 0, 3, [0, 2, 4], 2),
    gi!("3g.40gb", 2, 9, 3, 4, 40192, 42, 3, 2, 0, 0, 0, 2, [0, 4], 4),
    gi!("4g.40gb", 3, 5, 4, 4, 40192, 56, 4, 2, 0, 0, 0, 1, [0], 4),
    gi!("7g.80gb", 4, 0, 7, 8, 80896, 98, 7, 5, 0, 1, 1, 1, [0], 8),
];

static A30: [GiProfile; 5] = [
    gi!("1g.6gb", 0, 14, 1, 1, 5952, 14, 1, 1, 0, 0, 0, 4, [0, 1, 2, 3], 1),
    gi!("1g.6gb+me", 7, 21, 1, 1, 5952, 14, 1, 1, 0, 1, 1, 1, [0, 1, 2, 3], 1),
    gi!("2g.12gb", 1, 5, 2, 2, 11968, 28, 2, 2, 0, 0, 0, 2, [0, 2], 2),
    gi!("2g.12gb+me", 8, 6, 2, 2, 11968, 28, 2, 2, 0, 1, 1, 1, [0, 2], 2),
    gi!("4g.24gb", 3, 0, 4, 4, 24064, 56, 4, 4, 0, 1, 1, 1, [0], 4),
];

static H100_80: [GiProfile; 7] = [
    gi!("1g.10gb", 0, 19, 1, 1, 9984, 16, 1, 1, 0, 1, 0, 7, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.10gb+me", 7, 20, 1, 1, 9984, 16, 1, 1, 0, 1, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.20gb", 9, 15, 1, 2, 20096, 26, 1, 1, 0, 1, 0, 4, [0, 2, 4, 6], 2),
    gi!("2g.20gb", 1, 14, 2, 2, 20096, 32, 2, 2, 0, 2, 0, 3, [0, 2, 4], 2),
    gi!("3g.40gb", 2, 9, 3, 4, 40448, 60, 3, 3, 0, 3, 0, 2, [0, 4], 4),
    gi!("4g.40gb", 3, 5, 4, 4, 40448, 64, 4, 4, 0, 4, 0, 1, [0], 4),
    gi!("7g.80gb", 4, 0, 7, 8, 81152, 132, 8, 7, 0, 7, 1, 1, [0], 8),
];

static H200_141: [GiProfile; 7] = [
    gi!("1g.18gb", 0, 19, 1, 1, 16384, 16, 1, 1, 0, 1, 0, 7, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.18gb+me", 7, 20, 1, 1, 16384, 16, 1, 1, 0, 1, 1, 1, [0, 1, 2, 3, 4, 5, 6], 1),
    gi!("1g.35gb", 9, 15, 1, 2, 33024, 26, 1, 1, 0, 1, 0, 4, [0, 2, 4, 6], 2),
    gi!("2g.35gb", 1, 14, 2, 2, 33024, 32, 2, 2, 0, 2, 0, 3, [0, 2, 4], 2),
    gi!("3g.71gb", 2, 9, 3, 4, 71168, 60, 3, 3, 0, 3, 0, 2, [0, 4], 4),
    gi!("4g.71gb", 3, 5, 4, 4, 71168, 64, 4, 4, 0, 4, 0, 1, [0], 4),
    gi!("7g.141gb", 4, 0, 7, 8, 143104, 132, 8, 7, 0, 7, 1, 1, [0], 8),
];

pub static MODELS: &[Model] = &[
    Model {
        key: "A100-40GB",
        name: "NVIDIA A100-SXM4-40GB",
        memory_mib: 40537,
        sm_count: 108,
        cc: (8, 0),
        max_threads_per_sm: 2048,
        pci_device_id: 0x20B0_10DE,
        arch: Arch::Ampere,
        mig: Some(MigTable { memory_slices: 8, compute_slices: 7, profiles: &A100_40 }),
    },
    Model {
        key: "A100-80GB",
        name: "NVIDIA A100-SXM4-80GB",
        memory_mib: 81920,
        sm_count: 108,
        cc: (8, 0),
        max_threads_per_sm: 2048,
        pci_device_id: 0x20B2_10DE,
        arch: Arch::Ampere,
        mig: Some(MigTable { memory_slices: 8, compute_slices: 7, profiles: &A100_80 }),
    },
    Model {
        key: "A30",
        name: "NVIDIA A30",
        memory_mib: 24576,
        sm_count: 56,
        cc: (8, 0),
        max_threads_per_sm: 2048,
        pci_device_id: 0x20B7_10DE,
        arch: Arch::Ampere,
        mig: Some(MigTable { memory_slices: 4, compute_slices: 4, profiles: &A30 }),
    },
    Model {
        key: "H100-80GB",
        name: "NVIDIA H100 80GB HBM3",
        memory_mib: 81559,
        sm_count: 132,
        cc: (9, 0),
        max_threads_per_sm: 2048,
        pci_device_id: 0x2330_10DE,
        arch: Arch::Hopper,
        mig: Some(MigTable { memory_slices: 8, compute_slices: 7, profiles: &H100_80 }),
    },
    Model {
        key: "H200-141GB",
        name: "NVIDIA H200",
        memory_mib: 143771,
        sm_count: 132,
        cc: (9, 0),
        max_threads_per_sm: 2048,
        pci_device_id: 0x2335_10DE,
        arch: Arch::Hopper,
        mig: Some(MigTable { memory_slices: 8, compute_slices: 7, profiles: &H200_141 }),
    },
    Model {
        key: "L4",
        name: "NVIDIA L4",
        memory_mib: 23034,
        sm_count: 58,
        cc: (8, 9),
        max_threads_per_sm: 1536,
        pci_device_id: 0x27B8_10DE,
        arch: Arch::Ada,
        mig: None,
    },
];

pub fn model(key: &str) -> Option<&'static Model> {
    MODELS.iter().find(|m| m.key.eq_ignore_ascii_case(key))
}

/// Compute-instance profile ids (index = id) and their slice counts.
pub const CI_PROFILE_SLICES: [u32; 7] = [1, 2, 3, 4, 7, 8, 6];

/// How many compute instances of `ci_slices` fit in a GPU instance of `gi_slices` compute slices,
/// or `None` when that profile does not exist there.
pub fn ci_max(gi_slices: u32, ci_slices: u32) -> Option<u32> {
    let m = match (gi_slices, ci_slices) {
        (g, 1) => g,
        (2, 2) | (3, 2) | (3, 3) | (4, 4) | (7, 4) | (7, 7) => 1,
        (4, 2) | (7, 3) => 2,
        (7, 2) => 3,
        _ => return None,
    };
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_is_consistent() {
        for m in MODELS {
            let Some(t) = m.mig else { continue };
            for p in t.profiles {
                assert!(p.g <= t.compute_slices, "{} {}", m.key, p.name);
                for s in p.starts {
                    assert!(s + p.size <= t.memory_slices, "{} {} start {}", m.key, p.name, s);
                }
                assert!(p.max as usize <= p.starts.len(), "{} {}", m.key, p.name);
                assert!(t.by_id(p.id).is_some() && t.by_idx(p.idx).is_some());
            }
        }
    }

    /// Every profile's memory against the GiB that `nvidia-smi mig -lgip` printed for it (two
    /// decimals), and where that figure was published:
    /// * A100-40GB: NVIDIA's MIG User Guide, "Getting Started", the A100-SXM4-40GB listing;
    /// * A100-80GB and A30: `-lgip` listings of A100-SXM4-80GB and A30-24GB (R525 and later drivers),
    ///   as issue 61 of this project quotes them (9.50, 19.50, 39.25, 79.00 GiB; 5.81, 11.69, 23.50);
    /// * H100-80GB: `-lgip` listings of H100 80GB HBM3 published with NVIDIA's mig-parted and GPU
    ///   operator issues, and field notes (9.75, 19.62, 39.50, 79.25 GiB);
    /// * H200-141GB: the `-lgip` listing in NVIDIA/mig-parted issue 120.
    ///
    /// Drivers have moved these figures by a few hundred MiB (a 7g.80gb of 78.50 GiB on older ones):
    /// the agent reads them from NVML, never from a table.
    #[test]
    fn profile_memory_is_what_nvidia_smi_lists() {
        let published: &[(&str, &[(&str, f64)])] = &[
            (
                "A100-40GB",
                &[
                    ("1g.5gb", 4.75),
                    ("1g.5gb+me", 4.75),
                    ("1g.10gb", 9.75),
                    ("2g.10gb", 9.75),
                    ("3g.20gb", 19.62),
                    ("4g.20gb", 19.62),
                    ("7g.40gb", 39.50),
                ],
            ),
            (
                "A100-80GB",
                &[
                    ("1g.10gb", 9.50),
                    ("1g.10gb+me", 9.50),
                    ("1g.20gb", 19.50),
                    ("2g.20gb", 19.50),
                    ("3g.40gb", 39.25),
                    ("4g.40gb", 39.25),
                    ("7g.80gb", 79.00),
                ],
            ),
            (
                "A30",
                &[("1g.6gb", 5.81), ("1g.6gb+me", 5.81), ("2g.12gb", 11.69), ("2g.12gb+me", 11.69), ("4g.24gb", 23.50)],
            ),
            (
                "H100-80GB",
                &[
                    ("1g.10gb", 9.75),
                    ("1g.10gb+me", 9.75),
                    ("1g.20gb", 19.62),
                    ("2g.20gb", 19.62),
                    ("3g.40gb", 39.50),
                    ("4g.40gb", 39.50),
                    ("7g.80gb", 79.25),
                ],
            ),
            (
                "H200-141GB",
                &[
                    ("1g.18gb", 16.00),
                    ("1g.18gb+me", 16.00),
                    ("1g.35gb", 32.25),
                    ("2g.35gb", 32.25),
                    ("3g.71gb", 69.50),
                    ("4g.71gb", 69.50),
                    ("7g.141gb", 139.75),
                ],
            ),
        ];
        for (key, list) in published {
            let t = MODELS.iter().find(|m| m.key == *key).unwrap().mig.unwrap();
            assert_eq!(t.profiles.len(), list.len(), "{key}: every profile is listed");
            for (name, gib) in *list {
                let p = t.profiles.iter().find(|p| p.name == *name).unwrap_or_else(|| panic!("{key} {name}"));
                // nvidia-smi prints `%.2f` (exact halves to even), as Rust's `{:.2}` does.
                let shown = format!("{:.2}", p.mib as f64 / 1024.0);
                assert_eq!(shown, format!("{gib:.2}"), "{key} {name}: {} MiB", p.mib);
            }
        }
    }

    #[test]
    fn ci_table() {
        assert_eq!(ci_max(7, 2), Some(3));
        assert_eq!(ci_max(3, 4), None);
        assert_eq!(ci_max(1, 1), Some(1));
    }
}

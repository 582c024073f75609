//! What a MIG-capable GPU offers and what it has. Everything here comes from NVML at run time (the
//! backend fills it in); nothing is assumed from a GPU model's name.

use serde::{Deserialize, Serialize};

/// A GPU-instance profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// The id NVML takes and returns (`nvidia-smi mig -lgip` "ID").
    pub id: u32,
    /// Name without the "MIG " prefix, e.g. `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    /// Compute slices (the `Ng` of the name).
    pub compute: u32,
    /// Memory slices one placement takes.
    pub memory_slices: u32,
    pub memory_mib: u64,
    pub sms: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
    /// At most this many instances of the profile at once.
    pub max: u32,
    /// Valid placement starts, in memory slices.
    pub starts: Vec<u32>,
}

impl Profile {
    /// A media-extended (`+me`) profile.
    pub fn media_extended(&self) -> bool {
        self.name.ends_with("+me")
    }
}

/// A GPU instance that exists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub gi: u32,
    pub profile: u32,
    pub start: u32,
    pub size: u32,
    /// Compute instances: (id, compute-instance profile id).
    pub compute_instances: Vec<(u32, u32)>,
    /// A workload uses it (a process on it, or an allocation holds it): the planner keeps it.
    pub busy: bool,
    /// The MIG device UUID, when NVML reports it.
    pub uuid: Option<String>,
}

/// A MIG-capable GPU as the planner needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// Memory slices of the whole GPU (one past the highest placement end).
    pub memory_slices: u32,
    pub profiles: Vec<Profile>,
    pub mig_enabled: bool,
    /// A mode change waits for a GPU reset.
    pub mode_pending: bool,
    pub instances: Vec<Instance>,
}

impl Gpu {
    pub fn profile(&self, id: u32) -> Option<&Profile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// A profile by name (`1g.10gb`, with or without the "MIG " prefix; case-insensitive).
    pub fn profile_named(&self, name: &str) -> Option<&Profile> {
        let n = name.trim().trim_start_matches("MIG ").to_ascii_lowercase();
        self.profiles.iter().find(|p| p.name.to_ascii_lowercase() == n)
    }

    /// Memory slices in use, as a bit mask.
    pub fn used_mask(&self) -> u64 {
        self.instances.iter().fold(0, |m, i| m | mask(i.start, i.size))
    }
}

/// Bits `[start, start + size)`.
pub fn mask(start: u32, size: u32) -> u64 {
    if size == 0 {
        0
    } else {
        (((1u128 << size) - 1) << start) as u64
    }
}

/// A placed GPU instance of a layout (planned or wanted).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Placed {
    pub profile: u32,
    pub start: u32,
}

//! The mig-parted v1 configuration format, so existing configs and the GPU operator's
//! `nvidia.com/mig.config` label values (the names under `mig-configs`) work unchanged:
//!
//! ```yaml
//! version: v1
//! mig-configs:
//!   all-balanced:
//!     - device-filter: ["0x20B010DE"]   # optional: PCI device ids, one string or a list
//!       devices: all                    # or a list of GPU indices
//!       mig-enabled: true
//!       mig-devices:
//!         "1g.5gb": 2
//!         "2g.10gb": 1
//!         "3g.20gb": 1
//! ```
//!
//! A GPU takes the first entry of the chosen config that selects it (by index and device filter); a
//! GPU no entry selects is left alone. Compute-instance sub-profiles (`1c.3g.20gb`) are refused with a
//! clear error: every GPU instance gets one compute instance spanning it.

use crate::model::Gpu;
use crate::planner::Want;
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    pub version: String,
    #[serde(rename = "mig-configs")]
    pub mig_configs: BTreeMap<String, Vec<Entry>>,
}

#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum Devices {
    All(String),
    List(Vec<u32>),
}

#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    #[serde(rename = "device-filter")]
    pub device_filter: Option<OneOrMany>,
    pub devices: Devices,
    #[serde(rename = "mig-enabled")]
    pub mig_enabled: bool,
    /// Absent: the mode only, instances are made per request (dynamic mode). Given, even as `{}`:
    /// exactly these instances (`{}`: none, as mig-parted has it).
    #[serde(rename = "mig-devices", default)]
    pub mig_devices: Option<BTreeMap<String, u32>>,
}

/// What one GPU should look like.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Desired {
    pub mig_enabled: bool,
    /// Profile names and counts (resolved against the GPU's own profiles).
    pub devices: BTreeMap<String, u32>,
    /// `devices` is the whole layout, even when empty (`mig-devices` was given; `{}`: no
    /// instances). False: empty `devices` sets the mode only and leaves instances to requests.
    #[serde(default)]
    pub exact: bool,
}

impl Desired {
    /// Whether the layout is named (else only the mode is).
    pub fn has_layout(&self) -> bool {
        self.exact || !self.devices.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

impl File {
    pub fn parse(text: &str) -> Result<File, ConfigError> {
        let f: File = yaml_serde::from_str(text).map_err(|e| ConfigError(format!("mig-parted config: {e}")))?;
        if f.version != "v1" {
            return Err(ConfigError(format!("mig-parted config: version {:?} is not supported (only v1)", f.version)));
        }
        for (name, entries) in &f.mig_configs {
            for (i, e) in entries.iter().enumerate() {
                if let Devices::All(s) = &e.devices {
                    if s != "all" {
                        return Err(ConfigError(format!(
                            "{name}[{i}]: devices must be \"all\" or a list of GPU indices, not {s:?}"
                        )));
                    }
                }
                let devices = e.mig_devices.clone().unwrap_or_default();
                if !e.mig_enabled && !devices.is_empty() {
                    return Err(ConfigError(format!("{name}[{i}]: mig-devices given with mig-enabled: false")));
                }
                for k in devices.keys() {
                    if k.matches('.').count() > 1 && k.split('.').next().is_some_and(|c| c.ends_with('c')) {
                        return Err(ConfigError(format!(
                            "{name}[{i}]: {k}: compute-instance sub-profiles are not supported; \
                             each GPU instance gets one compute instance spanning it"
                        )));
                    }
                }
            }
        }
        Ok(f)
    }

    /// What config `name` wants for GPU `index` with PCI device id `pci` (None: leave it alone).
    pub fn desired(&self, name: &str, index: u32, pci: &str) -> Result<Option<Desired>, ConfigError> {
        let entries = self.mig_configs.get(name).ok_or_else(|| {
            ConfigError(format!(
                "no mig-config named {name:?} (have: {})",
                self.mig_configs.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        for e in entries {
            let idx_ok = match &e.devices {
                Devices::All(_) => true,
                Devices::List(l) => l.contains(&index),
            };
            let filter_ok = match &e.device_filter {
                None => true,
                Some(OneOrMany::One(f)) => f.eq_ignore_ascii_case(pci),
                Some(OneOrMany::Many(v)) => v.iter().any(|f| f.eq_ignore_ascii_case(pci)),
            };
            if idx_ok && filter_ok {
                return Ok(Some(Desired {
                    mig_enabled: e.mig_enabled,
                    devices: e.mig_devices.clone().unwrap_or_default(),
                    exact: e.mig_devices.is_some(),
                }));
            }
        }
        Ok(None)
    }
}

/// The planner's target for `gpu` from profile names and counts.
pub fn wants(gpu: &Gpu, d: &Desired) -> Result<Vec<Want>, ConfigError> {
    let mut v = Vec::new();
    for (name, &n) in &d.devices {
        let p = gpu.profile_named(name).ok_or_else(|| {
            ConfigError(format!(
                "GPU {} ({}) has no MIG profile {name:?} (it has: {})",
                gpu.index,
                gpu.name,
                gpu.profiles.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        // Bounded before anything is built from it: a count is the config's, not the GPU's.
        if n > p.max {
            return Err(ConfigError(format!(
                "{n} x {name}: GPU {} ({}) holds at most {} of that profile",
                gpu.index, gpu.name, p.max
            )));
        }
        v.extend((0..n).map(|_| Want { profile: p.id, start: None }));
    }
    Ok(v)
}

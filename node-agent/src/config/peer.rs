//! The peer schedulers' configuration files, as the agent reads them in their device plugin's
//! place: HAMi's and Volcano's device configuration (the `nvidia` section's settings and the
//! `knownMigGeometries`) and HAMi's per-node device plugin configuration.

use serde::{Deserialize, Serialize};

/// One kind of instance in a MIG geometry: a profile name, its memory in MiB, its share of the GPU's
/// compute in percent and how many the geometry holds. In the register annotation the keys are
/// capitalised, as HAMi's device plugin writes them (its scheduler reads keys case-insensitively); in
/// a scheduler's configuration file they are lower case.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigTemplate {
    #[serde(rename = "Name", alias = "name", default)]
    pub name: String,
    #[serde(rename = "Core", alias = "core", skip_serializing_if = "is_zero", default)]
    pub core: u32,
    #[serde(rename = "Memory", alias = "memory", default)]
    pub memory: u32,
    #[serde(rename = "Count", alias = "count", default)]
    pub count: u32,
}

/// A MIG geometry: a whole-GPU partition the scheduler hands out positions in. `group` is the name
/// Volcano's configuration gives it; HAMi names geometries by their index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigGeometry {
    pub group: String,
    pub templates: Vec<MigTemplate>,
}

impl MigGeometry {
    /// The template of position `pos`: positions count the geometry's instances template by
    /// template (`[2g x3, 1g x1]`: 0-2 are the 2g ones, 3 the 1g).
    pub fn template_at(&self, pos: u32) -> Option<&MigTemplate> {
        let mut first = 0u32;
        for t in &self.templates {
            if pos < first.saturating_add(t.count) {
                return Some(t);
            }
            first = first.saturating_add(t.count);
        }
        None
    }
}

/// The geometries a scheduler's configuration allows for GPUs whose name contains one of `models`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownMigGeometries {
    pub models: Vec<String>,
    pub geometries: Vec<MigGeometry>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum GeometryForm {
    /// Volcano's: `{group, geometries: [...]}`.
    Named { group: String, geometries: Vec<MigTemplate> },
    /// HAMi's: a bare list of templates.
    Bare(Vec<MigTemplate>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KnownForm {
    models: Vec<String>,
    #[serde(rename = "allowedGeometries")]
    allowed: Vec<GeometryForm>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileForm {
    List(Vec<KnownForm>),
    Known {
        #[serde(rename = "knownMigGeometries")]
        known: Vec<KnownForm>,
    },
    /// The whole file: its `nvidia` section, which may have no geometries (the GPUs' own then).
    Nvidia {
        nvidia: NvidiaForm,
    },
}

#[derive(Deserialize)]
struct NvidiaForm {
    #[serde(rename = "knownMigGeometries", default)]
    known: Vec<KnownForm>,
}

/// Why a scheduler's (HAMi's or Volcano's) device configuration cannot be followed.
#[derive(Debug, thiserror::Error)]
pub enum PeerConfigError {
    #[error("{0}; expected knownMigGeometries: a list of {{models: [...], allowedGeometries: [...]}}")]
    GeometriesForm(#[source] yaml_serde::Error),
    #[error("entry {0}: models is empty or names an empty model")]
    NoModels(usize),
    #[error(
        "entry {entry} ({models}): group {group:?}: a group name of digits alone would read as a geometry's index"
    )]
    DigitGroup { entry: usize, models: String, group: String },
    #[error(
        "entry {entry} ({models}): group {group:?}: a group name cannot be empty or hold '-', brackets, ',', ':' or ';' \
         (device IDs carry it as [group-position])"
    )]
    BadGroup { entry: usize, models: String, group: String },
    #[error("entry {entry} ({models}): geometry {group}: every template needs a name and a count of at least 1")]
    BadTemplate { entry: usize, models: String, group: String },
    #[error("entry {entry} ({models}): geometry {group} is named twice")]
    GroupTwice { entry: usize, models: String, group: String },
    #[error("{0}")]
    Settings(#[source] yaml_serde::Error),
    #[error("{0}; expected {{\"nodeconfig\": [...]}}")]
    NodeConfigForm(#[source] serde_json::Error),
    #[error(
        "node {0}: filterdevices is not supported (the agent shares every GPU of its node; leave the GPU out of the \
         scheduler's placement instead)"
    )]
    FilterDevices(String),
    #[error("node {0}: operatingmode {1:?} is not hami-core, mig or mps")]
    Mode(String, String),
}

/// Parses the `knownMigGeometries` of HAMi's or Volcano's device configuration: the list itself, a
/// mapping with that key, or the whole file with it under `nvidia` (other keys are ignored; a whole
/// file without it gives none).
/// Geometries without a group name are named by their index, as HAMi refers to them.
pub fn parse_mig_geometries(text: &str) -> Result<Vec<KnownMigGeometries>, PeerConfigError> {
    let form: FileForm = yaml_serde::from_str(text).map_err(PeerConfigError::GeometriesForm)?;
    let known = match form {
        FileForm::List(k) | FileForm::Known { known: k } | FileForm::Nvidia { nvidia: NvidiaForm { known: k } } => k,
    };
    let mut out = Vec::new();
    for (i, k) in known.into_iter().enumerate() {
        if k.models.is_empty() || k.models.iter().any(|m| m.trim().is_empty()) {
            return Err(PeerConfigError::NoModels(i));
        }
        let mut geometries = Vec::new();
        for (j, g) in k.allowed.into_iter().enumerate() {
            let (group, templates) = match g {
                GeometryForm::Named { group, .. } if group.parse::<usize>().is_ok() => {
                    return Err(PeerConfigError::DigitGroup { entry: i, models: k.models.join(", "), group })
                }
                GeometryForm::Named { group, geometries } => (group, geometries),
                GeometryForm::Bare(t) => (j.to_string(), t),
            };
            if group.is_empty() || group.contains(['-', '[', ']', ',', ':', ';']) {
                return Err(PeerConfigError::BadGroup { entry: i, models: k.models.join(", "), group });
            }
            if templates.is_empty() || templates.iter().any(|t| t.name.is_empty() || t.count == 0) {
                return Err(PeerConfigError::BadTemplate { entry: i, models: k.models.join(", "), group });
            }
            if geometries.iter().any(|g: &MigGeometry| g.group == group) {
                return Err(PeerConfigError::GroupTwice { entry: i, models: k.models.join(", "), group });
            }
            geometries.push(MigGeometry { group, templates });
        }
        out.push(KnownMigGeometries { models: k.models, geometries });
    }
    Ok(out)
}

/// What a scheduler's device configuration (HAMi's or Volcano's, its `nvidia` section) says that the
/// agent, in the device plugin's place, must agree with: the resources pods ask for, the replicas
/// per GPU, the memory scaling and (Volcano) the MiB per memory device. Absent keys are `None`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SchedulerSettings {
    pub resource_count_name: Option<String>,
    pub resource_memory_name: Option<String>,
    pub resource_core_name: Option<String>,
    pub device_split_count: Option<u32>,
    pub device_memory_scaling: Option<f64>,
    pub gpu_memory_factor: Option<u32>,
}

/// The settings of a device configuration's `nvidia` section; None for a file without one (the
/// geometries alone).
pub fn parse_scheduler_settings(text: &str) -> Result<Option<SchedulerSettings>, PeerConfigError> {
    #[derive(Deserialize)]
    struct Doc {
        nvidia: SchedulerSettings,
    }
    let v: yaml_serde::Value = yaml_serde::from_str(text).map_err(PeerConfigError::Settings)?;
    if v.get("nvidia").is_none() {
        return Ok(None);
    }
    // Read again as a document, so that an error names the key's path and line.
    yaml_serde::from_str::<Doc>(text).map(|d| Some(d.nvidia)).map_err(PeerConfigError::Settings)
}

/// This node's entry in HAMi's per-node device plugin configuration (the `config.json` of its
/// `hami-device-plugin` ConfigMap: `{"nodeconfig": [{"name", "devicesplitcount",
/// "devicememoryscaling", "operatingmode", "filterdevices", ...}]}`): its replicas per GPU and memory
/// scaling, and whether it runs MPS (`operatingmode: mps`). What the agent cannot do as HAMi's plugin
/// would is refused, naming the entry: GPUs left out (`filterdevices`).
pub fn hami_node_entry(text: &str, node: &str) -> Result<Option<HamiNodeEntry>, PeerConfigError> {
    #[derive(Deserialize)]
    struct File {
        nodeconfig: Vec<Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        name: String,
        operatingmode: Option<String>,
        devicesplitcount: Option<u32>,
        devicememoryscaling: Option<f64>,
        #[serde(default)]
        filterdevices: Filter,
    }
    #[derive(Deserialize, Default)]
    struct Filter {
        #[serde(default)]
        uuid: Vec<String>,
        #[serde(default)]
        index: Vec<u32>,
    }
    let f: File = serde_json::from_str(text).map_err(PeerConfigError::NodeConfigForm)?;
    let Some(e) = f.nodeconfig.into_iter().find(|e| e.name == node) else { return Ok(None) };
    if !e.filterdevices.uuid.is_empty() || !e.filterdevices.index.is_empty() {
        return Err(PeerConfigError::FilterDevices(node.to_string()));
    }
    let mps = match e.operatingmode.as_deref() {
        None | Some("hami-core" | "mig") => false,
        Some("mps") => true,
        Some(other) => return Err(PeerConfigError::Mode(node.to_string(), other.to_string())),
    };
    Ok(Some(HamiNodeEntry {
        split_count: e.devicesplitcount.filter(|&n| n > 0),
        memory_scaling: e.devicememoryscaling.filter(|&x| x > 0.0),
        mps,
    }))
}

/// What a node's entry in HAMi's per-node configuration sets ([`hami_node_entry`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HamiNodeEntry {
    pub split_count: Option<u32>,
    pub memory_scaling: Option<f64>,
    /// `operatingmode: mps`: every GPU of the node runs MPS.
    pub mps: bool,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

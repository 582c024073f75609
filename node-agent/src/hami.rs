//! HAMi's annotation formats (see HAMi's scheduler): the node register annotation (v2.8 JSON, and the
//! v2.7 text form) and the per-pod device assignment `hami.io/vgpu-devices-to-allocate`.
//! Pure functions; the Kubernetes calls are in `k8s`.

use serde::{Deserialize, Serialize};

pub const NODE_REGISTER: &str = "hami.io/node-nvidia-register";
pub const NODE_HANDSHAKE: &str = "hami.io/node-handshake";
pub const NODE_LOCK: &str = "hami.io/mutex.lock";
pub const TO_ALLOCATE: &str = "hami.io/vgpu-devices-to-allocate";
pub const ALLOCATED: &str = "hami.io/vgpu-devices-allocated";
pub const BIND_PHASE: &str = "hami.io/bind-phase";
pub const BIND_TIME: &str = "hami.io/bind-time";
pub const ASSIGNED_NODE: &str = "hami.io/vgpu-node";

/// The annotation keys and conventions of one scheduler's protocol. HAMi and Volcano's vGPU share
/// the device encoding and the bind-phase protocol, under their own keys.
#[derive(Debug)]
pub struct Protocol {
    pub name: &'static str,
    pub to_allocate: &'static str,
    pub bind_phase: &'static str,
    pub bind_time: &'static str,
    pub register: &'static str,
    /// The node lock annotation; HAMi's names its owner (`<time>,<ns>,<pod>`), Volcano's is a time.
    pub lock: &'static str,
    pub lock_names_owner: bool,
    /// Every container entry closed by `;` (HAMi), or entries joined by `;` (Volcano).
    pub trailing_separator: bool,
}

pub static HAMI: Protocol = Protocol {
    name: "hami",
    to_allocate: TO_ALLOCATE,
    bind_phase: BIND_PHASE,
    bind_time: BIND_TIME,
    register: NODE_REGISTER,
    lock: NODE_LOCK,
    lock_names_owner: true,
    trailing_separator: true,
};

pub static VOLCANO: Protocol = Protocol {
    name: "volcano",
    to_allocate: "volcano.sh/devices-to-allocate",
    bind_phase: "volcano.sh/bind-phase",
    bind_time: "volcano.sh/bind-time",
    register: "volcano.sh/node-vgpu-register",
    lock: "hamivgpu",
    lock_names_owner: false,
    trailing_separator: false,
};

/// Volcano's register value: `uuid,count,devmem,NVIDIA-<model>,health,mode:` per device, `devmem` in
/// units of the memory factor.
pub fn register_volcano(devs: &[RegisteredDevice], memory_factor: u32) -> String {
    devs.iter()
        .map(|d| format!("{},{},{},{},{},{}:", d.id, d.count, d.devmem / memory_factor.max(1), d.ty, d.health, d.mode))
        .collect()
}

/// One device of a container's assignment: `UUID,TYPE,MEM_MiB,CORES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerDevice {
    pub uuid: String,
    pub ty: String,
    pub mem_mib: u64,
    pub cores: u32,
}

/// Decodes `hami.io/vgpu-devices-to-allocate`: containers separated by `;` (init containers first,
/// GPU-less containers as empty entries), devices closed by `:`. With `trailing_separator` (HAMi)
/// every container is closed by `;`; without (Volcano) they are joined by `;`.
pub fn decode(s: &str, trailing_separator: bool) -> Result<Vec<Vec<ContainerDevice>>, String> {
    let body = if trailing_separator { s.strip_suffix(';').unwrap_or(s) } else { s };
    body.split(';')
        .map(|ctr| {
            ctr.split(':')
                .filter(|d| !d.trim().is_empty())
                .map(|d| {
                    let f: Vec<&str> = d.split(',').collect();
                    if f.len() != 4 {
                        return Err(format!("device {d:?}: expected UUID,TYPE,MEM,CORES"));
                    }
                    Ok(ContainerDevice {
                        uuid: f[0].trim().to_string(),
                        ty: f[1].trim().to_string(),
                        mem_mib: f[2]
                            .trim()
                            .parse()
                            .map_err(|_| format!("device {d:?}: memory {:?} is not a number", f[2]))?,
                        cores: f[3]
                            .trim()
                            .parse()
                            .map_err(|_| format!("device {d:?}: cores {:?} is not a number", f[3]))?,
                    })
                })
                .collect()
        })
        .collect()
}

/// The inverse of [`decode`], HAMi's way (every container closed by `;`).
pub fn encode(ctrs: &[Vec<ContainerDevice>]) -> String {
    let mut s = encode_joined(ctrs);
    s.push(';');
    s
}

/// The inverse of [`decode`], Volcano's way (containers joined by `;`).
pub fn encode_joined(ctrs: &[Vec<ContainerDevice>]) -> String {
    ctrs.iter()
        .map(|c| c.iter().map(|d| format!("{},{},{},{}:", d.uuid, d.ty, d.mem_mib, d.cores)).collect::<String>())
        .collect::<Vec<_>>()
        .join(";")
}

/// One GPU of the node register annotation (v2.8); fields left out when zero, false or empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisteredDevice {
    #[serde(skip_serializing_if = "String::is_empty", default)]
    pub id: String,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub index: u32,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub count: u32,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub devmem: u32,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub devcore: u32,
    #[serde(rename = "type", skip_serializing_if = "String::is_empty", default)]
    pub ty: String,
    #[serde(skip_serializing_if = "is_zero", default)]
    pub numa: u32,
    #[serde(skip_serializing_if = "String::is_empty", default)]
    pub mode: String,
    /// A GPU in MIG mode: the geometries the scheduler may cut it into (HAMi's `MIGTemplate`).
    #[serde(rename = "migtemplate", skip_serializing_if = "Vec::is_empty", default)]
    pub mig_template: Vec<Vec<MigTemplate>>,
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub health: bool,
}

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
    Nvidia {
        nvidia: Box<FileForm>,
    },
}

/// Parses the `knownMigGeometries` of HAMi's or Volcano's device configuration: the list itself, a
/// mapping with that key, or the whole file with it under `nvidia` (other keys are ignored).
/// Geometries without a group name are named by their index, as HAMi refers to them.
pub fn parse_mig_geometries(text: &str) -> Result<Vec<KnownMigGeometries>, String> {
    let form: FileForm = yaml_serde::from_str(text).map_err(|e| {
        format!("{e}; expected knownMigGeometries: a list of {{models: [...], allowedGeometries: [...]}}")
    })?;
    let mut form = form;
    let known = loop {
        match form {
            FileForm::List(k) | FileForm::Known { known: k } => break k,
            FileForm::Nvidia { nvidia } => form = *nvidia,
        }
    };
    let mut out = Vec::new();
    for (i, k) in known.into_iter().enumerate() {
        if k.models.is_empty() || k.models.iter().any(|m| m.trim().is_empty()) {
            return Err(format!("entry {i}: models is empty or names an empty model"));
        }
        let mut geometries = Vec::new();
        for (j, g) in k.allowed.into_iter().enumerate() {
            let (group, templates) = match g {
                GeometryForm::Named { group, .. } if group.parse::<usize>().is_ok() => {
                    return Err(format!(
                    "entry {i} ({}): group {group:?}: a group name of digits alone would read as a geometry's index",
                    k.models.join(", ")
                ))
                }
                GeometryForm::Named { group, geometries } => (group, geometries),
                GeometryForm::Bare(t) => (j.to_string(), t),
            };
            if group.is_empty() || group.contains(['-', '[', ']', ',', ':', ';']) {
                return Err(format!(
                    "entry {i} ({}): group {group:?}: a group name cannot be empty or hold '-', brackets, ',', ':' or ';' (device IDs carry it as [group-position])",
                    k.models.join(", ")
                ));
            }
            if templates.is_empty() || templates.iter().any(|t| t.name.is_empty() || t.count == 0) {
                return Err(format!(
                    "entry {i} ({}): geometry {group}: every template needs a name and a count of at least 1",
                    k.models.join(", ")
                ));
            }
            if geometries.iter().any(|g: &MigGeometry| g.group == group) {
                return Err(format!("entry {i} ({}): geometry {group} is named twice", k.models.join(", ")));
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
pub fn parse_scheduler_settings(text: &str) -> Result<Option<SchedulerSettings>, String> {
    #[derive(Deserialize)]
    struct Doc {
        nvidia: SchedulerSettings,
    }
    let v: yaml_serde::Value = yaml_serde::from_str(text).map_err(|e| e.to_string())?;
    if v.get("nvidia").is_none() {
        return Ok(None);
    }
    // Read again as a document, so that an error names the key's path and line.
    yaml_serde::from_str::<Doc>(text).map(|d| Some(d.nvidia)).map_err(|e| e.to_string())
}

/// Where the agent's configuration disagrees with the scheduler's settings, each with whether it
/// breaks placement outright (a resource pods ask for that the agent does not serve, or memory
/// counted in other units: `true`) or only makes the two count differently (`false`).
pub fn settings_mismatches(s: &SchedulerSettings, cfg: &crate::config::Config) -> Vec<(bool, String)> {
    use crate::deviceplugin::Kind;
    let mut v = Vec::new();
    let served = crate::deviceplugin::resources(cfg);
    let volcano = cfg.compat == crate::config::Compat::Volcano;
    // HAMi's memory and core resources are the scheduler's alone (no device plugin serves them).
    let names = [
        ("resourceCountName", &s.resource_count_name, Kind::Replicas),
        ("resourceMemoryName", &s.resource_memory_name, Kind::Memory),
        ("resourceCoreName", &s.resource_core_name, Kind::Cores),
    ];
    for (key, want, kind) in names {
        let Some(want) = want.as_deref().filter(|w| !w.is_empty()) else { continue };
        match served.iter().find(|(_, _, k)| *k == kind) {
            Some((name, _, _)) if name != want => v.push((
                true,
                format!("{key} is {want}, but the agent serves {name}: pods asking for {want} fit no node"),
            )),
            _ => {}
        }
    }
    // HAMi's device plugin takes the replicas and the scaling from this configuration (Volcano's from
    // its own flags, so there they say nothing), unless the node has its own (HAMi's per-node
    // configuration, or a [[node]] section: deliberate).
    if !volcano && !cfg.hami_node_entry && cfg.node_section.is_none() {
        if let Some(n) = s.device_split_count.filter(|&n| n > 0 && n != cfg.split_count) {
            v.push((
                false,
                format!("deviceSplitCount is {n}, but the agent registers {} per GPU (split_count)", cfg.split_count),
            ));
        }
        if let Some(x) = s.device_memory_scaling.filter(|&x| x > 0.0 && (x - cfg.memory_scaling).abs() > 1e-9) {
            v.push((
                false,
                format!(
                    "deviceMemoryScaling is {x}, but the agent scales memory by {} (memory_scaling)",
                    cfg.memory_scaling
                ),
            ));
        }
    }
    // Volcano's scheduler reads memory requests in units of this factor.
    if volcano {
        if let Some(f) = s.gpu_memory_factor.filter(|&f| f > 0 && f != cfg.memory_factor) {
            v.push((
                true,
                format!(
                    "gpuMemoryFactor is {f} MiB, but the agent counts memory in {} MiB units (memory_factor)",
                    cfg.memory_factor
                ),
            ));
        }
    }
    v
}

/// [`settings_mismatches`] as one line: each difference, `; ` between.
pub fn mismatches_text(m: &[(bool, String)]) -> String {
    m.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("; ")
}

/// This node's entry in HAMi's per-node device plugin configuration (the `config.json` of its
/// `hami-device-plugin` ConfigMap: `{"nodeconfig": [{"name", "devicesplitcount",
/// "devicememoryscaling", "operatingmode", "filterdevices", ...}]}`): its replicas per GPU and memory
/// scaling. What the agent cannot do as HAMi's plugin would is refused, naming the entry: GPUs left
/// out (`filterdevices`) and the `mps` mode.
pub fn hami_node_entry(text: &str, node: &str) -> Result<Option<HamiNodeEntry>, String> {
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
    let f: File = serde_json::from_str(text).map_err(|e| format!("{e}; expected {{\"nodeconfig\": [...]}}"))?;
    let Some(e) = f.nodeconfig.into_iter().find(|e| e.name == node) else { return Ok(None) };
    if !e.filterdevices.uuid.is_empty() || !e.filterdevices.index.is_empty() {
        return Err(format!(
            "node {node}: filterdevices is not supported (the agent shares every GPU of its node; leave the GPU out of the scheduler's placement instead)"
        ));
    }
    if e.operatingmode.as_deref() == Some("mps") {
        return Err(format!(
            "node {node}: operatingmode mps is not supported (hami-core, or mig, which follows each GPU's MIG mode)"
        ));
    }
    Ok(Some(HamiNodeEntry {
        split_count: e.devicesplitcount.filter(|&n| n > 0),
        memory_scaling: e.devicememoryscaling.filter(|&x| x > 0.0),
    }))
}

/// What a node's entry in HAMi's per-node configuration sets ([`hami_node_entry`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HamiNodeEntry {
    pub split_count: Option<u32>,
    pub memory_scaling: Option<f64>,
}

/// The configured entry for a GPU named `name` (NVML's name): the first one of whose models the name
/// contains (case-insensitive).
pub fn configured_geometries<'a>(known: &'a [KnownMigGeometries], name: &str) -> Option<&'a KnownMigGeometries> {
    let lower = name.to_ascii_lowercase();
    known.iter().find(|k| k.models.iter().any(|m| lower.contains(&m.to_ascii_lowercase())))
}

/// A GPU of this name and MIG profile table, for looking its profiles up by name.
fn gpu_of(name: &str, profiles: &[vgpu_mig::model::Profile]) -> vgpu_mig::model::Gpu {
    vgpu_mig::model::Gpu {
        index: 0,
        uuid: String::new(),
        name: name.to_string(),
        memory_slices: 0,
        profiles: profiles.to_vec(),
        mig_enabled: true,
        mode_pending: false,
        instances: Vec::new(),
    }
}

/// The geometries of a configured entry that name a MIG profile the GPU (`name`, `profiles`) lacks,
/// each with those profiles; none while its profiles are not known.
pub fn left_out_geometries<'a>(
    k: &'a KnownMigGeometries,
    name: &str,
    profiles: &[vgpu_mig::model::Profile],
) -> Vec<(&'a str, Vec<&'a str>)> {
    left_out_on(k, &gpu_of(name, profiles))
}

/// [`left_out_geometries`] for a GPU already made of its name and profiles.
fn left_out_on<'a>(k: &'a KnownMigGeometries, gpu: &vgpu_mig::model::Gpu) -> Vec<(&'a str, Vec<&'a str>)> {
    if gpu.profiles.is_empty() {
        return Vec::new();
    }
    k.geometries
        .iter()
        .filter_map(|g| {
            let missing: Vec<&str> =
                g.templates.iter().filter(|t| gpu.profile_named(&t.name).is_none()).map(|t| t.name.as_str()).collect();
            (!missing.is_empty()).then_some((g.group.as_str(), missing))
        })
        .collect()
}

/// [`left_out_geometries`] as text: `group (profile, ...); ...`.
pub fn left_out_text(left: &[(&str, Vec<&str>)]) -> String {
    left.iter().map(|(g, m)| format!("{g} ({})", m.join(", "))).collect::<Vec<_>>().join("; ")
}

/// The geometries of a GPU named `name` (NVML's name): those of the first configured entry one of
/// whose models its name contains (less any that names a profile the GPU does not have, when its
/// profiles are known: [`left_out_geometries`]), else the ones its profile table gives
/// ([`vgpu_mig::planner::default_geometries`]), each named after its first profile.
pub fn gpu_geometries(
    known: &[KnownMigGeometries],
    name: &str,
    profiles: &[vgpu_mig::model::Profile],
) -> Vec<MigGeometry> {
    let gpu = gpu_of(name, profiles);
    if let Some(k) = configured_geometries(known, name) {
        let left: Vec<&str> = left_out_on(k, &gpu).into_iter().map(|(g, _)| g).collect();
        let mut v: Vec<MigGeometry> =
            k.geometries.iter().filter(|g| !left.contains(&g.group.as_str())).cloned().collect();
        // HAMi's (unnamed) geometries are referred to by their index in what is registered.
        for (i, g) in v.iter_mut().enumerate() {
            if g.group.parse::<usize>().is_ok() {
                g.group = i.to_string();
            }
        }
        return v;
    }
    let full = profiles.iter().map(|p| p.compute).max().unwrap_or(1).max(1);
    vgpu_mig::planner::default_geometries(&gpu)
        .into_iter()
        .filter_map(|g| {
            let templates: Vec<MigTemplate> = g
                .iter()
                .filter_map(|&(id, count)| {
                    let p = gpu.profile(id)?;
                    Some(MigTemplate {
                        name: p.name.clone(),
                        core: p.compute * 100 / full,
                        memory: u32::try_from(p.memory_mib).unwrap_or(u32::MAX),
                        count,
                    })
                })
                .collect();
            Some(MigGeometry { group: templates.first()?.name.clone(), templates })
        })
        .collect()
}

/// A position in a MIG geometry: the geometry (an index or a group name) and the position in it.
pub type MigPosition<'a> = (&'a str, u32);

/// A device ID of a scheduler's assignment: a GPU UUID, or (a GPU in MIG mode) a GPU UUID with the
/// geometry and the position in it, `GPU-...[geometry-position]`; the geometry is HAMi's index or
/// Volcano's group name.
pub fn split_device_id(id: &str) -> Result<(&str, Option<MigPosition<'_>>), String> {
    let Some((base, rest)) = id.split_once('[') else { return Ok((id, None)) };
    let inner = rest.strip_suffix(']').ok_or_else(|| format!("device {id:?}: expected UUID[geometry-position]"))?;
    let (geo, pos) =
        inner.rsplit_once('-').ok_or_else(|| format!("device {id:?}: expected UUID[geometry-position]"))?;
    let pos = pos.parse().map_err(|_| format!("device {id:?}: position {pos:?} is not a number"))?;
    if base.is_empty() || geo.is_empty() {
        return Err(format!("device {id:?}: expected UUID[geometry-position]"));
    }
    Ok((base, Some((geo, pos))))
}

/// The geometry a device ID names: digits alone are an index (HAMi's), anything else a group name
/// (Volcano's).
pub fn find_geometry<'a>(geometries: &'a [MigGeometry], geo: &str) -> Option<&'a MigGeometry> {
    match geo.parse::<usize>() {
        Ok(i) => geometries.get(i),
        Err(_) => geometries.iter().find(|g| g.group == geo),
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// The v2.8 JSON value.
pub fn register_json(devs: &[RegisteredDevice]) -> String {
    serde_json::to_string(devs).expect("serialisable")
}

/// The v2.7 text value: `uuid,count,devmem,devcore,type,numa,health,index,mode:` per device.
pub fn register_text(devs: &[RegisteredDevice]) -> String {
    devs.iter()
        .map(|d| {
            format!(
                "{},{},{},{},{},{},{},{},{}:",
                d.id, d.count, d.devmem, d.devcore, d.ty, d.numa, d.health, d.index, d.mode
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_assignments_round_trip_with_init_and_gpu_less_containers() {
        let s = ";GPU-aaa,NVIDIA,3000,30:;GPU-aaa,NVIDIA,5000,0:GPU-bbb,NVIDIA,5000,0:;";
        let v = decode(s, true).unwrap();
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(v[0].is_empty(), "the init container has no GPU");
        assert_eq!(
            v[1],
            vec![ContainerDevice { uuid: "GPU-aaa".into(), ty: "NVIDIA".into(), mem_mib: 3000, cores: 30 }]
        );
        assert_eq!(v[2].len(), 2);
        assert_eq!(encode(&v), s);
        // Volcano's form: no trailing ';'.
        let v = decode("GPU-a,NVIDIA,1,2:;GPU-b,NVIDIA,3,4:", false).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(decode("GPU-a,NVIDIA,1,2:;", false).unwrap().len(), 2, "Volcano: a GPU-less second container");
        assert_eq!(encode_joined(&v), "GPU-a,NVIDIA,1,2:;GPU-b,NVIDIA,3,4:");
        assert!(decode("GPU-a,NVIDIA,lots,2:;", true).unwrap_err().contains("memory \"lots\""));
        assert!(decode("GPU-a,NVIDIA:;", true).unwrap_err().contains("expected UUID,TYPE,MEM,CORES"));
    }

    #[test]
    fn node_register_formats() {
        let d = RegisteredDevice {
            id: "GPU-a".into(),
            index: 0,
            count: 10,
            devmem: 40960,
            devcore: 100,
            ty: "NVIDIA-NVIDIA A100".into(),
            numa: 0,
            mode: "hami-core".into(),
            mig_template: Vec::new(),
            health: true,
        };
        assert_eq!(
            register_json(std::slice::from_ref(&d)),
            r#"[{"id":"GPU-a","count":10,"devmem":40960,"devcore":100,"type":"NVIDIA-NVIDIA A100","mode":"hami-core","health":true}]"#
        );
        assert_eq!(
            register_text(std::slice::from_ref(&d)),
            "GPU-a,10,40960,100,NVIDIA-NVIDIA A100,0,true,0,hami-core:"
        );
        assert_eq!(register_volcano(&[d], 1024), "GPU-a,10,40,NVIDIA-NVIDIA A100,true,hami-core:");
    }

    fn profile(
        id: u32,
        name: &str,
        compute: u32,
        slices: u32,
        mib: u64,
        max: u32,
        starts: &[u32],
    ) -> vgpu_mig::model::Profile {
        vgpu_mig::model::Profile {
            id,
            name: name.into(),
            compute,
            memory_slices: slices,
            memory_mib: mib,
            sms: compute * 16,
            decoders: 1,
            encoders: 0,
            jpegs: 0,
            ofas: 0,
            max,
            starts: starts.to_vec(),
        }
    }

    /// An H100 80GB's profile table, as NVML lists it (facts: NVIDIA's MIG user guide).
    fn h100() -> Vec<vgpu_mig::model::Profile> {
        vec![
            profile(19, "1g.10gb", 1, 1, 9984, 7, &[0, 1, 2, 3, 4, 5, 6]),
            profile(20, "1g.10gb+me", 1, 1, 9984, 1, &[0, 1, 2, 3, 4, 5, 6]),
            profile(15, "1g.20gb", 1, 2, 20096, 4, &[0, 2, 4, 6]),
            profile(14, "2g.20gb", 2, 2, 20096, 3, &[0, 2, 4]),
            profile(9, "3g.40gb", 3, 4, 40448, 2, &[0, 4]),
            profile(5, "4g.40gb", 4, 4, 40448, 1, &[0]),
            profile(0, "7g.80gb", 7, 8, 81152, 1, &[0]),
        ]
    }

    #[test]
    fn a_mig_gpu_registers_the_geometries_of_its_profile_table() {
        let g = gpu_geometries(&[], "NVIDIA H100 80GB HBM3", &h100());
        let t = |name: &str, core, memory, count| MigTemplate { name: name.into(), core, memory, count };
        assert_eq!(
            g,
            vec![
                MigGeometry { group: "1g.10gb".into(), templates: vec![t("1g.10gb", 14, 9984, 7)] },
                MigGeometry { group: "1g.20gb".into(), templates: vec![t("1g.20gb", 14, 20096, 4)] },
                MigGeometry {
                    group: "2g.20gb".into(),
                    templates: vec![t("2g.20gb", 28, 20096, 3), t("1g.10gb", 14, 9984, 1)]
                },
                MigGeometry { group: "3g.40gb".into(), templates: vec![t("3g.40gb", 42, 40448, 2)] },
                MigGeometry {
                    group: "4g.40gb".into(),
                    templates: vec![t("4g.40gb", 57, 40448, 1), t("3g.40gb", 42, 40448, 1)]
                },
                MigGeometry { group: "7g.80gb".into(), templates: vec![t("7g.80gb", 100, 81152, 1)] },
            ]
        );
        // In the annotation: HAMi's keys, as its device plugin writes them.
        let d = RegisteredDevice {
            id: "GPU-h".into(),
            mode: "mig".into(),
            mig_template: vec![g[2].templates.clone()],
            health: true,
            ..Default::default()
        };
        assert_eq!(
            register_json(&[d]),
            r#"[{"id":"GPU-h","mode":"mig","migtemplate":[[{"Name":"2g.20gb","Core":28,"Memory":20096,"Count":3},{"Name":"1g.10gb","Core":14,"Memory":9984,"Count":1}]],"health":true}]"#
        );
        // Positions count instances template by template.
        assert_eq!(g[2].template_at(2).unwrap().name, "2g.20gb");
        assert_eq!(g[2].template_at(3).unwrap().name, "1g.10gb");
        assert!(g[2].template_at(4).is_none());
        // HAMi names a geometry by its index, Volcano by its group.
        assert_eq!(find_geometry(&g, "2").unwrap().group, "2g.20gb");
        assert_eq!(find_geometry(&g, "3g.40gb").unwrap().group, "3g.40gb");
        assert!(find_geometry(&g, "9").is_none());
        assert!(find_geometry(&g, "8g").is_none());
    }

    #[test]
    fn device_ids_carry_a_position_in_a_mig_geometry() {
        assert_eq!(split_device_id("GPU-aaa").unwrap(), ("GPU-aaa", None));
        assert_eq!(split_device_id("GPU-a-b-c[2-3]").unwrap(), ("GPU-a-b-c", Some(("2", 3))));
        assert_eq!(split_device_id("GPU-a[group2-0]").unwrap(), ("GPU-a", Some(("group2", 0))));
        assert!(split_device_id("GPU-a[2-3").unwrap_err().contains("expected UUID[geometry-position]"));
        assert!(split_device_id("GPU-a[23]").unwrap_err().contains("expected UUID[geometry-position]"));
        assert!(split_device_id("GPU-a[2-x]").unwrap_err().contains("position \"x\" is not a number"));
        assert!(split_device_id("[2-1]").is_err());
        // And through the annotation's encoding, as HAMi's scheduler writes it.
        let v = decode("GPU-a[1-2],NVIDIA,20096,0:;", true).unwrap();
        assert_eq!(v[0][0].uuid, "GPU-a[1-2]");
    }

    #[test]
    fn the_schedulers_geometry_configuration_is_read_in_either_form() {
        // Volcano's: named groups, the whole device configuration (other keys ignored).
        let volcano = "nvidia:\n  resourceCountName: volcano.sh/vgpu-number\n  knownMigGeometries:\n  - models: [\"A100-SXM4-40GB\", \"A100-PCIE-40GB\"]\n    allowedGeometries:\n    - group: group1\n      geometries:\n      - {name: 1g.5gb, memory: 5120, count: 7}\n    - group: group2\n      geometries:\n      - {name: 2g.10gb, memory: 10240, count: 3}\n      - {name: 1g.5gb, memory: 5120, count: 1}\n";
        let k = parse_mig_geometries(volcano).unwrap();
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].geometries[1].group, "group2");
        assert_eq!(
            k[0].geometries[1].templates[1],
            MigTemplate { name: "1g.5gb".into(), core: 0, memory: 5120, count: 1 }
        );
        // HAMi's: bare lists, named by index; the list alone.
        let hami = "- models: [H100]\n  allowedGeometries:\n  - - {name: 1g.10gb, core: 14, memory: 10240, count: 7}\n  - - {name: 7g.80gb, memory: 81920, count: 1}\n";
        let k2 = parse_mig_geometries(hami).unwrap();
        assert_eq!(k2[0].geometries.iter().map(|g| g.group.as_str()).collect::<Vec<_>>(), ["0", "1"]);
        assert_eq!(k2[0].geometries[0].templates[0].core, 14);
        // A GPU whose name holds a model gets the configured geometries; another, its own.
        assert_eq!(gpu_geometries(&k2, "NVIDIA H100 80GB HBM3", &h100())[1].group, "1");
        // Less those that name a profile the GPU does not have (an A100's on an H100).
        let k3 = parse_mig_geometries("- models: [H100]\n  allowedGeometries:\n  - - {name: 1g.5gb, memory: 5120, count: 7}\n  - - {name: 3g.40gb, memory: 40960, count: 2}\n").unwrap();
        let g3 = gpu_geometries(&k3, "NVIDIA H100 80GB HBM3", &h100());
        assert_eq!(g3.len(), 1);
        assert_eq!(g3[0].templates[0].name, "3g.40gb");
        assert_eq!(g3[0].group, "0", "referred to by its index in what is registered, not in the file");
        assert_eq!(gpu_geometries(&k, "NVIDIA H100 80GB HBM3", &h100())[0].group, "1g.10gb");
        // Mistakes are named.
        let e = parse_mig_geometries("knownMigGeometries:\n- models: [A30]\n  allowedGeometries:\n  - group: my-group\n    geometries: [{name: 1g.6gb, memory: 6144, count: 4}]\n").unwrap_err();
        assert!(e.contains("group \"my-group\"") && e.contains("[group-position]"), "{e}");
        let e = parse_mig_geometries("- models: [A30]\n  allowedGeometries:\n  - - {name: 1g.6gb, memory: 6144}\n")
            .unwrap_err();
        assert!(e.contains("geometry 0: every template needs a name and a count"), "{e}");
        let e = parse_mig_geometries("- models: []\n  allowedGeometries: []\n").unwrap_err();
        assert!(e.contains("entry 0: models is empty"), "{e}");
        let e = parse_mig_geometries("- models: [\"\"]\n  allowedGeometries: []\n").unwrap_err();
        assert!(e.contains("names an empty model"), "{e}");
        let e = parse_mig_geometries(
            "- models: [A30]\n  allowedGeometries:\n  - group: \"7\"\n    geometries: [{name: 1g.6gb, count: 1}]\n",
        )
        .unwrap_err();
        assert!(e.contains("digits alone would read as a geometry's index"), "{e}");
        assert!(parse_mig_geometries("gpus: 3\n").unwrap_err().contains("expected knownMigGeometries"));
        let e = parse_mig_geometries("- models: [A30]\n  allowedGeometries:\n  - group: g\n    geometries: [{name: 1g.6gb, count: 1}]\n  - group: g\n    geometries: [{name: 1g.6gb, count: 1}]\n").unwrap_err();
        assert!(e.contains("geometry g is named twice"), "{e}");
    }

    #[test]
    fn the_agent_is_checked_against_the_rest_of_the_schedulers_configuration() {
        let geo = "  knownMigGeometries:\n  - models: [A30]\n    allowedGeometries:\n    - - {name: 1g.6gb, memory: 6144, count: 4}\n";
        // The geometries alone carry no settings; a whole configuration carries its nvidia section.
        assert_eq!(parse_scheduler_settings("- models: [A30]\n  allowedGeometries: []\n").unwrap(), None);
        let hami = format!("nvidia:\n  resourceCountName: nvidia.com/gpu\n  resourceMemoryName: nvidia.com/gpumem\n  deviceSplitCount: 10\n  deviceMemoryScaling: 1\n  defaultMemory: 0\n{geo}");
        let s = parse_scheduler_settings(&hami).unwrap().unwrap();
        assert_eq!(s.resource_count_name.as_deref(), Some("nvidia.com/gpu"));
        assert_eq!((s.device_split_count, s.device_memory_scaling, s.gpu_memory_factor), (Some(10), Some(1.0), None));
        let e = parse_scheduler_settings("nvidia:\n  deviceSplitCount: ten\n").unwrap_err();
        assert!(e.starts_with("nvidia.deviceSplitCount: invalid type"), "{e}");
        let cfg = |toml: &str| crate::config::Config::from_toml(toml).unwrap();
        // HAMi's defaults agree with the agent's; its memory resource is the scheduler's own.
        assert_eq!(settings_mismatches(&s, &cfg("compat = \"hami\"")), []);
        // Another count resource breaks placement; other replicas or scaling only count differently.
        let got = settings_mismatches(
            &s,
            &cfg("compat = \"hami\"\nresource_name = \"example.com/gpu\"\nsplit_count = 4\nmemory_scaling = 2.0"),
        );
        assert_eq!(
            got,
            [
                (true, "resourceCountName is nvidia.com/gpu, but the agent serves example.com/gpu: pods asking for nvidia.com/gpu fit no node".to_string()),
                (false, "deviceSplitCount is 10, but the agent registers 4 per GPU (split_count)".to_string()),
                (false, "deviceMemoryScaling is 1, but the agent scales memory by 2 (memory_scaling)".to_string()),
            ]
        );
        // Settings of the node's own are deliberate: not compared.
        let own = cfg("compat = \"hami\"\nsplit_count = 4\n[[node]]\nnames = [\"*\"]\nmemory_scaling = 2.0\n");
        assert_eq!(settings_mismatches(&s, &own), []);
        // Volcano: its three resources, and the memory factor.
        let volcano = parse_scheduler_settings(&format!("nvidia:\n  resourceCountName: volcano.sh/vgpu-number\n  resourceMemoryName: volcano.sh/vgpu-mem\n  resourceCoreName: volcano.sh/vgpu-cores\n  deviceSplitCount: 4\n  gpuMemoryFactor: 1\n{geo}")).unwrap().unwrap();
        let got = settings_mismatches(&volcano, &cfg("compat = \"volcano\""));
        assert_eq!(got.len(), 2, "not deviceSplitCount, which Volcano's plugin takes from its flags: {got:?}");
        assert!(
            got[0].0
                && got[0].1.starts_with(
                    "resourceMemoryName is volcano.sh/vgpu-mem, but the agent serves volcano.sh/vgpu-memory"
                ),
            "{got:?}"
        );
        assert_eq!(
            got[1],
            (
                true,
                "gpuMemoryFactor is 1 MiB, but the agent counts memory in 1024 MiB units (memory_factor)".to_string()
            )
        );
        assert_eq!(settings_mismatches(&volcano, &cfg("compat = \"volcano\"\nmemory_factor = 1")).len(), 1);
    }
}

//! HAMi's annotation formats (see HAMi's scheduler): the node register annotation (v2.8 JSON, and the
//! v2.7 text form) and the per-pod device assignment `hami.io/vgpu-devices-to-allocate`.
//! Pure functions; the Kubernetes calls are in `k8s`.

pub use crate::config::peer::{
    hami_node_entry, parse_mig_geometries, parse_scheduler_settings, HamiNodeEntry, KnownMigGeometries, MigGeometry,
    MigTemplate, SchedulerSettings,
};
use serde::{Deserialize, Serialize};

pub const NODE_REGISTER: &str = "hami.io/node-nvidia-register";
pub const NODE_HANDSHAKE: &str = "hami.io/node-handshake";
/// The handshake Volcano's vGPU device plugin writes; its scheduler reads no time from it, but the
/// write is a node event (see `Kube::register`).
pub const VOLCANO_HANDSHAKE: &str = "volcano.sh/node-vgpu-handshake";
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
    /// A device's memory in the scheduler's annotations: MiB (HAMi), or units of the scheduler's
    /// `gpuMemoryFactor` MiB, `memory_factor` here (Volcano: its scheduler writes what the pod asked
    /// for in `volcano.sh/vgpu-memory`, and its device plugin multiplies).
    pub memory_in_factor_units: bool,
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
    memory_in_factor_units: false,
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
    memory_in_factor_units: true,
};

/// A container's priority as HAMi states it: its `nvidia.com/priority` limit, or the
/// `CUDA_TASK_PRIORITY` its spec sets (what HAMi's admission webhook writes from that limit): 0 is
/// high, anything else (HAMi's default, 1) normal.
pub fn task_priority(c: &k8s_openapi::api::core::v1::Container) -> crate::slices::Priority {
    let limit = c.resources.as_ref().and_then(|r| r.limits.as_ref()).and_then(|l| l.get(PRIORITY_RESOURCE));
    let env = || c.env.iter().flatten().find(|e| e.name == "CUDA_TASK_PRIORITY").and_then(|e| e.value.clone());
    match limit.map(|q| q.0.clone()).or_else(env).as_deref().map(str::trim) {
        Some("0") => crate::slices::Priority::High,
        _ => crate::slices::Priority::Normal,
    }
}

/// HAMi's resource for a container's task priority.
pub const PRIORITY_RESOURCE: &str = "nvidia.com/priority";

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

/// Why a scheduler's assignment annotation cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    #[error("device {0:?}: expected UUID,TYPE,MEM,CORES")]
    Fields(String),
    #[error("device {device:?}: memory {value:?} is not a number")]
    Memory { device: String, value: String },
    #[error("device {device:?}: cores {value:?} is not a number")]
    Cores { device: String, value: String },
    #[error("device {0:?}: expected UUID[geometry-position]")]
    DeviceId(String),
    #[error("device {device:?}: position {value:?} is not a number")]
    Position { device: String, value: String },
    #[error("{MIG_ALLOCATIONS}: {0}")]
    MigAllocationsForm(String),
    #[error("{MIG_ALLOCATIONS}: allocation {0} is incomplete (it needs gpuUUID, profile and a placement)")]
    MigAllocationIncomplete(usize),
    #[error("{MIG_ALLOCATIONS}: allocation {0} has part of a MIG device's identity (migUUID, gpuInstanceID and computeInstanceID go together)")]
    MigAllocationPartial(usize),
    #[error("{MIG_ALLOCATIONS}: container {container} device {device} is allocated twice")]
    MigAllocationTwice { container: usize, device: usize },
}

/// HAMi (v2.10 and later): the MIG device its scheduler reserved for each MIG-placed device of a
/// pod, as JSON in this annotation; the node side makes exactly that (the profile at that
/// placement) and writes back the MIG device it made.
pub const MIG_ALLOCATIONS: &str = "hami.io/vgpu-mig-allocations";

/// One MIG device a scheduler reserved: for which container (annotation order, init containers
/// first) and which of its devices, on which GPU, of which profile, where; once made, its identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigAllocation {
    pub container_index: usize,
    pub device_index: usize,
    #[serde(rename = "gpuUUID")]
    pub gpu_uuid: String,
    pub profile: String,
    pub placement: MigPlacement,
    #[serde(rename = "migUUID", default, skip_serializing_if = "String::is_empty")]
    pub mig_uuid: String,
    #[serde(rename = "gpuInstanceID", default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance_id: Option<u32>,
    #[serde(rename = "computeInstanceID", default, skip_serializing_if = "Option::is_none")]
    pub compute_instance_id: Option<u32>,
}

/// Where a MIG device sits: its first memory slice and how many it spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

/// Reads [`MIG_ALLOCATIONS`] as HAMi writes it (empty: none), refusing an allocation without a
/// GPU, profile or placement, one with part of a made device's identity, and a device twice.
pub fn decode_mig_allocations(raw: &str) -> Result<Vec<MigAllocation>, AssignmentError> {
    if raw.trim().is_empty() {
        return Ok(Vec::new());
    }
    let all: Vec<MigAllocation> =
        serde_json::from_str(raw).map_err(|e| AssignmentError::MigAllocationsForm(e.to_string()))?;
    for (i, a) in all.iter().enumerate() {
        if a.gpu_uuid.is_empty() || a.profile.is_empty() || a.placement.size == 0 {
            return Err(AssignmentError::MigAllocationIncomplete(i));
        }
        let made = [!a.mig_uuid.is_empty(), a.gpu_instance_id.is_some(), a.compute_instance_id.is_some()];
        if made.iter().any(|m| *m) && !made.iter().all(|m| *m) {
            return Err(AssignmentError::MigAllocationPartial(i));
        }
        if all[..i].iter().any(|b| (b.container_index, b.device_index) == (a.container_index, a.device_index)) {
            return Err(AssignmentError::MigAllocationTwice { container: a.container_index, device: a.device_index });
        }
    }
    Ok(all)
}

/// Decodes `hami.io/vgpu-devices-to-allocate`: containers separated by `;` (init containers first,
/// GPU-less containers as empty entries), devices closed by `:`. With `trailing_separator` (HAMi)
/// every container is closed by `;`; without (Volcano) they are joined by `;`.
pub fn decode(s: &str, trailing_separator: bool) -> Result<Vec<Vec<ContainerDevice>>, AssignmentError> {
    let body = if trailing_separator { s.strip_suffix(';').unwrap_or(s) } else { s };
    body.split(';')
        .map(|ctr| {
            ctr.split(':')
                .filter(|d| !d.trim().is_empty())
                .map(|d| {
                    let f: Vec<&str> = d.split(',').collect();
                    if f.len() != 4 {
                        return Err(AssignmentError::Fields(d.to_string()));
                    }
                    Ok(ContainerDevice {
                        uuid: f[0].trim().to_string(),
                        ty: f[1].trim().to_string(),
                        mem_mib: f[2]
                            .trim()
                            .parse()
                            .map_err(|_| AssignmentError::Memory { device: d.to_string(), value: f[2].to_string() })?,
                        cores: f[3]
                            .trim()
                            .parse()
                            .map_err(|_| AssignmentError::Cores { device: d.to_string(), value: f[3].to_string() })?,
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
pub fn split_device_id(id: &str) -> Result<(&str, Option<MigPosition<'_>>), AssignmentError> {
    let Some((base, rest)) = id.split_once('[') else { return Ok((id, None)) };
    let shape = || AssignmentError::DeviceId(id.to_string());
    let inner = rest.strip_suffix(']').ok_or_else(shape)?;
    let (geo, pos) = inner.rsplit_once('-').ok_or_else(shape)?;
    let pos = pos.parse().map_err(|_| AssignmentError::Position { device: id.to_string(), value: pos.to_string() })?;
    if base.is_empty() || geo.is_empty() {
        return Err(shape());
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
    use crate::deviceplugin::settings_mismatches;

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
        assert!(
            matches!(decode("GPU-a,NVIDIA,lots,2:;", true).unwrap_err(), AssignmentError::Memory { value, .. } if value == "lots")
        );
        assert_eq!(decode("GPU-a,NVIDIA:;", true).unwrap_err(), AssignmentError::Fields("GPU-a,NVIDIA".into()));
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
    fn hami_s_mig_allocations_are_read_as_it_writes_them_and_refused_when_broken() {
        let raw = r#"[{"containerIndex":1,"deviceIndex":0,"gpuUUID":"GPU-a","profile":"1g.10gb","placement":{"start":6,"size":1}}]"#;
        let a = decode_mig_allocations(raw).unwrap();
        assert_eq!(
            (a[0].container_index, a[0].profile.as_str(), a[0].placement),
            (1, "1g.10gb", MigPlacement { start: 6, size: 1 })
        );
        assert_eq!(decode_mig_allocations("").unwrap(), []);
        let mut made = a[0].clone();
        (made.mig_uuid, made.gpu_instance_id, made.compute_instance_id) = ("MIG-x".into(), Some(13), Some(0));
        let back = serde_json::to_string(&[made.clone()]).unwrap();
        assert!(back.contains(r#""migUUID":"MIG-x","gpuInstanceID":13,"computeInstanceID":0"#), "{back}");
        assert_eq!(decode_mig_allocations(&back).unwrap(), [made]);
        let partial = raw.replace(r#""placement""#, r#""migUUID":"MIG-x","placement""#);
        assert_eq!(decode_mig_allocations(&partial).unwrap_err(), AssignmentError::MigAllocationPartial(0));
        let twice = format!("[{0},{0}]", &raw[1..raw.len() - 1]);
        assert_eq!(
            decode_mig_allocations(&twice).unwrap_err(),
            AssignmentError::MigAllocationTwice { container: 1, device: 0 }
        );
        let empty = raw.replace("GPU-a", "");
        assert_eq!(decode_mig_allocations(&empty).unwrap_err(), AssignmentError::MigAllocationIncomplete(0));
        assert!(matches!(decode_mig_allocations("{").unwrap_err(), AssignmentError::MigAllocationsForm(_)));
    }

    #[test]
    fn device_ids_carry_a_position_in_a_mig_geometry() {
        assert_eq!(split_device_id("GPU-aaa").unwrap(), ("GPU-aaa", None));
        assert_eq!(split_device_id("GPU-a-b-c[2-3]").unwrap(), ("GPU-a-b-c", Some(("2", 3))));
        assert_eq!(split_device_id("GPU-a[group2-0]").unwrap(), ("GPU-a", Some(("group2", 0))));
        assert!(split_device_id("GPU-a[2-3").unwrap_err().to_string().contains("expected UUID[geometry-position]"));
        assert!(split_device_id("GPU-a[23]").unwrap_err().to_string().contains("expected UUID[geometry-position]"));
        assert!(split_device_id("GPU-a[2-x]").unwrap_err().to_string().contains("position \"x\" is not a number"));
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
        // A whole device configuration without geometries (no MIG in the cluster): none, the GPUs' own.
        assert!(parse_mig_geometries("nvidia:\n  gpuMemoryFactor: 4\n").unwrap().is_empty());
        assert!(parse_mig_geometries("other: 1\n").is_err(), "neither form");
        assert_eq!(gpu_geometries(&k, "NVIDIA H100 80GB HBM3", &h100())[0].group, "1g.10gb");
        // Mistakes are named.
        let e = parse_mig_geometries("knownMigGeometries:\n- models: [A30]\n  allowedGeometries:\n  - group: my-group\n    geometries: [{name: 1g.6gb, memory: 6144, count: 4}]\n").unwrap_err().to_string();
        assert!(e.contains("group \"my-group\"") && e.contains("[group-position]"), "{e}");
        let e = parse_mig_geometries("- models: [A30]\n  allowedGeometries:\n  - - {name: 1g.6gb, memory: 6144}\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("geometry 0: every template needs a name and a count"), "{e}");
        let e = parse_mig_geometries("- models: []\n  allowedGeometries: []\n").unwrap_err().to_string();
        assert!(e.contains("entry 0: models is empty"), "{e}");
        let e = parse_mig_geometries("- models: [\"\"]\n  allowedGeometries: []\n").unwrap_err().to_string();
        assert!(e.contains("names an empty model"), "{e}");
        let e = parse_mig_geometries(
            "- models: [A30]\n  allowedGeometries:\n  - group: \"7\"\n    geometries: [{name: 1g.6gb, count: 1}]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("digits alone would read as a geometry's index"), "{e}");
        assert!(parse_mig_geometries("gpus: 3\n").unwrap_err().to_string().contains("expected knownMigGeometries"));
        let e = parse_mig_geometries("- models: [A30]\n  allowedGeometries:\n  - group: g\n    geometries: [{name: 1g.6gb, count: 1}]\n  - group: g\n    geometries: [{name: 1g.6gb, count: 1}]\n").unwrap_err().to_string();
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
        let e = parse_scheduler_settings("nvidia:\n  deviceSplitCount: ten\n").unwrap_err().to_string();
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
        let got = settings_mismatches(&volcano, &cfg("compat = \"volcano\"\nmemory_factor = 1024"));
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
        // Unset, memory_factor is Volcano's default unit, 1 MiB.
        assert_eq!(cfg("compat = \"volcano\"").memory_factor, 1);
    }
}

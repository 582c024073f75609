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
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub health: bool,
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
}

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

/// One device of a container's assignment: `UUID,TYPE,MEM_MiB,CORES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerDevice {
    pub uuid: String,
    pub ty: String,
    pub mem_mib: u64,
    pub cores: u32,
}

/// Decodes `hami.io/vgpu-devices-to-allocate`: containers separated by `;` (init containers first,
/// GPU-less containers as empty entries), devices closed by `:`. A trailing `;` closes the last
/// container (HAMi writes one; Volcano does not).
pub fn decode(s: &str) -> Result<Vec<Vec<ContainerDevice>>, String> {
    let body = s.strip_suffix(';').unwrap_or(s);
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
    let mut s = String::new();
    for c in ctrs {
        for d in c {
            s.push_str(&format!("{},{},{},{}:", d.uuid, d.ty, d.mem_mib, d.cores));
        }
        s.push(';');
    }
    s
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
        let v = decode(s).unwrap();
        assert_eq!(v.len(), 3, "{v:?}");
        assert!(v[0].is_empty(), "the init container has no GPU");
        assert_eq!(
            v[1],
            vec![ContainerDevice { uuid: "GPU-aaa".into(), ty: "NVIDIA".into(), mem_mib: 3000, cores: 30 }]
        );
        assert_eq!(v[2].len(), 2);
        assert_eq!(encode(&v), s);
        // Volcano's form: no trailing ';'.
        assert_eq!(decode("GPU-a,NVIDIA,1,2:;GPU-b,NVIDIA,3,4:").unwrap().len(), 2);
        assert!(decode("GPU-a,NVIDIA,lots,2:;").unwrap_err().contains("memory \"lots\""));
        assert!(decode("GPU-a,NVIDIA:;").unwrap_err().contains("expected UUID,TYPE,MEM,CORES"));
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
        assert_eq!(register_text(&[d]), "GPU-a,10,40960,100,NVIDIA-NVIDIA A100,0,true,0,hami-core:");
    }
}

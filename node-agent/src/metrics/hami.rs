//! HAMi's node-monitor series as HAMi's vGPU monitor serves them: its names, units (utilisation in
//! percent, 0 to 100; bytes; seconds; watts; degrees Celsius), labels (every series in zone
//! `vGPU`; a GPU's `node`, `device_index`, `device_uuid` and `device_type`; a container's
//! `namespace`, `pod`, `container`, `vdevice_index` and `device_uuid`) and help texts; and, with
//! `metrics_hami_legacy`, the names and labels HAMi served before them (its `--legacy-metrics`).
//! A slice's series carry one label more than HAMi's, `slice`: selectors and HAMi's own queries
//! (whose both sides carry it) are unaffected. The sensors read at the same time that HAMi does not
//! serve (temperature, power, ECC) are vgpu's own series.

use super::{owner, Out};
use crate::agent::Agent;
use vgpu_proto::v1 as pb;

/// The label HAMi's monitor registers its collector under.
const ZONE: (&str, &str) = ("zone", "vGPU");

/// What NVML says of a GPU at scrape time, beyond the status (HAMi reads the same per scrape).
#[derive(Default)]
struct Sensors {
    memory_utilization: Option<u32>,
    temperature_c: Option<u32>,
    power_w: Option<f64>,
    /// Aggregate ECC errors: corrected, uncorrected.
    ecc: [Option<u64>; 2],
}

/// The sensors of each GPU of the status (in its order); none where NVML is not open or a query
/// is not supported (the series is then left out, as HAMi leaves it out).
fn sensors(agent: &Agent, st: &pb::NodeStatus) -> Vec<Sensors> {
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
    let Some(nvml) = agent.nvml.get() else { return st.gpus.iter().map(|_| Sensors::default()).collect() };
    st.gpus
        .iter()
        .map(|g| {
            let Ok(d) = nvml.device_by_index(g.index) else { return Sensors::default() };
            let ecc = |kind| d.total_ecc_errors(kind, EccCounter::Aggregate).ok();
            Sensors {
                memory_utilization: d.utilization_rates().ok().map(|u| u.memory),
                temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
                power_w: d.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                ecc: [ecc(MemoryError::Corrected), ecc(MemoryError::Uncorrected)],
            }
        })
        .collect()
}

/// A GPU's labels: with the node's name or without (HAMi's memory-controller series has none).
fn gpu_labels<'a>(node: Option<&'a str>, g: &'a pb::GpuStatus, index: &'a str, ty: &'a str) -> Vec<(&'a str, &'a str)> {
    let mut l = Vec::with_capacity(5);
    if let Some(n) = node {
        l.push(("node", n));
    }
    l.extend([("device_index", index), ("device_uuid", g.uuid.as_str()), ("device_type", ty), ZONE]);
    l
}

/// HAMi's series of a node: its GPUs, then its slices' containers, then their MIG devices.
pub(super) fn series(o: &mut Out, agent: &Agent, st: &pb::NodeStatus) {
    host(o, agent, st);
    containers(o, st);
    mig(o, st);
    if agent.cfg.metrics_hami_legacy {
        legacy(o, st);
    }
}

/// HAMi's series of a GPU (`device_type` is `NVIDIA-` and its model, as HAMi names it).
fn host(o: &mut Out, agent: &Agent, st: &pb::NodeStatus) {
    let node = agent.cfg.node_name.as_str();
    let sensors = sensors(agent, st);
    type Value<'a> = &'a dyn Fn(&pb::GpuStatus, &Sensors) -> Option<f64>;
    let per_gpu: [(&str, &str, bool, Value); 3] = [
        ("hami_host_gpu_memory_used_bytes", "GPU device memory usage in bytes", true, &|g, _| {
            Some(g.memory_used as f64)
        }),
        ("hami_host_gpu_utilization_ratio", "GPU core utilization ratio (0-100)", true, &|g, _| {
            Some(f64::from(g.utilization))
        }),
        (
            "hami_host_gpu_memory_controller_utilization_ratio",
            "GPU memory controller utilization ratio (0-100)",
            false,
            &|_, s| s.memory_utilization.map(f64::from),
        ),
    ];
    for (name, help, with_node, value) in per_gpu {
        o.head(name, "gauge", help);
        for (g, s) in st.gpus.iter().zip(&sensors) {
            let (index, ty) = (g.index.to_string(), format!("NVIDIA-{}", g.model));
            if let Some(v) = value(g, s) {
                o.put(name, &gpu_labels(with_node.then_some(node), g, &index, &ty), v);
            }
        }
    }
    sensor_series(o, st, &sensors);
}

/// The GPU sensors read at this scrape that HAMi's monitor does not serve: vgpu's own series, with
/// vgpu's labels (`device_uuid`, `device_index`).
fn sensor_series(o: &mut Out, st: &pb::NodeStatus, sensors: &[Sensors]) {
    type Value<'a> = &'a dyn Fn(&Sensors) -> Option<f64>;
    let per_gpu: [(&str, &str, Value); 2] = [
        ("vgpu_gpu_temperature_celsius", "GPU temperature in degrees Celsius.", &|s| s.temperature_c.map(f64::from)),
        ("vgpu_gpu_power_usage_watts", "GPU power draw in watts.", &|s| s.power_w),
    ];
    for (name, help, value) in per_gpu {
        o.head(name, "gauge", help);
        for (g, s) in st.gpus.iter().zip(sensors) {
            if let Some(v) = value(s) {
                o.put(name, &[("device_uuid", &g.uuid), ("device_index", &g.index.to_string())], v);
            }
        }
    }
    let name = "vgpu_gpu_ecc_errors_total";
    o.head(name, "counter", "Lifetime aggregate ECC errors of the GPU.");
    for (g, s) in st.gpus.iter().zip(sensors) {
        for (kind, count) in ["corrected", "uncorrected"].into_iter().zip(s.ecc) {
            if let Some(c) = count {
                let index = g.index.to_string();
                o.put(name, &[("device_uuid", &g.uuid), ("device_index", &index), ("error_type", kind)], c as f64);
            }
        }
    }
}

/// One series per slice and GPU, with the container's labels (HAMi's, then `slice`) and the zone.
fn per_container(
    o: &mut Out,
    st: &pb::NodeStatus,
    name: &str,
    help: &str,
    f: &dyn Fn(&pb::SliceStatus, &pb::SliceGpuStatus) -> f64,
) {
    o.head(name, "gauge", help);
    for s in &st.slices {
        let ow = owner(s);
        for (i, g) in s.gpus.iter().enumerate() {
            let idx = i.to_string();
            let mut l: Vec<(&str, &str)> = ow.iter().map(|(k, v)| (*k, v.as_str())).collect();
            l.extend([("vdevice_index", idx.as_str()), ("device_uuid", g.uuid.as_str()), ZONE]);
            o.put(name, &l, f(s, g));
        }
    }
}

/// Seconds since a slice's last kernel (see the observability document for what counts).
fn last_kernel_s(s: &pb::SliceStatus, g: &pb::SliceGpuStatus) -> f64 {
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let since = if g.last_kernel_unix_ms > 0 { g.last_kernel_unix_ms } else { s.watched_since_unix_ms };
    now_ms.saturating_sub(since) as f64 / 1000.0
}

fn containers(o: &mut Out, st: &pb::NodeStatus) {
    per_container(o, st, "hami_vgpu_memory_used_bytes", "vGPU device memory usage in bytes", &|_, g| {
        g.memory_used as f64
    });
    per_container(o, st, "hami_vgpu_memory_limit_bytes", "vGPU device memory limit in bytes", &|_, g| {
        g.memory_limit as f64
    });
    per_container(o, st, "hami_container_device_memory_bytes", "Container device memory usage in bytes", &|_, g| {
        g.memory_used as f64
    });
    per_container(
        o,
        st,
        "hami_container_device_utilization_ratio",
        "Container device SM utilization ratio",
        &|_, g| f64::from(g.sm_used),
    );
    per_container(
        o,
        st,
        "hami_container_last_kernel_elapsed_seconds",
        "Seconds since last kernel execution in container",
        &last_kernel_s,
    );
}

/// `hami_mig_device_info`: a MIG device HAMi mode gave a container (value 1).
fn mig(o: &mut Out, st: &pb::NodeStatus) {
    let name = "hami_mig_device_info";
    o.head(name, "gauge", "MIG runtime identity for a container allocation");
    for g in &st.gpus {
        for m in g.mig.iter().flat_map(|m| &m.instances) {
            let Some(c) = &m.container else { continue };
            let (idx, gi, ci) =
                (c.device_index.to_string(), m.gpu_instance_id.to_string(), m.compute_instance_id.to_string());
            // The profile as HAMi names it (`1g.10gb`), not the device's NVML name.
            let profile = m.name.rsplit_once(" MIG ").map_or(m.name.as_str(), |(_, p)| p);
            let l = [
                ("namespace", c.namespace.as_str()),
                ("pod", &c.pod),
                ("container", &c.container),
                ("vdevice_index", &idx),
                ("device_uuid", &g.uuid),
                ("mig_uuid", &m.uuid),
                ("profile", profile),
                ("gpu_instance_id", &gi),
                ("compute_instance_id", &ci),
                ZONE,
            ];
            o.put(name, &l, 1.0);
        }
    }
}

/// The names and labels HAMi served before its current ones (its `--legacy-metrics`).
fn legacy(o: &mut Out, st: &pb::NodeStatus) {
    for (name, help, value) in [
        (
            "HostGPUMemoryUsage",
            "GPU device memory usage",
            &(|g: &pb::GpuStatus| g.memory_used as f64) as &dyn Fn(_) -> _,
        ),
        ("HostCoreUtilization", "GPU core utilization", &|g: &pb::GpuStatus| f64::from(g.utilization)),
    ] {
        o.head(name, "gauge", help);
        for g in &st.gpus {
            let (index, ty) = (g.index.to_string(), format!("NVIDIA-{}", g.model));
            let l = [
                ("nodeid", st.hostname.as_str()),
                ("deviceidx", &index),
                ("deviceuuid", &g.uuid),
                ("devicetype", &ty),
                ZONE,
            ];
            o.put(name, &l, value(g));
        }
    }
    type SliceValue<'a> = &'a dyn Fn(&pb::SliceStatus, &pb::SliceGpuStatus) -> f64;
    let per_container: [(&str, &str, SliceValue); 4] = [
        ("vGPU_device_memory_usage_in_bytes", "vGPU device usage", &|_, g| g.memory_used as f64),
        ("vGPU_device_memory_limit_in_bytes", "vGPU device limit", &|_, g| g.memory_limit as f64),
        ("Device_utilization_desc_of_container", "Container device utilization description", &|_, g| {
            f64::from(g.sm_used)
        }),
        ("Device_last_kernel_of_container", "Container device last kernel description", &last_kernel_s),
    ];
    for (name, help, value) in per_container {
        o.head(name, "gauge", help);
        for s in &st.slices {
            let ow = owner(s);
            for (i, g) in s.gpus.iter().enumerate() {
                let idx = i.to_string();
                let l = [
                    ("podnamespace", ow[0].1.as_str()),
                    ("podname", &ow[1].1),
                    ("ctrname", &ow[2].1),
                    ("vdeviceid", &idx),
                    ("deviceuuid", &g.uuid),
                    ZONE,
                ];
                o.put(name, &l, value(s, g));
            }
        }
    }
}

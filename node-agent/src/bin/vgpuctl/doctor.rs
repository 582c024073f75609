//! `vgpuctl doctor`: what is wrong with the node's setup, each finding with how to fix it.

use crate::render::Style;
use std::fmt::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use vgpu_agent::config::Config;
use vgpu_proto::v1 as pb;

/// Whether the geometries of `mig_geometries_file` fit the MIG-capable GPUs: a GPU no entry names
/// (it gets its own geometries, which the scheduler's configuration does not list) or a geometry
/// naming a profile the GPU lacks (left out) is a warning; a GPU left with none, a failure (the
/// scheduler could place nothing there).
fn mig_geometries_check(known: &[vgpu_agent::hami::KnownMigGeometries], gpus: &[vgpu_mig::model::Gpu]) -> Check {
    let fix = "make mig_geometries_file the scheduler's device configuration, with an entry whose models name each GPU (vgpuctl mig geometries prints what the agent uses)";
    if gpus.is_empty() {
        return check("mig-geometries", "skip", "no MIG-capable GPUs".into(), "");
    }
    let (mut warn, mut fail, mut ok) = (Vec::new(), Vec::new(), Vec::new());
    for g in gpus {
        let used = vgpu_agent::hami::gpu_geometries(known, &g.name, &g.profiles);
        match vgpu_agent::hami::configured_geometries(known, &g.name) {
            None => warn.push(format!(
                "GPU {} ({}) matches no models of the file: it uses its own {} geometries",
                g.index,
                g.name,
                used.len()
            )),
            Some(k) => {
                // Each geometry left out, with the profiles it names that the GPU lacks.
                let dropped =
                    vgpu_agent::hami::left_out_text(&vgpu_agent::hami::left_out_geometries(k, &g.name, &g.profiles));
                let line = format!("GPU {} ({}): {} of {} geometries", g.index, g.name, used.len(), k.geometries.len());
                if used.is_empty() {
                    fail.push(format!("{line}: every one names a profile it lacks: {dropped}"));
                } else if !dropped.is_empty() {
                    warn.push(format!("{line}; left out, naming profiles it lacks: {dropped}"));
                } else {
                    ok.push(line);
                }
            }
        }
    }
    let detail = fail.iter().chain(&warn).chain(&ok).cloned().collect::<Vec<_>>().join("; ");
    match (fail.is_empty(), warn.is_empty()) {
        (false, _) => check("mig-geometries", "fail", detail, fix),
        (true, false) => check("mig-geometries", "warn", detail, fix),
        (true, true) => check("mig-geometries", "ok", detail, ""),
    }
}

/// GPU instances without a compute instance (made outside the agent, e.g. `nvidia-smi mig -cgi`
/// without `-C`, or cut short): CUDA has no device there while their slices are taken.
fn mig_instances_check(gpus: &[vgpu_mig::model::Gpu]) -> Check {
    let bad: Vec<String> = gpus
        .iter()
        .flat_map(|g| {
            g.instances.iter().filter(|i| i.compute_instances.is_empty()).map(move |i| {
                let name = g.profile(i.profile).map_or("?", |p| p.name.as_str());
                format!("GPU {}: GPU instance {} ({name} at slice {})", g.index, i.gi, i.start)
            })
        })
        .collect();
    match (gpus.iter().any(|g| g.mig_enabled), bad.is_empty()) {
        (false, _) => check("mig-instances", "skip", "no GPU in MIG mode".into(), ""),
        (true, true) => check("mig-instances", "ok", "every GPU instance has its compute instance".into(), ""),
        (true, false) => check(
            "mig-instances",
            "warn",
            format!("without a compute instance, unusable, their slices taken: {}", bad.join("; ")),
            "restart the agent (it removes them at start), or remove them with nvidia-smi mig -dgi -gi ID -i GPU",
        ),
    }
}

/// Whether the agent agrees with the rest of the scheduler's device configuration (the `nvidia`
/// section of `mig_geometries_file`): a resource pods ask for that the agent does not serve, or
/// memory counted in other units, fails; other differences warn.
fn scheduler_settings_check(s: &vgpu_agent::hami::SchedulerSettings, cfg: &Config) -> Check {
    let m = vgpu_agent::deviceplugin::settings_mismatches(s, cfg);
    let detail = vgpu_agent::deviceplugin::mismatches_text(&m);
    let fix = "give the agent the scheduler's resource names, deviceSplitCount, deviceMemoryScaling and gpuMemoryFactor (resource_name, split_count, memory_scaling, memory_factor), or change the scheduler's configuration and restart the scheduler";
    match (m.is_empty(), m.iter().any(|(fatal, _)| *fatal)) {
        (true, _) => check(
            "scheduler-config",
            "ok",
            "resource names, replicas per GPU and memory units agree with the scheduler's device configuration".into(),
            "",
        ),
        (false, true) => check("scheduler-config", "fail", detail, fix),
        (false, false) => check("scheduler-config", "warn", detail, fix),
    }
}

/// One finding of `vgpuctl doctor`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    pub name: &'static str,
    /// "ok", "warn", "fail" or "skip".
    pub level: &'static str,
    pub detail: String,
    /// What to do about it (empty when nothing).
    pub fix: String,
}

fn check(name: &'static str, level: &'static str, detail: String, fix: &str) -> Check {
    Check { name, level, detail, fix: fix.to_string() }
}

/// The checks that need no agent; `agent` is the result of asking the agent for its health.
pub fn doctor(cfg: &Config, agent: Result<pb::HealthResponse, String>) -> Vec<Check> {
    let mut v = Vec::new();
    driver_checks(cfg, &mut v);
    library_checks(cfg, &mut v);
    agent_checks(cfg, &agent, &mut v);
    kubernetes_checks(cfg, &mut v);
    v
}

/// NVML and the CUDA driver library.
fn driver_checks(cfg: &Config, v: &mut Vec<Check>) {
    // NVML and the driver.
    match vgpu_agent::discovery::open(cfg.nvml_library.as_deref()).and_then(|n| vgpu_agent::discovery::discover(&n)) {
        Ok(inv) => v.push(check(
            "nvml",
            "ok",
            format!(
                "NVML loads: {} GPU(s), driver {}, CUDA {}.{}",
                inv.gpus.len(),
                inv.driver_version,
                inv.cuda_version / 1000,
                inv.cuda_version % 1000 / 10
            ),
            "",
        )),
        Err(e) => v.push(check(
            "nvml",
            "fail",
            e.to_string(),
            "install the NVIDIA driver, or set nvml_library in the agent's configuration",
        )),
    }
    let cuda = std::ffi::CString::new("libcuda.so.1").expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle is closed at once.
    let h = unsafe { libc::dlopen(cuda.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        v.push(check(
            "driver",
            "fail",
            "libcuda.so.1 cannot be loaded".into(),
            "install the NVIDIA driver's CUDA library (libcuda.so.1) or fix the loader path",
        ));
    } else {
        // SAFETY: a handle dlopen just returned.
        unsafe { libc::dlclose(h) };
        v.push(check("driver", "ok", "libcuda.so.1 loads".into(), ""));
    }
}

/// `libvgpu.so`, the preload template, and the host's own preload file.
fn library_checks(cfg: &Config, v: &mut Vec<Check>) {
    // The library.
    match std::fs::read(&cfg.library) {
        Ok(b) if b.starts_with(b"\x7fELF") => {
            let installed: Vec<String> = std::fs::read_dir(cfg.state_dir.join("lib"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with("libvgpu.so."))
                        .collect()
                })
                .unwrap_or_default();
            let exports = ["cuMemAlloc_v2", "cuLaunchKernel", "cuGetProcAddress_v2", "nvmlDeviceGetMemoryInfo"]
                .iter()
                .all(|s| b.windows(s.len()).any(|w| w == s.as_bytes()));
            if !exports {
                v.push(check(
                    "library",
                    "fail",
                    format!("{} is not libvgpu.so (hook symbols missing)", cfg.library.display()),
                    "reinstall: scripts/install.sh",
                ));
            } else if installed.is_empty() {
                v.push(check(
                    "library",
                    "warn",
                    format!(
                        "{} present; no versioned copy in {}/lib yet",
                        cfg.library.display(),
                        cfg.state_dir.display()
                    ),
                    "start the agent: it installs the library for containers",
                ));
            } else {
                v.push(check(
                    "library",
                    "ok",
                    format!("{} present; installed for containers: {}", cfg.library.display(), installed.join(", ")),
                    "",
                ));
            }
        }
        Ok(_) => v.push(check(
            "library",
            "fail",
            format!("{} is not an ELF shared object", cfg.library.display()),
            "reinstall: scripts/install.sh",
        )),
        Err(e) => v.push(check(
            "library",
            "fail",
            format!("{}: {e}", cfg.library.display()),
            "install it: scripts/install.sh (or set library in the agent's configuration)",
        )),
    }
    // The preload template, and the host's own preload file.
    let tpl = cfg.state_dir.join("ld.so.preload");
    match std::fs::read_to_string(&tpl) {
        Ok(t) if t.trim() == format!("{}/libvgpu.so", vgpu_agent::slices::CONTAINER_DIR) => v.push(check(
            "preload",
            "ok",
            format!("{} names {}/libvgpu.so", tpl.display(), vgpu_agent::slices::CONTAINER_DIR),
            "",
        )),
        Ok(t) => v.push(check(
            "preload",
            "fail",
            format!("{} holds {:?}", tpl.display(), t.trim()),
            "remove it and restart the agent, which rewrites it",
        )),
        Err(_) => v.push(check(
            "preload",
            "warn",
            format!("{} missing", tpl.display()),
            "start the agent: it writes the template",
        )),
    }
    if std::fs::read_to_string("/etc/ld.so.preload").is_ok_and(|t| t.contains("libvgpu")) {
        v.push(check(
            "host-preload",
            "warn",
            "the host's /etc/ld.so.preload loads libvgpu.so into every host process".into(),
            "remove the line: only containers should preload it",
        ));
    }
}

/// The state directory, and the agent's socket and health.
fn agent_checks(cfg: &Config, agent: &Result<pb::HealthResponse, String>, v: &mut Vec<Check>) {
    // The state directory.
    match std::fs::metadata(&cfg.state_dir) {
        Ok(m) if m.permissions().mode() & 0o022 != 0 => v.push(check(
            "state-dir",
            "fail",
            format!(
                "{} is writable by group or others (mode {:o}): containers could change limits",
                cfg.state_dir.display(),
                m.permissions().mode() & 0o7777
            ),
            "chmod 0755 it",
        )),
        // SAFETY: geteuid has no preconditions.
        Ok(m) if m.uid() != unsafe { libc::geteuid() } && m.uid() != 0 => v.push(check(
            "state-dir",
            "warn",
            format!("{} is owned by uid {}", cfg.state_dir.display(), m.uid()),
            "chown it to the agent's user (root)",
        )),
        Ok(_) => v.push(check(
            "state-dir",
            "ok",
            format!("{} exists, writable only by its owner", cfg.state_dir.display()),
            "",
        )),
        Err(e) => v.push(check(
            "state-dir",
            "fail",
            format!("{}: {e}", cfg.state_dir.display()),
            "start the agent (it creates it) or set state_dir",
        )),
    }
    // The agent's socket.
    match std::fs::metadata(&cfg.socket) {
        Ok(m) if !m.file_type().is_socket() => v.push(check(
            "agent-socket",
            "fail",
            format!("{} is not a socket", cfg.socket.display()),
            "remove it and restart the agent",
        )),
        Ok(m) if m.permissions().mode() & 0o007 != 0 => v.push(check(
            "agent-socket",
            "fail",
            format!("{} is accessible to others (mode {:o})", cfg.socket.display(), m.permissions().mode() & 0o777),
            "restart the agent (it creates the socket with mode 0660)",
        )),
        Ok(_) => match agent {
            Ok(h) if !h.live => v.push(check(
                "agent",
                "fail",
                format!("agent not live: {}", h.problems.join("; ")),
                "see the agent's log and the kernel log (dmesg) for a GPU that stopped answering; restart the agent",
            )),
            Ok(h) if h.ready && h.problems.is_empty() => {
                v.push(check("agent", "ok", format!("agent at {} is ready", cfg.socket.display()), ""))
            }
            Ok(h) if h.ready => v.push(check(
                "agent",
                "warn",
                format!("agent ready; problems: {}", h.problems.join("; ")),
                "vgpuctl status shows each; see the agent's log",
            )),
            Ok(h) => v.push(check(
                "agent",
                "warn",
                format!("agent starting: {}", h.problems.join("; ")),
                "wait a moment; if it stays, see the agent's log",
            )),
            Err(e) => v.push(check("agent", "fail", e.clone(), "start the agent: systemctl start vgpu-node-agent")),
        },
        Err(_) => v.push(check(
            "agent-socket",
            "fail",
            format!("{} does not exist", cfg.socket.display()),
            "start the agent: systemctl start vgpu-node-agent",
        )),
    }
}

/// Kubernetes, the DRA driver, the peer schedulers' settings, and CDI, where present.
fn kubernetes_checks(cfg: &Config, v: &mut Vec<Check>) {
    // Kubernetes and CDI, when present.
    let kubelet = cfg.kubelet_dir.join("kubelet.sock");
    if kubelet.exists() {
        v.push(check("kubelet", "ok", format!("{} present", kubelet.display()), ""));
        // Replica slices are collected through kubelet's pod resources API.
        if cfg.device_plugin && cfg.compat == vgpu_agent::config::Compat::Replicas {
            let is_socket = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket());
            v.push(match &cfg.pod_resources_socket {
                Some(p) if is_socket(p) => check("pod-resources", "ok", format!("{} present", p.display()), ""),
                Some(p) => check(
                    "pod-resources",
                    "warn",
                    format!("{} missing: slices of removed containers are kept", p.display()),
                    "mount kubelet's pod-resources directory into the agent (the Helm chart does), or set pod_resources_socket",
                ),
                None => check(
                    "pod-resources",
                    "warn",
                    "pod_resources_socket is off: slices of removed containers are kept".into(),
                    "delete them with vgpuctl slice delete, or set pod_resources_socket",
                ),
            });
        }
    } else {
        v.push(check("kubelet", "skip", "no kubelet device-plugin socket (not a Kubernetes node)".into(), ""));
    }
    // The DRA driver's sockets, which kubelet's plugin watcher and kubelet dial.
    if let Some(driver) = &cfg.dra {
        let (reg, dra) = vgpu_agent::dra::sockets(cfg, driver);
        let is_socket = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket());
        v.push(if is_socket(&reg) && is_socket(&dra) {
            check("dra", "ok", format!("driver {driver}: {} and {} present", reg.display(), dra.display()), "")
        } else {
            check(
                "dra",
                "fail",
                format!("driver {driver}: {} or {} missing", reg.display(), dra.display()),
                "mount kubelet's plugins and plugins_registry directories into the agent beside kubelet_dir (the Helm chart does), and see the agent's log",
            )
        });
    }
    let gpus: Vec<vgpu_mig::model::Gpu> = vgpu_agent::discovery::open(cfg.nvml_library.as_deref())
        .map(|n| {
            use vgpu_mig::backend::MigBackend;
            let b = vgpu_mig::backend::NvmlBackend::new(std::sync::Arc::new(n));
            (0..b.gpu_count().unwrap_or(0)).filter_map(|i| b.gpu(i).ok()).filter(|g| !g.profiles.is_empty()).collect()
        })
        .unwrap_or_default();
    v.push(mig_instances_check(&gpus));
    // The MIG geometries HAMi's and Volcano's MIG mode use, where a scheduler's file is configured.
    if cfg.compat != vgpu_agent::config::Compat::Replicas && !cfg.mig_geometries.is_empty() {
        v.push(mig_geometries_check(&cfg.mig_geometries, &gpus));
    }
    if let (false, Some(s)) = (cfg.compat == vgpu_agent::config::Compat::Replicas, &cfg.scheduler_settings) {
        v.push(scheduler_settings_check(s, cfg));
    }
    // Settings this node has of its own, and where from.
    let mut own = Vec::new();
    if cfg.hami_node_entry {
        own.push("HAMi's per-node configuration has an entry for it".to_string());
    }
    if let Some((i, names)) = &cfg.node_section {
        own.push(format!("[[node]] section {i} ({}) applies", names.join(", ")));
    }
    if !own.is_empty() {
        let detail = format!(
            "node {}: {}: split_count {}, memory_scaling {}",
            cfg.node_name,
            own.join("; "),
            cfg.split_count,
            cfg.memory_scaling
        );
        v.push(check("node-settings", "ok", detail, ""));
    }
    let cdi: Vec<&str> = ["/etc/cdi", "/var/run/cdi"].into_iter().filter(|d| Path::new(d).is_dir()).collect();
    if cdi.is_empty() {
        v.push(check("cdi", "skip", "no CDI directory (/etc/cdi, /var/run/cdi)".into(), ""));
    } else {
        v.push(check("cdi", "ok", format!("CDI directories: {}", cdi.join(", ")), ""));
    }
}

pub fn render_doctor(checks: &[Check], style: Style) -> String {
    let mut o = String::new();
    for c in checks {
        let tag = match c.level {
            "ok" => style.green("ok  "),
            "warn" => style.yellow("WARN"),
            "fail" => style.red("FAIL"),
            _ => "skip".to_string(),
        };
        let _ = writeln!(o, "{tag}  {:<13} {}", c.name, c.detail);
        if !c.fix.is_empty() {
            let _ = writeln!(o, "      {:<13} fix: {}", "", c.fix);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_mig::model::{Gpu, Instance, Profile};

    #[test]
    fn an_instance_without_a_compute_instance_is_reported() {
        let profile = Profile {
            id: 19,
            name: "1g.10gb".into(),
            compute: 1,
            memory_slices: 1,
            memory_mib: 9984,
            sms: 16,
            decoders: 1,
            encoders: 0,
            jpegs: 1,
            ofas: 0,
            max: 7,
            starts: (0..7).collect(),
        };
        let inst = |gi, start, cis: &[(u32, u32)]| Instance {
            gi,
            profile: 19,
            start,
            size: 1,
            compute_instances: cis.to_vec(),
            busy: false,
            uuid: None,
        };
        let mut g = Gpu {
            index: 1,
            uuid: "GPU-1".into(),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_slices: 8,
            profiles: vec![profile],
            mig_enabled: true,
            mode_pending: false,
            instances: vec![inst(7, 0, &[(0, 0)]), inst(8, 3, &[])],
        };
        let c = mig_instances_check(std::slice::from_ref(&g));
        assert_eq!(c.level, "warn", "{c:?}");
        assert!(c.detail.contains("GPU 1: GPU instance 8 (1g.10gb at slice 3)"), "{c:?}");
        g.instances.pop();
        assert_eq!(mig_instances_check(std::slice::from_ref(&g)).level, "ok");
        g.mig_enabled = false;
        assert_eq!(mig_instances_check(&[g]).level, "skip");
    }
}

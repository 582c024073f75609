//! What `vgpuctl` prints and parses: sizes, the status table, slice details and the doctor's checks.

use crate::config::Config;
use crate::slices::printable;
use std::fmt::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use vgpu_proto::v1 as pb;

/// Parses a size as everything in vgpu does (`vgpu_units::parse_size`: bytes, `0x` hex, `k`/`m`/`g`/`t`
/// and `KiB`...`TiB` as powers of 1024, `KB`...`TB` as powers of 1000, decimals allowed).
pub fn parse_size(s: &str) -> Result<u64, String> {
    vgpu_units::parse_size(s).map_err(|e| e.to_string())
}

/// `1.5 GiB`, `512 MiB`, `0 B`.
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn secs(ns: u64) -> String {
    let s = ns as f64 / 1e9;
    if s < 60.0 {
        format!("{s:.1}s")
    } else if s < 3600.0 {
        format!("{:.1}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}

/// A past span as a person reads it: whole seconds, minutes, hours or days.
fn span(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// When a slice's kernels last ran on a GPU, as of the status's time: "3s ago", or "none in 5m"
/// when the agent has seen none since it began watching the slice.
fn last_kernel(now_ms: u64, last_ms: u64, watched_ms: u64) -> String {
    if last_ms > 0 {
        format!("{} ago", span(now_ms.saturating_sub(last_ms)))
    } else if watched_ms > 0 {
        format!("none in {}", span(now_ms.saturating_sub(watched_ms)))
    } else {
        "-".into()
    }
}

/// Terminal colours (none when not on a terminal or with `NO_COLOR`).
#[derive(Clone, Copy)]
pub struct Style {
    pub colour: bool,
}

impl Style {
    fn paint(&self, code: &str, s: &str) -> String {
        if self.colour {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn red(&self, s: &str) -> String {
        self.paint("31", s)
    }
    fn green(&self, s: &str) -> String {
        self.paint("32", s)
    }
    fn yellow(&self, s: &str) -> String {
        self.paint("33", s)
    }
    fn bold(&self, s: &str) -> String {
        self.paint("1", s)
    }
}

/// Lays out rows in columns; widths ignore colour escapes.
fn table(rows: &[Vec<String>]) -> String {
    let visible = |s: &str| {
        let mut n = 0;
        let mut esc = false;
        for c in s.chars() {
            match (esc, c) {
                (false, '\x1b') => esc = true,
                (true, 'm') => esc = false,
                (true, _) => {}
                _ => n += 1,
            }
        }
        n
    };
    let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let w: Vec<usize> =
        (0..cols).map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| visible(s)).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, cell) in r.iter().enumerate() {
            line.push_str(cell);
            if i + 1 < r.len() {
                line.push_str(&" ".repeat(w[i] - visible(cell) + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn short_uuid(u: &str) -> String {
    u.chars().take(12).collect()
}

fn pct_of(used: u64, limit: u64) -> f64 {
    if limit == 0 {
        0.0
    } else {
        used as f64 * 100.0 / limit as f64
    }
}

/// The status as an operator reads it.
pub fn render_status(st: &pb::NodeStatus, style: Style) -> String {
    let mut o = String::new();
    let a = st.agent.unwrap_or_default();
    let _ = writeln!(
        o,
        "{} {}  agent {}  driver {}  CUDA {}.{}  pass {} ({:.1} ms)",
        style.bold("NODE"),
        st.hostname,
        st.agent_version,
        st.driver_version,
        st.cuda_version / 1000,
        st.cuda_version % 1000 / 10,
        st.sequence,
        a.loop_us as f64 / 1000.0
    );
    o.push('\n');
    let mut rows =
        vec![["GPU", "MODEL", "UUID", "MODE", "MEMORY USED", "UTIL", "HEALTH"].map(|s| style.bold(s)).to_vec()];
    for g in &st.gpus {
        let mig = g.mig.clone().unwrap_or_default();
        let mode = if mig.enabled {
            let layout: Vec<String> =
                mig.instances.iter().map(|i| i.name.rsplit(' ').next().unwrap_or("?").to_string()).collect();
            format!("mig [{}]{}", layout.join(" "), if mig.pending { " (pending reset)" } else { "" })
        } else if mig.pending {
            format!("{} (MIG pending reset)", g.mode)
        } else {
            g.mode.clone()
        };
        let health = if g.healthy { style.green("ok") } else { style.red(&format!("UNHEALTHY: {}", g.health_reason)) };
        rows.push(vec![
            g.index.to_string(),
            g.model.clone(),
            short_uuid(&g.uuid),
            mode,
            format!(
                "{} / {}{}",
                human(g.memory_used),
                human(g.memory_total),
                if g.unified_memory { " (unified, the host's)" } else { "" }
            ),
            format!("{}%", g.utilization),
            health,
        ]);
    }
    o.push_str(&table(&rows));
    for g in &st.gpus {
        for i in g.mig.iter().flat_map(|m| &m.instances).filter(|i| !i.holder.is_empty()) {
            let profile = crate::dra::mig_profile(&i.name);
            let _ = writeln!(o, "GPU {} MIG {} {}: {}", g.index, profile, short_uuid(&i.uuid), i.holder);
        }
        for i in g.mig.iter().flat_map(|m| &m.instances).filter(|i| i.unhealthy) {
            let profile = crate::dra::mig_profile(&i.name);
            let line = format!(
                "GPU {} MIG {} {} (GPU instance {}) UNHEALTHY: {}; its device is withdrawn, the GPU's others are not",
                g.index,
                profile,
                short_uuid(&i.uuid),
                i.gpu_instance_id,
                i.health_reason
            );
            let _ = writeln!(o, "{}", style.red(&line));
        }
        for p in &g.admin_processes {
            let _ =
                writeln!(o, "GPU {} admin access: pid {} ({}) of claim {}", g.index, p.pid, human(p.memory), p.claim);
        }
    }
    for w in &st.warnings {
        let _ = writeln!(o, "{}", style.yellow(w));
    }
    for g in st.gpus.iter().filter(|g| g.critical_xids + g.application_xids > 0) {
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        let mut line = format!("GPU {}: since the agent started", g.index);
        if g.critical_xids > 0 {
            let _ = write!(
                line,
                " {} critical XID{} (the last: {} at {})",
                g.critical_xids,
                plural(g.critical_xids),
                g.last_critical_xid,
                g.last_critical_xid_at
            );
        }
        if g.application_xids > 0 {
            let _ = write!(
                line,
                "{} {} application XID{} (a program's fault; the GPU stays healthy)",
                if g.critical_xids > 0 { "," } else { "" },
                g.application_xids,
                plural(g.application_xids)
            );
        }
        let _ = writeln!(o, "{}", if g.critical_xids > 0 { style.yellow(&line) } else { line });
    }
    for g in st.gpus.iter().filter(|g| g.sm_feedback_held) {
        let _ = writeln!(
            o,
            "{}",
            style.yellow(&format!(
                "GPU {}: NVML's per-process SM samples add up to more than its utilisation; SM-rate corrections held",
                g.index
            ))
        );
    }
    o.push('\n');
    if st.slices.is_empty() {
        o.push_str("no slices (create one: vgpuctl slice create --gpu 0 --memory 8GiB --sm 30 --name job1)\n");
    } else {
        let mut rows =
            vec![["SLICE", "GPU", "MEMORY USED / LIMIT", "SM USED / LIMIT", "THROTTLED", "LAST KERNEL", "PROCESSES"]
                .map(|s| style.bold(s))
                .to_vec()];
        for s in &st.slices {
            let label = |k: &str| s.labels.get(k);
            let owner = match (label("namespace"), label("pod"), label("container"), label("claim")) {
                (Some(n), Some(p), Some(c), _) => format!("{}  ({})", s.name, printable(&format!("{n}/{p}/{c}"))),
                (Some(n), Some(p), None, Some(c)) => {
                    format!("{}  ({})", s.name, printable(&format!("{n}/{p} claim {c}")))
                }
                (Some(n), None, None, Some(c)) => format!("{}  ({})", s.name, printable(&format!("{n} claim {c}"))),
                _ => s.name.clone(),
            };
            for (i, g) in s.gpus.iter().enumerate() {
                let lim = if g.memory_limit == 0 { "none".to_string() } else { human(g.memory_limit) };
                let mem = format!("{} / {lim}", human(g.memory_used));
                let mem = if g.memory_limit > 0 && pct_of(g.memory_used, g.memory_limit) >= 90.0 {
                    style.yellow(&mem)
                } else {
                    mem
                };
                let sm_lim =
                    if g.sm_limit == 0 || g.sm_limit >= 100 { "none".to_string() } else { format!("{}%", g.sm_limit) };
                let procs: Vec<String> = s.processes.iter().filter(|p| p.gpu == g.uuid).map(process_cell).collect();
                rows.push(vec![
                    if i == 0 { owner.clone() } else { String::new() },
                    if g.gpu_index == u32::MAX { "?".into() } else { g.gpu_index.to_string() },
                    mem,
                    if (1..100).contains(&g.sm_limit) {
                        format!("{}% / {sm_lim} (charged {}%)", g.sm_used, g.sm_accounted)
                    } else {
                        format!("{}% / {sm_lim}", g.sm_used)
                    },
                    if g.throttled_launches > 0 {
                        format!("{} ({} launches)", secs(g.throttled_ns), g.throttled_launches)
                    } else {
                        "-".into()
                    },
                    last_kernel(st.timestamp_ms, g.last_kernel_unix_ms, s.watched_since_unix_ms),
                    if procs.is_empty() { "-".into() } else { procs.join(", ") },
                ]);
            }
        }
        o.push_str(&table(&rows));
        for s in &st.slices {
            for g in s.gpus.iter().filter(|g| g.spilled_allocations > 0) {
                let gpu = if g.gpu_index == u32::MAX { short_uuid(&g.uuid) } else { g.gpu_index.to_string() };
                let _ = writeln!(
                    o,
                    "{}",
                    style.yellow(&format!(
                        "slice {} on GPU {gpu}: {} allocation(s), {} in all, served as unified memory: the GPU was full (CUDA_OVERSUBSCRIBE)",
                        s.name,
                        g.spilled_allocations,
                        human(g.spilled_bytes)
                    ))
                );
            }
        }
    }
    if !st.escapes.is_empty() {
        o.push('\n');
        o.push_str(&style.red("ESCAPES"));
        o.push('\n');
        for e in &st.escapes {
            let _ = writeln!(o, "  {}", escape_line(e));
        }
    }
    o
}

/// One escape as `vgpuctl status` lists it (and `doctor` reports it).
pub fn escape_line(e: &pb::Escape) -> String {
    if e.kind == pb::escape::Kind::OverLimit as i32 {
        format!(
            "slice {} over its limit on {}: NVML measures {} > {} (pid {}{}, {})",
            e.slice,
            short_uuid(&e.gpu),
            human(e.measured),
            human(e.limit),
            e.pid,
            process_owner(e),
            e.action
        )
    } else if !e.slice.is_empty() {
        format!(
            "pid {}{} of slice {} on {}, outside the slice: {} ({})",
            e.pid,
            process_owner(e),
            e.slice,
            short_uuid(&e.gpu),
            human(e.measured),
            e.action
        )
    } else {
        format!(
            "pid {}{} on {} outside every slice: {} ({})",
            e.pid,
            process_owner(e),
            short_uuid(&e.gpu),
            human(e.measured),
            e.action
        )
    }
}

/// Who runs an escape's process, as ` (python3, pod ml/train-0, container 0a1b2c3d4e5f)`: its
/// command, its pod (by name where a slice belongs to it, else by UID) and its container's short ID,
/// whichever are known; empty when none is.
pub fn process_owner(e: &pb::Escape) -> String {
    let mut parts = Vec::new();
    if !e.command.is_empty() {
        parts.push(e.command.clone());
    }
    if !e.pod.is_empty() {
        parts.push(format!("pod {}", e.pod));
    } else if !e.pod_uid.is_empty() {
        parts.push(format!("pod UID {}", e.pod_uid));
    }
    if !e.container_id.is_empty() {
        parts.push(format!("container {}", e.container_id.chars().take(12).collect::<String>()));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// A slice's limits, environment and mounts, and the `docker run` flags that put a container in it.
pub fn render_slice(d: &pb::SliceDetail) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "slice {}  (state {})", d.name, d.state_dir);
    for (i, g) in d.gpus.iter().enumerate() {
        let mem = if g.memory == 0 { "no memory limit".to_string() } else { format!("memory {}", human(g.memory)) };
        let sm = if g.sm == 0 || g.sm >= 100 { "no SM limit".to_string() } else { format!("SM {}%", g.sm) };
        let _ = writeln!(o, "  device {i}: {}  {mem}, {sm}", g.gpu);
    }
    let mut labels: Vec<_> = d.labels.iter().collect();
    labels.sort();
    for (k, v) in labels {
        let _ = writeln!(o, "  label {}={}", printable(k), printable(v));
    }
    o.push_str("environment:\n");
    let mut env: Vec<_> = d.env.iter().collect();
    env.sort();
    for (k, v) in &env {
        let _ = writeln!(o, "  {k}={v}");
    }
    o.push_str("mounts:\n");
    for m in &d.mounts {
        let _ =
            writeln!(o, "  {} -> {}{}", m.host_path, m.container_path, if m.read_only { " (read-only)" } else { "" });
    }
    if !d.cdi_device.is_empty() {
        let _ = writeln!(o, "CDI device (CDI-enabled runtimes, e.g. podman run --device {}):", d.cdi_device);
    }
    o.push_str("docker/podman run flags (add --gpus or the CDI device for the GPUs themselves):\n ");
    for (k, v) in &env {
        let _ = write!(o, " -e {k}={v}");
    }
    for m in &d.mounts {
        let _ = write!(o, " -v {}:{}{}", m.host_path, m.container_path, if m.read_only { ":ro" } else { "" });
    }
    o.push('\n');
    o
}

/// `vgpuctl mig status`.
pub fn render_mig_status(st: &pb::MigStatusResponse) -> String {
    if st.gpus.is_empty() {
        return "no MIG-capable GPUs\n".into();
    }
    let mut rows =
        vec![["GPU", "MODEL", "MIG", "INSTANCES (profile@slice)", "RECORDED LAYOUT"].map(String::from).to_vec()];
    for g in &st.gpus {
        let mode = match (g.enabled, g.pending_reset) {
            (_, true) => format!("{} (change pending a reset)", if g.enabled { "on" } else { "off" }),
            (true, false) => "on".into(),
            (false, false) => "off".into(),
        };
        let inst: Vec<String> = g
            .instances
            .iter()
            .map(|i| match i.holder.as_str() {
                "" => format!("{}@{}", i.name, i.start),
                h => format!("{}@{} ({h})", i.name, i.start),
            })
            .collect();
        let mut desired = g.desired.join(", ");
        if g.in_progress {
            desired.push_str(" (apply interrupted: resumed at agent start)");
        }
        rows.push(vec![
            g.index.to_string(),
            g.model.clone(),
            mode,
            if inst.is_empty() { "-".into() } else { inst.join(" ") },
            if desired.is_empty() { "-".into() } else { desired },
        ]);
    }
    let mut o = table(&rows);
    // What HAMi's and Volcano's schedulers may cut each GPU into, by index and group.
    for g in st.gpus.iter().filter(|g| !g.geometries.is_empty()) {
        let geo: Vec<String> = g
            .geometries
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let t: Vec<String> = x.templates.iter().map(|t| format!("{}x{}", t.count, t.name)).collect();
                format!("{i} {} ({})", x.group, t.join(" "))
            })
            .collect();
        let _ = writeln!(o, "GPU {} geometries: {}", g.index, geo.join(" | "));
    }
    o
}

/// Whether the geometries of `mig_geometries_file` fit the MIG-capable GPUs: a GPU no entry names
/// (it gets its own geometries, which the scheduler's configuration does not list) or a geometry
/// naming a profile the GPU lacks (left out) is a warning; a GPU left with none, a failure (the
/// scheduler could place nothing there).
fn mig_geometries_check(known: &[crate::hami::KnownMigGeometries], gpus: &[vgpu_mig::model::Gpu]) -> Check {
    let fix = "make mig_geometries_file the scheduler's device configuration, with an entry whose models name each GPU (vgpuctl mig geometries prints what the agent uses)";
    if gpus.is_empty() {
        return check("mig-geometries", "skip", "no MIG-capable GPUs".into(), "");
    }
    let (mut warn, mut fail, mut ok) = (Vec::new(), Vec::new(), Vec::new());
    for g in gpus {
        let used = crate::hami::gpu_geometries(known, &g.name, &g.profiles);
        match crate::hami::configured_geometries(known, &g.name) {
            None => warn.push(format!(
                "GPU {} ({}) matches no models of the file: it uses its own {} geometries",
                g.index,
                g.name,
                used.len()
            )),
            Some(k) => {
                // Each geometry left out, with the profiles it names that the GPU lacks.
                let dropped = crate::hami::left_out_text(&crate::hami::left_out_geometries(k, &g.name, &g.profiles));
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

/// Whether the agent agrees with the rest of the scheduler's device configuration (the `nvidia`
/// section of `mig_geometries_file`): a resource pods ask for that the agent does not serve, or
/// memory counted in other units, fails; other differences warn.
fn scheduler_settings_check(s: &crate::hami::SchedulerSettings, cfg: &Config) -> Check {
    let m = crate::hami::settings_mismatches(s, cfg);
    let detail = crate::hami::mismatches_text(&m);
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

/// `vgpuctl mig geometries`: the MIG geometries of this node's GPUs as the `knownMigGeometries` of a
/// scheduler's device configuration, one entry per model: Volcano's form (named groups), or HAMi's
/// (bare lists, with each template's share of compute).
pub fn render_mig_geometries(st: &pb::MigStatusResponse, hami: bool) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string");
    let mut o = String::from(
        "# The MIG geometries this node's agent uses (vgpuctl mig geometries); GPUs are matched by model\n# in their NVML name. For the scheduler, put them in the nvidia section of its device\n# configuration (the key device-config.yaml of the ConfigMap volcano-vgpu-device-config or\n# hami-scheduler-device) beside what is there: the schedulers take a configuration without\n# its resource names as it is.\nknownMigGeometries:\n",
    );
    let mut seen = std::collections::BTreeSet::new();
    for g in st.gpus.iter().filter(|g| !g.geometries.is_empty()) {
        let model = g.model.strip_prefix("NVIDIA ").unwrap_or(&g.model);
        if !seen.insert(model.to_string()) {
            continue;
        }
        let _ = writeln!(o, "- models: [{}]\n  allowedGeometries:", q(model));
        for x in &g.geometries {
            if hami {
                for (i, t) in x.templates.iter().enumerate() {
                    let _ = writeln!(
                        o,
                        "  {} {{name: {}, core: {}, memory: {}, count: {}}}",
                        if i == 0 { "- -" } else { "  -" },
                        q(&t.name),
                        t.core,
                        t.memory_mib,
                        t.count
                    );
                }
            } else {
                let _ = writeln!(o, "  - group: {}\n    geometries:", q(&x.group));
                for t in &x.templates {
                    let _ = writeln!(o, "    - {{name: {}, memory: {}, count: {}}}", q(&t.name), t.memory_mib, t.count);
                }
            }
        }
    }
    if seen.is_empty() {
        o = "# no MIG-capable GPUs on this node\nknownMigGeometries: []\n".into();
    }
    o
}

/// `vgpuctl mig plan|apply|assert`.
pub fn render_mig_report(r: &pb::MigReport, op: &str) -> String {
    let mut o = String::new();
    for g in &r.gpus {
        let _ = write!(o, "GPU {}", g.gpu);
        if !g.error.is_empty() {
            let _ = writeln!(o, ": cannot {op}: {}", g.error);
            continue;
        }
        o.push('\n');
        let mode = (!g.mode_change.is_empty()).then(|| {
            format!("  {} MIG mode{}\n", g.mode_change, if g.pending_reset { " (pending a GPU reset)" } else { "" })
        });
        // The mode comes on before the instances are made, and goes off after they are destroyed.
        let disabling = g.mode_change == "disable";
        if let Some(m) = mode.as_ref().filter(|_| !disabling) {
            o.push_str(m);
        } else if mode.is_none() && g.pending_reset {
            let _ = writeln!(o, "  MIG mode change pending a GPU reset: the layout follows after it");
        }
        for s in &g.steps {
            let _ = writeln!(o, "  {s}");
        }
        if let Some(m) = mode.as_ref().filter(|_| disabling) {
            o.push_str(m);
        }
        if op != "assert" {
            let n = g.steps.len() + usize::from(mode.is_some());
            let _ = writeln!(o, "  {n} step(s), {} instance(s) kept", g.kept);
        }
        if op == "assert" || op == "apply" {
            if g.differences.is_empty() && !g.pending_reset {
                o.push_str("  matches the config\n");
            }
            for d in &g.differences {
                let _ = writeln!(o, "  differs: {d}");
            }
        }
    }
    o
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
    // NVML and the driver.
    match crate::discovery::open(cfg.nvml_library.as_deref()).and_then(|n| crate::discovery::discover(&n)) {
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
        Ok(t) if t.trim() == format!("{}/libvgpu.so", crate::slices::CONTAINER_DIR) => v.push(check(
            "preload",
            "ok",
            format!("{} names {}/libvgpu.so", tpl.display(), crate::slices::CONTAINER_DIR),
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
        Ok(_) => match &agent {
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
    // Kubernetes and CDI, when present.
    let kubelet = cfg.kubelet_dir.join("kubelet.sock");
    if kubelet.exists() {
        v.push(check("kubelet", "ok", format!("{} present", kubelet.display()), ""));
        // Replica slices are collected through kubelet's pod resources API.
        if cfg.device_plugin && cfg.compat == crate::config::Compat::Replicas {
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
        let (reg, dra) = crate::dra::sockets(cfg, driver);
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
    // The MIG geometries HAMi's and Volcano's MIG mode use, where a scheduler's file is configured.
    if cfg.compat != crate::config::Compat::Replicas && !cfg.mig_geometries.is_empty() {
        let gpus: Vec<vgpu_mig::model::Gpu> = crate::discovery::open(cfg.nvml_library.as_deref())
            .map(|n| {
                use vgpu_mig::backend::MigBackend;
                let b = vgpu_mig::backend::NvmlBackend::new(std::sync::Arc::new(n));
                (0..b.gpu_count().unwrap_or(0))
                    .filter_map(|i| b.gpu(i).ok())
                    .filter(|g| !g.profiles.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        v.push(mig_geometries_check(&cfg.mig_geometries, &gpus));
    }
    if let (false, Some(s)) = (cfg.compat == crate::config::Compat::Replicas, &cfg.scheduler_settings) {
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
    v
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

/// One GPU's capacity as table cells: memory free / total, SM free, slices, MIG, health.
fn capacity_cells(g: &vgpu_proto::scheduler::v1::GpuCapacity, style: Style) -> Vec<String> {
    let mig = match &g.mig {
        Some(m) if m.enabled => {
            let inst: Vec<String> = m
                .instances
                .iter()
                .map(|i| {
                    if i.unhealthy {
                        format!("{} {}", i.profile, style.red("(unhealthy)"))
                    } else {
                        i.profile.clone()
                    }
                })
                .collect();
            let room: Vec<String> = m.room.iter().map(|r| format!("{}x{}", r.profile, r.starts.len())).collect();
            format!(
                "[{}]{}{}",
                inst.join(" "),
                if room.is_empty() { String::new() } else { format!(" room {}", room.join(" ")) },
                if m.pending { " (pending reset)" } else { "" }
            )
        }
        Some(m) if m.pending => "pending reset".into(),
        Some(_) => "off".into(),
        None => "-".into(),
    };
    let mut health = if g.healthy { style.green("ok") } else { style.red(&format!("UNHEALTHY: {}", g.health_reason)) };
    if g.draining {
        health = format!("{health} {}", style.yellow("draining"));
    }
    vec![
        g.index.to_string(),
        g.model.clone(),
        format!("{} / {}", human(g.memory_allocatable), human(g.memory_total)),
        format!("{}%", g.sm_allocatable),
        g.slices.to_string(),
        mig,
        health,
    ]
}

const CAPACITY_HEAD: [&str; 7] = ["GPU", "MODEL", "MEMORY FREE / TOTAL", "SM FREE", "SLICES", "MIG", "HEALTH"];

/// What the agent reports to the scheduler (`vgpuctl capacity`).
pub fn render_capacity(r: &pb::CapacityResponse, style: Style) -> String {
    let mut o = String::new();
    let c = r.capacity.clone().unwrap_or_default();
    let conn = if r.endpoint.is_empty() {
        "reporting off (set scheduler_endpoint)".to_string()
    } else if r.connected {
        format!("{} to {}", style.green("connected"), r.endpoint)
    } else {
        format!(
            "{} to {}{}",
            style.red("not connected"),
            r.endpoint,
            if r.last_error.is_empty() { String::new() } else { format!(": {}", r.last_error) }
        )
    };
    let _ = writeln!(o, "{} {}  {conn}\n", style.bold("NODE"), c.node);
    let mut rows = vec![CAPACITY_HEAD.map(|s| style.bold(s)).to_vec()];
    rows.extend(c.gpus.iter().map(|g| capacity_cells(g, style)));
    o.push_str(&table(&rows));
    o
}

/// The reference receiver's cluster view (`vgpuctl cluster status`).
pub fn render_cluster(st: &vgpu_proto::scheduler::v1::ClusterStatus, style: Style) -> String {
    let mut o = String::new();
    let (mut gpus, mut free, mut total, mut up) = (0usize, 0u64, 0u64, 0usize);
    for n in &st.nodes {
        let c = n.capacity.clone().unwrap_or_default();
        let state = match (n.connected, n.stale) {
            (true, false) => style.green("connected"),
            (true, true) => style.yellow("stale"),
            _ => style.red("disconnected"),
        };
        up += usize::from(n.connected && !n.stale);
        let _ = writeln!(
            o,
            "{} {}  {state}  agent {}  seen {:.1}s ago  seq {}  driver {}",
            style.bold("NODE"),
            c.node,
            n.agent_version,
            n.last_seen_ms_ago as f64 / 1000.0,
            c.sequence,
            c.driver_version
        );
        let mut rows = vec![CAPACITY_HEAD.map(|s| style.bold(s)).to_vec()];
        for g in &c.gpus {
            gpus += 1;
            free += g.memory_allocatable;
            total += g.memory_total;
            rows.push(capacity_cells(g, style));
        }
        o.push_str(&table(&rows));
        o.push('\n');
    }
    let _ = writeln!(
        o,
        "{} nodes ({up} connected), {gpus} GPUs, {} of {} GPU memory allocatable",
        st.nodes.len(),
        human(free),
        human(total)
    );
    o
}

/// A slice process in the status table: its PIDs (host, and in its container where they differ),
/// its memory, and how much of that the agent charged for what the driver holds beyond its calls.
fn process_cell(p: &pb::ProcessStatus) -> String {
    let pid = if p.host_pid != 0 && p.host_pid != p.pid {
        format!("{} (ctr {})", p.host_pid, p.pid)
    } else {
        p.pid.to_string()
    };
    if p.memory_beyond_calls > 0 {
        format!("{pid} {} ({} beyond its calls)", human(p.memory), human(p.memory_beyond_calls))
    } else {
        format!("{pid} {}", human(p.memory))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_geometries_print_as_a_schedulers_configuration_that_reads_back() {
        let t = |name: &str, core, memory_mib, count| pb::MigTemplate { name: name.into(), core, memory_mib, count };
        let geometries = vec![
            pb::MigGeometry { group: "1g.10gb".into(), templates: vec![t("1g.10gb", 14, 9984, 7)] },
            pb::MigGeometry {
                group: "2g.20gb".into(),
                templates: vec![t("2g.20gb", 28, 20096, 3), t("1g.10gb", 14, 9984, 1)],
            },
        ];
        let gpu = |index, model: &str| pb::MigGpu {
            index,
            model: model.into(),
            geometries: geometries.clone(),
            ..Default::default()
        };
        let st = pb::MigStatusResponse { gpus: vec![gpu(0, "NVIDIA H100 80GB HBM3"), gpu(1, "NVIDIA H100 80GB HBM3")] };
        for hami in [false, true] {
            let text = render_mig_geometries(&st, hami);
            let k = crate::hami::parse_mig_geometries(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
            assert_eq!(k.len(), 1, "one entry per model:\n{text}");
            assert_eq!(k[0].models, ["H100 80GB HBM3"]);
            let back = crate::hami::gpu_geometries(&k, "NVIDIA H100 80GB HBM3", &[]);
            assert_eq!(back.len(), 2);
            assert_eq!(back[1].templates[0].name, "2g.20gb");
            assert_eq!(back[1].templates[1].count, 1);
            assert_eq!(back[1].templates[0].memory, 20096);
            // Volcano's form keeps the group names; HAMi's refers to geometries by index.
            assert_eq!(back[1].group, if hami { "1" } else { "2g.20gb" });
            assert_eq!(back[1].templates[0].core, if hami { 28 } else { 0 });
        }
        let table = render_mig_status(&st);
        assert!(table.contains("GPU 1 geometries: 0 1g.10gb (7x1g.10gb) | 1 2g.20gb (3x2g.20gb 1x1g.10gb)"), "{table}");
        assert!(render_mig_geometries(&pb::MigStatusResponse::default(), false).contains("no MIG-capable GPUs"));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("8g").unwrap(), 8 << 30);
        assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("8 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_size("lots").unwrap_err().contains("is not a size"));
        assert!(parse_size("1e30").is_err());
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1536 << 20), "1.5 GiB");
        assert_eq!(human(512 << 20), "512.0 MiB");
    }

    #[test]
    fn escapes_read_by_kind_and_name_who_runs_them() {
        let e = |kind: pb::escape::Kind, slice: &str| pb::Escape {
            kind: kind as i32,
            gpu: "GPU-5eed0000-1000".into(),
            slice: slice.into(),
            pid: 4242,
            measured: 3 << 30,
            limit: 2 << 30,
            action: "reported".into(),
            command: "python3".into(),
            ..Default::default()
        };
        assert_eq!(
            escape_line(&e(pb::escape::Kind::OverLimit, "job1")),
            "slice job1 over its limit on GPU-5eed0000: NVML measures 3.0 GiB > 2.0 GiB (pid 4242 (python3), reported)"
        );
        assert_eq!(
            escape_line(&e(pb::escape::Kind::Unaccounted, "job1")),
            "pid 4242 (python3) of slice job1 on GPU-5eed0000, outside the slice: 3.0 GiB (reported)"
        );
        let mut out = e(pb::escape::Kind::Unaccounted, "");
        out.pod_uid = "4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d".into();
        out.container_id = "0a1b2c3d4e5f60718293".into();
        assert_eq!(
            escape_line(&out),
            "pid 4242 (python3, pod UID 4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d, container 0a1b2c3d4e5f) on GPU-5eed0000 \
             outside every slice: 3.0 GiB (reported)"
        );
        out.command.clear();
        out.pod = "ml/train-0".into();
        out.container_id.clear();
        assert!(escape_line(&out).starts_with("pid 4242 (pod ml/train-0) on "), "{}", escape_line(&out));
        out.pod.clear();
        out.pod_uid.clear();
        assert!(escape_line(&out).starts_with("pid 4242 on "), "nothing known: nothing added");
    }

    #[test]
    fn processes_show_what_was_charged_beyond_their_calls() {
        let mut p = pb::ProcessStatus { host_pid: 4242, pid: 7, memory: 364 << 20, ..Default::default() };
        assert_eq!(process_cell(&p), "4242 (ctr 7) 364.0 MiB");
        p.memory_beyond_calls = 300 << 20;
        assert_eq!(process_cell(&p), "4242 (ctr 7) 364.0 MiB (300.0 MiB beyond its calls)");
    }

    #[test]
    fn tables_align_with_colour() {
        let st = Style { colour: true };
        let t = table(&[vec![st.red("a"), "b".into()], vec!["ccc".into(), "d".into()]]);
        assert_eq!(t, "\x1b[31ma\x1b[0m    b\nccc  d\n");
    }

    #[test]
    fn last_kernels_read_as_spans() {
        let now = 10_000_000_000;
        assert_eq!(last_kernel(now, now - 3_400, 1), "3s ago");
        assert_eq!(last_kernel(now, now - 125_000, 1), "2m ago");
        assert_eq!(last_kernel(now, now - (2 * 3600 + 5 * 60) * 1000, 1), "2h05m ago");
        assert_eq!(last_kernel(now, now - (3 * 86400 + 4 * 3600) * 1000, 1), "3d04h ago");
        assert_eq!(last_kernel(now, 0, now - 300_000), "none in 5m");
        // A sample dated a little after the status (clocks read apart): not a negative span.
        assert_eq!(last_kernel(now, now + 50, 1), "0s ago");
        assert_eq!(last_kernel(now, 0, 0), "-");
    }
}

/// What `vgpuctl slice update` sends, and what it tells the operator.
#[derive(Debug, Default)]
pub struct UpdatePlan {
    /// Every named GPU with its limits after the change (what is not named keeps its value).
    pub gpus: Vec<pb::SliceGpuLimit>,
    /// One line per limit that changes or is kept.
    pub changes: Vec<String>,
    pub warnings: Vec<String>,
}

/// Works out a slice update from the slice as it is (`cur`) and the node's status: each GPU in
/// `gpus` (an index or a UUID or its prefix) gets `memory` and `sm` where given (0: no limit) and
/// keeps the other. A memory limit below what the slice's processes hold now is refused unless
/// `force`; a GPU in MIG mode is warned about.
pub fn plan_update(
    cur: &pb::SliceDetail,
    st: &pb::NodeStatus,
    gpus: &[String],
    memory: Option<u64>,
    sm: Option<u32>,
    force: bool,
) -> Result<UpdatePlan, String> {
    let mut plan = UpdatePlan::default();
    let limit_text = |m: u64| if m == 0 { "none".to_string() } else { human(m) };
    let sm_text = |v: u32| if v == 0 || v >= 100 { "none".to_string() } else { format!("{v}%") };
    for g in gpus {
        let by_index =
            g.parse::<u32>().ok().and_then(|i| st.gpus.iter().find(|x| x.index == i)).map(|x| x.uuid.clone());
        let uuid = by_index.unwrap_or_else(|| g.clone());
        let found: Vec<&pb::SliceGpuLimit> = cur.gpus.iter().filter(|x| x.gpu.starts_with(&uuid)).collect();
        let have = match found.as_slice() {
            [one] => *one,
            [] => return Err(format!("slice {} has no GPU {g:?} (it has {})", cur.name, names(cur))),
            _ => return Err(format!("GPU {g:?} matches {} of the slice's GPUs; give more of the UUID", found.len())),
        };
        let new = pb::SliceGpuLimit {
            gpu: have.gpu.clone(),
            memory: memory.unwrap_or(have.memory),
            sm: sm.unwrap_or(have.sm),
        };
        let used = st
            .slices
            .iter()
            .find(|s| s.name == cur.name)
            .and_then(|s| s.gpus.iter().find(|x| x.uuid == have.gpu))
            .map_or(0, |x| x.memory_used);
        if new.memory != 0 && new.memory < used && !force {
            return Err(format!(
                "slice {} holds {} on {} now: a memory limit of {} is below it (its processes' next allocations \
                 fail and the agent reports it over its limit); give --force to do it anyway",
                cur.name,
                human(used),
                have.gpu,
                human(new.memory)
            ));
        }
        let what = |name: &str, a: String, b: String| {
            if a == b {
                format!("{name} {a} (kept)")
            } else {
                format!("{name} {a} -> {b}")
            }
        };
        plan.changes.push(format!(
            "slice {} on {}: {}, {}",
            cur.name,
            have.gpu,
            what("memory", limit_text(have.memory), limit_text(new.memory)),
            what("SM", sm_text(have.sm), sm_text(new.sm))
        ));
        if let Some(x) = st.gpus.iter().find(|x| x.uuid == have.gpu && x.mode == "mig") {
            plan.warnings.push(format!(
                "warning: GPU {} ({}) is in MIG mode: its memory and SMs belong to its MIG instances, and a slice \
                 of the whole GPU holds nothing there",
                x.index, x.uuid
            ));
        }
        plan.gpus.push(new);
    }
    Ok(plan)
}

fn names(d: &pb::SliceDetail) -> String {
    d.gpus.iter().map(|g| g.gpu.as_str()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod update_tests {
    use super::*;

    fn slice() -> pb::SliceDetail {
        pb::SliceDetail {
            name: "job".into(),
            gpus: vec![pb::SliceGpuLimit { gpu: "GPU-aaaa".into(), memory: 8 << 30, sm: 30 }],
            ..Default::default()
        }
    }

    fn status(used: u64, mode: &str) -> pb::NodeStatus {
        pb::NodeStatus {
            gpus: vec![pb::GpuStatus { index: 0, uuid: "GPU-aaaa".into(), mode: mode.into(), ..Default::default() }],
            slices: vec![pb::SliceStatus {
                name: "job".into(),
                gpus: vec![pb::SliceGpuStatus { uuid: "GPU-aaaa".into(), memory_used: used, ..Default::default() }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn an_update_keeps_the_limits_it_does_not_name() {
        let p = plan_update(&slice(), &status(0, "shared"), &["0".into()], Some(1 << 30), None, false).unwrap();
        assert_eq!((p.gpus[0].memory, p.gpus[0].sm), (1 << 30, 30), "the SM limit is kept");
        assert!(
            p.changes[0].contains("memory 8.0 GiB -> 1.0 GiB") && p.changes[0].contains("SM 30% (kept)"),
            "{:?}",
            p.changes
        );
        let p = plan_update(&slice(), &status(0, "shared"), &["GPU-a".into()], None, Some(50), false).unwrap();
        assert_eq!((p.gpus[0].memory, p.gpus[0].sm), (8 << 30, 50), "the memory limit is kept");
        let p = plan_update(&slice(), &status(0, "shared"), &["0".into()], Some(0), None, false).unwrap();
        assert_eq!(p.gpus[0].memory, 0, "none removes the limit");
        assert!(p.changes[0].contains("memory 8.0 GiB -> none"), "{:?}", p.changes);
    }

    #[test]
    fn shrinking_below_what_is_held_needs_force_and_mig_mode_is_warned_about() {
        let e =
            plan_update(&slice(), &status(3 << 30, "shared"), &["0".into()], Some(1 << 30), None, false).unwrap_err();
        assert!(e.contains("holds 3.0 GiB") && e.contains("--force"), "{e}");
        assert!(plan_update(&slice(), &status(3 << 30, "shared"), &["0".into()], Some(1 << 30), None, true).is_ok());
        let p = plan_update(&slice(), &status(0, "mig"), &["0".into()], Some(1 << 30), None, false).unwrap();
        assert!(p.warnings[0].contains("MIG mode"), "{:?}", p.warnings);
        let e = plan_update(&slice(), &status(0, "shared"), &["GPU-b".into()], Some(1), None, false).unwrap_err();
        assert!(e.contains("has no GPU"), "{e}");
    }
}

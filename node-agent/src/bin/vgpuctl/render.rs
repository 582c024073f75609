//! What `vgpuctl` prints: sizes, the status table, slice details, MIG status and geometries,
//! capacity and the cluster's view.

use std::fmt::Write;
use vgpu_agent::describe::{escape_line, human};
use vgpu_agent::slices::printable;
use vgpu_proto::v1 as pb;

/// A UUID as a table shows it: its first 12 characters, whole with `-o wide`.
fn short_uuid(u: &str) -> String {
    if crate::wide() {
        u.to_string()
    } else {
        vgpu_agent::describe::short_uuid(u)
    }
}

/// Parses a size as everything in vgpu does (`vgpu_units::parse_size`: bytes, `0x` hex, `k`/`m`/`g`/`t`
/// and `KiB`...`TiB` as powers of 1024, `KB`...`TB` as powers of 1000, decimals allowed).
pub fn parse_size(s: &str) -> Result<u64, String> {
    vgpu_units::parse_size(s).map_err(|e| e.to_string())
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

/// A GPU's MPS daemon as the status says it: running (with its servers and pipe directory), or
/// down with why.
fn mps_line(index: u32, m: &pb::MpsStatus, style: Style) -> String {
    let restarts = match m.restarts {
        0 => String::new(),
        1 => ", started again once".into(),
        n => format!(", started again {n} times"),
    };
    if m.running {
        let servers = match &m.servers[..] {
            [] => "no server yet".to_string(),
            s => format!("server {}", s.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")),
        };
        format!("GPU {index} MPS: daemon running ({servers}), pipe directory {}{restarts}", m.pipe_dir)
    } else {
        style.red(&format!("GPU {index} MPS: daemon DOWN: {}{restarts}", m.last_error))
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
    pub fn red(&self, s: &str) -> String {
        self.paint("31", s)
    }
    pub fn green(&self, s: &str) -> String {
        self.paint("32", s)
    }
    pub fn yellow(&self, s: &str) -> String {
        self.paint("33", s)
    }
    pub fn bold(&self, s: &str) -> String {
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
            let profile = vgpu_agent::dra::mig_profile(&i.name);
            let _ = writeln!(o, "GPU {} MIG {} {}: {}", g.index, profile, short_uuid(&i.uuid), i.holder);
        }
        for i in g.mig.iter().flat_map(|m| &m.instances).filter(|i| i.unhealthy) {
            let profile = vgpu_agent::dra::mig_profile(&i.name);
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
        if let Some(m) = &g.mps {
            let _ = writeln!(o, "{}", mps_line(g.index, m, style));
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
    render_slices(&mut o, st, style);
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

/// The status's slice table: each slice's GPUs with their memory, SM time, throttling, latest
/// kernel and processes, then the allocations served as unified memory.
fn render_slices(o: &mut String, st: &pb::NodeStatus, style: Style) {
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
            let owner =
                if s.priority == pb::SlicePriority::PriorityHigh as i32 { format!("{owner} [high]") } else { owner };
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
        o.push_str(&sm_share_notes(st));
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
}

/// A line for each SM share not being applied now: a slice alone on its GPU may use all of it (as
/// HAMi's default policy has it); its share holds again once another slice or process shares it.
fn sm_share_notes(st: &pb::NodeStatus) -> String {
    let mut o = String::new();
    for s in &st.slices {
        for g in s.gpus.iter().filter(|g| (1..100).contains(&g.sm_limit)) {
            let alone = st.gpus.iter().any(|x| x.index == g.gpu_index && x.mode == "exclusive");
            if alone {
                let _ = writeln!(
                    o,
                    "slice {} on GPU {}: its SM share ({}%) is not applied now: the slice is alone on the GPU and may use it all; the share holds once another slice or process uses it",
                    s.name, g.gpu_index, g.sm_limit
                );
            }
        }
    }
    o
}

/// A slice's limits, environment and mounts, and the `docker run` flags that put a container in it.
pub fn render_slice(d: &pb::SliceDetail) -> String {
    let mut o = String::new();
    let high = if d.priority == pb::SlicePriority::PriorityHigh as i32 { ", priority high" } else { "" };
    let _ = writeln!(o, "slice {}  (state {}{high})", d.name, d.state_dir);
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
        let _ = writeln!(o, "CDI device: {0}  (CDI-enabled runtimes: podman run --device {0})", d.cdi_device);
    }
    o.push_str("docker/podman run flags (add --gpus or the CDI device for the GPUs themselves):\n ");
    for (k, v) in &env {
        let _ = write!(o, " -e {k}={v}");
    }
    for m in &d.mounts {
        let _ = write!(o, " -v {}:{}{}", m.host_path, m.container_path, if m.read_only { ":ro" } else { "" });
    }
    o.push('\n');
    let _ = writeln!(o, "on this host, without a container:\n  vgpuctl run {} -- COMMAND [ARGS...]", d.name);
    if !d.mounts.iter().any(|m| m.container_path.ends_with("/libvgpu.so")) {
        o.push_str(
            "warning: the agent has no libvgpu.so to give this slice (none was at its --library path when it \
             started): processes in it run without limits; install it (scripts/install.sh) and restart the agent\n",
        );
    }
    o
}

/// A slice priority's name, as tables and messages show it.
pub fn priority_name(p: i32) -> &'static str {
    if p == pb::SlicePriority::PriorityHigh as i32 {
        "high"
    } else {
        "normal"
    }
}

/// `vgpuctl slice list`: a slice per GPU row, with its limits and owner.
pub fn render_slice_list(slices: &[pb::SliceDetail]) -> String {
    if slices.is_empty() {
        return "no slices\n".into();
    }
    let mut rows = vec![["SLICE", "GPU", "MEMORY LIMIT", "SM LIMIT", "PRIORITY", "OWNER"].map(String::from).to_vec()];
    for d in slices {
        let owner = match (d.labels.get("namespace"), d.labels.get("pod"), d.labels.get("container")) {
            (Some(n), Some(p), Some(c)) => printable(&format!("{n}/{p}/{c}")),
            (Some(n), Some(p), None) => printable(&format!("{n}/{p}")),
            _ => "-".into(),
        };
        for (i, g) in d.gpus.iter().enumerate() {
            let first = i == 0;
            rows.push(vec![
                if first { d.name.clone() } else { String::new() },
                short_uuid(&g.gpu),
                if g.memory == 0 { "none".into() } else { human(g.memory) },
                if g.sm == 0 || g.sm >= 100 { "none".into() } else { format!("{}%", g.sm) },
                if first { priority_name(d.priority).into() } else { String::new() },
                if first { owner.clone() } else { String::new() },
            ]);
        }
    }
    table(&rows)
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
            .map(|i| match (i.holder.as_str(), i.compute_instances) {
                // Made without its compute instance (outside the agent, or cut short): CUDA has no
                // device there, and its slices are taken all the same.
                (_, 0) => format!("{}@{} (no compute instance: unusable)", i.name, i.start),
                ("", _) => format!("{}@{}", i.name, i.start),
                (h, _) => format!("{}@{} ({h})", i.name, i.start),
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
    // A host PID is shown only where NVML confirmed it; otherwise the PID is the slot's word (a
    // container may write anything there), or the process has not reached the GPU yet.
    let pid = match p.host_pid {
        0 => format!("? (ctr {}, unverified)", p.pid),
        h if h != p.pid => format!("{h} (ctr {})", p.pid),
        h => h.to_string(),
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
            let k = vgpu_agent::hami::parse_mig_geometries(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
            assert_eq!(k.len(), 1, "one entry per model:\n{text}");
            assert_eq!(k[0].models, ["H100 80GB HBM3"]);
            let back = vgpu_agent::hami::gpu_geometries(&k, "NVIDIA H100 80GB HBM3", &[]);
            assert_eq!(back.len(), 2);
            assert_eq!(back[1].templates[0].name, "2g.20gb");
            assert_eq!(back[1].templates[1].count, 1);
            assert_eq!(back[1].templates[0].memory, 20096);
            // Volcano's form keeps the group names; HAMi's refers to geometries by index.
            assert_eq!(back[1].group, if hami { "1" } else { "2g.20gb" });
            assert_eq!(back[1].templates[0].core, if hami { 28 } else { 0 });
        }
        let mut st = st;
        let inst = |name: &str, start, compute_instances, holder: &str| pb::MigInstance {
            name: name.into(),
            start,
            compute_instances,
            holder: holder.into(),
            ..Default::default()
        };
        st.gpus[0].enabled = true;
        st.gpus[0].instances =
            vec![inst("1g.10gb", 0, 1, ""), inst("1g.10gb", 1, 0, ""), inst("2g.20gb", 2, 1, "pod a")];
        st.gpus[0].desired = vec!["MIG enabled, instances made per request (no layout)".into()];
        let table = render_mig_status(&st);
        assert!(
            table.contains("1g.10gb@0 1g.10gb@1 (no compute instance: unusable) 2g.20gb@2 (pod a)"),
            "an instance without a compute instance is named so: {table}"
        );
        assert!(table.contains("MIG enabled, instances made per request"), "{table}");
        assert!(table.contains("GPU 1 geometries: 0 1g.10gb (7x1g.10gb) | 1 2g.20gb (3x2g.20gb 1x1g.10gb)"), "{table}");
        assert!(render_mig_geometries(&pb::MigStatusResponse::default(), false).contains("no MIG-capable GPUs"));
    }

    #[test]
    fn an_sm_share_not_applied_is_said() {
        let gpu = |index, mode: &str| pb::GpuStatus { index, mode: mode.into(), ..Default::default() };
        let slice = |name: &str, idx, sm| pb::SliceStatus {
            name: name.into(),
            gpus: vec![pb::SliceGpuStatus { gpu_index: idx, sm_limit: sm, ..Default::default() }],
            ..Default::default()
        };
        let st = pb::NodeStatus {
            gpus: vec![gpu(0, "exclusive"), gpu(1, "shared")],
            slices: vec![slice("alone", 0, 30), slice("beside", 1, 30), slice("free", 0, 0)],
            ..Default::default()
        };
        let n = sm_share_notes(&st);
        assert!(n.contains("slice alone on GPU 0: its SM share (30%) is not applied now"), "{n}");
        assert!(!n.contains("beside") && !n.contains("free"), "{n}");
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
    fn processes_show_what_was_charged_beyond_their_calls() {
        let mut p = pb::ProcessStatus { host_pid: 4242, pid: 7, memory: 364 << 20, ..Default::default() };
        assert_eq!(process_cell(&p), "4242 (ctr 7) 364.0 MiB");
        p.memory_beyond_calls = 300 << 20;
        assert_eq!(process_cell(&p), "4242 (ctr 7) 364.0 MiB (300.0 MiB beyond its calls)");
        // A PID only the slot claims is marked as such.
        let q = pb::ProcessStatus { host_pid: 0, pid: 7, memory: 0, ..Default::default() };
        assert_eq!(process_cell(&q), "? (ctr 7, unverified) 0 B");
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

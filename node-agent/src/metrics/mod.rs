//! The Prometheus endpoint: HAMi's node-monitor series as HAMi serves them (`hami`, so existing
//! dashboards and alerts keep working), vgpu's own, and the standard process series, rendered from
//! the latest status at scrape time, served by `vgpu-httpd`: `GET /metrics`, `GET /healthz` (200
//! when ready), `GET /livez`, anything else 404.

mod hami;
pub mod rotate;

use crate::agent::Agent;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use vgpu_proto::v1 as pb;

/// A label value as the exposition format wants it; control characters (which a record written
/// before labels were checked may hold) become `?`.
fn esc(v: &str) -> String {
    crate::slices::printable(&v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
}

struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
    fn put(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", esc(v))).collect();
        if l.is_empty() {
            let _ = writeln!(self.0, "{name} {v}");
        } else {
            let _ = writeln!(self.0, "{name}{{{}}} {v}", l.join(","));
        }
    }

    /// One metric: its HELP/TYPE head, then a sample per GPU.
    fn per_gpu(&mut self, st: &pb::NodeStatus, name: &str, kind: &str, help: &str, f: &dyn Fn(&pb::GpuStatus) -> f64) {
        self.head(name, kind, help);
        for g in &st.gpus {
            self.put(name, &[("device_uuid", &g.uuid), ("device_index", &g.index.to_string())], f(g));
        }
    }

    /// One metric: its head, then a sample per GPU that runs MPS (the head alone where none does).
    fn per_mps_gpu(
        &mut self,
        st: &pb::NodeStatus,
        name: &str,
        kind: &str,
        help: &str,
        f: &dyn Fn(&pb::MpsStatus) -> f64,
    ) {
        self.head(name, kind, help);
        for g in &st.gpus {
            if let Some(m) = &g.mps {
                self.put(name, &[("device_uuid", &g.uuid), ("device_index", &g.index.to_string())], f(m));
            }
        }
    }

    /// One metric: its head, then a sample per slice and GPU, with the slice's owner labels.
    fn per_slice_gpu(
        &mut self,
        st: &pb::NodeStatus,
        name: &str,
        kind: &str,
        help: &str,
        f: &dyn Fn(&pb::SliceStatus, &pb::SliceGpuStatus) -> f64,
    ) {
        self.head(name, kind, help);
        for s in &st.slices {
            let ow = owner(s);
            for (i, g) in s.gpus.iter().enumerate() {
                let idx = i.to_string();
                let mut l: Vec<(&str, &str)> = ow.iter().map(|(k, v)| (*k, v.as_str())).collect();
                l.push(("vdevice_index", &idx));
                l.push(("device_uuid", &g.uuid));
                self.put(name, &l, f(s, g));
            }
        }
    }

    /// One gauge per MIG instance: labels of its GPU, its UUID and GPU instance ID, and its profile
    /// where wanted.
    fn per_mig(
        &mut self,
        st: &pb::NodeStatus,
        name: &str,
        help: &str,
        profile: bool,
        f: &dyn Fn(&pb::MigInstance) -> f64,
    ) {
        self.head(name, "gauge", help);
        for g in &st.gpus {
            for m in g.mig.iter().flat_map(|m| &m.instances) {
                let (index, gi) = (g.index.to_string(), m.gpu_instance_id.to_string());
                let mut labels =
                    vec![("device_uuid", g.uuid.as_str()), ("device_index", &index), ("mig_uuid", &m.uuid)];
                if profile {
                    labels.push(("profile", &m.name));
                }
                labels.push(("gpu_instance_id", &gi));
                self.put(name, &labels, f(m));
            }
        }
    }
}

/// Kubernetes owner labels of a slice (empty outside Kubernetes).
fn owner(s: &pb::SliceStatus) -> [(&'static str, String); 4] {
    let l = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
    [("namespace", l("namespace")), ("pod", l("pod")), ("container", l("container")), ("slice", s.name.clone())]
}

pub fn render(agent: &Agent) -> String {
    let st = agent.live_status();
    let mut o = Out(String::with_capacity(16 * 1024));
    hami::series(&mut o, agent, &st);
    vgpu_series(&mut o, &st);
    mps_series(&mut o, &st);
    agent_series(&mut o, agent, &st);
    o.0
}

/// The MPS daemons' series (GPUs that run MPS only).
fn mps_series(o: &mut Out, st: &pb::NodeStatus) {
    o.per_mps_gpu(
        st,
        "vgpu_mps_daemon_up",
        "gauge",
        "1 while the GPU's MPS control daemon answers (GPUs that run MPS only).",
        &|m| f64::from(u8::from(m.running)),
    );
    o.per_mps_gpu(
        st,
        "vgpu_mps_daemon_restarts_total",
        "counter",
        "How often the agent started the GPU's MPS control daemon again since it started.",
        &|m| f64::from(m.restarts),
    );
}

/// vgpu's own series of GPUs, MIG instances and slices.
fn vgpu_series(o: &mut Out, st: &pb::NodeStatus) {
    // --- vgpu's own ---
    o.per_mig(
        st,
        "vgpu_mig_device_healthy",
        "1 unless a critical XID NVML reported about the MIG device's GPU instance (not the whole GPU) was \
         recent; the GPU's own health is vgpu_gpu_healthy.",
        false,
        &|m| f64::from(u8::from(!m.unhealthy)),
    );
    o.per_gpu(
        st,
        "vgpu_gpu_admin_processes",
        "gauge",
        "Processes of DRA claims with admin access on the GPU, outside every slice and not escapes.",
        &|g| g.admin_processes.len() as f64,
    );
    o.per_gpu(
        st,
        "vgpu_gpu_healthy",
        "gauge",
        "1 when the GPU is healthy (no recent critical XID, NVML answers).",
        &|g| g.healthy as u8 as f64,
    );
    o.per_gpu(
        st,
        "vgpu_gpu_critical_xids_total",
        "counter",
        "Critical XID events the GPU reported since the agent started (they make it unhealthy).",
        &|g| g.critical_xids as f64,
    );
    o.per_gpu(
        st,
        "vgpu_gpu_application_xids_total",
        "counter",
        "XID events reporting an application's fault (13, 31, 43, 45, 68, 109) since the agent started.",
        &|g| g.application_xids as f64,
    );
    o.per_gpu(
        st,
        "vgpu_gpu_last_critical_xid",
        "gauge",
        "The last critical XID the GPU reported since the agent started (0: none).",
        &|g| f64::from(g.last_critical_xid),
    );
    o.per_gpu(st, "vgpu_gpu_memory_total_bytes", "gauge", "Device memory of the GPU.", &|g| g.memory_total as f64);
    o.per_gpu(
        st,
        "vgpu_gpu_sm_feedback_held",
        "gauge",
        "1 while NVML's per-process SM samples on the GPU do not add up and SM-rate corrections are held.",
        &|g| g.sm_feedback_held as u8 as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_memory_measured_bytes",
        "gauge",
        "Device memory of a slice's processes as NVML measures it.",
        &|_, g| g.memory_measured as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_memory_drift_bytes",
        "gauge",
        "NVML-measured minus interposer-accounted memory (contexts, escapes).",
        &|_, g| g.memory_measured as f64 - g.memory_used as f64,
    );
    o.per_slice_gpu(st, "vgpu_slice_memory_peak_bytes", "gauge", "Highest accounted memory of a slice.", &|_, g| {
        g.memory_peak as f64
    });
    o.per_slice_gpu(st, "vgpu_slice_sm_limit_ratio", "gauge", "A slice's SM-time limit (0..1; 0: none).", &|_, g| {
        g.sm_limit as f64 / 100.0
    });
    o.per_slice_gpu(
        st,
        "vgpu_slice_throttled_seconds_total",
        "counter",
        "Time a slice's launches waited for SM budget.",
        &|_, g| g.throttled_ns as f64 / 1e9,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_throttled_launches_total",
        "counter",
        "Launches of a slice that waited for SM budget.",
        &|_, g| g.throttled_launches as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_sm_unmeasured_launches_total",
        "counter",
        "Launches of a slice its interposers could not time with events (a driver call failed); timed by their stream's completion instead.",
        &|_, g| g.sm_unmeasured_launches as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_oom_rejections_total",
        "counter",
        "Allocations refused because they would pass the limit.",
        &|_, g| g.oom_rejections as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_spilled_bytes_total",
        "counter",
        "Bytes of allocations the GPU had no room for, served as unified memory (CUDA_OVERSUBSCRIBE).",
        &|_, g| g.spilled_bytes as f64,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_sm_rate_correction_ratio",
        "gauge",
        "The agent's correction of the SM budget's refill rate (1: none).",
        &|_, g| g.sm_rate_ppm as f64 / 1e6,
    );
    o.per_slice_gpu(
        st,
        "vgpu_slice_sm_accounted_ratio",
        "gauge",
        "Share of the GPU's time a slice's interposers charged its launches (0..1; 0 while no SM limit applies).",
        &|_, g| g.sm_accounted as f64 / 100.0,
    );
    o.head("vgpu_slice_processes", "gauge", "Live processes of a slice.");
    for s in &st.slices {
        let ow = owner(s);
        let l: Vec<(&str, &str)> = ow.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut pids: Vec<u32> = s.processes.iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        o.put("vgpu_slice_processes", &l, pids.len() as f64);
    }
    o.head(
        "vgpu_slice_priority_high",
        "gauge",
        "1 for a high-priority slice (its GPUs' normal slices yield to it), else 0.",
    );
    for s in &st.slices {
        let ow = owner(s);
        let l: Vec<(&str, &str)> = ow.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let high = s.priority == pb::SlicePriority::PriorityHigh as i32;
        o.put("vgpu_slice_priority_high", &l, if high { 1.0 } else { 0.0 });
    }
}

/// The agent's own: versions, counters, its passes and its resources.
fn agent_series(o: &mut Out, agent: &Agent, st: &pb::NodeStatus) {
    let s = &agent.stats;
    o.head("vgpu_agent_info", "gauge", "The agent's version and the node's NVIDIA driver and CUDA versions (value 1).");
    let cuda = format!("{}.{}", st.cuda_version / 1000, st.cuda_version % 1000 / 10);
    o.put(
        "vgpu_agent_info",
        &[("version", &st.agent_version), ("driver_version", &st.driver_version), ("cuda_version", &cuda)],
        1.0,
    );
    o.head(
        "vgpu_reclaimed_bytes_total",
        "counter",
        "Device memory accounted to dead processes and released by the agent (as far as NVML saw them hold it).",
    );
    o.put("vgpu_reclaimed_bytes_total", &[], s.reclaimed_bytes.load(Relaxed) as f64);
    o.head("vgpu_escapes_total", "counter", "Escapes detected (each counted once while it lasts).");
    o.put("vgpu_escapes_total", &[("kind", "unaccounted")], s.escapes_unaccounted.load(Relaxed) as f64);
    o.put("vgpu_escapes_total", &[("kind", "over_limit")], s.escapes_over_limit.load(Relaxed) as f64);
    o.put("vgpu_escapes_total", &[("kind", "bypass")], s.escapes_bypass.load(Relaxed) as f64);
    o.head(
        "vgpu_slices_collected_total",
        "counter",
        "Replica slices removed because no container holds their devices any more (kubelet pod resources).",
    );
    o.put("vgpu_slices_collected_total", &[], s.slices_collected.load(Relaxed) as f64);
    o.head("vgpu_escapes_active", "gauge", "Escapes seen in the last monitoring pass.");
    o.put("vgpu_escapes_active", &[], st.escapes.len() as f64);
    o.head(
        "vgpu_warnings_active",
        "gauge",
        "Conditions an operator must act on that belong to no GPU or slice (vgpuctl status lists them).",
    );
    o.put("vgpu_warnings_active", &[], st.warnings.len() as f64);
    o.head("vgpu_agent_loop_seconds", "gauge", "Duration of the last monitoring pass.");
    o.put("vgpu_agent_loop_seconds", &[], s.loop_us.load(Relaxed) as f64 / 1e6);
    o.head(
        "vgpu_agent_last_pass_age_seconds",
        "gauge",
        "Seconds since the last monitoring pass completed (grows while a pass does not return).",
    );
    o.put("vgpu_agent_last_pass_age_seconds", &[], agent.pass_age().map_or(0.0, |d| d.as_secs_f64()));
    o.head("vgpu_agent_loop_max_seconds", "gauge", "Longest monitoring pass since start.");
    o.put("vgpu_agent_loop_max_seconds", &[], s.loop_max_us.load(Relaxed) as f64 / 1e6);
    o.head("vgpu_agent_loop_seconds_total", "counter", "Time spent in monitoring passes.");
    o.put("vgpu_agent_loop_seconds_total", &[], s.loop_us_total.load(Relaxed) as f64 / 1e6);
    o.head("vgpu_agent_passes_total", "counter", "Monitoring passes made.");
    o.put("vgpu_agent_passes_total", &[], s.passes.load(Relaxed) as f64);
    process_series(o);
}

/// The standard process series (Prometheus's client libraries' names and units).
fn process_series(o: &mut Out) {
    o.head("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
    o.put("process_resident_memory_bytes", &[], crate::procfs::self_rss() as f64);
    o.head("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.");
    o.put("process_cpu_seconds_total", &[], crate::procfs::self_cpu_ns() as f64 / 1e9);
    if let Some(t) = crate::procfs::self_start_time_s() {
        o.head("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.");
        o.put("process_start_time_seconds", &[], t);
    }
    if let Some(n) = crate::procfs::self_open_fds() {
        o.head("process_open_fds", "gauge", "Number of open file descriptors.");
        o.put("process_open_fds", &[], n as f64);
    }
    if let Some(n) = crate::procfs::self_max_fds() {
        o.head("process_max_fds", "gauge", "Maximum number of open file descriptors.");
        o.put("process_max_fds", &[], n as f64);
    }
}

/// Why the metrics endpoint's TLS cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum MetricsTlsError {
    #[error("metrics TLS: {0}")]
    Load(String),
    #[error("metrics TLS: {0}")]
    Config(#[from] tokio_rustls::rustls::Error),
}

/// TLS for the metrics endpoint, from the configured PEM files, followed on disk (None: plain
/// HTTP; see [`rotate`]).
pub fn acceptor(cfg: &crate::config::Config) -> Result<Option<tokio_rustls::TlsAcceptor>, MetricsTlsError> {
    let Some((cert, key)) = &cfg.metrics_tls else { return Ok(None) };
    let resolver = rotate::Certificate::new(cert, key).map_err(MetricsTlsError::Load)?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let sc = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(sc))))
}

/// Serves `/metrics` (with the bearer token when one is configured), `/healthz` (readiness) and
/// `/livez` (open: probes carry no token, and they tell nothing but health), over TLS when `tls`
/// is given; HTTP/1.1 with keep-alive, bounded as [`vgpu_httpd::Limits`] says.
pub async fn serve(
    listener: tokio::net::TcpListener,
    agent: Arc<Agent>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    token: Option<rotate::Token>,
) {
    let handler: vgpu_httpd::Handler = Arc::new(move |r| {
        let token = token.as_ref().and_then(rotate::Token::get);
        answer(&agent, token.as_deref(), r)
    });
    vgpu_httpd::serve(listener, tls, vgpu_httpd::Limits::default(), handler).await;
}

/// Constant-time comparison of a presented token.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn answer(agent: &Agent, token: Option<&str>, r: &vgpu_httpd::Request) -> vgpu_httpd::Response {
    use vgpu_httpd::Response;
    let authorized = token.is_none_or(|t| {
        r.authorization
            .and_then(|v| v.trim().strip_prefix("Bearer "))
            .is_some_and(|p| same(p.trim().as_bytes(), t.as_bytes()))
    });
    match (r.method, r.path) {
        ("GET", "/metrics") if !authorized => Response::text(401, "a bearer token is required\n"),
        ("GET", "/metrics") => {
            Response { status: 200, content_type: "text/plain; version=0.0.4; charset=utf-8", body: render(agent) }
        }
        ("GET", "/healthz") if agent.ready.load(Relaxed) => Response::text(200, "ok\n"),
        ("GET", "/healthz") => Response::text(503, "starting\n"),
        // Liveness: fails only while the monitoring has stalled (not while starting), so that kubelet
        // restarts an agent stuck in a call that never returns.
        ("GET", "/livez") => match agent.stalled() {
            None => Response::text(200, "ok\n"),
            Some(why) => Response::text(503, format!("{why}\n")),
        },
        ("GET", _) => Response::text(404, "not found: try /metrics\n"),
        _ => Response::text(405, "only GET\n"),
    }
}

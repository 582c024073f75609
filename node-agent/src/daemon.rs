//! The agent daemon. Start-up order: load the slice record and install the library (fast), serve the
//! API socket at once (readiness false), then discover GPUs, start the XID watcher and the
//! monitoring thread; ready after the first pass. SIGTERM or SIGINT stops it cleanly: the socket is
//! removed, the threads joined. Running containers stay enforced without the agent: their limits
//! live in their regions, which outlive it.

use crate::agent::{Agent, VERSION};
use crate::config::Config;
use crate::discovery;
use crate::monitor::Monitor;
use crate::slices::{install_library, SliceStore};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the inventory (MIG layout, topology) is read again.
const INVENTORY_REFRESH: Duration = Duration::from_secs(30);

/// Raises the soft limit on open files to the hard one (each slice holds two descriptors, and
/// [`FD_RESERVE`] are kept for everything else), and fits `max_slices` to what that allows: with
/// the limit at 1024, slices past about 500 failed with "Too many open files", `vgpuctl status`
/// hung, and a restart was wedged again at once. Returns the `max_slices` to use.
fn fit_fd_limit(max_slices: usize) -> usize {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return max_slices;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    let fit = slices_within(r.rlim_cur);
    if fit < max_slices {
        tracing::warn!(
            open_files = r.rlim_cur,
            max_slices,
            fitted = fit,
            "the open-file limit holds fewer slices than max_slices: the node takes at most the fitted number (raise LimitNOFILE for more)"
        );
        return fit;
    }
    max_slices
}

/// Descriptors kept for everything but the slices: sockets, connections, NVML, the kubelet's.
const FD_RESERVE: u64 = 256;

/// How many slices an open-file limit of `limit` holds (two descriptors each), at least one.
fn slices_within(limit: u64) -> usize {
    (limit.saturating_sub(FD_RESERVE) / 2).max(1) as usize
}

/// Why the daemon could not start or keep running. The agent's exit code follows the variant
/// ([`DaemonError::exit_code`]), never the message.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The process could not be set up: a signal handler, the runtime, a thread.
    #[error("{what}: {source}")]
    Process { what: &'static str, source: std::io::Error },
    /// The state a last run left could not be recovered, or the state directory prepared.
    #[error("{0}")]
    State(String),
    /// The metrics endpoint could not be served.
    #[error("cannot listen on {addr} for metrics: {source}")]
    Listen { addr: String, source: std::io::Error },
    /// The metrics endpoint's TLS could not be set up.
    #[error(transparent)]
    MetricsTls(#[from] crate::metrics::MetricsTlsError),
    /// The metrics endpoint's bearer token could not be read.
    #[error(transparent)]
    MetricsToken(#[from] crate::report::TokenError),
    /// NVML could not be opened, or the GPUs read.
    #[error("NVML: {0}")]
    Nvml(#[from] discovery::DiscoveryError),
    /// The API socket could not be bound.
    #[error(transparent)]
    Socket(#[from] crate::sockets::BindError),
    /// The configuration cannot work with this node or its scheduler (exit code 2, as a bad
    /// configuration).
    #[error("{0}")]
    Refused(String),
    /// A task the daemon waited on panicked.
    #[error("internal: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl DaemonError {
    /// The agent binary's exit code: 3 when NVML is unavailable, 2 when refused, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Nvml(_) => 3,
            DaemonError::Refused(_) => 2,
            _ => 1,
        }
    }
}

pub fn run(mut cfg: Config) -> Result<u64, DaemonError> {
    // Past a file-size limit (ulimit -f), writes fail with EFBIG like on a full disk, instead of the
    // signal killing the agent.
    // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    // Every container's region is mapped here, and a container can truncate its own: a SIGBUS in
    // one of those mappings turns it into zeros instead of killing the agent.
    vgpu_region::shrink::enable()
        .map_err(|source| DaemonError::Process { what: "cannot install the SIGBUS guard", source })?;
    cfg.max_slices = fit_fd_limit(cfg.max_slices);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(4)
        .build()
        .map_err(|source| DaemonError::Process { what: "cannot start the runtime", source })?;
    rt.block_on(run_async(cfg))
}

/// The agent's state as the last run left it: the state directory, the slice store (repaired),
/// `libvgpu.so` installed for containers, the preload template, and what the features recorded
/// (drained GPUs, MIG devices and admin claims given out).
fn recover(cfg: &Config) -> Result<Arc<Agent>, DaemonError> {
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|e| DaemonError::State(format!("cannot create {}: {e}", cfg.state_dir.display())))?;
    // The state directory holds the limits: only the agent writes there.
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o755));
    let store = SliceStore::open(&cfg.state_dir)
        .map_err(|e| DaemonError::State(e.to_string()))?
        .with_oversubscribe(cfg.memory_scaling > 1.0)
        .with_priority_queue_ns(cfg.priority_queue_us * 1000)
        .with_priority_min_share(cfg.priority_min_share)
        .with_max_slices(cfg.max_slices);
    for repair in store.recover() {
        tracing::warn!(%repair, "slice store repaired at start");
    }
    for p in crate::slices::remove_temporaries(&cfg.state_dir.join("lib")) {
        tracing::warn!(file = %p.display(), "removed a library install cut short");
    }
    let library = if cfg.library.exists() {
        let l = install_library(&cfg.library, &cfg.state_dir.join("lib"), VERSION)
            .map_err(|e| DaemonError::State(e.to_string()))?;
        tracing::info!(library = %l.display(), "libvgpu.so installed for containers");
        Some(l)
    } else {
        tracing::warn!(library = %cfg.library.display(), "libvgpu.so not found: slices get no library mount");
        None
    };
    // The template a container's /etc/ld.so.preload is mounted from.
    let tpl = cfg.state_dir.join("ld.so.preload");
    let line = format!("{}/libvgpu.so\n", crate::slices::CONTAINER_DIR);
    if std::fs::read_to_string(&tpl).ok().as_deref() != Some(line.as_str()) {
        let tmp = tpl.with_extension("tmp");
        std::fs::write(&tmp, &line)
            .and_then(|_| std::fs::rename(&tmp, &tpl))
            .map_err(|e| DaemonError::State(format!("cannot write {}: {e}", tpl.display())))?;
    }
    let agent = Arc::new(Agent::new(cfg.clone(), store, library).map_err(|e| DaemonError::State(e.to_string()))?);
    *agent.drained.write() = crate::capacity::load_drained(&agent.cfg.state_dir);
    crate::dra::refresh_mig_holders(&agent);
    crate::k8s::refresh_mig_holders(&agent);
    crate::dra::refresh_admitted(&agent);
    agent.prune_libraries();
    agent.reconcile_cdi();
    tracing::info!(slices = agent.slices().len(), state_dir = %cfg.state_dir.display(), "recovered slices");
    Ok(agent)
}

/// Serves `/metrics` and `/healthz` where the configuration asks for them.
async fn serve_metrics(cfg: &Config, agent: &Arc<Agent>) -> Result<Option<tokio::task::JoinHandle<()>>, DaemonError> {
    Ok(match cfg.metrics_address {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| DaemonError::Listen { addr: addr.to_string(), source })?;
            let bound = l.local_addr().map_err(|source| DaemonError::Listen { addr: addr.to_string(), source })?;
            *agent.metrics_address.write() = Some(bound);
            tracing::info!(address = %bound, "serving metrics");
            let tls = crate::metrics::acceptor(cfg)?;
            let token = match &cfg.metrics_token_file {
                Some(p) => {
                    crate::report::read_token(p)?;
                    Some(crate::metrics::rotate::Token::new(p).map_err(DaemonError::State)?)
                }
                None => None,
            };
            Some(tokio::spawn(crate::metrics::serve(l, agent.clone(), tls, token)))
        }
        None => None,
    })
}

async fn run_async(cfg: Config) -> Result<u64, DaemonError> {
    let agent = recover(&cfg)?;
    let reporter_state = Arc::new(crate::report::ReporterState::default());

    let listener = crate::sockets::bind(&cfg.socket)?;
    let _socket = crate::sockets::SocketFile(cfg.socket.clone());
    tracing::info!(socket = %cfg.socket.display(), "serving the API");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut srx = stop_rx.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(crate::api::server(agent.clone(), reporter_state.clone()))
            .serve_with_incoming_shutdown(crate::sockets::incoming(listener), async move {
                let _ = srx.wait_for(|s| *s).await;
            }),
    );
    let metrics = serve_metrics(&cfg, &agent).await?;

    // systemd's notifications (Type=notify units): ready after the first pass, the watchdog.
    let notify = tokio::spawn(crate::notify::run(agent.clone(), stop_rx.clone()));
    // The device plugin serves before the slow work too (its device list follows the first pass);
    // in Volcano mode only once the memory units are known to be right (see below): a list the
    // kubelet cannot take must never reach it.
    let kube_cell = crate::k8s::KubeCell::default();
    let start_plugin = || {
        cfg.device_plugin
            .then(|| tokio::spawn(crate::deviceplugin::run(agent.clone(), kube_cell.clone(), stop_rx.clone())))
    };
    let volcano = cfg.compat == crate::config::Compat::Volcano;
    let mut plugin = if volcano { None } else { start_plugin() };

    // NVML is synchronous: discovery, XID events and passes run on threads of their own.
    let stop = Arc::new(AtomicBool::new(false));
    let nvml = {
        let lib = cfg.nvml_library.clone();
        tokio::task::spawn_blocking(move || discovery::open(lib.as_deref())).await??
    };
    let nvml = Arc::new(nvml);
    let _ = agent.nvml.set(nvml.clone());
    // Recorded MIG layouts that no longer hold (a reboot, an interrupted apply) come back first.
    {
        let (n, a) = (nvml.clone(), agent.clone());
        tokio::task::spawn_blocking(move || {
            crate::mig::reconcile(n, &a.mig.lock(), a.mig_holders().into_keys().collect())
        })
        .await?;
    }
    let inv = discovery::discover(&nvml)?;
    for g in &inv.gpus {
        tracing::info!(gpu = %g.uuid, index = g.index, name = %g.name, memory = g.memory_total, "discovered GPU");
    }
    *agent.inventory.write() = inv;
    // Volcano mode: a pod's volcano.sh/vgpu-memory must mean here what it means to the scheduler.
    if let Some(why) = crate::deviceplugin::volcano_memory_refusal(&agent) {
        tracing::error!("{why}");
        crate::events::post_node_warning(&cfg, "VolcanoMemoryUnits", &why).await;
        return Err(DaemonError::Refused(why));
    }
    let mps = start_mps(&agent, &stop)?;
    if volcano {
        plugin = start_plugin();
    }
    // The DRA driver after discovery: its ResourceSlice lists the GPUs.
    let dra = cfg.dra.clone().map(|driver| tokio::spawn(crate::dra::run(agent.clone(), driver, stop_rx.clone())));
    let events = cfg.pod_events.then(|| tokio::spawn(crate::events::run(agent.clone(), stop_rx.clone())));
    let xids = {
        let (n, h, s) = (nvml.clone(), agent.health.clone(), stop.clone());
        std::thread::Builder::new().name("xid-events".into()).spawn(move || crate::health::watch_xids(n, h, s))
    }
    .map_err(|source| DaemonError::Process { what: "cannot start the XID thread", source })?;
    let monitor = {
        let (n, a, s) = (nvml.clone(), agent.clone(), stop.clone());
        std::thread::Builder::new().name("monitor".into()).spawn(move || monitor_loop(&n, &a, &s))
    }
    .map_err(|source| DaemonError::Process { what: "cannot start the monitoring thread", source })?;
    // Capacity reporting to the central scheduler (when configured): after discovery, so that the
    // first snapshot has the GPUs.
    let report_stop = Arc::new(tokio::sync::Notify::new());
    let reporter = cfg.scheduler.clone().map(|rc| {
        tracing::info!(endpoint = %rc.endpoint, node = %rc.node, "reporting capacity to the scheduler");
        tokio::spawn(crate::report::run(rc, agent.clone(), reporter_state.clone(), report_stop.clone()))
    });
    let proto = match cfg.compat {
        crate::config::Compat::Hami => Some(&crate::hami::HAMI),
        crate::config::Compat::Volcano => Some(&crate::hami::VOLCANO),
        crate::config::Compat::Replicas => None,
    };
    if agent.cfg.hami_node_entry {
        tracing::info!(
            node = %agent.cfg.node_name,
            split_count = agent.cfg.split_count,
            memory_scaling = agent.cfg.memory_scaling,
            "HAMi's node configuration has an entry for this node"
        );
    }
    if let Some((i, names)) = &agent.cfg.node_section {
        tracing::info!(
            node = %agent.cfg.node_name,
            section = i,
            names = %names.join(", "),
            split_count = agent.cfg.split_count,
            memory_scaling = agent.cfg.memory_scaling,
            "a [[node]] section of the configuration applies"
        );
    }
    // Where the agent disagrees with the scheduler's device configuration (mig_geometries_file):
    // logged, and a warning in the status for as long as it runs.
    if let (Some(_), Some(s)) = (proto, &agent.cfg.scheduler_settings) {
        let m = crate::deviceplugin::settings_mismatches(s, &agent.cfg);
        for (_, t) in &m {
            tracing::warn!("the scheduler's device configuration: {t}");
        }
        let all = crate::deviceplugin::mismatches_text(&m);
        agent.warn("scheduler-config", (!m.is_empty()).then(|| format!("the scheduler's device configuration: {all}")));
    }
    let kube = proto.map(|proto| {
        let (a, stop, cell) = (agent.clone(), stop_rx.clone(), kube_cell.clone());
        tokio::spawn(async move {
            match crate::k8s::Kube::connect(a.cfg.kube_api.as_deref(), &a.cfg.node_name, proto).await {
                Ok(k) => {
                    let k = Arc::new(k);
                    let _ = cell.set(k.clone());
                    tracing::info!(node = %a.cfg.node_name, protocol = proto.name, "connected to the Kubernetes API");
                    crate::k8s::run(a.clone(), k, a.cfg.hami_text_register, stop).await;
                }
                Err(e) => tracing::error!(error = %e, "no Kubernetes API: Allocate will fail until the agent restarts with one"),
            }
        })
    });

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|source| DaemonError::Process { what: "cannot handle SIGTERM", source })?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|source| DaemonError::Process { what: "cannot handle SIGINT", source })?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down");
    stop.store(true, SeqCst);
    let _ = stop_tx.send(true);
    if let Some(m) = metrics {
        m.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    report_stop.notify_one();
    for t in [plugin, kube, reporter, dra, events, Some(notify)].into_iter().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    let _ = std::fs::remove_file(&cfg.socket);
    let passes = tokio::task::spawn_blocking(move || {
        let _ = xids.join();
        let _ = mps.map(std::thread::JoinHandle::join);
        monitor.join().unwrap_or(0)
    })
    .await
    .unwrap_or(0);
    tracing::info!(passes, "stopped");
    Ok(passes)
}

/// MPS: the slices on its GPUs follow (their files' flag, their injection) before any container is
/// given one; then the supervisor of a daemon per GPU, where any GPU runs MPS.
fn start_mps(agent: &Arc<Agent>, stop: &Arc<AtomicBool>) -> Result<Option<std::thread::JoinHandle<()>>, DaemonError> {
    let gpus = crate::mps::gpus(agent);
    agent.store.set_mps(gpus.clone());
    for (slice, what) in agent.store.check() {
        tracing::info!(slice = %slice, %what, "slice files follow the MPS configuration");
    }
    if gpus.is_empty() {
        return Ok(None);
    }
    tracing::info!(gpus = ?gpus.keys().collect::<Vec<_>>(), "MPS on");
    let (a, s) = (agent.clone(), stop.clone());
    std::thread::Builder::new()
        .name("mps".into())
        .spawn(move || crate::mps::supervise(&a, &s))
        .map(Some)
        .map_err(|source| DaemonError::Process { what: "cannot start the MPS supervisor", source })
}

fn monitor_loop(nvml: &nvml_wrapper::Nvml, agent: &Agent, stop: &AtomicBool) -> u64 {
    let period = Duration::from_millis(agent.cfg.monitor_interval_ms);
    let mut m = Monitor::new(agent.cfg.escape_action)
        .with_true_up(agent.cfg.memory_true_up)
        .with_interval(agent.cfg.monitor_interval_ms);
    let mut passes = 0;
    let mut refreshed = Instant::now();
    while !stop.load(Relaxed) {
        let t = Instant::now();
        if refreshed.elapsed() >= INVENTORY_REFRESH {
            refreshed = t;
            match discovery::discover(nvml) {
                Ok(inv) => *agent.inventory.write() = inv,
                Err(e) => tracing::warn!(error = %e, "inventory refresh failed"),
            }
            agent.prune_libraries();
        }
        let slices = agent.slices();
        m.set_admitted(agent.admitted.read().clone());
        let pass = m.pass(nvml, &agent.store, &slices);
        agent.publish(pass, t.elapsed().as_micros() as u64);
        passes += 1;
        let spent = t.elapsed();
        if spent < period {
            agent.sleep(period - spent);
        }
    }
    passes
}

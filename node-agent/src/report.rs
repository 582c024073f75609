//! Capacity reporting to the central scheduler (`vgpu.scheduler.v1`): the node connects out, sends a
//! Hello and a full snapshot, then deltas (the GPUs that changed, each message with the next sequence
//! number) and heartbeats, and serves the scheduler's requests on the same stream.
//!
//! Nothing is queued while disconnected: the reporter keeps only what it last sent, and after a
//! reconnect it sends the whole state again, so changes made meanwhile are coalesced into one
//! snapshot and memory stays bounded. Reconnects back off exponentially with full jitter (a random
//! wait between 0 and the current back-off), so that a thousand nodes losing one receiver do not
//! come back at the same instant.
//!
//! The reporter is generic over its [`Source`]: the agent is one, the scale benchmark's synthetic
//! nodes are others.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};
use vgpu_proto::scheduler::v1 as sp;

pub const PROTOCOL_VERSION: u32 = 1;

pub use crate::config::scheduler::{Endpoint, EndpointError, ReportConfig};

/// What the reporter reports and serves.
pub trait Source: Send + Sync + 'static {
    /// The node's capacity now (node, epoch, sequence and timestamp are filled in by the reporter).
    fn capacity(&self) -> sp::NodeCapacity;
    /// Notified (`notify_one`) whenever the capacity may have changed.
    fn changed(&self) -> &Notify;
    /// Serves one request (runs on a blocking thread).
    fn handle(&self, req: &sp::NodeRequest) -> sp::RequestResult;
}

/// The connection's state, for status displays and tests.
#[derive(Default)]
pub struct ReporterState {
    pub connected: AtomicBool,
    /// Connections made (the first one included).
    pub connections: AtomicU64,
    pub attempts: AtomicU64,
    pub last_error: Mutex<String>,
    /// The last sequence number sent.
    pub sequence: AtomicU64,
}

/// The bearer token in a file (its one line, trimmed; `#` lines are comments); None when the file
/// holds nothing.
pub fn read_token(p: &Path) -> Result<Option<String>, TokenError> {
    let t = std::fs::read_to_string(p).map_err(|source| TokenError::Read { path: p.to_owned(), source })?;
    let mut lines = t.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
    let token = lines.next();
    if lines.next().is_some() || token.is_some_and(|t| t.contains(char::is_whitespace)) {
        return Err(TokenError::Form(p.to_owned()));
    }
    Ok(token.map(str::to_string))
}

/// Why a bearer token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {}: {source}", path.display())]
    Read { path: std::path::PathBuf, source: std::io::Error },
    #[error(
        "the token file {} must hold one token on one line (a receiver's token file, with roles, is not a client's)",
        .0.display()
    )]
    Form(std::path::PathBuf),
}

/// Why the scheduler could not be reached, or a session with it ended.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot connect to {endpoint}{}", causes(.source))]
    Connect { endpoint: String, source: tonic::transport::Error },
    #[error("{0}: a CA file is needed for https")]
    NoCa(String),
    #[error("cannot read the CA file {}: {source}", path.display())]
    ReadCa { path: std::path::PathBuf, source: std::io::Error },
    #[error("cannot read the client {what} {}: {source}", path.display())]
    ReadIdentity { what: &'static str, path: std::path::PathBuf, source: std::io::Error },
    #[error("{endpoint}: {source}")]
    Endpoint { endpoint: String, source: tonic::transport::Error },
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("{0}: a bearer token is needed for https (scheduler_token_file)")]
    NoToken(String),
    #[error("the token holds characters not allowed in a header")]
    TokenNotAHeader,
    /// The scheduler answered with an error status (with a hint where it looks like a TLS
    /// handshake refused for want of a client certificate).
    #[error("{endpoint}: {text}{hint}")]
    Refused { endpoint: String, text: String, hint: &'static str },
    #[error("{0}: no Welcome within 10 s")]
    NoWelcome(String),
    #[error("{0}: the stream ended before a Welcome")]
    EndedBeforeWelcome(String),
    #[error("{0}: the first message was not a Welcome")]
    NotWelcome(String),
    #[error("the stream closed")]
    Closed,
}

/// ": cause" of a transport error (empty when it has none).
fn causes(e: &tonic::transport::Error) -> String {
    std::error::Error::source(e).map_or(String::new(), |s| format!(": {s}"))
}

/// A channel to `endpoint` (TLS with `ca` for https).
pub async fn channel(
    endpoint: &Endpoint,
    ca: Option<&Path>,
    server_name: Option<&str>,
) -> Result<tonic::transport::Channel, ReportError> {
    channel_with(endpoint, ca, server_name, None).await
}

/// A channel to `endpoint` (TLS with `ca` for https), presenting the client certificate and key in
/// `identity` (PEM files) where given.
pub async fn channel_with(
    endpoint: &Endpoint,
    ca: Option<&Path>,
    server_name: Option<&str>,
    identity: Option<(&Path, &Path)>,
) -> Result<tonic::transport::Channel, ReportError> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint as E, Identity};
    let cause = |source| ReportError::Connect { endpoint: endpoint.to_string(), source };
    let bad = |source| ReportError::Endpoint { endpoint: endpoint.to_string(), source };
    match endpoint {
        Endpoint::Unix(p) => crate::sockets::unix_channel(p).await.map_err(cause),
        Endpoint::Https { uri, host } => {
            let ca = ca.ok_or_else(|| ReportError::NoCa(endpoint.to_string()))?;
            let pem = std::fs::read(ca).map_err(|source| ReportError::ReadCa { path: ca.to_owned(), source })?;
            let mut tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(pem))
                .domain_name(server_name.unwrap_or(host).to_string());
            if let Some((cert, key)) = identity {
                let read = |p: &Path, what: &'static str| {
                    std::fs::read(p).map_err(|source| ReportError::ReadIdentity { what, path: p.to_owned(), source })
                };
                tls = tls.identity(Identity::from_pem(read(cert, "certificate")?, read(key, "key")?));
            }
            E::from_shared(uri.clone())
                .map_err(bad)?
                .tls_config(tls)
                .map_err(bad)?
                .connect_timeout(Duration::from_secs(10))
                .http2_keep_alive_interval(Duration::from_secs(30))
                .keep_alive_timeout(Duration::from_secs(10))
                .connect()
                .await
                .map_err(cause)
        }
    }
}

/// A small xorshift generator for the jitter (seeded per reporter).
struct Jitter(u64);

impl Jitter {
    fn new(seed: u64) -> Jitter {
        Jitter(seed | 1)
    }
    /// Uniform in [0, d].
    fn upto(&mut self, d: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        d.mul_f64((self.0 >> 11) as f64 / (1u64 << 53) as f64)
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A new epoch: the time in microseconds, which a restarted agent never repeats.
pub fn new_epoch() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64)
}

/// The GPUs of `now` that differ from `last`, and those gone; None when node-level fields changed
/// (a snapshot is sent instead).
pub fn diff(last: &sp::NodeCapacity, now: &sp::NodeCapacity) -> Option<(Vec<sp::GpuCapacity>, Vec<String>)> {
    if last.driver_version != now.driver_version || last.cuda_version != now.cuda_version {
        return None;
    }
    let changed = now.gpus.iter().filter(|g| last.gpus.iter().find(|l| l.uuid == g.uuid) != Some(g)).cloned().collect();
    let removed =
        last.gpus.iter().filter(|l| !now.gpus.iter().any(|g| g.uuid == l.uuid)).map(|l| l.uuid.clone()).collect();
    Some((changed, removed))
}

/// Recent request results by id (a retried request gets its first answer).
struct Answered(VecDeque<sp::RequestResult>);

const ANSWERED: usize = 256;

/// Runs the reporter until `stop` is notified.
pub async fn run<S: Source>(cfg: ReportConfig, src: Arc<S>, state: Arc<ReporterState>, stop: Arc<Notify>) {
    let epoch = new_epoch();
    // Seeded by time, process and node name, so that nodes (or reporters of one process) started at
    // the same instant still draw different waits.
    let name = crate::slices::fnv1a(cfg.node.bytes());
    let mut jitter = Jitter::new(epoch ^ ((std::process::id() as u64) << 32) ^ name);
    let mut backoff = cfg.backoff_initial;
    let answered = Arc::new(Mutex::new(Answered(VecDeque::new())));
    loop {
        state.attempts.fetch_add(1, Relaxed);
        let started = Instant::now();
        let r = tokio::select! {
            r = session(&cfg, &src, &state, epoch, &answered) => r,
            _ = stop.notified() => return,
        };
        state.connected.store(false, Release);
        match r {
            Ok(()) => tracing::warn!(endpoint = %cfg.endpoint, "the scheduler closed the capacity stream"),
            Err(e) => {
                tracing::warn!(endpoint = %cfg.endpoint, error = %e, "capacity reporting: not connected");
                *state.last_error.lock() = e.to_string();
            }
        }
        // A connection that lasted starts the back-off over.
        if started.elapsed() > cfg.backoff_max {
            backoff = cfg.backoff_initial;
        }
        let wait = jitter.upto(backoff);
        backoff = (backoff * 2).min(cfg.backoff_max);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.notified() => return,
        }
    }
}

fn msg(body: sp::node_message::Body) -> sp::NodeMessage {
    sp::NodeMessage { body: Some(body) }
}

/// Connects to the scheduler, says Hello and waits for its Welcome: the sending side of the
/// stream, the scheduler's messages and the heartbeat interval it asked for.
async fn connect(
    cfg: &ReportConfig,
    epoch: u64,
) -> Result<(mpsc::Sender<sp::NodeMessage>, tonic::Streaming<sp::SchedulerMessage>, Duration), ReportError> {
    let identity = cfg.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let ch = channel_with(&cfg.endpoint, cfg.ca.as_deref(), cfg.server_name.as_deref(), identity).await?;
    let token = match &cfg.token_file {
        Some(p) => read_token(p)?,
        None => None,
    };
    if token.is_none() && matches!(cfg.endpoint, Endpoint::Https { .. }) {
        return Err(ReportError::NoToken(cfg.endpoint.to_string()));
    }
    let (tx, rx) = mpsc::channel::<sp::NodeMessage>(16);
    tx.send(msg(sp::node_message::Body::Hello(sp::Hello {
        protocol_version: PROTOCOL_VERSION,
        node: cfg.node.clone(),
        agent_version: crate::agent::VERSION.to_string(),
        epoch,
    })))
    .await
    .map_err(|_| ReportError::Closed)?;
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    if let Some(t) = token {
        let v = format!("Bearer {t}").parse().map_err(|_| ReportError::TokenNotAHeader)?;
        req.metadata_mut().insert("authorization", v);
    }
    let mut client = sp::capacity_client::CapacityClient::new(ch).max_decoding_message_size(16 << 20);
    // Before the Welcome, a connection the scheduler drops without a gRPC status (closed, reset, a
    // broken pipe, or the TLS alert itself, whichever the client sees first) is most often a TLS
    // handshake it refused for want of a client certificate (TLS 1.3 tells the client only then).
    let hint = |s: &tonic::Status| {
        let text = status_text(s);
        let refused = ["transport error", "CertificateRequired"].iter().any(|w| text.contains(w));
        let hint = if refused && cfg.identity.is_none() && matches!(cfg.endpoint, Endpoint::Https { .. }) {
            "; if the scheduler requires mutual TLS, set scheduler_client_cert and scheduler_client_key"
        } else {
            ""
        };
        ReportError::Refused { endpoint: cfg.endpoint.to_string(), text, hint }
    };
    let mut inbound = client.report(req).await.map_err(|s| hint(&s))?.into_inner();
    let welcome = match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
        Err(_) => return Err(ReportError::NoWelcome(cfg.endpoint.to_string())),
        Ok(Err(s)) => return Err(hint(&s)),
        Ok(Ok(None)) => return Err(ReportError::EndedBeforeWelcome(cfg.endpoint.to_string())),
        Ok(Ok(Some(m))) => match m.body {
            Some(sp::scheduler_message::Body::Welcome(w)) => w,
            _ => return Err(ReportError::NotWelcome(cfg.endpoint.to_string())),
        },
    };
    let heartbeat = match welcome.heartbeat_interval_ms {
        0 => cfg.heartbeat,
        ms => Duration::from_millis(ms as u64).max(Duration::from_millis(100)),
    };
    Ok((tx, inbound, heartbeat))
}

async fn session<S: Source>(
    cfg: &ReportConfig,
    src: &Arc<S>,
    state: &ReporterState,
    epoch: u64,
    answered: &Arc<Mutex<Answered>>,
) -> Result<(), ReportError> {
    let (tx, mut inbound, heartbeat) = connect(cfg, epoch).await?;
    state.connected.store(true, Release);
    state.connections.fetch_add(1, Relaxed);
    tracing::info!(endpoint = %cfg.endpoint, node = %cfg.node, "capacity reporting connected");

    let stamp = |mut c: sp::NodeCapacity, seq: u64| {
        c.node = cfg.node.clone();
        c.epoch = epoch;
        c.sequence = seq;
        c.timestamp_ms = now_ms();
        c
    };
    let send = |m: sp::NodeMessage| {
        let tx = tx.clone();
        async move { tx.send(m).await.map_err(|_| ReportError::Closed) }
    };
    let mut seq = state.sequence.load(Relaxed) + 1;
    let mut last = stamp(src.capacity(), seq);
    send(msg(sp::node_message::Body::Snapshot(last.clone()))).await?;
    state.sequence.store(seq, Relaxed);
    let (done_tx, mut done_rx) = mpsc::channel::<sp::RequestResult>(16);
    let mut hb = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    hb.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Sends what changed since `last` (a delta, or a snapshot when node-level fields changed).
    macro_rules! flush {
        () => {{
            let now = src.capacity();
            match diff(&last, &now) {
                Some((changed, removed)) if changed.is_empty() && removed.is_empty() => {}
                d => {
                    seq += 1;
                    let now = stamp(now, seq);
                    let body = match d {
                        Some((changed, removed)) => sp::node_message::Body::Delta(sp::CapacityDelta {
                            epoch,
                            sequence: seq,
                            timestamp_ms: now.timestamp_ms,
                            changed,
                            removed,
                        }),
                        None => sp::node_message::Body::Snapshot(now.clone()),
                    };
                    send(msg(body)).await?;
                    state.sequence.store(seq, Relaxed);
                    last = now;
                    hb.reset();
                }
            }
        }};
    }
    loop {
        tokio::select! {
            _ = src.changed().notified() => flush!(),
            _ = hb.tick() => {
                send(msg(sp::node_message::Body::Heartbeat(sp::Heartbeat { epoch, sequence: seq, timestamp_ms: now_ms() }))).await?;
            }
            Some(r) = done_rx.recv() => {
                // The change a request made is reported before its answer.
                flush!();
                send(msg(sp::node_message::Body::Result(r))).await?;
            }
            m = inbound.message() => match m {
                Ok(Some(m)) => match m.body {
                    Some(sp::scheduler_message::Body::Resync(r)) => {
                        tracing::info!(reason = %r.reason, "the scheduler asked for a full snapshot");
                        seq += 1;
                        last = stamp(src.capacity(), seq);
                        send(msg(sp::node_message::Body::Snapshot(last.clone()))).await?;
                        state.sequence.store(seq, Relaxed);
                    }
                    Some(sp::scheduler_message::Body::Request(r)) => {
                        let cached = answered.lock().0.iter().find(|a| !r.id.is_empty() && a.id == r.id).cloned();
                        if let Some(a) = cached {
                            send(msg(sp::node_message::Body::Result(a))).await?;
                            continue;
                        }
                        let (src, done, answered) = (src.clone(), done_tx.clone(), answered.clone());
                        tokio::spawn(async move {
                            let res = tokio::task::spawn_blocking(move || {
                                let mut a = src.handle(&r);
                                a.id = r.id.clone();
                                a
                            })
                            .await
                            .unwrap_or_else(|e| sp::RequestResult { ok: false, error: format!("internal error: {e}"), ..Default::default() });
                            {
                                let mut q = answered.lock();
                                if q.0.len() >= ANSWERED {
                                    q.0.pop_front();
                                }
                                q.0.push_back(res.clone());
                            }
                            let _ = done.send(res).await;
                        });
                    }
                    // A Welcome again, or a message kind this version does not know: ignored.
                    _ => {}
                },
                Ok(None) => return Ok(()),
                Err(s) => {
                    return Err(ReportError::Refused { endpoint: cfg.endpoint.to_string(), text: status_text(&s), hint: "" })
                }
            },
        }
    }
}

/// A status with its whole chain of causes (a refused TLS handshake shows only at the bottom).
pub fn status_text(s: &tonic::Status) -> String {
    let m = s.message();
    let mut causes: Vec<String> = Vec::new();
    let mut c = std::error::Error::source(s);
    while let Some(e) = c {
        let t = e.to_string();
        if causes.last() != Some(&t) && t != m {
            causes.push(t);
        }
        c = e.source();
    }
    let cause = if causes.is_empty() { String::new() } else { format!(" ({})", causes.join(": ")) };
    format!("{:?}{}{cause}", s.code(), if m.is_empty() { String::new() } else { format!(": {m}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(Endpoint::parse("unix:///run/s.sock").unwrap(), Endpoint::Unix("/run/s.sock".into()));
        assert_eq!(
            Endpoint::parse("https://sched.example:9400").unwrap(),
            Endpoint::Https { uri: "https://sched.example:9400".into(), host: "sched.example".into() }
        );
        assert_eq!(
            Endpoint::parse("https://[::1]:9400/x").unwrap(),
            Endpoint::Https { uri: "https://[::1]:9400".into(), host: "::1".into() }
        );
        let refused = |s: &str| Endpoint::parse(s).unwrap_err();
        assert!(matches!(refused("http://sched:9400"), EndpointError::PlainHttp(_)));
        assert!(refused("http://sched:9400").to_string().contains("plain http is not allowed"));
        assert!(matches!(refused("https://sched"), EndpointError::NoPort(_)));
        assert!(refused("https://sched").to_string().contains("host:port"));
        assert!(matches!(refused("unix://run/s.sock"), EndpointError::RelativePath(_)));
        assert!(refused("unix://run/s.sock").to_string().contains("absolute"));
        assert_eq!(refused("sched:9400"), EndpointError::Scheme("sched:9400".into()));
    }

    #[test]
    fn jitter_stays_within_its_window_and_spreads() {
        let mut j = Jitter::new(12345);
        let d = Duration::from_secs(2);
        let v: Vec<Duration> = (0..1000).map(|_| j.upto(d)).collect();
        assert!(v.iter().all(|x| *x <= d));
        let below_half = v.iter().filter(|x| **x < d / 2).count();
        assert!((400..600).contains(&below_half), "{below_half} of 1000 below half the window");
    }

    fn gpu(uuid: &str, mem: u64) -> sp::GpuCapacity {
        sp::GpuCapacity { uuid: uuid.into(), memory_allocatable: mem, ..Default::default() }
    }

    #[test]
    fn diffs_name_changed_added_and_removed_gpus() {
        let a = sp::NodeCapacity { gpus: vec![gpu("A", 1), gpu("B", 2), gpu("C", 3)], ..Default::default() };
        let b = sp::NodeCapacity { gpus: vec![gpu("A", 1), gpu("B", 5), gpu("D", 4)], ..Default::default() };
        let (changed, removed) = diff(&a, &b).unwrap();
        assert_eq!(changed, vec![gpu("B", 5), gpu("D", 4)]);
        assert_eq!(removed, vec!["C".to_string()]);
        assert_eq!(diff(&a, &a), Some((vec![], vec![])));
        let c = sp::NodeCapacity { driver_version: "x".into(), ..a.clone() };
        assert_eq!(diff(&a, &c), None, "node-level change: a snapshot");
    }

    #[test]
    fn a_token_file_holds_one_token() {
        let d = std::env::temp_dir().join(format!("vgpu-read-token-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let f = d.join("t");
        for (text, want) in [
            ("abc\n", Ok(Some("abc"))),
            ("# node n1\n\n  abc  \n\n", Ok(Some("abc"))),
            ("\n# nothing\n", Ok(None)),
            ("abc\ndef\n", Err("one token on one line")),
            ("node n1 abc\n", Err("one token on one line")),
        ] {
            std::fs::write(&f, text).unwrap();
            match (read_token(&f), want) {
                (Ok(got), Ok(w)) => assert_eq!(got.as_deref(), w, "{text:?}"),
                (Err(e), Err(w)) => {
                    assert!(matches!(e, TokenError::Form(_)) && e.to_string().contains(w), "{text:?}: {e}")
                }
                (got, w) => panic!("{text:?}: got {got:?}, wanted {w:?}"),
            }
        }
        let e = read_token(&d.join("missing")).unwrap_err();
        assert!(matches!(e, TokenError::Read { .. }) && e.to_string().contains("cannot read"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }
}

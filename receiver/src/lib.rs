//! vgpu's reference receiver of node capacity (`vgpu.scheduler.v1`): accepts the capacity streams of
//! many node agents, keeps the cluster view (each node's snapshot with its deltas applied in order),
//! sends nodes requests and routes their answers back, and publishes what it applied.
//!
//! A scheduler can embed it: build a [`Cluster`], serve [`Cluster::capacity_service`] (and
//! optionally [`Cluster::cluster_service`]), then read [`Cluster::view`], follow
//! [`Cluster::subscribe`], and call [`Cluster::request`]. Or use it as the pattern for its own.
//!
//! Robustness: every node has its own task and lock; a node that sends something malformed is told
//! (a Resync, or its stream ends with an error) and nobody else notices. A delta applies only on top
//! of the sequence before it; after a gap the receiver asks for a snapshot and applies nothing until
//! it comes.
#![deny(clippy::too_many_lines)]

pub mod auth;
pub mod certs;
pub mod metrics;

pub use auth::{Auth, Role, Tokens};

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};
use vgpu_proto::scheduler::v1 as sp;

pub const PROTOCOL_VERSION: u32 = 1;
/// Limits on what one node may send (anything larger is malformed).
const MAX_GPUS: usize = 256;
pub(crate) const MAX_NAME: usize = 253;
/// The largest message a node may send (a 256-GPU node with every peer listed fits).
pub const MAX_MESSAGE: usize = 4 << 20;
/// The most a node's applied state may take, encoded: what the receiver keeps per node is bounded
/// by this, however the node's messages are made up. With what the cluster view wraps around it
/// (at most [`VIEW_ENVELOPE`]) it stays within the 4 MiB every gRPC client reads by default, so the
/// page that carries the largest state a node may have is still readable: one node never makes the
/// view of the others fail.
pub const MAX_NODE_BYTES: usize = MAX_MESSAGE - VIEW_ENVELOPE;
/// What a page of the cluster view adds around one node's state, at most: the view's fields (agent
/// version up to 64 bytes, the peer's address, flags, times) and the page's (`next_after`, a node
/// name up to 253 bytes), with their tags and lengths.
const VIEW_ENVELOPE: usize = 4096;
/// A GPU's memory (64 TiB), SMs and slices at most: far above any GPU's, so that what a node reports
/// is a number a scheduler can add up.
const MAX_GPU_MEMORY: u64 = 64 << 40;
const MAX_SMS: u64 = 10_000;
const MAX_SLICES: u64 = 65_536;
/// Text fields (models, versions, reasons, profile names) and list lengths within a GPU.
const MAX_TEXT: usize = 256;
const MAX_UUID: usize = 96;
const MAX_MIG_ITEMS: usize = 64;
/// What one page of the cluster view holds at most, encoded (clients refuse messages over 4 MiB).
const PAGE_BYTES: usize = 1 << 20;
/// The default [`Settings::max_state_bytes`]: 10,000 nodes of 25 kB each, about 650 MiB held.
pub const DEFAULT_STATE_BYTES: usize = 256 << 20;

type Outbound = mpsc::Sender<Result<sp::SchedulerMessage, Status>>;

/// What to do after a message.
enum Step {
    Next,
    Answer(sp::SchedulerMessage),
    Reject(Status),
    Stop,
}

struct Node {
    capacity: sp::NodeCapacity,
    /// A snapshot of the current epoch arrived and every delta since applied in order.
    in_sync: bool,
    /// The stream currently serving this node (a newer one replaces it).
    session: u64,
    tx: Option<Outbound>,
    connected: bool,
    last_seen: Instant,
    agent_version: String,
    peer: String,
    pending: HashMap<String, oneshot::Sender<sp::RequestResult>>,
    /// The token that first streamed this node (each token may speak for a bounded number).
    token: String,
    /// `capacity`'s encoded size, counted in [`Cluster::held`].
    bytes: usize,
}

/// Counters (exported as Prometheus metrics).
#[derive(Default)]
pub struct Counters {
    pub streams: AtomicU64,
    pub snapshots: AtomicU64,
    pub deltas: AtomicU64,
    pub heartbeats: AtomicU64,
    pub results: AtomicU64,
    pub resyncs: AtomicU64,
    pub rejected_auth: AtomicU64,
    pub rejected_malformed: AtomicU64,
    pub requests_ok: AtomicU64,
    pub requests_failed: AtomicU64,
}

/// The receiver's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Accepted bearer tokens and their roles (none: no authentication, for Unix sockets only).
    pub auth: Arc<Auth>,
    /// The heartbeat period asked of nodes; a node silent for three is stale.
    pub heartbeat: Duration,
    /// A node's stream (other than over a Unix socket) must come with a client certificate that
    /// names the node (see [`certs::names`]); its token must allow it as well.
    pub node_certs: bool,
    /// A node disconnected for this long is forgotten (it leaves the view).
    pub forget_after: Duration,
    /// The most node names one token may stream (a `nodes` token is shared by a DaemonSet).
    pub max_nodes_per_token: usize,
    /// The most bytes of node state (encoded) the receiver holds, all nodes together; a state that
    /// would go beyond is refused. Held in memory, a state takes about 2.5 times its encoded size.
    pub max_state_bytes: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            auth: Arc::new(Auth::fixed(Tokens::default())),
            heartbeat: Duration::from_secs(10),
            node_certs: false,
            forget_after: Duration::from_secs(600),
            max_nodes_per_token: 10_000,
            max_state_bytes: DEFAULT_STATE_BYTES,
        }
    }
}

/// The cluster view and everything that changes it.
pub struct Cluster {
    nodes: RwLock<HashMap<String, Arc<Mutex<Node>>>>,
    /// The encoded bytes of every node's state together (at most `settings.max_state_bytes`).
    held: std::sync::atomic::AtomicUsize,
    events: broadcast::Sender<sp::ClusterEvent>,
    sessions: AtomicU64,
    pub settings: Settings,
    pub counters: Counters,
    pub started: Instant,
}

fn event(node: &str, kind: &str, c: &sp::NodeCapacity, gpus: Vec<String>) -> sp::ClusterEvent {
    sp::ClusterEvent { node: node.to_string(), kind: kind.to_string(), epoch: c.epoch, sequence: c.sequence, gpus }
}

/// Why a node's capacity is refused: one variant per rule it breaks.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    #[error("{field} has {len} bytes (at most {max})")]
    TooLong { field: &'static str, len: usize, max: usize },
    #[error("cuda_version {0} is negative")]
    NegativeCudaVersion(i32),
    #[error("{0} GPUs (at most {MAX_GPUS})")]
    TooManyGpus(usize),
    #[error("GPU {0} has no (or an oversized) uuid")]
    BadUuid(usize),
    #[error("GPU {0} listed twice")]
    ListedTwice(String),
    #[error("GPU {uuid}: {error}")]
    Gpu { uuid: String, error: Box<CapacityError> },
    #[error("memory_allocatable {allocatable} is above ten times memory_total {total}")]
    MemoryAboveTenfold { allocatable: u64, total: u64 },
    #[error("{field} {value} is above {max}, more than any GPU has")]
    Absurd { field: &'static str, value: u64, max: u64 },
    #[error("sm_allocatable {0} % is above 100")]
    SmAbove100(u32),
    #[error("numa_node {0} (-1 means unknown)")]
    BadNumaNode(i32),
    #[error("{0} peers (at most {MAX_GPUS})")]
    TooManyPeers(usize),
    #[error("more than {MAX_MIG_ITEMS} MIG instances or profiles")]
    TooManyMigItems,
    #[error("MIG profile {0}: more than {MAX_MIG_ITEMS} starts")]
    TooManyStarts(String),
    #[error("the node's state would take {0} bytes (at most {MAX_NODE_BYTES})")]
    TooLarge(usize),
    #[error("removes unknown GPU {0}")]
    RemovesUnknown(String),
}

fn text(field: &'static str, v: &str, max: usize) -> Result<(), CapacityError> {
    if v.len() > max {
        return Err(CapacityError::TooLong { field, len: v.len(), max });
    }
    Ok(())
}

/// What is wrong with a node's capacity, if anything: every list and string is bounded and every
/// number makes sense.
fn check_capacity(c: &sp::NodeCapacity) -> Result<(), CapacityError> {
    text("driver_version", &c.driver_version, 64)?;
    if c.cuda_version < 0 {
        return Err(CapacityError::NegativeCudaVersion(c.cuda_version));
    }
    check_gpus(&c.gpus)
}

fn check_gpus(gpus: &[sp::GpuCapacity]) -> Result<(), CapacityError> {
    if gpus.len() > MAX_GPUS {
        return Err(CapacityError::TooManyGpus(gpus.len()));
    }
    for (i, g) in gpus.iter().enumerate() {
        if g.uuid.is_empty() || g.uuid.len() > MAX_UUID {
            return Err(CapacityError::BadUuid(i));
        }
        if gpus[..i].iter().any(|o| o.uuid == g.uuid) {
            return Err(CapacityError::ListedTwice(g.uuid.clone()));
        }
        check_gpu(g).map_err(|e| CapacityError::Gpu { uuid: g.uuid.clone(), error: Box::new(e) })?;
    }
    Ok(())
}

fn check_gpu(g: &sp::GpuCapacity) -> Result<(), CapacityError> {
    text("model", &g.model, MAX_TEXT)?;
    text("health_reason", &g.health_reason, MAX_TEXT)?;
    text("pci_bus_id", &g.pci_bus_id, 32)?;
    // Numbers no GPU has: a bound far above today's (192 GB, 148 SMs) and the agent's slices.
    if g.memory_total > MAX_GPU_MEMORY {
        return Err(CapacityError::Absurd { field: "memory_total", value: g.memory_total, max: MAX_GPU_MEMORY });
    }
    if u64::from(g.sm_count) > MAX_SMS {
        return Err(CapacityError::Absurd { field: "sm_count", value: g.sm_count.into(), max: MAX_SMS });
    }
    if u64::from(g.slices) > MAX_SLICES {
        return Err(CapacityError::Absurd { field: "slices", value: g.slices.into(), max: MAX_SLICES });
    }
    // An agent may oversubscribe memory up to ten times (memory_scaling at most 10).
    if g.memory_allocatable > g.memory_total.saturating_mul(10) {
        return Err(CapacityError::MemoryAboveTenfold { allocatable: g.memory_allocatable, total: g.memory_total });
    }
    if g.sm_allocatable > 100 {
        return Err(CapacityError::SmAbove100(g.sm_allocatable));
    }
    if g.numa_node < -1 {
        return Err(CapacityError::BadNumaNode(g.numa_node));
    }
    if g.peers.len() > MAX_GPUS {
        return Err(CapacityError::TooManyPeers(g.peers.len()));
    }
    for p in &g.peers {
        text("a peer's uuid", &p.uuid, MAX_UUID)?;
        text("a peer's pcie", &p.pcie, 32)?;
    }
    if let Some(m) = &g.mig {
        if m.instances.len() > MAX_MIG_ITEMS || m.room.len() > MAX_MIG_ITEMS {
            return Err(CapacityError::TooManyMigItems);
        }
        for i in &m.instances {
            text("a MIG instance's profile", &i.profile, 64)?;
            text("a MIG instance's uuid", &i.uuid, MAX_UUID)?;
            text("a MIG instance's health_reason", &i.health_reason, MAX_TEXT)?;
        }
        for r in &m.room {
            text("a MIG profile's name", &r.profile, 64)?;
            if r.starts.len() > MAX_MIG_ITEMS {
                return Err(CapacityError::TooManyStarts(r.profile.clone()));
            }
        }
    }
    Ok(())
}

/// Returns the memory freed by forgotten nodes to the system (glibc's allocator keeps freed memory
/// in its arenas: the receiver stayed at 401 MiB after every node of 637 MiB aged out).
fn give_back_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it takes no
    // pointer and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A node's state within [`MAX_NODE_BYTES`].
fn check_size(c: &sp::NodeCapacity) -> Result<(), CapacityError> {
    let n = prost::Message::encoded_len(c);
    if n > MAX_NODE_BYTES {
        return Err(CapacityError::TooLarge(n));
    }
    Ok(())
}

impl Cluster {
    pub fn new(settings: Settings) -> Arc<Cluster> {
        Arc::new(Cluster {
            nodes: RwLock::new(HashMap::new()),
            held: Default::default(),
            events: broadcast::channel(8192).0,
            sessions: AtomicU64::new(0),
            settings,
            counters: Counters::default(),
            started: Instant::now(),
        })
    }

    /// The tonic service nodes connect to.
    pub fn capacity_service(self: &Arc<Self>) -> sp::capacity_server::CapacityServer<CapacitySvc> {
        sp::capacity_server::CapacityServer::new(CapacitySvc(self.clone())).max_decoding_message_size(MAX_MESSAGE)
    }

    /// The tonic service of the cluster view (`vgpuctl cluster status`), requests and events.
    pub fn cluster_service(self: &Arc<Self>) -> sp::cluster_server::ClusterServer<ClusterSvc> {
        sp::cluster_server::ClusterServer::new(ClusterSvc(self.clone()))
    }

    /// Applied changes as they happen (a slow reader loses the oldest and gets a "lagged" event).
    pub fn subscribe(&self) -> broadcast::Receiver<sp::ClusterEvent> {
        self.events.subscribe()
    }

    /// Every node (or one), as the receiver knows it now.
    pub fn view(&self, only: Option<&str>) -> sp::ClusterStatus {
        self.page(only, "", 0)
    }

    /// One page of the view: the nodes after `after` in name order, as many as fit in
    /// [`PAGE_BYTES`] (at least one) or `page_size` where that is fewer; `next_after` says where the
    /// next page starts.
    pub fn page(&self, only: Option<&str>, after: &str, page_size: u32) -> sp::ClusterStatus {
        self.forget_old();
        let stale_after = self.settings.heartbeat * 3;
        let mut names: Vec<(String, Arc<Mutex<Node>>)> = self
            .nodes
            .read()
            .iter()
            .filter(|(k, _)| only.is_none_or(|o| o == k.as_str()) && k.as_str() > after)
            .map(|(k, n)| (k.clone(), n.clone()))
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        let limit = if page_size == 0 { usize::MAX } else { page_size as usize };
        let (mut nodes, mut bytes, mut next_after) = (Vec::new(), 0usize, String::new());
        for (name, n) in names {
            let v = {
                let n = n.lock();
                let ago = n.last_seen.elapsed();
                sp::NodeView {
                    capacity: Some(n.capacity.clone()),
                    connected: n.connected,
                    last_seen_ms_ago: ago.as_millis() as u64,
                    stale: ago > stale_after,
                    agent_version: n.agent_version.clone(),
                    peer: n.peer.clone(),
                    synced: n.in_sync,
                }
            };
            let len = prost::Message::encoded_len(&v) + 8;
            if !nodes.is_empty() && (nodes.len() >= limit || bytes + len > PAGE_BYTES) {
                next_after = nodes
                    .last()
                    .and_then(|v: &sp::NodeView| v.capacity.as_ref())
                    .map(|c| c.node.clone())
                    .unwrap_or(name);
                break;
            }
            bytes += len;
            nodes.push(v);
        }
        sp::ClusterStatus { nodes, next_after }
    }

    /// Counts `bytes` as node `name`'s state in place of what it held, or refuses them where all
    /// nodes' states together would exceed `max_state_bytes`.
    fn hold(&self, name: &str, n: &mut Node, bytes: usize) -> Result<(), Status> {
        let max = self.settings.max_state_bytes;
        let was = n.bytes;
        self.held
            .fetch_update(Relaxed, Relaxed, |held| {
                let after = held - was + bytes;
                (after <= max || bytes <= was).then_some(after)
            })
            .map_err(|held| {
                Status::resource_exhausted(format!(
                    "node {name}'s state of {bytes} bytes is refused: the receiver holds {held} bytes of node                      state, and at most {max} (--max-state-mib {})",
                    max >> 20
                ))
            })?;
        n.bytes = bytes;
        Ok(())
    }

    /// The encoded bytes of node state held, all nodes together.
    pub fn held_bytes(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// Forgets the nodes disconnected for longer than `forget_after`.
    fn forget_old(&self) {
        let after = self.settings.forget_after;
        let old = |n: &Mutex<Node>| {
            let n = n.lock();
            !n.connected && n.last_seen.elapsed() > after
        };
        if !self.nodes.read().values().any(|n| old(n)) {
            return;
        }
        let mut nodes = self.nodes.write();
        nodes.retain(|name, n| {
            let forget = old(n);
            if forget {
                tracing::info!(node = %name, after_s = after.as_secs(), "node forgotten: disconnected too long");
                let mut n = n.lock();
                let _ = self.events.send(event(name, "forgotten", &n.capacity, vec![]));
                self.held.fetch_sub(std::mem::take(&mut n.bytes), Relaxed);
            }
            !forget
        });
        drop(nodes);
        give_back_memory();
    }

    /// (connected, known) node counts.
    pub fn counts(&self) -> (usize, usize) {
        self.forget_old();
        let nodes = self.nodes.read();
        (nodes.values().filter(|n| n.lock().connected).count(), nodes.len())
    }

    /// Sends `req` to `node` and waits for its answer.
    pub async fn request(
        &self,
        node: &str,
        mut req: sp::NodeRequest,
        timeout: Duration,
    ) -> Result<sp::RequestResult, Status> {
        if req.id.is_empty() {
            req.id = format!("r{}-{}", self.sessions.load(Relaxed), self.started.elapsed().as_nanos());
        }
        let (tx, rx) = oneshot::channel();
        let out = {
            let n = self.nodes.read().get(node).cloned().ok_or_else(|| Status::not_found(format!("no node {node}")))?;
            let mut n = n.lock();
            let out =
                n.tx.clone()
                    .filter(|_| n.connected)
                    .ok_or_else(|| Status::unavailable(format!("node {node} is not connected")))?;
            n.pending.insert(req.id.clone(), tx);
            out
        };
        let id = req.id.clone();
        // One deadline for all of it: a node that stops reading fills its queue, and the wait for
        // room there counts against the request's time as the wait for the answer does.
        let deadline = tokio::time::Instant::now() + timeout;
        let message = Ok(sp::SchedulerMessage { body: Some(sp::scheduler_message::Body::Request(req)) });
        let sent = match tokio::time::timeout_at(deadline, out.send(message)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Status::unavailable(format!("node {node} disconnected"))),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "node {node} did not take request {id} in time (it is not reading its stream)"
            ))),
        };
        let r = match sent {
            Err(e) => Err(e),
            Ok(()) => match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(_)) => Err(Status::unavailable(format!("node {node} disconnected before answering"))),
                Err(_) => Err(Status::deadline_exceeded(format!("node {node} did not answer request {id} in time"))),
            },
        };
        if let Some(n) = self.nodes.read().get(node) {
            n.lock().pending.remove(&id);
        }
        match &r {
            Ok(x) if x.ok => self.counters.requests_ok.fetch_add(1, Relaxed),
            _ => self.counters.requests_failed.fetch_add(1, Relaxed),
        };
        r
    }

    /// Applies one message of a node's stream (under the node's lock, never across an await).
    fn apply(&self, node: &Mutex<Node>, session: u64, hello: &sp::Hello, asked: &mut bool, m: sp::NodeMessage) -> Step {
        let resync = |reason: String| {
            Step::Answer(sp::SchedulerMessage {
                body: Some(sp::scheduler_message::Body::Resync(sp::Resync { reason })),
            })
        };
        let name = &hello.node;
        let mut n = node.lock();
        if n.session != session {
            return Step::Stop; // replaced by a newer stream
        }
        n.last_seen = Instant::now();
        match m.body {
            Some(sp::node_message::Body::Snapshot(c)) => {
                self.counters.snapshots.fetch_add(1, Relaxed);
                if let Err(e) = check_capacity(&c).and_then(|()| check_size(&c)) {
                    return Step::Reject(Status::invalid_argument(format!("malformed snapshot: {e}")));
                }
                if &c.node != name || c.epoch != hello.epoch {
                    return Step::Reject(Status::invalid_argument("malformed snapshot: of another node or epoch"));
                }
                if let Err(s) = self.hold(name, &mut n, prost::Message::encoded_len(&c)) {
                    return Step::Reject(s);
                }
                let gpus = c.gpus.iter().map(|g| g.uuid.clone()).collect();
                n.capacity = c;
                n.in_sync = true;
                *asked = false;
                let _ = self.events.send(event(name, "snapshot", &n.capacity, gpus));
                Step::Next
            }
            Some(sp::node_message::Body::Delta(d)) => {
                self.counters.deltas.fetch_add(1, Relaxed);
                // A sequence never wraps: after u64::MAX only a snapshot follows.
                let fits =
                    n.in_sync && d.epoch == n.capacity.epoch && n.capacity.sequence.checked_add(1) == Some(d.sequence);
                let valid = check_gpus(&d.changed).and_then(|_| {
                    if let Some(u) = d.removed.iter().find(|u| !n.capacity.gpus.iter().any(|g| &g.uuid == *u)) {
                        return Err(CapacityError::RemovesUnknown(u.clone()));
                    }
                    let added = d.changed.iter().filter(|g| !n.capacity.gpus.iter().any(|x| x.uuid == g.uuid)).count();
                    if n.capacity.gpus.len() + added > MAX_GPUS {
                        return Err(CapacityError::TooManyGpus(n.capacity.gpus.len() + added));
                    }
                    Ok(())
                });
                if fits && valid.is_ok() {
                    let mut gpus: Vec<String> = d.changed.iter().map(|g| g.uuid.clone()).collect();
                    let mut c = n.capacity.clone();
                    for g in d.changed {
                        match c.gpus.iter_mut().find(|x| x.uuid == g.uuid) {
                            Some(x) => *x = g,
                            None => c.gpus.push(g),
                        }
                    }
                    c.gpus.retain(|g| !d.removed.contains(&g.uuid));
                    c.gpus.sort_by_key(|g| g.index);
                    c.sequence = d.sequence;
                    c.timestamp_ms = d.timestamp_ms;
                    if let Err(e) = check_size(&c) {
                        return Step::Reject(Status::invalid_argument(format!("malformed delta: {e}")));
                    }
                    if let Err(s) = self.hold(name, &mut n, prost::Message::encoded_len(&c)) {
                        return Step::Reject(s);
                    }
                    n.capacity = c;
                    gpus.extend(d.removed);
                    let _ = self.events.send(event(name, "delta", &n.capacity, gpus));
                    return Step::Next;
                }
                n.in_sync = false;
                if *asked {
                    return Step::Next;
                }
                *asked = true;
                self.counters.resyncs.fetch_add(1, Relaxed);
                match valid {
                    Err(e) => resync(format!("delta {}: {e}", d.sequence)),
                    Ok(()) => resync(format!("delta {} does not follow {}", d.sequence, n.capacity.sequence)),
                }
            }
            Some(sp::node_message::Body::Heartbeat(h)) => {
                self.counters.heartbeats.fetch_add(1, Relaxed);
                if n.in_sync && (h.epoch != n.capacity.epoch || h.sequence != n.capacity.sequence) && !*asked {
                    n.in_sync = false;
                    *asked = true;
                    self.counters.resyncs.fetch_add(1, Relaxed);
                    return resync(format!("heartbeat at {} but {} applied", h.sequence, n.capacity.sequence));
                }
                Step::Next
            }
            Some(sp::node_message::Body::Result(r)) => {
                self.counters.results.fetch_add(1, Relaxed);
                if let Some(w) = n.pending.remove(&r.id) {
                    let _ = w.send(r);
                }
                Step::Next
            }
            Some(sp::node_message::Body::Hello(_)) => Step::Reject(Status::failed_precondition("a second Hello")),
            None => Step::Next, // a message kind this version does not know
        }
    }

    /// Makes (or takes over) the node's entry for a new stream; returns it and the session id.
    fn register(
        &self,
        hello: &sp::Hello,
        tx: Outbound,
        peer: String,
        token: &str,
    ) -> Result<(Arc<Mutex<Node>>, u64), Status> {
        self.forget_old();
        let name = hello.node.clone();
        let session = self.sessions.fetch_add(1, Relaxed) + 1;
        let mut nodes = self.nodes.write();
        if !nodes.contains_key(&name) && !token.is_empty() {
            let max = self.settings.max_nodes_per_token;
            let n = nodes.values().filter(|n| n.lock().token == token).count();
            if n >= max {
                return Err(Status::resource_exhausted(format!(
                    "this token already speaks for {n} nodes, the most the receiver allows one token \
                     (--max-nodes-per-token {max}); node {name} is refused"
                )));
            }
        }
        let node = nodes
            .entry(name.clone())
            .or_insert_with(|| {
                Arc::new(Mutex::new(Node {
                    capacity: sp::NodeCapacity { node: name.clone(), ..Default::default() },
                    in_sync: false,
                    session: 0,
                    tx: None,
                    connected: false,
                    last_seen: Instant::now(),
                    agent_version: String::new(),
                    peer: String::new(),
                    pending: HashMap::new(),
                    token: token.to_string(),
                    bytes: 0,
                }))
            })
            .clone();
        drop(nodes);
        {
            let mut n = node.lock();
            // A newer stream of the same node replaces the old one (its outbound side ends).
            n.session = session;
            n.tx = Some(tx);
            n.connected = true;
            n.last_seen = Instant::now();
            n.agent_version = hello.agent_version.clone();
            n.peer = peer;
            if n.capacity.epoch != hello.epoch {
                n.in_sync = false;
            }
            let _ = self.events.send(event(&name, "connected", &n.capacity, vec![]));
        }
        Ok((node, session))
    }

    /// Who sent `req`, if its token allows `need`.
    fn authorized<T>(&self, req: &Request<T>, need: Need) -> Result<Grant, Status> {
        let auth = &self.settings.auth;
        if auth.is_open() {
            return Ok(Grant { role: Role::Cluster, token: String::new(), generation: 0 });
        }
        let (tokens, generation) = auth.current();
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let Some((token, role)) = got.and_then(|t| tokens.role(t).map(|r| (t, r.clone()))) else {
            self.counters.rejected_auth.fetch_add(1, Relaxed);
            return Err(Status::unauthenticated("a valid bearer token is required"));
        };
        let allowed = matches!(
            (&role, need),
            (Role::Cluster, _) | (Role::Node(_) | Role::Nodes, Need::Stream) | (Role::Reader, Need::Read)
        );
        if !allowed {
            self.counters.rejected_auth.fetch_add(1, Relaxed);
            let what = match need {
                Need::Stream => "report a node's capacity",
                Need::Read => "read the cluster view",
                Need::Request => "send requests to nodes",
            };
            return Err(Status::permission_denied(format!("a {role} token may not {what}")));
        }
        Ok(Grant { role, token: token.to_string(), generation })
    }

    /// Whether a grant still holds (its token not revoked or changed role since it was given).
    fn still_valid(&self, g: &mut Grant) -> bool {
        if self.settings.auth.is_open() {
            return true;
        }
        let (tokens, generation) = self.settings.auth.current();
        if generation == g.generation {
            return true;
        }
        g.generation = generation;
        tokens.role(&g.token) == Some(&g.role)
    }

    /// Serves one node's stream until it ends.
    async fn serve_node(
        self: Arc<Self>,
        mut inbound: Streaming<sp::NodeMessage>,
        tx: Outbound,
        peer: Peer,
        mut grant: Grant,
    ) {
        let reject = |tx: &Outbound, s: Status| {
            self.counters.rejected_malformed.fetch_add(1, Relaxed);
            let tx = tx.clone();
            async move {
                let _ = tx.send(Err(s)).await;
            }
        };
        let hello = match tokio::time::timeout(Duration::from_secs(10), inbound.message()).await {
            Ok(Ok(Some(sp::NodeMessage { body: Some(sp::node_message::Body::Hello(h)) }))) => h,
            Ok(Ok(Some(_))) => {
                return reject(&tx, Status::failed_precondition("the first message must be a Hello")).await
            }
            Ok(Err(_)) | Ok(Ok(None)) => return,
            Err(_) => return reject(&tx, Status::deadline_exceeded("no Hello within 10 s")).await,
        };
        if hello.protocol_version != PROTOCOL_VERSION {
            let m = format!(
                "protocol version {} is not supported (this receiver speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            );
            return reject(&tx, Status::failed_precondition(m)).await;
        }
        let name = hello.node.clone();
        if !auth::valid_node(&name) {
            return reject(&tx, Status::invalid_argument("Hello.node must be a node name")).await;
        }
        if let Role::Node(n) = &grant.role {
            if *n != name {
                self.counters.rejected_auth.fetch_add(1, Relaxed);
                let _ =
                    tx.send(Err(Status::permission_denied(format!("this token is for node {n}, not {name}")))).await;
                return;
            }
        }
        if self.settings.node_certs && !peer.local && !peer.cert.as_ref().is_some_and(|c| certs::names(c, &name)) {
            self.counters.rejected_auth.fetch_add(1, Relaxed);
            let m =
                format!("the client certificate does not name node {name} (the receiver requires node certificates)");
            let _ = tx.send(Err(Status::permission_denied(m))).await;
            return;
        }
        if let Err(e) = auth::valid_text(&hello.agent_version, 64) {
            return reject(&tx, Status::invalid_argument(format!("Hello.agent_version: {e}"))).await;
        }
        let (node, session) = match self.register(&hello, tx.clone(), peer.addr, &grant.token) {
            Ok(x) => x,
            Err(s) => {
                self.counters.rejected_auth.fetch_add(1, Relaxed);
                let _ = tx.send(Err(s)).await;
                return;
            }
        };
        let welcome = sp::SchedulerMessage {
            body: Some(sp::scheduler_message::Body::Welcome(sp::Welcome {
                protocol_version: PROTOCOL_VERSION,
                heartbeat_interval_ms: self.settings.heartbeat.as_millis() as u32,
            })),
        };
        if tx.send(Ok(welcome)).await.is_err() {
            return;
        }
        // Whether a Resync is outstanding (sent, snapshot not yet come): one per gap.
        let mut asked = false;
        // A node silent for three heartbeats is cut off, and a revoked token ends the stream
        // within a second, whether or not the node sends anything.
        let silent_limit = self.settings.heartbeat * 3;
        let mut tick = tokio::time::interval(Duration::from_secs(1).min(self.settings.heartbeat));
        let mut heard = Instant::now();
        loop {
            let m = tokio::select! {
                m = inbound.message() => m,
                _ = tick.tick() => {
                    if !self.still_valid(&mut grant) {
                        self.counters.rejected_auth.fetch_add(1, Relaxed);
                        tracing::warn!(node = %name, "token revoked; stream ended");
                        let _ = tx.send(Err(Status::unauthenticated("the token was revoked"))).await;
                        break;
                    }
                    if heard.elapsed() > silent_limit {
                        tracing::warn!(node = %name, silent_ms = heard.elapsed().as_millis() as u64, "node silent for three heartbeats; stream ended");
                        let m = format!("no message for {} ms (three heartbeats)", heard.elapsed().as_millis());
                        let _ = tx.send(Err(Status::deadline_exceeded(m))).await;
                        break;
                    }
                    continue;
                }
            };
            let m = match m {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) if e.code() == tonic::Code::Cancelled => break,
                Err(e) => {
                    self.counters.rejected_malformed.fetch_add(1, Relaxed);
                    tracing::warn!(node = %name, error = %e, "node stream failed");
                    let _ = tx
                        .send(Err(Status::invalid_argument(format!("the stream could not be read: {}", e.message()))))
                        .await;
                    break;
                }
            };
            heard = Instant::now();
            if !self.still_valid(&mut grant) {
                self.counters.rejected_auth.fetch_add(1, Relaxed);
                tracing::warn!(node = %name, "token revoked; stream ended");
                let _ = tx.send(Err(Status::unauthenticated("the token was revoked"))).await;
                break;
            }
            match self.apply(&node, session, &hello, &mut asked, m) {
                Step::Next => {}
                Step::Answer(a) => {
                    if tx.send(Ok(a)).await.is_err() {
                        break;
                    }
                }
                Step::Reject(s) => {
                    tracing::warn!(node = %name, error = %s.message(), "malformed message; stream ended");
                    reject(&tx, s).await;
                    break;
                }
                Step::Stop => break,
            }
        }
        let mut n = node.lock();
        if n.session == session {
            n.connected = false;
            n.tx = None;
            n.pending.clear();
            let _ = self.events.send(event(&name, "disconnected", &n.capacity, vec![]));
        }
    }
}

/// What a call needs its token to allow.
#[derive(Clone, Copy)]
enum Need {
    Stream,
    Read,
    Request,
}

/// Where a node's stream comes from.
struct Peer {
    /// Its address ("local" over a Unix socket).
    addr: String,
    /// Over a Unix socket.
    local: bool,
    /// Its client certificate (TLS only).
    cert: Option<tonic::transport::CertificateDer<'static>>,
}

/// Who a call's token speaks for, and the token generation it was checked against.
struct Grant {
    role: Role,
    token: String,
    generation: u64,
}

/// The `Capacity` service.
pub struct CapacitySvc(Arc<Cluster>);

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl sp::capacity_server::Capacity for CapacitySvc {
    type ReportStream = Out<sp::SchedulerMessage>;

    async fn report(&self, req: Request<Streaming<sp::NodeMessage>>) -> Result<Response<Self::ReportStream>, Status> {
        self.0.counters.streams.fetch_add(1, Relaxed);
        let grant = self.0.authorized(&req, Need::Stream)?;
        let peer = Peer {
            addr: req.remote_addr().map(|a| a.to_string()).unwrap_or_else(|| "local".into()),
            local: req.extensions().get::<tonic::transport::server::UdsConnectInfo>().is_some(),
            cert: req.peer_certs().and_then(|c| c.first().cloned()),
        };
        let (tx, rx) = mpsc::channel(32);
        tokio::spawn(self.0.clone().serve_node(req.into_inner(), tx, peer, grant));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// The `Cluster` service.
pub struct ClusterSvc(Arc<Cluster>);

#[tonic::async_trait]
impl sp::cluster_server::Cluster for ClusterSvc {
    async fn status(&self, req: Request<sp::ClusterStatusRequest>) -> Result<Response<sp::ClusterStatus>, Status> {
        self.0.authorized(&req, Need::Read)?;
        let r = req.into_inner();
        Ok(Response::new(self.0.page((!r.node.is_empty()).then_some(r.node.as_str()), &r.after, r.page_size)))
    }

    async fn request(&self, req: Request<sp::ClusterRequest>) -> Result<Response<sp::RequestResult>, Status> {
        self.0.authorized(&req, Need::Request)?;
        let r = req.into_inner();
        let nr = r.request.ok_or_else(|| Status::invalid_argument("no request"))?;
        let t = if r.timeout_ms == 0 { Duration::from_secs(30) } else { Duration::from_millis(r.timeout_ms as u64) };
        Ok(Response::new(self.0.request(&r.node, nr, t).await?))
    }

    type WatchStream = Out<sp::ClusterEvent>;

    async fn watch(&self, req: Request<sp::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let mut grant = self.0.authorized(&req, Need::Read)?;
        let mut rx = self.0.subscribe();
        let cluster = self.0.clone();
        let (tx, out) = mpsc::channel(64);
        // A revoked token's watch ends within a second with UNAUTHENTICATED, events or not.
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                let e = tokio::select! {
                    e = rx.recv() => e,
                    _ = tick.tick() => {
                        if !cluster.still_valid(&mut grant) {
                            tracing::warn!("token revoked; watch ended");
                            let _ = tx.send(Err(Status::unauthenticated("the token was revoked"))).await;
                            return;
                        }
                        if tx.is_closed() {
                            return;
                        }
                        continue;
                    }
                };
                let e = match e {
                    Ok(e) => e,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        sp::ClusterEvent { kind: format!("lagged: {n}"), ..Default::default() }
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }
}

/// Entry points of the fuzz targets (`fuzz/`), also run over the stored corpora by the unit tests.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Length-delimited `NodeMessage`s as one node's stream (the first, if a Hello, introduces it):
    /// applied in order; every outcome is an answer, a refusal or nothing, never a panic.
    pub fn messages(data: &[u8]) {
        let mut buf = data;
        let mut msgs = Vec::new();
        while !buf.is_empty() && msgs.len() < 64 {
            match <sp::NodeMessage as prost::Message>::decode_length_delimited(&mut buf) {
                Ok(m) => msgs.push(m),
                Err(_) => break,
            }
        }
        let c = Cluster::new(Settings::default());
        let hello = match msgs.first().and_then(|m| m.body.clone()) {
            Some(sp::node_message::Body::Hello(h)) if !h.node.is_empty() => h,
            _ => sp::Hello {
                protocol_version: PROTOCOL_VERSION,
                node: "fuzz".into(),
                agent_version: String::new(),
                epoch: 7,
            },
        };
        let (tx, _rx) = mpsc::channel(1);
        let Ok((node, session)) = c.register(&hello, tx, "fuzz".into(), "") else { return };
        let mut asked = false;
        for m in msgs {
            if let Step::Reject(_) | Step::Stop = c.apply(&node, session, &hello, &mut asked, m) {
                break;
            }
        }
        let v = c.view(None);
        for n in &v.nodes {
            let cap = n.capacity.as_ref().expect("a capacity");
            assert!(check_capacity(cap).is_ok() || !n.synced, "an applied state is always well-formed");
        }
    }
}

#[cfg(test)]
mod tests;

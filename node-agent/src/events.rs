//! Kubernetes Events (`pod_events`, on by default where the agent reaches an API server), so that
//! `kubectl describe` shows what the node side did to a workload or found on the node:
//!
//! - **Refusals**: a container whose GPU allocation the quota refused sees only CUDA's
//!   out-of-memory error, which does not say that a quota, not the GPU, refused it. When a slice's
//!   refusals have grown, a Warning `GPUMemoryQuotaExceeded` on the slice's pod (labels
//!   `namespace`, `pod`, `container`, and `pod-uid` where known: HAMi, Volcano and replica modes)
//!   or on its DRA claim (`namespace`, `claim`, `claim-uid`): per GPU, the refusals since the last
//!   Event, the limit and the slice's peak use. At most one per slice in [`PER_SLICE`]; what is
//!   refused meanwhile goes in the next. Refusals from before the agent started are not reported
//!   again (an agent restart would repeat them).
//! - **Escapes** (each once, when the monitoring pass first sees it, with what was done): a slice
//!   over its limit as NVML measures it (`GPUMemoryOverQuota`) or a process of a slice on a GPU
//!   outside it (`GPUOutsideQuota`), on the slice's pod or claim; a process outside every slice on
//!   a GPU that slices use (`GPUProcessOutsideQuota`), on its pod where the agent could tell it
//!   (a pod with a slice), else on the Node.
//! - **Health**: a GPU that became unhealthy (`GPUUnhealthy`, with why) or healthy again
//!   (`GPUHealthy`, Normal), on the Node; likewise a MIG device of a GPU instance that a critical
//!   XID was about (`MIGDeviceUnhealthy`, `MIGDeviceHealthy`).
//!
//! The same Event again (same object and reason) within [`AGGREGATE`] of the last updates that
//! Event, as kubelet does: its `count` goes up, `lastTimestamp` and the message are the new one's
//! (`kubectl describe` shows "x3 over 5m"), so a container refused for an hour leaves one Event,
//! not sixty. An Event gone meanwhile (the API server keeps them an hour) is made anew.
//!
//! An Event the API server does not take is tried again next round; until one is taken, the
//! status carries a warning with the server's answer (a missing RBAC rule shows there).

use crate::agent::{Agent, Notice};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vgpu_proto::v1 as pb;

/// How often the slices' refusals are looked at.
const EVERY: Duration = Duration::from_secs(2);
/// The least time between two Events of one slice.
pub const PER_SLICE: Duration = Duration::from_secs(60);
/// How long after its last update an Event is updated rather than made anew when the same comes
/// again (kubelet's event correlator aggregates over ten minutes too).
pub const AGGREGATE: Duration = Duration::from_secs(600);
/// The Event's reason, as `kubectl describe` lists it.
pub const REASON: &str = "GPUMemoryQuotaExceeded";

/// The object a slice's Events are about (`involvedObject`), from its labels; None for a slice of
/// no pod or claim (made with `vgpuctl slice create`, or not yet tied to its pod).
pub fn subject(labels: &HashMap<String, String>) -> Option<Value> {
    let ns = labels.get("namespace")?;
    let uid = |k: &str| labels.get(k).cloned().unwrap_or_default();
    if let Some(pod) = labels.get("pod") {
        let mut o = json!({"kind": "Pod", "apiVersion": "v1", "namespace": ns, "name": pod, "uid": uid("pod-uid")});
        if let Some(c) = labels.get("container") {
            o["fieldPath"] = format!("spec.containers{{{c}}}").into();
        }
        return Some(o);
    }
    let claim = labels.get("claim")?;
    Some(json!({"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1", "namespace": ns, "name": claim,
        "uid": uid("claim-uid")}))
}

fn mib(b: u64) -> u64 {
    b >> 20
}

/// What has been reported of each slice's refusals, by slice and GPU, and when each slice last had
/// an Event.
#[derive(Default)]
pub struct Books {
    reported: HashMap<String, HashMap<String, u64>>,
    last: HashMap<String, Instant>,
}

impl Books {
    /// Books that take what the slices have refused so far as reported.
    pub fn seeded(st: &pb::NodeStatus) -> Books {
        let mut b = Books::default();
        for s in &st.slices {
            b.reported.insert(s.name.clone(), s.gpus.iter().map(|g| (g.uuid.clone(), g.oom_rejections)).collect());
        }
        b
    }

    /// The Events due at `now`, to be taken as reported once posted ([`Books::posted`]); slices
    /// that are gone are forgotten.
    pub fn due(&mut self, st: &pb::NodeStatus, now: Instant) -> Vec<Due> {
        self.reported.retain(|name, _| st.slices.iter().any(|s| &s.name == name));
        self.last.retain(|name, _| st.slices.iter().any(|s| &s.name == name));
        let mut out = Vec::new();
        for s in &st.slices {
            let Some(object) = subject(&s.labels) else { continue };
            let seen = self.reported.entry(s.name.clone()).or_default();
            let grown: Vec<(&pb::SliceGpuStatus, u64)> = s
                .gpus
                .iter()
                // (A count below what was reported: the slice was made again, its region anew.)
                .map(|g| {
                    (g, g.oom_rejections - seen.get(&g.uuid).copied().filter(|&n| n <= g.oom_rejections).unwrap_or(0))
                })
                .filter(|(_, n)| *n > 0)
                .collect();
            if grown.is_empty() || self.last.get(&s.name).is_some_and(|t| now.duration_since(*t) < PER_SLICE) {
                continue;
            }
            let parts: Vec<String> = grown
                .iter()
                .map(|(g, n)| {
                    format!(
                        "{n} GPU memory allocation{} refused on {} (quota {} MiB, peak use {} MiB)",
                        if *n == 1 { "" } else { "s" },
                        g.uuid,
                        mib(g.memory_limit),
                        mib(g.memory_peak)
                    )
                })
                .collect();
            let message = format!(
                "vgpu: {}: the container's GPU memory quota, not the GPU, refused {} (CUDA_ERROR_OUT_OF_MEMORY)",
                parts.join("; "),
                if grown.iter().map(|(_, n)| n).sum::<u64>() == 1 { "it" } else { "them" }
            );
            let counts = grown.iter().map(|(g, _)| (g.uuid.clone(), g.oom_rejections)).collect();
            out.push(Due { slice: s.name.clone(), object, message, counts });
        }
        out
    }

    /// Event `d` was posted at `now`: what it counted is reported.
    pub fn posted(&mut self, d: &Due, now: Instant) {
        let seen = self.reported.entry(d.slice.clone()).or_default();
        for (uuid, n) in &d.counts {
            seen.insert(uuid.clone(), *n);
        }
        self.last.insert(d.slice.clone(), now);
    }
}

/// A refusals Event due: the slice, the object it is about, the message, and the counts it
/// reports (by GPU).
#[derive(Debug)]
pub struct Due {
    pub slice: String,
    pub object: Value,
    pub message: String,
    counts: Vec<(String, u64)>,
}

/// The Node as an Event's `involvedObject` (its UID is its name, as kubelet's Events have it; `kubectl
/// describe node` looks for both). Its Events go in namespace `default`, as kubelet's do.
pub fn node_object(node: &str) -> Value {
    json!({"kind": "Node", "apiVersion": "v1", "name": node, "uid": node})
}

/// Events that cannot wait (escapes and health): the object, type, reason and message of a notice.
pub fn notice_event(n: &Notice, st: &pb::NodeStatus, node: &str) -> (Value, &'static str, &'static str, String) {
    match n {
        Notice::Escape(e) => {
            let subject =
                st.slices.iter().find(|s| !e.slice.is_empty() && s.name == e.slice).and_then(|s| subject(&s.labels));
            let action = if e.action == "killed" { format!("process {} killed", e.pid) } else { e.action.clone() };
            if e.kind == pb::escape::Kind::Bypass as i32 {
                let m = format!(
                    "vgpu: the container uses {} % of {} as NVML measures it, where its launches through libvgpu.so account for {} %: a process skips the interposer (busiest: {}{}) ({action})",
                    e.measured,
                    e.gpu,
                    e.limit,
                    e.pid,
                    crate::describe::process_owner(e)
                );
                return (subject.unwrap_or_else(|| node_object(node)), "Warning", "GPUTimeOutsideQuota", m);
            }
            if e.kind == pb::escape::Kind::OverLimit as i32 {
                let culprit = if e.pid == 0 {
                    String::new()
                } else {
                    format!(
                        "; process {}{} holds the most beyond its own account",
                        e.pid,
                        crate::describe::process_owner(e)
                    )
                };
                let m = format!(
                    "vgpu: the container holds {} MiB on {} as NVML measures it, over its {} MiB quota{culprit} ({action})",
                    mib(e.measured),
                    e.gpu,
                    mib(e.limit)
                );
                (subject.unwrap_or_else(|| node_object(node)), "Warning", "GPUMemoryOverQuota", m)
            } else if let Some(o) = subject {
                let m = format!(
                    "vgpu: process {}{} of the container uses {} ({} MiB), a GPU outside its slice ({action})",
                    e.pid,
                    crate::describe::process_owner(e),
                    e.gpu,
                    mib(e.measured)
                );
                (o, "Warning", "GPUOutsideQuota", m)
            } else {
                let m = format!(
                    "vgpu: process {}{} uses {} ({} MiB) outside every slice, on a GPU that slices use ({action})",
                    e.pid,
                    crate::describe::process_owner(e),
                    e.gpu,
                    mib(e.measured)
                );
                // On its pod where the agent could tell it (a pod with a slice: a container of it
                // that does not load libvgpu.so), else on the Node.
                let pod = e.pod.split_once('/').and_then(|(ns, name)| {
                    let of = |s: &&pb::SliceStatus| {
                        s.labels.get("namespace").is_some_and(|x| x == ns)
                            && s.labels.get("pod").is_some_and(|x| x == name)
                    };
                    let mut o = st.slices.iter().find(of).and_then(|s| self::subject(&s.labels))?;
                    // Not the slice's container: the process's own is not known by name.
                    o.as_object_mut()?.remove("fieldPath");
                    Some(o)
                });
                (pod.unwrap_or_else(|| node_object(node)), "Warning", "GPUProcessOutsideQuota", m)
            }
        }
        Notice::Health { gpu, index, healthy: false, reason } => (
            node_object(node),
            "Warning",
            "GPUUnhealthy",
            format!("vgpu: GPU {index} ({gpu}) is unhealthy: {reason}; its devices are withdrawn until it recovers"),
        ),
        Notice::Health { gpu, index, healthy: true, .. } => {
            (node_object(node), "Normal", "GPUHealthy", format!("vgpu: GPU {index} ({gpu}) is healthy again"))
        }
        Notice::MigHealth { gpu, index, device, gpu_instance, healthy: false, reason } => (
            node_object(node),
            "Warning",
            "MIGDeviceUnhealthy",
            format!(
                "vgpu: MIG device {device} (GPU instance {gpu_instance} of GPU {index}, {gpu}) is unhealthy: {reason}; \
                 it is withdrawn until it recovers, the GPU's other devices are not"
            ),
        ),
        Notice::MigHealth { gpu, index, device, gpu_instance, healthy: true, .. } => (
            node_object(node),
            "Normal",
            "MIGDeviceHealthy",
            format!("vgpu: MIG device {device} (GPU instance {gpu_instance} of GPU {index}, {gpu}) is healthy again"),
        ),
    }
}

/// The most Events of notices posted in one round; more are dropped (and logged).
const NOTICES_PER_ROUND: usize = 20;

/// The Event object for `object` (an `involvedObject`), posted by this node's agent.
pub fn event(object: &Value, kind: &str, reason: &str, message: &str, node: &str) -> Value {
    let now = crate::health::rfc3339_now();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("{}.{nanos:x}", object["name"].as_str().unwrap_or("slice")),
                     "namespace": object["namespace"].as_str().unwrap_or("default")},
        "involvedObject": object,
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": "vgpu-node-agent", "host": node},
        "reportingComponent": "vgpu-node-agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    })
}

/// Posts one Warning about this node (a refusal to start, before [`run`] posts anything): where
/// `pod_events` is on, within 10 s, or not at all (logged).
pub async fn post_node_warning(cfg: &crate::config::Config, reason: &str, message: &str) {
    if !cfg.pod_events {
        return;
    }
    let post = async {
        let client = crate::k8s::client(cfg.kube_api.as_deref()).await.map_err(|e| e.to_string())?;
        let events = ApiResource::erase::<k8s_openapi::api::core::v1::Event>(&());
        let api: Api<DynamicObject> = Api::namespaced_with(client, "default", &events);
        let object = node_object(&cfg.node_name);
        let e = serde_json::from_value::<DynamicObject>(event(&object, "Warning", reason, message, &cfg.node_name))
            .map_err(|e| format!("cannot make an Event: {e}"))?;
        api.create(&PostParams::default(), &e).await.map_err(|e| e.to_string())?;
        Ok::<(), String>(())
    };
    match tokio::time::timeout(Duration::from_secs(10), post).await {
        Ok(Ok(())) => tracing::info!(reason, "Event: {message}"),
        Ok(Err(e)) => tracing::warn!(error = %e, reason, "cannot post the Event"),
        Err(_) => tracing::warn!(reason, "cannot post the Event: the API server did not answer in 10 s"),
    }
}

/// The Events posted lately, by what they were about, so that the same again updates its Event.
#[derive(Default)]
pub struct Recent {
    by_key: HashMap<String, Latest>,
}

/// An Event posted: its name, how many times it has been reported, when last.
#[derive(Clone, Debug, PartialEq)]
pub struct Latest {
    pub name: String,
    pub count: u64,
    at: Instant,
}

impl Recent {
    /// What an Event is about, for aggregation: its object (kind, namespace, name, UID, field) and
    /// reason.
    pub fn key(object: &Value, reason: &str) -> String {
        let f = |k: &str| object[k].as_str().unwrap_or_default().to_string();
        [f("kind"), f("namespace"), f("name"), f("uid"), f("fieldPath"), reason.to_string()].join("\u{1f}")
    }

    /// The Event to update for `key` at `now`: one reported within [`AGGREGATE`]. Older ones are
    /// forgotten.
    pub fn update_of(&mut self, key: &str, now: Instant) -> Option<Latest> {
        self.by_key.retain(|_, l| now.duration_since(l.at) < AGGREGATE);
        self.by_key.get(key).cloned()
    }

    /// The Event `name` has now been reported `count` times, the last at `now` (its namespace is
    /// its object's, part of the key).
    pub fn reported(&mut self, key: String, name: String, count: u64, now: Instant) {
        self.by_key.insert(key, Latest { name, count, at: now });
    }
}

/// Posts the Events (see the module's documentation) for as long as the agent runs.
pub async fn run(agent: Arc<Agent>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let client = match crate::k8s::client(agent.cfg.kube_api.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(error = %e, "no Kubernetes API: no Events");
            return;
        }
    };
    let events = ApiResource::erase::<k8s_openapi::api::core::v1::Event>(&());
    agent.notices_wanted.store(true, std::sync::atomic::Ordering::Relaxed);
    let node = agent.cfg.node_name.clone();
    let recent = Arc::new(parking_lot::Mutex::new(Recent::default()));
    let post = |mut object: Value, kind: &'static str, reason: &'static str, message: String| {
        let (client, events, node, recent) = (client.clone(), events.clone(), node.clone(), recent.clone());
        async move {
            let ns = object["namespace"].as_str().unwrap_or("default").to_string();
            // A pod known by name only (replica mode learns its slices' pods from kubelet): its UID,
            // without which `kubectl describe pod` does not list the Event.
            if object["kind"] == "Pod" && object["uid"].as_str().is_none_or(str::is_empty) {
                let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
                if let Ok(Some(p)) = pods.get_opt(object["name"].as_str().unwrap_or_default()).await {
                    object["uid"] = p.metadata.uid.unwrap_or_default().into();
                }
            }
            let api: Api<DynamicObject> = Api::namespaced_with(client, &ns, &events);
            let key = Recent::key(&object, reason);
            let last = recent.lock().update_of(&key, Instant::now());
            if let Some(l) = last {
                let patch =
                    json!({"count": l.count + 1, "lastTimestamp": crate::health::rfc3339_now(), "message": message});
                match api.patch(&l.name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Ok(_) => {
                        recent.lock().reported(key, l.name, l.count + 1, Instant::now());
                        tracing::info!(reason, object = %object["name"], count = l.count + 1, "Event: {message}");
                        return Ok(());
                    }
                    // Gone (expired, or deleted), or no right to patch Events (a ClusterRole from
                    // before aggregation): made anew below.
                    Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            let e = serde_json::from_value::<DynamicObject>(event(&object, kind, reason, &message, &node))
                .map_err(|e| format!("cannot make an Event: {e}"))?;
            let name = e.metadata.name.clone().unwrap_or_default();
            api.create(&PostParams::default(), &e).await.map_err(|e| e.to_string())?;
            recent.lock().reported(key, name, 1, Instant::now());
            tracing::info!(reason, object = %object["name"], "Event: {message}");
            Ok::<(), String>(())
        }
    };
    // What the slices refused before this agent started is in the first pass's status.
    while !agent.ready.load(std::sync::atomic::Ordering::Acquire) {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = stop.changed() => return,
        }
    }
    let mut books = Books::seeded(&agent.status());
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.changed() => break,
        }
        let st = agent.status();
        let notices: Vec<Notice> = agent.notices.lock().drain(..).collect();
        if notices.len() > NOTICES_PER_ROUND {
            tracing::warn!(
                dropped = notices.len() - NOTICES_PER_ROUND,
                "more escapes and health changes than Events posted"
            );
        }
        let (mut error, mut posted, mut unposted) = (None, 0, Vec::new());
        for n in notices.into_iter().take(NOTICES_PER_ROUND) {
            let (object, kind, reason, message) = notice_event(&n, &st, &node);
            match post(object, kind, reason, message).await {
                Ok(()) => posted += 1,
                Err(e) => {
                    error = Some(e);
                    unposted.push(n);
                }
            }
        }
        for d in books.due(&st, Instant::now()) {
            match post(d.object.clone(), "Warning", REASON, d.message.clone()).await {
                Ok(()) => {
                    books.posted(&d, Instant::now());
                    posted += 1;
                }
                Err(e) => error = Some(e),
            }
        }
        // What could not be posted is tried again next round (refusals stay due until posted).
        if !unposted.is_empty() {
            let mut q = agent.notices.lock();
            for n in unposted.into_iter().rev() {
                q.push_front(n);
            }
            q.truncate(crate::agent::NOTICES_KEPT);
        }
        match error {
            Some(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot post Kubernetes Events; trying again every 2 s");
                }
                failing = true;
                agent.warn("events", Some(format!("cannot post Kubernetes Events: {e}")));
            }
            None if posted > 0 && failing => {
                tracing::info!("Kubernetes Events posted again");
                failing = false;
                agent.warn("events", None);
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str, labels: &[(&str, &str)], refused: &[(&str, u64)]) -> pb::SliceStatus {
        pb::SliceStatus {
            name: name.into(),
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            gpus: refused
                .iter()
                .map(|(u, n)| pb::SliceGpuStatus {
                    uuid: u.to_string(),
                    oom_rejections: *n,
                    memory_limit: 3000 << 20,
                    memory_peak: 2964 << 20,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn node(slices: Vec<pb::SliceStatus>) -> pb::NodeStatus {
        pb::NodeStatus { slices, ..Default::default() }
    }

    const POD: &[(&str, &str)] = &[("namespace", "ml"), ("pod", "train"), ("container", "main"), ("pod-uid", "u1")];

    #[test]
    fn a_slice_s_new_refusals_make_one_event_a_minute_on_its_pod_or_claim() {
        let t0 = Instant::now();
        // Refused before the agent started: not reported again.
        let mut b = Books::seeded(&node(vec![slice("a", POD, &[("GPU-0", 4)])]));
        assert!(b.due(&node(vec![slice("a", POD, &[("GPU-0", 4)])]), t0).is_empty());

        // Two more on GPU-0, one on GPU-1, and a slice of no pod (never an Event).
        let now = node(vec![
            slice("a", POD, &[("GPU-0", 6), ("GPU-1", 1)]),
            slice("mine", &[("owner", "me")], &[("GPU-0", 9)]),
        ]);
        let due = b.due(&now, t0);
        assert_eq!(due.len(), 1, "{due:?}");
        let Due { slice: name, object, message, .. } = &due[0];
        assert_eq!(name, "a");
        assert_eq!(
            object,
            &json!({"kind": "Pod", "apiVersion": "v1", "namespace": "ml", "name": "train", "uid": "u1",
                    "fieldPath": "spec.containers{main}"})
        );
        assert!(
            message.contains("2 GPU memory allocations refused on GPU-0 (quota 3000 MiB, peak use 2964 MiB)"),
            "{message}"
        );
        assert!(message.contains("1 GPU memory allocation refused on GPU-1"), "{message}");

        // Not posted (the API server refused it): due again next round, counting the same.
        let again = b.due(&now, t0 + EVERY);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].message, *message);
        b.posted(&again[0], t0 + EVERY);
        assert!(b.due(&now, t0 + EVERY * 2).is_empty(), "posted: nothing new");

        // More within the minute wait for the next Event, which counts them all.
        let later = node(vec![slice("a", POD, &[("GPU-0", 7), ("GPU-1", 1)])]);
        assert!(b.due(&later, t0 + Duration::from_secs(30)).is_empty(), "one a minute");
        let later = node(vec![slice("a", POD, &[("GPU-0", 9), ("GPU-1", 1)])]);
        let due = b.due(&later, t0 + EVERY + PER_SLICE);
        assert_eq!(due.len(), 1);
        assert!(due[0].message.contains("3 GPU memory allocations refused on GPU-0"), "{}", due[0].message);
        assert!(!due[0].message.contains("GPU-1"), "nothing new there: {}", due[0].message);
        b.posted(&due[0], t0 + EVERY + PER_SLICE);

        // A slice made again under its name (a new pod) starts from nothing seen.
        b.due(&node(vec![]), t0 + PER_SLICE * 3);
        let again = b.due(&node(vec![slice("a", POD, &[("GPU-0", 1)])]), t0 + PER_SLICE * 3);
        assert_eq!(again.len(), 1);

        // A DRA claim's slice: the Event is the claim's.
        let claim = &[("namespace", "ml"), ("claim", "gpu-claim"), ("claim-uid", "c1"), ("source", "dra")];
        let due = b.due(&node(vec![slice("dra-c1", claim, &[("GPU-0", 1)])]), t0);
        assert_eq!(due[0].object["kind"], "ResourceClaim");
        let o = &due[0].object;
        assert_eq!((o["name"].as_str(), o["uid"].as_str()), (Some("gpu-claim"), Some("c1")));
        assert!(o.get("fieldPath").is_none());
    }

    #[test]
    fn escapes_and_health_changes_go_to_the_pod_or_the_node() {
        let st = node(vec![slice("a", POD, &[("GPU-0", 0)])]);
        let esc = |kind: pb::escape::Kind, slice: &str, action: &str| {
            Notice::Escape(pb::Escape {
                kind: kind as i32,
                gpu: "GPU-0".into(),
                slice: slice.into(),
                pid: 4242,
                measured: 3200 << 20,
                limit: 3000 << 20,
                action: action.into(),
                ..Default::default()
            })
        };
        let (o, kind, reason, m) = notice_event(&esc(pb::escape::Kind::OverLimit, "a", "reported"), &st, "node1");
        assert_eq!((o["kind"].as_str(), o["name"].as_str()), (Some("Pod"), Some("train")));
        assert_eq!((kind, reason), ("Warning", "GPUMemoryOverQuota"));
        assert!(
            m.contains("holds 3200 MiB on GPU-0 as NVML measures it, over its 3000 MiB quota; process 4242 holds the most beyond its own account (reported)"),
            "{m}"
        );
        let Notice::Escape(mut b) = esc(pb::escape::Kind::Bypass, "a", "reported") else { unreachable!() };
        (b.measured, b.limit) = (91, 3);
        let (o, _, reason, m) = notice_event(&Notice::Escape(b), &st, "node1");
        assert_eq!((o["name"].as_str(), reason), (Some("train"), "GPUTimeOutsideQuota"));
        assert!(
            m.contains("uses 91 % of GPU-0 as NVML measures it, where its launches through libvgpu.so account for 3 %"),
            "{m}"
        );
        let (o, _, reason, m) = notice_event(&esc(pb::escape::Kind::Unaccounted, "a", "killed"), &st, "node1");
        assert_eq!((o["name"].as_str(), reason), (Some("train"), "GPUOutsideQuota"));
        assert!(m.contains("process 4242 of the container uses GPU-0") && m.contains("(process 4242 killed)"), "{m}");
        let (o, _, reason, m) = notice_event(&esc(pb::escape::Kind::Unaccounted, "", "reported"), &st, "node1");
        assert_eq!(o, json!({"kind": "Node", "apiVersion": "v1", "name": "node1", "uid": "node1"}));
        assert_eq!(reason, "GPUProcessOutsideQuota");
        assert!(m.contains("process 4242 uses GPU-0 (3200 MiB) outside every slice"), "{m}");
        assert_eq!(event(&o, "Warning", reason, &m, "node1")["metadata"]["namespace"], "default");
        // Who runs it, as far as the agent could tell.
        let Notice::Escape(mut e) = esc(pb::escape::Kind::Unaccounted, "", "reported") else { unreachable!() };
        e.command = "python3".into();
        e.pod_uid = "4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d".into();
        e.container_id = "0a1b2c3d4e5f6071".into();
        let (_, _, _, m) = notice_event(&Notice::Escape(e.clone()), &st, "node1");
        assert!(
            m.contains("process 4242 (python3, pod UID 4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d, container 0a1b2c3d4e5f) uses GPU-0"),
            "{m}"
        );
        e.pod = "ml/other-0".into();
        let (o, _, _, m) = notice_event(&Notice::Escape(e.clone()), &st, "node1");
        assert!(m.contains("process 4242 (python3, pod ml/other-0, container 0a1b2c3d4e5f) uses GPU-0"), "{m}");
        assert_eq!(o["kind"], "Node", "a pod the agent has no slice of: {o}");
        // The pod of a slice: the Event is on that pod (not at the slice's container).
        e.pod = "ml/train".into();
        let (o, _, reason, _) = notice_event(&Notice::Escape(e), &st, "node1");
        assert_eq!(
            (o["kind"].as_str(), o["namespace"].as_str(), o["name"].as_str(), o["uid"].as_str(), reason),
            (Some("Pod"), Some("ml"), Some("train"), Some("u1"), "GPUProcessOutsideQuota"),
            "{o}"
        );
        assert!(o.get("fieldPath").is_none(), "{o}");
        assert_eq!(event(&o, "Warning", reason, &m, "node1")["metadata"]["namespace"], "ml", "in the pod's namespace");
        // A slice of no pod: the Node's.
        let mine = node(vec![slice("b", &[("owner", "me")], &[])]);
        let (o, ..) = notice_event(&esc(pb::escape::Kind::OverLimit, "b", "reported"), &mine, "node1");
        assert_eq!(o["kind"], "Node");
        let bad = Notice::Health { gpu: "GPU-1".into(), index: 1, healthy: false, reason: "XID 79 at now".into() };
        let (o, kind, reason, m) = notice_event(&bad, &st, "node1");
        assert_eq!((o["kind"].as_str(), kind, reason), (Some("Node"), "Warning", "GPUUnhealthy"));
        assert!(m.contains("GPU 1 (GPU-1) is unhealthy: XID 79 at now"), "{m}");
        let good = Notice::Health { gpu: "GPU-1".into(), index: 1, healthy: true, reason: String::new() };
        assert_eq!(notice_event(&good, &st, "node1").1, "Normal");
        let mig = |healthy| Notice::MigHealth {
            gpu: "GPU-1".into(),
            index: 1,
            device: "MIG-9".into(),
            gpu_instance: 3,
            healthy,
            reason: if healthy { String::new() } else { "XID 94 at now".into() },
        };
        let (o, kind, reason, m) = notice_event(&mig(false), &st, "node1");
        assert_eq!((o["kind"].as_str(), kind, reason), (Some("Node"), "Warning", "MIGDeviceUnhealthy"));
        assert!(m.contains("MIG device MIG-9 (GPU instance 3 of GPU 1, GPU-1) is unhealthy: XID 94 at now"), "{m}");
        assert_eq!(notice_event(&mig(true), &st, "node1").2, "MIGDeviceHealthy");
    }

    #[test]
    fn the_same_event_within_ten_minutes_updates_the_last_one() {
        let pod = json!({"kind": "Pod", "namespace": "ml", "name": "train", "uid": "u1", "fieldPath": "spec.containers{main}"});
        let other_container = json!({"kind": "Pod", "namespace": "ml", "name": "train", "uid": "u1", "fieldPath": "spec.containers{side}"});
        let node = node_object("node1");
        let mut r = Recent::default();
        let t0 = Instant::now();
        let k = Recent::key(&pod, REASON);
        assert_eq!(r.update_of(&k, t0), None, "nothing posted yet");
        r.reported(k.clone(), "train.1".into(), 1, t0);
        let l = r.update_of(&k, t0 + Duration::from_secs(599)).unwrap();
        assert_eq!((l.name.as_str(), l.count), ("train.1", 1));
        // Another reason, another container of the pod, another object: Events of their own.
        assert_eq!(r.update_of(&Recent::key(&pod, "GPUOutsideQuota"), t0), None);
        assert_eq!(r.update_of(&Recent::key(&other_container, REASON), t0), None);
        assert_eq!(r.update_of(&Recent::key(&node, REASON), t0), None);
        // Updated at 500 s: the ten minutes run from then.
        r.reported(k.clone(), "train.1".into(), 2, t0 + Duration::from_secs(500));
        assert_eq!(r.update_of(&k, t0 + Duration::from_secs(1099)).map(|l| l.count), Some(2));
        // Ten minutes after the last update: a new Event, and the old one forgotten.
        assert_eq!(r.update_of(&k, t0 + Duration::from_secs(1100)), None);
        assert!(r.by_key.is_empty());
    }

    #[test]
    fn an_event_is_a_warning_from_this_node_s_agent() {
        let o = json!({"kind": "Pod", "namespace": "ml", "name": "train"});
        let e = event(&o, "Warning", REASON, "vgpu: refused", "node1");
        assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("Warning"), Some(REASON)));
        assert_eq!(e["metadata"]["namespace"], "ml");
        assert!(e["metadata"]["name"].as_str().unwrap().starts_with("train."), "{e}");
        assert_eq!(e["source"], json!({"component": "vgpu-node-agent", "host": "node1"}));
        assert_eq!(e["involvedObject"], o);
        assert_eq!(e["firstTimestamp"], e["lastTimestamp"]);
        assert!(serde_json::from_value::<DynamicObject>(e).is_ok());
    }
}

//! Kubernetes Events for the quota's refusals (`pod_events`, on by default where the agent reaches
//! an API server). A container whose GPU allocation the quota refused sees only CUDA's
//! out-of-memory error, which does not say that a quota, not the GPU, refused it. When a slice's
//! refusals have grown, the agent posts a Warning Event `GPUMemoryQuotaExceeded` on the slice's pod
//! (labels `namespace`, `pod`, `container`, and `pod-uid` where known: HAMi, Volcano and replica
//! modes), or on its DRA claim (`namespace`, `claim`, `claim-uid`), so that `kubectl describe`
//! shows it: per GPU, the refusals since the last Event, the limit and the slice's peak use. At most one Event
//! per slice in [`PER_SLICE`]; what is refused meanwhile goes in the next. Refusals from before the
//! agent started are not reported again (an agent restart would repeat them).

use crate::agent::Agent;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vgpu_proto::v1 as pb;

/// How often the slices' refusals are looked at.
const EVERY: Duration = Duration::from_secs(2);
/// The least time between two Events of one slice.
pub const PER_SLICE: Duration = Duration::from_secs(60);
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

    /// The Events due at `now` (the slice, the object, the message), taken as reported; slices
    /// that are gone are forgotten.
    pub fn due(&mut self, st: &pb::NodeStatus, now: Instant) -> Vec<(String, Value, String)> {
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
            for (g, _) in &grown {
                seen.insert(g.uuid.clone(), g.oom_rejections);
            }
            self.last.insert(s.name.clone(), now);
            out.push((s.name.clone(), object, message));
        }
        out
    }
}

/// The Event object for `object` (an `involvedObject`), posted by this node's agent.
pub fn event(object: &Value, message: &str, node: &str) -> Value {
    let now = crate::health::rfc3339_now();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    json!({
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": format!("{}.{nanos:x}", object["name"].as_str().unwrap_or("slice")),
                     "namespace": object["namespace"]},
        "involvedObject": object,
        "type": "Warning",
        "reason": REASON,
        "message": message,
        "source": {"component": "vgpu-node-agent", "host": node},
        "reportingComponent": "vgpu-node-agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    })
}

/// Posts Events for the quota's refusals for as long as the agent runs.
pub async fn run(agent: Arc<Agent>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let client = match crate::k8s::client(agent.cfg.kube_api.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(error = %e, "no Kubernetes API: no Events for refused allocations");
            return;
        }
    };
    let events = ApiResource {
        group: String::new(),
        version: "v1".into(),
        api_version: "v1".into(),
        kind: "Event".into(),
        plural: "events".into(),
    };
    let mut books = Books::seeded(&agent.status());
    loop {
        tokio::select! {
            _ = tokio::time::sleep(EVERY) => {}
            _ = stop.changed() => break,
        }
        for (slice, object, message) in books.due(&agent.status(), Instant::now()) {
            let ns = object["namespace"].as_str().unwrap_or_default().to_string();
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &events);
            let e = match serde_json::from_value::<DynamicObject>(event(&object, &message, &agent.cfg.node_name)) {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(slice = %slice, error = %e, "cannot make an Event");
                    continue;
                }
            };
            match api.create(&PostParams::default(), &e).await {
                Ok(_) => tracing::info!(slice = %slice, "{message}"),
                Err(e) => tracing::warn!(slice = %slice, error = %e, "cannot post an Event for refused allocations"),
            }
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
        let (name, object, message) = &due[0];
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

        // More within the minute wait for the next Event, which counts them all.
        let later = node(vec![slice("a", POD, &[("GPU-0", 7), ("GPU-1", 1)])]);
        assert!(b.due(&later, t0 + Duration::from_secs(30)).is_empty(), "one a minute");
        let later = node(vec![slice("a", POD, &[("GPU-0", 9), ("GPU-1", 1)])]);
        let due = b.due(&later, t0 + PER_SLICE);
        assert_eq!(due.len(), 1);
        assert!(due[0].2.contains("3 GPU memory allocations refused on GPU-0"), "{}", due[0].2);
        assert!(!due[0].2.contains("GPU-1"), "nothing new there: {}", due[0].2);

        // A slice made again under its name (a new pod) starts from nothing seen.
        b.due(&node(vec![]), t0 + PER_SLICE * 2);
        let again = b.due(&node(vec![slice("a", POD, &[("GPU-0", 1)])]), t0 + PER_SLICE * 2);
        assert_eq!(again.len(), 1);

        // A DRA claim's slice: the Event is the claim's.
        let claim = &[("namespace", "ml"), ("claim", "gpu-claim"), ("claim-uid", "c1"), ("source", "dra")];
        let due = b.due(&node(vec![slice("dra-c1", claim, &[("GPU-0", 1)])]), t0);
        assert_eq!(due[0].1["kind"], "ResourceClaim");
        assert_eq!((due[0].1["name"].as_str(), due[0].1["uid"].as_str()), (Some("gpu-claim"), Some("c1")));
        assert!(due[0].1.get("fieldPath").is_none());
    }

    #[test]
    fn an_event_is_a_warning_from_this_node_s_agent() {
        let o = json!({"kind": "Pod", "namespace": "ml", "name": "train"});
        let e = event(&o, "vgpu: refused", "node1");
        assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("Warning"), Some(REASON)));
        assert_eq!(e["metadata"]["namespace"], "ml");
        assert!(e["metadata"]["name"].as_str().unwrap().starts_with("train."), "{e}");
        assert_eq!(e["source"], json!({"component": "vgpu-node-agent", "host": "node1"}));
        assert_eq!(e["involvedObject"], o);
        assert_eq!(e["firstTimestamp"], e["lastTimestamp"]);
        assert!(serde_json::from_value::<DynamicObject>(e).is_ok());
    }
}

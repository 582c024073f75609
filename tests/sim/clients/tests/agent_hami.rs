//! HAMi compatibility against a fake Kubernetes API server (a small HTTP server on 127.0.0.1 that
//! keeps pods and a node as JSON, answers kube-rs's list/get/merge-patch calls and enforces
//! resourceVersion guards) and a fake kubelet: the node register annotation, Allocate following the
//! scheduler's annotations exactly as HAMi's scheduler writes them (init and GPU-less containers
//! included), the bind phase and node lock, a device-count mismatch, and slices removed once their
//! pod is gone.

mod common;
use common::agent::*;
use common::kubelet;
use common::*;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vgpu_proto::deviceplugin as dp;

const NODE: &str =
    "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n[[gpu]]\nmodel = \"H100-80GB\"\n";

#[derive(Default)]
struct Cluster {
    node: Value,
    pods: Vec<Value>,
    rv: u64,
    /// Events posted, in order.
    events: Vec<Value>,
    /// Answer 403 to an Event's update (a ClusterRole without `patch` on events).
    forbid_event_patch: bool,
    /// The next this many patches of a pod meet another writer's change first: the object's
    /// resourceVersion moves on (and `concurrent` is merged into it), so the patch at the version
    /// read conflicts (409).
    conflicts: u32,
    /// The same for patches of the node.
    node_conflicts: u32,
    /// What the other writer changes (merged into the object), if anything.
    concurrent: Option<Value>,
    /// The next this many patches of a pod fail (500).
    fail_pod_patches: u32,
}

fn merge(dst: &mut Value, patch: &Value) {
    match (dst, patch) {
        (Value::Object(d), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    d.remove(k);
                } else {
                    merge(d.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (d, p) => *d = p.clone(),
    }
}

fn serve(cluster: Arc<Mutex<Cluster>>) -> String {
    common::kubeapi::serve(move |method, target, body| handle(&cluster, method, target, body))
}

fn handle(cluster: &Mutex<Cluster>, method: &str, target: &str, body: &[u8]) -> (u16, Value) {
    let mut c = cluster.lock().unwrap();
    let path = target.split('?').next().unwrap();
    let conflict = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "the object has been modified"});
    let not_found = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
    let seg: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, seg.as_slice()) {
        ("GET", ["api", "v1", "pods"]) => {
            assert!(target.contains("fieldSelector=spec.nodeName%3Dnode1"), "{target}");
            (
                200,
                json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": c.rv.to_string()}, "items": c.pods}),
            )
        }
        ("GET", ["api", "v1", "nodes", "node1"]) => (200, c.node.clone()),
        ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => {
            match c.pods.iter().find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name) {
                Some(p) => (200, p.clone()),
                None => (404, not_found),
            }
        }
        ("POST", ["api", "v1", "namespaces", ns, "events"]) => {
            let e: Value = serde_json::from_slice(body).unwrap();
            assert_eq!(e["metadata"]["namespace"], *ns, "{e}");
            c.events.push(e.clone());
            (201, e)
        }
        ("PATCH", ["api", "v1", "namespaces", _, "events", _]) if c.forbid_event_patch => (
            403,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403, "message": "events is forbidden"}),
        ),
        ("PATCH", ["api", "v1", "namespaces", ns, "events", name]) => {
            let patch: Value = serde_json::from_slice(body).unwrap();
            match c.events.iter_mut().find(|e| e["metadata"]["namespace"] == *ns && e["metadata"]["name"] == *name) {
                Some(e) => {
                    merge(e, &patch);
                    (200, e.clone())
                }
                None => (404, not_found),
            }
        }
        ("PATCH", rest) => {
            let patch: Value = serde_json::from_slice(body).unwrap();
            let is_pod = matches!(rest, ["api", "v1", "namespaces", _, "pods", _]);
            if is_pod && c.fail_pod_patches > 0 {
                c.fail_pod_patches -= 1;
                let e = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcdserver: request timed out"});
                return (500, e);
            }
            c.rv += 1;
            let concurrent = c.concurrent.clone();
            let conflicts = if is_pod { &mut c.conflicts } else { &mut c.node_conflicts };
            let conflicts = std::mem::replace(conflicts, conflicts.saturating_sub(1));
            if conflicts > 0 {
                c.rv += 1;
            }
            let rv = c.rv.to_string();
            let obj: &mut Value = match rest {
                ["api", "v1", "nodes", "node1"] => &mut c.node,
                ["api", "v1", "namespaces", ns, "pods", name] => {
                    match c
                        .pods
                        .iter_mut()
                        .find(|p| p["metadata"]["namespace"] == *ns && p["metadata"]["name"] == *name)
                    {
                        Some(p) => p,
                        None => return (404, not_found),
                    }
                }
                _ => return (404, not_found),
            };
            if conflicts > 0 {
                // Another writer was first.
                if let Some(change) = &concurrent {
                    merge(obj, change);
                }
                obj["metadata"]["resourceVersion"] = (rv.parse::<u64>().unwrap() - 1).to_string().into();
            }
            if let Some(want) = patch["metadata"]["resourceVersion"].as_str() {
                if obj["metadata"]["resourceVersion"].as_str() != Some(want) {
                    return (409, conflict);
                }
            }
            merge(obj, &patch);
            obj["metadata"]["resourceVersion"] = rv.into();
            (200, obj.clone())
        }
        _ => (404, not_found),
    }
}

fn pod(ns: &str, name: &str, uid: &str, bind_time: &str, devices: &str, containers: &[&str], init: &[&str]) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "1", "annotations": {
            "hami.io/bind-phase": "allocating", "hami.io/bind-time": bind_time, "hami.io/vgpu-node": "node1",
            "hami.io/vgpu-devices-to-allocate": devices, "hami.io/vgpu-devices-allocated": devices}},
        "spec": {"nodeName": "node1",
                 "initContainers": init.iter().map(|n| json!({"name": n})).collect::<Vec<_>>(),
                 "containers": containers.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()},
    })
}

/// The node lock HAMi's scheduler sets for the pod it binds (`<time>,<namespace>,<pod>`).
fn lock(cluster: &Mutex<Cluster>, ns: &str, pod: &str) {
    let mut c = cluster.lock().unwrap();
    c.rv += 1;
    let rv = c.rv.to_string();
    c.node["metadata"]["annotations"]["hami.io/mutex.lock"] = format!("2026-11-29T10:01:00Z,{ns},{pod}").into();
    c.node["metadata"]["resourceVersion"] = rv.into();
}

fn wait(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(15), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The harness of a test: a fake API server holding `cluster`, a fake kubelet, and the agent with
/// `config` (TOML) pointed at both as node "node1".
struct Harness {
    kdir: std::path::PathBuf,
    rt: tokio::runtime::Runtime,
    rx: tokio::sync::mpsc::UnboundedReceiver<dp::RegisterRequest>,
    _kubelet: tokio::sync::oneshot::Sender<()>,
    a: Agent,
}

fn harness(s: &Sim, cluster: &Arc<Mutex<Cluster>>, config: &str) -> Harness {
    let api = serve(cluster.clone());
    let kdir = s.state.join("kubelet");
    std::fs::create_dir_all(&kdir).unwrap();
    let cfg = s.state.join("agent.toml");
    std::fs::write(&cfg, config).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let _kubelet = rt.block_on(async { kubelet::start(&kdir, tx) });
    let a = Agent::start(
        s,
        &[
            ("VGPU_AGENT_CONFIG", cfg.to_str().unwrap()),
            ("VGPU_AGENT_KUBELET_DIR", kdir.to_str().unwrap()),
            ("VGPU_AGENT_KUBE_API", &api),
            ("NODE_NAME", "node1"),
        ],
    );
    Harness { kdir, rt, rx, _kubelet, a }
}

#[test]
fn hami_mode_follows_the_schedulers_annotations() {
    let mut s = Sim::new(Some(NODE));
    let st = {
        // GPU UUIDs: ask the simulator.
        s.status()
    };
    let g0 = st["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let g1 = st["gpus"][1]["uuid"].as_str().unwrap().to_string();
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1",
                     "annotations": {"hami.io/mutex.lock": "2026-11-29T10:00:00Z,ml,train"}}}),
        pods: vec![
            // The lock owner: an init container and a sidecar without GPUs, one container with 3000 MiB
            // and 30 %, of HAMi's high task priority (its nvidia.com/priority resource at 0).
            {
                let mut p = pod(
                    "ml",
                    "train",
                    "uid-train",
                    "200",
                    &format!(";{g0},NVIDIA,3000,30:;;"),
                    &["main", "side"],
                    &["init"],
                );
                p["spec"]["containers"][0]["resources"] = json!({"limits": {"nvidia.com/priority": "0"}});
                p
            },
            // Older, but not the lock owner; two devices for its one container.
            pod("other", "x", "uid-x", "100", &format!("{g0},NVIDIA,1000,0:{g1},NVIDIA,1000,0:;"), &["c"], &[]),
            // Newest; its container sets CUDA_DISABLE_CONTROL=true.
            {
                let mut p = pod("ml", "free", "uid-free", "300", &format!("{g1},NVIDIA,500,0:;"), &["c"], &[]);
                p["spec"]["containers"][0]["env"] = json!([{"name": "CUDA_DISABLE_CONTROL", "value": "true"}]);
                p
            },
        ],
        rv: 10,
        ..Default::default()
    }));
    // HAMi's per-node device plugin configuration gives this node 7 replicas a GPU and its memory
    // scaling (the other node's entry, and the file's split_count, do not apply).
    let node_json = s.state.join("hami-node-config.json");
    std::fs::write(
        &node_json,
        r#"{"nodeconfig": [{"name": "node2", "devicesplitcount": 3},
            {"name": "node1", "operatingmode": "hami-core", "devicememoryscaling": 1.5, "devicesplitcount": 7,
             "migstrategy": "none", "filterdevices": {"uuid": [], "index": []}}]}"#,
    )
    .unwrap();
    let Harness { kdir, rt, mut rx, _kubelet, a } = harness(
        &s,
        &cluster,
        &format!(
            "compat = \"hami\"\nregister_interval_s = 1\nsplit_count = 10\nhealth_recovery_s = 1\npriority_namespaces = [\"ml\"]\nhami_node_config_file = {:?}\n",
            node_json.to_str().unwrap()
        ),
    );

    // The node register annotation (v2.8 JSON), the memory scaled as HAMi's deviceMemoryScaling does.
    wait("the node annotation", || {
        cluster.lock().unwrap().node["metadata"]["annotations"]["hami.io/node-nvidia-register"].is_string()
    });
    let reg: Value = serde_json::from_str(
        cluster.lock().unwrap().node["metadata"]["annotations"]["hami.io/node-nvidia-register"].as_str().unwrap(),
    )
    .unwrap();
    assert_eq!(reg[0]["id"], g0);
    assert_eq!(
        (reg[0]["count"].as_u64(), reg[0]["devmem"].as_u64(), reg[0]["devcore"].as_u64()),
        (Some(7), Some(12288), Some(100))
    );
    assert_eq!(reg[0]["type"], "NVIDIA-NVIDIA A100-SXM4-40GB");
    assert_eq!((reg[0]["mode"].as_str(), reg[0]["health"].as_bool()), (Some("hami-core"), Some(true)));
    assert!(reg[0].get("index").is_none(), "zero fields are left out, as HAMi writes them");
    assert_eq!(reg[1]["numa"], 1);

    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    rt.block_on(async {
        let mut c = kubelet::plugin(kdir.join(&reg.endpoint)).await;
        // kubelet picks any replica ID; HAMi mode follows the annotations.
        let r = c
            .allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g1}-7")] }] })
            .await
            .unwrap()
            .into_inner();
        let cr = &r.container_responses[0];
        assert_eq!(cr.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&g0));
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("3000m"));
        assert_eq!(cr.envs.get("CUDA_DEVICE_SM_LIMIT_0").map(String::as_str), Some("30"));
        assert_eq!(cr.envs.get("CUDA_OVERSUBSCRIBE").map(String::as_str), Some("true"), "memory_scaling above 1");
        assert!(cr.mounts.iter().any(|m| m.container_path == "/etc/ld.so.preload" && m.read_only));
        // HAMi's task priority 0 is a high-priority slice, in its limits file (the agent's alone).
        let st = a.status().unwrap();
        let train = st["slices"].as_array().unwrap().iter().find(|x| x["labels"]["pod"] == "train").unwrap().clone();
        assert_eq!(train["priority"], "high", "{train}");
        let limits = cr.mounts.iter().find(|m| m.container_path == "/usr/local/vgpu/limits").unwrap();
        assert!(vgpu_region::Region::open(std::path::Path::new(&limits.host_path), false).unwrap().priority_high());

        // A process with that environment gets its 3000 MiB.
        let detail = json!({
            "env": cr.envs.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect::<serde_json::Map<_, _>>(),
            "mounts": cr.mounts.iter().map(|m| json!({"container_path": m.container_path, "host_path": m.host_path})).collect::<Vec<_>>(),
        });
        let o = in_slice(&s, &detail, RT).env("LD_PRELOAD", libvgpu()).args(["alloc", "--size", "4g", "--chunk", "100m"]).output().unwrap();
        assert_eq!(lines(&o.stdout)[0]["allocated"], 2900 * MIB, "3000 MiB less the 64 MiB context, in 100 MiB chunks");

        // The refusal is a Warning Event on the pod's container, which says the quota refused it.
        wait("the Event", || !cluster.lock().unwrap().events.is_empty());
        let e = cluster.lock().unwrap().events[0].clone();
        assert_eq!(
            e["involvedObject"],
            json!({"kind": "Pod", "apiVersion": "v1", "namespace": "ml", "name": "train", "uid": "uid-train",
                   "fieldPath": "spec.containers{main}"})
        );
        assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("Warning"), Some("GPUMemoryQuotaExceeded")));
        let m = e["message"].as_str().unwrap();
        assert!(m.contains(&format!("1 GPU memory allocation refused on {g0} (quota 3000 MiB, peak use 2964 MiB)")), "{m}");
        assert_eq!(e["source"]["host"], "node1");
        // Refused again within the minute: no second Event yet.
        let o = in_slice(&s, &detail, RT).env("LD_PRELOAD", libvgpu()).args(["alloc", "--size", "4g"]).output().unwrap();
        assert_eq!(lines(&o.stdout)[0]["error"], "CUDA_ERROR_OUT_OF_MEMORY", "{o:?}");
        std::thread::sleep(Duration::from_millis(2500));
        assert_eq!(cluster.lock().unwrap().events.len(), 1, "one Event a minute");

        // A process outside every slice on the slice's GPU, and a critical XID on GPU 1 and its
        // recovery: Events on the Node, in namespace default, as kubelet's are.
        let mut rogue = s.cmd(RT).args(["alloc", "--size", "100m", "--hold"]).stdout(std::process::Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(rogue.stdout.as_mut().unwrap()), &mut line).unwrap();
        let of = |reason: &str| cluster.lock().unwrap().events.iter().find(|e| e["reason"] == reason).cloned();
        wait("the escape's Event", || of("GPUProcessOutsideQuota").is_some());
        let _ = rogue.kill();
        let _ = rogue.wait();
        let e = of("GPUProcessOutsideQuota").unwrap();
        assert_eq!(e["involvedObject"], json!({"kind": "Node", "apiVersion": "v1", "name": "node1", "uid": "node1"}));
        assert_eq!(e["metadata"]["namespace"], "default");
        let m = e["message"].as_str().unwrap();
        // Who runs it: the command, and whatever container this machine runs the test in.
        assert!(m.contains(&format!("process {} (cuda-rt-app", rogue.id())), "{m}");
        assert!(m.contains(&format!(") uses {g0}")) && m.contains("outside every slice"), "{m}");
        assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
        wait("the unhealthy GPU's Event", || of("GPUUnhealthy").is_some());
        let e = of("GPUUnhealthy").unwrap();
        assert_eq!((e["type"].as_str(), e["involvedObject"]["kind"].as_str()), (Some("Warning"), Some("Node")));
        assert!(e["message"].as_str().unwrap().contains(&format!("GPU 1 ({g1}) is unhealthy: XID 79 at ")), "{e}");
        wait("the recovered GPU's Event", || of("GPUHealthy").is_some());
        assert_eq!(of("GPUHealthy").unwrap()["type"], "Normal");
        // The GPU fails again: the same Event is updated (count 2, as kubelet aggregates), once the
        // new one is in; an Event the server no longer has (expired) is made anew.
        let first = of("GPUUnhealthy").unwrap();
        assert_eq!(first["count"], 1);
        assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
        wait("the second failure counted", || of("GPUUnhealthy").is_some_and(|e| e["count"] == 2));
        let again = of("GPUUnhealthy").unwrap();
        let unhealthy = || cluster.lock().unwrap().events.iter().filter(|e| e["reason"] == "GPUUnhealthy").count();
        assert_eq!(unhealthy(), 1, "{:?}", cluster.lock().unwrap().events);
        assert_eq!(again["metadata"]["name"], first["metadata"]["name"]);
        assert_eq!(again["firstTimestamp"], first["firstTimestamp"]);
        assert!(again["lastTimestamp"].as_str() >= first["lastTimestamp"].as_str(), "{again}");
        wait("the second recovery counted", || of("GPUHealthy").is_some_and(|e| e["count"] == 2));
        // The server no longer has it, and may not update Events (no `patch` right): the next
        // failure and recovery are new Events.
        {
            let mut cl = cluster.lock().unwrap();
            cl.events.retain(|e| e["reason"] != "GPUUnhealthy");
            cl.forbid_event_patch = true;
        }
        assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
        wait("a new Event for the expired one", || of("GPUUnhealthy").is_some());
        assert_eq!(of("GPUUnhealthy").unwrap()["count"], 1);
        assert_ne!(of("GPUUnhealthy").unwrap()["metadata"]["name"], first["metadata"]["name"]);
        let healthy = || -> Vec<Value> {
            cluster.lock().unwrap().events.iter().filter(|e| e["reason"] == "GPUHealthy").cloned().collect()
        };
        wait("a new Event where the update is forbidden", || healthy().len() == 2);
        assert_eq!((healthy()[0]["count"].as_u64(), healthy()[1]["count"].as_u64()), (Some(2), Some(1)));
        cluster.lock().unwrap().forbid_event_patch = false;

        // The pod's entry is consumed, its bind phase is success, the node lock is released.
        {
            let cl = cluster.lock().unwrap();
            let p = cl.pods.iter().find(|p| p["metadata"]["name"] == "train").unwrap();
            assert_eq!(p["metadata"]["annotations"]["hami.io/vgpu-devices-to-allocate"], ";;;");
            assert_eq!(p["metadata"]["annotations"]["hami.io/bind-phase"], "success");
            assert!(cl.node["metadata"]["annotations"].get("hami.io/mutex.lock").is_none(), "{}", cl.node);
        }
        let v = a.status().unwrap();
        let sl = v["slices"].as_array().unwrap().iter().find(|x| x["labels"]["pod"] == "train").expect("the pod's slice").clone();
        assert_eq!((sl["labels"]["namespace"].as_str(), sl["labels"]["container"].as_str()), (Some("ml"), Some("main")));

        // The scheduler locks the node for the next pod it binds: its container has two devices but
        // kubelet asks for one: refused, failed.
        lock(&cluster, "other", "x");
        let e = c
            .allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g0}-1")] }] })
            .await
            .unwrap_err();
        assert!(e.message().contains("device number not matched"), "{e}");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "the scheduler's annotations refuse it: {e}");
        {
            let cl = cluster.lock().unwrap();
            let x = cl.pods.iter().find(|p| p["metadata"]["name"] == "x").unwrap();
            assert_eq!(x["metadata"]["annotations"]["hami.io/bind-phase"], "failed");
        }
        // CUDA_DISABLE_CONTROL=true: limits and files, but no preload file.
        lock(&cluster, "ml", "free");
        let r = c
            .allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g1}-2")] }] })
            .await
            .unwrap()
            .into_inner();
        let cr = &r.container_responses[0];
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("500m"));
        assert!(!cr.mounts.iter().any(|m| m.container_path == "/etc/ld.so.preload"), "{cr:?}");
        assert!(cr.mounts.iter().any(|m| m.container_path == "/usr/local/vgpu/libvgpu.so"));
    });

    // The agent is killed and restarted: it registers again, and the allocation survives (the slice
    // is on disk, its pod still exists).
    let mut a = a;
    a.sigkill();
    a.spawn(&s);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.expect("re-registration").unwrap()
    });
    std::thread::sleep(Duration::from_millis(1500)); // a collection pass (register_interval_s = 1)
    let v = a.status().unwrap();
    assert!(v["slices"].as_array().unwrap().iter().any(|x| x["labels"]["pod"] == "train"), "{v}");
    // The restarted agent does not report the slice's earlier refusals again (they are in its region).
    std::thread::sleep(Duration::from_millis(3000));
    let refusals = cluster.lock().unwrap().events.iter().filter(|e| e["reason"] == "GPUMemoryQuotaExceeded").count();
    assert_eq!(refusals, 1, "{:?}", cluster.lock().unwrap().events);

    // The pod goes: its slice goes.
    cluster.lock().unwrap().pods.retain(|p| p["metadata"]["name"] != "train");
    wait("the deleted pod's slice removed", || {
        a.status().is_some_and(|v| !v["slices"].as_array().unwrap().iter().any(|x| x["labels"]["pod"] == "train"))
    });
    let _ = &mut s;
}

/// HAMi's protocol where the API server is not quiet: the pod is the node lock's, or none; a
/// conflicting write to the pod or the node is written again on the object as it now is; an
/// assignment that changed meanwhile, or a pod that cannot be annotated, leaves no slice behind.
#[test]
fn hami_mode_allocates_only_the_lock_s_pod_and_retries_conflicts_leaving_nothing_behind() {
    let s = Sim::new(Some(NODE));
    let g0 = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let one = |name: &str, bind: &str| {
        pod("ml", name, &format!("uid-{name}"), bind, &format!("{g0},NVIDIA,1000,0:;"), &["c"], &[])
    };
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1", "annotations": {}}}),
        pods: vec![one("a", "100"), one("b", "200"), one("c", "300"), one("d", "400")],
        rv: 10,
        ..Default::default()
    }));
    let Harness { kdir, rt, mut rx, _kubelet, a } =
        harness(&s, &cluster, "compat = \"hami\"\nregister_interval_s = 60\n");
    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    let slices = || a.status().unwrap()["slices"].as_array().unwrap().len();
    let ann = |name: &str, key: &str| {
        let c = cluster.lock().unwrap();
        c.pods.iter().find(|p| p["metadata"]["name"] == name).unwrap()["metadata"]["annotations"][key].clone()
    };
    rt.block_on(async {
        let mut c = kubelet::plugin(kdir.join(&reg.endpoint)).await;
        let ask = || dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g0}-0")] }] };
        // No lock: no pod is the scheduler's now, and the oldest pending one is not taken for it.
        let e = c.allocate(ask()).await.unwrap_err();
        assert!(e.message().contains("has no hami.io/mutex.lock annotation"), "{e}");
        assert_eq!((e.code(), slices()), (tonic::Code::FailedPrecondition, 0));
        assert_eq!(ann("a", "hami.io/bind-phase"), "allocating", "the oldest pending pod is untouched");
        // A lock naming a pod that is not pending (stale): refused, naming it.
        lock(&cluster, "ml", "gone");
        let e = c.allocate(ask()).await.unwrap_err();
        assert!(e.message().contains("names ml/gone") && e.message().contains("stale"), "{e}");
        assert_eq!(slices(), 0);

        // The lock's pod; two other writers change the pod first (its labels) and one the node:
        // both written again, the lock released.
        lock(&cluster, "ml", "b");
        {
            let mut cl = cluster.lock().unwrap();
            (cl.conflicts, cl.node_conflicts) = (2, 1);
            cl.concurrent = Some(json!({"metadata": {"labels": {"touched": "yes"}}}));
        }
        c.allocate(ask()).await.unwrap();
        assert_eq!(ann("b", "hami.io/bind-phase"), "success");
        assert_eq!(ann("b", "hami.io/vgpu-devices-to-allocate"), ";");
        assert_eq!(ann("a", "hami.io/bind-phase"), "allocating", "not the lock's pod");
        assert!(cluster.lock().unwrap().node["metadata"]["annotations"].get("hami.io/mutex.lock").is_none());
        assert_eq!(cluster.lock().unwrap().node["metadata"]["labels"]["touched"], "yes", "the other writer's change kept");
        assert_eq!(slices(), 1);

        // The scheduler changes the pod's assignment while the agent writes its answer: the answer
        // is not written over it, and the slice made for the old one goes.
        lock(&cluster, "ml", "c");
        {
            let mut cl = cluster.lock().unwrap();
            cl.conflicts = 1;
            cl.concurrent = Some(json!({"metadata": {"annotations": {"hami.io/vgpu-devices-to-allocate": format!("{g0},NVIDIA,2000,0:;")}}}));
        }
        let e = c.allocate(ask()).await.unwrap_err();
        assert!(e.message().contains("hami.io/vgpu-devices-to-allocate changed"), "{e}");
        assert_eq!(ann("c", "hami.io/vgpu-devices-to-allocate"), format!("{g0},NVIDIA,2000,0:;"), "the scheduler's");
        assert_eq!(slices(), 1, "only b's slice: c's went with the refusal");
        cluster.lock().unwrap().concurrent = None;

        // The pod cannot be annotated (the API server fails): the slice goes, nothing is left.
        lock(&cluster, "ml", "d");
        cluster.lock().unwrap().fail_pod_patches = 1;
        let e = c.allocate(ask()).await.unwrap_err();
        assert!(e.message().contains("etcdserver: request timed out"), "{e}");
        assert_eq!(slices(), 1, "d's slice removed");
        assert_eq!(ann("d", "hami.io/bind-phase"), "failed", "the failure recorded once the server answers");
        assert!(cluster.lock().unwrap().node["metadata"]["annotations"].get("hami.io/mutex.lock").is_none());
    });
}

/// HAMi v2.10 reserves each MIG device in `hami.io/vgpu-mig-allocations`: the agent makes that
/// profile at that placement, exactly (not where it would fit best), and writes back the MIG device
/// it made; the metrics name the container it went to.
#[test]
fn hami_mode_makes_the_mig_device_hami_reserved_and_says_which() {
    let (mut s, g1, cluster, Harness { kdir, rt, mut rx, _kubelet, a }) = hami_mig_node(|g1| {
        let mut p = pod("ml", "placed", "uid-placed", "100", &format!("{g1},NVIDIA,9984,0:;"), &["main"], &[]);
        p["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"] = format!(
            r#"[{{"containerIndex":0,"deviceIndex":0,"gpuUUID":"{g1}","profile":"1g.10gb","placement":{{"start":5,"size":1}}}}]"#
        )
        .into();
        p
    });
    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    let uuid = rt.block_on(async {
        let r = kubelet::allocate(kdir.join(&reg.endpoint), vec![format!("{g1}-0")]).await.unwrap();
        r.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].clone()
    });
    assert!(uuid.starts_with("MIG-"), "{uuid}");
    assert_eq!(h100_instances(&a), [("1g.10gb".to_string(), 5)], "at the reserved slice 5");
    let ann = cluster.lock().unwrap().pods[0]["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"].clone();
    let back: Value = serde_json::from_str(ann.as_str().unwrap()).unwrap();
    assert_eq!(back[0]["migUUID"], uuid.as_str(), "{back}");
    assert!(back[0]["gpuInstanceID"].is_u64() && back[0]["computeInstanceID"].is_u64(), "{back}");
    assert_eq!((back[0]["profile"].as_str(), back[0]["placement"]["start"].as_u64()), (Some("1g.10gb"), Some(5)));
    let (_, body) = a.scrape("/metrics");
    let info = body.lines().find(|l| l.starts_with("hami_mig_device_info{")).unwrap_or_default().to_string();
    for want in [
        "namespace=\"ml\"",
        "pod=\"placed\"",
        "container=\"main\"",
        "profile=\"1g.10gb\"",
        &format!("mig_uuid=\"{uuid}\""),
    ] {
        assert!(info.contains(want), "{want} missing from {info:?}");
    }

    // A reservation the GPU cannot make (no 1g.10gb starts at slice 7): refused, saying so.
    {
        let mut p = pod("ml", "off", "uid-off", "200", &format!("{g1},NVIDIA,9984,0:;"), &["main"], &[]);
        p["metadata"]["annotations"]["hami.io/vgpu-mig-allocations"] = format!(
            r#"[{{"containerIndex":0,"deviceIndex":0,"gpuUUID":"{g1}","profile":"1g.10gb","placement":{{"start":7,"size":1}}}}]"#
        )
        .into();
        cluster.lock().unwrap().pods.push(p);
    }
    lock(&cluster, "ml", "off");
    let e = rt.block_on(kubelet::allocate(kdir.join(&reg.endpoint), vec![format!("{g1}-1")])).unwrap_err();
    assert!(e.message().contains("no MIG profile 1g.10gb of 1 memory slices placed at slice 7"), "{e}");
    assert_eq!(h100_instances(&a), [("1g.10gb".to_string(), 5)], "nothing more made");
    let _ = &mut s;
}

fn vpod(ns: &str, name: &str, uid: &str, devices: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "1", "annotations": {
            "volcano.sh/bind-phase": "allocating", "volcano.sh/bind-time": "100", "volcano.sh/vgpu-node": "node1",
            "volcano.sh/devices-to-allocate": devices, "volcano.sh/vgpu-ids-new": devices}},
        "spec": {"nodeName": "node1", "containers": [{"name": "a"}, {"name": "b"}]},
    })
}

#[test]
fn volcano_mode_registers_three_resources_and_follows_its_annotations() {
    let mut s = Sim::new(Some(NODE));
    let st = s.status();
    let g0 = st["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let g1 = st["gpus"][1]["uuid"].as_str().unwrap().to_string();
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1",
                     "annotations": {"hamivgpu": "2026-11-29T10:00:00Z"}}}),
        // Volcano's encoding: containers joined by ';' without a trailing one; the second container has
        // no GPU. Memory in the scheduler's units, gpuMemoryFactor (memory_factor 1024 here): 2 GiB.
        pods: vec![vpod("batch", "job", "uid-job", &format!("{g1},NVIDIA,2,50:;"))],
        rv: 10,
        ..Default::default()
    }));
    let Harness { kdir, rt, mut rx, _kubelet, a: _a } = harness(
        &s,
        &cluster,
        "compat = \"volcano\"\nregister_interval_s = 1\nmemory_factor = 1024\nmemory_scaling = 2\n",
    );
    // Three resources, each on its own socket; all non-zero.
    let mut regs = BTreeMap::new();
    rt.block_on(async {
        while regs.len() < 3 {
            let r =
                tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.expect("three registrations").unwrap();
            regs.insert(r.resource_name.clone(), r.endpoint.clone());
        }
    });
    assert_eq!(
        regs.keys().cloned().collect::<Vec<_>>(),
        ["volcano.sh/vgpu-cores", "volcano.sh/vgpu-memory", "volcano.sh/vgpu-number"]
    );
    rt.block_on(async {
        let count = |sock: String| {
            let path = kdir.join(sock);
            async move {
                let mut c = kubelet::plugin(path).await;
                c.list_and_watch(dp::Empty {})
                    .await
                    .unwrap()
                    .into_inner()
                    .message()
                    .await
                    .unwrap()
                    .unwrap()
                    .devices
                    .len()
            }
        };
        assert_eq!(count(regs["volcano.sh/vgpu-number"].clone()).await, 20);
        assert_eq!(count(regs["volcano.sh/vgpu-cores"].clone()).await, 200);
        assert_eq!(
            count(regs["volcano.sh/vgpu-memory"].clone()).await,
            16 + 159,
            "8192 MiB and 81559 MiB, counted twice (memory_scaling 2), in 1024 MiB units"
        );
        let mut c = kubelet::plugin(kdir.join(&regs["volcano.sh/vgpu-number"])).await;
        let r = c
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g0}-3")] }],
            })
            .await
            .unwrap()
            .into_inner();
        let cr = &r.container_responses[0];
        assert_eq!(cr.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&g1));
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("2048m"));
        assert_eq!(cr.envs.get("CUDA_DEVICE_SM_LIMIT_0").map(String::as_str), Some("50"));
        assert_eq!(cr.envs.get("CUDA_OVERSUBSCRIBE").map(String::as_str), Some("true"));
        // The memory resource answers without allocating anything.
        let mut m = kubelet::plugin(kdir.join(&regs["volcano.sh/vgpu-memory"])).await;
        let e = m
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g1}-mem-0")] }],
            })
            .await
            .unwrap()
            .into_inner();
        assert!(e.container_responses[0].envs.is_empty());
    });
    let cl = cluster.lock().unwrap();
    let p = &cl.pods[0]["metadata"]["annotations"];
    assert_eq!(p["volcano.sh/devices-to-allocate"], ";", "consumed, joined Volcano's way");
    assert_eq!(p["volcano.sh/bind-phase"], "success");
    assert!(cl.node["metadata"]["annotations"].get("hamivgpu").is_none(), "the node lock is released");
    let reg = cl.node["metadata"]["annotations"]["volcano.sh/node-vgpu-register"].as_str().unwrap();
    assert!(reg.starts_with(&format!("{g0},10,16,NVIDIA-NVIDIA A100-SXM4-40GB,true,hami-core:{g1},10,159,")), "{reg}");
    // The handshake, written every registration: the node event that makes Volcano's scheduler
    // build the node's GPUs (it ignores a node it cached before its vGPU plugin came on).
    let hs = cl.node["metadata"]["annotations"]["volcano.sh/node-vgpu-handshake"].as_str().unwrap_or_default();
    assert!(hs.starts_with("Reported 20"), "{hs:?}");
    drop(cl);

    // The pod goes: its slice goes.
    let job = |v: &Value| v["slices"].as_array().unwrap().iter().any(|x| x["labels"]["pod"] == "job");
    assert!(_a.status().is_some_and(|v| job(&v)), "{:?}", _a.status());
    cluster.lock().unwrap().pods.clear();
    wait("the deleted pod's slice removed", || _a.status().is_some_and(|v| !job(&v)));
    let _ = &mut s;
}

#[test]
fn hami_mode_on_a_mig_gpu_makes_an_instance_per_container_and_destroys_it_with_the_pod() {
    let (mut s, g1, cluster, Harness { kdir, rt, mut rx, _kubelet, a }) =
        hami_mig_node(|g1| pod("ml", "infer", "uid-infer", "100", &format!("{g1},NVIDIA,15000,0:;"), &["main"], &[]));
    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    let uuid = rt.block_on(async {
        let mut c = kubelet::plugin(kdir.join(&reg.endpoint)).await;
        let r = c
            .allocate(dp::AllocateRequest {
                container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![format!("{g1}-0")] }],
            })
            .await
            .unwrap()
            .into_inner();
        let cr = r.container_responses[0].clone();
        assert_eq!(cr.envs.len(), 1, "only the MIG device, as HAMi does: {cr:?}");
        assert!(cr.mounts.is_empty());
        cr.envs["NVIDIA_VISIBLE_DEVICES"].clone()
    });
    assert!(uuid.starts_with("MIG-"), "{uuid}");
    let st: Value = serde_json::from_str(&a.ctl_ok(&["mig", "status", "--json"])).unwrap();
    let h100 = st["gpus"].as_array().unwrap().iter().find(|g| g["index"] == 1).unwrap().clone();
    let inst = h100["instances"].as_array().unwrap();
    assert_eq!(inst.len(), 1, "{h100}");
    assert_eq!(inst[0]["uuid"], uuid.as_str());
    let holder = inst[0]["holder"].as_str().unwrap_or_default();
    assert!(holder.starts_with("container ") && holder.contains("infer"), "held by the pod's container: {holder:?}");
    assert!(inst[0]["memory_total"].as_u64().unwrap() >= 15000 << 20, "fits the 15000 MiB asked: {}", inst[0]);
    assert_eq!(cluster.lock().unwrap().pods[0]["metadata"]["annotations"]["hami.io/bind-phase"], "success");

    // The pod goes: its instance goes.
    cluster.lock().unwrap().pods.clear();
    wait("the instance destroyed", || {
        let st: Value = serde_json::from_str(&a.ctl_ok(&["mig", "status", "--json"])).unwrap();
        st["gpus"].as_array().unwrap().iter().find(|g| g["index"] == 1).unwrap()["instances"]
            .as_array()
            .is_none_or(|v| v.is_empty())
    });
    let _ = &mut s;
}

/// The H100's MIG instances as `vgpuctl mig status --json` lists them: (name, start), in start order.
fn h100_instances(a: &Agent) -> Vec<(String, u64)> {
    let st: Value = serde_json::from_str(&a.ctl_ok(&["mig", "status", "--json"])).unwrap();
    let h100 = st["gpus"].as_array().unwrap().iter().find(|g| g["index"] == 1).unwrap().clone();
    let mut v: Vec<(String, u64)> = h100["instances"]
        .as_array()
        .map(|v| {
            v.iter().map(|i| (i["name"].as_str().unwrap_or("").to_string(), i["start"].as_u64().unwrap_or(0))).collect()
        })
        .unwrap_or_default();
    v.sort_by_key(|x| x.1);
    v
}

/// A HAMi-mode node whose H100 (GPU 1) is in MIG mode, with no layout, and one pending pod
/// (`pod(uuid of the H100)`): the simulator, the H100's UUID, the cluster, the harness.
fn hami_mig_node(pod: impl FnOnce(&str) -> Value) -> (Sim, String, Arc<Mutex<Cluster>>, Harness) {
    let s = Sim::new(Some(NODE));
    let g1 = s.status()["gpus"][1]["uuid"].as_str().unwrap().to_string();
    let first = pod(&g1);
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1", "annotations": {}}}),
        pods: vec![first.clone()],
        rv: 10,
        ..Default::default()
    }));
    // The scheduler has bound it: the node is locked for it.
    lock(&cluster, first["metadata"]["namespace"].as_str().unwrap(), first["metadata"]["name"].as_str().unwrap());
    let h = harness(&s, &cluster, "compat = \"hami\"\nregister_interval_s = 1\n");
    mig_on(&s, &h.a);
    (s, g1, cluster, h)
}

/// Turns MIG mode on for the H100 (GPU 1), with no layout: instances are made per request.
fn mig_on(s: &Sim, a: &Agent) {
    let mig = s.state.join("mig.yaml");
    std::fs::write(&mig, "version: v1\nmig-configs:\n  dynamic:\n    - devices: [1]\n      mig-enabled: true\n")
        .unwrap();
    a.ctl_ok(&["mig", "apply", "-f", mig.to_str().unwrap(), "--name", "dynamic"]);
}

#[test]
fn hami_mode_registers_mig_geometries_and_makes_the_instance_of_a_position_in_one() {
    // HAMi's scheduler names a MIG device by geometry index and position: geometry 2 of the H100 is
    // three 2g.20gb and one 1g.10gb, position 3 its 1g.10gb.
    let (mut s, g1, cluster, Harness { kdir, rt, mut rx, _kubelet, a }) = hami_mig_node(|g1| {
        pod("ml", "small", "uid-small", "100", &format!("{g1}[2-3],NVIDIA,9984,0:;"), &["main"], &[])
    });
    let st = s.status();
    // The register annotation names the geometries of the GPU in MIG mode, from its profile table.
    let registered = || -> Option<Vec<Value>> {
        let cl = cluster.lock().unwrap();
        let v: Vec<Value> =
            serde_json::from_str(cl.node["metadata"]["annotations"]["hami.io/node-nvidia-register"].as_str()?).ok()?;
        (v.iter().any(|d| d["mode"] == "mig" && d.get("migtemplate").is_some())).then_some(v)
    };
    wait("the H100's MIG geometries registered", || registered().is_some());
    let reg = registered().unwrap();
    let h100 = reg.iter().find(|d| d["id"] == g1.as_str()).unwrap();
    let geo = h100["migtemplate"].as_array().unwrap();
    assert_eq!(geo.len(), 6, "{h100}");
    assert_eq!(geo[0], json!([{"Name": "1g.10gb", "Core": 14, "Memory": 9984, "Count": 7}]));
    assert_eq!(
        geo[2],
        json!([{"Name": "2g.20gb", "Core": 28, "Memory": 20096, "Count": 3}, {"Name": "1g.10gb", "Core": 14, "Memory": 9984, "Count": 1}])
    );
    assert_eq!(geo[5], json!([{"Name": "7g.80gb", "Core": 100, "Memory": 81152, "Count": 1}]));
    let a100 = reg.iter().find(|d| d["id"] != g1.as_str()).unwrap();
    assert!(a100.get("migtemplate").is_none() && a100["mode"] == "hami-core", "{a100}");
    // vgpuctl shows them, and prints them for the scheduler's configuration.
    let table = a.ctl_ok(&["mig", "status"]);
    assert!(
        table.contains(
            "GPU 1 geometries: 0 1g.10gb (7x1g.10gb) | 1 1g.20gb (4x1g.20gb) | 2 2g.20gb (3x2g.20gb 1x1g.10gb)"
        ),
        "{table}"
    );
    let conf = a.ctl_ok(&["mig", "geometries", "--hami"]);
    assert!(conf.contains("- models: [\"H100 80GB HBM3\"]\n  allowedGeometries:\n  - - {name: \"1g.10gb\", core: 14, memory: 9984, count: 7}\n"), "{conf}");

    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    // Kubelet's Allocate for one container, of the replica IDs given (comma-separated).
    let allocate = |ids: &str| {
        rt.block_on(kubelet::allocate(kdir.join(&reg.endpoint), ids.split(',').map(String::from).collect()))
    };
    let r = allocate(&format!("{g1}-0")).unwrap();
    assert!(r.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].starts_with("MIG-"), "{r:?}");
    // The 1g.10gb goes where the three 2g.20gb of its geometry still fit: slice 6.
    assert_eq!(h100_instances(&a), [("1g.10gb".to_string(), 6)]);
    // A 2g.20gb of the same geometry (position 0) next.
    cluster.lock().unwrap().pods.push(pod(
        "ml",
        "mid",
        "uid-mid",
        "200",
        &format!("{g1}[2-0],NVIDIA,20096,0:;"),
        &["main"],
        &[],
    ));
    lock(&cluster, "ml", "mid");
    allocate(&format!("{g1}-1")).unwrap();
    let inst = h100_instances(&a);
    assert_eq!(inst.len(), 2, "{inst:?}");
    assert!(inst.iter().any(|(n, s)| n == "2g.20gb" && [0, 2, 4].contains(s)), "{inst:?}");
    // Refused, each saying why: a position in another geometry while the GPU is cut into this one;
    // one the geometry does not have; one on the A100, which is not in MIG mode; and a container
    // with two MIG devices whose second cannot be made (its first goes again).
    let g0 = st["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let refusals = [
        ("big", format!("{g1}[3-0],NVIDIA,40448,0:;"), format!("{g1}-2"), "holds a 2g.20gb instance"),
        ("odd", format!("{g1}[2-4],NVIDIA,9984,0:;"), format!("{g1}-3"), "geometry 2g.20gb has no position 4"),
        (
            "flat",
            format!("{g0}[0-0],NVIDIA,4864,0:;"),
            format!("{g1}-4"),
            "a MIG geometry position, on a GPU not in MIG mode",
        ),
        (
            "pair",
            format!("{g1}[2-1],NVIDIA,20096,0:{g1}[2-7],NVIDIA,20096,0:;"),
            format!("{g1}-5,{g1}-6"),
            "geometry 2g.20gb has no position 7",
        ),
    ];
    for (i, (name, devices, ids, why)) in refusals.iter().enumerate() {
        let t = (300 + i).to_string();
        cluster.lock().unwrap().pods.push(pod("ml", name, &format!("uid-{name}"), &t, devices, &["main"], &[]));
        lock(&cluster, "ml", name);
        let e = allocate(ids).unwrap_err();
        assert!(e.message().contains(why), "{name}: {e}");
    }
    {
        let cl = cluster.lock().unwrap();
        let phase = |n: &str| {
            cl.pods.iter().find(|p| p["metadata"]["name"] == n).unwrap()["metadata"]["annotations"]
                ["hami.io/bind-phase"]
                .clone()
        };
        assert_eq!((phase("small"), phase("mid")), (json!("success"), json!("success")));
        for (name, ..) in &refusals {
            assert_eq!(phase(name), json!("failed"), "{name}");
        }
    }
    assert_eq!(
        h100_instances(&a).len(),
        2,
        "nothing made for the refused ones, nor left of them: {:?}",
        h100_instances(&a)
    );
    let _ = &mut s;
}

#[test]
fn volcano_mode_follows_the_mig_geometries_of_the_schedulers_configuration() {
    let mut s = Sim::new(Some(NODE));
    let st = s.status();
    let g1 = st["gpus"][1]["uuid"].as_str().unwrap().to_string();
    // Volcano's device configuration, with its named groups; the agent reads the same file.
    let conf = s.state.join("volcano-vgpu-device-config.yaml");
    std::fs::write(
        &conf,
        "nvidia:\n  resourceCountName: volcano.sh/vgpu-number\n  deviceSplitCount: 5\n  gpuMemoryFactor: 1024\n  knownMigGeometries:\n  - models: [\"A100-SXM4-80GB\"]\n    allowedGeometries:\n    - group: other\n      geometries: [{name: 7g.80gb, memory: 81920, count: 1}]\n  - models: [\"H100 80GB HBM3\", \"H100-SXM5-80GB\"]\n    allowedGeometries:\n    - group: group1\n      geometries: [{name: 1g.10gb, memory: 10240, count: 7}]\n    - group: group3\n      geometries:\n      - {name: 3g.40gb, memory: 40960, count: 1}\n      - {name: 2g.20gb, memory: 20480, count: 1}\n      - {name: 1g.10gb, memory: 10240, count: 1}\n    - group: groupx\n      geometries: [{name: 1g.5gb, memory: 5120, count: 7}]\n",
    )
    .unwrap();
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1", "annotations": {}}}),
        // Volcano's MIG device: the GPU's UUID with [group-position]; position 1 of group3 its 2g.20gb.
        pods: vec![vpod("batch", "job", "uid-job", &format!("{g1}[group3-1],NVIDIA,20480,0:"))],
        rv: 10,
        ..Default::default()
    }));
    let Harness { kdir, rt, mut rx, _kubelet, a } = harness(
        &s,
        &cluster,
        &format!("compat = \"volcano\"\nregister_interval_s = 1\nmig_geometries_file = {:?}\n", conf.to_str().unwrap()),
    );
    mig_on(&s, &a);
    let sock = rt.block_on(async {
        loop {
            let r = tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap();
            if r.resource_name == "volcano.sh/vgpu-number" {
                break r.endpoint;
            }
        }
    });
    let r = rt.block_on(kubelet::allocate(kdir.join(&sock), vec![format!("{g1}-0")])).unwrap();
    let uuid = r.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(uuid.starts_with("MIG-"), "{uuid}");
    // The 2g.20gb leaves the 3g.40gb its half (slices 0-3 or 4-7) and the 1g.10gb a slice beside it.
    let inst = h100_instances(&a);
    assert_eq!(inst.len(), 1, "{inst:?}");
    assert_eq!(
        inst[0],
        ("2g.20gb".to_string(), 4),
        "the 2g.20gb at 4, leaving 0-3 for the 3g.40gb and 6 for the 1g.10gb"
    );
    assert_eq!(cluster.lock().unwrap().pods[0]["metadata"]["annotations"]["volcano.sh/bind-phase"], "success");
    // The configured geometries are the ones the agent shows (and would print back).
    let conf = a.ctl_ok(&["mig", "geometries"]);
    assert!(
        conf.contains("  - group: \"group3\"\n    geometries:\n    - {name: \"3g.40gb\", memory: 40960, count: 1}\n"),
        "{conf}"
    );
    assert!(!conf.contains("groupx"), "a geometry naming a profile the H100 lacks is left out: {conf}");
    // The agent says so too: a warning in the status while it lasts, logged once.
    let left = "GPU 1 (NVIDIA H100 80GB HBM3): 1 of the 3 MIG geometries mig_geometries_file gives it name profiles it lacks and are left out: groupx (1g.5gb)";
    let st = a.wait("the left-out geometry's warning", |v| v["warnings"].to_string().contains(left));
    // Nothing else: the memory unit is the scheduler's (memory_factor unset follows its
    // gpuMemoryFactor), and the replicas are not compared (Volcano's plugin takes them from its flags).
    assert_eq!(st["warnings"], json!([left]), "the H100's, nothing else: {st}");
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(a.log_text().matches(left).count(), 1, "logged once over several register passes:\n{}", a.log_text());
    // vgpuctl doctor says which GPUs the file does not fit: the A100 40GB matches none of its
    // models, and one of the H100's geometries names an A100 profile.
    let doctor_check = |cfg: &std::path::Path, name: &str| -> Option<Value> {
        let o = s.cmd(&bin("vgpuctl")).args(["--config", cfg.to_str().unwrap(), "doctor", "--json"]).output().unwrap();
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
        v.as_array().unwrap().iter().find(|c| c["name"] == name).cloned()
    };
    let doctor = |cfg: &std::path::Path| doctor_check(cfg, "mig-geometries").expect("a mig-geometries check");
    let d = doctor_check(&s.state.join("agent.toml"), "scheduler-config").expect("a scheduler-config check");
    assert_eq!(d["level"], "ok", "{d}");
    let d = doctor(&s.state.join("agent.toml"));
    assert_eq!(d["level"], "warn", "{d}");
    let detail = d["detail"].as_str().unwrap();
    assert!(detail.contains("GPU 0 (NVIDIA A100-SXM4-40GB) matches no models of the file"), "{detail}");
    assert!(
        detail.contains(
            "GPU 1 (NVIDIA H100 80GB HBM3): 2 of 3 geometries; left out, naming profiles it lacks: groupx (1g.5gb)"
        ),
        "{detail}"
    );
    // A file that leaves the H100 nothing fails.
    let bad = s.state.join("bad-geometries.yaml");
    std::fs::write(
        &bad,
        "- models: [H100, A100]\n  allowedGeometries:\n  - group: a\n    geometries: [{name: 1g.5gb, count: 7}]\n",
    )
    .unwrap();
    let bad_cfg = s.state.join("bad.toml");
    std::fs::write(&bad_cfg, format!("compat = \"volcano\"\nmig_geometries_file = {:?}\n", bad.to_str().unwrap()))
        .unwrap();
    let d = doctor(&bad_cfg);
    assert_eq!(d["level"], "fail", "{d}");
    assert!(
        d["detail"].as_str().unwrap().contains(
            "GPU 1 (NVIDIA H100 80GB HBM3): 0 of 1 geometries: every one names a profile it lacks: a (1g.5gb)"
        ),
        "{d}"
    );
    assert!(doctor_check(&bad_cfg, "scheduler-config").is_none(), "the geometries alone carry no settings");
    // Resources the agent does not serve fail (pods asking for them fit no node).
    let other = s.state.join("other-names.yaml");
    std::fs::write(&other, "nvidia:\n  resourceCountName: volcano.sh/gpu-number\n  gpuMemoryFactor: 1024\n  knownMigGeometries:\n  - models: [H100]\n    allowedGeometries:\n    - group: a\n      geometries: [{name: 7g.80gb, count: 1}]\n").unwrap();
    let other_cfg = s.state.join("other.toml");
    std::fs::write(&other_cfg, format!("compat = \"volcano\"\nmig_geometries_file = {:?}\n", other.to_str().unwrap()))
        .unwrap();
    let d = doctor_check(&other_cfg, "scheduler-config").expect("a scheduler-config check");
    assert_eq!(d["level"], "fail", "{d}");
    assert_eq!(
        d["detail"],
        "resourceCountName is volcano.sh/gpu-number, but the agent serves volcano.sh/vgpu-number: pods asking for volcano.sh/gpu-number fit no node",
        "{d}"
    );
    let _ = &mut s;
}

/// Volcano mode: a pod's `volcano.sh/vgpu-memory` means here what it means to Volcano's scheduler.
/// Unset, `memory_factor` is the scheduler's `gpuMemoryFactor`, or 1 MiB (Volcano's default); an
/// agent whose units differ from the scheduler's, or whose memory device list the kubelet could not
/// take, refuses to start, says what to set, and raises a Kubernetes Event on its Node.
#[test]
fn volcano_mode_refuses_memory_units_other_than_the_schedulers() {
    let s = Sim::new(Some(NODE));
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1", "annotations": {}}}),
        rv: 10,
        ..Default::default()
    }));
    let api = serve(cluster.clone());
    let kdir = s.state.join("kubelet");
    std::fs::create_dir_all(&kdir).unwrap();
    let scheduler = s.state.join("volcano-vgpu-device-config.yaml");
    std::fs::write(&scheduler, "nvidia:\n  resourceMemoryName: volcano.sh/vgpu-memory\n  gpuMemoryFactor: 1\n")
        .unwrap();
    let cfg = s.state.join("agent.toml");
    // A kubelet listens from the start: an agent that refuses never registers with it.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let _kubelet = rt.block_on(async { kubelet::start(&kdir, tx) });
    let run = |config: String| {
        std::fs::write(&cfg, config).unwrap();
        let o = s
            .cmd(&bin("vgpu-node-agent"))
            .env("VGPU_AGENT_KUBELET_DIR", &kdir)
            .env("VGPU_AGENT_KUBE_API", &api)
            .env("NODE_NAME", "node1")
            .args(["--config", cfg.to_str().unwrap(), "--state-dir", s.state.join("agent").to_str().unwrap()])
            .args(["--socket", s.state.join("agent.sock").to_str().unwrap(), "--metrics-address", "off"])
            .arg("--nvml-library")
            .arg(s.libs.join("libnvidia-ml.so.1"))
            .arg("run")
            .output()
            .unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    // The scheduler counts in MiB (its default), the agent was told GiB: refused, with the fix.
    let base = format!("compat = \"volcano\"\nmig_geometries_file = {:?}\n", scheduler.to_str().unwrap());
    let (code, err) = run(format!("{base}memory_factor = 1024\n"));
    assert_eq!(code, Some(2), "{err}");
    let why = "Volcano's scheduler counts volcano.sh/vgpu-memory in units of 1 MiB (gpuMemoryFactor in its device configuration), but memory_factor is 1024 MiB: a pod asking for 1000 would be placed for 1000.0 MiB and limited to 1000.0 GiB here. Set memory_factor = 1 (chart: memoryFactor), or leave it unset to follow the scheduler";
    assert!(err.contains(why), "{err}");
    {
        let c = cluster.lock().unwrap();
        assert_eq!(c.events.len(), 1, "{:?}", c.events);
        let e = &c.events[0];
        assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("Warning"), Some("VolcanoMemoryUnits")));
        assert_eq!(
            (e["involvedObject"]["kind"].as_str(), e["involvedObject"]["name"].as_str()),
            (Some("Node"), Some("node1"))
        );
        assert!(e["message"].as_str().unwrap().contains(why), "{e}");
    }
    // vgpuctl doctor, on the same configuration, fails the same check.
    let o = s.cmd(&bin("vgpuctl")).args(["--config", cfg.to_str().unwrap(), "doctor", "--json"]).output().unwrap();
    let checks: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
    let d = checks.as_array().unwrap().iter().find(|c| c["name"] == "scheduler-config").expect("the check").clone();
    let factor = "gpuMemoryFactor is 1 MiB, but the agent counts memory in 1024 MiB units (memory_factor)";
    assert_eq!((d["level"].as_str(), d["detail"].as_str()), (Some("fail"), Some(factor)), "{d}");

    // Unset, memory_factor is Volcano's default, 1 MiB: this node's 8 GiB and 80 GiB GPUs as one
    // device per MiB are more than the kubelet takes in one message. Refused, naming a factor that fits.
    let (code, err) = run("compat = \"volcano\"\n".into());
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "at memory_factor 1 MiB (Volcano's default unit) this node's volcano.sh/vgpu-memory is 89751 devices"
        ),
        "{err}"
    );
    let fits: u32 = err
        .split("set gpuMemoryFactor: ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a factor named: {err}"));
    assert!(err.contains(&format!("and memory_factor = {fits} here")), "{err}");
    assert_eq!(cluster.lock().unwrap().events.len(), 2, "an Event for this refusal too");
    let early = rx.try_recv().ok().map(|r| r.resource_name);
    assert_eq!(early, None, "a refusing agent registered with the kubelet (its list would be refused there)");
    // And it does fit: at that factor the agent starts and the kubelet takes the list.
    std::fs::write(&cfg, format!("compat = \"volcano\"\nmemory_factor = {fits}\n")).unwrap();
    let _a = Agent::start(
        &s,
        &[
            ("VGPU_AGENT_CONFIG", cfg.to_str().unwrap()),
            ("VGPU_AGENT_KUBELET_DIR", kdir.to_str().unwrap()),
            ("VGPU_AGENT_KUBE_API", &api),
            ("NODE_NAME", "node1"),
        ],
    );
    let sock = rt.block_on(async {
        loop {
            let r = tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap();
            if r.resource_name == "volcano.sh/vgpu-memory" {
                break r.endpoint;
            }
        }
    });
    let n = rt.block_on(async {
        let mut c = kubelet::plugin(kdir.join(sock)).await;
        c.list_and_watch(dp::Empty {}).await.unwrap().into_inner().message().await.unwrap().unwrap().devices.len()
    });
    assert_eq!(n as u32, 8192 / fits + 81559 / fits, "one device per {fits} MiB of each GPU");
}

#[test]
fn hami_mode_on_an_mps_node_registers_mps_gpus_and_gives_their_containers_mps() {
    // HAMi's per-node configuration puts node1 in `operatingmode: mps`: every GPU runs MPS, the
    // register annotation says so (HAMi's scheduler places pods asking `nvidia.com/vgpu-mode: mps`
    // there), and a pod it placed gets its GPU's daemon and its share as its MPS partition.
    let s = Sim::new(Some(NODE));
    let g1 = s.status()["gpus"][1]["uuid"].as_str().unwrap().to_string();
    let placed = pod("ml", "infer", "uid-infer", "100", &format!("{g1},NVIDIA,4000,30:;"), &["main"], &[]);
    let cluster = Arc::new(Mutex::new(Cluster {
        node: json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "resourceVersion": "1", "annotations": {}}}),
        pods: vec![placed],
        rv: 10,
        ..Default::default()
    }));
    lock(&cluster, "ml", "infer");
    let node_json = s.state.join("hami-node-config.json");
    std::fs::write(&node_json, r#"{"nodeconfig": [{"name": "node1", "operatingmode": "mps"}]}"#).unwrap();
    let control = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
    let config = format!(
        "compat = \"hami\"\nregister_interval_s = 1\nhami_node_config_file = {:?}\nmps_control = {control:?}\n",
        node_json.to_str().unwrap()
    );
    let Harness { kdir, rt, mut rx, _kubelet, a } = harness(&s, &cluster, &config);
    wait("the node annotation", || {
        cluster.lock().unwrap().node["metadata"]["annotations"]["hami.io/node-nvidia-register"].is_string()
    });
    let reg: Value = serde_json::from_str(
        cluster.lock().unwrap().node["metadata"]["annotations"]["hami.io/node-nvidia-register"].as_str().unwrap(),
    )
    .unwrap();
    assert_eq!((reg[0]["mode"].as_str(), reg[1]["mode"].as_str()), (Some("mps"), Some("mps")), "{reg}");
    let v = a.wait("both daemons", |v| (0..2).all(|i| v["gpus"][i]["mps"]["running"] == true));
    let pipe = v["gpus"][1]["mps"]["pipe_dir"].as_str().unwrap().to_string();
    let reg = rt.block_on(async { tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap() });
    let r = rt.block_on(kubelet::allocate(kdir.join(&reg.endpoint), vec![format!("{g1}-0")])).unwrap();
    let cr = &r.container_responses[0];
    assert_eq!(cr.envs.get("CUDA_MPS_PIPE_DIRECTORY").map(String::as_str), Some("/usr/local/vgpu/mps"));
    assert_eq!(cr.envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").map(String::as_str), Some("30"));
    assert_eq!(cr.envs.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").map(String::as_str), Some("0=4000M"));
    assert!(!cr.envs.contains_key("CUDA_DEVICE_SM_LIMIT_0"), "the share is the partition, not time: {:?}", cr.envs);
    assert!(
        cr.mounts.iter().any(|m| m.host_path == pipe && m.container_path == "/usr/local/vgpu/mps" && !m.read_only),
        "the GPU's pipe directory: {:?}",
        cr.mounts
    );
}

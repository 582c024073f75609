//! The agent as a Kubernetes DRA driver (`dra = "on"`), against a fake API server (a small HTTP
//! server on 127.0.0.1 that keeps objects as JSON, answers kube-rs's get/create/replace calls and
//! enforces resourceVersion on replace) and a fake kubelet (the plugin watcher's GetInfo and
//! NotifyRegistrationStatus, then NodePrepareResources and NodeUnprepareResources on the driver's
//! socket, in both API versions): the ResourceSlice, a claim's slice with its share of the GPU and
//! its CDI device, a replaced claim refused, the slice removed when the claim is unprepared or, never
//! unprepared, once the claim is gone, and a failing GPU's devices taken out of the pool; with
//! consumable capacity, claims sharing one device per GPU by the memory and cores they consumed.

mod common;
use common::agent::*;
use common::kubeapi::status;
use common::*;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vgpu_proto::dra::{health as hp, registration as reg, v1, v1beta1};

const NODE: &str =
    "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n[[gpu]]\nmodel = \"H100-80GB\"\n";
const DRIVER: &str = "gpu.vgpu.io";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

/// Objects by API path, and the last resourceVersion given.
#[derive(Default)]
struct Store {
    objects: BTreeMap<String, Value>,
    rv: u64,
    /// How many times each path was written.
    writes: BTreeMap<String, u32>,
    /// Drop the fields of consumable capacity from what is written, as an API server without the
    /// DRAConsumableCapacity feature gate does.
    no_consumable_capacity: bool,
    /// The versions of `resource.k8s.io` served (others answer 404).
    served: Vec<&'static str>,
}

/// What an API server of Kubernetes 1.34 serves of `resource.k8s.io`.
const SERVED_1_34: &[&str] = &["v1", "v1beta2", "v1beta1"];

fn serve(store: Arc<Mutex<Store>>) -> String {
    common::kubeapi::serve(move |method, target, body| handle(&store, method, target, body))
}

/// Rewrites the quantities of capacities (values and request policies) as an API server does, in a
/// canonical form of its own (here: whole GiB as `<n>Gi`, whole MiB as `<n>Mi`), so that the driver
/// must compare them by value; without consumable capacity, drops its fields.
fn canonical(o: &mut Value, no_consumable_capacity: bool) {
    fn quantities(v: &mut Value) {
        match v {
            Value::String(q) => match q.parse::<u64>() {
                Ok(n) if n > 0 && n % (1 << 30) == 0 => *q = format!("{}Gi", n >> 30),
                Ok(n) if n > 0 && n % (1 << 20) == 0 => *q = format!("{}Mi", n >> 20),
                _ => {}
            },
            Value::Array(a) => a.iter_mut().for_each(quantities),
            Value::Object(m) => m.values_mut().for_each(quantities),
            _ => {}
        }
    }
    let devices = o.get_mut("spec").and_then(|s| s.get_mut("devices")).and_then(Value::as_array_mut);
    for mut d in devices.into_iter().flatten() {
        if d.get("basic").is_some() {
            d = d.get_mut("basic").unwrap();
        }
        if no_consumable_capacity {
            d.as_object_mut().unwrap().remove("allowMultipleAllocations");
            for c in d["capacity"].as_object_mut().into_iter().flat_map(|m| m.values_mut()) {
                c.as_object_mut().unwrap().remove("requestPolicy");
            }
        }
        if let Some(c) = d.get_mut("capacity") {
            quantities(c);
        }
    }
}

/// Why a ResourceSlice is not valid in version `v` (a device of `v1beta1` is its name and `basic`;
/// later versions have no `basic`), as the API server would refuse it.
fn invalid_shape(v: &str, o: &Value) -> Option<String> {
    let devices = o["spec"]["devices"].as_array().cloned().unwrap_or_default();
    devices.iter().find_map(|d| {
        let keys: Vec<&str> = d.as_object()?.keys().map(String::as_str).collect();
        let ok = if v == "v1beta1" { keys == ["basic", "name"] } else { !keys.contains(&"basic") };
        (!ok).then(|| format!("{v} device {d}"))
    })
}

fn handle(store: &Mutex<Store>, method: &str, target: &str, body: &[u8]) -> (u16, Value) {
    let mut s = store.lock().unwrap();
    let path = target.split('?').next().unwrap().to_string();
    if (method, path.as_str()) == ("GET", "/apis") {
        let versions: Vec<Value> =
            s.served.iter().map(|v| json!({"groupVersion": format!("resource.k8s.io/{v}"), "version": v})).collect();
        let mut groups = vec![json!({"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}]})];
        if !versions.is_empty() {
            groups.push(json!({"name": "resource.k8s.io", "versions": versions, "preferredVersion": versions[0]}));
        }
        return (200, json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}));
    }
    let version = path.strip_prefix("/apis/resource.k8s.io/").map(|p| p.split('/').next().unwrap_or(""));
    if let Some(v) = version {
        if !s.served.contains(&v) {
            return status(404, "NotFound");
        }
        if matches!(method, "POST" | "PUT") {
            if let Some(e) = invalid_shape(v, &serde_json::from_slice(body).unwrap()) {
                return (
                    422,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422, "message": e}),
                );
            }
        }
    }
    match method {
        "GET" => s.objects.get(&path).map_or_else(|| status(404, "NotFound"), |o| (200, o.clone())),
        "POST" => {
            let mut o: Value = serde_json::from_slice(body).unwrap();
            canonical(&mut o, s.no_consumable_capacity);
            let at = format!("{path}/{}", o["metadata"]["name"].as_str().unwrap());
            if s.objects.contains_key(&at) {
                return status(409, "AlreadyExists");
            }
            s.rv += 1;
            o["metadata"]["resourceVersion"] = s.rv.to_string().into();
            o["metadata"]["uid"] = format!("uid-{}", s.rv).into();
            *s.writes.entry(at.clone()).or_default() += 1;
            s.objects.insert(at, o.clone());
            (201, o)
        }
        "PUT" => {
            let mut o: Value = serde_json::from_slice(body).unwrap();
            canonical(&mut o, s.no_consumable_capacity);
            let Some(cur) = s.objects.get(&path) else { return status(404, "NotFound") };
            if o["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
                return status(409, "Conflict");
            }
            s.rv += 1;
            o["metadata"]["resourceVersion"] = s.rv.to_string().into();
            *s.writes.entry(path.clone()).or_default() += 1;
            s.objects.insert(path, o.clone());
            (200, o)
        }
        "DELETE" => match s.objects.remove(&path) {
            Some(o) => {
                *s.writes.entry(path).or_default() += 1;
                (200, o)
            }
            None => status(404, "NotFound"),
        },
        _ => status(405, "MethodNotAllowed"),
    }
}

fn claim(ns: &str, name: &str, uid: &str, results: &[(&str, &str, &str, &str)]) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|(request, driver, pool, device)| json!({"request": request, "driver": driver, "pool": pool, "device": device}))
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "resourceVersion": "1"},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results}}},
    })
}

fn wait(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(15), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// NodePrepareResources (v1) on the driver's socket, as kubelet calls it.
fn prepare(rt: &tokio::runtime::Runtime, sock: &Path, claims: Vec<v1::Claim>) -> v1::NodePrepareResourcesResponse {
    rt.block_on(async {
        let mut c = v1::dra_plugin_client::DraPluginClient::new(vgpu_agent::sockets::unix_channel(sock).await.unwrap());
        c.node_prepare_resources(v1::NodePrepareResourcesRequest { claims }).await.unwrap().into_inner()
    })
}

/// NodeUnprepareResources (v1).
fn unprepare(rt: &tokio::runtime::Runtime, sock: &Path, claims: Vec<v1::Claim>) -> v1::NodeUnprepareResourcesResponse {
    rt.block_on(async {
        let mut c = v1::dra_plugin_client::DraPluginClient::new(vgpu_agent::sockets::unix_channel(sock).await.unwrap());
        c.node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims }).await.unwrap().into_inner()
    })
}

fn v1_claim(ns: &str, name: &str, uid: &str) -> v1::Claim {
    v1::Claim { namespace: ns.into(), uid: uid.into(), name: name.into() }
}

/// The fake API server (of Kubernetes 1.34) with node1's Node object, and the agent as a DRA driver
/// on node1 with `config` added to its configuration; the kubelet directory.
fn start(s: &Sim, config: &str) -> (Arc<Mutex<Store>>, Agent, std::path::PathBuf) {
    start_on(s, config, SERVED_1_34)
}

/// [`start`] with an API server that serves versions `served` of `resource.k8s.io`.
fn start_on(s: &Sim, config: &str, served: &[&'static str]) -> (Arc<Mutex<Store>>, Agent, std::path::PathBuf) {
    let store = Arc::new(Mutex::new(Store { served: served.to_vec(), ..Default::default() }));
    store.lock().unwrap().objects.insert(
        "/api/v1/nodes/node1".into(),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node1", "uid": "node-uid-1", "resourceVersion": "1"}}),
    );
    let api = serve(store.clone());
    let kubelet = s.state.join("kubelet");
    let cfg = s.state.join("agent.toml");
    std::fs::write(&cfg, format!("dra = \"on\"\ndevice_plugin = \"off\"\nslice_gc_grace_s = 2\n{config}")).unwrap();
    let a = Agent::start(
        s,
        &[
            ("VGPU_AGENT_CONFIG", cfg.to_str().unwrap()),
            ("VGPU_AGENT_KUBELET_DIR", kubelet.join("device-plugins").to_str().unwrap()),
            ("VGPU_AGENT_KUBE_API", &api),
            ("NODE_NAME", "node1"),
        ],
    );
    (store, a, kubelet)
}

/// Kubelet's watch of device health on the driver's socket: each report, as health by device name
/// (every device of pool `node1`, with its time).
fn watch_health(rt: &tokio::runtime::Runtime, sock: &Path) -> std::sync::mpsc::Receiver<BTreeMap<String, i32>> {
    let (health_tx, health_rx) = std::sync::mpsc::channel();
    let sock = sock.to_path_buf();
    rt.spawn(async move {
        let ch = vgpu_agent::sockets::unix_channel(&sock).await.unwrap();
        let mut c = hp::dra_resource_health_client::DraResourceHealthClient::new(ch);
        let mut stream = c.node_watch_resources(hp::NodeWatchResourcesRequest {}).await.unwrap().into_inner();
        while let Ok(Some(m)) = stream.message().await {
            let by: BTreeMap<String, i32> =
                m.devices.iter().map(|d| (d.device.as_ref().unwrap().device_name.clone(), d.health)).collect();
            assert!(m
                .devices
                .iter()
                .all(|d| d.device.as_ref().unwrap().pool_name == "node1" && d.last_updated_time > 0));
            if health_tx.send(by).is_err() {
                break;
            }
        }
    });
    health_rx
}

fn dra_socket(kubelet: &Path) -> std::path::PathBuf {
    kubelet.join("plugins").join(DRIVER).join("dra.sock")
}

#[test]
fn the_agent_is_a_dra_driver_for_claims_of_gpu_shares() {
    let s = Sim::new(Some(NODE));
    let g0 = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let (store, a, kubelet) = start(&s, "split_count = 8\n");

    // The ResourceSlice: both GPUs as 8 devices each, owned by the node; a device of GPU 0 has 1 GiB,
    // which the API server writes back as "1Gi".
    let at = format!("{SLICES}/node1-{DRIVER}");
    wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
    let rs = store.lock().unwrap().objects[&at].clone();
    let spec = &rs["spec"];
    assert_eq!((&spec["driver"], &spec["nodeName"]), (&json!(DRIVER), &json!("node1")), "{rs}");
    assert_eq!(spec["pool"], json!({"name": "node1", "generation": 1, "resourceSliceCount": 1}));
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 16);
    let d3 = devices.iter().find(|d| d["name"] == "gpu-0-3").expect("gpu-0-3");
    assert_eq!(d3["attributes"]["uuid"]["string"], g0.as_str());
    assert_eq!(d3["attributes"]["index"]["int"], 0);
    assert_eq!(d3["capacity"]["memory"]["value"], "1Gi");
    assert_eq!(d3["capacity"]["cores"]["value"], "12");
    assert_eq!(rs["metadata"]["ownerReferences"][0]["uid"], "node-uid-1");

    // Unchanged devices are not written again (their capacities compared by value).
    std::thread::sleep(Duration::from_millis(2500));
    let (writes, now) = {
        let st = store.lock().unwrap();
        (st.writes[&at], st.objects[&at].clone())
    };
    assert_eq!(writes, 1, "written once while nothing changed: {now}\n{}", a.log_text());
    assert_eq!(a.status().unwrap()["warnings"], json!([]), "no warnings");

    // Claims: three devices of GPU 0 for request "gpu" (one from another driver, ignored); a claim
    // replaced since kubelet learned of it.
    {
        let mut st = store.lock().unwrap();
        st.objects.insert(
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/train-gpu".into(),
            claim(
                "ml",
                "train-gpu",
                "c1a1-0001",
                &[
                    ("gpu", DRIVER, "node1", "gpu-0-3"),
                    ("gpu", DRIVER, "node1", "gpu-0-4"),
                    ("gpu", DRIVER, "node1", "gpu-0-7"),
                    ("nic", "net.example.com", "node1", "eth1"),
                ],
            ),
        );
        st.objects.insert(
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/old".into(),
            claim("ml", "old", "c1a1-0003", &[("gpu", DRIVER, "node1", "gpu-1-0")]),
        );
    }

    let (reg_sock, dra_sock) =
        (kubelet.join("plugins_registry").join(format!("{DRIVER}-reg.sock@localhost")), dra_socket(&kubelet));
    wait("the registration socket", || reg_sock.exists());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        // The plugin watcher's side of registration, with the HTTP/2 authority kubelet sends.
        let mut r = reg::registration_client::RegistrationClient::new(kubelet_style_channel(&reg_sock).await);
        let info = r.get_info(reg::InfoRequest {}).await.unwrap().into_inner();
        assert_eq!((info.r#type.as_str(), info.name.as_str()), ("DRAPlugin", DRIVER));
        assert_eq!(info.endpoint, dra_sock.display().to_string());
        assert_eq!(info.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]);
        r.notify_registration_status(reg::RegistrationStatus { plugin_registered: true, error: String::new() })
            .await
            .unwrap();

        let ch = vgpu_agent::sockets::unix_channel(&dra_sock).await.unwrap();
        let mut c = v1::dra_plugin_client::DraPluginClient::new(ch.clone());
        let req = v1::NodePrepareResourcesRequest {
            claims: vec![
                v1_claim("ml", "train-gpu", "c1a1-0001"),
                v1_claim("ml", "gone", "c1a1-0002"),
                v1_claim("ml", "old", "c1a1-0004"),
            ],
        };
        let resp = c.node_prepare_resources(req.clone()).await.unwrap().into_inner();
        assert_eq!(resp.claims.len(), 3, "every claim has an entry: {resp:?}");
        let ok = &resp.claims["c1a1-0001"];
        assert_eq!(ok.error, "");
        let got: Vec<(&str, &str, &str, &[String])> = ok
            .devices
            .iter()
            .map(|d| {
                (d.request_names[0].as_str(), d.pool_name.as_str(), d.device_name.as_str(), d.cdi_device_ids.as_slice())
            })
            .collect();
        let cdi = vec!["vgpu.io/slice=dra-c1a1-0001".to_string()];
        assert_eq!(
            got,
            [
                ("gpu", "node1", "gpu-0-3", cdi.as_slice()),
                ("gpu", "node1", "gpu-0-4", &[][..]),
                ("gpu", "node1", "gpu-0-7", &[][..])
            ],
            "the slice's CDI device once for the request"
        );
        assert!(resp.claims["c1a1-0002"].error.contains("reading claim ml/gone"), "{:?}", resp.claims["c1a1-0002"]);
        assert!(resp.claims["c1a1-0004"].error.contains("made again"), "{:?}", resp.claims["c1a1-0004"]);
        assert!(resp.claims["c1a1-0004"].devices.is_empty());

        // Preparing again (a kubelet restart) answers the same; so does the v1beta1 service.
        let again = c.node_prepare_resources(req).await.unwrap().into_inner();
        assert_eq!(again.claims["c1a1-0001"], *ok);
        let mut b = v1beta1::dra_plugin_client::DraPluginClient::new(ch.clone());
        let beta = b
            .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
                claims: vec![v1beta1::Claim {
                    namespace: "ml".into(),
                    uid: "c1a1-0001".into(),
                    name: "train-gpu".into(),
                }],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(beta.claims["c1a1-0001"].devices.len(), 3);
        assert_eq!(beta.claims["c1a1-0001"].devices[0].cdi_device_ids, cdi);
    });

    // The claim's slice: 3 of GPU 0's 8 shares, labelled with the claim, and its CDI spec.
    let detail: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "dra-c1a1-0001", "--json"])).unwrap();
    let gpus = detail["slice"]["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 1, "{detail}");
    assert_eq!(gpus[0]["gpu"], g0.as_str());
    assert_eq!(gpus[0]["memory"].as_u64(), Some(3 << 30), "{detail}");
    assert_eq!(gpus[0]["sm"], 37);
    assert_eq!(
        detail["slice"]["labels"],
        json!({"source": "dra", "namespace": "ml", "claim": "train-gpu", "claim-uid": "c1a1-0001"})
    );
    let spec_file = a.state.join("cdi").join("vgpu-dra-c1a1-0001.json");
    let spec: Value = serde_json::from_slice(&std::fs::read(&spec_file).unwrap()).unwrap();
    assert_eq!((&spec["kind"], &spec["devices"][0]["name"]), (&json!("vgpu.io/slice"), &json!("dra-c1a1-0001")));

    // Unprepared: the slice and its spec go; unpreparing again is not an error.
    for _ in 0..2 {
        let resp = unprepare(&rt, &dra_sock, vec![v1_claim("ml", "train-gpu", "c1a1-0001")]);
        assert_eq!(resp.claims["c1a1-0001"].error, "");
    }
    assert!(!a.ctl(&["inspect", "dra-c1a1-0001"]).status.success(), "the slice is gone");
    assert!(!spec_file.exists());

    // A claim kubelet never unprepares (its state lost): once the claim is gone, so is its slice.
    store.lock().unwrap().objects.insert(
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/left".into(),
        claim("ml", "left", "c1a1-0005", &[("gpu", DRIVER, "node1", "gpu-1-2")]),
    );
    let resp = prepare(&rt, &dra_sock, vec![v1_claim("ml", "left", "c1a1-0005")]);
    assert_eq!(resp.claims["c1a1-0005"].error, "");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(a.ctl(&["inspect", "dra-c1a1-0005"]).status.success(), "kept while its claim exists");
    store.lock().unwrap().objects.remove("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/left");
    wait("the slice of the gone claim removed", || !a.ctl(&["inspect", "dra-c1a1-0005"]).status.success());

    // Device health for kubelet: every device, healthy, at once.
    let health_rx = watch_health(&rt, &dra_sock);
    let first = health_rx.recv_timeout(Duration::from_secs(10)).expect("a health report");
    assert_eq!(first.len(), 16, "{first:?}");
    assert!(first.values().all(|h| *h == hp::HealthStatus::Healthy as i32), "{first:?}");
    // Sent again while nothing changes (kubelet holds a report only for a while).
    let again = health_rx.recv_timeout(Duration::from_secs(8)).expect("the report sent again");
    assert_eq!(again, first);

    // A GPU that fails (a critical XID) leaves the pool: its devices go, the generation rises; to
    // kubelet they are unhealthy.
    assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
    let t = Instant::now();
    let failed = loop {
        let m = health_rx.recv_timeout(Duration::from_secs(10)).expect("health reports go on");
        if m.get("gpu-1-0") == Some(&(hp::HealthStatus::Unhealthy as i32)) {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "GPU 1 never reported unhealthy: {m:?}");
    };
    assert_eq!(failed.len(), 16, "a failed GPU's devices are still reported: {failed:?}");
    for (name, h) in &failed {
        let want = if name.starts_with("gpu-1-") { hp::HealthStatus::Unhealthy } else { hp::HealthStatus::Healthy };
        assert_eq!(*h, want as i32, "{name}");
    }
    wait("the ResourceSlice without GPU 1", || {
        store.lock().unwrap().objects[&at]["spec"]["devices"].as_array().is_some_and(|d| d.len() == 8)
    });
    let rs = store.lock().unwrap().objects[&at].clone();
    assert_eq!(rs["spec"]["pool"]["generation"], 2);
    assert!(rs["spec"]["devices"].as_array().unwrap().iter().all(|d| d["attributes"]["index"]["int"] == 0));

    // vgpuctl doctor with the agent's configuration sees both sockets; not with a driver name
    // nothing serves.
    let doctor = |extra: &str| {
        let c = s.state.join("doctor.toml");
        std::fs::write(
            &c,
            format!(
                "socket = \"{}\"\nkubelet_dir = \"{}\"\ndra = \"on\"\ndevice_plugin = \"off\"\n{extra}",
                a.socket.display(),
                kubelet.join("device-plugins").display()
            ),
        )
        .unwrap();
        let o = s.cmd(&bin("vgpuctl")).args(["--config", c.to_str().unwrap(), "doctor", "--json"]).output().unwrap();
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
        v.as_array().unwrap().iter().find(|c| c["name"] == "dra").cloned().expect("a dra check")
    };
    assert_eq!(doctor("")["level"], "ok", "{}", doctor(""));
    assert_eq!(doctor("dra_driver = \"other.example.com\"\n")["level"], "fail");

    // A removed registration socket (a kubelet clean-up) is served again.
    std::fs::remove_file(&reg_sock).unwrap();
    wait("the registration socket again", || reg_sock.exists());
    drop(a);
}

#[test]
fn before_kubernetes_1_34_the_driver_speaks_v1beta2_or_v1beta1() {
    // Kubernetes 1.33 serves v1beta2 and v1beta1; 1.32 v1beta1 alone, where a device's fields but
    // its name go under `basic` (the fake server refuses a device of the wrong shape, and any other
    // version of resource.k8s.io).
    for (served, v) in [(&["v1beta2", "v1beta1"][..], "v1beta2"), (&["v1beta1"][..], "v1beta1")] {
        let s = Sim::new(Some(NODE));
        let (store, a, kubelet) = start_on(&s, "split_count = 4\ndra_mig = \"dynamic\"\n", served);
        let g0 = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_string();
        let at = format!("/apis/resource.k8s.io/{v}/resourceslices/node1-{DRIVER}");
        wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
        let rs = store.lock().unwrap().objects[&at].clone();
        assert_eq!(rs["apiVersion"], format!("resource.k8s.io/{v}"), "{rs}");
        let devices = rs["spec"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 8, "{rs}");
        let d2 = devices.iter().find(|d| d["name"] == "gpu-0-2").expect("gpu-0-2");
        let fields = if v == "v1beta1" { &d2["basic"] } else { d2 };
        assert_eq!(fields["attributes"]["uuid"]["string"], g0.as_str(), "{rs}");
        assert_eq!(fields["capacity"]["memory"]["value"], "2Gi", "{rs}");

        // Unchanged devices are not written again; dra_mig = "dynamic" is not for these versions.
        std::thread::sleep(Duration::from_millis(2500));
        assert_eq!(store.lock().unwrap().writes[&at], 1, "{}", a.log_text());
        let warnings = a.status().unwrap()["warnings"].to_string();
        assert!(warnings.contains("dra_mig = \\\"dynamic\\\" needs resource.k8s.io/v1"), "{warnings}");

        // A claim of two of GPU 0's four shares, read in that version, prepared through the v1beta1
        // service (what kubelet of 1.32 and 1.33 calls).
        let mut c = claim(
            "ml",
            "half",
            "c1a2-0001",
            &[("gpu", DRIVER, "node1", "gpu-0-1"), ("gpu", DRIVER, "node1", "gpu-0-2")],
        );
        c["apiVersion"] = format!("resource.k8s.io/{v}").into();
        store.lock().unwrap().objects.insert(format!("/apis/resource.k8s.io/{v}/namespaces/ml/resourceclaims/half"), c);
        let sock = dra_socket(&kubelet);
        wait("the DRA socket", || sock.exists());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let resp = rt.block_on(async {
            let mut b = v1beta1::dra_plugin_client::DraPluginClient::new(
                vgpu_agent::sockets::unix_channel(&sock).await.unwrap(),
            );
            let claims = vec![v1beta1::Claim { namespace: "ml".into(), uid: "c1a2-0001".into(), name: "half".into() }];
            b.node_prepare_resources(v1beta1::NodePrepareResourcesRequest { claims }).await.unwrap().into_inner()
        });
        let prepared = &resp.claims["c1a2-0001"];
        assert_eq!(prepared.error, "", "{v}");
        assert_eq!(prepared.devices[0].cdi_device_ids, ["vgpu.io/slice=dra-c1a2-0001"]);
        let detail: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "dra-c1a2-0001", "--json"])).unwrap();
        assert_eq!(detail["slice"]["gpus"][0]["memory"].as_u64(), Some(4 << 30), "{detail}");

        // GPU 1 in MIG mode offers its MIG device as it is, not partitions (no counter sets).
        apply_gpu1_layout(&s, &a, "one", &[("1g.10gb", 1)]);
        let names = || -> Vec<String> {
            let st = store.lock().unwrap();
            let devices = st.objects[&at]["spec"]["devices"].as_array().cloned().unwrap_or_default();
            devices
                .iter()
                .filter_map(|d| d["name"].as_str().filter(|n| !n.starts_with("gpu-0-")).map(String::from))
                .collect()
        };
        wait("GPU 1's MIG device in the pool", || {
            !names().is_empty() && !names().iter().any(|n| n.starts_with("gpu-1-"))
        });
        let mig = names();
        assert!(mig.len() == 1 && mig[0].starts_with("mig-"), "{mig:?}");
        let st = store.lock().unwrap();
        assert!(st.objects[&at]["spec"].get("sharedCounters").is_none(), "{}", st.objects[&at]);
    }

    // An API server without DRA (before 1.32, or with it off): the driver says why, and why it
    // cannot prepare a claim.
    let s = Sim::new(Some(NODE));
    let (_store, a, kubelet) = start_on(&s, "", &[]);
    let st = a.wait("the warning", |v| v["warnings"].to_string().contains("serves no version of resource.k8s.io"));
    assert!(st["warnings"].to_string().contains("v1beta1 (1.32)"), "{st}");
    let (_rt, _sock, resp) = prepare_claims(&kubelet, "c1a3", &["any"]);
    assert!(resp.claims["c1a3-0001"].error.contains("serves no version of resource.k8s.io"), "{resp:?}");
}

/// A claim's allocation of a shared device, with the capacity it consumed (None: none recorded).
fn shared(request: &str, device: &str, consumed: Option<(&str, &str)>) -> Value {
    let mut r = json!({"request": request, "driver": DRIVER, "pool": "node1", "device": device});
    if let Some((memory, cores)) = consumed {
        r["shareID"] = format!("s{}", memory.len() * 7 + cores.len()).into();
        r["consumedCapacity"] = json!({"memory": memory, "cores": cores});
    }
    r
}

/// Once the driver serves kubelet, NodePrepareResources (v1) for claims `names` of namespace `ml`,
/// whose UIDs are `<prefix>-0001`, `<prefix>-0002`, ... in that order; the runtime and socket for
/// more calls.
fn prepare_claims(
    kubelet: &Path,
    prefix: &str,
    names: &[&str],
) -> (tokio::runtime::Runtime, std::path::PathBuf, v1::NodePrepareResourcesResponse) {
    let sock = dra_socket(kubelet);
    wait("the DRA socket", || sock.exists());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let claims = names.iter().enumerate().map(|(i, n)| v1_claim("ml", n, &format!("{prefix}-{:04}", i + 1))).collect();
    let resp = prepare(&rt, &sock, claims);
    (rt, sock, resp)
}

fn put_claim(store: &Mutex<Store>, name: &str, uid: &str, results: Vec<Value>) {
    let mut c = claim("ml", name, uid, &[]);
    c["status"]["allocation"]["devices"]["results"] = Value::Array(results);
    store.lock().unwrap().objects.insert(format!("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/{name}"), c);
}

#[test]
fn with_consumable_capacity_claims_share_a_gpu_by_what_they_asked_for() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "dra_sharing = \"capacity\"\n");
    let st = a.wait("GPUs discovered", |v| v["gpus"].as_array().is_some_and(|g| g.len() == 2));
    let (g0, g1) = (st["gpus"][0]["uuid"].as_str().unwrap(), st["gpus"][1]["uuid"].as_str().unwrap());
    let total1 = st["gpus"][1]["memory_total"].as_u64().unwrap();

    // One device per GPU, allocatable many times: memory (all by default, in MiB steps) and cores
    // (none by default), as the API server writes them back.
    let at = format!("{SLICES}/node1-{DRIVER}");
    wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
    let rs = store.lock().unwrap().objects[&at].clone();
    let devices = rs["spec"]["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1"], "{rs}");
    assert_eq!(devices[0]["allowMultipleAllocations"], true);
    assert_eq!(devices[0]["attributes"]["uuid"]["string"], g0);
    assert_eq!(
        devices[0]["capacity"],
        json!({
            "memory": {"value": "8Gi", "requestPolicy": {"default": "8Gi", "validRange": {"min": "1Mi", "step": "1Mi"}}},
            "cores": {"value": "100", "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}}},
        })
    );
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(store.lock().unwrap().writes[&at], 1, "written once while nothing changed\n{}", a.log_text());

    // Two claims share GPU 0 (2 GiB and 30 %; 3 GiB and no cores asked: no SM limit); one was
    // allocated GPU 1 by a scheduler without consumable capacity (nothing recorded: all of it); one
    // claims more memory than GPU 0 has; one has two requests on GPU 0.
    put_claim(&store, "infer", "cc-0001", vec![shared("gpu", "gpu-0", Some(("2Gi", "30")))]);
    put_claim(&store, "notebook", "cc-0002", vec![shared("gpu", "gpu-0", Some(("3221225472", "0")))]);
    put_claim(&store, "whole", "cc-0003", vec![shared("gpu", "gpu-1", None)]);
    put_claim(&store, "huge", "cc-0004", vec![shared("gpu", "gpu-0", Some(("9Gi", "10")))]);
    put_claim(
        &store,
        "pair",
        "cc-0005",
        vec![shared("a", "gpu-0", Some(("1Gi", "20"))), shared("b", "gpu-0", Some(("512Mi", "25")))],
    );
    let (_rt, _, resp) = prepare_claims(&kubelet, "cc", &["infer", "notebook", "whole", "huge", "pair"]);
    for uid in ["cc-0001", "cc-0002", "cc-0003", "cc-0005"] {
        let r = &resp.claims[uid];
        assert_eq!(r.error, "", "{uid}");
        assert_eq!(r.devices[0].cdi_device_ids, [format!("vgpu.io/slice=dra-{uid}")], "{uid}: {r:?}");
    }
    assert_eq!(resp.claims["cc-0005"].devices.len(), 2, "a device per request, each with the slice");
    assert_eq!(resp.claims["cc-0005"].devices[1].cdi_device_ids, ["vgpu.io/slice=dra-cc-0005"]);
    let huge = &resp.claims["cc-0004"];
    assert!(huge.error.contains("consumes 9.0 GiB of GPU 0's memory, which offers 8.0 GiB"), "{huge:?}");

    let limits = |uid: &str| {
        let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", &format!("dra-{uid}"), "--json"])).unwrap();
        let g = &d["slice"]["gpus"][0];
        (g["gpu"].as_str().unwrap().to_string(), g["memory"].as_u64().unwrap(), g["sm"].as_u64().unwrap_or(0), d)
    };
    assert_eq!((limits("cc-0001").0.as_str(), limits("cc-0001").1, limits("cc-0001").2), (g0, 2 << 30, 30));
    assert_eq!((limits("cc-0002").1, limits("cc-0002").2), (3 << 30, 0));
    assert_eq!((limits("cc-0003").0.as_str(), limits("cc-0003").1, limits("cc-0003").2), (g1, total1 >> 20 << 20, 0));
    assert_eq!((limits("cc-0005").1, limits("cc-0005").2), ((1 << 30) + (512 << 20), 45), "the requests add up");
    assert!(!a.ctl(&["inspect", "dra-cc-0004"]).status.success(), "no slice for a refused claim");

    // What the container of "infer" runs with: its 2 GiB as its GPU, and no more.
    let (_, _, _, detail) = limits("cc-0001");
    let detail = &detail["slice"];
    let o = in_slice(&s, detail, RT).arg("info").output().unwrap();
    let info = lines(&o.stdout).pop().unwrap_or_default();
    assert_eq!(info["devices"][0]["total_mem"], 2u64 << 30, "{info}");
    let o = in_slice(&s, detail, RT).args(["alloc", "--size", "3g", "--chunk", "256m"]).output().unwrap();
    let first = lines(&o.stdout).into_iter().next().unwrap_or_default();
    assert_eq!(first["error"], "CUDA_ERROR_OUT_OF_MEMORY", "{o:?}");
    assert_eq!(first["allocated"], 7 * (256 << 20), "7 chunks of 256 MiB beside the context's 64: {o:?}");
    // The refusal is a Warning Event on the claim.
    let event = || {
        let st = store.lock().unwrap();
        st.objects.iter().find(|(k, _)| k.starts_with("/api/v1/namespaces/ml/events/")).map(|(_, e)| e.clone())
    };
    wait("the claim's Event", || event().is_some());
    let e = event().unwrap();
    assert_eq!(
        e["involvedObject"],
        json!({"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1", "namespace": "ml", "name": "infer",
               "uid": "cc-0001"}),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("quota 2048 MiB"), "{e}");

    // An API server without consumable capacity drops its fields; the driver writes the slice when
    // the devices change (GPU 1 fails), then leaves it, and says why claims get whole GPUs.
    store.lock().unwrap().no_consumable_capacity = true;
    assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
    wait("the ResourceSlice without GPU 1", || {
        store.lock().unwrap().objects[&at]["spec"]["devices"].as_array().is_some_and(|d| d.len() == 1)
    });
    let writes = store.lock().unwrap().writes[&at];
    std::thread::sleep(Duration::from_millis(4500));
    let rs = store.lock().unwrap().objects[&at].clone();
    assert_eq!(store.lock().unwrap().writes[&at], writes, "not rewritten for what the server drops: {rs}");
    assert!(rs["spec"]["devices"][0].get("allowMultipleAllocations").is_none());
    assert!(a.log_text().contains("dropped allowMultipleAllocations"), "{}", a.log_text());
    // The status says so too, for as long as it lasts.
    let st = a.wait("the warning in the status", |v| v["warnings"].as_array().is_some_and(|w| !w.is_empty()));
    let w = st["warnings"].as_array().unwrap();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].as_str().unwrap().contains("DRAConsumableCapacity feature gate"), "{w:?}");
    assert!(a.ctl_ok(&["status"]).contains("DRA: the API server dropped allowMultipleAllocations"));
    let (_, metrics) = a.scrape("/metrics");
    assert!(metrics.lines().any(|l| l == "vgpu_warnings_active 1"), "{metrics}");
}

/// Applies layout `name` to GPU 1 with `vgpuctl mig apply` (MIG mode on, `devices` as profile and
/// count); returns the layout file.
fn apply_gpu1_layout(s: &Sim, a: &Agent, name: &str, devices: &[(&str, u32)]) -> std::path::PathBuf {
    let mig = s.state.join("mig.yaml");
    let mut y = format!(
        "version: v1\nmig-configs:\n  {name}:\n    - devices: [1]\n      mig-enabled: true\n      mig-devices:\n"
    );
    for (profile, n) in devices {
        y.push_str(&format!("        \"{profile}\": {n}\n"));
    }
    std::fs::write(&mig, y).unwrap();
    a.ctl_ok(&["mig", "apply", "-f", mig.to_str().unwrap(), "--name", name]);
    mig
}

#[test]
fn mig_devices_are_offered_whole_and_prepared_for_one_claim_at_a_time() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "");
    let g1 = s.status()["gpus"][1]["uuid"].as_str().unwrap().to_string();
    let mig = apply_gpu1_layout(&s, &a, "mixed", &[("3g.40gb", 1), ("1g.10gb", 2)]);

    // GPU 0 as 10 replicas (not MIG); GPU 1 as its three MIG devices, named after their UUIDs.
    let at = format!("{SLICES}/node1-{DRIVER}");
    let devices = |store: &Mutex<Store>| -> Vec<Value> {
        store
            .lock()
            .unwrap()
            .objects
            .get(&at)
            .and_then(|o| o["spec"]["devices"].as_array().cloned())
            .unwrap_or_default()
    };
    wait("the ResourceSlice with MIG devices", || {
        devices(&store).iter().filter(|d| d["attributes"]["mig"]["bool"] == true).count() == 3
    });
    let all = devices(&store);
    assert_eq!(all.len(), 13, "{all:?}");
    assert!(all
        .iter()
        .filter(|d| d["name"].as_str().unwrap().starts_with("gpu-0-"))
        .all(|d| d["attributes"]["mig"]["bool"] == false));
    let migs: Vec<&Value> = all.iter().filter(|d| d["attributes"]["mig"]["bool"] == true).collect();
    let by_profile = |p: &str| -> Vec<(String, String)> {
        migs.iter()
            .filter(|d| d["attributes"]["profile"]["string"] == p)
            .map(|d| {
                (
                    d["name"].as_str().unwrap().to_string(),
                    d["attributes"]["uuid"]["string"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (big, small) = (by_profile("3g.40gb"), by_profile("1g.10gb"));
    assert_eq!((big.len(), small.len()), (1, 2), "{migs:?}");
    for d in &migs {
        let uuid = d["attributes"]["uuid"]["string"].as_str().unwrap();
        assert!(uuid.starts_with("MIG-"), "{d}");
        assert_eq!(d["name"].as_str().unwrap(), format!("mig-{}", uuid[4..].to_ascii_lowercase()));
        assert_eq!(d["attributes"]["parentUUID"]["string"], g1.as_str());
        assert_eq!(d["attributes"]["index"]["int"], 1);
        assert!(d["capacity"]["memory"]["value"].as_str().is_some(), "{d}");
    }

    let mig_result =
        |request: &str, device: &str| json!({"request": request, "driver": DRIVER, "pool": "node1", "device": device});
    put_claim(&store, "a", "cm-0001", vec![mig_result("gpu", &big[0].0)]);
    put_claim(&store, "b", "cm-0002", vec![mig_result("gpu", &big[0].0)]);
    put_claim(&store, "c", "cm-0003", vec![mig_result("gpu", &small[0].0), mig_result("gpu", &small[1].0)]);
    put_claim(&store, "mixed", "cm-0004", vec![mig_result("gpu", &small[0].0), mig_result("share", "gpu-0-0")]);
    put_claim(&store, "stale", "cm-0005", vec![mig_result("gpu", "mig-00000000-0000-0000-0000-000000000000")]);
    let (rt, sock, resp) = prepare_claims(&kubelet, "cm", &["a", "b", "c", "mixed", "stale"]);
    let spec_of = |uid: &str| a.state.join("cdi").join(format!("vgpu-mig-dra-{uid}.json"));
    let visible = |uid: &str| -> String {
        let spec: Value = serde_json::from_slice(&std::fs::read(spec_of(uid)).unwrap()).unwrap();
        assert_eq!((&spec["kind"], &spec["devices"][0]["name"]), (&json!("vgpu.io/mig"), &json!(format!("dra-{uid}"))));
        assert_eq!(spec["devices"][0]["containerEdits"]["mounts"], json!([]), "no slice, no library: {spec}");
        spec["devices"][0]["containerEdits"]["env"][0].as_str().unwrap().to_string()
    };
    let ra = &resp.claims["cm-0001"];
    assert_eq!(ra.error, "");
    assert_eq!(ra.devices[0].cdi_device_ids, ["vgpu.io/mig=dra-cm-0001"]);
    assert_eq!(visible("cm-0001"), format!("NVIDIA_VISIBLE_DEVICES={}", big[0].1));
    assert!(resp.claims["cm-0002"].error.contains("is prepared for claim ml/a"), "{:?}", resp.claims["cm-0002"]);
    assert!(!spec_of("cm-0002").exists());
    let rc = &resp.claims["cm-0003"];
    assert_eq!((rc.error.as_str(), rc.devices.len()), ("", 2), "{rc:?}");
    let mut both = [small[0].1.clone(), small[1].1.clone()];
    both.sort();
    assert_eq!(visible("cm-0003"), format!("NVIDIA_VISIBLE_DEVICES={}", both.join(",")));
    assert!(resp.claims["cm-0004"].error.contains("MIG devices and GPU shares"), "{:?}", resp.claims["cm-0004"]);
    assert!(resp.claims["cm-0005"].error.contains("no such MIG device"), "{:?}", resp.claims["cm-0005"]);
    assert!(!a.ctl(&["inspect", "dra-cm-0004"]).status.success(), "no slice for the refused claim");

    // The status says who holds which MIG device.
    let holder = |uuid: &str| -> String {
        let st = a.status().unwrap();
        let inst = st["gpus"][1]["mig"]["instances"].as_array().cloned().unwrap_or_default();
        let i = inst.iter().find(|i| i["uuid"] == uuid).unwrap_or_else(|| panic!("{uuid} in {st}"));
        i["holder"].as_str().unwrap_or_default().to_string()
    };
    wait("the holders in the status", || holder(&big[0].1) == "claim ml/a");
    assert_eq!((holder(&small[0].1), holder(&small[1].1)), ("claim ml/c".into(), "claim ml/c".into()));
    let table = a.ctl_ok(&["status"]);
    let line = format!("GPU 1 MIG 3g.40gb {}: claim ml/a", &big[0].1[..12]);
    assert!(table.contains(&line), "{line:?} in\n{table}");
    assert!(a.ctl_ok(&["mig", "status"]).contains("3g.40gb@"), "{}", a.ctl_ok(&["mig", "status"]));
    assert!(a.ctl_ok(&["mig", "status"]).contains("(claim ml/a)"), "{}", a.ctl_ok(&["mig", "status"]));

    // With admin access (monitoring beside the claim that holds it), the held device is given
    // again, whole, and "a" still holds it.
    let mut watch = mig_result("gpu", &big[0].0);
    watch["adminAccess"] = json!(true);
    put_claim(&store, "watch", "cm-0007", vec![watch]);
    let rw = prepare(&rt, &sock, vec![v1_claim("ml", "watch", "cm-0007")]);
    assert_eq!(rw.claims["cm-0007"].error, "");
    assert_eq!(rw.claims["cm-0007"].devices[0].cdi_device_ids, ["vgpu.io/admin=dra-cm-0007"]);
    let spec = a.state.join("cdi").join("vgpu-admin-dra-cm-0007.json");
    let spec: Value = serde_json::from_slice(&std::fs::read(spec).unwrap()).unwrap();
    assert_eq!(spec["devices"][0]["containerEdits"]["env"], json!([format!("NVIDIA_VISIBLE_DEVICES={}", big[0].1)]));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(holder(&big[0].1), "claim ml/a");

    // A layout change keeps the MIG devices given out, idle as they are (no process runs on them
    // yet), unless forced: seven 1g.10gb cannot be laid out around them.
    std::fs::write(
        &mig,
        "version: v1\nmig-configs:\n  mixed:\n    - devices: [1]\n      mig-enabled: true\n      mig-devices:\n        \"3g.40gb\": 1\n        \"1g.10gb\": 2\n  all-1g:\n    - devices: [1]\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n",
    )
    .unwrap();
    let o = a.ctl(&["mig", "apply", "-f", mig.to_str().unwrap(), "--name", "all-1g"]);
    let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprintln!("apply all-1g with MIG devices held: {said}");
    assert!(!o.status.success(), "refused: {said}");
    let st = a.status().unwrap();
    let uuids: Vec<&str> =
        st["gpus"][1]["mig"]["instances"].as_array().unwrap().iter().filter_map(|i| i["uuid"].as_str()).collect();
    for (_, u) in big.iter().chain(&small) {
        assert!(uuids.contains(&u.as_str()), "{u} kept: {st}");
    }

    // Unprepared, "a" lets its device go, and "b" gets it.
    assert_eq!(unprepare(&rt, &sock, vec![v1_claim("ml", "a", "cm-0001")]).claims["cm-0001"].error, "");
    assert!(!spec_of("cm-0001").exists());
    wait("held by nobody once unprepared", || holder(&big[0].1).is_empty());
    let rb = prepare(&rt, &sock, vec![v1_claim("ml", "b", "cm-0002")]);
    assert_eq!(rb.claims["cm-0002"].error, "");
    assert_eq!(visible("cm-0002"), format!("NVIDIA_VISIBLE_DEVICES={}", big[0].1));
    wait("held by b", || holder(&big[0].1) == "claim ml/b");

    // A claim kubelet never unprepares: once it is gone, so are its record and spec, and its devices
    // can be prepared for another.
    store.lock().unwrap().objects.remove("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/c");
    wait("the gone claim's MIG spec removed", || !spec_of("cm-0003").exists());
    put_claim(&store, "d", "cm-0006", vec![mig_result("gpu", &small[1].0)]);
    let rd = prepare(&rt, &sock, vec![v1_claim("ml", "d", "cm-0006")]);
    assert_eq!(rd.claims["cm-0006"].error, "");
    assert!(a.log_text().contains("devices released: the claim is gone"), "{}", a.log_text());
}

#[test]
fn an_xid_about_a_mig_instance_withdraws_its_device_alone() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "health_recovery_s = 3\n");
    apply_gpu1_layout(&s, &a, "mixed", &[("3g.40gb", 1), ("1g.10gb", 2)]);
    let at = format!("{SLICES}/node1-{DRIVER}");
    let names = |mig: bool| -> Vec<String> {
        let st = store.lock().unwrap();
        let devices = st.objects.get(&at).and_then(|o| o["spec"]["devices"].as_array().cloned()).unwrap_or_default();
        devices
            .iter()
            .filter(|d| d["attributes"]["mig"]["bool"] == mig)
            .map(|d| d["name"].as_str().unwrap().into())
            .collect()
    };
    wait("the ResourceSlice with MIG devices", || names(true).len() == 3);
    let instances = || a.status().unwrap()["gpus"][1]["mig"]["instances"].as_array().cloned().unwrap_or_default();
    let small = instances().into_iter().find(|i| i["name"].as_str().unwrap().ends_with("1g.10gb")).unwrap();
    let (gi, uuid) = (small["gpu_instance_id"].as_u64().unwrap(), small["uuid"].as_str().unwrap().to_string());
    let device = format!("mig-{}", uuid[4..].to_ascii_lowercase());
    assert!(names(true).contains(&device), "{:?}", names(true));

    // Device health as kubelet watches it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let health_rx = watch_health(&rt, &dra_socket(&kubelet));
    let healthy = hp::HealthStatus::Healthy as i32;
    let first = health_rx.recv_timeout(Duration::from_secs(10)).expect("a health report");
    assert!(first.len() == 13 && first.values().all(|h| *h == healthy), "{first:?}");

    // A critical XID that NVML says is about that GPU instance: its MIG device alone goes.
    let gi_arg = gi.to_string();
    let xid = ["xid", "--gpu", "1", "--code", "94", "--gpu-instance", &gi_arg, "--compute-instance", "0"];
    assert!(s.output(SIM, &xid).status.success());
    let t = Instant::now();
    let report = loop {
        let m = health_rx.recv_timeout(Duration::from_secs(10)).expect("health reports go on");
        if m.get(&device) == Some(&(hp::HealthStatus::Unhealthy as i32)) {
            break m;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{device} never reported unhealthy: {m:?}");
    };
    assert_eq!(report.len(), 13, "{report:?}");
    assert!(report.iter().all(|(n, h)| n == &device || *h == healthy), "only {device} unhealthy: {report:?}");
    wait("the ResourceSlice without that MIG device", || names(true).len() == 2);
    assert!(!names(true).contains(&device) && names(false).len() == 10, "{:?} {:?}", names(true), names(false));
    let st = a.status().unwrap();
    assert_eq!((st["gpus"][1]["healthy"].as_bool(), st["gpus"][1]["critical_xids"].as_u64()), (Some(true), Some(1)));
    for i in instances() {
        let bad = i["unhealthy"].as_bool().unwrap_or(false);
        assert_eq!(bad, i["uuid"] == uuid.as_str(), "{i}");
        let why = i["health_reason"].as_str().unwrap_or_default();
        assert!(if bad { why.starts_with("XID 94 at 20") } else { why.is_empty() }, "{i}");
    }
    // What the central scheduler is told: that instance unhealthy, the GPU healthy.
    let cap: Value = serde_json::from_str(&a.ctl_ok(&["capacity", "--json"])).unwrap();
    let g1 = &cap["capacity"]["gpus"][1];
    assert_eq!(g1["healthy"], true, "{g1}");
    for i in g1["mig"]["instances"].as_array().unwrap() {
        assert_eq!(i["unhealthy"].as_bool().unwrap_or(false), i["uuid"] == uuid.as_str(), "{i}");
    }
    let table = a.ctl_ok(&["status"]);
    let line = format!("GPU 1 MIG 1g.10gb {} (GPU instance {gi}) UNHEALTHY: XID 94 at", &uuid[..12]);
    assert!(table.contains(&line), "{line:?} in\n{table}");
    let (_, metrics) = a.scrape("/metrics");
    let series: Vec<&str> = metrics.lines().filter(|l| l.starts_with("vgpu_mig_device_healthy{")).collect();
    assert_eq!(series.len(), 3, "{series:?}");
    for l in &series {
        let want = if l.contains(&format!("mig_uuid=\"{uuid}\"")) { " 0" } else { " 1" };
        assert!(l.ends_with(want) && l.contains("gpu_instance_id="), "{l}");
    }
    let event = |reason: &str| {
        let st = store.lock().unwrap();
        st.objects.iter().find(|(k, e)| k.contains("/events/") && e["reason"] == reason).map(|(_, e)| e.clone())
    };
    wait("the MIGDeviceUnhealthy Event", || event("MIGDeviceUnhealthy").is_some());
    let e = event("MIGDeviceUnhealthy").unwrap();
    assert_eq!((e["involvedObject"]["kind"].as_str(), e["type"].as_str()), (Some("Node"), Some("Warning")), "{e}");
    assert!(e["message"].as_str().unwrap().contains(&format!("MIG device {uuid} (GPU instance {gi} of GPU 1")), "{e}");

    // On a GPU not in MIG mode an instance ID means nothing: the XID is the GPU's.
    assert!(s.output(SIM, &["xid", "--gpu", "0", "--code", "79", "--gpu-instance", "1"]).status.success());
    wait("GPU 0 unhealthy", || a.status().unwrap()["gpus"][0]["healthy"] == false);

    // Quiet for the recovery time: the MIG device is offered again.
    wait("the MIG device back in the ResourceSlice", || names(true).contains(&device));
    assert!(instances().iter().all(|i| !i["unhealthy"].as_bool().unwrap_or(false)), "{:?}", instances());
    wait("the MIGDeviceHealthy Event", || event("MIGDeviceHealthy").is_some());
}

#[test]
fn a_pool_of_more_devices_than_a_resource_slice_holds_spans_several() {
    let s = Sim::new(Some(NODE));
    let (store, a, _kubelet) = start(&s, "split_count = 70\n");
    let (first, second) = (format!("{SLICES}/node1-{DRIVER}"), format!("{SLICES}/node1-{DRIVER}-1"));
    let get = |p: &str| store.lock().unwrap().objects.get(p).cloned();
    wait("the pool's two ResourceSlices", || get(&first).is_some() && get(&second).is_some());
    let (one, two) = (get(&first).unwrap(), get(&second).unwrap());
    let pool = json!({"name": "node1", "generation": 1, "resourceSliceCount": 2});
    assert_eq!((&one["spec"]["pool"], &two["spec"]["pool"]), (&pool, &pool), "{one}\n{two}");
    let names = |o: &Value| -> Vec<String> {
        o["spec"]["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect()
    };
    let (n1, n2) = (names(&one), names(&two));
    assert_eq!((n1.len(), n2.len()), (128, 12), "the API's limit of 128 devices a slice");
    assert_eq!((n1[0].as_str(), n2[11].as_str()), ("gpu-0-0", "gpu-1-69"));
    assert_eq!(two["metadata"]["ownerReferences"][0]["uid"], "node-uid-1");
    std::thread::sleep(Duration::from_millis(2500));
    let writes = |p: &str| store.lock().unwrap().writes.get(p).copied().unwrap_or(0);
    assert_eq!((writes(&first), writes(&second)), (1, 1), "written once while nothing changed\n{}", a.log_text());

    // GPU 1 fails: 70 devices fit in one slice, written with the generation raised; the other goes.
    assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
    wait("the second ResourceSlice removed", || get(&second).is_none());
    let one = get(&first).unwrap();
    assert_eq!(one["spec"]["pool"], json!({"name": "node1", "generation": 2, "resourceSliceCount": 1}));
    assert_eq!(names(&one).len(), 70);
}

/// Whether this process may make mount namespaces (root, and `unshare` there); where the tests must
/// run whole (`VGPU_REQUIRE_RUNC`, set by `.ci/run`), it must.
fn can_unshare() -> bool {
    let ok = std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok || std::env::var_os("VGPU_REQUIRE_RUNC").is_none(), "unshare -m required but it fails here");
    ok
}

#[test]
fn claims_with_admin_access_see_their_gpus_whole_and_are_not_escapes() {
    let mut s = Sim::new(Some(NODE));
    let st = s.status();
    let gpu = |i: usize| st["gpus"][i]["uuid"].as_str().unwrap().to_string();
    let (g0, g1) = (gpu(0), gpu(1));
    let (store, a, kubelet) = start(&s, "split_count = 4\n");
    let result = |request: &str, device: &str, admin: bool| {
        let mut r = json!({"request": request, "driver": DRIVER, "pool": "node1", "device": device});
        if admin {
            r["adminAccess"] = json!(true);
        }
        r
    };
    // A user of a share of GPU 0; a monitor of GPUs 0 and 1 with admin access (GPU 0's share is the
    // user's, as the scheduler allocates with admin access); a claim of both kinds.
    put_claim(&store, "user", "ca-0001", vec![result("gpu", "gpu-0-0", false)]);
    put_claim(
        &store,
        "watch",
        "ca-0002",
        vec![result("gpu", "gpu-0-0", true), result("gpu", "gpu-1-3", true), result("more", "gpu-1-2", true)],
    );
    put_claim(&store, "half", "ca-0003", vec![result("gpu", "gpu-0-1", true), result("share", "gpu-0-2", false)]);
    let (rt, sock, resp) = prepare_claims(&kubelet, "ca", &["user", "watch", "half"]);
    assert_eq!(resp.claims["ca-0001"].error, "");
    let rw = &resp.claims["ca-0002"];
    assert_eq!(rw.error, "");
    let cdi: Vec<&[String]> = rw.devices.iter().map(|d| d.cdi_device_ids.as_slice()).collect();
    let admin = vec!["vgpu.io/admin=dra-ca-0002".to_string()];
    assert_eq!(cdi, [admin.as_slice(), &[][..], admin.as_slice()], "once per request: {rw:?}");
    assert!(!a.ctl(&["inspect", "dra-ca-0002"]).status.success(), "no slice: no limits");
    let spec: Value =
        serde_json::from_slice(&std::fs::read(a.state.join("cdi").join("vgpu-admin-dra-ca-0002.json")).unwrap())
            .unwrap();
    let mut both = [g0.clone(), g1.clone()];
    both.sort();
    let edits = &spec["devices"][0]["containerEdits"];
    assert_eq!((&spec["kind"], &spec["devices"][0]["name"]), (&json!("vgpu.io/admin"), &json!("dra-ca-0002")));
    assert_eq!(edits["env"], json!([format!("NVIDIA_VISIBLE_DEVICES={}", both.join(","))]));
    let record = a.state.join("dra-admin").join("dra-ca-0002.json");
    assert_eq!(
        edits["mounts"],
        json!([{"hostPath": record.display().to_string(), "containerPath": "/run/vgpu-admin/dra-ca-0002.json",
            "options": ["bind", "ro"]}])
    );
    assert!(resp.claims["ca-0003"].error.contains("admin access and without"), "{:?}", resp.claims["ca-0003"]);
    assert!(!a.ctl(&["inspect", "dra-ca-0003"]).status.success());

    if !can_unshare() {
        skipped("the escape part: cannot make a mount namespace here");
        return;
    }
    // On GPU 0, which the user's slice uses: a process outside every slice is an escape; one in the
    // monitor's container (its own mount namespace with the record mounted where the CDI spec
    // says) is not.
    let (outsider, _) = s.spawn(RT, &["alloc", "--size", "100m", "--hold"]);
    let script = "mount -t tmpfs vgpu-test /run && mkdir /run/vgpu-admin && touch /run/vgpu-admin/dra-ca-0002.json \
                  && mount --bind -o ro \"$VGPU_TEST_RECORD\" /run/vgpu-admin/dra-ca-0002.json && exec \"$0\" \"$@\"";
    let mut c = s.cmd("unshare");
    c.env("VGPU_TEST_RECORD", &record).args(["-m", "--propagation", "private", "sh", "-c", script, RT]);
    let (watcher, _) = s.spawn_cmd(c, &["alloc", "--size", "100m", "--hold"]);
    let escaped = |v: &Value, pid: u32| v["escapes"].as_array().unwrap().iter().any(|e| e["pid"] == pid);
    let passes = |v: &Value| v["agent"]["passes"].as_u64().unwrap();
    let st = a.wait("the outsider's escape", |v| escaped(v, outsider));
    let from = passes(&st);
    let st = a.wait("three more passes", |v| passes(v) >= from + 3);
    assert!(escaped(&st, outsider) && !escaped(&st, watcher), "only the outsider: {st}");
    let admitted = &st["gpus"][0]["admin_processes"];
    assert_eq!((admitted[0]["pid"].as_u64(), admitted[0]["claim"].as_str()), (Some(watcher as u64), Some("ml/watch")));
    assert_eq!(admitted.as_array().unwrap().len(), 1, "{st}");
    let table = a.ctl_ok(&["status"]);
    assert!(table.contains(&format!("GPU 0 admin access: pid {watcher} (")), "{table}");
    assert!(table.contains("of claim ml/watch"), "{table}");
    let (_, metrics) = a.scrape("/metrics");
    let line = format!("vgpu_gpu_admin_processes{{device_uuid=\"{g0}\",device_index=\"0\"}} 1");
    assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    // Unprepared, the monitor's claim no longer admits its process.
    assert_eq!(unprepare(&rt, &sock, vec![v1_claim("ml", "watch", "ca-0002")]).claims["ca-0002"].error, "");
    assert!(!record.exists());
    a.wait("the watcher an escape once its claim is unprepared", |v| escaped(v, watcher));
}

#[test]
fn a_container_is_given_one_claim_of_the_driver() {
    let s = Sim::new(Some(NODE));
    let (store, _a, kubelet) = start(&s, "split_count = 4\n");
    let result =
        |device: &str, driver: &str| json!({"request": "r", "driver": driver, "pool": "node1", "device": device});
    let reserved = |store: &Mutex<Store>, name: &str, pod: &str| {
        let mut st = store.lock().unwrap();
        let c = st.objects.get_mut(&format!("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/{name}")).unwrap();
        c["status"]["reservedFor"] = json!([{"resource": "pods", "name": pod, "uid": format!("{pod}-uid")}]);
    };
    // Pod p1: container "main" uses claim a (named) and claim b (from a template), both of this
    // driver; container "side" uses claim n of another driver and claim a.
    put_claim(&store, "two-a", "cc-0001", vec![result("gpu-0-0", DRIVER)]);
    put_claim(&store, "p1-b-x7", "cc-0002", vec![result("gpu-1-0", DRIVER)]);
    put_claim(&store, "net", "cc-0003", vec![result("eth1", "net.example.com")]);
    put_claim(&store, "alone", "cc-0004", vec![result("gpu-1-1", DRIVER)]);
    for (c, p) in [("two-a", "p1"), ("p1-b-x7", "p1"), ("net", "p2"), ("alone", "p2")] {
        reserved(&store, c, p);
    }
    let pod = |name: &str, containers: Value, claims: Value, generated: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "uid": format!("{name}-uid"), "resourceVersion": "1"},
            "spec": {"containers": containers, "resourceClaims": claims},
            "status": {"resourceClaimStatuses": generated}})
    };
    let uses = |name: &str, claims: &[&str]| json!({"name": name, "resources": {"claims": claims.iter().map(|c| json!({"name": c})).collect::<Vec<_>>()}});
    {
        let mut st = store.lock().unwrap();
        st.objects.insert(
            "/api/v1/namespaces/ml/pods/p1".into(),
            pod(
                "p1",
                json!([uses("main", &["a", "b"]), uses("side", &["a"])]),
                json!([{"name": "a", "resourceClaimName": "two-a"}, {"name": "b", "resourceClaimTemplateName": "t"}]),
                json!([{"name": "b", "resourceClaimName": "p1-b-x7"}]),
            ),
        );
        // Pod p2: one container with a claim of this driver and one of another: fine.
        st.objects.insert(
            "/api/v1/namespaces/ml/pods/p2".into(),
            pod(
                "p2",
                json!([uses("main", &["g", "n"])]),
                json!([{"name": "g", "resourceClaimName": "alone"}, {"name": "n", "resourceClaimName": "net"}]),
                json!([]),
            ),
        );
    }
    let (_rt, _sock, resp) = prepare_claims(&kubelet, "cc", &["two-a", "p1-b-x7"]);
    for uid in ["cc-0001", "cc-0002"] {
        let e = &resp.claims[uid].error;
        assert!(e.contains("container main of pod ml/p1 uses claims"), "{uid}: {e}");
        assert!(e.contains("put the requests in one claim"), "{uid}: {e}");
    }
    let (_rt, _sock, resp) = prepare_claims(&kubelet, "cc", &["x", "y", "z", "alone"]);
    assert_eq!(resp.claims["cc-0004"].error, "", "{resp:?}");
    // Its slice names the pod it is reserved for, as `vgpuctl status` shows it.
    let detail: Value = serde_json::from_str(&_a.ctl_ok(&["inspect", "dra-cc-0004", "--json"])).unwrap();
    assert_eq!(
        (&detail["slice"]["labels"]["pod"], &detail["slice"]["labels"]["pod-uid"]),
        (&json!("p2"), &json!("p2-uid"))
    );
    let status = _a.ctl_ok(&["status"]);
    assert!(status.contains("dra-cc-0004  (ml/p2 claim alone)"), "{status}");
}

/// The H100's MIG profiles as NVML gives them (name, placement starts, memory slices).
const H100_PROFILES: [(&str, &[u32], u32); 7] = [
    ("1g.10gb", &[0, 1, 2, 3, 4, 5, 6], 1),
    ("1g.10gb+me", &[0, 1, 2, 3, 4, 5, 6], 1),
    ("1g.20gb", &[0, 2, 4, 6], 2),
    ("2g.20gb", &[0, 2, 4], 2),
    ("3g.40gb", &[0, 4], 4),
    ("4g.40gb", &[0], 4),
    ("7g.80gb", &[0], 8),
];

#[test]
fn with_dynamic_mig_claims_get_instances_made_to_measure() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "dra_mig = \"dynamic\"\n");
    // GPU 1 (an H100) in MIG mode, with one instance made by hand.
    apply_gpu1_layout(&s, &a, "one", &[("1g.10gb", 1)]);
    let instances = || a.status().unwrap()["gpus"][1]["mig"]["instances"].as_array().cloned().unwrap_or_default();
    let by_hand = instances();
    assert_eq!(by_hand.len(), 1, "{by_hand:?}");
    let (hs, he) = {
        let start = by_hand[0]["start"].as_u64().unwrap() as u32;
        (start, start + by_hand[0]["size"].as_u64().unwrap() as u32)
    };

    // The pool: GPU 1's counter set in a slice of its own, then the devices: GPU 0's 10 replicas and
    // every placement of every profile of GPU 1 that the instance made by hand does not overlap.
    let slice = |k: usize| {
        let n = if k == 0 { format!("{SLICES}/node1-{DRIVER}") } else { format!("{SLICES}/node1-{DRIVER}-{k}") };
        store.lock().unwrap().objects.get(&n).cloned()
    };
    wait("the pool with counters", || {
        slice(0).is_some_and(|s| s["spec"]["sharedCounters"].is_array() && s["spec"]["pool"]["resourceSliceCount"] == 2)
            && slice(1).is_some_and(|s| s["spec"]["pool"] == slice(0).unwrap()["spec"]["pool"])
    });
    let counters = slice(0).unwrap();
    assert!(counters["spec"].get("devices").is_none(), "{counters}");
    let set = &counters["spec"]["sharedCounters"][0];
    assert_eq!(set["name"], "gpu-1-mig");
    let mut want = serde_json::Map::new();
    for k in 0..8 {
        want.insert(format!("memory-slice-{k}"), json!({"value": "1"}));
    }
    want.insert("compute".into(), json!({"value": "7"}));
    want.insert("media".into(), json!({"value": "1"}));
    assert_eq!(set["counters"], Value::Object(want));
    let devices = slice(1).unwrap()["spec"]["devices"].as_array().cloned().unwrap();
    let gen = slice(1).unwrap()["spec"]["pool"]["generation"].clone();
    let label = |p: &str| p.replace(['.', '+'], "-");
    let mut expected: Vec<String> = H100_PROFILES
        .iter()
        .flat_map(|(p, starts, size)| {
            starts
                .iter()
                .filter(move |&&st| st + size <= hs || st >= he)
                .map(move |st| format!("gpu-1-mig-{}-{st}", label(p)))
        })
        .collect();
    expected.sort();
    let mut have: Vec<String> = devices
        .iter()
        .filter(|d| d["attributes"]["index"]["int"] == 1)
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect();
    have.sort();
    assert_eq!(have, expected, "GPU 1's partitions around the instance at [{hs}, {he})");
    assert_eq!(devices.len(), 10 + expected.len());
    // (The applier puts one 1g.10gb at the last slice it can take.)
    assert_eq!((hs, he), (6, 7), "{by_hand:?}");
    // The 3g.40gb at memory slice 0, and what it consumes.
    let name = "gpu-1-mig-3g-40gb-0".to_string();
    let d = devices.iter().find(|d| d["name"] == name.as_str()).expect("a free 3g.40gb");
    assert_eq!(d["capacity"]["memory"]["value"], "40448Mi");
    assert_eq!(d["attributes"]["profile"]["string"], "3g.40gb");
    assert_eq!(d["attributes"]["placement"]["int"], 0);
    let consumed = &d["consumesCounters"][0];
    assert_eq!(consumed["counterSet"], "gpu-1-mig");
    let mut c: Vec<&String> = consumed["counters"].as_object().unwrap().keys().collect();
    c.sort();
    assert_eq!(c, ["compute", "memory-slice-0", "memory-slice-1", "memory-slice-2", "memory-slice-3"]);
    assert_eq!(consumed["counters"]["compute"]["value"], "3");
    let me = devices.iter().find(|d| d["name"] == "gpu-1-mig-1g-10gb-me-5").expect("a 1g.10gb+me");
    assert_eq!(me["consumesCounters"][0]["counters"]["media"]["value"], "1");

    // Claims, prepared in this order: "p" the 3g.40gb; "s" a 1g.10gb at slice 4 and a 2g.20gb
    // overlapping p's (as a scheduler without partitionable devices might allocate): refused, and
    // its 1g.10gb destroyed again; "q" a 1g.10gb at 4 and a 1g.10gb+me at 5; "r" one overlapping p's.
    let part =
        |request: &str, device: &str| json!({"request": request, "driver": DRIVER, "pool": "node1", "device": device});
    put_claim(&store, "p", "cd-0001", vec![part("gpu", &name)]);
    put_claim(&store, "s", "cd-0002", vec![part("gpu", "gpu-1-mig-1g-10gb-4"), part("gpu", "gpu-1-mig-2g-20gb-2")]);
    put_claim(&store, "q", "cd-0003", vec![part("a", "gpu-1-mig-1g-10gb-4"), part("b", "gpu-1-mig-1g-10gb-me-5")]);
    put_claim(&store, "r", "cd-0004", vec![part("gpu", "gpu-1-mig-2g-20gb-0")]);
    let (rt, sock, resp) = prepare_claims(&kubelet, "cd", &["p", "s", "q", "r"]);
    let visible = |uid: &str| -> Vec<String> {
        let spec: Value = serde_json::from_slice(
            &std::fs::read(a.state.join("cdi").join(format!("vgpu-mig-dra-{uid}.json"))).unwrap(),
        )
        .unwrap();
        let env = spec["devices"][0]["containerEdits"]["env"][0].as_str().unwrap().to_string();
        env.strip_prefix("NVIDIA_VISIBLE_DEVICES=").unwrap().split(',').map(String::from).collect()
    };
    assert_eq!(resp.claims["cd-0001"].error, "", "{resp:?}");
    assert_eq!(resp.claims["cd-0001"].devices[0].cdi_device_ids, ["vgpu.io/mig=dra-cd-0001"]);
    assert!(resp.claims["cd-0002"].error.contains("making a 2g.20gb instance at memory slice 2"), "{resp:?}");
    assert_eq!(resp.claims["cd-0003"].error, "", "s's 1g.10gb was destroyed again: {resp:?}");
    assert!(resp.claims["cd-0004"].error.contains("making a 2g.20gb instance"), "{:?}", resp.claims["cd-0004"]);
    wait("the claims' instances in the status", || instances().len() >= 4);
    let now = instances();
    let of =
        |uuid: &str| now.iter().find(|i| i["uuid"] == uuid).cloned().unwrap_or_else(|| panic!("{uuid} in {now:?}"));
    let p_uuid = visible("cd-0001");
    assert_eq!(p_uuid.len(), 1);
    let pi = of(&p_uuid[0]);
    assert_eq!((pi["start"].as_u64(), pi["name"].as_str().map(|n| n.ends_with("3g.40gb"))), (Some(0), Some(true)));
    assert_eq!(pi["holder"], "claim ml/p");
    let q_uuids = visible("cd-0003");
    let mut starts: Vec<u64> = q_uuids.iter().map(|u| of(u)["start"].as_u64().unwrap()).collect();
    starts.sort();
    assert_eq!(starts, [4, 5]);
    assert!(q_uuids.iter().all(|u| of(u)["holder"] == "claim ml/q"));
    assert_eq!(now.len(), 4, "by hand, p's and q's two; none left of r's or s's: {now:?}");

    // Prepared again: the same instance. The pool does not change for the claims' instances.
    let again = prepare(&rt, &sock, vec![v1_claim("ml", "p", "cd-0001")]);
    assert_eq!(again.claims["cd-0001"].error, "");
    assert_eq!(visible("cd-0001"), p_uuid);
    assert_eq!(instances().len(), 4);
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(slice(1).unwrap()["spec"]["pool"]["generation"], gen, "the pool unchanged");

    // Unprepared, p's instance is destroyed; q's go when the claim does.
    assert_eq!(unprepare(&rt, &sock, vec![v1_claim("ml", "p", "cd-0001")]).claims["cd-0001"].error, "");
    wait("p's instance destroyed", || !instances().iter().any(|i| i["uuid"] == p_uuid[0].as_str()));
    assert_eq!(unprepare(&rt, &sock, vec![v1_claim("ml", "p", "cd-0001")]).claims["cd-0001"].error, "");
    store.lock().unwrap().objects.remove("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/q");
    wait("q's instances destroyed once the claim is gone", || instances().len() == 1);
    assert_eq!(instances()[0]["uuid"], by_hand[0]["uuid"], "the instance made by hand is left alone");
    assert!(a.log_text().contains("MIG instance of a DRA claim destroyed"), "{}", a.log_text());

    // An agent killed while it made a claim's instances left a record of the one it had made (here
    // made through NVML and recorded by hand): preparing the claim again makes them all.
    let uuids = || -> Vec<String> {
        let d = s.mig(1, &["devices"]);
        d[0]["mig_devices"].as_array().unwrap().iter().map(|m| m["uuid"].as_str().unwrap().to_string()).collect()
    };
    let before = uuids();
    let r = s.mig(1, &["create:19@0"]);
    assert_eq!(r[0]["ret"], 0, "{r:?}");
    let gi = r[0]["id"].as_u64().unwrap();
    assert_eq!(s.mig(1, &[&format!("ci:{gi}:0")])[0]["ret"], 0);
    let uuid = uuids().into_iter().find(|u| !before.contains(u)).expect("the new MIG device");
    let record = json!({"namespace": "ml", "name": "t", "uid": "cd-0005", "devices": [uuid],
        "made": [{"gpu": 1, "gi": gi, "uuid": uuid}]});
    std::fs::write(a.state.join("dra-mig").join("dra-cd-0005.json"), record.to_string()).unwrap();
    put_claim(&store, "t", "cd-0005", vec![part("a", "gpu-1-mig-1g-10gb-0"), part("b", "gpu-1-mig-1g-10gb-1")]);
    let rt5 = prepare(&rt, &sock, vec![v1_claim("ml", "t", "cd-0005")]);
    assert_eq!(rt5.claims["cd-0005"].error, "", "{rt5:?}");
    let t_uuids = visible("cd-0005");
    assert_eq!(t_uuids.len(), 2, "both made: {t_uuids:?}");
    wait("t's two instances and the one by hand", || instances().len() == 3);
    let now = instances();
    let mut starts: Vec<u64> = t_uuids
        .iter()
        .map(|u| now.iter().find(|i| i["uuid"] == u.as_str()).unwrap()["start"].as_u64().unwrap())
        .collect();
    starts.sort();
    assert_eq!(starts, [0, 1], "{now:?}");
    assert!(a.log_text().contains("were made in part"), "{}", a.log_text());
}

/// What grpc-go, in kubelet's plugin watcher, sends as the `:authority` when it dials a socket by
/// its path: the path with every byte that RFC 3986 does not allow in an authority
/// percent-encoded.
fn grpc_go_authority(path: &Path) -> String {
    let keep = |c: u8| c.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&c);
    path.as_os_str()
        .as_encoded_bytes()
        .iter()
        .map(|&c| if keep(c) { (c as char).to_string() } else { format!("%{c:02X}") })
        .collect()
}

/// A channel to the socket at `path` whose requests carry the authority kubelet's sends.
async fn kubelet_style_channel(path: &Path) -> tonic::transport::Channel {
    let uri = format!("http://{}", grpc_go_authority(path));
    let p = path.to_owned();
    tonic::transport::Endpoint::from_shared(uri.clone())
        .unwrap_or_else(|e| panic!("kubelet's authority for {} is not a valid one ({uri}): {e}", path.display()))
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = p.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
        }))
        .await
        .unwrap()
}

#[test]
fn a_socket_path_is_a_valid_authority_only_with_a_host_after_an_at() {
    // The reason for the registration socket's name: without the `@`, the percent-encoded path is
    // the host, which the HTTP/2 server refuses.
    let plain = grpc_go_authority(Path::new("/var/lib/kubelet/plugins_registry/gpu.vgpu.io-reg.sock"));
    assert!(plain.parse::<tonic::codegen::http::uri::Authority>().is_err(), "{plain}");
    let named = grpc_go_authority(Path::new("/var/lib/kubelet/plugins_registry/gpu.vgpu.io-reg.sock@localhost"));
    let a = named.parse::<tonic::codegen::http::uri::Authority>().unwrap();
    assert_eq!(a.host(), "localhost");
}

/// A claim's configuration for the driver (`config[].opaque.parameters`, from the claim or its
/// DeviceClass) can make its slice high-priority (docs/priority.md); another driver's cannot, and a
/// value other than high or normal is refused, naming it.
#[test]
fn a_claim_s_configuration_sets_its_slice_s_priority() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "dra_sharing = \"capacity\"\npriority_namespaces = [\"ml\"]\n");
    a.wait("GPUs discovered", |v| v["gpus"].as_array().is_some_and(|g| g.len() == 2));
    let at = format!("{SLICES}/node1-{DRIVER}");
    wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
    let config = |driver: &str, priority: &str| {
        json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": driver,
            "parameters": {"apiVersion": "gpu.vgpu.io/v1", "kind": "SliceConfig", "priority": priority}}}])
    };
    for (name, uid, cfg) in [
        ("svc", "pr-0001", config(DRIVER, "high")),
        ("bad", "pr-0002", config(DRIVER, "urgent")),
        ("batch", "pr-0003", config("other.example.com", "high")),
    ] {
        put_claim(&store, name, uid, vec![shared("gpu", "gpu-0", Some(("1Gi", "0")))]);
        let key = format!("/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/{name}");
        store.lock().unwrap().objects.get_mut(&key).unwrap()["status"]["allocation"]["devices"]["config"] = cfg;
    }
    let (_rt, _, resp) = prepare_claims(&kubelet, "pr", &["svc", "bad", "batch"]);
    let priority = |uid: &str| {
        let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", &format!("dra-{uid}"), "--json"])).unwrap();
        d["slice"]["priority"].as_str().unwrap().to_string()
    };
    assert_eq!(resp.claims["pr-0001"].error, "");
    assert_eq!(priority("pr-0001"), "high");
    assert!(
        resp.claims["pr-0002"].error.contains(r#"gives priority "urgent": "high" or "normal" is accepted"#),
        "{:?}",
        resp.claims["pr-0002"]
    );
    assert_eq!(
        (resp.claims["pr-0003"].error.as_str(), priority("pr-0003").as_str()),
        ("", "normal"),
        "another driver's"
    );
}

/// High priority is the administrator's grant (issue 61, item 20): a claim of a namespace that
/// `priority_namespaces` does not name gets a normal slice, and the status says why.
#[test]
fn priority_is_granted_only_to_the_namespaces_the_administrator_names() {
    let s = Sim::new(Some(NODE));
    let (store, a, kubelet) = start(&s, "dra_sharing = \"capacity\"\npriority_namespaces = [\"serving\"]\n");
    a.wait("GPUs discovered", |v| v["gpus"].as_array().is_some_and(|g| g.len() == 2));
    let at = format!("{SLICES}/node1-{DRIVER}");
    wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
    put_claim(&store, "svc", "pg-0001", vec![shared("gpu", "gpu-0", Some(("1Gi", "0")))]);
    let key = "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/svc";
    store.lock().unwrap().objects.get_mut(key).unwrap()["status"]["allocation"]["devices"]["config"] = json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER,
            "parameters": {"apiVersion": "gpu.vgpu.io/v1", "kind": "SliceConfig", "priority": "high"}}}]);
    let (_rt, _, resp) = prepare_claims(&kubelet, "pg", &["svc"]);
    assert_eq!(resp.claims["pg-0001"].error, "");
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "dra-pg-0001", "--json"])).unwrap();
    assert_eq!(d["slice"]["priority"], "normal", "{d}");
    let st = a.wait("the warning", |v| v["warnings"].to_string().contains("asked for high priority"));
    assert!(
        st["warnings"][0].as_str().unwrap().starts_with(
            "claim ml/svc asked for high priority; namespace \"ml\" may not have it (priority_namespaces)"
        ),
        "{}",
        st["warnings"]
    );
}

#[test]
fn a_gpu_that_runs_mps_says_so_and_its_claims_get_its_daemon() {
    // MPS on GPU 1: its devices carry `mps: true` (a DeviceClass or request selects by it), GPU
    // 0's `false`; a claim of a GPU 1 device is an MPS client on its share of the SMs.
    let s = Sim::new(Some(NODE));
    let control = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
    let (store, a, kubelet) = start(&s, &format!("split_count = 4\nmps_gpus = [\"1\"]\nmps_control = {control:?}\n"));
    let at = format!("{SLICES}/node1-{DRIVER}");
    wait("the ResourceSlice", || store.lock().unwrap().objects.contains_key(&at));
    let rs = store.lock().unwrap().objects[&at].clone();
    let mps = |name: &str| {
        let d = rs["spec"]["devices"].as_array().unwrap().iter().find(|d| d["name"] == name).cloned();
        d.unwrap_or_else(|| panic!("{name}: {rs}"))["attributes"]["mps"]["bool"].clone()
    };
    assert_eq!((mps("gpu-0-0"), mps("gpu-1-0")), (json!(false), json!(true)));
    let pipe = a.wait("the daemon", |v| v["gpus"][1]["mps"]["running"] == true)["gpus"][1]["mps"]["pipe_dir"].clone();
    store.lock().unwrap().objects.insert(
        "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/infer".into(),
        claim("ml", "infer", "c1a1-00m5", &[("gpu", DRIVER, "node1", "gpu-1-2")]),
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let r = prepare(&rt, &dra_socket(&kubelet), vec![v1_claim("ml", "infer", "c1a1-00m5")]);
    assert!(r.claims["c1a1-00m5"].error.is_empty(), "{r:?}");
    let spec: Value =
        serde_json::from_slice(&std::fs::read(a.state.join("cdi").join("vgpu-dra-c1a1-00m5.json")).unwrap()).unwrap();
    let edits = &spec["devices"][0]["containerEdits"];
    let env: Vec<&str> = edits["env"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for want in ["CUDA_MPS_PIPE_DIRECTORY=/usr/local/vgpu/mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"] {
        assert!(env.contains(&want), "{want} missing: {env:?}");
    }
    let mounts = edits["mounts"].as_array().unwrap();
    assert!(
        mounts.iter().any(|m| m["hostPath"] == pipe && m["containerPath"] == "/usr/local/vgpu/mps"),
        "the GPU's pipe directory: {mounts:?}"
    );
}

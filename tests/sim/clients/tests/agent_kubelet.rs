//! The agent's kubelet device plugin against a fake kubelet (our own tonic Registration server on a
//! Unix socket, as kubelet serves it): registration, ListAndWatch with health, preferred allocation,
//! Allocate checked field by field and its environment and mounts limiting a real process, and
//! re-registration when kubelet restarts; replica slices removed once kubelet's pod resources API
//! no longer lists their devices.

mod common;
use common::agent::*;
use common::kubelet::{plugin, pod, serve_pod_resources, start as start_kubelet, PodList};
use common::*;

use std::time::Duration;
use tokio::sync::mpsc;
use vgpu_proto::deviceplugin as dp;

const NODE: &str =
    "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n[[gpu]]\nmodel = \"H100-80GB\"\n";

async fn next_register(rx: &mut mpsc::UnboundedReceiver<dp::RegisterRequest>, what: &str) -> dp::RegisterRequest {
    tokio::time::timeout(Duration::from_secs(15), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no registration: {what}"))
        .unwrap()
}

/// A simulated node with a directory for kubelet's sockets, a runtime for the fake kubelet, and the
/// channel its Registration server reports to.
fn kubelet_node() -> (
    Sim,
    std::path::PathBuf,
    tokio::runtime::Runtime,
    mpsc::UnboundedSender<dp::RegisterRequest>,
    mpsc::UnboundedReceiver<dp::RegisterRequest>,
) {
    let s = Sim::new(Some(NODE));
    let kdir = s.state.join("kubelet");
    std::fs::create_dir_all(&kdir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    (s, kdir, rt, tx, rx)
}

#[test]
fn the_device_plugin_registers_lists_allocates_and_follows_kubelet_restarts() {
    let (mut s, kdir, rt, tx, mut rx) = kubelet_node();
    let stop = rt.block_on(async { start_kubelet(&kdir, tx.clone()) });
    // One configuration for unlike nodes: this node's [[node]] section gives it 10 replicas a GPU.
    let conf = s.state.join("agent.toml");
    std::fs::write(
        &conf,
        "split_count = 4\n[[node]]\nnames = [\"edge-*\"]\nsplit_count = 2\n[[node]]\nnames = [\"gpu-node-*\"]\nsplit_count = 10\n",
    )
    .unwrap();
    let a = Agent::start(
        &s,
        &[
            ("VGPU_AGENT_KUBELET_DIR", kdir.to_str().unwrap()),
            ("VGPU_AGENT_CONFIG", conf.to_str().unwrap()),
            ("NODE_NAME", "gpu-node-3"),
        ],
    );
    assert!(a.log_text().contains("a [[node]] section of the configuration applies"), "{}", a.log_text());
    // vgpuctl doctor (as on that node) says so.
    let o = s
        .cmd(&bin("vgpuctl"))
        .env("NODE_NAME", "gpu-node-3")
        .args(["--config", conf.to_str().unwrap(), "doctor", "--json"])
        .output()
        .unwrap();
    let checks: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
    let node = checks.as_array().unwrap().iter().find(|c| c["name"] == "node-settings").expect("a node-settings check");
    assert_eq!(
        node["detail"], "node gpu-node-3: [[node]] section 1 (gpu-node-*) applies: split_count 10, memory_scaling 1",
        "{node}"
    );
    let st = a.status().unwrap();
    let uuid0 = st["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let uuid1 = st["gpus"][1]["uuid"].as_str().unwrap().to_string();

    let reg = rt.block_on(next_register(&mut rx, "first"));
    assert_eq!(
        (reg.version.as_str(), reg.endpoint.as_str(), reg.resource_name.as_str()),
        ("v1beta1", "vgpu.sock", "nvidia.com/gpu")
    );
    assert!(reg.options.unwrap().get_preferred_allocation_available);

    rt.block_on(async {
        let mut c = plugin(kdir.join(&reg.endpoint)).await;
        let opts = c.get_device_plugin_options(dp::Empty {}).await.unwrap().into_inner();
        assert!(!opts.pre_start_required);
        let mut lw = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        let first = lw.message().await.unwrap().unwrap();
        assert_eq!(first.devices.len(), 20, "2 GPUs x split_count 10 (its section's, not the file's 4)");
        assert!(first.devices.iter().all(|d| d.health == "Healthy"));
        let d0 = first.devices.iter().find(|d| d.id == format!("{uuid0}-0")).unwrap();
        assert_eq!(d0.topology.as_ref().unwrap().nodes[0].id, 0);
        assert_eq!(first.devices.iter().find(|d| d.id == format!("{uuid1}-9")).unwrap().topology.as_ref().unwrap().nodes[0].id, 1);

        // Preferred: replicas of one GPU, the one already asked for.
        let all: Vec<String> = first.devices.iter().map(|d| d.id.clone()).collect();
        let pref = c
            .get_preferred_allocation(dp::PreferredAllocationRequest {
                container_requests: vec![dp::ContainerPreferredAllocationRequest {
                    available_device_i_ds: all.clone(),
                    must_include_device_i_ds: vec![format!("{uuid1}-4")],
                    allocation_size: 3,
                }],
            })
            .await
            .unwrap()
            .into_inner();
        let ids = &pref.container_responses[0].device_i_ds;
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|i| i.starts_with(&uuid1)), "{ids:?}");

        // Allocate 3 of GPU 0's 10 replicas: 30 % of its memory and of its time.
        let req = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest { devices_ids: (0..3).map(|n| format!("{uuid0}-{n}")).collect() }],
        };
        let r = c.allocate(req.clone()).await.unwrap().into_inner();
        let cr = &r.container_responses[0];
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("2457m"));
        assert_eq!(cr.envs.get("CUDA_DEVICE_SM_LIMIT_0").map(String::as_str), Some("30"));
        assert_eq!(cr.envs.get("NVIDIA_VISIBLE_DEVICES"), Some(&uuid0));
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_SHARED_CACHE").map(String::as_str), Some("/usr/local/vgpu/region"));
        assert!(!cr.envs.contains_key("LD_PRELOAD"), "the preload file does it");
        let mount = |cp: &str| cr.mounts.iter().find(|m| m.container_path == cp).unwrap_or_else(|| panic!("no mount {cp}: {cr:?}"));
        assert!(!mount("/usr/local/vgpu/region").read_only, "the region file alone, read-write");
        assert!(!cr.mounts.iter().any(|m| m.container_path == "/usr/local/vgpu"), "never the slice's directory");
        assert!(mount("/usr/local/vgpu/limits").read_only);
        assert!(mount("/usr/local/vgpu/libvgpu.so").read_only && mount("/usr/local/vgpu/libvgpu.so").host_path.contains("/lib/libvgpu.so.0."));
        let pre = mount("/etc/ld.so.preload");
        assert!(pre.read_only);
        assert_eq!(std::fs::read_to_string(&pre.host_path).unwrap().trim(), "/usr/local/vgpu/libvgpu.so");
        // A container restart gets the same answer (same files).
        let again = c.allocate(req).await.unwrap().into_inner();
        assert_eq!(again.container_responses[0].mounts, cr.mounts);

        // That environment and those mounts limit a real process (LD_PRELOAD stands for the preload
        // file, which a test on the host cannot mount).
        let detail = serde_json::json!({
            "env": cr.envs.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect::<serde_json::Map<_, _>>(),
            "mounts": cr.mounts.iter().map(|m| serde_json::json!({"container_path": m.container_path, "host_path": m.host_path})).collect::<Vec<_>>(),
        });
        let mut cmd = in_slice(&s, &detail, RT);
        cmd.env("LD_PRELOAD", libvgpu()).args(["alloc", "--size", "4g", "--chunk", "256m"]);
        let o = cmd.output().unwrap();
        let v = lines(&o.stdout).remove(0);
        assert_eq!(v["allocated"], 2304 * MIB, "2457 MiB less the 64 MiB context, in 256 MiB chunks: {v}");
        assert_eq!(v["mem_info"]["total"], 2457 * MIB);

        // A critical XID on GPU 1: its replicas turn Unhealthy in the stream.
        assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), lw.message()).await.expect("a health update").unwrap().unwrap();
            if m.devices.iter().any(|d| d.id.starts_with(&uuid1) && d.health == "Unhealthy") {
                assert!(m.devices.iter().filter(|d| d.id.starts_with(&uuid0)).all(|d| d.health == "Healthy"));
                break;
            }
        }
    });

    // Kubelet holds a ListAndWatch stream open while it uses the plugin (this one stays open
    // through what follows): the servers the plugin replaces must stop all the same.
    let held = rt.block_on(async {
        let mut c = plugin(kdir.join("vgpu.sock")).await;
        let mut lw = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        lw.message().await.unwrap().unwrap();
        lw
    });

    // Kubelet restarts: it removes plugin sockets and recreates its own; the plugin registers again.
    let _ = stop.send(());
    let _ = std::fs::remove_file(kdir.join("vgpu.sock"));
    std::thread::sleep(Duration::from_millis(300));
    let stop2 = rt.block_on(async { start_kubelet(&kdir, tx.clone()) });
    let reg2 = rt.block_on(next_register(&mut rx, "after the kubelet restart"));
    assert_eq!(reg2.endpoint, "vgpu.sock");
    assert!(kdir.join("vgpu.sock").exists());
    rt.block_on(async {
        let mut c = plugin(kdir.join("vgpu.sock")).await;
        let mut lw = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        assert_eq!(lw.message().await.unwrap().unwrap().devices.len(), 20);
    });
    assert!(a.log_text().contains("kubelet restarted"), "{}", a.log_text());
    assert!(!a.log_text().contains("another process replaced"), "{}", a.log_text());

    // Another process binds the plugin's socket path (a second agent on the node) while kubelet
    // stays: not taken for a kubelet restart, but warned of; the plugin serves and registers again.
    let _ = std::fs::remove_file(kdir.join("vgpu.sock"));
    let _intruder = std::os::unix::net::UnixListener::bind(kdir.join("vgpu.sock")).unwrap();
    let reg3 = rt.block_on(next_register(&mut rx, "after the socket was replaced"));
    assert_eq!(reg3.endpoint, "vgpu.sock");
    assert!(
        a.log_text().contains("another process replaced the device plugin socket (a second agent on this node?)"),
        "{}",
        a.log_text()
    );
    // Three servers later the agent listens on the path once: the replaced ones closed their sockets.
    std::thread::sleep(Duration::from_millis(2500));
    let n = listening(a.pid(), &kdir.join("vgpu.sock"));
    if n != 1 {
        eprintln!(
            "{}",
            std::fs::read_to_string("/proc/net/unix")
                .unwrap()
                .lines()
                .filter(|l| l.contains("vgpu.sock"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        eprintln!("{}", a.log_text());
    }
    assert_eq!(n, 1, "the agent's listening sockets on vgpu.sock");
    drop(held);

    // Kubelet drops the plugin's stream for good (as when another plugin registers the same
    // resource, and later goes): the plugin registers again within seconds.
    let lw = rt.block_on(async {
        let mut c = plugin(kdir.join("vgpu.sock")).await;
        let mut lw = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
        lw.message().await.unwrap().unwrap();
        lw
    });
    std::thread::sleep(Duration::from_millis(500));
    drop(lw);
    let t = std::time::Instant::now();
    let reg4 = rt.block_on(next_register(&mut rx, "after kubelet stopped watching"));
    assert_eq!(reg4.resource_name, "nvidia.com/gpu");
    assert!(t.elapsed() < Duration::from_secs(9), "registered again after {:?}", t.elapsed());
    assert!(a.log_text().contains("kubelet stopped watching the device plugin"), "{}", a.log_text());
    let _ = stop2.send(());
    let _ = &mut s;
}

/// How many listening Unix sockets bound to `path` process `pid` holds.
fn listening(pid: u32, path: &std::path::Path) -> usize {
    const ACCEPTING: u32 = 0x10000; // __SO_ACCEPTCON
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    let on_path: std::collections::HashSet<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            (f.get(7) == Some(&path.to_str()?) && flags & ACCEPTING != 0).then(|| f[6].to_string())
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(String::from))
        .filter(|ino| on_path.contains(ino))
        .count()
}

/// What a replica Allocate answers, as `in_slice` takes it.
fn detail_of(cr: &dp::ContainerAllocateResponse) -> serde_json::Value {
    serde_json::json!({
        "env": cr.envs.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect::<serde_json::Map<_, _>>(),
        "mounts": cr.mounts.iter().map(|m| serde_json::json!({"container_path": m.container_path, "host_path": m.host_path})).collect::<Vec<_>>(),
    })
}

#[test]
fn replica_slices_go_once_no_container_holds_their_devices() {
    use vgpu_agent::deviceplugin::slice_name;
    let (mut s, kdir, rt, tx, mut rx) = kubelet_node();
    // An API server that knows pod default/a and takes Events (refuses them while `forbid` is set,
    // as one does without the RBAC for them).
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::<serde_json::Value>::new()));
    let forbid = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let api = {
        let (events, forbid) = (events.clone(), forbid.clone());
        common::kubeapi::serve(move |method, target, body| match (method, target.split('?').next().unwrap()) {
            ("POST", "/api/v1/namespaces/default/events") if forbid.load(std::sync::atomic::Ordering::SeqCst) => {
                common::kubeapi::status(403, "Forbidden")
            }
            ("GET", "/api/v1/namespaces/default/pods/a") => (
                200,
                serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "a", "namespace": "default", "uid": "uid-a"}}),
            ),
            ("POST", "/api/v1/namespaces/default/events") => {
                let e: serde_json::Value = serde_json::from_slice(body).unwrap();
                events.lock().unwrap().push(e.clone());
                (201, e)
            }
            _ => common::kubeapi::status(404, "NotFound"),
        })
    };
    let a = Agent::start(
        &s,
        &[
            ("VGPU_AGENT_KUBELET_DIR", kdir.to_str().unwrap()),
            ("VGPU_AGENT_SLICE_GC_GRACE_S", "1"),
            ("VGPU_AGENT_KUBE_API", &api),
        ],
    );
    // No kubelet yet (as on a host without Kubernetes): the pod resources API is not asked for.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(!a.log_text().contains("pod resources"), "{}", a.log_text());
    let _kubelet = rt.block_on(async { start_kubelet(&kdir, tx) });
    let uuid0 = a.status().unwrap()["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let reg = rt.block_on(next_register(&mut rx, "first"));
    let ids = |ns: &[u32]| -> Vec<String> { ns.iter().map(|n| format!("{uuid0}-{n}")).collect() };
    let (da, db, dc) = (ids(&[0, 1]), ids(&[2]), ids(&[3, 4]));
    let answers: Vec<dp::ContainerAllocateResponse> = rt.block_on(async {
        let mut c = plugin(kdir.join(&reg.endpoint)).await;
        let req = dp::AllocateRequest {
            container_requests: [&da, &db, &dc]
                .iter()
                .map(|d| dp::ContainerAllocateRequest { devices_ids: d.to_vec() })
                .collect(),
        };
        c.allocate(req).await.unwrap().into_inner().container_responses
    });
    let (sa, sb, sc) = (slice_name(&da), slice_name(&db), slice_name(&dc));
    let names = || -> Vec<String> {
        let mut v: Vec<String> = a.status().unwrap()["slices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["name"].as_str().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    let mut all = vec![sa.clone(), sb.clone(), sc.clone()];
    all.sort();
    assert_eq!(names(), all);

    // No pod resources API yet: nothing is removed, and the log says why.
    std::thread::sleep(Duration::from_millis(3500));
    assert_eq!(names(), all);
    assert!(a.log_text().contains("pod resources API unavailable"), "{}", a.log_text());

    // Kubelet lists container A (its devices in another order) and a container holding another
    // resource's devices that happen to share IDs with B; C's container is gone but a process of its
    // slice still runs.
    let list = PodList::default();
    list.lock().unwrap().pod_resources = vec![
        pod("a", &[("main", &[("nvidia.com/gpu", &[da[1].clone(), da[0].clone()])])]),
        pod("other", &[("nic", &[("example.com/nic", &db)]), ("idle", &[])]),
    ];
    let sock = s.state.join("pod-resources/kubelet.sock");
    let _pr = rt.block_on(async { serve_pod_resources(&sock, list.clone()) });
    let mut cmd = in_slice(&s, &detail_of(&answers[2]), RT);
    cmd.env("LD_PRELOAD", libvgpu());
    let (p, _) = s.spawn_cmd(cmd, &["alloc", "--size", "100m", "--hold"]);
    a.wait("B's slice removed", |st| slice_of(st, &sb).is_null());
    // A held slice is labelled with its pod and container (status and metrics show them).
    let st = a.wait("A labelled", |st| slice_of(st, &sa)["labels"]["pod"] == "a");
    let l = &slice_of(&st, &sa)["labels"];
    assert_eq!(
        (&l["namespace"], &l["container"], &l["source"]),
        (&"default".into(), &"main".into(), &"kubelet".into())
    );
    assert!(a.log_text().contains("answers again"), "{}", a.log_text());
    // A's quota refuses an allocation: an Event on pod default/a, whose UID the agent looked up
    // (kubelet names pods, it does not give their UIDs). The API server refuses it first: the status
    // says so, and the Event is posted once it is taken.
    let mut cmd = in_slice(&s, &detail_of(&answers[0]), RT);
    cmd.env("LD_PRELOAD", libvgpu()).args(["alloc", "--size", "4g"]);
    assert_eq!(lines(&cmd.output().unwrap().stdout)[0]["error"], "CUDA_ERROR_OUT_OF_MEMORY");
    let st = a.wait("the warning", |st| st["warnings"].to_string().contains("cannot post Kubernetes Events"));
    assert!(st["warnings"].to_string().contains("Forbidden"), "{st}");
    assert!(events.lock().unwrap().is_empty());
    forbid.store(false, std::sync::atomic::Ordering::SeqCst);
    let t = std::time::Instant::now();
    while events.lock().unwrap().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(15), "no Event: {}", a.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let e = events.lock().unwrap()[0].clone();
    assert_eq!(
        e["involvedObject"],
        serde_json::json!({"kind": "Pod", "apiVersion": "v1", "namespace": "default", "name": "a", "uid": "uid-a",
                           "fieldPath": "spec.containers{main}"})
    );
    a.wait("the warning cleared", |st| st["warnings"] == serde_json::json!([]));
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        names(),
        {
            let mut v = vec![sa.clone(), sc.clone()];
            v.sort();
            v
        },
        "A is held, C has a live process"
    );
    // C's process exits: its slice goes too. A stays while kubelet lists it.
    s.kill(p);
    a.wait("C's slice removed", |st| slice_of(st, &sc).is_null());
    assert_eq!(names(), vec![sa.clone()]);
    // The counter follows the removal (counted once the delete has returned).
    let t = std::time::Instant::now();
    let metrics = loop {
        let (_, m) = a.scrape("/metrics");
        if m.contains("vgpu_slices_collected_total 2") || t.elapsed() > Duration::from_secs(5) {
            break m;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(metrics.contains("vgpu_slices_collected_total 2"), "{metrics}");
    assert!(
        metrics.contains(&format!("namespace=\"default\",pod=\"a\",container=\"main\",slice=\"{sa}\"")),
        "{metrics}"
    );
    // A container given B's devices again gets its slice again.
    rt.block_on(async {
        let mut c = plugin(kdir.join(&reg.endpoint)).await;
        let req =
            dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: db.clone() }] };
        c.allocate(req).await.unwrap();
    });
    assert!(names().contains(&sb));
}

#[test]
fn with_memory_scaling_a_replica_is_its_share_of_the_scaled_memory() {
    let (s, kdir, rt, tx, mut rx) = kubelet_node();
    let _stop = rt.block_on(async { start_kubelet(&kdir, tx.clone()) });
    let a = Agent::start(&s, &[("VGPU_AGENT_KUBELET_DIR", kdir.to_str().unwrap()), ("VGPU_AGENT_MEMORY_SCALING", "2")]);
    let uuid0 = a.status().unwrap()["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let reg = rt.block_on(next_register(&mut rx, "first"));
    rt.block_on(async {
        let mut c = plugin(kdir.join(&reg.endpoint)).await;
        let req = dp::AllocateRequest {
            container_requests: vec![dp::ContainerAllocateRequest {
                devices_ids: (0..3).map(|n| format!("{uuid0}-{n}")).collect(),
            }],
        };
        let r = c.allocate(req).await.unwrap().into_inner();
        let cr = &r.container_responses[0];
        // 3 of 10 replicas of 8 GiB counted twice: 4915 MiB, on a GPU that has 8192.
        assert_eq!(cr.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0").map(String::as_str), Some("4915m"));
        assert_eq!(cr.envs.get("CUDA_OVERSUBSCRIBE").map(String::as_str), Some("true"));
    });
}

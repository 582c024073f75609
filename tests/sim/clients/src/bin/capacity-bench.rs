//! Capacity reporting at cluster scale: N nodes (the agent's own reporter code, in this process, each
//! with a realistic 8-GPU snapshot: H100s with peers, half of them in MIG mode with instances and
//! room) stream to one `vgpu-receiver` process over loopback with TLS and a bearer token.
//!
//! Measures: the time for all nodes to connect and send their snapshots; change propagation (a
//! node's capacity changes -> the change is visible to a watcher of the receiver) p50/p99/max at a
//! steady change rate; the receiver's resident memory and CPU; and a reconnect storm: the receiver is
//! SIGKILLed and restarted after an outage, and every node must be back (snapshot applied) within a
//! bounded time, spread out by the reporters' jittered back-off rather than all at once.
//!
//! usage: capacity-bench [--quick] [--nodes N] [--changes N] [--rate PER_S] [--outage-ms MS]
//! Uses `vgpu-receiver` built next to this binary (cargo build --release -p vgpu-receiver
//! -p vgpu-sim-clients).
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vgpu_agent::report::{self, Endpoint, ReportConfig, ReporterState, Source};
use vgpu_proto::scheduler::v1 as sp;

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect("a number"))
}

/// A synthetic node: 8 H100s, all NVLinked; GPUs 4-7 in MIG mode with two instances each.
struct Node {
    cap: Mutex<sp::NodeCapacity>,
    n: tokio::sync::Notify,
}

fn node_capacity(k: usize) -> sp::NodeCapacity {
    let uuid = |g: usize| format!("GPU-{k:08x}-{g:04x}-4000-8000-00000000c0de");
    let gpus = (0..8)
        .map(|g| {
            let mig = g >= 4;
            sp::GpuCapacity {
                uuid: uuid(g),
                index: g as u32,
                model: "NVIDIA H100 80GB HBM3".into(),
                memory_total: 85_520_809_984,
                memory_allocatable: if mig { 0 } else { 85_520_809_984 - (g as u64) * (8 << 30) },
                sm_allocatable: if mig { 0 } else { 100 - 10 * g as u32 },
                slices: if mig { 0 } else { g as u32 },
                healthy: true,
                numa_node: (g / 4) as i32,
                pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + g * 0x10),
                sm_count: 132,
                peers: (0..8)
                    .filter(|&o| o != g)
                    .map(|o| sp::Peer {
                        uuid: uuid(o),
                        nvlink: true,
                        pcie: if o / 4 == g / 4 { "Node".into() } else { "System".into() },
                    })
                    .collect(),
                mig: Some(sp::MigCapacity {
                    enabled: mig,
                    pending: false,
                    instances: if mig {
                        vec![
                            sp::MigInstance {
                                gpu_instance_id: 1,
                                profile: "3g.40gb".into(),
                                start: 4,
                                size: 4,
                                uuid: format!("MIG-{k:08x}-{g}-1"),
                                memory_mib: 40_320,
                                ..Default::default()
                            },
                            sp::MigInstance {
                                gpu_instance_id: 2,
                                profile: "1g.10gb".into(),
                                start: 0,
                                size: 1,
                                uuid: format!("MIG-{k:08x}-{g}-2"),
                                memory_mib: 9_856,
                                ..Default::default()
                            },
                        ]
                    } else {
                        vec![]
                    },
                    room: if mig {
                        vec![
                            sp::MigRoom {
                                profile: "1g.10gb".into(),
                                memory_mib: 9_856,
                                compute_slices: 1,
                                starts: vec![1, 2, 3],
                            },
                            sp::MigRoom {
                                profile: "1g.20gb".into(),
                                memory_mib: 19_968,
                                compute_slices: 1,
                                starts: vec![2],
                            },
                            sp::MigRoom {
                                profile: "2g.20gb".into(),
                                memory_mib: 19_968,
                                compute_slices: 2,
                                starts: vec![2],
                            },
                        ]
                    } else {
                        vec![]
                    },
                }),
                ..Default::default()
            }
        })
        .collect();
    sp::NodeCapacity { driver_version: "570.86.15".into(), cuda_version: 12080, gpus, ..Default::default() }
}

impl Source for Node {
    fn capacity(&self) -> sp::NodeCapacity {
        self.cap.lock().unwrap().clone()
    }
    fn changed(&self) -> &tokio::sync::Notify {
        &self.n
    }
    fn handle(&self, _: &sp::NodeRequest) -> sp::RequestResult {
        sp::RequestResult { ok: true, ..Default::default() }
    }
}

/// (CPU seconds, resident bytes) of a process.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = f.get(11).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:").and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok()))
        .unwrap_or(0);
    (ticks / 100.0, rss * 1024)
}

struct Receiver {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl Receiver {
    fn spawn(&mut self) {
        let d = &self.dir;
        let c = Command::new(&self.bin)
            .args(["serve", "--listen", &format!("127.0.0.1:{}", self.port), "--heartbeat-ms", "10000"])
            .arg("--tls-cert")
            .arg(d.join("server.pem"))
            .arg("--tls-key")
            .arg(d.join("server-key.pem"))
            .arg("--token-file")
            .arg(d.join("token"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("vgpu-receiver");
        self.child = Some(c);
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(t.elapsed() < Duration::from_secs(10), "the receiver did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.kill();
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Follows the receiver's events: per node, the Instant of its latest snapshot and the queue of
/// delta arrival times.
#[derive(Default)]
struct Seen {
    snapshots: HashMap<String, Instant>,
    deltas: HashMap<String, VecDeque<Instant>>,
}

/// Matches the changes sent (per node, in order) with the deltas the watcher saw; latencies in ms.
fn collect(seen: &Mutex<Seen>, pending: &mut HashMap<String, VecDeque<Instant>>, lat: &mut Vec<f64>) {
    let mut g = seen.lock().unwrap();
    for (node, q) in pending.iter_mut() {
        while let (Some(sent), Some(arrived)) = (q.front().copied(), g.deltas.get_mut(node).and_then(|d| d.pop_front()))
        {
            q.pop_front();
            lat.push(arrived.duration_since(sent).as_secs_f64() * 1e3);
        }
    }
}

async fn watch(dir: PathBuf, port: u16, seen: Arc<Mutex<Seen>>) {
    let ep = Endpoint::parse(&format!("https://127.0.0.1:{port}")).unwrap();
    let ch = report::channel(&ep, Some(&dir.join("ca.pem")), None).await.expect("watch channel");
    let token = std::fs::read_to_string(dir.join("token")).unwrap();
    fn authed<T>(token: &str, m: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(m);
        req.metadata_mut().insert("authorization", format!("Bearer {}", token.trim()).parse().unwrap());
        req
    }
    let mut client = sp::cluster_client::ClusterClient::new(ch);
    let mut s = client.watch(authed(&token, sp::WatchRequest {})).await.expect("watch").into_inner();
    // Nodes whose snapshot came before the watch did (the receiver had subscribed it by the time it
    // answered): in the view already, counted as back now (an overestimate).
    let view = client.status(authed(&token, sp::ClusterStatusRequest::default())).await.expect("status").into_inner();
    {
        let now = Instant::now();
        let mut g = seen.lock().unwrap();
        let mut early = 0;
        for v in view.nodes.into_iter().filter(|v| v.synced) {
            if let Some(c) = v.capacity {
                g.snapshots.entry(c.node).or_insert_with(|| {
                    early += 1;
                    now
                });
            }
        }
        if early > 0 {
            eprintln!("{early} nodes were back before the watch started (counted as back when it did)");
        }
    }
    while let Ok(Some(e)) = s.message().await {
        let now = Instant::now();
        let mut g = seen.lock().unwrap();
        match e.kind.as_str() {
            "snapshot" => {
                g.snapshots.insert(e.node, now);
            }
            "delta" => g.deltas.entry(e.node).or_default().push_back(now),
            k if k.starts_with("lagged") => eprintln!("watch lagged: {k}"),
            _ => {}
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let n = arg(&args, "--nodes", if quick { 200 } else { 1000 }) as usize;
    let changes = arg(&args, "--changes", if quick { 400 } else { 3000 }) as usize;
    let rate = arg(&args, "--rate", 200) as f64;
    let outage = Duration::from_millis(arg(&args, "--outage-ms", 2000));
    let here = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let bin = here.join("vgpu-receiver");
    assert!(bin.exists(), "{} is missing: cargo build --release -p vgpu-receiver", bin.display());
    let dir = std::env::temp_dir().join(format!("vgpu-capacity-bench-{}", std::process::id()));
    let o = Command::new(&bin).args(["gen-certs", "--out"]).arg(&dir).output().unwrap();
    assert!(o.status.success(), "gen-certs: {}", String::from_utf8_lossy(&o.stderr));
    // Many sockets on both ends.
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut recv = Receiver { bin, dir: dir.clone(), port, child: None };
    recv.spawn();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    rt.spawn(watch(dir.clone(), port, seen.clone()));
    std::thread::sleep(Duration::from_millis(200));
    let snapshot_bytes = prost::Message::encoded_len(&node_capacity(0));
    println!("{n} nodes x 8 GPUs (snapshot {snapshot_bytes} bytes), TLS + token over loopback");

    // Phase 1: every node connects and sends its snapshot.
    let nodes: Vec<(String, Arc<Node>, Arc<ReporterState>)> = (0..n)
        .map(|k| {
            let name = format!("node-{k:04}");
            let src = Arc::new(Node { cap: Mutex::new(node_capacity(k)), n: Default::default() });
            let st = Arc::new(ReporterState::default());
            let mut c = ReportConfig::new(Endpoint::parse(&format!("https://127.0.0.1:{port}")).unwrap(), name.clone());
            c.ca = Some(dir.join("ca.pem"));
            c.token_file = Some(dir.join("token"));
            (name, src, st, c)
        })
        .map(|(name, src, st, c)| {
            rt.spawn(report::run(c, src.clone(), st.clone(), Arc::new(tokio::sync::Notify::new())));
            (name, src, st)
        })
        .collect();
    let t0 = Instant::now();
    let all_in = |since: Instant| {
        let g = seen.lock().unwrap();
        nodes.iter().all(|(name, _, _)| g.snapshots.get(name).is_some_and(|t| *t >= since))
    };
    while !all_in(t0) {
        assert!(t0.elapsed() < Duration::from_secs(120), "not every node connected within 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let connect_s = t0.elapsed().as_secs_f64();
    let (cpu0, rss_connected) = usage(recv.pid());
    println!(
        "connect: all {n} snapshots applied in {connect_s:.2} s; receiver RSS {:.1} MiB",
        rss_connected as f64 / 1048576.0
    );

    // Phase 2: changes at a steady rate, each timed from the source's change to the watcher.
    let mut lat = Vec::with_capacity(changes);
    let mut pending: HashMap<String, VecDeque<Instant>> = HashMap::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let period = Duration::from_secs_f64(1.0 / rate);
    let start = Instant::now();
    for i in 0..changes {
        let due = start + period * i as u32;
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = (x % n as u64) as usize;
        let (name, src, _) = &nodes[k];
        // Skip a node whose previous change has not arrived (its deltas would coalesce).
        if pending.get(name).is_some_and(|q| !q.is_empty()) {
            continue;
        }
        {
            let mut c = src.cap.lock().unwrap();
            c.gpus[i % 4].memory_allocatable -= 1 << 20;
        }
        pending.entry(name.clone()).or_default().push_back(Instant::now());
        src.n.notify_one();
        collect(&seen, &mut pending, &mut lat);
    }
    let wait_end = Instant::now() + Duration::from_secs(10);
    while pending.values().any(|q| !q.is_empty()) && Instant::now() < wait_end {
        std::thread::sleep(Duration::from_millis(5));
        collect(&seen, &mut pending, &mut lat);
    }
    let steady_s = start.elapsed().as_secs_f64();
    let (cpu1, rss_steady) = usage(recv.pid());
    let lost: usize = pending.values().map(|q| q.len()).sum();
    let measured = lat.len();
    let (p50, p99, max) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99), pct(&mut lat, 1.0));
    println!(
        "propagation: {measured} changes at {rate:.0}/s: p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms ({lost} not seen)"
    );
    println!(
        "receiver: RSS {:.1} MiB ({:.1} KiB per node), CPU {:.1} % of a core over {steady_s:.1} s of changes and heartbeats",
        rss_steady as f64 / 1048576.0,
        rss_steady as f64 / 1024.0 / n as f64,
        100.0 * (cpu1 - cpu0) / steady_s
    );

    // Phase 3: reconnect storm.
    let attempts0: u64 = nodes.iter().map(|(_, _, s)| s.attempts.load(Relaxed)).sum();
    recv.kill();
    let down = Instant::now();
    std::thread::sleep(outage);
    let seen2 = Arc::new(Mutex::new(Seen::default()));
    recv.spawn();
    let up = Instant::now();
    rt.spawn(watch(dir.clone(), port, seen2.clone()));
    // Reconnections per 100 ms bucket after the restart (from each node's snapshot arrival).
    while !{
        let g = seen2.lock().unwrap();
        nodes.iter().all(|(name, _, _)| g.snapshots.contains_key(name))
    } {
        assert!(up.elapsed() < Duration::from_secs(120), "not every node came back within 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let back_s = up.elapsed().as_secs_f64();
    let g = seen2.lock().unwrap();
    let mut after: Vec<f64> = g.snapshots.values().map(|t| t.duration_since(up).as_secs_f64()).collect();
    let mut buckets = vec![0usize; (back_s * 10.0) as usize + 1];
    let last = buckets.len() - 1;
    for t in &after {
        buckets[((t * 10.0) as usize).min(last)] += 1;
    }
    let peak = buckets.iter().copied().max().unwrap_or(0);
    let attempts1: u64 = nodes.iter().map(|(_, _, s)| s.attempts.load(Relaxed)).sum();
    println!(
        "reconnect storm: receiver down {:.1} s; all {n} nodes back {back_s:.2} s after its restart (p50 {:.2} s, p99 {:.2} s); busiest 100 ms: {peak} nodes ({:.0} %); {:.1} connection attempts per node",
        up.duration_since(down).as_secs_f64(),
        pct(&mut after, 0.5),
        pct(&mut after, 0.99),
        100.0 * peak as f64 / n as f64,
        (attempts1 - attempts0) as f64 / n as f64
    );
    drop(g);
    let (_, rss_after) = usage(recv.pid());
    println!(
        "{}",
        serde_json::json!({"nodes": n, "snapshot_bytes": snapshot_bytes, "connect_s": connect_s, "changes": measured,
            "rate": rate, "p50_ms": p50, "p99_ms": p99, "max_ms": max, "not_seen": lost,
            "receiver_rss_mib": rss_steady as f64 / 1048576.0, "receiver_cpu_pct": 100.0 * (cpu1 - cpu0) / steady_s,
            "outage_s": outage.as_secs_f64(), "back_s": back_s, "peak_100ms": peak,
            "receiver_rss_after_storm_mib": rss_after as f64 / 1048576.0})
    );
    recv.kill();
    let _ = std::fs::remove_dir_all(&dir);
    std::process::exit(0);
}

//! Prometheus metrics of the receiver over plain HTTP (`GET /metrics`, `GET /healthz`), served by
//! `vgpu-httpd`.

use crate::Cluster;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The metrics text.
pub fn render(c: &Cluster) -> String {
    let mut s = String::new();
    let (connected, known) = c.counts();
    let view = c.view(None);
    let stale = view.nodes.iter().filter(|n| n.stale && n.connected).count();
    let gpus: usize = view.nodes.iter().filter_map(|n| n.capacity.as_ref()).map(|c| c.gpus.len()).sum();
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge("vgpu_receiver_nodes_connected", "Nodes with an open capacity stream.", connected as f64);
    gauge("vgpu_receiver_nodes_known", "Nodes the receiver has heard from since it started.", known as f64);
    gauge("vgpu_receiver_nodes_stale", "Connected nodes silent for three heartbeat periods.", stale as f64);
    gauge("vgpu_receiver_gpus", "GPUs in the cluster view.", gpus as f64);
    gauge("vgpu_receiver_state_bytes", "Encoded bytes of node state held, all nodes together.", c.held_bytes() as f64);
    // The standard process series.
    let (rss, cpu) = process();
    gauge("process_resident_memory_bytes", "Resident memory size in bytes.", rss as f64);
    let _ = writeln!(
        s,
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n\
         # TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {cpu}"
    );
    let k = &c.counters;
    let _ = writeln!(s, "# HELP vgpu_receiver_messages_total Messages received from nodes, by kind.");
    let _ = writeln!(s, "# TYPE vgpu_receiver_messages_total counter");
    for (kind, v) in
        [("snapshot", &k.snapshots), ("delta", &k.deltas), ("heartbeat", &k.heartbeats), ("result", &k.results)]
    {
        let _ = writeln!(s, "vgpu_receiver_messages_total{{kind=\"{kind}\"}} {}", v.load(Relaxed));
    }
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    };
    counter("vgpu_receiver_streams_total", "Capacity streams opened by nodes.", k.streams.load(Relaxed));
    counter(
        "vgpu_receiver_resyncs_total",
        "Full snapshots asked for after a gap or a bad delta.",
        k.resyncs.load(Relaxed),
    );
    counter(
        "vgpu_receiver_rejected_auth_total",
        "Streams and calls refused for a missing, wrong, revoked or insufficient token.",
        k.rejected_auth.load(Relaxed),
    );
    counter(
        "vgpu_receiver_rejected_malformed_total",
        "Streams ended for malformed messages.",
        k.rejected_malformed.load(Relaxed),
    );
    counter("vgpu_receiver_requests_ok_total", "Requests nodes carried out.", k.requests_ok.load(Relaxed));
    counter(
        "vgpu_receiver_requests_failed_total",
        "Requests that failed or got no answer.",
        k.requests_failed.load(Relaxed),
    );
    s
}

/// (resident bytes, CPU seconds) of this process, from /proc.
pub fn process() -> (u64, f64) {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("VmRSS:").map(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
            })
        })
        .flatten()
        .unwrap_or(0)
        * 1024;
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let f: Vec<&str> = s.rsplit(')').next()?.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / 100.0)
        })
        .unwrap_or(0.0);
    (rss, cpu)
}

/// Serves `/metrics` and `/healthz` on `l` until the task is dropped (HTTP/1.1 with keep-alive,
/// bounded as [`vgpu_httpd::Limits`] says).
pub async fn serve(l: tokio::net::TcpListener, c: Arc<Cluster>) {
    use vgpu_httpd::Response;
    let handler: vgpu_httpd::Handler = Arc::new(move |r| match (r.method, r.path) {
        ("GET", "/metrics") => {
            Response { status: 200, content_type: "text/plain; version=0.0.4; charset=utf-8", body: render(&c) }
        }
        ("GET", "/healthz") => Response::text(200, "ok\n"),
        ("GET", _) => Response::text(404, "not found\n"),
        _ => Response::text(405, "only GET\n"),
    });
    vgpu_httpd::serve(l, None, vgpu_httpd::Limits::default(), handler).await;
}

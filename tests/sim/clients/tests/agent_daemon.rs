//! The agent daemon as operators run it: the `vgpu-node-agent` binary on the simulated GPU (NVML
//! loaded through nvml-wrapper), driven with the `vgpuctl` binary over its Unix socket (gRPC),
//! metrics scraped over HTTP, workloads started with the environment and files the agent's
//! injection names, the agent SIGKILLed and restarted under running workloads.

mod common;
use common::agent::*;
use common::*;

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NODE: &str =
    "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n[[gpu]]\nmodel = \"H100-80GB\"\n";

fn metric(body: &str, name: &str, label: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .unwrap_or_else(|| panic!("no {name} with {label} in\n{body}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn slices_over_grpc_status_metrics_reclaim_and_clean_stop() {
    let mut s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    // The socket is the owner's and group's only.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&a.socket).unwrap().permissions().mode() & 0o777, 0o660);

    // Slices over gRPC, through vgpuctl.
    let out = a.ctl_ok(&["slice", "create", "--name", "job1", "--gpu", "0", "--memory", "1GiB", "--sm", "30"]);
    assert!(out.contains("-e CUDA_DEVICE_MEMORY_LIMIT_0=1024m") && out.contains("/usr/local/vgpu/limits:ro"), "{out}");
    assert!(out.contains("CDI device: vgpu.io/slice=job1  (CDI-enabled runtimes"), "{out}");
    assert!(out.contains("on this host, without a container:\n  vgpuctl run job1 -- COMMAND"), "{out}");
    assert!(!out.contains("warning"), "the library is installed: {out}");
    let j1: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "job1", "--json"])).unwrap();
    let j1 = j1["slice"].clone();
    // On disk: the state directory and the slice's record are the agent's to write; the limits file
    // is the agent's alone (0644); the region is writable by the container's processes, whatever
    // their uid (0666).
    let mode = |p: std::path::PathBuf| std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
    let sd = a.state.join("slices/job1");
    assert_eq!(mode(a.state.clone()), 0o755);
    assert_eq!((mode(sd.join("limits")), mode(sd.join("region"))), (0o644, 0o666));
    assert_eq!(mode(a.state.join("records/job1.json")), 0o600, "the record is the agent's alone");
    assert!(!sd.join("slice.json").exists(), "no record where a container could reach it");
    // Its CDI spec: the same edits, for CDI-enabled runtimes.
    assert_eq!(j1["cdi_device"], "vgpu.io/slice=job1");
    let cdi: Value = serde_json::from_slice(&std::fs::read(a.state.join("cdi/vgpu-job1.json")).unwrap()).unwrap();
    assert_eq!((cdi["cdiVersion"].as_str(), cdi["kind"].as_str()), (Some("0.5.0"), Some("vgpu.io/slice")));
    assert!(cdi["devices"][0]["containerEdits"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e == "CUDA_DEVICE_MEMORY_LIMIT_0=1024m"));
    assert!(j1["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["host_path"].as_str().unwrap().contains("/lib/libvgpu.so.0.")));
    let j2: Value = serde_json::from_str(&a.ctl_ok(&[
        "slice",
        "create",
        "--name",
        "job2",
        "--gpu",
        "0",
        "--memory",
        "512m",
        "--label",
        "namespace=ml",
        "--label",
        "pod=p2",
        "--json",
    ]))
    .unwrap();
    // Bad requests are refused with the reason.
    let o = a.ctl(&["slice", "create", "--name", "job1", "--gpu", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("slice job1 already exists"));
    let o = a.ctl(&["slice", "create", "--name", "x", "--gpu", "7"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no GPU \"7\" on this node"), "{o:?}");
    let o = a.ctl(&["slice", "create", "--name", "x", "--gpu", "0", "--memory", "100GiB"]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("memory limit 100.0 GiB is more than GPU 0 has (8.0 GiB)"),
        "{o:?}"
    );
    let o = a.ctl(&["slice", "create", "--name", "x", "--gpu", "0", "--memory", "lots"]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(list.contains("job1") && list.contains("job2"), "{list}");

    // Workloads in each slice, one outside.
    let (p1, _) = s.spawn_cmd(in_slice(&s, &j1, RT), &["alloc", "--size", "300m", "--hold"]);
    let over = in_slice(&s, &j1, RT).args(["alloc", "--size", "2g", "--chunk", "100m"]).output().unwrap();
    assert_eq!(
        lines(&over.stdout)[0]["allocated"],
        500 * MIB,
        "1 GiB less p1's 364 MiB less this context, in 100 MiB steps"
    );
    let (p2, _) = s.spawn_cmd(in_slice(&s, &j2, RT), &["alloc", "--size", "200m", "--hold"]);
    let (pout, _) = s.spawn(RT, &["alloc", "--size", "100m", "--hold"]);
    let st = a.wait("both slices' processes and the escape", |v| {
        slice_of(v, "job1")["gpus"][0]["memory_used"] == 364 * MIB
            && slice_of(v, "job2")["gpus"][0]["memory_used"] == 264 * MIB
            && v["escapes"].as_array().unwrap().len() == 1
    });
    let g0 = &st["gpus"][0];
    assert_eq!((g0["mode"].as_str(), g0["healthy"].as_bool()), (Some("shared"), Some(true)));
    assert_eq!(st["gpus"][1]["mode"], "exclusive");
    let j1s = slice_of(&st, "job1");
    assert_eq!(j1s["processes"][0]["host_pid"], p1);
    assert_eq!(j1s["gpus"][0]["memory_measured"], 364 * MIB);
    assert_eq!(j1s["gpus"][0]["oom_rejections"], 1);
    assert_eq!(slice_of(&st, "job2")["processes"][0]["pid"], p2);
    assert_eq!(
        (st["escapes"][0]["pid"].as_u64(), st["escapes"][0]["kind"].as_str()),
        (Some(pout as u64), Some("UNACCOUNTED"))
    );

    // The table names the same things.
    let table = a.ctl_ok(&["status"]);
    assert!(!table.contains('\x1b'), "no colour when not on a terminal");
    for want in [
        "NVIDIA A100-SXM4-40GB",
        "shared",
        "job1",
        "364.0 MiB / 1.0 GiB",
        "0% / 30%",
        &format!("{p1} 364.0 MiB"),
        "outside every slice",
    ] {
        assert!(table.contains(want), "{want:?} missing from\n{table}");
    }
    // -o yaml is the JSON's content; -o wide prints whole UUIDs; filters keep what they name.
    let yaml: Value = yaml_serde::from_str(&a.ctl_ok(&["status", "-o", "yaml"])).unwrap();
    assert_eq!(yaml["slices"].as_array().map(Vec::len), st["slices"].as_array().map(Vec::len));
    assert_eq!(yaml["escapes"][0]["kind"], "UNACCOUNTED", "enums by name");
    let uuid = g0["uuid"].as_str().unwrap();
    assert!(a.ctl_ok(&["status", "-o", "wide"]).contains(uuid), "the whole UUID");
    assert!(!table.contains(uuid), "a table shortens it");
    let only = |args: &[&str]| -> Vec<String> {
        let v: Value = serde_json::from_str(&a.ctl_ok(&[&["status", "-o", "json"], args].concat())).unwrap();
        v["slices"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(only(&["--gpu", "1"]), Vec::<String>::new(), "no slice on GPU 1");
    let mut on0 = only(&["--gpu", "0"]);
    on0.sort();
    assert_eq!(on0, ["job1", "job2"]);
    assert_eq!(only(&["--pod", "nobody"]), Vec::<String>::new(), "no slice has that pod label");
    assert_eq!(only(&["--namespace", "ml"]), ["job2"]);
    // slice list takes the same filters.
    let listed = |args: &[&str]| -> Vec<String> {
        let v: Value = serde_json::from_str(&a.ctl_ok(&[&["slice", "list", "-o", "json"], args].concat())).unwrap();
        let mut names: Vec<String> =
            v.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap().to_string()).collect();
        names.sort();
        names
    };
    assert_eq!(listed(&[]), ["job1", "job2"]);
    assert_eq!(listed(&["--gpu", "1"]), Vec::<String>::new());
    assert_eq!(listed(&["--gpu", "0"]), ["job1", "job2"]);
    assert_eq!(listed(&["--gpu", &uuid[..8]]), ["job1", "job2"], "a UUID's start");
    assert_eq!(listed(&["--pod", "p2", "--namespace", "ml"]), ["job2"]);
    assert_eq!(listed(&["--pod", "p2", "--namespace", "other"]), Vec::<String>::new());
    let list_table = a.ctl_ok(&["slice", "list", "--namespace", "ml"]);
    assert!(
        list_table.contains("job2") && list_table.contains("ml/p2") && !list_table.contains("job1"),
        "{list_table}"
    );
    assert_eq!(a.ctl_ok(&["slice", "list", "--pod", "nobody"]), "no slices\n");
    let e = a.ctl(&["status", "-o", "xml"]);
    assert!(String::from_utf8_lossy(&e.stderr).contains("possible values: table, wide, json, yaml"), "{e:?}");

    // Into a pipe nobody reads any more (`vgpuctl status | head -0`): ended by SIGPIPE, quietly.
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills the two descriptors; the read end is closed at once.
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
    }
    use std::os::fd::FromRawFd;
    // SAFETY: fds[1] is an open descriptor owned by nothing else.
    let gone = Stdio::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fds[1]) });
    let o = Command::new(bin("vgpuctl")).env("VGPU_SOCKET", &a.socket).arg("status").stdout(gone).output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc::SIGPIPE), "{o:?}");
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));

    // Metrics over HTTP: HAMi's names and ours.
    let (code, body) = a.scrape("/metrics");
    assert_eq!(code, "HTTP/1.1 200 OK");
    assert_eq!(metric(&body, "hami_vgpu_memory_used_bytes", "slice=\"job1\""), (364 * MIB) as f64);
    assert_eq!(metric(&body, "hami_vgpu_memory_limit_bytes", "slice=\"job2\""), (512 * MIB) as f64);
    assert_eq!(metric(&body, "vgpu_slice_oom_rejections_total", "slice=\"job1\""), 1.0);
    assert_eq!(metric(&body, "vgpu_escapes_total", "kind=\"unaccounted\""), 1.0);
    assert!(metric(&body, "hami_host_gpu_memory_used_bytes", "device_index=\"0\"") >= (728 * MIB) as f64);
    assert!(metric(&body, "vgpu_agent_passes_total", "") >= 1.0);
    let version = format!("version=\"{}\",", env!("CARGO_PKG_VERSION"));
    let info = body.lines().find(|l| l.starts_with("vgpu_agent_info{")).unwrap();
    assert!(info.contains(&version) && info.ends_with("} 1"), "{info}");
    assert!(!info.contains("driver_version=\"\"") && !info.contains("cuda_version=\"0.0\""), "{info}");
    // Every metric the packaged alerting rules name is one the agent exports.
    let rules = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../packaging/prometheus/vgpu-alerts.yaml");
    let rules = std::fs::read_to_string(rules).unwrap();
    let mut named = Vec::new();
    for expr in rules.lines().filter_map(|l| l.trim().strip_prefix("expr:")) {
        for w in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if w.starts_with("vgpu_") || w.starts_with("hami_") {
                named.push(w);
            }
        }
    }
    assert!(named.len() >= 5, "{named:?}");
    for m in named {
        assert!(body.contains(&format!("# TYPE {m} ")), "the alerting rules name {m}, which the agent does not export");
    }
    assert_eq!(a.scrape("/healthz").0, "HTTP/1.1 200 OK");
    assert_eq!(a.scrape("/nope").0, "HTTP/1.1 404 Not Found");
    // Keep-alive: Prometheus scrapes over one connection.
    {
        use std::io::{BufRead, Read, Write};
        let c = std::net::TcpStream::connect(&a.metrics).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = std::io::BufReader::new(c.try_clone().unwrap());
        let mut w = c;
        for _ in 0..2 {
            write!(w, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let (mut status, mut len) = (String::new(), 0usize);
            r.read_line(&mut status).unwrap();
            loop {
                let mut h = String::new();
                r.read_line(&mut h).unwrap();
                if h == "\r\n" {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            assert_eq!(status.trim_end(), "HTTP/1.1 200 OK");
            assert!(String::from_utf8_lossy(&body).contains("hami_vgpu_memory_used_bytes"));
        }
    }

    // Limits change live over gRPC.
    a.ctl_ok(&["slice", "update", "job1", "--gpu", "0", "--memory", "2GiB", "--sm", "50"]);
    let more = in_slice(&s, &j1, RT).args(["alloc", "--size", "2g", "--chunk", "100m"]).output().unwrap();
    assert_eq!(lines(&more.stdout)[0]["allocated"], 1600 * MIB);

    // A dead process is reclaimed within one monitoring pass of the agent noticing.
    // (after two passes that began once the last process had exited, which reclaimed its context)
    let s0 = a.status().unwrap()["sequence"].as_u64().unwrap();
    let v = a.wait("the finished process reclaimed", |v| {
        v["sequence"].as_u64().unwrap() >= s0 + 2 && slice_of(v, "job1")["gpus"][0]["memory_used"] == 364 * MIB
    });
    let reclaimed = v["agent"]["reclaimed_bytes"].as_u64().unwrap();
    s.kill(p1);
    let before = a.status().unwrap()["sequence"].as_u64().unwrap();
    let v = a.wait("reclaim", |v| slice_of(v, "job1")["gpus"][0]["memory_used"] == 0);
    assert!(v["sequence"].as_u64().unwrap() <= before + 2, "reclaimed in pass {} (first seen {before})", v["sequence"]);
    assert_eq!(v["agent"]["reclaimed_bytes"].as_u64().unwrap() - reclaimed, 364 * MIB);

    // Deletion is refused while the slice runs, then allowed.
    let o = a.ctl(&["slice", "delete", "job2"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("1 live process"), "{o:?}");
    s.kill(p2);
    a.wait("job2 idle", |v| slice_of(v, "job2")["processes"].as_array().is_some_and(|p| p.is_empty()));
    assert!(a.state.join("cdi/vgpu-job2.json").exists());
    a.ctl_ok(&["slice", "delete", "job2"]);
    assert!(!a.state.join("cdi/vgpu-job2.json").exists(), "the CDI spec goes with the slice");
    assert!(!a.state.join("slices/job2").exists());
    let o = a.ctl(&["inspect", "job2"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no slice named \"job2\""), "{o:?}");
    // An error quotes at most 64 characters of what it names (issue 61, item 25: a 16 kB name came
    // back whole, and vgpuctl failed with an h2 protocol error).
    let long = "x".repeat(16 << 10);
    for args in [vec!["inspect", long.as_str()], vec!["slice", "create", "--name", "y", "--gpu", long.as_str()]] {
        let o = a.ctl(&args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("... (16384 bytes)") && e.len() < 400 && !e.contains("h2 protocol"), "{e}");
    }

    // The watch stream delivers successive passes.
    let mut w = Command::new(bin("vgpuctl"))
        .env("VGPU_SOCKET", &a.socket)
        .args(["status", "--watch", "--json", "--interval", "100"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut r = std::io::BufReader::new(w.stdout.take().unwrap());
    let mut seqs = Vec::new();
    for _ in 0..3 {
        let mut l = String::new();
        std::io::BufRead::read_line(&mut r, &mut l).unwrap();
        seqs.push(serde_json::from_str::<Value>(&l).unwrap()["sequence"].as_u64().unwrap());
    }
    w.kill().unwrap();
    w.wait().unwrap();
    assert!(seqs.windows(2).all(|p| p[1] > p[0]), "{seqs:?}");

    // On this host, in a slice: `vgpuctl run` gives a command the slice's environment with host
    // paths, and its allocations are held to the slice's limit (2 GiB since the update above; the
    // GPU alone would give the whole 2 GiB asked).
    let o = s
        .cmd(&bin("vgpuctl"))
        .env("VGPU_SOCKET", &a.socket)
        .env_remove("VGPU_AGENT_CONFIG")
        .env("VGPU_CONTEXT_OVERHEAD", "64m")
        .args(["run", "job1", "--", RT, "alloc", "--size", "2g", "--chunk", "100m"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let got = lines(&o.stdout)[0]["allocated"].as_u64().unwrap();
    assert!(got > 0 && got < 2 << 30, "held to the slice's limit: {got}");

    // SIGTERM: a clean exit, the socket removed.
    assert!(a.sigterm().success());
    assert!(!a.socket.exists());
    let log = a.log_text();
    assert!(log.contains("\"shutting down\"") && log.contains("\"stopped\""), "{log}");
    let o = a.ctl(&["status"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot reach the agent"), "{o:?}");
}

#[test]
fn a_sigkilled_agent_leaves_workloads_enforced_and_recovers_everything() {
    let mut s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    let d: Value = serde_json::from_str(
        &a.ctl_ok(&["slice", "create", "--name", "web", "--gpu", "1", "--memory", "1GiB", "--json"]),
    )
    .unwrap();
    a.ctl_ok(&["slice", "create", "--name", "batch", "--gpu", "0,1", "--memory", "2GiB", "--sm", "40"]);
    let (p, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--device", "0", "--size", "500m", "--hold"]);
    a.wait("usage", |v| slice_of(v, "web")["gpus"][0]["memory_used"] == 564 * MIB);

    a.sigkill();
    assert!(a.ctl(&["status"]).status.code() == Some(3));
    // Still enforced without the agent: the limit lives in the region.
    let o = in_slice(&s, &d, RT).args(["alloc", "--device", "0", "--size", "1g", "--chunk", "100m"]).output().unwrap();
    assert_eq!(lines(&o.stdout)[0]["allocated"], 300 * MIB, "1 GiB - 564 MiB - 64 MiB context, in 100 MiB chunks");

    // A process dies while the agent is down.
    let (q, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--device", "0", "--size", "100m", "--hold"]);
    s.kill(q);

    // Restarted (a stale socket file is left behind by SIGKILL): everything comes back.
    assert!(a.socket.exists(), "SIGKILL leaves the socket file");
    a.spawn(&s);
    let v = a.wait("recovered", |v| {
        v["slices"].as_array().is_some_and(|a| a.len() == 2)
            && slice_of(v, "web")["gpus"][0]["memory_used"] == 564 * MIB
    });
    assert_eq!(slice_of(&v, "web")["processes"][0]["host_pid"], p);
    assert_eq!(slice_of(&v, "batch")["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(slice_of(&v, "batch")["gpus"][1]["sm_limit"], 40);
    assert!(a.log_text().contains("\"recovered slices\",\"slices\":2"), "{}", a.log_text());
    // The library was not installed twice.
    assert_eq!(std::fs::read_dir(a.state.join("lib")).unwrap().count(), 1);
    // A second agent on the same socket is refused.
    let o = s
        .cmd(&bin("vgpu-node-agent"))
        .env("VGPU_AGENT_LIBRARY", libvgpu())
        .args([
            "--state-dir",
            a.state.to_str().unwrap(),
            "--socket",
            a.socket.to_str().unwrap(),
            "--metrics-address",
            "off",
        ])
        .arg("--nvml-library")
        .arg(s.libs.join("libnvidia-ml.so.1"))
        .arg("run")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("another agent is serving"), "{o:?}");
}

/// An agent that kills escapes (its configuration file: `escape_action = "kill"` and `more`), with
/// a 1 GiB slice `t` on GPU 0: (agent, configuration file, the slice's detail).
fn killing_agent(s: &Sim, more: &str) -> (Agent, std::path::PathBuf, Value) {
    let cfg = s.state.join("agent.toml");
    std::fs::write(&cfg, format!("escape_action = \"kill\"\n{more}")).unwrap();
    let a = Agent::start(s, &[("VGPU_AGENT_CONFIG", cfg.to_str().unwrap())]);
    let d: Value = serde_json::from_str(
        &a.ctl_ok(&["slice", "create", "--name", "t", "--gpu", "0", "--memory", "1GiB", "--json"]),
    )
    .unwrap();
    (a, cfg, d)
}

#[test]
fn escapes_are_caught_and_killed_when_configured_and_xids_mark_gpus_unhealthy() {
    let mut s = Sim::new(Some(NODE));
    let (a, cfg, d) = killing_agent(&s, "health_recovery_s = 1\n");
    let (p, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--size", "100m", "--hold"]);
    // A process that bypasses the interposer (no LD_PRELOAD) on the slice's GPU.
    let mut rogue = s.cmd(RT).args(["alloc", "--size", "2g", "--hold"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(rogue.stdout.as_mut().unwrap()), &mut line).unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(st) = rogue.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the escaping process was not killed");
        std::thread::sleep(Duration::from_millis(10));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    // (the agent logs after it acts: wait for the line)
    let t = Instant::now();
    while !(a.log_text().contains("GPU process outside every slice") && a.log_text().contains("\"action\":\"killed\""))
    {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", a.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
    let v = a.wait("the escape counted", |v| {
        v["agent"]["escapes_total"] == 1 && v["escapes"].as_array().unwrap().is_empty()
    });
    assert_eq!(slice_of(&v, "t")["processes"][0]["host_pid"], p, "the slice's own process is untouched");

    // A critical XID makes the GPU unhealthy; it recovers after the quiet period. An application
    // XID does not.
    assert!(s.output(SIM, &["xid", "--gpu", "0", "--code", "31"]).status.success());
    assert!(s.output(SIM, &["xid", "--gpu", "1", "--code", "79"]).status.success());
    let v = a.wait("unhealthy", |v| v["gpus"][1]["healthy"] == false);
    assert!(v["gpus"][1]["health_reason"].as_str().unwrap().starts_with("XID 79 at "), "{v}");
    assert_eq!(v["gpus"][0]["healthy"], true);
    let table = a.ctl_ok(&["status"]);
    assert!(table.contains("UNHEALTHY: XID 79"), "{table}");
    let doctor = a.ctl(&["--config", cfg.to_str().unwrap(), "doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(text.contains("unhealthy: XID 79"), "{text}");
    let v = a.wait("recovered", |v| v["gpus"][1]["healthy"] == true);
    // Each GPU's XIDs stay counted after it recovered: in the status, the table and the metrics.
    let xids = |g: usize| {
        let g = &v["gpus"][g];
        (g["critical_xids"].as_u64(), g["application_xids"].as_u64(), g["last_critical_xid"].as_u64())
    };
    assert_eq!((xids(0), xids(1)), ((Some(0), Some(1), Some(0)), (Some(1), Some(0), Some(79))), "{v}");
    let at = v["gpus"][1]["last_critical_xid_at"].as_str().unwrap();
    assert!(v["gpus"][1]["health_reason"] == "" && at.starts_with("20") && at.ends_with('Z'), "{v}");
    let table = a.ctl_ok(&["status"]);
    assert!(
        table.contains(&format!("GPU 1: since the agent started 1 critical XID (the last: 79 at {at})")),
        "{table}"
    );
    assert!(table.contains("GPU 0: since the agent started 1 application XID (a program's fault"), "{table}");
    assert!(!table.contains("UNHEALTHY"), "{table}");
    let (_, body) = a.scrape("/metrics");
    let gpu = |i: usize| format!("device_uuid=\"{}\",device_index=\"{i}\"", v["gpus"][i]["uuid"].as_str().unwrap());
    assert_eq!(metric(&body, "vgpu_gpu_critical_xids_total", &gpu(1)), 1.0, "{body}");
    assert_eq!(metric(&body, "vgpu_gpu_critical_xids_total", &gpu(0)), 0.0, "{body}");
    assert_eq!(metric(&body, "vgpu_gpu_application_xids_total", &gpu(0)), 1.0, "{body}");
    assert_eq!(metric(&body, "vgpu_gpu_last_critical_xid", &gpu(1)), 79.0, "{body}");
}

/// A cgroup made to look like a Kubernetes container's (the systemd driver's names), in the first
/// writable cgroup hierarchy of this machine; removed when dropped. None where none is writable.
struct PodCgroup {
    dirs: Vec<std::path::PathBuf>,
    uid: String,
    id: String,
}

impl PodCgroup {
    fn make() -> Option<PodCgroup> {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let uid = format!("{:08x}-{:04x}-4000-8000-{:012x}", std::process::id(), t as u16, t & 0xffff_ffff_ffff);
        let id = format!("{:016x}{:048x}", t, std::process::id());
        let pod = format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_"));
        let roots = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/systemd"];
        for root in roots.iter().map(Path::new).filter(|r| r.join("cgroup.procs").exists()) {
            let leaf = root
                .join("kubepods.slice")
                .join("kubepods-besteffort.slice")
                .join(&pod)
                .join(format!("cri-containerd-{id}.scope"));
            if std::fs::create_dir_all(&leaf).is_ok() {
                let mut dirs: Vec<_> = leaf.ancestors().take(4).map(Path::to_path_buf).collect();
                dirs.retain(|d| d.starts_with(root.join("kubepods.slice")));
                let cg = PodCgroup { dirs, uid: uid.clone(), id: id.clone() };
                // A process can be moved in (a cgroup v2 hierarchy may refuse, e.g. a threaded one).
                let moved = Command::new("/bin/sh")
                    .args(["-c", &format!("echo $$ > {}", leaf.join("cgroup.procs").display())])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if moved {
                    return Some(cg);
                }
            }
        }
        None
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        // What a failed test left in it (only this test's processes are), then the leaf; the shared
        // parents only once empty (another test's may be beside them).
        let procs = self.dirs[0].join("cgroup.procs");
        for _ in 0..100 {
            let pids = std::fs::read_to_string(&procs).unwrap_or_default();
            if pids.trim().is_empty() {
                break;
            }
            for pid in pids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                // SAFETY: kill(2) with a PID read from this test's own cgroup and a valid signal.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A 1 GiB slice on GPU 0 labelled `labels` (`k=v`), as `slice create --json` describes it.
fn labelled_slice(a: &Agent, name: &str, labels: &[&str]) -> Value {
    let mut args = vec!["slice", "create", "--name", name, "--gpu", "0", "--memory", "1GiB", "--json"];
    for l in labels {
        args.extend(["--label", l]);
    }
    serde_json::from_str(&a.ctl_ok(&args)).unwrap()
}

/// The CUDA client started in cgroup `cg` (where given) before it runs, without libvgpu.so.
fn outside_in(s: &Sim, cg: Option<&PodCgroup>) -> Command {
    let mut c = s.cmd("/bin/sh");
    let join = cg.map(|cg| format!("echo $$ > {} && ", cg.dirs[0].join("cgroup.procs").display()));
    c.args(["-c", &format!("{}exec \"$0\" \"$@\"", join.unwrap_or_default()), RT]);
    c
}

/// The escape of process `pid`, once the agent reports it.
fn escape_of(a: &Agent, pid: u32) -> Value {
    let has = |v: &Value| v["escapes"].as_array().and_then(|e| e.iter().find(|e| e["pid"] == pid)).cloned();
    has(&a.wait("the escape", |v| has(v).is_some())).unwrap()
}

#[test]
fn an_escape_names_its_process_pod_and_container() {
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let cg = PodCgroup::make();
    let uid = cg.as_ref().map_or("00000000-0000-4000-8000-000000000000".to_string(), |c| c.uid.clone());
    let d = labelled_slice(&a, "t", &["namespace=ml", "pod=train-0", &format!("pod-uid={uid}")]);
    let (p, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--size", "100m", "--hold"]);
    // A process of the same pod that does not load libvgpu.so: in the pod's cgroup where this
    // machine lets the test make one.
    if cg.is_none() {
        skipped("the escape's pod and container part: no writable cgroup hierarchy here");
    }
    let (rogue, _) = s.spawn_cmd(outside_in(&s, cg.as_ref()), &["alloc", "--size", "2g", "--hold"]);
    let e = escape_of(&a, rogue);
    assert_eq!(e["command"], "cuda-rt-app", "{e}");
    // `vgpuctl doctor` reports it among the agent's problems.
    let doctor = a.ctl(&["doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(text.contains(&format!("escape: pid {rogue} (cuda-rt-app")), "{text}");
    let table = a.ctl_ok(&["status"]);
    if let Some(cg) = &cg {
        assert_eq!(
            (e["pod_uid"].as_str(), e["container_id"].as_str()),
            (Some(cg.uid.as_str()), Some(cg.id.as_str())),
            "{e}"
        );
        assert_eq!(e["pod"], "ml/train-0", "the pod of the slice with that UID: {e}");
        let line = format!("pid {rogue} (cuda-rt-app, pod ml/train-0, container {}) on ", &cg.id[..12]);
        assert!(table.contains(&line), "{table}");
        let log = a.log_text();
        assert!(
            log.contains(&format!("\"pod_uid\":\"{}\"", cg.uid)) && log.contains("\"command\":\"cuda-rt-app\""),
            "{log}"
        );

        // A slice labelled with its pod's name but not its UID (as in replica mode): the pod is
        // told by the cgroup of the slice's own process.
        let cg2 = PodCgroup::make().unwrap();
        let d2 = labelled_slice(&a, "u", &["namespace=ml", "pod=infer-0"]);
        let (q, _) = s.spawn_cmd(in_slice(&s, &d2, RT), &["alloc", "--size", "100m", "--hold"]);
        std::fs::write(cg2.dirs[0].join("cgroup.procs"), q.to_string()).unwrap();
        a.wait("the slice's process", |v| slice_of(v, "u")["processes"][0]["host_pid"] == q);
        let (rogue2, _) = s.spawn_cmd(outside_in(&s, Some(&cg2)), &["alloc", "--size", "1g", "--hold"]);
        let e = escape_of(&a, rogue2);
        assert_eq!((e["pod"].as_str(), e["pod_uid"].as_str()), (Some("ml/infer-0"), Some(cg2.uid.as_str())), "{e}");
        s.kill(rogue2);
        s.kill(q);
    } else {
        // (a container of this machine's own may follow the command)
        assert!(table.contains(&format!("pid {rogue} (cuda-rt-app")), "{table}");
    }
    let v = a.wait("the slice's own process in it", |v| slice_of(v, "t")["processes"][0]["host_pid"] == p);
    let escaped = |pid: u32| v["escapes"].as_array().unwrap().iter().any(|e| e["pid"] == pid);
    assert!(escaped(rogue) && !escaped(p), "the slice's own process is no escape: {v}");
    s.kill(rogue);
    s.kill(p);
    a.wait("the escape gone", |v| v["escapes"].as_array().is_some_and(|e| e.is_empty()));
}

#[test]
fn an_mps_server_is_not_an_escape_even_where_escapes_are_killed() {
    // MPS: the server holds its clients' work and belongs to no slice; each client (in NVML's MPS
    // list) is attributed to its slice like any process.
    let mut s = Sim::new(Some(&format!("mps = true\n{NODE}")));
    let (a, _, d) = killing_agent(&s, "");
    let server = s.state.join("nvidia-cuda-mps-server");
    std::os::unix::fs::symlink(RT, &server).unwrap();
    let (srv, _) = s.spawn(server.to_str().unwrap(), &["alloc", "--size", "200m", "--hold"]);
    let (client, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--size", "100m", "--hold"]);
    // NVML lists the client only as the server's: measured through the MPS list.
    let v = a.wait("the client measured", |v| slice_of(v, "t")["gpus"][0]["memory_measured"] == 164 * MIB);
    assert!(slice_of(&v, "t")["processes"].as_array().unwrap().iter().any(|p| p["host_pid"] == client), "{v}");
    // Ten passes later the server is still alive and nothing was reported.
    let passes = v["agent"]["passes"].as_u64().unwrap_or(0);
    let v = a.wait("ten more passes", |v| v["agent"]["passes"].as_u64().unwrap_or(0) >= passes + 10);
    assert!(std::path::Path::new(&format!("/proc/{srv}")).exists(), "the MPS server was killed: {}", a.log_text());
    assert_eq!(
        (v["agent"]["escapes_total"].as_u64(), v["escapes"].as_array().map(Vec::len)),
        (Some(0), Some(0)),
        "{v}"
    );
    s.kill(srv);
    s.kill(client);
}

#[test]
fn processes_in_a_pid_namespace_are_mapped_to_their_slice() {
    // Needs PID namespaces (root, or unprivileged user namespaces).
    let probe = |args: &[&str]| Command::new("unshare").args(args).arg("true").status().is_ok_and(|s| s.success());
    let prefix: Vec<&str> = if probe(&["--pid", "--fork"]) {
        // A /proc of its own too, as a container has (for a look from inside it, below).
        vec!["--pid", "--fork", "--mount-proc", "--kill-child"]
    } else if probe(&["--user", "--map-root-user", "--pid", "--fork"]) {
        vec!["--user", "--map-root-user", "--pid", "--fork", "--kill-child"]
    } else {
        skipped("this machine allows no PID namespaces (unshare failed)");
        return;
    };
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let d: Value = serde_json::from_str(
        &a.ctl_ok(&["slice", "create", "--name", "ns", "--gpu", "0", "--memory", "1GiB", "--json"]),
    )
    .unwrap();
    let mut c = in_slice(&s, &d, "unshare");
    c.args(&prefix).arg(RT);
    let (outer, _) = s.spawn_cmd(c, &["alloc", "--size", "200m", "--hold"]);
    let v = a.wait("the namespaced process attributed", |v| {
        slice_of(v, "ns")["processes"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["host_pid"].as_u64().unwrap_or(0) != 0))
    });
    let p = &slice_of(&v, "ns")["processes"][0];
    assert_eq!(p["pid"], 1, "PID 1 inside its namespace: {v}");
    assert_ne!(p["host_pid"], 1);
    assert_ne!(p["host_pid"].as_u64().unwrap(), outer as u64, "the app, not unshare");
    assert_eq!(p["memory"], 264 * MIB);
    assert_eq!(slice_of(&v, "ns")["gpus"][0]["memory_measured"], 264 * MIB, "NVML's figure attributed to the slice");
    assert!(v["escapes"].as_array().unwrap().is_empty(), "not an escape: {v}");
    // The agent wrote the host PID into the process's slot, so NVML's process list inside the
    // container (what nvidia-smi shows) has it, and only it.
    let host = p["host_pid"].as_u64().unwrap() as u32;
    let region = vgpu_region::Region::open(&a.state.join("slices/ns/region"), false).unwrap();
    assert_eq!(region.slots().iter().map(|(_, pid, h, _)| (*pid, *h)).collect::<Vec<_>>(), vec![(1, host)]);
    let lib = s.libs.join("libnvidia-ml.so.1");
    let o = in_slice(&s, &d, NVML).args(["--lib", lib.to_str().unwrap(), "snapshot"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let snap: Value = serde_json::from_slice(&o.stdout).unwrap();
    let listed: Vec<u64> =
        snap["gpus"][0]["processes"]["Ok"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
    assert_eq!(listed, vec![host as u64], "{snap}");
    // From inside the container's PID namespace (and its /proc), as nvidia-smi there: named by its
    // PID there, which that /proc has (the host PID the driver lists does not exist there).
    if prefix[0] == "--pid" {
        let mut c = in_slice(&s, &d, "nsenter");
        c.args(["-t", &host.to_string(), "--pid", "--mount", "--", NVML, "--lib", lib.to_str().unwrap(), "snapshot"]);
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let snap: Value = serde_json::from_slice(&o.stdout).unwrap();
        let listed: Vec<u64> =
            snap["gpus"][0]["processes"]["Ok"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
        assert_eq!(listed, vec![1], "{snap}");
    } else {
        eprintln!("(not as root: the look from inside the namespace is left out)");
    }
}

#[test]
fn bad_configuration_is_rejected_precisely() {
    let s = Sim::new(Some(NODE));
    let cfg = s.state.join("bad.toml");
    std::fs::write(&cfg, "monitor_interval_ms = 1\n").unwrap();
    let o = s.cmd(&bin("vgpu-node-agent")).args(["--config", cfg.to_str().unwrap(), "run"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("bad.toml: monitor_interval_ms: 1 is not from 10 to 60000"), "{e}");
    std::fs::write(&cfg, "state_dir = \"/x\"\nsocket = 5\n").unwrap();
    let o = s.cmd(&bin("vgpu-node-agent")).args(["--config", cfg.to_str().unwrap(), "run"]).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("bad.toml") && e.contains("socket"), "{e}");
    let o = s.cmd(&bin("vgpu-node-agent")).args(["--metrics-address", "nowhere", "run"]).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("metrics_address: \"nowhere\" is not an address"), "{o:?}");
}

#[test]
fn the_agent_exits_3_without_nvml_and_1_when_its_state_cannot_be_made() {
    let s = Sim::new(Some(NODE));
    let dir = s.state.join("exits");
    std::fs::create_dir_all(&dir).unwrap();
    let run = |state_dir: &Path, nvml: &Path| {
        let cfg = dir.join("agent.toml");
        let toml = format!(
            "state_dir = \"{}\"\nsocket = \"{}\"\nmetrics_address = \"off\"\ndevice_plugin = \"off\"\n",
            state_dir.display(),
            dir.join("agent.sock").display()
        );
        std::fs::write(&cfg, toml).unwrap();
        let args = ["--config", cfg.to_str().unwrap(), "--nvml-library", nvml.to_str().unwrap(), "run"];
        let o = s.cmd(&bin("vgpu-node-agent")).args(args).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let nvml = s.libs.join("libnvidia-ml.so.1");
    // NVML missing: 3, as documented, and said.
    let (code, err) = run(&dir.join("state"), Path::new("/nonexistent/libnvidia-ml.so.1"));
    assert_eq!(code, Some(3), "{err}");
    assert!(err.contains("NVML: cannot initialise NVML from /nonexistent/libnvidia-ml.so.1"), "{err}");
    assert!(err.contains("--nvml-library or VGPU_AGENT_NVML_LIBRARY"), "it says how to name it: {err}");
    // A state directory that cannot be made (under a file): 1, whatever the message says.
    std::fs::write(dir.join("a-file"), "").unwrap();
    let (code, err) = run(&dir.join("a-file").join("state"), &nvml);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot create"), "{err}");
}

#[test]
fn doctor_reports_what_to_fix() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let cfg = s.state.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\nsocket = \"{}\"\nlibrary = \"{}\"\nnvml_library = \"{}\"\n",
            a.state.display(),
            a.socket.display(),
            libvgpu().display(),
            s.libs.join("libnvidia-ml.so.1").display()
        ),
    )
    .unwrap();
    let run = |cfg: &Path| {
        let o = s.cmd(&bin("vgpuctl")).args(["--config", cfg.to_str().unwrap(), "doctor", "--json"]).output().unwrap();
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {o:?}"));
        let level = |n: &str| {
            v.as_array().unwrap().iter().find(|c| c["name"] == n).map(|c| c["level"].as_str().unwrap().to_string())
        };
        (o.status.code(), level("nvml"), level("library"), level("preload"), level("state-dir"), level("agent"), v)
    };
    let (code, nvml, lib, pre, state, agent, v) = run(&cfg);
    assert_eq!(
        (nvml.as_deref(), lib.as_deref(), pre.as_deref(), state.as_deref(), agent.as_deref()),
        (Some("ok"), Some("ok"), Some("ok"), Some("ok"), Some("ok")),
        "{v}"
    );
    // The simulated libcuda is on LD_LIBRARY_PATH: the driver check passes too, so nothing fails.
    assert_eq!(code, Some(0), "{v}");
    // A configuration that names only the socket: the running agent says where its state and
    // library are, and those are checked (not the defaults).
    let bare = s.state.join("bare.toml");
    let nvml = s.libs.join("libnvidia-ml.so.1");
    std::fs::write(&bare, format!("socket = \"{}\"\nnvml_library = \"{}\"\n", a.socket.display(), nvml.display()))
        .unwrap();
    let (_, _, lib, _, state, _, v) = run(&bare);
    assert_eq!((lib.as_deref(), state.as_deref()), (Some("ok"), Some("ok")), "{v}");
    let sd = v.as_array().unwrap().iter().find(|c| c["name"] == "state-dir").cloned().unwrap_or_default();
    assert!(sd.to_string().contains(&a.state.display().to_string()), "the agent's state directory: {sd}");
    // A world-writable state directory and a missing library are failures, with the fix (the agent
    // stopped: the configuration file's paths are what is checked).
    let mut a = a;
    assert!(a.sigterm().success());
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&a.state, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::write(
        &cfg,
        std::fs::read_to_string(&cfg).unwrap().replace(&libvgpu().display().to_string(), "/nonexistent/libvgpu.so"),
    )
    .unwrap();
    let (code, _, lib, _, state, _, v) = run(&cfg);
    assert_eq!((code, lib.as_deref(), state.as_deref()), (Some(1), Some("fail"), Some("fail")), "{v}");
    assert!(v.to_string().contains("chmod 0755"), "{v}");
    std::fs::set_permissions(&a.state, std::fs::Permissions::from_mode(0o755)).unwrap();
    // On a Kubernetes node (kubelet's socket in kubelet_dir: the node's own, which `s.cmd` names),
    // replica mode needs the pod resources socket beside it: a warning while it is missing, ok once
    // it is there.
    let k = s.kubelet_dir().parent().unwrap().to_path_buf();
    std::fs::create_dir_all(k.join("device-plugins")).unwrap();
    let _kubelet = std::os::unix::net::UnixListener::bind(k.join("device-plugins/kubelet.sock")).unwrap();
    let (_, _, _, _, _, _, v) = run(&cfg);
    let pr = v.as_array().unwrap().iter().find(|c| c["name"] == "pod-resources").cloned().unwrap_or_default();
    assert_eq!(pr["level"], "warn", "{v}");
    assert!(pr.to_string().contains("slices of removed containers are kept"), "{pr}");
    std::fs::create_dir_all(k.join("pod-resources")).unwrap();
    let _pr = std::os::unix::net::UnixListener::bind(k.join("pod-resources/kubelet.sock")).unwrap();
    let (_, _, _, _, _, _, v) = run(&cfg);
    let pr = v.as_array().unwrap().iter().find(|c| c["name"] == "pod-resources").cloned().unwrap_or_default();
    assert_eq!(pr["level"], "ok", "{v}");
}

#[test]
fn mig_through_the_agent_plan_apply_assert_and_restore_after_reboot() {
    let mut s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    let cfg = s.state.join("mig.yaml");
    std::fs::write(
        &cfg,
        "version: v1\nmig-configs:\n  balanced:\n    - device-filter: \"0x233010DE\"\n      devices: all\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 2\n        \"2g.20gb\": 1\n        \"3g.40gb\": 1\n  all-1g:\n    - devices: [1]\n      mig-enabled: true\n      mig-devices:\n        \"1g.10gb\": 7\n",
    )
    .unwrap();
    let c = cfg.to_str().unwrap();
    let plan = a.ctl_ok(&["mig", "plan", "-f", c, "--name", "balanced"]);
    assert!(
        plan.contains("GPU 1\n  enable MIG mode")
            && plan.contains("create 3g.40gb at slice")
            && plan.contains("5 step(s)"),
        "{plan}"
    );
    assert!(!plan.contains("GPU 0"), "the filter selects the H100 only: {plan}");
    let o = a.ctl(&["mig", "assert", "-f", c, "--name", "balanced"]);
    assert_eq!(o.status.code(), Some(1), "not applied yet");
    let out = a.ctl_ok(&["mig", "apply", "-f", c, "--name", "balanced"]);
    assert!(out.contains("matches the config"), "{out}");
    a.ctl_ok(&["mig", "assert", "-f", c, "--name", "balanced"]);
    // The status (and its stream) shows the layout at once.
    let st = a.status().unwrap();
    assert_eq!(st["gpus"][1]["mode"], "mig");
    assert_eq!(st["gpus"][1]["mig"]["instances"].as_array().unwrap().len(), 4, "{}", st["gpus"][1]);
    let table = a.ctl_ok(&["mig", "status"]);
    assert!(table.contains("3g.40gb@") && table.contains("1g.10gb: 2"), "{table}");
    // Incremental: to 7 x 1g.10gb keeps the two 1g.10gb.
    let plan = a.ctl_ok(&["mig", "plan", "-f", c, "--name", "all-1g"]);
    assert!(plan.contains("2 instance(s) kept"), "{plan}");
    // Disabling: the plan names the four instances destroyed, then the mode, and counts all five.
    let off = s.state.join("off.yaml");
    std::fs::write(&off, "version: v1\nmig-configs:\n  off:\n    - devices: [1]\n      mig-enabled: false\n").unwrap();
    let plan = a.ctl_ok(&["mig", "plan", "-f", off.to_str().unwrap(), "--name", "off"]);
    assert_eq!(plan.matches("  destroy ").count(), 4, "{plan}");
    assert!(plan.contains("disable MIG mode\n  5 step(s)"), "the mode after the destroys, counted: {plan}");
    // Bad input is refused with the reason.
    let o = a.ctl(&["mig", "apply", "-f", c, "--name", "nope"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no mig-config named \"nope\""), "{o:?}");
    // A reboot (the agent down): Hopper loses the mode and the instances; the restarted agent
    // re-applies the recorded layout.
    a.sigterm();
    assert!(s.output(SIM, &["reboot"]).status.success());
    a.spawn(&s);
    a.ctl_ok(&["mig", "assert", "-f", c, "--name", "balanced"]);
    assert!(a.log_text().contains("MIG layout restored"), "{}", a.log_text());
    let _ = &mut s;
}

/// Two slices (25 % and 75 %) on one GPU, both saturating it with 5 ms kernels for 5 s: the status
/// (and `vgpuctl status`) once `ready` holds of it, from 4 s in for as long as both workloads run
/// (a loaded machine starts them late, and runs the agent's passes late), the kernels each ran, and
/// how often the agent logged that it held the SM feedback.
fn two_throttled_slices(nvml: &str, ready: impl Fn(&Value) -> bool) -> (Value, String, [u64; 2], usize) {
    let s = Sim::new(Some(&format!("context_overhead_mib = 64\n{nvml}\n[[gpu]]\nmodel = \"A100-40GB\"\n")));
    let a = Agent::start(&s, &[]);
    let mut apps = Vec::new();
    for (name, sm) in [("low", "25"), ("high", "75")] {
        let out = a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--memory", "1g", "--sm", sm, "--json"]);
        let detail: Value = serde_json::from_str(&out).unwrap();
        let c = in_slice(&s, &detail, RT)
            .args(["launch", "--kernel", "sleep_5ms", "--seconds", "5"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        apps.push(c);
    }
    std::thread::sleep(Duration::from_secs(4));
    let mut st = a.status().unwrap();
    while !ready(&st) && apps.iter_mut().all(|c| c.try_wait().unwrap().is_none()) {
        std::thread::sleep(Duration::from_millis(50));
        st = a.status().unwrap();
    }
    let table = a.ctl_ok(&["status"]);
    let mut k = [0; 2];
    for (i, c) in apps.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{o:?}");
        k[i] = lines(&o.stdout).last().unwrap()["kernels"].as_u64().unwrap();
    }
    let held = a.log_text().matches("SM feedback held").count();
    (st, table, k, held)
}

#[test]
fn the_sm_controller_holds_when_per_process_samples_do_not_add_up() {
    // A driver that credits every time-sliced process with the GPU's whole busy share (as an H200
    // did): both slices seem to use nearly all of it, which, acted on, would drive both budgets to
    // the controller's floor.
    let (st, table, k, held) =
        two_throttled_slices("process_util = \"gpu\"", |v| v["gpus"][0]["sm_feedback_held"] == true);
    assert_eq!(st["gpus"][0]["sm_feedback_held"], true, "{st}");
    assert!(held >= 1, "the hold is logged");
    for name in ["low", "high"] {
        let rate = slice_of(&st, name)["gpus"][0]["sm_rate_ppm"].as_u64().unwrap();
        assert!(rate >= 950_000, "{name}: the rate was corrected to {rate} ppm on samples that do not add up");
    }
    assert!(table.contains("GPU 0: NVML's per-process SM samples add up to more than its utilisation"), "{table}");
    // What the interposers charged (their own accounting) is shown beside NVML's figure.
    let acct = |st: &Value, name| slice_of(st, name)["gpus"][0]["sm_accounted"].as_u64().unwrap();
    assert!((20..=30).contains(&acct(&st, "low")) && (65..=82).contains(&acct(&st, "high")), "{st}");
    let shown = table.split_once("/ 25% (charged ").and_then(|(_, r)| r.split_once('%')?.0.parse::<u64>().ok());
    assert!(shown.is_some_and(|x| (20..=30).contains(&x)), "{table}");
    // 5 s of 5 ms kernels is 1000 for the whole GPU: the interposers' own accounting stands.
    assert!((210..=290).contains(&k[0]) && (670..=790).contains(&k[1]), "25/75 ran {k:?} of 1000");

    // A driver whose samples add up, taken every 150 ms (three passes): nothing held, and each
    // process's latest sample stands for it in the passes between samples.
    let (st, table, k, held) = two_throttled_slices("process_util = \"own\"\nprocess_sample_ms = 150", |_| true);
    assert_eq!(st["gpus"][0]["sm_feedback_held"], false, "{st}");
    // Not even while the workloads started (the GPU's utilisation trails their samples then).
    assert_eq!(held, 0, "held on samples that add up");
    let used = |name| slice_of(&st, name)["gpus"][0]["sm_used"].as_u64().unwrap();
    assert!((17..=33).contains(&used("low")) && (60..=86).contains(&used("high")), "{st}");
    assert!((20..=30).contains(&acct(&st, "low")) && (65..=82).contains(&acct(&st, "high")), "{st}");
    assert!(!table.contains("corrections held"), "{table}");
    assert!((210..=290).contains(&k[0]) && (670..=790).contains(&k[1]), "25/75 ran {k:?} of 1000");
}

/// `nvidia-smi`'s GPU-Util in a slice's container (NVML's utilization rates through libvgpu) is
/// the share of the GPU's time the slice's own kernels ran, as the agent measures it; outside, the
/// GPU's. Once the agent stops, the figure goes stale and the GPU's shows again.
#[test]
fn nvml_in_a_slice_shows_the_slice_s_own_utilization() {
    let mut s = Sim::new(Some("context_overhead_mib = 64\nutil_window_ms = 500\n[[gpu]]\nmodel = \"A100-40GB\"\n"));
    let mut a = Agent::start(&s, &[]);
    let mut detail = std::collections::HashMap::new();
    for name in ["busy", "idle"] {
        let out = a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--memory", "1g", "--json"]);
        detail.insert(name, serde_json::from_str::<Value>(&out).unwrap());
    }
    a.wait("two slices", |v| v["slices"].as_array().unwrap().len() == 2);
    let (idle, _) = s.spawn_cmd(in_slice(&s, &detail["idle"], RT), &["alloc", "--size", "100m", "--hold"]);
    let mut busy = in_slice(&s, &detail["busy"], RT);
    let mut busy =
        busy.args(["launch", "--kernel", "sleep_5ms", "--seconds", "20"]).stdout(Stdio::null()).spawn().unwrap();
    a.wait("the busy slice measured", |v| slice_of(v, "busy")["gpus"][0]["sm_used"].as_u64() >= Some(80));
    let lib = s.libs.join("libnvidia-ml.so.1");
    // GPU-Util (nvmlDeviceGetUtilizationRates), and the lowest and highest of NVML's latest
    // utilization samples (nvmlDeviceGetSamples: nvidia-smi -q -d UTILIZATION).
    let gpu_util = |c: &mut Command| -> (u64, u64, u64) {
        let o = c.args(["--lib", lib.to_str().unwrap(), "snapshot"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let samples: Vec<u64> = v["gpus"][0]["utilization_samples"]["Ok"]
            .as_array()
            .unwrap_or_else(|| panic!("no samples: {}", v["gpus"][0]))
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert!(samples.len() >= 5, "{samples:?}");
        // The newest five (oldest first): the last 400 ms or so, while the busy slice ran.
        let recent = &samples[samples.len() - 5..];
        let (lo, hi) = (*recent.iter().min().unwrap(), *recent.iter().max().unwrap());
        (v["gpus"][0]["utilization"]["gpu"].as_u64().unwrap(), lo, hi)
    };
    let (outside, out_lo, _) = gpu_util(&mut s.cmd(NVML));
    let (in_idle, _, idle_hi) = gpu_util(&mut in_slice(&s, &detail["idle"], NVML));
    let (in_busy, busy_lo, busy_hi) = gpu_util(&mut in_slice(&s, &detail["busy"], NVML));
    // (A sample covers a sixth of the window: busy from about 60 % up, as the launches come.)
    assert!(outside >= 80 && out_lo >= 40, "the GPU is busy: {outside} %, samples from {out_lo} %");
    assert!(
        in_idle <= 5 && idle_hi <= 5,
        "the idle slice's own kernels: none, shown {in_idle} %, samples up to {idle_hi} %"
    );
    assert!(in_busy >= 70 && in_busy <= outside, "the busy slice's own: {in_busy} % (GPU {outside} %)");
    // Its samples are the GPU's, capped at its own share (at least 70 %).
    assert!(busy_lo >= 40, "the busy slice's samples: {busy_lo}-{busy_hi} %");
    // nvidia-smi's view there: the slice's memory, its utilisation, its one process.
    let o = in_slice(&s, &detail["idle"], NVML).args(["--lib", lib.to_str().unwrap(), "smi"]).output().unwrap();
    let smi = String::from_utf8_lossy(&o.stdout);
    let gpu0 = smi.lines().next().unwrap_or_default();
    let util = gpu0.split_once("GPU-Util ").and_then(|(_, u)| u.trim_end_matches(" %").parse::<u64>().ok());
    assert!(gpu0.contains(" MiB / 1024 MiB,") && util.is_some_and(|u| u <= 5), "{smi}");
    let procs: Vec<&str> = smi.lines().filter(|l| l.trim_start().starts_with("process")).collect();
    assert!(procs.len() == 1 && procs[0].contains(&idle.to_string()), "{smi}");
    // The agent stops: within its figure's life (2 s here) the GPU's shows again.
    a.sigkill();
    std::thread::sleep(Duration::from_millis(2500));
    let (in_idle, idle_lo, _) = gpu_util(&mut in_slice(&s, &detail["idle"], NVML));
    assert!(in_idle >= 80 && idle_lo >= 40, "no agent: the GPU's figures, {in_idle} %, samples from {idle_lo} %");
    busy.kill().unwrap();
    busy.wait().unwrap();
    s.kill(idle);
}

/// Current wall-clock time in ms.
fn wall_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

#[test]
fn each_slice_s_last_kernel_is_reported_from_nvml_samples_or_from_its_charged_launches() {
    // The slice's kernels seen through NVML's per-process samples, whether or not a limit applies;
    // and through the launches its interposers charged where the driver has no such samples.
    for (nvml, seen) in [("own", ["busy", "limited"]), ("none", ["limited", "limited"])] {
        let mut s = Sim::new(Some(&format!(
            "context_overhead_mib = 64\nprocess_util = \"{nvml}\"\n[[gpu]]\nmodel = \"A100-40GB\"\n"
        )));
        let a = Agent::start(&s, &[]);
        let mut detail = std::collections::HashMap::new();
        for (name, sm) in [("busy", None), ("limited", Some("50")), ("idle", None)] {
            let mut args = vec!["slice", "create", "--name", name, "--gpu", "0", "--memory", "1g", "--json"];
            args.extend(sm.map(|x| ["--sm", x]).into_iter().flatten());
            detail.insert(name, serde_json::from_str::<Value>(&a.ctl_ok(&args)).unwrap());
        }
        // Every slice watched (and so GPU 0 shared: the 50 % limit applies).
        a.wait("three slices", |v| v["slices"].as_array().unwrap().len() == 3);
        let (idle, _) = s.spawn_cmd(in_slice(&s, &detail["idle"], RT), &["alloc", "--size", "100m", "--hold"]);
        let start = wall_ms();
        let runs: Vec<_> = ["busy", "limited"]
            .into_iter()
            .map(|n| {
                let mut c = in_slice(&s, &detail[n], RT);
                c.args(["launch", "--kernel", "sleep_5ms", "--seconds", "1"]).stdout(Stdio::null()).spawn().unwrap()
            })
            .collect();
        for mut c in runs {
            assert!(c.wait().unwrap().success());
        }
        let end = wall_ms();
        std::thread::sleep(Duration::from_millis(1500));
        let st = a.wait("a pass after the kernels", |v| v["timestamp_ms"].as_u64().unwrap() > end + 1400);
        let last = |n| slice_of(&st, n)["gpus"][0]["last_kernel_unix_ms"].as_u64().unwrap_or(0);
        for n in ["busy", "limited"] {
            let l = last(n);
            if seen.contains(&n) {
                // Within the run, give or take NVML's sample period and one agent pass.
                assert!(l >= start && l <= end + 300, "{nvml}: {n}'s last kernel at {l}, ran {start}..{end}");
            } else {
                assert_eq!(l, 0, "{nvml}: {n}'s kernels cannot be seen without per-process samples");
            }
        }
        assert_eq!(last("idle"), 0, "{nvml}: the idle slice ran no kernel");
        let watched = slice_of(&st, "idle")["watched_since_unix_ms"].as_u64().unwrap();
        assert!(watched > 0 && watched <= start, "{st}");

        // The HAMi metric: seconds since the last kernel, or since the agent began watching.
        let (_, body) = a.scrape("/metrics");
        let name = "hami_container_last_kernel_elapsed_seconds";
        let scraped = wall_ms();
        let elapsed = |n: &str| metric(&body, name, &format!("slice=\"{n}\""));
        let l = last("limited");
        let want = (scraped - l) as f64 / 1000.0;
        assert!((elapsed("limited") - want).abs() < 0.5, "{} vs {want}\n{body}", elapsed("limited"));
        assert!(elapsed("limited") >= 1.4, "{body}");
        let want = (scraped - watched) as f64 / 1000.0;
        assert!((elapsed("idle") - want).abs() < 0.5 && elapsed("idle") > elapsed("limited"), "{body}");

        // vgpuctl: how long ago, or none since it watched.
        let table = a.ctl_ok(&["status"]);
        assert!(table.contains("LAST KERNEL"), "{table}");
        let row = |n: &str| table.lines().find(|l| l.starts_with(n)).unwrap_or_else(|| panic!("{table}")).to_string();
        assert!(row("limited").contains("s ago"), "{table}");
        assert!(row("idle").contains("none in "), "{table}");
        s.kill(idle);
    }
}

#[test]
fn allocations_served_as_unified_memory_are_reported_per_slice() {
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let mut detail = std::collections::HashMap::new();
    for (name, memory) in [("big", "7500m"), ("over", "2g")] {
        let out = a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--memory", memory, "--json"]);
        detail.insert(name, serde_json::from_str::<Value>(&out).unwrap());
    }
    // 7 GiB and a 64 MiB context of GPU 0's 8 GiB held by "big"; "over" (2 GiB, 64 MiB charged per
    // context here) gets 19 x 100 MiB: 8 fit on the GPU beside its context, 11 become unified memory.
    s.spawn_cmd(in_slice(&s, &detail["big"], RT), &["alloc", "--size", "7g", "--hold"]);
    let mut c = in_slice(&s, &detail["over"], RT);
    c.env("CUDA_OVERSUBSCRIBE", "true");
    let (_, v) = s.spawn_cmd(c, &["alloc", "--size", "4g", "--chunk", "100m", "--hold"]);
    assert_eq!(v["allocated"], 1900 * MIB, "{v}");
    let st = a.wait("the spill reported", |v| slice_of(v, "over")["gpus"][0]["spilled_allocations"] == 11);
    assert_eq!(slice_of(&st, "over")["gpus"][0]["spilled_bytes"], 1100 * MIB);
    assert_eq!(slice_of(&st, "big")["gpus"][0]["spilled_allocations"].as_u64().unwrap_or(0), 0);
    let table = a.ctl_ok(&["status"]);
    assert!(
        table.contains("slice over on GPU 0: 11 allocation(s), 1.1 GiB in all, served as unified memory"),
        "{table}"
    );
    assert!(!table.contains("slice big on GPU 0"), "{table}");
    let (_, body) = a.scrape("/metrics");
    assert_eq!(metric(&body, "vgpu_slice_spilled_bytes_total", "slice=\"over\""), (1100 * MIB) as f64);
}

#[test]
fn with_memory_scaling_slices_add_up_past_the_gpu_and_what_has_no_room_becomes_unified_memory() {
    let mut s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[("VGPU_AGENT_MEMORY_SCALING", "1.5")]);
    // GPU 0's 8 GiB count as 12 GiB.
    let o = a.ctl(&["slice", "create", "--name", "x", "--gpu", "0", "--memory", "12.5g"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("memory limit 12.5 GiB is more than GPU 0 has (12.0 GiB, memory_scaling 1.5)"), "{e}");
    let mut detail = std::collections::HashMap::new();
    for (name, memory) in [("a", "6g"), ("b", "5g")] {
        let out = a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--memory", memory, "--json"]);
        detail.insert(name, serde_json::from_str::<Value>(&out).unwrap());
    }
    assert_eq!(detail["b"]["env"]["CUDA_OVERSUBSCRIBE"], "true", "{}", detail["b"]);
    // "a" holds 5 GiB and a 64 MiB context; "b" gets its 4 GiB although 2944 MiB are left: 29 x 100 MiB
    // on the GPU, 11 as unified memory. The flag in its limits file is enough (no environment).
    s.spawn_cmd(in_slice(&s, &detail["a"], RT), &["alloc", "--size", "5g", "--hold"]);
    let mut c = in_slice(&s, &detail["b"], RT);
    c.env_remove("CUDA_OVERSUBSCRIBE");
    let (b, v) = s.spawn_cmd(c, &["alloc", "--size", "4000m", "--chunk", "100m", "--hold"]);
    assert_eq!((v["allocated"].as_u64(), v["error"].as_str()), (Some(4000 * MIB), None), "{v}");
    let st = a.wait("b's spill", |v| slice_of(v, "b")["gpus"][0]["spilled_allocations"] == 11);
    assert_eq!(slice_of(&st, "b")["gpus"][0]["memory_used"], 4064 * MIB);
    assert!(st["escapes"].as_array().unwrap().is_empty(), "{st}");
    s.kill(b);

    // Back to 1 (an agent restart): the flag goes from every slice's files, and the variable from
    // their injection.
    let limits = a.state.join("slices/b/limits");
    assert!(vgpu_region::Region::open(&limits, false).unwrap().oversubscribe());
    assert!(a.sigterm().success());
    a.env.clear();
    a.spawn(&s);
    assert!(!vgpu_region::Region::open(&limits, false).unwrap().oversubscribe());
    let v: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "b", "--json"])).unwrap();
    assert!(v["slice"]["env"].get("CUDA_OVERSUBSCRIBE").is_none(), "{v}");
}

#[test]
fn a_unified_memory_gpu_is_sliced_against_the_host_s_memory() {
    // GB10: NVML answers NOT_SUPPORTED for the GPU's memory (its memory is the host's) and still
    // lists what each process holds.
    let mut s = Sim::new(Some("context_overhead_mib = 64\n[[gpu]]\nmodel = \"H100-80GB\"\nnvml_memory_info = false\n"));
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:")).unwrap();
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().unwrap();
    let host = kib * 1024;
    let lib = s.libs.join("libnvidia-ml.so.1");
    let probe = |mut c: Command| -> Value {
        let o = c.args(["--lib", lib.to_str().unwrap(), "snapshot"]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    assert!(probe(s.cmd(NVML))["gpus"][0]["memory"].is_null(), "NVML itself has no memory figures");

    let a = Agent::start(&s, &[]);
    let st = a.status().unwrap();
    let g = &st["gpus"][0];
    assert_eq!((g["memory_total"].as_u64(), g["unified_memory"].as_bool()), (Some(host), Some(true)), "{g}");
    let out = a.ctl_ok(&["slice", "create", "--name", "spark", "--gpu", "0", "--memory", "2g", "--json"]);
    let detail: Value = serde_json::from_str(&out).unwrap();
    s.spawn_cmd(in_slice(&s, &detail, RT), &["alloc", "--size", "1g", "--hold"]);
    let over = in_slice(&s, &detail, RT).args(["alloc", "--size", "2g", "--chunk", "100m"]).output().unwrap();
    assert_eq!(lines(&over.stdout)[0]["allocated"], 800 * MIB, "2 GiB less 1088 MiB held, less this context");
    // The GPU's use is what its processes hold; it stays healthy through the passes.
    let st = a.wait("the process counted", |v| {
        v["gpus"][0]["memory_used"] == 1088 * MIB && slice_of(v, "spark")["gpus"][0]["memory_used"] == 1088 * MIB
    });
    assert_eq!((st["gpus"][0]["healthy"].as_bool(), st["gpus"][0]["memory_total"].as_u64()), (Some(true), Some(host)));
    // In the container, NVML (nvidia-smi) shows the slice.
    let n = probe(in_slice(&s, &detail, NVML));
    assert_eq!(
        (n["gpus"][0]["memory"]["total"].as_u64(), n["gpus"][0]["memory"]["used"].as_u64()),
        (Some(2048 * MIB), Some(1088 * MIB)),
        "{n}"
    );
    let table = a.ctl_ok(&["status"]);
    assert!(table.contains("1.1 GiB / ") && table.contains("(unified, the host's)"), "{table}");
}

#[test]
fn an_upgrade_gives_new_slices_the_new_library_and_the_old_one_goes_once_nothing_needs_it() {
    let mut s = Sim::new(Some(NODE));
    let dir = s.state.join("releases");
    std::fs::create_dir_all(&dir).unwrap();
    let (old, new) = (dir.join("old.so"), dir.join("new.so"));
    std::fs::copy(libvgpu(), &old).unwrap();
    let mut bytes = std::fs::read(libvgpu()).unwrap();
    bytes.extend_from_slice(b"\0another build");
    std::fs::write(&new, bytes).unwrap();
    let lib_of = |d: &Value| -> std::path::PathBuf {
        let m = d["mounts"].as_array().unwrap().iter().find(|m| m["container_path"] == "/usr/local/vgpu/libvgpu.so");
        m.unwrap()["host_path"].as_str().unwrap().into()
    };
    let mut a = Agent::start(&s, &[("VGPU_AGENT_LIBRARY", old.to_str().unwrap())]);
    let before: Value = serde_json::from_str(
        &a.ctl_ok(&["slice", "create", "--name", "before", "--gpu", "0", "--memory", "1g", "--json"]),
    )
    .unwrap();
    let (p, _) = s.spawn_cmd(in_slice(&s, &before, RT), &["alloc", "--size", "100m", "--hold"]);

    // The upgrade: the agent restarts with another build of the library.
    assert!(a.sigterm().success());
    a.env = vec![("VGPU_AGENT_LIBRARY".into(), new.to_str().unwrap().into())];
    a.spawn(&s);
    let after: Value = serde_json::from_str(
        &a.ctl_ok(&["slice", "create", "--name", "after", "--gpu", "0", "--memory", "1g", "--json"]),
    )
    .unwrap();
    let (l1, l2) = (lib_of(&before), lib_of(&after));
    assert_ne!(l1, l2, "a new slice gets the new build");
    assert!(l1.exists(), "kept: the slice from before the upgrade (and its process) may need it");
    let st = a.wait("the process from before found again", |v| slice_of(v, "before")["processes"][0]["host_pid"] == p);
    assert_eq!(slice_of(&st, "before")["gpus"][0]["memory_used"], 164 * MIB);
    // Still limited by the library it loaded: 1 GiB less what it holds.
    let o = in_slice(&s, &before, RT).args(["alloc", "--size", "2g", "--chunk", "100m"]).output().unwrap();
    assert_eq!(lines(&o.stdout)[0]["allocated"], 700 * MIB);

    s.kill(p);
    a.ctl_ok(&["slice", "delete", "before"]);
    assert!(!l1.exists() && l2.exists(), "no slice predates the new build and no process maps the old one");
    assert!(a.log_text().contains("older libvgpu.so removed"), "{}", a.log_text());
}

/// `log_level` (or `VGPU_AGENT_LOG_LEVEL`) sets what the agent logs, as a level or `RUST_LOG`-style
/// directives.
#[test]
fn the_log_level_is_a_setting() {
    let s = Sim::new(Some(NODE));
    let quiet = Agent::start(&s, &[("VGPU_AGENT_LOG_LEVEL", "warn")]);
    assert!(!quiet.log_text().contains("serving the API"), "{}", quiet.log_text());
    drop(quiet);
    let s = Sim::new(Some(NODE));
    let chatty = Agent::start(&s, &[("VGPU_AGENT_LOG_LEVEL", "warn,vgpu_agent::daemon=info")]);
    assert!(chatty.log_text().contains("serving the API"), "{}", chatty.log_text());
}

/// An agent that found no libvgpu.so at start: `slice create` says that the slice runs unlimited.
#[test]
fn a_slice_without_the_library_is_said_to_run_unlimited() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[("VGPU_AGENT_LIBRARY", "/nonexistent/libvgpu.so")]);
    let out = a.ctl_ok(&["slice", "create", "--name", "bare", "--gpu", "0", "--memory", "1GiB"]);
    assert!(out.contains("warning: the agent has no libvgpu.so to give this slice"), "{out}");
    assert!(out.contains("run without limits"), "{out}");
}

/// A slice's priority: set at creation, shown by status, slice list, inspect and the metrics, kept
/// in its limits file (which only the agent writes), and changed while its processes run.
#[test]
fn a_slice_s_priority_is_set_shown_and_changed_while_it_runs() {
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let d: Value = serde_json::from_str(&a.ctl_ok(&[
        "slice",
        "create",
        "--name",
        "web",
        "--gpu",
        "0",
        "--memory",
        "1GiB",
        "--priority",
        "high",
        "--json",
    ]))
    .unwrap();
    assert_eq!(d["priority"], "high", "{d}");
    a.ctl_ok(&["slice", "create", "--name", "batch", "--gpu", "0", "--memory", "1GiB"]);
    let limits = |name: &str| {
        let p = a.state.join("slices").join(name).join("limits");
        vgpu_region::Region::open(&p, false).unwrap().priority_high()
    };
    assert!(limits("web") && !limits("batch"));
    // A process in the slice while its priority changes.
    let (p, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--size", "100m", "--hold"]);
    let st = a.wait("the process in web", |v| slice_of(v, "web")["processes"][0]["host_pid"] == p);
    assert_eq!(
        (slice_of(&st, "web")["priority"].as_str(), slice_of(&st, "batch")["priority"].as_str()),
        (Some("high"), Some("normal"))
    );
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(list.lines().any(|l| l.starts_with("web ") && l.contains(" high ")), "{list}");
    assert!(a.ctl_ok(&["status"]).contains("web [high]"));
    let (_, body) = a.scrape("/metrics");
    assert_eq!(metric(&body, "vgpu_slice_priority_high", "slice=\"web\""), 1.0);
    assert_eq!(metric(&body, "vgpu_slice_priority_high", "slice=\"batch\""), 0.0);
    // Lowered while it runs: the limits file follows at once, and so does what the agent reports.
    let out = a.ctl_ok(&["slice", "update", "web", "--priority", "normal"]);
    assert!(out.contains("priority: high -> normal"), "{out}");
    assert!(!limits("web"));
    let st = a.wait("web normal", |v| slice_of(v, "web")["priority"] == "normal");
    assert_eq!(slice_of(&st, "web")["processes"][0]["host_pid"], p, "its process runs on");
    a.ctl_ok(&["slice", "update", "batch", "--priority", "high"]);
    assert!(limits("batch"));
    // A bad value is refused with what is accepted.
    let o = a.ctl(&["slice", "update", "web", "--priority", "top"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("possible values: normal, high"), "{o:?}");
    s.kill(p);
}

/// Liveness holds whatever the metrics port suffers: with 600 connections held open there sending
/// a header a byte at a time (a slowloris: 5 of 6 `/livez` probes took 10-14 s against the chart's
/// 5 s), `vgpuctl live`, the chart's probe, answers over the agent's socket at once. Issue 61,
/// item 24.
#[test]
fn liveness_is_answered_over_the_socket_whatever_the_metrics_port_suffers() {
    use std::io::Write;
    let s = Sim::new(Some("[[gpu]]\nmodel = \"A100-40GB\"\n"));
    let a = Agent::start(&s, &[]);
    assert_eq!(a.ctl_ok(&["live"]).trim(), "live");
    let mut held: Vec<std::net::TcpStream> = Vec::new();
    let addr: std::net::SocketAddr = a.metrics.parse().unwrap();
    for _ in 0..600 {
        match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200)) {
            Ok(mut c) => {
                let _ = c.write_all(b"GET /metrics HTTP/1.1\r\nX-a: ");
                held.push(c);
            }
            Err(_) => break,
        }
    }
    let t = std::time::Instant::now();
    for _ in 0..6 {
        assert_eq!(a.ctl_ok(&["live"]).trim(), "live");
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "six probes took {:?}", t.elapsed());
    drop(held);
}

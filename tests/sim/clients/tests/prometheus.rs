//! The packaged alerting rules (packaging/prometheus/vgpu-alerts.yaml) and Grafana dashboard
//! (packaging/helm/vgpu/dashboards/vgpu-dashboard.json) against Prometheus itself.
//!
//! - promtool's unit tests run the rules through Prometheus's rule engine over series with the
//!   names and labels of a real agent's scrape (a slice with a pod's labels, a process in it) and
//!   the labels the chart's ServiceMonitor gives a target (honorLabels, `node`). Each alert fires
//!   when its condition has held for its `for`, with the labels and the filled-in summary an
//!   operator gets, and stays quiet before, after and for what must not page (a counter reset by
//!   an agent's restart, a slice that freed its memory). A second node's scrape gives the series
//!   of a MIG device. Both scrapes pass `promtool check metrics`.
//! - A real Prometheus scrapes a real agent on the simulated GPU with the rules loaded: every rule
//!   evaluates without error, every query of the dashboard (and of its variables) returns series,
//!   nothing fires on a healthy node, and an allocation refused at a slice's limit fires
//!   VgpuSliceMemoryRefused with the pod's and the node's names.
//!
//! promtool and prometheus come with Debian's `prometheus` package; `.ci/run` installs it and sets
//! VGPU_REQUIRE_PROMETHEUS=1, so there the tests cannot skip. Elsewhere they skip, saying so.

mod common;
use common::agent::*;
use common::*;

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

type Labels = BTreeMap<String, String>;
/// An alert, its input series with their values, and the minutes at which it is checked (and
/// whether it fires then).
type Case<'a> = (&'a str, Vec<(Labels, &'a str)>, Vec<(u32, bool)>);

/// A program of Debian's `prometheus` package, from PATH.
fn tool(name: &str) -> Option<String> {
    let found =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()));
    if found.is_none() {
        assert!(
            std::env::var_os("VGPU_REQUIRE_PROMETHEUS").is_none(),
            "{name} is required (apt-get install prometheus)"
        );
        skipped(&format!("no {name} on PATH (Debian: apt-get install prometheus)"));
    }
    found.map(|p| p.display().to_string())
}

fn repo_file(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../..").join(path).canonicalize().unwrap()
}

/// A node with one GPU and one slice with a pod's labels (1 GiB, 50 % of the GPU's time), a
/// process holding 300 MiB in it.
fn node_with_a_slice() -> (Sim, Agent, Value) {
    node_with_a_slice_and(&[])
}

/// [`node_with_a_slice`], the agent given `env` too. The agent's node is the one the scrape
/// labels (in a cluster, both are the Node's name).
fn node_with_a_slice_and(env: &[(&str, &str)]) -> (Sim, Agent, Value) {
    let mut s = Sim::new(Some("context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let mut env = env.to_vec();
    env.push(("NODE_NAME", "gpu-node-7"));
    let a = Agent::start(&s, &env);
    let args = "slice create --name train-0-main --gpu 0 --memory 1GiB --sm 50 --json";
    let mut args: Vec<&str> = args.split(' ').collect();
    args.extend(["--label", "namespace=ml", "--label", "pod=train-0", "--label", "container=main"]);
    let j: Value = serde_json::from_str(&a.ctl_ok(&args)).unwrap();
    s.spawn_cmd(in_slice(&s, &j, RT), &["alloc", "--size", "300m", "--hold"]);
    a.wait("the slice's memory", |v| slice_of(v, "train-0-main")["gpus"][0]["memory_used"].as_u64() > Some(0));
    (s, a, j)
}

/// A node with one GPU in MIG mode and one MIG device on it (made through NVML before the agent
/// starts): the agent's scrape, with the per-MIG-instance series.
fn mig_node_scrape() -> String {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    assert_eq!(s.mig(0, &["mode:1"])[0]["ret"], 0);
    let gi = s.mig(0, &["create:19@0"]);
    assert_eq!(gi[0]["ret"], 0, "{gi:?}");
    let ci = s.mig(0, &[&format!("ci:{}:0", gi[0]["id"])]);
    assert_eq!(ci[0]["ret"], 0, "{ci:?}");
    let a = Agent::start(&s, &[]);
    a.wait("the MIG device", |v| v["gpus"][0]["mig"]["instances"].as_array().is_some_and(|i| i.len() == 1));
    let (code, body) = a.scrape("/metrics");
    assert_eq!(code, "HTTP/1.1 200 OK");
    body
}

/// A node whose GPU runs MPS (the simulator's stand-in daemon): the agent's scrape, with the
/// per-daemon series.
fn mps_node_scrape() -> String {
    let s = Sim::new(Some("[[gpu]]\nmodel = \"H100-80GB\"\n"));
    let control = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");
    let a = Agent::start(&s, &[("VGPU_AGENT_MPS_GPUS", "0"), ("VGPU_AGENT_MPS_CONTROL", control)]);
    a.wait("the MPS daemon", |v| v["gpus"][0]["mps"]["running"] == true);
    let (code, body) = a.scrape("/metrics");
    assert_eq!(code, "HTTP/1.1 200 OK");
    let _ = a.ctl(&["status"]);
    let pipe = a.state.join("mps").join(s.nvml()["gpus"][0]["uuid"].as_str().unwrap()).join("pipe");
    let mut quit = s.cmd(control);
    quit.env("CUDA_MPS_PIPE_DIRECTORY", pipe).stdin(Stdio::piped());
    let mut c = quit.spawn().unwrap();
    c.stdin.take().unwrap().write_all(b"quit\n").unwrap();
    let _ = c.wait();
    body
}

/// The labels of each metric's first series in an exposition (`name{k="v",...} value` lines).
fn series(body: &str) -> BTreeMap<String, Labels> {
    let mut out = BTreeMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (name, rest) = match line.find('{') {
            Some(i) => (&line[..i], &line[i + 1..]),
            None => (line.split(' ').next().unwrap(), ""),
        };
        let mut labels = Labels::new();
        let mut rest = rest;
        while let Some(eq) = rest.find("=\"") {
            let key = rest[..eq].trim_start_matches(',').to_string();
            let mut value = String::new();
            let mut chars = rest[eq + 2..].char_indices();
            let end = loop {
                match chars.next().expect("a closed label value") {
                    (_, '\\') => value.push(match chars.next().unwrap().1 {
                        'n' => '\n',
                        c => c,
                    }),
                    (i, '"') => break eq + 2 + i + 1,
                    (_, c) => value.push(c),
                }
            };
            labels.insert(key, value);
            rest = &rest[end..];
            if rest.starts_with('}') {
                break;
            }
        }
        out.entry(name.to_string()).or_insert(labels);
    }
    out
}

fn selector(name: &str, labels: &Labels) -> String {
    let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{name}{{{}}}", l.join(","))
}

/// `{{ $labels.x }}` filled in, as Prometheus does; the rules use no other template, and name only
/// labels their alert carries (Prometheus would print nothing for another).
fn expand(text: &str, labels: &Labels, value: Option<&str>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("{{") {
        out.push_str(&rest[..i]);
        let j = rest[i..].find("}}").unwrap() + i;
        let key = rest[i + 2..j].trim();
        if key == "$value" {
            out.push_str(value.unwrap_or_else(|| panic!("{text}: the case gives no value")));
        } else {
            let key = key.strip_prefix("$labels.").unwrap_or_else(|| panic!("template {text}"));
            out.push_str(
                labels.get(key).unwrap_or_else(|| panic!("{text} names {key}, which the alert does not carry")),
            );
        }
        rest = &rest[j + 2..];
    }
    out + rest
}

#[test]
fn the_alerting_rules_fire_on_the_agent_s_series_and_only_then() {
    let Some(promtool) = tool("promtool") else { return };
    let rules_path = repo_file("packaging/prometheus/vgpu-alerts.yaml");
    let o = Command::new(&promtool).args(["check", "rules"]).arg(&rules_path).output().unwrap();
    assert!(
        o.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    // A real scrape.
    let (s, a, _) = node_with_a_slice();
    let (code, body) = a.scrape("/metrics");
    assert_eq!(code, "HTTP/1.1 200 OK");
    // And one of a node with a MIG device, and one of a node running MPS, for the series only
    // such nodes have.
    let mig_body = mig_node_scrape();
    let mps_body = mps_node_scrape();

    // The expositions are valid and pass Prometheus's lint.
    for body in [&body, &mig_body, &mps_body] {
        let mut c = Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success() && said.trim().is_empty(), "promtool check metrics: {said}");
    }

    // Each series as Prometheus stores it: the agent's labels, then the target's where the agent
    // has none of that name (honorLabels), with the node's name added by the ServiceMonitor.
    let target: Labels = [
        ("job", "vgpu-node-agent-metrics"),
        ("instance", "10.4.7.21:9394"),
        ("node", "gpu-node-7"),
        ("namespace", "vgpu-system"),
        ("pod", "vgpu-node-agent-x7k2p"),
        ("container", "vgpu-node-agent"),
        ("service", "vgpu-node-agent-metrics"),
        ("endpoint", "metrics"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut scraped = series(&body);
    for (name, labels) in series(&mig_body).into_iter().chain(series(&mps_body)) {
        scraped.entry(name).or_insert(labels);
    }
    let stored = |name: &str| -> Labels {
        let mut l = scraped.get(name).unwrap_or_else(|| panic!("the agent exports no {name}")).clone();
        for (k, v) in &target {
            l.entry(k.clone()).or_insert_with(|| v.clone());
        }
        l
    };
    let slice = stored("hami_vgpu_memory_used_bytes");
    assert_eq!((slice["namespace"].as_str(), slice["pod"].as_str()), ("ml", "train-0"), "{slice:?}");

    // Each alert's severity and annotations, as written.
    let text = std::fs::read_to_string(&rules_path).unwrap();
    let file: yaml_serde::Value = yaml_serde::from_str(&text).unwrap();
    let rules = file["groups"][0]["rules"].as_sequence().unwrap();
    let rule = |alert: &str| -> (String, BTreeMap<String, String>) {
        let r = rules.iter().find(|r| r["alert"].as_str() == Some(alert)).unwrap_or_else(|| panic!("no rule {alert}"));
        let ann = r["annotations"].as_mapping().unwrap();
        let ann = ann.iter().map(|(k, v)| (k.as_str().unwrap().to_string(), v.as_str().unwrap().to_string()));
        (r["labels"]["severity"].as_str().unwrap().to_string(), ann.collect())
    };

    // (alert, [(series, values)], [(minute, fires)]): the alert's labels are the first series'.
    // One value a minute from minute 0; in promtool's notation `AxN` is A repeated N+1 times and
    // `A+BxN` counts up from A by B.
    let up = {
        let mut l = target.clone();
        l.insert("__name__".into(), "up".into());
        l
    };
    let cases: Vec<Case> = {
        let m = |name: &str| {
            let mut l = stored(name);
            l.insert("__name__".into(), name.into());
            l
        };
        let ksm = |name: &str| -> Labels {
            [
                ("__name__", name),
                ("job", "kube-state-metrics"),
                ("instance", "10.4.0.9:8080"),
                ("namespace", "vgpu-system"),
                ("daemonset", "vgpu-node-agent"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
        };
        vec![
            ("VgpuAgentDown", vec![(up.clone(), "1 1 0x10")], vec![(1, false), (6, false), (7, true), (12, true)]),
            ("VgpuAgentDown", vec![(up.clone(), "1x12")], vec![(12, false)]),
            // kube-state-metrics' series of the agent's DaemonSet: 3 nodes, one without an available
            // pod from minute 2 to 16 (a rollout's brief gap at minute 21 is not an alert).
            (
                "VgpuAgentUnavailable",
                vec![
                    (ksm("kube_daemonset_status_desired_number_scheduled"), "3x30"),
                    (ksm("kube_daemonset_status_number_available"), "3 3 2x14 3x3 2 3x9"),
                ],
                vec![(1, false), (11, false), (12, true), (16, true), (17, false), (20, false), (21, false)],
            ),
            (
                "VgpuGpuUnhealthy",
                vec![(m("vgpu_gpu_healthy"), "1 0x3 1x5")],
                vec![(1, false), (2, true), (4, true), (5, false)],
            ),
            // An XID about one GPU instance: its MIG device out for 3 minutes.
            (
                "VgpuMigDeviceUnhealthy",
                vec![(m("vgpu_mig_device_healthy"), "1 1 0x2 1x5")],
                vec![(2, false), (3, true), (4, true), (5, false)],
            ),
            (
                "VgpuCriticalXid",
                vec![(m("vgpu_gpu_critical_xids_total"), "0 0 1x20")],
                vec![(1, false), (3, true), (11, true), (13, false)],
            ),
            // The agent restarted: its counter starts again at 0. Not an XID.
            ("VgpuCriticalXid", vec![(m("vgpu_gpu_critical_xids_total"), "5x3 0x10")], vec![(6, false), (12, false)]),
            ("VgpuQuotaEscape", vec![(m("vgpu_escapes_active"), "0 1x5 0x3")], vec![(2, false), (3, true), (7, false)]),
            ("VgpuAgentWarnings", vec![(m("vgpu_warnings_active"), "0 2x15")], vec![(10, false), (11, true)]),
            (
                "VgpuAgentPassSlow",
                // A pass of exactly 1 s is not over a second; 3 s from minute 7.
                vec![(m("vgpu_agent_loop_seconds"), "0.001 1x5 3x12")],
                vec![(12, false), (16, false), (17, true)],
            ),
            // Passes complete every 100 ms, then none for minutes.
            (
                "VgpuAgentStalled",
                vec![(m("vgpu_agent_last_pass_age_seconds"), "0.1x3 60+60x10 0.1x3")],
                vec![(3, false), (4, false), (5, false), (6, true), (14, true), (15, false)],
            ),
            ("VgpuSmFeedbackHeld", vec![(m("vgpu_gpu_sm_feedback_held"), "0 1x40")], vec![(30, false), (31, true)]),
            // The daemon stopped answering at minute 2; the agent had it back at minute 4 (under
            // the 2 minutes the alert waits), and lost it for good at minute 8.
            (
                "VgpuMpsDaemonDown",
                vec![(m("vgpu_mps_daemon_up"), "1 1 0 0 1x3 0x10")],
                vec![(3, false), (5, false), (9, false), (10, true), (17, true)],
            ),
            (
                "VgpuSliceMemoryRefused",
                vec![(m("vgpu_slice_oom_rejections_total"), "0 0 1 1 4x25")],
                vec![(1, false), (3, true), (18, true), (20, false)],
            ),
            (
                "VgpuSliceIdle",
                vec![
                    (m("hami_container_last_kernel_elapsed_seconds"), "3000+60x40"),
                    (m("hami_vgpu_memory_used_bytes"), "381681664x30 0x10"),
                ],
                vec![(10, false), (15, false), (16, true), (30, true), (31, false)],
            ),
            // A kernel ran at minute 20: the elapsed time starts again.
            (
                "VgpuSliceIdle",
                vec![
                    (m("hami_container_last_kernel_elapsed_seconds"), "3000+60x19 0+60x20"),
                    (m("hami_vgpu_memory_used_bytes"), "381681664x40"),
                ],
                vec![(19, true), (20, false), (35, false)],
            ),
        ]
    };
    // The alerts whose annotations give the value: what it is where the case fires.
    let value_of = |alert: &str| (alert == "VgpuAgentUnavailable").then_some("1");
    let mut named = std::collections::BTreeSet::new();
    let mut tests = Vec::new();
    for (alert, input, checks) in &cases {
        named.insert(*alert);
        let (severity, ann) = rule(alert);
        let mut labels = input[0].0.clone();
        labels.remove("__name__");
        labels.insert("severity".into(), severity);
        let fired = json!([{
            "exp_labels": labels,
            "exp_annotations": ann.iter().map(|(k, v)| (k.clone(), expand(v, &labels, value_of(alert)))).collect::<BTreeMap<_, _>>(),
        }]);
        let input_series: Vec<Value> = input
            .iter()
            .map(|(l, values)| {
                let mut l = l.clone();
                let name = l.remove("__name__").unwrap();
                json!({"series": selector(&name, &l), "values": values})
            })
            .collect();
        let alert_rule_test: Vec<Value> = checks
            .iter()
            .map(|(minute, fires)| {
                json!({"eval_time": format!("{minute}m"), "alertname": alert, "exp_alerts": if *fires { fired.clone() } else { json!([]) }})
            })
            .collect();
        tests.push(json!({"interval": "1m", "input_series": input_series, "alert_rule_test": alert_rule_test}));
    }
    // Every rule of the file has its case.
    let all: std::collections::BTreeSet<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    assert_eq!(named, all, "every alert is tested");

    let file = s.state.join("vgpu-alerts.test.json");
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&json!({"rule_files": [rules_path], "evaluation_interval": "1m", "tests": tests}))
            .unwrap(),
    )
    .unwrap();
    let o = Command::new(&promtool).args(["test", "rules"]).arg(&file).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "promtool test rules {}:\n{said}", file.display());
    assert!(said.contains("SUCCESS"), "{said}");
}

/// A Prometheus server for a test: scrapes the agent every second, evaluates the packaged rules
/// every second, stopped when dropped.
struct Prometheus {
    child: std::process::Child,
    address: String,
    log: std::path::PathBuf,
}

impl Prometheus {
    fn start(bin: &str, dir: &std::path::Path, agent_metrics: &str, rules: &std::path::Path) -> Prometheus {
        std::fs::create_dir_all(dir).unwrap();
        // The scrape as the chart's ServiceMonitor makes it: the job named after its Service, the
        // target labelled with the agent's own pod (as the operator's discovery labels it), the
        // agent's labels kept over those, the node's name added.
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\nscrape_configs:\n  - \
             job_name: vgpu-node-agent-metrics\n    honor_labels: true\n    static_configs:\n      - targets: \
             [\"{agent_metrics}\"]\n        labels:\n          node: gpu-node-7\n          namespace: vgpu-system\n          pod: \
             vgpu-node-agent-x7k2p\n          container: vgpu-node-agent\n",
            rules = rules.display()
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        // Port 0: Prometheus takes a free port and logs it (a port found free and then handed over
        // could be taken in between).
        let log = dir.join("prometheus.log");
        let child = Command::new(bin)
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg("--web.listen-address=127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut p = Prometheus { child, address: String::new(), log };
        let listening = |text: &str| -> Option<String> {
            let line = text.lines().find(|l| l.contains("Listening on"))?;
            let a = line.split_whitespace().find_map(|w| w.strip_prefix("address="))?;
            Some(a.trim_matches('"').to_string())
        };
        let text = || std::fs::read_to_string(&p.log).unwrap_or_default();
        p.until("its address", Duration::from_secs(60), || listening(&text()).is_some());
        p.address = listening(&text()).unwrap();
        p.until("ready", Duration::from_secs(60), || p.get("/-/ready").0 == 200);
        p
    }

    /// GET over HTTP/1.0 (so the body is not chunked): the status code and the body.
    fn get(&self, path: &str) -> (u16, String) {
        use std::io::Read;
        let Ok(mut c) = std::net::TcpStream::connect(&self.address) else { return (0, String::new()) };
        write!(c, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.address).unwrap();
        let mut r = String::new();
        if c.read_to_string(&mut r).is_err() {
            return (0, String::new());
        }
        let (head, body) = r.split_once("\r\n\r\n").unwrap_or((&r, ""));
        let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, body.to_string())
    }

    /// An API call's `data`.
    fn api(&self, path: &str) -> Value {
        let (code, body) = self.get(path);
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {code} {e}: {body}"));
        assert_eq!((code, v["status"].as_str()), (200, Some("success")), "{path}: {body}");
        v["data"].clone()
    }

    /// An instant query's result vector.
    fn query(&self, expr: &str) -> Vec<Value> {
        let enc: String = expr
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        let d = self.api(&format!("/api/v1/query?query={enc}"));
        assert_eq!(d["resultType"], "vector", "{expr}: {d}");
        d["result"].as_array().unwrap().clone()
    }

    fn until(&self, what: &str, limit: Duration, f: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !f() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            assert!(t0.elapsed() < limit, "Prometheus: {what} not within {limit:?}; its log:\n{log}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_prometheus_scraping_the_agent_runs_the_rules_and_every_dashboard_query() {
    let Some(bin) = tool("prometheus") else { return };
    let (s, a, j) = node_with_a_slice();
    let p = Prometheus::start(
        &bin,
        &s.state.join("prometheus"),
        &a.metrics,
        &repo_file("packaging/prometheus/vgpu-alerts.yaml"),
    );
    // Five scrapes, so that rates over a minute have their two samples and more.
    p.until("five scrapes of the agent", Duration::from_secs(60), || {
        p.query(r#"count_over_time(up{job="vgpu-node-agent-metrics"}[1m]) >= 5 and up == 1"#).len() == 1
    });

    // Every rule evaluated, without an error.
    let in_file = std::fs::read_to_string(repo_file("packaging/prometheus/vgpu-alerts.yaml"))
        .unwrap()
        .matches("- alert: ")
        .count();
    assert!(in_file >= 10, "{in_file}");
    p.until("every rule evaluated", Duration::from_secs(30), || {
        let g = p.api("/api/v1/rules");
        let rules = g["groups"][0]["rules"].as_array().cloned().unwrap_or_default();
        rules.len() == in_file && rules.iter().all(|r| r["health"] == "ok")
    });
    let g = p.api("/api/v1/rules");
    assert_eq!(g["groups"].as_array().unwrap().len(), 1, "{g}");

    // Every query of the dashboard returns series, with the variables as Grafana fills them in:
    // this node, this namespace, a rate window of a minute.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_file("packaging/helm/vgpu/dashboards/vgpu-dashboard.json")).unwrap(),
    )
    .unwrap();
    let fill = |e: &str| e.replace("$node", "gpu-node-7").replace("$namespace", "ml").replace("$__rate_interval", "1m");
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            exprs.push((panel["title"].as_str().unwrap().to_string(), fill(t["expr"].as_str().unwrap())));
        }
    }
    assert!(exprs.len() >= 20, "{exprs:?}");
    // Every metric a query names is one the agent exports (`or vector(0)` would hide one it does
    // not), series or none on this node (MIG devices: none).
    let (_, body) = a.scrape("/metrics");
    for (title, expr) in &exprs {
        for w in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if w.starts_with("vgpu_") || w.starts_with("hami_") {
                assert!(
                    body.contains(&format!("# TYPE {w} ")),
                    "panel {title:?} names {w}, which the agent does not export"
                );
            }
        }
    }
    for (title, expr) in &exprs {
        let r = p.query(expr);
        assert!(!r.is_empty(), "panel {title:?}: {expr} returns nothing");
        for series in &r {
            let v: f64 = series["value"][1].as_str().unwrap().parse().unwrap();
            assert!(v.is_finite(), "panel {title:?}: {expr}: {series}");
        }
    }
    // Values, where the simulated node fixes them: the slice holds 300 MiB and its context.
    let used = p.query(&fill(r#"hami_vgpu_memory_used_bytes{node=~"$node",namespace=~"$namespace"}"#));
    let want = slice_of(&a.status().unwrap(), "train-0-main")["gpus"][0]["memory_used"].as_u64().unwrap();
    assert_eq!(used[0]["value"][1].as_str().unwrap().parse::<u64>().unwrap(), want);
    assert_eq!(used[0]["metric"]["pod"], "train-0", "the agent's labels win over the target's: {used:?}");
    let promised = p.query(&exprs.iter().find(|(t, _)| t == "GPU time promised to slices").unwrap().1);
    assert_eq!(promised[0]["value"][1], "0.5");
    // The variables' queries: label_values(selector, label) offers this node and namespace.
    for v in dash["templating"]["list"].as_array().unwrap().iter().filter(|v| v["type"] == "query") {
        let q = v["query"]["query"].as_str().unwrap();
        let inner = q.strip_prefix("label_values(").and_then(|q| q.strip_suffix(')')).unwrap();
        let (selector, label) = inner.rsplit_once(", ").unwrap();
        let r = p.query(&format!("count by ({label}) ({})", fill(selector)));
        let want = if label == "node" { "gpu-node-7" } else { "ml" };
        assert!(r.iter().any(|s| s["metric"][label] == want), "variable {}: {q} offers {r:?}", v["name"]);
    }

    // A healthy node: nothing fires, nothing is pending.
    let alerts = p.api("/api/v1/alerts");
    assert_eq!(alerts["alerts"].as_array().unwrap().len(), 0, "{alerts}");

    // An allocation refused at the slice's limit: the alert fires within seconds, naming the pod
    // and the node.
    let over = in_slice(&s, &j, RT).args(["alloc", "--size", "2g", "--chunk", "100m"]).output().unwrap();
    assert!(over.status.success(), "{over:?}");
    let firing = || -> Option<Value> {
        let alerts = p.api("/api/v1/alerts")["alerts"].as_array().cloned().unwrap_or_default();
        alerts.into_iter().find(|a| a["labels"]["alertname"] == "VgpuSliceMemoryRefused" && a["state"] == "firing")
    };
    p.until("VgpuSliceMemoryRefused firing", Duration::from_secs(30), || firing().is_some());
    let alert = firing().unwrap();
    let l = &alert["labels"];
    assert_eq!(
        (l["namespace"].as_str(), l["pod"].as_str(), l["node"].as_str(), l["severity"].as_str()),
        (Some("ml"), Some("train-0"), Some("gpu-node-7"), Some("info")),
        "{alert}"
    );
    let summary = alert["annotations"]["summary"].as_str().unwrap();
    assert!(summary.starts_with("GPU allocations of ml/train-0 (main, slice train-0-main) were refused"), "{summary}");
}

/// HAMi's published PromQL: the examples of HAMi's metrics reference (generated from its metrics
/// catalog, `docs/metrics.md`), each with what its answer must be on a node whose one slice keeps
/// the GPU busy (alone on it, its 50 % share does not hold it back) and holds 300 MiB. The units
/// are the point: HAMi's utilisation series are percent (0 to 100), so a 0..1 ratio would read a
/// busy GPU as idle.
const HAMI_QUERIES: &[(&str, Expect)] = &[
    ("avg_over_time(hami_host_gpu_utilization_ratio[1h])", Expect::Within(20.0, 100.0)),
    ("avg by (namespace, pod) (hami_container_device_utilization_ratio)", Expect::Within(20.0, 100.0)),
    ("hami_vgpu_memory_used_bytes / hami_vgpu_memory_limit_bytes", Expect::Within(0.25, 0.6)),
    ("topk(10, hami_vgpu_memory_used_bytes)", Expect::Within(300.0 * MIB as f64, 600.0 * MIB as f64)),
    ("hami_container_device_memory_bytes", Expect::Within(300.0 * MIB as f64, 600.0 * MIB as f64)),
    ("hami_container_last_kernel_elapsed_seconds > 3600", Expect::Nothing),
    ("hami_mig_device_info", Expect::Nothing),
    ("hami_host_gpu_memory_used_bytes", Expect::Within(300.0 * MIB as f64, 8192.0 * MIB as f64)),
    ("hami_host_gpu_memory_controller_utilization_ratio", Expect::Within(10.0, 100.0)),
    ("vgpu_gpu_temperature_celsius", Expect::Within(30.0, 100.0)),
    ("vgpu_gpu_power_usage_watts", Expect::Within(60.0, 400.0)),
    ("vgpu_gpu_ecc_errors_total", Expect::Within(0.0, 0.0)),
    // The names HAMi served before (its --legacy-metrics), in the same units.
    ("avg_over_time(HostCoreUtilization[1h])", Expect::Within(20.0, 100.0)),
    ("vGPU_device_memory_usage_in_bytes / vGPU_device_memory_limit_in_bytes", Expect::Within(0.25, 0.6)),
    ("Device_utilization_desc_of_container", Expect::Within(20.0, 100.0)),
];

enum Expect {
    /// Series, every value within (inclusive).
    Within(f64, f64),
    /// No series.
    Nothing,
}

#[test]
fn hami_s_published_queries_read_the_agent_in_hami_s_units_and_labels() {
    let Some(bin) = tool("prometheus") else { return };
    let (s, a, j) = node_with_a_slice_and(&[("VGPU_AGENT_METRICS_HAMI_LEGACY", "true")]);
    // The slice's kernels, for the whole test.
    let mut busy = in_slice(&s, &j, RT).args(["launch", "--seconds", "60", "--kernel", "sleep_5ms"]).spawn().unwrap();
    a.wait("the slice's kernels", |v| slice_of(v, "train-0-main")["gpus"][0]["sm_used"].as_u64() > Some(20));
    let rules = s.state.join("no-rules.yaml");
    std::fs::write(&rules, "groups: []\n").unwrap();
    let p = Prometheus::start(&bin, &s.state.join("prometheus-hami"), &a.metrics, &rules);
    p.until("five scrapes of the agent", Duration::from_secs(60), || {
        p.query(r#"count_over_time(up{job="vgpu-node-agent-metrics"}[1m]) >= 5 and up == 1"#).len() == 1
    });
    for (q, want) in HAMI_QUERIES {
        let r = p.query(q);
        match want {
            Expect::Nothing => assert!(r.is_empty(), "{q}: {r:?}"),
            Expect::Within(lo, hi) => {
                assert!(!r.is_empty(), "{q}: no series");
                for series in &r {
                    let v: f64 = series["value"][1].as_str().unwrap().parse().unwrap();
                    assert!((*lo..=*hi).contains(&v), "{q}: {v} is not within {lo}..={hi}: {series}");
                }
            }
        }
    }
    // HAMi's labels: every series in zone vGPU; a GPU's type as HAMi names it and its node; a
    // container's namespace, pod, container, vdevice_index and device_uuid.
    assert!(p.query(r#"{__name__=~"hami_.*", zone!="vGPU"}"#).is_empty());
    let host = p.query("hami_host_gpu_utilization_ratio");
    let m = &host[0]["metric"];
    assert_eq!(
        (m["device_type"].as_str(), m["node"].as_str(), m["device_index"].as_str()),
        (Some("NVIDIA-NVIDIA A100-SXM4-40GB"), Some("gpu-node-7"), Some("0")),
        "{m}"
    );
    let ctr = p.query("hami_container_device_utilization_ratio");
    let m = &ctr[0]["metric"];
    assert_eq!(
        (m["namespace"].as_str(), m["pod"].as_str(), m["container"].as_str(), m["vdevice_index"].as_str()),
        (Some("ml"), Some("train-0"), Some("main"), Some("0")),
        "{m}"
    );
    assert!(m["device_uuid"].as_str().is_some_and(|u| u.starts_with("GPU-")), "{m}");
    let legacy = p.query("vGPU_device_memory_usage_in_bytes");
    assert_eq!(
        (legacy[0]["metric"]["podname"].as_str(), legacy[0]["metric"]["ctrname"].as_str()),
        (Some("train-0"), Some("main"))
    );
    // The standard process series, not home-made names.
    let rss = p.query(r#"process_resident_memory_bytes{job="vgpu-node-agent-metrics"}"#);
    let rss: f64 = rss[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!((1e6..2e9).contains(&rss), "{rss}");
    assert_eq!(p.query(r#"process_start_time_seconds{job="vgpu-node-agent-metrics"} > 1.7e9"#).len(), 1);
    let _ = busy.kill();
    let _ = busy.wait();
}

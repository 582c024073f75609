//! The Helm chart and the plain manifests: the manifests are the chart's templates rendered with its
//! default values (kept in sync: this test fails when they drift; `VGPU_UPDATE_MANIFESTS=1` rewrites
//! them), every document parses into its k8s-openapi type with the fields the agent needs, and the
//! ConfigMap's agent configuration passes the agent's own validation.
//!
//! The templates use only `{{ .Values.<key> }}`, `{{ .Release.Namespace }}` and whole-file
//! `{{- if .Values.<key> }}` / `{{- end }}`; the renderer here refuses anything else, so what it
//! checks is what Helm renders.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use std::path::{Path, PathBuf};

const NAMESPACE: &str = "vgpu-system";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The chart's default values.
fn chart_values() -> yaml_serde::Value {
    yaml_serde::from_str(&std::fs::read_to_string(root().join("packaging/helm/vgpu/values.yaml")).unwrap()).unwrap()
}

fn render(template: &str, values: &yaml_serde::Value) -> String {
    let value = |key: &str| -> String {
        match &values[key] {
            yaml_serde::Value::String(s) => s.clone(),
            yaml_serde::Value::Number(n) => n.to_string(),
            yaml_serde::Value::Bool(b) => b.to_string(),
            v => panic!("value {key}: {v:?} is not a scalar"),
        }
    };
    let mut out = String::new();
    let mut lines = template.lines().peekable();
    if let Some(first) = lines.peek() {
        if let Some(key) = first.trim().strip_prefix("{{- if .Values.").and_then(|r| r.strip_suffix(" }}")) {
            if !matches!(values[key], yaml_serde::Value::Bool(true)) {
                return String::new();
            }
            lines.next();
        }
    }
    for line in lines {
        if line.trim() == "{{- end }}" {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("{{") {
            out.push_str(&rest[..i]);
            // A raw string, {{`...`}}: its text as it is (how the chart writes Prometheus's own
            // {{ $labels.x }} templates).
            if let Some(raw) = rest[i + 2..].strip_prefix('`') {
                let end = raw.find("`}}").expect("a raw string closed by `}}");
                out.push_str(&raw[..end]);
                rest = &raw[end + 3..];
                continue;
            }
            let j = rest[i..].find("}}").expect("closed") + i;
            let expr = rest[i + 2..j].trim();
            if expr == ".Release.Namespace" {
                out.push_str(NAMESPACE);
            } else if let Some(get) = expr.strip_prefix(".Files.Get \"") {
                // {{ .Files.Get "path" | indent N }}: a file of the chart, each line indented.
                let (path, pipe) = get.split_once('"').unwrap();
                let n: usize = pipe.trim().strip_prefix("| indent ").expect("piped to indent").parse().unwrap();
                let text = std::fs::read_to_string(root().join("packaging/helm/vgpu").join(path)).unwrap();
                let pad = " ".repeat(n);
                let lines: Vec<String> = text.lines().map(|l| format!("{pad}{l}")).collect();
                out.push_str(&lines.join("\n"));
            } else if let Some((k, n)) = expr.strip_prefix(".Values.").and_then(|e| e.split_once(" | indent ")) {
                // {{ .Values.key | indent N }}: a value's lines, each indented (as Helm's indent: the
                // first line too, and an empty value gives the padding alone).
                let pad = " ".repeat(n.trim().parse().unwrap());
                let v = value(k);
                out.push_str(&format!("{pad}{}", v.replace('\n', &format!("\n{pad}"))));
            } else if let Some(k) = expr.strip_prefix(".Values.") {
                out.push_str(&value(k));
            } else {
                panic!("template expression {expr:?} is beyond what this chart uses");
            }
            rest = &rest[j + 2..];
        }
        out.push_str(rest);
        out.push('\n');
    }
    out
}

#[test]
fn manifests_are_the_rendered_chart_and_parse_into_kubernetes_types() {
    let chart = root().join("packaging/helm/vgpu");
    let values: yaml_serde::Value = chart_values();
    let mut names: Vec<PathBuf> =
        std::fs::read_dir(chart.join("templates")).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    let mut rendered = format!("# Rendered from packaging/helm/vgpu with its default values, namespace {NAMESPACE}.\n# Apply the namespace first: kubectl create namespace {NAMESPACE}\n");
    for t in names {
        let r = render(&std::fs::read_to_string(&t).unwrap(), &values);
        if !r.trim().is_empty() {
            rendered.push_str("---\n");
            rendered.push_str(&r);
        }
    }
    let path = root().join("packaging/manifests/vgpu.yaml");
    if std::env::var_os("VGPU_UPDATE_MANIFESTS").is_some() {
        std::fs::write(&path, &rendered).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(committed == rendered, "packaging/manifests/vgpu.yaml is not the rendered chart: run VGPU_UPDATE_MANIFESTS=1 cargo test -p vgpu-node-agent --test packaging");

    let mut kinds = Vec::new();
    for doc in rendered.split("\n---\n").filter(|d| d.lines().any(|l| l.starts_with("kind:"))) {
        let v: yaml_serde::Value = yaml_serde::from_str(doc).unwrap();
        let kind = v["kind"].as_str().unwrap().to_string();
        match kind.as_str() {
            "ServiceAccount" => {
                let sa: ServiceAccount = yaml_serde::from_str(doc).unwrap();
                assert_eq!(sa.metadata.namespace.as_deref(), Some(NAMESPACE));
            }
            "ClusterRole" => {
                let r: ClusterRole = yaml_serde::from_str(doc).unwrap();
                let rules = r.rules.unwrap();
                // Exactly what the agent calls: pods get/list/patch, nodes get/patch.
                let verbs = |res: &str| {
                    rules
                        .iter()
                        .find(|x| x.resources.as_ref().unwrap().contains(&res.to_string()))
                        .unwrap()
                        .verbs
                        .clone()
                };
                assert_eq!(verbs("pods"), ["get", "list", "patch"]);
                assert_eq!(verbs("nodes"), ["get", "patch"]);
            }
            "ClusterRoleBinding" => {
                let b: ClusterRoleBinding = yaml_serde::from_str(doc).unwrap();
                assert_eq!(b.subjects.unwrap()[0].namespace.as_deref(), Some(NAMESPACE));
            }
            "ConfigMap" => {
                let c: ConfigMap = yaml_serde::from_str(doc).unwrap();
                let toml = c.data.unwrap()["agent.toml"].clone();
                let f = std::env::temp_dir().join(format!("vgpu-packaging-{}.toml", std::process::id()));
                std::fs::write(&f, toml).unwrap();
                let flags = vgpu_agent::config::Flags { config: Some(f.clone()), ..Default::default() };
                let cfg = vgpu_agent::config::Config::load(&flags, |_| None)
                    .unwrap_or_else(|e| panic!("the chart's agent.toml: {e}"));
                assert_eq!(cfg.compat, vgpu_agent::config::Compat::Hami);
                assert_eq!(cfg.kubelet_dir, PathBuf::from("/var/lib/kubelet/device-plugins"));
                assert_eq!((cfg.memory_scaling, cfg.memory_factor), (1.0, 1024));
                std::fs::remove_file(f).ok();
            }
            "DaemonSet" => {
                let d: DaemonSet = yaml_serde::from_str(doc).unwrap();
                let spec = d.spec.unwrap().template.spec.unwrap();
                assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
                assert_eq!(spec.host_pid, Some(true));
                assert!(spec.tolerations.unwrap().iter().any(|t| t.key.as_deref() == Some("nvidia.com/gpu")));
                assert!(spec.node_selector.unwrap().contains_key("nvidia.com/gpu.present"));
                let c = &spec.containers[0];
                assert!(c.env.as_ref().unwrap().iter().any(|e| e.name == "NODE_NAME" && e.value_from.is_some()));
                // Ready once serving; live unless its monitoring has stalled (the agent's endpoints).
                let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
                    p.as_ref().and_then(|p| p.http_get.as_ref()).and_then(|h| h.path.clone())
                };
                assert_eq!(probe(&c.readiness_probe).as_deref(), Some("/healthz"));
                assert_eq!(probe(&c.liveness_probe).as_deref(), Some("/livez"));
                // Capacity reporting is off by default and its Secret optional.
                let env = |name: &str| c.env.as_ref().unwrap().iter().find(|e| e.name == name).unwrap().value.clone();
                assert_eq!(env("VGPU_AGENT_SCHEDULER_ENDPOINT").as_deref(), Some(""));
                // So is mutual TLS (the agent reads these empty values as unset).
                assert_eq!(env("VGPU_AGENT_SCHEDULER_CLIENT_CERT").as_deref(), Some(""));
                assert_eq!(env("VGPU_AGENT_SCHEDULER_CLIENT_KEY").as_deref(), Some(""));
                let sched = spec.volumes.as_ref().unwrap().iter().find(|v| v.name == "scheduler").unwrap();
                assert_eq!(sched.secret.as_ref().unwrap().optional, Some(true));
                // The scheduler's MIG geometries: none by default, from an optional ConfigMap.
                assert_eq!(env("VGPU_AGENT_MIG_GEOMETRIES_FILE").as_deref(), Some(""));
                let geo = spec.volumes.as_ref().unwrap().iter().find(|v| v.name == "mig-geometries").unwrap();
                let cm = geo.config_map.as_ref().unwrap();
                assert_eq!((cm.name.as_str(), cm.optional), ("vgpu-mig-geometries", Some(true)));
                // So is HAMi's per-node configuration (its own ConfigMap's name by default).
                assert_eq!(env("VGPU_AGENT_HAMI_NODE_CONFIG_FILE").as_deref(), Some(""));
                let node = spec.volumes.as_ref().unwrap().iter().find(|v| v.name == "hami-node-config").unwrap();
                let cm = node.config_map.as_ref().unwrap();
                assert_eq!((cm.name.as_str(), cm.optional), ("hami-device-plugin", Some(true)));
                let mounts: Vec<String> =
                    c.volume_mounts.as_ref().unwrap().iter().map(|m| m.mount_path.clone()).collect();
                for p in ["/var/lib/vgpu", "/run/vgpu", "/var/lib/kubelet/device-plugins", "/var/run/cdi", "/etc/vgpu"]
                {
                    assert!(mounts.contains(&p.to_string()), "{p} not mounted: {mounts:?}");
                }
                // Host paths equal container paths: the paths the agent hands to kubelet are host paths.
                for v in spec.volumes.unwrap() {
                    if let Some(h) = v.host_path {
                        let m = c.volume_mounts.as_ref().unwrap().iter().find(|m| m.name == v.name).unwrap();
                        assert_eq!(h.path, m.mount_path);
                    }
                }
            }
            k => panic!("unexpected kind {k}"),
        }
        kinds.push(kind);
    }
    assert_eq!(kinds, ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]);

    // The optional monitor renders when enabled.
    let mut v2 = values.clone();
    v2["serviceMonitor"] = yaml_serde::Value::Bool(true);
    let sm = render(&std::fs::read_to_string(chart.join("templates/servicemonitor.yaml")).unwrap(), &v2);
    assert!(sm.contains("kind: ServiceMonitor") && sm.contains("port: 9394"), "{sm}");
    let docs: Vec<yaml_serde::Value> = sm.split("\n---\n").map(|d| yaml_serde::from_str(d).unwrap()).collect();
    // The operator names the job after the Service: the job the agent-down alert watches.
    let job = docs[0]["metadata"]["name"].as_str().unwrap();
    let rules = std::fs::read_to_string(root().join("packaging/prometheus/vgpu-alerts.yaml")).unwrap();
    assert!(rules.contains(&format!("up{{job=\"{job}\"}} == 0")), "the agent-down alert watches job {job}");
    // The agent's namespace/pod/container labels (the workload's) win over the target's, and the
    // node's name is added: the alerts' summaries name both.
    let ep = &docs[1]["spec"]["endpoints"][0];
    assert_eq!(ep["honorLabels"].as_bool(), Some(true), "{sm}");
    let node = &ep["relabelings"][0];
    assert_eq!(
        (node["sourceLabels"][0].as_str(), node["targetLabel"].as_str()),
        (Some("__meta_kubernetes_pod_node_name"), Some("node")),
        "{sm}"
    );

    // The DRA driver's DeviceClasses, off by default, select its devices by the driver's name.
    let t = std::fs::read_to_string(chart.join("templates/deviceclasses.yaml")).unwrap();
    assert!(render(&t, &values).trim().is_empty(), "off by default");
    let mut v3 = values.clone();
    v3["deviceClasses"] = yaml_serde::Value::Bool(true);
    v3["draDriver"] = yaml_serde::Value::String("gpu.example.com".into());
    let classes: Vec<yaml_serde::Value> =
        render(&t, &v3).split("\n---\n").map(|d| yaml_serde::from_str(d).unwrap()).collect();
    let got: Vec<(&str, &str, &str)> = classes
        .iter()
        .map(|c| {
            (
                c["kind"].as_str().unwrap(),
                c["metadata"]["name"].as_str().unwrap(),
                c["spec"]["selectors"][0]["cel"]["expression"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                "DeviceClass",
                "vgpu-share",
                r#"device.driver == "gpu.example.com" && !device.attributes["gpu.example.com"].mig"#
            ),
            (
                "DeviceClass",
                "vgpu-mig",
                r#"device.driver == "gpu.example.com" && device.attributes["gpu.example.com"].mig"#
            ),
        ]
    );
    assert!(classes.iter().all(|c| c["apiVersion"] == "resource.k8s.io/v1"));
    // On Kubernetes 1.32, in v1beta1 (the selectors are the same).
    v3["deviceClassApiVersion"] = yaml_serde::Value::String("resource.k8s.io/v1beta1".into());
    let beta = render(&t, &v3);
    assert_eq!(beta.matches("apiVersion: resource.k8s.io/v1beta1\n").count(), 2, "{beta}");
}

/// Values that reach the agent's configuration: Volcano's memory factor and the memory scaling, and
/// any other key (and `[[node]]` sections) through `extraConfig`.
#[test]
fn the_agent_configuration_takes_the_chart_s_values() {
    let mut values = chart_values();
    values["compat"] = yaml_serde::Value::String("volcano".into());
    values["memoryFactor"] = yaml_serde::from_str("512").unwrap();
    values["memoryScaling"] = yaml_serde::from_str("1.5").unwrap();
    values["extraConfig"] = yaml_serde::Value::String(
        "escape_action = \"kill\"\nregister_interval_s = 7\n[[node]]\nnames = [\"*\"]\nsplit_count = 3\n".into(),
    );
    let t = std::fs::read_to_string(root().join("packaging/helm/vgpu/templates/vgpu.yaml")).unwrap();
    let doc = render(&t, &values).split("\n---\n").find(|d| d.contains("kind: ConfigMap")).unwrap().to_string();
    let c: ConfigMap = yaml_serde::from_str(&doc).unwrap();
    let cfg = vgpu_agent::config::Config::from_toml(&c.data.unwrap()["agent.toml"])
        .unwrap_or_else(|e| panic!("the rendered agent.toml: {e}"));
    assert_eq!(cfg.compat, vgpu_agent::config::Compat::Volcano);
    assert_eq!((cfg.memory_factor, cfg.memory_scaling), (512, 1.5));
    assert_eq!((cfg.escape_action, cfg.register_interval_s), (vgpu_agent::config::EscapeAction::Kill, 7));
    assert_eq!((cfg.split_count, cfg.node_section.map(|n| n.0)), (3, Some(0)), "a [[node]] section for every node");
}

#[test]
fn the_receiver_renders_when_enabled() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Service;
    let chart = root().join("packaging/helm/vgpu");
    let mut values: yaml_serde::Value = chart_values();
    let t = std::fs::read_to_string(chart.join("templates/receiver.yaml")).unwrap();
    assert!(render(&t, &values).trim().is_empty(), "off by default");
    values["receiver"] = yaml_serde::Value::Bool(true);
    let r = render(&t, &values);
    let docs: Vec<&str> = r.split("\n---\n").collect();
    let d: Deployment = yaml_serde::from_str(docs[0]).unwrap();
    let spec = d.spec.unwrap().template.spec.unwrap();
    let c = &spec.containers[0];
    assert_eq!(c.command.as_ref().unwrap()[0], "/usr/local/bin/vgpu-receiver");
    assert!(c.args.as_ref().unwrap().contains(&"--listen=0.0.0.0:9400".to_string()));
    assert_eq!(spec.volumes.unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(), Some("vgpu-receiver-tls"));
    let svc: Service = yaml_serde::from_str(docs[1]).unwrap();
    assert_eq!(svc.spec.unwrap().ports.unwrap()[0].port, 9400);
    // Mutual TLS is off by default (an empty --client-ca) and on with the CA's path.
    assert!(c.args.as_ref().unwrap().contains(&"--client-ca=".to_string()));
    values["receiverClientCa"] = yaml_serde::Value::String("/etc/vgpu-receiver/ca.pem".into());
    let d: Deployment = yaml_serde::from_str(render(&t, &values).split("\n---\n").next().unwrap()).unwrap();
    let args = d.spec.unwrap().template.spec.unwrap().containers[0].args.clone().unwrap();
    assert!(args.contains(&"--client-ca=/etc/vgpu-receiver/ca.pem".to_string()), "{args:?}");
}

/// The alerting rules: the plain rules file and the chart's PrometheusRule (off by default) hold the
/// same groups, and every rule is complete: a unique `Vgpu` name, an expression whose brackets
/// balance, a `for` that is a duration, a severity, a summary and a description. (That every metric
/// they name is one the agent exports is checked against its scrape: vgpu-sim-clients,
/// agent_daemon.)
#[test]
fn the_alerting_rules_are_the_chart_s_and_complete() {
    let chart = root().join("packaging/helm/vgpu");
    let mut values: yaml_serde::Value = chart_values();
    let file: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(root().join("packaging/prometheus/vgpu-alerts.yaml")).unwrap())
            .unwrap();
    let t = std::fs::read_to_string(chart.join("templates/prometheusrule.yaml")).unwrap();
    assert!(render(&t, &values).trim().is_empty(), "off by default");
    values["prometheusRule"] = yaml_serde::Value::Bool(true);
    let pr: yaml_serde::Value = yaml_serde::from_str(&render(&t, &values)).unwrap();
    assert_eq!(
        (pr["apiVersion"].as_str(), pr["kind"].as_str()),
        (Some("monitoring.coreos.com/v1"), Some("PrometheusRule"))
    );
    assert_eq!(pr["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(
        pr["spec"]["groups"], file["groups"],
        "the chart's rules and packaging/prometheus/vgpu-alerts.yaml differ"
    );

    let rules = file["groups"][0]["rules"].as_sequence().unwrap();
    assert!(rules.len() >= 5, "{rules:?}");
    let mut names = std::collections::HashSet::new();
    for r in rules {
        let name = r["alert"].as_str().unwrap();
        assert!(name.starts_with("Vgpu") && names.insert(name), "{name}: a unique Vgpu name");
        let expr = r["expr"].as_str().unwrap();
        let mut depth = Vec::new();
        for c in expr.chars() {
            match c {
                '(' | '[' | '{' => depth.push(c),
                ')' | ']' | '}' => {
                    let open = depth.pop();
                    assert_eq!(
                        open,
                        Some(match c {
                            ')' => '(',
                            ']' => '[',
                            _ => '{',
                        }),
                        "{name}: {expr}"
                    );
                }
                _ => {}
            }
        }
        assert!(depth.is_empty() && !expr.trim().is_empty(), "{name}: {expr}");
        if let Some(f) = r.get("for") {
            let f = f.as_str().unwrap();
            let (n, unit) = f.split_at(f.len() - 1);
            assert!(n.parse::<u32>().is_ok() && matches!(unit, "s" | "m" | "h"), "{name}: for {f}");
        }
        let sev = r["labels"]["severity"].as_str().unwrap_or_default();
        assert!(matches!(sev, "critical" | "warning" | "info"), "{name}: severity {sev:?}");
        for a in ["summary", "description"] {
            assert!(r["annotations"][a].as_str().is_some_and(|s| s.len() > 20), "{name}: {a}");
        }
    }
}

/// The Grafana dashboard is one Grafana imports as it is: a uid, a data source variable every
/// query uses, panels with unique ids inside the 24-column grid and not overlapping, each with a
/// description, and queries that use only the dashboard's variables. (That every query returns
/// series from a real agent is checked against a real Prometheus: vgpu-sim-clients, prometheus.)
#[test]
fn the_grafana_dashboard_is_well_formed() {
    let d: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("packaging/helm/vgpu/dashboards/vgpu-dashboard.json")).unwrap(),
    )
    .unwrap();
    assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty() && u.len() <= 40), "uid");
    // The chart's optional ConfigMap for Grafana's dashboard sidecar carries it unchanged.
    let chart = root().join("packaging/helm/vgpu");
    let mut values: yaml_serde::Value = chart_values();
    let t = std::fs::read_to_string(chart.join("templates/dashboard.yaml")).unwrap();
    assert!(render(&t, &values).trim().is_empty(), "off by default");
    values["grafanaDashboard"] = yaml_serde::Value::Bool(true);
    let cm: ConfigMap = yaml_serde::from_str(&render(&t, &values)).unwrap();
    assert_eq!(cm.metadata.labels.as_ref().unwrap()["grafana_dashboard"], "1");
    let carried: serde_json::Value = serde_json::from_str(&cm.data.unwrap()["vgpu-dashboard.json"]).unwrap();
    assert_eq!(carried, d, "the ConfigMap's dashboard");
    assert!(d["title"].as_str().is_some_and(|t| t.starts_with("vgpu")));
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(vars[0], "datasource");
    assert_eq!(d["templating"]["list"][0]["query"], "prometheus");
    let uses_ds =
        |v: &serde_json::Value| v["datasource"]["uid"] == "${datasource}" && v["datasource"]["type"] == "prometheus";
    for v in &d["templating"]["list"].as_array().unwrap()[1..] {
        assert!(uses_ds(v), "variable {v}");
    }
    let mut ids = std::collections::HashSet::new();
    let mut cells = std::collections::HashSet::new();
    let panels = d["panels"].as_array().unwrap();
    assert!(panels.len() >= 15, "{}", panels.len());
    for p in panels {
        let title = p["title"].as_str().unwrap();
        assert!(ids.insert(p["id"].as_u64().unwrap()), "{title}: id not unique");
        let g = &p["gridPos"];
        let (x, y, w, h) =
            (g["x"].as_u64().unwrap(), g["y"].as_u64().unwrap(), g["w"].as_u64().unwrap(), g["h"].as_u64().unwrap());
        assert!(w > 0 && h > 0 && x + w <= 24, "{title}: {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel at ({cx}, {cy})");
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(uses_ds(p), "{title}: the panel's data source");
        assert!(p["description"].as_str().is_some_and(|s| s.len() > 20), "{title}: a description");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}");
        let mut refs = std::collections::HashSet::new();
        for t in targets {
            assert!(uses_ds(t) && refs.insert(t["refId"].as_str().unwrap()), "{title}: {t}");
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split('$').skip(1) {
                let name: String = word.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                assert!(vars.contains(&name.as_str()) || name == "__rate_interval", "{title}: {expr} uses ${name}");
            }
        }
    }
}

/// A heading's anchor as GitHub makes it: lower case, punctuation other than `-` and `_` dropped,
/// spaces made `-`.
fn anchor(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn the_docs_links_reach_their_targets_and_the_readme_s_contents_list_every_section() {
    let mut docs = vec!["README.md".to_string()];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        docs.push(format!("docs/{}", e.unwrap().file_name().to_string_lossy()));
    }
    for doc in docs.iter().map(String::as_str) {
        let path = root().join(doc);
        let text = std::fs::read_to_string(&path).unwrap();
        // Headings outside code blocks.
        let mut headings = Vec::new();
        let mut code = false;
        for line in text.lines() {
            if line.starts_with("```") {
                code = !code;
            } else if !code && line.starts_with('#') {
                let (hashes, title) = line.split_once(' ').unwrap();
                headings.push((hashes.len(), title.to_string()));
            }
        }
        let anchors: Vec<String> = headings.iter().map(|(_, t)| anchor(t)).collect();
        // Every link: to a heading of this file, or to a file of the repository.
        let mut rest = text.as_str();
        let mut links = Vec::new();
        while let Some(i) = rest.find("](") {
            let end = rest[i + 2..].find(')').expect("a link closed by )") + i + 2;
            links.push(rest[i + 2..end].to_string());
            rest = &rest[end..];
        }
        for link in &links {
            if let Some(a) = link.strip_prefix('#') {
                assert!(anchors.iter().any(|x| x == a), "{doc}: link to #{a}, which no heading makes");
            } else if !link.contains("://") {
                let file = link.split('#').next().unwrap();
                let target = path.parent().unwrap().join(file);
                assert!(target.exists(), "{doc}: link to {link}, which does not exist");
            }
        }
        if doc == "README.md" {
            // The contents name every section and subsection, in order, and nothing else.
            let contents: Vec<&str> = text
                .split("**Contents**\n\n")
                .nth(1)
                .expect("README has its contents")
                .split("\n\n")
                .next()
                .unwrap()
                .lines()
                .collect();
            let want: Vec<String> = headings
                .iter()
                .filter(|(level, _)| matches!(level, 2 | 3))
                .map(|(level, t)| format!("{}- [{t}](#{})", if *level == 3 { "  " } else { "" }, anchor(t)))
                .collect();
            assert_eq!(contents, want, "README's contents and its headings differ");
        }
    }
}

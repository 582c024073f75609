//! The Helm chart and the plain manifests, rendered by the real Helm: the manifests are `helm
//! template` of the chart's default values (this test fails when they drift; `VGPU_UPDATE_MANIFESTS=1`
//! rewrites them), every document parses into its k8s-openapi type with the fields the agent needs,
//! and the ConfigMap's agent configuration passes the agent's own validation. The API server's own
//! checks of the same renderings are in the Kubernetes end-to-end test (tests/k8s/e2e.sh).
//!
//! Helm: `VGPU_HELM`, or `helm` on PATH (tests/k8s/tools.sh builds one); without it these tests say
//! SKIPPED, unless `VGPU_REQUIRE_HELM` is set (as in CI).

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use std::path::{Path, PathBuf};
use std::process::Command;

const NAMESPACE: &str = "vgpu-system";
/// The image the renderings name (the plain manifests too: replace its registry with yours).
const IMAGE: &str = "registry.example.com/vgpu-node-agent";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn helm() -> Option<PathBuf> {
    let helm = std::env::var_os("VGPU_HELM").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("helm"));
    if Command::new(&helm).arg("version").output().is_ok_and(|o| o.status.success()) {
        return Some(helm);
    }
    assert!(std::env::var_os("VGPU_REQUIRE_HELM").is_none(), "Helm required but {} does not run", helm.display());
    skipped("no Helm (set VGPU_HELM, or put helm on PATH: tests/k8s/tools.sh builds one)");
    None
}

/// Says that a check could not run here: on stderr, and as a line of `VGPU_SKIP_LOG` (what
/// `scripts/test.sh` counts as skipped, never as passed).
fn skipped(what: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    eprintln!("SKIPPED: {what}");
    if let Some(log) = std::env::var_os("VGPU_SKIP_LOG") {
        use std::io::Write;
        // One write of the whole line: appends from tests running at once do not interleave.
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(format!("packaging {test}: {what}\n").as_bytes());
        }
    }
}

/// `helm template` of the chart with `values` (YAML) over its defaults; None without Helm.
fn template(values: &str) -> Option<String> {
    let r = try_template(values)?;
    Some(r.unwrap_or_else(|e| panic!("helm template with {values:?}: {e}")))
}

/// [`template`], or what Helm said when it refused.
fn try_template(values: &str) -> Option<Result<String, String>> {
    try_template_as("vgpu", values)
}

/// [`try_template`] of the release `release`.
fn try_template_as(release: &str, values: &str) -> Option<Result<String, String>> {
    let helm = helm()?;
    let f =
        std::env::temp_dir().join(format!("vgpu-values-{}-{:?}.yaml", std::process::id(), std::thread::current().id()));
    std::fs::write(&f, values).unwrap();
    // No image is published: every rendering names one (a test's own values may name another).
    let image = f.with_extension("image.yaml");
    std::fs::write(&image, format!("image: {{repository: {IMAGE}}}\n")).unwrap();
    let o = Command::new(helm)
        .args(["template", release])
        .arg(root().join("packaging/helm/vgpu"))
        .args(["--namespace", NAMESPACE, "--values"])
        .arg(&image)
        .arg("--values")
        .arg(&f)
        .output()
        .unwrap();
    std::fs::remove_file(&f).ok();
    std::fs::remove_file(&image).ok();
    Some(if o.status.success() {
        Ok(String::from_utf8(o.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    })
}

/// The documents of a rendering (Helm's `# Source:` comments kept), by kind.
fn docs(rendered: &str) -> Vec<(String, String)> {
    rendered
        .split("\n---\n")
        .filter_map(|d| {
            let v: yaml_serde::Value = yaml_serde::from_str(d).ok()?;
            Some((v["kind"].as_str()?.to_string(), d.to_string()))
        })
        .collect()
}

fn doc<'a>(all: &'a [(String, String)], kind: &str) -> &'a str {
    &all.iter().find(|(k, _)| k == kind).unwrap_or_else(|| panic!("no {kind}")).1
}

#[test]
fn manifests_are_the_rendered_chart_and_parse_into_kubernetes_types() {
    let Some(r) = template("{}") else { return };
    let rendered = format!("# helm template vgpu packaging/helm/vgpu --namespace {NAMESPACE} --set image.repository={IMAGE}\n# (its default values). No image is published: build packaging/image/Dockerfile, push it, and\n# replace {IMAGE} below with yours. Apply the namespace first: kubectl create namespace {NAMESPACE}\n{r}");
    let path = root().join("packaging/manifests/vgpu.yaml");
    if std::env::var_os("VGPU_UPDATE_MANIFESTS").is_some() {
        std::fs::write(&path, &rendered).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(committed == rendered, "packaging/manifests/vgpu.yaml is not the rendered chart: run VGPU_UPDATE_MANIFESTS=1 cargo test -p vgpu-node-agent --test packaging");

    let mut kinds = Vec::new();
    for (kind, doc) in docs(&rendered) {
        let doc = doc.as_str();
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
                // DRA's rules only with DRA on.
                assert!(!rules.iter().any(|x| x.api_groups.as_ref().unwrap().contains(&"resource.k8s.io".to_string())));
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
                assert_eq!((cfg.memory_scaling, cfg.memory_factor), (1.0, 1), "Volcano's default unit, 1 MiB");
                std::fs::remove_file(f).ok();
            }
            "DaemonSet" => {
                let d: DaemonSet = yaml_serde::from_str(doc).unwrap();
                let spec = d.spec.unwrap().template.spec.unwrap();
                assert_eq!(spec.priority_class_name.as_deref(), Some("system-node-critical"));
                assert_eq!(spec.host_pid, Some(true));
                assert!(spec.tolerations.unwrap().iter().any(|t| t.key.as_deref() == Some("nvidia.com/gpu")));
                // GPU nodes as NVIDIA's charts find them: either label.
                let terms = spec.affinity.unwrap().node_affinity.unwrap();
                let terms = terms.required_during_scheduling_ignored_during_execution.unwrap().node_selector_terms;
                let keys: Vec<String> =
                    terms.iter().map(|t| t.match_expressions.as_ref().unwrap()[0].key.clone()).collect();
                assert_eq!(keys, ["nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"]);
                let c = &spec.containers[0];
                assert!(c.env.as_ref().unwrap().iter().any(|e| e.name == "NODE_NAME" && e.value_from.is_some()));
                // Ready once serving; live unless its monitoring has stalled (the agent's endpoints).
                let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
                    p.as_ref().and_then(|p| p.http_get.as_ref()).and_then(|h| h.path.clone())
                };
                assert_eq!(probe(&c.readiness_probe).as_deref(), Some("/healthz"));
                // Liveness over the agent's socket, not the metrics port (a slowloris there made
                // 5 of 6 /livez probes take 10-14 s against the probe's 5 s: issue 61, item 24).
                let live = c.liveness_probe.as_ref().and_then(|p| p.exec.as_ref()).and_then(|e| e.command.clone());
                assert_eq!(
                    live.as_deref(),
                    Some(&["/usr/local/bin/vgpuctl", "--socket", "/run/vgpu/agent.sock", "live"].map(String::from)[..])
                );
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
            "ValidatingAdmissionPolicy" | "ValidatingAdmissionPolicyBinding" => {}
            k => panic!("unexpected kind {k}"),
        }
        kinds.push(kind);
    }
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ConfigMap",
            "ClusterRole",
            "ClusterRoleBinding",
            "DaemonSet",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding"
        ]
    );
}

/// The optional monitor, rules and DRA objects render when enabled; RBAC follows the mode.
#[test]
fn optional_objects_and_rbac_follow_the_values() {
    let Some(sm) = template("serviceMonitor: {enabled: true, additionalLabels: {release: kps}}") else { return };
    let all = docs(&sm);
    assert!(doc(&all, "ServiceMonitor").contains("release: kps"), "{sm}");
    let monitor: Vec<yaml_serde::Value> =
        [doc(&all, "Service"), doc(&all, "ServiceMonitor")].iter().map(|d| yaml_serde::from_str(d).unwrap()).collect();
    // The operator names the job after the Service: the job the agent-down alert watches.
    let job = monitor[0]["metadata"]["name"].as_str().unwrap();
    let rules = std::fs::read_to_string(root().join("packaging/prometheus/vgpu-alerts.yaml")).unwrap();
    assert!(rules.contains(&format!("up{{job=\"{job}\"}} == 0")), "the agent-down alert watches job {job}");
    // The agent's namespace/pod/container labels (the workload's) win over the target's, and the
    // node's name is added: the alerts' summaries name both.
    let ep = &monitor[1]["spec"]["endpoints"][0];
    assert_eq!(ep["honorLabels"].as_bool(), Some(true), "{sm}");
    let node = &ep["relabelings"][0];
    assert_eq!(
        (node["sourceLabels"][0].as_str(), node["targetLabel"].as_str()),
        (Some("__meta_kubernetes_pod_node_name"), Some("node")),
        "{sm}"
    );

    // The DRA driver's DeviceClasses, off by default, select its devices by the driver's name.
    assert!(!template("{}").unwrap().contains("kind: DeviceClass"), "off by default");
    let dra =
        template("{dra: \"on\", devicePlugin: \"off\", deviceClasses: true, draDriver: gpu.example.com}").unwrap();
    let classes: Vec<yaml_serde::Value> =
        docs(&dra).iter().filter(|(k, _)| k == "DeviceClass").map(|(_, d)| yaml_serde::from_str(d).unwrap()).collect();
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
    // With DRA on: its RBAC rules and the policy that keeps each agent to its node's slices.
    let all = docs(&dra);
    let role: ClusterRole = yaml_serde::from_str(doc(&all, "ClusterRole")).unwrap();
    assert!(role.rules.unwrap().iter().any(|r| r.resources.as_ref().unwrap().contains(&"resourceslices".to_string())));
    assert!(dra.contains("name: vgpu-node-agent-own-slices"), "{dra}");
    // Replica mode annotates nothing: no pod or node patch.
    let all = docs(template("compat: replicas").as_deref().unwrap());
    let role: ClusterRole = yaml_serde::from_str(doc(&all, "ClusterRole")).unwrap();
    assert!(role
        .rules
        .unwrap()
        .iter()
        .all(|r| !r.verbs.contains(&"patch".to_string()) || r.resources.as_ref().unwrap() == &["events".to_string()]));
    // On Kubernetes 1.32, in v1beta1 (the selectors are the same).
    let beta = template("{deviceClasses: true, deviceClassApiVersion: resource.k8s.io/v1beta1}").unwrap();
    assert_eq!(beta.matches("apiVersion: resource.k8s.io/v1beta1\n").count(), 2, "{beta}");
}

/// Values that reach the agent's configuration: Volcano's memory factor, the memory scaling and the
/// priority gate's queue bound, and
/// any other key (and `[[node]]` sections) through `extraConfig`.
#[test]
fn the_agent_configuration_takes_the_chart_s_values() {
    let values = "compat: volcano\nmemoryFactor: 512\nmemoryScaling: 1.5\npriorityQueueUs: 250\nextraConfig: |\n  escape_action = \"kill\"\n  register_interval_s = 7\n  [[node]]\n  names = [\"*\"]\n  split_count = 3\n";
    let Some(r) = template(values) else { return };
    let c: ConfigMap = yaml_serde::from_str(doc(&docs(&r), "ConfigMap")).unwrap();
    let cfg = vgpu_agent::config::Config::from_toml(&c.data.unwrap()["agent.toml"])
        .unwrap_or_else(|e| panic!("the rendered agent.toml: {e}"));
    assert_eq!(cfg.compat, vgpu_agent::config::Compat::Volcano);
    assert_eq!((cfg.memory_factor, cfg.memory_scaling, cfg.priority_queue_us), (512, 1.5, 250));
    assert_eq!((cfg.escape_action, cfg.register_interval_s), (vgpu_agent::config::EscapeAction::Kill, 7));
    assert_eq!((cfg.split_count, cfg.node_section.map(|n| n.0)), (3, Some(0)), "a [[node]] section for every node");
}

/// MPS: the GPUs and the control program reach the agent, and the agent's container gets the
/// driver's compute files (its MPS servers run there) only where a GPU runs MPS.
#[test]
fn mps_values_reach_the_agent_and_its_container() {
    use vgpu_agent::config::MpsGpus;
    let Some(r) = template("mps:\n  gpus: [\"0\", \"GPU-5eed0000-1000\"]\n  control: /opt/nvidia/mps-control\n") else {
        return;
    };
    let c: ConfigMap = yaml_serde::from_str(doc(&docs(&r), "ConfigMap")).unwrap();
    let cfg = vgpu_agent::config::Config::from_toml(&c.data.unwrap()["agent.toml"]).unwrap();
    assert_eq!(cfg.mps.gpus, MpsGpus::Some(vec!["0".into(), "GPU-5eed0000-1000".into()]));
    assert_eq!(cfg.mps.control, PathBuf::from("/opt/nvidia/mps-control"));
    assert!(doc(&docs(&r), "DaemonSet").contains("value: compute,utility"), "the compute files for the servers");
    let Some(plain) = template("") else { return };
    let c: ConfigMap = yaml_serde::from_str(doc(&docs(&plain), "ConfigMap")).unwrap();
    let cfg = vgpu_agent::config::Config::from_toml(&c.data.unwrap()["agent.toml"]).unwrap();
    assert_eq!(cfg.mps.gpus, MpsGpus::None);
    assert!(doc(&docs(&plain), "DaemonSet").contains("value: utility\n"), "no compute files without MPS");
    let refused = try_template("mps:\n  gpus: [\"first\"]\n").unwrap().unwrap_err();
    assert!(refused.contains("/mps/gpus/0"), "{refused}");
}

/// Every bounded value of the schema that reaches the agent is bounded exactly as the agent is: at
/// each bound Helm renders and the agent takes the rendering; past it Helm refuses, and so would
/// the agent (a schema wider than the agent let an install succeed and the agent crash-loop on
/// every GPU node: splitCount up to 1024, memoryScaling unbounded).
#[test]
fn the_schema_s_bounds_are_the_agent_s() {
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("packaging/helm/vgpu/values.schema.json")).unwrap())
            .unwrap();
    // (value, agent setting); the receiver's port is the receiver's, not the agent's.
    let walked = [
        ("splitCount", "split_count"),
        ("memoryScaling", "memory_scaling"),
        ("priorityQueueUs", "priority_queue_us"),
        ("priorityMinShare", "priority_min_share"),
        ("memoryFactor", "memory_factor"),
    ];
    let props = schema["properties"].as_object().unwrap();
    let bounded: Vec<&str> = props
        .iter()
        .filter(|(_, v)| ["minimum", "maximum", "exclusiveMinimum"].iter().any(|b| v.get(*b).is_some()))
        .map(|(k, _)| k.as_str())
        .filter(|k| *k != "receiverPort")
        .collect();
    let mut names: Vec<&str> = walked.iter().map(|w| w.0).collect();
    names.sort_unstable();
    let mut b = bounded.clone();
    b.sort_unstable();
    assert_eq!(b, names, "every bounded value is walked here");
    let agent = |key: &str, v: &str| vgpu_agent::config::Config::from_toml(&format!("{key} = {v}"));
    for (value, key) in walked {
        let p = &props[value];
        let num = |b: &str| p.get(b).and_then(serde_json::Value::as_f64);
        let integer = p["type"].as_str() == Some("integer")
            || p["type"].as_array().is_some_and(|t| t.contains(&"integer".into()));
        let show = |x: f64| if integer { format!("{}", x as i64) } else { format!("{x}") };
        let (inside, outside): (Vec<f64>, Vec<f64>) = match (num("minimum"), num("exclusiveMinimum"), num("maximum")) {
            (Some(lo), _, Some(hi)) => (vec![lo, hi], vec![lo - 1.0, hi + 1.0]),
            (_, Some(lo), Some(hi)) => (vec![lo + 0.01, hi], vec![lo, hi + 0.5]),
            other => panic!("{value}: bounded on both sides, not {other:?}"),
        };
        for x in inside {
            let Some(r) = try_template(&format!("{value}: {}", show(x))) else { return };
            let r = r.unwrap_or_else(|e| panic!("{value} = {} refused by the schema: {e}", show(x)));
            let c: ConfigMap = yaml_serde::from_str(doc(&docs(&r), "ConfigMap")).unwrap();
            vgpu_agent::config::Config::from_toml(&c.data.unwrap()["agent.toml"])
                .unwrap_or_else(|e| panic!("{value} = {}: the agent refuses the rendering: {e}", show(x)));
        }
        for x in outside {
            let Some(r) = try_template(&format!("{value}: {}", show(x))) else { return };
            assert!(r.is_err(), "{value} = {} passed the schema", show(x));
            assert!(agent(key, &show(x)).is_err(), "the agent takes {key} = {}: the schema is narrower", show(x));
        }
    }
}

/// The chart says which Kubernetes it needs (its admission policies are GA from 1.30), can be a
/// subchart (`global` is accepted), and its DaemonSet's update strategy is the admin's.
#[test]
fn the_chart_states_its_kubernetes_and_takes_an_update_strategy() {
    let Some(r) = template("global: {imageRegistry: example.com}\nupdateStrategy: {type: OnDelete}") else { return };
    let ds: DaemonSet = yaml_serde::from_str(doc(&docs(&r), "DaemonSet")).unwrap();
    assert_eq!(ds.spec.unwrap().update_strategy.unwrap().type_.as_deref(), Some("OnDelete"));
    let ds: DaemonSet = yaml_serde::from_str(doc(&docs(&template("{}").unwrap()), "DaemonSet")).unwrap();
    let u = ds.spec.unwrap().update_strategy.unwrap();
    assert_eq!(u.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        u.rolling_update.unwrap().max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let helm = helm().unwrap();
    let o = Command::new(&helm)
        .args(["template", "vgpu", "--kube-version", "1.29.4"])
        .arg(root().join("packaging/helm/vgpu"))
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains(">=1.30.0-0"), "{o:?}");
    let e = try_template("updateStrategy: {type: Sometimes}").unwrap().unwrap_err();
    assert!(e.contains("updateStrategy"), "{e}");
    // No image is published: an install that names none stops at render, saying what to set.
    let e = try_template("image: {repository: \"\"}").unwrap().unwrap_err();
    assert!(e.contains("image.repository is not set: no vgpu image is published yet"), "{e}");
}

/// What an admin sets about scraping: the ServiceMonitor's interval, timeout and relabelings, and a
/// NetworkPolicy that lets only the named peers reach the metrics port; the notes say when plain
/// HTTP metrics are open to anyone who reaches the pod.
#[test]
fn scraping_and_its_network_policy_follow_the_values() {
    let values = "serviceMonitor: {enabled: true, interval: 15s, scrapeTimeout: 5s, relabelings: [{targetLabel: cluster, replacement: c1}], metricRelabelings: [{action: drop, regex: hami_.*, sourceLabels: [__name__]}]}\nnetworkPolicy: {enabled: true, from: [{namespaceSelector: {matchLabels: {team: mon}}}]}";
    let Some(r) = template(values) else { return };
    let all = docs(&r);
    let sm: yaml_serde::Value = yaml_serde::from_str(doc(&all, "ServiceMonitor")).unwrap();
    let ep = &sm["spec"]["endpoints"][0];
    assert_eq!((ep["interval"].as_str(), ep["scrapeTimeout"].as_str()), (Some("15s"), Some("5s")));
    let relabel = ep["relabelings"].as_sequence().unwrap();
    assert_eq!(relabel.len(), 2, "the node's, then the values': {relabel:?}");
    assert_eq!(relabel[1]["targetLabel"].as_str(), Some("cluster"));
    assert_eq!(ep["metricRelabelings"][0]["action"].as_str(), Some("drop"));
    let np: k8s_openapi::api::networking::v1::NetworkPolicy = yaml_serde::from_str(doc(&all, "NetworkPolicy")).unwrap();
    let rule = &np.spec.unwrap().ingress.unwrap()[0];
    assert_eq!(
        rule.ports.as_ref().unwrap()[0].port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9394))
    );
    let from = rule.from.as_ref().unwrap()[0].namespace_selector.as_ref().unwrap();
    assert_eq!(from.match_labels.as_ref().unwrap()["team"], "mon");
    assert!(!docs(&template("{}").unwrap()).iter().any(|(k, _)| k == "NetworkPolicy"), "off by default");
    let out = Command::new(helm().unwrap())
        .args(["install", "--dry-run", "vgpu"])
        .arg(root().join("packaging/helm/vgpu"))
        .args(["--set", &format!("image.repository={IMAGE}")])
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&out.stdout);
    assert!(notes.contains("Metrics are served over plain HTTP on port 9394"), "{notes}");
}

/// (kind, namespace, name) of every object of a rendering.
fn identities(rendered: &str) -> Vec<(String, String, String)> {
    docs(rendered)
        .iter()
        .map(|(kind, d)| {
            let v: yaml_serde::Value = yaml_serde::from_str(d).unwrap();
            let field = |f: &str| v["metadata"][f].as_str().unwrap_or("").to_string();
            (kind.clone(), field("namespace"), field("name"))
        })
        .collect()
}

/// Two releases in one cluster (one per node pool, say) share no object: each name is made of the
/// release's ("<release>-node-agent": vgpu-node-agent for the release vgpu, as before these names),
/// selectors name the release, the admission policies name its service account, and only one
/// release makes the DeviceClasses (cluster-wide names that claims use). fullnameOverride,
/// nameOverride and namespaceOverride are followed; a name Kubernetes would refuse is refused.
#[test]
fn two_releases_share_no_object_and_names_follow_the_overrides() {
    let every = "{receiver: true, serviceMonitor: {enabled: true}, grafanaDashboard: true, \
                 networkPolicy: {enabled: true}, prometheusRule: {enabled: true}, dra: \"on\", \
                 devicePlugin: \"off\", compat: hami, deviceClasses: ";
    let Some(Ok(a)) = try_template_as("vgpu", &format!("{every}true}}")) else { return };
    let b = try_template_as("pool-b", &format!("{every}false}}")).unwrap().unwrap();
    let (ia, ib) = (identities(&a), identities(&b));
    let shared: Vec<_> = ia.iter().filter(|i| ib.contains(i)).collect();
    assert!(shared.is_empty(), "two releases share {shared:?}");
    assert!(ia.contains(&("DaemonSet".into(), NAMESPACE.into(), "vgpu-node-agent".into())), "{ia:?}");
    assert!(ib.contains(&("Deployment".into(), NAMESPACE.into(), "pool-b-receiver".into())), "{ib:?}");
    assert!(b.contains("request.userInfo.username == \"system:serviceaccount:vgpu-system:pool-b-node-agent\""));
    // Every selector names the release.
    for (kind, d) in docs(&b) {
        let v: yaml_serde::Value = yaml_serde::from_str(&d).unwrap();
        let sel = match kind.as_str() {
            "DaemonSet" | "Deployment" | "ServiceMonitor" => &v["spec"]["selector"]["matchLabels"],
            "Service" => &v["spec"]["selector"],
            "NetworkPolicy" => &v["spec"]["podSelector"]["matchLabels"],
            _ => continue,
        };
        assert_eq!(sel["app.kubernetes.io/instance"].as_str(), Some("pool-b"), "{kind}: {sel:?}");
    }

    let o =
        template("{fullnameOverride: gpu-agent, nameOverride: agent, namespaceOverride: gpu, receiver: true}").unwrap();
    let io = identities(&o);
    assert!(io.contains(&("DaemonSet".into(), "gpu".into(), "gpu-agent".into())), "{io:?}");
    assert!(io.contains(&("Deployment".into(), "gpu".into(), "gpu-agent-receiver".into())), "{io:?}");
    assert!(io.iter().all(|(_, ns, _)| ns.is_empty() || ns == "gpu"), "{io:?}");
    assert!(o.contains("app.kubernetes.io/name: agent\n"), "nameOverride labels the agent's objects");
    assert!(o.contains("\"system:serviceaccount:gpu:gpu-agent\""));
    for bad in ["{fullnameOverride: Agent_1}", "{namespaceOverride: gpu.}", "{nameOverride: -a}"] {
        let e = try_template(bad).unwrap().unwrap_err();
        assert!(e.contains("does not match pattern"), "{bad}: {e}");
    }
}

#[test]
fn the_receiver_renders_when_enabled() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Service;
    let Some(off) = template("{}") else { return };
    assert!(!off.contains("vgpu-receiver"), "off by default");
    let r = template("receiver: true").unwrap();
    let all = docs(&r);
    let d: Deployment = yaml_serde::from_str(doc(&all, "Deployment")).unwrap();
    let spec = d.spec.unwrap().template.spec.unwrap();
    let c = &spec.containers[0];
    assert_eq!(c.command.as_ref().unwrap()[0], "/usr/local/bin/vgpu-receiver");
    assert!(c.args.as_ref().unwrap().contains(&"--listen=0.0.0.0:9400".to_string()));
    assert_eq!(spec.volumes.unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(), Some("vgpu-receiver-tls"));
    let svc: Service = yaml_serde::from_str(doc(&all, "Service")).unwrap();
    assert_eq!(svc.spec.unwrap().ports.unwrap()[0].port, 9400);
    // Mutual TLS is off by default (an empty --client-ca) and on with the CA's path.
    assert!(c.args.as_ref().unwrap().contains(&"--client-ca=".to_string()));
    let r = template("{receiver: true, receiverClientCa: /etc/vgpu-receiver/ca.pem}").unwrap();
    let d: Deployment = yaml_serde::from_str(doc(&docs(&r), "Deployment")).unwrap();
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
    let file: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(root().join("packaging/prometheus/vgpu-alerts.yaml")).unwrap())
            .unwrap();
    let Some(off) = template("{}") else { return };
    assert!(!off.contains("kind: PrometheusRule"), "off by default");
    let r = template("prometheusRule: {enabled: true, additionalLabels: {release: kps}}").unwrap();
    let pr: yaml_serde::Value = yaml_serde::from_str(doc(&docs(&r), "PrometheusRule")).unwrap();
    assert_eq!(pr["metadata"]["labels"]["release"].as_str(), Some("kps"));
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
    if let Some(off) = template("{}") {
        assert!(!off.contains("grafana_dashboard"), "off by default");
        let r = template("grafanaDashboard: true").unwrap();
        let cm = docs(&r)
            .into_iter()
            .filter(|(k, _)| k == "ConfigMap")
            .map(|(_, d)| yaml_serde::from_str::<ConfigMap>(&d).unwrap())
            .find(|c| c.metadata.name.as_deref() == Some("vgpu-dashboard"))
            .unwrap();
        assert_eq!(cm.metadata.labels.as_ref().unwrap()["grafana_dashboard"], "1");
        let carried: serde_json::Value = serde_json::from_str(&cm.data.unwrap()["vgpu-dashboard.json"]).unwrap();
        assert_eq!(carried, d, "the ConfigMap's dashboard");
    }
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
    // The README and every document under docs/, its folders (run records) included.
    let mut docs = vec!["README.md".to_string()];
    let mut dirs = vec!["docs".to_string()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(root().join(&dir)).unwrap() {
            let e = e.unwrap();
            let rel = format!("{dir}/{}", e.file_name().to_string_lossy());
            if e.file_type().unwrap().is_dir() {
                dirs.push(rel);
            } else if rel.ends_with(".md") {
                docs.push(rel);
            }
        }
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
    // The site (mdBook, docs/SUMMARY.md) has every page of docs/, each once.
    let summary = std::fs::read_to_string(root().join("docs/SUMMARY.md")).unwrap();
    let mut listed: Vec<&str> =
        summary.lines().filter_map(|l| l.split_once("](")).filter_map(|(_, r)| r.strip_suffix(')')).collect();
    listed.sort_unstable();
    let mut pages: Vec<String> = docs
        .iter()
        .filter_map(|d| d.strip_prefix("docs/"))
        .filter(|d| !d.contains('/') && *d != "SUMMARY.md")
        .map(str::to_string)
        .collect();
    pages.sort_unstable();
    assert_eq!(listed, pages, "docs/SUMMARY.md lists every page of docs/ once");
}

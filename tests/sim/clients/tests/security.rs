//! The agent's only TCP endpoint, metrics, with TLS and a bearer token: plain HTTP gets no answer,
//! TLS without the token gets 401 for /metrics, the token gets the metrics; /healthz stays open for
//! probes. A container with the agent's files mounted cannot loosen its limits through its own
//! environment. (Limits files, permissions and container isolation are tested in agent_daemon and
//! oci_hook; the threat model is docs/security.md.)

mod common;
use common::agent::{bin, Agent};
use common::*;
use std::io::{Read, Write};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn https_get(addr: &str, ca: &std::path::Path, path: &str, token: Option<&str>) -> String {
    use rustls_pki_types::pem::PemObject;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let cfg = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s = conn.connect("127.0.0.1".try_into().unwrap(), tcp).await.unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

#[test]
fn metrics_over_tls_need_the_token() {
    let s = Sim::new(None);
    let certs = s.state.join("certs");
    let o = std::process::Command::new(bin("vgpu-receiver")).args(["gen-certs", "--out"]).arg(&certs).output().unwrap();
    assert!(o.status.success());
    let cfg = s.state.join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "metrics_tls_cert = \"{0}/server.pem\"\nmetrics_tls_key = \"{0}/server-key.pem\"\nmetrics_token_file = \"{0}/token\"\n",
            certs.display()
        ),
    )
    .unwrap();
    let a = Agent::start(&s, &[("VGPU_AGENT_CONFIG", cfg.to_str().unwrap())]);
    let token = std::fs::read_to_string(certs.join("token")).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ca = certs.join("ca.pem");
    let ok = rt.block_on(https_get(&a.metrics, &ca, "/metrics", Some(token.trim())));
    assert!(ok.starts_with("HTTP/1.1 200") && ok.contains("vgpu_agent_loop_seconds"), "{ok}");
    let denied = rt.block_on(https_get(&a.metrics, &ca, "/metrics", Some("wrong")));
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    let denied = rt.block_on(https_get(&a.metrics, &ca, "/metrics", None));
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    let health = rt.block_on(https_get(&a.metrics, &ca, "/healthz", None));
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut c = std::net::TcpStream::connect(&a.metrics).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    assert!(!String::from_utf8_lossy(&out).contains("vgpu_agent"), "metrics leaked over plain HTTP");

    // Rotated in place (as cert-manager does to a mounted Secret): a new certificate, key and
    // token are served within a couple of seconds, without a restart; the old token is refused.
    let next = s.state.join("certs-next");
    let o = std::process::Command::new(bin("vgpu-receiver")).args(["gen-certs", "--out"]).arg(&next).output().unwrap();
    assert!(o.status.success());
    for f in ["server.pem", "server-key.pem", "token"] {
        std::fs::copy(next.join(f), certs.join(f)).unwrap();
    }
    let new_token = std::fs::read_to_string(next.join("token")).unwrap();
    let new_ca = next.join("ca.pem");
    let t = std::time::Instant::now();
    loop {
        let got = std::panic::catch_unwind(|| {
            rt.block_on(https_get(&a.metrics, &new_ca, "/metrics", Some(new_token.trim())))
        });
        if got.as_ref().is_ok_and(|r| r.starts_with("HTTP/1.1 200")) {
            break;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the rotated files are not served: {got:?}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let old = rt.block_on(https_get(&a.metrics, &new_ca, "/metrics", Some(token.trim())));
    assert!(old.starts_with("HTTP/1.1 401"), "the old token after the rotation: {old}");
    assert!(a.log_text().contains("changed files loaded again"), "{}", a.log_text());
}

#[test]
fn the_agent_refuses_plain_metrics_on_the_network() {
    let s = Sim::new(None);
    let o = s
        .cmd(&bin("vgpu-node-agent"))
        .args([
            "--state-dir",
            s.state.join("agent").to_str().unwrap(),
            "--socket",
            s.state.join("a.sock").to_str().unwrap(),
        ])
        .args(["--metrics-address", "0.0.0.0:0", "run"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("reachable from the network"));
}

/// Root and unshare(1) for a private mount namespace, else skipped (CI runs as root and sets
/// VGPU_REQUIRE_RUNC: not skipped there).
fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let unshare = std::process::Command::new("unshare").arg("--version").output().is_ok_and(|o| o.status.success());
    if root && unshare {
        return true;
    }
    assert!(std::env::var_os("VGPU_REQUIRE_RUNC").is_none(), "needs root ({root}) and unshare ({unshare})");
    skipped("needs root and unshare");
    false
}

#[test]
fn a_managed_container_s_environment_cannot_loosen_its_limits() {
    use vgpu_agent::slices::{SliceGpu, SliceStore};
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some("[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let uuid = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let store = SliceStore::open(&s.state.join("agent")).unwrap();
    store.create("job", vec![SliceGpu { uuid, memory: 1 << 30, sm: 0 }], Default::default()).unwrap();
    let dir = store.dir("job");
    let own = s.state.join("own.region");
    let own = own.to_str().unwrap();
    // Everything a workload could set to get more than its slice.
    let hostile = [
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", own),
        ("VGPU_LIMITS_FILE", own),
        ("CUDA_DEVICE_MEMORY_LIMIT", "100g"),
        ("VGPU_FAIL_OPEN", "1"),
        ("GPU_CORE_UTILIZATION_POLICY", "disable"),
        ("VGPU_COUNT_MANAGED", "0"),
        ("VGPU_CONTEXT_OVERHEAD", "0"),
    ];
    // In a private mount namespace, the slice's files where the agent's injection puts them (the
    // region file, and the limits file read-only), then the workload.
    let run = |mounted: bool| {
        let script = if mounted {
            "mount --make-rprivate / && mount -t tmpfs vgpu-test /usr/local && mkdir /usr/local/vgpu \
             && touch /usr/local/vgpu/region /usr/local/vgpu/limits \
             && mount --bind \"$1/region\" /usr/local/vgpu/region && mount --bind -o ro \"$1/limits\" /usr/local/vgpu/limits \
             && shift && exec \"$@\""
        } else {
            "shift; exec \"$@\""
        };
        let o = s
            .cmd("unshare")
            .args(["-m", "--", "sh", "-c", script, "sh", dir.to_str().unwrap(), RT])
            .args(["alloc", "--size", "2g", "--chunk", "100m"])
            .env("LD_PRELOAD", libvgpu())
            .envs(hostile)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        (lines(&o.stdout).remove(0), err)
    };
    // Without the agent's files the environment is the configuration (the HAMi contract)...
    let (v, _) = run(false);
    assert_eq!(v["allocated"], 2048 * MIB, "not managed: the environment's 100 GiB");
    // ...with them, the slice's 1 GiB less the default 256 MiB per context, in the slice's region.
    let (v, err) = run(true);
    assert_eq!(v["allocated"], 700 * MIB, "{err}");
    assert!(err.contains("ignored: CUDA_DEVICE_MEMORY_SHARED_CACHE") && err.contains("VGPU_FAIL_OPEN"), "{err}");
    let region = vgpu_region::Region::open(&dir.join("region"), false).unwrap();
    assert_eq!(region.layout().devices[0].peak_used.load(std::sync::atomic::Ordering::Relaxed), 956 * MIB);
}

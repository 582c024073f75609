//! The vgpu-receiver binary's command line: certificates it makes, and the settings it refuses.
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_vgpu-receiver");

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vgpu-receiver-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn gen_certs_writes_a_ca_a_server_certificate_a_private_key_and_a_token() {
    let d = dir("certs");
    let o = Command::new(BIN)
        .args(["gen-certs", "--out"])
        .arg(&d)
        .args(["--host", "recv.example", "--host", "10.1.2.3"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (f, mode) in
        [("ca.pem", 0o644), ("ca-key.pem", 0o600), ("server.pem", 0o644), ("server-key.pem", 0o600), ("token", 0o600)]
    {
        let m = std::fs::metadata(d.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, mode, "{f}");
    }
    assert!(std::fs::read_to_string(d.join("ca.pem")).unwrap().starts_with("-----BEGIN CERTIFICATE-----"));
    assert!(std::fs::read_to_string(d.join("server-key.pem")).unwrap().contains("PRIVATE KEY"));
    assert_eq!(std::fs::read_to_string(d.join("token")).unwrap().len(), 64);
    // A client certificate from that CA.
    let o = Command::new(BIN)
        .args(["gen-client-cert", "--ca-dir"])
        .arg(&d)
        .args(["--name", "node-7", "--out"])
        .arg(d.join("clients"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (f, mode) in [("node-7.pem", 0o644), ("node-7-key.pem", 0o600)] {
        let m = std::fs::metadata(d.join("clients").join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, mode, "{f}");
    }
    assert!(std::fs::read_to_string(d.join("clients/node-7.pem")).unwrap().starts_with("-----BEGIN CERTIFICATE-----"));
    for (args, want) in [
        (vec!["--name", "a b"], "cannot be a certificate name"),
        (vec!["--name", "../x"], "cannot be a certificate name"),
    ] {
        let o = Command::new(BIN)
            .args(["gen-client-cert", "--ca-dir"])
            .arg(&d)
            .args(&args)
            .args(["--out", "/tmp"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.code() == Some(2) && err.contains(want), "{args:?}: {err}");
    }
    let o = Command::new(BIN)
        .args(["gen-client-cert", "--ca-dir", "/nonexistent", "--name", "n", "--out", "/tmp"])
        .output()
        .unwrap();
    assert!(o.status.code() == Some(1) && String::from_utf8_lossy(&o.stderr).contains("ca-key.pem"));
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn tcp_needs_tls_and_a_token() {
    let d = dir("refuse");
    assert!(Command::new(BIN).args(["gen-certs", "--out"]).arg(&d).status().unwrap().success());
    let empty = d.join("empty-token");
    std::fs::write(&empty, "# no tokens\n\n").unwrap();
    let cert = d.join("server.pem").display().to_string();
    let key = d.join("server-key.pem").display().to_string();
    let token = d.join("token").display().to_string();
    let e = empty.display().to_string();
    for (args, want) in [
        (vec!["serve"], "nothing to serve on"),
        (vec!["serve", "--listen", "127.0.0.1:0", "--token-file", &token], "--tls-cert and --tls-key"),
        (vec!["serve", "--listen", "127.0.0.1:0", "--tls-cert", &cert, "--tls-key", &key], "--token-file"),
        (
            vec!["serve", "--listen", "127.0.0.1:0", "--tls-cert", &cert, "--tls-key", &key, "--token-file", &e],
            "at least one token",
        ),
        (vec!["serve", "--unix", "/tmp/x.sock", "--heartbeat-ms", "5"], "--heartbeat-ms"),
        (vec!["serve", "--unix", "/tmp/x.sock", "--client-ca", &cert], "--client-ca is for --listen"),
        (
            vec!["serve", "--listen", "127.0.0.1:0", "--tls-cert", &key, "--tls-key", &cert, "--token-file", &token],
            "TLS",
        ),
    ] {
        let o = Command::new(BIN).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(d).unwrap();
}

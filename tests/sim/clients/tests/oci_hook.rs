//! The OCI hook with runc for real: a busybox container whose environment asks for a slice gets the
//! slice's files mounted (limits read-only) and `/etc/ld.so.preload`, and loses the slice when it
//! stops; a container that asks for nothing is untouched. Needs root and runc (`.ci/run` installs
//! runc and busybox-static and sets VGPU_REQUIRE_RUNC=1, so there the test cannot skip).

mod common;
use common::agent::*;
use common::*;

use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

const NODE: &str = "[[gpu]]\nmodel = \"A100-40GB\"\n";

fn available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let runc = Command::new("runc").arg("--version").output().is_ok_and(|o| o.status.success());
    let busybox = Path::new("/usr/bin/busybox").exists() || Path::new("/bin/busybox").exists();
    if root && runc && busybox {
        return true;
    }
    assert!(
        std::env::var_os("VGPU_REQUIRE_RUNC").is_none(),
        "runc end-to-end test required but root={root} runc={runc} busybox={busybox}"
    );
    eprintln!("SKIPPED: needs root, runc and busybox (root={root} runc={runc} busybox={busybox})");
    false
}

fn bundle(dir: &Path, env: &[&str], script: &str, hook: &str, socket: &Path) {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::create_dir_all(rootfs.join("etc")).unwrap();
    let bb = if Path::new("/usr/bin/busybox").exists() { "/usr/bin/busybox" } else { "/bin/busybox" };
    std::fs::copy(bb, rootfs.join("bin/busybox")).unwrap();
    for c in ["sh", "cat", "ls", "touch", "wc", "echo"] {
        let _ = std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(c));
    }
    let o = Command::new("runc").arg("spec").current_dir(dir).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    cfg["process"]["terminal"] = json!(false);
    cfg["process"]["args"] = json!(["/bin/sh", "-c", script]);
    let e = cfg["process"]["env"].as_array_mut().unwrap();
    for v in env {
        e.push(json!(v));
    }
    let sock = socket.display().to_string();
    cfg["hooks"] = json!({
        "createRuntime": [{"path": hook, "args": ["vgpu-oci-hook", "--socket", sock]}],
        "poststop": [{"path": hook, "args": ["vgpu-oci-hook", "--socket", sock, "poststop"]}],
    });
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
}

fn run(dir: &Path, id: &str) -> String {
    let o = Command::new("runc").args(["run", id]).current_dir(dir).output().unwrap();
    let _ = Command::new("runc").args(["delete", "--force", id]).output();
    assert!(
        o.status.success(),
        "runc run: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn runc_containers_get_their_slice_through_the_hook() {
    if !available() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let hook = bin("vgpu-oci-hook");
    let id = format!("vgpu-test-{}", std::process::id());

    // Asks for 1 GiB and 30 %: mounted, limits read-only, preload file in place.
    let b1 = s.state.join("bundle1");
    // Another container's slice exists: the container must not see it (nor the agent's state).
    a.ctl_ok(&["slice", "create", "--name", "other", "--gpu", "0", "--memory", "2GiB"]);
    let script = format!(
        "cat /etc/ld.so.preload; ls /usr/local/vgpu; \
         (echo x >> /usr/local/vgpu/limits) 2>/dev/null && echo LIMITS-WRITABLE || echo LIMITS-READONLY; \
         (echo x >> /usr/local/vgpu/libvgpu.so) 2>/dev/null && echo LIB-WRITABLE || echo LIB-READONLY; \
         (ls {0}/slices/other || ls {0}) >/dev/null 2>&1 && echo OTHERS-VISIBLE || echo OTHERS-HIDDEN; \
         wc -c < /usr/local/vgpu/limits",
        a.state.display()
    );
    let script = script.as_str();
    bundle(&b1, &["VGPU_MEMORY=1GiB", "VGPU_SM=30", "VGPU_GPUS=0"], script, &hook, &a.socket);
    let out = run(&b1, &id);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/usr/local/vgpu/libvgpu.so", "{out}");
    for f in ["libvgpu.so", "limits", "region", "slice.json"] {
        assert!(lines.contains(&f), "{f} missing in\n{out}");
    }
    assert!(out.contains("LIMITS-READONLY") && out.contains("LIB-READONLY"), "{out}");
    assert!(out.contains("OTHERS-HIDDEN"), "another container's slice is out of reach: {out}");
    let size: u64 = lines.last().unwrap().trim().parse().unwrap();
    assert_eq!(size, vgpu_region::TOTAL_SIZE as u64, "the slice's limits region");
    // The agent made the slice with the asked limits, and poststop removed it.
    assert!(a.log_text().contains(&format!("\"slice\":\"oci-{id}\"")), "{}", a.log_text());
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(!list.contains(&format!("oci-{id}")), "deleted at poststop: {list}");

    // Asks for nothing: untouched.
    let b2 = s.state.join("bundle2");
    bundle(&b2, &[], "ls /usr/local/vgpu 2>&1; cat /etc/ld.so.preload 2>&1; true", &hook, &a.socket);
    let out = run(&b2, &format!("{id}-plain"));
    assert!(out.contains("No such file or directory"), "{out}");
    assert!(!out.contains("libvgpu.so\n"), "{out}");
}

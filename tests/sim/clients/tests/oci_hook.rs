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
    skipped(&format!("needs root, runc and busybox (root={root} runc={runc} busybox={busybox})"));
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

/// The bundle's hooks run with these arguments too (the runtime administrator's policy).
fn hook_args(dir: &Path, extra: &[&str]) {
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    for stage in ["createRuntime", "poststop"] {
        let args = cfg["hooks"][stage][0]["args"].as_array_mut().unwrap();
        for (i, a) in extra.iter().enumerate() {
            args.insert(3 + i, json!(a));
        }
    }
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
    bundle(&b1, &["VGPU_MEMORY=1GiB", "VGPU_SM=30", "VGPU_GPUS=0", "VGPU_PRIORITY=high"], script, &hook, &a.socket);
    hook_args(&b1, &["--allow-priority"]);
    let out = run(&b1, &id);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/usr/local/vgpu/libvgpu.so", "{out}");
    for f in ["libvgpu.so", "limits", "region"] {
        assert!(lines.contains(&f), "{f} missing in\n{out}");
    }
    assert!(!lines.contains(&"slice.json"), "the slice's record is out of the container's reach: {out}");
    assert!(out.contains("LIMITS-READONLY") && out.contains("LIB-READONLY"), "{out}");
    assert!(out.contains("OTHERS-HIDDEN"), "another container's slice is out of reach: {out}");
    let size: u64 = lines.last().unwrap().trim().parse().unwrap();
    assert_eq!(size, vgpu_region::TOTAL_SIZE as u64, "the slice's limits region");
    // The agent made the slice with the asked limits, and poststop removed it.
    assert!(a.log_text().contains(&format!("\"slice\":\"oci-{id}\"")), "{}", a.log_text());
    let created = a
        .log_text()
        .lines()
        .find(|l| l.contains("slice created") && l.contains(&format!("oci-{id}")))
        .map(str::to_owned);
    assert!(created.as_deref().is_some_and(|l| l.contains("\"priority\":\"High\"")), "VGPU_PRIORITY=high: {created:?}");
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(!list.contains(&format!("oci-{id}")), "deleted at poststop: {list}");

    // Asks for nothing: untouched.
    let b2 = s.state.join("bundle2");
    bundle(&b2, &[], "ls /usr/local/vgpu 2>&1; cat /etc/ld.so.preload 2>&1; true", &hook, &a.socket);
    let out = run(&b2, &format!("{id}-plain"));
    assert!(out.contains("No such file or directory"), "{out}");
    assert!(!out.contains("libvgpu.so\n"), "{out}");
}

/// `runc run` that is expected to fail: its stderr.
fn run_failing(dir: &Path, id: &str) -> String {
    let o = Command::new("runc").args(["run", id]).current_dir(dir).output().unwrap();
    let _ = Command::new("runc").args(["delete", "--force", id]).output();
    assert!(!o.status.success(), "runc run succeeded: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn kai_fractional_gpus_get_their_portion_through_the_hook() {
    if !available() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let hook = bin("vgpu-oci-hook");
    let id = format!("vgpu-kai-{}", std::process::id());
    let st = a.wait("the GPU is listed", |v| v["gpus"][0]["uuid"].as_str().is_some());
    let uuid = st["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let total = st["gpus"][0]["memory_total"].as_u64().unwrap();
    let visible = format!("NVIDIA_VISIBLE_DEVICES={uuid}");
    // What the container's limits file says (the record is out of its reach): the first device's
    // UUID, memory and SM limits, read at their offsets in the region layout.
    // annotations: the pod's, as containerd copies them into the OCI spec (its `pod_annotations`).
    let record_with = |env: &[&str], annotations: Value, n: &str| -> Value {
        let b = s.state.join(format!("kai-{n}"));
        let (uuid, mem, sm) = (
            std::mem::offset_of!(vgpu_region::Layout, devices),
            std::mem::offset_of!(vgpu_region::Layout, devices) + std::mem::offset_of!(vgpu_region::Device, mem_limit),
            std::mem::offset_of!(vgpu_region::Layout, devices) + std::mem::offset_of!(vgpu_region::Device, sm_limit),
        );
        let f = "/usr/local/vgpu/limits";
        let script = format!(
            "dd if={f} bs=1 skip={uuid} count=64 2>/dev/null | tr -d '\\000'; echo; \
             od -A n -t u8 -j {mem} -N 8 {f}; od -A n -t u4 -j {sm} -N 4 {f}"
        );
        bundle(&b, env, &script, &hook, &a.socket);
        let mut cfg: Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
        cfg["annotations"] = annotations;
        std::fs::write(b.join("config.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        let out = run(&b, &format!("{id}-{n}"));
        let l: Vec<&str> = out.lines().map(str::trim).collect();
        json!({"gpus": [{"uuid": l[0], "memory": l[1].parse::<u64>().unwrap(), "sm": l[2].parse::<u64>().unwrap()}]})
    };
    let record = |env: &[&str], n: &str| record_with(env, json!({}), n);
    // KAI alone: a quarter of the GPU's memory, no SM limit (KAI shares time, it does not divide it).
    let r = record(&["GPU_PORTION=0.25", &visible], "quarter");
    assert_eq!(r["gpus"][0]["uuid"], uuid.as_str(), "{r}");
    let quarter = total / 4 / MIB * MIB;
    assert_eq!((r["gpus"][0]["memory"].as_u64(), r["gpus"][0]["sm"].as_u64()), (Some(quarter), Some(0)), "{r}");
    assert!(a.log_text().contains("oci-hook"), "labelled by its source: {}", a.log_text());
    // With KAI's hamicore plugin: its exact limit (HAMi's syntax) and SM share.
    let r =
        record(&["GPU_PORTION=0.5", &visible, "CUDA_DEVICE_MEMORY_LIMIT=6000m", "CUDA_DEVICE_SM_LIMIT=40"], "hamicore");
    assert_eq!((r["gpus"][0]["memory"].as_u64(), r["gpus"][0]["sm"].as_u64()), (Some(6000 * MIB), Some(40)), "{r}");
    // KAI's pod annotations, which containerd passes where its runtime names them: exact, whatever
    // the GPU_PORTION KAI rounded up to two decimals (a gpu-memory: 2000 pod gets 0.03 of a GPU).
    let kai = |k: &str, v: &str| json!({k: v, "io.kubernetes.cri.container-name": "main"});
    let r = record_with(&["GPU_PORTION=0.03", &visible], kai("gpu-memory", "2000"), "memory");
    assert_eq!(
        (r["gpus"][0]["uuid"].as_str(), r["gpus"][0]["memory"].as_u64()),
        (Some(uuid.as_str()), Some(2000 * MIB)),
        "{r}"
    );
    let r = record_with(&["GPU_PORTION=0.34", &visible], kai("gpu-fraction", "0.333"), "fraction");
    assert_eq!(r["gpus"][0]["memory"].as_u64(), Some((total as f64 * 0.333) as u64 / MIB * MIB), "{r}");
    // No GPU_PORTION at all: the annotations alone ask.
    let r = record_with(&[&visible], kai("gpu-memory", "1500"), "annotations-only");
    assert_eq!(r["gpus"][0]["memory"].as_u64(), Some(1500 * MIB), "{r}");
    // Nonsense is refused with the reason, and the container does not start.
    for (env, want) in [
        (vec!["GPU_PORTION=2", visible.as_str()], "is not a fraction of a GPU (0 < p <= 1)"),
        (vec!["GPU_PORTION=0.5", "NVIDIA_VISIBLE_DEVICES=all"], "a fraction of one GPU"),
        (
            vec!["GPU_PORTION=0.5", "NVIDIA_VISIBLE_DEVICES=GPU-nope"],
            "GPU GPU-nope (NVIDIA_VISIBLE_DEVICES) is not on this node",
        ),
    ] {
        let b = s.state.join(format!("kai-bad-{}", want.len()));
        bundle(&b, &env, "true", &hook, &a.socket);
        let e = run_failing(&b, &format!("{id}-bad"));
        assert!(e.contains(want), "{env:?}: {e}");
    }
    // A container a device plugin already put in a slice (its /usr/local/vgpu is mounted) is left alone.
    let b = s.state.join("kai-mounted");
    bundle(&b, &["GPU_PORTION=0.5", &visible], "ls /usr/local/vgpu", &hook, &a.socket);
    let theirs = s.state.join("theirs");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::write(theirs.join("marker"), "").unwrap();
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    cfg["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/usr/local/vgpu", "type": "bind", "source": theirs.display().to_string(), "options": ["rbind", "ro"]
    }));
    std::fs::write(b.join("config.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    assert_eq!(run(&b, &format!("{id}-mounted")).trim(), "marker");
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(!list.contains(&format!("{id}-mounted")) && !list.contains("kai"), "{list}");
    assert!(!a.log_text().contains(&format!("oci-{id}-mounted")), "no slice was made for it");
}

#[test]
fn a_container_s_environment_gets_it_no_slice_but_its_own_and_no_priority_unless_allowed() {
    if !available() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let hook = bin("vgpu-oci-hook");
    let id = format!("vgpu-policy-{}", std::process::id());
    a.ctl_ok(&["slice", "create", "--name", "victim", "--gpu", "0", "--memory", "1GiB", "--priority", "high"]);
    // A tenant naming another slice in its environment: refused, the container never starts (so
    // it never mounts the victim's region or activity file).
    let b = s.state.join("join");
    bundle(&b, &["VGPU_SLICE=victim"], "ls /usr/local/vgpu", &hook, &a.socket);
    let e = run_failing(&b, &format!("{id}-join"));
    assert!(e.contains("VGPU_SLICE=") && e.contains("victim") && e.contains("--allow-join"), "{e}");
    // Claiming high priority for its own slice: refused, and no slice is left behind.
    let b = s.state.join("priority");
    bundle(&b, &["VGPU_MEMORY=1GiB", "VGPU_PRIORITY=high"], "true", &hook, &a.socket);
    let e = run_failing(&b, &format!("{id}-priority"));
    assert!(e.contains("VGPU_PRIORITY=high") && e.contains("--allow-priority"), "{e}");
    let list = a.ctl_ok(&["slice", "list"]);
    assert!(!list.contains(&format!("oci-{id}")), "{list}");
    // Where the administrator allows them (the hook's arguments), both work.
    let b = s.state.join("joined");
    bundle(&b, &["VGPU_SLICE=victim"], "ls /usr/local/vgpu", &hook, &a.socket);
    hook_args(&b, &["--allow-join"]);
    let out = run(&b, &format!("{id}-joined"));
    assert!(out.lines().any(|l| l == "limits"), "{out}");
    let b = s.state.join("prioritised");
    bundle(&b, &["VGPU_MEMORY=1GiB", "VGPU_PRIORITY=high"], "true", &hook, &a.socket);
    hook_args(&b, &["--allow-priority"]);
    run(&b, &format!("{id}-prioritised"));
    assert!(
        a.log_text().lines().any(|l| l.contains("slice created")
            && l.contains(&format!("oci-{id}-prioritised"))
            && l.contains("\"priority\":\"High\"")),
        "{}",
        a.log_text()
    );
}

#[test]
fn the_image_s_symbolic_links_lead_the_hook_s_mounts_only_inside_the_container() {
    if !available() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let hook = bin("vgpu-oci-hook");
    // The image's /usr/local/vgpu and /etc point at host folders (absolute links): the hook must
    // resolve them inside the container's root, as the container will, and write nothing there.
    let (host_vgpu, host_etc) = (s.state.join("host-vgpu"), s.state.join("host-etc"));
    std::fs::create_dir_all(&host_vgpu).unwrap();
    std::fs::create_dir_all(&host_etc).unwrap();
    let b = s.state.join("links");
    bundle(&b, &["VGPU_MEMORY=1GiB"], "ls /usr/local/vgpu; cat /etc/ld.so.preload", &hook, &a.socket);
    let rootfs = b.join("rootfs");
    std::fs::create_dir_all(rootfs.join("usr/local")).unwrap();
    std::os::unix::fs::symlink(&host_vgpu, rootfs.join("usr/local/vgpu")).unwrap();
    std::fs::remove_dir_all(rootfs.join("etc")).unwrap();
    std::os::unix::fs::symlink(&host_etc, rootfs.join("etc")).unwrap();
    let out = run(&b, &format!("vgpu-links-{}", std::process::id()));
    for f in ["limits", "region", "libvgpu.so", "/usr/local/vgpu/libvgpu.so"] {
        assert!(out.lines().any(|l| l == f), "{f} missing in the container:\n{out}");
    }
    for d in [&host_vgpu, &host_etc] {
        let left: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "the hook wrote on the host through the image's link, in {}: {left:?}", d.display());
    }
    // Inside the root, where the links lead in the container.
    assert!(rootfs.join(host_vgpu.strip_prefix("/").unwrap()).join("limits").exists());
}

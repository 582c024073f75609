//! The agent against a hostile container: a private mount namespace holding exactly the mounts the
//! agent's injection gives (`vgpuctl inspect --json`), root inside it and a non-root user, trying
//! what independent testing found worked before: rewriting the slice record, pointing its region at
//! a neighbour's limits, truncating or scribbling on its region, and the API asked for names that
//! are paths, for more slices and labels than a node can hold. Each test fails on the layout that
//! mounted the slice's whole directory read-write (0be7502). The threat model is docs/security.md.

mod common;
use common::agent::{bin, in_slice, slice_of, Agent};
use common::*;
use serde_json::Value;
use std::time::{Duration, Instant};

const NODE: &str = "[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 16384\n";

/// Root and unshare(1) for private mount namespaces, else skipped (CI runs as root and sets
/// VGPU_REQUIRE_RUNC: not skipped there).
fn can_mount() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let tools = ["unshare", "setpriv"]
        .iter()
        .all(|t| std::process::Command::new(t).arg("--version").output().is_ok_and(|o| o.status.success()));
    if root && tools {
        return true;
    }
    assert!(std::env::var_os("VGPU_REQUIRE_RUNC").is_none(), "needs root ({root}), unshare and setpriv ({tools})");
    skipped("needs root, unshare and setpriv");
    false
}

/// Runs `script` with `sh` as a container of the slice would: in a new mount namespace whose
/// `/usr/local` is a fresh tmpfs holding the injection's mounts, each made as the runtime makes it
/// (a file bind-mounted on a file, read-only where the injection says), as `uid` (0: root).
fn in_container(a: &Agent, slice: &str, uid: u32, script: &str) -> std::process::Output {
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", slice, "--json"])).unwrap();
    let mut setup = String::from("set -e; mount --make-rprivate /; mount -t tmpfs hostile /usr/local; ");
    for m in d["slice"]["mounts"].as_array().unwrap() {
        let (host, dst) = (m["host_path"].as_str().unwrap(), m["container_path"].as_str().unwrap());
        let ro = if m["read_only"].as_bool().unwrap_or(false) { "-o ro " } else { "" };
        let dir = std::path::Path::new(dst).parent().unwrap().display().to_string();
        if std::path::Path::new(host).is_dir() {
            setup += &format!("mkdir -p '{dst}'; mount --bind {ro}'{host}' '{dst}'; ");
        } else {
            setup += &format!("mkdir -p '{dir}'; touch '{dst}'; mount --bind {ro}'{host}' '{dst}'; ");
        }
    }
    setup += &format!("set +e; exec setpriv --reuid {uid} --regid {uid} --clear-groups sh -c \"$0\"");
    std::process::Command::new("unshare").args(["-m", "--", "sh", "-c", &setup, script]).output().unwrap()
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn limit(a: &Agent, slice: &str) -> u64 {
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", slice, "--json"])).unwrap();
    d["slice"]["gpus"][0]["memory"].as_u64().unwrap()
}

fn restart(a: &mut Agent, s: &Sim) {
    a.sigkill();
    a.spawn(s);
}

#[test]
fn a_container_cannot_raise_its_own_limit_or_lower_a_neighbours() {
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "evil", "--gpu", "0", "--memory", "1GiB"]);
    a.ctl_ok(&["slice", "create", "--name", "victim", "--gpu", "0", "--memory", "4GiB"]);
    let victim_limits = a.state.join("slices/victim/limits");
    let raised = r#"{"name":"evil","gpus":[{"uuid":"x","memory":75161927680,"sm":0}],"created":1}"#;
    for uid in [0, 65534] {
        let o = in_container(
            &a,
            "evil",
            uid,
            &format!(
                "echo '{raised}' > /usr/local/vgpu/slice.json; \
                 rm -f /usr/local/vgpu/region && echo REGION-REMOVED; \
                 ln -sf '{}' /usr/local/vgpu/region && echo REGION-LINKED; \
                 (echo x >> /usr/local/vgpu/limits) 2>/dev/null && echo LIMITS-WRITABLE; true",
                victim_limits.display()
            ),
        );
        let out = text(&o);
        assert!(!out.contains("REGION-REMOVED") && !out.contains("REGION-LINKED"), "uid {uid}: {out}");
        assert!(!out.contains("LIMITS-WRITABLE"), "uid {uid}: {out}");
    }
    // Nothing of that reached the host: the agent's next start keeps both limits.
    restart(&mut a, &s);
    assert_eq!((limit(&a, "evil"), limit(&a, "victim")), (1 << 30, 4 << 30));
    let r = vgpu_region::Region::open(&victim_limits, false).unwrap();
    assert_eq!(r.mem_limit(0), 4 << 30);
    // And the slice holds its processes to 1 GiB.
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "evil", "--json"])).unwrap();
    let o = in_slice(&s, &d["slice"], RT).args(["alloc", "--size", "3g", "--chunk", "100m"]).output().unwrap();
    let v = lines(&o.stdout).remove(0);
    assert_eq!(v["allocated"].as_u64().unwrap(), 700 * MIB, "1 GiB less the 256 MiB context: {v}");
}

#[test]
fn a_container_that_truncates_or_scribbles_on_its_region_does_not_take_the_agent_down() {
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "evil", "--gpu", "0", "--memory", "1GiB"]);
    a.ctl_ok(&["slice", "create", "--name", "other", "--gpu", "0", "--memory", "2GiB"]);
    // Truncated by a non-root user (the region is 0666), then by root, between passes.
    for (round, uid) in [65534, 0].into_iter().enumerate() {
        let o = in_container(&a, "evil", uid, ": > /usr/local/vgpu/region && echo TRUNCATED");
        assert!(text(&o).contains("TRUNCATED"), "{}", text(&o));
        let seq = a.status().unwrap()["sequence"].as_u64().unwrap();
        a.wait("passes after the truncation", |v| v["sequence"].as_u64().unwrap_or(0) > seq + 3);
        assert!(a.log_text().contains("shrank under the agent"), "{}", a.log_text());
        // Made whole again in place, at once (not only at the agent's next start).
        assert_eq!(a.log_text().matches("repaired in place").count(), round + 1, "{}", a.log_text());
        let len = std::fs::metadata(a.state.join("slices/evil/region")).unwrap().len();
        assert_eq!(len, vgpu_region::TOTAL_SIZE as u64);
    }
    // Scribbled with random bytes: the agent keeps serving, the other slice is unaffected.
    let o = in_container(&a, "evil", 0, "head -c 200000 /dev/urandom > /usr/local/vgpu/region; echo DONE");
    assert!(text(&o).contains("DONE"));
    let seq = a.status().unwrap()["sequence"].as_u64().unwrap();
    let st = a.wait("passes after the scribble", |v| v["sequence"].as_u64().unwrap_or(0) > seq + 3);
    assert_eq!(slice_of(&st, "other")["gpus"][0]["memory_limit"], 2u64 << 30);
    restart(&mut a, &s);
    assert_eq!(a.ctl_ok(&["slice", "list"]).lines().filter(|l| l.contains("evil") || l.contains("other")).count(), 2);
    a.ctl_ok(&["slice", "delete", "evil", "--force"]);
}

/// Two slices on GPU 0, `evil` (1 GiB) and `victim` (2 GiB), a process holding 64 MiB in each, both
/// attributed; then the evil container writes the victim's host PID into its own slot. The victim's
/// and evil's host PIDs, evil's region (mapped here, writable) and the slot's index.
fn victim_s_pid_in_evil_s_slot(s: &mut Sim, a: &Agent) -> (u32, u32, vgpu_region::Region, usize) {
    use std::sync::atomic::Ordering::SeqCst;
    let detail = |n: &str| -> Value {
        serde_json::from_str::<Value>(&a.ctl_ok(&["inspect", n, "--json"])).unwrap()["slice"].clone()
    };
    a.ctl_ok(&["slice", "create", "--name", "evil", "--gpu", "0", "--memory", "1GiB"]);
    a.ctl_ok(&["slice", "create", "--name", "victim", "--gpu", "0", "--memory", "2GiB"]);
    let (victim, _) = s.spawn_cmd(in_slice(s, &detail("victim"), RT), &["alloc", "--size", "64m", "--hold"]);
    let (evil, _) = s.spawn_cmd(in_slice(s, &detail("evil"), RT), &["alloc", "--size", "64m", "--hold"]);
    a.wait("both processes attributed", |v| {
        [("victim", victim), ("evil", evil)].iter().all(|(n, p)| {
            slice_of(v, n)["processes"].as_array().is_some_and(|ps| ps.iter().any(|x| x["host_pid"] == *p))
        })
    });
    let region = vgpu_region::Region::open(&a.state.join("slices/evil/region"), true).unwrap();
    let slot = region.layout().slots.iter().position(|x| x.pid.load(SeqCst) == evil).unwrap();
    region.layout().slots[slot].host_pid.store(victim, SeqCst);
    (victim, evil, region, slot)
}

#[test]
fn region_scribbles_neither_poison_node_counters_nor_name_another_container_s_process() {
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    // The evil container writes the victim's PID into its own slot, and an absurd usage.
    let (victim, evil, region, slot) = victim_s_pid_in_evil_s_slot(&mut s, &a);
    region.layout().slots[slot].used[0].store(u64::MAX / 2, std::sync::atomic::Ordering::SeqCst);
    let seq = a.status().unwrap()["sequence"].as_u64().unwrap();
    let st = a.wait("passes after the scribble", |v| v["sequence"].as_u64().unwrap_or(0) > seq + 3);
    let evil_pids: Vec<u64> =
        slice_of(&st, "evil")["processes"].as_array().unwrap().iter().filter_map(|p| p["host_pid"].as_u64()).collect();
    assert!(!evil_pids.contains(&(victim as u64)), "the victim's process listed under the evil slice: {evil_pids:?}");
    assert!(slice_of(&st, "victim")["processes"].as_array().unwrap().iter().any(|p| p["host_pid"] == victim), "{st}");
    // The evil process dies: what its slot claimed is reclaimed, but never more than the GPU has.
    s.kill(evil);
    a.wait("the slot reclaimed", |v| v["agent"]["reclaimed_bytes"].as_u64().unwrap_or(0) > 0);
    let (_, body) = a.scrape("/metrics");
    let reclaimed: f64 = body
        .lines()
        .find(|l| l.starts_with("vgpu_reclaimed_bytes_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(reclaimed <= (1024 * MIB) as f64, "reclaimed {reclaimed} bytes of a slice limited to 1 GiB");
}

#[test]
fn names_that_are_paths_are_refused_on_every_call_and_nothing_outside_is_deleted() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "victim", "--gpu", "0", "--memory", "1GiB"]);
    let precious = s.state.join("outside/precious");
    std::fs::create_dir_all(&precious).unwrap();
    for name in ["lib/../victim", "../../../outside/precious", "../records/victim", ".."] {
        for force in [false, true] {
            let mut args = vec!["slice", "delete", name];
            if force {
                args.push("--force");
            }
            let o = a.ctl(&args);
            assert!(!o.status.success(), "{name}");
            assert!(
                String::from_utf8_lossy(&o.stderr).contains("invalid slice name"),
                "{}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    assert!(precious.exists());
    assert!(a.ctl_ok(&["slice", "list"]).contains("victim"));
    assert!(a.status().is_some(), "listing still works for everyone");
    // An over-long name is not echoed whole (gRPC clients refuse large metadata).
    let long = "a".repeat(70_000);
    let o = a.ctl(&["slice", "delete", &long]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("invalid slice name") && err.len() < 400,
        "{} bytes: {}",
        err.len(),
        &err[..err.len().min(200)]
    );
}

#[test]
fn slices_and_labels_are_bounded_and_running_out_of_descriptors_does_not_spin() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[("VGPU_AGENT_MAX_SLICES", "3")]);
    for n in ["a", "b", "c"] {
        a.ctl_ok(&["slice", "create", "--name", n, "--gpu", "0", "--memory", "64m"]);
    }
    let o = a.ctl(&["slice", "create", "--name", "d", "--gpu", "0", "--memory", "64m"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("the most max_slices = 3 allows"), "{o:?}");
    a.ctl_ok(&["slice", "delete", "c"]);
    let big = format!("note={}", "x".repeat(100_000));
    let o = a.ctl(&["slice", "create", "--name", "c", "--gpu", "0", "--memory", "64m", "--label", &big]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("at most 1024"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = a.ctl(&["slice", "create", "--name", "c", "--gpu", "0", "--label", "pod=a\u{1b}[2J"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("control characters"));
    assert!(a.status().is_some());

    // The agent's descriptors run out (a low limit, held connections): it waits instead of spinning
    // on accept, and serves again once they are free.
    // Only the soft limit: raising a hard limit again needs CAP_SYS_RESOURCE.
    let mut was = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit on our own child with valid structs.
    assert_eq!(unsafe { libc::prlimit(a.pid() as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut was) }, 0);
    let lim = libc::rlimit { rlim_cur: 64, rlim_max: was.rlim_max };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::prlimit(a.pid() as i32, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()) }, 0);
    let held: Vec<_> = (0..80).filter_map(|_| std::os::unix::net::UnixStream::connect(&a.socket).ok()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let cpu = |pid: u32| -> u64 {
        let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let f: Vec<&str> = st.rsplit_once(')').unwrap().1.split_whitespace().collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    };
    let (t, c) = (Instant::now(), cpu(a.pid()));
    std::thread::sleep(Duration::from_secs(2));
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let share = (cpu(a.pid()) - c) as f64 / ticks / t.elapsed().as_secs_f64();
    assert!(share < 0.5, "the agent used {:.0} % of a CPU while out of descriptors", share * 100.0);
    assert!(a.log_text().contains("cannot accept a connection"), "said why");
    drop(held);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::prlimit(a.pid() as i32, libc::RLIMIT_NOFILE, &was, std::ptr::null_mut()) }, 0);
    let t = Instant::now();
    while a.status().is_none() {
        assert!(t.elapsed() < Duration::from_secs(10), "the agent serves again");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn cdi_specs_are_reconciled_at_start_and_a_failed_start_leaves_no_socket() {
    let s = Sim::new(Some(NODE));
    let mut a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "kept", "--gpu", "0", "--memory", "64m"]);
    a.ctl_ok(&["slice", "create", "--name", "gone", "--gpu", "0", "--memory", "64m"]);
    a.sigkill();
    let cdi = a.state.join("cdi");
    std::fs::remove_file(cdi.join("vgpu-kept.json")).unwrap();
    // Deleted while the agent was down (its record and files), its spec left behind.
    std::fs::remove_file(a.state.join("records/gone.json")).unwrap();
    std::fs::write(cdi.join("vgpu-x.json.tmp"), b"{").unwrap();
    a.spawn(&s);
    assert!(cdi.join("vgpu-kept.json").exists(), "{}", a.log_text());
    assert!(!cdi.join("vgpu-gone.json").exists() && !cdi.join("vgpu-x.json.tmp").exists());
    assert!(!a.state.join("slices/gone").exists());
    a.sigkill();

    // No NVML: the start fails, and the socket it had bound is gone.
    let o = s
        .cmd(&bin("vgpu-node-agent"))
        .args(["--state-dir", a.state.to_str().unwrap(), "--socket", a.socket.to_str().unwrap()])
        .args(["--nvml-library", "/nonexistent/libnvidia-ml.so.1", "run"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(!a.socket.exists(), "the socket outlived a failed start");
    let e = String::from_utf8_lossy(&a.ctl(&["status"]).stderr).into_owned();
    assert!(e.contains("is vgpu-node-agent running?") && !e.contains("refused"), "{e}");
    // A value that is not UTF-8 is named, not ignored.
    use std::os::unix::ffi::OsStrExt;
    let o = s
        .cmd(&bin("vgpu-node-agent"))
        .env("VGPU_AGENT_ESCAPE_ACTION", std::ffi::OsStr::from_bytes(b"kill\xff"))
        .args(["--state-dir", a.state.to_str().unwrap(), "run"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("VGPU_AGENT_ESCAPE_ACTION: its value"), "{o:?}");
}

#[test]
fn slice_update_changes_only_what_it_names() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "j", "--gpu", "0", "--memory", "2GiB", "--sm", "30"]);
    let out = a.ctl_ok(&["slice", "update", "j", "--gpu", "0", "--memory", "1GiB"]);
    assert!(out.contains("memory 2.0 GiB -> 1.0 GiB") && out.contains("SM 30% (kept)"), "{out}");
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "j", "--json"])).unwrap();
    assert_eq!(
        (d["slice"]["gpus"][0]["memory"].as_u64(), d["slice"]["gpus"][0]["sm"].as_u64()),
        (Some(1 << 30), Some(30))
    );
    a.ctl_ok(&["slice", "update", "j", "--gpu", "0", "--sm", "none"]);
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "j", "--json"])).unwrap();
    assert_eq!(
        (d["slice"]["gpus"][0]["memory"].as_u64(), d["slice"]["gpus"][0]["sm"].as_u64()),
        (Some(1 << 30), Some(0))
    );
    let o = a.ctl(&["slice", "update", "j", "--gpu", "0"]);
    assert_eq!(o.status.code(), Some(2), "nothing to change");
}

/// A container cannot fill the host's disk through the files it may write: its region and activity
/// file grown by uid 65534 are cut back to their sizes within a second (issue 61, item 21: 200 MiB
/// each went into the agent's state directory, outside the container's storage accounting).
#[test]
fn a_container_cannot_grow_its_slice_s_files_on_the_host() {
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "fat", "--gpu", "0", "--memory", "1GiB"]);
    let o = in_container(
        &a,
        "fat",
        65534,
        "head -c 20000000 /dev/zero >> /usr/local/vgpu/region && head -c 20000000 /dev/zero >> /usr/local/vgpu/activity && echo GREW",
    );
    assert!(text(&o).contains("GREW"), "{}", text(&o));
    let len = |f: &str| std::fs::metadata(a.state.join("slices/fat").join(f)).unwrap().len();
    let sizes = (vgpu_region::TOTAL_SIZE as u64, vgpu_region::activity::SIZE as u64);
    let start = Instant::now();
    while (len("region"), len("activity")) != sizes {
        assert!(start.elapsed() < Duration::from_secs(10), "not cut back: {} and {}", len("region"), len("activity"));
        std::thread::sleep(Duration::from_millis(100));
    }
    // The agent says so after it has cut the files back.
    while !a.log_text().contains("a container grew its slice's file") {
        assert!(start.elapsed() < Duration::from_secs(10), "not said: {}", a.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A container that truncates its region cannot split its quota: processes it starts after get no
/// region of their own (libvgpu.so refuses their allocations until the agent has made the region
/// whole again, in place), and after the repair they share the slice's quota (issue 61, item 13:
/// after a truncation, three processes of a 1 GiB slice allocated 700 MiB each).
#[test]
fn a_container_that_truncates_its_region_cannot_split_its_quota() {
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "split", "--gpu", "0", "--memory", "1GiB"]);
    let env = format!(
        "LD_PRELOAD=/usr/local/vgpu/libvgpu.so LD_LIBRARY_PATH={} VGPU_SIM_STATE={} VGPU_SIM_CONFIG={} VGPU_CONTEXT_OVERHEAD=64m",
        s.libs.display(),
        s.state.display(),
        s.config.as_ref().unwrap().display()
    );
    // Three processes holding 700 MiB each, started at once after the truncation.
    let three = format!(
        "p=; for i in 1 2 3; do env {env} {RT} alloc --size 700m --hold & p=\"$p $!\"; done; sleep 3; kill $p; wait"
    );
    let o = in_container(&a, "split", 0, &format!(": > /usr/local/vgpu/region; {three}"));
    let held = text(&o).matches("\"allocated\":734003200").count();
    assert!(held <= 1, "{held} processes of a 1 GiB slice held 700 MiB each:\n{}", text(&o));
    // The agent makes the region whole in place; the container's processes share its quota again.
    let region = a.state.join("slices/split/region");
    let start = Instant::now();
    while std::fs::metadata(&region).unwrap().len() != vgpu_region::TOTAL_SIZE as u64
        || !a.log_text().contains("repaired in place")
    {
        assert!(start.elapsed() < Duration::from_secs(10), "not repaired: {}", a.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    // Started a moment apart (at once, their contexts alone may take the room): the first holds
    // 700 MiB, and the others, sharing its quota, are refused.
    let staggered = three.replace("--hold & p=", "--hold & sleep 0.5; p=");
    let o = in_container(&a, "split", 0, &staggered);
    assert_eq!(text(&o).matches("\"allocated\":734003200").count(), 1, "one of three fits 1 GiB:\n{}", text(&o));
}

/// A container with CAP_SYS_ADMIN (root in its own mount namespace, as a privileged container)
/// remounts its read-only files read-write: it raises its limit in its limits file and drops a file
/// into its GPU's gate (a high-priority slice that does not exist). The agent puts both back
/// within a pass or two, says so in its log and keeps a warning in the status (issue 61, item 17:
/// 1 GiB became 12 GiB until the agent's next restart).
#[test]
fn rewritten_limits_and_gates_are_put_back_at_once() {
    if !can_mount() {
        return;
    }
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "admin", "--gpu", "0", "--memory", "1GiB"]);
    let limits = a.state.join("slices/admin/limits");
    // Where device 0's memory limit lies in the file (1 GiB, little-endian, in the first device).
    let bytes = std::fs::read(&limits).unwrap();
    let at = (128..128 + 192).step_by(8).find(|&o| bytes[o..o + 8] == (1u64 << 30).to_le_bytes()).unwrap();
    let d: Value = serde_json::from_str(&a.ctl_ok(&["inspect", "admin", "--json"])).unwrap();
    let gate = d["slice"]["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|m| m["container_path"].as_str().filter(|p| p.contains("/gates/")))
        .unwrap()
        .to_string();
    let o = in_container(
        &a,
        "admin",
        0,
        &format!(
            "mount -o remount,bind,rw /usr/local/vgpu/limits && mount -o remount,bind,rw '{gate}' && \
             printf '\\000\\000\\000\\000\\003\\000\\000\\000' | dd of=/usr/local/vgpu/limits bs=1 seek={at} conv=notrunc 2>/dev/null && \
             cp /usr/local/vgpu/activity '{gate}/ffffffffffffffff.0' && echo REWROTE"
        ),
    );
    assert!(text(&o).contains("REWROTE"), "{}", text(&o));
    let limit_now = || vgpu_region::Region::open(&limits, false).unwrap().mem_limit(0);
    let fake = a.state.join("gates").join(d["slice"]["gpus"][0]["gpu"].as_str().unwrap()).join("ffffffffffffffff.0");
    let start = Instant::now();
    while limit_now() != 1 << 30 || fake.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not put back: {} bytes, gate file {}",
            limit_now(),
            fake.exists()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = a.wait("a warning says what was put back", |st| {
        st["warnings"]
            .as_array()
            .is_some_and(|w| w.iter().any(|x| x.as_str().is_some_and(|x| x.contains("limits put back"))))
    });
    let w = st["warnings"].to_string();
    assert!(w.contains("slice admin: limits put back (limits: GPU 0 memory 12884901888, not 1073741824)"), "{w}");
    assert!(w.contains("ffffffffffffffff.0 removed"), "{w}");
    assert!(a.log_text().contains("put back"), "{}", a.log_text());
}

/// A container writes a neighbour's host PID into its own slot (issue 61, item 15). With
/// `escape_action = "kill"` and the container's slice over its limit as NVML measures it, the kill
/// takes the container's own process, never the neighbour's; the neighbour's PID is never listed
/// under the container's slice, and a PID only a slot claims shows as unverified.
#[test]
fn a_foreign_pid_in_a_slot_draws_no_action_onto_its_process() {
    let mut s = Sim::new(Some(NODE));
    let cfg = s.state.join("agent.toml");
    std::fs::write(&cfg, "escape_action = \"kill\"\n").unwrap();
    let a = Agent::start(&s, &[("VGPU_AGENT_CONFIG", cfg.to_str().unwrap())]);
    let (victim, evil, _region, _) = victim_s_pid_in_evil_s_slot(&mut s, &a);
    // Alive: neither gone nor a zombie (the test's children stay zombies until reaped).
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|st| st.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
    };
    // The evil slice goes over its limit as NVML measures it: its limit drops below what it holds.
    a.ctl_ok(&["slice", "update", "evil", "--gpu", "0", "--memory", "32MiB", "--force"]);
    let v = a.wait("the escape acted on", |v| v["agent"]["escapes_total"].as_u64().unwrap_or(0) >= 1 && !alive(evil));
    assert!(alive(victim), "the victim's process was killed: {v}");
    let t = Instant::now();
    while !a.log_text().contains("\"action\":\"killed\"") {
        assert!(t.elapsed() < Duration::from_secs(5), "{}", a.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = a.log_text();
    let killed: Vec<&str> = log.lines().filter(|l| l.contains("\"action\":\"killed\"")).collect();
    assert!(killed.iter().all(|l| l.contains(&format!("\"pid\":{evil}"))), "{killed:?}");
    let st = a.status().unwrap();
    for p in slice_of(&st, "evil")["processes"].as_array().into_iter().flatten() {
        assert_ne!(p["host_pid"], victim, "the victim listed under the evil slice: {st}");
    }
    assert!(slice_of(&st, "victim")["processes"].as_array().unwrap().iter().any(|p| p["host_pid"] == victim), "{st}");
}

/// With the open-file limit at 1024, slices past about 500 failed with "Too many open files",
/// `vgpuctl status` hung, and a restart was wedged again at once (issue 61, item 25). The agent
/// fits `max_slices` to its limit (two descriptors a slice, 256 kept for the rest) and says so: a
/// limit of 300 holds 22 slices, the 23rd is refused with the reason, and the agent serves on and
/// starts again with them.
#[test]
fn max_slices_fits_the_open_file_limit() {
    let s = Sim::new(Some(NODE));
    let mut a = Agent::start_with_nofile(&s, &[], Some(300));
    assert!(a.log_text().contains("the open-file limit holds fewer slices than max_slices"), "{}", a.log_text());
    for i in 0..22 {
        a.ctl_ok(&["slice", "create", "--name", &format!("s{i}"), "--gpu", "0", "--memory", "64m"]);
    }
    let o = a.ctl(&["slice", "create", "--name", "s22", "--gpu", "0", "--memory", "64m"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("this node has 22 slices, the most max_slices = 22 allows"), "{err}");
    let st = a.wait("every slice watched", |v| v["slices"].as_array().is_some_and(|l| l.len() == 22));
    assert_eq!(st["slices"].as_array().unwrap().len(), 22);
    restart(&mut a, &s);
    assert_eq!(a.status().unwrap()["slices"].as_array().unwrap().len(), 22, "a restart is not wedged");
    assert!(!a.log_text().contains("Too many open files"), "{}", a.log_text());
}

/// One garbage record on a running agent made `ListSlices` fail for every slice until a restart
/// (issue 61, item 25): the list comes from what the agent holds, and each slice stands alone.
#[test]
fn one_damaged_record_does_not_hide_the_other_slices() {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    for n in ["a", "b"] {
        a.ctl_ok(&["slice", "create", "--name", n, "--gpu", "0", "--memory", "64m"]);
    }
    std::fs::write(a.state.join("records/a.json"), b"\x00garbage{").unwrap();
    let out = a.ctl_ok(&["slice", "list", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let names: Vec<&str> = v.as_array().unwrap().iter().filter_map(|x| x["name"].as_str()).collect();
    assert_eq!(names, ["a", "b"], "{v}");
    assert!(a.ctl_ok(&["inspect", "b", "--json"]).contains("\"b\""));
}

/// Scribbles on a slot, one process after another: `vgpu_reclaimed_bytes_total` grew by up to the
/// slice's limit on each (20 GiB for a 1 GiB slice), and the slice's used memory read 1.07e17
/// (issue 61, item 25). What counts as reclaimed is what NVML saw each process hold, and the used
/// memory shown is never more than the GPU has.
#[test]
fn repeated_scribbles_add_only_what_nvml_saw_to_the_reclaimed_bytes() {
    let mut s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    a.ctl_ok(&["slice", "create", "--name", "evil", "--gpu", "0", "--memory", "1GiB"]);
    let d: Value = serde_json::from_str::<Value>(&a.ctl_ok(&["inspect", "evil", "--json"])).unwrap()["slice"].clone();
    let region = vgpu_region::Region::open(&a.state.join("slices/evil/region"), true).unwrap();
    let mut reclaimed = 0;
    for _ in 0..5 {
        let (p, _) = s.spawn_cmd(in_slice(&s, &d, RT), &["alloc", "--size", "64m", "--hold"]);
        a.wait("attributed", |v| {
            slice_of(v, "evil")["processes"].as_array().is_some_and(|ps| ps.iter().any(|x| x["host_pid"] == p))
        });
        let slot = region.layout().slots.iter().find(|x| x.pid.load(std::sync::atomic::Ordering::SeqCst) == p).unwrap();
        slot.used[0].store(u64::MAX / 2, std::sync::atomic::Ordering::SeqCst);
        let seq = a.status().unwrap()["sequence"].as_u64().unwrap();
        let st = a.wait("a pass after the scribble", |v| v["sequence"].as_u64().unwrap_or(0) > seq + 1);
        let used = slice_of(&st, "evil")["gpus"][0]["memory_used"].as_u64().unwrap();
        assert!(used <= 16 << 30, "the slice's used memory reads {used}");
        s.kill(p);
        let st = a.wait("reclaimed", |v| v["agent"]["reclaimed_bytes"].as_u64().unwrap_or(0) > reclaimed);
        reclaimed = st["agent"]["reclaimed_bytes"].as_u64().unwrap();
    }
    // Five processes of 64 MiB and a 256 MiB context each, as NVML measured them.
    assert!(reclaimed <= 5 * 320 * MIB, "reclaimed {reclaimed} bytes for five processes of 320 MiB");
}

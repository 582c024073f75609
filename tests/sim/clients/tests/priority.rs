//! Priority tenants on a simulated GPU that time-slices between processes (`timeslice_us`), as a
//! real one does: a high-priority slice's requests keep their latency beside a best-effort
//! backlog, which still gets the GPU time they leave; a priority changed while both run takes
//! effect; a killed high-priority process releases the gate within an agent pass. The benchmark
//! with figures is `priority-bench` (docs/benchmarks.md).

mod common;
use common::agent::*;
use common::*;
use serde_json::Value;
use std::process::Stdio;
use std::time::Duration;

/// The tests here measure time on a shared machine: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const NODE: &str = "timeslice_us = 2000\ncontext_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\n";

fn slice(a: &Agent, name: &str, priority: &str) -> Value {
    let out = a.ctl_ok(&["slice", "create", "--name", name, "--gpu", "0", "--priority", priority, "--json"]);
    serde_json::from_str(&out).unwrap()
}

/// A simulated GPU, its agent, and two slices on it: the service `svc` (of `priority`) and the
/// best-effort `batch`.
fn tenants(priority: &str) -> (Sim, Agent, Value, Value) {
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let (svc, batch) = (slice(&a, "svc", priority), slice(&a, "batch", "normal"));
    (s, a, svc, batch)
}

/// 2 s of requests at 100 a second, each a 500 us kernel: their latency percentiles.
fn serve(s: &Sim, svc: &Value) -> Value {
    let o = in_slice(s, svc, RT)
        .args(["serve", "--rate", "100", "--seconds", "2", "--kernel", "sleep_500us"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    lines(&o.stdout).remove(0)
}

/// A best-effort training-like loop: 100 us kernels, 50 queued between synchronisations.
fn backlog(s: &Sim, batch: &Value, seconds: &str) -> std::process::Child {
    in_slice(s, batch, RT)
        .args(["launch", "--kernel", "sleep_100us", "--seconds", seconds, "--sync-every", "50"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn kernels(c: std::process::Child) -> f64 {
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{o:?}");
    lines(&o.stdout).last().unwrap()["kernels"].as_f64().unwrap()
}

#[test]
fn a_high_priority_slice_keeps_its_latency_and_the_backlog_the_rest() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (s, a, svc, batch) = tenants("normal");
    let alone = serve(&s, &svc);
    // Without priority: each request waits behind the backlog's queued work.
    let be = backlog(&s, &batch, "3");
    std::thread::sleep(Duration::from_millis(500));
    let shared = serve(&s, &svc);
    let be_shared = kernels(be);
    // With priority (changed while nothing runs; the gate follows within its 20 ms look).
    a.ctl_ok(&["slice", "update", "svc", "--priority", "high"]);
    let be = backlog(&s, &batch, "3");
    std::thread::sleep(Duration::from_millis(500));
    let gated = serve(&s, &svc);
    let be_gated = kernels(be);
    let q = |v: &Value, k: &str| v[k].as_f64().unwrap();
    let summary = format!(
        "p50/p90/p99 us: alone {:.0}/{:.0}/{:.0}, beside the backlog {:.0}/{:.0}/{:.0}, with priority {:.0}/{:.0}/{:.0}; \
         backlog kernels {be_shared} then {be_gated}",
        q(&alone, "p50_us"), q(&alone, "p90_us"), q(&alone, "p99_us"), q(&shared, "p50_us"), q(&shared, "p90_us"),
        q(&shared, "p99_us"), q(&gated, "p50_us"), q(&gated, "p90_us"), q(&gated, "p99_us")
    );
    eprintln!("{summary}");
    assert!(q(&shared, "p50_us") > 1.5 * q(&alone, "p50_us"), "the problem shows without priority: {summary}");
    assert!(q(&gated, "p50_us") < 1.3 * q(&alone, "p50_us"), "{summary}");
    // The tail judged at p90, the 20th longest of 200: p99 is the 2nd, which one pause of a loaded
    // test machine decides (gated 5.1 ms against 3.9 ms beside the backlog once, with the p50 and
    // the backlog's share as they should be); priority-bench records the p99.
    assert!(q(&gated, "p90_us") < 0.7 * q(&shared, "p90_us"), "{summary}");
    // The service uses 5 % of the GPU: the backlog keeps most of the rest.
    assert!(be_gated > 0.8 * be_shared, "{summary}");
}

/// A priority change while both tenants run takes effect on the processes already running: the
/// backlog's one process is held once the service turns high, and let go when it turns normal.
#[test]
fn a_priority_change_while_both_run_takes_effect() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut s, a, svc, batch) = tenants("normal");
    // A service process that lives through every change, and the backlog's one process.
    let (held, _) = s.spawn_cmd(in_slice(&s, &svc, RT), &["alloc", "--size", "100m", "--hold"]);
    let be = backlog(&s, &batch, "10");
    std::thread::sleep(Duration::from_millis(500));
    let before = serve(&s, &svc);
    a.ctl_ok(&["slice", "update", "svc", "--priority", "high"]);
    // The backlog's helper thread looks at the gates every 20 ms.
    std::thread::sleep(Duration::from_millis(200));
    let raised = serve(&s, &svc);
    a.ctl_ok(&["slice", "update", "svc", "--priority", "normal"]);
    std::thread::sleep(Duration::from_millis(200));
    let lowered = serve(&s, &svc);
    let st = a.status().unwrap();
    let runs = |name: &str, pid: u32| {
        slice_of(&st, name)["processes"].as_array().is_some_and(|p| p.iter().any(|x| x["host_pid"] == pid))
    };
    assert!(runs("svc", held) && runs("batch", be.id()), "both ran throughout: {st}");
    kernels(be);
    s.kill(held);
    let q = |v: &Value, k: &str| v[k].as_f64().unwrap();
    let f = |v: &Value| format!("{:.0}/{:.0}/{:.0}", q(v, "p50_us"), q(v, "mean_us"), q(v, "p99_us"));
    let summary = format!(
        "p50/mean/p99 us: normal {}, raised to high {}, lowered to normal {}",
        f(&before),
        f(&raised),
        f(&lowered)
    );
    eprintln!("{summary}");
    // The median and the mean: this test asks whether the change took hold, not what the tail is (a
    // machine's pause in two of 200 requests moves a P99; the first test and the benchmark measure it).
    assert!(q(&raised, "mean_us") < 0.7 * q(&before, "mean_us"), "raising took effect: {summary}");
    assert!(q(&raised, "p50_us") < 0.7 * q(&before, "p50_us"), "raising took effect: {summary}");
    assert!(q(&lowered, "p50_us") > 1.5 * q(&raised, "p50_us"), "lowering took effect: {summary}");
}

#[test]
fn a_killed_high_priority_process_releases_the_gate_within_a_pass() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (s, a, svc, batch) = tenants("high");
    // The high-priority slice keeps the GPU busy: 10 ms kernels, 100 queued at a time.
    let mut hp = in_slice(&s, &svc, RT)
        .args(["launch", "--kernel", "sleep_10ms", "--seconds", "60", "--sync-every", "100"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let be = backlog(&s, &batch, "3");
    std::thread::sleep(Duration::from_millis(1000));
    let st = a.status().unwrap();
    assert_eq!(slice_of(&st, "batch")["processes"].as_array().map(Vec::len), Some(1), "{st}");
    let killed = std::time::Instant::now();
    hp.kill().unwrap(); // SIGKILL
    let _ = hp.wait();
    let n = kernels(be);
    // Held back while the service had work queued (the first second), running after it died: about
    // 2 s of 100 us kernels (some 19,000), less what one pass (100 ms) costs. Had only the dead
    // service's own estimate released it (a second of queued work), some 9,500; never held, 28,000.
    eprintln!("the backlog ran {n} kernels, {:.1} s after the kill", killed.elapsed().as_secs_f64());
    assert!(n > 12_000.0, "the gate was released within a pass: {n} kernels");
    assert!(n < 24_000.0, "and held while the service lived: {n} kernels");
}

/// Best-effort work that bypasses the gate (a process launching without libvgpu.so) cannot be held
/// back, but it is not hidden: the agent reports it as an escape on the high-priority slice's GPU.
#[test]
fn work_that_bypasses_the_gate_is_reported() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let _svc = slice(&a, "svc", "high");
    let mut rogue = s
        .cmd(RT)
        .args(["launch", "--kernel", "sleep_100us", "--seconds", "3", "--sync-every", "50"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = rogue.id() as u64;
    let st = a.wait("the escape", |v| {
        v["escapes"].as_array().is_some_and(|e| e.iter().any(|x| x["pid"].as_u64() == Some(pid)))
    });
    let e = st["escapes"].as_array().unwrap().iter().find(|x| x["pid"].as_u64() == Some(pid)).unwrap().clone();
    assert_eq!(e["kind"], "UNACCOUNTED", "{e}");
    let _ = rogue.kill();
    let _ = rogue.wait();
}

/// A high-priority slice whose activity file claims far more queued work than it could have (its
/// file is its own to write) holds normal slices back for at most a pass: the agent clears it.
#[test]
fn a_high_priority_slice_cannot_claim_endless_work() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut s, a, svc, batch) = tenants("high");
    // A live process in the high-priority slice, and its file made to claim 1000 s of work.
    let (p, _) = s.spawn_cmd(in_slice(&s, &svc, RT), &["alloc", "--size", "64m", "--hold"]);
    a.wait("its process", |v| slice_of(v, "svc")["processes"][0]["host_pid"] == p);
    let file = a.state.join("slices/svc/activity");
    let act = vgpu_region::activity::Mapped::open(&file, true).unwrap();
    act.note(0, vgpu_sim::now_ns(), 1_000_000_000_000);
    let be = backlog(&s, &batch, "2");
    let n = kernels(be);
    assert!(n > 10_000.0, "held back for at most a pass: {n} kernels in 2 s");
    assert!(act.until(0) < 1_000_000_000_000, "cleared");
    assert!(a.log_text().contains("claims more than 10 s of queued GPU work"), "{}", a.log_text());
    s.kill(p);
}

/// A high-priority tenant that truncates its activity file (its own to write) does not crash the
/// normal slices that read it: their mapping reads zeros, and their work goes on.
#[test]
fn a_truncated_activity_file_crashes_no_neighbour() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let s = Sim::new(Some(NODE));
    let a = Agent::start(&s, &[]);
    let (_svc, batch) = (slice(&a, "svc", "high"), slice(&a, "batch", "normal"));
    let be = backlog(&s, &batch, "1.5");
    std::thread::sleep(Duration::from_millis(500));
    let file = a.state.join("slices/svc/activity");
    std::fs::OpenOptions::new().write(true).open(&file).unwrap().set_len(0).unwrap();
    assert!(kernels(be) > 1_000.0, "the loop ran on");
}

/// A high-priority tenant that runs nothing but rewrites its activity file every millisecond to
/// claim 9 s of queued work (under the agent's 10 s horizon) took a best-effort loop from 98 % of
/// the GPU to 0 (issue 61, item 14). The GPU time NVML measures for it does not bear the claim
/// out: within a second its priority is suspended (out of the gates, said in the status), and the
/// loop runs.
#[test]
fn claims_of_queued_work_the_gpu_does_not_bear_out_are_not_honoured() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut s, a, svc, batch) = tenants("high");
    let (p, _) = s.spawn_cmd(in_slice(&s, &svc, RT), &["alloc", "--size", "64m", "--hold"]);
    a.wait("its process", |v| slice_of(v, "svc")["processes"][0]["host_pid"] == p);
    let file = a.state.join("slices/svc/activity");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let attack = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let act = vgpu_region::activity::Mapped::open(&file, true).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                act.clear(0);
                act.note(0, vgpu_sim::now_ns(), 9_000_000_000);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let n = kernels(backlog(&s, &batch, "3"));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    attack.join().unwrap();
    let st = a.status().unwrap();
    let w = st["warnings"].to_string();
    eprintln!("the backlog ran {n} kernels in 3 s beside the claims; {w}");
    assert!(w.contains("slice svc: claimed") && w.contains("high priority suspended"), "{w}");
    // Alone, some 14,000 a second; held for the first half second or so at most.
    assert!(n > 20_000.0, "the claims held the backlog back: {n} kernels in 3 s");
    s.kill(p);
}

/// A genuinely busy high-priority slice (10 ms kernels back to back) keeps its priority, and a
/// normal slice beside it still gets its guaranteed share of the GPU (`priority_min_share`, 10 %
/// of every 100 ms by default), where before it got nothing while the slice was busy.
#[test]
fn a_normal_slice_keeps_its_share_beside_a_busy_high_priority_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (s, a, svc, batch) = tenants("high");
    let mut hp = in_slice(&s, &svc, RT)
        .args(["launch", "--kernel", "sleep_10ms", "--seconds", "4", "--sync-every", "100"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let n = kernels(backlog(&s, &batch, "2"));
    let st = a.status().unwrap();
    let _ = hp.kill();
    let _ = hp.wait();
    eprintln!("the backlog ran {n} kernels of 100 us in 2 s beside a busy high-priority slice");
    // 10 % of 2 s of GPU time is 2,000 of them; time-slicing and the window's edges take some.
    assert!(n > 1_000.0, "no guaranteed share: {n} kernels");
    assert!(n < 8_000.0, "the high-priority slice held nothing back: {n} kernels");
    assert!(!st["warnings"].to_string().contains("suspended"), "a busy slice's claims are borne out: {st}");
}

/// A process that skips libvgpu.so but maps its slice's region passes for one of the slice's, and
/// beside a high-priority service it ran ungated with nothing reported (issue 61, item 16: the
/// service's P99 went from 692 us to 2658 us, `escapes=[]`). The GPU time NVML measures for the
/// slice is held to what its launches through the interposer noted: beyond it for two seconds is a
/// `BYPASS` escape, named on the slice, with its busiest process. The same backlog through the
/// interposer raises none.
#[test]
fn gpu_time_that_skips_the_interposer_is_an_escape() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (s, a, svc, batch) = tenants("high");
    let bypass =
        |st: &Value| -> Option<Value> { st["escapes"].as_array()?.iter().find(|e| e["kind"] == "BYPASS").cloned() };
    // Through the interposer, beside the service: no escape.
    let be = backlog(&s, &batch, "4");
    let served = serve(&s, &svc);
    kernels(be);
    let st = a.status().unwrap();
    assert!(bypass(&st).is_none(), "the interposed backlog is no escape: {st}");
    assert_eq!(a.status().unwrap()["agent"]["escapes_total"], 0, "{served}");
    // The same loop without libvgpu.so, mapping the slice's region.
    let region = a.state.join("slices/batch/region");
    let mut rogue = s
        .cmd(RT)
        .arg("--map-file")
        .arg(&region)
        .args(["launch", "--kernel", "sleep_100us", "--seconds", "20", "--sync-every", "50"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = rogue.id() as u64;
    let st = a.wait("the bypass escape", |v| bypass(v).is_some());
    let e = bypass(&st).unwrap();
    let _ = rogue.kill();
    let _ = rogue.wait();
    assert_eq!((e["slice"].as_str(), e["pid"].as_u64()), (Some("batch"), Some(pid)), "{e}");
    assert!(e["measured"].as_u64().unwrap() > 50, "{e}");
    assert_eq!(e["command"], "cuda-rt-app", "{e}");
    let (_, metrics) = a.scrape("/metrics");
    assert!(metrics.contains("vgpu_escapes_total{kind=\"bypass\"} 1"), "{metrics}");
}

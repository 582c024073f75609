//! SM-time quotas through libvgpu.so on the simulated GPU, measured from the simulator's kernel
//! timeline. Short runs with tolerances that hold on a loaded 2-core machine; the full accuracy table
//! is `sm-accuracy` (docs/benchmarks.md).

mod common;
use common::*;
use std::path::Path;
use vgpu_sim_clients::accuracy::{container, Harness, Scenario};

fn harness() -> Harness {
    Harness::new(Path::new(RT).parent().unwrap(), &libvgpu(), &lib_dir())
}

fn one(c: vgpu_sim_clients::accuracy::Container, seconds: f64) -> Scenario {
    Scenario { name: String::new(), containers: vec![c], seconds, change: None }
}

#[test]
fn a_limited_container_gets_its_share_on_every_launch_path() {
    let h = harness();
    for (i, (limit, kernel, extra)) in [
        (30, "sleep_1ms", vec![]),
        (20, "sleep_20ms", vec![]),
        (50, "sleep_200us", vec!["--path", "graph", "--nodes", "10"]),
        (40, "sleep_1ms", vec!["--path", "coop"]),
        (40, "sleep_500us", vec!["--path", "ex", "--sync-every", "8"]),
        (30, "sleep_1ms", vec!["--path", "legacy"]),
        (40, "sleep_2ms", vec!["--path", "legacy-default"]),
    ]
    .into_iter()
    .enumerate()
    {
        let o = h.run(&one(container(limit, kernel, &extra), 3.5), i);
        let got = o.overall[0][0] * 100.0;
        assert!((got - limit as f64).abs() <= 5.0, "{kernel} {extra:?} at {limit} %: achieved {got:.1} %");
    }
}

/// Small kernels whose launch calls take longer than they run leave the GPU mostly idle: an SM
/// limit above what they use must not slow them down. The simulated driver spends 40 us of host
/// time in each launch call before queuing a 5 us kernel; a measurement bracket recorded on the
/// idle stream before the call used to time the call too (45 us for a 5 us kernel), so the
/// container was charged more GPU time than passed and a 30 % limit held it to a third of its pace.
#[test]
fn small_launches_on_an_idle_gpu_are_charged_their_own_time() {
    let h = Harness::with_node(Path::new(RT).parent().unwrap(), &libvgpu(), &lib_dir(), "launch_host_us = 40");
    let run = |limit, i| {
        let o = h.run(&one(container(limit, "sleep_5us", &["--sync-every", "64"]), 3.0), i);
        o.overall[0][0] * 100.0
    };
    let free = run(0, 0);
    let limited = run(30, 1);
    assert!(free > 3.0 && free < 30.0, "unlimited: {free:.1} % of the GPU (the launch calls' pace)");
    assert!(limited >= 0.8 * free, "under a 30 % limit {limited:.1} %, unlimited {free:.1} %");
}

#[test]
fn two_containers_split_the_gpu_by_their_limits() {
    let h = harness();
    let sc = Scenario {
        name: String::new(),
        containers: vec![container(20, "sleep_1ms", &[]), container(60, "sleep_1ms", &[])],
        seconds: 4.0,
        change: None,
    };
    let o = h.run(&sc, 0);
    let (a, b) = (o.overall[0][0], o.overall[1][0]);
    let ratio = a / b;
    assert!((ratio / (20.0 / 60.0) - 1.0).abs() <= 0.2, "20/60 achieved {:.1}/{:.1}", a * 100.0, b * 100.0);
    assert!(b * 100.0 <= 65.0 && a * 100.0 <= 25.0);
}

#[test]
fn a_lowered_limit_takes_effect_and_policy_disable_lifts_it() {
    let h = harness();
    let mut sc = one(container(60, "sleep_1ms", &["--sync-every", "8"]), 5.0);
    sc.change = Some((2.0, 20));
    let o = h.run(&sc, 0);
    let last = o.windows[0][0].last().copied().unwrap() * 100.0;
    let first = o.windows[0][0][0] * 100.0;
    assert!((45.0..=66.0).contains(&first), "before the change: {first:.1}");
    assert!((last - 20.0).abs() <= 5.0, "settled at the new limit: {last:.1}");

    // Policy disable: the 30 % limit is not applied. (How far above it the client gets is its own
    // ceiling on a loaded machine, so only "well above the limit" is asserted.)
    let mut c = container(30, "sleep_1ms", &["--sync-every", "16"]);
    c.policy = Some("disable");
    let o = h.run(&one(c, 2.5), 1);
    assert!(o.overall[0][0] > 0.6, "policy disable: unlimited ({:.2})", o.overall[0][0]);
}

/// Launches captured into a graph run nothing and must not be charged (nor bracketed by timing
/// events, which the driver refuses to query once recorded into a capture): capturing 400 launches
/// of a 1 ms kernel under a 10 % limit waits for nothing, and the graph's replays are charged and
/// limited like any launch.
#[test]
fn captured_launches_are_not_charged_and_replays_are() {
    let s = Sim::new(None);
    let env = [("CUDA_DEVICE_SM_LIMIT", "10")];
    let o = s
        .limited(DIRECT, &env)
        .args(["launch", "--path", "capture", "--nodes", "400", "--kernel", "sleep_1ms", "--count", "1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let launched = lines(&o.stdout).into_iter().find(|v| v["event"] == "launched").unwrap();
    assert_eq!(launched["kernels"], 400);
    let r = vgpu_region::Region::open(&s.region_path(), false).unwrap();
    let d = &r.layout().devices[0];
    let waited = d.sm_throttled_ns.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(waited, 0, "the capture was throttled for {} ms", waited / 1_000_000);

    // Replays: 100 launches of a 1 ms graph (100 x 10 us) at 10 % wait for the budget (the first
    // ones are admitted on the bounded burst).
    let o = s
        .limited(DIRECT, &env)
        .args(["launch", "--path", "capture", "--nodes", "100", "--kernel", "sleep_10us", "--count", "100"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let waited = d.sm_throttled_ns.load(std::sync::atomic::Ordering::Relaxed);
    assert!(waited > 0, "graph replays were not limited");
}

/// A capture that is never ended, its stream or context destroyed instead (an error path), ends
/// with it: launches afterwards are measured as before, not charged a first guess for good (1 ms
/// kernels charged 100 us each ran at several times the limit).
#[test]
fn a_capture_whose_stream_is_destroyed_leaves_launches_measured() {
    let h = harness();
    for (i, how) in ["--abandon-capture", "--abandon-capture-context"].into_iter().enumerate() {
        let o = h.run(&one(container(30, "sleep_1ms", &[how]), 3.0), i);
        let got = o.overall[0][0] * 100.0;
        assert!((got - 30.0).abs() <= 5.0, "at 30 % after {how}: achieved {got:.1} %");
    }
}

/// A kernel's GPU time often follows its grid (a GEMM's or an attention kernel's grid grows with the
/// batch and the sequence): one function launched with small and large grids in turn must be
/// charged each launch's own time, not the smallest it was seen to take.
#[test]
fn a_kernel_launched_with_different_grids_is_charged_each_grids_time() {
    let h = harness();
    // wave_1ms on the simulated H100's 132 SMs: a grid of 132 blocks runs 1 ms, 1320 blocks 10 ms.
    for (i, (limit, grids)) in [(30, "132,1320"), (20, "132,264,1320,660")].into_iter().enumerate() {
        let o = h.run(&one(container(limit, "wave_1ms", &["--grids", grids, "--block", "256"]), 3.5), i);
        let got = o.overall[0][0] * 100.0;
        assert!((got - limit as f64).abs() <= 5.0, "grids {grids} at {limit} %: achieved {got:.1} %");
    }
}

/// A kernel (or graph) whose time grows launch after launch, as a decode step's attention does with
/// the context: long launches are measured often enough that the estimate (the smallest recent
/// measurement) stays close to the current time.
#[test]
fn a_kernel_that_keeps_getting_longer_is_followed() {
    let h = harness();
    // param_ns from 1 ms, 0.3 % longer at each launch (3.3 ms after 400 launches).
    let c = container(30, "param_ns", &["--duration-ns", "1000000", "--ramp-ppm", "3000"]);
    let o = h.run(&one(c, 3.5), 0);
    let got = o.overall[0][0] * 100.0;
    assert!((got - 30.0).abs() <= 5.0, "a growing kernel at 30 %: achieved {got:.1} %");
}

/// A graph's estimate is kept under its executable handle. When the graph's work changes (updated,
/// node parameters set, nodes enabled, or destroyed and its handle given to the next graph
/// instantiated, as the simulated driver does like a real allocator), the old estimate must not be
/// charged for the new work: here a 100 us graph becomes a 1 ms one after 3000 launches.
#[test]
fn a_graph_whose_work_changes_is_charged_its_new_time() {
    let h = harness();
    let hows =
        ["update", "update-v1", "reinstantiate", "set-params", "set-params-v1", "node-params", "child", "enable"];
    for (i, how) in hows.into_iter().enumerate() {
        let args = [
            "--path",
            "graph",
            "--nodes",
            "10",
            "--duration-ns",
            "10000",
            "--regraph-after",
            "3000",
            "--regraph-how",
            how,
        ];
        let o = h.run(&one(container(30, "param_ns", &args), 3.0), i);
        let got = o.overall[0][0] * 100.0;
        eprintln!("graph changed by {how}: {got:.1} %");
        assert!((got - 30.0).abs() <= 5.0, "graph changed by {how} at 30 %: achieved {got:.1} %");
    }
}

/// Kernel estimates are keyed by function handle (and grid); a module's functions die with it (and
/// with its context), and the driver may give a handle to a function of a module loaded later (the
/// simulated driver does, as a real allocator would). That function must not be charged as the old
/// one: here a 100 us kernel is followed by a 1 ms one under the same handle after 3000 launches.
#[test]
fn a_kernel_of_a_module_loaded_after_an_unload_is_charged_its_own_time() {
    let h = harness();
    // The module unloaded (or a CUDA 12 library: `cuLibraryUnload`), or the primary context reset,
    // taking its modules with it.
    for (i, (loader, how)) in [("module", "unload"), ("library", "unload"), ("module", "reset")].into_iter().enumerate()
    {
        let args = ["--loader", loader, "--reload-after", "3000", "--reload-kernel", "sleep_1ms", "--reload-how", how];
        let o = h.run(&one(container(30, "sleep_100us", &args), 3.0), i);
        let got = o.overall[0][0] * 100.0;
        eprintln!("{loader} reloaded after {how}: {got:.1} %");
        assert!((got - 30.0).abs() <= 5.0, "a kernel reloaded ({loader}, {how}) at 30 %: achieved {got:.1} %");
    }
}

/// One process driving two GPUs (a model split across them), a thread on each: each GPU's launches
/// must be measured on that GPU's own events. An event can be recorded only on a stream of the
/// context it was made in; measurements that reused the other GPU's events failed, and kernels
/// never measured were charged the first guess (100 us) for every 1 ms they ran.
#[test]
fn a_process_on_two_gpus_gets_its_share_of_each() {
    let h = harness();
    for (i, kernel) in ["sleep_1ms", "sleep_2ms"].into_iter().enumerate() {
        let mut c = container(30, kernel, &["--devices", "0,1"]);
        c.limits = vec![30, 30];
        let o = h.run(&one(c, 3.5), i);
        let got = [o.overall[0][0] * 100.0, o.overall[0][1] * 100.0];
        eprintln!("{kernel} on two GPUs at 30 %: achieved {:.1} % and {:.1} %", got[0], got[1]);
        for (gpu, g) in got.into_iter().enumerate() {
            assert!((g - 30.0).abs() <= 5.0, "{kernel}: GPU {gpu} at 30 %: achieved {g:.1} %");
        }
    }
}

/// A context-independent kernel (`CUkernel`) may be launched into a stream of another context than
/// the current one (here device 1's, with device 0 current): its launches are charged to that
/// stream's device, under its limit (60 %, not device 0's 30 %), and measured with events of the
/// stream's context, made with that context pushed for the purpose.
#[test]
fn a_kernel_launched_into_another_context_s_stream_is_measured() {
    let h = harness();
    let mut c = container(30, "sleep_1ms", &["--loader", "library", "--stream-on", "1"]);
    c.limits = vec![30, 60];
    let o = h.run(&one(c, 3.5), 0);
    let (here, there) = (o.overall[0][0] * 100.0, o.overall[0][1] * 100.0);
    eprintln!("launched from device 0 (30 %) into device 1's stream (60 %): {here:.1} % and {there:.1} %");
    assert!(here < 1.0, "nothing ran on device 0: {here:.1} %");
    assert!((there - 60.0).abs() <= 5.0, "device 1 at its 60 %: achieved {there:.1} %");
}

/// A stream handle the driver hands out again, for a stream of another device, after the first was
/// destroyed (as a real driver's allocator may): launches into it are charged to its own device,
/// not to the device the interposer learned for the old stream. Here 200 launches go to device 1's
/// stream (60 %), which is then destroyed and replaced by one of device 0 (30 %) under the same
/// handle, launched into for the rest of the run.
#[test]
fn a_stream_handle_given_out_again_is_charged_to_its_new_device() {
    let h = harness();
    let mut c = container(30, "sleep_1ms", &["--loader", "library", "--stream-on", "1", "--restream-after", "200"]);
    c.limits = vec![30, 60];
    let o = h.run(&one(c, 3.5), 0);
    let (here, there) = (o.overall[0][0] * 100.0, o.overall[0][1] * 100.0);
    eprintln!("after the handle was given to device 0's stream (30 %): {here:.1} % and {there:.1} %");
    assert!((here - 30.0).abs() <= 5.0, "device 0 at its 30 %: achieved {here:.1} %");
    assert!(there < 1.0, "device 1 idle after the first 200 launches: {there:.1} %");
}

/// The interposer's timing events of a context go with the context (the driver destroys them), and
/// once the driver has destroyed it, the same handle may name another thread's new context. Here a
/// context that launched under a limit (and so holds timing events, spare and in flight) is
/// destroyed while another thread makes a context (the simulated driver gives it the old one's
/// handle) and launches under the limit in it before the destroy returns. Events of the old context
/// given to the new one, or asked about by a collection, are dangling handles: the simulated driver
/// aborts the process on their use.
#[test]
fn a_context_made_with_the_handle_of_one_being_destroyed_gets_no_dead_events() {
    let s = Sim::new(Some(
        "context_overhead_mib = 64\ndestroy_return_ms = 400\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n",
    ));
    let env = [("CUDA_DEVICE_SM_LIMIT", "50")];
    let args = ["context-reuse", "--size", "8m", "--again", "8m", "--launches", "64"];
    let o = s.limited(DIRECT, &env).args(args).output().unwrap();
    assert!(o.status.success(), "{:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    let v = lines(&o.stdout).into_iter().find(|v| v["event"] == "context-reuse").unwrap();
    assert_eq!(
        (&v["destroy"], &v["made_during_destroy"], &v["same_handle"], &v["launched_during_destroy"]),
        (&serde_json::json!("CUDA_SUCCESS"), &true.into(), &true.into(), &true.into()),
        "{v}"
    );
}

/// The same for a primary context reset (the driver destroys its events, and the context stays):
/// another thread, launching under the limit on another GPU while the reset is in the driver,
/// collects its own measurements and must not ask about the reset context's.
#[test]
fn a_reset_context_s_events_are_not_asked_about() {
    let s = Sim::new(Some("destroy_return_ms = 400\n[[gpu]]\nmodel = \"A100-40GB\"\n[[gpu]]\nmodel = \"A100-40GB\"\n"));
    let env = [("CUDA_DEVICE_SM_LIMIT", "50")];
    let o = s.limited(DIRECT, &env).args(["reset-race", "--launches", "64"]).output().unwrap();
    assert!(o.status.success(), "{:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    let v = lines(&o.stdout).into_iter().find(|v| v["event"] == "reset-race").unwrap();
    assert_eq!(v["reset"], "CUDA_SUCCESS", "{v}");
    assert!(v["rounds_during_reset"].as_u64().unwrap() >= 1, "{v}");
}

/// Each driver call the limiter uses to time launches, failing on its own (the driver exports it
/// and answers an error): the limit still holds, timed by synchronising the stream (or, where that
/// fails too, on a conservative charge per launch), and the process says why once. (A driver whose `cuStreamGetCtx_v2` answered
/// NOT_SUPPORTED let a process under a 30 % limit take 98 % of the GPU, saying nothing.)
#[test]
fn the_limit_holds_when_a_call_it_relies_on_fails() {
    let h = harness();
    let sim = |args: &[&str]| {
        let o = std::process::Command::new(SIM)
            .env("VGPU_SIM_STATE", h.dir.join("state"))
            .env("VGPU_SIM_CONFIG", h.dir.join("node.toml"))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "vgpu-sim {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    // Launches into a stream the process made (the stream's context is asked for), 1 ms kernels.
    let args = ["--loader", "library", "--path", "kernel", "--stream-on", "0", "--no-timing"];
    for (i, failing) in [
        &["cuStreamGetCtx_v2"][..],
        &["cuStreamGetCtx_v2", "cuStreamGetCtx"],
        &["cuEventCreate"],
        &["cuEventRecord"],
        &["cuEventElapsedTime"],
        &["cuEventQuery"],
        &["cuStreamQuery"],
    ]
    .into_iter()
    .enumerate()
    {
        sim(&["fault", "clear"]);
        for f in failing {
            sim(&["fault", "set", f, "--code", "801", "--count", "0"]);
        }
        let o = h.run(&one(container(30, "sleep_1ms", &args), 3.5), 100 + i);
        let got = o.overall[0][0] * 100.0;
        assert!((5.0..=35.0).contains(&got), "{failing:?} failing: achieved {got:.1} % under a 30 % limit");
        // Launches that events could not time are counted where the agent reads them.
        let r = vgpu_region::Region::open(&h.dir.join(format!("s{}-c0.region", 100 + i)), false).unwrap();
        let events = failing.iter().any(|f| f.starts_with("cuEvent"));
        assert_eq!(r.sm_unmeasured(0) > 0, events, "{failing:?}: {} unmeasured", r.sm_unmeasured(0));
    }
    sim(&["fault", "clear"]);
}

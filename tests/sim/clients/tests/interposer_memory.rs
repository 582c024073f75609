//! libvgpu.so preloaded into real processes on the simulated GPU: memory quotas on every binding path
//! and allocator, across processes, with the simulator (and NVML) as ground truth.
//!
//! Regressions for the memory defects known in HAMi-core: limits frozen at region creation
//! (`limits_change_while_processes_run`), slot compaction letting a live process escape
//! (`slots_never_move_and_forked_children_get_their_own`), a SIGKILLed process's usage kept until
//! another process starts (`processes_share_one_quota_and_dead_ones_give_it_back`), `cuDeviceTotalMem`
//! = 0 without a limit (`the_container_sees_its_slice_in_cuda_and_nvml`), `cuGetProcAddress` answering
//! an old-ABI request with the newer hook and ignoring flags
//! (`get_proc_address_returns_hooks_for_exactly_the_entry_points_the_driver_returned`), a banner on
//! every process (`every_binding_path_is_limited_and_silent`). `cuMemFree` in O(1) at 30 000 live
//! allocations and start-up with hundreds of processes are benchmarks (docs/benchmarks.md).

mod common;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use vgpu_region::Region;

/// GPU 0: 8 GiB; GPU 1: an L4 without a container limit. 64 MiB per context, like the interposer's
/// VGPU_CONTEXT_OVERHEAD in these tests.
const NODE: &str = r#"
context_overhead_mib = 64
[[gpu]]
model = "A100-40GB"
memory_mib = 8192
[[gpu]]
model = "L4"
"#;

const LIMIT: &[(&str, &str)] = &[("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")];

/// The real-GPU suite's probe (one workload for both).
const PROBE: &str = env!("CARGO_BIN_EXE_gpu-probe");

fn out(c: &mut Command, args: &[&str]) -> Output {
    c.args(args).output().unwrap()
}

fn json1(o: &Output) -> Value {
    assert!(
        o.status.success(),
        "exit {}: {}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    lines(&o.stdout).remove(0)
}

fn region(s: &Sim) -> Region {
    Region::open(&s.region_path(), true).unwrap()
}

/// What the simulated driver says this GPU holds (ground truth).
fn physical_used(s: &Sim, gpu: usize) -> u64 {
    s.status()["gpus"][gpu]["memory_used"].as_u64().unwrap()
}

#[test]
fn every_binding_path_is_limited_and_silent() {
    let s = Sim::new(Some(NODE));
    let mut runs = vec![(DIRECT, vec![]), (DLSYM, vec![])];
    for v in ["11060", "12000", "12040"] {
        runs.push((RT, vec!["--cuda-version", v]));
        runs.push((RT, vec!["--cuda-version", v, "--per-thread"]));
    }
    for (bin, pre) in runs {
        let mut args = pre.clone();
        args.extend(["alloc", "--size", "2g", "--chunk", "100m"]);
        let o = out(&mut s.limited(bin, LIMIT), &args);
        let v = json1(&o);
        assert_eq!(v["allocated"], 900 * MIB, "{bin} {pre:?}: 64m context + 9 x 100m fit in 1g, the 10th does not");
        assert_eq!(v["error"], "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(v["mem_info"]["total"], 1024 * MIB, "{bin}: cuMemGetInfo shows the slice");
        assert_eq!(v["mem_info"]["free"], 60 * MIB);
        assert!(o.stderr.is_empty(), "{bin}: a healthy process prints nothing: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert_eq!(physical_used(&s, 0), 0);
}

#[test]
fn get_proc_address_returns_hooks_for_exactly_the_entry_points_the_driver_returned() {
    let s = Sim::new(Some(NODE));
    let q = |ver: &str, pt: bool, names: &[&str]| -> Vec<Value> {
        let mut args = vec!["--cuda-version", ver];
        if pt {
            args.push("--per-thread");
        }
        args.push("procaddr");
        args.extend_from_slice(names);
        let o = out(&mut s.limited(RT, LIMIT), &args);
        assert!(o.status.success());
        lines(&o.stdout)
    };
    let lib = |v: &Value| v["library"].as_str().unwrap_or("").rsplit('/').next().unwrap().to_owned();
    let r = q("12040", false, &["cuMemAlloc", "cuLaunchKernel", "cuMemcpyHtoD", "cuGetProcAddress", "cuMemGetInfo"]);
    for (v, sym) in
        r.iter().zip(["cuMemAlloc_v2", "cuLaunchKernel", "cuMemcpyHtoD_v2", "cuGetProcAddress_v2", "cuMemGetInfo_v2"])
    {
        assert_eq!(v["resolved"], sym, "{v}");
    }
    assert_eq!(lib(&r[0]), "libvgpu.so", "intercepted: our hook");
    assert_eq!(lib(&r[1]), "libvgpu.so");
    assert_eq!(lib(&r[2]), "libcuda.so.1", "not intercepted: the driver's own entry point");
    assert_eq!(lib(&r[3]), "libvgpu.so", "cuGetProcAddress itself is hooked");
    // The per-thread variant the driver chose, not a guess.
    let r = q("12040", true, &["cuLaunchKernel", "cuMemAllocAsync", "cuMemAlloc"]);
    assert_eq!((r[0]["resolved"].as_str(), lib(&r[0]).as_str()), (Some("cuLaunchKernel_ptsz"), "libvgpu.so"));
    assert_eq!((r[1]["resolved"].as_str(), lib(&r[1]).as_str()), (Some("cuMemAllocAsync_ptsz"), "libvgpu.so"));
    assert_eq!(r[2]["resolved"], "cuMemAlloc_v2");
    // Old ABI: the v1 entry point's hook, never the v2 one.
    let r = q(
        "3010",
        false,
        &["cuMemAlloc", "cuMemGetInfo", "cuCtxDestroy", "cuMemAllocPitch", "cuArrayCreate", "cuArray3DCreate"],
    );
    assert_eq!((r[0]["resolved"].as_str(), lib(&r[0]).as_str()), (Some("cuMemAlloc"), "libvgpu.so"));
    assert_eq!(r[1]["resolved"], "cuMemGetInfo");
    // A context destroyed through the old entry point gives its memory back too.
    assert_eq!((r[2]["resolved"].as_str(), lib(&r[2]).as_str()), (Some("cuCtxDestroy"), "libvgpu.so"));
    // The other allocations of the old ABI (32-bit pointers or extents) are charged too.
    for (v, sym) in r[3..].iter().zip(["cuMemAllocPitch", "cuArrayCreate", "cuArray3DCreate"]) {
        assert_eq!((v["resolved"].as_str(), lib(v).as_str()), (Some(sym), "libvgpu.so"), "{v}");
    }
    // The context entry point of each ABI: hooked, the one the driver chose.
    for (ver, sym) in [("11000", "cuCtxCreate_v2"), ("12040", "cuCtxCreate_v3"), ("12050", "cuCtxCreate_v4")] {
        let r = q(ver, false, &["cuCtxCreate"]);
        assert_eq!((r[0]["resolved"].as_str(), lib(&r[0]).as_str()), (Some(sym), "libvgpu.so"), "{ver}");
    }
    // Versions the driver refuses stay refused.
    let r = q("11000", false, &["cuMemAllocAsync"]);
    assert_eq!((r[0]["ret"].as_u64(), r[0]["status"].as_i64()), (Some(500), Some(2)));
}

#[test]
fn every_allocator_is_counted_exactly() {
    let s = Sim::new(Some(NODE));
    for a in ["device", "pitch", "managed", "vmm", "async", "pool", "array", "array-v1", "array3d-v1"] {
        let o = out(&mut s.limited(RT, LIMIT), &["alloc", "--allocator", a, "--size", "2g", "--chunk", "100m"]);
        let v = lines(&o.stdout);
        assert!(o.status.success(), "{a}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(v[0]["allocated"], 900 * MIB, "{a}: {}", v[0]);
        assert_eq!(v[0]["error"], "CUDA_ERROR_OUT_OF_MEMORY", "{a}");
        assert_eq!(v[1]["failures"], 0, "{a}");
        assert_eq!(v[1]["mem_info"]["free"], (1024 - 64) * MIB, "{a}: every free gave back what it charged");
    }
    // Mipmapped arrays: charged what the driver reports for the whole chain.
    let (pid, v) = {
        let mut s2 = Sim::new(Some(NODE));
        let (pid, v) =
            s2.spawn_cmd(s2.limited(RT, LIMIT), &["alloc", "--allocator", "mipmap", "--size", "64m", "--hold"]);
        let used = region(&s2).used(0);
        s2.kill(pid);
        (used, v)
    };
    assert_eq!(pid, 64 * MIB + v["bytes"].as_u64().unwrap(), "mipmapped: {v}");
    // Host memory is not limited.
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["alloc", "--allocator", "host", "--size", "3g", "--chunk", "1g"]));
    assert_eq!(v["allocated"], 3072 * MIB);
    assert_eq!(physical_used(&s, 0), 0);
}

#[test]
fn a_free_the_driver_refuses_keeps_the_charge_and_the_next_one_releases_it() {
    // The interposer takes an allocation's entry out before the driver frees (the address may be
    // handed out again at once); a free the driver refuses must put it back.
    let s = Sim::new(Some(NODE));
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["free-refused", "--size", "300m"]));
    let free = |k: &str| v[k]["free"].as_u64().unwrap();
    assert_eq!(v["refused"], "CUDA_ERROR_INVALID_HANDLE", "{v}");
    assert_eq!(free("allocated"), free("base") - 300 * MIB, "{v}");
    assert_eq!(free("after_refusal"), free("allocated"), "still allocated, still charged: {v}");
    assert_eq!(free("freed"), free("base"), "released by the free that worked: {v}");
}

#[test]
fn context_limits_that_hold_memory_are_charged_to_their_context() {
    // A thread's stack is reserved for every thread the GPU holds at once (108 SMs x 2048 threads
    // on an A100): from 1 KiB to 4016 bytes a thread is 631 MiB more, from there to 16 KiB 2.5 GiB
    // more. The heap is what it says.
    let s = Sim::new(Some(NODE));
    let run = |c: &mut Command| json1(&out(c, &["limits", "--heap", "200m", "--too-big", "16k"]));
    let v = run(&mut s.limited(RT, LIMIT));
    let per = v["sms"].as_u64().unwrap() * v["threads_per_sm"].as_u64().unwrap();
    assert_eq!(per, 108 * 2048);
    let step = |i: usize| &v["steps"][i];
    let free = |i: usize| step(i)["mem_info"]["free"].as_u64().unwrap();
    let stack = (4016 - 1024) * per;
    assert_eq!(free(0), 960 * MIB);
    // The driver rounds the stack to 16 bytes; the charge follows what it set.
    assert_eq!((step(1)["result"].as_str(), step(1)["now"].as_u64()), (Some("CUDA_SUCCESS"), Some(4016)), "{v}");
    assert_eq!(free(1), free(0) - stack);
    assert_eq!((step(2)["result"].as_str(), free(2)), (Some("CUDA_SUCCESS"), free(1) - 192 * MIB), "{v}");
    // Past the limit: refused before the driver is asked (the stack stays as it was).
    assert_eq!((step(3)["result"].as_str(), step(3)["now"].as_u64()), (Some("CUDA_ERROR_OUT_OF_MEMORY"), Some(4016)));
    assert_eq!(free(3), free(2));
    // Lowered: still charged (the driver need not give the memory back) until the context goes.
    assert_eq!((step(4)["result"].as_str(), free(4)), (Some("CUDA_SUCCESS"), free(2)));
    // Raised again: what it holds is charged already (not once more at each raise).
    assert_eq!((step(5)["result"].as_str(), free(5)), (Some("CUDA_SUCCESS"), free(2)), "{v}");
    assert_eq!(free(6), free(0), "a reset context has its defaults again: {v}");
    assert_eq!(free(7), free(0) - stack);
    assert_eq!(free(8), free(0), "released with the context: {v}");
    assert_eq!(free(9), free(0) - 64 * MIB - stack, "a context of its own: {v}");
    assert_eq!(free(10), free(0), "destroyed with what its stack held: {v}");
    // Without libvgpu.so the 8 GiB GPU grants the stack the 1 GiB slice refused.
    let bare = run(&mut s.cmd(RT));
    assert_eq!(bare["steps"][3]["result"], "CUDA_SUCCESS", "{bare}");
}

#[test]
fn memory_the_driver_frees_with_a_context_is_given_back() {
    // A context's allocations (linear, pitched, an array) go with it: destroyed, its primary
    // context released for the last time, or reset (what cudaDeviceReset does). The container's
    // usage must follow, or a process that resets and allocates again is refused memory it has.
    let s = Sim::new(Some(NODE));
    for (bin, pre, how) in [
        (DIRECT, vec![], "destroy"),
        (DLSYM, vec![], "release"),
        (DIRECT, vec![], "reset"),
        (RT, vec!["--cuda-version", "12040"], "reset"),
    ] {
        let mut args = pre.clone();
        args.extend(["context-end", "--how", how, "--size", "200m", "--again", "800m"]);
        // The simulated driver frees them (ground truth), and so does the interposer's account.
        let plain = json1(&out(&mut s.cmd(bin), &args));
        let v = json1(&out(&mut s.limited(bin, LIMIT), &args));
        let free = |v: &Value, k: &str| v[k]["free"].as_u64().unwrap_or_else(|| panic!("{bin} {how}: {v}"));
        assert_eq!(free(&plain, "after"), free(&plain, "base"), "{bin} {how}: the driver frees them: {plain}");
        assert_eq!(free(&v, "base"), (1024 - 64) * MIB, "{bin} {how}: {v}");
        assert!(free(&v, "during") <= (1024 - 64 - 600) * MIB, "{bin} {how}: all three charged: {v}");
        assert_eq!(free(&v, "after"), (1024 - 64) * MIB, "{bin} {how}: back to the context alone: {v}");
        assert_eq!(v["again"], "CUDA_SUCCESS", "{bin} {how}: {v}");
        assert_eq!(free(&v, "again_mem_info"), (1024 - 64 - 800) * MIB, "{bin} {how}: {v}");
    }
    assert_eq!(physical_used(&s, 0), 0);
}

/// The node of the reuse scenarios: a destroy returns 300 ms after the object went.
const REUSE_NODE: &str =
    "context_overhead_mib = 64\ndestroy_return_ms = 300\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n";

/// A reuse scenario's line says the race it is about happened: the destroy succeeded, and the other
/// thread's object was made while it was in the driver, with the destroyed one's handle.
fn reused_during_destroy(v: &Value) {
    assert_eq!(
        (&v["destroy"], &v["made_during_destroy"], &v["same_handle"]),
        (&json!("CUDA_SUCCESS"), &json!(true), &json!(true)),
        "{v}"
    );
}

#[test]
fn a_context_made_with_the_handle_of_one_being_destroyed_keeps_its_charge() {
    // The driver gives a destroyed context's handle to the next context made (the simulated one
    // does), here another thread's, made 100 ms into a destroy that returns 300 ms after the
    // context went: the new context's 200 MiB allocation, and its malloc heap raised from 8 to
    // 40 MiB, must not go with, or be taken for, the old context's 100 MiB and heap.
    let s = Sim::new(Some(REUSE_NODE));
    let args = ["context-reuse", "--size", "100m", "--again", "200m", "--heap", "40m"];
    let v = json1(&out(&mut s.limited(RT, LIMIT), &args));
    reused_during_destroy(&v);
    let free = |k: &str| v[k]["free"].as_u64().unwrap();
    // Two contexts of 64 MiB (the primary and the one destroyed), 100 MiB and 32 MiB more heap in
    // the latter.
    assert_eq!(free("base"), (1024 - 128 - 100 - 32) * MIB, "{v}");
    // The new context, its allocation and heap charged; the old one's go once the driver returns.
    assert_eq!(free("during"), free("base") - (64 + 200 + 32) * MIB, "{v}");
    assert_eq!(free("after"), free("during") + (64 + 100 + 32) * MIB, "only the destroyed context's: {v}");
}

#[test]
fn a_pool_made_with_the_handle_of_one_being_destroyed_keeps_its_charge() {
    // The same for a memory pool: the new pool keeps the 200 MiB freed into it (its release
    // threshold at the maximum), which must stay charged when the old pool's destroy returns.
    let s = Sim::new(Some(REUSE_NODE));
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["pool-reuse", "--size", "100m", "--again", "200m"]));
    reused_during_destroy(&v);
    // The device's default pool, holding 64 MiB, is not destroyed (the driver refuses): through an
    // allocation and a synchronisation after the refusal it stays charged.
    let refused = &v["default_destroyed"];
    assert_eq!(refused["result"], "CUDA_ERROR_INVALID_VALUE", "{v}");
    assert_eq!(refused["before"]["free"].as_u64(), Some((1024 - 64 - 64) * MIB), "{v}");
    assert_eq!(refused["after"], refused["before"], "{v}");
    assert_eq!(refused["trimmed"]["free"].as_u64(), Some((1024 - 64) * MIB), "{v}");
    let free = |k: &str| v[k]["free"].as_u64().unwrap();
    // The first pool was trimmed at its synchronisation: only the context is charged.
    assert_eq!(free("base"), (1024 - 64) * MIB, "{v}");
    assert_eq!(free("during"), free("base") - 200 * MIB, "the new pool keeps what was freed into it: {v}");
    assert_eq!(free("after"), free("during"), "nothing of it goes with the old pool: {v}");
    assert_eq!(free("synchronised"), free("during"), "{v}");
    assert_eq!(free("destroyed"), free("base"), "and it goes with its own: {v}");
}

#[test]
fn a_context_the_driver_refuses_to_destroy_keeps_what_it_holds() {
    // cuCtxDestroy of a primary context is refused; what the hook took out of its bookkeeping
    // before asking the driver is put back: still charged, and released when it is reset.
    let s = Sim::new(Some(NODE));
    let args = ["context-end", "--how", "reset", "--size", "200m", "--again", "100m", "--destroy-primary-first"];
    let v = json1(&out(&mut s.limited(DIRECT, LIMIT), &args));
    let refused = &v["destroy_primary_first"];
    assert_eq!(refused["result"], "CUDA_ERROR_INVALID_CONTEXT", "{v}");
    assert_eq!(refused["mem_info"], v["during"], "{v}");
    assert_eq!(v["after"], v["base"], "released at the reset: {v}");
    assert_eq!(v["again_mem_info"]["free"].as_u64(), Some((1024 - 64 - 100) * MIB), "{v}");
}

#[test]
fn a_graph_instantiated_with_the_handle_of_one_being_destroyed_keeps_its_reservation() {
    // The same for an executable graph with allocation nodes: the new graph's 200 MiB must still be
    // reserved for at its launch once the old one's destroy has returned.
    let s = Sim::new(Some(REUSE_NODE));
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["graph-reuse", "--size", "100m", "--again", "200m"]));
    reused_during_destroy(&v);
    assert_eq!(v["launch"], "CUDA_SUCCESS", "{v}");
    let free = |k: &str| v[k]["free"].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    // The device's graph pool holds 100 MiB after the first graph's launch, 200 MiB after the new
    // one's.
    assert_eq!(free("base"), (1024 - 64 - 100) * MIB, "{v}");
    assert_eq!(free("launched"), (1024 - 64 - 200) * MIB, "the pool grew by the new graph's: {v}");
}

#[test]
fn graphs_launched_at_once_do_not_share_the_pool_s_spare_memory() {
    // The graph pool holds 500 MiB spare; two graphs each keeping 500 MiB are launched by two
    // threads at once (the simulated driver backs their memory 200 ms into the call, so both are in
    // it together). Only one of them may count the spare as its own: the other needs 500 MiB more,
    // and the container has 460 MiB left.
    let s = Sim::new(Some(
        "context_overhead_mib = 64\ngraph_launch_ms = 200\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n",
    ));
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["graph-race", "--size", "500m"]));
    let free = |k: &str| v[k]["free"].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert_eq!((free("base"), v["base_pool"].as_u64()), ((1024 - 64 - 500) * MIB, Some(500 * MIB)), "{v}");
    let mut launches: Vec<&str> = v["launches"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
    launches.sort();
    assert_eq!(launches, ["CUDA_ERROR_OUT_OF_MEMORY", "CUDA_SUCCESS"], "{v}");
    assert_eq!((free("after"), v["pool"].as_u64()), (free("base"), Some(500 * MIB)), "{v}");
}

/// The lines of a `graph-mem` run, by step ("launched" lines in launch order).
fn step_lines(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    lines(&o.stdout)
}

fn step<'a>(v: &'a [Value], name: &str) -> &'a Value {
    v.iter().find(|x| x["step"] == name).unwrap_or_else(|| panic!("no {name} in {v:?}"))
}

#[test]
fn memory_that_graphs_allocate_is_charged_as_the_pool_that_backs_it() {
    // Graph memory nodes allocate no memory when made: the driver backs them from the device's
    // graph pool when the graph runs, and keeps the pool for later launches of any graph until
    // trimmed. Two graphs of 600 MiB each, run one after the other, hold 600 MiB: that is what the
    // container must be charged (no more, or the second is refused memory it does not need).
    let s = Sim::new(Some(NODE));
    let free = |v: &Value| v["mem_info"]["free"].as_u64().unwrap();
    type Env<'a> = &'a [(&'a str, &'a str)];
    let runs: &[(&str, &[&str], Env)] = &[
        (RT, &["--how", "explicit"], LIMIT),
        (RT, &["--how", "capture"], LIMIT),
        (RT, &["--how", "capture", "--keep"], LIMIT),
        (RT, &["--how", "explicit", "--instantiate", "params"], LIMIT),
        (DIRECT, &["--how", "capture"], LIMIT),
        (DLSYM, &["--how", "explicit"], LIMIT),
        // Under an SM limit the launch also goes through the throttle.
        (RT, &["--how", "capture"], &[("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("CUDA_DEVICE_SM_LIMIT", "50")]),
    ];
    for &(bin, how, env) in runs {
        let mut args = vec!["graph-mem", "--size", "600m", "--graphs", "2", "--alloc", "600m", "--destroy", "--trim"];
        args.extend_from_slice(how);
        let v = step_lines(&out(&mut s.limited(bin, env), &args));
        let what = format!("{bin} {how:?} {env:?}");
        for x in v.iter().filter(|x| x["step"] == "captured" || x["step"] == "instantiated") {
            assert_eq!(
                (&x["result"], free(x)),
                (&json!("CUDA_SUCCESS"), (1024 - 64) * MIB),
                "{what}: nothing yet: {x}"
            );
        }
        let launched: Vec<&Value> = v.iter().filter(|x| x["step"] == "launched").collect();
        assert_eq!(launched.len(), 4, "{what}: {v:?}");
        for x in launched {
            assert_eq!(x["result"], "CUDA_SUCCESS", "{what}: {x}");
            assert_eq!(x["pool"], 600 * MIB, "{what}: one pool for both graphs: {x}");
            assert_eq!(free(x), (1024 - 64 - 600) * MIB, "{what}: the pool charged once: {x}");
        }
        assert_eq!(step(&v, "alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{what}: the pool holds the memory");
        assert_eq!(free(step(&v, "destroyed")), (1024 - 64 - 600) * MIB, "{what}: the driver keeps the pool");
        let t = step(&v, "trimmed");
        assert_eq!((&t["pool"], free(t)), (&json!(0), (1024 - 64) * MIB), "{what}: trimmed: {t}");
        assert_eq!(step(&v, "alloc-after-trim")["result"], "CUDA_SUCCESS", "{what}");
    }
    // A graph allocating more than the container has left is refused at launch, before the
    // driver takes anything; the quota is untouched.
    for how in ["explicit", "capture"] {
        let args = ["graph-mem", "--how", how, "--size", "1200m", "--launches", "1", "--alloc", "900m"];
        let v = step_lines(&out(&mut s.limited(RT, LIMIT), &args));
        let l = step(&v, "launched");
        assert_eq!((&l["result"], &l["pool"]), (&json!("CUDA_ERROR_OUT_OF_MEMORY"), &json!(0)), "{how}: {l}");
        assert_eq!(free(l), (1024 - 64) * MIB, "{how}");
        assert_eq!(step(&v, "alloc")["result"], "CUDA_SUCCESS", "{how}: nothing left behind");
        // Uploading maps the memory as a launch would, and so does instantiating with the upload flag.
        let up = step_lines(&out(
            &mut s.limited(RT, LIMIT),
            &["graph-mem", "--how", how, "--size", "1200m", "--upload", "--launches", "0"],
        ));
        assert_eq!(step(&up, "uploaded")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{how}: {up:?}");
        let up = step_lines(&out(
            &mut s.limited(RT, LIMIT),
            &["graph-mem", "--how", how, "--size", "600m", "--instantiate", "upload", "--launches", "0"],
        ));
        let i = step(&up, "instantiated");
        assert_eq!((&i["pool"], free(i)), (&json!(600 * MIB), (1024 - 64 - 600) * MIB), "{how}: {i}");
    }
    // A driver that backs graph allocations as the graph runs (the pool grows by the next
    // synchronisation, not within the launch call) is followed at that synchronisation.
    let lazy = Sim::new(Some(&format!("graph_memory_mapped_at = \"sync\"\n{NODE}")));
    for how in ["explicit", "capture"] {
        let args = ["graph-mem", "--how", how, "--size", "600m", "--graphs", "2", "--alloc", "600m", "--trim"];
        let v = step_lines(&out(&mut lazy.limited(RT, LIMIT), &args));
        for x in v.iter().filter(|x| x["step"] == "launched") {
            assert_eq!((&x["pool"], free(x)), (&json!(600 * MIB), (1024 - 64 - 600) * MIB), "lazy {how}: {x}");
        }
        assert_eq!(step(&v, "alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "lazy {how}");
        assert_eq!(free(step(&v, "trimmed")), (1024 - 64) * MIB, "lazy {how}");
    }
    assert_eq!(physical_used(&lazy, 0), 0);
    // The pool goes with its context (cudaDeviceReset), and so does its charge.
    let v = step_lines(&out(
        &mut s.limited(RT, LIMIT),
        &["graph-mem", "--how", "capture", "--size", "600m", "--launches", "1", "--alloc", "600m", "--reset"],
    ));
    assert_eq!(step(&v, "alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY");
    let r = step(&v, "reset");
    assert_eq!((&r["pool"], free(r)), (&json!(0), (1024 - 64) * MIB), "{r}");
    assert_eq!(step(&v, "alloc-after-reset")["result"], "CUDA_SUCCESS");
    assert_eq!(physical_used(&s, 0), 0);
}

#[test]
fn a_graph_that_allocates_on_two_gpus_is_charged_on_both() {
    // Each graph allocates 300 MiB on GPU 0 and 600 MiB on GPU 1 (whose primary context the
    // process holds too); 1 GiB limits on both.
    let s = Sim::new(Some(NODE));
    let limits = [("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g")];
    let free = |v: &Value, k: &str| v[k]["free"].as_u64().unwrap();
    for bin in [RT, DLSYM] {
        let args = [
            "graph-mem",
            "--size",
            "300m",
            "--peer-size",
            "600m",
            "--graphs",
            "2",
            "--alloc",
            "600m",
            "--destroy",
            "--trim",
        ];
        let v = step_lines(&out(&mut s.limited(bin, &limits), &args));
        for x in v.iter().filter(|x| x["step"] == "launched") {
            assert_eq!(
                (&x["result"], &x["pool"], &x["peer_pool"]),
                (&json!("CUDA_SUCCESS"), &json!(300 * MIB), &json!(600 * MIB)),
                "{bin}: {x}"
            );
            assert_eq!(
                (free(x, "mem_info"), free(x, "peer_mem_info")),
                ((1024 - 64 - 300) * MIB, (1024 - 64 - 600) * MIB),
                "{bin}: each GPU's pool charged to its own quota: {x}"
            );
        }
        assert_eq!(step(&v, "alloc")["result"], "CUDA_SUCCESS", "{bin}: 600 MiB fit beside GPU 0's pool");
        assert_eq!(step(&v, "peer-alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{bin}: not beside GPU 1's");
        let t = step(&v, "trimmed");
        assert_eq!(
            (free(t, "mem_info"), free(t, "peer_mem_info")),
            ((1024 - 64) * MIB, (1024 - 64) * MIB),
            "{bin}: {t}"
        );
        assert_eq!(step(&v, "peer-alloc-after-trim")["result"], "CUDA_SUCCESS", "{bin}");
    }
    // Too much for GPU 1: the launch is refused before the driver takes anything on either GPU,
    // and what was held on GPU 0 for it is given back.
    let args = ["graph-mem", "--size", "300m", "--peer-size", "1200m", "--launches", "1", "--alloc", "900m"];
    let v = step_lines(&out(&mut s.limited(RT, &limits), &args));
    let l = step(&v, "launched");
    assert_eq!(
        (&l["result"], &l["pool"], &l["peer_pool"]),
        (&json!("CUDA_ERROR_OUT_OF_MEMORY"), &json!(0), &json!(0)),
        "{l}"
    );
    assert_eq!((free(l, "mem_info"), free(l, "peer_mem_info")), ((1024 - 64) * MIB, (1024 - 64) * MIB), "{l}");
    assert_eq!(
        (step(&v, "alloc")["result"].as_str(), step(&v, "peer-alloc")["result"].as_str()),
        (Some("CUDA_SUCCESS"), Some("CUDA_SUCCESS"))
    );
    assert_eq!((physical_used(&s, 0), physical_used(&s, 1)), (0, 0));
}

#[test]
fn graph_memory_of_a_killed_process_comes_back() {
    let mut s = Sim::new(Some(NODE));
    let (pid, _) = s.spawn_until(
        s.limited(RT, LIMIT),
        &["graph-mem", "--how", "capture", "--size", "600m", "--launches", "1", "--hold"],
        Some("ready"),
    );
    assert_eq!(region(&s).used(0), (64 + 600) * MIB, "the context and the graph pool");
    s.kill(pid);
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["alloc", "--size", "900m"]));
    assert_eq!(v["allocated"], 900 * MIB, "{v}");
    assert_eq!(physical_used(&s, 0), 0);
}

#[test]
fn physical_memory_stays_charged_while_a_mapping_or_a_reference_keeps_it() {
    // cuMemRelease right after cuMemMap is a common idiom: the mapping keeps the memory, and so
    // does a handle retained from its address (cuMemRetainAllocationHandle) after the unmap. The
    // charge must follow the memory, not the first release: 600 MiB under a 1 GiB limit, and
    // another 600 MiB tried while they are kept.
    let s = Sim::new(Some(NODE));
    let free = |v: &Value| v["mem_info"]["free"].as_u64().unwrap();
    for bin in [RT, DIRECT, DLSYM] {
        let v = step_lines(&out(&mut s.limited(bin, LIMIT), &["vmm", "--size", "600m", "--alloc", "600m"]));
        for name in ["created", "mapped", "released", "retained", "unmapped"] {
            let x = step(&v, name);
            assert_eq!((&x["result"], free(x)), (&json!("CUDA_SUCCESS"), (1024 - 64 - 600) * MIB), "{bin} {name}: {x}");
        }
        assert_eq!(step(&v, "alloc-while-mapped")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{bin}: the mapping keeps it");
        assert_eq!(
            step(&v, "alloc-while-retained")["result"],
            "CUDA_ERROR_OUT_OF_MEMORY",
            "{bin}: the reference keeps it"
        );
        assert_eq!(free(step(&v, "released-again")), (1024 - 64) * MIB, "{bin}: gone with the last reference");
        assert_eq!(step(&v, "alloc-after")["result"], "CUDA_SUCCESS", "{bin}");
        assert_eq!(physical_used(&s, 0), 0, "{bin}");
    }
}

#[test]
fn pools_are_charged_what_they_hold() {
    // A stream-ordered pool keeps what is freed into it until the driver trims it: at the next
    // synchronisation down to its release threshold (0 by default; PyTorch's cudaMallocAsync
    // backend and RAPIDS set it high), or on cuMemPoolTrimTo. Memory held is charged; memory reused
    // from the pool is not charged twice.
    let s = Sim::new(Some(NODE));
    let free = |v: &Value| v["mem_info"]["free"].as_u64().unwrap();
    for (bin, allocator) in [(RT, "async"), (RT, "pool"), (DIRECT, "async"), (DLSYM, "pool")] {
        // u64::MAX is what PyTorch's cudaMallocAsync backend sets.
        for (threshold, kept) in [("0", false), ("64g", true), ("18446744073709551615", true)] {
            let args =
                ["pool", "--allocator", allocator, "--size", "600m", "--threshold", threshold, "--alloc", "600m"];
            let v = step_lines(&out(&mut s.limited(bin, LIMIT), &args));
            let what = format!("{bin} {allocator} threshold {threshold}");
            let held = (1024 - 64 - 600) * MIB;
            assert_eq!(free(step(&v, "allocated")), held, "{what}");
            assert_eq!(free(step(&v, "freed")), held, "{what}: still in the pool until a synchronisation");
            let sy = step(&v, "synchronised");
            let want = if kept { held } else { (1024 - 64) * MIB };
            assert_eq!(
                (free(sy), sy["pool"].as_u64().unwrap()),
                (want, if kept { 600 * MIB } else { 0 }),
                "{what}: {sy}"
            );
            let a = step(&v, "alloc");
            assert_eq!(a["result"], if kept { "CUDA_ERROR_OUT_OF_MEMORY" } else { "CUDA_SUCCESS" }, "{what}: {a}");
            let again = step(&v, "allocated-again");
            assert_eq!(
                (&again["result"], free(again)),
                (&json!("CUDA_SUCCESS"), held),
                "{what}: reused, not charged twice"
            );
            assert_eq!(free(step(&v, "trimmed")), (1024 - 64) * MIB, "{what}");
        }
    }
    // A context's synchronisation trims its pools too, also CUDA 13.0's cuCtxSynchronize_v2 (which
    // names the context): the charge follows at once.
    for (bin, sync) in [(RT, "ctx"), (RT, "ctx-v2"), (DIRECT, "ctx-v2")] {
        let v = step_lines(&out(&mut s.limited(bin, LIMIT), &["pool", "--size", "600m", "--sync", sync]));
        let sy = step(&v, "synchronised");
        assert_eq!((free(sy), sy["pool"].as_u64().unwrap()), ((1024 - 64) * MIB, 0), "{bin} {sync}: {sy}");
    }
    // Destroying the device's current pool makes its default pool current again: cuMemAllocAsync
    // then draws from the default pool, which keeps what is freed into it (a high threshold), so
    // that stays charged, not given back as if it went with the destroyed pool.
    for bin in [RT, DIRECT] {
        let args = ["pool", "--destroyed-current", "--size", "600m", "--threshold", "64g", "--alloc", "600m"];
        let v = step_lines(&out(&mut s.limited(bin, LIMIT), &args));
        let held = (1024 - 64 - 600) * MIB;
        assert_eq!(free(step(&v, "freed")), held, "{bin}: {v:?}");
        let sy = step(&v, "synchronised");
        assert_eq!(
            (free(sy), sy["pool"].as_u64().unwrap()),
            (held, 600 * MIB),
            "{bin}: kept in the default pool: {sy}"
        );
        assert_eq!(step(&v, "alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{bin}: the GPU holds the pool's 600 MiB");
        let again = step(&v, "allocated-again");
        assert_eq!((&again["result"], free(again)), (&json!("CUDA_SUCCESS"), held), "{bin}: reused, not charged twice");
        assert_eq!(free(step(&v, "trimmed")), (1024 - 64) * MIB, "{bin}");
    }
    // The same where a pool of the application's own is made current with cuMemSetMemPool (CUDA
    // 13.0) after cuMemAllocAsync drew from the default pool: cuMemAllocAsync draws from the own
    // pool now (named by cuMemGetMemPool), and what it keeps stays charged.
    for bin in [RT, DIRECT] {
        let args = ["pool", "--own-current", "--size", "600m", "--threshold", "64g", "--alloc", "600m"];
        let v = step_lines(&out(&mut s.limited(bin, LIMIT), &args));
        let held = (1024 - 64 - 600) * MIB;
        let sy = step(&v, "synchronised");
        assert_eq!((free(sy), sy["pool"].as_u64().unwrap()), (held, 600 * MIB), "{bin}: kept in the own pool: {sy}");
        assert_eq!(step(&v, "alloc")["result"], "CUDA_ERROR_OUT_OF_MEMORY", "{bin}: the GPU holds the pool's 600 MiB");
        let again = step(&v, "allocated-again");
        assert_eq!((&again["result"], free(again)), (&json!("CUDA_SUCCESS"), held), "{bin}: reused, not charged twice");
        assert_eq!(free(step(&v, "trimmed")), (1024 - 64) * MIB, "{bin}");
    }
    // A pool holds the memory of the device it was made for, whatever device is current when it is
    // drawn from (cuMemAllocFromPoolAsync takes a pool of any device): charged there. Device 0 is
    // current; the pool is of device 1, whose limit is 1 GiB.
    let two: &[(&str, &str)] = &[("CUDA_DEVICE_MEMORY_LIMIT_0", "2g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g")];
    std::fs::remove_file(s.region_path()).unwrap(); // a new container, with these limits
    let args = ["pool", "--allocator", "pool", "--pool-on", "1", "--size", "600m", "--alloc", "1900m"];
    let v = step_lines(&out(&mut s.limited(RT, two), &args));
    let a = step(&v, "allocated");
    assert_eq!((&a["result"], free(a)), (&json!("CUDA_SUCCESS"), (2048 - 64) * MIB), "not charged on device 0: {a}");
    assert_eq!(step(&v, "alloc")["result"], "CUDA_SUCCESS", "device 0's 1900 MiB are all there: {v:?}");
    let args = ["pool", "--allocator", "pool", "--pool-on", "1", "--size", "1200m"];
    let o = out(&mut s.limited(RT, two), &args);
    let a = lines(&o.stdout).into_iter().find(|x| x["step"] == "allocated").expect("an allocated line");
    assert_eq!(a["result"], "CUDA_ERROR_OUT_OF_MEMORY", "over device 1's 1 GiB: {a}");
    // So does a device's default pool named by cuMemGetDefaultMemPool (CUDA 13.0) for a location.
    for (size, result) in [("600m", "CUDA_SUCCESS"), ("1200m", "CUDA_ERROR_OUT_OF_MEMORY")] {
        let args = ["pool", "--allocator", "default", "--pool-on", "1", "--size", size];
        let o = out(&mut s.limited(RT, two), &args);
        let a = lines(&o.stdout).into_iter().find(|x| x["step"] == "allocated").expect("an allocated line");
        assert_eq!(a["result"], result, "{size} from device 1's default pool: {a}");
        assert_eq!(free(&a), (2048 - 64) * MIB, "not charged on device 0: {a}");
    }
    // A pool of host memory (CUDA 12.2 and later) takes nothing from the GPU's quota.
    std::fs::remove_file(s.region_path()).unwrap();
    let args =
        ["pool", "--allocator", "pool", "--pool-on", "host", "--size", "600m", "--threshold", "64g", "--alloc", "900m"];
    let v = step_lines(&out(&mut s.limited(RT, LIMIT), &args));
    for name in ["allocated", "freed", "synchronised", "allocated-again", "trimmed"] {
        assert_eq!(free(step(&v, name)), (1024 - 64) * MIB, "{name}: host memory is not charged: {v:?}");
    }
    assert_eq!(step(&v, "alloc")["result"], "CUDA_SUCCESS", "{v:?}");
    // An allocation outstanding when its context is reset (cudaDeviceReset) went with it: the
    // driver reports its pool unused, and the charge follows.
    for allocator in ["async", "pool"] {
        let args =
            ["pool", "--allocator", allocator, "--size", "600m", "--threshold", "64g", "--alloc", "900m", "--reset"];
        let v = step_lines(&out(&mut s.limited(RT, LIMIT), &args));
        assert_eq!(free(step(&v, "reset")), (1024 - 64) * MIB, "{allocator}: {v:?}");
        assert_eq!(step(&v, "alloc-after-reset")["result"], "CUDA_SUCCESS", "{allocator}");
    }
    // A pool reserves in chunks (2 MiB on the simulator): what it holds beyond the request is
    // charged once it is known (at the synchronisation).
    let v = step_lines(&out(&mut s.limited(RT, LIMIT), &["pool", "--size", "1m", "--threshold", "64g"]));
    assert_eq!(free(step(&v, "allocated")), (1024 - 64 - 1) * MIB);
    assert_eq!(free(step(&v, "synchronised")), (1024 - 64 - 2) * MIB, "{v:?}");
    assert_eq!(physical_used(&s, 0), 0);
}

#[test]
fn an_allocation_on_another_device_s_stream_is_charged_to_that_device() {
    // cuMemAllocAsync draws from the current pool of the stream's device, not of the current
    // context's: with device 0 current (2 GiB) and a stream of device 1 (1 GiB), 768 MiB are
    // device 1's, and 1.5 GiB do not fit there however much room device 0 has.
    let s = Sim::new(Some(NODE));
    let two: &[(&str, &str)] = &[("CUDA_DEVICE_MEMORY_LIMIT_0", "2g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "1g")];
    let free = |v: &Value, k: &str| v[k]["free"].as_u64().unwrap();
    for bin in [RT, DIRECT, DLSYM] {
        let args = ["pool", "--stream-on", "1", "--size", "768m", "--alloc", "1900m"];
        let v = step_lines(&out(&mut s.limited(bin, two), &args));
        let a = step(&v, "allocated");
        assert_eq!(
            (&a["result"], &a["pool"], free(a, "mem_info"), free(a, "stream_mem_info")),
            (&json!("CUDA_SUCCESS"), &json!(768 * MIB), (2048 - 64) * MIB, (1024 - 64 - 768) * MIB),
            "{bin}: charged on the stream's device, not the current one: {a}"
        );
        assert_eq!(step(&v, "alloc")["result"], "CUDA_SUCCESS", "{bin}: device 0's 1900 MiB are all there");
        let t = step(&v, "trimmed");
        assert_eq!((free(t, "mem_info"), free(t, "stream_mem_info")), ((2048 - 64) * MIB, (1024 - 64) * MIB), "{bin}");
        let o = out(&mut s.limited(bin, two), &["pool", "--stream-on", "1", "--size", "1536m"]);
        let a = lines(&o.stdout).into_iter().find(|x| x["step"] == "allocated").expect("an allocated line");
        assert_eq!(
            (&a["result"], &a["pool"], free(&a, "stream_mem_info")),
            (&json!("CUDA_ERROR_OUT_OF_MEMORY"), &json!(0), (1024 - 64) * MIB),
            "{bin}: over device 1's 1 GiB: {a}"
        );
        assert_eq!((physical_used(&s, 0), physical_used(&s, 1)), (0, 0), "{bin}");
    }
}

#[test]
fn contexts_created_through_every_cu_ctx_create_are_charged() {
    // v3 (execution affinity) and v4 (what `cuCtxCreate` means from CUDA 13) cost a context like v2.
    let s = Sim::new(Some(NODE));
    let during = |create: &str| -> Value {
        let args = ["context-end", "--how", "destroy", "--create", create, "--size", "64m"];
        let v = json1(&out(&mut s.limited(DIRECT, LIMIT), &args));
        assert_eq!(v["after"], v["base"], "{create}: the context and its allocations given back: {v}");
        v["during"].clone()
    };
    let v2 = during("v2");
    assert!(v2["free"].as_u64().unwrap() <= (1024 - 64 - 64 - 192) * MIB, "its 64 MiB charged: {v2}");
    assert_eq!(during("v3"), v2);
    assert_eq!(during("v4"), v2);
}

#[test]
fn the_container_sees_its_slice_in_cuda_and_nvml() {
    let mut s = Sim::new(Some(NODE));
    // Without a limit: the physical figures (never 0).
    let v = json1(&out(&mut s.limited(RT, &[]), &["info"]));
    assert_eq!(v["devices"][0]["total_mem"], 8192 * MIB);
    assert_eq!(v["mem_info"]["total"], 8192 * MIB);
    // With a limit on device 0 only (a new container: the region keeps the limits it was made with).
    std::fs::remove_file(s.region_path()).unwrap();
    let v = json1(&out(&mut s.limited(DLSYM, LIMIT), &["info"]));
    assert_eq!(v["devices"][0]["total_mem"], 1024 * MIB);
    assert_eq!(v["devices"][1]["total_mem"], 23034 * MIB, "no limit on device 1");
    assert_eq!(v["mem_info"]["free"], 960 * MIB);

    // A container process holds 300m; an outside process holds 2g on the same GPU.
    let (inside, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "300m", "--hold"]);
    let (outside, _) = s.spawn(RT, &["alloc", "--size", "2g", "--hold"]);
    let lib = s.libs.join("libnvidia-ml.so.1");
    let probe = |c: &mut Command| -> Value {
        let o = out(c, &["--lib", lib.to_str().unwrap(), "snapshot"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let n = probe(&mut s.limited(NVML, LIMIT));
    let g = &n["gpus"][0];
    assert_eq!(g["memory"]["total"], 1024 * MIB, "{g}");
    assert_eq!(g["memory"]["used"], 364 * MIB, "the container's usage, context included");
    assert_eq!(g["memory"]["free"], 660 * MIB);
    let pids: Vec<u64> = g["processes"]["Ok"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids, vec![inside as u64], "only the container's processes");
    // A container process in a PID namespace whose PID there is the outside process's host PID:
    // named by its host PID (known), its inner PID must not list the stranger.
    let r = region(&s);
    let _claim = r.claim(outside, 4_000_000).unwrap();
    let n = probe(&mut s.limited(NVML, LIMIT));
    let pids: Vec<u64> =
        n["gpus"][0]["processes"]["Ok"].as_array().unwrap().iter().map(|p| p["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids, vec![inside as u64], "not the process whose host PID is another's inner PID");
    // A container process in a PID namespace whose host PID is known (the stranger's PID stands in
    // for it): listed under its PID in the container, what nvidia-smi there finds in /proc.
    let _ns = r.claim(54321, outside).unwrap();
    let n = probe(&mut s.limited(NVML, LIMIT));
    let mut procs: Vec<(u64, u64)> = n["gpus"][0]["processes"]["Ok"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["pid"].as_u64().unwrap(), p["used"].as_u64().unwrap()))
        .collect();
    procs.sort_unstable();
    assert_eq!(procs, vec![(inside as u64, 364 * MIB), (54321, (2048 + 64) * MIB)], "{n}");
    let lists = out(&mut s.limited(NVML, LIMIT), &["--lib", lib.to_str().unwrap(), "lists"]);
    let l: Value = serde_json::from_slice(&lists.stdout).unwrap();
    let mut want = vec![inside as u64, 54321];
    want.sort_unstable();
    assert_eq!(l["gpus"][0]["lists"]["nvmlDeviceGetComputeRunningProcesses"], json!(want), "{l}");
    assert_eq!(l["gpus"][0]["lists"]["detail:0"], json!(want), "{l}");
    // The simulated driver is a 550 one, whose private table (nvidia-smi's lists) is not known to
    // have the shape of 580's: passed through as the driver answers (host PIDs, every process).
    let mut host = vec![inside as u64, outside as u64];
    host.sort_unstable();
    assert_eq!(l["gpus"][0]["lists"]["private:213"], json!(host), "{l}");
    drop(_ns);
    assert_eq!(n["gpus"][1]["memory"]["total"], 23034 * MIB, "unlimited device passes through");
    // Outside the container NVML tells the physical truth.
    let n = probe(&mut s.cmd(NVML));
    assert_eq!(n["gpus"][0]["memory"]["used"], (364 + 2048 + 64) * MIB);
    assert_eq!(n["gpus"][0]["processes"]["Ok"].as_array().unwrap().len(), 2);
    s.kill(inside);
    s.kill(outside);
}

/// Every NVML query that names processes, in each version an application may call (the compute,
/// graphics and MPS lists, the R550 detail list of each mode, both per-process utilization
/// queries, and the lists of NVML's private table that `nvidia-smi` uses), names only the
/// container's processes on a GPU it shares (a memory or an SM limit); outside, all of them.
#[test]
fn every_nvml_query_that_names_processes_names_only_the_containers() {
    // Every process also draws (graphics list), so that list is not empty to begin with. A 580
    // driver: the private table's shape is known there.
    let s =
        Sim::new(Some(&format!("graphics = true\ndriver_version = \"580.95.05\"\n{NODE}[[gpu]]\nmodel = \"L4\"\n")));
    let launcher = |mut c: Command, more: &[&str]| {
        c.args(["launch", "--kernel", "sleep_1ms", "--seconds", "30"]).args(more);
        c.stdout(std::process::Stdio::null()).spawn().unwrap()
    };
    // GPU 0: a memory limit; GPU 1: an SM limit only; GPU 2: no limit.
    let env = [LIMIT[0], ("CUDA_DEVICE_SM_LIMIT_1", "50")];
    let mut inside = launcher(s.limited(RT, &env), &["--devices", "0,1"]);
    // The stranger also runs on GPUs 1 and 2.
    let mut outside = launcher(s.cmd(RT), &["--devices", "0,1,2"]);
    let (pin, pout) = (inside.id() as u64, outside.id() as u64);
    let lib = s.libs.join("libnvidia-ml.so.1");
    let probe = |c: &mut Command| -> Value {
        let o = out(c, &["--lib", lib.to_str().unwrap(), "lists"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["gpus"][0]["lists"].clone()
    };
    // No MPS server: the MPS lists (and the detail list's MPS mode) are empty on both sides.
    let mps = |name: &str| name.contains("MPS") || name == "detail:2" || name == "private:215";
    // Outside the container: both, once both have contexts and kernels in the sampling window.
    // One probe asks list after list, so a process that starts between two of them shows in the
    // later ones only: wait until every list (not just some) shows both.
    let both = json!([pin.min(pout), pin.max(pout)]);
    let t0 = std::time::Instant::now();
    let all = loop {
        let l = probe(&mut s.cmd(NVML));
        let lists = l.as_object().unwrap();
        if lists.len() == 9 + 3 + 2 + 3 && lists.iter().all(|(name, v)| mps(name) || *v == both) {
            break l;
        }
        assert!(t0.elapsed().as_secs() < 20, "both processes never showed: {l}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let names: Vec<&String> = all.as_object().unwrap().keys().collect();
    assert_eq!(names.len(), 9 + 3 + 2 + 3, "every list found: {names:?}");
    let o = out(&mut s.limited(NVML, &env), &["--lib", lib.to_str().unwrap(), "lists"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let gpus: Value = serde_json::from_slice(&o.stdout).unwrap();
    let mine = &gpus["gpus"][0]["lists"];
    for (name, v) in all.as_object().unwrap() {
        let (want_all, want_mine) = if mps(name) { (json!([]), json!([])) } else { (both.clone(), json!([pin])) };
        assert_eq!(*v, want_all, "{name} outside: {all}");
        assert_eq!(mine[name], want_mine, "{name} in the container: {mine}");
    }
    // The private table asked for before anything initialised NVML (nvidia-smi may fetch it
    // first): restricted the same.
    // With the log at info, it says so (what the real-GPU suite reads when nvidia-smi lists more).
    let mut c = s.limited(NVML, &env);
    c.env("LIBCUDA_LOG_LEVEL", "2");
    let o = out(&mut c, &["--lib", lib.to_str().unwrap(), "lists", "--table-first"]);
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{said}");
    let first: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(first["gpus"][0]["lists"]["private:213"], json!([pin]), "{first}");
    assert!(said.contains("process lists restricted to the container's"), "{said}");
    assert!(said.contains("1 of its 2 entries are the container's"), "{said}");
    // GPU 1, shared by an SM limit alone: the container's process only.
    let l1 = &gpus["gpus"][1]["lists"];
    for name in ["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses", "private:213"] {
        assert_eq!(l1[name], json!([pin]), "{name} on GPU 1: {l1}");
    }
    // GPU 2 has no limit in the container: its lists pass through, the stranger included.
    let l2 = &gpus["gpus"][2]["lists"];
    assert_eq!(l2["nvmlDeviceGetComputeRunningProcesses_v3"], json!([pout]), "{l2}");
    assert_eq!(l2["nvmlDeviceGetGraphicsRunningProcesses"], json!([pout]), "{l2}");
    assert_eq!(l2["private:213"], json!([pout]), "{l2}");
    for c in [&mut inside, &mut outside] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

/// A process in a PID namespace with a /proc of its own (what every container has) cannot tell
/// its host PID: its `NSpid` shows one PID, its own there. It must record none (the agent, or the
/// true-up, learns it), not take its inner PID for the host's: that PID would name another host
/// process in NVML's lists, and the true-up would not look for the real one.
#[test]
fn a_process_in_a_container_s_pid_namespace_does_not_take_its_pid_for_the_host_s() {
    let unshare = ["--pid", "--fork", "--mount-proc", "--kill-child"];
    if !Command::new("unshare").args(unshare).arg("true").status().is_ok_and(|s| s.success()) {
        skipped("this machine allows no PID namespace with its own /proc (needs root)");
        return;
    }
    let mut s = Sim::new(Some(NODE));
    // The true-up off: it would learn a PID from the simulated driver, which knows only the PID
    // the process sees as its own (a real driver lists host PIDs).
    let env = [("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("VGPU_MEMORY_TRUE_UP", "0")];
    let mut c = s.limited("unshare", &env);
    c.args(unshare).arg(RT);
    let (_, v) = s.spawn_cmd(c, &["alloc", "--size", "100m", "--hold"]);
    assert_eq!(v["allocated"], 100 * MIB, "{v}");
    let slots: Vec<(u32, u32)> = region(&s).slots().iter().map(|(_, p, h, _)| (*p, *h)).collect();
    assert_eq!(slots, vec![(1, 0)], "PID 1 in its namespace, host PID not known");
    // Without a namespace the PID is the host's.
    let (pid, _) = s.spawn_cmd(s.limited(RT, &env), &["alloc", "--size", "100m", "--hold"]);
    assert!(region(&s).slots().iter().any(|(_, p, h, _)| (*p, *h) == (pid, pid)));
}

/// `nvidia-smi` run before any CUDA process of the container (standalone mode: the region is new and
/// knows no device yet) shows the limit too, for the devices CUDA would see, with the container
/// indices CUDA would give them.
#[test]
fn nvml_before_any_cuda_process_shows_the_limit() {
    let s = Sim::new(Some(NODE));
    let lib = s.libs.join("libnvidia-ml.so.1");
    let probe = |c: &mut Command| -> Value {
        let o = out(c, &["--lib", lib.to_str().unwrap(), "snapshot"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let totals = |n: &Value| -> Vec<u64> {
        n["gpus"].as_array().unwrap().iter().map(|g| g["memory"]["total"].as_u64().unwrap()).collect()
    };
    let n = probe(&mut s.limited(NVML, &[("CUDA_DEVICE_MEMORY_LIMIT", "2g")]));
    assert_eq!(totals(&n), vec![2048 * MIB, 2048 * MIB]);
    // CUDA_VISIBLE_DEVICES=1: only device 1 is the container's, as container index 1 (numbers keep
    // their index, like `CUDA_DEVICE_MEMORY_LIMIT_1`); a CUDA process later agrees.
    std::fs::remove_file(s.region_path()).unwrap();
    let env = [("CUDA_VISIBLE_DEVICES", "1"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "3g")];
    let n = probe(&mut s.limited(NVML, &env));
    assert_eq!(totals(&n), vec![8192 * MIB, 3072 * MIB]);
    let v = json1(&out(&mut s.limited(DLSYM, &env), &["info"]));
    assert_eq!(v["devices"][0]["total_mem"], 3072 * MIB);
    assert_eq!(region(&s).find_device(n["gpus"][1]["uuid"].as_str().unwrap()), Some(1));
}

#[test]
fn processes_share_one_quota_and_dead_ones_give_it_back() {
    let mut s = Sim::new(Some(NODE));
    let (a, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "500m", "--hold"]);
    let v = json1(&out(&mut s.limited(DIRECT, LIMIT), &["alloc", "--size", "600m", "--chunk", "100m"]));
    assert_eq!(v["allocated"], 300 * MIB, "564m held by A; B: 64m + 3 x 100m");
    assert_eq!(v["mem_info"]["free"], (1024 - 564 - 364) * MIB);
    // A process that started before the kill and allocates after it gets the memory back (the OOM
    // path reclaims dead slots).
    let (b, w) = s.spawn_cmd(s.limited(DLSYM, LIMIT), &["alloc", "--size", "900m", "--delay-secs", "1.5", "--hold"]);
    assert_eq!(w["event"], "waiting");
    s.kill(a);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let r = region(&s);
    assert_eq!(r.used(0), 964 * MIB, "B holds 900m + its context; A's share was reclaimed");
    assert!(physical_used(&s, 0) <= 1024 * MIB);
    s.kill(b);
    // Twenty processes in a row, each using most of the quota.
    for i in 0..20 {
        let v = json1(&out(
            &mut s.limited(if i % 2 == 0 { RT } else { DLSYM }, LIMIT),
            &["alloc", "--size", "900m", "--chunk", "300m"],
        ));
        assert_eq!(v["allocated"], 900 * MIB, "run {i}");
    }
}

#[test]
fn a_process_that_exits_gives_its_memory_back_to_those_still_running_at_their_next_look() {
    use std::io::{BufRead, BufReader};
    let s = Sim::new(Some(NODE));
    // B starts first (so its own start, which reclaims dead slots, comes before A's end), then
    // waits; A exits holding 500m (no frees: the driver frees it at exit) while B runs.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut b = Killed(
        s.limited(RT, LIMIT)
            .args(["alloc", "--size", "100m", "--delay-secs", "2", "--hold"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines_b = BufReader::new(b.0.stdout.take().unwrap()).lines();
    let waiting: Value = serde_json::from_str(&lines_b.next().unwrap().unwrap()).unwrap();
    assert_eq!(waiting["event"], "waiting");
    let a = json1(&out(&mut s.limited(DIRECT, LIMIT), &["alloc", "--size", "500m", "--no-free"]));
    assert_eq!(a["allocated"], 500 * MIB);
    // B's next look at the usage (its cuMemGetInfo after allocating, no limit met) no longer counts
    // A's 564m: A's exit marked its slot, and B reclaimed it once A was gone.
    let allocated: Value = serde_json::from_str(&lines_b.next().unwrap().unwrap()).unwrap();
    assert_eq!(allocated["allocated"], 100 * MIB, "{allocated}");
    assert_eq!(allocated["mem_info"]["free"], (1024 - 64 - 100) * MIB, "{allocated}");
    let r = region(&s);
    assert_eq!((r.used(0), r.exiting()), (164 * MIB, 0));
}

#[test]
fn racing_processes_never_exceed_the_limit() {
    let s = Sim::new(Some(NODE));
    // Contexts aside: not charged, nor trued up (what a context really holds is charged after it
    // exists, and may take a container past its limit: the next allocation is refused).
    let env = [("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("VGPU_CONTEXT_OVERHEAD", "0"), ("VGPU_MEMORY_TRUE_UP", "0")];
    let children: Vec<_> = (0..8)
        .map(|i| {
            s.limited(if i % 2 == 0 { RT } else { DIRECT }, &env)
                .args(["alloc", "--size", "200m", "--chunk", "1m", "--hold-secs", "2"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // While they hold: never above the limit, in the region and physically (contexts aside).
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let r = region(&s);
    let held = r.used(0);
    assert!(held <= 1024 * MIB, "{held}");
    let mut total = 0;
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success());
        total += lines(&o.stdout)[0]["allocated"].as_u64().unwrap();
    }
    assert!(total <= 1024 * MIB, "admitted {total}");
    assert!(total >= 1000 * MIB, "the quota is used, not lost to contention: {total}");
    assert_eq!(held, total, "the region holds exactly what was admitted");
}

#[test]
fn many_threads_allocate_and_free() {
    let s = Sim::new(Some(NODE));
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["threads", "--threads", "16", "--iters", "50", "--size", "8m"]));
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["mem_info"]["free"], 960 * MIB);
    // VMM: the driver gives a released handle's value to the next cuMemCreate at once (the
    // simulator's does, last gone first given), here often another thread's while the release's
    // own bookkeeping is still to come.
    let args = ["threads", "--threads", "16", "--iters", "50", "--size", "8m", "--allocator", "vmm"];
    let v = json1(&out(&mut s.limited(RT, LIMIT), &args));
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["mem_info"]["free"], 960 * MIB, "{v}");
    // Over-subscribed: 16 threads x 100m cannot all fit; failures are clean OOMs and nothing leaks.
    let v = json1(&out(&mut s.limited(RT, LIMIT), &["threads", "--threads", "16", "--iters", "20", "--size", "100m"]));
    assert!(v["errors"].as_array().unwrap().iter().all(|e| e == "CUDA_ERROR_OUT_OF_MEMORY"), "{v}");
    assert_eq!(v["mem_info"]["free"], 960 * MIB);
    // Stream-ordered, from one pool that keeps what is freed into it (`gpu-probe pool-threads`,
    // the real-GPU suite's workload: 16 threads on their own streams, the release threshold at the
    // maximum): allocations take from its charged slack, frees return to it, and settles (at the
    // synchronisations, and before each refusal) race with both. The pool never holds more than
    // the limit leaves (a settle that counted an allocation the driver had made, but `live` did not
    // show yet, as slack let later allocations spend it unreserved); once quiescent the container
    // is charged exactly what the pool holds, and nothing after the trim; over-subscribed, failures
    // are clean OOMs.
    for (size, hold, fits) in [(8 * MIB, "2", true), (100 * MIB, "3", false), (100 * MIB, "12", false)] {
        let args = ["pool-threads", "--size", &size.to_string(), "--hold", hold];
        let v = json1(&out(&mut s.limited(PROBE, LIMIT), &args));
        let outcomes = v["outcomes"].as_object().unwrap();
        assert!(outcomes.keys().all(|k| k == "CUDA_SUCCESS" || k == "CUDA_ERROR_OUT_OF_MEMORY"), "{v}");
        assert_eq!(outcomes.contains_key("CUDA_ERROR_OUT_OF_MEMORY"), !fits, "16 threads holding {hold} x {size}: {v}");
        let (room, pool, high) =
            (v["base"]["free"].as_u64().unwrap(), v["pool"].as_u64().unwrap(), v["pool_high"].as_u64().unwrap());
        assert_eq!(room, 960 * MIB, "{v}");
        assert!(pool > 0, "the pool keeps memory: {v}");
        assert!(high <= room, "the pool held {} MiB, past the {} MiB the limit leaves: {v}", high / MIB, room / MIB);
        assert_eq!(v["synchronised"]["free"].as_u64().unwrap(), room - pool, "charged what the pool holds: {v}");
        assert_eq!((v["pool_after_trim"].as_u64(), v["trimmed"]["free"].as_u64()), (Some(0), Some(room)), "{v}");
    }
}

#[test]
fn the_true_up_keeps_what_it_charged_while_threads_allocate() {
    // Each context holds 640 MiB, 64 MiB of it charged by the call: the true-up charges the other
    // 576 MiB at the first context. Then 16 threads allocate 512 MiB each from one pool under a 4 GiB
    // limit (`gpu-probe pool-threads`): the container comes near its limit again and again, and each
    // time the true-up measures while other threads' allocations are charged but not yet made, and
    // their pools' shrinking at a synchronisation is not yet settled. Such a measurement shows less
    // than the driver holds beyond the account; it lowered the correction (by 384 MiB in 4 of 4
    // runs), and the pool then grew past the limit. It may only lower it when no other call is in
    // flight: the correction is whole at the end, and the pool never held more than it left.
    let s = Sim::new(Some("context_overhead_mib = 640\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    for run in 0..3 {
        let mut c = s.limited(PROBE, &[("CUDA_DEVICE_MEMORY_LIMIT_0", "4g")]);
        c.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", s.state.join(format!("storm{run}.region")));
        let v = json1(&out(&mut c, &["pool-threads", "--size", &(512 * MIB).to_string()]));
        let (room, pool) = (v["base"]["free"].as_u64().unwrap(), v["pool"].as_u64().unwrap());
        assert_eq!(room, (4096 - 640) * MIB, "the context's real size is charged: {v}");
        assert!(v["outcomes"]["CUDA_ERROR_OUT_OF_MEMORY"].as_u64() > Some(0), "over-subscribed: {v}");
        assert_eq!(v["synchronised"]["free"].as_u64(), Some(room - pool), "run {run}: {v}");
        assert_eq!(v["trimmed"]["free"].as_u64(), Some(room), "run {run}: the context's correction is whole: {v}");
        assert!(v["pool_high"].as_u64() <= Some(room), "run {run}: the pool held more than the limit left: {v}");
    }
}

#[test]
fn limits_change_while_processes_run() {
    let mut s = Sim::new(Some(NODE));
    let (watcher, first) = s.spawn_cmd(s.limited(RT, LIMIT), &["watch", "--count", "40", "--interval-ms", "50"]);
    assert_eq!(first["mem_info"]["total"], 1024 * MIB);
    let r = region(&s);
    r.set_mem_limit(0, 2048 * MIB).unwrap();
    let v = json1(&out(
        &mut s.limited(DIRECT, LIMIT),
        &["alloc", "--size", "1500m", "--chunk", "500m", "--hold-secs", "0.5"],
    ));
    assert_eq!(v["allocated"], 1500 * MIB, "a raised limit applies to the next allocation");
    assert_eq!(v["mem_info"]["total"], 2048 * MIB, "the region's limit wins over the environment");
    r.set_mem_limit(0, 512 * MIB).unwrap();
    let v = json1(&out(&mut s.limited(DIRECT, LIMIT), &["alloc", "--size", "500m", "--chunk", "100m"]));
    assert_eq!(v["allocated"], 300 * MIB, "lowered: 64m (watcher) + 64m + 3 x 100m");
    s.kill(watcher);
    // The running process saw both changes.
    let o = s.limited(RT, LIMIT).args(["watch", "--count", "1"]).output().unwrap();
    assert_eq!(lines(&o.stdout)[0]["mem_info"]["total"], 512 * MIB);
}

#[test]
fn slots_never_move_and_forked_children_get_their_own() {
    let mut s = Sim::new(Some(NODE));
    let (a, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "100m", "--hold"]);
    let (b, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "200m", "--hold"]);
    let (c, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "300m", "--hold"]);
    let r = region(&s);
    let before = r.slots();
    let slot_of = |pid: u32| before.iter().find(|x| x.1 == pid).unwrap().0;
    let (sa, sb, sc) = (slot_of(a), slot_of(b), slot_of(c));
    s.kill(b);
    r.reap();
    let after = r.slots();
    assert_eq!(after.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(), vec![(sa, a), (sc, c)], "no compaction");
    assert_eq!(r.used(0), (64 + 100 + 64 + 300) * MIB);
    let (d, _) = s.spawn_cmd(s.limited(RT, LIMIT), &["alloc", "--size", "10m", "--hold"]);
    assert_eq!(r.slots().iter().find(|x| x.1 == d).unwrap().0, sb, "the dead slot is reused");

    // exec: the new image (same PID) claims a new slot; what the old image held is reclaimed.
    let mut c = s.limited(RT, LIMIT);
    c.args(["exec-self", "--size", "200m"]).stdout(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::BufRead;
    out.read_line(&mut line).unwrap();
    let before: Value = serde_json::from_str(&line).unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    let after: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(after["event"], "ready");
    assert_eq!(after["pid"], before["pid"], "same process");
    r.reap();
    let pid = child.id();
    let mine: Vec<_> = r.slots().into_iter().filter(|x| x.1 == pid).collect();
    assert_eq!(mine.len(), 1, "one live slot for the PID: {mine:?}");
    assert_eq!(mine[0].3[0], 64 * MIB, "the new image holds its context only; the 200m went with the old image");
    child.kill().unwrap();
    child.wait().unwrap();

    // fork: the child claims a slot of its own; the parent's stays and keeps its usage.
    let child = s
        .limited(DLSYM, LIMIT)
        .args(["fork-child", "--size", "50m", "--child-secs", "1.5"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(800));
    let live = r.slots();
    assert_eq!(live.len(), 5, "a, c, d, the parent and its child: {live:?}");
    let o = child.wait_with_output().unwrap();
    let v = lines(&o.stdout);
    assert_eq!(v[1]["event"], "child");
    assert_eq!(
        v[1]["get_info"], "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA is unusable in a forked child, as with the real driver"
    );
    assert_eq!(v[2]["mem_info"], v[0]["mem_info"], "the parent's accounting is untouched by the child");
}

#[test]
fn bad_configuration_and_damaged_regions_fail_closed_with_one_clear_line() {
    let s = Sim::new(Some(NODE));
    let o = out(&mut s.limited(RT, &[("CUDA_DEVICE_MEMORY_LIMIT", "lots")]), &["alloc", "--size", "1m"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(json1(&o)["error"], "CUDA_ERROR_OUT_OF_MEMORY", "fail-closed");
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("CUDA_DEVICE_MEMORY_LIMIT=\"lots\"") && e.contains("VGPU_FAIL_OPEN"), "{e}");
    let o = out(
        &mut s.limited(RT, &[("CUDA_DEVICE_MEMORY_LIMIT", "lots"), ("VGPU_FAIL_OPEN", "1")]),
        &["alloc", "--size", "1m"],
    );
    assert_eq!(json1(&o)["error"], Value::Null, "fail-open runs unlimited");

    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage)> = vec![
        ("truncated", Box::new(|b: &mut Vec<u8>| b.truncate(4096))),
        ("bad magic", Box::new(|b: &mut Vec<u8>| b.iter_mut().for_each(|x| *x = 0x5a))),
        ("ABI version 9", Box::new(|b: &mut Vec<u8>| b[8..12].copy_from_slice(&9u32.to_le_bytes()))),
        ("layout hash", Box::new(|b: &mut Vec<u8>| b[24] ^= 0x40)),
    ];
    json1(&out(&mut s.limited(RT, LIMIT), &["alloc", "--size", "1m"]));
    let good = std::fs::read(s.region_path()).unwrap();
    for (what, damage) in cases {
        let mut b = good.clone();
        damage(&mut b);
        std::fs::write(s.region_path(), &b).unwrap();
        let o = out(&mut s.limited(DIRECT, LIMIT), &["alloc", "--size", "1m"]);
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(json1(&o)["error"], "CUDA_ERROR_OUT_OF_MEMORY", "{what}");
        assert!(e.contains(what) && e.contains("refusing"), "{what}: {e}");
    }
}

#[test]
fn limits_follow_the_container_index_through_cuda_visible_devices() {
    let s = Sim::new(Some(NODE));
    let env =
        [("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g"), ("CUDA_VISIBLE_DEVICES", "1")];
    let v = json1(&out(&mut s.limited(RT, &env), &["info"]));
    assert_eq!(v["devices"].as_array().unwrap().len(), 1);
    assert_eq!(v["devices"][0]["total_mem"], 2048 * MIB, "ordinal 0 here is the container's device 1");
    let env = [("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"), ("CUDA_DEVICE_MEMORY_LIMIT_1", "2g")];
    let v = json1(&out(&mut s.limited(DLSYM, &env), &["info"]));
    assert_eq!(v["devices"][0]["total_mem"], 1024 * MIB);
    assert_eq!(v["devices"][1]["total_mem"], 2048 * MIB, "and the region agrees on which device is which");
    let r = region(&s);
    assert_eq!((r.ndevices(), r.mem_limit(0), r.mem_limit(1)), (2, 1024 * MIB, 2048 * MIB));
}

/// Builds tests/c-probe (an application in C that binds the driver with dlopen + dlsym, and two
/// libraries that each define `marker`) with the system C compiler, into a fresh directory.
fn c_probe() -> std::path::PathBuf {
    let src = format!("{}/../../c-probe", env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("vgpu-c-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = |args: &[&str]| {
        let o = Command::new(&cc).args(args).output().unwrap_or_else(|e| panic!("cannot run {cc}: {e}"));
        assert!(o.status.success(), "{cc} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    build(&["-shared", "-fPIC", "-o", &format!("{d}/libprobe-b.so"), &format!("{src}/probe-b.c")]);
    build(&["-shared", "-fPIC", "-o", &format!("{d}/libprobe-a.so"), &format!("{src}/probe-a.c"), "-ldl"]);
    // libprobe-a.so before libprobe-b.so in the search order.
    build(&[
        "-o",
        &format!("{d}/probe"),
        &format!("{src}/probe.c"),
        &format!("-L{d}"),
        &format!("-Wl,-rpath,{d}"),
        "-Wl,--no-as-needed",
        "-lprobe-a",
        "-lprobe-b",
        "-ldl",
    ]);
    dir.join("probe")
}

#[test]
fn an_application_in_c_is_limited_through_dlsym_and_rtld_next_still_resolves_past_its_caller() {
    let s = Sim::new(Some(NODE));
    let probe = c_probe();
    let probe = probe.to_str().unwrap();
    let plain = json1(&out(&mut s.cmd(probe), &["128", "20"]));
    assert_eq!((plain["total"].as_u64(), plain["granted"].as_u64()), (Some(8192 * MIB), Some(20)), "{plain}");
    // libprobe-a.so's dlsym(RTLD_NEXT, "marker") finds libprobe-b.so's (2), not its own (1).
    assert_eq!(plain["next"], 2, "{plain}");
    let v = json1(&out(&mut s.limited(probe, LIMIT), &["128", "20"]));
    assert_eq!(v["total"], 1024 * MIB, "{v}");
    assert_eq!((v["granted"].as_u64(), v["refused"].as_u64()), (Some(7), Some(2)), "64m context + 7 x 128m: {v}");
    assert_eq!(v["proc_address"], 2, "cuMemAlloc through cuGetProcAddress refused too: {v}");
    // Through libvgpu.so's dlsym: glibc must still see libprobe-a.so as the caller.
    assert_eq!(v["next"], 2, "{v}");
    // dlvsym (not overridden) cannot reach the driver's entry points, defined without a version.
    assert_eq!((plain["dlvsym"].as_u64(), v["dlvsym"].as_u64()), (Some(0), Some(0)), "{plain} {v}");
    let _ = std::fs::remove_dir_all(std::path::Path::new(probe).parent().unwrap());
}

#[test]
fn with_cuda_oversubscribe_what_the_gpu_has_no_room_for_becomes_unified_memory_within_the_limit() {
    // GPU 0 (8 GiB): a process outside the container holds 7 GiB and its 64 MiB context: 960 MiB
    // are left. The container's limit is 2 GiB.
    let mut s = Sim::new(Some(NODE));
    let (hog, _) = s.spawn(RT, &["alloc", "--size", "7g", "--hold"]);
    let hog_used = physical_used(&s, 0);
    assert_eq!(hog_used, 7232 * MIB);
    let limit = [("CUDA_DEVICE_MEMORY_LIMIT_0", "2g")];
    let args = ["alloc", "--size", "4g", "--chunk", "100m"];

    // Without CUDA_OVERSUBSCRIBE the GPU's room decides: its context and 8 chunks.
    let v = json1(&out(&mut s.limited(RT, &limit), &args));
    assert_eq!((v["allocated"].as_u64(), v["error"].as_str()), (Some(800 * MIB), Some("CUDA_ERROR_OUT_OF_MEMORY")));
    assert_eq!(region(&s).spilled(0), (0, 0));

    // With it, the limit decides: 64 MiB + 19 x 100 MiB fit in 2 GiB; 8 chunks on the GPU, 11 as
    // unified memory (on the host here), which the GPU's usage does not count.
    let c = s.limited(RT, &[limit[0], ("CUDA_OVERSUBSCRIBE", "true")]);
    let (p, v) = s.spawn_cmd(c, &[&args[..], &["--hold"]].concat());
    assert_eq!((v["allocated"].as_u64(), v["error"].as_str()), (Some(1900 * MIB), Some("CUDA_ERROR_OUT_OF_MEMORY")));
    assert_eq!(v["mem_info"]["total"], 2048 * MIB, "{v}");
    assert_eq!(region(&s).spilled(0), (11, 1100 * MIB));
    assert_eq!(region(&s).used(0), 1964 * MIB, "the container is charged for all of it");
    assert_eq!(physical_used(&s, 0), hog_used + 864 * MIB, "the GPU holds only what fitted");
    // Freed by the process's end like the rest: nothing left on the GPU or in the region.
    s.kill(p);
    assert_eq!(physical_used(&s, 0), hog_used);
    let r = region(&s);
    r.reap();
    assert_eq!(r.used(0), 0);

    // Freed one by one with cuMemFree: the frees of unified memory succeed and give the quota back.
    let o = out(&mut s.limited(RT, &[limit[0], ("CUDA_OVERSUBSCRIBE", "1")]), &args);
    assert_eq!(json1(&o)["allocated"], 1900 * MIB);
    let freed = &lines(&o.stdout)[1];
    assert_eq!((freed["chunks"].as_u64(), freed["failures"].as_u64()), (Some(19), Some(0)), "{freed}");
    assert_eq!(freed["mem_info"]["free"], 1984 * MIB, "only the context is left: {freed}");
    assert_eq!(region(&s).spilled(0), (22, 2200 * MIB));
    assert_eq!(physical_used(&s, 0), hog_used);
    s.kill(hog);

    // A GPU whose unified memory does not page on demand: the GPU's room decides, as without.
    let mut s = Sim::new(Some(&NODE.replacen("memory_mib = 8192", "memory_mib = 8192\nmanaged_paging = false", 1)));
    let (hog, _) = s.spawn(RT, &["alloc", "--size", "7g", "--hold"]);
    let v = json1(&out(&mut s.limited(RT, &[limit[0], ("CUDA_OVERSUBSCRIBE", "true")]), &args));
    assert_eq!(v["allocated"], 800 * MIB, "{v}");
    assert_eq!(region(&s).spilled(0), (0, 0));
    s.kill(hog);
}

/// Root and unshare(1) with `--kill-child`, for a process in its own PID namespace; else skipped
/// (not in CI, which runs as root with VGPU_REQUIRE_RUNC set).
fn can_unshare_pid() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ok = root
        && Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "true"])
            .output()
            .is_ok_and(|o| o.status.success());
    assert!(ok || std::env::var_os("VGPU_REQUIRE_RUNC").is_none(), "needs root and unshare --pid --kill-child");
    ok
}

/// What the driver takes after the first context (modules loaded, as PyTorch's kernels load lazily
/// at their first launch) shows in `cuMemGetInfo` before any allocation comes near the limit: the
/// container sees the memory it really has left, and the same again once what it allocated is
/// freed. On an H200, PyTorch's `mem_get_info` said 7.49 GiB free under 8 GiB before a fill and
/// 7.40 GiB after the fill was freed: the modules were charged only when the fill came near the
/// limit.
#[test]
fn memory_the_driver_takes_after_the_first_context_shows_in_mem_get_info() {
    let s = Sim::new(Some(
        "context_overhead_mib = 640\nmodule_overhead_mib = 50\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n",
    ));
    let limit = ("CUDA_DEVICE_MEMORY_LIMIT_0", "2g");
    let o = out(&mut s.limited(RT, &[limit]), &["alloc", "--size", "1m", "--modules", "4", "--delay-secs", "0"]);
    let l = lines(&o.stdout);
    let waiting = l.iter().find(|v| v["event"] == "waiting").unwrap_or_else(|| panic!("{l:?}"));
    // 2048 MiB less the context's 640 and the four modules' 200.
    assert_eq!(waiting["mem_info"]["free"], 1208 * MIB, "{waiting}");
    let done = l.iter().find(|v| v["event"] == "allocated").unwrap();
    assert_eq!((done["allocated"].as_u64(), &done["error"]), (Some(MIB), &Value::Null), "{done}");

    // Turned off, the calls' own account: the context's 64 MiB.
    let o = out(
        &mut s.limited(RT, &[limit, ("VGPU_MEMORY_TRUE_UP", "off")]),
        &["alloc", "--size", "1m", "--modules", "4", "--delay-secs", "0"],
    );
    let l = lines(&o.stdout);
    let waiting = l.iter().find(|v| v["event"] == "waiting").unwrap();
    assert_eq!(waiting["mem_info"]["free"], (2048 - 64) * MIB, "{waiting}");
}

/// A context's true-up runs on a thread of its own; an allocation waits for it only where the
/// context's real size could take the container over its limit (within 1 GiB of it). NVML's
/// process list is made to take 1.5 s: with a 4 GiB limit the first allocation is made at once and
/// charged before the measurement (64 MiB for the context, 1 MiB), which then adds the context's
/// 576 MiB beyond its charge; with a 1 GiB limit it waits, and is admitted on the measured figure.
#[test]
fn only_an_allocation_near_the_limit_waits_for_the_context_s_measurement() {
    let s = Sim::new(Some("context_overhead_mib = 640\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let fault = |args: &[&str]| assert!(s.output(SIM, args).status.success());
    for (limit, charged_at_first_allocation) in [("4g", 65 * MIB), ("1g", 641 * MIB)] {
        let _ = std::fs::remove_file(s.region_path());
        let list = "nvmlDeviceGetComputeRunningProcesses_v3";
        fault(&["fault", "set", list, "--code", "0", "--latency-us", "1500000", "--count", "1"]);
        let mut c = s.limited(START, &[("CUDA_DEVICE_MEMORY_LIMIT_0", limit)]);
        let mut child = c.arg("5").stdout(Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line, "ok\n", "limit {limit}");
        assert_eq!(region(&s).used(0), charged_at_first_allocation, "limit {limit}");
        // The measurement lands: the context's real 640 MiB and the allocation.
        let t = Instant::now();
        while region(&s).used(0) != 641 * MIB {
            assert!(t.elapsed() < Duration::from_secs(10), "limit {limit}: {} MiB", region(&s).used(0) >> 20);
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        fault(&["fault", "clear"]);
    }
}

/// `cuda-start` under `limit`, holding for 30 s once it printed `ok` (its first allocation made).
fn started(s: &Sim, limit: &str) -> std::process::Child {
    let mut c = s.limited(START, &[("CUDA_DEVICE_MEMORY_LIMIT_0", limit)]);
    let mut child = c.arg("30").stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "ok\n", "limit {limit}");
    child
}

/// In a standalone region one process measures every process's contexts: the first to start
/// becomes the region's measurer, and the next ones load no NVML, their contexts charged by its
/// helper; once it is gone, the next process to start takes over.
#[test]
fn one_process_of_a_standalone_region_measures_every_process_s_context() {
    let s = Sim::new(Some("context_overhead_mib = 640\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let start = || started(&s, "4g");
    let nvml_loaded = |pid: u32| {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        maps.contains("nvidia_ml") || maps.contains("nvidia-ml")
    };
    // Each charged the context's real 640 MiB and its 1 MiB, the calls 64 MiB and 1 MiB.
    let charged = |n: u64| {
        let t = Instant::now();
        while region(&s).used(0) != n * 641 * MIB {
            assert!(t.elapsed() < Duration::from_secs(10), "{} MiB, not {n} x 641", region(&s).used(0) >> 20);
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut kids = vec![start(), start(), start()];
    charged(3);
    let loaded: Vec<bool> = kids.iter().map(|k| nvml_loaded(k.id())).collect();
    assert_eq!(loaded, [true, false, false], "NVML in the measurer only");
    assert_eq!(region(&s).measurer().map(|(_, pid)| pid), Some(kids[0].id()));
    assert!(region(&s).measurer_alive());
    let mut first = kids.remove(0);
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(!region(&s).measurer_alive());
    kids.push(start());
    // The dead one's slot goes at the newcomer's claim; the newcomer measures itself.
    charged(3);
    assert_eq!(region(&s).measurer().map(|(_, pid)| pid), Some(kids[2].id()));
    assert!(nvml_loaded(kids[2].id()) && region(&s).measurer_alive());
    for mut k in kids {
        let _ = k.kill();
        let _ = k.wait();
    }
}

/// A process the region's measurer measures waits for its pass where the measurer's helper
/// would wait for its own (an allocation within 1 GiB of the limit): NVML's process list is made
/// to take 1.5 s for the pass that follows the second process's context. Under a 4 GiB limit its
/// first allocation is made at once, charged on the calls' figure; under 1.5 GiB it waits, and is
/// admitted on the measured one.
#[test]
fn a_process_the_measurer_measures_waits_for_it_only_near_the_limit() {
    let s = Sim::new(Some("context_overhead_mib = 640\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let fault = |args: &[&str]| assert!(s.output(SIM, args).status.success());
    let start = |limit: &str| started(&s, limit);
    for (limit, at_first_allocation, waited) in [("4g", (641 + 65) * MIB, false), ("1536m", 2 * 641 * MIB, true)] {
        let _ = std::fs::remove_file(s.region_path());
        let mut measurer = start(limit);
        while region(&s).used(0) != 641 * MIB {
            std::thread::sleep(Duration::from_millis(20));
        }
        fault(&[
            "fault",
            "set",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "--code",
            "0",
            "--latency-us",
            "1500000",
            "--count",
            "1",
        ]);
        let t = Instant::now();
        let mut client = start(limit);
        assert_eq!(
            (t.elapsed() >= Duration::from_millis(1400), region(&s).used(0)),
            (waited, at_first_allocation),
            "limit {limit}"
        );
        while region(&s).used(0) != 2 * 641 * MIB {
            assert!(t.elapsed() < Duration::from_secs(10), "limit {limit}: {} MiB", region(&s).used(0) >> 20);
            std::thread::sleep(Duration::from_millis(20));
        }
        fault(&["fault", "clear"]);
        for k in [&mut measurer, &mut client] {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// A measurer killed before it answers: the process waiting for it near the limit waits 2 s, then
/// measures its context itself. NVML's list is made to take 3 s for the measurer's pass, and the
/// measurer killed during it; the second process's first allocation, under a 1.5 GiB limit, comes
/// within 1 GiB of it and is admitted with the context's real 640 MiB charged (the dead one's 641
/// still counted: nothing reclaimed it yet).
#[test]
fn a_process_whose_measurer_dies_measures_itself() {
    let s = Sim::new(Some("context_overhead_mib = 640\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n"));
    let start = || started(&s, "1536m");
    let mut measurer = start();
    let t = Instant::now();
    while region(&s).used(0) != 641 * MIB {
        assert!(t.elapsed() < Duration::from_secs(10), "{} MiB", region(&s).used(0) >> 20);
        std::thread::sleep(Duration::from_millis(20));
    }
    let list = "nvmlDeviceGetComputeRunningProcesses_v3";
    assert!(s
        .output(SIM, &["fault", "set", list, "--code", "0", "--latency-us", "3000000", "--count", "1"])
        .status
        .success());
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        let _ = measurer.kill();
        let _ = measurer.wait();
    });
    let t = Instant::now();
    let mut client = start();
    let took = t.elapsed();
    killer.join().unwrap();
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_millis(3900), "waited 2 s: {took:?}");
    assert_eq!(region(&s).used(0), 2 * 641 * MIB, "its context's real size charged before its allocation");
    let _ = client.kill();
    let _ = client.wait();
}

#[test]
fn without_an_agent_each_process_is_charged_for_what_the_driver_really_holds_for_it() {
    // GPU 0 (8 GiB): each CUDA context holds 640 MiB (as PyTorch's did on an H200) and each module
    // 50 MiB, while the interposer charges 64 MiB per context in these tests. Limit 2 GiB.
    let mut s = Sim::new(Some(
        "context_overhead_mib = 640\nmodule_overhead_mib = 50\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n",
    ));
    let limit = ("CUDA_DEVICE_MEMORY_LIMIT_0", "2g");
    let args = ["alloc", "--size", "4g", "--chunk", "100m", "--modules", "4", "--hold"];

    // Turned off, the calls' own account (64 MiB + 19 x 100 MiB) lets the process hold 2740 MiB.
    let (p, v) = s.spawn_cmd(s.limited(RT, &[limit, ("VGPU_MEMORY_TRUE_UP", "off")]), &args);
    assert_eq!((v["allocated"].as_u64(), v["error"].as_str()), (Some(1900 * MIB), Some("CUDA_ERROR_OUT_OF_MEMORY")));
    assert_eq!(physical_used(&s, 0), 2740 * MIB);
    s.kill(p);

    // On (the default): the context's 576 MiB beyond its charge are charged at its creation, the
    // modules' 200 MiB once the container comes within 512 MiB of its limit (at 640 + 9 x 100 MiB),
    // before that allocation is admitted. Refused after 12 chunks, holding 2040 MiB: the region
    // agrees with the driver to the byte. The same in a PID namespace, where the process learns its
    // host PID from NVML's list at its first context.
    let unshare = can_unshare_pid();
    for in_namespace in [false, true] {
        if in_namespace && !unshare {
            skipped("the PID namespace part: needs root and unshare --pid --kill-child");
            continue;
        }
        let (p, v) = if in_namespace {
            let c = s.limited("unshare", &[limit]);
            s.spawn_cmd(c, &[&["--pid", "--fork", "--kill-child", "--", RT][..], &args].concat())
        } else {
            s.spawn_cmd(s.limited(RT, &[limit]), &args)
        };
        assert_eq!(v["allocated"], 1200 * MIB, "in a PID namespace: {in_namespace}: {v}");
        assert_eq!(physical_used(&s, 0), 2040 * MIB);
        let r = region(&s);
        assert_eq!(r.used(0), 2040 * MIB);
        assert_eq!(v["mem_info"]["free"], 8 * MIB, "what the container sees agrees: {v}");
        // The slot names the process as NVML does (in the namespace, learned; the agent and
        // nvidia-smi in the container use it).
        let slots = r.slots();
        let host = slots[0].2;
        let nspid = std::fs::read_to_string(format!("/proc/{host}/status")).unwrap();
        let nspid: Vec<String> = nspid
            .lines()
            .find(|l| l.starts_with("NSpid:"))
            .unwrap()
            .split_whitespace()
            .skip(1)
            .map(String::from)
            .collect();
        let want: Vec<String> = if in_namespace { vec![host.to_string(), "1".into()] } else { vec![host.to_string()] };
        assert_eq!((slots.len(), nspid), (1, want), "slot {:?}", slots[0]);
        s.kill(p);
        // In the namespace the process dies after unshare (its parent-death signal): wait for it.
        let r = region(&s);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while r.reap() == 0 && r.used(0) != 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(r.used(0), 0, "nothing left charged once the process is gone");
    }

    // A limit below what the context really holds: said once, and every allocation refused.
    let mut c = s.limited(RT, &[("CUDA_DEVICE_MEMORY_LIMIT_0", "512m")]);
    c.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", s.state.join("small.region"));
    let o = out(&mut c, &["alloc", "--size", "1m"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("CUDA contexts alone hold 640 MiB, more than its 512 MiB limit"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(json1(&o)["error"], "CUDA_ERROR_OUT_OF_MEMORY");

    // Under MPS NVML lists the clients apart, and the server is the one new compute process at a
    // client's first context: no true-up (as with it off).
    let mut s = Sim::new(Some(
        "mps = true\ncontext_overhead_mib = 640\nmodule_overhead_mib = 50\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n",
    ));
    let server = s.state.join("nvidia-cuda-mps-server");
    std::os::unix::fs::symlink(RT, &server).unwrap();
    let (srv, _) = s.spawn(server.to_str().unwrap(), &["alloc", "--size", "100m", "--hold"]);
    let (p, v) = s.spawn_cmd(s.limited(RT, &[limit]), &args);
    assert_eq!(v["allocated"], 1900 * MIB, "{v}");
    assert_eq!(region(&s).used(0), 1964 * MIB);
    s.kill(p);
    s.kill(srv);
}

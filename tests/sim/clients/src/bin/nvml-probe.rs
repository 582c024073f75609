//! Looks at the node through NVML with `nvml-wrapper` (as the agent does) and prints JSON.
//!
//! usage: nvml-probe [--lib PATH] snapshot
//!        nvml-probe [--lib PATH] mig --gpu I OP...
//!   OP: mode:0|1  create:PROFILE[@START]  ci:GI:CIPROFILE  destroy:GI  destroyci:GI:CI
//!       destroy-all  remaining:PROFILE  placements:PROFILE  list  devices
//!        nvml-probe [--lib PATH] events --gpu I [--timeout-ms T]
//!   (registers for XID events, prints {"event":"registered"}, then the first event or a timeout)
//!   Each OP prints {"op", "ret"(NVML code), ...}; MIG calls that nvml-wrapper lacks go through its
//!   raw function table.
//!        nvml-probe [--lib PATH] util --gpu I [--seconds S] [--interval-ms M]
//!   (samples the GPU's utilization for S seconds; prints the mean and the mean SM utilization of
//!   each process seen)
//!        nvml-probe [--lib PATH] smi
//!   (what `nvidia-smi` shows, as text: per GPU its memory, utilization and compute processes)
//!        nvml-probe [--lib PATH] lists [--table-first]
//!   (the PIDs each per-process query names, per GPU, each entry point found by `dlsym` as an
//!   application finds it: the compute, graphics and MPS lists of every version, the detail list
//!   of each mode, both per-process utilization queries, and the lists of NVML's private table that
//!   nvidia-smi uses, "private:213" to "private:215", that table asked for before NVML is
//!   initialised with --table-first; an NVML error as {"error": code})
use nvml_wrapper::bitmasks::InitFlags;
use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings::*;
use serde_json::{json, Value};

fn die(m: &str) -> ! {
    eprintln!("nvml-probe: {m}");
    std::process::exit(2)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut b = Nvml::builder();
    let lib = args.iter().position(|a| a == "--lib").map(|i| {
        let p = args.get(i + 1).cloned().unwrap_or_else(|| die("--lib needs a path"));
        args.drain(i..i + 2);
        std::ffi::OsString::from(p)
    });
    if let Some(l) = &lib {
        b.lib_path(l);
    }
    // `lists --table-first`: the private table asked for before anything initialises NVML.
    if let Some(i) = args.iter().position(|a| a == "--table-first") {
        args.remove(i);
        use std::os::unix::ffi::OsStrExt;
        let path =
            std::ffi::CString::new(lib.as_deref().map(|l| l.as_bytes()).unwrap_or(b"libnvidia-ml.so.1")).unwrap();
        if let Some(get) = entry(&path, "nvmlInternalGetExportTable") {
            let (r, t) = private_table(get);
            let _ = TABLE_FIRST.set((r, t as usize));
        }
    }
    let nvml = b.flags(InitFlags::empty()).init().unwrap_or_else(|e| die(&format!("init: {e}")));
    match args.first().map(String::as_str) {
        Some("snapshot") => println!("{}", snapshot(&nvml)),
        Some("mig") => {
            let g: u32 = args
                .iter()
                .position(|a| a == "--gpu")
                .and_then(|i| args.get(i + 1))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| die("mig needs --gpu I"));
            let ops: Vec<&String> =
                args[1..].iter().filter(|a| !a.starts_with("--") && a.parse::<u32>().is_err()).collect();
            for op in ops {
                println!("{}", mig_op(&nvml, g, op));
            }
        }
        Some("events") => events(&nvml, &args),
        Some("util") => println!("{}", util(&nvml, &args)),
        Some("lists") => println!("{}", lists(&nvml, lib.as_deref())),
        Some("smi") => print!("{}", smi(&nvml)),
        _ => die("usage: nvml-probe [--lib PATH] snapshot | mig --gpu I OP... | events --gpu I [--timeout-ms T] | util --gpu I [--seconds S] [--interval-ms M] | lists | smi"),
    }
}

fn snapshot(nvml: &Nvml) -> Value {
    let n = nvml.device_count().unwrap_or_else(|e| die(&format!("count: {e}")));
    let mut gpus = Vec::new();
    for i in 0..n {
        let d = nvml.device_by_index(i).unwrap_or_else(|e| die(&format!("device {i}: {e}")));
        let mem =
            d.memory_info().map(|m| json!({"total": m.total, "used": m.used, "free": m.free, "reserved": m.reserved}));
        let procs = listed(d.running_compute_processes());
        let mps_procs = listed(d.mps_running_compute_processes());
        let util = d.utilization_rates().map(|u| json!({"gpu": u.gpu, "memory": u.memory}));
        // The GPU utilization samples NVML keeps (nvidia-smi -q -d UTILIZATION), oldest first.
        let samples = d.samples(nvml_wrapper::enum_wrappers::device::Sampling::GpuUtilization, None).map(|v| {
            v.iter()
                .map(|s| match s.value {
                    nvml_wrapper::enums::device::SampleValue::U32(x) => json!(x),
                    ref other => json!(format!("{other:?}")),
                })
                .collect::<Vec<_>>()
        });
        let putil = d
            .process_utilization_stats(None)
            .map(|v| v.iter().map(|s| json!({"pid": s.pid, "sm": s.sm_util, "ts": s.timestamp})).collect::<Vec<_>>());
        let mig = d.mig_mode().map(|m| json!({"current": m.current, "pending": m.pending}));
        let pci = d
            .pci_info()
            .map(|p| json!({"bus_id": p.bus_id, "device_id": p.pci_device_id, "domain": p.domain, "bus": p.bus}));
        let topo: Vec<Value> = (0..n)
            .map(|j| {
                let o = nvml.device_by_index(j).unwrap();
                d.topology_common_ancestor(o).map(|l| json!(format!("{l:?}"))).unwrap_or_else(|e| json!(e.to_string()))
            })
            .collect();
        gpus.push(json!({
            "index": d.index().ok(),
            "uuid": d.uuid().ok(),
            "name": d.name().ok(),
            "pci": pci.ok(),
            "memory": mem.ok(),
            "processes": procs.map_err(|e| e.to_string()),
            "mps_processes": mps_procs.map_err(|e| e.to_string()),
            "utilization": util.ok(),
            "utilization_samples": samples.map_err(|e| e.to_string()),
            "process_utilization": putil.unwrap_or_default(),
            "numa_node": d.numa_node_id().ok(),
            "cpu_affinity": d.cpu_affinity(2).ok(),
            "cc": d.cuda_compute_capability().map(|c| [c.major, c.minor]).ok(),
            "mig_mode": mig.map_err(|e| e.to_string()),
            "max_mig_devices": d.mig_device_count().ok(),
            "topology": topo,
        }));
    }
    json!({"driver_version": nvml.sys_driver_version().ok(), "cuda_version": nvml.sys_cuda_driver_version().ok(), "gpus": gpus})
}

fn mig_op(nvml: &Nvml, g: u32, op: &str) -> Value {
    let lib = nvml.lib();
    let d = nvml.device_by_index(g).unwrap_or_else(|e| die(&format!("device {g}: {e}")));
    // SAFETY: raw NVML calls with a valid device handle and out-pointers to locals.
    let dev = unsafe { d.handle() };
    let parts: Vec<&str> = op.split(':').collect();
    let num = |s: &str| s.parse::<u32>().unwrap_or_else(|_| die(&format!("bad number in {op}")));
    let gi_by_id = |id: u32| -> (nvmlReturn_t, nvmlGpuInstance_t) {
        let mut gi = std::ptr::null_mut();
        // SAFETY: see above.
        let r = unsafe { lib.nvmlDeviceGetGpuInstanceById(dev, id, &mut gi) };
        (r, gi)
    };
    let all_gis = || -> Vec<(u32, u32, u32, u32, nvmlGpuInstance_t)> {
        let mut v = Vec::new();
        for pid in [0u32, 5, 6, 9, 14, 15, 19, 20, 21] {
            let mut arr = [std::ptr::null_mut(); 8];
            let mut n = 0;
            // SAFETY: arr has room for 8 >= any instanceCount.
            if unsafe { lib.nvmlDeviceGetGpuInstances(dev, pid, arr.as_mut_ptr(), &mut n) } == 0 {
                for gi in &arr[..n as usize] {
                    // SAFETY: zeroed POD out-struct.
                    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
                    // SAFETY: a handle NVML just listed and an out-pointer to the local above.
                    unsafe { lib.nvmlGpuInstanceGetInfo(*gi, &mut info) };
                    v.push((info.id, info.profileId, info.placement.start, info.placement.size, *gi));
                }
            }
        }
        v.sort();
        v
    };
    // SAFETY: (all arms) raw calls with handles obtained above and out-pointers to locals.
    unsafe {
        match parts[0] {
            "mode" => {
                let mut st = 0;
                let r = lib.nvmlDeviceSetMigMode(dev, num(parts[1]), &mut st);
                json!({"op": op, "ret": r, "activation": st})
            }
            "create" => {
                let (pid, start) = match parts[1].split_once('@') {
                    Some((p, s)) => (num(p), Some(num(s))),
                    None => (num(parts[1]), None),
                };
                let mut gi = std::ptr::null_mut();
                let r = match start {
                    Some(s) => {
                        // the placement size is the profile's memory slices: ask NVML for it
                        let mut pl = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 8];
                        let mut n = 8;
                        lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, pid, pl.as_mut_ptr(), &mut n);
                        let size = pl.first().map_or(0, |p| p.size);
                        lib.nvmlDeviceCreateGpuInstanceWithPlacement(
                            dev,
                            pid,
                            &nvmlGpuInstancePlacement_t { start: s, size },
                            &mut gi,
                        )
                    }
                    None => lib.nvmlDeviceCreateGpuInstance(dev, pid, &mut gi),
                };
                let mut info: nvmlGpuInstanceInfo_t = std::mem::zeroed();
                if r == 0 {
                    lib.nvmlGpuInstanceGetInfo(gi, &mut info);
                }
                json!({"op": op, "ret": r, "id": info.id, "start": info.placement.start})
            }
            "ci" => {
                let (r0, gi) = gi_by_id(num(parts[1]));
                if r0 != 0 {
                    return json!({"op": op, "ret": r0});
                }
                let mut ci = std::ptr::null_mut();
                let r = lib.nvmlGpuInstanceCreateComputeInstance(gi, num(parts[2]), &mut ci);
                let mut info: nvmlComputeInstanceInfo_t = std::mem::zeroed();
                if r == 0 {
                    lib.nvmlComputeInstanceGetInfo_v2(ci, &mut info);
                }
                json!({"op": op, "ret": r, "id": info.id})
            }
            "destroy" => {
                let (r0, gi) = gi_by_id(num(parts[1]));
                if r0 != 0 {
                    return json!({"op": op, "ret": r0});
                }
                json!({"op": op, "ret": lib.nvmlGpuInstanceDestroy(gi)})
            }
            "destroyci" => {
                let (r0, gi) = gi_by_id(num(parts[1]));
                if r0 != 0 {
                    return json!({"op": op, "ret": r0});
                }
                let mut ci = std::ptr::null_mut();
                let r = lib.nvmlGpuInstanceGetComputeInstanceById(gi, num(parts[2]), &mut ci);
                if r != 0 {
                    return json!({"op": op, "ret": r});
                }
                json!({"op": op, "ret": lib.nvmlComputeInstanceDestroy(ci)})
            }
            "destroy-all" => {
                let mut worst = 0;
                for (_, _, _, _, gi) in all_gis() {
                    for cp in 0..7 {
                        let mut arr = [std::ptr::null_mut(); 8];
                        let mut n = 0;
                        if lib.nvmlGpuInstanceGetComputeInstances(gi, cp, arr.as_mut_ptr(), &mut n) == 0 {
                            for ci in &arr[..n as usize] {
                                worst = worst.max(lib.nvmlComputeInstanceDestroy(*ci));
                            }
                        }
                    }
                    worst = worst.max(lib.nvmlGpuInstanceDestroy(gi));
                }
                json!({"op": op, "ret": worst})
            }
            "remaining" => {
                let mut n = 0;
                let r = lib.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, num(parts[1]), &mut n);
                json!({"op": op, "ret": r, "count": n})
            }
            "placements" => {
                let mut pl = [nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 8];
                let mut n = 8;
                let r = lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, num(parts[1]), pl.as_mut_ptr(), &mut n);
                let v: Vec<_> = pl[..n.min(8) as usize].iter().map(|p| json!([p.start, p.size])).collect();
                json!({"op": op, "ret": r, "placements": v})
            }
            "profile" => {
                let mut info: nvmlGpuInstanceProfileInfo_t = std::mem::zeroed();
                let r = lib.nvmlDeviceGetGpuInstanceProfileInfo(dev, num(parts[1]), &mut info);
                json!({"op": op, "ret": r, "id": info.id, "slices": info.sliceCount, "count": info.instanceCount, "mib": info.memorySizeMB, "sm": info.multiprocessorCount})
            }
            "list" => {
                let v: Vec<_> = all_gis()
                    .iter()
                    .map(|(id, p, s, z, _)| json!({"id": id, "profile_id": p, "start": s, "size": z}))
                    .collect();
                json!({"op": op, "ret": 0, "gpu_instances": v})
            }
            "devices" => {
                let n = d.mig_device_count().unwrap_or(0);
                let v: Vec<_> = (0..n)
                    .filter_map(|i| d.mig_device_by_index(i).ok())
                    .map(|m| json!({"uuid": m.uuid().ok(), "name": m.name().ok(), "memory": m.memory_info().ok().map(|x| x.total),
                        "is_mig": m.mig_is_mig_device_handle().ok()}))
                    .collect();
                json!({"op": op, "ret": 0, "mig_devices": v})
            }
            _ => die(&format!("unknown op {op}")),
        }
    }
}

fn events(nvml: &Nvml, args: &[String]) {
    use nvml_wrapper::bitmasks::event::EventTypes;
    let get = |k: &str, d: u32| {
        args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(d)
    };
    let d = nvml.device_by_index(get("--gpu", 0)).unwrap_or_else(|e| die(&format!("device: {e}")));
    let set = nvml.create_event_set().unwrap_or_else(|e| die(&format!("event set: {e}")));
    let set = d.register_events(EventTypes::CRITICAL_XID_ERROR, set).unwrap_or_else(|e| die(&format!("register: {e}")));
    println!("{}", json!({"event": "registered"}));
    match set.wait(get("--timeout-ms", 5000)) {
        Ok(e) => {
            let xid = match e.event_data {
                Some(nvml_wrapper::enums::event::XidError::Value(v)) => json!(v),
                _ => Value::Null,
            };
            println!("{}", json!({"event": "xid", "xid": xid, "uuid": e.device.uuid().ok()}))
        }
        Err(e) => println!("{}", json!({"event": "error", "error": e.to_string()})),
    }
}

fn arg(args: &[String], name: &str, default: f64) -> f64 {
    match args.iter().position(|a| a == name) {
        None => default,
        Some(i) => {
            args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or_else(|| die(&format!("{name} needs a number")))
        }
    }
}

/// Mean utilization over a window, sampled every interval: the GPU's (`nvmlDeviceGetUtilizationRates`)
/// and each process's SM share (`nvmlDeviceGetProcessUtilization`, samples newer than the last read),
/// and the mean SM clock and power draw where NVML reports them (-1 where it does not).
fn util(nvml: &Nvml, args: &[String]) -> Value {
    let g = arg(args, "--gpu", 0.0) as u32;
    let seconds = arg(args, "--seconds", 3.0);
    let interval = std::time::Duration::from_millis(arg(args, "--interval-ms", 100.0) as u64);
    let d = nvml.device_by_index(g).unwrap_or_else(|e| die(&format!("device {g}: {e}")));
    let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(seconds);
    let (mut sum, mut n) = (0f64, 0u32);
    let (mut clock, mut nc, mut power, mut np) = (0f64, 0u32, 0f64, 0u32);
    let mut per: std::collections::BTreeMap<u32, (f64, u32)> = Default::default();
    let mut last_seen = None;
    while std::time::Instant::now() < end {
        std::thread::sleep(interval);
        if let Ok(u) = d.utilization_rates() {
            sum += u.gpu as f64;
            n += 1;
        }
        if let Ok(mhz) = d.clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM) {
            clock += mhz as f64;
            nc += 1;
        }
        if let Ok(mw) = d.power_usage() {
            power += mw as f64 / 1000.0;
            np += 1;
        }
        if let Ok(ps) = d.process_utilization_stats(last_seen) {
            for p in &ps {
                let e = per.entry(p.pid).or_default();
                e.0 += p.sm_util as f64;
                e.1 += 1;
                last_seen = Some(last_seen.unwrap_or(0).max(p.timestamp));
            }
        }
    }
    let procs: Vec<Value> =
        per.into_iter().map(|(pid, (s, k))| json!({"pid": pid, "sm": s / k as f64, "samples": k})).collect();
    let mean = |s: f64, k: u32| if k > 0 { s / k as f64 } else { -1.0 };
    json!({"gpu": g, "samples": n, "mean_gpu": mean(sum, n), "mean_sm_clock_mhz": mean(clock, nc),
        "mean_power_w": mean(power, np), "processes": procs})
}

/// The entry point `name` of the NVML library, as `dlsym` gives it to an application.
fn entry(lib: &std::ffi::CStr, name: &str) -> Option<*mut std::ffi::c_void> {
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: NUL-terminated strings; the library is already loaded (nvml-wrapper opened it), so
    // this only takes another reference.
    let p = unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW);
        if h.is_null() {
            die(&format!("dlopen {lib:?} failed"));
        }
        libc::dlsym(h, n.as_ptr())
    };
    (!p.is_null()).then_some(p)
}

/// Calls an NVML list query the way applications do: a count query, then a buffer of that size
/// (grown while NVML asks for more). The PIDs of the entries, or NVML's error.
fn pids_of<T: Copy>(mut query: impl FnMut(*mut u32, *mut T) -> nvmlReturn_t, pid: impl Fn(&T) -> u32) -> Value {
    let mut n = 0u32;
    let mut buf: Vec<T> = Vec::new();
    let mut r = query(&mut n, std::ptr::null_mut());
    for _ in 0..4 {
        if r != nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE {
            break;
        }
        // SAFETY: NVML's entries are plain integers; all-zero is a valid value.
        buf.resize(n as usize + 4, unsafe { std::mem::zeroed() });
        n = buf.len() as u32;
        r = query(&mut n, buf.as_mut_ptr());
    }
    match r {
        0 => {
            let mut pids: Vec<u32> = buf.iter().take(n as usize).map(&pid).collect();
            pids.sort_unstable();
            json!(pids)
        }
        e => json!({ "error": e }),
    }
}

fn lists(nvml: &Nvml, lib: Option<&std::ffi::OsStr>) -> Value {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(lib.map(|l| l.as_bytes()).unwrap_or(b"libnvidia-ml.so.1")).unwrap();
    type List<T> = unsafe extern "C" fn(nvmlDevice_t, *mut u32, *mut T) -> nvmlReturn_t;
    let n = nvml.device_count().unwrap_or_else(|e| die(&format!("count: {e}")));
    let mut gpus = Vec::new();
    for i in 0..n {
        let d = nvml.device_by_index(i).unwrap_or_else(|e| die(&format!("device {i}: {e}")));
        // SAFETY: the raw handle, used only while nvml lives.
        let dev = unsafe { d.handle() };
        let mut m = serde_json::Map::new();
        for kind in ["Compute", "Graphics", "MPSCompute"] {
            for v in ["", "_v2", "_v3"] {
                let name = format!("nvmlDeviceGet{kind}RunningProcesses{v}");
                let Some(p) = entry(&path, &name) else { continue };
                let r = if v.is_empty() {
                    // SAFETY: the unversioned lists fill nvmlProcessInfo_v1_t (nvml.h).
                    let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, List<nvmlProcessInfo_v1_t>>(p) };
                    // SAFETY: count and buffer as pids_of passes them.
                    pids_of(|n, b| unsafe { f(dev, n, b) }, |e| e.pid)
                } else {
                    // SAFETY: _v2 and _v3 fill nvmlProcessInfo_t.
                    let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, List<nvmlProcessInfo_t>>(p) };
                    // SAFETY: as above.
                    pids_of(|n, b| unsafe { f(dev, n, b) }, |e| e.pid)
                };
                m.insert(name, r);
            }
        }
        if let Some(p) = entry(&path, "nvmlDeviceGetRunningProcessDetailList") {
            type F = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlProcessDetailList_t) -> nvmlReturn_t;
            // SAFETY: the signature of nvml.h.
            let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, F>(p) };
            for mode in 0..3u32 {
                let q = |n: *mut u32, b: *mut nvmlProcessDetail_v1_t| {
                    let mut l = nvmlProcessDetailList_t {
                        version: std::mem::size_of::<nvmlProcessDetailList_t>() as u32 | 1 << 24,
                        mode,
                        // SAFETY: n is pids_of's count.
                        numProcArrayEntries: unsafe { *n },
                        procArray: b,
                    };
                    // SAFETY: a v1 structure whose array holds numProcArrayEntries entries.
                    let r = unsafe { f(dev, &mut l) };
                    // SAFETY: as above.
                    unsafe { *n = l.numProcArrayEntries };
                    r
                };
                m.insert(format!("detail:{mode}"), pids_of(q, |e| e.pid));
            }
        }
        if let Some(p) = entry(&path, "nvmlDeviceGetProcessUtilization") {
            type F =
                unsafe extern "C" fn(nvmlDevice_t, *mut nvmlProcessUtilizationSample_t, *mut u32, u64) -> nvmlReturn_t;
            // SAFETY: the signature of nvml.h.
            let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, F>(p) };
            // SAFETY: count and buffer as pids_of passes them.
            m.insert("utilization".into(), pids_of(|n, b| unsafe { f(dev, b, n, 0) }, |e| e.pid));
        }
        if let Some(p) = entry(&path, "nvmlDeviceGetProcessesUtilizationInfo") {
            type F = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlProcessesUtilizationInfo_t) -> nvmlReturn_t;
            // SAFETY: the signature of nvml.h.
            let f = unsafe { std::mem::transmute::<*mut std::ffi::c_void, F>(p) };
            let q = |n: *mut u32, b: *mut nvmlProcessUtilizationInfo_v1_t| {
                let mut i = nvmlProcessesUtilizationInfo_t {
                    version: std::mem::size_of::<nvmlProcessesUtilizationInfo_t>() as u32 | 1 << 24,
                    // SAFETY: n is pids_of's count.
                    processSamplesCount: unsafe { *n },
                    lastSeenTimeStamp: 0,
                    procUtilArray: b,
                };
                // SAFETY: a v1 structure whose array holds processSamplesCount entries.
                let r = unsafe { f(dev, &mut i) };
                // SAFETY: as above.
                unsafe { *n = i.processSamplesCount };
                r
            };
            m.insert("utilization_info".into(), pids_of(q, |e| e.pid));
        }
        if let Some(p) = entry(&path, "nvmlInternalGetExportTable") {
            private_lists(p, dev, &mut m);
        }
        gpus.push(json!({ "index": i, "lists": m }));
    }
    json!({ "gpus": gpus })
}

/// (NVML's answer, the table's address) of `nvmlInternalGetExportTable` (`get`) for the process
/// lists' GUID.
fn private_table(get: *mut std::ffi::c_void) -> (nvmlReturn_t, *const usize) {
    const GUID: [u8; 16] =
        [0xc4, 0xfe, 0x3e, 0x6c, 0xc9, 0x8f, 0x6c, 0x4e, 0xa3, 0x27, 0xee, 0x69, 0x6e, 0x12, 0xf7, 0xc4];
    type Get = unsafe extern "C" fn(*mut *const usize, *const u8) -> nvmlReturn_t;
    // SAFETY: the signature the symbol has (a table out-pointer and the GUID's bytes).
    let get = unsafe { std::mem::transmute::<*mut std::ffi::c_void, Get>(get) };
    let mut t: *const usize = std::ptr::null();
    // SAFETY: an out-pointer to a local and 16 bytes.
    let r = unsafe { get(&mut t, GUID.as_ptr()) };
    (r, t)
}

/// The private table as asked for before NVML was initialised (`lists --table-first`).
static TABLE_FIRST: std::sync::OnceLock<(nvmlReturn_t, usize)> = std::sync::OnceLock::new();

/// The process lists of NVML's private table that `nvidia-smi` lists processes through (entries
/// 213-215 of the table `nvmlInternalGetExportTable` gives for its GUID; each entry of a list
/// 4128 bytes, the PID first), asked as `nvidia-smi` asks them: one call with room for 250.
fn private_lists(get: *mut std::ffi::c_void, dev: nvmlDevice_t, m: &mut serde_json::Map<String, Value>) {
    const ENTRY: usize = 4128;
    const ROOM: u32 = 250;
    type List = unsafe extern "C" fn(nvmlDevice_t, *mut u32, *mut u8) -> nvmlReturn_t;
    // The table asked for before NVML was initialised (`--table-first`), or now.
    let (r, t) = match TABLE_FIRST.get() {
        Some(&(r, t)) => (r, t as *const usize),
        None => private_table(get),
    };
    // SAFETY: NVML gave a table whose first word is its size in bytes.
    if r != 0 || t.is_null() || unsafe { *t } < 216 * std::mem::size_of::<usize>() {
        m.insert("private".into(), json!({ "error": r }));
        return;
    }
    for slot in 213..216 {
        // SAFETY: within the table's size (checked above); the entry is a function of that shape.
        let f = unsafe { std::mem::transmute::<usize, List>(*t.add(slot)) };
        // Room for ROOM entries, and as much again should an entry be larger than known.
        let mut buf = vec![0u8; ROOM as usize * ENTRY * 2];
        let mut n = ROOM;
        // SAFETY: a count and an array of that many entries.
        let r = unsafe { f(dev, &mut n, buf.as_mut_ptr()) };
        let v = if r == 0 && n <= ROOM {
            let mut pids: Vec<u32> = (0..n as usize)
                .map(|k| u32::from_ne_bytes(buf[k * ENTRY..k * ENTRY + 4].try_into().unwrap()))
                .collect();
            pids.sort_unstable();
            json!(pids)
        } else {
            json!({ "error": r, "count": n })
        };
        m.insert(format!("private:{slot}"), v);
    }
}

/// The part of `nvidia-smi`'s default view that a container's slice changes: per GPU its memory,
/// GPU-Util and compute processes.
fn smi(nvml: &Nvml) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let n = nvml.device_count().unwrap_or_else(|e| die(&format!("count: {e}")));
    for i in 0..n {
        let d = nvml.device_by_index(i).unwrap_or_else(|e| die(&format!("device {i}: {e}")));
        let mem =
            d.memory_info().map_or("memory: ?".into(), |m| format!("{} MiB / {} MiB", m.used >> 20, m.total >> 20));
        let util = d.utilization_rates().map_or("?".into(), |u| format!("{} %", u.gpu));
        let _ = writeln!(out, "GPU {i} {}: {mem}, GPU-Util {util}", d.name().unwrap_or_default());
        for p in d.running_compute_processes().unwrap_or_default() {
            let used = match p.used_gpu_memory {
                nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => format!("{} MiB", b >> 20),
                nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => "N/A".into(),
            };
            let _ = writeln!(out, "    process {:>7}  {used}", p.pid);
        }
    }
    out
}

/// A process list as JSON: each process's PID and memory (null where NVML has no figure).
fn listed(
    r: Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, nvml_wrapper::error::NvmlError>,
) -> Result<Vec<Value>, nvml_wrapper::error::NvmlError> {
    r.map(|ps| {
        ps.iter()
            .map(|p| {
                json!({"pid": p.pid, "used": match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => json!(b),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => Value::Null,
                }})
            })
            .collect()
    })
}

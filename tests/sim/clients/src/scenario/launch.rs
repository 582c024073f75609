//! The launch scenario: every launch path, on threads or devices, kernels that change.

use super::*;

/// Launch kernels on one path (simulator kernels: sleep_<N><unit>, wave_<N><unit>, param_ns).
#[derive(Args, Debug)]
pub struct LaunchArgs {
    #[arg(long, default_value = "1", value_parser = size)]
    pub threads: u64,
    #[arg(long)]
    pub devices: Option<String>,
    #[arg(long, default_value = "10", value_parser = size)]
    pub count: u64,
    #[arg(long, default_value = "10", value_parser = size)]
    pub nodes: u64,
    #[arg(long, default_value = "1", value_parser = size)]
    pub grid: u64,
    #[arg(long, default_value = "128", value_parser = size)]
    pub block: u64,
    #[arg(long, default_value = "1000000", value_parser = size)]
    pub duration_ns: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub ramp_ppm: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub regraph_after: u64,
    #[arg(long, default_value = "10", value_parser = size)]
    pub regraph_factor: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub reload_after: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub restream_after: u64,
    #[arg(long, default_value = "1", value_parser = size)]
    pub sync_every: u64,
    #[arg(long)]
    pub no_timing: bool,
    #[arg(long)]
    pub abandon_capture: bool,
    #[arg(long)]
    pub abandon_capture_context: bool,
    #[arg(long, default_value = "sleep_1ms")]
    pub kernel: String,
    #[arg(long, default_value = "kernel")]
    pub path: String,
    #[arg(long, default_value = "update")]
    pub regraph_how: String,
    #[arg(long, default_value = "")]
    pub reload_kernel: String,
    #[arg(long, default_value = "unload")]
    pub reload_how: String,
    #[arg(long, default_value = "module")]
    pub loader: String,
    #[arg(long)]
    pub seconds: Option<f64>,
    #[arg(long)]
    pub grids: Option<String>,
    #[arg(long)]
    pub stream_on: Option<String>,
}

pub(super) fn launch(api: &Api, dev: i32, a: &LaunchArgs) -> Res<()> {
    if let Some(list) = a.devices.as_ref() {
        // A thread per device, each with its device's primary context current (one process driving
        // several GPUs, as a model split across them is).
        let devs: Vec<i32> = list
            .split(',')
            .map(|d| d.parse().map_err(|_| format!("--devices: bad device {d:?}")))
            .collect::<Res<_>>()?;
        let results: Vec<Res<Value>> = std::thread::scope(|s| {
            let hs: Vec<_> = devs
                .iter()
                .map(|&d| {
                    s.spawn(move || {
                        setup(api, d)?;
                        launch_one(api, a, d)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into()))).collect()
        });
        let mut per_device = Vec::new();
        for r in results {
            per_device.push(r?["kernels"].as_u64().unwrap_or(0));
        }
        emit(json!({"event": "launched", "devices": devs, "kernels": per_device}));
        return Ok(());
    }
    setup(api, dev)?;
    let threads = a.threads.max(1);
    if threads > 1 {
        let ctx = {
            let mut c = std::ptr::null_mut();
            // SAFETY: out-pointer to a local.
            unsafe { ck(api, (api.cuDevicePrimaryCtxRetain)(&mut c, dev), "cuDevicePrimaryCtxRetain")? };
            c as usize
        };
        let results: Vec<Res<Value>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(move || {
                        // SAFETY: the primary context handle is valid for the process.
                        unsafe { ck(api, (api.cuCtxSetCurrent)(ctx as CUcontext), "cuCtxSetCurrent")? };
                        launch_one(api, a, dev)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into()))).collect()
        });
        let mut total = 0;
        for r in results {
            total += r?["kernels"].as_u64().unwrap_or(0);
        }
        emit(json!({"event": "launched", "threads": threads, "kernels": total}));
        return Ok(());
    }
    let v = launch_one(api, a, dev)?;
    emit(v);
    Ok(())
}

pub(super) fn launch_one(api: &Api, a: &LaunchArgs, dev: i32) -> Res<Value> {
    let kernel = a.kernel.as_str();
    let path = a.path.as_str();
    let count = a.count;
    let seconds = a.seconds;
    let nodes = a.nodes as usize;
    let grid = a.grid as u32;
    // --grids G1,G2,...: one launch with each in turn (kernels whose duration follows the grid).
    let grids: Vec<u32> = match a.grids.as_ref() {
        Some(v) => {
            v.split(',').map(|g| g.parse().map_err(|_| format!("--grids: bad grid {g:?}"))).collect::<Res<_>>()?
        }
        None => vec![grid],
    };
    let block = a.block as u32;
    let mut dur = a.duration_ns;
    // --ramp-ppm R: `param_ns` kernels grow by R parts per million each launch (a decode step's
    // attention as the context grows).
    let ramp_ppm = a.ramp_ppm;
    let regraph_after = a.regraph_after;
    let factor = a.regraph_factor.max(1);
    let how = a.regraph_how.as_str();
    const HOWS: [&str; 8] =
        ["update", "update-v1", "reinstantiate", "set-params", "set-params-v1", "node-params", "child", "enable"];
    if regraph_after > 0 && (path != "graph" || !HOWS.contains(&how)) {
        return Err(format!("--regraph-after needs --path graph and --regraph-how one of {HOWS:?}"));
    }
    // The enabled share of the nodes (see --regraph-how enable).
    let built = if regraph_after > 0 && how == "enable" { nodes * factor as usize } else { nodes };
    let mut dur2 = dur * factor;
    let reload_after = a.reload_after;
    let reload_kernel = CString::new(a.reload_kernel.as_str()).map_err(|e| e.to_string())?;
    let reload_how = a.reload_how.as_str();
    let library = match a.loader.as_str() {
        "module" => false,
        "library" => true,
        l => return Err(format!("--loader {l:?}: module or library")),
    };
    if reload_after > 0 && (path != "kernel" || reload_kernel.is_empty() || !["unload", "reset"].contains(&reload_how))
    {
        return Err("--reload-after needs --path kernel, --reload-kernel and --reload-how unload or reset".into());
    }
    let stream_on: Option<i32> = match a.stream_on.as_ref() {
        Some(d) => Some(d.parse().map_err(|_| format!("--stream-on {d:?}: a device ordinal"))?),
        None => None,
    };
    if stream_on.is_some() && (!library || path != "kernel") {
        return Err(
            "--stream-on needs --loader library and --path kernel (a CUkernel launches on any context's stream)".into(),
        );
    }
    let restream_after = a.restream_after;
    if restream_after > 0 && (stream_on.is_none() || seconds.is_none()) {
        return Err("--restream-after needs --stream-on and --seconds".into());
    }
    let image = b"vgpu-sim module\0";
    let start_wall = std::time::Instant::now();
    // SAFETY: calls through the table with out-pointers to locals; kernel parameters point to `dur`,
    // which outlives every launch (they are synchronised before return).
    unsafe {
        // A module (or library) and its kernel `name`.
        let load = |name: &CString| -> Res<(CUmodule, CUfunction)> {
            let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
            let code = image.as_ptr() as *const c_void;
            let (opts, values) = (std::ptr::null_mut(), std::ptr::null_mut());
            if library {
                let r = (api.cuLibraryLoadData)(&mut m, code, opts, values, 0, opts, values, 0);
                ck(api, r, "cuLibraryLoadData")?;
                ck(api, (api.cuLibraryGetKernel)(&mut f, m, name.as_ptr()), "cuLibraryGetKernel")?;
            } else {
                ck(api, (api.cuModuleLoadData)(&mut m, code), "cuModuleLoadData")?;
                ck(api, (api.cuModuleGetFunction)(&mut f, m, name.as_ptr()), "cuModuleGetFunction")?;
            }
            Ok((m, f))
        };
        let cname = CString::new(kernel).map_err(|e| e.to_string())?;
        let (m, f) = load(&cname)?;
        let mut s = std::ptr::null_mut();
        // --stream-on D: the stream (and the events that time it) in device D's primary context,
        // this device's current again for the launches.
        if let Some(other) = stream_on {
            setup(api, other)?;
        }
        // The deprecated cuLaunch and cuLaunchGrid run on the default stream.
        if path != "legacy-default" {
            ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate")?;
        }
        let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
        // --no-timing: no events of the run's own (a test that makes event calls fail).
        let timing = !a.no_timing;
        if timing {
            ck(api, (api.cuEventCreate)(&mut e0, 0), "cuEventCreate")?;
            ck(api, (api.cuEventCreate)(&mut e1, 0), "cuEventCreate")?;
        }
        if a.abandon_capture {
            // A capture begun on a stream of its own, which is destroyed instead of ending it (an
            // error path): the capture goes with the stream.
            let mut c = std::ptr::null_mut();
            ck(api, (api.cuStreamCreate)(&mut c, 0), "cuStreamCreate")?;
            ck(api, (api.cuStreamBeginCapture_v2)(c, 0), "cuStreamBeginCapture")?;
            ck(api, (api.cuStreamDestroy_v2)(c), "cuStreamDestroy")?;
        }
        if a.abandon_capture_context {
            // The same on a stream of a context of its own, which is destroyed instead (the capture
            // goes with the context), the primary context current again.
            let (mut d, mut c, mut cs) = (0, std::ptr::null_mut(), std::ptr::null_mut());
            ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
            ck(api, (api.cuCtxCreate_v2)(&mut c, 0, d), "cuCtxCreate")?;
            ck(api, (api.cuStreamCreate)(&mut cs, 0), "cuStreamCreate")?;
            ck(api, (api.cuStreamBeginCapture_v2)(cs, 0), "cuStreamBeginCapture")?;
            ck(api, (api.cuCtxDestroy_v2)(c), "cuCtxDestroy")?;
            setup(api, dev)?;
        }
        if stream_on.is_some() {
            setup(api, dev)?;
        }
        let mut arg: *mut c_void = &mut dur as *mut u64 as *mut c_void;
        let params: *mut *mut c_void = &mut arg;
        let mut arg2: *mut c_void = &mut dur2 as *mut u64 as *mut c_void;
        let params2: *mut *mut c_void = &mut arg2;
        let node_params = |params: *mut *mut c_void| CUDA_KERNEL_NODE_PARAMS_v2 {
            func: f,
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            kernelParams: params,
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        // A graph of `k` kernel nodes with these parameters, and its nodes.
        let build = |params: *mut *mut c_void, k: usize| -> Res<(CUgraph, Vec<CUgraphNode>)> {
            let mut g = std::ptr::null_mut();
            ck(api, (api.cuGraphCreate)(&mut g, 0), "cuGraphCreate")?;
            let np = node_params(params);
            let mut ns = Vec::with_capacity(k);
            for _ in 0..k {
                let mut n = std::ptr::null_mut();
                ck(api, (api.cuGraphAddKernelNode_v2)(&mut n, g, std::ptr::null(), 0, &np), "cuGraphAddKernelNode")?;
                ns.push(n);
            }
            Ok((g, ns))
        };
        // A graph of `k` child-graph nodes, each a graph of one kernel node with these parameters.
        let build_children = |params: *mut *mut c_void, k: usize| -> Res<(CUgraph, Vec<CUgraphNode>)> {
            let (child, _) = build(params, 1)?;
            let mut g = std::ptr::null_mut();
            ck(api, (api.cuGraphCreate)(&mut g, 0), "cuGraphCreate")?;
            let mut ns = Vec::with_capacity(k);
            for _ in 0..k {
                let mut n = std::ptr::null_mut();
                let r = (api.cuGraphAddChildGraphNode)(&mut n, g, std::ptr::null(), 0, child);
                ck(api, r, "cuGraphAddChildGraphNode")?;
                ns.push(n);
            }
            Ok((g, ns))
        };
        let mut exec = std::ptr::null_mut();
        let mut graph_nodes = Vec::new();
        let per_launch = match path {
            "graph" | "capture" => {
                let mut g = std::ptr::null_mut();
                if path == "graph" {
                    (g, graph_nodes) = if regraph_after > 0 && how == "child" {
                        build_children(params, nodes)?
                    } else {
                        build(params, built)?
                    };
                } else {
                    ck(api, (api.cuStreamBeginCapture_v2)(s, 0), "cuStreamBeginCapture")?;
                    for _ in 0..nodes {
                        ck(
                            api,
                            (api.cuLaunchKernel)(f, grid, 1, 1, block, 1, 1, 0, s, params, std::ptr::null_mut()),
                            "cuLaunchKernel (capturing)",
                        )?;
                    }
                    ck(api, (api.cuStreamEndCapture)(s, &mut g), "cuStreamEndCapture")?;
                }
                ck(api, (api.cuGraphInstantiateWithFlags)(&mut exec, g, 0), "cuGraphInstantiate")?;
                for &n in graph_nodes.iter().skip(nodes) {
                    ck(api, (api.cuGraphNodeSetEnabled)(exec, n, 0), "cuGraphNodeSetEnabled")?;
                }
                nodes as u64
            }
            "kernel" | "ex" | "coop" => 1,
            "legacy" | "legacy-default" => {
                ck(api, (api.cuFuncSetBlockShape)(f, block as i32, 1, 1), "cuFuncSetBlockShape")?;
                ck(api, (api.cuParamSetv)(f, 0, &mut dur as *mut u64 as *mut c_void, 8), "cuParamSetv")?;
                ck(api, (api.cuParamSetSize)(f, 8), "cuParamSetSize")?;
                1
            }
            p => return Err(format!("unknown launch path {p:?}")),
        };
        let mut n = 0u64;
        let dur_p = arg as *mut u64;
        // The graph's work changes as --regraph-how says (each node F times longer, or F times as
        // many nodes).
        let regraph = |exec: &mut CUgraphExec| -> CUresult {
            let np = node_params(params2);
            let each = |r: &mut dyn FnMut(CUgraphNode) -> CUresult| {
                graph_nodes.iter().map(|&n| r(n)).find(|&x| x != CUresult::SUCCESS).unwrap_or(CUresult::SUCCESS)
            };
            match how {
                "update" | "update-v1" | "reinstantiate" => {
                    let Ok((g2, _)) = build(params2, nodes) else { return CUresult::UNKNOWN };
                    match how {
                        "update" => {
                            let mut info = CUgraphExecUpdateResultInfo {
                                result: -1,
                                errorNode: std::ptr::null_mut(),
                                errorFromNode: std::ptr::null_mut(),
                            };
                            (api.cuGraphExecUpdate_v2)(*exec, g2, &mut info)
                        }
                        "update-v1" => {
                            let (mut node, mut result) = (std::ptr::null_mut(), -1);
                            (api.cuGraphExecUpdate)(*exec, g2, &mut node, &mut result)
                        }
                        _ => match (api.cuGraphExecDestroy)(*exec) {
                            CUresult::SUCCESS => (api.cuGraphInstantiateWithFlags)(exec, g2, 0),
                            e => e,
                        },
                    }
                }
                "set-params" => each(&mut |n| (api.cuGraphExecKernelNodeSetParams_v2)(*exec, n, &np)),
                "set-params-v1" => {
                    let v1 = CUDA_KERNEL_NODE_PARAMS {
                        func: np.func,
                        gridDimX: np.gridDimX,
                        gridDimY: 1,
                        gridDimZ: 1,
                        blockDimX: np.blockDimX,
                        blockDimY: 1,
                        blockDimZ: 1,
                        sharedMemBytes: 0,
                        kernelParams: np.kernelParams,
                        extra: std::ptr::null_mut(),
                    };
                    each(&mut |n| (api.cuGraphExecKernelNodeSetParams)(*exec, n, &v1))
                }
                "node-params" => {
                    let mut p = CUgraphNodeParams {
                        type_: CU_GRAPH_NODE_TYPE_KERNEL,
                        reserved0: [0; 3],
                        u: CUgraphNodeParamsUnion { reserved1: [0; 29] },
                        reserved2: 0,
                    };
                    p.u.kernel = np;
                    each(&mut |n| (api.cuGraphExecNodeSetParams)(*exec, n, &mut p))
                }
                "child" => {
                    let Ok((child, _)) = build(params2, 1) else { return CUresult::UNKNOWN };
                    each(&mut |n| (api.cuGraphExecChildGraphNodeSetParams)(*exec, n, child))
                }
                _ => each(&mut |n| (api.cuGraphNodeSetEnabled)(*exec, n, 1)),
            }
        };
        let (mut fk, mut module) = (f, m);
        // The events that time the run. A reset destroys them with the context's other objects:
        // new ones then time what runs after it.
        let events = std::cell::Cell::new((e0, e1));
        // The stream launched into (--restream-after replaces it).
        let cur = std::cell::Cell::new(s);
        let mut one = || -> CUresult {
            let s = cur.get();
            let grid = grids[n as usize % grids.len()];
            if restream_after > 0 && n == restream_after {
                // The stream goes, and one of this device's context takes its place (which the
                // simulated driver, as a real one may, gives the freed handle).
                let mut s2 = std::ptr::null_mut();
                for r in [(api.cuStreamSynchronize)(s), (api.cuStreamDestroy_v2)(s), (api.cuStreamCreate)(&mut s2, 0)] {
                    if r != CUresult::SUCCESS {
                        return r;
                    }
                }
                cur.set(s2);
            }
            let s = cur.get();
            if reload_after > 0 && n == reload_after {
                // A reset takes the context's modules and events with it. (The simulated driver
                // keeps the context's streams, which a real one would also destroy.)
                let r = match reload_how {
                    "reset" => (api.cuDevicePrimaryCtxReset_v2)(dev),
                    _ if library => (api.cuLibraryUnload)(module),
                    _ => (api.cuModuleUnload)(module),
                };
                if r != CUresult::SUCCESS {
                    return r;
                }
                match load(&reload_kernel) {
                    Ok(x) => (module, fk) = x,
                    Err(_) => return CUresult::UNKNOWN,
                }
                if reload_how == "reset" {
                    let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
                    for r in [(api.cuEventCreate)(&mut a, 0), (api.cuEventCreate)(&mut b, 0), (api.cuEventRecord)(a, s)]
                    {
                        if r != CUresult::SUCCESS {
                            return r;
                        }
                    }
                    events.set((a, b));
                }
            }
            if regraph_after > 0 && n == regraph_after {
                let r = regraph(&mut exec);
                if r != CUresult::SUCCESS {
                    return r;
                }
            }
            n += 1;
            if ramp_ppm > 0 && n > 1 {
                *dur_p += (*dur_p * ramp_ppm).div_ceil(1_000_000);
            }
            match path {
                "kernel" => (api.cuLaunchKernel)(fk, grid, 1, 1, block, 1, 1, 0, s, params, std::ptr::null_mut()),
                "ex" => {
                    let cfg = CUlaunchConfig {
                        gridDimX: grid,
                        gridDimY: 1,
                        gridDimZ: 1,
                        blockDimX: block,
                        blockDimY: 1,
                        blockDimZ: 1,
                        sharedMemBytes: 0,
                        hStream: s,
                        attrs: std::ptr::null_mut(),
                        numAttrs: 0,
                    };
                    (api.cuLaunchKernelEx)(&cfg, f, params, std::ptr::null_mut())
                }
                "coop" => (api.cuLaunchCooperativeKernel)(f, grid, 1, 1, block, 1, 1, 0, s, params),
                "legacy" => (api.cuLaunchGridAsync)(f, grid as i32, 1, s),
                // Alternately the two forms without a stream (cuLaunch is a 1 x 1 grid).
                "legacy-default" if grid == 1 && n.is_multiple_of(2) => (api.cuLaunch)(f),
                "legacy-default" => (api.cuLaunchGrid)(f, grid as i32, 1),
                _ => (api.cuGraphLaunch)(exec, s),
            }
        };
        if timing {
            ck(api, (api.cuEventRecord)(e0, s), "cuEventRecord")?;
        }
        let mut launches = 0u64;
        match seconds {
            Some(secs) => {
                let every = a.sync_every.max(1);
                let end = std::time::Instant::now() + std::time::Duration::from_secs_f64(secs);
                while std::time::Instant::now() < end {
                    ck(api, one(), "launch")?;
                    launches += 1;
                    if launches.is_multiple_of(every) {
                        ck(api, (api.cuStreamSynchronize)(cur.get()), "cuStreamSynchronize")?;
                    }
                }
            }
            None => {
                for _ in 0..count {
                    ck(api, one(), "launch")?;
                    launches += 1;
                }
            }
        }
        let mut ms = 0f32;
        let (e0, e1) = events.get();
        if restream_after > 0 && launches > restream_after || !timing {
            // The events are the first stream's context's (or there are none): no GPU time is reported.
            ck(api, (api.cuStreamSynchronize)(cur.get()), "cuStreamSynchronize")?;
        } else {
            ck(api, (api.cuEventRecord)(e1, s), "cuEventRecord")?;
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            ck(api, (api.cuEventElapsedTime)(&mut ms, e0, e1), "cuEventElapsedTime")?;
        }
        Ok(json!({"event": "launched", "pid": std::process::id(), "path": path, "launches": launches,
            "kernels": launches * per_launch, "gpu_ms": ms, "wall_ms": start_wall.elapsed().as_secs_f64() * 1e3}))
    }
}

//! Graphs that allocate (graph memory nodes) and two launched at once.

use super::*;

/// Graphs that allocate in graph memory nodes, launched, destroyed and trimmed.
#[derive(Args, Debug)]
pub struct GraphMemArgs {
    #[arg(long, default_value = "256m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub alloc: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub peer_size: u64,
    #[arg(long, default_value = "1", value_parser = size)]
    pub graphs: u64,
    #[arg(long, default_value = "2", value_parser = size)]
    pub launches: u64,
    #[arg(long)]
    pub keep: bool,
    #[arg(long)]
    pub upload: bool,
    #[arg(long)]
    pub destroy: bool,
    #[arg(long)]
    pub trim: bool,
    #[arg(long)]
    pub reset: bool,
    #[arg(long)]
    pub hold: bool,
    #[arg(long, default_value = "explicit")]
    pub how: String,
    #[arg(long, default_value = "flags")]
    pub instantiate: String,
}

/// Two graphs that allocate, launched at once.
#[derive(Args, Debug)]
pub struct GraphRaceArgs {
    #[arg(long, default_value = "500m", value_parser = size)]
    pub size: u64,
}

/// See USAGE: graphs that allocate, launched under whatever limit the environment sets.
pub(super) fn graph_mem(api: &Api, dev: i32, a: &GraphMemArgs) -> Res<()> {
    let ctx = setup(api, dev)?;
    let how = a.how.as_str();
    let size = a.size as usize;
    let keep = a.keep;
    let inst = a.instantiate.as_str();
    let probe = a.alloc as usize;
    let peer_size = a.peer_size as usize;
    if !matches!(how, "explicit" | "capture") || !matches!(inst, "flags" | "params" | "upload") {
        return Err(format!("graph-mem: --how {how:?} --instantiate {inst:?}?\n{USAGE}"));
    }
    if peer_size > 0 && how != "explicit" {
        return Err(format!("graph-mem: --peer-size needs --how explicit\n{USAGE}"));
    }
    // SAFETY: (the whole function) calls through the bound table with out-pointers to locals and
    // parameter blocks built here; handles are the driver's.
    unsafe {
        let (d, s) = device_and_stream(api, dev)?;
        // The next device, with its primary context, when the graphs allocate there too.
        let peer = if peer_size > 0 {
            let mut p = 0;
            ck(api, (api.cuDeviceGet)(&mut p, dev + 1), "cuDeviceGet (peer)")?;
            let mut c = std::ptr::null_mut();
            ck(api, (api.cuDevicePrimaryCtxRetain)(&mut c, p), "cuDevicePrimaryCtxRetain (peer)")?;
            Some((p, c))
        } else {
            None
        };
        // Runs `f` with the peer's context current.
        let on_peer = |f: &dyn Fn() -> Value| -> Value {
            let Some((_, c)) = peer else { return Value::Null };
            (api.cuCtxSetCurrent)(c);
            let v = f();
            (api.cuCtxSetCurrent)(ctx);
            v
        };
        let pool = |d: CUdevice| graph_pool(api, d);
        let report = |step: &str, r: CUresult, more: Value| {
            let mut v = json!({"event": "graph-mem", "step": step, "result": error_name(api, r),
                "mem_info": mem_info(api), "pool": pool(d)});
            if let (Some(m), Value::Object(x)) = (v.as_object_mut(), more) {
                m.extend(x);
            }
            if let (Some(m), Some((p, _))) = (v.as_object_mut(), peer) {
                m.insert("peer_pool".into(), pool(p));
                m.insert("peer_mem_info".into(), on_peer(&|| mem_info(api)));
            }
            emit(v);
        };
        let (mut execs, mut ptrs) = (Vec::new(), Vec::new());
        for i in 0..a.graphs.max(1) {
            let mut g = std::ptr::null_mut();
            let mut ptr: CUdeviceptr = 0;
            if how == "explicit" {
                ck(api, (api.cuGraphCreate)(&mut g, 0), "cuGraphCreate")?;
                // An allocation node of `bytes` on `device` in `g`, with a free node after it unless
                // the memory is kept; its address.
                let alloc_node = |device: CUdevice, bytes: usize, free: bool| -> Res<CUdeviceptr> {
                    let mut p = CUDA_MEM_ALLOC_NODE_PARAMS {
                        poolProps: CUmemPoolProps::device(device),
                        accessDescs: std::ptr::null(),
                        accessDescCount: 0,
                        bytesize: bytes,
                        dptr: 0,
                    };
                    let mut n = std::ptr::null_mut();
                    ck(
                        api,
                        (api.cuGraphAddMemAllocNode)(&mut n, g, std::ptr::null(), 0, &mut p),
                        "cuGraphAddMemAllocNode",
                    )?;
                    if free {
                        let mut f = std::ptr::null_mut();
                        ck(api, (api.cuGraphAddMemFreeNode)(&mut f, g, &n, 1, p.dptr), "cuGraphAddMemFreeNode")?;
                    }
                    Ok(p.dptr)
                };
                ptr = alloc_node(d, size, !keep)?;
                if let Some((pd, _)) = peer {
                    alloc_node(pd, peer_size, true)?;
                }
            } else {
                ck(api, (api.cuStreamBeginCapture_v2)(s, 0), "cuStreamBeginCapture")?;
                let r = (api.cuMemAllocAsync)(&mut ptr, size, s);
                if r == CUresult::SUCCESS && !keep {
                    ck(api, (api.cuMemFreeAsync)(ptr, s), "cuMemFreeAsync (captured)")?;
                }
                ck(api, (api.cuStreamEndCapture)(s, &mut g), "cuStreamEndCapture")?;
                report("captured", r, json!({"graph": i}));
                ck(api, r, "cuMemAllocAsync (captured)")?;
            }
            let mut e = std::ptr::null_mut();
            let r = if inst == "flags" {
                (api.cuGraphInstantiateWithFlags)(&mut e, g, 0)
            } else {
                let flags = if inst == "upload" { CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD } else { 0 };
                let mut p = CUDA_GRAPH_INSTANTIATE_PARAMS {
                    flags,
                    hUploadStream: s,
                    hErrNode_out: std::ptr::null_mut(),
                    result_out: 0,
                };
                (api.cuGraphInstantiateWithParams)(&mut e, g, &mut p)
            };
            report("instantiated", r, json!({"graph": i}));
            if r == CUresult::SUCCESS {
                execs.push(e);
                ptrs.push(ptr);
            }
        }
        if a.upload {
            for (i, &e) in execs.iter().enumerate() {
                report("uploaded", (api.cuGraphUpload)(e, s), json!({"graph": i}));
            }
        }
        for round in 0..a.launches {
            for (i, &e) in execs.iter().enumerate() {
                let r = (api.cuGraphLaunch)(e, s);
                ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
                report("launched", r, json!({"graph": i, "round": round}));
                if keep && r == CUresult::SUCCESS {
                    ck(api, (api.cuMemFreeAsync)(ptrs[i], s), "cuMemFreeAsync")?;
                }
            }
        }
        let try_alloc = |step: &str| {
            let mut p = 0;
            let r = (api.cuMemAlloc_v2)(&mut p, probe);
            report(step, r, json!({"bytes": probe}));
            if r == CUresult::SUCCESS {
                (api.cuMemFree_v2)(p);
            }
            if peer.is_some() {
                let r = on_peer(&|| {
                    let mut p = 0;
                    let r = (api.cuMemAlloc_v2)(&mut p, probe);
                    if r == CUresult::SUCCESS {
                        (api.cuMemFree_v2)(p);
                    }
                    json!(error_name(api, r))
                });
                emit(json!({"event": "graph-mem", "step": format!("peer-{step}"), "result": r, "bytes": probe}));
            }
        };
        if probe > 0 {
            try_alloc("alloc");
        }
        if a.destroy {
            for &e in &execs {
                ck(api, (api.cuGraphExecDestroy)(e), "cuGraphExecDestroy")?;
            }
            report("destroyed", CUresult::SUCCESS, json!({}));
        }
        if a.trim {
            if let Some((p, _)) = peer {
                ck(api, (api.cuDeviceGraphMemTrim)(p), "cuDeviceGraphMemTrim (peer)")?;
            }
            report("trimmed", (api.cuDeviceGraphMemTrim)(d), json!({}));
            if probe > 0 {
                try_alloc("alloc-after-trim");
            }
        }
        if a.reset {
            // What cudaDeviceReset does: the context goes, and the graph pool with it.
            ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")?;
            setup(api, dev)?;
            report("reset", CUresult::SUCCESS, json!({}));
            if probe > 0 {
                try_alloc("alloc-after-reset");
            }
        }
    }
    if a.hold {
        emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
        hold_forever();
    }
    Ok(())
}

/// What device `d`'s graph memory pool holds (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), or the
/// driver's error.
pub(super) fn graph_pool(api: &Api, d: CUdevice) -> Value {
    let mut v = 0u64;
    // SAFETY: the attribute is a 64-bit value, written to a local.
    let r = unsafe {
        (api.cuDeviceGetGraphMemAttribute)(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &mut v as *mut u64 as *mut c_void)
    };
    if r == CUresult::SUCCESS {
        json!(v)
    } else {
        json!(error_name(api, r))
    }
}

/// An executable graph of one allocation node of `bytes` on device `d`, and a free node after it
/// when `free` (else the allocation is kept after the graph has run).
pub(super) fn alloc_graph(api: &Api, d: CUdevice, bytes: usize, free: bool) -> Res<CUgraphExec> {
    let (mut g, mut n, mut f, mut e) =
        (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    let mut p = CUDA_MEM_ALLOC_NODE_PARAMS {
        poolProps: CUmemPoolProps::device(d),
        accessDescs: std::ptr::null(),
        accessDescCount: 0,
        bytesize: bytes,
        dptr: 0,
    };
    // SAFETY: out-pointers to locals and a parameter block built here; handles are the driver's.
    unsafe {
        ck(api, (api.cuGraphCreate)(&mut g, 0), "cuGraphCreate")?;
        ck(api, (api.cuGraphAddMemAllocNode)(&mut n, g, std::ptr::null(), 0, &mut p), "cuGraphAddMemAllocNode")?;
        if free {
            ck(api, (api.cuGraphAddMemFreeNode)(&mut f, g, &n, 1, p.dptr), "cuGraphAddMemFreeNode")?;
        }
        ck(api, (api.cuGraphInstantiateWithFlags)(&mut e, g, 0), "cuGraphInstantiateWithFlags")?;
    }
    Ok(e)
}

/// A graph allocating N launched and synchronised (the device's graph pool then holds N spare), then
/// two graphs each allocating N and keeping it, launched at the same moment by a thread each on a
/// stream of its own: they must not both count the pool's spare memory as theirs.
pub(super) fn graph_race(api: &Api, dev: i32, a: &GraphRaceArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let (d, s) = device_and_stream(api, dev)?;
    let pool = || graph_pool(api, d);
    let first = alloc_graph(api, d, size, true)?;
    // SAFETY: the graph and stream made above.
    unsafe {
        ck(api, (api.cuGraphLaunch)(first, s), "cuGraphLaunch")?;
        ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
    }
    let (base, base_pool) = (mem_info(api), pool());
    let execs = [alloc_graph(api, d, size, false)? as usize, alloc_graph(api, d, size, false)? as usize];
    let together = std::sync::Barrier::new(execs.len());
    let results: Vec<Res<Value>> = std::thread::scope(|sc| {
        let hs: Vec<_> = execs
            .iter()
            .map(|&e| {
                let together = &together;
                sc.spawn(move || -> Res<Value> {
                    setup(api, dev)?;
                    let (_, s) = device_and_stream(api, dev)?;
                    together.wait();
                    // SAFETY: a graph made above, launched once, on the stream made here.
                    let r = unsafe { (api.cuGraphLaunch)(e as CUgraphExec, s) };
                    // SAFETY: as above.
                    unsafe { ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")? };
                    Ok(json!(error_name(api, r)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into()))).collect()
    });
    let launches = results.into_iter().collect::<Res<Vec<Value>>>()?;
    emit(json!({"event": "graph-race", "launches": launches, "base": base, "base_pool": base_pool,
        "after": mem_info(api), "pool": pool()}));
    Ok(())
}

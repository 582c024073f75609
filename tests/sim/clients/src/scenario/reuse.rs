//! Handles the driver hands out again while one is destroyed: pools, graphs and contexts.

use super::contexts::kernel_rounds;
use super::graphs::alloc_graph;
use super::*;

/// An object destroyed while another thread makes one (graphs or pools).
#[derive(Args, Debug)]
pub struct ReuseArgs {
    #[arg(long, default_value = "100m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "200m", value_parser = size)]
    pub again: u64,
    #[arg(long, default_value = "100", value_parser = size)]
    pub wait_ms: u64,
}

/// A context destroyed while another thread makes one.
#[derive(Args, Debug)]
pub struct ContextReuseArgs {
    #[arg(long, default_value = "100m", value_parser = size)]
    pub size: u64,
    #[arg(long, default_value = "200m", value_parser = size)]
    pub again: u64,
    #[arg(long, default_value = "100", value_parser = size)]
    pub wait_ms: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub heap: u64,
    #[arg(long, default_value = "0", value_parser = size)]
    pub launches: u64,
}

/// What the two threads of a reuse scenario share: whether the other thread has made its object
/// (and its handle), and whether this thread's destroy has returned.
#[derive(Default)]
pub(super) struct Reuse {
    made: std::sync::atomic::AtomicBool,
    handle: std::sync::atomic::AtomicUsize,
    destroyed: std::sync::atomic::AtomicBool,
}

impl Reuse {
    /// The other thread made its object, `handle`.
    fn made(&self, handle: usize) {
        self.handle.store(handle, std::sync::atomic::Ordering::SeqCst);
        self.made.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn destroyed(&self) -> bool {
        self.destroyed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until the destroy has returned.
    fn wait_destroyed(&self) {
        while !self.destroyed() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The memory left now and once the destroy has returned.
    fn around(&self, api: &Api) -> (Value, Value) {
        let now = mem_info(api);
        self.wait_destroyed();
        (now, mem_info(api))
    }
}

/// Runs `destroy` of the object `old` in this thread while another thread runs `make` `wait_ms`
/// later (the driver may give what it makes `old`'s handle), and emits `head` (an object) with
/// `make`'s value, the destroy's result (`destroy`), whether the other object was made while the
/// destroy was in the driver (`made_during_destroy`) and whether it got `old`'s handle
/// (`same_handle`).
pub(super) fn destroy_while_made(
    api: &Api,
    head: Value,
    wait_ms: u64,
    old: usize,
    destroy: impl FnOnce() -> CUresult,
    make: impl FnOnce(&Reuse) -> Res<Value> + Send,
) -> Res<()> {
    let reuse = Reuse::default();
    let (r, made_during, other) = std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(wait_ms));
            make(&reuse)
        });
        let r = destroy();
        let made_during = reuse.made.load(std::sync::atomic::Ordering::SeqCst);
        reuse.destroyed.store(true, std::sync::atomic::Ordering::SeqCst);
        (r, made_during, t.join().map_err(|_| "the other thread panicked".to_string()))
    });
    let same = reuse.handle.load(std::sync::atomic::Ordering::SeqCst) == old;
    let mut v = head;
    if let (Some(m), Value::Object(made)) = (v.as_object_mut(), other??) {
        m.extend(made);
        m.insert("destroy".into(), json!(error_name(api, r)));
        m.insert("made_during_destroy".into(), json!(made_during));
        m.insert("same_handle".into(), json!(same));
    }
    emit(v);
    Ok(())
}

/// A memory pool destroyed while another thread makes one: where the driver gives the new pool the
/// destroyed one's handle (and returns from the destroy a while after the pool went), what the new
/// pool holds must not go with the old one.
pub(super) fn pool_reuse(api: &Api, dev: i32, a: &ReuseArgs) -> Res<()> {
    let ctx = setup(api, dev)? as usize;
    let size = a.size as usize;
    let again = a.again as usize;
    let wait = a.wait_ms;
    let mut d = 0;
    let (mut a, mut s, mut p) = (std::ptr::null_mut(), std::ptr::null_mut(), 0);
    // SAFETY: out-pointers to locals; the pool properties are fully initialised; the allocation is
    // freed once.
    unsafe {
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate")?;
    }
    // First the device's current (default) pool, keeping 64 MiB freed into it, given to
    // cuMemPoolDestroy, which refuses it: what it holds stays charged through a synchronisation.
    let mut dp = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: as above.
    let refused = unsafe {
        ck(api, (api.cuDeviceGetMemPool)(&mut dp, d), "cuDeviceGetMemPool")?;
        let t = &mut keep as *mut u64 as *mut c_void;
        ck(api, (api.cuMemPoolSetAttribute)(dp, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, t), "cuMemPoolSetAttribute")?;
        ck(api, (api.cuMemAllocAsync)(&mut p, 64 << 20, s), "cuMemAllocAsync")?;
        ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
        ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
        let before = mem_info(api);
        let r = (api.cuMemPoolDestroy)(dp);
        ck(api, (api.cuMemAllocAsync)(&mut p, 1 << 20, s), "cuMemAllocAsync")?;
        ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
        ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
        let after = mem_info(api);
        ck(api, (api.cuMemPoolTrimTo)(dp, 0), "cuMemPoolTrimTo")?;
        json!({"result": error_name(api, r), "before": before, "after": after, "trimmed": mem_info(api)})
    };
    // SAFETY: as above.
    unsafe {
        ck(api, (api.cuMemPoolCreate)(&mut a, &CUmemPoolProps::device(d)), "cuMemPoolCreate")?;
        ck(api, (api.cuMemAllocFromPoolAsync)(&mut p, size, a, s), "cuMemAllocFromPoolAsync")?;
        ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
        ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
    }
    let base = mem_info(api);
    let old = a as usize;
    // SAFETY: the pool made above, destroyed once (nothing of it is allocated).
    let destroy = || unsafe { (api.cuMemPoolDestroy)(old as CUmemoryPool) };
    let head = json!({"event": "pool-reuse", "default_destroyed": refused, "base": base});
    destroy_while_made(api, head, wait, old, destroy, |reuse| {
        let (mut b, mut s2, mut q) = (std::ptr::null_mut(), std::ptr::null_mut(), 0);
        let mut keep = u64::MAX;
        // SAFETY: the primary context retained by `setup`; out-pointers to locals; the pool
        // and stream made here are destroyed once, below.
        unsafe {
            (api.cuCtxSetCurrent)(ctx as CUcontext);
            ck(api, (api.cuStreamCreate)(&mut s2, 0), "cuStreamCreate")?;
            ck(api, (api.cuMemPoolCreate)(&mut b, &CUmemPoolProps::device(d)), "cuMemPoolCreate")?;
            reuse.made(b as usize);
            let t = &mut keep as *mut u64 as *mut c_void;
            ck(api, (api.cuMemPoolSetAttribute)(b, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, t), "cuMemPoolSetAttribute")?;
            ck(api, (api.cuMemAllocFromPoolAsync)(&mut q, again, b, s2), "cuMemAllocFromPoolAsync")?;
            ck(api, (api.cuMemFreeAsync)(q, s2), "cuMemFreeAsync")?;
            ck(api, (api.cuStreamSynchronize)(s2), "cuStreamSynchronize")?;
        }
        let (during, after) = reuse.around(api);
        // SAFETY: as above.
        unsafe {
            ck(api, (api.cuStreamSynchronize)(s2), "cuStreamSynchronize")?;
        }
        let synchronised = mem_info(api);
        // SAFETY: as above.
        unsafe {
            ck(api, (api.cuMemPoolDestroy)(b), "cuMemPoolDestroy")?;
        }
        Ok(json!({"during": during, "after": after, "synchronised": synchronised, "destroyed": mem_info(api)}))
    })
}

/// An executable graph allocating N, launched, destroyed while another thread instantiates one
/// allocating --again T ms later (the driver may give it the destroyed one's handle) and, once the
/// destroy has returned, launches it: the new graph's allocations must still be reserved for.
pub(super) fn graph_reuse(api: &Api, dev: i32, a: &ReuseArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let again = a.again as usize;
    let wait = a.wait_ms;
    let (d, s) = device_and_stream(api, dev)?;
    let stream = s as usize;
    let a = alloc_graph(api, d, size, true)?;
    // SAFETY: the graph and stream made above.
    unsafe {
        ck(api, (api.cuGraphLaunch)(a, s), "cuGraphLaunch")?;
        ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
    }
    let base = mem_info(api);
    let old = a as usize;
    // SAFETY: the graph made above, destroyed once.
    let destroy = || unsafe { (api.cuGraphExecDestroy)(old as CUgraphExec) };
    let head = json!({"event": "graph-reuse", "base": base});
    destroy_while_made(api, head, wait, old, destroy, |reuse| {
        setup(api, dev)?;
        let b = alloc_graph(api, d, again, true)?;
        reuse.made(b as usize);
        reuse.wait_destroyed();
        let s = stream as CUstream;
        // SAFETY: the graph made above, launched and destroyed once on the stream made above.
        let r = unsafe {
            let r = (api.cuGraphLaunch)(b, s);
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            r
        };
        let launched = mem_info(api);
        // SAFETY: as above.
        unsafe { ck(api, (api.cuGraphExecDestroy)(b), "cuGraphExecDestroy")? };
        Ok(json!({"launch": error_name(api, r), "launched": launched}))
    })
}

/// A context destroyed while another thread makes one: where the driver gives the new context the
/// destroyed one's handle (and returns from the destroy a while after the context went), what is
/// charged for the new one must not go with the old one.
pub(super) fn context_reuse(api: &Api, dev: i32, a: &ContextReuseArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let again = a.again as usize;
    let wait = a.wait_ms;
    // Each context's malloc heap raised to this much (0: left as it is).
    let heap = a.heap as usize;
    const HEAP: i32 = 2; // CU_LIMIT_MALLOC_HEAP_SIZE

    // Kernels each context launches, twice, synchronising after each round: under an SM limit, the
    // interposer then holds timing events of the context, spare and in flight, when it ends.
    let launches = a.launches;
    let run = || if launches == 0 { Ok(()) } else { kernel_rounds(api, launches, true) };
    let mut d = 0;
    let mut a = std::ptr::null_mut();
    let mut p = 0;
    // SAFETY: out-pointers to locals; the context made is this thread's current one.
    unsafe {
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        ck(api, (api.cuCtxCreate_v2)(&mut a, 0, d), "cuCtxCreate")?;
        ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")?;
        if heap > 0 {
            ck(api, (api.cuCtxSetLimit)(HEAP, heap), "cuCtxSetLimit")?;
        }
    }
    run()?;
    let base = mem_info(api);
    let old = a as usize;
    // SAFETY: the context made above, destroyed once (with the allocation in it).
    let destroy = || unsafe { (api.cuCtxDestroy_v2)(old as CUcontext) };
    let head = json!({"event": "context-reuse", "base": base});
    destroy_while_made(api, head, wait, old, destroy, |reuse| {
        let mut b = std::ptr::null_mut();
        let mut q = 0;
        // SAFETY: out-pointers to locals; the context made here is destroyed once, below.
        unsafe {
            ck(api, (api.cuCtxCreate_v2)(&mut b, 0, d), "cuCtxCreate")?;
            reuse.made(b as usize);
            ck(api, (api.cuMemAlloc_v2)(&mut q, again), "cuMemAlloc")?;
            if heap > 0 {
                ck(api, (api.cuCtxSetLimit)(HEAP, heap), "cuCtxSetLimit")?;
            }
        }
        run()?;
        let ran_during = !reuse.destroyed();
        let (during, after) = reuse.around(api);
        // SAFETY: the allocation and context made above.
        unsafe {
            ck(api, (api.cuMemFree_v2)(q), "cuMemFree")?;
            ck(api, (api.cuCtxDestroy_v2)(b), "cuCtxDestroy")?;
        }
        Ok(json!({"during": during, "after": after, "launched_during_destroy": launches > 0 && ran_during}))
    })
}

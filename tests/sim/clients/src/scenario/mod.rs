//! Scenarios the clients run; each prints JSON lines on stdout (`{"event": ...}`).

use crate::abi::*;
use crate::{error_name, Api};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::Write;

pub const USAGE: &str = "\
scenarios:
  info                                  devices, versions and memory info as the driver reports them
  watch-free [--seconds S] [--every-ms M]
                                        after a context, memory info every M ms for S seconds
  alloc --size N [--chunk N] [--allocator device|pitch|managed|vmm|async|pool|array|array-v1|
                                        array3d-v1|mipmap|host]
        [--modules K] [--delay-secs S] [--hold] [--hold-secs S] [--no-free]
                                        allocate N bytes in chunks until done or refused (after
                                        loading K modules)
  launch [--no-timing] [--kernel NAME] [--count N | --seconds S [--sync-every K]]
         [--path kernel|ex|coop|graph|capture|legacy|legacy-default]
         [--nodes K] [--grid G | --grids G1,G2,...] [--block B] [--duration-ns D [--ramp-ppm R]]
         [--threads T | --devices D1,D2,...] [--regraph-after N [--regraph-factor F] [--regraph-how HOW]]
         [--loader module|library] [--reload-after N --reload-kernel NAME [--reload-how unload|reset]]
         [--stream-on D [--restream-after N]]
                                        launch kernels (simulator convention: sleep_<N><unit>,
                                        wave_<N><unit>, param_ns); legacy: cuLaunchGridAsync,
                                        legacy-default: cuLaunch/cuLaunchGrid (default stream);
                                        --devices: a thread per device, each launching on its
                                        device's primary context;
                                        --regraph-after: after N launches the graph's param_ns
                                        nodes run F (10) times longer, changed by HOW: update,
                                        update-v1, reinstantiate, set-params, set-params-v1,
                                        node-params, child (K child-graph nodes of one kernel
                                        each, given another child) or enable (F times as many
                                        nodes, all but K disabled until then); --reload-after: after N
                                        launches the module is unloaded (or the primary context
                                        reset) and another loaded, whose kernel NAME the path
                                        kernel launches from then on; --loader library: kernels
                                        from cuLibraryLoadData/cuLibraryGetKernel, launched by
                                        their CUkernel handle as CUDA 12 runtimes do; --stream-on
                                        (with --loader library): into a stream of device D's
                                        primary context, this device's current; --restream-after
                                        (with --seconds): after N launches that stream is
                                        destroyed and one of this device's made (the simulator
                                        hands out the freed handle again), launched into from
                                        then on
  graph-mem [--how explicit|capture] [--size N] [--graphs G] [--keep]
            [--instantiate flags|params|upload] [--upload] [--launches L] [--alloc N]
            [--destroy] [--trim] [--reset] [--peer-size P] [--hold]
                                        G graphs that each allocate N bytes in a graph memory node
                                        (explicit: cuGraphAddMemAllocNode; capture: cuMemAllocAsync
                                        captured) and free them (--keep: freed after each launch
                                        with cuMemFreeAsync), launched L rounds; then cuMemAlloc N
                                        (--alloc), the graphs destroyed, the graph pool trimmed and
                                        cuMemAlloc tried again (--reset: the primary context reset,
                                        then cuMemAlloc again); a line per step with the pool's
                                        reservation as the driver reports it; --peer-size (with
                                        explicit): each graph also allocates P bytes on the next
                                        device (whose primary context is retained), its pool and
                                        free memory reported too, --alloc and --trim done there too
  vmm [--size N] [--alloc N]            a physical allocation of N bytes (cuMemCreate) mapped, its
                                        handle released at once (the mapping keeps the memory),
                                        its handle retained again from the address
                                        (cuMemRetainAllocationHandle), unmapped (the reference
                                        keeps it) and released: a line per step with what
                                        cuMemGetInfo reports; --alloc: cuMemAlloc N tried while the
                                        memory is kept and once it is gone
  pool [--allocator async|pool|default] [--size N] [--threshold T] [--alloc N] [--reset]
       [--destroyed-current] [--own-current] [--pool-on D|host] [--stream-on D]
       [--sync stream|ctx|ctx-v2]
                                        a stream-ordered allocation of N bytes (async: from the
                                        stream's device's current pool; pool: from a new pool, of
                                        device D's memory or the host's if --pool-on says so;
                                        default: from device D's default pool, named by
                                        cuMemGetDefaultMemPool of CUDA 13.0) on a
                                        stream of --device's context (--stream-on: of device D's
                                        primary context, with --device's still current; each line
                                        then also has D's memory info), its pool's
                                        release threshold set to T first; then, a line each: freed,
                                        synchronised (the stream, or --sync: the context, with
                                        cuCtxSynchronize or CUDA 13.0's cuCtxSynchronize_v2),
                                        cuMemAlloc --alloc tried, N allocated from the pool again, freed and the pool trimmed to 0 (--reset:
                                        instead, the primary context reset with the allocation
                                        outstanding, then cuMemAlloc --alloc; --destroyed-current:
                                        first, a new pool made the device's current one, 1 MiB
                                        allocated from it and freed, and the pool destroyed;
                                        --own-current: first, 1 MiB allocated and freed, then a
                                        new pool made the device's current one with
                                        cuMemSetMemPool and named by cuMemGetMemPool, both of
                                        CUDA 13.0)
  memcpy [--size N]                     copy a pattern to the device and back, and compare
  threads [--threads T] [--iters I] [--size N] [--allocator device|managed|pitch|vmm|array]
                                        T threads allocating and freeing concurrently
  hold                                  create a context, print ready, wait to be killed
  watch [--count N] [--interval-ms T]    print cuMemGetInfo N times, T ms apart
  fork-child [--size N] [--child-secs S]
                                        allocate, then fork a child that touches the driver and
                                        sleeps; the parent reports after the child exits
  exec-self [--size N]                  allocate, then exec this program to hold a context (same PID,
                                        new image)
  contexts [--size N]                   an explicit context: allocate in it, destroy it, and
                                        report memory before, during and after
  context-end [--how destroy|release|reset] [--create v2|v3|v4] [--size N] [--again N]
              [--destroy-primary-first]
                                        allocate in a context, end it as told, allocate again
                                        (first asking cuCtxDestroy to destroy the primary context)
  pool-reuse [--size N] [--again N] [--wait-ms T]
                                        (first the default pool given to cuMemPoolDestroy);
                                        a pool that held N destroyed while another thread makes
                                        one T ms later, keeping all it frees, and allocates and
                                        frees --again from it: the memory left while the destroy
                                        is in the driver and after it returns
  context-reuse [--size N] [--again N] [--wait-ms T] [--heap N] [--launches K]
                                        a context holding N destroyed while another thread makes
                                        one T ms later and allocates --again in it (each raising
                                        its malloc heap to --heap, and launching K kernels twice,
                                        synchronising after each K): the memory left while the
                                        destroy is in the driver and after it returns
  graph-reuse [--size N] [--again N] [--wait-ms T]
                                        a graph allocating N, launched and destroyed while another
                                        thread instantiates one allocating --again T ms later and,
                                        once the destroy returned, launches it: the memory left
  graph-race [--size N]                 a graph allocating N run (its pool then holds N spare), then
                                        two graphs each allocating N and keeping it, launched at
                                        once by a thread each: their results, the memory left
                                        and the pool
  reset-race [--other D] [--launches K] the primary context reset (after two rounds of K launches,
                                        the last not synchronised) while another thread launches
                                        rounds of K on device D's
  limits [--heap N] [--too-big N]       the primary context's stack raised to 4001 bytes a thread,
                                        its heap to N, its stack to --too-big, the heap lowered
                                        again; then the context reset, the stack raised again and
                                        the context released and retained; then a context of its
                                        own with that stack, destroyed; memory after each step
  free-refused [--size N]               allocate, free into a destroyed stream (the driver refuses;
                                        the memory stays allocated), then free it
  procaddr NAME...                      which entry point cuGetProcAddress_v2 returns for each base
                                        name at --cuda-version/--per-thread (named with dladdr)
common: --device I (default 0); sizes accept k, m, g suffixes (powers of 1024)";

type Res<T> = Result<T, String>;

struct Opts {
    map: HashMap<String, String>,
}

impl Opts {
    fn parse(args: &[String]) -> Res<Opts> {
        let mut map = HashMap::new();
        let mut i = 0;
        while i < args.len() {
            let k = args[i].strip_prefix("--").ok_or_else(|| format!("unexpected argument {:?}", args[i]))?;
            match args.get(i + 1) {
                Some(v) if !v.starts_with("--") => {
                    map.insert(k.to_owned(), v.clone());
                    i += 2;
                }
                _ => {
                    map.insert(k.to_owned(), String::new());
                    i += 1;
                }
            }
        }
        Ok(Opts { map })
    }
    fn flag(&self, k: &str) -> bool {
        self.map.contains_key(k)
    }
    fn str<'a>(&'a self, k: &str, d: &'a str) -> &'a str {
        self.map.get(k).map_or(d, String::as_str)
    }
    fn num(&self, k: &str, d: u64) -> Res<u64> {
        match self.map.get(k) {
            None => Ok(d),
            Some(v) => parse_size(v).ok_or_else(|| format!("--{k}: cannot parse {v:?}")),
        }
    }
    fn float(&self, k: &str) -> Res<Option<f64>> {
        self.map.get(k).map(|v| v.parse::<f64>().map_err(|_| format!("--{k}: cannot parse {v:?}"))).transpose()
    }
}

/// `123`, `4k`, `16m`, `2g` (powers of 1024).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()?.to_ascii_lowercase() {
        'k' => (&s[..s.len() - 1], 1u64 << 10),
        'm' => (&s[..s.len() - 1], 1 << 20),
        'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

fn emit(v: Value) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{v}");
    let _ = o.flush();
}

fn ck(api: &Api, r: CUresult, what: &str) -> Res<()> {
    if r == CUresult::SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {}", error_name(api, r)))
    }
}

/// Initialises the driver and makes the device's primary context current.
fn setup(api: &Api, dev: i32) -> Res<CUcontext> {
    // SAFETY (whole module): calls through the bound table with valid out-pointers to locals.
    unsafe {
        ck(api, (api.cuInit)(0), "cuInit")?;
        let mut d = 0;
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        let mut c = std::ptr::null_mut();
        ck(api, (api.cuDevicePrimaryCtxRetain)(&mut c, d), "cuDevicePrimaryCtxRetain")?;
        ck(api, (api.cuCtxSetCurrent)(c), "cuCtxSetCurrent")?;
        Ok(c)
    }
}

fn mem_info(api: &Api) -> Value {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    let r = unsafe { (api.cuMemGetInfo_v2)(&mut f, &mut t) };
    if r == CUresult::SUCCESS {
        json!({"free": f, "total": t})
    } else {
        json!({"error": error_name(api, r)})
    }
}

fn hold_forever() -> ! {
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

pub fn run(api: &Api, args: &[String]) -> Res<()> {
    let o = Opts::parse(&args[1..])?;
    let dev = o.num("device", 0)? as i32;
    match args[0].as_str() {
        "info" => info(api, dev),
        "alloc" => alloc(api, dev, &o),
        "launch" => launch(api, dev, &o),
        "memcpy" => memcpy(api, dev, &o),
        "graph-mem" => graph_mem(api, dev, &o),
        "pool" => pool_steps(api, dev, &o),
        "vmm" => vmm_steps(api, dev, &o),
        "threads" => threads(api, dev, &o),
        "contexts" => contexts(api, dev, &o),
        "context-end" => context_end(api, dev, &o),
        "context-reuse" => context_reuse(api, dev, &o),
        "reset-race" => reset_race(api, dev, &o),
        "graph-reuse" => graph_reuse(api, dev, &o),
        "graph-race" => graph_race(api, dev, &o),
        "pool-reuse" => pool_reuse(api, dev, &o),
        "free-refused" => free_refused(api, dev, &o),
        "limits" => limits(api, dev, &o),
        "watch" => watch(api, dev, &o),
        "fork-child" => fork_child(api, dev, &o),
        "exec-self" => exec_self(api, dev, &o),
        "watch-free" => {
            setup(api, dev)?;
            let (secs, every) = (o.num("seconds", 5)?, o.num("every-ms", 20)?);
            emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_secs(secs) {
                emit(json!({"t_ms": t.elapsed().as_millis() as u64, "mem_info": mem_info(api)}));
                std::thread::sleep(std::time::Duration::from_millis(every));
            }
            Ok(())
        }
        "hold" => {
            setup(api, dev)?;
            emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
            hold_forever()
        }
        s => Err(format!("unknown scenario {s:?}\n{USAGE}")),
    }
}

/// Context limits that hold device memory: each step reports what the driver answered, the limit
/// as it reads back, and the memory left.
fn limits(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    const STACK: i32 = 0;
    const HEAP: i32 = 2;
    setup(api, dev)?;
    let heap = o.num("heap", 200 << 20)? as usize;
    let too_big = o.num("too-big", 64 << 10)? as usize;
    let mut d = 0;
    let (mut sms, mut threads) = (0, 0);
    // SAFETY: out-pointers to locals.
    unsafe {
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        ck(api, (api.cuDeviceGetAttribute)(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d), "attribute")?;
        ck(
            api,
            (api.cuDeviceGetAttribute)(&mut threads, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, d),
            "attribute",
        )?;
    }
    let step = |what: &str, limit: i32, value: usize| -> Value {
        let mut now = 0usize;
        // SAFETY: as above.
        let (r, g) = unsafe { ((api.cuCtxSetLimit)(limit, value), (api.cuCtxGetLimit)(&mut now, limit)) };
        json!({"step": what, "result": error_name(api, r), "get": error_name(api, g), "now": now, "mem_info": mem_info(api)})
    };
    let mut steps = vec![json!({"step": "base", "mem_info": mem_info(api)})];
    steps.push(step("stack", STACK, 4001));
    steps.push(step("heap", HEAP, heap));
    steps.push(step("too big", STACK, too_big));
    steps.push(step("heap lowered", HEAP, 8 << 20));
    steps.push(step("heap raised again", HEAP, heap));
    // SAFETY: the primary context retained by `setup`.
    unsafe { ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")? };
    steps.push(json!({"step": "reset", "mem_info": mem_info(api)}));
    steps.push(step("stack again", STACK, 4001));
    // SAFETY: released once (the retain of `setup`), then retained and made current again.
    unsafe {
        ck(api, (api.cuDevicePrimaryCtxRelease_v2)(d), "cuDevicePrimaryCtxRelease")?;
        let mut c = std::ptr::null_mut();
        ck(api, (api.cuDevicePrimaryCtxRetain)(&mut c, d), "cuDevicePrimaryCtxRetain")?;
        ck(api, (api.cuCtxSetCurrent)(c), "cuCtxSetCurrent")?;
    }
    steps.push(json!({"step": "released and retained", "mem_info": mem_info(api)}));
    // A context of its own: the same, released when it is destroyed.
    let mut own = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; the context made here is destroyed once.
    unsafe { ck(api, (api.cuCtxCreate_v2)(&mut own, 0, d), "cuCtxCreate")? };
    steps.push(step("own context's stack", STACK, 4001));
    // SAFETY: as above.
    unsafe { ck(api, (api.cuCtxDestroy_v2)(own), "cuCtxDestroy")? };
    steps.push(json!({"step": "own context destroyed", "mem_info": mem_info(api)}));
    emit(json!({"event": "limits", "sms": sms, "threads_per_sm": threads, "steps": steps}));
    Ok(())
}

/// A free the driver refuses leaves the allocation charged, and the free that follows releases it.
fn free_refused(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 64 << 20)? as usize;
    let base = mem_info(api);
    let mut p = 0;
    // SAFETY: out-pointers to locals; the pointer freed is the one just allocated, and the stream
    // handle one the driver made and destroyed (it checks the handle before it frees anything).
    unsafe {
        let mut gone = std::ptr::null_mut();
        ck(api, (api.cuStreamCreate)(&mut gone, 0), "cuStreamCreate")?;
        ck(api, (api.cuStreamDestroy_v2)(gone), "cuStreamDestroy")?;
        ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")?;
        let allocated = mem_info(api);
        let refused = (api.cuMemFreeAsync)(p, gone);
        let after_refusal = mem_info(api);
        ck(api, (api.cuMemFree_v2)(p), "cuMemFree")?;
        emit(json!({"event": "freed", "base": base, "allocated": allocated,
            "refused": error_name(api, refused), "after_refusal": after_refusal, "freed": mem_info(api)}));
    }
    Ok(())
}

/// The device `dev` and a new stream on it (the primary context is current).
fn device_and_stream(api: &Api, dev: i32) -> Res<(CUdevice, CUstream)> {
    let (mut d, mut s) = (0, std::ptr::null_mut());
    // SAFETY: out-pointers to locals.
    unsafe {
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate")?;
    }
    Ok((d, s))
}

/// See USAGE: a physical allocation kept by its mapping, then by a retained reference.
fn vmm_steps(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 256 << 20)? as usize;
    let probe = o.num("alloc", 0)? as usize;
    let step = |name: &str, r: CUresult| {
        emit(json!({"event": "vmm", "step": name, "result": error_name(api, r), "mem_info": mem_info(api)}));
        if r == CUresult::SUCCESS {
            Ok(())
        } else {
            Err(format!("{name}: {}", error_name(api, r)))
        }
    };
    let try_alloc = |name: &str| {
        let mut p = 0;
        // SAFETY: an out-pointer to a local.
        let r = unsafe { (api.cuMemAlloc_v2)(&mut p, probe) };
        emit(json!({"event": "vmm", "step": name, "result": error_name(api, r), "bytes": probe}));
        if r == CUresult::SUCCESS {
            // SAFETY: the allocation just made.
            unsafe { (api.cuMemFree_v2)(p) };
        }
    };
    // SAFETY (whole block): calls through the bound table with out-pointers to locals and a
    // property block built here; handles and addresses are the driver's.
    unsafe {
        let prop = CUmemAllocationProp::device(dev);
        let mut g = 0;
        ck(api, (api.cuMemGetAllocationGranularity)(&mut g, &prop, 0), "cuMemGetAllocationGranularity")?;
        let size = size.div_ceil(g) * g;
        let (mut h, mut ptr) = (0u64, 0);
        step("created", (api.cuMemCreate)(&mut h, size, &prop, 0))?;
        ck(api, (api.cuMemAddressReserve)(&mut ptr, size, 0, 0, 0), "cuMemAddressReserve")?;
        step("mapped", (api.cuMemMap)(ptr, size, 0, h, 0))?;
        let acc = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        ck(api, (api.cuMemSetAccess)(ptr, size, &acc, 1), "cuMemSetAccess")?;
        step("released", (api.cuMemRelease)(h))?;
        if probe > 0 {
            try_alloc("alloc-while-mapped");
        }
        let mut again = 0u64;
        step("retained", (api.cuMemRetainAllocationHandle)(&mut again, ptr as *mut c_void))?;
        step("unmapped", (api.cuMemUnmap)(ptr, size))?;
        if probe > 0 {
            try_alloc("alloc-while-retained");
        }
        step("released-again", (api.cuMemRelease)(again))?;
        ck(api, (api.cuMemAddressFree)(ptr, size), "cuMemAddressFree")?;
        if probe > 0 {
            try_alloc("alloc-after");
        }
    }
    Ok(())
}

/// See USAGE: what a stream-ordered pool holds after each step.
fn pool_steps(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let ctx = setup(api, dev)?;
    let kind = o.str("allocator", "async");
    let size = o.num("size", 256 << 20)? as usize;
    let probe = o.num("alloc", 0)? as usize;
    let sync = o.str("sync", "stream");
    if !matches!(kind, "async" | "pool" | "default") || !matches!(sync, "stream" | "ctx" | "ctx-v2") {
        return Err(format!("pool: --allocator {kind:?} --sync {sync:?}?\n{USAGE}"));
    }
    // SAFETY (whole function): calls through the bound table with out-pointers to locals and
    // property blocks built here; handles are the driver's.
    unsafe {
        let (mut d, mut s) = device_and_stream(api, dev)?;
        // The stream on another device's primary context, this one current again.
        let mut stream_ctx = None;
        if let Some(n) = o.map.get("stream-on") {
            let n = n.parse().map_err(|_| format!("--stream-on {n:?}: a device ordinal"))?;
            let here = setup(api, dev)?;
            let there = setup(api, n)?;
            ck(api, (api.cuDeviceGet)(&mut d, n), "cuDeviceGet (stream)")?;
            ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate (stream)")?;
            ck(api, (api.cuCtxSetCurrent)(here), "cuCtxSetCurrent")?;
            stream_ctx = Some((here, there));
        }
        let mut pool = std::ptr::null_mut();
        if o.flag("destroyed-current") {
            // A pool of the application's own made the device's current one, drawn from, then
            // destroyed: the driver makes the default pool current again.
            let props = CUmemPoolProps::device(d);
            let mut own = std::ptr::null_mut();
            ck(api, (api.cuMemPoolCreate)(&mut own, &props), "cuMemPoolCreate")?;
            ck(api, (api.cuDeviceSetMemPool)(d, own), "cuDeviceSetMemPool")?;
            let mut p = 0;
            ck(api, (api.cuMemAllocAsync)(&mut p, 1 << 20, s), "cuMemAllocAsync")?;
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            ck(api, (api.cuMemPoolDestroy)(own), "cuMemPoolDestroy")?;
        }
        let mut here = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: d };
        if o.flag("own-current") {
            // The device's current pool drawn from once (so that whoever follows it has learned it),
            // then a pool of the application's own made current by the call of CUDA 13.0.
            let mut p = 0;
            ck(api, (api.cuMemAllocAsync)(&mut p, 1 << 20, s), "cuMemAllocAsync")?;
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            let props = CUmemPoolProps::device(d);
            let mut own = std::ptr::null_mut();
            ck(api, (api.cuMemPoolCreate)(&mut own, &props), "cuMemPoolCreate")?;
            ck(api, (api.cuMemSetMemPool)(&mut here, CU_MEM_ALLOCATION_TYPE_PINNED, own), "cuMemSetMemPool")?;
        }
        // Where the pool of --allocator pool or default is: --device's memory, or --pool-on's.
        let mut at = here;
        match o.map.get("pool-on").map(String::as_str) {
            None => {}
            Some("host") => at = CUmemLocation { type_: CU_MEM_LOCATION_TYPE_HOST_NUMA, id: 0 },
            Some(n) => {
                let n = n.parse().map_err(|_| format!("--pool-on {n:?}: a device ordinal or host"))?;
                ck(api, (api.cuDeviceGet)(&mut at.id, n), "cuDeviceGet")?;
            }
        }
        if kind == "default" {
            ck(
                api,
                (api.cuMemGetDefaultMemPool)(&mut pool, &mut at, CU_MEM_ALLOCATION_TYPE_PINNED),
                "cuMemGetDefaultMemPool",
            )?;
        } else if kind == "pool" {
            let props = CUmemPoolProps { location: at, ..CUmemPoolProps::device(d) };
            ck(api, (api.cuMemPoolCreate)(&mut pool, &props), "cuMemPoolCreate")?;
        } else if o.flag("own-current") {
            ck(api, (api.cuMemGetMemPool)(&mut pool, &mut here, CU_MEM_ALLOCATION_TYPE_PINNED), "cuMemGetMemPool")?;
        } else {
            ck(api, (api.cuDeviceGetMemPool)(&mut pool, d), "cuDeviceGetMemPool")?;
        }
        if let Some(t) = o.map.get("threshold") {
            let mut t = parse_size(t).ok_or("--threshold needs a size")?;
            ck(
                api,
                (api.cuMemPoolSetAttribute)(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut t as *mut u64 as *mut c_void),
                "cuMemPoolSetAttribute",
            )?;
        }
        let report = |step: &str, r: CUresult| {
            let mut held = 0u64;
            (api.cuMemPoolGetAttribute)(
                pool,
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                &mut held as *mut u64 as *mut c_void,
            );
            let mut v = json!({"event": "pool", "step": step, "result": error_name(api, r), "mem_info": mem_info(api), "pool": held});
            if let Some((here, there)) = stream_ctx {
                (api.cuCtxSetCurrent)(there);
                v["stream_mem_info"] = mem_info(api);
                (api.cuCtxSetCurrent)(here);
            }
            emit(v);
        };
        let alloc = |p: &mut CUdeviceptr| {
            if kind != "async" {
                (api.cuMemAllocFromPoolAsync)(p, size, pool, s)
            } else {
                (api.cuMemAllocAsync)(p, size, s)
            }
        };
        let mut p = 0;
        let r = alloc(&mut p);
        report("allocated", r);
        ck(api, r, "allocation")?;
        if o.flag("reset") {
            // What cudaDeviceReset does with the allocation outstanding: the driver frees it.
            ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")?;
            setup(api, dev)?;
            emit(json!({"event": "pool", "step": "reset", "mem_info": mem_info(api)}));
            let mut q = 0;
            let r = (api.cuMemAlloc_v2)(&mut q, probe.max(1));
            emit(json!({"event": "pool", "step": "alloc-after-reset", "result": error_name(api, r)}));
            return Ok(());
        }
        report("freed", (api.cuMemFreeAsync)(p, s));
        report(
            "synchronised",
            match sync {
                "ctx" => (api.cuCtxSynchronize)(),
                "ctx-v2" => (api.cuCtxSynchronize_v2)(ctx),
                _ => (api.cuStreamSynchronize)(s),
            },
        );
        if probe > 0 {
            let mut q = 0;
            let r = (api.cuMemAlloc_v2)(&mut q, probe);
            report("alloc", r);
            if r == CUresult::SUCCESS {
                (api.cuMemFree_v2)(q);
            }
        }
        let r = alloc(&mut p);
        report("allocated-again", r);
        if r == CUresult::SUCCESS {
            ck(api, (api.cuMemFreeAsync)(p, s), "cuMemFreeAsync")?;
        }
        report("trimmed", (api.cuMemPoolTrimTo)(pool, 0));
    }
    Ok(())
}

/// See USAGE: graphs that allocate, launched under whatever limit the environment sets.
fn graph_mem(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let ctx = setup(api, dev)?;
    let how = o.str("how", "explicit");
    let size = o.num("size", 256 << 20)? as usize;
    let keep = o.flag("keep");
    let inst = o.str("instantiate", "flags");
    let probe = o.num("alloc", 0)? as usize;
    let peer_size = o.num("peer-size", 0)? as usize;
    if !matches!(how, "explicit" | "capture") || !matches!(inst, "flags" | "params" | "upload") {
        return Err(format!("graph-mem: --how {how:?} --instantiate {inst:?}?\n{USAGE}"));
    }
    if peer_size > 0 && how != "explicit" {
        return Err(format!("graph-mem: --peer-size needs --how explicit\n{USAGE}"));
    }
    // SAFETY (whole function): calls through the bound table with out-pointers to locals and
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
        for i in 0..o.num("graphs", 1)?.max(1) {
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
        if o.flag("upload") {
            for (i, &e) in execs.iter().enumerate() {
                report("uploaded", (api.cuGraphUpload)(e, s), json!({"graph": i}));
            }
        }
        for round in 0..o.num("launches", 2)? {
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
        if o.flag("destroy") {
            for &e in &execs {
                ck(api, (api.cuGraphExecDestroy)(e), "cuGraphExecDestroy")?;
            }
            report("destroyed", CUresult::SUCCESS, json!({}));
        }
        if o.flag("trim") {
            if let Some((p, _)) = peer {
                ck(api, (api.cuDeviceGraphMemTrim)(p), "cuDeviceGraphMemTrim (peer)")?;
            }
            report("trimmed", (api.cuDeviceGraphMemTrim)(d), json!({}));
            if probe > 0 {
                try_alloc("alloc-after-trim");
            }
        }
        if o.flag("reset") {
            // What cudaDeviceReset does: the context goes, and the graph pool with it.
            ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")?;
            setup(api, dev)?;
            report("reset", CUresult::SUCCESS, json!({}));
            if probe > 0 {
                try_alloc("alloc-after-reset");
            }
        }
    }
    if o.flag("hold") {
        emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
        hold_forever();
    }
    Ok(())
}

fn info(api: &Api, dev: i32) -> Res<()> {
    // SAFETY: see `setup`.
    unsafe {
        ck(api, (api.cuInit)(0), "cuInit")?;
        let mut v = 0;
        ck(api, (api.cuDriverGetVersion)(&mut v), "cuDriverGetVersion")?;
        let mut n = 0;
        ck(api, (api.cuDeviceGetCount)(&mut n), "cuDeviceGetCount")?;
        let mut devices = Vec::new();
        for i in 0..n {
            let mut d = 0;
            ck(api, (api.cuDeviceGet)(&mut d, i), "cuDeviceGet")?;
            let mut name = [0 as c_char; 128];
            ck(api, (api.cuDeviceGetName)(name.as_mut_ptr(), 128, d), "cuDeviceGetName")?;
            let mut bus = [0 as c_char; 32];
            ck(api, (api.cuDeviceGetPCIBusId)(bus.as_mut_ptr(), 32, d), "cuDeviceGetPCIBusId")?;
            let mut u = CUuuid::default();
            ck(api, (api.cuDeviceGetUuid_v2)(&mut u, d), "cuDeviceGetUuid")?;
            let mut total = 0usize;
            ck(api, (api.cuDeviceTotalMem_v2)(&mut total, d), "cuDeviceTotalMem")?;
            let attr = |a: i32| -> Res<i32> {
                let mut x = 0;
                ck(api, (api.cuDeviceGetAttribute)(&mut x, a, d), "cuDeviceGetAttribute")?;
                Ok(x)
            };
            let b = u.bytes;
            devices.push(json!({
                "ordinal": i,
                "name": CStr::from_ptr(name.as_ptr()).to_string_lossy(),
                "pci_bus_id": CStr::from_ptr(bus.as_ptr()).to_string_lossy(),
                "uuid": format!("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]),
                "total_mem": total,
                "sm_count": attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                "max_threads_per_sm": attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?,
                "cc": [attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?],
            }));
        }
        let mi = if n > 0 {
            setup(api, dev)?;
            mem_info(api)
        } else {
            Value::Null
        };
        emit(
            json!({"event": "info", "pid": std::process::id(), "driver_version": v, "devices": devices, "mem_info": mi}),
        );
    }
    Ok(())
}

enum Chunk {
    Ptr(CUdeviceptr),
    Vmm { ptr: CUdeviceptr, size: usize, h: u64 },
    Async(CUdeviceptr),
    Array(CUarray),
    Mipmap(CUmipmappedArray),
    Host(*mut c_void),
}

struct Allocator<'a> {
    api: &'a Api,
    kind: String,
    dev: i32,
    stream: CUstream,
    pool: CUmemoryPool,
}

impl Allocator<'_> {
    /// Allocates about `size` bytes; returns the chunk and the bytes it really takes.
    unsafe fn alloc(&self, size: usize) -> Result<(Chunk, usize), CUresult> {
        let a = self.api;
        let r = |r: CUresult| {
            if r == CUresult::SUCCESS {
                Ok(())
            } else {
                Err(r)
            }
        };
        // SAFETY: calls with out-pointers to locals and descriptors built here.
        unsafe {
            match self.kind.as_str() {
                "device" => {
                    let mut p = 0;
                    r((a.cuMemAlloc_v2)(&mut p, size))?;
                    Ok((Chunk::Ptr(p), size))
                }
                "managed" => {
                    let mut p = 0;
                    r((a.cuMemAllocManaged)(&mut p, size, 1))?;
                    Ok((Chunk::Ptr(p), size))
                }
                "pitch" => {
                    let (mut p, mut pitch) = (0, 0);
                    let h = size.div_ceil(4096).max(1);
                    r((a.cuMemAllocPitch_v2)(&mut p, &mut pitch, 4096, h, 16))?;
                    Ok((Chunk::Ptr(p), pitch * h))
                }
                "vmm" => {
                    let prop = CUmemAllocationProp::device(self.dev);
                    let mut g = 0;
                    r((a.cuMemGetAllocationGranularity)(&mut g, &prop, 0))?;
                    let sz = size.div_ceil(g) * g;
                    let mut h = 0;
                    r((a.cuMemCreate)(&mut h, sz, &prop, 0))?;
                    let mut ptr = 0;
                    if let Err(e) = r((a.cuMemAddressReserve)(&mut ptr, sz, 0, 0, 0)) {
                        (a.cuMemRelease)(h);
                        return Err(e);
                    }
                    r((a.cuMemMap)(ptr, sz, 0, h, 0))?;
                    let acc = CUmemAccessDesc { location: prop.location, flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
                    r((a.cuMemSetAccess)(ptr, sz, &acc, 1))?;
                    Ok((Chunk::Vmm { ptr, size: sz, h }, sz))
                }
                "async" => {
                    let mut p = 0;
                    r((a.cuMemAllocAsync)(&mut p, size, self.stream))?;
                    Ok((Chunk::Async(p), size))
                }
                "pool" => {
                    let mut p = 0;
                    r((a.cuMemAllocFromPoolAsync)(&mut p, size, self.pool, self.stream))?;
                    Ok((Chunk::Async(p), size))
                }
                "array" => {
                    let d = float_array(size);
                    let mut arr = std::ptr::null_mut();
                    r((a.cuArray3DCreate_v2)(&mut arr, &d))?;
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Array(arr), req.size))
                }
                "array-v1" | "array3d-v1" => {
                    // The original entry points (32-bit extents), by their exported names.
                    let d = float_array(size);
                    let width = u32::try_from(d.Width).map_err(|_| CUresult::INVALID_VALUE)?;
                    let name = if self.kind == "array-v1" { "cuArrayCreate" } else { "cuArray3DCreate" };
                    let f = crate::driver_symbol(name).unwrap_or(std::ptr::null_mut());
                    if f.is_null() {
                        return Err(CUresult::NOT_FOUND);
                    }
                    let mut arr = std::ptr::null_mut();
                    if self.kind == "array-v1" {
                        type Create = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult;
                        let d = CUDA_ARRAY_DESCRIPTOR_v1 { Width: width, Height: 0, Format: d.Format, NumChannels: 1 };
                        r(std::mem::transmute::<*mut c_void, Create>(f)(&mut arr, &d))?;
                    } else {
                        type Create = unsafe extern "C" fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult;
                        let d = CUDA_ARRAY3D_DESCRIPTOR_v1 {
                            Width: width,
                            Format: d.Format,
                            NumChannels: 1,
                            ..Default::default()
                        };
                        r(std::mem::transmute::<*mut c_void, Create>(f)(&mut arr, &d))?;
                    }
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Array(arr), req.size))
                }
                "mipmap" => {
                    // A square 2D float texture with a full mip chain of about `size` bytes.
                    let side = ((size as f64 * 0.75 / 4.0).sqrt() as usize).max(1);
                    let d = CUDA_ARRAY3D_DESCRIPTOR {
                        Width: side,
                        Height: side,
                        Depth: 0,
                        Format: CU_AD_FORMAT_FLOAT,
                        NumChannels: 1,
                        Flags: 0,
                    };
                    let mut arr = std::ptr::null_mut();
                    r((a.cuMipmappedArrayCreate)(&mut arr, &d, 4))?;
                    let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
                    r((a.cuMipmappedArrayGetMemoryRequirements)(&mut req, arr, self.dev))?;
                    Ok((Chunk::Mipmap(arr), req.size))
                }
                "host" => {
                    let mut p = std::ptr::null_mut();
                    r((a.cuMemAllocHost_v2)(&mut p, size))?;
                    Ok((Chunk::Host(p), size))
                }
                _ => Err(CUresult::NOT_SUPPORTED),
            }
        }
    }

    unsafe fn free(&self, c: Chunk) -> CUresult {
        let a = self.api;
        // SAFETY: frees what `alloc` returned, once.
        unsafe {
            match c {
                Chunk::Ptr(p) => (a.cuMemFree_v2)(p),
                Chunk::Vmm { ptr, size, h } => {
                    (a.cuMemUnmap)(ptr, size);
                    (a.cuMemAddressFree)(ptr, size);
                    (a.cuMemRelease)(h)
                }
                Chunk::Async(p) => (a.cuMemFreeAsync)(p, self.stream),
                Chunk::Array(x) => (a.cuArrayDestroy)(x),
                Chunk::Mipmap(x) => (a.cuMipmappedArrayDestroy)(x),
                Chunk::Host(p) => (a.cuMemFreeHost)(p),
            }
        }
    }
}

fn alloc(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let kind = o.str("allocator", "device").to_owned();
    let size = o.num("size", 1 << 20)? as usize;
    let chunk = (o.num("chunk", size as u64)? as usize).max(1);
    let mut al = Allocator { api, kind: kind.clone(), dev, stream: std::ptr::null_mut(), pool: std::ptr::null_mut() };
    // SAFETY: out-pointers to locals; the pool properties are fully initialised.
    unsafe {
        if kind == "async" || kind == "pool" {
            ck(api, (api.cuStreamCreate)(&mut al.stream, 0), "cuStreamCreate")?;
        }
        if kind == "pool" {
            let props = CUmemPoolProps::device(dev);
            ck(api, (api.cuMemPoolCreate)(&mut al.pool, &props), "cuMemPoolCreate")?;
        }
    }
    // Modules loaded first (as a framework loads its kernels): driver memory no allocation call sees.
    for _ in 0..o.num("modules", 0)? {
        let mut m = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local and a NUL-terminated image.
        ck(
            api,
            unsafe { (api.cuModuleLoadData)(&mut m, c"vgpu-sim module".as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
    }
    if let Some(s) = o.float("delay-secs")? {
        emit(json!({"event": "waiting", "pid": std::process::id(), "mem_info": mem_info(api)}));
        std::thread::sleep(std::time::Duration::from_secs_f64(s));
    }
    let mut chunks = Vec::new();
    let (mut done, mut taken, mut error) = (0usize, 0usize, Value::Null);
    while done < size {
        let this = chunk.min(size - done);
        // SAFETY: see Allocator.
        match unsafe { al.alloc(this) } {
            Ok((c, bytes)) => {
                chunks.push(c);
                done += this;
                taken += bytes;
            }
            Err(e) => {
                error = json!(error_name(api, e));
                break;
            }
        }
    }
    emit(json!({"event": "allocated", "pid": std::process::id(), "allocator": kind, "requested": size,
        "allocated": done, "bytes": taken, "chunks": chunks.len(), "error": error, "mem_info": mem_info(api)}));
    if o.flag("hold") {
        hold_forever();
    }
    if let Some(s) = o.float("hold-secs")? {
        std::thread::sleep(std::time::Duration::from_secs_f64(s));
    }
    if o.flag("no-free") {
        return Ok(());
    }
    let n = chunks.len();
    let mut failures = 0;
    for c in chunks {
        // SAFETY: each chunk is freed once.
        if unsafe { al.free(c) } != CUresult::SUCCESS {
            failures += 1;
        }
    }
    // SAFETY: plain calls on handles created above.
    unsafe {
        if !al.stream.is_null() {
            ck(api, (api.cuStreamSynchronize)(al.stream), "cuStreamSynchronize")?;
        }
        if !al.pool.is_null() {
            ck(api, (api.cuMemPoolTrimTo)(al.pool, 0), "cuMemPoolTrimTo")?;
            ck(api, (api.cuMemPoolDestroy)(al.pool), "cuMemPoolDestroy")?;
        }
    }
    emit(json!({"event": "freed", "chunks": n, "failures": failures, "mem_info": mem_info(api)}));
    if failures > 0 {
        return Err(format!("{failures} frees failed"));
    }
    Ok(())
}

fn launch(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    if let Some(list) = o.map.get("devices") {
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
                        launch_one(api, o, d)
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
    let threads = o.num("threads", 1)?.max(1);
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
                        launch_one(api, o, dev)
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
    let v = launch_one(api, o, dev)?;
    emit(v);
    Ok(())
}

fn launch_one(api: &Api, o: &Opts, dev: i32) -> Res<Value> {
    let kernel = o.str("kernel", "sleep_1ms");
    let path = o.str("path", "kernel");
    let count = o.num("count", 10)?;
    let seconds = o.float("seconds")?;
    let nodes = o.num("nodes", 10)? as usize;
    let grid = o.num("grid", 1)? as u32;
    // --grids G1,G2,...: one launch with each in turn (kernels whose duration follows the grid).
    let grids: Vec<u32> = match o.map.get("grids") {
        Some(v) => {
            v.split(',').map(|g| g.parse().map_err(|_| format!("--grids: bad grid {g:?}"))).collect::<Res<_>>()?
        }
        None => vec![grid],
    };
    let block = o.num("block", 128)? as u32;
    let mut dur = o.num("duration-ns", 1_000_000)?;
    // --ramp-ppm R: `param_ns` kernels grow by R parts per million each launch (a decode step's
    // attention as the context grows).
    let ramp_ppm = o.num("ramp-ppm", 0)?;
    let regraph_after = o.num("regraph-after", 0)?;
    let factor = o.num("regraph-factor", 10)?.max(1);
    let how = o.str("regraph-how", "update");
    const HOWS: [&str; 8] =
        ["update", "update-v1", "reinstantiate", "set-params", "set-params-v1", "node-params", "child", "enable"];
    if regraph_after > 0 && (path != "graph" || !HOWS.contains(&how)) {
        return Err(format!("--regraph-after needs --path graph and --regraph-how one of {HOWS:?}"));
    }
    // The enabled share of the nodes (see --regraph-how enable).
    let built = if regraph_after > 0 && how == "enable" { nodes * factor as usize } else { nodes };
    let mut dur2 = dur * factor;
    let reload_after = o.num("reload-after", 0)?;
    let reload_kernel = CString::new(o.str("reload-kernel", "")).map_err(|e| e.to_string())?;
    let reload_how = o.str("reload-how", "unload");
    let library = match o.str("loader", "module") {
        "module" => false,
        "library" => true,
        l => return Err(format!("--loader {l:?}: module or library")),
    };
    if reload_after > 0 && (path != "kernel" || reload_kernel.is_empty() || !["unload", "reset"].contains(&reload_how))
    {
        return Err("--reload-after needs --path kernel, --reload-kernel and --reload-how unload or reset".into());
    }
    let stream_on: Option<i32> = match o.map.get("stream-on") {
        Some(d) => Some(d.parse().map_err(|_| format!("--stream-on {d:?}: a device ordinal"))?),
        None => None,
    };
    if stream_on.is_some() && (!library || path != "kernel") {
        return Err(
            "--stream-on needs --loader library and --path kernel (a CUkernel launches on any context's stream)".into(),
        );
    }
    let restream_after = o.num("restream-after", 0)?;
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
        let timing = !o.flag("no-timing");
        if timing {
            ck(api, (api.cuEventCreate)(&mut e0, 0), "cuEventCreate")?;
            ck(api, (api.cuEventCreate)(&mut e1, 0), "cuEventCreate")?;
        }
        if o.flag("abandon-capture") {
            // A capture begun on a stream of its own, which is destroyed instead of ending it (an
            // error path): the capture goes with the stream.
            let mut c = std::ptr::null_mut();
            ck(api, (api.cuStreamCreate)(&mut c, 0), "cuStreamCreate")?;
            ck(api, (api.cuStreamBeginCapture_v2)(c, 0), "cuStreamBeginCapture")?;
            ck(api, (api.cuStreamDestroy_v2)(c), "cuStreamDestroy")?;
        }
        if o.flag("abandon-capture-context") {
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
                let every = o.num("sync-every", 1)?.max(1);
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

fn memcpy(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let n = o.num("size", 1 << 20)? as usize;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let mut back = vec![0u8; n];
    // SAFETY: host buffers of n bytes; the device buffer is n bytes.
    let ok = unsafe {
        let mut d = 0;
        ck(api, (api.cuMemAlloc_v2)(&mut d, n), "cuMemAlloc")?;
        ck(api, (api.cuMemcpyHtoD_v2)(d, src.as_ptr() as *const c_void, n), "cuMemcpyHtoD")?;
        ck(api, (api.cuMemcpyDtoH_v2)(back.as_mut_ptr() as *mut c_void, d, n), "cuMemcpyDtoH")?;
        let same = back == src;
        ck(api, (api.cuMemsetD8_v2)(d, 0xab, n), "cuMemsetD8")?;
        ck(api, (api.cuMemcpyDtoH_v2)(back.as_mut_ptr() as *mut c_void, d, n), "cuMemcpyDtoH")?;
        let set = back.iter().all(|&b| b == 0xab);
        let oob = (api.cuMemcpyHtoD_v2)(d + n as u64, src.as_ptr() as *const c_void, 1);
        ck(api, (api.cuMemFree_v2)(d), "cuMemFree")?;
        emit(
            json!({"event": "memcpy", "bytes": n, "roundtrip_ok": same, "memset_ok": set, "out_of_bounds": error_name(api, oob)}),
        );
        same && set
    };
    if ok {
        Ok(())
    } else {
        Err("data mismatch".into())
    }
}

fn contexts(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let primary = setup(api, dev)?;
    let size = o.num("size", 64 << 20)? as usize;
    let before = mem_info(api);
    // SAFETY: out-pointers to locals; the context is destroyed once.
    unsafe {
        let mut c = std::ptr::null_mut();
        ck(api, (api.cuCtxCreate_v2)(&mut c, 0, dev), "cuCtxCreate")?;
        let with_ctx = mem_info(api);
        let mut p = 0;
        ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")?;
        let during = mem_info(api);
        ck(api, (api.cuCtxDestroy_v2)(c), "cuCtxDestroy")?;
        ck(api, (api.cuCtxSetCurrent)(primary), "cuCtxSetCurrent")?;
        let after = mem_info(api);
        let stale = (api.cuMemFree_v2)(p);
        emit(json!({"event": "contexts", "before": before, "with_context": with_ctx, "during": during, "after": after,
            "free_after_destroy": error_name(api, stale)}));
    }
    Ok(())
}

/// A one-dimensional array of floats of about `bytes`.
fn float_array(bytes: usize) -> CUDA_ARRAY3D_DESCRIPTOR {
    CUDA_ARRAY3D_DESCRIPTOR {
        Width: bytes.div_ceil(4).max(1),
        Height: 0,
        Depth: 0,
        Format: CU_AD_FORMAT_FLOAT,
        NumChannels: 1,
        Flags: 0,
    }
}

/// What the two threads of a reuse scenario share: whether the other thread has made its object
/// (and its handle), and whether this thread's destroy has returned.
#[derive(Default)]
struct Reuse {
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
fn destroy_while_made(
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
fn pool_reuse(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let ctx = setup(api, dev)? as usize;
    let size = o.num("size", 100 << 20)? as usize;
    let again = o.num("again", 200 << 20)? as usize;
    let wait = o.num("wait-ms", 100)?;
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

/// A context destroyed while another thread makes one: where the driver gives the new context the
/// destroyed one's handle (and returns from the destroy a while after the context went), what is
/// charged for the new one must not go with the old one.
/// What device `d`'s graph memory pool holds (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`), or the
/// driver's error.
fn graph_pool(api: &Api, d: CUdevice) -> Value {
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
fn alloc_graph(api: &Api, d: CUdevice, bytes: usize, free: bool) -> Res<CUgraphExec> {
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

/// An executable graph allocating N, launched, destroyed while another thread instantiates one
/// allocating --again T ms later (the driver may give it the destroyed one's handle) and, once the
/// destroy has returned, launches it: the new graph's allocations must still be reserved for.
fn graph_reuse(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 100 << 20)? as usize;
    let again = o.num("again", 200 << 20)? as usize;
    let wait = o.num("wait-ms", 100)?;
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

/// A graph allocating N launched and synchronised (the device's graph pool then holds N spare), then
/// two graphs each allocating N and keeping it, launched at the same moment by a thread each on a
/// stream of its own: they must not both count the pool's spare memory as theirs.
fn graph_race(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 500 << 20)? as usize;
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

/// Two rounds of `k` launches of a 200 us kernel on the current context's default stream, the
/// first synchronised, the second too when `sync`. Under an SM limit the interposer then holds
/// timing events of the context, spare (the first round's, collected during the second) and in
/// flight.
fn kernel_rounds(api: &Api, k: u64, sync: bool) -> Res<()> {
    let (mut m, mut f) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals, a NUL-terminated image and name; the kernel takes no
    // parameters.
    unsafe {
        ck(api, (api.cuModuleLoadData)(&mut m, c"vgpu-sim module".as_ptr() as *const c_void), "cuModuleLoadData")?;
        ck(api, (api.cuModuleGetFunction)(&mut f, m, c"sleep_200us".as_ptr()), "cuModuleGetFunction")?;
        for round in 0..2 {
            for _ in 0..k {
                let (none, s) = (std::ptr::null_mut(), std::ptr::null_mut());
                ck(api, (api.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, s, none, none), "cuLaunchKernel")?;
            }
            if round == 0 || sync {
                ck(api, (api.cuCtxSynchronize)(), "cuCtxSynchronize")?;
            }
        }
    }
    Ok(())
}

/// The primary context of `dev` reset while another thread launches under the limit on device
/// `--other`: the reset context's timing events in flight must not be asked about once the driver
/// has destroyed them.
fn reset_race(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let other = o.num("other", 1)? as i32;
    let k = o.num("launches", 64)?;
    setup(api, dev)?;
    kernel_rounds(api, k, false)?;
    let (ready, reset) = (AtomicBool::new(false), AtomicBool::new(false));
    let (r, rounds) = std::thread::scope(|s| {
        let t = s.spawn(|| -> Res<u64> {
            let go = setup(api, other);
            ready.store(true, SeqCst);
            go?;
            let mut rounds = 0;
            while !reset.load(SeqCst) {
                kernel_rounds(api, k, true)?;
                rounds += 1;
            }
            Ok(rounds)
        });
        while !ready.load(SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // SAFETY: a plain call with a device ordinal.
        let r = unsafe { (api.cuDevicePrimaryCtxReset_v2)(dev) };
        reset.store(true, SeqCst);
        (r, t.join().map_err(|_| "the other thread panicked".to_string()))
    });
    emit(json!({"event": "reset-race", "reset": error_name(api, r), "rounds_during_reset": rounds??}));
    Ok(())
}

fn context_reuse(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 100 << 20)? as usize;
    let again = o.num("again", 200 << 20)? as usize;
    let wait = o.num("wait-ms", 100)?;
    // Each context's malloc heap raised to this much (0: left as it is).
    let heap = o.num("heap", 0)? as usize;
    const HEAP: i32 = 2; // CU_LIMIT_MALLOC_HEAP_SIZE

    // Kernels each context launches, twice, synchronising after each round: under an SM limit, the
    // interposer then holds timing events of the context, spare and in flight, when it ends.
    let launches = o.num("launches", 0)?;
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

/// Allocates in a context (linear, pitched and an array: `--size` each, about), then ends the
/// context `--how`: `destroy` (an explicit context), `release` (the primary context's last release,
/// then retained again) or `reset` (`cuDevicePrimaryCtxReset`); then allocates `--again` bytes.
fn context_end(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let primary = setup(api, dev)?;
    let size = o.num("size", 64 << 20)? as usize;
    let how = o.str("how", "destroy");
    let base = mem_info(api);
    // SAFETY: out-pointers to locals; every handle is one the driver just returned.
    unsafe {
        let mut d = 0;
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        let mut c = std::ptr::null_mut();
        if how == "destroy" {
            // Through the entry point of `--create` (v3 and v4 by name: the table binds v2's ABI).
            match o.str("create", "v2") {
                "v2" => ck(api, (api.cuCtxCreate_v2)(&mut c, 0, d), "cuCtxCreate")?,
                "v3" => {
                    type V3 = unsafe extern "C" fn(*mut CUcontext, *mut c_void, i32, u32, CUdevice) -> CUresult;
                    let f = crate::driver_symbol("cuCtxCreate_v3")?;
                    // SAFETY: cuCtxCreate_v3 has this signature in cuda.h (no affinity parameters).
                    let f = std::mem::transmute::<*mut c_void, V3>(f);
                    ck(api, f(&mut c, std::ptr::null_mut(), 0, 0, d), "cuCtxCreate_v3")?;
                }
                "v4" => {
                    type V4 = unsafe extern "C" fn(*mut CUcontext, *mut c_void, u32, CUdevice) -> CUresult;
                    let f = crate::driver_symbol("cuCtxCreate_v4")?;
                    // SAFETY: cuCtxCreate_v4 has this signature in cuda.h (no create parameters).
                    let f = std::mem::transmute::<*mut c_void, V4>(f);
                    ck(api, f(&mut c, std::ptr::null_mut(), 0, d), "cuCtxCreate_v4")?;
                }
                v => return Err(format!("--create {v}: not v2, v3 or v4")),
            }
        }
        let (mut p, mut q, mut pitch) = (0, 0, 0);
        ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")?;
        ck(api, (api.cuMemAllocPitch_v2)(&mut q, &mut pitch, 4096, size / 4096, 4), "cuMemAllocPitch")?;
        let desc = float_array(size);
        let mut arr = std::ptr::null_mut();
        ck(api, (api.cuArray3DCreate_v2)(&mut arr, &desc), "cuArray3DCreate")?;
        let during = mem_info(api);
        // `cuCtxDestroy` of the primary context first, which the driver refuses (it is released or
        // reset, not destroyed): nothing of it may go.
        let refused = if o.flag("destroy-primary-first") {
            let r = (api.cuCtxDestroy_v2)(primary);
            json!({"result": error_name(api, r), "mem_info": mem_info(api)})
        } else {
            Value::Null
        };
        match how {
            "destroy" => {
                ck(api, (api.cuCtxDestroy_v2)(c), "cuCtxDestroy")?;
                ck(api, (api.cuCtxSetCurrent)(primary), "cuCtxSetCurrent")?;
            }
            "release" => {
                ck(api, (api.cuDevicePrimaryCtxRelease_v2)(d), "cuDevicePrimaryCtxRelease")?;
                setup(api, dev)?;
            }
            "reset" => ck(api, (api.cuDevicePrimaryCtxReset_v2)(d), "cuDevicePrimaryCtxReset")?,
            h => return Err(format!("--how {h}: not destroy, release or reset")),
        }
        let after = mem_info(api);
        let mut r = 0;
        let again = (api.cuMemAlloc_v2)(&mut r, o.num("again", size as u64)? as usize);
        emit(json!({"event": "context_end", "how": how, "base": base, "during": during, "after": after,
            "again": error_name(api, again), "again_mem_info": mem_info(api), "destroy_primary_first": refused}));
    }
    Ok(())
}

fn watch(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    for i in 0..o.num("count", 10)? {
        emit(json!({"event": "mem_info", "i": i, "mem_info": mem_info(api)}));
        std::thread::sleep(std::time::Duration::from_millis(o.num("interval-ms", 100)?));
    }
    Ok(())
}

fn fork_child(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 64 << 20)? as usize;
    let secs = o.float("child-secs")?.unwrap_or(1.0);
    // SAFETY: out-pointer to a local.
    let mut p = 0;
    unsafe { ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")? };
    emit(json!({"event": "parent", "pid": std::process::id(), "mem_info": mem_info(api)}));
    // SAFETY: the child only calls the driver, prints and exits.
    let child = unsafe { libc::fork() };
    if child == 0 {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        let r = unsafe { (api.cuMemGetInfo_v2)(&mut f, &mut t) };
        emit(json!({"event": "child", "pid": std::process::id(), "get_info": error_name(api, r)}));
        std::thread::sleep(std::time::Duration::from_secs_f64(secs));
        // SAFETY: leave without running the parent's destructors twice.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(child, &mut status, 0) };
    emit(json!({"event": "parent-after", "mem_info": mem_info(api)}));
    Ok(())
}

fn exec_self(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    setup(api, dev)?;
    let size = o.num("size", 64 << 20)? as usize;
    let mut p = 0;
    // SAFETY: out-pointer to a local.
    unsafe { ck(api, (api.cuMemAlloc_v2)(&mut p, size), "cuMemAlloc")? };
    emit(json!({"event": "before-exec", "pid": std::process::id(), "mem_info": mem_info(api)}));
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let err = std::os::unix::process::CommandExt::exec(std::process::Command::new(exe).args([
        "hold",
        "--device",
        &dev.to_string(),
    ]));
    Err(format!("exec: {err}"))
}

fn threads(api: &Api, dev: i32, o: &Opts) -> Res<()> {
    let ctx = setup(api, dev)? as usize;
    let t = o.num("threads", 16)?;
    let iters = o.num("iters", 100)?;
    let size = o.num("size", 1 << 20)? as usize;
    // Allocators that need no stream or pool of their own.
    let kind = o.str("allocator", "device");
    if !["device", "managed", "pitch", "vmm", "array"].contains(&kind) {
        return Err(format!("threads: allocator {kind:?} is not one of device, managed, pitch, vmm, array"));
    }
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..t)
            .map(|_| {
                s.spawn(move || {
                    let mut errs = Vec::new();
                    let al = Allocator {
                        api,
                        kind: kind.to_owned(),
                        dev,
                        stream: std::ptr::null_mut(),
                        pool: std::ptr::null_mut(),
                    };
                    // SAFETY: the primary context stays retained for the process; each chunk is
                    // freed once, by the allocator that made it.
                    unsafe {
                        (api.cuCtxSetCurrent)(ctx as CUcontext);
                        for _ in 0..iters {
                            let c = match al.alloc(size) {
                                Ok((c, _)) => c,
                                Err(r) => {
                                    errs.push(error_name(api, r));
                                    continue;
                                }
                            };
                            let r = al.free(c);
                            if r != CUresult::SUCCESS {
                                errs.push(error_name(api, r));
                            }
                        }
                    }
                    errs
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    emit(
        json!({"event": "threads", "threads": t, "iters": iters, "failures": errors.len(), "errors": errors, "mem_info": mem_info(api)}),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("12"), Some(12));
        assert_eq!(super::parse_size("4k"), Some(4096));
        assert_eq!(super::parse_size("2G"), Some(2 << 30));
        assert_eq!(super::parse_size("x"), None);
    }
}

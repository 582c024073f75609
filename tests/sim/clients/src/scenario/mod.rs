//! Scenarios the clients run; each prints JSON lines on stdout (`{"event": ...}`). The command
//! line is parsed by clap ([`Cli`]); the scenarios live by topic: `memory` (allocators, pools,
//! physical memory, context limits, threads), `launch`, `graphs`, `contexts`, `reuse` (handles the
//! driver hands out again while one is destroyed) and `process` (info, watching, fork and exec).

mod contexts;
mod graphs;
mod launch;
mod memory;
mod process;
mod reuse;
mod serve;

use crate::abi::*;
use crate::{error_name, Api};
use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::Write;

pub const USAGE: &str = "\
scenarios in detail:
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
every scenario: --device I (default 0); sizes accept k, m, g suffixes (powers of 1024)";

/// A CUDA client: binds the driver API its way (linked, `dlsym`, `cuGetProcAddress`), runs one
/// scenario and prints what the driver answered as JSON lines.
#[derive(Parser, Debug)]
#[command(after_long_help = USAGE)]
pub struct Cli {
    /// The CUDA version entry points are asked for at (`cuGetProcAddress`; 12040 is 12.4).
    #[arg(long, global = true, default_value_t = 12040)]
    pub cuda_version: i32,
    /// Ask `cuGetProcAddress` for the per-thread default stream forms (`_ptsz`).
    #[arg(long, global = true)]
    pub per_thread: bool,
    /// The device the scenario runs on.
    #[arg(long, global = true, default_value_t = 0)]
    pub device: i32,
    /// Use --device as the driver's device handle itself, without `cuDeviceGet` (as code that
    /// takes a handle for an ordinal does).
    #[arg(long, global = true)]
    pub raw_device: bool,
    /// Map this file read-only for the process's life before anything else: what a process that
    /// skips libvgpu.so does to pass for one of its slice's (mapping the slice's region).
    #[arg(long, global = true)]
    pub map_file: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub scenario: Scenario,
}

/// The scenarios (`--help` after one names its options; `--help` here describes each in detail).
#[derive(Subcommand, Debug)]
pub enum Scenario {
    /// Devices, versions and memory info as the driver reports them.
    Info,
    /// After a context, memory info every --every-ms for --seconds.
    WatchFree(process::WatchFreeArgs),
    /// A context made, then held until killed.
    Hold,
    Alloc(memory::AllocArgs),
    Launch(launch::LaunchArgs),
    Serve(serve::ServeArgs),
    Memcpy(memory::MemcpyArgs),
    GraphMem(graphs::GraphMemArgs),
    Pool(memory::PoolArgs),
    Vmm(memory::VmmArgs),
    Threads(memory::ThreadsArgs),
    Contexts(contexts::ContextsArgs),
    ContextEnd(contexts::ContextEndArgs),
    ContextReuse(reuse::ContextReuseArgs),
    ResetRace(contexts::ResetRaceArgs),
    GraphReuse(reuse::ReuseArgs),
    GraphRace(graphs::GraphRaceArgs),
    PoolReuse(reuse::ReuseArgs),
    FreeRefused(memory::FreeRefusedArgs),
    Limits(memory::LimitsArgs),
    Watch(process::WatchArgs),
    ForkChild(process::ForkChildArgs),
    ExecSelf(process::ExecSelfArgs),
    /// Which entry point `cuGetProcAddress_v2` returns for each base name (named with `dladdr`).
    Procaddr {
        /// Base names, as `cuMemAlloc`.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

type Res<T> = Result<T, String>;

/// Runs the scenario `cli` names through `api`.
pub fn run(api: &Api, cli: &Cli) -> Res<()> {
    let dev = cli.device;
    RAW_DEVICE.store(cli.raw_device, std::sync::atomic::Ordering::Relaxed);
    match &cli.scenario {
        Scenario::Info => process::info(api, dev),
        Scenario::WatchFree(a) => process::watch_free(api, dev, a),
        Scenario::Hold => process::hold(api, dev),
        Scenario::Alloc(a) => memory::alloc(api, dev, a),
        Scenario::Launch(a) => launch::launch(api, dev, a),
        Scenario::Serve(a) => serve::serve(api, dev, a),
        Scenario::Memcpy(a) => memory::memcpy(api, dev, a),
        Scenario::GraphMem(a) => graphs::graph_mem(api, dev, a),
        Scenario::Pool(a) => memory::pool_steps(api, dev, a),
        Scenario::Vmm(a) => memory::vmm_steps(api, dev, a),
        Scenario::Threads(a) => memory::threads(api, dev, a),
        Scenario::Contexts(a) => contexts::contexts(api, dev, a),
        Scenario::ContextEnd(a) => contexts::context_end(api, dev, a),
        Scenario::ContextReuse(a) => reuse::context_reuse(api, dev, a),
        Scenario::ResetRace(a) => contexts::reset_race(api, dev, a),
        Scenario::GraphReuse(a) => reuse::graph_reuse(api, dev, a),
        Scenario::GraphRace(a) => graphs::graph_race(api, dev, a),
        Scenario::PoolReuse(a) => reuse::pool_reuse(api, dev, a),
        Scenario::FreeRefused(a) => memory::free_refused(api, dev, a),
        Scenario::Limits(a) => memory::limits(api, dev, a),
        Scenario::Watch(a) => process::watch(api, dev, a),
        Scenario::ForkChild(a) => process::fork_child(api, dev, a),
        Scenario::ExecSelf(a) => process::exec_self(api, dev, a),
        Scenario::Procaddr { .. } => Err("procaddr runs before the driver is bound".into()),
    }
}

/// A size option's value (see [`parse_size`]).
fn size(s: &str) -> Res<u64> {
    parse_size(s).ok_or_else(|| format!("{s:?} is not a size: a number of bytes with an optional k, m or g"))
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
/// `--raw-device`: the device number is the driver's handle.
static RAW_DEVICE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn setup(api: &Api, dev: i32) -> Res<CUcontext> {
    // SAFETY: (the whole module) calls through the bound table with valid out-pointers to locals.
    unsafe {
        ck(api, (api.cuInit)(0), "cuInit")?;
        let mut d = dev;
        if !RAW_DEVICE.load(std::sync::atomic::Ordering::Relaxed) {
            ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        }
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

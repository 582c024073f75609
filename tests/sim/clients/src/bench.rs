//! Call-cost measurement of the driver entry points that the interposer's budgets are about.
//! The same code measures the bare simulator and, later, the simulator behind the interposer.

use crate::abi::*;
use crate::Api;
use std::ffi::c_void;
use std::time::Instant;

/// Median over `batches` of the mean cost of one call in a batch of `per` calls, in ns.
pub fn median_ns(batches: usize, per: usize, f: impl FnMut()) -> f64 {
    median_ns_with(batches, per, || {}, f)
}

/// The same, running `between` (not timed) before each batch. Stream work is measured with the
/// stream drained between batches: a real driver's queue is bounded (a launch waits when it is
/// full), the simulator's is not, and a queue of a hundred thousand launches would make every call
/// (and every figure) a matter of the simulator's growing working set.
pub fn median_ns_with(batches: usize, per: usize, mut between: impl FnMut(), mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..batches)
        .map(|_| {
            between();
            let t = Instant::now();
            for _ in 0..per {
                f();
            }
            t.elapsed().as_nanos() as f64 / per as f64
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[derive(Debug, Clone, Copy)]
pub struct Figures {
    pub launch_ns: f64,
    /// `cuLaunchKernel` of a 1 us kernel while the stream holds up to 20 000 of them: the GPU far
    /// behind the launches, as in a stream of small kernels (measurements then stay in flight).
    pub deep_launch_ns: f64,
    pub alloc_free_ns: f64,
    pub alloc_free_30k_ns: f64,
    pub get_info_ns: f64,
    /// `cuGraphLaunch` of a one-kernel graph, and of a graph that allocates and frees 4 KiB in
    /// graph memory nodes.
    pub graph_launch_ns: f64,
    pub graph_mem_launch_ns: f64,
    /// `cuMemAllocAsync` + `cuMemFreeAsync` (4 KiB) on a stream, from the device's pool.
    pub async_pair_ns: f64,
}

fn ok(r: CUresult, what: &str) {
    assert!(r == CUresult::SUCCESS, "{what} failed: {}", r.0);
}

/// Measures on device 0 with the primary context current. `scale` divides the iteration counts.
pub fn measure(api: &Api, scale: usize) -> Figures {
    let per = (1000 / scale).max(10);
    let batches = 101;
    // SAFETY: calls through the bound table with out-pointers to locals.
    unsafe {
        ok((api.cuInit)(0), "cuInit");
        let mut c = std::ptr::null_mut();
        ok((api.cuDevicePrimaryCtxRetain)(&mut c, 0), "cuDevicePrimaryCtxRetain");
        ok((api.cuCtxSetCurrent)(c), "cuCtxSetCurrent");
        let mut m = std::ptr::null_mut();
        ok((api.cuModuleLoadData)(&mut m, c"bench".as_ptr() as *const c_void), "cuModuleLoadData");
        let mut f = std::ptr::null_mut();
        ok((api.cuModuleGetFunction)(&mut f, m, c"sleep_0ns".as_ptr()), "cuModuleGetFunction");
        let mut s = std::ptr::null_mut();
        ok((api.cuStreamCreate)(&mut s, 0), "cuStreamCreate");

        let drain = || ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        let launch_ns = median_ns_with(batches, per, drain, || {
            (api.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, s, std::ptr::null_mut(), std::ptr::null_mut());
        });
        ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        let mut short = std::ptr::null_mut();
        ok((api.cuModuleGetFunction)(&mut short, m, c"sleep_1us".as_ptr()), "cuModuleGetFunction");
        // 20 batches of 1000 (not scaled: the queue's depth is the point), drained only before.
        let deep_launch_ns = median_ns(20, 1000, || {
            (api.cuLaunchKernel)(short, 1, 1, 1, 32, 1, 1, 0, s, std::ptr::null_mut(), std::ptr::null_mut());
        });
        ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        let pair = || {
            let mut p = 0;
            ok((api.cuMemAlloc_v2)(&mut p, 4096), "cuMemAlloc");
            ok((api.cuMemFree_v2)(p), "cuMemFree");
        };
        let alloc_free_ns = median_ns(batches, per / 4 + 1, pair);
        let live: Vec<CUdeviceptr> = (0..30_000 / scale)
            .map(|_| {
                let mut p = 0;
                ok((api.cuMemAlloc_v2)(&mut p, 4096), "cuMemAlloc");
                p
            })
            .collect();
        let alloc_free_30k_ns = median_ns(batches, per / 4 + 1, pair);
        for p in live {
            ok((api.cuMemFree_v2)(p), "cuMemFree");
        }
        let get_info_ns = median_ns(batches, per, || {
            let (mut fr, mut t) = (0, 0);
            (api.cuMemGetInfo_v2)(&mut fr, &mut t);
        });
        let instantiate = |g: CUgraph| {
            let mut e = std::ptr::null_mut();
            ok((api.cuGraphInstantiateWithFlags)(&mut e, g, 0), "cuGraphInstantiate");
            e
        };
        let mut g = std::ptr::null_mut();
        ok((api.cuGraphCreate)(&mut g, 0), "cuGraphCreate");
        let k = CUDA_KERNEL_NODE_PARAMS_v2 {
            func: f,
            gridDimX: 1,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: 32,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            kernelParams: std::ptr::null_mut(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        };
        let mut n = std::ptr::null_mut();
        ok((api.cuGraphAddKernelNode_v2)(&mut n, g, std::ptr::null(), 0, &k), "cuGraphAddKernelNode");
        let plain = instantiate(g);
        let graph_launch_ns = median_ns_with(batches, per / 4 + 1, drain, || {
            (api.cuGraphLaunch)(plain, s);
        });
        ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        let mut g = std::ptr::null_mut();
        ok((api.cuStreamBeginCapture_v2)(s, 0), "cuStreamBeginCapture");
        let mut p = 0;
        ok((api.cuMemAllocAsync)(&mut p, 4096, s), "cuMemAllocAsync (captured)");
        ok((api.cuMemFreeAsync)(p, s), "cuMemFreeAsync (captured)");
        ok((api.cuStreamEndCapture)(s, &mut g), "cuStreamEndCapture");
        let with_mem = instantiate(g);
        let graph_mem_launch_ns = median_ns_with(batches, per / 4 + 1, drain, || {
            ok((api.cuGraphLaunch)(with_mem, s), "cuGraphLaunch (graph memory)");
        });
        ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        let async_pair_ns = median_ns_with(batches, per / 4 + 1, drain, || {
            let mut p = 0;
            ok((api.cuMemAllocAsync)(&mut p, 4096, s), "cuMemAllocAsync");
            ok((api.cuMemFreeAsync)(p, s), "cuMemFreeAsync");
        });
        ok((api.cuStreamSynchronize)(s), "cuStreamSynchronize");
        Figures {
            launch_ns,
            deep_launch_ns,
            alloc_free_ns,
            alloc_free_30k_ns,
            get_info_ns,
            graph_launch_ns,
            graph_mem_launch_ns,
            async_pair_ns,
        }
    }
}

/// What a benchmark that runs the agent needs next to it (in `dir`, the release binaries'): the
/// path of each, checked, with the simulated driver libraries linked under `dir/sim-lib` by the
/// names a process loads (`libcuda.so.1`, `libnvidia-ml.so.1`). Returns that directory.
pub fn sim_libs(dir: &std::path::Path) -> std::path::PathBuf {
    let libs = dir.join("sim-lib");
    std::fs::create_dir_all(&libs).unwrap();
    for (name, file) in [("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia_ml.so")] {
        let _ = std::fs::remove_file(libs.join(name));
        std::os::unix::fs::symlink(need(dir.join(file)), libs.join(name)).unwrap();
    }
    libs
}

/// `p`, which must exist (a benchmark's binary or library).
pub fn need(p: std::path::PathBuf) -> std::path::PathBuf {
    assert!(p.exists(), "{} is missing: build the release binaries first (see the usage)", p.display());
    p
}

//! Call-cost measurement of the driver entry points that the interposer's budgets are about.
//! The same code measures the bare simulator and, later, the simulator behind the interposer.

use crate::abi::*;
use crate::Api;
use std::ffi::c_void;
use std::time::Instant;

/// Median over `batches` of the mean cost of one call in a batch of `per` calls, in ns.
pub fn median_ns(batches: usize, per: usize, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..batches)
        .map(|_| {
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
    pub alloc_free_ns: f64,
    pub alloc_free_30k_ns: f64,
    pub get_info_ns: f64,
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

        let launch_ns = median_ns(batches, per, || {
            (api.cuLaunchKernel)(f, 1, 1, 1, 32, 1, 1, 0, s, std::ptr::null_mut(), std::ptr::null_mut());
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
        Figures { launch_ns, alloc_free_ns, alloc_free_30k_ns, get_info_ns }
    }
}

//! Contexts: allocations in contexts of their own, contexts ended every way, a reset racing
//! launches.

use super::*;

/// Allocations in contexts of their own, destroyed.
#[derive(Args, Debug)]
pub struct ContextsArgs {
    #[arg(long, default_value = "64m", value_parser = size)]
    pub size: u64,
}

/// The primary context reset while another thread launches.
#[derive(Args, Debug)]
pub struct ResetRaceArgs {
    #[arg(long, default_value = "1", value_parser = size)]
    pub other: u64,
    #[arg(long, default_value = "64", value_parser = size)]
    pub launches: u64,
}

/// Allocations in a context, then the context ended --how; then --again bytes.
#[derive(Args, Debug)]
pub struct ContextEndArgs {
    #[arg(long, default_value = "64m", value_parser = size)]
    pub size: u64,
    #[arg(long, value_parser = size)]
    pub again: Option<u64>,
    #[arg(long)]
    pub destroy_primary_first: bool,
    #[arg(long, default_value = "destroy")]
    pub how: String,
    #[arg(long, default_value = "v2")]
    pub create: String,
}

pub(super) fn contexts(api: &Api, dev: i32, a: &ContextsArgs) -> Res<()> {
    let primary = setup(api, dev)?;
    let size = a.size as usize;
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

/// Two rounds of `k` launches of a 200 us kernel on the current context's default stream, the
/// first synchronised, the second too when `sync`. Under an SM limit the interposer then holds
/// timing events of the context, spare (the first round's, collected during the second) and in
/// flight.
pub(super) fn kernel_rounds(api: &Api, k: u64, sync: bool) -> Res<()> {
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
pub(super) fn reset_race(api: &Api, dev: i32, a: &ResetRaceArgs) -> Res<()> {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let other = a.other as i32;
    let k = a.launches;
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

/// Allocates in a context (linear, pitched and an array: `--size` each, about), then ends the
/// context `--how`: `destroy` (an explicit context), `release` (the primary context's last release,
/// then retained again) or `reset` (`cuDevicePrimaryCtxReset`); then allocates `--again` bytes.
pub(super) fn context_end(api: &Api, dev: i32, a: &ContextEndArgs) -> Res<()> {
    let primary = setup(api, dev)?;
    let size = a.size as usize;
    let how = a.how.as_str();
    let base = mem_info(api);
    // SAFETY: out-pointers to locals; every handle is one the driver just returned.
    unsafe {
        let mut d = 0;
        ck(api, (api.cuDeviceGet)(&mut d, dev), "cuDeviceGet")?;
        let mut c = std::ptr::null_mut();
        if how == "destroy" {
            // Through the entry point of `--create` (v3 and v4 by name: the table binds v2's ABI).
            match a.create.as_str() {
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
        let refused = if a.destroy_primary_first {
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
        let again = (api.cuMemAlloc_v2)(&mut r, a.again.unwrap_or(size as u64) as usize);
        emit(json!({"event": "context_end", "how": how, "base": base, "during": during, "after": after,
            "again": error_name(api, again), "again_mem_info": mem_info(api), "destroy_primary_first": refused}));
    }
    Ok(())
}

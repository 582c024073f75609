//! What the driver reports, watched over time, and processes that fork or exec.

use super::*;

/// After a context, memory info every --every-ms for --seconds.
#[derive(Args, Debug)]
pub struct WatchFreeArgs {
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    #[arg(long, default_value_t = 20)]
    pub every_ms: u64,
}

pub(super) fn watch_free(api: &Api, dev: i32, a: &WatchFreeArgs) -> Res<()> {
    setup(api, dev)?;
    emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_secs(a.seconds) {
        emit(json!({"t_ms": t.elapsed().as_millis() as u64, "mem_info": mem_info(api)}));
        std::thread::sleep(std::time::Duration::from_millis(a.every_ms));
    }
    Ok(())
}

pub(super) fn hold(api: &Api, dev: i32) -> Res<()> {
    setup(api, dev)?;
    emit(json!({"event": "ready", "pid": std::process::id(), "mem_info": mem_info(api)}));
    hold_forever()
}

/// Memory info --count times, every --interval-ms.
#[derive(Args, Debug)]
pub struct WatchArgs {
    #[arg(long, default_value = "10", value_parser = size)]
    pub count: u64,
    #[arg(long, default_value = "100", value_parser = size)]
    pub interval_ms: u64,
}

/// Allocate, fork a child that asks for memory info, wait.
#[derive(Args, Debug)]
pub struct ForkChildArgs {
    #[arg(long, default_value = "64m", value_parser = size)]
    pub size: u64,
    #[arg(long)]
    pub child_secs: Option<f64>,
}

/// Allocate, then exec this binary's `hold` scenario.
#[derive(Args, Debug)]
pub struct ExecSelfArgs {
    #[arg(long, default_value = "64m", value_parser = size)]
    pub size: u64,
}

pub(super) fn info(api: &Api, dev: i32) -> Res<()> {
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

pub(super) fn watch(api: &Api, dev: i32, a: &WatchArgs) -> Res<()> {
    setup(api, dev)?;
    for i in 0..a.count {
        emit(json!({"event": "mem_info", "i": i, "mem_info": mem_info(api)}));
        std::thread::sleep(std::time::Duration::from_millis(a.interval_ms));
    }
    Ok(())
}

pub(super) fn fork_child(api: &Api, dev: i32, a: &ForkChildArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
    let secs = a.child_secs.unwrap_or(1.0);
    let mut p = 0;
    // SAFETY: out-pointer to a local.
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

pub(super) fn exec_self(api: &Api, dev: i32, a: &ExecSelfArgs) -> Res<()> {
    setup(api, dev)?;
    let size = a.size as usize;
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

//! The serve scenario: an inference-like service. Requests arrive at a fixed rate (or, with
//! `--arrivals poisson`, at random at that mean rate); each launches `--kernels` kernels on its
//! stream and waits for them. Prints each request's latency (from its
//! arrival to its completion) as percentiles: what a neighbour's queued work costs a service.

use super::*;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Requests per second
    #[arg(long, default_value = "100")]
    pub rate: f64,
    /// How long to serve
    #[arg(long, default_value = "3")]
    pub seconds: f64,
    /// The kernel of a request (sleep_<N><unit>, wave_<N><unit>)
    #[arg(long, default_value = "sleep_500us")]
    pub kernel: String,
    /// Kernels per request
    #[arg(long, default_value = "1")]
    pub kernels: u64,
    /// Blocks of a request's kernel (a `wave_` kernel takes a wave per SM's worth)
    #[arg(long, default_value = "1")]
    pub grid: u32,
    /// Requests before the measured ones (estimates settle)
    #[arg(long, default_value = "20")]
    pub warmup: u64,
    /// When requests arrive: `fixed` (one every 1/rate s) or `poisson` (independent, at that mean
    /// rate)
    #[arg(long, default_value = "fixed", value_parser = ["fixed", "poisson"])]
    pub arrivals: String,
}

/// The arrival times of `n` requests at `rate` a second, from 0: evenly spaced, or with
/// exponentially distributed gaps (a fixed seed, so that runs compare).
fn arrivals(n: u64, rate: f64, poisson: bool) -> Vec<std::time::Duration> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if !poisson {
                return std::time::Duration::from_secs_f64(i as f64 / rate);
            }
            let at = std::time::Duration::from_secs_f64(t);
            // xorshift64*, then a uniform in (0, 1] for the gap's inverse CDF.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let u = ((x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            t += -u.ln() / rate;
            at
        })
        .collect()
}

/// The `q` quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

pub fn serve(api: &Api, dev: i32, a: &ServeArgs) -> Res<()> {
    let _ctx = setup(api, dev)?;
    let image = b"vgpu-sim module\0";
    let name = CString::new(a.kernel.as_str()).map_err(|e| e.to_string())?;
    let total = a.warmup + (a.seconds * a.rate).ceil() as u64;
    let at = arrivals(total, a.rate.max(0.001), a.arrivals == "poisson");
    let mut lat_us = Vec::with_capacity(total as usize);
    let mut late = 0u64;
    // SAFETY: calls through the table with out-pointers to locals; no kernel parameters.
    unsafe {
        let (mut m, mut f, mut s) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        ck(api, (api.cuModuleLoadData)(&mut m, image.as_ptr() as *const c_void), "cuModuleLoadData")?;
        ck(api, (api.cuModuleGetFunction)(&mut f, m, name.as_ptr()), "cuModuleGetFunction")?;
        ck(api, (api.cuStreamCreate)(&mut s, 0), "cuStreamCreate")?;
        let start = std::time::Instant::now();
        for (i, offset) in at.iter().enumerate() {
            let arrival = start + *offset;
            let now = std::time::Instant::now();
            if now < arrival {
                std::thread::sleep(arrival - now);
            } else if i > 0 {
                late += 1;
            }
            for _ in 0..a.kernels {
                let none = std::ptr::null_mut();
                ck(api, (api.cuLaunchKernel)(f, a.grid, 1, 1, 1, 1, 1, 0, s, none, none), "cuLaunchKernel")?;
            }
            ck(api, (api.cuStreamSynchronize)(s), "cuStreamSynchronize")?;
            if i as u64 >= a.warmup {
                lat_us.push(arrival.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    lat_us.sort_by(f64::total_cmp);
    let mean = lat_us.iter().sum::<f64>() / lat_us.len().max(1) as f64;
    println!(
        "{}",
        json!({"event": "served", "pid": std::process::id(), "requests": lat_us.len(), "late_arrivals": late,
               "arrivals": a.arrivals,
               "mean_us": mean, "p50_us": quantile(&lat_us, 0.5), "p90_us": quantile(&lat_us, 0.9),
               "p99_us": quantile(&lat_us, 0.99),
               "p999_us": quantile(&lat_us, 0.999), "max_us": lat_us.last().copied().unwrap_or(0.0)})
    );
    Ok(())
}

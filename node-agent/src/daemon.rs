//! The agent's main loop (first part): recover the slices on record, then run a monitoring pass every
//! `monitor_interval_ms` until SIGTERM or SIGINT, logging escapes and writing a status snapshot
//! (`<state_dir>/status.json`, replaced atomically) for operators and tools.

use crate::config::Config;
use crate::discovery::{self, Inventory};
use crate::monitor::{self, Escape, Report};
use crate::slices::{Slice, SliceStore};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, SeqCst);
}

#[derive(Serialize)]
struct Status<'a> {
    inventory: &'a Inventory,
    slices: &'a [Slice],
    report: &'a Report,
    /// Duration of the last pass, in microseconds.
    loop_us: u64,
}

/// Runs until a termination signal; returns the number of passes made.
pub fn run(cfg: &Config) -> Result<u64, String> {
    // SAFETY: installing an async-signal-safe handler (it only stores to an atomic).
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    std::fs::create_dir_all(&cfg.state_dir).map_err(|e| format!("cannot create {}: {e}", cfg.state_dir.display()))?;
    let store = SliceStore::open(&cfg.state_dir).map_err(|e| e.to_string())?;
    let recovered = store.list().map_err(|e| e.to_string())?;
    tracing::info!(slices = recovered.len(), state_dir = %cfg.state_dir.display(), "recovered slices");
    let nvml = discovery::open(cfg.nvml_library.as_deref()).map_err(|e| e.to_string())?;
    let inventory = discovery::discover(&nvml).map_err(|e| e.to_string())?;
    for g in &inventory.gpus {
        tracing::info!(gpu = %g.uuid, index = g.index, name = %g.name, memory = g.memory_total, "discovered GPU");
    }
    let period = Duration::from_millis(cfg.monitor_interval_ms);
    let mut passes = 0;
    while !STOP.load(SeqCst) {
        let t = Instant::now();
        match monitor::tick(&nvml, &store) {
            Ok(report) => {
                if report.reclaimed > 0 {
                    tracing::info!(bytes = report.reclaimed, "reclaimed memory of dead processes");
                }
                for e in &report.escapes {
                    match e {
                        Escape::Unaccounted { gpu, pid, memory } => {
                            tracing::warn!(gpu = %gpu, pid, memory, "GPU process outside every slice")
                        }
                        Escape::OverLimit { slice, gpu, measured, limit } => {
                            tracing::warn!(slice = %slice, gpu = %gpu, measured, limit, "slice over its memory limit")
                        }
                    }
                }
                let slices = store.list().unwrap_or_default();
                let status = Status {
                    inventory: &inventory,
                    slices: &slices,
                    report: &report,
                    loop_us: t.elapsed().as_micros() as u64,
                };
                write_status(cfg, &status);
            }
            Err(e) => tracing::error!(error = %e, "monitoring pass failed"),
        }
        passes += 1;
        let spent = t.elapsed();
        if spent < period {
            std::thread::sleep(period - spent);
        }
    }
    tracing::info!(passes, "shutting down");
    Ok(passes)
}

fn write_status(cfg: &Config, status: &Status<'_>) {
    let path = cfg.state_dir.join("status.json");
    let tmp = cfg.state_dir.join("status.json.tmp");
    let data = serde_json::to_vec_pretty(status).expect("serialisable");
    if let Err(e) = std::fs::write(&tmp, data).and_then(|_| std::fs::rename(&tmp, &path)) {
        tracing::error!(error = %e, path = %path.display(), "cannot write the status snapshot");
    }
}

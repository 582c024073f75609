//! MPS (docs/mps.md). A slice on an MPS GPU is held to its partition of the SMs by MPS itself: its
//! active thread percentage, which the driver reads from the environment at `cuInit`, as it reads
//! the pinned device memory limit. The hook sets both there first, to the slice's or to the
//! process's own where that is lower, so that a process cannot raise them; a process of such a
//! slice that is an MPS client is then not throttled by time as well (`sm::applies`). One that has
//! no pipe directory (`CUDA_MPS_PIPE_DIRECTORY` unset) does not reach MPS, and is throttled by time
//! as any slice's process.
//!
//! Setting the environment races with another thread reading it at that moment; `cuInit` comes
//! before a process's CUDA threads, and the hook does it once.

use crate::config::parse_size;
use crate::log::{vlog, INFO};
use crate::real::cuda_fns as f;
use crate::state::{state, State};
use cuda_abi::CUresult;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Once;

/// The process is an MPS client of its slice's GPU (see the module's head).
static CLIENT: AtomicBool = AtomicBool::new(false);

/// Whether the process is an MPS client of its slice's GPU, with its share held by MPS.
#[inline]
pub fn client() -> bool {
    CLIENT.load(Relaxed)
}

/// `cuInit`: the slice's MPS settings set before the driver reads them.
pub unsafe fn init(real: f::cuInit, flags: u32) -> CUresult {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some_and(|d| !d.is_empty()) {
            hold_to_slice(state());
        }
    });
    forward!(real, flags)
}

/// Sets the MPS settings to the slice's where the process's own are higher (or missing).
fn hold_to_slice(st: &State) {
    if !st.mps() {
        return;
    }
    CLIENT.store(true, Relaxed);
    // An MPS slice has one GPU: its device 0, the process's CUDA device 0.
    let pct = st.sm_limit(0);
    let own = std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").ok().and_then(|v| v.trim().parse::<f64>().ok());
    if (1..100).contains(&pct) && own.is_none_or(|o| !(o > 0.0 && o <= f64::from(pct))) {
        std::env::set_var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", pct.to_string());
        vlog!(INFO, "MPS: active thread percentage {pct} (the slice's)");
    }
    let mem = st.mem_limit(0);
    let own = std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").ok().and_then(|v| device0_limit(&v));
    if mem > 0 && own.is_none_or(|o| o == 0 || o > mem) {
        let v = format!("0={}M", mem.div_ceil(1 << 20));
        vlog!(INFO, "MPS: pinned device memory limit {v} (the slice's)");
        std::env::set_var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", v);
    }
}

/// Device 0's limit in a `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` value (`0=1G,1=2G`, or `2G` for every
/// device); None where it names none or does not parse.
fn device0_limit(v: &str) -> Option<u64> {
    v.split(',').map(str::trim).find_map(|item| match item.split_once('=') {
        Some((d, size)) if d.trim() == "0" => parse_size(size),
        Some(_) => None,
        None => parse_size(item),
    })
}

#[cfg(test)]
mod tests {
    use super::device0_limit;

    #[test]
    fn device_0_s_limit_is_read_from_either_form() {
        assert_eq!(device0_limit("0=1G,1=2G"), Some(1 << 30));
        assert_eq!(device0_limit("1=2G, 0=512M"), Some(512 << 20));
        assert_eq!(device0_limit("2G"), Some(2 << 30));
        assert_eq!(device0_limit("1=2G"), None);
        assert_eq!(device0_limit("0=lots"), None);
    }
}

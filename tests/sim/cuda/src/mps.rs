//! A process joining MPS at `cuInit`, as the driver does: where a control daemon answers in the
//! pipe directory, the process becomes a client of the server it names (started for it if need
//! be): its kernels run in the server's context on its partition of the SMs, its memory held to
//! its pinned limit. Where none answers, the process runs on its own, without MPS.
//!
//! The client's settings only narrow the server's: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` above the
//! server's percentage, or a `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` above its limit, leave the server's.

use vgpu_sim::abi::CUresult;
use vgpu_sim::mps::{self, Server};
use vgpu_sim::state::MPS_SERVER;
use vgpu_sim::Node;

/// How long a client waits for the server of another user to finish with its clients.
const WAIT_FOR_SERVER_S: u64 = 60;

/// Joins MPS where a daemon answers; `visible` maps CUDA ordinals to node GPUs.
pub fn join(node: &Node, slot: usize, visible: &[usize]) -> Result<(), CUresult> {
    let dir = mps::pipe_dir();
    // SAFETY: getuid has no preconditions.
    let uid = std::env::var("VGPU_SIM_UID").ok().and_then(|u| u.parse().ok()).unwrap_or(unsafe { libc::getuid() });
    let ask = format!("client {} {uid}", std::process::id());
    let t = std::time::Instant::now();
    let server = loop {
        let Ok(answer) = mps::ask(&dir, &ask) else { return Ok(()) };
        if let Some(s) = Server::parse(&answer) {
            break s;
        }
        if answer != "wait" || t.elapsed().as_secs() >= WAIT_FOR_SERVER_S {
            eprintln!("vgpu-sim libcuda: MPS: {answer}");
            return Err(CUresult::MPS_CONNECTION_FAILED);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let me = &node.shared().procs[slot];
    let env_pct = std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").ok().and_then(|v| mps::parse_pct(&v));
    me.mps_pct.store(env_pct.map_or(server.pct, |p| p.min(server.pct)), std::sync::atomic::Ordering::Release);
    let env_limits = std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").ok().and_then(|v| mps::parse_limits(&v));
    for (ordinal, &g) in visible.iter().enumerate() {
        let theirs = server.limits.iter().find(|(sg, _)| *sg == g).map(|(_, b)| *b);
        let mine =
            env_limits.iter().flatten().filter(|(o, _)| o.is_none_or(|o| o == ordinal)).map(|(_, b)| *b).next_back();
        let limit = match (theirs, mine) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(0),
        };
        me.mps_limit[g].store(limit, std::sync::atomic::Ordering::Release);
    }
    debug_assert_ne!(server.slot as u32 + 1, MPS_SERVER);
    me.mps.store(server.slot as u32 + 1, std::sync::atomic::Ordering::Release);
    Ok(())
}

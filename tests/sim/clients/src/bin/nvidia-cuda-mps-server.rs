//! The simulated node's `nvidia-cuda-mps-server`: started by the control daemon for a user, it holds
//! a context on each GPU the daemon was given (`CUDA_VISIBLE_DEVICES`, indices or UUIDs), so that
//! NVML lists it there with the context's memory, and is the context its clients' kernels run in
//! (see `vgpu_sim::timeline`). It says `ready <slot>` on its standard output once it is, and ends
//! with the daemon (or on SIGTERM).

use std::io::Write;
use std::sync::atomic::Ordering::{AcqRel, Release};
use vgpu_sim::state::MPS_SERVER;
use vgpu_sim::Node;

fn main() {
    // SAFETY: prctl with PR_SET_PDEATHSIG and a signal number has no memory effects.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    let node = Node::global().unwrap_or_else(|e| fail(e));
    let (slot, _liveness) = node.register_process().unwrap_or_else(|e| fail(&e));
    let me = &node.shared().procs[slot];
    me.mps.store(MPS_SERVER, Release);
    let gpus = vgpu_sim::mps::visible_gpus(&node.cfg);
    for &g in &gpus {
        if !node.try_charge(slot, g, node.cfg.context_overhead_bytes) {
            fail(&format!("no memory for the server's context on GPU {g}"));
        }
        me.ctx[g].fetch_add(1, AcqRel);
    }
    println!("ready {slot}");
    let _ = std::io::stdout().flush();
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    // SAFETY: as above.
    while unsafe { libc::getppid() } == parent {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn fail(e: &str) -> ! {
    eprintln!("nvidia-cuda-mps-server: {e}");
    std::process::exit(1)
}

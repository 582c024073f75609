//! Entry points after which SM-time estimates no longer describe the work they are kept for.
//!
//! A graph launch is charged by the estimate kept under its executable handle (see `sm`); when the
//! graph is updated (`cuGraphExecUpdate`), its kernel nodes get other parameters, nodes are enabled
//! or disabled, or it is destroyed (and the driver may give the same handle to the next graph
//! instantiated), that estimate no longer describes it and is forgotten: the next launch is measured
//! afresh. Kept, a graph that became ten times longer would be charged its old time until its old
//! measurements left the estimate's window.
//!
//! Kernel estimates are keyed by function handle and grid, and a module's functions die with it
//! (`cuModuleUnload`, `cuLibraryUnload`; a context's end, see `memory`, takes its modules too): the
//! driver may give their handles to the functions of a module loaded later, so every estimate is
//! forgotten then (the keys do not say which function they came from). Modules are unloaded rarely;
//! each kernel's next launch is measured again.
#![allow(clippy::missing_safety_doc)]

use crate::real::cuda_fns as f;
use crate::sm;
use cuda_abi::*;

/// Forgets `exec`'s estimate when the driver accepted the change.
fn changed(exec: CUgraphExec, r: CUresult) -> CUresult {
    if r == CUresult::SUCCESS {
        sm::forget(exec as u64);
    }
    r
}

/// Before the driver is asked: once it has destroyed the graph, the same handle may name another
/// thread's new graph, whose estimate and allocations must not be taken for this one's. (A refused
/// destroy loses the estimate, which the next launch measures again.)
pub unsafe fn exec_destroy(real: f::cuGraphExecDestroy, exec: CUgraphExec) -> CUresult {
    sm::forget(exec as u64);
    let going = crate::graphmem::going(exec);
    let r = forward!(real, exec);
    if r == CUresult::SUCCESS {
        going.destroyed();
    } else {
        going.stays(exec);
    }
    r
}

pub unsafe fn exec_update(
    real: f::cuGraphExecUpdate,
    exec: CUgraphExec,
    graph: CUgraph,
    err_node: *mut CUgraphNode,
    result: *mut i32,
) -> CUresult {
    changed(exec, forward!(real, exec, graph, err_node, result))
}

pub unsafe fn exec_update_v2(
    real: f::cuGraphExecUpdate_v2,
    exec: CUgraphExec,
    graph: CUgraph,
    info: *mut CUgraphExecUpdateResultInfo,
) -> CUresult {
    changed(exec, forward!(real, exec, graph, info))
}

pub unsafe fn kernel_node_set(
    real: f::cuGraphExecKernelNodeSetParams,
    exec: CUgraphExec,
    node: CUgraphNode,
    p: *const CUDA_KERNEL_NODE_PARAMS,
) -> CUresult {
    changed(exec, forward!(real, exec, node, p))
}

pub unsafe fn kernel_node_set_v2(
    real: f::cuGraphExecKernelNodeSetParams_v2,
    exec: CUgraphExec,
    node: CUgraphNode,
    p: *const CUDA_KERNEL_NODE_PARAMS_v2,
) -> CUresult {
    changed(exec, forward!(real, exec, node, p))
}

pub unsafe fn node_set(
    real: f::cuGraphExecNodeSetParams,
    exec: CUgraphExec,
    node: CUgraphNode,
    p: *mut CUgraphNodeParams,
) -> CUresult {
    changed(exec, forward!(real, exec, node, p))
}

pub unsafe fn child_graph_set(
    real: f::cuGraphExecChildGraphNodeSetParams,
    exec: CUgraphExec,
    node: CUgraphNode,
    child: CUgraph,
) -> CUresult {
    changed(exec, forward!(real, exec, node, child))
}

pub unsafe fn node_enable(real: f::cuGraphNodeSetEnabled, exec: CUgraphExec, node: CUgraphNode, on: u32) -> CUresult {
    changed(exec, forward!(real, exec, node, on))
}

// Every estimate is forgotten before the driver is asked: once it has unloaded the module, its
// functions' handles may name another thread's new kernels, which would be charged the old
// kernels' estimates until a forgetting after the call (which would then drop their first
// measurements too). A refused unload loses estimates that the next launches measure again.

pub unsafe fn module_unload(real: f::cuModuleUnload, m: CUmodule) -> CUresult {
    sm::forget_all();
    forward!(real, m)
}

pub unsafe fn library_unload(real: f::cuLibraryUnload, lib: CUlibrary) -> CUresult {
    sm::forget_all();
    forward!(real, lib)
}

//! Stream capture. A launch into a stream that is being captured runs nothing: it becomes a node of
//! the graph, which is charged when the graph is launched. Such launches must be neither charged nor
//! bracketed by timing events (an event recorded into a capture cannot be queried, and querying
//! events while another thread captures in global mode is not allowed). Captures are counted here so
//! that launches ask the driver whether their stream captures only while some capture is open.
#![allow(clippy::missing_safety_doc)]

use crate::real::{cuda_fns as f, driver};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, Ordering::*};

/// Captures begun and not yet ended in this process.
static OPEN: AtomicI64 = AtomicI64::new(0);

/// Whether any capture is open in this process (one load).
#[inline]
pub fn any_open() -> bool {
    OPEN.load(Relaxed) > 0
}

/// Whether the driver says `stream` is capturing (None: it cannot say). Only asks while a capture
/// is open.
#[inline]
fn status(stream: CUstream) -> Option<bool> {
    if !any_open() {
        return Some(false);
    }
    let is = driver().helpers.cuStreamIsCapturing?;
    let mut status = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's stream handle and an out-pointer to a local.
    (unsafe { is(stream, &mut status) } == CUresult::SUCCESS).then_some(status != CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Whether launches into `stream` are being captured; an unknown answer counts as capturing (the
/// safe side for a launch: it goes through uncharged).
#[inline]
pub fn capturing(stream: CUstream) -> bool {
    status(stream).unwrap_or(true)
}

/// Whether an allocation on `stream` is being captured; an unknown answer counts as not (the safe
/// side for memory: it is charged).
#[inline]
pub fn captures(stream: CUstream) -> bool {
    status(stream).unwrap_or(false)
}

/// A stream about to be destroyed: whether a capture is open on it (asked only while some is).
pub fn destroying(s: CUstream) -> bool {
    status(s) == Some(true)
}

/// The stream was destroyed, and with it any capture that was open on it (`was`): a capture that is
/// never ended must not leave launches asking about capture, and unmeasured, for good.
pub fn destroyed(was: bool) {
    ended(was, CUresult::SUCCESS);
}

fn opened(r: CUresult) -> CUresult {
    if r == CUresult::SUCCESS {
        OPEN.fetch_add(1, Relaxed);
    }
    r
}

/// The per-thread default stream for entry points of the `_ptsz` family.
pub fn ptsz(s: CUstream) -> CUstream {
    if s.is_null() {
        CU_STREAM_PER_THREAD as CUstream
    } else {
        s
    }
}

// The `_ptsz` forms have the same signatures and route here too (their stream argument is only
// forwarded).
pub unsafe fn begin_v1(real: f::cuStreamBeginCapture, s: CUstream) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    opened(unsafe { real(s) })
}

pub unsafe fn begin(real: f::cuStreamBeginCapture_v2, s: CUstream, mode: i32) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    opened(unsafe { real(s, mode) })
}

pub unsafe fn begin_to_graph(
    real: f::cuStreamBeginCaptureToGraph,
    s: CUstream,
    g: CUgraph,
    deps: *const c_void,
    data: *const c_void,
    n: usize,
    mode: i32,
) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    opened(unsafe { real(s, g, deps, data, n, mode) })
}

/// Ends a capture: whatever the driver answers (an invalidated capture ends too), a stream that was
/// capturing no longer is.
fn ended(was: bool, r: CUresult) -> CUresult {
    if was && OPEN.fetch_sub(1, Relaxed) <= 0 {
        OPEN.store(0, Relaxed);
    }
    r
}

pub unsafe fn end(real: f::cuStreamEndCapture, s: CUstream, g: *mut CUgraph) -> CUresult {
    let was = capturing(s);
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    ended(was, unsafe { real(s, g) })
}

pub unsafe fn end_ptsz(real: f::cuStreamEndCapture_ptsz, s: CUstream, g: *mut CUgraph) -> CUresult {
    let was = capturing(ptsz(s));
    // SAFETY: the caller's arguments, forwarded unchanged to the driver's own entry point (the hook's contract).
    ended(was, unsafe { real(s, g) })
}

//! Stream capture. A launch into a stream that is being captured runs nothing: it becomes a node of
//! the graph, which is charged when the graph is launched. Such launches must be neither charged nor
//! bracketed by timing events (an event recorded into a capture cannot be queried, and querying
//! events while another thread captures in global mode is not allowed). Captures are kept here, each
//! with its stream and the stream's context, so that launches ask the driver whether their stream
//! captures only while some capture is open. A capture ends with `cuStreamEndCapture` (whatever the
//! driver answers: an invalidated capture ends too), with its stream's destruction, or with its
//! context's end (see `memory::Going`); one left open for good would leave every later launch of
//! the process asking, and unmeasured.
#![allow(clippy::missing_safety_doc)]

use crate::real::{cuda_fns as f, driver};
use cuda_abi::*;
use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, Ordering::*};
use std::sync::Mutex;

/// How many captures are open in this process (`CAPTURES`' length, for the launch path's one load).
static OPEN: AtomicI64 = AtomicI64::new(0);
/// The open captures: (stream, its context), the per-thread stream as `CU_STREAM_PER_THREAD`.
static CAPTURES: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());

/// Changes the open captures under their lock, and the count with them.
fn with_captures<T>(f: impl FnOnce(&mut Vec<(usize, u64)>) -> T) -> T {
    let mut v = CAPTURES.lock().unwrap_or_else(|p| p.into_inner());
    let t = f(&mut v);
    OPEN.store(v.len() as i64, Relaxed);
    t
}

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

/// A forked child: the captures open are its parent's, in a CUDA it cannot use. With none counted
/// open it never looks at them (nor takes their lock, which a thread it does not have may hold).
pub fn after_fork() {
    OPEN.store(0, Relaxed);
}

/// A stream about to be destroyed: whether a capture is open on it (asked only while some is).
pub fn destroying(s: CUstream) -> bool {
    status(s) == Some(true)
}

/// The stream was destroyed, and with it any capture that was open on it (`was`).
pub fn destroyed(s: CUstream, was: bool) {
    ended(s, was, CUresult::SUCCESS);
}

/// The captures open in context `ctx` (0: a context this process cannot name: every capture), taken
/// out before the driver is asked to end it: they end with it. (After the call, a capture another
/// thread began meanwhile in a new context at the same handle would be taken for one of them.)
#[cold]
pub fn take_context(ctx: u64) -> Vec<(usize, u64)> {
    if !any_open() {
        return Vec::new();
    }
    with_captures(|v| {
        let (gone, kept) = v.drain(..).partition(|&(_, c)| ctx == 0 || c == ctx);
        *v = kept;
        gone
    })
}

/// The driver refused to end the context: its captures are still open.
#[cold]
pub fn put_back(captures: Vec<(usize, u64)>) {
    if !captures.is_empty() {
        with_captures(|v| v.extend(captures));
    }
}

/// A capture begun on `s` (null through a `_ptsz` entry point: the per-thread stream; the legacy
/// stream cannot capture).
fn opened(s: CUstream, r: CUresult) -> CUresult {
    if r == CUresult::SUCCESS {
        let ctx = crate::drv::stream_ctx(ptsz(s));
        with_captures(|v| v.push((ptsz(s) as usize, ctx)));
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
    opened(s, forward!(real, s))
}

pub unsafe fn begin(real: f::cuStreamBeginCapture_v2, s: CUstream, mode: i32) -> CUresult {
    opened(s, forward!(real, s, mode))
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
    opened(s, forward!(real, s, g, deps, data, n, mode))
}

/// Ends the capture on `s`: whatever the driver answers (an invalidated capture ends too), a stream
/// that was capturing no longer is. (One not found under its stream, which cannot be, ends the
/// newest, so that none is left open for good.)
fn ended(s: CUstream, was: bool, r: CUresult) -> CUresult {
    if was && any_open() {
        with_captures(|v| {
            if let Some(i) = v.iter().rposition(|&(x, _)| x == s as usize).or(v.len().checked_sub(1)) {
                v.remove(i);
            }
        });
    }
    r
}

/// `cuStreamEndCapture` and its `_ptsz` twin (`PER_THREAD`: the default stream is the thread's).
pub unsafe fn end<const PER_THREAD: bool>(real: f::cuStreamEndCapture, s: CUstream, g: *mut CUgraph) -> CUresult {
    let mine = if PER_THREAD { ptsz(s) } else { s };
    let was = capturing(mine);
    ended(mine, was, forward!(real, s, g))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_end_with_their_stream_or_context_and_stay_if_the_driver_refuses() {
        let open = || CAPTURES.lock().unwrap().clone();
        with_captures(|v| v.extend([(0x10, 0xc1), (0x20, 0xc2), (0x30, 0xc1)]));
        assert!(any_open());
        // A context about to end gives up its captures; the driver refused, so they are back.
        let taken = take_context(0xc1);
        assert_eq!(taken, [(0x10, 0xc1), (0x30, 0xc1)]);
        assert_eq!((open(), OPEN.load(Relaxed)), (vec![(0x20, 0xc2)], 1));
        put_back(taken);
        assert_eq!(OPEN.load(Relaxed), 3);
        // Ended (or its stream destroyed): that stream's capture goes.
        ended(0x20 as CUstream, true, CUresult::SUCCESS);
        assert_eq!(open(), [(0x10, 0xc1), (0x30, 0xc1)]);
        // A stream that was not capturing ends nothing; one that was but is not known ends the newest.
        ended(0x10 as CUstream, false, CUresult::SUCCESS);
        assert_eq!(OPEN.load(Relaxed), 2);
        ended(0x99 as CUstream, true, CUresult::SUCCESS);
        assert_eq!(open(), [(0x10, 0xc1)]);
        // A context this process cannot name takes every capture with it.
        assert_eq!(take_context(0), [(0x10, 0xc1)]);
        assert!(!any_open());
        ended(0x10 as CUstream, true, CUresult::SUCCESS);
        assert_eq!(OPEN.load(Relaxed), 0, "never below none");
        // A forked child counts none of its parent's captures open.
        with_captures(|v| v.push((0x10, 0xc1)));
        after_fork();
        assert!(!any_open());
        assert!(take_context(0xc1).is_empty());
        assert_eq!(open(), [(0x10, 0xc1)], "left as they were, not looked at");
        with_captures(Vec::clear);
    }
}

//! Which device and context a call is on: the current context's, or a stream's (asked of the
//! driver once per context or per thread and stream, then read from the context table).

use crate::drv;
use crate::state::State;
use cuda_abi::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::*};

/// Where an allocation is made: the current context's region device and the context's id (0: not
/// tracked). One driver call, as `State::current_dev` is, once the context is known.
#[inline]
pub(crate) fn site(st: &State) -> Result<(usize, u64), CUresult> {
    let ctx = drv::current_ctx();
    if ctx != 0 {
        if let Some(found) = st.contexts.lookup(ctx) {
            return Ok(found);
        }
    }
    let (_, d) = st.current_dev()?;
    Ok((d, if ctx == 0 { 0 } else { st.contexts.add(ctx, d) }))
}

/// The id of the current context, a context of region device `d` (0: not tracked).
pub(crate) fn ctx_id(st: &State, d: usize) -> u64 {
    match drv::current_ctx() {
        0 => 0,
        ctx => st.contexts.lookup(ctx).map_or_else(|| st.contexts.add(ctx, d), |(_, id)| id),
    }
}

/// Raised whenever a stream handle may stop naming the stream it named: before a stream is
/// destroyed, and when a context goes (with its streams). A thread's remembered stream is good only
/// under the generation it was asked under.
static STREAMS_GEN: AtomicU64 = AtomicU64::new(0);

/// Per thread: the stream last asked for its device, the generation it was asked under, and the
/// answer (CUDA ordinal, region device). A thread launching into a stream of its own asks once.
#[derive(Clone, Copy)]
struct LastStream {
    stream: usize,
    gen: u64,
    ordinal: CUdevice,
    dev: usize,
}

thread_local! {
    static LAST_STREAM: Cell<LastStream> = const { Cell::new(LastStream { stream: 0, gen: u64::MAX, ordinal: 0, dev: 0 }) };
}

/// Stream handles may be reused from now on for other streams: forget every thread's answer.
pub(crate) fn streams_changed() {
    STREAMS_GEN.fetch_add(1, AcqRel);
}

/// The device of `stream` (CUDA ordinal, region device). The default streams are the current
/// context's, and so is every stream of a process that sees one device; any other stream is asked
/// for its context (one driver call, as `State::current_dev` is), looked up in the context table,
/// and the answer kept for the thread's next call on the same stream while no stream or context
/// went.
#[inline]
pub(crate) fn stream_dev(st: &State, stream: CUstream) -> Result<(CUdevice, usize), CUresult> {
    if st.sees_one_device() || stream as usize <= CU_STREAM_PER_THREAD {
        return st.current_dev();
    }
    let gen = STREAMS_GEN.load(Acquire);
    let last = LAST_STREAM.with(Cell::get);
    if last.stream == stream as usize && last.gen == gen {
        return Ok((last.ordinal, last.dev));
    }
    let ctx = drv::stream_ctx(stream);
    if ctx == 0 {
        // A bad stream (the driver's own call refuses it too), or a driver without the call.
        return st.current_dev();
    }
    let known = st.contexts.lookup(ctx);
    let (ordinal, dev) = match known.and_then(|(d, _)| Some((st.ordinal_of(d)?, d))) {
        Some(found) => found,
        None => context_dev(st, ctx, known.is_some())?,
    };
    // Under the generation read before asking: a stream destroyed meanwhile makes it stale.
    LAST_STREAM.with(|c| c.set(LastStream { stream: stream as usize, gen, ordinal, dev }));
    Ok((ordinal, dev))
}

/// The device of context `ctx`, which the table does not know yet (or not with an ordinal): asked
/// of the driver with the context pushed for the question (unless it is current), and added to the
/// table unless it is there (`known`).
#[cold]
fn context_dev(st: &State, ctx: u64, known: bool) -> Result<(CUdevice, usize), CUresult> {
    let (o, d) = drv::with_context(ctx, || st.current_dev()).unwrap_or_else(|| st.current_dev())?;
    if !known {
        st.contexts.add(ctx, d);
    }
    Ok((o, d))
}

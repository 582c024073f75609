//! The contexts allocations are made in, by a small id, so that when a context goes (destroyed, its
//! primary context released for the last time, or reset) the allocations the driver freed with it
//! are released from the container's usage too.
//!
//! A fixed table of 63 entries, each one word: the context handle in the low 56 bits and its region
//! device + 1 in the top 8 (0: a free entry). The entry's index + 1 is the id packed into each
//! allocation's value (see `ptrmap::pack_in`); 0 means "not tracked" (the table was full), and such
//! allocations stay counted until freed, as before. Lookups read the words without locks; adding
//! and retiring take no locks either (compare-and-swap on a free or a matching entry).
//!
//! Below the table: which device and context a call is on (the current context's, or a stream's).

use crate::drv;
use crate::state::State;
use cuda_abi::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

pub const SLOTS: usize = 63;
const HANDLE: u64 = (1 << 56) - 1;
/// An entry whose context is going: matches no lookup, and is not reused until its sweep is done.
const RETIRED: u64 = u64::MAX;

pub struct Contexts {
    slots: [AtomicU64; SLOTS],
    /// Entries at or above this index have never been used.
    used: AtomicUsize,
}

impl Contexts {
    pub const fn new() -> Contexts {
        Contexts { slots: [const { AtomicU64::new(0) }; SLOTS], used: AtomicUsize::new(0) }
    }

    /// (region device, id) of `ctx`, if it is in the table.
    #[inline]
    pub fn lookup(&self, ctx: u64) -> Option<(usize, u64)> {
        let n = self.used.load(Acquire);
        for (i, e) in self.slots[..n].iter().enumerate() {
            let e = e.load(Acquire);
            if e != RETIRED && e != 0 && e & HANDLE == ctx {
                return Some(((e >> 56) as usize - 1, i as u64 + 1));
            }
        }
        None
    }

    /// Adds `ctx` (a context of region device `dev`) and returns its id; 0 when the table is full
    /// or the handle does not fit.
    #[cold]
    pub fn add(&self, ctx: u64, dev: usize) -> u64 {
        if ctx == 0 || ctx > HANDLE || dev >= 255 {
            return 0;
        }
        let word = (dev as u64 + 1) << 56 | ctx;
        for (i, e) in self.slots.iter().enumerate() {
            if e.compare_exchange(0, word, AcqRel, Relaxed).is_ok() {
                self.used.fetch_max(i + 1, AcqRel);
                return i as u64 + 1;
            }
        }
        0
    }

    /// Marks every entry of `ctx` as going and returns their ids as a bit mask (bit `id`).
    pub fn retire(&self, ctx: u64) -> u64 {
        let mut mask = 0;
        for (i, e) in self.slots.iter().enumerate() {
            let cur = e.load(Acquire);
            if cur != RETIRED
                && cur != 0
                && cur & HANDLE == ctx
                && e.compare_exchange(cur, RETIRED, AcqRel, Relaxed).is_ok()
            {
                mask |= 1u64 << (i + 1);
            }
        }
        mask
    }

    /// Puts back the entries of `mask`, retired for `ctx` of region device `dev`, which did not go
    /// after all (the driver refused to destroy it).
    pub fn restore(&self, mask: u64, ctx: u64, dev: usize) {
        let word = (dev as u64 + 1) << 56 | ctx;
        for (i, e) in self.slots.iter().enumerate() {
            if mask & (1u64 << (i + 1)) != 0 {
                let _ = e.compare_exchange(RETIRED, word, AcqRel, Relaxed);
            }
        }
    }

    /// Frees the entries of `mask` (once no allocation carries their ids any more).
    pub fn free(&self, mask: u64) {
        for (i, e) in self.slots.iter().enumerate() {
            if mask & (1u64 << (i + 1)) != 0 {
                e.store(0, Release);
            }
        }
    }

    /// Forgets every context (a forked child has none).
    pub fn clear(&self) {
        for e in &self.slots {
            e.store(0, Release);
        }
    }
}

// ----- which device a call is on: the current context's, or a stream's -----

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_until_retired_and_reused_only_after_their_sweep() {
        let t = Contexts::new();
        assert_eq!(t.lookup(0x5000), None);
        let a = t.add(0x5000, 0);
        let b = t.add(0x6000, 3);
        assert_eq!((a, b), (1, 2));
        assert_eq!(t.lookup(0x5000), Some((0, 1)));
        assert_eq!(t.lookup(0x6000), Some((3, 2)));
        // A second entry for one context (two threads added it at once): both are retired.
        let a2 = t.add(0x5000, 0);
        assert_eq!(t.retire(0x5000), 1 << a | 1 << a2);
        assert_eq!(t.lookup(0x5000), None, "a retired context matches nothing");
        assert_eq!(t.add(0x7000, 1), 4, "retired entries are not reused before they are freed");
        t.free(1 << a | 1 << a2);
        assert_eq!(t.add(0x5000, 2), 1, "the same handle again (a new context) gets a fresh entry");
        assert_eq!(t.lookup(0x5000), Some((2, 1)));
        assert_eq!(t.retire(0x9999), 0);
    }

    #[test]
    fn entries_put_back_keep_their_ids() {
        let t = Contexts::new();
        let (a, b) = (t.add(0x5000, 2), t.add(0x6000, 0));
        let ids = t.retire(0x5000);
        assert_eq!(t.lookup(0x5000), None);
        t.restore(ids, 0x5000, 2);
        assert_eq!(t.lookup(0x5000), Some((2, a)), "the same id, so its allocations are still its own");
        assert_eq!(t.lookup(0x6000), Some((0, b)), "others untouched");
    }

    #[test]
    fn a_full_table_or_an_odd_handle_gives_no_id() {
        let t = Contexts::new();
        for i in 0..SLOTS as u64 {
            assert_eq!(t.add(0x1000 * (i + 1), 0), i + 1);
        }
        assert_eq!(t.add(0xfff_0000, 0), 0);
        assert_eq!(t.add(1 << 60, 0), 0);
        assert_eq!(t.add(0, 0), 0);
        t.clear();
        assert_eq!(t.lookup(0x1000), None);
    }
}

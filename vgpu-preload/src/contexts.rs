//! The contexts allocations are made in, by a small id, so that when a context goes (destroyed, its
//! primary context released for the last time, or reset) the allocations the driver freed with it
//! are released from the container's usage too.
//!
//! A fixed table of 63 entries, each one word: the context handle in the low 56 bits and its region
//! device + 1 in the top 8 (0: a free entry). The entry's index + 1 is the id packed into each
//! allocation's value (see `ptrmap::pack_in`); 0 means "not tracked" (the table was full), and such
//! allocations stay counted until freed, as before. Lookups read the words without locks; adding
//! and retiring take no locks either (compare-and-swap on a free or a matching entry).

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

//! A lock-free map from allocation address (or handle) to (device, bytes), so that a free subtracts
//! exactly what its allocation charged, in O(1), without locks or allocation on the hot path.
//!
//! Open addressing with linear probing over a table mapped once (pages are committed as touched).
//! Keys are never 0 (empty), 1 (tombstone), 2 (filling) or 3 (held). An insert claims a free slot
//! as filling, writes the value, then publishes the key, so whoever sees a key sees its value (a
//! filling slot holds no key anyone could be removing, so removes pass it by). A sweep
//! ([`PtrMap::take_where`], only when a context goes) holds an entry while it reads the value, so what
//! it judges is that entry's own value (not an earlier occupant's), and a remove that meets a held
//! slot waits the few instructions it stays held. An insert
//! that finds no place within `MAX_PROBE` slots goes to a mutex-protected overflow map (a slow path
//! that a sane workload never reaches).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Mutex;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const FILLING: u64 = 2;
const HELD: u64 = 3;
const MAX_PROBE: usize = 64;

pub struct PtrMap {
    /// Key i at 2i, its value at 2i + 1: one cache line per probe.
    slots: &'static [AtomicU64],
    bits: u32,
    overflow: Mutex<Option<HashMap<u64, u64>>>,
    overflowed: AtomicUsize,
}

fn table(n: usize) -> &'static [AtomicU64] {
    let bytes = n * 8;
    // SAFETY: a private anonymous mapping, zero-filled (all EMPTY), never unmapped; AtomicU64 accepts
    // any bit pattern. Pages are committed as they are first touched (at most 256 faults over a
    // process's life for the default table), which keeps process start cheap. Failure falls back to
    // a leaked heap table.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return Box::leak((0..n).map(|_| AtomicU64::new(0)).collect());
        }
        std::slice::from_raw_parts(p as *const AtomicU64, n)
    }
}

const BYTES: u64 = (1 << 48) - 1;

/// Packs (device, bytes) into one word: device in the top 8 bits, no context (see [`pack_in`]).
pub fn pack(dev: usize, bytes: u64) -> u64 {
    pack_in(dev, 0, bytes)
}

/// Packs (device, context id, bytes): device in the top 8 bits, the id of the context the
/// allocation belongs to in the next 8 (0: none that is tracked), bytes in the low 48 (256 TiB).
pub fn pack_in(dev: usize, ctx: u64, bytes: u64) -> u64 {
    (dev as u64) << 56 | (ctx & 0xff) << 48 | (bytes & BYTES)
}

/// (device, bytes).
pub fn unpack(v: u64) -> (usize, u64) {
    ((v >> 56) as usize, v & BYTES)
}

/// The context id of a packed value.
pub fn ctx_of(v: u64) -> u64 {
    (v >> 48) & 0xff
}

impl PtrMap {
    pub fn new(bits: u32) -> PtrMap {
        let n = 1usize << bits;
        PtrMap { slots: table(2 * n), bits, overflow: Mutex::new(None), overflowed: AtomicUsize::new(0) }
    }

    #[inline]
    fn home(&self, k: u64) -> usize {
        ((k >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - self.bits)) as usize
    }

    #[inline]
    pub fn insert(&self, k: u64, v: u64) {
        debug_assert!(k > HELD);
        let mask = (1usize << self.bits) - 1;
        let h = self.home(k);
        for i in 0..MAX_PROBE {
            let idx = ((h + i) & mask) * 2;
            let key = &self.slots[idx];
            let cur = key.load(Relaxed);
            if (cur == EMPTY || cur == TOMB) && key.compare_exchange(cur, FILLING, AcqRel, Relaxed).is_ok() {
                self.slots[idx + 1].store(v, Relaxed);
                key.store(k, Release);
                return;
            }
        }
        self.insert_slow(k, v);
    }

    #[cold]
    fn insert_slow(&self, k: u64, v: u64) {
        let mut o = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        o.get_or_insert_with(HashMap::new).insert(k, v);
        self.overflowed.fetch_add(1, AcqRel);
    }

    /// The value under `k`, changing nothing.
    #[inline]
    pub fn get(&self, k: u64) -> Option<u64> {
        if k <= HELD {
            return None;
        }
        let mask = (1usize << self.bits) - 1;
        let h = self.home(k);
        for i in 0..MAX_PROBE {
            let idx = ((h + i) & mask) * 2;
            let key = &self.slots[idx];
            let mut cur = key.load(Acquire);
            while cur == HELD {
                std::hint::spin_loop(); // looked at by a sweep: a few instructions
                cur = key.load(Acquire);
            }
            if cur == k {
                // The value was written before the key was published (see `insert`).
                return Some(self.slots[idx + 1].load(Acquire));
            }
            if cur == EMPTY {
                break;
            }
        }
        if self.overflowed.load(Acquire) == 0 {
            return None;
        }
        let o = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        o.as_ref()?.get(&k).copied()
    }

    /// Removes `k`, returning its value.
    #[inline]
    pub fn remove(&self, k: u64) -> Option<u64> {
        if k <= HELD {
            return None;
        }
        let mask = (1usize << self.bits) - 1;
        let h = self.home(k);
        for i in 0..MAX_PROBE {
            let idx = ((h + i) & mask) * 2;
            let key = &self.slots[idx];
            let mut cur = key.load(Acquire);
            loop {
                if cur == HELD {
                    // Looked at by a sweep: a few instructions.
                    std::hint::spin_loop();
                    cur = key.load(Acquire);
                    continue;
                }
                if cur != k {
                    break;
                }
                let v = self.slots[idx + 1].load(Acquire);
                match key.compare_exchange(k, TOMB, AcqRel, Acquire) {
                    Ok(_) => return Some(v),
                    // Held by a sweep (wait and try again), or another remove or a sweep got this
                    // entry: look on, as the key may have a second entry (an address another thread
                    // freed and the driver handed out again, entered before the first entry was
                    // out), which is then this remove's.
                    Err(now) => cur = now,
                }
            }
            if cur == EMPTY {
                break;
            }
        }
        if self.overflowed.load(Acquire) == 0 {
            return None;
        }
        self.remove_slow(k)
    }

    #[cold]
    fn remove_slow(&self, k: u64) -> Option<u64> {
        let mut o = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        let v = o.as_mut()?.remove(&k)?;
        self.overflowed.fetch_sub(1, AcqRel);
        Some(v)
    }

    /// Removes every entry whose value satisfies `gone`, handing each value to `taken` (a cold path:
    /// it reads the whole table). Entries inserted or removed meanwhile are either seen whole or
    /// not at all.
    pub fn take_where(&self, gone: impl Fn(u64) -> bool, mut taken: impl FnMut(u64)) {
        for i in (0..self.slots.len()).step_by(2) {
            let k = self.slots[i].load(Acquire);
            if k <= HELD {
                continue;
            }
            // Claimed, the entry cannot change under us (nor be taken by a remove) until released.
            if self.slots[i].compare_exchange(k, HELD, AcqRel, Relaxed).is_err() {
                continue;
            }
            let v = self.slots[i + 1].load(Relaxed);
            if gone(v) {
                self.slots[i].store(TOMB, Release);
                taken(v);
            } else {
                self.slots[i].store(k, Release);
            }
        }
        if self.overflowed.load(Acquire) == 0 {
            return;
        }
        let mut o = self.overflow.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = o.as_mut() {
            let before = m.len();
            m.retain(|_, v| {
                let g = gone(*v);
                if g {
                    taken(*v);
                }
                !g
            });
            self.overflowed.fetch_sub(before - m.len(), AcqRel);
        }
    }

    /// Forgets everything (a forked child starts with no allocations of its own).
    pub fn clear(&self) {
        for k in self.slots {
            k.store(EMPTY, Relaxed);
        }
        if let Ok(mut o) = self.overflow.lock() {
            *o = None;
        }
        self.overflowed.store(0, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_and_tombstones() {
        let m = PtrMap::new(10);
        for i in 0..700u64 {
            m.insert(0x7f00_0000_0000 + i * 4096, pack(i as usize % 16, i));
        }
        for i in (0..700u64).step_by(2) {
            assert_eq!(m.remove(0x7f00_0000_0000 + i * 4096).map(unpack), Some((i as usize % 16, i)));
        }
        assert_eq!(m.remove(0x7f00_0000_0000), None, "already removed");
        for i in 0..700u64 {
            m.insert(0x7e00_0000_0000 + i * 4096, pack(1, i));
        }
        for i in (1..700u64).step_by(2) {
            assert_eq!(m.remove(0x7f00_0000_0000 + i * 4096).map(unpack), Some((i as usize % 16, i)));
        }
        for i in 0..700u64 {
            assert_eq!(m.remove(0x7e00_0000_0000 + i * 4096), Some(pack(1, i)), "{i}");
        }
        assert_eq!(m.overflowed.load(Relaxed), 0);
    }

    #[test]
    fn lookups_find_what_is_there_past_tombstones() {
        let m = PtrMap::new(10);
        for i in 1..600u64 {
            m.insert(i << 12, i);
        }
        for i in (1..600u64).step_by(3) {
            m.remove(i << 12);
        }
        for i in 1..600u64 {
            let want = if (i - 1).is_multiple_of(3) { None } else { Some(i) };
            assert_eq!(m.get(i << 12), want, "{i}");
        }
        assert_eq!(m.get(0), None);
        assert_eq!(m.get(HELD), None);
        assert_eq!(m.get(1 << 40), None);
        assert_eq!(m.get(2 << 12), Some(2), "a lookup changes nothing");
    }

    #[test]
    fn overflow_keeps_everything() {
        let m = PtrMap::new(6); // 64 slots
        for i in 2..500u64 {
            m.insert(i << 12, i);
        }
        assert!(m.overflowed.load(Relaxed) > 0);
        for i in 2..500u64 {
            assert_eq!(m.get(i << 12), Some(i), "found, in the table or the overflow");
        }
        for i in 2..500u64 {
            assert_eq!(m.remove(i << 12), Some(i));
        }
        assert_eq!(m.overflowed.load(Relaxed), 0);
    }

    #[test]
    fn concurrent_threads() {
        let m = std::sync::Arc::new(PtrMap::new(16));
        let hs: Vec<_> = (0..8u64)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for round in 0..200u64 {
                        let keys: Vec<u64> = (0..50).map(|i| (t << 40) | (round << 20) | (i << 8) | 0x100).collect();
                        for &k in &keys {
                            m.insert(k, k);
                        }
                        for &k in &keys {
                            assert_eq!(m.remove(k), Some(k));
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }

    #[test]
    fn two_entries_of_one_key_removed_at_once_are_both_found() {
        // An address freed by one thread is the driver's to hand out again at once: another
        // thread's allocation may be entered under it before the first thread's entry is out. Two
        // entries of one key, removed by two threads at once: each must get one, or the charge of
        // the one left behind is never released. (The threads start each round spinning on one
        // word, so that their removes meet.)
        use std::sync::atomic::AtomicU64;
        use std::sync::Arc;
        let m = Arc::new(PtrMap::new(4));
        let rounds = 50_000u64;
        let (go, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let other = {
            let (m, go, done) = (m.clone(), go.clone(), done.clone());
            std::thread::spawn(move || {
                let mut got = 0;
                for round in 1..=rounds {
                    while go.load(Acquire) != round {
                        std::hint::spin_loop();
                    }
                    got += m.remove(0x1000).is_some() as u64;
                    done.store(round, Release);
                }
                got
            })
        };
        let mut got = 0;
        for round in 1..=rounds {
            m.insert(0x1000, 1);
            m.insert(0x1000, 2);
            go.store(round, Release);
            got += m.remove(0x1000).is_some() as u64;
            while done.load(Acquire) != round {
                std::hint::spin_loop();
            }
            assert_eq!(m.get(0x1000), None, "round {round}: an entry was left behind");
        }
        assert_eq!(got + other.join().unwrap(), 2 * rounds);
    }

    #[test]
    fn packing() {
        assert_eq!(unpack(pack(15, 123 << 30)), (15, 123 << 30));
        let v = pack_in(255, 63, BYTES);
        assert_eq!((unpack(v), ctx_of(v)), ((255, BYTES), 63));
        assert_eq!(ctx_of(pack(3, 1 << 40)), 0);
    }

    #[test]
    fn take_where_removes_exactly_the_matching_entries_in_table_and_overflow() {
        let m = PtrMap::new(6); // 64 slots: most of these overflow
        for i in 3..300u64 {
            m.insert(i << 12, pack_in(0, i % 3, i));
        }
        assert!(m.overflowed.load(Relaxed) > 0);
        let mut taken = Vec::new();
        m.take_where(|v| ctx_of(v) == 1, |v| taken.push(unpack(v).1));
        taken.sort();
        assert_eq!(taken, (3..300u64).filter(|i| i % 3 == 1).collect::<Vec<_>>());
        for i in 3..300u64 {
            assert_eq!(m.remove(i << 12).is_some(), i % 3 != 1, "{i}");
        }
        assert_eq!(m.overflowed.load(Relaxed), 0);
    }

    #[test]
    fn take_where_beside_concurrent_inserts_never_takes_what_it_should_not() {
        // One slot is used over and over: by an entry of context 1, removed (its value stays behind
        // in the slot), then by one of context 2. A sweep for context 1 running meanwhile must never
        // take the context 2 entry through the value its slot's last occupant left behind.
        use std::sync::atomic::AtomicBool;
        let m = std::sync::Arc::new(PtrMap::new(4));
        let k1 = 0x7f00_0000_1000u64;
        let k2 = (1..).map(|i| k1 + (i << 12)).find(|&k| m.home(k) == m.home(k1)).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (m2, stop2) = (m.clone(), stop.clone());
        let sweeper = std::thread::spawn(move || {
            let mut sweeps = 0u64;
            while !stop2.load(Relaxed) {
                m2.take_where(|v| ctx_of(v) == 1, |_| {});
                sweeps += 1;
            }
            sweeps
        });
        for i in 0..300_000u64 {
            m.insert(k1, pack_in(0, 1, i));
            m.remove(k1);
            m.insert(k2, pack_in(0, 2, i));
            assert_eq!(m.remove(k2), Some(pack_in(0, 2, i)), "iteration {i}: a sweep took context 2's entry");
        }
        stop.store(true, Relaxed);
        assert!(sweeper.join().unwrap() > 0);
    }
}

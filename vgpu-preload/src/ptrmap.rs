//! A lock-free map from allocation address (or handle) to (device, bytes), so that a free subtracts
//! exactly what its allocation charged, in O(1), without locks or allocation on the hot path.
//!
//! Open addressing with linear probing over a table mapped once (pages are committed as touched).
//! Keys are never 0 (empty) or 1 (tombstone). An insert that finds no place within `MAX_PROBE`
//! slots goes to a mutex-protected overflow map (a slow path that a sane workload never reaches).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Mutex;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
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

/// Packs (device, bytes) into one word: device in the top 8 bits.
pub fn pack(dev: usize, bytes: u64) -> u64 {
    (dev as u64) << 56 | (bytes & ((1 << 56) - 1))
}

pub fn unpack(v: u64) -> (usize, u64) {
    ((v >> 56) as usize, v & ((1 << 56) - 1))
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
        debug_assert!(k > TOMB);
        let mask = (1usize << self.bits) - 1;
        let h = self.home(k);
        for i in 0..MAX_PROBE {
            let idx = ((h + i) & mask) * 2;
            let key = &self.slots[idx];
            let cur = key.load(Relaxed);
            if (cur == EMPTY || cur == TOMB) && key.compare_exchange(cur, k, AcqRel, Relaxed).is_ok() {
                self.slots[idx + 1].store(v, Release);
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

    /// Removes `k`, returning its value.
    #[inline]
    pub fn remove(&self, k: u64) -> Option<u64> {
        if k <= TOMB {
            return None;
        }
        let mask = (1usize << self.bits) - 1;
        let h = self.home(k);
        for i in 0..MAX_PROBE {
            let idx = ((h + i) & mask) * 2;
            let cur = self.slots[idx].load(Acquire);
            if cur == k {
                let v = self.slots[idx + 1].load(Acquire);
                if self.slots[idx].compare_exchange(k, TOMB, AcqRel, Relaxed).is_ok() {
                    return Some(v);
                }
                return None; // freed twice concurrently: the other free got it
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
    fn overflow_keeps_everything() {
        let m = PtrMap::new(6); // 64 slots
        for i in 2..500u64 {
            m.insert(i << 12, i);
        }
        assert!(m.overflowed.load(Relaxed) > 0);
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
    fn packing() {
        assert_eq!(unpack(pack(15, 123 << 30)), (15, 123 << 30));
    }
}

//! The entry guard of every hook: re-entrancy (calls made while a hook runs pass straight through)
//! and panics mapped to error codes (a panic never unwinds into C). Where the true-up is on, the
//! driver calls it guards are also counted while they run (see [`Calls`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};

thread_local! {
    /// [`INSIDE`] while the thread runs one of our hooks, [`COUNTED`] while it is in a counted call;
    /// above them, the thread's entry in [`PER_THREAD`] plus one (0: none yet; [`SHARED_ENTRY`]:
    /// all were taken, it counts in [`SHARED`]).
    static GUARD: Cell<u32> = const { Cell::new(0) };
}
const INSIDE: u32 = 1;
const COUNTED: u32 = 2;
const ENTRY_SHIFT: u32 = 2;
const SHARED_ENTRY: u32 = u32::MAX >> ENTRY_SHIFT;

/// True while the calling thread is inside one of our hooks.
#[inline]
pub fn inside() -> bool {
    GUARD.with(|g| g.get() & INSIDE != 0)
}

/// Runs `f` as the outermost hook, or returns None if the thread already is inside a hook.
#[inline]
pub fn run<R>(f: impl FnOnce() -> R, on_panic: R) -> Option<R> {
    guarded(f, on_panic, false)
}

/// [`run`] for a driver call that may change what the driver holds for the process or what the
/// process is charged: counted in [`Calls`] while it runs.
#[inline]
pub fn run_counted<R>(f: impl FnOnce() -> R, on_panic: R) -> Option<R> {
    guarded(f, on_panic, true)
}

#[inline]
fn guarded<R>(f: impl FnOnce() -> R, on_panic: R, count: bool) -> Option<R> {
    GUARD.with(|g| {
        if g.get() & INSIDE != 0 {
            return None;
        }
        let counted = count && begin(g);
        g.set(g.get() | INSIDE);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
            crate::log::vlog!(crate::log::ERROR, "internal error in a hook (panic); the call failed");
            on_panic
        });
        g.set(g.get() & !INSIDE);
        if counted {
            end(g);
        }
        Some(r)
    })
}

/// The process's driver calls in flight, for the true-up: what NVML says the driver holds for the
/// process agrees with what the process is charged only while no call is between its charge and
/// the driver's work (an allocation reserves before the driver allocates, a free is released after
/// the driver freed, a synchronisation lets a pool shrink before its charge is settled). Counted
/// only once [`Calls::track`] was called. Each thread counts in an entry of its own, on a cache line
/// of its own, that only it writes: calls begun (times two) plus one while it is in one. A call
/// costs two plain stores (no atomic read-modify-write, no lock, no system call); the reader, off
/// the hot paths, adds the entries up. Threads beyond the first [`THREADS`] that make counted calls
/// share one word instead (calls begun in the high half, in flight in the low), two atomic additions
/// per call.
pub struct Calls;

const THREADS: usize = 256;

#[repr(align(64))]
struct Entry(AtomicU64);

static PER_THREAD: [Entry; THREADS] = [const { Entry(AtomicU64::new(0)) }; THREADS];
/// Entries handed out.
static ENTRIES: AtomicUsize = AtomicUsize::new(0);
static SHARED: AtomicU64 = AtomicU64::new(0);
static TRACK: AtomicBool = AtomicBool::new(false);
const BEGUN: u64 = 1 << 32;
const IN_FLIGHT: u64 = BEGUN - 1;

/// The calling thread's entry (None: it counts in [`SHARED`]), handed out at its first call.
#[inline]
fn entry(g: &Cell<u32>) -> Option<&'static AtomicU64> {
    let mut e = g.get() >> ENTRY_SHIFT;
    if e == 0 {
        e = new_entry();
        g.set(g.get() | e << ENTRY_SHIFT);
    }
    PER_THREAD.get(e as usize - 1).map(|x| &x.0)
}

#[cold]
fn new_entry() -> u32 {
    let i = ENTRIES.fetch_add(1, Relaxed);
    if i < THREADS {
        i as u32 + 1
    } else {
        SHARED_ENTRY
    }
}

/// Counts a call begun, if calls are counted and the thread is not in one already.
#[inline]
fn begin(g: &Cell<u32>) -> bool {
    if g.get() & COUNTED != 0 || !TRACK.load(Relaxed) {
        return false;
    }
    match entry(g) {
        // Only this thread writes its entry. Released before the call's first charge, which is
        // itself a release: a reader that acquires the charge sees the call begun.
        Some(e) => e.store(e.load(Relaxed) + 3, Release),
        None => {
            SHARED.fetch_add(BEGUN | 1, AcqRel);
        }
    }
    g.set(g.get() | COUNTED);
    true
}

/// The call [`begin`] counted ended, after its last charge or release.
#[inline]
fn end(g: &Cell<u32>) {
    g.set(g.get() & !COUNTED);
    match entry(g) {
        Some(e) => e.store(e.load(Relaxed) - 1, Release),
        None => {
            SHARED.fetch_sub(1, AcqRel);
        }
    }
}

/// What [`Calls::now`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    begun: u64,
    others: u64,
}

impl Snapshot {
    /// No call began between `self` and `later`.
    pub fn none_began_before(self, later: Snapshot) -> bool {
        self.begun == later.begun
    }

    /// No other thread of the process was in a counted call.
    pub fn quiet(self) -> bool {
        self.others == 0
    }
}

impl Calls {
    /// Counts calls from now on (the calls in flight now are not counted, and uncount nothing).
    pub fn track() {
        TRACK.store(true, Release);
    }

    /// The count now, less the calling thread's own call. Not one instant's: but each entry only
    /// grows its calls begun, so two readings with the same total saw every entry unchanged, and a
    /// call in flight between them was in flight at the first.
    pub fn now() -> Snapshot {
        let shared = SHARED.load(Acquire);
        let (mut begun, mut in_flight) = (shared >> 32, shared & IN_FLIGHT);
        for e in &PER_THREAD[..ENTRIES.load(Acquire).min(THREADS)] {
            let v = e.0.load(Acquire);
            begun = begun.wrapping_add(v >> 1);
            in_flight += v & 1;
        }
        let mine = GUARD.with(|g| g.get() & COUNTED != 0) as u64;
        Snapshot { begun, others: in_flight.saturating_sub(mine) }
    }

    /// In a forked child: the parent's other threads, in calls when it forked, are not in the child.
    pub fn after_fork() {
        // The child's only thread: nothing races with these stores.
        GUARD.with(|g| {
            let counted = g.get() & COUNTED != 0;
            let own = (g.get() >> ENTRY_SHIFT) as usize;
            for (i, e) in PER_THREAD.iter().enumerate() {
                if i + 1 != own {
                    e.0.store(e.0.load(Relaxed) & !1, Release);
                }
            }
            let mine = (counted && own == SHARED_ENTRY as usize) as u64;
            SHARED.store((SHARED.load(Relaxed) & !IN_FLIGHT) | mine, Release);
        });
    }
}

/// A counted call outside the entry guard (a graph launch that charges), from [`Call::begin`] to
/// its drop; nothing when the thread already is in one.
pub struct Call(bool);

impl Call {
    #[inline]
    pub fn begin() -> Call {
        Call(GUARD.with(begin))
    }
}

impl Drop for Call {
    #[inline]
    fn drop(&mut self) {
        if self.0 {
            GUARD.with(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_error_values_and_reentry_passes_through() {
        let r = run(|| -> u32 { panic!("boom") }, 999);
        assert_eq!(r, Some(999));
        assert!(!inside(), "the guard is released after a panic");
        let nested = run(|| run(|| 1, 0), Some(0));
        assert_eq!(nested, Some(None), "a call made inside a hook is not policed again");
    }

    /// What `inside` returned, run first in a counted call of another thread, and [`Calls::now`]
    /// read while that call went on. (Checked out here: the guard would turn a failed assertion in
    /// the call into its error value.)
    fn while_another_is_in_a_call<R: Send>(inside: impl Fn() -> R + Sync) -> (R, Snapshot) {
        let (go, wait) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let call = || {
                    let r = inside();
                    go.wait();
                    wait.wait();
                    Some(r)
                };
                run_counted(call, None).flatten()
            });
            go.wait();
            let busy = Calls::now();
            wait.wait();
            (t.join().unwrap().expect("the counted call ran"), busy)
        })
    }

    #[test]
    fn counted_calls_are_seen_by_other_threads_and_not_by_their_own() {
        Calls::track();
        let idle = Calls::now();
        assert!(idle.quiet(), "{idle:?}");
        let (me, busy) = while_another_is_in_a_call(Calls::now);
        assert!(me.quiet(), "its own call: {me:?}");
        assert!(!busy.quiet() && !idle.none_began_before(busy), "{idle:?} {busy:?}");
        let after = Calls::now();
        assert!(after.quiet(), "the call ended: {after:?}");
        // A panicking call is uncounted too, and a nested one is not counted twice.
        let r = run_counted(|| -> u32 { panic!("boom") }, 7);
        assert_eq!(r, Some(7));
        assert!(Calls::now().quiet());
        let nested = run_counted(|| (Calls::now(), run_counted(|| 1, 0)), (after, Some(0)));
        assert_eq!(nested.map(|(s, n)| (s.quiet(), n)), Some((true, None)));
        assert!(Calls::now().quiet() && !after.none_began_before(Calls::now()));
        // More threads than entries: the later ones share one word, and are seen the same.
        for _ in 0..THREADS {
            std::thread::spawn(|| run_counted(|| (), ())).join().unwrap();
        }
        assert!(ENTRIES.load(Relaxed) > THREADS);
        let before = Calls::now();
        let (entry, busy) = while_another_is_in_a_call(|| GUARD.with(|g| g.get() >> ENTRY_SHIFT));
        assert_eq!(entry, SHARED_ENTRY, "counted in the shared word");
        assert!(!busy.quiet() && !before.none_began_before(busy), "{before:?} {busy:?}");
        assert!(Calls::now().quiet());
    }
}

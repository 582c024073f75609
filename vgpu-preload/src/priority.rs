//! Priority tenants (docs/priority.md): the gate between a GPU's high-priority slice and its
//! normal ones.
//!
//! A high-priority slice's processes note each launch's estimated GPU time in their slice's
//! activity file (`vgpu_region::activity`): until when the work they queued is expected to run. The
//! agent links that file into `gates/<gpu-uuid>/`, which every container of the node sees
//! read-only. A normal slice's process on that GPU admits a launch only once that time has passed
//! (the high-priority slice has nothing queued) and while its own queued work (noted in its own
//! activity file) is within the bound the agent wrote in its limits file: what the high-priority
//! slice's next request can find ahead of it on the GPU. Where the high-priority slice's requests
//! come in a steady rhythm (each launch onto its idle queue starts one; their period and jitter are
//! in its activity file), a normal launch is also held when the next request is due before the
//! launch and what is queued could be done: the request then finds the GPU free.
//!
//! A helper thread looks at the gate directories every [`WATCH_EVERY`] and publishes the files it
//! finds (mapped once, never unmapped); the launch path only loads atomics and reads the clock.

use crate::state::State;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::time::Duration;
use vgpu_region::activity::Mapped;
use vgpu_region::MAX_DEVICES;

/// High-priority slices of one GPU followed, at most.
const MAX_HIGH: usize = 8;
/// Activity files mapped in a process's life, at most.
const MAX_MAPS: usize = 256;
/// What a normal slice keeps queued where the agent's limits file says nothing.
const DEFAULT_QUEUE_NS: u64 = 100_000;
/// How often the gate directories are looked at.
const WATCH_EVERY: Duration = Duration::from_millis(20);
/// Longest single wait at the gate; the state is read again after it.
const MAX_WAIT_NS: u64 = 5_000_000;
/// The window over which a normal slice keeps its share of launching (see [`Share`]).
const SHARE_WINDOW_NS: u64 = 100_000_000;
/// That share where the agent's limits file says none (percent).
const DEFAULT_MIN_SHARE: u64 = 10;

/// A normal slice's guaranteed share, per device: once held at the gate for `(100 - share)` % of a
/// window without a break, it launches `share` % of a window's GPU time (by its launches'
/// estimates) whatever the high-priority slice claims to have queued, and without its own queue
/// bound: the high-priority slice is another tenant, who may claim anything, or be busy for ever.
/// A latency service whose queue runs dry between requests never lets a hold last that long.
struct Share {
    /// When the current hold began (0: not held).
    held_since: AtomicU64,
    /// The current free spell's end (0: none), and the GPU time launched in it.
    free_until: AtomicU64,
    spent: AtomicU64,
}

static SHARES: [Share; MAX_DEVICES] =
    [const { Share { held_since: AtomicU64::new(0), free_until: AtomicU64::new(0), spent: AtomicU64::new(0) } };
        MAX_DEVICES];

impl Share {
    /// Whether a launch of `cost` held at `now` by the high-priority slice goes now, its share
    /// being `percent`: within a free spell while its GPU time lasts; else it starts the hold, or
    /// ends it into a free spell once it has lasted its part of the window.
    fn release(&self, now: u64, percent: u64, cost: u64) -> bool {
        let budget = SHARE_WINDOW_NS / 100 * percent;
        if now < self.free_until.load(Relaxed) {
            if self.spent.load(Relaxed).saturating_add(cost) <= budget {
                self.spent.fetch_add(cost, Relaxed);
                return true;
            }
            // Spent: held again from now.
            self.free_until.store(0, Relaxed);
            self.held_since.store(now, Relaxed);
            return false;
        }
        let since = self.held_since.load(Relaxed);
        if since == 0 || since > now {
            self.held_since.store(now, Relaxed);
            return false;
        }
        if now - since >= SHARE_WINDOW_NS - budget {
            // A spell lasts until its GPU time is launched, half a window at most.
            self.spent.store(cost, Relaxed);
            self.free_until.store(now + SHARE_WINDOW_NS / 2, Relaxed);
            self.held_since.store(0, Relaxed);
            return true;
        }
        false
    }

    /// A launch that the high-priority slice did not hold: the hold, if any, is over.
    fn unheld(&self) {
        if self.held_since.load(Relaxed) != 0 {
            self.held_since.store(0, Relaxed);
        }
    }
}

/// One GPU's gate: the high-priority slices' activity files and which of their devices it is.
struct Gate {
    n: AtomicUsize,
    files: [AtomicPtr<Mapped>; MAX_HIGH],
    devs: [AtomicUsize; MAX_HIGH],
}

static GATES: [Gate; MAX_DEVICES] = [const {
    Gate {
        n: AtomicUsize::new(0),
        files: [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_HIGH],
        devs: [const { AtomicUsize::new(0) }; MAX_HIGH],
    }
}; MAX_DEVICES];

/// This slice's own activity file (null: none, so no gate applies).
static OWN: AtomicPtr<Mapped> = AtomicPtr::new(std::ptr::null_mut());
/// Whether launches must pass the gate: this is a high-priority slice, or a GPU of it has one
/// (kept by the watcher).
static ENGAGED: AtomicBool = AtomicBool::new(false);

/// Whether launches must go through [`role`] (one load: the launch hooks ask it first).
#[inline]
pub fn engaged() -> bool {
    ENGAGED.load(Relaxed)
}

/// What a launch on a device has to do at the gate.
pub enum Role {
    /// Nothing: no activity file, or no high-priority slice on the GPU.
    Free,
    /// This is the high-priority slice: note the launch's time.
    High(&'static Mapped),
    /// A normal slice beside a high-priority one: wait at the gate, then note the launch's time.
    Normal(&'static Mapped),
}

/// The gate of region device `dev` for this process. An MPS client has none: under MPS a
/// high-priority slice's SMs are its own (the agent shrinks the other slices' partitions), and the
/// gate on top only cost the normal slices' throughput and, with random requests, the service's
/// own tail (docs/benchmarks-priority-tenants.md, "Under MPS").
#[inline]
pub fn role(st: &State, dev: usize) -> Role {
    let own = OWN.load(Acquire);
    if own.is_null() || dev >= MAX_DEVICES || crate::mps::client() {
        return Role::Free;
    }
    // SAFETY: OWN holds a leaked, never freed mapping once set.
    let own = unsafe { &*own };
    if st.priority_high() {
        Role::High(own)
    } else if GATES[dev].n.load(Acquire) > 0 {
        Role::Normal(own)
    } else {
        Role::Free
    }
}

/// The high-priority slices of `dev`'s GPU: each one's activity and its device there.
fn highs(dev: usize) -> impl Iterator<Item = (&'static Mapped, usize)> {
    let g = &GATES[dev];
    let n = g.n.load(Acquire).min(MAX_HIGH);
    (0..n).filter_map(move |i| {
        let f = g.files[i].load(Acquire);
        // SAFETY: published pointers are leaked, never freed mappings.
        (!f.is_null()).then(|| (unsafe { &*f }, g.devs[i].load(Relaxed)))
    })
}

/// The latest time a high-priority slice of `dev`'s GPU has work queued until.
fn high_until(dev: usize) -> u64 {
    highs(dev).map(|(f, d)| f.until(d)).max().unwrap_or(0)
}

/// How long to hold a normal launch at `now` because a high-priority slice whose requests come in
/// a steady rhythm is due within `guard` (0: not due): what this launch would queue must be done by
/// then. A slice that missed four periods is not waited for.
fn due(dev: usize, now: u64, guard: u64) -> u64 {
    highs(dev)
        .filter_map(|(f, d)| f.rhythm(d))
        .filter(|r| r.jitter.saturating_mul(8) < r.period && now < r.last.saturating_add(r.period.saturating_mul(4)))
        .map(|r| {
            // The next burst after the latest, given a slack of its jitter each way.
            // (saturating: the file is another tenant's to write)
            let late = now.saturating_sub(r.last) / r.period.max(1);
            let next = r.last.saturating_add(r.period.saturating_mul(late.saturating_add(1)));
            let (from, to) = (next.saturating_sub(guard.saturating_add(r.jitter)), next.saturating_add(r.jitter));
            if (from..to).contains(&now) {
                to - now
            } else {
                0
            }
        })
        .max()
        .unwrap_or(0)
}

/// A normal slice's launch of `cost_ns` on `dev`: waits while a high-priority slice of the GPU has
/// work queued, or while this slice's own queued work is past the bound; then notes it.
pub fn wait_normal(st: &State, own: &Mapped, dev: usize, cost_ns: u64) {
    let bound = match st.priority_queue_ns() {
        0 => DEFAULT_QUEUE_NS,
        b => b,
    };
    let share = match st.priority_min_share() {
        0 => DEFAULT_MIN_SHARE,
        p => u64::from(p.min(50)),
    };
    let mut now = crate::clock::now_precise();
    let held_by_high = loop {
        let own_wait = own.until(dev).saturating_sub(now.saturating_add(bound));
        let high_wait = high_until(dev).saturating_sub(now).max(due(dev, now, bound.saturating_add(cost_ns)));
        let wait = match high_wait {
            0 => own_wait,
            // Within its guaranteed share: neither the high-priority slice nor its own bound holds it.
            _ if SHARES[dev].release(now, share, cost_ns) => break true,
            w => w.max(own_wait),
        };
        if wait == 0 {
            break false;
        }
        std::thread::sleep(Duration::from_nanos(wait.min(MAX_WAIT_NS)));
        now = crate::clock::now_precise();
    };
    if !held_by_high {
        SHARES[dev].unheld();
    }
    own.note(dev, now, cost_ns);
}

/// Synchronisations the process made (a stream, context or event waited for), modulo 2^64.
static SYNCS: AtomicU64 = AtomicU64::new(0);
/// Launches a thread notes without reading the clock, at most, between two readings.
const REREAD_EVERY: u32 = 16;

thread_local! {
    /// The thread's view at its latest clock reading: [`SYNCS`] then, and its launches since.
    static SINCE_CLOCK: Cell<(u64, u32)> = const { Cell::new((u64::MAX, 0)) };
}

/// After a synchronisation of the process returned: what the high-priority slice had queued may
/// be done, so its threads' next launches read the clock (a new request's first launch is noted
/// exactly).
#[inline]
pub fn synced() {
    // Any change will do: a lost increment between two threads still changes it.
    SYNCS.store(SYNCS.load(Relaxed).wrapping_add(1), Relaxed);
}

/// A high-priority slice's launch of `cost_ns` on `dev`, queued; onto an idle queue, the start of
/// a burst (a request), whose rhythm normal slices may anticipate.
///
/// Only a queue that ran dry moves the estimate to the clock (`max(queued, now) + cost`), and the
/// queue can only be seen to run dry by a synchronisation (or by time: the coarse clock passing
/// the estimate). So the clock (some 20 ns) is read on a thread's first launch after any
/// synchronisation of the process, where the estimate is behind the coarse clock, and on every
/// [`REREAD_EVERY`]th launch; the others add their cost (an idle gap that none of these shows,
/// shorter than a tick of the coarse clock, is noted late by at most `REREAD_EVERY` launches).
#[inline]
pub fn note_high(own: &Mapped, dev: usize, cost_ns: u64) {
    let syncs = SYNCS.load(Relaxed);
    let since = SINCE_CLOCK.try_with(Cell::get).unwrap_or((u64::MAX, 0));
    if since.0 == syncs && since.1 < REREAD_EVERY && own.until(dev) >= crate::clock::now_coarse() {
        own.add(dev, cost_ns);
        let _ = SINCE_CLOCK.try_with(|c| c.set((syncs, since.1 + 1)));
        return;
    }
    let _ = SINCE_CLOCK.try_with(|c| c.set((syncs, 0)));
    let now = crate::clock::now_precise();
    if own.note(dev, now, cost_ns).0 < now {
        own.note_burst(dev, now);
    }
}

/// Maps this slice's activity file and starts following the gates of its GPUs, where the agent
/// manages the container (a limits file of its own); paths from `VGPU_ACTIVITY_FILE` and
/// `VGPU_GATES_DIR`, else beside the limits file.
pub fn start(st: &State) {
    let Some((limits, uuids)) = st.limits_file() else { return };
    let dir = Path::new(limits).parent().map(Path::to_path_buf).unwrap_or_default();
    let from_env = |k: &str, dflt: PathBuf| {
        if st.cfg.managed {
            dflt
        } else {
            std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or(dflt)
        }
    };
    let own_path = from_env("VGPU_ACTIVITY_FILE", dir.join("activity"));
    // Beside the limits file in a container; on the agent's host, two levels up
    // (`<state>/slices/<name>/limits`, `<state>/gates`).
    let beside = dir.join("gates");
    let host = dir.parent().and_then(Path::parent).map(|p| p.join("gates"));
    let gates = from_env("VGPU_GATES_DIR", host.filter(|h| !beside.is_dir() && h.is_dir()).unwrap_or(beside));
    let Some(own) = Mapped::open(&own_path, true) else {
        crate::log::vlog!(crate::log::INFO, "no activity file at {}: no priority gate", own_path.display());
        return;
    };
    crate::log::vlog!(
        crate::log::INFO,
        "priority gate: {} slice, gates in {}",
        if st.priority_high() { "high-priority" } else { "normal" },
        gates.display()
    );
    use std::os::unix::fs::MetadataExt;
    let own_ino = std::fs::metadata(&own_path).map_or(0, |m| m.ino());
    OWN.store(Box::leak(Box::new(own)), Release);
    let high = st.priority_high();
    ENGAGED.store(high, Release);
    // The watcher reads the flag from its own mapping of the limits file (the agent may change it).
    let limits = vgpu_region::Region::open(Path::new(limits), false).ok();
    let _ = std::thread::Builder::new().name("vgpu-gate".into()).stack_size(256 << 10).spawn(move || {
        let mut maps: Vec<(u64, &'static Mapped)> = Vec::new();
        loop {
            let mut any = limits.as_ref().is_some_and(|l| l.priority_high());
            for (d, uuid) in uuids.iter().enumerate().take(MAX_DEVICES) {
                any |= publish(d, &gates.join(uuid), own_ino, &mut maps) > 0;
            }
            ENGAGED.store(any, Release);
            std::thread::sleep(WATCH_EVERY);
        }
    });
}

/// Publishes the activity files in GPU gate directory `dir` as device `d`'s gate; how many.
fn publish(d: usize, dir: &Path, own_ino: u64, maps: &mut Vec<(u64, &'static Mapped)>) -> usize {
    use std::os::unix::fs::MetadataExt;
    let mut found: Vec<(&'static Mapped, usize)> = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(dev) = name.rsplit_once('.').and_then(|(_, d)| d.parse::<usize>().ok()) else { continue };
        let Ok(md) = e.metadata() else { continue };
        if md.ino() == own_ino || found.len() == MAX_HIGH {
            continue;
        }
        let m = match maps.iter().find(|(ino, _)| *ino == md.ino()) {
            Some((_, m)) => *m,
            None if maps.len() < MAX_MAPS => {
                // Another slice's file, which it can truncate: its mapping is guarded, so that a
                // read past a new end gives zeros instead of SIGBUS (`vgpu_region::shrink`; a
                // handler of the application's installed before is kept for other addresses).
                if vgpu_region::shrink::enable().is_err() {
                    continue;
                }
                let Some(m) = Mapped::open(&e.path(), false) else { continue };
                let m: &'static Mapped = Box::leak(Box::new(m));
                maps.push((md.ino(), m));
                m
            }
            None => continue,
        };
        found.push((m, dev));
    }
    let g = &GATES[d];
    for (i, (m, dev)) in found.iter().enumerate() {
        g.devs[i].store(*dev, Relaxed);
        g.files[i].store(*m as *const Mapped as *mut Mapped, Release);
    }
    g.n.store(found.len(), Release);
    found.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::now_precise;
    use std::sync::Mutex;

    /// The tests synchronise (a process-wide event) and count launches: one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn activity(tag: &str) -> (PathBuf, Mapped) {
        let p = std::env::temp_dir().join(format!("vgpu-prio-{tag}-{}", std::process::id()));
        vgpu_region::activity::create(&p).unwrap();
        let m = Mapped::open(&p, true).unwrap();
        (p, m)
    }

    #[test]
    fn a_high_priority_launch_after_a_synchronisation_is_noted_from_the_clock() {
        let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (p, m) = activity("sync");
        // Busy: launches add their cost without the clock.
        let t0 = now_precise();
        note_high(&m, 0, 1_000_000_000);
        let first = m.until(0);
        assert!(first >= t0 + 1_000_000_000, "an idle queue's launch is noted from now");
        note_high(&m, 0, 500);
        note_high(&m, 0, 500);
        assert_eq!(m.until(0), first + 1_000, "queued work adds up");
        // The queue ran dry 100 us ago (its estimate ahead of the coarse clock, which lags by up to
        // a tick): the synchronisation that saw it makes the next launch read the clock.
        m.clear(0);
        m.note(0, now_precise() - 100_000, 0);
        synced();
        let t1 = now_precise();
        note_high(&m, 0, 500);
        assert!(m.until(0) >= t1 + 500, "noted from the clock after a synchronisation");
        // Cleared by the agent: behind the coarse clock, so from the clock again.
        m.clear(0);
        let t2 = now_precise();
        note_high(&m, 0, 700);
        assert!(m.until(0) >= t2 + 700);
        std::fs::remove_file(&p).ok();
    }

    #[test]
    fn a_held_normal_slice_gets_its_share_of_every_window() {
        let sh = Share { held_since: AtomicU64::new(0), free_until: AtomicU64::new(0), spent: AtomicU64::new(0) };
        let ms = 1_000_000;
        // Held from t = 1 ms: nothing goes for 90 ms of the window.
        assert!(!sh.release(ms, 10, ms));
        assert!(!sh.release(60 * ms, 10, ms));
        // Then 10 ms of GPU time goes, launch by launch, and no more.
        assert!(sh.release(91 * ms, 10, ms));
        for t in 92..101 {
            assert!(sh.release(t * ms, 10, ms), "launch at {t} ms within the share");
        }
        assert!(!sh.release(101 * ms, 10, ms), "the share is spent: held again");
        assert!(!sh.release(150 * ms, 10, ms));
        assert!(sh.release(192 * ms, 10, ms), "the next window's share");
        // A hold that the high-priority slice ends (its queue ran dry) starts again from nothing.
        sh.free_until.store(0, Relaxed);
        sh.unheld();
        assert!(!sh.release(300 * ms, 10, ms));
        assert!(!sh.release(389 * ms, 10, ms));
        assert!(sh.release(390 * ms, 10, ms));
    }

    #[test]
    fn a_thread_reads_the_clock_again_within_its_bound_of_launches() {
        let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (p, m) = activity("reread");
        note_high(&m, 1, 10);
        // The queue ran dry unseen 50 us ago (no synchronisation; the coarse clock, which lags by up
        // to a tick, most likely not past it yet): within `REREAD_EVERY` more launches one reads
        // the clock and notes from now.
        m.clear(1);
        let t = now_precise();
        m.note(1, t - 50_000, 0);
        for _ in 0..=REREAD_EVERY {
            note_high(&m, 1, 10);
        }
        assert!(m.until(1) >= t + 10, "an unseen idle gap is caught up with");
        std::fs::remove_file(&p).ok();
    }
}

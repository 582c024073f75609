//! The standalone true-up. A CUDA context holds more device memory than `VGPU_CONTEXT_OVERHEAD`
//! charges on some GPUs (610 MiB for PyTorch's on an H200), and modules loaded later add more:
//! memory no hooked call allocates. Where the agent watches a container, it charges each process
//! for what NVML says the driver holds for it beyond its own account. Where none does (a region a
//! process created from its environment, as under HAMi's or Volcano's device plugin), each process
//! does the same for itself, from NVML's per-process figure for its own host PID (a new context's,
//! where the processes know their host PIDs, by the region's measurer: see [`TrueUp::warm_up`]):
//!
//! * right after its first context on a device (the context's real size), and after a context
//!   went (its memory with it): these two also where an agent watches the region (see
//!   [`TrueUp::new`]);
//! * on allocations that bring the container within min(limit / 4, 1 GiB) of its limit, at most
//!   once per 100 ms, before the reservation that would admit them;
//! * before refusing an allocation, at most once per 10 ms (memory the driver gave back is no
//!   longer charged).
//! * when the application asks what is free (`cuMemGetInfo`), at most once per 100 ms (modules
//!   loaded lazily at a kernel's first launch show in its answer before an allocation comes near
//!   the limit).
//!
//! The first two are off the path of the context's creation: NVML is initialised on a helper
//! thread as soon as the process starts using CUDA (`nvmlInit` alone took 10 ms and more on an
//! H200), and the measurement after a context runs on that thread too ([`Helper`]). Until it is
//! done, an allocation on that device that would bring the container within [`CONTEXT_MARGIN`] of its
//! limit waits for it, and so does `cuMemGetInfo`; nothing else does (what the measurement adds is
//! less than the margin, so an allocation admitted before it cannot take the container over the
//! limit; two threads allocating at once while it runs could together, as each checks the usage
//! before its own reservation, so that the measurement never counts a reservation the driver has
//! not made yet).
//!
//! In a PID namespace the process does not know its host PID: it learns it from NVML at its first
//! context, as the one process that appears in the device's list while the context is created (if
//! others appear at the same moment it cannot tell, and tries again at its next first context on a
//! device). Not under MPS (NVML then lists clients' memory under the MPS server's PID). The
//! measurements are off the hot paths: the allocation path compares one total it already has, and
//! the hooks count their calls in flight for them (two plain stores, see `guard::Calls`).

use crate::guard::Calls;
use crate::log::{vlog, INFO, WARN};
use crate::nvquery::list_processes;
use crate::real::nvml;
use cuda_abi::nvml::{NvmlDevice, NVML_SUCCESS};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::*};
use std::sync::Mutex;
use vgpu_region::Region;
use vgpu_region::MAX_DEVICES;

/// Changes smaller than this are left alone (NVML's figures move by a few MiB on their own).
const STEP: u64 = 8 << 20;
/// Near the limit, at most one measurement per device per this long.
const PERIOD_NS: u64 = 100_000_000;
/// The stack of the true-up's threads (NVML calls and a few vectors; the default 2 MiB costs more to
/// map than the work takes on a simulator).
const HELPER_STACK: usize = 256 << 10;
/// While a context's measurement runs, allocations that leave more than this free under the limit
/// do not wait for it: the most a context has been measured to hold beyond its charge is 610 MiB
/// (PyTorch's on an H200, `VGPU_CONTEXT_OVERHEAD` at its default).
pub const CONTEXT_MARGIN: u64 = 1 << 30;
/// NVML's "not available" for a process's memory.
const NOT_AVAILABLE: u64 = u64::MAX;

/// What the true-up measures against: the process's account in its container's region (the
/// process state, which holds the true-up and is above it).
pub trait Ledger: Sync + 'static {
    /// The container's region, where there is one.
    fn region(&self) -> Option<&Region>;
    /// The region and this process's slot in it, when the process's calls are accounted.
    fn accounting(&self) -> Option<(&Region, usize)>;
    /// The container's memory limit on `dev` (0: none).
    fn mem_limit(&self, dev: usize) -> u64;
    /// The container's usage on `dev`.
    fn used(&self, dev: usize) -> u64;
    /// The true-up this ledger holds.
    fn true_up(&self) -> &TrueUp;
}

pub struct TrueUp {
    /// The region is standalone (no agent watches it) and the setting allows it: every occasion.
    on: bool,
    /// The setting allows it and the process has a region: at contexts made and gone, also where
    /// an agent watches the region (see [`TrueUp::new`]).
    at_context: bool,
    /// This process's PID as NVML lists it (0: not known yet).
    host_pid: AtomicU32,
    /// Bytes charged per device by the true-up, on top of the process's own account.
    added: [AtomicU64; MAX_DEVICES],
    /// When each device was last measured (monotonic ns).
    last_ns: [AtomicU64; MAX_DEVICES],
    /// A context was created on the device in this process (its host PID is then in the list
    /// before the next one, so a new one cannot tell it).
    had_context: [AtomicBool; MAX_DEVICES],
    /// A context's measurement is running on its own thread: allocations on the device wait.
    pending: [AtomicBool; MAX_DEVICES],
    /// How many devices are pending (the allocation path's one load).
    any_pending: AtomicU32,
    /// Signalled when a pending measurement is done.
    done: (Mutex<()>, std::sync::Condvar),
    lock: Mutex<()>,
    /// Who measures this process's contexts: its own helper ([`OWN`]), or the region's measurer,
    /// this process ([`MEASURER`]) or another ([`CLIENT`]); see [`TrueUp::warm_up`].
    role: AtomicU8,
    /// Per device, the ask of the region's measurer a pending measurement waits for.
    ticket: [AtomicU32; MAX_DEVICES],
    /// The measurer's passes are served (its job handed to a helper).
    serving: AtomicBool,
}

/// This process's own helper measures its contexts.
const OWN: u8 = 0;
/// This process's helper measures the region's contexts, its own among them.
const MEASURER: u8 = 1;
/// Another process of the region measures this one's contexts.
const CLIENT: u8 = 2;

impl TrueUp {
    /// `on`: every occasion (no agent watches the region). `at_context`: at a context's creation and
    /// end only, where an agent watches it: the agent's correction takes two of its passes (200 ms
    /// or more) to come, and a process that fills its slice right after its first context would
    /// otherwise be admitted past the limit by what its context really holds beyond its charge (on
    /// an H200, a PyTorch process held 8.10 GiB in an 8 GiB slice). The agent's correction and the
    /// process's own move toward the same total (each takes NVML's figure less everything else
    /// charged), so the agent then finds nothing to add for the context.
    pub fn new(on: bool, at_context: bool, host_pid: u32) -> TrueUp {
        TrueUp {
            on,
            at_context: on || at_context,
            host_pid: AtomicU32::new(host_pid),
            added: [const { AtomicU64::new(0) }; MAX_DEVICES],
            last_ns: [const { AtomicU64::new(0) }; MAX_DEVICES],
            had_context: [const { AtomicBool::new(false) }; MAX_DEVICES],
            pending: [const { AtomicBool::new(false) }; MAX_DEVICES],
            any_pending: AtomicU32::new(0),
            done: (Mutex::new(()), std::sync::Condvar::new()),
            lock: Mutex::new(()),
            role: AtomicU8::new(OWN),
            ticket: [const { AtomicU32::new(0) }; MAX_DEVICES],
            serving: AtomicBool::new(false),
        }
    }

    /// At the process's first CUDA call, well before its first context: starts NVML's
    /// initialisation on the helper thread, where the measurements will be made. In a standalone
    /// region, a process whose host PID is known (`own`: its region and slot) measures its
    /// contexts through the region's measurer: the first such process becomes it, and the others
    /// start no helper and load no NVML for their contexts (a hundred processes starting at once
    /// in a container each loaded NVML, whose `nvmlInit` alone takes 10 ms on an H200). A process
    /// that must learn its host PID from NVML's lists at its first context keeps a helper of its
    /// own.
    #[cold]
    pub fn warm_up(&self, own: Option<(&Region, usize)>) {
        if !self.at_context {
            return;
        }
        if let Some((r, slot)) = own.filter(|_| self.shares()) {
            if !r.become_measurer(slot, std::process::id()) {
                self.role.store(CLIENT, Release);
                return;
            }
            self.role.store(MEASURER, Release);
        }
        if NVML_STATE.load(Acquire) == NVML_NONE {
            HELPER.start();
        }
    }

    /// Whether the region's measurer can measure this process: a standalone region (no agent) and
    /// the process's host PID known, as NVML names it.
    fn shares(&self) -> bool {
        self.on && self.host_pid.load(Acquire) != 0
    }

    /// Waits (up to 2 s) for a context's measurement on `dev` still running on its own thread,
    /// when `near()` says the caller's figure could be changed by it (an allocation that would come
    /// within [`CONTEXT_MARGIN`] of the limit). One load where none is pending.
    #[inline]
    pub fn settle(&self, st: &impl Ledger, dev: usize, near: impl FnOnce() -> bool) {
        if self.any_pending.load(Acquire) != 0 && near() {
            self.settle_slow(st, dev);
        }
    }

    #[cold]
    fn settle_slow(&self, st: &impl Ledger, dev: usize) {
        if self.role.load(Acquire) != OWN {
            return self.settle_asked(st, dev);
        }
        let t = std::time::Instant::now();
        let mut g = self.done.0.lock().unwrap_or_else(|p| p.into_inner());
        while self.pending.get(dev).is_some_and(|p| p.load(Acquire)) && t.elapsed() < std::time::Duration::from_secs(2)
        {
            g = self.done.1.wait_timeout(g, std::time::Duration::from_millis(10)).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// [`settle_slow`](Self::settle_slow) where the region's measurer measures: waits (up to 2 s)
    /// for its answer to this process's ask on `dev`. Where the measurer went without answering,
    /// this process measures its context itself, here, and waits no more.
    #[cold]
    fn settle_asked(&self, st: &impl Ledger, dev: usize) {
        let Some(r) = st.region() else { return };
        let ticket = self.ticket[dev].load(Acquire);
        if !self.pending[dev].load(Acquire) {
            return;
        }
        if r.wait_served(ticket, std::time::Duration::from_secs(2)) {
            self.answered(dev, ticket);
        } else if !r.measurer_alive() {
            vlog!(INFO, "device {dev}: the region's true-up measurer went without measuring this process's context");
            self.after_context_now(st, dev, None);
            self.answered(dev, ticket);
        }
    }

    /// The measurer answered this process's ask `ticket` on `dev`: no longer pending, unless asked
    /// again since.
    fn answered(&self, dev: usize, ticket: u32) {
        if self.ticket[dev].load(Acquire) == ticket && self.pending[dev].swap(false, AcqRel) {
            self.any_pending.fetch_sub(1, AcqRel);
        }
    }

    /// Whether the calls' in-flight counts are needed (any measurement is made).
    pub fn measures(&self) -> bool {
        self.at_context
    }

    /// Whether allocations near the limit are checked: the hot path's only question.
    #[inline]
    pub fn on(&self) -> bool {
        self.on
    }

    /// A forked child: a new process, with its own slot and no context.
    pub fn after_fork(&self, host_pid: u32) {
        self.host_pid.store(host_pid, Release);
        for i in 0..MAX_DEVICES {
            self.added[i].store(0, Relaxed);
            self.last_ns[i].store(0, Relaxed);
            self.had_context[i].store(false, Relaxed);
            // A measurement thread of the parent's is not the child's.
            self.pending[i].store(false, Relaxed);
        }
        self.any_pending.store(0, Release);
        // Its parent's measurer, or whoever measures the region now, measures it (it has no
        // helper of its own; see `ask_measurer`).
        self.serving.store(false, Relaxed);
        self.role.store(if self.shares() && self.role.load(Relaxed) != OWN { CLIENT } else { OWN }, Release);
    }

    /// Bytes the true-up charges on `dev` now.
    pub fn added(&self, dev: usize) -> u64 {
        self.added[dev].load(Acquire)
    }

    /// Before a context is created on `dev`: the PIDs NVML lists there, when this process's host
    /// PID is still to be learned from them.
    #[cold]
    pub fn before_context(&self, st: &impl Ledger, dev: usize) -> Option<Vec<u32>> {
        if !self.at_context || self.host_pid.load(Acquire) != 0 || self.had_context[dev].load(Acquire) {
            return None;
        }
        if st.mem_limit(dev) == 0 {
            return None;
        }
        processes(st, dev).map(|v| v.into_iter().map(|(pid, _)| pid).collect())
    }

    /// After a context was created on `dev` (`before` from [`before_context`](Self::before_context)):
    /// the measurement runs on a thread of its own, and allocations on `dev` near the limit wait
    /// for it ([`settle`](Self::settle)); where no thread can be started, here.
    #[cold]
    pub fn after_context<L: Ledger>(&self, st: &'static L, dev: usize, before: Option<Vec<u32>>) {
        if !self.at_context {
            return;
        }
        self.had_context[dev].store(true, Release);
        if let Some(ticket) = self.ask_measurer(st) {
            self.ticket[dev].store(ticket, Release);
            if !self.pending[dev].swap(true, AcqRel) {
                self.any_pending.fetch_add(1, AcqRel);
            }
            return;
        }
        if self.pending[dev].swap(true, AcqRel) {
            // One is running for this device already (two contexts at once): it measures both.
            return;
        }
        self.any_pending.fetch_add(1, AcqRel);
        let job: Job = Box::new(move || {
            let t = st.true_up();
            t.after_context_now(st, dev, before);
            let _g = t.done.0.lock().unwrap_or_else(|p| p.into_inner());
            t.pending[dev].store(false, Release);
            t.any_pending.fetch_sub(1, AcqRel);
            t.done.1.notify_all();
        });
        let Err(job) = HELPER.hand(job) else { return };
        if let Err(job) = spawn_background(job) {
            // No thread to be had: measured here.
            job();
        }
    }

    /// Where the region's measurer measures this process: asks it for a pass, and returns the
    /// ticket to wait for. A client whose measurer is gone becomes the measurer; the measurer's
    /// helper is handed its passes at its first context. None where this process measures itself.
    fn ask_measurer<L: Ledger>(&self, st: &'static L) -> Option<u32> {
        let role = self.role.load(Acquire);
        if role == OWN {
            return None;
        }
        let (r, slot) = st.accounting()?;
        if role == CLIENT && !r.measurer_alive() && r.become_measurer(slot, std::process::id()) {
            vlog!(INFO, "the region's true-up measurer is gone: this process measures its contexts now");
            self.role.store(MEASURER, Release);
        }
        if self.role.load(Acquire) == MEASURER && !self.serving.swap(true, AcqRel) {
            let job: Job = Box::new(move || serve_region(st));
            let unserved = match HELPER.hand(job) {
                Ok(()) => None,
                Err(job) => spawn_background(job).err(),
            };
            if unserved.is_some() {
                // No thread to be had: this process measures itself, here.
                self.serving.store(false, Release);
                self.role.store(OWN, Release);
                return None;
            }
        }
        Some(r.ask_measurer())
    }

    /// A pass of the region's measurer on `dev`: this process's own charge as after its own
    /// context, and every other process of the region whose host PID is known charged for what
    /// NVML says the driver holds for it beyond its charge. Others' charges are only raised: their
    /// calls in flight make NVML's figure lag their charge (allocations are charged before the
    /// driver makes them, frees released after), so what it shows beyond the charge is a lower
    /// bound; lowering is left to the process itself, which knows its calls in flight.
    fn region_pass(&self, st: &impl Ledger, dev: usize) {
        if self.had_context[dev].load(Acquire) {
            self.after_context_now(st, dev, None);
        }
        let Some((r, own)) = st.accounting() else { return };
        if st.mem_limit(dev) == 0 {
            return;
        }
        let before = r.slots();
        let Some(list) = processes(st, dev) else { return };
        for (slot, pid, host, used) in before {
            if slot == own || host == 0 {
                continue;
            }
            let mine = list.iter().filter(|(p, _)| *p == host).map(|(_, b)| *b);
            if mine.clone().any(|b| b == NOT_AVAILABLE) {
                continue;
            }
            let measured: u64 = mine.sum();
            // The larger of its charge before and after NVML's figure (see `measure`).
            let charged = used.get(dev).copied().unwrap_or(0).max(r.slot_used(slot, dev));
            let more = measured.saturating_sub(charged);
            if more >= STEP && r.adjust_for(slot, pid, dev, more as i64) {
                vlog!(
                    INFO,
                    "device {dev}: the driver holds {measured} bytes for process {pid} (host PID {host}), \
                     {charged} charged: {more} bytes more charged to it"
                );
            }
        }
    }

    fn after_context_now(&self, st: &impl Ledger, dev: usize, before: Option<Vec<u32>>) {
        if let (Some(before), Some(after)) = (before, processes(st, dev)) {
            match learned(&before, after.iter().map(|(pid, _)| *pid)) {
                Ok(pid) => {
                    self.host_pid.store(pid, Release);
                    // Recorded in the slot for NVML's process lists in the container, where no
                    // agent does so (an agent maps its processes from the host's /proc).
                    if let Some((r, slot)) = st.accounting().filter(|_| self.on) {
                        r.set_host_pid(slot, std::process::id(), pid);
                    }
                    vlog!(INFO, "host PID {pid} (from NVML, at this process's first context)");
                }
                Err(n) => vlog!(INFO, "cannot tell this process's host PID ({n} new in NVML's list); no true-up yet"),
            }
        }
        if self.measure(st, dev, false, 0) {
            let (limit, used) = (st.mem_limit(dev), st.used(dev));
            if used > limit {
                vlog!(
                    WARN,
                    "device {dev}: the container's CUDA contexts alone hold {} MiB, more than its {} MiB limit: \
                     every allocation will be refused",
                    used >> 20,
                    limit >> 20
                );
            }
        }
    }

    /// A context on `dev` went: what the driver held for it went too.
    #[cold]
    pub fn context_gone(&self, st: &impl Ledger, dev: usize) {
        if self.at_context && self.added(dev) > 0 {
            self.measure(st, dev, true, 0);
        }
    }

    /// The container's usage on `dev` came near its limit: measure, unless measured in the last
    /// 100 ms (10 ms with `force`, before a refusal). `pending`: bytes this call reserved and the
    /// driver has not allocated yet. True when the charge changed.
    #[cold]
    pub fn near_limit(&self, st: &impl Ledger, dev: usize, force: bool, pending: u64) -> bool {
        let now = crate::clock::now_coarse();
        let last = self.last_ns[dev].load(Relaxed);
        let period = if force { PERIOD_NS / 10 } else { PERIOD_NS };
        if last != 0 && now.saturating_sub(last) < period {
            return false;
        }
        self.last_ns[dev].store(now.max(1), Relaxed);
        self.measure(st, dev, false, pending)
    }

    /// Moves the true-up's charge on `dev` to what NVML says the driver holds for this process
    /// beyond its own account (less `pending`, reserved for a call not made yet). `gone`: a context
    /// went, and a process NVML no longer lists holds nothing there.
    ///
    /// Other threads' calls in flight make NVML's figure lag the account: an allocation is charged
    /// before the driver makes it, a free released after the driver freed it, a pool's shrinking at
    /// a synchronisation settled after it. Each makes the figure look smaller than the account, so
    /// what a measurement taken among them shows is a lower bound of what the driver holds beyond
    /// it: it may raise the charge, and lowers it only when no other call was in flight (see
    /// `guard::Calls`). A measurement during which a call began bounds nothing; it is taken again,
    /// at most three times.
    fn measure(&self, st: &impl Ledger, dev: usize, gone: bool, pending: u64) -> bool {
        let host = self.host_pid.load(Acquire);
        let Some((r, slot)) = st.accounting() else { return false };
        if host == 0 || st.mem_limit(dev) == 0 {
            return false;
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..3 {
            // The account before NVML's figure, and again after: whatever a call in flight did to
            // the account in between, the larger of the two is at least what it was meanwhile.
            let calls = Calls::now();
            let before = r.slot_used(slot, dev);
            let Some(list) = processes(st, dev) else { return false };
            let after = r.slot_used(slot, dev);
            let calls_after = Calls::now();
            if !calls.none_began_before(calls_after) {
                continue;
            }
            let mine: Vec<u64> = list.iter().filter(|(pid, _)| *pid == host).map(|(_, b)| *b).collect();
            if (mine.is_empty() && !gone) || mine.contains(&NOT_AVAILABLE) {
                return false;
            }
            let measured: u64 = mine.iter().sum();
            let added = self.added[dev].load(Acquire);
            let own = before.max(after).saturating_sub(added).saturating_sub(pending);
            let target = measured.saturating_sub(own);
            if target.abs_diff(added) < STEP && !(target == 0 && added > 0) {
                return false;
            }
            if target < added && !(calls.quiet() && calls_after.quiet() && before == after) {
                return false;
            }
            if !r.adjust_for(slot, std::process::id(), dev, target as i64 - added as i64) {
                return false;
            }
            self.added[dev].store(target, Release);
            vlog!(
                INFO,
                "device {dev}: the driver holds {measured} bytes for this process, {own} charged by its calls: \
                 {target} bytes more charged"
            );
            return true;
        }
        false
    }
}

/// The region's measurer, on its helper: a pass over every device for each batch of asks (the
/// asks that came during a pass are answered by the next), for as long as the process lives.
fn serve_region<L: Ledger>(st: &'static L) {
    let Some(r) = st.region() else { return };
    nvml_ready();
    let mut seen = r.measurer_answered();
    loop {
        let asked = r.wait_asked(seen, std::time::Duration::from_secs(60));
        if asked == seen {
            continue;
        }
        for dev in 0..r.ndevices().min(MAX_DEVICES) {
            st.true_up().region_pass(st, dev);
        }
        r.answered(asked);
        seen = asked;
    }
}

/// The one PID in `after` that is not in `before`; else how many there are.
fn learned(before: &[u32], after: impl Iterator<Item = u32>) -> Result<u32, usize> {
    let mut new: Vec<u32> = after.filter(|p| !before.contains(p)).collect();
    new.sort_unstable();
    new.dedup();
    match new[..] {
        [pid] => Ok(pid),
        _ => Err(new.len()),
    }
}

const NVML_NONE: u8 = 0;
const NVML_STARTING: u8 = 1;
const NVML_READY: u8 = 2;
const NVML_UNAVAILABLE: u8 = 3;
type Job = Box<dyn FnOnce() + Send>;

/// The true-up's helper thread: started at the process's first CUDA call, it initialises NVML and
/// then runs the measurements after contexts handed to it, one at a time. One thread for both: the
/// application's thread that started a second one for the measurement, while the first still
/// loaded NVML, waited for the loader's lock (`strace -k`: its `pthread_create` blocked until
/// NVML's `dlopen` was done). A forked child has no helper (the parent's thread is not copied): it
/// starts a thread per measurement instead. A measurement that panics ends, not the helper.
struct Helper {
    /// The process whose helper this is (0: none started).
    pid: AtomicU32,
    jobs: Mutex<Vec<Job>>,
    wake: std::sync::Condvar,
}

static HELPER: Helper =
    Helper { pid: AtomicU32::new(0), jobs: Mutex::new(Vec::new()), wake: std::sync::Condvar::new() };

impl Helper {
    /// Starts NVML's initialisation: on the helper, where this process has none yet; on a thread of
    /// its own in a forked child (whose parent's helper is not there).
    fn start(&'static self) {
        if self.pid.compare_exchange(0, std::process::id(), AcqRel, Acquire).is_ok() {
            if spawn_background(Box::new(|| HELPER.serve())).is_err() {
                self.pid.store(0, Release);
            } else {
                // Handed after the thread started, so that the helper, waiting for its first job,
                // is woken onto an idle core rather than run on this one (see spawn_background).
                let _ = self.hand(Box::new(|| {
                    nvml_ready();
                }));
            }
        } else {
            let _ = spawn_background(Box::new(|| {
                nvml_ready();
            }));
        }
    }

    fn serve(&self) {
        loop {
            let job = {
                let mut q = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
                while q.is_empty() {
                    q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                }
                q.remove(0)
            };
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        }
    }

    /// Hands `job` to this process's helper; gives it back where there is none.
    fn hand(&self, job: Job) -> Result<(), Job> {
        if self.pid.load(Acquire) != std::process::id() {
            return Err(job);
        }
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).push(job);
        self.wake.notify_one();
        Ok(())
    }
}

/// Starts a true-up thread. Its first act makes it a batch thread (`SCHED_BATCH`, same weight as
/// the application's threads): the kernel starts a new thread on its creator's CPU, where a normal
/// one preempted the application's thread while NVML loaded (its first allocation came 0.2 ms
/// later on a 2-core machine with the other core idle, the application's thread switched out 1.6
/// times instead of 0.4); a batch thread does not preempt on waking, and an idle core takes it.
/// Made with `pthread_create` itself, detached: the application's thread waits for the making, and
/// `std::thread`'s own bookkeeping (its handle, result slot and name) added 12 us to that here.
/// A job that panics ends the thread, not the process. Where no thread can be made, the job is
/// given back.
fn spawn_background(job: Job) -> Result<(), Job> {
    extern "C" fn run(arg: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: `arg` is the job spawn_background leaked for this thread alone.
        let job = unsafe { Box::from_raw(arg as *mut Job) };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param for SCHED_BATCH
        // (priority 0). A refusal (a seccomp profile, say) leaves the thread as it was.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        // SAFETY: naming the calling thread with a static C string of at most 15 bytes.
        unsafe { libc::pthread_setname_np(libc::pthread_self(), c"vgpu-trueup".as_ptr()) };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(*job));
        std::ptr::null_mut()
    }
    // A thin pointer to hand through pthread_create's one argument.
    let job: *mut Job = Box::into_raw(Box::new(job));
    // SAFETY: attr is initialised before use and destroyed after; `run` takes ownership of `job`
    // only when the thread was made, otherwise it is taken back here.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        libc::pthread_attr_setstacksize(&mut attr, HELPER_STACK);
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut t: libc::pthread_t = 0;
        let rc = libc::pthread_create(&mut t, &attr, run, job as *mut libc::c_void);
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 {
            return Err(*Box::from_raw(job));
        }
    }
    Ok(())
}

/// Where this library's NVML initialisation is. An atomic rather than a lock: a child forked while
/// another thread initialised NVML must not wait for a thread it does not have.
static NVML_STATE: AtomicU8 = AtomicU8::new(NVML_NONE);

/// In a forked child: an initialisation that was under way in the parent never finishes here.
pub(crate) fn after_fork_in_child() {
    let _ = NVML_STATE.compare_exchange(NVML_STARTING, NVML_UNAVAILABLE, AcqRel, Acquire);
}

/// NVML, initialised once by this library (its own reference; the application's init and shutdown
/// pair is unaffected). False when it cannot be used.
pub(crate) fn nvml_ready() -> bool {
    let t = std::time::Instant::now();
    loop {
        match NVML_STATE.load(Acquire) {
            NVML_READY => return true,
            NVML_UNAVAILABLE => return false,
            NVML_NONE if NVML_STATE.compare_exchange(NVML_NONE, NVML_STARTING, AcqRel, Acquire).is_ok() => {
                // SAFETY: nvmlInit_v2 takes no arguments; NVML counts initialisations.
                let ok = nvml().nvmlInit_v2.is_some_and(|init| unsafe { init() } == NVML_SUCCESS);
                if !ok {
                    vlog!(
                        INFO,
                        "NVML unavailable: device memory the driver holds beyond what is allocated is not charged"
                    );
                }
                NVML_STATE.store(if ok { NVML_READY } else { NVML_UNAVAILABLE }, Release);
                return ok;
            }
            // Another thread is initialising it: wait for it (NVML's init takes milliseconds).
            _ if t.elapsed() < std::time::Duration::from_secs(10) => {
                std::thread::sleep(std::time::Duration::from_micros(200))
            }
            _ => return false,
        }
    }
}

/// (PID, bytes) of each process NVML lists on the region device `dev`; None if NVML cannot say
/// (no NVML, or a device it does not know by this UUID, such as a MIG instance).
fn processes(st: &impl Ledger, dev: usize) -> Option<Vec<(u32, u64)>> {
    if !nvml_ready() {
        return None;
    }
    let uuid = CString::new(st.region()?.device_uuid(dev)).ok()?;
    let by_uuid = nvml().nvmlDeviceGetHandleByUUID?;
    let mut h: NvmlDevice = std::ptr::null_mut();
    // SAFETY: a NUL-terminated UUID and an out-pointer to a local.
    if unsafe { by_uuid(uuid.as_ptr(), &mut h) } != NVML_SUCCESS {
        return None;
    }
    // Under MPS a client's memory shows under the MPS server's PID, which can also be the one PID
    // that appears at a client's first context: no per-process figure to go by.
    if let Some(mps) = nvml().nvmlDeviceGetMPSComputeRunningProcesses_v3 {
        // SAFETY: the real entry point (same signature as the compute list's) with NVML's handle.
        if unsafe { list_processes(mps, h) }.is_ok_and(|l| !l.is_empty()) {
            mps_noted(dev);
            return None;
        }
    }
    let real = nvml().nvmlDeviceGetComputeRunningProcesses_v3.or(nvml().nvmlDeviceGetComputeRunningProcesses_v2)?;
    // SAFETY: the real entry point with a handle NVML just gave.
    let list = unsafe { list_processes(real, h) }.ok()?;
    Some(list.into_iter().map(|p| (p.pid, p.used_gpu_memory)).collect())
}

/// Says once per process that MPS keeps the true-up off on a device.
#[cold]
fn mps_noted(dev: usize) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Relaxed) {
        vlog!(INFO, "device {dev} runs MPS clients: NVML's per-process memory is the MPS server's; no true-up there");
    }
}

#[cfg(test)]
mod tests {
    use super::learned;

    #[test]
    fn the_host_pid_is_the_one_that_appeared_and_only_if_it_is_the_only_one() {
        let before = [100, 200];
        assert_eq!(learned(&before, [100, 300, 200].into_iter()), Ok(300));
        // Listed twice (one entry per compute instance, say): still one process.
        assert_eq!(learned(&before, [300, 100, 300].into_iter()), Ok(300));
        // Another process of the node created a context at the same moment: cannot tell.
        assert_eq!(learned(&before, [100, 300, 400].into_iter()), Err(2));
        // Not listed (NVML does not show it yet, or at all): nothing learned.
        assert_eq!(learned(&before, [200].into_iter()), Err(0));
        assert_eq!(learned(&[], [7].into_iter()), Ok(7));
    }
}

//! A region file that shrinks under a mapping must not kill the process that maps it.
//!
//! A container's processes can truncate their own region (they hold it open read-write), and any
//! later access to a page past the new end raises SIGBUS. The agent maps every container's region,
//! so one truncation would kill it, and again after every restart. Once [`enable`] has run, every
//! region mapped in this process is registered here; a SIGBUS inside one of them replaces that
//! mapping with private zero pages (the faulting access then reads zeros and carries on) and marks
//! it [`faulted`]: its owner drops it and treats the region as damaged. A SIGBUS anywhere else gets
//! the handler that was installed before, as if this one had never been there.
//!
//! The handler only loads atomics and calls `mmap`, both async-signal-safe.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// How many mappings can be guarded at once (the agent maps one region per slice, plus briefly the
/// ones it changes).
pub const CAPACITY: usize = 16_384;

static STARTS: [AtomicUsize; CAPACITY] = [const { AtomicUsize::new(0) }; CAPACITY];
/// The length of each registered mapping (set before its start is published).
static LENS: [AtomicUsize; CAPACITY] = [const { AtomicUsize::new(0) }; CAPACITY];
static FAULTED: [AtomicBool; CAPACITY] = [const { AtomicBool::new(false) }; CAPACITY];
static ENABLED: AtomicBool = AtomicBool::new(false);
static FAULTS: AtomicUsize = AtomicUsize::new(0);
/// The handler installed before [`enable`] (a `libc::sigaction`, boxed and leaked once).
static PREVIOUS: AtomicUsize = AtomicUsize::new(0);

/// Installs the SIGBUS handler; regions mapped from now on are guarded. Idempotent.
pub fn enable() -> std::io::Result<()> {
    if ENABLED.swap(true, SeqCst) {
        return Ok(());
    }
    // SAFETY: sigaction structs are plain data; the new action names a handler with the
    // SA_SIGINFO signature; the previous action is written to a leaked allocation that lives for
    // the rest of the process, and only read by the handler after it is published.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigbus as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut act.sa_mask);
        let prev: &'static mut libc::sigaction = Box::leak(Box::new(std::mem::zeroed()));
        if libc::sigaction(libc::SIGBUS, &act, prev) != 0 {
            ENABLED.store(false, SeqCst);
            return Err(std::io::Error::last_os_error());
        }
        PREVIOUS.store(prev as *mut libc::sigaction as usize, SeqCst);
    }
    Ok(())
}

/// How many guarded mappings have faulted since the process started.
pub fn faults() -> usize {
    FAULTS.load(Relaxed)
}

/// Registers a region's mapping at `start` (when guarding is on). `Ok(None)`: guarding is off.
pub(crate) fn register(start: usize) -> Result<Option<usize>, ()> {
    register_len(start, crate::TOTAL_SIZE)
}

/// Registers a mapping of `len` bytes at `start` (when guarding is on).
pub(crate) fn register_len(start: usize, len: usize) -> Result<Option<usize>, ()> {
    if !ENABLED.load(Acquire) {
        return Ok(None);
    }
    for (i, s) in STARTS.iter().enumerate() {
        // A slot is claimed by its length (free: 0), then published by its start: the handler
        // matches an address only against a published start, whose length is set by then.
        if s.load(Relaxed) == 0 && LENS[i].compare_exchange(0, len, AcqRel, Relaxed).is_ok() {
            if s.compare_exchange(0, start, AcqRel, Relaxed).is_err() {
                LENS[i].store(0, Release);
                continue;
            }
            FAULTED[i].store(false, Release);
            return Ok(Some(i));
        }
    }
    Err(())
}

pub(crate) fn unregister(slot: usize) {
    STARTS[slot].store(0, Release);
    LENS[slot].store(0, Release);
}

pub(crate) fn faulted(slot: usize) -> bool {
    FAULTED[slot].load(Acquire)
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for (i, s) in STARTS.iter().enumerate() {
        let start = s.load(Acquire);
        let len = LENS[i].load(Acquire);
        if start != 0 && addr >= start && addr < start + len {
            // SAFETY: replaces exactly the registered mapping (made by this crate, `len` bytes at
            // `start`, still registered so not yet unmapped) with private zero pages; every field
            // of a region is an atomic integer, for which zero is a valid value.
            let p = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                FAULTED[i].store(true, Release);
                FAULTS.fetch_add(1, Relaxed);
                return;
            }
        }
    }
    // Not a region's fault: what was there before decides (its handler, or the default action,
    // which the access repeated on return then takes).
    let prev = PREVIOUS.load(Acquire) as *const libc::sigaction;
    // SAFETY: `prev` is the leaked action saved by `enable` (published before any region could be
    // registered). Calling a SA_SIGINFO handler with the arguments we got, or reinstalling the
    // previous action, is what would have happened without this handler.
    unsafe {
        if prev.is_null() {
            libc::signal(sig, libc::SIG_DFL);
            return;
        }
        let h = (*prev).sa_sigaction;
        if h == libc::SIG_DFL || h == libc::SIG_IGN || (*prev).sa_flags & libc::SA_SIGINFO == 0 {
            libc::sigaction(sig, prev, std::ptr::null_mut());
            return;
        }
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(h);
        f(sig, info, ctx);
    }
}

//! The monotonic clocks the launch paths read (vDSO reads, no system call).

/// A monotonic clock in ns.
fn monotonic(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer; both clocks used here always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The monotonic clock at full resolution: for measured launches and the priority gate (whose
/// activity files other processes compare with their own reading of it).
pub(crate) fn now_precise() -> u64 {
    monotonic(libc::CLOCK_MONOTONIC)
}

/// The same, to the kernel's tick: cheaper, for budgets that a tick does not change.
pub(crate) fn now_coarse() -> u64 {
    monotonic(libc::CLOCK_MONOTONIC_COARSE)
}

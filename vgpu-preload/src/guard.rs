//! The entry guard of every hook: re-entrancy (calls made while a hook runs pass straight through)
//! and panics mapped to error codes (a panic never unwinds into C).

use std::cell::Cell;

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// True while the calling thread is inside one of our hooks.
#[inline]
pub fn inside() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// Runs `f` as the outermost hook, or returns None if the thread already is inside a hook.
#[inline]
pub fn run<R>(f: impl FnOnce() -> R, on_panic: R) -> Option<R> {
    DEPTH.with(|d| {
        if d.get() > 0 {
            return None;
        }
        d.set(1);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
            crate::log::vlog!(crate::log::ERROR, "internal error in a hook (panic); the call failed");
            on_panic
        });
        d.set(0);
        Some(r)
    })
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
}

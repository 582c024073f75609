//! The context limits that hold device memory (`cuCtxSetLimit`: stack, printf FIFO, malloc heap):
//! for each context, the value each limit is charged up to, and a flag that lets one thread at a
//! time charge a limit (see `memory::set_limit`).
//!
//! A limit lowered keeps its charge until its context goes (the driver need not give the memory
//! back), so the charge follows the highest value set: raised again, only what lies above that is
//! charged (a library that raises the stack for one kernel and lowers it after would otherwise add
//! the whole increase at every call). Two threads raising one limit at once would each charge the
//! increase from the same old value; they take turns instead. None of this is on a hot path.

use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Mutex;

/// Context handle -> the value each limit is charged up to (0: never raised here).
static CHARGED: Mutex<Vec<(u64, [usize; 3])>> = Mutex::new(Vec::new());

/// Set while a thread charges a limit: a flag rather than a mutex held across the driver's call,
/// so that a child forked meanwhile can clear it.
static BUSY: AtomicBool = AtomicBool::new(false);

fn charged() -> std::sync::MutexGuard<'static, Vec<(u64, [usize; 3])>> {
    CHARGED.lock().unwrap_or_else(|e| e.into_inner())
}

/// One thread's turn at charging a limit, until dropped.
pub struct Turn(());

impl Turn {
    pub fn take() -> Turn {
        while BUSY.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
            std::thread::yield_now();
        }
        Turn(())
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        BUSY.store(false, Release);
    }
}

/// The value `limit` of `ctx` is charged up to (0: none).
pub fn charged_to(ctx: u64, limit: usize) -> usize {
    charged().iter().find(|(c, _)| *c == ctx).map_or(0, |(_, l)| l[limit])
}

/// `limit` of `ctx` is now charged up to `value`.
pub fn set_charged_to(ctx: u64, limit: usize, value: usize) {
    let mut m = charged();
    match m.iter_mut().find(|(c, _)| *c == ctx) {
        Some((_, l)) => l[limit] = value,
        None => {
            let mut l = [0; 3];
            l[limit] = value;
            m.push((ctx, l));
        }
    }
}

/// `ctx` went (destroyed, released for the last time, or reset to its defaults): its limits'
/// charges went with it. What it had, to be put back if it did not go after all.
pub fn context_gone(ctx: u64) -> Option<[usize; 3]> {
    let mut m = charged();
    let i = m.iter().position(|(c, _)| *c == ctx)?;
    Some(m.swap_remove(i).1)
}

/// `ctx` did not go after all: its limits are charged up to `l` again.
pub fn put_back(ctx: u64, l: [usize; 3]) {
    let mut m = charged();
    m.retain(|(c, _)| *c != ctx);
    m.push((ctx, l));
}

/// A forked child has no contexts; a turn its parent's other threads held is over.
pub fn after_fork() {
    charged().clear();
    BUSY.store(false, Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_context_s_limits_are_kept_apart_until_it_goes() {
        let (a, b) = (0xa000_0001, 0xb000_0001);
        assert_eq!(charged_to(a, 0), 0);
        set_charged_to(a, 0, 4096);
        set_charged_to(a, 2, 200 << 20);
        set_charged_to(b, 0, 8192);
        assert_eq!((charged_to(a, 0), charged_to(a, 1), charged_to(a, 2)), (4096, 0, 200 << 20));
        assert_eq!(charged_to(b, 0), 8192);
        let had = context_gone(a);
        assert_eq!(had, Some([4096, 0, 200 << 20]));
        assert_eq!((charged_to(a, 0), charged_to(a, 2), charged_to(b, 0)), (0, 0, 8192));
        put_back(a, had.unwrap());
        assert_eq!((charged_to(a, 0), charged_to(a, 2)), (4096, 200 << 20), "it did not go after all");
        context_gone(a);
        context_gone(b);
        assert_eq!(context_gone(b), None);
    }

    #[test]
    fn turns_are_taken_one_at_a_time() {
        use std::sync::atomic::AtomicUsize;
        static INSIDE: AtomicUsize = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _t = Turn::take();
                        assert_eq!(INSIDE.fetch_add(1, AcqRel), 0, "two threads in a turn at once");
                        std::thread::yield_now();
                        INSIDE.fetch_sub(1, AcqRel);
                    }
                });
            }
        });
    }
}

//! A figure the region is charged for, replaced while other threads may replace it too (a pool's
//! `held`, a graph pool's reservation).

use std::sync::atomic::{AtomicU64, Ordering::*};

/// Replaces `figure` with `new` and moves the region by the difference: an increase is charged
/// (`charge`) before the figure shows it, a decrease released (`release`) after, so the region
/// never holds less than the figures say. Swapped first and charged after, another thread could
/// replace the new figure and release it before this charge landed: the region then showed that
/// much less than the process held, and an allocation admitted in between went past the limit.
/// Returns the figure replaced.
pub fn replace(figure: &AtomicU64, new: u64, charge: impl Fn(u64), release: impl Fn(u64)) -> u64 {
    let mut old = figure.load(Acquire);
    loop {
        let up = new.saturating_sub(old);
        if up > 0 {
            charge(up);
        }
        match figure.compare_exchange(old, new, AcqRel, Acquire) {
            Ok(_) => break,
            Err(now) => {
                if up > 0 {
                    release(up);
                }
                old = now;
            }
        }
    }
    if old > new {
        release(old - new);
    }
    old
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn an_increase_is_charged_before_it_shows_and_a_decrease_released_after() {
        let figure = AtomicU64::new(100);
        let region = Cell::new(100u64);
        let at_least_the_figure = |what: &str| {
            assert!(
                region.get() >= figure.load(Relaxed),
                "{what}: region {} under {}",
                region.get(),
                figure.load(Relaxed)
            )
        };
        let charge = |b: u64| {
            at_least_the_figure("before a charge");
            region.set(region.get() + b);
        };
        let release = |b: u64| {
            region.set(region.get() - b);
            at_least_the_figure("after a release");
        };
        assert_eq!(replace(&figure, 300, charge, release), 100);
        assert_eq!((figure.load(Relaxed), region.get()), (300, 300));
        assert_eq!(replace(&figure, 50, |_| unreachable!("nothing to add"), release), 300);
        assert_eq!((figure.load(Relaxed), region.get()), (50, 50));
    }

    #[test]
    fn a_replacement_in_between_is_not_lost() {
        // Another thread replaces the figure while this one charges: this one's charge goes back,
        // and it charges again for the difference to what it then replaces.
        let figure = AtomicU64::new(0);
        let region = Cell::new(0u64);
        let other = Cell::new(false);
        let charge = |b: u64| {
            region.set(region.get() + b);
            if !other.replace(true) {
                figure.store(200, Relaxed);
                region.set(region.get() + 200);
            }
        };
        let release = |b: u64| region.set(region.get() - b);
        assert_eq!(replace(&figure, 100, charge, release), 200);
        assert_eq!((figure.load(Relaxed), region.get()), (100, 100));
    }
}

//! Virtual memory management (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemRetainAllocationHandle`): a physical allocation lives until every reference to its handle
//! is released *and* every mapping of it is unmapped. Releasing the handle right after mapping it is
//! a common idiom (the mapping keeps the memory), so the charge taken at `cuMemCreate` goes back
//! only when both counts reach zero, not at the first `cuMemRelease`.
//!
//! Only handles this process created and charged are followed. The bookkeeping sits behind one
//! mutex: these calls are not on the hot paths (an allocator maps and unmaps whole segments, and
//! the driver does far more work in each), and a mapping must be found by address on unmap.
//!
//! A release or an unmap changes the bookkeeping *before* the driver is asked and undoes it if the
//! driver refuses: once the driver has let a handle (or an address) go it may give the same value to
//! another thread's `cuMemCreate` (or `cuMemMap`) at once, whose record must not be mistaken for the
//! one going. The mutex is never held across a driver call.
#![allow(clippy::missing_safety_doc)]

use crate::real::cuda_fns as f;
use crate::state::state;
use cuda_abi::*;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::Mutex;

const OK: CUresult = CUresult::SUCCESS;

struct Handle {
    /// Region device and the bytes charged for it.
    dev: usize,
    bytes: u64,
    /// References: 1 from `cuMemCreate`, +1 per `cuMemRetainAllocationHandle`, -1 per `cuMemRelease`.
    refs: u32,
    /// Live mappings of it.
    maps: u32,
}

#[derive(Default)]
struct Vmm {
    handles: HashMap<u64, Handle>,
    /// Mapped address -> (handle, length), for the handles in `handles`.
    maps: BTreeMap<u64, (u64, u64)>,
}

/// The bookkeeping (made on first use). A cell rather than a bare value so that tests can run the
/// hooks' bodies on bookkeeping of their own.
type Cell = Mutex<Option<Vmm>>;

static VMM: Cell = Mutex::new(None);

/// Runs `f` on the bookkeeping in `cell`.
fn with<T>(cell: &Cell, f: impl FnOnce(&mut Vmm) -> T) -> T {
    f(cell.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Vmm::default))
}

impl Vmm {
    /// Takes `h` out if nothing keeps its memory any more: its charge is then to be released.
    fn done(&mut self, h: u64) -> Option<(usize, u64)> {
        let x = self.handles.get(&h)?;
        if x.refs > 0 || x.maps > 0 {
            return None;
        }
        self.handles.remove(&h).map(|x| (x.dev, x.bytes))
    }
}

/// `cuMemCreate` made handle `h`, charged `bytes` on region device `dev`.
pub fn created(h: u64, dev: usize, bytes: u64) {
    created_in(&VMM, h, dev, bytes);
}

fn created_in(cell: &Cell, h: u64, dev: usize, bytes: u64) {
    with(cell, |v| v.handles.insert(h, Handle { dev, bytes, refs: 1, maps: 0 }));
}

/// A forked child has no handles of its own.
pub fn after_fork() {
    *VMM.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// What a release took out of the bookkeeping before the driver was asked.
enum Took {
    /// Not a handle this process charged.
    Nothing,
    /// One reference; mappings still keep the memory.
    Reference,
    /// The last reference of an unmapped handle: the handle's record, its charge to be released.
    Handle(usize, u64),
}

/// `cuMemRelease` of `handle`, the driver's call being `driver`: the result, and the charge to
/// release.
fn release_in(cell: &Cell, handle: u64, driver: impl FnOnce() -> CUresult) -> (CUresult, Option<(usize, u64)>) {
    let took = with(cell, |v| {
        let Some(x) = v.handles.get_mut(&handle).filter(|x| x.refs > 0) else { return Took::Nothing };
        x.refs -= 1;
        match v.done(handle) {
            Some((dev, bytes)) => Took::Handle(dev, bytes),
            None => Took::Reference,
        }
    });
    let r = driver();
    match (r == OK, took) {
        (true, Took::Handle(dev, bytes)) => (r, Some((dev, bytes))),
        (true, _) | (false, Took::Nothing) => (r, None),
        // Refused: the driver still holds the handle, so its value cannot have been given out again.
        (false, Took::Reference) => {
            with(cell, |v| {
                // (Gone only if another thread unmapped its last mapping meanwhile and released the
                // charge: the driver refusing a release of a live handle is all but unknown.)
                if let Some(x) = v.handles.get_mut(&handle) {
                    x.refs += 1;
                }
            });
            (r, None)
        }
        (false, Took::Handle(dev, bytes)) => {
            created_in(cell, handle, dev, bytes);
            (r, None)
        }
    }
}

/// `cuMemUnmap` of `[ptr, ptr + size)`, the driver's call being `driver`: every mapping that starts
/// in the range goes (the driver unmaps whole mappings only). The result, and the charges to release.
fn unmap_in(cell: &Cell, ptr: u64, size: u64, driver: impl FnOnce() -> CUresult) -> (CUresult, Vec<(usize, u64)>) {
    // Mappings taken out (address, handle, length), and the handles they were the last of.
    let (taken, freed) = with(cell, |v| {
        let hit: Vec<u64> = v.maps.range(ptr..ptr.saturating_add(size)).map(|(&a, _)| a).collect();
        let (mut taken, mut freed) = (Vec::new(), Vec::new());
        for a in hit {
            let Some((h, len)) = v.maps.remove(&a) else { continue };
            if let Some(x) = v.handles.get_mut(&h) {
                x.maps = x.maps.saturating_sub(1);
            }
            taken.push((a, h, len));
            if let Some((dev, bytes)) = v.done(h) {
                freed.push((h, dev, bytes));
            }
        }
        (taken, freed)
    });
    let r = driver();
    if r == OK {
        return (r, freed.into_iter().map(|(_, d, b)| (d, b)).collect());
    }
    // Refused: the mappings are still there, and so are their handles.
    with(cell, |v| {
        for (h, dev, bytes) in freed {
            v.handles.insert(h, Handle { dev, bytes, refs: 0, maps: 0 });
        }
        for (a, h, len) in taken {
            if let Some(x) = v.handles.get_mut(&h) {
                x.maps += 1;
                v.maps.insert(a, (h, len));
            }
        }
    });
    (r, Vec::new())
}

fn map_in(cell: &Cell, ptr: u64, size: u64, handle: u64) {
    with(cell, |v| {
        if let Some(x) = v.handles.get_mut(&handle) {
            x.maps += 1;
            v.maps.insert(ptr, (handle, size));
        }
    });
}

fn release_charge(freed: Option<(usize, u64)>) {
    if let Some((d, b)) = freed {
        state().release(d, b);
    }
}

// ----- hooks -----

pub unsafe fn release(real: f::cuMemRelease, handle: u64) -> CUresult {
    let (r, freed) = release_in(&VMM, handle, || forward!(real, handle));
    release_charge(freed);
    r
}

pub unsafe fn map(
    real: f::cuMemMap,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CUresult {
    let r = forward!(real, ptr, size, offset, handle, flags);
    if r == OK {
        map_in(&VMM, ptr, size as u64, handle);
    }
    r
}

pub unsafe fn unmap(real: f::cuMemUnmap, ptr: CUdeviceptr, size: usize) -> CUresult {
    let (r, freed) = unmap_in(&VMM, ptr, size as u64, || forward!(real, ptr, size));
    for f in freed {
        release_charge(Some(f));
    }
    r
}

pub unsafe fn retain(real: f::cuMemRetainAllocationHandle, handle: *mut u64, addr: *mut c_void) -> CUresult {
    let r = forward!(real, handle, addr);
    if r == OK && !handle.is_null() {
        // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
        let h = unsafe { *handle };
        with(&VMM, |v| {
            if let Some(x) = v.handles.get_mut(&h) {
                x.refs += 1;
            }
        });
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const REFUSED: CUresult = CUresult::INVALID_VALUE;

    #[test]
    fn memory_goes_when_the_last_reference_and_the_last_mapping_go() {
        let mut v = Vmm::default();
        v.handles.insert(7, Handle { dev: 1, bytes: 2 << 20, refs: 1, maps: 1 });
        v.handles.get_mut(&7).unwrap().refs = 0; // released while mapped
        assert_eq!(v.done(7), None, "the mapping keeps it");
        v.handles.get_mut(&7).unwrap().maps = 0;
        assert_eq!(v.done(7), Some((1, 2 << 20)));
        assert_eq!(v.done(7), None, "once");
    }

    #[test]
    fn a_handle_value_the_driver_gives_out_again_during_a_release_names_the_new_allocation() {
        let cell = Cell::new(None);
        created_in(&cell, 7, 0, 2 * MIB);
        // The driver lets handle 7 go, and another thread's cuMemCreate is given the same value
        // before this release's call returns.
        let (r, freed) = release_in(&cell, 7, || {
            created_in(&cell, 7, 0, 4 * MIB);
            OK
        });
        assert_eq!((r, freed), (OK, Some((0, 2 * MIB))), "the released handle's own charge");
        let (_, freed) = release_in(&cell, 7, || OK);
        assert_eq!(freed, Some((0, 4 * MIB)), "the new handle's record is whole");
    }

    #[test]
    fn an_address_mapped_again_during_an_unmap_keeps_its_new_mapping() {
        let cell = Cell::new(None);
        created_in(&cell, 1, 0, 2 * MIB);
        map_in(&cell, 0x1000_0000, 2 * MIB, 1);
        assert_eq!(release_in(&cell, 1, || OK).1, None, "mapped: the memory stays");
        created_in(&cell, 2, 0, 8 * MIB);
        // The driver unmaps, and another thread maps handle 2 at the same address before this
        // unmap's call returns.
        let (_, freed) = unmap_in(&cell, 0x1000_0000, 2 * MIB, || {
            map_in(&cell, 0x1000_0000, 2 * MIB, 2);
            OK
        });
        assert_eq!(freed, vec![(0, 2 * MIB)], "handle 1 goes");
        assert_eq!(release_in(&cell, 2, || OK).1, None, "handle 2 is still mapped");
        let (_, freed) = unmap_in(&cell, 0x1000_0000, 2 * MIB, || OK);
        assert_eq!(freed, vec![(0, 8 * MIB)]);
    }

    #[test]
    fn what_the_driver_refuses_is_left_as_it_was() {
        let cell = Cell::new(None);
        created_in(&cell, 1, 0, 2 * MIB);
        assert_eq!(release_in(&cell, 1, || REFUSED), (REFUSED, None));
        map_in(&cell, 0x2000_0000, 2 * MIB, 1);
        map_in(&cell, 0x2020_0000, 2 * MIB, 1);
        assert_eq!(release_in(&cell, 1, || OK), (OK, None), "still mapped twice");
        assert_eq!(release_in(&cell, 1, || OK), (OK, None), "no reference left to release");
        assert_eq!(unmap_in(&cell, 0x2000_0000, 4 * MIB, || REFUSED), (REFUSED, vec![]));
        assert_eq!(unmap_in(&cell, 0x2000_0000, 2 * MIB, || OK), (OK, vec![]), "one mapping left");
        assert_eq!(unmap_in(&cell, 0x2020_0000, 2 * MIB, || REFUSED), (REFUSED, vec![]));
        assert_eq!(unmap_in(&cell, 0x2020_0000, 2 * MIB, || OK), (OK, vec![(0, 2 * MIB)]));
    }
}

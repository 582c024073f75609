//! Virtual memory management (`cuMemCreate`, `cuMemMap`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemRetainAllocationHandle`): a physical allocation lives until every reference to its handle
//! is released *and* every mapping of it is unmapped. Releasing the handle right after mapping it is
//! a common idiom (the mapping keeps the memory), so the charge taken at `cuMemCreate` goes back
//! only when both counts reach zero, not at the first `cuMemRelease`.
//!
//! Only handles this process created and charged are followed. The bookkeeping sits behind one
//! mutex: these calls are not on the hot paths (an allocator maps and unmaps whole segments, and
//! the driver does far more work in each), and a mapping must be found by address on unmap.
#![allow(clippy::missing_safety_doc)]

use crate::real::cuda_fns as f;
use crate::state::state;
use cuda_abi::*;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

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

static VMM: Mutex<Option<Vmm>> = Mutex::new(None);

fn vmm() -> MutexGuard<'static, Option<Vmm>> {
    VMM.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the bookkeeping (made on first use).
fn with<T>(f: impl FnOnce(&mut Vmm) -> T) -> T {
    f(vmm().get_or_insert_with(Vmm::default))
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
    with(|v| v.handles.insert(h, Handle { dev, bytes, refs: 1, maps: 0 }));
}

/// A forked child has no handles of its own.
pub fn after_fork() {
    *vmm() = None;
}

fn release_charge(freed: Option<(usize, u64)>) {
    if let Some((d, b)) = freed {
        state().release(d, b);
    }
}

// ----- hooks -----

pub unsafe fn release(real: f::cuMemRelease, handle: u64) -> CUresult {
    // SAFETY: the caller's arguments, forwarded unchanged (the hook's contract).
    let r = unsafe { real(handle) };
    if r == OK {
        release_charge(with(|v| {
            let x = v.handles.get_mut(&handle)?;
            x.refs = x.refs.saturating_sub(1);
            v.done(handle)
        }));
    }
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
    // SAFETY: as above.
    let r = unsafe { real(ptr, size, offset, handle, flags) };
    if r == OK {
        with(|v| {
            if let Some(x) = v.handles.get_mut(&handle) {
                x.maps += 1;
                v.maps.insert(ptr, (handle, size as u64));
            }
        });
    }
    r
}

/// Unmaps every mapping that starts in the range (the driver unmaps whole mappings only).
pub unsafe fn unmap(real: f::cuMemUnmap, ptr: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: as above.
    let r = unsafe { real(ptr, size) };
    if r != OK {
        return r;
    }
    let freed: Vec<(usize, u64)> = with(|v| {
        let hit: Vec<u64> = v.maps.range(ptr..ptr.saturating_add(size as u64)).map(|(&a, _)| a).collect();
        let mut freed = Vec::new();
        for a in hit {
            let Some((h, _)) = v.maps.remove(&a) else { continue };
            if let Some(x) = v.handles.get_mut(&h) {
                x.maps = x.maps.saturating_sub(1);
            }
            freed.extend(v.done(h));
        }
        freed
    });
    for f in freed {
        release_charge(Some(f));
    }
    r
}

pub unsafe fn retain(real: f::cuMemRetainAllocationHandle, handle: *mut u64, addr: *mut c_void) -> CUresult {
    // SAFETY: as above.
    let r = unsafe { real(handle, addr) };
    if r == OK && !handle.is_null() {
        // SAFETY: the driver returned success, so it wrote the caller's out-pointer.
        let h = unsafe { *handle };
        with(|v| {
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
}

//! `nvidia-smi`'s process lists. `nvidia-smi` (R535 and later) does not list a GPU's processes
//! through NVML's public calls, which [`crate::nvml`] restricts to the container's, but through a
//! private table of entry points that `nvmlInternalGetExportTable` hands out for one GUID: on the
//! lent H200 (driver 580.159.04) `nvidia-smi --query-compute-apps` in a container listed every
//! tenant's processes while every public list named only the container's.
//!
//! What is publicly known of that table (from driver 580.65.06): its first word is its size in
//! bytes; its entries 213, 214 and 215 are process lists, `fn(nvmlDevice_t, unsigned int *count,
//! entry *array)`, the count the array's capacity on entry and the entries written on return; an
//! entry is 4128 bytes, the PID (u32) first, the process's name inline from byte 32. Where the
//! container shares a GPU, the table handed to the caller is a copy whose three list entries are
//! ours: each calls the driver's and keeps the container's processes (named by their PIDs in the
//! container, as the public lists are).
//!
//! Private means unstable, so this is done only where it is known to fit: the 580 driver branch,
//! a table large enough, a device handle NVML gave, and entries whose PIDs NVML's public lists
//! name too; anything else is passed through as the driver answered it.
#![allow(clippy::missing_safety_doc)]

use crate::log::{vlog, INFO};
use crate::nvquery::list_processes;
use crate::real::{nvml, nvml_fns as f};
use crate::state::state;
use cuda_abi::nvml::{NvmlDevice, NvmlReturn, NVML_SUCCESS};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::Mutex;

/// The GUID of the table, as its 16 bytes lie in memory (6c3efec4-8fc9-4e6c-a327-ee696e12f7c4).
const PROCESS_TABLE: [u8; 16] =
    [0xc4, 0xfe, 0x3e, 0x6c, 0xc9, 0x8f, 0x6c, 0x4e, 0xa3, 0x27, 0xee, 0x69, 0x6e, 0x12, 0xf7, 0xc4];
/// The table's first process list, and how many there are.
const FIRST_LIST: usize = 213;
const LISTS: usize = 3;
/// Bytes of one entry of a list.
const ENTRY: usize = 4128;
/// The most words a table is taken to have (a larger size word is not a size).
const MAX_WORDS: usize = 4096;
/// The most entries a list is taken to have been given room for.
const MAX_ENTRIES: u32 = 65536;
/// Driver branches whose table is known to have this shape.
const KNOWN_BRANCHES: &[u32] = &[580];

/// An entry point of the table, called with every argument register it could have been given (a
/// function that takes fewer ignores the rest).
type Slot = unsafe extern "C" fn(usize, usize, usize, usize, usize, usize) -> NvmlReturn;

/// The driver's list entries, as the first table wrapped had them.
static REAL: [AtomicUsize; LISTS] = [const { AtomicUsize::new(0) }; LISTS];
/// (driver's table, our copy) for each table handed out.
static TABLES: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// `nvmlInternalGetExportTable`: the driver's table, or for the process lists' table where the
/// container shares a GPU, a copy whose lists keep the container's processes.
pub unsafe fn export_table(
    real: f::nvmlInternalGetExportTable,
    table: *mut *const c_void,
    id: *const c_void,
) -> NvmlReturn {
    let r = forward!(real, table, id);
    // SAFETY: a non-null GUID is 16 bytes (NVML's contract).
    if r != NVML_SUCCESS || id.is_null() || unsafe { *(id as *const [u8; 16]) } != PROCESS_TABLE {
        return r;
    }
    // The driver just wrote the table's address.
    let Some(table) = out_ref!(table) else { return r };
    let t = *table as usize;
    if t == 0 || !restricts() {
        return r;
    }
    // SAFETY: a table the driver handed out, its first word its size.
    if let Some(ours) = unsafe { wrapped(t) } {
        *table = ours as *const c_void;
    }
    r
}

/// Whether the container shares a GPU (a region) and the driver's table is known to fit.
fn restricts() -> bool {
    if state().region.is_none() {
        return false;
    }
    let branch = driver_branch();
    if !KNOWN_BRANCHES.contains(&branch) {
        said_once(|| {
            format!(
                "nvidia-smi's process lists are not restricted to the container's on driver branch {branch}: \
                 its private table is known only on {KNOWN_BRANCHES:?}"
            )
        });
        return false;
    }
    true
}

/// The driver's major version (0: not known). NVML is initialised for it (a reference of this
/// library's own): the caller may ask for the table before its own `nvmlInit`.
fn driver_branch() -> u32 {
    if !crate::trueup::nvml_ready() {
        return 0;
    }
    let Some(get) = nvml().nvmlSystemGetDriverVersion else { return 0 };
    let mut buf = [0 as std::ffi::c_char; 80];
    // SAFETY: a buffer of the length given.
    if unsafe { get(buf.as_mut_ptr(), buf.len() as u32) } != NVML_SUCCESS {
        return 0;
    }
    // SAFETY: NVML wrote a NUL-terminated string into it.
    let v = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    v.split('.').next().and_then(|m| m.parse().ok()).unwrap_or(0)
}

/// Says why `nvidia-smi`'s lists are not restricted, once per process (whatever the reason: one
/// is enough to know; the text is made only then).
fn said_once(what: impl FnOnce() -> String) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Relaxed) {
        vlog!(INFO, "{}", what());
    }
}

/// Our copy of table `t` (made once per table; leaked: callers keep the pointer for good). None
/// when its size word does not fit, or a list entry is missing or not the one first seen.
unsafe fn wrapped(t: usize) -> Option<usize> {
    let mut tables = TABLES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, ours)) = tables.iter().find(|(real, _)| *real == t) {
        return Some(ours);
    }
    let word = std::mem::size_of::<usize>();
    // SAFETY: the table's first word (the caller's contract).
    let size = unsafe { *(t as *const usize) };
    let words = size / word;
    if size % word != 0 || words <= FIRST_LIST + LISTS || words > MAX_WORDS {
        said_once(|| format!("NVML's private table has {size} bytes: nvidia-smi's process lists are not restricted"));
        return None;
    }
    // SAFETY: `words` words from the table's start, as its size says.
    let mut copy: Vec<usize> = unsafe { std::slice::from_raw_parts(t as *const usize, words) }.to_vec();
    for (i, ours) in [list_213 as Slot, list_214, list_215].into_iter().enumerate() {
        let real = copy[FIRST_LIST + i];
        let first = REAL[i].compare_exchange(0, real, AcqRel, Acquire).unwrap_or_else(|x| x);
        if real == 0 || (first != 0 && first != real) {
            return None;
        }
        copy[FIRST_LIST + i] = ours as usize;
    }
    let ours = Box::leak(copy.into_boxed_slice()).as_ptr() as usize;
    tables.push((t, ours));
    vlog!(INFO, "NVML's private table ({size} bytes) handed out with its process lists restricted to the container's");
    Some(ours)
}

macro_rules! lists {
    ($($name:ident => $i:expr;)*) => {$(
        unsafe extern "C" fn $name(a: usize, b: usize, c: usize, d: usize, e: usize, g: usize) -> NvmlReturn {
            // SAFETY: set before this entry was handed out, to the driver's entry it stands for.
            let real: Slot = unsafe { std::mem::transmute::<usize, Slot>(REAL[$i].load(Acquire)) };
            let (dev, count, array) = (a as NvmlDevice, b as *mut u32, c as *mut u8);
            // SAFETY: the count the caller gave (its array's capacity), read before the driver's call.
            let cap = if count.is_null() { 0 } else { unsafe { *count } };
            // SAFETY: the caller's arguments, forwarded unchanged to the driver's entry.
            let r = unsafe { real(a, b, c, d, e, g) };
            if r == NVML_SUCCESS && !count.is_null() && !array.is_null() {
                // SAFETY: the list's contract, checked as far as it can be in `keep_ours`.
                crate::guard::run(|| unsafe { keep_ours(dev, count, array, cap) }, ());
            }
            r
        }
    )*};
}
lists! {
    list_213 => 0;
    list_214 => 1;
    list_215 => 2;
}

/// Keeps the container's entries of a list the driver wrote (`*count` entries of [`ENTRY`] bytes
/// at `array`, which has room for `cap`), each named by its PID in the container, at the front;
/// `*count` then says how many. Left as it is where the device is not a shared one of the
/// container's, the handle is not one NVML gave, or an entry's PID is not in NVML's public lists.
unsafe fn keep_ours(dev: NvmlDevice, count: *mut u32, array: *mut u8, cap: u32) {
    // SAFETY: the caller's non-null count.
    let n = unsafe { *count };
    if n == 0 || n > cap || cap > MAX_ENTRIES {
        return;
    }
    if !known_handle(dev) {
        said_once(|| {
            "a private process list was asked about a handle NVML's public calls do not give: nvidia-smi's \
             process lists are not restricted"
                .into()
        });
        return;
    }
    let Some(mine) = crate::nvml::ours(dev) else { return };
    // SAFETY: the driver wrote n <= cap entries of ENTRY bytes.
    let pids: Vec<u32> =
        (0..n as usize).map(|k| unsafe { (array.add(k * ENTRY) as *const u32).read_unaligned() }).collect();
    let public = public_pids(dev);
    if !pids.iter().all(|p| public.contains(p)) {
        said_once(|| {
            "an entry of NVML's private process list is not a process NVML lists: nvidia-smi's process lists are \
             not restricted"
                .into()
        });
        return;
    }
    let mut kept = 0usize;
    for (k, pid) in pids.iter().enumerate() {
        let Some(inner) = crate::nvml::shown_as(&mine, *pid) else { continue };
        // SAFETY: both entries are within the n written; copy handles kept == k.
        unsafe {
            std::ptr::copy(array.add(k * ENTRY), array.add(kept * ENTRY), ENTRY);
            (array.add(kept * ENTRY) as *mut u32).write_unaligned(inner);
        }
        kept += 1;
    }
    // SAFETY: the caller's non-null count.
    unsafe { *count = kept as u32 };
    vlog!(INFO, "a private process list: {kept} of its {n} entries are the container's");
}

/// Whether `dev` is a handle NVML gives for one of the node's GPUs (a private entry given anything
/// else is left alone: the public calls are not asked about it).
fn known_handle(dev: NvmlDevice) -> bool {
    let (Some(count), Some(by_index)) = (nvml().nvmlDeviceGetCount_v2, nvml().nvmlDeviceGetHandleByIndex_v2) else {
        return false;
    };
    let mut n = 0u32;
    // SAFETY: an out-pointer to a local.
    if unsafe { count(&mut n) } != NVML_SUCCESS {
        return false;
    }
    (0..n.min(64)).any(|i| {
        let mut h: NvmlDevice = std::ptr::null_mut();
        // SAFETY: an index below the count and an out-pointer to a local.
        unsafe { by_index(i, &mut h) == NVML_SUCCESS && h == dev }
    })
}

/// Every PID NVML's public lists name on `dev` (compute, graphics and MPS).
fn public_pids(dev: NvmlDevice) -> Vec<u32> {
    let n = nvml();
    let mut all = Vec::new();
    for real in [
        n.nvmlDeviceGetComputeRunningProcesses_v3,
        n.nvmlDeviceGetGraphicsRunningProcesses_v3,
        n.nvmlDeviceGetMPSComputeRunningProcesses_v3,
    ]
    .into_iter()
    .flatten()
    {
        // SAFETY: the driver's entry point with a handle NVML gave.
        if let Ok(l) = unsafe { list_processes(real, dev) } {
            all.extend(l.iter().map(|p| p.pid));
        }
    }
    all
}

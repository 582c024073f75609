//! NVML inside the container: memory info shows the container's slice, the queries that name
//! processes name the container's, and GPU-Util and its samples the container's share (so
//! `nvidia-smi` in the container shows its slice). Devices are matched to the region by UUID;
//! devices without a limit, and MIG devices, pass through.
#![allow(clippy::missing_safety_doc)]

use crate::nvquery::{device_uuid, grown, ListFn, Listed};
use crate::real::{nvml, nvml_fns as f};
use crate::state::state;
pub use cuda_abi::nvml::*;

/// The region device of an NVML handle, if it has a limit.
fn limited_device(dev: NvmlDevice) -> Option<(usize, u64)> {
    let d = region_device(dev)?;
    let limit = state().mem_limit(d);
    (limit != 0).then_some((d, limit))
}

/// Whether the container shares `dev` with others: it holds a slice of its memory or of its time.
/// Other tenants may run there, so what NVML says about processes is restricted to the
/// container's. A GPU without a limit is the container's whole (as NVML tells it).
fn shared_device(dev: NvmlDevice) -> bool {
    region_device(dev).is_some_and(|d| {
        let st = state();
        st.mem_limit(d) != 0 || matches!(st.sm_limit(d), 1..=99)
    })
}

/// The region device of an NVML handle (a device of the container, limited or not).
fn region_device(dev: NvmlDevice) -> Option<usize> {
    let st = state();
    let r = st.region.as_ref()?;
    let uuid = device_uuid(dev)?;
    let uuid = uuid.as_str();
    let d = match r.find_device(uuid) {
        Some(d) => d,
        // Not used through CUDA in this container yet (nvidia-smi before any CUDA process, or a
        // process that only uses NVML): bound like CUDA would bind it.
        None => {
            let mut index = 0u32;
            // SAFETY: out-pointer to a local.
            if unsafe { nvml().nvmlDeviceGetIndex?(dev, &mut index) } != NVML_SUCCESS {
                return None;
            }
            st.bind_nvml(index as usize, uuid)?
        }
    };
    Some(d)
}

/// The slice's (total, used) to answer a memory query of `dev` with: when the device is limited and
/// NVML answered `r` (the GPU's `total`, read only after a success), or has no memory figures for
/// it (a unified-memory GPU, GB10, answers NOT_SUPPORTED: the slice is then all the container has,
/// and it is told so).
fn sliced(r: NvmlReturn, dev: NvmlDevice, total: impl FnOnce() -> u64) -> Option<(u64, u64)> {
    let total = match r {
        NVML_SUCCESS => total(),
        NVML_ERROR_NOT_SUPPORTED => u64::MAX,
        _ => return None,
    };
    let (d, limit) = limited_device(dev)?;
    let t = total.min(limit);
    Some((t, state().used(d).min(t)))
}

pub unsafe fn memory_info(real: f::nvmlDeviceGetMemoryInfo, dev: NvmlDevice, m: *mut NvmlMemory) -> NvmlReturn {
    let r = forward!(real, dev, m);
    // SAFETY: the caller's structure for NVML to fill (NULL answered as NVML answered it); NVML
    // has returned, and no one else writes it during the hook.
    let Some(m) = (unsafe { m.as_mut() }) else { return r };
    let Some((t, u)) = sliced(r, dev, || m.total) else { return r };
    (m.total, m.used, m.free) = (t, u, t - u);
    NVML_SUCCESS
}

pub unsafe fn memory_info_v2(real: f::nvmlDeviceGetMemoryInfo_v2, dev: NvmlDevice, m: *mut NvmlMemoryV2) -> NvmlReturn {
    let r = forward!(real, dev, m);
    // SAFETY: as in `memory_info`, for the v2 structure: the caller's, NVML has returned.
    let Some(m) = (unsafe { m.as_mut() }) else { return r };
    let Some((t, u)) = sliced(r, dev, || m.total) else { return r };
    (m.total, m.reserved, m.used, m.free) = (t, 0, u, t - u);
    NVML_SUCCESS
}

/// The share of `dev`'s time the container's kernels ran, as the agent last published it in the
/// region (None: not a device of the container, or no fresh figure).
fn slice_utilization(dev: NvmlDevice) -> Option<u32> {
    region_device(dev).and_then(|d| state().region.as_ref()?.utilization(d))
}

/// `nvmlDeviceGetUtilizationRates`: on a device of the container, the share of the GPU's time its
/// own kernels ran, as the agent last measured it (never more than the GPU's); the GPU's figure
/// where none is published (no agent, or its figure went stale). The memory figure stays the
/// GPU's: no per-container measure of it exists.
pub unsafe fn utilization_rates(
    real: f::nvmlDeviceGetUtilizationRates,
    dev: NvmlDevice,
    u: *mut NvmlUtilization,
) -> NvmlReturn {
    let r = forward!(real, dev, u);
    if r != NVML_SUCCESS || u.is_null() {
        return r;
    }
    if let Some(pct) = slice_utilization(dev) {
        // SAFETY: u is non-null and NVML filled it.
        unsafe { (*u).gpu = (*u).gpu.min(pct) };
    }
    r
}

/// `NVML_GPU_UTILIZATION_SAMPLES` of `nvmlSamplingType_t`.
const GPU_UTILIZATION_SAMPLES: u32 = 1;
/// `NVML_VALUE_TYPE_UNSIGNED_INT` of `nvmlValueType_t`.
const VALUE_TYPE_UNSIGNED_INT: u32 = 1;

/// `nvmlDeviceGetSamples`: on a device of the container, the GPU utilization samples (what
/// `nvidia-smi -q -d UTILIZATION` shows) capped as [`utilization_rates`] is, at the share of the
/// GPU's time the container's kernels ran as the agent last published it. Other kinds of sample,
/// and every sample where no figure is published, are the GPU's.
pub unsafe fn samples(
    real: f::nvmlDeviceGetSamples,
    dev: NvmlDevice,
    kind: u32,
    last_seen: u64,
    value_type: *mut u32,
    count: *mut u32,
    samples: *mut NvmlSample,
) -> NvmlReturn {
    let r = forward!(real, dev, kind, last_seen, value_type, count, samples);
    if r != NVML_SUCCESS || kind != GPU_UTILIZATION_SAMPLES || samples.is_null() || count.is_null() {
        return r;
    }
    // SAFETY: value_type, where given, is what NVML just wrote.
    if value_type.is_null() || unsafe { *value_type } != VALUE_TYPE_UNSIGNED_INT {
        return r;
    }
    let Some(pct) = slice_utilization(dev) else { return r };
    // SAFETY: NVML filled *count entries of the caller's array.
    let filled = unsafe { std::slice::from_raw_parts_mut(samples, *count as usize) };
    for s in filled {
        // SAFETY: the value type is unsigned int: the union's `ui` member is the one NVML wrote.
        unsafe { s.value.ui = s.value.ui.min(pct) };
    }
    r
}

/// NVML's `NVML_STRUCT_VERSION(name, 1)`: the structure's size with the version in the top byte.
const fn struct_v1<T>() -> u32 {
    std::mem::size_of::<T>() as u32 | 1 << 24
}
const PROCESS_DETAIL_LIST_V1: u32 = struct_v1::<NvmlProcessDetailList>();
const PROCESSES_UTILIZATION_INFO_V1: u32 = struct_v1::<NvmlProcessesUtilizationInfo>();

const _: () = assert!(
    std::mem::size_of::<NvmlProcessInfoV1>() == 16
        && std::mem::size_of::<NvmlProcessInfo>() == 24
        && std::mem::size_of::<NvmlProcessDetail>() == 32
        && std::mem::size_of::<NvmlProcessDetailList>() == 24
        && std::mem::size_of::<NvmlProcessUtilizationSample>() == 32
        && std::mem::size_of::<NvmlProcessUtilizationInfo>() == 40
        && std::mem::size_of::<NvmlProcessesUtilizationInfo>() == 24
        && std::mem::size_of::<NvmlMemoryV2>() == 40
);

/// The container's processes as (the PID NVML names it by, the PID to show it under), when `dev`
/// is shared (see [`shared_device`]; None: answer as NVML does). NVML lists host PIDs (the driver
/// knows no PID namespace): a slot's host PID where known (its inner PID, in a PID namespace, may
/// be another process's host PID), else its PID (no namespace, or it could not be told). It is
/// shown under its PID in the container, unless the caller sees it by its host PID (a caller
/// outside the container's PID namespace, such as the host with the container's environment).
pub(crate) fn ours(dev: NvmlDevice) -> Option<Vec<(u32, u32)>> {
    if !shared_device(dev) {
        return None;
    }
    let region = state().region.as_ref()?;
    let slots: Vec<(u32, u32)> = region.slots().iter().map(|&(_, p, h, _)| (p, h)).collect();
    Some(pid_pairs(&slots, seen_by_host_pid))
}

/// The (NVML's PID, the PID to show) of each slot's (PID, host PID), as [`ours`] says; `by_host`
/// tells whether this process sees a process by its host PID ([`seen_by_host_pid`]).
fn pid_pairs(slots: &[(u32, u32)], by_host: impl Fn(u32, u32) -> bool) -> Vec<(u32, u32)> {
    slots
        .iter()
        .map(|&(p, h)| match h {
            0 => (p, p),
            h if h == p || by_host(h, p) => (h, h),
            h => (h, p),
        })
        .filter(|(nv, p)| *nv != 0 && *p != 0)
        .collect()
}

/// Whether this process sees process `host` (`inner` in its own PID namespace) by its host PID:
/// its `/proc/<host>` is that process, whose namespace PIDs (`NSpid`, from this `/proc`'s
/// namespace inward) run from `host` to `inner`. Inside the container `/proc/<host>` is another
/// process, or none.
fn seen_by_host_pid(host: u32, inner: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{host}/status")) else { return false };
    let Some(line) = status.lines().find_map(|l| l.strip_prefix("NSpid:")) else { return false };
    let pids: Vec<u32> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    pids.len() >= 2 && pids.first() == Some(&host) && pids.last() == Some(&inner)
}

/// Keeps the container's entries of `list` (`mine` from [`ours`]), each named by its PID in the
/// container: what `nvidia-smi` there can find in `/proc` (with host PIDs its process table stays
/// empty) and what a process compares with its own `getpid()`.
fn keep_ours<T: Listed>(list: &mut Vec<T>, mine: &[(u32, u32)]) {
    list.retain_mut(|e| match shown_as(mine, e.pid()) {
        Some(inner) => {
            e.set_pid(inner);
            true
        }
        None => false,
    });
}

/// The PID a process NVML lists as `nv` is shown under in the container, if it is one of the
/// container's (`mine`, from [`ours`]).
pub(crate) fn shown_as(mine: &[(u32, u32)], nv: u32) -> Option<u32> {
    mine.iter().find(|(n, _)| *n == nv).map(|&(_, inner)| inner)
}

/// Asks `query` (the driver, with a buffer of ours grown as it asks, see [`grown`]), keeps the
/// container's entries (`mine`, from [`ours`]) and answers the caller with them: `*count` the
/// entries, copied to `out` if it has room for them (`cap` entries), else INSUFFICIENT_SIZE;
/// `empty` when there are none (the process lists succeed, the utilization samples are NOT_FOUND);
/// the driver's error as it was.
///
/// # Safety
/// `query` calls the driver's entry point with the count and array it is given; `count` is valid
/// for writes; `out` is null or holds `cap` entries.
unsafe fn answer_ours<T: Listed>(
    query: impl FnMut(*mut u32, *mut T) -> NvmlReturn,
    mine: &[(u32, u32)],
    count: *mut u32,
    out: *mut T,
    cap: usize,
    empty: NvmlReturn,
) -> NvmlReturn {
    // SAFETY: the caller's contract.
    let mut list = match unsafe { grown(query) } {
        Ok(l) => l,
        Err(r) => return r,
    };
    keep_ours(&mut list, mine);
    // SAFETY: the caller's contract.
    unsafe { *count = list.len() as u32 };
    if list.is_empty() {
        return empty;
    }
    if out.is_null() || cap < list.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: out holds cap >= list.len() entries.
    unsafe { std::ptr::copy_nonoverlapping(list.as_ptr(), out, list.len()) };
    NVML_SUCCESS
}

/// The compute, graphics and MPS process lists (every version), restricted to the container's
/// processes.
pub unsafe fn processes<T: Listed>(real: ListFn<T>, dev: NvmlDevice, count: *mut u32, infos: *mut T) -> NvmlReturn {
    let mine = if count.is_null() { None } else { ours(dev) };
    let Some(mine) = mine else {
        return forward!(real, dev, count, infos);
    };
    // SAFETY: the real entry point with the caller's handle; count is non-null, and the caller's
    // infos holds the *count entries it passed in.
    unsafe { answer_ours(|n, p| real(dev, n, p), &mine, count, infos, *count as usize, NVML_SUCCESS) }
}

/// `nvmlDeviceGetRunningProcessDetailList`: the list of the mode asked for, restricted to the
/// container's processes.
pub unsafe fn process_details(
    real: f::nvmlDeviceGetRunningProcessDetailList,
    dev: NvmlDevice,
    list: *mut NvmlProcessDetailList,
) -> NvmlReturn {
    // SAFETY: list, when non-null, points at the caller's structure (its version says which).
    let mine = if list.is_null() || unsafe { (*list).version } != PROCESS_DETAIL_LIST_V1 { None } else { ours(dev) };
    let Some(mine) = mine else {
        return forward!(real, dev, list);
    };
    // SAFETY: `list` is non-null here (checked with its version above) and the caller's; its fields
    // are read once, and NVML fills a structure of our own.
    let (mode, cap, out) = unsafe { ((*list).mode, (*list).num_proc_array_entries, (*list).proc_array) };
    let query = |n: *mut u32, p: *mut NvmlProcessDetail| {
        let mut l =
            NvmlProcessDetailList { version: PROCESS_DETAIL_LIST_V1, mode, num_proc_array_entries: 0, proc_array: p };
        // SAFETY: n is grown()'s count; p null or holding *n entries.
        l.num_proc_array_entries = unsafe { *n };
        // SAFETY: a v1 structure of ours and the caller's handle.
        let r = unsafe { real(dev, &mut l) };
        // SAFETY: n is grown()'s count, valid for the query's duration.
        unsafe { *n = l.num_proc_array_entries };
        r
    };
    // SAFETY: query is the real entry point with a buffer of the count it states; the count is
    // the caller's structure's (non-null), whose array holds the cap entries it stated.
    unsafe { answer_ours(query, &mine, &raw mut (*list).num_proc_array_entries, out, cap as usize, NVML_SUCCESS) }
}

/// `nvmlDeviceGetProcessUtilization`: the samples of the container's processes (the GPU's other
/// processes are other tenants'); NOT_FOUND when none of them has a sample.
pub unsafe fn process_utilization(
    real: f::nvmlDeviceGetProcessUtilization,
    dev: NvmlDevice,
    samples: *mut NvmlProcessUtilizationSample,
    count: *mut u32,
    last_seen: u64,
) -> NvmlReturn {
    let mine = if count.is_null() { None } else { ours(dev) };
    let Some(mine) = mine else {
        return forward!(real, dev, samples, count, last_seen);
    };
    // SAFETY: the real entry point with the caller's handle; count is non-null, and samples holds
    // the *count entries the caller passed in.
    unsafe {
        answer_ours(|n, p| real(dev, p, n, last_seen), &mine, count, samples, *count as usize, NVML_ERROR_NOT_FOUND)
    }
}

/// `nvmlDeviceGetProcessesUtilizationInfo`: as [`process_utilization`], for the R550 structure.
pub unsafe fn processes_utilization(
    real: f::nvmlDeviceGetProcessesUtilizationInfo,
    dev: NvmlDevice,
    info: *mut NvmlProcessesUtilizationInfo,
) -> NvmlReturn {
    // SAFETY: info, when non-null, points at the caller's structure (its version says which).
    let v1 = !info.is_null() && unsafe { (*info).version } == PROCESSES_UTILIZATION_INFO_V1;
    let Some(mine) = (if v1 { ours(dev) } else { None }) else {
        return forward!(real, dev, info);
    };
    // SAFETY: `info` is non-null here (checked with its version above) and the caller's; its
    // fields are read once, and NVML fills a structure of our own.
    let (cap, out, last_seen) =
        unsafe { ((*info).process_samples_count, (*info).proc_util_array, (*info).last_seen_time_stamp) };
    let query = |n: *mut u32, p: *mut NvmlProcessUtilizationInfo| {
        let mut i = NvmlProcessesUtilizationInfo {
            version: PROCESSES_UTILIZATION_INFO_V1,
            // SAFETY: n is grown()'s count; p null or holding *n entries.
            process_samples_count: unsafe { *n },
            last_seen_time_stamp: last_seen,
            proc_util_array: p,
        };
        // SAFETY: a v1 structure of ours and the caller's handle.
        let r = unsafe { real(dev, &mut i) };
        // SAFETY: n is grown()'s count, valid for the query's duration.
        unsafe { *n = i.process_samples_count };
        r
    };
    // SAFETY: query is the real entry point with a buffer of the count it states; the count is
    // the caller's structure's (non-null), whose array holds the cap entries it stated.
    unsafe {
        answer_ours(query, &mine, &raw mut (*info).process_samples_count, out, cap as usize, NVML_ERROR_NOT_FOUND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pid: u32, mem: u64) -> NvmlProcessInfo {
        NvmlProcessInfo { pid, used_gpu_memory: mem, ..Default::default() }
    }

    /// A driver's process list as NVML answers a query of it: the count (capacity in, entries
    /// out), INSUFFICIENT_SIZE with the count needed when the array is NULL or too small. `grow`
    /// processes start between one call and the next.
    struct FakeList {
        list: Vec<NvmlProcessInfo>,
        grow: u32,
        fail: Option<NvmlReturn>,
        calls: u32,
    }

    impl FakeList {
        fn new(pids: &[u32]) -> Self {
            FakeList {
                list: pids.iter().map(|&p| info(p, u64::from(p) << 20)).collect(),
                grow: 0,
                fail: None,
                calls: 0,
            }
        }

        /// # Safety
        /// `n` is valid for reads and writes; `out` is NULL or holds `*n` entries.
        unsafe fn query(&mut self, n: *mut u32, out: *mut NvmlProcessInfo) -> NvmlReturn {
            self.calls += 1;
            if let Some(e) = self.fail {
                return e;
            }
            let len = self.list.len();
            let next = self.list.len() as u32 + 1000;
            self.list.extend((next..next + self.grow).map(|p| info(p, 0)));
            // SAFETY: the function's contract.
            let cap = unsafe { *n } as usize;
            // SAFETY: the function's contract.
            unsafe { *n = len as u32 };
            if len == 0 {
                return NVML_SUCCESS;
            }
            if out.is_null() || cap < len {
                return NVML_ERROR_INSUFFICIENT_SIZE;
            }
            // SAFETY: out holds cap >= len entries.
            unsafe { std::ptr::copy_nonoverlapping(self.list.as_ptr(), out, len) };
            NVML_SUCCESS
        }
    }

    fn pids<T: Listed>(l: &[T]) -> Vec<u32> {
        l.iter().map(Listed::pid).collect()
    }

    /// `grown` over a fake list.
    fn grow(fake: &mut FakeList) -> Result<Vec<NvmlProcessInfo>, NvmlReturn> {
        // SAFETY: the fake's query takes grown()'s count and buffer, as its contract asks.
        unsafe { grown(|n, p| fake.query(n, p)) }
    }

    #[test]
    fn a_list_is_asked_for_its_size_then_read_into_a_buffer_of_ours() {
        let mut fake = FakeList::new(&[11, 12, 13]);
        assert_eq!(pids(&grow(&mut fake).unwrap()), [11, 12, 13]);
        assert_eq!(fake.calls, 2, "a count query, then the list");
        assert!(grow(&mut FakeList::new(&[])).unwrap().is_empty());
    }

    #[test]
    fn a_list_that_grows_while_it_is_read_is_read_again_or_refused_whole() {
        // Three processes start between calls: the buffer's slack holds them.
        let mut fake = FakeList { grow: 3, ..FakeList::new(&[1, 2]) };
        assert_eq!(grow(&mut fake).unwrap().len(), 5, "the list as the filling call found it");
        // A list that outgrows every buffer: the caller is told so, never given part of it.
        let mut fake = FakeList { grow: 20, ..FakeList::new(&[1, 2]) };
        assert_eq!(grow(&mut fake).err(), Some(NVML_ERROR_INSUFFICIENT_SIZE));
        assert_eq!(fake.calls, 5, "four tries after the count");
    }

    #[test]
    fn a_driver_error_is_answered_as_it_was() {
        let mut fake = FakeList { fail: Some(NVML_ERROR_UNKNOWN), ..FakeList::new(&[1]) };
        assert_eq!(grow(&mut fake).err(), Some(NVML_ERROR_UNKNOWN));
    }

    /// `answer_ours` over a fake list, for a caller with an array of `cap` entries (None: NULL).
    fn answer(
        fake: &mut FakeList,
        mine: &[(u32, u32)],
        cap: Option<usize>,
        empty: NvmlReturn,
    ) -> (NvmlReturn, u32, Vec<NvmlProcessInfo>) {
        let mut out = vec![info(99, 99); cap.unwrap_or(0)];
        let ptr = if cap.is_some() { out.as_mut_ptr() } else { std::ptr::null_mut() };
        let mut count = cap.unwrap_or(0) as u32;
        // SAFETY: the fake's query as in `grow`; count is a local; out holds cap entries or is NULL.
        let r = unsafe { answer_ours(|n, p| fake.query(n, p), mine, &mut count, ptr, cap.unwrap_or(0), empty) };
        (r, count, out)
    }

    #[test]
    fn only_the_container_s_processes_are_answered_under_the_pids_it_sees() {
        let mut fake = FakeList::new(&[100, 200, 300]);
        // 200 is the container's process 7 (a PID namespace); 300 is seen by its host PID.
        let mine = [(200, 7), (300, 300)];
        let (r, count, out) = answer(&mut fake, &mine, Some(4), NVML_SUCCESS);
        assert_eq!((r, count), (NVML_SUCCESS, 2));
        assert_eq!(pids(&out[..2]), [7, 300], "in NVML's order, renamed");
        assert_eq!(out[0].used_gpu_memory, 200 << 20, "the entry's figures are NVML's");
        assert_eq!(out[2].pid, 99, "nothing written past the count");
    }

    #[test]
    fn a_caller_s_array_too_small_for_the_container_s_entries_is_told_how_many() {
        let mine = [(200, 7), (300, 300)];
        // Room for one of the two: INSUFFICIENT_SIZE, the count needed, the array untouched.
        let (r, count, out) = answer(&mut FakeList::new(&[100, 200, 300]), &mine, Some(1), NVML_SUCCESS);
        assert_eq!((r, count, out[0].pid), (NVML_ERROR_INSUFFICIENT_SIZE, 2, 99));
        // The count query (NULL array).
        let (r, count, _) = answer(&mut FakeList::new(&[100, 200, 300]), &mine, None, NVML_SUCCESS);
        assert_eq!((r, count), (NVML_ERROR_INSUFFICIENT_SIZE, 2));
        // The GPU's other tenants' entries do not count: room for two is enough though NVML has three.
        let (r, count, _) = answer(&mut FakeList::new(&[100, 200, 300]), &mine, Some(2), NVML_SUCCESS);
        assert_eq!((r, count), (NVML_SUCCESS, 2));
    }

    #[test]
    fn none_of_the_container_s_processes_answers_the_query_s_empty_value() {
        let mine = [(555, 5)];
        let (r, count, _) = answer(&mut FakeList::new(&[100, 200]), &mine, Some(2), NVML_SUCCESS);
        assert_eq!((r, count), (NVML_SUCCESS, 0), "a process list: empty");
        let (r, count, _) = answer(&mut FakeList::new(&[100, 200]), &mine, Some(2), NVML_ERROR_NOT_FOUND);
        assert_eq!((r, count), (NVML_ERROR_NOT_FOUND, 0), "utilization samples: none");
        let mut failing = FakeList { fail: Some(NVML_ERROR_UNKNOWN), ..FakeList::new(&[200]) };
        assert_eq!(answer(&mut failing, &[(200, 7)], Some(2), NVML_SUCCESS).0, NVML_ERROR_UNKNOWN);
    }

    #[test]
    fn a_slot_is_named_by_its_host_pid_and_shown_as_the_caller_sees_it() {
        // (pid, host pid) per slot; the caller sees process 4321 by its host PID (it is outside
        // the container's PID namespace), not 1234.
        let slots = [(5, 0), (6, 6), (7, 1234), (8, 4321), (0, 0), (9, 0)];
        let pairs = pid_pairs(&slots, |host, inner| (host, inner) == (4321, 8));
        assert_eq!(pairs, [(5, 5), (6, 6), (1234, 7), (4321, 4321), (9, 9)]);
        assert_eq!(shown_as(&pairs, 1234), Some(7));
        assert_eq!(shown_as(&pairs, 7), None, "NVML names host PIDs: 7 is another process");
        let mut l = vec![info(1234, 1), info(42, 2), info(4321, 3)];
        keep_ours(&mut l, &pairs);
        assert_eq!(pids(&l), [7, 4321]);
    }
}

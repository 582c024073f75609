//! The region's binary layout (ABI). Every field shared between processes is an atomic; everything
//! read from the file is untrusted input and is validated before use.

use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64};

pub const MAGIC: u64 = u64::from_le_bytes(*b"VGPUREG\0");
pub const ABI_VERSION: u32 = 1;
pub const MAX_DEVICES: usize = 16;
pub const MAX_SLOTS: usize = 1024;
/// Byte offsets used for record locks; they lie beyond the end of the file (locks need no data).
pub const INIT_LOCK_BYTE: i64 = 1 << 40;
pub const SLOT_LOCK_BASE: i64 = (1 << 40) + 4096;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub abi_version: AtomicU32,
    pub header_size: AtomicU32,
    pub total_size: AtomicU64,
    pub layout_hash: AtomicU64,
    /// 0 while being created, 1 when ready.
    pub state: AtomicU32,
    /// Devices described (container-visible CUDA indices 0..n).
    pub ndevices: AtomicU32,
    /// Bit 0 ([`FLAG_STANDALONE`](crate::FLAG_STANDALONE)): created by a process from its
    /// environment, not by the agent. Bit 1
    /// ([`FLAG_OVERSUBSCRIBE`](crate::FLAG_OVERSUBSCRIBE)): allocations the GPU has no room for may
    /// be served as unified memory. Bit 2 ([`FLAG_PRIORITY_HIGH`](crate::FLAG_PRIORITY_HIGH)): the
    /// slice is a high-priority tenant.
    pub flags: AtomicU32,
    pub creator_pid: AtomicU32,
    /// Bumped by every limit change.
    pub limits_generation: AtomicU64,
    /// One past the highest slot ever claimed.
    pub slots_hw: AtomicU32,
    /// Slots marked exiting and not yet reclaimed (a hint: readers of the usage that see 0 do not
    /// look for them). Was padding: builds that do not know it leave it 0.
    pub exiting: AtomicU32,
    /// A normal slice beside a high-priority one keeps at most this much GPU time queued on each
    /// GPU (ns; 0: the interposer's default). Was reserved: builds that do not know it leave it 0.
    pub priority_queue_ns: AtomicU64,
    /// The share of every window (percent, 1-50; 0: the interposer's default) in which a normal
    /// slice beside a high-priority one launches whatever the high-priority slice claims to have
    /// queued. Was reserved: builds that do not know it leave it 0.
    pub priority_min_share: AtomicU64,
    /// The process whose true-up measures the contexts of a standalone region's processes (see
    /// [`Region::become_measurer`](crate::Region::become_measurer)): `(slot + 1) << 32 | pid`;
    /// 0: none. Was reserved: builds that do not know it leave it 0.
    pub trueup_measurer: AtomicU64,
    /// Passes asked of the measurer and passes it finished (wrapping counters, each a futex word).
    /// Were reserved: builds that do not know them leave them 0.
    pub trueup_asked: AtomicU32,
    pub trueup_served: AtomicU32,
    pub _reserved: [AtomicU64; 4],
}

#[repr(C)]
pub struct Device {
    /// `GPU-...` UUID, NUL padded, 8 bytes per word (little-endian).
    pub uuid: [AtomicU64; 8],
    /// Memory limit in bytes; 0 = unlimited.
    pub mem_limit: AtomicU64,
    /// SM limit in percent; 0 or >= 100 = unlimited.
    pub sm_limit: AtomicU32,
    /// Launches the container's processes could not time with events (each said once in its log;
    /// the agent reports the count). Wrapping. Was padding: builds that do not know it leave it 0.
    pub sm_unmeasured: AtomicU32,
    /// Allocations refused because of the limit.
    pub oom_rejections: AtomicU64,
    /// Highest usage seen by a successful reservation.
    pub peak_used: AtomicU64,
    /// SM-time budget shared by the container's processes, in ns of GPU time; negative is debt.
    pub sm_tokens: AtomicI64,
    /// CLOCK_MONOTONIC ns up to which the budget has been refilled.
    pub sm_refilled_to: AtomicU64,
    /// Correction of the refill rate in parts per million (0 means 1 000 000): the agent's feedback
    /// from measured utilisation.
    pub sm_rate_ppm: AtomicU64,
    /// Bit 0: the GPU is shared with another container (set by the agent; the default policy limits
    /// only then). Bit 1: the agent manages this flag.
    pub sm_flags: AtomicU64,
    /// Totals for observability: GPU time measured by samples, time launches waited, launches that
    /// waited.
    pub sm_charged_ns: AtomicU64,
    pub sm_throttled_ns: AtomicU64,
    pub sm_throttled_launches: AtomicU64,
    /// GPU ns the budget has been refilled with (what the cap kept), ever: with `sm_tokens`, what the
    /// container's launches were charged over a window is (change of this) - (change of the
    /// tokens). Written on the refill path only. Libraries from before it leave it 0.
    pub sm_earned_ns: AtomicU64,
    /// Allocations the driver refused for want of physical memory that were served as unified
    /// (managed) memory instead, and their bytes, ever (`CUDA_OVERSUBSCRIBE`). Libraries from before
    /// them leave them 0.
    pub spilled_allocs: AtomicU64,
    pub spilled_bytes: AtomicU64,
    /// Bytes reserved by calls the driver has not answered yet, all processes together (added
    /// before a reservation, taken back after the call; wrapping, read as signed): what NVML's
    /// figures may not show yet, for the agent's true-up. Was reserved: libraries from before it,
    /// and standalone processes (no agent), leave it alone.
    pub in_flight: AtomicU64,
    /// The container's GPU utilisation on this device as the agent measured it, for NVML in the
    /// container: `(until_ms << 8) | (percent + 1)`, where `until_ms` is the CLOCK_MONOTONIC ms
    /// after which the figure is stale; 0 = none. Was reserved: libraries from before it, and
    /// standalone containers (no agent), leave it 0.
    pub utilization: AtomicU64,
}

#[repr(C)]
pub struct Slot {
    /// 0 free, 1 live.
    pub state: AtomicU32,
    /// PID as the process sees itself.
    pub pid: AtomicU32,
    /// PID on the host, when known (filled by the agent, or equal to pid without a PID namespace).
    pub host_pid: AtomicU32,
    /// 1 once the process has begun to exit (its exit handler ran): reclaim the slot as soon as its
    /// lock is free. Was padding: builds that do not know it leave it 0.
    pub exiting: AtomicU32,
    /// CLOCK_REALTIME ns at claim.
    pub claimed_ns: AtomicU64,
    /// Device memory held per device, context overhead included.
    pub used: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
pub struct Layout {
    pub header: Header,
    pub devices: [Device; MAX_DEVICES],
    pub slots: [Slot; MAX_SLOTS],
}

pub const TOTAL_SIZE: usize = size_of::<Layout>();

const fn fnv(mut h: u64, x: u64) -> u64 {
    let b = x.to_le_bytes();
    let mut i = 0;
    while i < 8 {
        h ^= b[i] as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
        i += 1;
    }
    h
}

/// A fingerprint of every offset and size: two builds agree on it only if they agree on the layout.
pub const LAYOUT_HASH: u64 = {
    let parts = [
        size_of::<Header>(),
        offset_of!(Header, state),
        offset_of!(Header, limits_generation),
        offset_of!(Header, slots_hw),
        size_of::<Device>(),
        offset_of!(Device, mem_limit),
        offset_of!(Device, sm_limit),
        offset_of!(Device, oom_rejections),
        offset_of!(Device, sm_tokens),
        offset_of!(Device, sm_flags),
        size_of::<Slot>(),
        offset_of!(Slot, used),
        offset_of!(Layout, devices),
        offset_of!(Layout, slots),
        MAX_DEVICES,
        MAX_SLOTS,
        ABI_VERSION as usize,
    ];
    let mut h = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < parts.len() {
        h = fnv(h, parts[i] as u64);
        i += 1;
    }
    h
};

// The ABI: changing any of these is an ABI version bump.
const _: () = {
    assert!(size_of::<Header>() == 128);
    assert!(size_of::<Device>() == 192);
    assert!(size_of::<Slot>() == 152);
    assert!(offset_of!(Layout, devices) == 128);
    assert!(offset_of!(Layout, slots) == 128 + 192 * MAX_DEVICES);
    assert!(TOTAL_SIZE == 128 + 192 * MAX_DEVICES + 152 * MAX_SLOTS);
};

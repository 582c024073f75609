//! GPU health: critical XID events from NVML's event API mark a GPU unhealthy; it becomes healthy
//! again once `recovery` has passed without another critical XID and NVML answers for it. NVML
//! failing for a GPU in a monitoring pass also marks it unhealthy until it answers again.
//!
//! On a GPU in MIG mode NVML says which GPU instance an XID is about (or that it is about the whole
//! GPU): one about an instance marks only that instance's MIG device unhealthy, for as long, and
//! leaves the GPU and its other instances healthy.
//!
//! XIDs that report an application's own fault (the kernel, not the GPU, misbehaved) do not make a
//! GPU unhealthy: 13 (graphics engine exception), 31 (memory page fault), 43 (GPU stopped
//! processing), 45 (preemptive cleanup), 68 (video processor exception), 109 (context switch timeout).

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::Nvml;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

pub fn is_critical(xid: u64) -> bool {
    !matches!(xid, 13 | 31 | 43 | 45 | 68 | 109)
}

#[derive(Clone, Debug)]
struct Bad {
    last: Instant,
    reason: String,
}

/// The XIDs one GPU reported since the agent started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XidCounts {
    pub critical: u64,
    /// XIDs that report an application's fault (the GPU stays healthy).
    pub application: u64,
    /// The last critical XID (0: none) and when it came.
    pub last_critical: u64,
    pub last_critical_at: String,
}

/// What a health mark is on: a GPU (`None`) or one of its GPU instances.
type Key = (String, Option<u32>);

pub struct Health {
    recovery: Duration,
    bad: Mutex<HashMap<Key, Bad>>,
    /// Per GPU UUID.
    xids: Mutex<HashMap<String, XidCounts>>,
}

/// `t` as RFC 3339 in UTC to the second (`YYYY-MM-DDTHH:MM:SSZ`, as Kubernetes writes times).
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    jiff::Timestamp::from_second(secs).map_or_else(|_| "1970-01-01T00:00:00Z".to_string(), |ts| ts.to_string())
}

/// Now, as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339_now() -> String {
    rfc3339(SystemTime::now())
}

impl Health {
    pub fn new(recovery: Duration) -> Health {
        Health { recovery, bad: Mutex::new(HashMap::new()), xids: Mutex::new(HashMap::new()) }
    }

    /// The XIDs `uuid` reported since start.
    pub fn xids(&self, uuid: &str) -> XidCounts {
        self.xids.lock().get(uuid).cloned().unwrap_or_default()
    }

    /// Records an XID on `uuid`, about its GPU instance `instance` where NVML named one (a GPU in
    /// MIG mode); returns whether it made the GPU, or that instance, unhealthy. The GPU's counts
    /// take both.
    pub fn xid(&self, uuid: &str, instance: Option<u32>, xid: u64) -> bool {
        if !is_critical(xid) {
            tracing::info!(gpu = %uuid, gpu_instance = ?instance, xid, "application XID (the GPU stays healthy)");
            self.xids.lock().entry(uuid.to_owned()).or_default().application += 1;
            return false;
        }
        let at = rfc3339(SystemTime::now());
        let reason = format!("XID {xid} at {at}");
        {
            let mut xids = self.xids.lock();
            let c = xids.entry(uuid.to_owned()).or_default();
            c.critical += 1;
            c.last_critical = xid;
            c.last_critical_at = at;
        }
        match instance {
            None => tracing::warn!(gpu = %uuid, xid, "critical XID: GPU marked unhealthy"),
            Some(gi) => tracing::warn!(gpu = %uuid, gpu_instance = gi, xid,
                "critical XID in a MIG GPU instance: its device marked unhealthy (the GPU's others stay healthy)"),
        }
        self.bad.lock().insert((uuid.to_owned(), instance), Bad { last: Instant::now(), reason });
        true
    }

    /// Why GPU instance `gi` of `uuid` is unhealthy (a critical XID about it within the recovery
    /// time), or `None` where it is not. Its GPU's own health is [`check`](Self::check)'s.
    pub fn instance(&self, uuid: &str, gi: u32) -> Option<String> {
        let mut bad = self.bad.lock();
        let key = (uuid.to_owned(), Some(gi));
        let b = bad.get(&key)?;
        if b.last.elapsed() < self.recovery {
            return Some(b.reason.clone());
        }
        tracing::info!(gpu = %uuid, gpu_instance = gi, was = %b.reason, "MIG GPU instance healthy again");
        bad.remove(&key);
        None
    }

    /// A monitoring pass's verdict for `uuid`: `error` when NVML failed for it. Returns (healthy, why).
    pub fn check(&self, uuid: &str, error: Option<&str>) -> (bool, String) {
        let mut bad = self.bad.lock();
        let key = (uuid.to_owned(), None);
        if let Some(e) = error {
            let b = bad.entry(key).or_insert_with(|| Bad { last: Instant::now(), reason: String::new() });
            b.reason = format!("NVML: {e}");
            b.last = Instant::now();
            return (false, b.reason.clone());
        }
        match bad.get(&key) {
            None => (true, String::new()),
            Some(b) if b.last.elapsed() >= self.recovery || b.reason.starts_with("NVML:") => {
                tracing::info!(gpu = %uuid, was = %b.reason, "GPU healthy again");
                bad.remove(&key);
                (true, String::new())
            }
            Some(b) => (false, b.reason.clone()),
        }
    }
}

/// Waits for critical-XID events on every GPU until `stop`; a thread of its own (NVML's wait blocks).
pub fn watch_xids(nvml: Arc<Nvml>, health: Arc<Health>, stop: Arc<AtomicBool>) {
    let set = match nvml.create_event_set() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "NVML events unavailable: GPU health from monitoring passes only");
            return;
        }
    };
    let mut set = Some(set);
    for i in 0..nvml.device_count().unwrap_or(0) {
        let Ok(d) = nvml.device_by_index(i) else { continue };
        let supported = d.supported_event_types().map(|t| t.contains(EventTypes::CRITICAL_XID_ERROR));
        if !matches!(supported, Ok(true)) {
            tracing::warn!(gpu = i, "GPU does not report XID events");
            continue;
        }
        match d.register_events(EventTypes::CRITICAL_XID_ERROR, set.take().expect("set")) {
            Ok(s) => set = Some(s),
            Err(e) => {
                tracing::warn!(gpu = i, error = %e.error, "cannot register for XID events");
                match nvml.create_event_set() {
                    Ok(s) => set = Some(s),
                    Err(_) => return,
                }
            }
        }
    }
    let set = set.expect("set");
    // NVML's wait called directly: nvml-wrapper's leaves out which MIG instance an event is about.
    let wait = match nvml.lib().nvmlEventSetWait_v2.as_ref() {
        Ok(w) => *w,
        Err(e) => {
            tracing::warn!(error = %e, "NVML has no nvmlEventSetWait_v2: GPU health from monitoring passes only");
            return;
        }
    };
    while !stop.load(Relaxed) {
        // SAFETY: all-zero is a valid nvmlEventData_t (plain integers and a null handle).
        let mut data: nvml_wrapper_sys::bindings::nvmlEventData_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a live event set (it outlives this loop) and `data` a local to write.
        let r = nvml_try(unsafe { wait(set.handle(), &mut data, 200) });
        match r {
            Ok(()) => {
                let gi = data.gpuInstanceId;
                // SAFETY: NVML filled `data` (its device handle is one of `nvml`'s).
                let ev = unsafe { EventData::new(data, &nvml) };
                let xid = match ev.event_data {
                    Some(XidError::Value(v)) => v,
                    _ => 0,
                };
                // 0xFFFFFFFF: the whole GPU. An instance ID means one only on a GPU in MIG mode.
                let in_mig = || ev.device.mig_mode().is_ok_and(|m| m.current == 1);
                let instance = (gi != u32::MAX && in_mig()).then_some(gi);
                if let Ok(uuid) = ev.device.uuid() {
                    health.xid(&uuid, instance, xid);
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "waiting for NVML events failed");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_xids_mark_unhealthy_until_quiet_and_nvml_errors_until_answering() {
        let h = Health::new(Duration::from_millis(50));
        assert!(!h.xid("GPU-a", None, 31), "an application fault leaves the GPU healthy");
        assert_eq!(h.check("GPU-a", None), (true, String::new()));
        assert!(h.xid("GPU-a", None, 79));
        let (ok, why) = h.check("GPU-a", None);
        assert!(!ok && why.starts_with("XID 79 at 20"), "{why}");
        assert!(h.check("GPU-b", None).0, "other GPUs unaffected");
        std::thread::sleep(Duration::from_millis(60));
        assert!(h.check("GPU-a", None).0, "recovered after a quiet period");
        assert_eq!(h.check("GPU-b", Some("GPU is lost")), (false, "NVML: GPU is lost".into()));
        assert!(h.check("GPU-b", None).0, "NVML answers again");
        let a = h.xids("GPU-a");
        assert_eq!((a.critical, a.application, a.last_critical), (1, 1, 79), "{a:?}");
        assert!(a.last_critical_at.starts_with("20") && why.ends_with(&a.last_critical_at), "{a:?} {why}");
        assert!(h.xid("GPU-a", None, 48));
        assert_eq!((h.xids("GPU-a").critical, h.xids("GPU-a").last_critical), (2, 48));
        assert_eq!(h.xids("GPU-b"), XidCounts::default(), "counted per GPU");
    }

    #[test]
    fn an_xid_about_a_mig_instance_marks_only_that_instance() {
        let h = Health::new(Duration::from_millis(50));
        assert!(!h.xid("GPU-m", Some(3), 43), "an application fault leaves the instance healthy");
        assert_eq!(h.instance("GPU-m", 3), None);
        assert!(h.xid("GPU-m", Some(3), 94));
        let why = h.instance("GPU-m", 3).unwrap_or_default();
        assert!(why.starts_with("XID 94 at 20"), "{why}");
        assert_eq!(
            (h.instance("GPU-m", 5), h.instance("GPU-x", 3)),
            (None, None),
            "other instances and GPUs unaffected"
        );
        assert!(h.check("GPU-m", None).0, "the GPU itself stays healthy");
        let c = h.xids("GPU-m");
        assert_eq!((c.critical, c.application, c.last_critical), (1, 1, 94), "the GPU's counts take both");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(h.instance("GPU-m", 3), None, "recovered after a quiet period");
        // One about the whole GPU leaves the instances' own marks alone (the GPU's covers them).
        assert!(h.xid("GPU-m", None, 79));
        assert!(!h.check("GPU-m", None).0);
        assert_eq!(h.instance("GPU-m", 5), None);
    }

    #[test]
    fn dates() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_000_000)), "2026-11-30T00:53:20Z");
    }
}

//! The interposer's configuration: the HAMi-core environment contract plus `VGPU_` additions, read
//! once. Bad values are collected, reported once, and handled by the stated policy.

use vgpu_region::MAX_DEVICES;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CorePolicy {
    /// Limit SM time always.
    Force,
    /// Never limit SM time.
    Disable,
    /// Limit while the GPU is shared.
    Default,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// Memory limit per container-visible device index; 0 = none.
    pub mem_limit: [u64; MAX_DEVICES],
    /// SM limit in percent per device; 0 = none.
    pub sm_limit: [u32; MAX_DEVICES],
    pub region_path: String,
    /// `region_path` is [`default_region`]'s (no region was named).
    pub default_region: bool,
    /// Read-only region holding the limits (written by the agent), if any.
    pub limits_path: Option<String>,
    pub core_policy: CorePolicy,
    pub log_level: u8,
    /// Device memory charged per CUDA context.
    pub context_overhead: u64,
    /// Count cuMemAllocManaged allocations.
    pub count_managed: bool,
    /// On bad configuration or an unusable region, run unlimited instead of refusing allocations.
    pub fail_open: bool,
    /// `CUDA_OVERSUBSCRIBE`: a `cuMemAlloc` within the limit that the GPU has no physical room for
    /// is served as unified (managed) memory, which the driver pages between GPU and host.
    pub oversubscribe: bool,
    /// Where no agent watches the region, charge the process for device memory NVML says the
    /// driver holds for it beyond its own account (`VGPU_MEMORY_TRUE_UP`, on unless 0/false/no/off).
    pub memory_true_up: bool,
    /// The agent's files are mounted into this container (its limits file exists at
    /// [`INJECTED_LIMITS`]): they are the configuration, and the environment cannot loosen it.
    pub managed: bool,
    /// Problems found, one line each.
    pub errors: Vec<String>,
    /// Settings of the environment ignored because the container is managed, one line each.
    pub ignored: Vec<String>,
}

/// Where a process keeps its region when nothing names one (no agent, no
/// `CUDA_DEVICE_MEMORY_SHARED_CACHE`): one file per user and limit set, so that processes of one
/// user started with the same limits share a quota, and a run with other limits gets its own
/// instead of the limits an earlier run left in a shared file.
pub fn default_region(uid: u32, mem: &[u64; MAX_DEVICES], sm: &[u32; MAX_DEVICES]) -> String {
    // FNV-1a over the limits: a name, not a secret.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in mem.iter().flat_map(|m| m.to_le_bytes()).chain(sm.iter().flat_map(|s| s.to_le_bytes())) {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("{}/{h:016x}.region", default_region_dir(uid))
}
/// The folder of a user's default regions: `$TMPDIR/vgpu-<uid>` (`/tmp` without `TMPDIR`), which
/// only that user may write (see the interposer's state: made 0700, refused otherwise).
pub fn default_region_dir(uid: u32) -> String {
    let tmp = std::env::var("TMPDIR").ok().filter(|t| t.starts_with('/')).unwrap_or_else(|| "/tmp".into());
    format!("{}/vgpu-{uid}", tmp.trim_end_matches('/'))
}

/// Where the agent's injection puts a slice's files in a container.
pub const INJECTED_REGION: &str = "/usr/local/vgpu/region";
pub const INJECTED_LIMITS: &str = "/usr/local/vgpu/limits";
pub const DEFAULT_CONTEXT_OVERHEAD: u64 = 256 << 20;

/// A size as everything in vgpu parses it (`vgpu_units`: HAMi's `8g` and `8192m`, `8GiB`, `8GB`,
/// bytes, `0x` hex); None when it is not one.
pub fn parse_size(s: &str) -> Option<u64> {
    vgpu_units::parse_size(s).ok()
}

fn parse_percent(s: &str) -> Option<u32> {
    let v: u32 = s.trim().parse().ok()?;
    Some(if v >= 100 { 0 } else { v })
}

impl Config {
    /// From the process environment. Where the agent's injection mounted a slice's files
    /// (`/usr/local/vgpu/region` and the read-only `/usr/local/vgpu/limits`; an OCI hook can mount
    /// files into a container but cannot change its environment), the container is managed: those
    /// files are used whatever the environment says (see [`Config::managed`]).
    pub fn from_env() -> Config {
        let managed = injected();
        Self::from_lookup_in(
            |k| {
                std::env::var(k).ok().or_else(|| {
                    // A region mounted without a limits file: used when nothing else is named.
                    let region =
                        k == "CUDA_DEVICE_MEMORY_SHARED_CACHE" && std::path::Path::new(INJECTED_REGION).exists();
                    region.then(|| INJECTED_REGION.to_string())
                })
            },
            managed,
        )
    }

    /// The agent's limits file, as [`from_env`](Self::from_env) would find it, without the rest of
    /// the configuration (the slice's GPUs are read before the process's state is made).
    pub fn limits_path_from_env() -> Option<String> {
        limits_path(std::env::var("VGPU_LIMITS_FILE").ok(), injected())
    }

    /// From `get`, for a container that is not managed.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Config {
        Self::from_lookup_in(get, false)
    }

    /// From `get`; in a `managed` container the environment is the process's own (a hostile workload
    /// sets what it likes) and may only tighten what the agent's files say: the region and limits
    /// files are the injected ones, `VGPU_FAIL_OPEN`, `GPU_CORE_UTILIZATION_POLICY=disable` and
    /// `VGPU_COUNT_MANAGED=0` are ignored, and `VGPU_CONTEXT_OVERHEAD` may raise the per-context
    /// charge but not lower it below the default. (The limits themselves always come from the
    /// limits file when there is one.) What was ignored is listed in `ignored`.
    pub fn from_lookup_in(get: impl Fn(&str) -> Option<String>, managed: bool) -> Config {
        let mut errors = Vec::new();
        let mut size = |k: &str| -> Option<u64> {
            let v = get(k)?;
            match vgpu_units::parse_size(&v) {
                Ok(x) => Some(x),
                Err(e) => {
                    errors.push(format!("{k}={v:?} {}", e.reason()));
                    None
                }
            }
        };
        let all = size("CUDA_DEVICE_MEMORY_LIMIT").unwrap_or(0);
        let mut mem_limit = [all; MAX_DEVICES];
        for (i, m) in mem_limit.iter_mut().enumerate() {
            if let Some(v) = size(&format!("CUDA_DEVICE_MEMORY_LIMIT_{i}")) {
                *m = v;
            }
        }
        let context_overhead = size("VGPU_CONTEXT_OVERHEAD").unwrap_or(DEFAULT_CONTEXT_OVERHEAD);
        let mut pct = |k: &str| -> Option<u32> {
            let v = get(k)?;
            match parse_percent(&v) {
                Some(x) => Some(x),
                None => {
                    errors.push(format!("{k}={v:?} is not a percentage"));
                    None
                }
            }
        };
        let all = pct("CUDA_DEVICE_SM_LIMIT").unwrap_or(0);
        let mut sm_limit = [all; MAX_DEVICES];
        for (i, s) in sm_limit.iter_mut().enumerate() {
            if let Some(v) = pct(&format!("CUDA_DEVICE_SM_LIMIT_{i}")) {
                *s = v;
            }
        }
        let core_policy = match get("GPU_CORE_UTILIZATION_POLICY").as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("") | Some("default") => CorePolicy::Default,
            Some("force") => CorePolicy::Force,
            Some("disable") => CorePolicy::Disable,
            Some(v) => {
                errors.push(format!("GPU_CORE_UTILIZATION_POLICY={v:?} is not force, disable or default"));
                CorePolicy::Default
            }
        };
        let log_level = match get("LIBCUDA_LOG_LEVEL") {
            None => 1,
            Some(v) => match v.trim().parse::<u8>() {
                Ok(l) if l <= 4 => l,
                _ => {
                    errors.push(format!("LIBCUDA_LOG_LEVEL={v:?} is not 0-4"));
                    1
                }
            },
        };
        let flag = |k: &str| {
            get(k).is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        };
        let mut c = Config {
            mem_limit,
            sm_limit,
            region_path: get("CUDA_DEVICE_MEMORY_SHARED_CACHE").filter(|p| !p.is_empty()).unwrap_or_else(|| {
                // SAFETY: geteuid has no preconditions.
                default_region(unsafe { libc::geteuid() }, &mem_limit, &sm_limit)
            }),
            default_region: get("CUDA_DEVICE_MEMORY_SHARED_CACHE").is_none_or(|p| p.is_empty()),
            limits_path: limits_path(get("VGPU_LIMITS_FILE"), false),
            core_policy,
            log_level,
            context_overhead,
            count_managed: get("VGPU_COUNT_MANAGED").is_none_or(|v| v.trim() != "0"),
            fail_open: flag("VGPU_FAIL_OPEN"),
            oversubscribe: flag("CUDA_OVERSUBSCRIBE"),
            memory_true_up: !get("VGPU_MEMORY_TRUE_UP")
                .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off")),
            managed,
            errors,
            ignored: Vec::new(),
        };
        if managed {
            c.lock_to_injected(get("CUDA_DEVICE_MEMORY_SHARED_CACHE"), get("VGPU_LIMITS_FILE"));
        }
        c
    }

    /// The managed container's rules (see [`from_lookup_in`](Self::from_lookup_in)).
    fn lock_to_injected(&mut self, region: Option<String>, limits: Option<String>) {
        let ignored = &mut self.ignored;
        for (k, set, injected) in [
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", region, INJECTED_REGION),
            ("VGPU_LIMITS_FILE", limits, INJECTED_LIMITS),
        ] {
            if let Some(v) = set.filter(|v| v != injected) {
                ignored.push(format!("{k}={v:?} (the agent's {injected} is used)"));
            }
        }
        self.region_path = INJECTED_REGION.into();
        self.default_region = false;
        self.limits_path = limits_path(None, true);
        if self.fail_open {
            ignored.push("VGPU_FAIL_OPEN".into());
            self.fail_open = false;
        }
        if self.core_policy == CorePolicy::Disable {
            ignored.push("GPU_CORE_UTILIZATION_POLICY=disable (default is used)".into());
            self.core_policy = CorePolicy::Default;
        }
        if !self.count_managed {
            ignored.push("VGPU_COUNT_MANAGED=0".into());
            self.count_managed = true;
        }
        if self.context_overhead < DEFAULT_CONTEXT_OVERHEAD {
            ignored.push(format!(
                "VGPU_CONTEXT_OVERHEAD={} (below the default {} MiB)",
                self.context_overhead,
                DEFAULT_CONTEXT_OVERHEAD >> 20
            ));
            self.context_overhead = DEFAULT_CONTEXT_OVERHEAD;
        }
    }
}

/// Whether the agent's injection mounted a slice's limits file here (a managed container).
fn injected() -> bool {
    std::path::Path::new(INJECTED_LIMITS).exists()
}

/// The limits file: the injected one in a managed container, else `VGPU_LIMITS_FILE` where set.
fn limits_path(named: Option<String>, managed: bool) -> Option<String> {
    if managed {
        Some(INJECTED_LIMITS.into())
    } else {
        named.filter(|p| !p.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(kv: &[(&str, &str)]) -> Config {
        let m: HashMap<String, String> = kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1024"), Some(1024));
        assert_eq!(parse_size("3000m"), Some(3000 << 20));
        assert_eq!(parse_size("8G"), Some(8 << 30));
        assert_eq!(parse_size("16k"), Some(16 << 10));
        assert_eq!(parse_size("0x100"), Some(256));
        assert_eq!(parse_size("0"), Some(0));
        // The forms vgpuctl accepts are accepted here too (one parser: `vgpu_units`).
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size("1.5g"), Some(3 << 29));
        for bad in ["", "m", "12q", "-5", "99999999999999g"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
        let c = Config::from_lookup_in(|k| (k == "CUDA_DEVICE_MEMORY_LIMIT").then(|| "8 gigs".to_string()), false);
        assert!(
            c.errors[0].contains("CUDA_DEVICE_MEMORY_LIMIT=\"8 gigs\" has an unknown unit")
                && c.errors[0].contains("KiB"),
            "{:?}",
            c.errors
        );
    }

    #[test]
    fn hami_contract() {
        let c = cfg(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "3000m"),
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("CUDA_DEVICE_SM_LIMIT_2", "150"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/x.cache"),
            ("GPU_CORE_UTILIZATION_POLICY", "FORCE"),
            ("CUDA_OVERSUBSCRIBE", "True"),
        ]);
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert!(c.oversubscribe);
        assert_eq!((c.mem_limit[0], c.mem_limit[1], c.mem_limit[15]), (4 << 30, 3000 << 20, 4 << 30));
        assert_eq!((c.sm_limit[0], c.sm_limit[2]), (30, 0), ">= 100 means no limit");
        assert_eq!(c.region_path, "/usr/local/vgpu/x.cache");
        assert_eq!(c.core_policy, CorePolicy::Force);
        assert_eq!(c.log_level, 1);
        assert!(!c.fail_open && c.count_managed);
        let d = cfg(&[]);
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(d.mem_limit[0], 0);
        assert!(
            d.default_region && d.region_path.starts_with(&format!("{}/", default_region_dir(uid))),
            "{}",
            d.region_path
        );
        let four = cfg(&[("CUDA_DEVICE_MEMORY_LIMIT", "4g")]);
        let one = cfg(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
        assert_ne!(four.region_path, one.region_path, "another limit set, another region");
        assert_eq!(
            four.region_path,
            cfg(&[("CUDA_DEVICE_MEMORY_LIMIT", "4096m")]).region_path,
            "the same limits, the same one"
        );
        assert!(!d.oversubscribe && !cfg(&[("CUDA_OVERSUBSCRIBE", "false")]).oversubscribe);
        assert!(d.memory_true_up && cfg(&[("VGPU_MEMORY_TRUE_UP", "yes")]).memory_true_up);
        assert!(
            !cfg(&[("VGPU_MEMORY_TRUE_UP", " Off")]).memory_true_up
                && !cfg(&[("VGPU_MEMORY_TRUE_UP", "0")]).memory_true_up
        );
        assert_eq!(d.context_overhead, DEFAULT_CONTEXT_OVERHEAD);
    }

    #[test]
    fn bad_values_are_reported() {
        let c = cfg(&[
            ("CUDA_DEVICE_MEMORY_LIMIT", "lots"),
            ("CUDA_DEVICE_SM_LIMIT_0", "x"),
            ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
            ("LIBCUDA_LOG_LEVEL", "9"),
            ("VGPU_FAIL_OPEN", "1"),
        ]);
        assert_eq!(c.errors.len(), 4, "{:?}", c.errors);
        assert!(c.errors[0].contains("CUDA_DEVICE_MEMORY_LIMIT=\"lots\""));
        assert!(c.fail_open);
    }

    #[test]
    fn a_managed_container_cannot_loosen_the_agent_s_configuration() {
        let hostile = [
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/own.region"),
            ("VGPU_LIMITS_FILE", "/tmp/own.limits"),
            ("VGPU_FAIL_OPEN", "1"),
            ("GPU_CORE_UTILIZATION_POLICY", "disable"),
            ("VGPU_COUNT_MANAGED", "0"),
            ("VGPU_CONTEXT_OVERHEAD", "0"),
        ];
        let m: std::collections::HashMap<&str, &str> = hostile.into_iter().collect();
        let get = |k: &str| m.get(k).map(|v| v.to_string());
        // Not managed: the environment is the configuration (the HAMi contract).
        let c = Config::from_lookup_in(get, false);
        assert_eq!((c.region_path.as_str(), c.limits_path.as_deref()), ("/tmp/own.region", Some("/tmp/own.limits")));
        assert!(c.fail_open && !c.count_managed && c.core_policy == CorePolicy::Disable && c.context_overhead == 0);
        assert!(c.ignored.is_empty() && !c.managed);
        // Managed: the agent's files, and nothing that loosens them.
        let c = Config::from_lookup_in(get, true);
        assert_eq!((c.region_path.as_str(), c.limits_path.as_deref()), (INJECTED_REGION, Some(INJECTED_LIMITS)));
        assert!(!c.fail_open && c.count_managed && c.core_policy == CorePolicy::Default);
        assert_eq!(c.context_overhead, DEFAULT_CONTEXT_OVERHEAD);
        assert_eq!(c.ignored.len(), 6, "{:?}", c.ignored);
        assert!(c.ignored[0].starts_with("CUDA_DEVICE_MEMORY_SHARED_CACHE=\"/tmp/own.region\""), "{:?}", c.ignored);
        // What tightens still applies; the agent's own values are not reported as ignored.
        let tight = [
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", INJECTED_REGION),
            ("VGPU_LIMITS_FILE", INJECTED_LIMITS),
            ("GPU_CORE_UTILIZATION_POLICY", "force"),
            ("VGPU_CONTEXT_OVERHEAD", "1g"),
        ];
        let m: std::collections::HashMap<&str, &str> = tight.into_iter().collect();
        let c = Config::from_lookup_in(|k| m.get(k).map(|v| v.to_string()), true);
        assert!(c.ignored.is_empty(), "{:?}", c.ignored);
        assert_eq!((c.core_policy, c.context_overhead), (CorePolicy::Force, 1 << 30));
    }
}

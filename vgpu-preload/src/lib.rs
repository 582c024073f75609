//! `libvgpu.so`: the CUDA driver-API interposer. Loaded into every GPU process of a container
//! (LD_PRELOAD or /etc/ld.so.preload), it enforces the container's GPU memory quota exactly, across
//! all its processes, and makes the container see its slice as its GPU.
//!
//! Layout: `api` declares the intercepted entry points once (`abicheck` holds them to the real
//! headers); `hooks` generates the exported symbols from it (and, in `hooks/procaddr`, rewrites
//! `cuGetProcAddress` answers); `dl` overrides `dlsym`; `real` is the real driver's table and
//! `dlsym`, at the bottom; `memory` and `nvml` are the policies (`pools` and `graphmem` charge what stream-ordered pools hold and what
//! graphs allocate, `vmm` follows physical allocations, `ctxlimits` what context limits are
//! charged up to), and `sm` throttles launches (`capture` and `stale` keep its charges and
//! estimates right); `state` holds the process's slot in the container's region, `contexts` the
//! table of contexts seen, `locate` which device and context a call is on, and `drv` the driver
//! calls the policies make themselves; `visible` keeps a process of a slice to its slice's GPUs.
#![deny(clippy::too_many_lines)]
// Unit-test builds have no exported hooks, so most of the crate is unreachable there.
#![cfg_attr(test, allow(dead_code, unused_imports))]

/// A hook's call of the driver's own entry point `real` with the arguments the hook was given:
/// `forward!(real, a, b)`. Every such call rests on this one argument.
macro_rules! forward {
    ($real:expr $(, $arg:expr)* $(,)?) => {
        // SAFETY: a hook runs under its entry point's contract (the C declaration, which
        // `abicheck` holds the hook table to), and `real` is that entry point's own
        // implementation, typed by the same declaration (`real.rs`): the arguments the caller
        // gave the hook, handed on unchanged (an out-pointer perhaps as the reference the hook
        // made of it: the same address), are as valid for it, for the duration of the call.
        unsafe { $real($($arg),*) }
    };
}

mod abicheck;
mod api;
mod capture;
mod clock;
mod config;
mod contexts;
mod ctxlimits;
mod dl;
mod drv;
mod graphmem;
mod guard;
mod hooks;
mod locate;
mod log;
mod memory;
mod nvml;
mod pools;
mod priority;
mod ptrmap;
mod real;
mod sm;
mod smi;
mod stale;
mod state;
mod trueup;
mod visible;
mod vmm;

pub(crate) const MAX_DEVICES: usize = vgpu_region::MAX_DEVICES;

/// Entry points of the fuzz targets (`fuzz/`), also run over the stored corpora by the unit tests.
#[doc(hidden)]
pub mod fuzzing {
    /// `KEY=VALUE` lines as the process environment: the configuration must be read without a panic,
    /// every problem reported as a message; in a managed container, whatever the environment, the
    /// agent's files are used and nothing is loosened.
    pub fn env(data: &[u8]) {
        use crate::config::{Config, CorePolicy, DEFAULT_CONTEXT_OVERHEAD, INJECTED_LIMITS, INJECTED_REGION};
        let text = String::from_utf8_lossy(data);
        let vars: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once('=')).collect();
        let get = |k: &str| vars.iter().rev().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        let c = Config::from_lookup(get);
        for e in &c.errors {
            assert!(!e.is_empty());
        }
        let m = Config::from_lookup_in(get, true);
        assert_eq!((m.region_path.as_str(), m.limits_path.as_deref()), (INJECTED_REGION, Some(INJECTED_LIMITS)));
        assert!(!m.fail_open && m.count_managed && m.core_policy != CorePolicy::Disable);
        assert!(m.context_overhead >= DEFAULT_CONTEXT_OVERHEAD);
        for (_, v) in &vars {
            let _ = crate::config::parse_size(v);
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_fuzz_corpus_runs_cleanly() {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/env_config");
            let mut n = 0;
            for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                super::env(&std::fs::read(e.unwrap().path()).unwrap());
                n += 1;
            }
            assert!(n > 0);
        }
    }
}

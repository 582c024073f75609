//! `libvgpu.so`: the CUDA driver-API interposer. Loaded into every GPU process of a container
//! (LD_PRELOAD or /etc/ld.so.preload), it enforces the container's GPU memory quota exactly, across
//! all its processes, and makes the container see its slice as its GPU.
//!
//! Layout, bottom up (docs/design-the-interposer.md, "Layers"; `scripts/module-graph.py` checks
//! it): `api` declares the intercepted entry points once (`abicheck` holds them to the real
//! headers) and `real` is the real driver's table and `dlsym`; `drv` and `nvquery` are the driver
//! and NVML calls the interposer makes itself; `visible` keeps a process of a slice to its slice's
//! GPUs and `trueup` charges what the driver holds beyond the calls; `state` holds the process's
//! slot in the container's region, its device map and reservations; the policies stand on it
//! (`memory`, `nvml` and `smi` for memory and NVML's view, with `pools`, `graphmem`, `vmm` and
//! `ctxlimits` for what pools, graphs, physical allocations and context limits hold; `sm` throttles
//! launches, with `capture`, `stale` and `priority`; `locate` finds a call's device and context);
//! `hooks` generates the exported symbols (and, in `hooks/procaddr`, rewrites `cuGetProcAddress`
//! answers) and `dl` overrides `dlsym`. The root wires the policies into the state's moments
//! ([`connect`]).
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

/// A pointer a hook's caller passed, as a reference for the duration of the hook (None where it is
/// NULL): `out_ref!(p)` for one the call writes through, `in_ref!(p)` for one it reads.
macro_rules! out_ref {
    ($p:expr) => {
        // SAFETY: under the entry point's contract an out-pointer the caller passed is NULL or
        // valid for writes for the duration of the call, and nothing else refers to it meanwhile.
        unsafe { $p.as_mut() }
    };
}

/// See [`out_ref!`].
macro_rules! in_ref {
    ($p:expr) => {
        // SAFETY: under the entry point's contract a pointer the caller passed for the call to read
        // is NULL or valid for reads for the duration of the call.
        unsafe { $p.as_ref() }
    };
}

mod abicheck;
mod api;
mod capture;
mod charged;
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
mod mps;
mod nvml;
mod nvquery;
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

/// Run as the library loads (the ELF constructors' table): the policies' parts in the process
/// state's moments, which the state cannot name (`state::Above`).
#[used]
#[link_section = ".init_array"]
static CONNECT: extern "C" fn() = connect;

extern "C" fn connect() {
    state::connect(state::Above {
        made: priority::start,
        child: sm::after_fork,
        forked: || {
            graphmem::after_fork();
            pools::after_fork();
            vmm::after_fork();
        },
        reclaim: |st, dev| pools::settle_all(st, Some(dev)),
    });
}

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

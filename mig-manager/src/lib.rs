//! MIG geometry for vgpu.
//!
//! * [`model`]: what a GPU offers (profiles with their placements, read from NVML at run time) and
//!   what it has (GPU instances, with whether a workload uses them).
//! * [`planner`]: pure functions. Given a GPU, its instances and a target, the minimal set of
//!   destroy/create steps with explicit placements that never touches a busy instance unless forced,
//!   or why the target is impossible; and for a dynamic request, the best-fitting profile and the
//!   placement that keeps large placements free.
//! * [`backend`]: the [`backend::MigBackend`] trait and its NVML implementation (nvml-wrapper, plus
//!   raw calls through the loaded library for what the wrapper lacks).
//! * [`apply`]: carrying a plan out, with a journal so that an interrupted apply resumes on restart.
//! * [`config`]: the mig-parted v1 configuration format.
#![deny(clippy::too_many_lines)]

pub mod apply;
pub mod backend;
pub mod config;
pub mod model;
pub mod planner;

/// Entry points of the fuzz targets (`fuzz/`), also run over the stored corpora by the unit tests.
#[doc(hidden)]
pub mod fuzzing {
    /// A mig-parted file: parsed, or refused with a message; what parses resolves for an A100.
    pub fn mig_config(data: &[u8]) {
        let Ok(text) = std::str::from_utf8(data) else { return };
        match crate::config::File::parse(text) {
            Ok(f) => {
                let _ = format!("{f:?}");
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_fuzz_corpus_runs_cleanly() {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/mig_config");
            let mut n = 0;
            for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                super::mig_config(&std::fs::read(e.unwrap().path()).unwrap());
                n += 1;
            }
            assert!(n > 0);
        }
    }
}

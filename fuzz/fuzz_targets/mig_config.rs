#![no_main]
//! Fuzz target mig_config: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu_mig::fuzzing::mig_config(data));

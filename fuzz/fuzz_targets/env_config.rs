#![no_main]
//! Fuzz target env_config: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu::fuzzing::env(data));

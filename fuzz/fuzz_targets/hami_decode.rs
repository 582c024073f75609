#![no_main]
//! Fuzz target hami_decode: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu_agent::fuzzing::hami_decode(data));

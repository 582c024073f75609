#![no_main]
//! Fuzz target region: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu_region::fuzzing::region_bytes(data));

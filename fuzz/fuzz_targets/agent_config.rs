#![no_main]
//! Fuzz target agent_config: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu_agent::fuzzing::agent_config(data));

#![no_main]
//! Fuzz target scheduler_messages: see fuzz/README.md.
libfuzzer_sys::fuzz_target!(|data: &[u8]| vgpu_receiver::fuzzing::messages(data));

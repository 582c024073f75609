//! In-process tests of the receiver's bookkeeping (streams over real sockets are in
//! tests/sim/clients/tests/capacity.rs).
use super::*;

#[test]
fn tokens_compare_in_constant_time_and_exactly() {
    assert!(same(b"abc", b"abc"));
    assert!(!same(b"abc", b"abd"));
    assert!(!same(b"abc", b"abcd"));
    assert!(!same(b"", b"a"));
}

#[test]
fn malformed_gpu_lists_are_named() {
    let g = |u: &str| sp::GpuCapacity { uuid: u.into(), ..Default::default() };
    assert!(check_gpus(&[g("A"), g("B")]).is_ok());
    assert!(check_gpus(&[g("A"), g("A")]).unwrap_err().contains("twice"));
    assert!(check_gpus(&[g("")]).unwrap_err().contains("uuid"));
    let many: Vec<_> = (0..300).map(|i| g(&format!("G{i}"))).collect();
    assert!(check_gpus(&many).unwrap_err().contains("at most"));
}

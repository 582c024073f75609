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

#[test]
fn the_fuzz_corpus_runs_cleanly() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/scheduler_messages");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        fuzzing::messages(&std::fs::read(e.unwrap().path()).unwrap());
        n += 1;
    }
    assert!(n > 0);
}

/// Writes the seed inputs of the `scheduler_messages` fuzz target (run by hand after a protocol
/// change: `cargo test -p vgpu-receiver -- --ignored write_fuzz_seeds`).
#[test]
#[ignore]
fn write_fuzz_seeds() {
    use prost::Message;
    use sp::node_message::Body as B;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/scheduler_messages");
    std::fs::create_dir_all(&dir).unwrap();
    let hello = B::Hello(sp::Hello { protocol_version: 1, node: "n1".into(), agent_version: "0.1.0".into(), epoch: 7 });
    let gpu = |u: &str, i: u32| sp::GpuCapacity {
        uuid: u.into(),
        index: i,
        memory_total: 80 << 30,
        memory_allocatable: 40 << 30,
        sm_allocatable: 50,
        healthy: true,
        peers: vec![sp::Peer { uuid: "G-other".into(), nvlink: true, pcie: "System".into() }],
        mig: Some(sp::MigCapacity {
            enabled: true,
            instances: vec![sp::MigInstance {
                gpu_instance_id: 1,
                profile: "1g.10gb".into(),
                start: 0,
                size: 1,
                ..Default::default()
            }],
            room: vec![sp::MigRoom { profile: "1g.10gb".into(), starts: vec![1, 2], ..Default::default() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let snap = B::Snapshot(sp::NodeCapacity {
        node: "n1".into(),
        epoch: 7,
        sequence: 1,
        gpus: vec![gpu("G0", 0), gpu("G1", 1)],
        ..Default::default()
    });
    let delta = |seq, changed, removed: Vec<&str>| {
        B::Delta(sp::CapacityDelta {
            epoch: 7,
            sequence: seq,
            changed,
            removed: removed.into_iter().map(String::from).collect(),
            ..Default::default()
        })
    };
    let hb = |seq| B::Heartbeat(sp::Heartbeat { epoch: 7, sequence: seq, timestamp_ms: 1 });
    let result = B::Result(sp::RequestResult { id: "r1".into(), ok: true, ..Default::default() });
    let seeds: Vec<(&str, Vec<B>)> = vec![
        (
            "in_order",
            vec![
                hello.clone(),
                snap.clone(),
                delta(2, vec![gpu("G1", 1)], vec![]),
                hb(2),
                delta(3, vec![gpu("G2", 2)], vec!["G0"]),
            ],
        ),
        ("gap", vec![hello.clone(), snap.clone(), delta(5, vec![gpu("G1", 1)], vec![]), snap.clone()]),
        ("delta_first", vec![hello.clone(), delta(2, vec![], vec![])]),
        (
            "bad_snapshot",
            vec![
                hello.clone(),
                B::Snapshot(sp::NodeCapacity {
                    node: "n1".into(),
                    epoch: 7,
                    gpus: vec![gpu("G0", 0), gpu("G0", 1)],
                    ..Default::default()
                }),
            ],
        ),
        ("heartbeat_gap", vec![hello.clone(), snap.clone(), hb(4), result]),
        ("second_hello", vec![hello.clone(), snap, hello]),
    ];
    for (name, msgs) in seeds {
        let mut buf = Vec::new();
        for m in msgs {
            sp::NodeMessage { body: Some(m) }.encode_length_delimited(&mut buf).unwrap();
        }
        std::fs::write(dir.join(name), buf).unwrap();
    }
}

//! In-process tests of the receiver's bookkeeping (streams over real sockets are in
//! tests/sim/clients/tests/capacity.rs).
use super::*;

#[test]
fn tokens_compare_in_constant_time_and_exactly() {
    use auth::same;
    assert!(same(b"abc", b"abc"));
    assert!(!same(b"abc", b"abd"));
    assert!(!same(b"abc", b"abcd"));
    assert!(!same(b"", b"a"));
}

const T1: &str = "0123456789abcdef0001";
const T2: &str = "0123456789abcdef0002";
const T3: &str = "0123456789abcdef0003";

#[test]
fn token_files_give_each_token_a_role() {
    let t = Tokens::parse(&format!("# comment\n\n  {T1}  \nreader {T2}\nnode gpu-7 {T3}\nnodes {T3}x\n")).unwrap();
    assert_eq!(t.len(), 4);
    assert_eq!(t.role(&format!("{T3}x")), Some(&Role::Nodes));
    assert_eq!(t.role(T1), Some(&Role::Cluster));
    assert_eq!(t.role(T2), Some(&Role::Reader));
    assert_eq!(t.role(T3), Some(&Role::Node("gpu-7".into())));
    assert_eq!(t.role("0123456789abcdef0004"), None);
    assert_eq!(t.role(&T1[..10]), None);
    assert!(t.has_node("gpu-7") && !t.has_node("gpu-8"));
    for (text, want) in [
        ("short\n", "line 1: a token must have at least 16"),
        (&format!("{T1}\nnode {T2}\n") as &str, "line 2: expected"),
        (&format!("writer {T1}\n"), "line 1: expected"),
        (&format!("node a b {T1}\n"), "line 1: expected"),
        (&format!("{T1}\nreader {T1}\n"), "line 2: this token is already listed"),
        ("reader 0123456789abcdef\u{7f}01\n", "printable ASCII"),
    ] {
        let e = Tokens::parse(text).unwrap_err().to_string();
        assert!(e.contains(want), "{text:?}: {e}");
    }
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vgpu-receiver-auth-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Two looks at the token file.
fn settle(a: &Auth) {
    a.recheck_now();
    a.current();
    a.recheck_now();
}

#[test]
fn a_changed_token_file_is_reloaded_and_a_broken_one_is_not() {
    let d = temp("reload");
    let f = d.join("tokens");
    std::fs::write(&f, format!("{T1}\n")).unwrap();
    let a = Auth::from_file(&f).unwrap();
    let (t, g0) = a.current();
    assert_eq!(t.role(T1), Some(&Role::Cluster));
    // A new node token: in force at the next look, with a new generation.
    let tok = auth::add_token(&f, &Role::Node("n1".into())).unwrap();
    assert_eq!(tok.len(), 64);
    // Seen once: not yet read (it could be half-written); unchanged at the next look: read.
    a.recheck_now();
    assert_eq!(a.current().1, g0);
    a.recheck_now();
    let (t, g1) = a.current();
    assert!(g1 > g0);
    assert_eq!(t.role(&tok), Some(&Role::Node("n1".into())));
    assert_eq!(t.role(T1), Some(&Role::Cluster));
    // A second token for the same node is refused; the file is unchanged.
    let before = std::fs::read_to_string(&f).unwrap();
    assert!(auth::add_token(&f, &Role::Node("n1".into()))
        .unwrap_err()
        .to_string()
        .contains("already has a token for node n1"));
    assert!(auth::add_token(&f, &Role::Node("bad name".into())).unwrap_err().to_string().contains("not a node name"));
    assert_eq!(std::fs::read_to_string(&f).unwrap(), before);
    // A broken file (or one listing nothing) keeps the tokens before it.
    for broken in ["garbage here now\n".to_string(), "# empty\n".to_string()] {
        std::fs::write(&f, broken).unwrap();
        settle(&a);
        let (t, g) = a.current();
        assert_eq!(g, g1);
        assert_eq!(t.role(&tok), Some(&Role::Node("n1".into())));
    }
    // Revoking (deleting the line) takes effect.
    std::fs::write(&f, format!("{T2}\n")).unwrap();
    settle(&a);
    let (t, g2) = a.current();
    assert!(g2 > g1);
    assert_eq!(t.role(&tok), None);
    assert_eq!(t.role(T2), Some(&Role::Cluster));
    // Unreadable at start: an error, not an open receiver.
    assert!(matches!(Auth::from_file(&d.join("missing")).unwrap_err(), auth::TokenError::Read { .. }));
    std::fs::write(&f, "").unwrap();
    assert!(matches!(Auth::from_file(&f).unwrap_err(), auth::TokenError::Empty(_)));
    std::fs::remove_dir_all(d).unwrap();
}

#[test]
fn malformed_gpu_lists_are_named() {
    let g = |u: &str| sp::GpuCapacity { uuid: u.into(), ..Default::default() };
    assert!(check_gpus(&[g("A"), g("B")]).is_ok());
    assert!(matches!(check_gpus(&[g("A"), g("A")]).unwrap_err(), CapacityError::ListedTwice(u) if u == "A"));
    assert!(check_gpus(&[g("")]).unwrap_err().to_string().contains("uuid"));
    let many: Vec<_> = (0..300).map(|i| g(&format!("G{i}"))).collect();
    assert!(check_gpus(&many).unwrap_err().to_string().contains("at most"));
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

#[test]
fn a_client_certificate_names_a_node_by_its_subject_alternative_names_only() {
    use rustls_pki_types::pem::PemObject;
    let b = crate::certs::generate(&["receiver.example".into()]).unwrap();
    let der = |name: &str| {
        let (pem, _) = crate::certs::client(&b.ca_key, name).unwrap();
        rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    };
    let n1 = der("n1");
    assert!(crate::certs::names(&n1, "n1"));
    assert!(crate::certs::names(&n1, "N1"), "DNS names compare without case");
    assert!(
        !crate::certs::names(&n1, "n2") && !crate::certs::names(&n1, "n1.example") && !crate::certs::names(&n1, "")
    );
    assert!(crate::certs::names(&der("10.0.0.5"), "10.0.0.5") && !crate::certs::names(&der("10.0.0.5"), "10.0.0.6"));
    let pool = der("*.pool.example");
    assert!(crate::certs::names(&pool, "gpu-7.pool.example") && !crate::certs::names(&pool, "gpu-7.other.example"));
    // A certificate with the name only as its common name does not name the node.
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, "n1");
    let cn_only = p.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap();
    assert!(!crate::certs::names(&rustls_pki_types::CertificateDer::from(cn_only.der().to_vec()), "n1"));
    assert!(!crate::certs::names(&rustls_pki_types::CertificateDer::from(vec![0x30, 0x03, 1, 2, 3]), "n1"));
}

/// A state of about `bytes` encoded (at most that, within a few hundred bytes of it) that passes
/// every check: GPUs with full peer lists (256 GPUs of 256 peers exceed 4 MiB), the last one cut
/// to size and padded with its model.
fn state_of(bytes: usize) -> sp::NodeCapacity {
    let peer = |i: usize| sp::Peer { uuid: format!("GPU-{i:0>92}"), nvlink: true, pcie: "Node".into() };
    let gpu = |i: usize, peers: usize| sp::GpuCapacity {
        uuid: format!("GPU-{i:0>92}"),
        memory_total: 80 << 30,
        peers: (0..peers).map(peer).collect(),
        ..Default::default()
    };
    let mut c = sp::NodeCapacity { node: "n".repeat(MAX_NAME), ..Default::default() };
    let len = |c: &sp::NodeCapacity| prost::Message::encoded_len(c);
    while len(&c) <= bytes {
        c.gpus.push(gpu(c.gpus.len(), MAX_GPUS));
    }
    while len(&c) > bytes && !c.gpus.last().unwrap().peers.is_empty() {
        c.gpus.last_mut().unwrap().peers.pop();
    }
    for n in (0..=MAX_TEXT).rev() {
        c.gpus.last_mut().unwrap().model = "m".repeat(n);
        if len(&c) <= bytes {
            break;
        }
    }
    c
}

/// The largest state a node may have still reaches every client: the page of the cluster view that
/// carries it, with every field of its envelope at its largest, is within the 4 MiB a gRPC client
/// reads by default (a legal 4,194,264-byte state made `vgpuctl cluster status` fail for the whole
/// cluster with "found 4194371 bytes, the limit is 4194304"). Issue 61, item 8.
#[test]
fn the_page_of_the_largest_state_a_node_may_have_is_readable() {
    let c = state_of(MAX_NODE_BYTES);
    let n = prost::Message::encoded_len(&c);
    assert!(n <= MAX_NODE_BYTES && n > MAX_NODE_BYTES - 400, "{n}");
    assert!(check_capacity(&c).is_ok() && check_size(&c).is_ok());
    let view = sp::NodeView {
        capacity: Some(c),
        connected: true,
        last_seen_ms_ago: u64::MAX,
        stale: true,
        agent_version: "v".repeat(64),
        peer: "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535".into(),
        synced: true,
    };
    let page = sp::ClusterStatus { nodes: vec![view], next_after: "z".repeat(MAX_NAME) };
    assert!(prost::Message::encoded_len(&page) <= MAX_MESSAGE, "{}", prost::Message::encoded_len(&page));
    // More than that is refused, with the bound.
    let e = check_size(&state_of(MAX_NODE_BYTES + 1000)).unwrap_err();
    assert!(e.to_string().contains(&format!("(at most {MAX_NODE_BYTES})")), "{e}");
}

/// Numbers no GPU has are refused with the field and the bound (2^64-1 bytes, 1e9 SMs and 4e9
/// slices were accepted and summed into the cluster view). Issue 61, item 12.
#[test]
fn numbers_no_gpu_has_are_refused() {
    let ok = sp::GpuCapacity {
        uuid: "G".into(),
        memory_total: 192 << 30,
        sm_count: 148,
        slices: 4096,
        ..Default::default()
    };
    assert!(check_gpu(&ok).is_ok());
    for (g, want) in [
        (sp::GpuCapacity { memory_total: u64::MAX, ..ok.clone() }, "memory_total 18446744073709551615 is above"),
        (sp::GpuCapacity { sm_count: 1_000_000_000, ..ok.clone() }, "sm_count 1000000000 is above 10000"),
        (sp::GpuCapacity { slices: 4_000_000_000, ..ok.clone() }, "slices 4000000000 is above 65536"),
    ] {
        let e = check_gpu(&g).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

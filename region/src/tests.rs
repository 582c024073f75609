use super::*;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vgpu-region-unit-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&d);
    d
}

fn init(limit: u64) -> impl FnOnce() -> Init {
    move || Init { devices: vec![("GPU-aaaa".into(), limit, 0), ("GPU-bbbb".into(), 0, 30)], standalone: true }
}

#[test]
fn create_then_reopen_sees_the_same_region() {
    let p = tmp("create");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    assert_eq!(r.ndevices(), 2);
    assert_eq!(r.device_uuid(1), "GPU-bbbb");
    assert_eq!(r.mem_limit(0), 1 << 30);
    assert_eq!(r.sm_limit(1), 30);
    let again = Region::open_or_create(&p, || panic!("must not re-initialise")).unwrap();
    assert_eq!(again.mem_limit(0), 1 << 30);
    let ro = Region::open(&p, false).unwrap();
    assert!(ro.set_mem_limit(0, 1).is_err());
    assert!(ro.claim(1, 1).is_err());
    r.set_mem_limit(0, 5).unwrap();
    assert_eq!(ro.mem_limit(0), 5, "limit changes are visible at once");
    assert_eq!(r.add_device("GPU-bbbb", 0, 0), Some(1));
    assert_eq!(r.add_device("GPU-cccc", 7, 0), Some(2));
    assert_eq!(ro.ndevices(), 3);
    std::fs::remove_file(p).ok();
}

/// A creator killed after reserving the file and before its header's magic (`kill -9` during a
/// process's start) leaves a file of zeros, whole or short, or a header without its magic: the next
/// creator makes the region, where before every later process was refused ("bad magic") for as
/// long as the file stayed.
#[test]
fn a_region_whose_creator_died_before_its_header_is_made_again() {
    let mut partial = vec![0u8; TOTAL_SIZE];
    partial[std::mem::offset_of!(Header, ndevices)] = 2; // written before the magic
    for (what, bytes) in [
        ("zeros", vec![0u8; TOTAL_SIZE]),
        ("4096 zero bytes", vec![0u8; 4096]),
        ("5 zero bytes", vec![0u8; 5]),
        ("a header without its magic", partial),
    ] {
        let p = tmp(&format!("unfinished-{}", bytes.len()));
        std::fs::write(&p, &bytes).unwrap();
        let r = Region::open_or_create(&p, init(1 << 30)).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!((r.ndevices(), r.mem_limit(0), r.sm_limit(1)), (2, 1 << 30, 30), "{what}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), TOTAL_SIZE as u64);
        // Made once: the next opener finds it whole.
        Region::open_or_create(&p, || panic!("must not re-initialise")).unwrap();
        std::fs::remove_file(p).ok();
    }
    // Any other magic is not taken for an unfinished region: refused, not overwritten.
    let p = tmp("unfinished-not");
    let mut b = vec![0u8; TOTAL_SIZE];
    b[3] = 1;
    std::fs::write(&p, &b).unwrap();
    let e = Region::open_or_create(&p, init(0)).err().unwrap().to_string();
    assert!(e.contains("bad magic"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), b, "left as it was");
    std::fs::remove_file(p).ok();
}

#[test]
fn damaged_regions_are_refused_with_a_reason() {
    let p = tmp("damaged");
    Region::open_or_create(&p, init(0)).unwrap();
    let bytes = std::fs::read(&p).unwrap();

    std::fs::write(&p, &bytes[..1000]).unwrap();
    let e = Region::open(&p, true).err().unwrap().to_string();
    assert!(e.contains("truncated") && e.contains("1000 bytes"), "{e}");

    let mut b = bytes.clone();
    b[0] ^= 0xff;
    std::fs::write(&p, &b).unwrap();
    assert!(Region::open(&p, true).err().unwrap().to_string().contains("bad magic"));

    let mut b = bytes.clone();
    b[8..12].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    let e = Region::open_or_create(&p, init(0)).err().unwrap().to_string();
    assert!(e.contains("ABI version 7"), "{e}");

    let mut b = bytes.clone();
    b[24] ^= 1; // layout hash
    std::fs::write(&p, &b).unwrap();
    assert!(Region::open(&p, true).err().unwrap().to_string().contains("layout hash"));

    // Another build's region of another size is told by its header, not taken for a truncated one.
    let mut b = bytes[..4096].to_vec();
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(Region::open(&p, true).err().unwrap().to_string().contains("ABI version 2"));
    let mut b = bytes.clone();
    b[24] ^= 1;
    b.extend_from_slice(&[0; 4096]);
    std::fs::write(&p, &b).unwrap();
    assert!(Region::open(&p, false).err().unwrap().to_string().contains("layout hash"));

    std::fs::write(&p, vec![0xa5u8; TOTAL_SIZE]).unwrap();
    assert!(Region::open(&p, true).err().unwrap().to_string().contains("bad magic"));
    std::fs::remove_file(p).ok();
}

#[test]
fn reservations_respect_the_limit_and_roll_back() {
    let p = tmp("reserve");
    let r = Region::open_or_create(&p, init(100)).unwrap();
    let a = r.claim(1, 1).unwrap();
    let b = r.claim(2, 2).unwrap();
    assert_ne!(a.index, b.index);
    assert_eq!(r.reserve(a.index, 0, 60, 100), Reserve::Ok);
    assert_eq!(r.reserve(b.index, 0, 41, 100), Reserve::OverLimit);
    assert_eq!(r.reserve(b.index, 0, 40, 100), Reserve::Ok);
    assert_eq!(r.used(0), 100);
    r.release(a.index, 0, 60);
    assert_eq!(r.used(0), 40);
    assert_eq!(r.reserve(a.index, 1, 1 << 40, 0), Reserve::Ok, "no limit on device 1");
    assert_eq!(r.layout().devices[0].oom_rejections.load(Relaxed), 1);
    assert_eq!(r.layout().devices[0].peak_used.load(Relaxed), 100);
    std::fs::remove_file(p).ok();
}

#[test]
fn dead_slots_are_reclaimed_exactly() {
    let p = tmp("reap");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let a = r.claim(1, 1).unwrap();
    let b = r.claim(2, 2).unwrap();
    r.reserve(a.index, 0, 1000, 0);
    r.reserve(b.index, 0, 24, 0);
    assert_eq!(r.reap(), 0, "both alive");
    let ia = a.index;
    drop(a); // the "process" dies: its lock goes
    assert_eq!(r.reap(), 1000);
    assert_eq!(r.used(0), 24);
    let c = r.claim(3, 3).unwrap();
    assert_eq!(c.index, ia, "the freed slot is reused");
    assert_eq!(r.slots().len(), 2);
    std::fs::remove_file(p).ok();
}

#[test]
fn slots_marked_exiting_are_reclaimed_once_their_process_is_gone() {
    let p = tmp("exiting");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let a = r.claim(1, 1).unwrap();
    let b = r.claim(2, 2).unwrap();
    let c = r.claim(3, 3).unwrap();
    r.reserve(a.index, 0, 1000, 0);
    r.reserve(b.index, 0, 24, 0);
    r.reserve(c.index, 0, 5, 0);
    assert_eq!(r.exiting(), 0);
    // A is exiting: nothing is released while it lives.
    r.mark_exiting(a.index);
    r.mark_exiting(a.index);
    assert_eq!(r.exiting(), 1, "one mark per slot");
    assert_eq!(r.reap_exited(), 0, "still alive");
    assert_eq!((r.used(0), r.exiting()), (1029, 1));
    // C dies without exiting (SIGKILL): reap_exited does not look at it; A is gone: reclaimed.
    drop(c);
    drop(a);
    assert_eq!(r.reap_exited(), 1000);
    assert_eq!((r.used(0), r.exiting()), (29, 0));
    assert_eq!(r.reap(), 5, "the killed one is found by a full reap");
    // A slot marked exiting and claimed again before any reap starts unmarked.
    r.mark_exiting(b.index);
    let ib = b.index;
    drop(b);
    let d = r.claim(4, 4).unwrap();
    let e = r.claim(5, 5).unwrap();
    assert!(d.index == ib || e.index == ib);
    assert_eq!((r.exiting(), r.used(0)), (0, 0), "the claim released what B held and its mark");
    // A full reap of an exiting slot clears the hint too.
    r.mark_exiting(d.index);
    drop(d);
    assert_eq!((r.reap(), r.exiting()), (0, 0));
    drop(e);
    std::fs::remove_file(p).ok();
}

#[test]
fn reap_where_skips_only_the_slots_it_is_told_are_alive() {
    let p = tmp("reap-where");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let a = r.claim(10, 110).unwrap();
    let b = r.claim(20, 0).unwrap();
    r.reserve(a.index, 0, 7, 0);
    r.reserve(b.index, 0, 5, 0);
    drop(a);
    drop(b);
    // Told (wrongly) that host PID 110 is alive: its slot is skipped; the other is reclaimed.
    assert_eq!(r.reap_where(|_, host| host != 110), 5);
    assert_eq!(r.used(0), 7);
    // The next unrestricted reap finds it.
    assert_eq!(r.reap_where(|pid, _| pid == 10), 7);
    assert_eq!(r.used(0), 0);
    std::fs::remove_file(p).ok();
}

#[test]
fn racing_reservations_never_exceed_the_limit() {
    let p = tmp("race");
    let limit = 64 << 20;
    let r = Arc::new(Region::open_or_create(&p, init(limit)).unwrap());
    let admitted = Arc::new(AtomicU64::new(0));
    let hs: Vec<_> = (0..8)
        .map(|i| {
            let (r, admitted) = (r.clone(), admitted.clone());
            std::thread::spawn(move || {
                let c = r.claim(100 + i, 0).unwrap();
                let mut mine = 0u64;
                for _ in 0..10_000 {
                    if r.reserve(c.index, 0, 1 << 20, limit) == Reserve::Ok {
                        mine += 1 << 20;
                        assert!(r.used(0) <= limit);
                        if mine > 4 << 20 {
                            r.release(c.index, 0, 1 << 20);
                            mine -= 1 << 20;
                        }
                    }
                }
                admitted.fetch_add(mine, Relaxed);
                c
            })
        })
        .collect();
    let claims: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(r.used(0) <= limit);
    assert_eq!(r.used(0), admitted.load(Relaxed), "the region holds exactly what was admitted");
    drop(claims);
    std::fs::remove_file(p).ok();
}

#[test]
fn devices_bind_by_uuid_at_their_container_index() {
    let p = tmp("bind");
    let r = Region::open_or_create(&p, Init::default).unwrap();
    assert_eq!(r.bind_device(1, "GPU-b", 10, 0), Some(1), "container index 1 first");
    assert_eq!(r.ndevices(), 2);
    assert_eq!(r.bind_device(0, "GPU-a", 20, 0), Some(0));
    assert_eq!(r.bind_device(0, "GPU-b", 99, 0), Some(1), "known UUID keeps its index and limit");
    assert_eq!(r.mem_limit(1), 10);
    assert_eq!(r.bind_device(0, "GPU-c", 30, 0), Some(2), "taken index: first free one");
    assert_eq!(r.find_device("GPU-c"), Some(2));
    std::fs::remove_file(p).ok();
}

#[test]
fn sm_budget_refills_caps_and_carries_debt() {
    let p = tmp("sm");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let t0 = 1_000_000_000;
    // First use: a full burst (10 % of 20 ms = 2 ms of GPU time).
    assert_eq!(r.sm_admit(0, 10, t0, 5_000_000), Ok(()));
    // 3 ms of debt: at 10 % that takes 30 ms of wall time to pay back.
    let wait = r.sm_admit(0, 10, t0 + 50_000, 1).unwrap_err();
    assert!((29_000_000..=30_100_000).contains(&wait), "{wait}");
    assert!(r.sm_admit(0, 10, t0 + 20_000_000, 1).is_err(), "still 1 ms in debt");
    assert_eq!(r.sm_admit(0, 10, t0 + 31_000_000, 1_000_000), Ok(()));
    // A long idle period banks no more than the burst.
    assert_eq!(r.sm_admit(0, 10, t0 + 10_000_000_000, 1_900_000), Ok(()));
    assert_eq!(r.sm_admit(0, 10, t0 + 10_000_000_000, 200_000), Ok(()), "2 ms banked, 1.9 ms spent: 0.1 ms left");
    assert!(r.sm_admit(0, 10, t0 + 10_000_000_000, 1).is_err(), "0.1 ms of debt");
    // Corrections move the budget.
    r.sm_correct(0, 5_000_000, 0);
    assert_eq!(r.sm_admit(0, 10, t0 + 10_000_000_000, 1), Ok(()));
    std::fs::remove_file(p).ok();
}

#[test]
fn what_launches_were_charged_is_told_by_refills_and_the_budget() {
    let p = tmp("smacct");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let t0 = 1_000_000_000;
    let mut charged = 0i64;
    let mut admit = |at: u64, cost: u64| {
        if r.sm_admit(0, 10, at, cost).is_ok() {
            charged += cost as i64;
        }
    };
    // Charges through refills (first burst, earned time), a refused launch, and debt.
    admit(t0, 1_500_000);
    admit(t0 + 1_000, 1_000_000);
    admit(t0 + 2_000, 1);
    admit(t0 + 40_000_000, 700_000);
    // An idle second: the refill is capped, and the cut is not counted as earned.
    admit(t0 + 1_040_000_000, 2_000_000);
    admit(t0 + 1_040_000_000, 50_000);
    assert_eq!(r.sm_accounted_ns(0), charged);
    // A correction (charged more than the launch took) is taken off.
    r.sm_correct(0, 300_000, 0);
    assert_eq!(r.sm_accounted_ns(0), charged - 300_000);
    std::fs::remove_file(p).ok();
}

#[test]
fn sm_rate_correction_scales_the_refill() {
    let p = tmp("smrate");
    let r = Region::open_or_create(&p, init(0)).unwrap();
    let t0 = 1_000_000_000;
    r.sm_admit(0, 50, t0, 10_000_000).unwrap(); // burst 10 ms, 10 ms spent
    r.layout().devices[0].sm_rate_ppm.store(500_000, Relaxed); // the agent measured twice the share
                                                               // 10 ms of wall time now earns 2.5 ms instead of 5 ms.
    assert!(r.sm_admit(0, 50, t0 + 10_000_000, 1).is_ok());
    let t = r.layout().devices[0].sm_tokens.load(Relaxed);
    assert!((2_400_000..=2_600_000).contains(&t), "{t}");
    std::fs::remove_file(p).ok();
}

#[test]
fn the_published_utilization_is_read_until_it_goes_stale() {
    let p = tmp("utilization");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    let other = Region::open(&p, true).unwrap();
    assert_eq!(other.utilization(0), None, "nothing published");
    r.set_utilization(0, Some(37), 60_000);
    r.set_utilization(1, Some(0), 60_000);
    assert_eq!((other.utilization(0), other.utilization(1)), (Some(37), Some(0)), "0 % is a figure");
    r.set_utilization(0, Some(250), 60_000);
    assert_eq!(other.utilization(0), Some(100), "at most the whole GPU");
    r.set_utilization(0, None, 60_000);
    assert_eq!(other.utilization(0), None, "withdrawn");
    r.set_utilization(1, Some(50), 0);
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(other.utilization(1), None, "stale");
    std::fs::remove_file(p).ok();
}

#[test]
fn bytes_in_flight_are_counted_per_device_and_never_read_below_zero() {
    let p = tmp("in-flight");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    let other = Region::open(&p, true).unwrap();
    r.begin_in_flight(0, 100);
    other.begin_in_flight(0, 50);
    other.begin_in_flight(1, 7);
    assert_eq!((r.in_flight(0), r.in_flight(1)), (150, 7), "all processes together, per device");
    r.end_in_flight(0, 100);
    assert_eq!(other.in_flight(0), 50);
    // What a process killed during a call left is taken back once no slot is claimed, and only then.
    let c = r.claim(std::process::id(), 0).unwrap();
    r.clear_in_flight();
    assert_eq!((r.in_flight(0), r.in_flight(1)), (50, 7), "a process is alive: nothing taken back");
    drop(c); // the process dies
    r.reap();
    r.clear_in_flight();
    assert_eq!((r.in_flight(0), r.in_flight(1)), (0, 0));
    r.begin_in_flight(0, 80);
    r.clear_in_flight();
    assert_eq!(r.in_flight(0), 0);
    // A count below zero (an end without its beginning) reads as nothing.
    r.end_in_flight(1, 5);
    assert_eq!(r.in_flight(1), 0);
    std::fs::remove_file(p).ok();
}

#[test]
fn dropping_a_region_unmaps_it() {
    let p = std::env::temp_dir().join(format!("vgpu-region-unmap-{}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    let maps = || {
        std::fs::read_to_string("/proc/self/maps").unwrap().lines().filter(|l| l.contains("vgpu-region-unmap")).count()
    };
    let r = Region::open_or_create(&p, || Init { devices: vec![], standalone: true }).unwrap();
    assert_eq!(maps(), 1);
    for _ in 0..200 {
        let again = Region::open(&p, true).unwrap();
        assert_eq!(again.used(0), 0);
    }
    assert_eq!(maps(), 1, "each open's mapping goes with it");
    // Failed opens (a damaged header) leave no mapping either.
    let bad = p.with_extension("bad");
    std::fs::write(&bad, vec![0u8; TOTAL_SIZE]).unwrap();
    for _ in 0..50 {
        assert!(Region::open(&bad, true).is_err());
    }
    assert_eq!(maps(), 1);
    std::fs::remove_file(&bad).unwrap();
    drop(r);
    assert_eq!(maps(), 0);
    std::fs::remove_file(p).unwrap();
}

#[test]
fn the_oversubscribe_flag_is_the_writers_and_leaves_the_standalone_bit_alone() {
    let p = tmp("oversub");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    let standalone = r.standalone();
    assert!(!r.oversubscribe());
    r.set_oversubscribe(true).unwrap();
    assert!(r.oversubscribe());
    let ro = Region::open(&p, false).unwrap();
    assert!(ro.oversubscribe(), "seen by another mapping");
    assert!(ro.set_oversubscribe(false).is_err(), "a read-only mapping cannot change it");
    r.set_oversubscribe(false).unwrap();
    assert!(!ro.oversubscribe());
    assert_eq!(r.standalone(), standalone);
    std::fs::remove_file(p).ok();
}

#[test]
fn the_priority_flag_is_the_writers_and_independent_of_the_others() {
    let p = tmp("priority");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    assert!(!r.priority_high());
    r.set_oversubscribe(true).unwrap();
    r.set_priority_high(true).unwrap();
    let ro = Region::open(&p, false).unwrap();
    assert!(ro.priority_high() && ro.oversubscribe(), "seen by another mapping, the other flag kept");
    assert!(ro.set_priority_high(false).is_err(), "a read-only mapping cannot change it");
    r.set_priority_high(false).unwrap();
    assert!(!ro.priority_high() && ro.oversubscribe());
    std::fs::remove_file(p).ok();
}

#[test]
fn a_process_records_its_host_pid_in_its_own_slot_only() {
    let p = tmp("hostpid");
    let r = Region::open_or_create(&p, init(1 << 30)).unwrap();
    assert!(r.standalone());
    let agent = tmp("hostpid-agent");
    let a = Region::open_or_create(&agent, || Init { devices: vec![("GPU-aaaa".into(), 0, 0)], standalone: false })
        .unwrap();
    assert!(!a.standalone(), "a region the agent made is not standalone");
    let c = r.claim(42, 0).unwrap();
    assert_eq!(r.reserve(c.index, 0, 4096, 1 << 30), Reserve::Ok);
    assert_eq!((r.slot_used(c.index, 0), r.slot_used(c.index, 1), r.slot_used(MAX_SLOTS, 0)), (4096, 0, 0));
    assert!(!r.set_host_pid(c.index, 43, 9000), "not the slot's process");
    assert!(!r.set_host_pid(c.index + 1, 42, 9000), "a free slot");
    assert_eq!(r.slots()[0].2, 0);
    assert!(r.set_host_pid(c.index, 42, 9000));
    assert_eq!(r.slots()[0].2, 9000);
    let ro = Region::open(&p, false).unwrap();
    assert!(!ro.set_host_pid(c.index, 42, 1), "a read-only mapping cannot");
    assert_eq!(ro.slots()[0].2, 9000);
    std::fs::remove_file(p).ok();
    std::fs::remove_file(agent).ok();
}

/// A container truncating its region under the agent's mapping: without the guard the next read of
/// the mapping kills the reader with SIGBUS (the agent, at every restart); with it the reader sees
/// zeros, is told the mapping faulted, and a new open is refused as truncated.
#[test]
fn a_region_that_shrinks_under_a_guarded_mapping_reads_as_zeros_instead_of_killing_the_reader() {
    shrink::enable().unwrap();
    let p = tmp("shrink");
    let made = Region::open_or_create(&p, init(1 << 30)).unwrap();
    let r = Region::open_strict(&p, true).unwrap();
    assert_eq!((r.mem_limit(0), r.faulted()), (1 << 30, false));
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(0).unwrap();
    let before = shrink::faults();
    // Past the end of the file now: a SIGBUS the guard turns into zeros.
    assert_eq!(r.mem_limit(0), 0);
    assert_eq!(r.slots().len(), 0);
    assert!(r.faulted() && shrink::faults() > before);
    assert!(made.faulted() || made.mem_limit(0) == 0);
    assert!(matches!(Region::open_strict(&p, true), Err(RegionError::Truncated { .. })));
    drop((r, made));
    std::fs::remove_file(p).ok();
}

#[test]
fn a_strict_open_refuses_links_and_special_files() {
    let p = tmp("strict-target");
    Region::open_or_create(&p, init(1 << 30)).unwrap();
    let link = tmp("strict-link");
    std::os::unix::fs::symlink(&p, &link).unwrap();
    assert!(Region::open(&link, false).is_ok(), "a plain open follows the link");
    assert!(matches!(Region::open_strict(&link, true), Err(RegionError::NotAFile { .. })));
    let dir = tmp("strict-dir");
    std::fs::create_dir_all(&dir).unwrap();
    assert!(matches!(Region::open_strict(&dir, false), Err(RegionError::NotAFile { .. })));
    for x in [&p, &link] {
        std::fs::remove_file(x).ok();
    }
    std::fs::remove_dir(dir).ok();
}

use super::*;
use crate::model::{Gpu, Instance, Profile};

/// A100-SXM4-40GB as NVML describes it (facts: NVIDIA's MIG user guide).
pub(crate) fn a100() -> Gpu {
    let p = |id, name: &str, compute, mem, mib, max, starts: &[u32], media: bool| Profile {
        id,
        name: name.into(),
        compute,
        memory_slices: mem,
        memory_mib: mib,
        sms: compute * 14,
        decoders: u32::from(mem > 1 || media),
        encoders: 0,
        jpegs: u32::from(media || compute == 7),
        ofas: u32::from(media || compute == 7),
        max,
        starts: starts.to_vec(),
    };
    Gpu {
        index: 0,
        uuid: "GPU-a100".into(),
        name: "NVIDIA A100-SXM4-40GB".into(),
        memory_slices: 8,
        profiles: vec![
            p(19, "1g.5gb", 1, 1, 4864, 7, &[0, 1, 2, 3, 4, 5, 6], false),
            p(20, "1g.5gb+me", 1, 1, 4864, 1, &[0, 1, 2, 3, 4, 5, 6], true),
            p(15, "1g.10gb", 1, 2, 9984, 4, &[0, 2, 4, 6], false),
            p(14, "2g.10gb", 2, 2, 9984, 3, &[0, 2, 4], false),
            p(9, "3g.20gb", 3, 4, 20096, 2, &[0, 4], false),
            p(5, "4g.20gb", 4, 4, 20096, 1, &[0], false),
            p(0, "7g.40gb", 7, 8, 40448, 1, &[0], false),
        ],
        mig_enabled: true,
        mode_pending: false,
        instances: vec![],
    }
}

fn with(gpu: &Gpu, layout: &[Placed]) -> Gpu {
    let mut g = gpu.clone();
    g.instances = layout
        .iter()
        .enumerate()
        .map(|(i, p)| Instance {
            gi: i as u32 + 1,
            profile: p.profile,
            start: p.start,
            size: g.profile(p.profile).unwrap().memory_slices,
            compute_instances: vec![(0, 0)],
            busy: false,
            uuid: None,
        })
        .collect();
    g
}

/// Applies a plan to a pure model, checking every step is valid where NVML would check it.
fn simulate(gpu: &Gpu, plan: &Plan) -> Gpu {
    let mut g = gpu.clone();
    let mut next = 100;
    for s in &plan.steps {
        match s {
            Step::Destroy { gi, .. } => {
                let before = g.instances.len();
                g.instances.retain(|i| i.gi != *gi);
                assert_eq!(g.instances.len() + 1, before, "destroying a missing instance {gi}");
            }
            Step::Create { profile, start } => {
                let p = g.profile(*profile).unwrap().clone();
                assert!(p.starts.contains(start), "{} at {start}", p.name);
                assert_eq!(g.used_mask() & mask(*start, p.memory_slices), 0, "{} at {start} overlaps", p.name);
                assert!(
                    (g.instances.iter().filter(|i| i.profile == p.id).count() as u32) < p.max,
                    "too many {}",
                    p.name
                );
                next += 1;
                g.instances.push(Instance {
                    gi: next,
                    profile: p.id,
                    start: *start,
                    size: p.memory_slices,
                    compute_instances: vec![],
                    busy: false,
                    uuid: None,
                });
            }
        }
    }
    g
}

fn profiles_of(layout: &[Placed]) -> Vec<u32> {
    let mut v: Vec<u32> = layout.iter().map(|p| p.profile).collect();
    v.sort_unstable();
    v
}

#[test]
fn the_19_maximal_a100_layouts_are_reachable_from_each_other_minimally() {
    let gpu = a100();
    let layouts = maximal_layouts(&gpu, &[19, 14, 9, 5, 0]);
    assert_eq!(layouts.len(), 19, "{layouts:?}");
    for from in &layouts {
        let g = with(&gpu, from);
        for to in &layouts {
            let want: Vec<Want> = to.iter().map(|p| Want { profile: p.profile, start: Some(p.start) }).collect();
            let exact = plan(&g, &want, false).unwrap_or_else(|e| panic!("{from:?} -> {to:?}: {e}"));
            let after = simulate(&g, &exact);
            let mut got: Vec<Placed> =
                after.instances.iter().map(|i| Placed { profile: i.profile, start: i.start }).collect();
            got.sort();
            let mut exp = to.clone();
            exp.sort();
            assert_eq!(got, exp, "{from:?} -> {to:?}");
            // Minimal: every instance present in both layouts is kept.
            let common = from.iter().filter(|p| to.contains(p)).count();
            assert_eq!(exact.keep.len(), common, "{from:?} -> {to:?}: {exact:?}");
            assert_eq!(exact.steps.len(), from.len() + to.len() - 2 * common);
            // Without fixed placements the target's profiles are reached too, keeping at least as much.
            let loose: Vec<Want> = to.iter().map(|p| Want { profile: p.profile, start: None }).collect();
            let plan2 = plan(&g, &loose, false).unwrap();
            assert_eq!(
                profiles_of(
                    &simulate(&g, &plan2)
                        .instances
                        .iter()
                        .map(|i| Placed { profile: i.profile, start: i.start })
                        .collect::<Vec<_>>()
                ),
                profiles_of(to)
            );
            assert!(plan2.steps.len() <= exact.steps.len());
            // With the instances both layouts share busy, the plan still succeeds and keeps them.
            let mut busy = g.clone();
            for i in &mut busy.instances {
                i.busy = to.contains(&Placed { profile: i.profile, start: i.start });
            }
            let p3 = plan(&busy, &want, false).unwrap_or_else(|e| panic!("busy {from:?} -> {to:?}: {e}"));
            assert!(busy.instances.iter().filter(|i| i.busy).all(|i| p3.keep.contains(&i.gi)));
        }
    }
}

#[test]
fn busy_instances_are_never_touched_unless_forced() {
    let gpu = a100();
    let from = [Placed { profile: 9, start: 0 }, Placed { profile: 14, start: 4 }, Placed { profile: 19, start: 6 }];
    let mut g = with(&gpu, &from);
    g.instances[0].busy = true; // 3g.20gb@0 runs a workload
                                // Target: 3g + 3 x 1g. The busy 3g stays; the rest is rebuilt around it (the 1g@6 kept too).
    let want = [vec![Want { profile: 9, start: None }], vec![Want { profile: 19, start: None }; 3]].concat();
    let p = plan(&g, &want, false).unwrap();
    assert_eq!(p.keep, vec![1, 3], "{p:?}");
    assert!(!p.steps.iter().any(|s| matches!(s, Step::Destroy { gi: 1, .. })));
    let after = simulate(&g, &p);
    assert_eq!(after.instances.len(), 4);
    // 3g + 4 x 1g fits an empty GPU (3g@4), not around the busy 3g@0: refused, naming it.
    let want4 = [vec![Want { profile: 9, start: None }], vec![Want { profile: 19, start: None }; 4]].concat();
    assert!(matches!(plan(&g, &want4, false).unwrap_err(), Impossible::Busy { gi: 1, .. }));
    // A target without it is refused, naming it.
    let e = plan(&g, &[Want { profile: 0, start: None }], false).unwrap_err();
    assert_eq!(e, Impossible::Busy { gi: 1, profile: "3g.20gb".into(), start: 0 });
    assert!(e.to_string().contains("GPU instance 1 (3g.20gb at slice 0) is in use"), "{e}");
    // 4g.20gb only fits at slice 0, where the busy 3g is: refused too, though it would fit an empty GPU.
    let e = plan(&g, &[Want { profile: 9, start: None }, Want { profile: 5, start: None }], false).unwrap_err();
    assert!(matches!(e, Impossible::Busy { gi: 1, .. }), "{e}");
    // Forced: done.
    let p = plan(&g, &[Want { profile: 0, start: None }], true).unwrap();
    assert_eq!(simulate(&g, &p).instances.len(), 1);
}

#[test]
fn impossible_targets_are_explained() {
    let g = a100();
    let w = |p| Want { profile: p, start: None };
    assert_eq!(
        plan(&g, &[w(5), w(5)], false).unwrap_err().to_string(),
        "2 x 4g.20gb wanted, but the GPU allows at most 1"
    );
    assert!(matches!(plan(&g, &[w(0), w(19)], false).unwrap_err(), Impossible::NoFit { .. }));
    assert_eq!(plan(&g, &[w(99)], false).unwrap_err(), Impossible::UnknownProfile(99));
    let e = plan(&g, &[Want { profile: 19, start: Some(7) }], false).unwrap_err();
    assert!(e.to_string().contains("1g.5gb cannot start at memory slice 7"), "{e}");
    // 3 x 2g + 3g: 6 + 4 slices > 8.
    let e = plan(&g, &[w(14), w(14), w(14), w(9)], false).unwrap_err();
    assert!(e.to_string().contains("do not fit together"), "{e}");
    // 2g@4 blocks 3g@4 and 3g@0+2g@0 overlap: 3g + 3g + 2g has no valid placement although 10 > 8 already...
    // and 4g@0 + 3g@4 is valid (R510+), 3g@0 + 4g is not.
    assert!(plan(&g, &[w(5), w(9)], false).is_ok());
    assert!(plan(&g, &[Want { profile: 9, start: Some(0) }, w(5)], false).is_err());
    // 1g.5gb+me: one at most.
    assert!(matches!(plan(&g, &[w(20), w(20)], false).unwrap_err(), Impossible::TooMany { .. }));
}

#[test]
fn dynamic_choice_fits_best_and_keeps_large_placements_free() {
    let g = a100();
    let r = |mib, compute, media| Request { memory_mib: mib, compute, sms: 0, media };
    // 8 GiB with one compute slice: the double-memory 1g.10gb, not 2g.10gb.
    assert_eq!(g.profile(choose(&g, &r(8192, 1, false)).unwrap().profile).unwrap().name, "1g.10gb");
    // Media engines: the +me profile.
    assert_eq!(g.profile(choose(&g, &r(4096, 0, true)).unwrap().profile).unwrap().name, "1g.5gb+me");
    assert_eq!(g.profile(choose(&g, &r(4096, 0, false)).unwrap().profile).unwrap().name, "1g.5gb");
    let e = choose(&g, &r(50_000, 0, false)).unwrap_err();
    assert!(matches!(e, NoPlacement::NoProfile { .. }) && e.to_string().contains("no MIG profile"), "{e}");
    // A small instance on an empty GPU goes where it blocks least: not slice 0 (4g, 3g, 2g, 7g start there).
    let p = choose(&g, &r(4096, 1, false)).unwrap();
    assert_ne!(p.start, 0);
    // After it, a 4g still fits.
    let g2 = with(&g, &[p]);
    assert_eq!(g2.profile(choose(&g2, &r(20_000, 4, false)).unwrap().profile).unwrap().name, "4g.20gb");
    // The greedy baseline takes slice 0 and blocks the 4g.
    let q = choose_greedy(&g, &r(4096, 1, false)).unwrap();
    assert_eq!(q.start, 0);
    let g3 = with(&g, &[q]);
    assert!(choose_greedy(&g3, &r(20_000, 4, false)).is_none());
    // A refusal names what was asked: a request of compute slices alone said "for 0 MiB" (issue 61,
    // item 7); a full GPU has no room for 4 compute slices.
    let full = gpu_with_all_but(&g, 0);
    let e = choose(&full, &r(0, 4, false)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("no room on {} for 4 compute slices: its free memory slices cannot hold a fitting profile", g.name)
    );
    assert_eq!(fragmentation(&g), 0.0, "an empty GPU: one usable block");
    assert_eq!(fragmentation(&gpu_with_all_but(&g, 0)), 1.0, "slice 7 alone holds no profile");
}

fn gpu_with_all_but(g: &Gpu, _free: u32) -> Gpu {
    // 1g at 0..6: the free slice 7 cannot hold any 1-slice profile, yet nothing else is free.
    with(g, &(0..7).map(|s| Placed { profile: 19, start: s }).collect::<Vec<_>>())
}

#[test]
fn default_geometries_follow_the_profile_table() {
    let g = a100();
    // 1g.5gb, 1g.10gb (double memory: its own geometry, never a filler), 2g.10gb with a 1g.5gb in
    // the slices left, 3g.20gb, 4g.20gb with a 3g.20gb beside it, 7g.40gb; no `+me`.
    assert_eq!(
        default_geometries(&g),
        vec![vec![(19, 7)], vec![(15, 4)], vec![(14, 3), (19, 1)], vec![(9, 2)], vec![(5, 1), (9, 1)], vec![(0, 1)]]
    );
    // Every default geometry is a valid layout: the planner can reach it.
    for geo in default_geometries(&g) {
        let want: Vec<Want> = geo
            .iter()
            .flat_map(|&(id, n)| std::iter::repeat_n(Want { profile: id, start: None }, n as usize))
            .collect();
        assert!(plan(&g, &want, false).is_ok(), "{geo:?}");
    }
}

#[test]
fn an_instance_of_a_geometry_leaves_room_for_the_rest_of_it() {
    let g = a100();
    let geo = vec![(14, 3), (19, 1)];
    // The 1g.5gb first: only slice 6 leaves the three 2g.10gb placements free.
    let one = choose_in_geometry(&g, &geo, 19).unwrap();
    assert_eq!(one, Placed { profile: 19, start: 6 });
    // Then the 2g.10gb instances, one at a time, each at a free placement, until all are made.
    let mut layout = vec![one];
    for _ in 0..3 {
        let p = choose_in_geometry(&with(&g, &layout), &geo, 14).unwrap();
        assert_eq!(p.profile, 14);
        layout.push(p);
    }
    let full = with(&g, &layout);
    assert_eq!(full.used_mask(), 0x7f, "{layout:?}");
    assert_eq!(
        choose_in_geometry(&full, &geo, 14).unwrap_err(),
        NoPlacement::GeometryFull { count: 3, profile: "2g.10gb".into() }
    );
    assert!(choose_in_geometry(&full, &geo, 14)
        .unwrap_err()
        .to_string()
        .contains("3 2g.10gb instances, and all of them are made"));
    assert!(matches!(choose_in_geometry(&full, &geo, 19).unwrap_err(), NoPlacement::GeometryFull { .. }));
    // A 2g.10gb made where it blocks nothing first still leaves the 1g.5gb its slice.
    let first = with(&g, &[Placed { profile: 14, start: 0 }, Placed { profile: 14, start: 2 }]);
    assert_eq!(choose_in_geometry(&first, &geo, 14).unwrap(), Placed { profile: 14, start: 4 });
    // An instance the geometry does not hold (a 3g.20gb made by hand) is named.
    let foreign = with(&g, &[Placed { profile: 9, start: 4 }]);
    let e = choose_in_geometry(&foreign, &geo, 14).unwrap_err().to_string();
    assert!(e.contains("holds a 3g.20gb instance") && e.contains("slice 4"), "{e}");
    // A profile the GPU does not have.
    assert!(choose_in_geometry(&g, &geo, 99).unwrap_err().to_string().contains("no MIG profile 99"));
    // Where the placements left cannot hold the rest: 1g.5gb at 0 and 2 break the 2g.10gb pairs.
    let broken = with(&g, &[Placed { profile: 19, start: 1 }]);
    let e = choose_in_geometry(&broken, &[(14, 3), (19, 2)], 14).unwrap_err();
    assert!(matches!(e, NoPlacement::NoRest { .. }) && e.to_string().contains("leaves room for the rest"), "{e}");
}

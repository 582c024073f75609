//! The MIG manager's placement and planning, measured.
//!
//! usage: mig-bench [--quick] [--steps N] [--seed S]
//!
//! 1. A stream of random allocate/release requests on an 8-GPU H100 node (profiles and placements
//!    read from the simulated NVML through the MIG manager's NVML backend, then modelled in memory):
//!    the MIG manager's dynamic placement against a greedy placer like HAMi's (smallest fitting profile
//!    by memory among the profiles without media extension or double memory, at the lowest free
//!    placement). Reported: the share of requests satisfied, and the fragmentation left (free memory
//!    slices the largest still-placeable profile cannot use, averaged over the run).
//! 2. Plan time for a full-node reconfiguration: 8 GPUs, from 7 x 1g.10gb to a balanced layout.
use std::sync::Arc;
use std::time::Instant;
use vgpu_mig::backend::{MigBackend, NvmlBackend};
use vgpu_mig::model::{Gpu, Instance, Placed};
use vgpu_mig::planner::{self, Request, Want};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn place(g: &mut Gpu, p: Placed, id: u32) {
    let size = g.profile(p.profile).unwrap().memory_slices;
    g.instances.push(Instance {
        gi: id,
        profile: p.profile,
        start: p.start,
        size,
        compute_instances: vec![],
        busy: true,
        uuid: None,
    });
}

struct Stats {
    ok: u64,
    asked: u64,
    /// Requests of 36 GiB and more: (satisfied, asked).
    large: (u64, u64),
    /// Memory satisfied / asked.
    gib: (f64, f64),
    frag: f64,
    used: f64,
}

/// Runs the stream with `choose`.
/// Picks a GPU and a placement for a request, or None.
type Placer<'a> = &'a dyn Fn(&[Gpu], &Request) -> Option<(usize, Placed)>;

fn run(template: &Gpu, steps: u64, seed: u64, choose: Placer) -> Stats {
    let mut rng = Rng(seed);
    let mut gpus: Vec<Gpu> = (0..8).map(|_| template.clone()).collect();
    let mut live: Vec<(usize, u32)> = Vec::new();
    let (mut ok, mut asked, mut frag, mut used, mut samples) = (0, 0, 0.0, 0.0, 0);
    let (mut large, mut gib) = ((0, 0), (0.0, 0.0));
    let mut next_id = 1;
    // Memory asked (MiB) with weights: many small inference pods, some mid-size, a few large.
    let sizes: [(u64, u64); 6] =
        [(6 << 10, 30), (9 << 10, 20), (16 << 10, 20), (20 << 10, 12), (36 << 10, 12), (70 << 10, 6)];
    let total: u64 = sizes.iter().map(|s| s.1).sum();
    for _ in 0..steps {
        if live.is_empty() || rng.below(100) < 52 {
            let mut r = rng.below(total);
            let mib = sizes
                .iter()
                .find(|s| {
                    if r < s.1 {
                        true
                    } else {
                        r -= s.1;
                        false
                    }
                })
                .unwrap()
                .0;
            let req = Request { memory_mib: mib, compute: 0, sms: 0, media: rng.below(100) < 3 };
            asked += 1;
            let big = mib >= 36 << 10;
            large.1 += u64::from(big);
            gib.1 += mib as f64 / 1024.0;
            if let Some((i, p)) = choose(&gpus, &req) {
                place(&mut gpus[i], p, next_id);
                live.push((i, next_id));
                next_id += 1;
                ok += 1;
                large.0 += u64::from(big);
                gib.0 += mib as f64 / 1024.0;
            }
        } else {
            let k = rng.below(live.len() as u64) as usize;
            let (g, id) = live.swap_remove(k);
            gpus[g].instances.retain(|x| x.gi != id);
        }
        for g in &gpus {
            frag += planner::fragmentation(g);
            used += g.used_mask().count_ones() as f64 / g.memory_slices as f64;
            samples += 1;
        }
    }
    Stats { ok, asked, large, gib, frag: frag / samples as f64, used: used / samples as f64 }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let num = |name: &str, d: u64| {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(d, |v| v.parse().unwrap())
    };
    let steps = num("--steps", if quick { 5_000 } else { 100_000 });
    let seed = num("--seed", 0x5eed);

    // The H100's profiles from the simulated NVML.
    let dir = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
    let state = std::env::temp_dir().join(format!("vgpu-mig-bench-{}", std::process::id()));
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(state.join("node.toml"), "[[gpu]]\nmodel = \"H100-80GB\"\n").unwrap();
    std::env::set_var("VGPU_SIM_STATE", state.join("node"));
    std::env::set_var("VGPU_SIM_CONFIG", state.join("node.toml"));
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(dir.join("libnvidia_ml.so").as_os_str())
        .init()
        .expect("the simulated NVML (build it)");
    let b = NvmlBackend::new(Arc::new(nvml));
    b.set_mode(0, true).unwrap();
    let mut h100 = b.gpu(0).unwrap();
    h100.instances.clear();
    let _ = std::fs::remove_dir_all(&state);
    println!(
        "mig-bench: 8 x {} ({} profiles: {})",
        h100.name,
        h100.profiles.len(),
        h100.profiles.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
    );

    // Ours picks the GPU too (the least room lost); the baseline takes the first GPU where its
    // choice fits, in index order.
    let ours = |g: &[Gpu], r: &Request| planner::choose_on(g, r).ok();
    let greedy =
        |g: &[Gpu], r: &Request| g.iter().enumerate().find_map(|(i, x)| planner::choose_greedy(x, r).map(|p| (i, p)));
    println!("request stream: {steps} steps (52 % allocate, 48 % release), seed {seed:#x}");
    println!("| placer | requests satisfied | of them >= 36 GiB | memory satisfied | mean fragmentation | mean slices in use |");
    println!("|---|---|---|---|---|---|");
    for (name, f) in [
        ("vgpu (best fit, least room lost across GPUs)", &ours as Placer),
        ("greedy smallest fit, first GPU, lowest placement", &greedy),
    ] {
        let r = run(&h100, steps, seed, f);
        println!(
            "| {name} | {:.1} % ({}/{}) | {:.1} % ({}/{}) | {:.1} % | {:.3} | {:.1} % |",
            r.ok as f64 * 100.0 / r.asked as f64,
            r.ok,
            r.asked,
            r.large.0 as f64 * 100.0 / r.large.1.max(1) as f64,
            r.large.0,
            r.large.1,
            r.gib.0 * 100.0 / r.gib.1,
            r.frag,
            r.used * 100.0
        );
    }

    // Plan time: a full-node reconfiguration.
    let one = h100.profile_named("1g.10gb").unwrap().id;
    let mut from = h100.clone();
    for (k, s) in (0..7).enumerate() {
        place(&mut from, Placed { profile: one, start: s }, k as u32 + 1);
        from.instances[k].busy = false;
    }
    let want: Vec<Want> = ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
        .iter()
        .map(|n| Want { profile: h100.profile_named(n).unwrap().id, start: None })
        .collect();
    let reps = if quick { 200 } else { 2000 };
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..8 {
                std::hint::black_box(planner::plan(&from, &want, false).unwrap());
            }
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p = planner::plan(&from, &want, false).unwrap();
    println!(
        "plan, 8 GPUs from 7 x 1g.10gb to 2 x 1g.10gb + 2g.20gb + 3g.40gb: median {:.0} us, p99 {:.0} us ({} steps per GPU, {} instances kept)",
        times[times.len() / 2],
        times[times.len() * 99 / 100],
        p.steps.len(),
        p.keep.len()
    );
}

//! SM-limit accuracy on the simulated GPU: achieved share of GPU time per container, from the
//! simulator's kernel timeline (simulated device time), against the limit.
//!
//! usage: sm-accuracy [--quick] [--libvgpu PATH] [--only SUBSTRING]
//! Prints a Markdown table. Uses the simulator and clients built next to this binary.
use vgpu_sim_clients::accuracy::{container, Container, Harness, Outcome, Scenario};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1).cloned());
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    let libvgpu = args
        .iter()
        .position(|a| a == "--libvgpu")
        .and_then(|i| args.get(i + 1).map(std::path::PathBuf::from))
        .unwrap_or_else(|| dir.join("libvgpu.so"));
    let lib_dir = dir.join("sim-lib");
    std::fs::create_dir_all(&lib_dir).unwrap();
    for (n, t) in [("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia_ml.so")] {
        let src = if dir.join(t).exists() { dir.join(t) } else { dir.join("deps").join(t) };
        let _ = std::fs::remove_file(lib_dir.join(n));
        std::os::unix::fs::symlink(src, lib_dir.join(n)).unwrap();
    }
    let h = Harness::new(&dir, &libvgpu, &lib_dir);
    let secs = if quick { 4.0 } else { 11.0 };
    let mut scenarios: Vec<(Scenario, Vec<f64>)> = Vec::new();
    let one = |name: String, c: Vec<Container>| Scenario { name, containers: c, seconds: secs, change: None };
    // One container, whose target is its limit on GPU 0.
    let alone = |name: &str, c: Container| {
        let target = c.limits[0] as f64;
        (one(name.to_string(), vec![c]), vec![target])
    };
    let limits: &[u32] = if quick { &[30] } else { &[10, 30, 50, 70, 90] };
    let kernels: &[&str] = if quick { &["sleep_1ms"] } else { &["sleep_50us", "sleep_1ms", "sleep_20ms"] };
    for &l in limits {
        for &k in kernels {
            // Short kernels are queued in batches, as applications do; longer ones synchronise each time.
            let extra: &[&str] = if k == "sleep_50us" { &["--sync-every", "64"] } else { &[] };
            scenarios.push(alone(&format!("one container, {k}"), container(l, k, extra)));
        }
    }
    for &l in if quick { &[50u32][..] } else { &[10, 50, 90][..] } {
        let graphs = container(l, "sleep_200us", &["--path", "graph", "--nodes", "10"]);
        scenarios.push(alone("graphs of 10 x sleep_200us", graphs));
        scenarios.push(alone("cooperative sleep_1ms", container(l, "sleep_1ms", &["--path", "coop"])));
    }
    if !quick {
        for l in [10u32, 30, 70] {
            // One function whose GPU time follows its grid (1 and 10 ms on the H100's 132 SMs).
            let c = container(l, "wave_1ms", &["--grids", "132,1320", "--block", "256"]);
            scenarios.push(alone("one kernel, grids of 132 and 1320 blocks (wave_1ms: 1 and 10 ms)", c));
        }
        let c = container(30, "param_ns", &["--duration-ns", "1000000", "--ramp-ppm", "1000"]);
        scenarios.push(alone("one kernel getting 0.1 % longer at each launch (param_ns from 1 ms)", c));
        scenarios
            .push(alone("deprecated cuLaunchGridAsync, sleep_1ms", container(30, "sleep_1ms", &["--path", "legacy"])));
        let args = ["--path", "graph", "--nodes", "10", "--duration-ns", "10000", "--regraph-after", "3000"];
        let c = container(30, "param_ns", &args);
        scenarios.push(alone("graph updated after 3000 launches to 10x longer (100 us -> 1 ms)", c));
        let c = container(30, "sleep_100us", &["--reload-after", "3000", "--reload-kernel", "sleep_1ms"]);
        scenarios.push(alone("module reloaded after 3000 launches, its kernel 10x longer at the same handle", c));
    }
    for (a, b) in if quick { vec![(10, 90)] } else { vec![(10, 90), (30, 70), (50, 50)] } {
        scenarios.push((
            one(
                "two containers, sleep_1ms".into(),
                vec![container(a, "sleep_1ms", &[]), container(b, "sleep_1ms", &[])],
            ),
            vec![a as f64, b as f64],
        ));
    }
    if !quick {
        let mut four = container(40, "sleep_1ms", &[]);
        four.processes = 4;
        scenarios.push((one("four processes, one container".into(), vec![four]), vec![40.0]));
        let mut two_gpus = container(20, "sleep_1ms", &[]);
        two_gpus.limits = vec![20, 60];
        let mut other = two_gpus.clone();
        other.args.extend(["--device".to_string(), "1".to_string()]);
        scenarios.push((one("GPU 0 at 20 %".into(), vec![two_gpus.clone()]), vec![20.0]));
        let mut sc = one("GPU 1 at 60 % (same container)".into(), vec![other]);
        sc.containers[0].limits = vec![20, 60];
        scenarios.push((sc, vec![60.0]));
        let mut change = one("limit 60 -> 20 at 4 s".into(), vec![container(60, "sleep_1ms", &[])]);
        change.change = Some((4.0, 20));
        scenarios.push((change, vec![20.0]));
        let mut d = container(30, "sleep_1ms", &[]);
        d.policy = Some("default");
        scenarios.push((one("alone, policy default (standalone: limited)".into(), vec![d]), vec![30.0]));
        let mut f = container(30, "sleep_1ms", &[]);
        f.policy = Some("force");
        scenarios.push((one("alone, policy force".into(), vec![f]), vec![30.0]));
        let mut x = container(30, "sleep_1ms", &[]);
        x.policy = Some("disable");
        scenarios.push((one("alone, policy disable (unlimited)".into(), vec![x]), vec![100.0]));
    }
    println!("| scenario | limit | achieved (after 1 s) | 1 s windows min-max | verdict |\n|---|---|---|---|---|");
    let mut failed = 0;
    for (i, (sc, targets)) in scenarios.iter().enumerate() {
        if only.as_ref().is_some_and(|o| !sc.name.contains(o.as_str())) {
            continue;
        }
        let o: Outcome = h.run(sc, i);
        let gpu = if sc.name.starts_with("GPU 1") { 1 } else { 0 };
        let got: Vec<f64> = o.overall.iter().map(|g| g[gpu] * 100.0).collect();
        let wins: Vec<(f64, f64)> = o
            .windows
            .iter()
            .map(|w| {
                let w = &w[gpu];
                let lo = w.iter().cloned().fold(f64::MAX, f64::min) * 100.0;
                let hi = w.iter().cloned().fold(f64::MIN, f64::max) * 100.0;
                (lo, hi)
            })
            .collect();
        let (verdict, ok) = if targets.len() == 2 {
            let want = targets[0] / targets[1];
            let have = got[0] / got[1].max(1e-9);
            let err = (have / want - 1.0).abs() * 100.0;
            // The quick run (CI, a loaded 2-core machine) allows twice the budget.
            let budget = if quick { 20.0 } else { 10.0 };
            (format!("ratio {have:.3} vs {want:.3} ({err:.1} % off; budget {budget} %)"), err <= budget)
        } else if targets[0] >= 100.0 {
            ("unlimited".to_string(), got[0] > 90.0)
        } else {
            let settle = if sc.change.is_some() { 4 } else { 0 };
            let w = &o.windows[0][gpu][settle.min(o.windows[0][gpu].len())..];
            let worst = w.iter().map(|x| (x * 100.0 - targets[0]).abs()).fold(0.0, f64::max);
            let overall = (got[0] - targets[0]).abs();
            let ok = worst <= 5.0 && (quick || sc.change.is_some() || overall <= 2.0);
            (format!("worst window {worst:.1} points off, overall {overall:.1}"), ok)
        };
        failed += !ok as usize;
        let t: Vec<String> = targets.iter().map(|t| format!("{t:.0} %")).collect();
        let g: Vec<String> = got.iter().map(|x| format!("{x:.1} %")).collect();
        let w: Vec<String> = wins.iter().map(|(a, b)| format!("{a:.1}-{b:.1}")).collect();
        println!(
            "| {} | {} | {} | {} | {} {} |",
            sc.name,
            t.join(" / "),
            g.join(" / "),
            w.join(" / "),
            if ok { "ok" } else { "MISS" },
            verdict
        );
    }
    if failed > 0 {
        eprintln!("{failed} scenario(s) outside their tolerance");
        std::process::exit(1);
    }
}

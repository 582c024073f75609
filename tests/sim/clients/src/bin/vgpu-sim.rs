//! `vgpu-sim`: inspect and steer the simulated node (the things a person does to a real node with
//! `nvidia-smi -r`, a reboot, or a failing GPU).
//!
//! Uses `VGPU_SIM_CONFIG` and `VGPU_SIM_STATE` like the simulated libraries.
use serde_json::json;
use std::sync::atomic::Ordering::*;
use vgpu_sim::{mig, now_ns, Node};

const USAGE: &str = "\
usage: vgpu-sim <command>
  status                          the node as JSON: GPUs, memory, MIG, processes, faults
  summary                         the same as a table, with utilisation over the last second
  reset --gpu I                   GPU reset: applies a pending MIG mode, wipes MIG instances
                                  (refused while processes hold the GPU)
  reboot                          reboot/driver reload: Hopper loses MIG mode, Ampere keeps it
  fault set FUNCTION [--code C] [--count N] [--latency-us U] [--gpu I]
                                  make FUNCTION fail with C (NVML or CUDA code) N times (0: always)
  fault clear                     remove every fault
  xid --gpu I --code X [--gpu-instance G [--compute-instance C]]
                                  raise an XID event on GPU I (about MIG GPU instance G and its
                                  compute instance C, default 0, where given)
  util --gpu I [--window-ms W]    busy share of GPU I over the last W ms, total and per PID
  timeline --gpu I [--window-ms W]
                                  the kernels of the last W ms as [start_ns, end_ns, pid], oldest first
  wipe                            delete the node state (refused while processes are live)";

fn arg(args: &[String], k: &str) -> Option<String> {
    args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned()
}

fn num<T: std::str::FromStr>(args: &[String], k: &str, d: Option<T>) -> T {
    match arg(args, k) {
        Some(v) => v.parse().unwrap_or_else(|_| die(&format!("{k}: cannot parse {v:?}"), 2)),
        None => d.unwrap_or_else(|| die(&format!("{k} is required"), 2)),
    }
}

fn die(msg: &str, code: i32) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(code)
}

fn gpu_index(n: &Node, args: &[String]) -> usize {
    let g: usize = num(args, "--gpu", None);
    if g >= n.cfg.gpus.len() {
        die(&format!("--gpu {g}: the node has {} GPUs", n.cfg.gpus.len()), 2);
    }
    g
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first().map(String::as_str) else { die(USAGE, 2) };
    if cmd == "--help" || cmd == "-h" {
        println!("{USAGE}");
        return;
    }
    let n = Node::global().unwrap_or_else(|e| die(e, 1));
    match cmd {
        "status" => status(n),
        "summary" => summary(n),
        "reset" => {
            let g = gpu_index(n, &args);
            n.reap();
            let busy = n.gpu_in_use(g, None);
            let mut l = n.lock();
            match mig::reset(n.mig(&mut l, g), busy) {
                Ok(()) => println!("GPU {g} reset"),
                Err(_) => die(&format!("GPU {g} is in use by running processes; reset refused"), 1),
            }
        }
        "reboot" => {
            n.reap();
            if n.live_slots().next().is_some() {
                die("processes are still running on the node; stop them first", 1);
            }
            let mut l = n.lock();
            for (g, cfg) in n.cfg.gpus.iter().enumerate() {
                mig::reboot(n.mig(&mut l, g), cfg.model);
                n.clear_timeline(g);
            }
            println!("node rebooted");
        }
        "fault" => match args.get(1).map(String::as_str) {
            Some("set") => {
                let f = args
                    .get(2)
                    .filter(|a| !a.starts_with("--"))
                    .unwrap_or_else(|| die("fault set needs a function name", 2));
                let gpu: i32 = num(&args, "--gpu", Some(-1));
                if gpu >= n.cfg.gpus.len() as i32 {
                    die("--gpu out of range", 2);
                }
                n.set_fault(
                    f,
                    gpu,
                    num(&args, "--code", Some(999)),
                    num(&args, "--count", Some(0)),
                    num(&args, "--latency-us", Some(0)),
                )
                .unwrap_or_else(|e| die(&e, 1));
            }
            Some("clear") => n.clear_faults(),
            _ => die("fault set|clear", 2),
        },
        "xid" => {
            let g = gpu_index(n, &args);
            let code = num(&args, "--code", None);
            match arg(&args, "--gpu-instance") {
                Some(_) => n.inject_instance_xid(
                    g,
                    code,
                    num(&args, "--gpu-instance", None),
                    num(&args, "--compute-instance", Some(0)),
                ),
                None => n.inject_xid(g, code),
            }
        }
        "util" => {
            let g = gpu_index(n, &args);
            let w: u64 = num(&args, "--window-ms", Some(1000));
            let now = now_ns();
            let span = w * 1_000_000;
            let (total, per) = n.busy(g, now.saturating_sub(span), now);
            let per: serde_json::Map<String, serde_json::Value> =
                per.into_iter().map(|(p, b)| (p.to_string(), json!(b as f64 / span as f64))).collect();
            println!("{}", json!({"gpu": g, "window_ms": w, "busy": total as f64 / span as f64, "per_pid": per}));
        }
        "timeline" => {
            let g = gpu_index(n, &args);
            let w: u64 = num(&args, "--window-ms", Some(1000));
            let mut k = n.kernels_since(g, now_ns().saturating_sub(w * 1_000_000));
            k.reverse();
            println!("{}", json!(k));
        }
        "wipe" => {
            n.reap();
            if n.live_slots().next().is_some() {
                die("processes are still running on the node; stop them first", 1);
            }
            std::fs::remove_dir_all(&n.dir)
                .unwrap_or_else(|e| die(&format!("cannot remove {}: {e}", n.dir.display()), 1));
            println!("removed {}", n.dir.display());
        }
        _ => die(&format!("unknown command {cmd:?}\n{USAGE}"), 2),
    }
}

fn status(n: &Node) {
    n.reap();
    let gpus: Vec<_> = n
        .cfg
        .gpus
        .iter()
        .enumerate()
        .map(|(g, c)| {
            let st = {
                let mut l = n.lock();
                *n.mig(&mut l, g)
            };
            let gis: Vec<_> = st
                .gis
                .iter()
                .filter(|x| x.live != 0)
                .map(|x| {
                    let name = c.model.mig.and_then(|t| t.by_id(x.profile_id)).map_or("?", |p| p.name);
                    let cis: Vec<_> = x.cis.iter().filter(|c| c.live != 0).map(|c| json!({"id": c.id, "profile_id": c.profile_id, "start": c.start, "size": c.size})).collect();
                    json!({"id": x.id, "profile": name, "profile_id": x.profile_id, "start": x.start, "size": x.size, "compute_instances": cis})
                })
                .collect();
            json!({"index": g, "model": c.model.key, "name": c.model.name, "uuid": c.uuid, "pci_bus_id": c.pci_bus_id,
                "numa_node": c.numa_node, "memory_total": c.memory_bytes, "memory_used": n.mem_used(g), "sm_count": c.sm_count,
                "mig": {"supported": c.model.mig.is_some(), "current": st.current, "pending": st.pending, "gpu_instances": gis}})
        })
        .collect();
    let procs: Vec<_> = n
        .live_slots()
        .map(|p| {
            let mem: Vec<u64> = (0..n.cfg.gpus.len()).map(|g| p.mem[g].load(Acquire)).collect();
            let ctx: Vec<u32> = (0..n.cfg.gpus.len()).map(|g| p.ctx[g].load(Acquire)).collect();
            json!({"pid": p.pid.load(Relaxed), "memory": mem, "contexts": ctx})
        })
        .collect();
    let faults: Vec<_> = vgpu_sim::state::fault_names(n.shared())
        .into_iter()
        .map(|(f, g, c, r, l)| json!({"function": f, "gpu": g, "code": c, "remaining": r, "latency_us": l}))
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({"state_dir": n.dir, "gpus": gpus, "processes": procs, "faults": faults}))
            .unwrap()
    );
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn summary(n: &Node) {
    n.reap();
    let now = now_ns();
    println!("{:<4} {:<12} {:<42} {:>22} {:>5}  MIG", "GPU", "MODEL", "UUID", "MEMORY USED/TOTAL", "UTIL");
    for (g, c) in n.cfg.gpus.iter().enumerate() {
        let (busy, _) = n.busy(g, now.saturating_sub(1_000_000_000), now);
        let st = {
            let mut l = n.lock();
            *n.mig(&mut l, g)
        };
        let mig = match (c.model.mig.is_some(), st.current, st.pending) {
            (false, _, _) => "n/a".to_string(),
            (true, c, p) if c != p => format!("{} (pending {})", on(c), on(p)),
            (true, c, _) => format!("{} ({} instances)", on(c), st.gis.iter().filter(|x| x.live != 0).count()),
        };
        println!(
            "{:<4} {:<12} {:<42} {:>22} {:>4}%  {}",
            g,
            c.model.key,
            c.uuid,
            format!("{} / {}", gib(n.mem_used(g)), gib(c.memory_bytes)),
            busy / 10_000_000,
            mig
        );
    }
    println!("\n{:<8} {:<4} {:>12}", "PID", "GPU", "MEMORY");
    for p in n.live_slots() {
        for g in 0..n.cfg.gpus.len() {
            if p.ctx[g].load(Acquire) > 0 {
                println!("{:<8} {:<4} {:>12}", p.pid.load(Relaxed), g, gib(p.mem[g].load(Acquire)));
            }
        }
    }
}

fn on(x: u32) -> &'static str {
    if x == 1 {
        "enabled"
    } else {
        "disabled"
    }
}

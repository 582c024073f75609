//! vgpu-node-agent. For now: `vgpu-node-agent [--config PATH] [--state-dir DIR] [--nvml-library PATH]
//! discover` loads and validates the configuration and prints the node's GPU inventory as JSON.
//!
//! Exit codes: 0 success, 2 usage or configuration error, 3 NVML unavailable.
use vgpu_agent::config::{Config, Flags};
use vgpu_agent::discovery;

fn usage() -> ! {
    eprintln!("usage: vgpu-node-agent [--config PATH] [--state-dir DIR] [--nvml-library PATH] discover");
    std::process::exit(2)
}

fn main() {
    let mut flags = Flags::default();
    let mut cmd = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => flags.config = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--state-dir" => flags.state_dir = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--nvml-library" => flags.nvml_library = Some(args.next().unwrap_or_else(|| usage()).into()),
            "discover" if cmd.is_none() => cmd = Some(a),
            "-h" | "--help" => {
                println!("vgpu-node-agent [--config PATH] [--state-dir DIR] [--nvml-library PATH] discover");
                return;
            }
            _ => usage(),
        }
    }
    if cmd.is_none() {
        usage();
    }
    let cfg = Config::load(&flags, |k| std::env::var(k).ok()).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    });
    let inv = discovery::open(cfg.nvml_library.as_deref()).and_then(|n| discovery::discover(&n)).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(3)
    });
    println!("{}", serde_json::to_string_pretty(&inv).expect("serialisable"));
}

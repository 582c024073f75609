//! vgpu-node-agent [--config PATH] [--state-dir DIR] [--socket PATH] [--metrics-address ADDR]
//!                 [--nvml-library PATH] <command>
//!   run        recover the slices, serve the API and metrics, monitor until SIGTERM/SIGINT
//!   discover   print the node's GPU inventory as JSON
//!
//! Exit codes: 0 success, 1 the daemon failed, 2 usage or configuration error, 3 NVML unavailable.
use vgpu_agent::config::{Config, Flags};
use vgpu_agent::discovery;

const USAGE: &str =
    "usage: vgpu-node-agent [--config PATH] [--state-dir DIR] [--socket PATH] [--metrics-address ADDR|off]
                       [--nvml-library PATH] run|discover|version";

fn usage() -> ! {
    eprintln!("{USAGE}");
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
            "--socket" => flags.socket = Some(args.next().unwrap_or_else(|| usage()).into()),
            "--metrics-address" => flags.metrics_address = Some(args.next().unwrap_or_else(|| usage())),
            "version" | "--version" => {
                println!("vgpu-node-agent {}", vgpu_agent::agent::VERSION);
                return;
            }
            "discover" | "run" if cmd.is_none() => cmd = Some(a),
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            _ => usage(),
        }
    }
    if cmd.is_none() {
        usage();
    }
    let cfg = vgpu_agent::config::check_environment()
        .and_then(|()| Config::load(&flags, |k| std::env::var(k).ok()))
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2)
        });
    if cmd.as_deref() == Some("run") {
        use std::io::IsTerminal;
        let builder = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(std::io::stderr().is_terminal());
        match cfg.log_format {
            vgpu_agent::config::LogFormat::Json => builder.json().init(),
            vgpu_agent::config::LogFormat::Text => builder.init(),
        }
        if let Err(e) = vgpu_agent::daemon::run(cfg.clone()) {
            tracing::error!(error = %e, "agent failed");
            std::process::exit(if e.contains("NVML") { 3 } else { 1 });
        }
        return;
    }
    let inv = discovery::open(cfg.nvml_library.as_deref()).and_then(|n| discovery::discover(&n)).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(3)
    });
    println!("{}", serde_json::to_string_pretty(&inv).expect("serialisable"));
}

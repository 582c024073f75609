//! vgpu-node-agent [--config PATH] [--state-dir DIR] [--socket PATH] [--metrics-address ADDR]
//!                 [--nvml-library PATH] run|discover|version (`--help` for all, with their
//!                 environment variables; `--flag=value` works too)
//!
//! Exit codes: 0 success, 1 the daemon failed, 2 usage or configuration error, 3 NVML unavailable.
#![deny(clippy::too_many_lines)]
use clap::{Parser, Subcommand};
use vgpu_agent::config::{Config, Flags};
use vgpu_agent::discovery;

/// The vgpu node agent. Settings come from the configuration file, then the environment
/// (`VGPU_AGENT_*`), then these options, each overriding the one before.
#[derive(Parser)]
#[command(name = "vgpu-node-agent", version = vgpu_agent::agent::VERSION, disable_version_flag = true)]
struct Cli {
    /// The configuration file [env: VGPU_AGENT_CONFIG; default: /etc/vgpu/agent.toml where it exists]
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<std::path::PathBuf>,
    /// The state directory [env: VGPU_AGENT_STATE_DIR; default: /var/lib/vgpu]
    #[arg(long, global = true, value_name = "DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// The API's Unix socket [env: VGPU_AGENT_SOCKET; default: /run/vgpu/agent.sock]
    #[arg(long, global = true, value_name = "PATH")]
    socket: Option<std::path::PathBuf>,
    /// The metrics address, or off [env: VGPU_AGENT_METRICS_ADDRESS; default: 127.0.0.1:9394]
    #[arg(long, global = true, value_name = "ADDR")]
    metrics_address: Option<String>,
    /// The NVML library to load [env: VGPU_AGENT_NVML_LIBRARY; default: the system's]
    #[arg(long, global = true, value_name = "PATH")]
    nvml_library: Option<std::path::PathBuf>,
    /// Print the version
    #[arg(long)]
    version: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Clone, Copy, PartialEq, Eq)]
enum Cmd {
    /// Recover the slices, serve the API and metrics, monitor until SIGTERM or SIGINT
    Run,
    /// Print the node's GPU inventory as JSON
    Discover,
    /// Print the version
    Version,
}

fn main() {
    let cli = Cli::parse();
    if cli.version || cli.cmd == Some(Cmd::Version) {
        println!("vgpu-node-agent {}", vgpu_agent::agent::VERSION);
        return;
    }
    let Some(cmd) = cli.cmd else {
        eprintln!("error: a command is required: run, discover or version (see --help)");
        std::process::exit(2)
    };
    let flags = Flags {
        config: cli.config,
        state_dir: cli.state_dir,
        nvml_library: cli.nvml_library,
        socket: cli.socket,
        metrics_address: cli.metrics_address,
    };
    let cfg = vgpu_agent::config::check_environment()
        .and_then(|()| Config::load(&flags, |k| std::env::var(k).ok()))
        .unwrap_or_else(|e| {
            eprintln!("error: {e}");
            std::process::exit(2)
        });
    if cmd == Cmd::Run {
        use std::io::IsTerminal;
        let builder = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(std::io::stderr().is_terminal())
            // Checked when the configuration was read.
            .with_env_filter(tracing_subscriber::EnvFilter::builder().parse_lossy(&cfg.log_level));
        match cfg.log_format {
            vgpu_agent::config::LogFormat::Json => builder.json().init(),
            vgpu_agent::config::LogFormat::Text => builder.init(),
        }
        if let Err(e) = vgpu_agent::daemon::run(cfg.clone()) {
            tracing::error!(error = %e, "agent failed");
            std::process::exit(e.exit_code());
        }
        return;
    }
    let inv = discovery::open(cfg.nvml_library.as_deref()).and_then(|n| discovery::discover(&n)).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(3)
    });
    println!("{}", serde_json::to_string_pretty(&inv).expect("serialisable"));
}

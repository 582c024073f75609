//! vgpu-receiver: the reference receiver of node capacity. Node agents connect to it (TLS and a bearer
//! token over TCP, or a Unix socket); `vgpuctl cluster status` reads its cluster view.
//!
//!   vgpu-receiver serve --listen 0.0.0.0:9400 --tls-cert server.pem --tls-key server-key.pem --token-file token
//!   vgpu-receiver gen-certs --out DIR --host receiver.example --host 10.0.0.5
//!   vgpu-receiver gen-client-cert --ca-dir DIR --name node-7 --out DIR   (with serve --client-ca DIR/ca.pem,
//!                                                                         and --require-node-certs)
#![deny(clippy::too_many_lines)]
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use vgpu_receiver::{auth, certs, metrics, Auth, Cluster, Role, Settings, Tokens};

#[derive(Parser)]
#[command(name = "vgpu-receiver", version, about = "vgpu's reference receiver of node capacity (vgpu.scheduler.v1)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Accept node agents' capacity streams and serve the cluster view.
    Serve {
        /// TCP address for nodes and vgpuctl (needs --tls-cert, --tls-key and --token-file).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// PEM certificate (chain) of the receiver.
        #[arg(long)]
        tls_cert: Option<PathBuf>,
        /// PEM private key of the certificate.
        #[arg(long)]
        tls_key: Option<PathBuf>,
        /// Require mutual TLS on --listen: clients must present a certificate signed by this CA
        /// (PEM), as well as a token. An empty value is off.
        #[arg(long)]
        client_ca: Option<String>,
        /// With --client-ca: a node's capacity stream must come with a certificate that names the
        /// node (a DNS name or IP address among its subject alternative names; gen-client-cert
        /// --name NODE makes one), so that one node's key cannot speak for another.
        #[arg(long)]
        require_node_certs: bool,
        /// Accepted bearer tokens, one per line: `TOKEN` (cluster), `reader TOKEN` or
        /// `nodes TOKEN` or `node NAME TOKEN`; re-read when it changes.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// A Unix socket to serve on as well (or instead); no TLS there.
        #[arg(long)]
        unix: Option<PathBuf>,
        /// Prometheus metrics address (plain HTTP), e.g. 127.0.0.1:9401.
        #[arg(long)]
        metrics_address: Option<SocketAddr>,
        /// Heartbeat period asked of nodes, ms; a node silent for three is stale.
        #[arg(long, default_value_t = 10_000)]
        heartbeat_ms: u64,
        /// A node disconnected this long (seconds) leaves the view.
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=604_800))]
        forget_after_s: u64,
        /// The most node names one token may stream (a `nodes` token is one Secret for a DaemonSet).
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        max_nodes_per_token: u64,
        /// The most node state the receiver holds, all nodes together, in MiB of encoded state (in
        /// memory about 2.5 times that); a node whose state would go beyond is refused.
        #[arg(long, default_value_t = (vgpu_receiver::DEFAULT_STATE_BYTES >> 20) as u64,
              value_parser = clap::value_parser!(u64).range(4..=65_536))]
        max_state_mib: u64,
    },
    /// Add a fresh token to a token file (the running receiver picks it up within a second) and
    /// write it to --out (0600) or print it. Revoke a token by deleting its line.
    AddToken {
        /// The receiver's token file (made 0600 if absent).
        #[arg(long)]
        token_file: PathBuf,
        /// A token for this node's capacity stream only.
        #[arg(long, conflicts_with_all = ["reader", "nodes", "cluster"])]
        node: Option<String>,
        /// A token that may only read the cluster view (Cluster.Status and Cluster.Watch).
        #[arg(long, conflicts_with_all = ["nodes", "cluster"])]
        reader: bool,
        /// A token for any node's capacity stream and nothing else (one Secret for a DaemonSet).
        #[arg(long, conflicts_with = "cluster")]
        nodes: bool,
        /// A token that may do everything (any node's stream, the cluster view, requests).
        #[arg(long)]
        cluster: bool,
        /// Where to write the token (0600); without it the token is printed.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Make a client certificate for mutual TLS (`--client-ca`), signed by the CA that gen-certs made:
    /// writes NAME.pem and NAME-key.pem (0600) into --out.
    GenClientCert {
        /// The directory gen-certs wrote (its ca-key.pem signs).
        #[arg(long)]
        ca_dir: PathBuf,
        /// The certificate's name, as its common name and subject alternative name (a node's name
        /// for --require-node-certs).
        #[arg(long)]
        name: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Make a private CA (ca.pem, ca-key.pem), a server certificate for the given names, its key and
    /// a token.
    GenCerts {
        #[arg(long)]
        out: PathBuf,
        /// A DNS name or IP address of the receiver (repeatable) [default: localhost, 127.0.0.1].
        #[arg(long)]
        host: Vec<String>,
    },
}

/// Writes `text` to a new file readable by its owner only (an existing file is replaced).
fn write_secret(p: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(p);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(p)?;
    std::io::Write::write_all(&mut f, format!("{text}\n").as_bytes())
}

fn die(code: i32, msg: impl std::fmt::Display) -> ! {
    eprintln!("vgpu-receiver: {msg}");
    std::process::exit(code)
}

/// Many nodes mean many sockets: raise the open-file limit to the hard limit.
fn raise_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer; RLIMIT_NOFILE exists.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::GenCerts { out, mut host } => {
            if host.is_empty() {
                host = vec!["localhost".into(), "127.0.0.1".into()];
            }
            let b = certs::generate(&host).unwrap_or_else(|e| die(1, e));
            certs::write(&out, &b).unwrap_or_else(|e| die(1, e));
            println!(
                "wrote {0}/ca.pem, {0}/ca-key.pem, {0}/server.pem, {0}/server-key.pem and {0}/token for {1}",
                out.display(),
                host.join(", ")
            );
        }
        Cmd::GenClientCert { ca_dir, name, out } => {
            if !auth::valid_node(&name) || name.contains('/') {
                die(2, format!("{name:?} cannot be a certificate name (no spaces or slashes)"));
            }
            let key_path = ca_dir.join("ca-key.pem");
            let ca_key = std::fs::read_to_string(&key_path)
                .unwrap_or_else(|e| die(1, format!("cannot read {}: {e}", key_path.display())));
            let (cert, key) = certs::client(&ca_key, &name).unwrap_or_else(|e| die(1, e));
            let (c, k) = (format!("{name}.pem"), format!("{name}-key.pem"));
            certs::write_files(&out, &[(&c, &cert, 0o644), (&k, &key, 0o600)]).unwrap_or_else(|e| die(1, e));
            println!("wrote {0}/{c} and {0}/{k}", out.display());
        }
        Cmd::AddToken { token_file, node, reader, nodes, cluster, out } => {
            let role = match (node, reader, nodes, cluster) {
                (Some(n), ..) => Role::Node(n),
                (None, true, ..) => Role::Reader,
                (None, false, true, _) => Role::Nodes,
                (None, false, false, true) => Role::Cluster,
                (None, false, false, false) => {
                    die(2, "say what the token is for: --node NAME, --nodes, --reader or --cluster")
                }
            };
            let token = auth::add_token(&token_file, &role).unwrap_or_else(|e| die(1, e));
            match out {
                Some(p) => {
                    write_secret(&p, &token).unwrap_or_else(|e| die(1, format!("cannot write {}: {e}", p.display())));
                    eprintln!("added a {role} token to {}; the token is in {}", token_file.display(), p.display());
                }
                None => {
                    println!("{token}");
                    eprintln!("added a {role} token to {}", token_file.display());
                }
            }
        }
        Cmd::Serve {
            listen,
            tls_cert,
            tls_key,
            client_ca,
            require_node_certs,
            token_file,
            unix,
            metrics_address,
            heartbeat_ms,
            forget_after_s,
            max_nodes_per_token,
            max_state_mib,
        } => {
            // An empty --client-ca is off (the Helm chart always passes it).
            let client_ca = client_ca.filter(|p| !p.is_empty()).map(PathBuf::from);
            if require_node_certs && client_ca.is_none() {
                die(2, "--require-node-certs needs --client-ca (the CA of the nodes' certificates)");
            }
            use std::io::IsTerminal;
            tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal()).init();
            if listen.is_none() && unix.is_none() {
                die(2, "nothing to serve on: give --listen ADDR (with TLS and a token) and/or --unix PATH");
            }
            let auth = match &token_file {
                Some(p) => Auth::from_file(p).unwrap_or_else(|e| die(2, e)),
                None => Auth::fixed(Tokens::default()),
            };
            let tls = match (listen, &tls_cert, &tls_key) {
                (None, _, _) => None,
                (Some(_), Some(c), Some(k)) => {
                    if auth.is_open() {
                        die(2, "--listen needs --token-file (TCP requires TLS and a token)");
                    }
                    let read = |p: &PathBuf| {
                        std::fs::read(p).unwrap_or_else(|e| die(2, format!("cannot read {}: {e}", p.display())))
                    };
                    // A handshake not done in 10 s is dropped: half-open ones otherwise held their
                    // descriptors for minutes (310 of them starved the port of descriptors).
                    let tls = tonic::transport::ServerTlsConfig::new()
                        .identity(tonic::transport::Identity::from_pem(read(c), read(k)))
                        .timeout(Duration::from_secs(10));
                    Some(match &client_ca {
                        Some(ca) => tls.client_ca_root(tonic::transport::Certificate::from_pem(read(ca))),
                        None => tls,
                    })
                }
                (Some(_), _, _) => die(2, "--listen needs --tls-cert and --tls-key (TCP requires TLS and a token)"),
            };
            if client_ca.is_some() && tls.is_none() {
                die(2, "--client-ca is for --listen (TLS)");
            }
            if !(100..=3_600_000).contains(&heartbeat_ms) {
                die(2, "--heartbeat-ms must be within 100..=3600000");
            }
            raise_nofile();
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap_or_else(|e| die(1, e));
            rt.block_on(serve(
                listen,
                tls,
                unix,
                metrics_address,
                Settings {
                    auth: Arc::new(auth),
                    heartbeat: Duration::from_millis(heartbeat_ms),
                    node_certs: require_node_certs,
                    forget_after: Duration::from_secs(forget_after_s),
                    max_nodes_per_token: max_nodes_per_token as usize,
                    max_state_bytes: (max_state_mib as usize) << 20,
                },
            ));
        }
    }
}

async fn serve(
    listen: Option<SocketAddr>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    unix: Option<PathBuf>,
    metrics_address: Option<SocketAddr>,
    settings: Settings,
) {
    let cluster = Cluster::new(settings);
    let mut tasks = Vec::new();
    let router = |c: &Arc<Cluster>| {
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .add_service(c.capacity_service())
            .add_service(c.cluster_service())
    };
    if let (Some(addr), Some(tls)) = (listen, tls) {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| die(1, format!("cannot listen on {addr}: {e}")));
        let bound = l.local_addr().unwrap_or(addr);
        tracing::info!(address = %bound, "serving node capacity (TLS)");
        eprintln!("listening on {bound}");
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
        let mut b = tonic::transport::Server::builder()
            .tls_config(tls)
            .unwrap_or_else(|e| die(2, format!("bad TLS certificate or key: {e}")))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)));
        let r = b.add_service(cluster.capacity_service()).add_service(cluster.cluster_service());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = r.serve_with_incoming(incoming).await {
                die(1, format!("serving {bound}: {e}"));
            }
        }));
    }
    if let Some(p) = unix {
        let _ = std::fs::remove_file(&p);
        let l = tokio::net::UnixListener::bind(&p)
            .unwrap_or_else(|e| die(1, format!("cannot listen on {}: {e}", p.display())));
        tracing::info!(socket = %p.display(), "serving node capacity (Unix socket)");
        let r = router(&cluster);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = r.serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l)).await {
                die(1, format!("serving {}: {e}", p.display()));
            }
        }));
    }
    if let Some(addr) = metrics_address {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| die(1, format!("cannot listen on {addr}: {e}")));
        let bound = l.local_addr().unwrap_or(addr);
        tracing::info!(address = %bound, "serving metrics");
        eprintln!("metrics on {bound}");
        tasks.push(tokio::spawn(metrics::serve(l, cluster.clone())));
    }
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap_or_else(|e| die(1, e));
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping");
}

//! How the agent reaches the central scheduler it reports capacity to (`scheduler_*` settings).

use std::path::PathBuf;
use std::time::Duration;

/// Where the scheduler listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `unix:///path`: a local socket (TLS not needed; a token is sent when configured).
    Unix(PathBuf),
    /// `https://host:port`: TLS with the configured CA, and a bearer token.
    Https { uri: String, host: String },
}

/// Why a scheduler endpoint is refused; each names the value and what is accepted.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("{0:?}: a unix endpoint needs an absolute path (unix:///run/sched.sock)")]
    RelativePath(String),
    #[error("{0:?}: expected https://host:port")]
    NoPort(String),
    #[error("{0:?}: plain http is not allowed; use https:// (TLS and a token) or unix://")]
    PlainHttp(String),
    #[error("{0:?} is not https://host:port or unix:///path")]
    Scheme(String),
}

impl Endpoint {
    /// Parses `unix:///path` or `https://host:port`. Plain `http://` is refused: capacity and
    /// requests are not sent over the network unauthenticated.
    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        if let Some(p) = s.strip_prefix("unix://") {
            if !p.starts_with('/') {
                return Err(EndpointError::RelativePath(s.to_string()));
            }
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        if let Some(rest) = s.strip_prefix("https://") {
            let authority = rest.split('/').next().unwrap_or("");
            let host = if let Some(v6) = authority.strip_prefix('[') {
                v6.split(']').next().unwrap_or("").to_string()
            } else {
                authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_string()
            };
            if host.is_empty() || !authority.contains(':') {
                return Err(EndpointError::NoPort(s.to_string()));
            }
            return Ok(Endpoint::Https { uri: format!("https://{authority}"), host });
        }
        if s.starts_with("http://") {
            return Err(EndpointError::PlainHttp(s.to_string()));
        }
        Err(EndpointError::Scheme(s.to_string()))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Https { uri, .. } => f.write_str(uri),
        }
    }
}

/// How to reach the scheduler and how to behave.
#[derive(Clone, Debug)]
pub struct ReportConfig {
    pub endpoint: Endpoint,
    /// PEM file of the CA that signed the scheduler's certificate (https).
    pub ca: Option<PathBuf>,
    /// File holding the bearer token (read at every connection, so it can be rotated).
    pub token_file: Option<PathBuf>,
    /// The name the scheduler's certificate is checked against (default: the endpoint's host).
    pub server_name: Option<String>,
    /// A client certificate and its key (PEM files) for schedulers that require mutual TLS; read at
    /// every connection, so they can be renewed.
    pub identity: Option<(PathBuf, PathBuf)>,
    pub node: String,
    pub heartbeat: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl ReportConfig {
    pub fn new(endpoint: Endpoint, node: String) -> ReportConfig {
        ReportConfig {
            endpoint,
            ca: None,
            token_file: None,
            server_name: None,
            identity: None,
            node,
            heartbeat: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(10),
        }
    }
}

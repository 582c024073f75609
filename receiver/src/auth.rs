//! Who may talk to the receiver: bearer tokens, each with a role, read from a token file that is
//! re-read when it changes (so a node's token can be added or revoked without a restart).
//!
//! The token file, one entry per line (lines starting with `#` are comments):
//!
//! ```text
//! TOKEN             cluster: any node's capacity stream, the cluster view, requests to nodes
//! reader TOKEN      the cluster view only (Cluster.Status and Cluster.Watch)
//! nodes TOKEN       any node's capacity stream, nothing else (one Secret shared by a DaemonSet)
//! node NAME TOKEN   only node NAME's capacity stream
//! ```

use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Shortest token accepted (the receiver's own are 64 hex digits).
pub const MIN_TOKEN: usize = 16;
/// How often, at most, the token file is looked at for changes.
const RECHECK: Duration = Duration::from_secs(1);

/// What a token allows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Everything: any node's stream, the cluster view, requests to nodes.
    Cluster,
    /// The cluster view only.
    Reader,
    /// Any node's capacity stream, nothing else.
    Nodes,
    /// Only this node's capacity stream.
    Node(String),
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Cluster => f.write_str("cluster"),
            Role::Reader => f.write_str("reader"),
            Role::Nodes => f.write_str("nodes"),
            Role::Node(n) => write!(f, "node {n}"),
        }
    }
}

/// A parsed token file.
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    entries: Vec<(String, Role)>,
}

/// Constant-time comparison (a token check must not tell how much of a guess was right).
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a token, a token file or a new token is refused: one variant per failed check or action.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("a token must have at least {MIN_TOKEN} characters")]
    TooShort,
    #[error("a token must be printable ASCII without spaces")]
    NotPrintable,
    #[error("line {0}: expected `TOKEN`, `reader TOKEN`, `nodes TOKEN` or `node NAME TOKEN`")]
    BadLine(usize),
    #[error("line {line}: {error}")]
    BadToken { line: usize, error: Box<TokenError> },
    #[error("line {0}: this token is already listed")]
    ListedTwice(usize),
    #[error("cannot read {}: {error}", path.display())]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{}: {error}", path.display())]
    Parse { path: PathBuf, error: Box<TokenError> },
    #[error("{} lists no token (at least one token is needed)", .0.display())]
    Empty(PathBuf),
    #[error("{0:?} is not a node name")]
    NotANodeName(String),
    #[error("{} already has a token for node {node} (delete its line to revoke it first)", path.display())]
    NodeHasToken { path: PathBuf, node: String },
    #[error(transparent)]
    Random(#[from] crate::certs::CertError),
    #[error("cannot write {}: {error}", path.display())]
    Write { path: PathBuf, error: std::io::Error },
}

/// A text field longer than its bound.
#[derive(Debug, thiserror::Error)]
#[error("{len} bytes (at most {max})")]
pub struct TextTooLong {
    pub len: usize,
    pub max: usize,
}

fn valid_token(t: &str) -> Result<(), TokenError> {
    if t.len() < MIN_TOKEN {
        return Err(TokenError::TooShort);
    }
    if !t.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable);
    }
    Ok(())
}

/// Whether `n` can be a node name (as the receiver accepts it in a Hello).
pub fn valid_node(n: &str) -> bool {
    !n.is_empty() && n.len() <= crate::MAX_NAME && !n.chars().any(|c| c.is_control() || c.is_whitespace())
}

impl Tokens {
    /// Parses a token file's text; errors name the line.
    pub fn parse(text: &str) -> Result<Tokens, TokenError> {
        let mut entries: Vec<(String, Role)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let (token, role) = match words.as_slice() {
                [t] => (*t, Role::Cluster),
                ["reader", t] => (*t, Role::Reader),
                ["nodes", t] => (*t, Role::Nodes),
                ["node", n, t] if valid_node(n) => (*t, Role::Node(n.to_string())),
                _ => return Err(TokenError::BadLine(i + 1)),
            };
            valid_token(token).map_err(|e| TokenError::BadToken { line: i + 1, error: Box::new(e) })?;
            if entries.iter().any(|(t, _)| t == token) {
                return Err(TokenError::ListedTwice(i + 1));
            }
            entries.push((token.to_string(), role));
        }
        Ok(Tokens { entries })
    }

    /// Builds a set from bare (cluster) tokens.
    pub fn cluster(tokens: impl IntoIterator<Item = String>) -> Tokens {
        Tokens { entries: tokens.into_iter().map(|t| (t, Role::Cluster)).collect() }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The role of a presented token. Every entry is compared, in constant time each, so the time
    /// taken tells nothing about which entry (if any) came close.
    pub fn role(&self, presented: &str) -> Option<&Role> {
        let mut found = None;
        for (t, r) in &self.entries {
            if same(t.as_bytes(), presented.as_bytes()) {
                found = Some(r);
            }
        }
        found
    }

    /// Whether a node entry exists for `node`.
    pub fn has_node(&self, node: &str) -> bool {
        self.entries.iter().any(|(_, r)| matches!(r, Role::Node(n) if n == node))
    }
}

/// What identifies a version of the token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

fn stamp(p: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p)?;
    Ok(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
    })
}

/// The tokens in force, and the file they come from (if any).
#[derive(Debug)]
pub struct Auth {
    file: Option<PathBuf>,
    /// No token file and no tokens: fixed at construction (a file never reloads to empty).
    open: bool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    tokens: Arc<Tokens>,
    /// Bumped at every change, so a stream can tell cheaply whether to check its token again.
    generation: u64,
    /// The version of the file in force (or last refused).
    stamp: Option<Stamp>,
    /// The version seen at the last look: a change is read once it has held for a whole look, so a
    /// file caught half-written is not taken for one with fewer tokens.
    seen: Option<Stamp>,
    checked: Instant,
}

impl Auth {
    /// Fixed tokens (empty: no authentication, for Unix sockets only).
    pub fn fixed(tokens: Tokens) -> Auth {
        Auth {
            file: None,
            open: tokens.is_empty(),
            state: Mutex::new(State {
                tokens: Arc::new(tokens),
                generation: 0,
                stamp: None,
                seen: None,
                checked: Instant::now(),
            }),
        }
    }

    /// Tokens read from `file` now (an error if it cannot be read, does not parse, or lists none), and
    /// again whenever it changes. A later version that cannot be read or parsed, or lists no token,
    /// is reported and the tokens before it stay in force.
    pub fn from_file(file: &Path) -> Result<Auth, TokenError> {
        let st = stamp(file).map_err(|error| TokenError::Read { path: file.to_owned(), error })?;
        let tokens = read(file)?;
        Ok(Auth {
            file: Some(file.to_owned()),
            open: false,
            state: Mutex::new(State {
                tokens: Arc::new(tokens),
                generation: 0,
                stamp: Some(st),
                seen: Some(st),
                checked: Instant::now(),
            }),
        })
    }

    /// The tokens in force and their generation (the file is looked at, at most once a second, and
    /// re-read once a change has held from one look to the next: in force within about 2 s).
    pub fn current(&self) -> (Arc<Tokens>, u64) {
        let mut s = self.state.lock();
        if let Some(f) = &self.file {
            if s.checked.elapsed() >= RECHECK {
                s.checked = Instant::now();
                let now = stamp(f).ok();
                let settled = now == s.seen;
                s.seen = now;
                if now != s.stamp && settled {
                    match (now, read(f)) {
                        (Some(st), Ok(t)) => {
                            tracing::info!(file = %f.display(), tokens = t.len(), "token file reloaded");
                            s.tokens = Arc::new(t);
                            s.generation += 1;
                            s.stamp = Some(st);
                        }
                        (_, Err(e)) => {
                            tracing::warn!(file = %f.display(), error = %e, "token file not reloaded; the previous tokens stay in force");
                            s.stamp = now;
                        }
                        (None, Ok(_)) => {}
                    }
                }
            }
        }
        (s.tokens.clone(), s.generation)
    }

    /// Makes the next `current` look at the file again (tests).
    #[cfg(test)]
    pub(crate) fn recheck_now(&self) {
        let mut s = self.state.lock();
        s.checked = Instant::now() - RECHECK;
    }

    /// Whether authentication is off (no token file and no tokens: Unix sockets only).
    pub fn is_open(&self) -> bool {
        self.open
    }
}

/// A text field within `max` bytes.
pub(crate) fn valid_text(v: &str, max: usize) -> Result<(), TextTooLong> {
    if v.len() > max {
        return Err(TextTooLong { len: v.len(), max });
    }
    Ok(())
}

fn read(file: &Path) -> Result<Tokens, TokenError> {
    let text = std::fs::read_to_string(file).map_err(|error| TokenError::Read { path: file.to_owned(), error })?;
    let t = Tokens::parse(&text).map_err(|e| TokenError::Parse { path: file.to_owned(), error: Box::new(e) })?;
    if t.is_empty() {
        return Err(TokenError::Empty(file.to_owned()));
    }
    Ok(t)
}

/// Adds an entry for `role` with a fresh token to `file` (made 0600 if absent; replaced by
/// write-and-rename, so a reader never sees half a file) and returns the token. Refuses a second
/// token for the same node (revoke the first by deleting its line).
pub fn add_token(file: &Path, role: &Role) -> Result<String, TokenError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let old = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(TokenError::Read { path: file.to_owned(), error }),
    };
    let parsed = Tokens::parse(&old).map_err(|e| TokenError::Parse { path: file.to_owned(), error: Box::new(e) })?;
    if let Role::Node(n) = role {
        if !valid_node(n) {
            return Err(TokenError::NotANodeName(n.clone()));
        }
        if parsed.has_node(n) {
            return Err(TokenError::NodeHasToken { path: file.to_owned(), node: n.clone() });
        }
    }
    let token = crate::certs::token()?;
    let line = match role {
        Role::Cluster => token.clone(),
        Role::Reader => format!("reader {token}"),
        Role::Nodes => format!("nodes {token}"),
        Role::Node(n) => format!("node {n} {token}"),
    };
    let mut text = old;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&line);
    text.push('\n');
    let mode = std::fs::metadata(file).map(|m| m.permissions().mode() & 0o777).unwrap_or(0o600);
    let tmp = file.with_extension(format!("tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        std::io::Write::write_all(&mut f, text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, file)
    };
    write().map_err(|error| {
        let _ = std::fs::remove_file(&tmp);
        TokenError::Write { path: file.to_owned(), error }
    })?;
    Ok(token)
}

//! The metrics endpoint's certificate, key and bearer token, followed on disk: a Secret mounted
//! into the pod is replaced in place when cert-manager rotates it (or an admin does), and reading
//! them once at start broke every scrape until the agent restarted. Each is looked at again at
//! most once a second, when a connection or a request needs it; a file that cannot be read or
//! parsed keeps the last good one in use, said once in the log.

use parking_lot::Mutex;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

/// How often the files are looked at, at most.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// When `paths` were last changed (None where one cannot be read).
fn stamps<const N: usize>(paths: [&Path; N]) -> [Option<SystemTime>; N] {
    paths.map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
}

/// A value loaded from files, loaded again when they change.
struct Followed<T, const N: usize> {
    paths: [PathBuf; N],
    load: fn(&[PathBuf; N]) -> Result<T, String>,
    /// The value in use, the files' stamps it came from, and when they were last looked at.
    state: Mutex<(T, [Option<SystemTime>; N], Instant)>,
}

impl<T: Clone, const N: usize> Followed<T, N> {
    fn new(paths: [PathBuf; N], load: fn(&[PathBuf; N]) -> Result<T, String>) -> Result<Self, String> {
        let first = load(&paths)?;
        let now = stamps(paths.each_ref().map(PathBuf::as_path));
        Ok(Followed { paths, load, state: Mutex::new((first, now, Instant::now())) })
    }

    /// The value now: loaded again first where the files changed since.
    fn get(&self) -> T {
        let mut st = self.state.lock();
        if st.2.elapsed() >= LOOK_EVERY {
            st.2 = Instant::now();
            let now = stamps(self.paths.each_ref().map(PathBuf::as_path));
            if now != st.1 {
                st.1 = now;
                match (self.load)(&self.paths) {
                    Ok(v) => {
                        st.0 = v;
                        tracing::info!(files = ?self.paths, "metrics endpoint: changed files loaded again");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics endpoint: changed files cannot be used; the last good ones stay")
                    }
                }
            }
        }
        st.0.clone()
    }
}

/// The serving certificate and key, followed on disk.
pub struct Certificate(Followed<Arc<CertifiedKey>, 2>);

impl std::fmt::Debug for Certificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Certificate").field(&self.0.paths).finish()
    }
}

fn load_certified(paths: &[PathBuf; 2]) -> Result<Arc<CertifiedKey>, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let [cert, key] = paths;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let provider = tokio_rustls::rustls::crypto::ring::default_provider();
    let signer = provider.key_provider.load_private_key(key).map_err(|e| format!("{}: {e}", paths[1].display()))?;
    let ck = CertifiedKey::new(certs, signer);
    ck.keys_match().map_err(|e| format!("{} and {}: {e}", paths[0].display(), paths[1].display()))?;
    Ok(Arc::new(ck))
}

impl Certificate {
    pub fn new(cert: &Path, key: &Path) -> Result<Certificate, String> {
        Followed::new([cert.to_owned(), key.to_owned()], load_certified).map(Certificate)
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get())
    }
}

/// The bearer token, followed on disk.
pub struct Token(Followed<Option<String>, 1>);

fn load_token(paths: &[PathBuf; 1]) -> Result<Option<String>, String> {
    crate::report::read_token(&paths[0]).map_err(|e| e.to_string())
}

impl Token {
    pub fn new(path: &Path) -> Result<Token, String> {
        Followed::new([path.to_owned()], load_token).map(Token)
    }

    /// The token now (None: the file holds none).
    pub fn get(&self) -> Option<String> {
        self.0.get()
    }
}

//! Unix sockets for gRPC: binding a server's socket safely, accepting connections that survive
//! running out of file descriptors, and dialling a socket as a channel. The agent's API, the device
//! plugin, the DRA driver and the capacity reporter use them.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Why a server's socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another server answers on the socket.
    #[error("another agent is serving on {0}")]
    Taken(PathBuf),
    /// The socket's directory, a stale socket's removal, or the listening itself failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Binds a server's socket: refuses if another server answers on it, removes a stale one, and leaves
/// the socket readable and writable by its owner and group only (mode 0660).
pub fn bind(path: &Path) -> Result<tokio::net::UnixListener, BindError> {
    fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> BindError + 'a {
        move |source| BindError::Io { what, path: path.to_owned(), source }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(BindError::Taken(path.to_owned()));
        }
        std::fs::remove_file(path).map_err(io("cannot remove the stale socket", path))?;
    }
    // The socket is created with the umask's permissions: make it 0660 from the start (no window in
    // which others could connect). The agent is single-threaded at this point.
    // SAFETY: umask has no preconditions.
    let old = unsafe { libc::umask(0o117) };
    let l = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let l = l.map_err(io("cannot listen on", path))?;
    l.set_nonblocking(true).map_err(io("cannot listen on", path))?;
    tokio::net::UnixListener::from_std(l).map_err(io("cannot listen on", path))
}

/// The connections of a listening socket, for a tonic server, that survive running out of file
/// descriptors: on EMFILE or ENFILE the accept loop waits (10 ms, doubling up to 1 s) and says so at
/// most once a minute, instead of trying again at once (which spun at full CPU and starved the
/// agent). Ends, closing the socket, as soon as the server drops the stream (not at the next
/// connection: a replaced server must not keep listening).
pub fn incoming(
    l: tokio::net::UnixListener,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::net::UnixStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let floor = std::time::Duration::from_millis(10);
        let mut wait = floor;
        let mut said: Option<std::time::Instant> = None;
        loop {
            let accepted = tokio::select! {
                a = l.accept() => a,
                _ = tx.closed() => return,
            };
            match accepted {
                Ok((s, _)) => {
                    wait = floor;
                    if tx.send(Ok(s)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    if tx.is_closed() {
                        return;
                    }
                    if said.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(60)) {
                        tracing::warn!(error = %e, "cannot accept a connection (out of file descriptors? see max_slices and LimitNOFILE); waiting");
                        said = Some(std::time::Instant::now());
                    }
                    tokio::time::sleep(wait).await;
                    let fds = matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE));
                    wait = if fds { (wait * 2).min(std::time::Duration::from_secs(1)) } else { floor };
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Removes the API socket when dropped: a start that fails after binding it (no NVML, say) leaves
/// nothing behind that would make `vgpuctl` report "connection refused" instead of "no agent".
pub struct SocketFile(pub PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A gRPC channel to the Unix socket at `path` (the agent's, kubelet's, a local scheduler's).
pub async fn unix_channel(path: &Path) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let p: PathBuf = path.to_owned();
    // The URI is required by the API but unused: the connector dials the socket.
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(std::time::Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = p.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
        }))
        .await
}

/// The inode of `p` (None: not there): a socket made again has another.
pub fn inode(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.ino())
}

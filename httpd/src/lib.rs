//! The small HTTP endpoints of the agent and the receiver (`/metrics`, `/healthz`, `/livez`),
//! served by hyper: HTTP/1.1 with keep-alive (Prometheus scrapes over one connection), at most
//! [`Limits::connections`] connections at once (further ones wait in the listen backlog), a
//! connection closed when its request head does not arrive within [`Limits::header`] or it stays
//! idle for [`Limits::idle`], and TLS where an acceptor is given. What a request gets is the
//! caller's [`Handler`], a plain function of the method, path and `Authorization` header.
#![deny(clippy::too_many_lines)]

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What the server allows a client.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once.
    pub connections: usize,
    /// Time for a request's head (and a TLS handshake) to arrive.
    pub header: Duration,
    /// Time a connection may stay without a byte either way.
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { connections: 64, header: Duration::from_secs(5), idle: Duration::from_secs(120) }
    }
}

/// A request as the endpoints see it.
#[derive(Debug)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub authorization: Option<&'a str>,
}

/// An answer: status code, content type and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }
}

pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Serves `handler` on `listener` (over TLS with `tls`) until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: Limits,
    handler: Handler,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections.max(1)));
    loop {
        // A slot first: at the bound, connections wait in the listen backlog.
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // Out of file descriptors, most often: wait rather than spin.
                tracing::debug!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (tls, handler) = (tls.clone(), handler.clone());
        tokio::spawn(async move {
            let _slot = slot;
            match tls {
                Some(t) => {
                    if let Ok(Ok(s)) = tokio::time::timeout(limits.header, t.accept(sock)).await {
                        connection(s, limits, handler).await;
                    }
                }
                None => connection(sock, limits, handler).await,
            }
        });
    }
}

/// Serves one connection: its requests in turn, until the client closes it or it stays idle.
async fn connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: S, limits: Limits, handler: Handler) {
    let started = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = Watched { inner: io, last: last.clone(), started };
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let handler = handler.clone();
        // The handler may block (the agent's metrics read NVML and /proc): off the runtime's
        // threads.
        let method = req.method().as_str().to_string();
        let path = req.uri().path().to_string();
        let auth = req.headers().get(hyper::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(String::from);
        async move {
            let r = tokio::task::spawn_blocking(move || {
                handler(&Request { method: &method, path: &path, authorization: auth.as_deref() })
            })
            .await
            .unwrap_or_else(|_| Response::text(500, "internal error\n"));
            Ok::<_, std::convert::Infallible>(answer(r))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header)
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(Duration::from_secs(1).min(limits.idle));
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "HTTP connection ended");
                }
                return;
            }
            _ = tick.tick() => {
                let quiet = started.elapsed().saturating_sub(Duration::from_millis(last.load(Relaxed)));
                if quiet >= limits.idle {
                    // Closes once the request in progress, if any, is answered.
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

fn answer(r: Response) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .status(r.status)
        .header(hyper::header::CONTENT_TYPE, r.content_type)
        .body(Full::new(Bytes::from(r.body)))
        .unwrap_or_else(|_| hyper::Response::new(Full::new(Bytes::from_static(b"internal error\n"))))
}

/// A connection's stream that notes when a byte last went either way (milliseconds after
/// `started`), for the idle timeout.
struct Watched<S> {
    inner: S,
    last: Arc<AtomicU64>,
    started: Instant,
}

impl<S> Watched<S> {
    fn touch(&self) {
        self.last.store(self.started.elapsed().as_millis() as u64, Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;

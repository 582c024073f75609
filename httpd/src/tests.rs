//! The server over real sockets: keep-alive, the connection bound, the header and idle timeouts.

use super::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

/// A server on a free port of 127.0.0.1 answering every path with its name; its address.
fn start(rt: &tokio::runtime::Runtime, limits: Limits) -> String {
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let handler: Handler = Arc::new(|r: &Request| match r.authorization {
        Some(a) => Response::text(200, format!("{} {}\n", r.path, a)),
        None => Response::text(200, format!("{}\n", r.path)),
    });
    rt.spawn(serve(l, None, limits, handler));
    addr
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// One response read off a kept-alive connection: its status line and body.
fn response(r: &mut BufReader<TcpStream>) -> (String, String) {
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    (status.trim_end().to_string(), String::from_utf8(body).unwrap())
}

#[test]
fn requests_share_a_kept_alive_connection() {
    let rt = runtime();
    let addr = start(&rt, Limits::default());
    let c = TcpStream::connect(&addr).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut w = c;
    write!(w, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(response(&mut r), ("HTTP/1.1 200 OK".to_string(), "/metrics\n".to_string()));
    write!(w, "GET /healthz?x=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).1, "/healthz Bearer t0k\n", "the same connection, the query left out");
    // Connection: close is honoured: the server closes after answering.
    write!(w, "GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).1, "/last\n");
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}

#[test]
fn connections_beyond_the_bound_wait_for_a_slot() {
    let rt = runtime();
    let addr = start(&rt, Limits { connections: 1, ..Limits::default() });
    let first = TcpStream::connect(&addr).unwrap();
    let mut second = TcpStream::connect(&addr).unwrap();
    second.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    write!(second, "GET /second HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut b = [0u8; 1];
    let e = second.read(&mut b).unwrap_err();
    assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
    // The first goes: the second is served.
    drop(first);
    second.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = String::new();
    second.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK") && out.ends_with("/second\n"), "{out}");
}

#[test]
fn a_slow_head_and_an_idle_connection_are_closed() {
    let rt = runtime();
    let limits = Limits { connections: 4, header: Duration::from_millis(300), idle: Duration::from_millis(800) };
    let addr = start(&rt, limits);
    // A head that never ends: closed after the header timeout (a 408 or nothing, then EOF).
    let mut slow = TcpStream::connect(&addr).unwrap();
    write!(slow, "GET /slow HTTP/1.1\r\n").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    let mut out = Vec::new();
    slow.read_to_end(&mut out).unwrap();
    assert!(t.elapsed() < Duration::from_secs(4), "closed by the header timeout");
    assert!(!String::from_utf8_lossy(&out).contains("/slow"), "never answered");
    // A kept-alive connection that goes quiet: closed after the idle timeout.
    let c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut w = c;
    write!(w, "GET /once HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).1, "/once\n");
    let t = Instant::now();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty() && t.elapsed() < Duration::from_secs(4), "closed when idle");
}

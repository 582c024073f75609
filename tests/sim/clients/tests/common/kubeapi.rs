//! The HTTP side of a fake Kubernetes API server: a listener on 127.0.0.1 whose connections are
//! read as HTTP/1.1 requests (kube-rs keeps them alive and sends a Content-Length) and answered with
//! JSON by the test's handler (method, target with its query, body) -> (status code, body).
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;

/// Serves `handle` and returns the server's URL.
pub fn serve(handle: impl Fn(&str, &str, &[u8]) -> (u16, Value) + Send + Sync + 'static) -> String {
    let handle = Arc::new(handle);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in l.incoming().flatten() {
            let handle = handle.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut w = conn;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut parts = line.split_whitespace();
                    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                    let mut len = 0;
                    loop {
                        let mut h = String::new();
                        r.read_line(&mut h).unwrap();
                        if h.trim().is_empty() {
                            break;
                        }
                        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    let (code, resp) = handle(method, target, &body);
                    let text = resp.to_string();
                    write!(
                        w,
                        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
                        text.len()
                    )
                    .unwrap();
                }
            });
        }
    });
    addr
}

/// A Kubernetes `Status` answer.
pub fn status(code: u16, reason: &str) -> (u16, Value) {
    (
        code,
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code, "message": reason}),
    )
}

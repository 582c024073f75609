//! systemd's service notifications (sd_notify(3)), without libsystemd: `READY=1` once the first
//! monitoring pass is published, `WATCHDOG=1` every third of `WatchdogSec=` while the monitoring has
//! not stalled (so systemd restarts an agent stuck in a call that never returns), `STATUS=` with a
//! one-line summary, `STOPPING=1` at shutdown. Nothing at all where `NOTIFY_SOCKET` is unset.

use crate::agent::Agent;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;
use std::time::Duration;

pub struct Notifier {
    sock: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notification socket systemd named; None where it named none (or one this cannot use, with
    /// a warning).
    pub fn from_env() -> Option<Notifier> {
        Notifier::new(&std::env::var_os("NOTIFY_SOCKET")?)
    }

    /// A socket path, or an abstract name written `@name` (as systemd does).
    pub fn new(path: &std::ffi::OsStr) -> Option<Notifier> {
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path);
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => <SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name),
            None => SocketAddr::from_pathname(path),
        };
        match (addr, UnixDatagram::unbound()) {
            (Ok(addr), Ok(sock)) => Some(Notifier { sock, addr }),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(socket = ?path, error = %e, "cannot notify systemd");
                None
            }
        }
    }

    /// Sends one notification (newline-separated assignments); a failure is logged, not fatal.
    pub fn send(&self, msg: &str) {
        if let Err(e) = self.sock.send_to_addr(msg.as_bytes(), &self.addr) {
            tracing::debug!(error = %e, "systemd notification not sent");
        }
    }
}

/// The watchdog interval systemd asks for (`WATCHDOG_USEC`, for this process when `WATCHDOG_PID`
/// names one).
fn watchdog() -> Option<Duration> {
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok().and_then(|p| p.trim().parse::<u32>().ok()) {
        if pid != std::process::id() {
            return None;
        }
    }
    let us: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    (us > 0).then(|| Duration::from_micros(us))
}

/// One line for `systemctl status`.
fn summary(agent: &Agent) -> String {
    if let Some(why) = agent.stalled() {
        return why;
    }
    if !agent.ready.load(Acquire) {
        return "starting: GPU discovery and the first monitoring pass".into();
    }
    let st = agent.status();
    let unhealthy = st.gpus.iter().filter(|g| !g.healthy).count();
    let mut s = format!("{} GPUs, {} slices", st.gpus.len(), st.slices.len());
    if unhealthy > 0 {
        s += &format!(", {unhealthy} unhealthy");
    }
    if !st.escapes.is_empty() {
        s += &format!(", {} escapes", st.escapes.len());
    }
    if !st.warnings.is_empty() {
        s += &format!(", {} warnings", st.warnings.len());
    }
    s
}

/// Notifies systemd until `stop`: ready, the watchdog, the status line.
pub async fn run(agent: Arc<Agent>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let Some(n) = Notifier::from_env() else { return };
    let dog = watchdog();
    let tick = dog.map_or(Duration::from_secs(5), |d| (d / 3).clamp(Duration::from_millis(50), Duration::from_secs(5)));
    let mut ready = false;
    let mut last = String::new();
    loop {
        let mut msg = Vec::new();
        if !ready && agent.ready.load(Acquire) {
            ready = true;
            msg.push("READY=1".to_string());
        }
        // Not while stalled: then systemd, with WatchdogSec=, restarts the agent.
        if dog.is_some() && agent.stalled().is_none() {
            msg.push("WATCHDOG=1".into());
        }
        let status = summary(&agent);
        if status != last {
            msg.push(format!("STATUS={status}"));
            last = status;
        }
        if !msg.is_empty() {
            n.send(&msg.join("\n"));
        }
        let wait = if ready { tick } else { tick.min(Duration::from_millis(100)) };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {
                n.send("STOPPING=1\nSTATUS=stopping");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_reach_a_path_and_an_abstract_socket() {
        let dir = std::env::temp_dir().join(format!("vgpu-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let by_path = UnixDatagram::bind(&path).unwrap();
        let name = format!("vgpu-notify-test-{}", std::process::id());
        let addr = <SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name.as_bytes()).unwrap();
        let abstract_ = UnixDatagram::bind_addr(&addr).unwrap();
        let mut buf = [0u8; 64];
        Notifier::new(path.as_os_str()).unwrap().send("READY=1");
        let n = by_path.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        Notifier::new(std::ffi::OsStr::new(&format!("@{name}"))).unwrap().send("WATCHDOG=1\nSTATUS=x");
        let n = abstract_.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1\nSTATUS=x");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

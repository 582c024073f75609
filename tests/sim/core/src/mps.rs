//! The simulated MPS's wire and settings: how a client's driver and `nvidia-cuda-mps-control` reach
//! the control daemon (a Unix socket `control` in the pipe directory: one line asked, the answer
//! read to the end), what the daemon answers a client, and the client's environment.
//!
//! The pipe directory is `CUDA_MPS_PIPE_DIRECTORY`, else `<state>/nvidia-mps` (standing for the
//! driver's `/tmp/nvidia-mps`, so that a simulated node never meets a real daemon).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The control socket's name in the pipe directory.
pub const CONTROL: &str = "control";

/// The pipe directory a process uses.
pub fn pipe_dir() -> PathBuf {
    match std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => crate::config::state_dir().join("nvidia-mps"),
    }
}

/// The log directory: `CUDA_MPS_LOG_DIRECTORY`, else `<state>/nvidia-mps-log`.
pub fn log_dir() -> PathBuf {
    match std::env::var_os("CUDA_MPS_LOG_DIRECTORY").filter(|v| !v.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => crate::config::state_dir().join("nvidia-mps-log"),
    }
}

/// Sends `line` to the control daemon of pipe directory `dir`; its answer (without the last
/// newline). An error when no daemon listens there.
pub fn ask(dir: &Path, line: &str) -> std::io::Result<String> {
    let mut s = UnixStream::connect(dir.join(CONTROL))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("{line}\n").as_bytes())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    Ok(answer.trim_end_matches('\n').to_string())
}

/// What the daemon answers a client: the server it is to use (its slot in the node's state and
/// its PID), the server's active thread percentage and pinned device memory limits (node GPU
/// index, bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    pub slot: usize,
    pub pid: u32,
    pub pct: u32,
    pub limits: Vec<(usize, u64)>,
}

impl Server {
    /// `server SLOT PID PCT [GPU=BYTES,...]`.
    pub fn line(&self) -> String {
        let limits: Vec<String> = self.limits.iter().map(|(g, b)| format!("{g}={b}")).collect();
        format!("server {} {} {} {}", self.slot, self.pid, self.pct, limits.join(",")).trim_end().to_string()
    }

    pub fn parse(line: &str) -> Option<Server> {
        let mut w = line.strip_prefix("server ")?.split(' ');
        let (slot, pid, pct) = (w.next()?.parse().ok()?, w.next()?.parse().ok()?, w.next()?.parse().ok()?);
        let mut limits = Vec::new();
        for pair in w.next().unwrap_or("").split(',').filter(|p| !p.is_empty()) {
            let (g, b) = pair.split_once('=')?;
            limits.push((g.parse().ok()?, b.parse().ok()?));
        }
        Some(Server { slot, pid, pct, limits })
    }
}

/// A percentage as MPS takes it (`50`, `33.3`): 1 to 100, rounded down to whole percent (at least
/// 1).
pub fn parse_pct(v: &str) -> Option<u32> {
    let f: f64 = v.trim().parse().ok()?;
    (f > 0.0 && f <= 100.0).then(|| (f as u32).max(1))
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: `0=1G,1=512M` (per device ordinal) or `2G` (every device:
/// ordinal None), sizes as `vgpu_units` reads them. None where it does not parse.
pub fn parse_limits(v: &str) -> Option<Vec<(Option<usize>, u64)>> {
    v.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| match p.split_once('=') {
            Some((d, s)) => Some((Some(d.trim().parse().ok()?), vgpu_units::parse_size(s).ok()?)),
            None => Some((None, vgpu_units::parse_size(p).ok()?)),
        })
        .collect()
}

/// The node GPUs a daemon or server started with `CUDA_VISIBLE_DEVICES` uses: indices or GPU UUIDs
/// (prefixes allowed), every GPU without it; parsing stops at the first it cannot use.
pub fn visible_gpus(cfg: &crate::Config) -> Vec<usize> {
    let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") else { return (0..cfg.gpus.len()).collect() };
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim) {
        let found = match item.parse::<usize>() {
            Ok(i) => (i < cfg.gpus.len()).then_some(i),
            Err(_) => {
                let m: Vec<usize> = (0..cfg.gpus.len()).filter(|&g| cfg.gpus[g].uuid.starts_with(item)).collect();
                (item.starts_with("GPU-") && m.len() == 1).then(|| m[0])
            }
        };
        match found {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_and_the_settings_read_back() {
        let s = Server { slot: 7, pid: 4242, pct: 30, limits: vec![(0, 1 << 30), (2, 512 << 20)] };
        assert_eq!(s.line(), "server 7 4242 30 0=1073741824,2=536870912");
        assert_eq!(Server::parse(&s.line()), Some(s));
        let bare = Server { slot: 1, pid: 2, pct: 100, limits: vec![] };
        assert_eq!(Server::parse(&bare.line()), Some(bare));
        assert_eq!(Server::parse("wait"), None);
        assert_eq!(parse_pct("33.3"), Some(33));
        assert_eq!((parse_pct("0"), parse_pct("101"), parse_pct("x")), (None, None, None));
        assert_eq!(parse_limits("0=1G,1=512M"), Some(vec![(Some(0), 1 << 30), (Some(1), 512 << 20)]));
        assert_eq!(parse_limits("2G"), Some(vec![(None, 2 << 30)]));
        assert_eq!(parse_limits("0=lots"), None);
    }
}

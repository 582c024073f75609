//! The simulated node's `nvidia-cuda-mps-control`, the commands of the real one that vgpu uses:
//!
//! * `-d` starts the daemon in the background, `-f` in the foreground: it listens on `control` in
//!   the pipe directory (`CUDA_MPS_PIPE_DIRECTORY`, see `vgpu_sim::mps`) and logs to
//!   `control.log` in the log directory (`CUDA_MPS_LOG_DIRECTORY`);
//! * without an option it sends each line of its standard input to the daemon as a command and
//!   prints the answers: `get_server_list`, `start_server -uid UID`, `get_client_list PID`,
//!   `set_default_active_thread_percentage P`, `get_default_active_thread_percentage`,
//!   `set_active_thread_percentage PID P`, `set_default_device_pinned_mem_limit DEV SIZE`,
//!   `get_default_device_pinned_mem_limit DEV`, `shutdown_server PID`, `quit`.
//!
//! A client's driver asks `client PID UID` at its `cuInit`: the daemon starts a server for that user
//! where none runs (the server binary beside this one) and answers with it (`vgpu_sim::mps::Server`);
//! where the server runs for another user, it answers `wait` while that server has clients, then
//! replaces it. Settings made after a server started apply to the next server, as MPS's do.
//!
//! Unlike the real daemon, it ends (with its server) once its control socket is gone: a simulated
//! node's scratch directories are removed with the test or benchmark that made them.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use vgpu_sim::mps::{self, Server};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["-d"] => serve(true),
        ["-f"] => serve(false),
        [] => commands(),
        _ => {
            eprintln!("usage: nvidia-cuda-mps-control [-d | -f]");
            std::process::exit(2)
        }
    }
}

/// Each line of standard input as a command to the running daemon.
fn commands() {
    let dir = mps::pipe_dir();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match mps::ask(&dir, line) {
            Ok(a) if !a.is_empty() => println!("{a}"),
            Ok(_) => {}
            Err(e) => {
                eprintln!("Cannot find MPS control daemon process ({}: {e})", dir.join(mps::CONTROL).display());
                std::process::exit(1)
            }
        }
    }
}

/// A server the daemon started.
struct Running {
    child: Child,
    slot: usize,
    uid: u32,
    pct: u32,
    limits: Vec<(usize, u64)>,
    clients: Vec<u32>,
}

impl Running {
    fn server(&self) -> Server {
        Server { slot: self.slot, pid: self.child.id(), pct: self.pct, limits: self.limits.clone() }
    }

    /// Its clients still alive.
    fn live_clients(&mut self) -> &[u32] {
        // SAFETY: kill with signal 0 only checks that the process exists.
        self.clients.retain(|&p| unsafe { libc::kill(p as i32, 0) } == 0);
        &self.clients
    }
}

struct Daemon {
    gpus: Vec<usize>,
    default_pct: u32,
    /// Per device of the daemon (its index among `gpus`), the default pinned memory limit.
    default_limits: BTreeMap<usize, u64>,
    server: Option<Running>,
    log: std::fs::File,
}

fn serve(background: bool) {
    let (dir, logs) = (mps::pipe_dir(), mps::log_dir());
    let made = std::fs::create_dir_all(&dir).and_then(|()| std::fs::create_dir_all(&logs));
    if let Err(e) = made {
        fail(&format!("{} or {}: {e}", dir.display(), logs.display()));
    }
    let path = dir.join(mps::CONTROL);
    if UnixStream::connect(&path).is_ok() {
        fail("An instance of this daemon is already running");
    }
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
    if background {
        // SAFETY: fork in a single-threaded process; the child goes on with its own session.
        match unsafe { libc::fork() } {
            -1 => fail("fork failed"),
            // SAFETY: setsid in the new child, which leads no group.
            0 => unsafe {
                libc::setsid();
            },
            _ => std::process::exit(0),
        }
    }
    let node = vgpu_sim::Node::global().unwrap_or_else(|e| fail(e));
    let log = std::fs::OpenOptions::new().create(true).append(true).open(logs.join("control.log"));
    let log = log.unwrap_or_else(|e| fail(&format!("{}: {e}", logs.display())));
    let mut d = Daemon {
        gpus: mps::visible_gpus(&node.cfg),
        default_pct: 100,
        default_limits: BTreeMap::new(),
        server: None,
        log,
    };
    d.say(&format!("Starting control daemon (pipe directory {}, GPUs {:?})", dir.display(), d.gpus));
    let bound = socket_id(&path);
    loop {
        if !readable(&listener, 500) {
            if socket_id(&path) != bound {
                d.stop_server_if("");
                d.say("The control socket is gone: exit");
                return;
            }
            continue;
        }
        let Ok((mut conn, _)) = listener.accept() else { continue };
        let mut line = String::new();
        if BufReader::new(&mut conn).read_line(&mut line).is_err() {
            continue;
        }
        let (answer, quit) = d.handle(line.trim());
        let _ = conn.write_all(answer.as_bytes());
        drop(conn);
        if quit {
            let _ = std::fs::remove_file(&path);
            d.say("Exit");
            return;
        }
    }
}

impl Daemon {
    fn say(&mut self, what: &str) {
        let _ = writeln!(self.log, "[{}] {what}", vgpu_sim::now_ns() / 1_000_000);
    }

    /// One command's answer, and whether the daemon ends.
    fn handle(&mut self, line: &str) -> (String, bool) {
        self.reap_server();
        let w: Vec<&str> = line.split_whitespace().collect();
        let r = match w[..] {
            ["client", pid, uid] => self.client(pid.parse().unwrap_or(0), uid.parse().unwrap_or(0)),
            ["get_server_list"] => Ok(self.server.as_ref().map(|s| s.child.id().to_string()).unwrap_or_default()),
            ["start_server", "-uid", uid] => {
                self.ensure_server(uid.parse().unwrap_or(0)).map(|s| s.child.id().to_string())
            }
            ["get_client_list", pid] => Ok(self.clients_of(pid)),
            ["set_default_active_thread_percentage", p] => match mps::parse_pct(p) {
                Some(p) => {
                    self.default_pct = p;
                    Ok(format!("{p}.0"))
                }
                None => Err(format!("invalid percentage {p}: 1 to 100")),
            },
            ["get_default_active_thread_percentage"] => Ok(format!("{}.0", self.default_pct)),
            ["set_active_thread_percentage", pid, p] => match (self.server.as_mut(), mps::parse_pct(p)) {
                (Some(s), Some(p)) if s.child.id().to_string() == pid => {
                    s.pct = p;
                    Ok(format!("{p}.0"))
                }
                _ => Err(format!("no server {pid}, or invalid percentage {p}")),
            },
            ["set_default_device_pinned_mem_limit", dev, size] => {
                match (dev.parse::<usize>(), vgpu_units::parse_size(size).ok()) {
                    (Ok(dev), Some(b)) if dev < self.gpus.len() => {
                        self.default_limits.insert(dev, b);
                        Ok(String::new())
                    }
                    _ => Err(format!("invalid device {dev} or size {size}")),
                }
            }
            ["get_default_device_pinned_mem_limit", dev] => Ok(dev
                .parse::<usize>()
                .ok()
                .and_then(|d| self.default_limits.get(&d))
                .map_or("0".into(), |b| format!("{}M", b >> 20))),
            ["shutdown_server", pid, ..] => Ok(self.stop_server_if(pid)),
            ["quit"] => {
                self.stop_server_if("");
                return (String::new(), true);
            }
            _ => Err(format!("unknown command: {line}")),
        };
        (r.unwrap_or_else(|e| format!("error: {e}")), false)
    }

    fn client(&mut self, pid: u32, uid: u32) -> Result<String, String> {
        let other_user = self.server.as_mut().is_some_and(|s| s.uid != uid);
        if other_user {
            if !self.server.as_mut().is_some_and(|s| s.live_clients().is_empty()) {
                return Ok("wait".into());
            }
            self.stop_server_if("");
        }
        let s = self.ensure_server(uid)?;
        s.clients.push(pid);
        let line = s.server().line();
        self.say(&format!("New client {pid} connected"));
        Ok(line)
    }

    fn ensure_server(&mut self, uid: u32) -> Result<&mut Running, String> {
        if self.server.is_none() {
            let s = self.start_server(uid)?;
            self.say(&format!("Starting new server {} for user {uid}", s.child.id()));
            self.server = Some(s);
        }
        Ok(self.server.as_mut().expect("just made"))
    }

    fn start_server(&self, uid: u32) -> Result<Running, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("nvidia-cuda-mps-server");
        let mut child =
            Command::new(&exe).stdout(Stdio::piped()).spawn().map_err(|e| format!("{}: {e}", exe.display()))?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut ready = String::new();
        let _ = out.read_line(&mut ready);
        let Some(slot) = ready.trim().strip_prefix("ready ").and_then(|s| s.parse().ok()) else {
            let _ = child.kill();
            let mut rest = String::new();
            let _ = out.read_to_string(&mut rest);
            return Err(format!("the server did not start: {ready}{rest}"));
        };
        let limits = self.default_limits.iter().filter_map(|(d, b)| Some((*self.gpus.get(*d)?, *b))).collect();
        Ok(Running { child, slot, uid, pct: self.default_pct, limits, clients: Vec::new() })
    }

    fn clients_of(&mut self, pid: &str) -> String {
        match self.server.as_mut() {
            Some(s) if s.child.id().to_string() == pid => {
                s.live_clients().iter().map(u32::to_string).collect::<Vec<_>>().join("\n")
            }
            _ => String::new(),
        }
    }

    /// Stops the server (the one of PID `pid`, or any where `pid` is empty).
    fn stop_server_if(&mut self, pid: &str) -> String {
        if let Some(mut s) = self.server.take() {
            if pid.is_empty() || s.child.id().to_string() == pid {
                let _ = s.child.kill();
                let _ = s.child.wait();
                self.say(&format!("Server {} exited", s.child.id()));
            } else {
                self.server = Some(s);
            }
        }
        String::new()
    }

    /// Forgets a server that ended on its own.
    fn reap_server(&mut self) {
        let ended = self.server.as_mut().is_some_and(|s| !matches!(s.child.try_wait(), Ok(None)));
        if ended {
            let s = self.server.take().expect("checked");
            self.say(&format!("Server {} exited", s.child.id()));
        }
    }
}

/// The control socket's identity (device, inode), None once it is gone.
fn socket_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether a connection waits on `l`, within `ms`.
fn readable(l: &UnixListener, ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd of a descriptor the listener owns, for the duration of the call.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

fn fail(e: &str) -> ! {
    eprintln!("nvidia-cuda-mps-control: {e}");
    std::process::exit(1)
}

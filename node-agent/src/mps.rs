//! MPS per GPU (docs/mps.md): each GPU the configuration names (`mps_gpus`) gets a control daemon
//! of its own, started with `CUDA_VISIBLE_DEVICES` naming that GPU and its pipe and log directories
//! under `<state_dir>/mps/<GPU UUID>/`. The supervisor asks each daemon for its servers every
//! [`CHECK_EVERY`] and starts it again when it does not answer. The daemon runs in the background
//! (`-d`): it outlives an agent restart, and the next agent takes over the one that answers, so
//! that clients keep their server. The agent never changes a GPU's compute mode.

use crate::agent::Agent;
use crate::config::Config;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;
use vgpu_proto::v1 as pb;

/// How often each daemon is asked whether it answers.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// How long a daemon just started has to answer.
const START_WAIT: Duration = Duration::from_secs(5);
/// How long one control command may take.
const COMMAND_WAIT: Duration = Duration::from_secs(10);

/// A GPU's daemon directories: (pipe, log).
pub fn dirs(state_dir: &Path, uuid: &str) -> (PathBuf, PathBuf) {
    let d = state_dir.join("mps").join(uuid);
    (d.join("pipe"), d.join("log"))
}

/// The GPUs that run MPS (UUID -> pipe directory), of those discovered. A GPU in MIG mode is left
/// out, with a warning: MPS runs on a MIG device, not on its GPU, and vgpu does not do that yet.
pub fn gpus(agent: &Agent) -> BTreeMap<String, PathBuf> {
    let inv = agent.inventory.read();
    let mut out = BTreeMap::new();
    for g in inv.gpus.iter().filter(|g| agent.cfg.mps.gpus.has(g.index, &g.uuid)) {
        if g.mig.as_ref().is_some_and(|m| m.enabled) {
            tracing::warn!(gpu = %g.uuid, "mps_gpus names a GPU in MIG mode: no MPS there");
            continue;
        }
        out.insert(g.uuid.clone(), dirs(&agent.cfg.state_dir, &g.uuid).0);
    }
    out
}

/// Keeps a daemon answering on every MPS GPU until `stop`; what it finds is in `agent.mps`.
pub fn supervise(agent: &Agent, stop: &AtomicBool) {
    let gpus: Vec<String> = gpus(agent).into_keys().collect();
    while !stop.load(Relaxed) {
        for uuid in &gpus {
            let was = agent.mps.read().get(uuid).cloned().unwrap_or_default();
            let now = check(&agent.cfg, uuid, was);
            agent.mps.write().insert(uuid.clone(), now);
        }
        let until = std::time::Instant::now() + CHECK_EVERY;
        while !stop.load(Relaxed) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One look at the daemon of GPU `uuid`: asked for its servers; started where it does not answer.
fn check(cfg: &Config, uuid: &str, mut st: pb::MpsStatus) -> pb::MpsStatus {
    let (pipe, log) = dirs(&cfg.state_dir, uuid);
    (st.pipe_dir, st.log_dir) = (pipe.display().to_string(), log.display().to_string());
    let answer = match control(cfg, uuid, "get_server_list\n") {
        Ok(a) => Ok(a),
        Err(why) => {
            // Its first start is no restart; any later one is (after it stopped answering, or
            // after a start that failed).
            let again = st.running || !st.last_error.is_empty();
            if st.running {
                tracing::warn!(gpu = uuid, reason = %why, "the MPS control daemon stopped answering: starting it again");
            } else if !again {
                tracing::info!(gpu = uuid, "starting the MPS control daemon");
            }
            st.restarts += u32::from(again);
            start(cfg, uuid)
        }
    };
    match answer {
        Ok(a) => {
            if !st.running {
                tracing::info!(gpu = uuid, pipe = %st.pipe_dir, "MPS control daemon answering");
            }
            st.running = true;
            st.last_error.clear();
            st.servers = a.lines().filter_map(|l| l.trim().parse().ok()).collect();
        }
        Err(e) => {
            if st.last_error != e {
                tracing::error!(gpu = uuid, error = %e, "cannot start the MPS control daemon");
            }
            st.running = false;
            st.last_error = e;
            st.servers.clear();
        }
    }
    st
}

/// The control program for GPU `uuid`'s daemon, its environment set.
fn program(cfg: &Config, uuid: &str) -> Command {
    let (pipe, log) = dirs(&cfg.state_dir, uuid);
    let mut c = Command::new(&cfg.mps.control);
    c.env("CUDA_VISIBLE_DEVICES", uuid)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Sends `commands` (lines) to GPU `uuid`'s daemon; what it printed, or why not.
pub fn control(cfg: &Config, uuid: &str, commands: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut child = program(cfg, uuid).spawn().map_err(|e| format!("{}: {e}", cfg.mps.control.display()))?;
    let _ = child.stdin.take().map(|mut i| i.write_all(commands.as_bytes()));
    let deadline = std::time::Instant::now() + COMMAND_WAIT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{} did not answer in {}s", cfg.mps.control.display(), COMMAND_WAIT.as_secs()));
            }
        }
    };
    let (mut out, mut err) = (String::new(), String::new());
    let _ = child.stdout.take().map(|mut o| o.read_to_string(&mut out));
    let _ = child.stderr.take().map(|mut e| e.read_to_string(&mut err));
    if status.success() {
        Ok(out)
    } else {
        Err(format!("{} ({status}): {}", cfg.mps.control.display(), err.trim()))
    }
}

/// Starts GPU `uuid`'s daemon in the background and waits until it answers; its servers then.
fn start(cfg: &Config, uuid: &str) -> Result<String, String> {
    let (pipe, log) = dirs(&cfg.state_dir, uuid);
    for d in [&pipe, &log] {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }
    // Its errors to a file: the daemon keeps what it inherits open, so a pipe would never end.
    let errors = log.join("agent-start.err");
    let err_file = std::fs::File::create(&errors).map_err(|e| format!("cannot create {}: {e}", errors.display()))?;
    let mut c = program(cfg, uuid);
    c.arg("-d").stdin(Stdio::null()).stdout(Stdio::null()).stderr(err_file);
    let status = c.status().map_err(|e| format!("cannot run {}: {e}", cfg.mps.control.display()))?;
    if !status.success() {
        let said = std::fs::read_to_string(&errors).unwrap_or_default();
        return Err(format!("{} -d ({status}): {}", cfg.mps.control.display(), said.trim()));
    }
    let deadline = std::time::Instant::now() + START_WAIT;
    loop {
        match control(cfg, uuid, "get_server_list\n") {
            Ok(a) => return Ok(a),
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(format!("started, but not answering after {}s: {e}", START_WAIT.as_secs()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

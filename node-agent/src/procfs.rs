//! What the agent reads from `/proc`: a process's PIDs in its namespaces, its start time (to guard
//! caches against PID reuse), which files it has mapped, and the agent's own resource use.

use std::path::PathBuf;

fn proc_dir() -> PathBuf {
    PathBuf::from("/proc")
}

/// `NSpid` of `/proc/<pid>/status`: the PID in every namespace from the one of this `/proc` mount
/// inwards (the last entry is the PID inside the process's own namespace).
pub fn ns_pids(pid: u32) -> Option<Vec<u32>> {
    let s = std::fs::read_to_string(proc_dir().join(pid.to_string()).join("status")).ok()?;
    parse_ns_pids(&s)
}

pub fn parse_ns_pids(status: &str) -> Option<Vec<u32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let v: Vec<u32> = line.split_whitespace().map(|x| x.parse().ok()).collect::<Option<_>>()?;
    (!v.is_empty()).then_some(v)
}

/// The MPS control daemon's server (`nvidia-cuda-mps-server`): NVML lists it among a GPU's compute
/// processes, holding its clients' work; its clients are in NVML's MPS list.
pub fn is_mps_server(pid: u32) -> bool {
    // `comm` holds 15 characters: "nvidia-cuda-mps" (the control daemon's too, but it never holds a
    // GPU context).
    std::fs::read_to_string(proc_dir().join(pid.to_string()).join("comm"))
        .is_ok_and(|c| c.trim_end() == "nvidia-cuda-mps")
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks since boot): with the PID, it names a
/// process uniquely.
pub fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(proc_dir().join(pid.to_string()).join("stat")).ok()?;
    parse_start_time(&s)
}

pub fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields restart after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Who runs a process: its command and, where its cgroup says so, its Kubernetes pod (UID) and its
/// container (the runtime's 64-hex-digit ID).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    pub command: String,
    pub pod_uid: String,
    pub container_id: String,
}

/// The [`Owner`] of `pid` (empty fields for what cannot be read or told).
pub fn owner(pid: u32) -> Owner {
    let dir = proc_dir().join(pid.to_string());
    let command = std::fs::read(dir.join("comm")).map(|c| printable(&c)).unwrap_or_default();
    let (pod_uid, container_id) =
        std::fs::read_to_string(dir.join("cgroup")).map(|c| parse_cgroup_owner(&c)).unwrap_or_default();
    Owner { command, pod_uid, container_id }
}

/// A process's `comm` as text safe to print: the process sets it (`prctl(PR_SET_NAME)`), so control
/// characters (a terminal's escape sequences) and invalid UTF-8 become `?`; the newline that ends
/// it goes.
pub fn printable(comm: &[u8]) -> String {
    let comm = comm.strip_suffix(b"\n").unwrap_or(comm);
    printable_text(&String::from_utf8_lossy(comm))
}

/// Text from elsewhere (a process name, a slice's label) safe to print: control characters, the
/// replacement character of invalid UTF-8 and the bidirectional controls (which reorder what a
/// terminal shows after them: `U+202A`-`U+202E`, `U+2066`-`U+2069`, `U+200E`/`U+200F`, `U+061C`)
/// become `?`.
pub fn printable_text(s: &str) -> String {
    let bidi =
        |c: char| matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}');
    s.chars().map(|c| if c.is_control() || c == '\u{fffd}' || bidi(c) { '?' } else { c }).collect()
}

/// A pod's UID and a container's ID from `/proc/<pid>/cgroup`, in the layouts kubelet and the
/// runtimes make: the systemd driver (`kubepods-burstable-pod<uid with _>.slice`,
/// `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`) and cgroupfs
/// (`kubepods/burstable/pod<uid>/<id>`, `/docker/<id>`), cgroup v1 or v2, also relative to another
/// cgroup namespace (`/../..`). Empty where the path has none.
pub fn parse_cgroup_owner(cgroup: &str) -> (String, String) {
    let is_hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    let uid_of = |c: &str| -> Option<String> {
        let c = c.strip_suffix(".slice").unwrap_or(c);
        let u = c[c.rfind("pod")? + 3..].replace('_', "-");
        let groups: Vec<&str> = u.split('-').collect();
        let shape = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12]);
        (shape && groups.iter().all(|g| is_hex(g))).then_some(u)
    };
    let id_of = |c: &str| -> Option<String> {
        let c = c.strip_suffix(".scope").unwrap_or(c);
        // A runtime's monitor process (`crio-conmon-<id>`) is not the container.
        if c.contains("conmon") {
            return None;
        }
        let id = c.rsplit('-').next()?;
        (id.len() == 64 && is_hex(id)).then(|| id.to_string())
    };
    // The unified hierarchy first (`0::`), then the v1 controllers; a path that names a pod over one
    // that names only a container (v1 hierarchies can disagree where something moved a process in
    // some of them).
    let mut lines: Vec<&str> = cgroup.lines().collect();
    lines.sort_by_key(|l| !l.starts_with("0::"));
    let mut found = (String::new(), String::new());
    for line in lines {
        let Some(path) = line.splitn(3, ':').nth(2) else { continue };
        let parts: Vec<&str> = path.split('/').filter(|c| !c.is_empty() && *c != "..").collect();
        let pod = parts.iter().rev().find_map(|c| uid_of(c)).unwrap_or_default();
        let container = parts.last().and_then(|c| id_of(c)).unwrap_or_default();
        if !pod.is_empty() {
            return (pod, container);
        }
        if found.1.is_empty() {
            found.1 = container;
        }
    }
    found
}

/// A file identity as `/proc/<pid>/maps` shows it: (major, minor, inode).
pub type FileId = (u32, u32, u64);

/// The identity of the file at `path` (what a mapping of it shows in `/proc/<pid>/maps`).
pub fn file_id(path: &std::path::Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    let dev = m.dev();
    Some((libc::major(dev), libc::minor(dev), m.ino()))
}

/// `path` as process `pid` sees it (through its root directory: inside its mount namespace).
pub fn in_root(pid: u32, path: &std::path::Path) -> PathBuf {
    proc_dir().join(pid.to_string()).join("root").join(path.strip_prefix("/").unwrap_or(path))
}

/// Which of `wanted` any process has mapped (every process's maps read: for rare use).
pub fn mapped_anywhere<T>(wanted: &[(FileId, T)]) -> std::collections::HashSet<FileId> {
    let mut found = std::collections::HashSet::new();
    let Ok(dir) = std::fs::read_dir(proc_dir()) else { return found };
    for pid in dir.flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()) {
        let Ok(maps) = std::fs::read_to_string(proc_dir().join(pid.to_string()).join("maps")) else { continue };
        for line in maps.lines() {
            if let Some(id) = map_line_id(line).filter(|id| wanted.iter().any(|(w, _)| w == id)) {
                found.insert(id);
            }
        }
        if found.len() == wanted.len() {
            break;
        }
    }
    found
}

/// The first of `wanted` that process `pid` has mapped.
pub fn mapped<T>(pid: u32, wanted: &[(FileId, T)]) -> Option<&T> {
    let s = std::fs::read_to_string(proc_dir().join(pid.to_string()).join("maps")).ok()?;
    find_mapped(&s, wanted)
}

pub fn find_mapped<'a, T>(maps: &str, wanted: &'a [(FileId, T)]) -> Option<&'a T> {
    maps.lines().filter_map(map_line_id).find_map(|id| wanted.iter().find(|(w, _)| *w == id).map(|(_, t)| t))
}

/// The file a line of `/proc/<pid>/maps` maps (None for anonymous memory).
fn map_line_id(line: &str) -> Option<FileId> {
    let mut f = line.split_whitespace();
    let (_, _, _, dev, ino) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let ino = ino.parse::<u64>().ok().filter(|i| *i != 0)?;
    let (maj, min) = dev.split_once(':')?;
    Some((u32::from_str_radix(maj, 16).ok()?, u32::from_str_radix(min, 16).ok()?, ino))
}

/// The host's memory (`MemTotal` of `/proc/meminfo`) in bytes: all a unified-memory GPU has.
pub fn mem_total() -> Option<u64> {
    parse_mem_total(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// This process's resident set size in bytes.
pub fn self_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// CPU time this process has used (user + system), in nanoseconds.
pub fn self_cpu_ns() -> u64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: an out-pointer to the local above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// When this process started, in seconds since the Unix epoch (`/proc/self/stat`'s start time
/// after boot, plus `/proc/stat`'s boot time).
pub fn self_start_time_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command (which may hold spaces), from the third on: start time is the 22nd.
    let ticks: f64 = stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()?;
    let boot: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| boot + ticks / hz as f64)
}

/// How many file descriptors this process has open.
pub fn self_open_fds() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}

/// The most file descriptors this process may open (its soft limit).
pub fn self_max_fds() -> Option<u64> {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: an out-pointer to the local above.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0).then_some(l.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_s_start_and_descriptors_are_read() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let start = self_start_time_s().unwrap();
        assert!(start <= now + 1.0 && start > now - 86_400.0 * 365.0, "{start} against {now}");
        let _f = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(self_open_fds().unwrap() >= 4, "stdin, stdout, stderr and the file above");
        assert!(self_max_fds().unwrap() >= self_open_fds().unwrap() as u64);
    }

    #[test]
    fn parses_mem_total() {
        assert_eq!(parse_mem_total("MemTotal:       127600748 kB\nMemFree: 1 kB\n"), Some(127600748 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: lots\n"), None);
        assert!(mem_total().is_some_and(|t| t > 0), "this machine's /proc/meminfo");
    }

    #[test]
    fn parses_nspid_stat_and_maps() {
        assert_eq!(parse_ns_pids("Name:\tx\nNSpid:\t17624\t2\nNSpgid: 1\n"), Some(vec![17624, 2]));
        assert_eq!(parse_ns_pids("NSpid:\t31\n"), Some(vec![31]));
        assert_eq!(parse_ns_pids("Name:\tx\n"), None);
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194304 100 0 0 0 5 6 0 0 20 0 1 0 987654 1000 200";
        assert_eq!(parse_start_time(stat), Some(987654));
        let maps = "7f00-7f10 rw-s 00000000 fd:01 1234 /usr/local/vgpu/region\n\
                    7f20-7f30 r-xp 00000000 00:00 0 [vdso]\n\
                    7f40-7f50 rw-s 00000000 103:02 99 /x (deleted)\n";
        let wanted = [((0xfd, 1, 1235), "other"), ((0x103, 2, 99), "b"), ((0xfd, 1, 1234), "a")];
        assert_eq!(find_mapped(maps, &wanted), Some(&"a"));
        assert_eq!(find_mapped(maps, &wanted[..1]), None);
    }

    #[test]
    fn tells_the_pod_and_container_of_a_cgroup() {
        let uid = "4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
        let id = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
        let both = (uid.to_string(), id.to_string());
        let u = uid.replace('-', "_");
        // containerd, systemd driver, cgroup v2.
        let v2 = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{id}.scope\n"
        );
        assert_eq!(parse_cgroup_owner(&v2), both);
        // The same seen from another cgroup namespace.
        let rel =
            format!("0::/../../kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{id}.scope\n");
        assert_eq!(parse_cgroup_owner(&rel), both);
        // A guaranteed pod under CRI-O.
        assert_eq!(parse_cgroup_owner(&format!("0::/kubepods.slice/kubepods-pod{u}.slice/crio-{id}.scope\n")), both);
        // cgroupfs driver, cgroup v1 (the unified line empty).
        let v1 =
            format!("12:memory:/kubepods/besteffort/pod{uid}/{id}\n11:pids:/kubepods/besteffort/pod{uid}/{id}\n0::/\n");
        assert_eq!(parse_cgroup_owner(&v1), both);
        // v1 hierarchies that disagree: the one that names the pod.
        let mixed = format!("11:memory:/docker/{}\n4:pids:/kubepods/pod{uid}/{id}\n0::/\n", "f".repeat(64));
        assert_eq!(parse_cgroup_owner(&mixed), both);
        // Docker without Kubernetes, both drivers.
        assert_eq!(
            parse_cgroup_owner(&format!("0::/system.slice/docker-{id}.scope\n")),
            (String::new(), id.to_string())
        );
        assert_eq!(parse_cgroup_owner(&format!("4:devices:/docker/{id}\n")), (String::new(), id.to_string()));
        // A pod's cgroup itself (no container), CRI-O's monitor process, and hosts' own processes.
        assert_eq!(parse_cgroup_owner(&format!("0::/kubepods/pod{uid}\n")), (uid.to_string(), String::new()));
        assert_eq!(
            parse_cgroup_owner(&format!("0::/kubepods.slice/kubepods-pod{u}.slice/crio-conmon-{id}.scope\n")),
            (uid.to_string(), String::new())
        );
        for host in
            ["0::/\n", "0::/system.slice/sshd.service\n", "0::/user.slice/user-1000.slice/session-2.scope\n", ""]
        {
            assert_eq!(parse_cgroup_owner(host), Default::default(), "{host}");
        }
        // Near misses: a UID of the wrong shape, an ID of the wrong length.
        assert_eq!(parse_cgroup_owner("0::/kubepods/podnot-a-uid/abc\n"), Default::default());
        let short = &id[..63];
        assert_eq!(parse_cgroup_owner(&format!("0::/system.slice/docker-{short}.scope\n")), Default::default());
        // A command a process chose to disturb a terminal or a log prints harmlessly.
        assert_eq!(printable(b"python3\n"), "python3");
        assert_eq!(printable(b"\x1b[2J\x1b[Hx\ty\xff\n"), "?[2J?[Hx?y?");
        // Bidirectional controls reorder what follows on a terminal (issue 61, item 25: a label
        // holding U+202E was printed raw).
        assert_eq!(printable_text("team\u{202e}nimda\u{2066}x\u{200f}"), "team?nimda?x?");
        assert_eq!(printable_text("é ü 中文"), "é ü 中文", "other text stays");
        // This process: its command, and whatever its cgroup says.
        let me = owner(std::process::id());
        assert!(!me.command.is_empty(), "{me:?}");
        assert_eq!(owner(u32::MAX), Owner::default(), "no such process");
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        assert_eq!(ns_pids(me).unwrap().first().copied(), Some(me), "the test runs in the host namespace");
        assert!(start_time(me).unwrap() > 0);
        assert!(self_rss() > 1 << 20);
        let f = std::env::temp_dir().join(format!("vgpu-procfs-{me}"));
        std::fs::write(&f, [0u8; 4096]).unwrap();
        let file = std::fs::File::open(&f).unwrap();
        // SAFETY: a private read-only mapping of a file this test owns, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let id = file_id(&f).unwrap();
        assert_eq!(mapped(me, &[(id, 7)]), Some(&7));
        // SAFETY: unmaps the one page this function mapped above, not used after.
        unsafe { libc::munmap(p, 4096) };
        assert_eq!(mapped(me, &[(id, 7)]), None, "gone once unmapped");
        std::fs::remove_file(f).ok();
    }
}

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
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[cfg(test)]
mod tests {
    use super::*;

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

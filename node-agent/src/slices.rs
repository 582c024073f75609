//! Slices: per-container regions under the state directory, with limits only the agent writes, and
//! a record per slice, out of every container's reach, from which a restarted agent recovers them.
//!
//! Layout under the state directory:
//! * `slices/<name>/region`: the usage region. The file alone is bind-mounted read-write into the
//!   container: the container can write its contents (and even truncate it, which the agent
//!   survives, see [`vgpu_region::shrink`]) but cannot replace it, link it elsewhere or add files
//!   beside it;
//! * `slices/<name>/limits`: a region holding the limits, bind-mounted read-only;
//! * `records/<name>.json` (the directory 0700): the record, what was asked and when. No container
//!   reaches it, and it is still read as untrusted: never through a link, at most
//!   [`RECORD_MAX`] bytes, and a record that cannot be read quarantines its slice alone.
//!
//! Library installs go to `<state_dir>/lib/libvgpu.so.<version>.<digest>`, written to a temporary
//! name and renamed, never overwriting a file that running containers may have mapped.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use vgpu_region::{Init, Region};

/// What kind of failure a slice operation met (the API maps it to a status code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request itself is wrong (a name, a limit, a label).
    Invalid,
    NotFound,
    Exists,
    /// Processes still use the slice.
    Busy,
    /// A node-wide bound (`max_slices`) is reached.
    Full,
    /// The state directory failed (I/O), or a file in it is damaged.
    Io,
}

#[derive(Debug)]
pub struct SliceError {
    pub kind: ErrorKind,
    pub msg: String,
}

impl SliceError {
    fn new(kind: ErrorKind, msg: impl Into<String>) -> SliceError {
        SliceError { kind, msg: msg.into() }
    }
}

impl std::fmt::Display for SliceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for SliceError {}

type Result<T> = std::result::Result<T, SliceError>;

/// The largest slice record read (a record is a few hundred bytes; labels are bounded far below).
pub const RECORD_MAX: u64 = 64 << 10;
/// The most labels a slice has, and their sizes.
pub const LABELS_MAX: usize = 32;
pub const LABEL_KEY_MAX: usize = 253;
pub const LABEL_VALUE_MAX: usize = 1024;
pub const LABELS_BYTES_MAX: usize = 16 << 10;
/// The default bound on slices per node (`max_slices`).
pub const DEFAULT_MAX_SLICES: usize = 4096;

/// One device of a slice, in the container's device order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceGpu {
    pub uuid: String,
    /// Bytes; 0 = no limit.
    pub memory: u64,
    /// Percent; 0 = no limit.
    pub sm: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub name: String,
    pub gpus: Vec<SliceGpu>,
    /// Seconds since the epoch.
    pub created: u64,
    /// Free-form owner labels (e.g. namespace, pod, container).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Nanoseconds since the epoch at creation: tells a slice from an earlier one of the same name
    /// (0 in records written before it existed).
    #[serde(default)]
    pub created_ns: u64,
    #[serde(default, skip_serializing_if = "Priority::is_normal")]
    pub priority: Priority,
}

/// How a slice's work is ordered against the other tenants of its GPUs (in its limits file, which
/// only the agent writes; see docs/priority.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Best effort beside a high-priority slice; otherwise as any tenant.
    #[default]
    Normal,
    /// Latency first: the normal slices of its GPUs admit new work only while it has none queued.
    High,
}

impl Priority {
    fn is_normal(&self) -> bool {
        *self == Priority::Normal
    }
}

/// A bind mount into the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mount {
    pub host: PathBuf,
    pub container: String,
    pub read_only: bool,
}

/// What puts a process into a slice.
#[derive(Clone, Debug, Serialize)]
pub struct Injection {
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Mount>,
}

/// Every slice on record, and the names whose record cannot be read (quarantined: left out of
/// everything until deleted with `force`), with why.
#[derive(Debug, Default)]
pub struct Listing {
    pub slices: Vec<Slice>,
    pub quarantined: Vec<(String, String)>,
}

pub struct SliceStore {
    /// `<state_dir>/slices`: the files containers get.
    root: PathBuf,
    /// `<state_dir>/gates`: per GPU UUID, links to the activity files of its high-priority slices
    /// (every container gets it read-only; see docs/priority.md).
    gates: PathBuf,
    /// `<state_dir>/records`: the records, which no container gets.
    records: PathBuf,
    /// The node's memory is oversubscribed (`memory_scaling` above 1): every slice's files carry the
    /// flag that lets its interposers serve what the GPU has no room for as unified memory.
    oversubscribe: bool,
    /// What every slice's limits file says a normal slice keeps queued beside a high-priority one.
    priority_queue_ns: u64,
    /// What every slice's limits file says a normal slice's guaranteed share is (percent).
    priority_min_share: u32,
    max_slices: usize,
    /// Held while a slice's record and files change together, so that [`check`](Self::check)
    /// never takes a change half-made for a container's tampering.
    changing: parking_lot::Mutex<()>,
    /// High-priority slices whose priority is suspended, until when: out of the gates, so that
    /// no normal slice waits for them (claims of queued work their GPU time did not bear out).
    suspended: parking_lot::Mutex<BTreeMap<String, std::time::Instant>>,
    /// The GPUs that run MPS, by UUID, with their daemon's pipe directory; None until the GPUs are
    /// known (see [`set_mps`](Self::set_mps)).
    mps: parking_lot::RwLock<Option<BTreeMap<String, PathBuf>>>,
}

/// Where a slice's containers see their GPU's MPS pipe directory.
pub const CONTAINER_MPS_DIR: &str = "/usr/local/vgpu/mps";

/// What a normal slice keeps queued beside a high-priority one, unless configured.
pub const DEFAULT_PRIORITY_QUEUE_NS: u64 = 100_000;
/// A normal slice's guaranteed share of launching beside a high-priority one, unless configured.
pub const DEFAULT_PRIORITY_MIN_SHARE: u32 = 10;

/// Where the container sees the slice's files.
pub const CONTAINER_DIR: &str = "/usr/local/vgpu";

fn io(what: String) -> impl FnOnce(std::io::Error) -> SliceError {
    move |e| SliceError::new(ErrorKind::Io, format!("{what}: {e}"))
}

/// FNV-1a of `bytes`: the digest in the names the agent makes (slices, library installs, gate
/// links, replica slices, leases).
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// A GPU UUID as a directory name may hold it (`GPU-...`, `MIG-...`).
fn valid_uuid(u: &str) -> bool {
    !u.is_empty() && u.len() <= 96 && u.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.')
}

/// A value from a request as an error message shows it: quoted, control characters escaped, and
/// cut at 64 characters (an over-long name must not make an over-long error).
pub fn shown(v: &str) -> String {
    let cut: String = v.chars().take(64).collect();
    if cut.len() < v.len() {
        format!("{cut:?}... ({} bytes)", v.len())
    } else {
        format!("{cut:?}")
    }
}

/// Every slice name on every path (the API, the scheduler's requests, HAMi, Volcano, DRA) is
/// checked here: a name is one path component under the state directory, never `..` or a path.
pub fn check_name(name: &str) -> Result<()> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(SliceError::new(
            ErrorKind::Invalid,
            format!(
                "invalid slice name {}: use 1-63 lower-case letters, digits, '-', '_' or '.', not starting with '.'",
                shown(name)
            ),
        ))
    }
}

/// Labels within bounds ([`LABELS_MAX`] of them, keys up to [`LABEL_KEY_MAX`] bytes, values up to
/// [`LABEL_VALUE_MAX`], [`LABELS_BYTES_MAX`] in all) and without control characters.
pub fn check_labels(labels: &BTreeMap<String, String>) -> Result<()> {
    let bad = |m: String| Err(SliceError::new(ErrorKind::Invalid, m));
    if labels.len() > LABELS_MAX {
        return bad(format!("{} labels: a slice has at most {LABELS_MAX}", labels.len()));
    }
    let mut total = 0;
    for (k, v) in labels {
        if k.is_empty() || k.len() > LABEL_KEY_MAX {
            return bad(format!("label key {}: 1 to {LABEL_KEY_MAX} bytes are accepted", shown(k)));
        }
        if v.len() > LABEL_VALUE_MAX {
            return bad(format!("label {}: its value has {} bytes, at most {LABEL_VALUE_MAX}", shown(k), v.len()));
        }
        if k.chars().chain(v.chars()).any(char::is_control) {
            return bad(format!("label {}: control characters are not accepted", shown(k)));
        }
        total += k.len() + v.len();
    }
    if total > LABELS_BYTES_MAX {
        return bad(format!("labels of {total} bytes: at most {LABELS_BYTES_MAX} in all"));
    }
    Ok(())
}

/// `s` with control characters as `?`, for a terminal or a metrics label.
pub fn printable(s: &str) -> String {
    crate::procfs::printable_text(s)
}

/// Writes `data` to `path` through a temporary file and a rename (readers never see a partial
/// file). The temporary name starts with `.` and ends in `.tmp.<pid>`, so [`remove_temporaries`]
/// finds what a killed writer left.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let made = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(io(format!("cannot create {}", tmp.display())))?;
        f.write_all(data).and_then(|_| f.sync_all()).map_err(io(format!("cannot write {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io(format!("cannot install {}", path.display())))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    made
}

/// Reads a file the agent wrote, as untrusted: not through a link, a regular file only, at most
/// `max` bytes.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind as K};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| if e.raw_os_error() == Some(libc::ELOOP) { Error::other("a symbolic link") } else { e })?;
    let m = f.metadata()?;
    if !m.file_type().is_file() {
        return Err(Error::other("not a regular file"));
    }
    if m.len() > max {
        return Err(Error::new(K::InvalidData, format!("{} bytes, more than the {max} accepted", m.len())));
    }
    let mut data = Vec::with_capacity(m.len() as usize);
    f.take(max + 1).read_to_end(&mut data)?;
    if data.len() as u64 > max {
        return Err(Error::new(K::InvalidData, format!("more than the {max} bytes accepted")));
    }
    Ok(data)
}

/// Removes what writers killed mid-write left in `dir`: files named `.<name>.tmp.<pid>` or
/// `<name>.tmp.<pid>` (the library installs' and the former records'), whatever the PID (only this
/// agent writes there, and it is starting). Returns what it removed.
pub fn remove_temporaries(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    rd.flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            n.rsplit_once(".tmp.").is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter(|p| p.symlink_metadata().is_ok_and(|m| m.file_type().is_file() || m.file_type().is_symlink()))
        .filter(|p| std::fs::remove_file(p).is_ok())
        .collect()
}

impl SliceStore {
    pub fn open(state_dir: &Path) -> Result<SliceStore> {
        let root = state_dir.join("slices");
        let records = state_dir.join("records");
        let gates = state_dir.join("gates");
        for d in [&root, &records, &gates] {
            std::fs::create_dir_all(d).map_err(io(format!("cannot create {}", d.display())))?;
        }
        std::fs::set_permissions(&records, std::fs::Permissions::from_mode(0o700))
            .map_err(io(format!("cannot restrict {}", records.display())))?;
        std::fs::set_permissions(&gates, std::fs::Permissions::from_mode(0o755))
            .map_err(io(format!("cannot set the mode of {}", gates.display())))?;
        Ok(SliceStore {
            root,
            records,
            gates,
            oversubscribe: false,
            priority_queue_ns: DEFAULT_PRIORITY_QUEUE_NS,
            priority_min_share: DEFAULT_PRIORITY_MIN_SHARE,
            max_slices: DEFAULT_MAX_SLICES,
            changing: parking_lot::Mutex::new(()),
            suspended: parking_lot::Mutex::new(BTreeMap::new()),
            mps: parking_lot::RwLock::new(None),
        })
    }

    /// Sets whether slices get the oversubscription flag (new ones at creation, existing ones at
    /// [`recover`](Self::recover) and at their next update).
    /// Sets what normal slices keep queued beside a high-priority one (written like the
    /// oversubscription flag).
    pub fn with_priority_queue_ns(mut self, ns: u64) -> SliceStore {
        self.priority_queue_ns = ns;
        self
    }

    /// Sets a normal slice's guaranteed share beside a high-priority one (percent; written like
    /// the oversubscription flag).
    pub fn with_priority_min_share(mut self, percent: u32) -> SliceStore {
        self.priority_min_share = percent;
        self
    }

    pub fn with_oversubscribe(mut self, on: bool) -> SliceStore {
        self.oversubscribe = on;
        self
    }

    /// Sets the GPUs that run MPS (by UUID, with their daemon's pipe directory): slices on them get
    /// the pipe directory, their SM share as their MPS partition and the flag that says so in their
    /// files (written at their next [`apply_limits`](Self::apply_limits); until this is called,
    /// the flag is left as it is).
    pub fn set_mps(&self, gpus: BTreeMap<String, PathBuf>) {
        *self.mps.write() = Some(gpus);
    }

    /// Whether slice `s` runs on MPS GPUs (None: not known yet). A slice reaches one MPS daemon:
    /// one GPU (see [`injection_of`](Self::injection_of)).
    fn on_mps(&self, gpus: &[SliceGpu]) -> Option<bool> {
        self.mps.read().as_ref().map(|m| gpus.iter().any(|g| m.contains_key(&g.uuid)))
    }

    /// What slice `s`'s files hold as each GPU's SM share: its record's, or on a GPU that runs MPS
    /// its partition there ([`mps_share`]) among `all` the slices (read where not given).
    fn sm_limits_of(&self, s: &Slice, all: Option<&[Slice]>) -> Vec<u32> {
        if self.on_mps(&s.gpus) != Some(true) {
            return s.gpus.iter().map(|g| g.sm).collect();
        }
        let listed;
        let all = match all {
            Some(a) => a,
            None => {
                listed = self.list().map(|l| l.slices).unwrap_or_default();
                &listed
            }
        };
        s.gpus.iter().map(|g| mps_share(s, g, all)).collect()
    }

    /// Brings the files of every slice on an MPS GPU to its partition, after a change to one of
    /// them (a high-priority slice came, went or changed: the normal ones' partitions follow).
    fn follow_mps(&self) {
        if self.mps.read().as_ref().is_none_or(BTreeMap::is_empty) {
            return;
        }
        let all = self.list().map(|l| l.slices).unwrap_or_default();
        for s in &all {
            if self.on_mps(&s.gpus) == Some(true) {
                if let Err(e) = self.apply_limits_among(s, Some(&all)) {
                    tracing::warn!(slice = %s.name, error = %e, "cannot write the slice's MPS partition");
                }
            }
        }
    }

    /// Sets the most slices the node holds (`max_slices`).
    pub fn with_max_slices(mut self, n: usize) -> SliceStore {
        self.max_slices = n;
        self
    }

    /// The directory of a slice's container files. `name` must be valid ([`check_name`]).
    pub fn dir(&self, name: &str) -> PathBuf {
        debug_assert!(valid_name(name), "{name:?}");
        self.root.join(name)
    }

    fn record(&self, name: &str) -> PathBuf {
        self.records.join(format!("{name}.json"))
    }

    fn write_record(&self, s: &Slice) -> Result<()> {
        write_atomic(&self.record(&s.name), &serde_json::to_vec_pretty(s).expect("serialisable"), 0o600)
    }

    fn count(&self) -> usize {
        std::fs::read_dir(&self.records).map_or(0, |rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().strip_suffix(".json").is_some_and(valid_name))
                .count()
        })
    }

    /// Creates a slice of normal priority; fails if one of that name exists.
    pub fn create(&self, name: &str, gpus: Vec<SliceGpu>, labels: BTreeMap<String, String>) -> Result<Slice> {
        self.create_with(name, gpus, labels, Priority::Normal)
    }

    /// Creates a slice; fails if one of that name exists.
    pub fn create_with(
        &self,
        name: &str,
        gpus: Vec<SliceGpu>,
        labels: BTreeMap<String, String>,
        priority: Priority,
    ) -> Result<Slice> {
        check_name(name)?;
        check_labels(&labels)?;
        if gpus.is_empty() || gpus.len() > vgpu_region::MAX_DEVICES {
            return Err(SliceError::new(
                ErrorKind::Invalid,
                format!("a slice has 1 to {} GPUs", vgpu_region::MAX_DEVICES),
            ));
        }
        if let Some(g) = gpus.iter().find(|g| g.sm > 100) {
            return Err(SliceError::new(ErrorKind::Invalid, format!("SM limit {} % of {} is above 100", g.sm, g.uuid)));
        }
        self.mps_pipe(name, &gpus)?;
        let _changing = self.changing.lock();
        if self.record(name).symlink_metadata().is_ok() {
            return Err(SliceError::new(ErrorKind::Exists, format!("slice {name} already exists")));
        }
        let n = self.count();
        if n >= self.max_slices {
            return Err(SliceError::new(
                ErrorKind::Full,
                format!("this node has {n} slices, the most max_slices = {} allows", self.max_slices),
            ));
        }
        let dir = self.dir(name);
        // A directory without its record is what an interrupted create or delete left: not a slice.
        if dir.symlink_metadata().is_ok() {
            let _ = std::fs::remove_dir_all(&dir).or_else(|_| std::fs::remove_file(&dir));
        }
        std::fs::create_dir(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                SliceError::new(ErrorKind::Exists, format!("slice {name} already exists"))
            }
            _ => SliceError::new(ErrorKind::Io, format!("cannot create {}: {e}", dir.display())),
        })?;
        let made = (|| {
            self.make_files(&dir, &gpus, priority)?;
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let (created, created_ns) = (now.as_secs(), now.as_nanos() as u64);
            let s = Slice { name: name.to_owned(), gpus: gpus.clone(), created, labels, created_ns, priority };
            self.write_record(&s)?;
            Ok(s)
        })();
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        if made.as_ref().is_ok_and(|s| s.priority == Priority::High) {
            self.sync_gates();
        }
        if made.is_ok() {
            self.follow_mps();
        }
        made
    }

    /// Where slice `name`'s device `dev` is linked in its GPU's gate directory: a name that tells
    /// the slices of the GPU apart without naming them.
    fn gate_link(&self, uuid: &str, name: &str, dev: usize) -> PathBuf {
        let h = fnv1a(name.bytes());
        self.gates.join(uuid).join(format!("{h:016x}.{dev}"))
    }

    /// Makes a slice's region whole again in place (the same file, which its containers have
    /// mounted): after its container truncated or resized it, emptied and made afresh with the
    /// slice's limits. A new file would not reach the running container, whose processes started
    /// after would then have no region (libvgpu.so refuses their allocations until this is done).
    pub fn repair_region(&self, name: &str) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let s = self.get(name)?;
        let path = self.dir(name).join("region");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io(format!("cannot open {}", path.display())))?;
        let md = f.metadata().map_err(io(format!("cannot stat {}", path.display())))?;
        if !md.is_file() {
            return Err(SliceError::new(ErrorKind::Io, format!("{} is not a regular file", path.display())));
        }
        f.set_len(0).map_err(io(format!("cannot empty {}", path.display())))?;
        let init =
            || Init { devices: s.gpus.iter().map(|g| (g.uuid.clone(), g.memory, g.sm)).collect(), standalone: false };
        let region_err = |e: vgpu_region::RegionError| SliceError::new(ErrorKind::Io, e.to_string());
        let region = Region::open_or_create(&path, init).map_err(region_err)?;
        region.set_priority_high(s.priority == Priority::High).map_err(region_err)?;
        region.set_priority_queue_ns(self.priority_queue_ns).map_err(region_err)?;
        region.set_priority_min_share(self.priority_min_share).map_err(region_err)?;
        region.set_oversubscribe(self.oversubscribe).map_err(region_err)
    }

    /// Cuts a slice's container-writable files (its region and activity file, each of a fixed
    /// size) back to their size where they grew: a container appending to them writes into the
    /// agent's state directory, outside its own storage. What was cut, with the size it had.
    pub fn bound_files(&self, name: &str) -> Vec<(&'static str, u64)> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut cut = Vec::new();
        let dir = self.dir(name);
        let sizes = [("region", vgpu_region::TOTAL_SIZE as u64), ("activity", vgpu_region::activity::SIZE as u64)];
        for (file, size) in sizes {
            let open = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(dir.join(file));
            let Ok(f) = open else { continue };
            match f.metadata() {
                Ok(md) if md.is_file() && md.len() > size && f.set_len(size).is_ok() => cut.push((file, md.len())),
                _ => {}
            }
        }
        cut
    }

    /// Makes `gates/<gpu>/` hold exactly the activity files of the high-priority slices on each GPU
    /// (hard links: the containers see the directory, read-only, not the slices'). Best effort:
    /// what cannot be linked is logged, and a normal slice then does not wait for that one.
    pub fn sync_gates(&self) {
        if let Ok(listing) = self.list() {
            self.sync_gates_of(&listing.slices);
        }
    }

    /// Takes high-priority slice `name` out of its GPUs' gates for `how_long` (its processes keep
    /// their limits; the normal slices stop waiting for it within their next look, 20 ms).
    pub fn suspend_priority(&self, name: &str, how_long: std::time::Duration) {
        let _changing = self.changing.lock();
        self.suspended.lock().insert(name.to_string(), std::time::Instant::now() + how_long);
        self.sync_gates();
    }

    /// Whether slice `name`'s priority is suspended now (expired suspensions are forgotten).
    pub fn priority_suspended(&self, name: &str) -> bool {
        let mut s = self.suspended.lock();
        let now = std::time::Instant::now();
        s.retain(|_, until| *until > now);
        s.contains_key(name)
    }

    /// [`sync_gates`](Self::sync_gates) for `slices`; returns what was there and not wanted, or
    /// not the file it should be (what only a container with its gates remounted read-write makes).
    fn sync_gates_of(&self, slices: &[Slice]) -> Vec<String> {
        let mut want: BTreeMap<PathBuf, PathBuf> = BTreeMap::new();
        for s in slices.iter().filter(|s| s.priority == Priority::High && !self.priority_suspended(&s.name)) {
            for (i, g) in s.gpus.iter().enumerate() {
                if valid_uuid(&g.uuid) {
                    want.insert(self.gate_link(&g.uuid, &s.name, i), self.dir(&s.name).join("activity"));
                }
            }
        }
        let mut wrong = Vec::new();
        // What is there and not wanted goes.
        for gpu in std::fs::read_dir(&self.gates).into_iter().flatten().flatten() {
            for e in std::fs::read_dir(gpu.path()).into_iter().flatten().flatten() {
                if !want.contains_key(&e.path()) && std::fs::remove_file(e.path()).is_ok() {
                    wrong.push(format!("gate file {} removed: no high-priority slice's", e.path().display()));
                }
            }
        }
        use std::os::unix::fs::MetadataExt;
        for (link, target) in want {
            let same = |a: &Path, b: &Path| matches!((a.symlink_metadata(), b.symlink_metadata()), (Ok(x), Ok(y)) if x.ino() == y.ino() && x.dev() == y.dev());
            if same(&link, &target) {
                continue;
            }
            if link.symlink_metadata().is_ok() {
                wrong.push(format!("gate file {} was another file: linked again", link.display()));
            }
            let made = link.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| {
                let tmp = link.with_extension("tmp");
                let _ = std::fs::remove_file(&tmp);
                std::fs::hard_link(&target, &tmp).and_then(|_| std::fs::rename(&tmp, &link))
            });
            if let Err(e) = made {
                tracing::warn!(link = %link.display(), error = %e, "cannot link a high-priority slice into its GPU's gate");
            }
        }
        wrong
    }

    /// Makes a slice's limits file and region in `dir`.
    fn make_files(&self, dir: &Path, gpus: &[SliceGpu], priority: Priority) -> Result<()> {
        let init =
            || Init { devices: gpus.iter().map(|g| (g.uuid.clone(), g.memory, g.sm)).collect(), standalone: false };
        let region_err = |e: vgpu_region::RegionError| SliceError::new(ErrorKind::Io, e.to_string());
        let limits = Region::open_or_create(&dir.join("limits"), init).map_err(region_err)?;
        limits.set_oversubscribe(self.oversubscribe).map_err(region_err)?;
        limits.set_priority_high(priority == Priority::High).map_err(region_err)?;
        limits.set_priority_queue_ns(self.priority_queue_ns).map_err(region_err)?;
        limits.set_priority_min_share(self.priority_min_share).map_err(region_err)?;
        limits.set_mps(self.on_mps(gpus) == Some(true)).map_err(region_err)?;
        // Only the agent writes limits (containers get the file read-only; on the host, other
        // users must not raise them). The region stays writable by every user: a container's
        // processes, whatever their uid, account their usage in it.
        std::fs::set_permissions(dir.join("limits"), std::fs::Permissions::from_mode(0o644))
            .map_err(io(format!("cannot restrict {}", dir.join("limits").display())))?;
        let region = Region::open_or_create(&dir.join("region"), init).map_err(region_err)?;
        region.set_priority_high(priority == Priority::High).map_err(region_err)?;
        region.set_priority_queue_ns(self.priority_queue_ns).map_err(region_err)?;
        region.set_priority_min_share(self.priority_min_share).map_err(region_err)?;
        region.set_oversubscribe(self.oversubscribe).map_err(region_err)?;
        let activity = dir.join("activity");
        vgpu_region::activity::create(&activity).map_err(io(format!("cannot create {}", activity.display())))
    }

    pub fn get(&self, name: &str) -> Result<Slice> {
        check_name(name)?;
        let p = self.record(name);
        let data = read_bounded(&p, RECORD_MAX).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                SliceError::new(ErrorKind::NotFound, format!("no slice named {}", shown(name)))
            }
            _ => SliceError::new(ErrorKind::Io, format!("cannot read {}: {e}", p.display())),
        })?;
        let s: Slice = serde_json::from_slice(&data)
            .map_err(|e| SliceError::new(ErrorKind::Io, format!("{}: {e}", p.display())))?;
        if s.name != name {
            return Err(SliceError::new(ErrorKind::Io, format!("{}: it names slice {}", p.display(), shown(&s.name))));
        }
        check_labels(&s.labels).map_err(|e| SliceError::new(ErrorKind::Io, format!("{}: {e}", p.display())))?;
        Ok(s)
    }

    /// Every slice on record (what a restarted agent recovers). A record that cannot be read is
    /// reported in the listing, and blocks nothing else.
    pub fn list(&self) -> Result<Listing> {
        let mut out = Listing::default();
        let rd = std::fs::read_dir(&self.records).map_err(io(format!("cannot list {}", self.records.display())))?;
        for e in rd.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(name) = file.strip_suffix(".json").filter(|n| valid_name(n)) else { continue };
            match self.get(name) {
                Ok(s) => out.slices.push(s),
                Err(e) => out.quarantined.push((name.to_owned(), e.msg)),
            }
        }
        out.slices.sort_by(|a, b| a.name.cmp(&b.name));
        out.quarantined.sort();
        Ok(out)
    }

    /// Changes limits; running processes apply them at their next allocation or launch. The record
    /// is written first: an agent killed before the regions follow brings them in line at its next
    /// start ([`recover`](Self::recover)).
    pub fn update(&self, name: &str, gpus: &[SliceGpu]) -> Result<Slice> {
        let _changing = self.changing.lock();
        let mut s = self.get(name)?;
        for g in gpus {
            let i = s.gpus.iter().position(|x| x.uuid == g.uuid).ok_or_else(|| {
                SliceError::new(ErrorKind::NotFound, format!("slice {name} has no GPU {}", shown(&g.uuid)))
            })?;
            if g.sm > 100 {
                return Err(SliceError::new(ErrorKind::Invalid, format!("SM limit {} % is above 100", g.sm)));
            }
            s.gpus[i] = g.clone();
        }
        self.write_record(&s)?;
        self.apply_limits(&s)?;
        self.follow_mps();
        Ok(s)
    }

    /// Changes a slice's priority; its running processes follow within a launch or two.
    pub fn set_priority(&self, name: &str, priority: Priority) -> Result<Slice> {
        let _changing = self.changing.lock();
        let mut s = self.get(name)?;
        s.priority = priority;
        self.write_record(&s)?;
        self.apply_limits(&s)?;
        self.sync_gates();
        self.follow_mps();
        Ok(s)
    }

    /// Replaces a slice's labels (the record only; limits and files are untouched).
    pub fn set_labels(&self, name: &str, labels: BTreeMap<String, String>) -> Result<Slice> {
        check_labels(&labels)?;
        let mut s = self.get(name)?;
        s.labels = labels;
        self.write_record(&s)?;
        Ok(s)
    }

    /// Writes a slice's limits from its record into its limits file and region (where they differ).
    /// Neither is opened through a link or as anything but a regular file. Returns what differed.
    fn apply_limits(&self, s: &Slice) -> Result<Vec<String>> {
        self.apply_limits_among(s, None)
    }

    /// [`apply_limits`](Self::apply_limits) with the node's slices given (an MPS slice's partition
    /// depends on them), where the caller has them.
    fn apply_limits_among(&self, s: &Slice, all: Option<&[Slice]>) -> Result<Vec<String>> {
        let mut diffs = Vec::new();
        let sm_limits = self.sm_limits_of(s, all);
        let region_err = |e: vgpu_region::RegionError| SliceError::new(ErrorKind::Io, e.to_string());
        for f in ["limits", "region"] {
            let r = Region::open_strict(&self.dir(&s.name).join(f), true).map_err(region_err)?;
            let mut differ = |what: String, was: String, is: String| diffs.push(format!("{f}: {what} {was}, not {is}"));
            if r.oversubscribe() != self.oversubscribe {
                differ("oversubscription".into(), r.oversubscribe().to_string(), self.oversubscribe.to_string());
                r.set_oversubscribe(self.oversubscribe).map_err(region_err)?;
            }
            let high = s.priority == Priority::High;
            if r.priority_high() != high {
                differ("high priority".into(), r.priority_high().to_string(), high.to_string());
                r.set_priority_high(high).map_err(region_err)?;
            }
            if r.priority_queue_ns() != self.priority_queue_ns {
                differ(
                    "priority queue ns".into(),
                    r.priority_queue_ns().to_string(),
                    self.priority_queue_ns.to_string(),
                );
                r.set_priority_queue_ns(self.priority_queue_ns).map_err(region_err)?;
            }
            if let Some(mps) = self.on_mps(&s.gpus).filter(|&m| m != r.mps()) {
                differ("MPS".into(), r.mps().to_string(), mps.to_string());
                r.set_mps(mps).map_err(region_err)?;
            }
            if r.priority_min_share() != self.priority_min_share {
                differ(
                    "priority min share".into(),
                    r.priority_min_share().to_string(),
                    self.priority_min_share.to_string(),
                );
                r.set_priority_min_share(self.priority_min_share).map_err(region_err)?;
            }
            for ((i, g), &sm) in s.gpus.iter().enumerate().zip(&sm_limits) {
                if r.mem_limit(i) != g.memory {
                    differ(format!("GPU {i} memory"), r.mem_limit(i).to_string(), g.memory.to_string());
                    r.set_mem_limit(i, g.memory).map_err(region_err)?;
                }
                if r.sm_limit(i) != sm {
                    differ(format!("GPU {i} SM %"), r.sm_limit(i).to_string(), sm.to_string());
                    r.set_sm_limit(i, sm).map_err(region_err)?;
                }
            }
            if r.faulted() {
                return Err(SliceError::new(
                    ErrorKind::Io,
                    format!("{} shrank while it was written", r.path().display()),
                ));
            }
        }
        Ok(diffs)
    }

    /// Holds every slice's limits file and region, and the gates, to the records (a container with
    /// CAP_SYS_ADMIN can remount its read-only files read-write and rewrite them): what differed
    /// is put back at once. Returns one line per slice or gate put back.
    pub fn check(&self) -> Vec<(String, String)> {
        let _changing = self.changing.lock();
        let Ok(listing) = self.list() else { return Vec::new() };
        let mut out = Vec::new();
        for s in &listing.slices {
            match self.apply_limits_among(s, Some(&listing.slices)) {
                Ok(d) if !d.is_empty() => out.push((s.name.clone(), format!("limits put back ({})", d.join("; ")))),
                _ => {}
            }
        }
        for g in self.sync_gates_of(&listing.slices) {
            out.push((String::new(), g));
        }
        out
    }

    /// Brings the store to a consistent state at start: records of the former layout (inside the
    /// container's directory) are moved out of its reach; a directory without a record (an
    /// interrupted create or delete) is removed; a slice whose limits file or region is missing,
    /// damaged or not a regular file gets new ones; limits that differ from the record are
    /// rewritten; temporary files that killed writers left are removed. Returns one line per repair.
    pub fn recover(&self) -> Vec<String> {
        let mut done: Vec<String> = remove_temporaries(&self.records)
            .iter()
            .map(|p| format!("removed {}: a write cut short", p.display()))
            .collect();
        let Ok(rd) = std::fs::read_dir(&self.root) else { return done };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let dir = e.path();
            if !valid_name(&name) || !dir.symlink_metadata().is_ok_and(|m| m.is_dir()) {
                continue;
            }
            for p in remove_temporaries(&dir) {
                done.push(format!("removed {}: a write cut short", p.display()));
            }
            if dir.join("slice.json").symlink_metadata().is_ok() {
                done.push(self.migrate(&name));
            }
            let s = match self.get(&name) {
                Ok(s) => s,
                Err(e) if e.kind == ErrorKind::NotFound => {
                    if std::fs::remove_dir_all(&dir).is_ok() {
                        done.push(format!("removed {}: an interrupted create or delete", dir.display()));
                    }
                    continue;
                }
                Err(e) => {
                    done.push(format!("slice {name} quarantined: {e}"));
                    continue;
                }
            };
            self.recover_files(&s, &mut done);
            match self.apply_limits(&s) {
                Ok(d) if !d.is_empty() => {
                    done.push(format!("slice {name}: limits brought in line with its record ({})", d.join("; ")))
                }
                Ok(_) => {}
                Err(e) => done.push(format!("slice {name}: {e}")),
            }
            // A slice from before activity files (or whose file is not one): a new one; processes
            // already running keep theirs (they run without the gate until they restart).
            let activity = self.dir(&name).join("activity");
            if vgpu_region::activity::Mapped::open(&activity, false).is_none() {
                let _ = std::fs::remove_file(&activity);
                match vgpu_region::activity::create(&activity) {
                    Ok(()) => done.push(format!("made {}", activity.display())),
                    Err(e) => done.push(format!("cannot make {}: {e}", activity.display())),
                }
            }
        }
        self.sync_gates();
        done
    }

    /// Makes a slice's limits file and region anew where they are missing, damaged or not regular
    /// files (a link is removed, never followed).
    fn recover_files(&self, s: &Slice, done: &mut Vec<String>) {
        let dir = self.dir(&s.name);
        for f in ["limits", "region"] {
            let p = dir.join(f);
            let odd = p.symlink_metadata().is_ok_and(|m| !m.file_type().is_file());
            if odd {
                let gone = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir_all(&p));
                done.push(format!(
                    "removed {}: not a regular file ({})",
                    p.display(),
                    if gone.is_ok() { "done" } else { "failed" }
                ));
            } else if let Err(e) = Region::open_strict(&p, true) {
                // Recreated only if missing or damaged. One another build wrote (another ABI or
                // layout), or one that could not be opened just now, may be in use by the slice's
                // processes (the container's mount holds the file itself: a new file here would
                // never reach them); it is left alone and reported.
                if let Some(why) = keep_region(&e) {
                    done.push(format!("left {} alone: {e}{why}", p.display()));
                    continue;
                }
                let _ = std::fs::remove_file(&p);
            } else {
                continue;
            }
            let init = || Init {
                devices: s.gpus.iter().map(|g| (g.uuid.clone(), g.memory, g.sm)).collect(),
                standalone: false,
            };
            match Region::open_or_create(&p, init) {
                Ok(_) => {
                    if f == "limits" {
                        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644));
                    }
                    done.push(format!("recreated {} (missing or unreadable)", p.display()))
                }
                Err(e) => done.push(format!("cannot recreate {}: {e}", p.display())),
            }
        }
    }

    /// Moves the record of the former layout (`slices/<name>/slice.json`, which the container could
    /// write) out of its reach. Its limits are not believed: they are taken from the slice's limits
    /// file, which the container only ever had read-only; its labels and creation time are kept
    /// where they are valid.
    fn migrate(&self, name: &str) -> String {
        let dir = self.dir(name);
        let old = dir.join("slice.json");
        let line = if self.record(name).symlink_metadata().is_ok() {
            format!("removed {}: the record is in {} now", old.display(), self.records.display())
        } else {
            match Region::open_strict(&dir.join("limits"), false) {
                Ok(limits) => {
                    let gpus = (0..limits.ndevices())
                        .map(|i| SliceGpu { uuid: limits.device_uuid(i), memory: limits.mem_limit(i), sm: limits.sm_limit(i) })
                        .collect();
                    let was: Option<Slice> =
                        read_bounded(&old, RECORD_MAX).ok().and_then(|d| serde_json::from_slice(&d).ok());
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                    let mut s = Slice {
                        name: name.to_owned(),
                        gpus,
                        created: now.as_secs(),
                        labels: BTreeMap::new(),
                        created_ns: 0,
                        priority: if limits.priority_high() { Priority::High } else { Priority::Normal },
                    };
                    if let Some(w) = was {
                        (s.created, s.created_ns) = (w.created, w.created_ns);
                        if check_labels(&w.labels).is_ok() {
                            s.labels = w.labels;
                        }
                    }
                    match self.write_record(&s) {
                        Ok(()) => format!(
                            "moved the record of slice {name} out of the container's reach ({}), with the limits of its read-only limits file",
                            self.record(name).display()
                        ),
                        Err(e) => return format!("slice {name}: cannot move its record: {e}"),
                    }
                }
                Err(e) => return format!("slice {name}: its former record is not believed and its limits file cannot be read ({e}); quarantined"),
            }
        };
        let _ = std::fs::remove_file(&old);
        line
    }

    /// Deletes a slice. Refused while processes of the container are alive, unless `force`. A
    /// quarantined slice (its record unreadable) is deleted with `force`.
    pub fn delete(&self, name: &str, force: bool) -> Result<()> {
        check_name(name)?;
        let record = self.record(name);
        if record.symlink_metadata().is_err() {
            return Err(SliceError::new(ErrorKind::NotFound, format!("no slice named {}", shown(name))));
        }
        if !force {
            self.get(name)?;
        }
        let dir = self.dir(name);
        if !force {
            if let Ok(r) = Region::open_strict(&dir.join("region"), true) {
                r.reap();
                let live = r.slots();
                if !live.is_empty() && !r.faulted() {
                    return Err(SliceError::new(
                        ErrorKind::Busy,
                        format!("slice {name} has {} live process(es); stop them or force the deletion", live.len()),
                    ));
                }
            }
        }
        // The record goes first: a deletion interrupted after it leaves a directory that is no
        // longer a slice, which the next create or start removes.
        let _changing = self.changing.lock();
        std::fs::remove_file(&record).map_err(io(format!("cannot remove {}", record.display())))?;
        self.sync_gates();
        self.follow_mps();
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(SliceError::new(ErrorKind::Io, format!("cannot remove {}: {e}", dir.display())))
            }
            _ => Ok(()),
        }
    }

    /// The environment and mounts that put a process into this slice (for `docker run`): the region
    /// file read-write and the limits file read-only, each mounted by itself.
    pub fn injection(&self, name: &str, library: Option<&Path>) -> Result<Injection> {
        self.injection_of(&self.get(name)?, library)
    }

    /// [`injection`](Self::injection) of a slice the caller holds (its record is not read again:
    /// a record damaged since the agent read it takes nothing else down with it).
    pub fn injection_of(&self, s: &Slice, library: Option<&Path>) -> Result<Injection> {
        let name = s.name.as_str();
        let mut env = vec![
            ("LD_PRELOAD".to_string(), format!("{CONTAINER_DIR}/libvgpu.so")),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE".to_string(), format!("{CONTAINER_DIR}/region")),
            ("VGPU_LIMITS_FILE".to_string(), format!("{CONTAINER_DIR}/limits")),
            (
                "NVIDIA_VISIBLE_DEVICES".to_string(),
                s.gpus.iter().map(|g| g.uuid.as_str()).collect::<Vec<_>>().join(","),
            ),
        ];
        if self.oversubscribe {
            env.push(("CUDA_OVERSUBSCRIBE".to_string(), "true".to_string()));
        }
        let mps = self.mps_pipe(name, &s.gpus)?;
        for (i, g) in s.gpus.iter().enumerate() {
            if g.memory > 0 {
                env.push((format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), format!("{}m", g.memory.div_ceil(1 << 20))));
            }
            // Under MPS the share is the slice's partition of the SMs (libvgpu.so holds the
            // process to it at cuInit), not a share of time.
            if g.sm > 0 && g.sm < 100 {
                let key = if mps.is_some() {
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into()
                } else {
                    format!("CUDA_DEVICE_SM_LIMIT_{i}")
                };
                env.push((key, g.sm.to_string()));
            }
            if mps.is_some() && g.memory > 0 {
                env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), format!("{i}={}M", g.memory.div_ceil(1 << 20))));
            }
        }
        env.push(("VGPU_ACTIVITY_FILE".to_string(), format!("{CONTAINER_DIR}/activity")));
        env.push(("VGPU_GATES_DIR".to_string(), format!("{CONTAINER_DIR}/gates")));
        let dir = self.dir(name);
        let m = |host: PathBuf, container: String, read_only| Mount { host, container, read_only };
        let mut mounts = vec![
            m(dir.join("region"), format!("{CONTAINER_DIR}/region"), false),
            m(dir.join("limits"), format!("{CONTAINER_DIR}/limits"), true),
            m(dir.join("activity"), format!("{CONTAINER_DIR}/activity"), false),
        ];
        // The gates of the slice's own GPUs only: another GPU's would tell a tenant the rhythm of
        // high-priority work it does not share a GPU with. Each is made now, so that it can be
        // mounted before any high-priority slice is linked into it.
        for g in s.gpus.iter().filter(|g| valid_uuid(&g.uuid)) {
            let gate = self.gates.join(&g.uuid);
            std::fs::create_dir_all(&gate)
                .map_err(|e| SliceError::new(ErrorKind::Io, format!("{}: {e}", gate.display())))?;
            mounts.push(m(gate, format!("{CONTAINER_DIR}/gates/{}", g.uuid), true));
        }
        if let Some(lib) = library {
            mounts.push(m(lib.to_owned(), format!("{CONTAINER_DIR}/libvgpu.so"), true));
        }
        if let Some(pipe) = mps {
            env.push(("CUDA_MPS_PIPE_DIRECTORY".into(), CONTAINER_MPS_DIR.into()));
            mounts.push(m(pipe, CONTAINER_MPS_DIR.into(), false));
        }
        Ok(Injection { env, mounts })
    }

    /// The MPS pipe directory of slice `s`'s GPU, where it runs MPS. A slice with an MPS GPU among
    /// several is refused: a process reaches one daemon (`CUDA_MPS_PIPE_DIRECTORY`), and each GPU
    /// has its own.
    fn mps_pipe(&self, name: &str, gpus: &[SliceGpu]) -> Result<Option<PathBuf>> {
        let m = self.mps.read();
        let Some(m) = m.as_ref() else { return Ok(None) };
        let on: Vec<&SliceGpu> = gpus.iter().filter(|g| m.contains_key(&g.uuid)).collect();
        match (&on[..], gpus.len()) {
            ([], _) => Ok(None),
            ([g], 1) => Ok(m.get(&g.uuid).cloned()),
            ([g, ..], n) => Err(SliceError::new(
                ErrorKind::Invalid,
                format!(
                    "slice {} has {n} GPUs and {} runs MPS: a process reaches one MPS daemon, so a slice on an MPS \
                     GPU has that GPU only",
                    name,
                    shown(&g.uuid)
                ),
            )),
        }
    }
}

/// Slice `s`'s partition of its GPU `g` under MPS, of `all` the node's slices: its own share (`sm`,
/// 0 for the whole GPU), but a normal slice's where high-priority slices share the GPU and the
/// normal slices' shares there add up to more than those leave: scaled down with the others to fit,
/// at least 1 %. A high-priority slice's SMs are then its own (docs/mps.md).
fn mps_share(s: &Slice, g: &SliceGpu, all: &[Slice]) -> u32 {
    if s.priority == Priority::High {
        return g.sm;
    }
    let share = |x: &SliceGpu| if (1..100).contains(&x.sm) { x.sm } else { 100 };
    let (mut high, mut normal) = (0u32, 0u32);
    for o in all.iter().filter(|o| o.name != s.name).chain([s]) {
        for x in o.gpus.iter().filter(|x| x.uuid == g.uuid) {
            if o.priority == Priority::High {
                high += share(x);
            } else {
                normal += share(x);
            }
        }
    }
    let left = 100u32.saturating_sub(high).max(1);
    if high == 0 || normal <= left {
        return g.sm;
    }
    ((u64::from(share(g)) * u64::from(left) / u64::from(normal)) as u32).max(1)
}

/// Why a region file that cannot be opened is to be kept (None: it is missing or damaged, and is
/// made anew).
fn keep_region(e: &vgpu_region::RegionError) -> Option<&'static str> {
    use vgpu_region::RegionError as E;
    match e {
        E::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => None,
        E::Io { .. } => Some(" (it may be in use; try again with the agent's next start)"),
        E::Version { .. } | E::Layout { .. } => Some(
            " (written by another build of vgpu: the slice's processes may be using it; drain the node to \
             move it to this one)",
        ),
        _ => None,
    }
}

/// Installs `src` as `<lib_dir>/libvgpu.so.<version>.<digest>` (content-addressed, written to a
/// temporary name and renamed; an existing file of that name is the same content and is kept). Its
/// modification time says when it became the current install (see [`prune_libraries`]).
pub fn install_library(src: &Path, lib_dir: &Path, version: &str) -> Result<PathBuf> {
    let data = std::fs::read(src).map_err(io(format!("cannot read {}", src.display())))?;
    let digest = fnv1a(data.iter().copied());
    std::fs::create_dir_all(lib_dir).map_err(io(format!("cannot create {}", lib_dir.display())))?;
    let dst = lib_dir.join(format!("libvgpu.so.{version}.{digest:016x}"));
    if !dst.exists() {
        write_atomic(&dst, &data, 0o755)?;
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755))
            .map_err(io(format!("cannot chmod {}", dst.display())))?;
    } else {
        // Current again (a restart, or a rollback to it): from now. Opened read-only: running
        // containers may have it mapped.
        std::fs::File::open(&dst)
            .and_then(|f| f.set_modified(std::time::SystemTime::now()))
            .map_err(io(format!("cannot touch {}", dst.display())))?;
    }
    Ok(dst)
}

/// Removes the library installs in `lib_dir` other than `current` that no container can need any
/// more, and returns them. An install is kept while any slice is older than the current install
/// (its container may have been given the older file, and a restart of that container asks for it
/// again: the kubelet keeps a device plugin's answer for the pod's life, and a CDI spec written then
/// names it) and while any process has it mapped.
pub fn prune_libraries(lib_dir: &Path, current: &Path, slices: &[Slice]) -> Vec<PathBuf> {
    let since = std::fs::metadata(current)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as u64);
    // A record from before `created_ns` existed (0) is older than anything.
    if !since.is_some_and(|s| slices.iter().all(|x| x.created_ns >= s)) {
        return Vec::new();
    }
    let Ok(dir) = std::fs::read_dir(lib_dir) else { return Vec::new() };
    let old: Vec<(crate::procfs::FileId, PathBuf)> = dir
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.as_path() != current
                && p.file_name().and_then(|n| n.to_str()).is_some_and(is_install_name)
                && p.metadata().is_ok_and(|m| m.is_file())
        })
        .filter_map(|p| Some((crate::procfs::file_id(&p)?, p)))
        .collect();
    if old.is_empty() {
        return Vec::new();
    }
    let mapped = crate::procfs::mapped_anywhere(&old);
    old.into_iter()
        .filter(|(id, _)| !mapped.contains(id))
        .filter_map(|(_, p)| std::fs::remove_file(&p).is_ok().then_some(p))
        .collect()
}

/// `libvgpu.so.<version>.<16 hex digits>`: a name [`install_library`] gives (not a temporary file).
fn is_install_name(n: &str) -> bool {
    let Some(rest) = n.strip_prefix("libvgpu.so.") else { return false };
    let Some((version, digest)) = rest.rsplit_once('.') else { return false };
    !version.is_empty() && digest.len() == 16 && digest.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_interrupted_change_is_repaired_at_start() {
        let (st, d) = store();
        let gpu = |m| vec![super::SliceGpu { uuid: "GPU-a".into(), memory: m, sm: 30 }];
        st.create("ok", gpu(1 << 30), Default::default()).unwrap();
        st.create("drift", gpu(1 << 30), Default::default()).unwrap();
        st.create("lost", gpu(2 << 30), Default::default()).unwrap();
        // Killed during a create (the record not yet written) and during a delete (record gone).
        std::fs::create_dir(st.dir("half")).unwrap();
        std::fs::write(st.dir("half").join("region"), b"partial").unwrap();
        // Killed after an update wrote its record, before the regions followed.
        let mut s = st.get("drift").unwrap();
        s.gpus[0].memory = 3 << 30;
        st.write_record(&s).unwrap();
        // A limits file gone and a region overwritten.
        std::fs::remove_file(st.dir("lost").join("limits")).unwrap();
        std::fs::write(st.dir("lost").join("region"), vec![0xffu8; 4096]).unwrap();
        // A new slice of the half-made one's name works even before recovery.
        let repairs = st.recover();
        // (the lost slice's new files get their limits, the priority queue bound among them)
        assert_eq!(repairs.len(), 5, "{repairs:?}");
        assert!(!st.dir("half").exists());
        assert_eq!(
            st.list().unwrap().slices.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["drift", "lost", "ok"]
        );
        for f in ["limits", "region"] {
            let r = vgpu_region::Region::open(&st.dir("drift").join(f), false).unwrap();
            assert_eq!(r.mem_limit(0), 3 << 30, "{f}");
            let r = vgpu_region::Region::open(&st.dir("lost").join(f), false).unwrap();
            assert_eq!((r.mem_limit(0), r.sm_limit(0), r.device_uuid(0).as_str()), (2 << 30, 30, "GPU-a"), "{f}");
        }
        assert!(st.recover().is_empty(), "nothing left to repair");
        std::fs::create_dir(st.dir("again")).unwrap();
        st.create("again", gpu(1 << 30), Default::default()).expect("a leftover directory does not block a create");
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn a_region_another_build_wrote_is_left_alone_and_a_damaged_one_made_anew() {
        use std::os::unix::fs::FileExt;
        let (st, d) = store();
        for n in ["newer-abi", "bigger", "damaged"] {
            st.create(n, vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        }
        let region = |n: &str| st.dir(n).join("region");
        let f = |n: &str| std::fs::OpenOptions::new().write(true).open(region(n)).unwrap();
        // A later ABI version, and a later layout of another size: the slices' processes may use them.
        f("newer-abi").write_all_at(&2u32.to_le_bytes(), 8).unwrap();
        f("bigger").write_all_at(&2u32.to_le_bytes(), 8).unwrap();
        f("bigger").set_len(vgpu_region::TOTAL_SIZE as u64 + 4096).unwrap();
        // This build's header on a file of the wrong size: damaged.
        f("damaged").set_len(4096).unwrap();
        let repairs = st.recover();
        for n in ["newer-abi", "bigger"] {
            assert!(
                repairs
                    .iter()
                    .any(|r| r.contains(&format!("left {} alone", region(n).display())) && r.contains("another build")),
                "{n}: {repairs:?}"
            );
            let mut v = [0u8; 4];
            std::fs::File::open(region(n)).unwrap().read_exact_at(&mut v, 8).unwrap();
            assert_eq!(u32::from_le_bytes(v), 2, "{n}: not made anew");
        }
        assert!(repairs.iter().any(|r| r.contains("recreated") && r.contains("damaged")), "{repairs:?}");
        assert!(Region::open(&region("damaged"), false).is_ok());
        std::fs::remove_dir_all(d).ok();
    }

    /// Attacks through the files a container used to reach (issue: the whole slice directory was
    /// mounted read-write): a rewritten record, a region replaced by a link to a neighbour's limits,
    /// a garbage record, a record linked to /dev/zero. None of them may move a limit or block
    /// another slice.
    #[test]
    fn the_record_is_out_of_the_container_s_reach_and_only_its_files_are_mounted() {
        let (st, d) = store();
        st.create("job", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        let inj = st.injection("job", None).unwrap();
        let hosts: Vec<_> = inj.mounts.iter().map(|m| (m.host.clone(), m.container.as_str(), m.read_only)).collect();
        assert_eq!(
            hosts,
            [
                (st.dir("job").join("region"), "/usr/local/vgpu/region", false),
                (st.dir("job").join("limits"), "/usr/local/vgpu/limits", true),
                (st.dir("job").join("activity"), "/usr/local/vgpu/activity", false),
                (d.join("gates").join("GPU-aaaa"), "/usr/local/vgpu/gates/GPU-aaaa", true),
            ],
            "the files alone, never the slice's directory (its GPU's gate, read-only, holds links only)"
        );
        assert!(!st.dir("job").join("slice.json").exists(), "no record beside what the container gets");
        let mode = std::fs::metadata(d.join("records")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn a_former_record_the_container_rewrote_does_not_raise_its_limit() {
        let (st, d) = store();
        st.create("job", vec![gpu(1 << 30, 30)], [("pod".to_string(), "a".to_string())].into()).unwrap();
        // The former layout: the record inside the (container-writable) directory, raised to 70 GiB.
        let mut s = st.get("job").unwrap();
        std::fs::remove_file(st.record("job")).unwrap();
        s.gpus[0].memory = 70 << 30;
        s.gpus[0].sm = 0;
        std::fs::write(st.dir("job").join("slice.json"), serde_json::to_vec(&s).unwrap()).unwrap();
        let repairs = st.recover();
        assert!(repairs.iter().any(|r| r.contains("moved the record of slice job")), "{repairs:?}");
        let got = st.get("job").unwrap();
        assert_eq!((got.gpus[0].memory, got.gpus[0].sm), (1 << 30, 30), "the read-only limits file decides");
        assert_eq!(got.labels["pod"], "a");
        assert!(!st.dir("job").join("slice.json").exists());
        for f in ["limits", "region"] {
            assert_eq!(Region::open(&st.dir("job").join(f), false).unwrap().mem_limit(0), 1 << 30, "{f}");
        }
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn a_region_replaced_by_a_link_is_never_followed() {
        let (st, d) = store();
        st.create("victim", vec![gpu(4 << 30, 0)], Default::default()).unwrap();
        st.create("evil", vec![gpu(1 << 20, 0)], Default::default()).unwrap();
        let victim = st.dir("victim").join("limits");
        std::fs::remove_file(st.dir("evil").join("region")).unwrap();
        std::os::unix::fs::symlink(&victim, st.dir("evil").join("region")).unwrap();
        // Neither an update nor a restart's repair writes through the link.
        assert!(st.update("evil", &[gpu(2 << 20, 0)]).unwrap_err().msg.contains("not a regular file"));
        let repairs = st.recover();
        assert!(repairs.iter().any(|r| r.contains("not a regular file")), "{repairs:?}");
        assert_eq!(Region::open(&victim, false).unwrap().mem_limit(0), 4 << 30, "the neighbour keeps its limit");
        let evil = st.dir("evil").join("region");
        assert!(evil.symlink_metadata().unwrap().file_type().is_file(), "made anew as a file");
        assert_eq!(Region::open(&evil, false).unwrap().mem_limit(0), 2 << 20);
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn a_record_that_cannot_be_read_quarantines_its_slice_alone() {
        let (st, d) = store();
        for n in ["a", "garbage", "zero", "z"] {
            st.create(n, vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        }
        std::fs::write(st.record("garbage"), b"{not json").unwrap();
        std::fs::remove_file(st.record("zero")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", st.record("zero")).unwrap();
        let t = std::time::Instant::now();
        let l = st.list().unwrap();
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "a bounded read");
        assert_eq!(l.slices.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["a", "z"]);
        assert_eq!(l.quarantined.iter().map(|q| q.0.as_str()).collect::<Vec<_>>(), ["garbage", "zero"]);
        assert!(l.quarantined[1].1.contains("symbolic link"), "{:?}", l.quarantined);
        // A big record is refused by its size, not read whole.
        std::fs::write(st.record("a"), vec![b' '; RECORD_MAX as usize + 1]).unwrap();
        assert!(st.get("a").unwrap_err().msg.contains("more than the"));
        // Quarantined slices are deleted with force; the name is then free.
        assert!(st.delete("garbage", false).is_err());
        st.delete("garbage", true).unwrap();
        st.delete("zero", true).unwrap();
        st.create("garbage", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn every_name_is_checked_on_every_path_and_nothing_outside_the_store_is_touched() {
        let (st, d) = store();
        st.create("victim", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        let outside = d.join("outside").join("precious");
        std::fs::create_dir_all(&outside).unwrap();
        for name in ["lib/../victim", "../outside/precious", "../../../outside/precious", "..", "a/b", ""] {
            for force in [false, true] {
                let e = st.delete(name, force).unwrap_err();
                assert_eq!(e.kind, ErrorKind::Invalid, "{name:?}: {e}");
            }
            assert_eq!(st.get(name).unwrap_err().kind, ErrorKind::Invalid);
            assert_eq!(st.update(name, &[]).unwrap_err().kind, ErrorKind::Invalid);
            assert_eq!(st.set_labels(name, Default::default()).unwrap_err().kind, ErrorKind::Invalid);
        }
        assert!(outside.exists() && st.get("victim").is_ok());
        let long = "x".repeat(70_000);
        let e = st.create(&long, vec![gpu(1, 0)], Default::default()).unwrap_err().msg;
        assert!(e.len() < 300 && e.contains("(70000 bytes)"), "the name is not echoed whole: {} bytes", e.len());
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn slices_and_labels_are_bounded_with_clear_errors() {
        let (st, d) = store();
        let st = st.with_max_slices(2);
        st.create("a", vec![gpu(1, 0)], Default::default()).unwrap();
        st.create("b", vec![gpu(1, 0)], Default::default()).unwrap();
        let e = st.create("c", vec![gpu(1, 0)], Default::default()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Full);
        assert!(e.msg.contains("2 slices, the most max_slices = 2 allows"), "{e}");
        st.delete("b", true).unwrap();
        let label = |k: &str, v: String| BTreeMap::from([(k.to_string(), v)]);
        for (labels, want) in [
            (label("pod", "x".repeat(LABEL_VALUE_MAX + 1)), "its value has 1025 bytes"),
            (label("pod", "a\u{1b}[31m".into()), "control characters"),
            ((0..=LABELS_MAX).map(|i| (format!("k{i}"), String::new())).collect(), "at most 32"),
        ] {
            let e = st.create("c", vec![gpu(1, 0)], labels.clone()).unwrap_err();
            assert!(e.kind == ErrorKind::Invalid && e.msg.contains(want), "{e}");
            assert!(st.set_labels("a", labels).unwrap_err().msg.contains(want));
        }
        assert_eq!(printable("a\u{1b}[31mb\n"), "a?[31mb?");
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn what_killed_writers_left_is_removed_at_start() {
        let (st, d) = store();
        st.create("a", vec![gpu(1, 0)], Default::default()).unwrap();
        std::fs::write(d.join("records").join(".a.json.tmp.4242"), b"{").unwrap();
        std::fs::write(st.dir("a").join("slice.tmp.77"), b"{").unwrap();
        let lib = d.join("lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libvgpu.so.0.1.0.tmp.99"), b"half").unwrap();
        std::fs::write(lib.join(".libvgpu.so.0.1.0.0123456789abcdef.tmp.98"), b"half").unwrap();
        std::fs::write(lib.join("libvgpu.so.0.1.0.0123456789abcdef"), b"whole").unwrap();
        let repairs = st.recover();
        assert_eq!(repairs.iter().filter(|r| r.contains("a write cut short")).count(), 2, "{repairs:?}");
        assert_eq!(remove_temporaries(&lib).len(), 2);
        assert_eq!(std::fs::read_dir(&lib).unwrap().count(), 1, "the install stays");
        std::fs::remove_dir_all(d).ok();
    }

    use super::*;

    fn store() -> (SliceStore, PathBuf) {
        let d =
            std::env::temp_dir().join(format!("vgpu-slices-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&d);
        (SliceStore::open(&d).unwrap(), d)
    }

    fn gpu(m: u64, sm: u32) -> SliceGpu {
        SliceGpu { uuid: "GPU-aaaa".into(), memory: m, sm }
    }

    /// On an MPS GPU a high-priority slice's SMs are its own: the normal slices' partitions shrink
    /// together to what it leaves while it is there, and come back when it goes; on other GPUs and
    /// without one the shares are the records'.
    #[test]
    fn normal_partitions_make_room_for_a_high_priority_slice_under_mps() {
        let (st, d) = store();
        st.set_mps(BTreeMap::from([("GPU-aaaa".to_string(), d.join("pipe"))]));
        let sm = |n: &str| Region::open(&d.join("slices").join(n).join("limits"), false).unwrap().sm_limit(0);
        st.create("n1", vec![gpu(1 << 30, 60)], Default::default()).unwrap();
        st.create("n2", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        st.create("other", vec![SliceGpu { uuid: "GPU-bbbb".into(), memory: 0, sm: 40 }], Default::default()).unwrap();
        assert_eq!((sm("n1"), sm("n2"), sm("other")), (60, 0, 40), "no high-priority slice: the records'");
        st.create_with("svc", vec![gpu(1 << 30, 50)], Default::default(), Priority::High).unwrap();
        // 60 + 100 (the whole GPU) of normal shares into the 50 % left: 18 and 31.
        assert_eq!((sm("n1"), sm("n2"), sm("svc"), sm("other")), (18, 31, 50, 40));
        assert!(Region::open(&d.join("slices/n1/limits"), false).unwrap().mps());
        st.set_priority("svc", Priority::Normal).unwrap();
        assert_eq!((sm("n1"), sm("n2"), sm("svc")), (60, 0, 50), "no high-priority slice any more");
        st.set_priority("svc", Priority::High).unwrap();
        assert_eq!(sm("n1"), 18);
        st.delete("svc", true).unwrap();
        assert_eq!((sm("n1"), sm("n2")), (60, 0), "it went");
        assert!(st.check().is_empty(), "nothing to put back: {:?}", st.check());
        std::fs::remove_dir_all(d).ok();
    }

    /// A GPU's gate holds exactly its high-priority slices' activity files, as the priority
    /// changes and slices go.
    #[test]
    fn the_gates_follow_the_high_priority_slices() {
        use std::os::unix::fs::MetadataExt;
        let (st, d) = store();
        let gate = |n: &str| -> Vec<u64> {
            std::fs::read_dir(d.join("gates").join(n))
                .map_or(Vec::new(), |rd| rd.flatten().map(|e| e.metadata().unwrap().ino()).collect())
        };
        let ino = |slice: &str| std::fs::metadata(st.dir(slice).join("activity")).unwrap().ino();
        st.create_with("svc", vec![gpu(1 << 30, 0)], Default::default(), Priority::High).unwrap();
        st.create("batch", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        assert_eq!(gate("GPU-aaaa"), [ino("svc")]);
        let names: Vec<String> = std::fs::read_dir(d.join("gates/GPU-aaaa"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains("svc") && n.ends_with(".0")), "named without the slice: {names:?}");
        st.set_priority("batch", Priority::High).unwrap();
        let mut both = vec![ino("svc"), ino("batch")];
        both.sort();
        let mut now = gate("GPU-aaaa");
        now.sort();
        assert_eq!(now, both);
        st.set_priority("svc", Priority::Normal).unwrap();
        assert_eq!(gate("GPU-aaaa"), [ino("batch")]);
        st.delete("batch", true).unwrap();
        assert!(gate("GPU-aaaa").is_empty());
        // A restart finds the record's priority again: the gate is remade from the records.
        st.set_priority("svc", Priority::High).unwrap();
        std::fs::remove_dir_all(d.join("gates/GPU-aaaa")).unwrap();
        st.recover();
        assert_eq!(gate("GPU-aaaa"), [ino("svc")]);
    }

    #[test]
    fn create_get_update_list_delete() {
        let (s, d) = store();
        let a = s.create("job1", vec![gpu(8 << 30, 30)], Default::default()).unwrap();
        assert_eq!(s.get("job1").unwrap(), a);
        assert!(s.create("job1", vec![gpu(1, 0)], Default::default()).unwrap_err().msg.contains("already exists"));
        assert!(s
            .create("Bad Name", vec![gpu(1, 0)], Default::default())
            .unwrap_err()
            .msg
            .contains("invalid slice name"));
        assert!(s.create("x", vec![gpu(1, 120)], Default::default()).unwrap_err().msg.contains("above 100"));
        let limits = Region::open(&s.dir("job1").join("limits"), false).unwrap();
        assert_eq!(
            (limits.mem_limit(0), limits.sm_limit(0), limits.device_uuid(0)),
            (8 << 30, 30, "GPU-aaaa".to_string())
        );
        s.update("job1", &[gpu(4 << 30, 50)]).unwrap();
        assert_eq!((limits.mem_limit(0), limits.sm_limit(0)), (4 << 30, 50), "seen live through the mapping");
        assert!(s
            .update("job1", &[SliceGpu { uuid: "GPU-zz".into(), memory: 1, sm: 0 }])
            .unwrap_err()
            .msg
            .contains("no GPU"));
        s.create("job0", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        let names: Vec<String> = s.list().unwrap().slices.into_iter().map(|x| x.name).collect();
        assert_eq!(names, vec!["job0", "job1"]);
        // A live process in the slice blocks deletion.
        let region = Region::open(&s.dir("job1").join("region"), true).unwrap();
        let claim = region.claim(42, 42).unwrap();
        assert!(s.delete("job1", false).unwrap_err().msg.contains("1 live process"));
        drop(claim);
        s.delete("job1", false).unwrap();
        assert!(s.get("job1").unwrap_err().msg.contains("no slice named \"job1\""));
        // A restarted agent recovers what is on disk.
        let again = SliceStore::open(&d).unwrap();
        assert_eq!(again.list().unwrap().slices.len(), 1);
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn injection_and_library_install() {
        let (s, d) = store();
        s.create(
            "web",
            vec![gpu(3000 << 20, 25), SliceGpu { uuid: "GPU-bbbb".into(), memory: 0, sm: 0 }],
            Default::default(),
        )
        .unwrap();
        let src = d.join("libvgpu.so");
        std::fs::write(&src, b"v1").unwrap();
        let lib = install_library(&src, &d.join("lib"), "0.1.0").unwrap();
        assert!(lib.file_name().unwrap().to_string_lossy().starts_with("libvgpu.so.0.1.0."));
        assert_eq!(install_library(&src, &d.join("lib"), "0.1.0").unwrap(), lib, "same content, same file");
        std::fs::write(&src, b"v2").unwrap();
        let lib2 = install_library(&src, &d.join("lib"), "0.1.0").unwrap();
        assert_ne!(lib2, lib, "new content gets a new name");
        assert_eq!(std::fs::read(&lib).unwrap(), b"v1", "the old file is left for running containers");
        let inj = s.injection("web", Some(&lib)).unwrap();
        let get = |k: &str| inj.env.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone());
        assert_eq!(get("CUDA_DEVICE_MEMORY_LIMIT_0").as_deref(), Some("3000m"));
        assert_eq!(get("CUDA_DEVICE_SM_LIMIT_0").as_deref(), Some("25"));
        assert_eq!(get("CUDA_DEVICE_MEMORY_LIMIT_1"), None);
        assert_eq!(get("NVIDIA_VISIBLE_DEVICES").as_deref(), Some("GPU-aaaa,GPU-bbbb"));
        assert!(inj
            .mounts
            .iter()
            .any(|m| m.host.ends_with("limits") && m.container == "/usr/local/vgpu/limits" && m.read_only));
        // The gates of its own GPUs only, each read-only (issue 61, item 18: every GPU's were
        // mounted, so a tenant read the rhythm of high-priority work on GPUs it does not use).
        s.create("elsewhere", vec![SliceGpu { uuid: "GPU-cccc".into(), memory: 0, sm: 0 }], Default::default())
            .unwrap();
        let gates: Vec<&str> =
            inj.mounts.iter().filter(|m| m.container.contains("/gates")).map(|m| m.container.as_str()).collect();
        assert_eq!(gates, ["/usr/local/vgpu/gates/GPU-aaaa", "/usr/local/vgpu/gates/GPU-bbbb"]);
        assert!(inj.mounts.iter().filter(|m| m.container.contains("/gates")).all(|m| m.read_only && m.host.is_dir()));
        std::fs::remove_dir_all(d).ok();
    }

    /// A container that appends to its region and activity file (both mounted read-write) is cut
    /// back to their sizes (issue 61, item 21: 200 MiB each went into the agent's state directory,
    /// and the activity file kept them across a restart).
    #[test]
    fn files_a_container_grows_are_cut_back_to_their_size() {
        use std::io::Write;
        let (s, d) = store();
        s.create("fat", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        assert!(s.bound_files("fat").is_empty(), "nothing to cut in a fresh slice");
        for f in ["region", "activity"] {
            let mut h = std::fs::OpenOptions::new().append(true).open(s.dir("fat").join(f)).unwrap();
            h.write_all(&vec![7u8; 1 << 20]).unwrap();
        }
        let cut = s.bound_files("fat");
        assert_eq!(cut.iter().map(|(f, _)| *f).collect::<Vec<_>>(), ["region", "activity"], "{cut:?}");
        let len = |f: &str| std::fs::metadata(s.dir("fat").join(f)).unwrap().len();
        assert_eq!(
            (len("region"), len("activity")),
            (vgpu_region::TOTAL_SIZE as u64, vgpu_region::activity::SIZE as u64)
        );
        assert!(vgpu_region::activity::Mapped::open(&s.dir("fat").join("activity"), false).is_some(), "still valid");
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn older_library_installs_go_once_no_slice_predates_the_current_one_and_no_process_maps_them() {
        let (s, d) = store();
        let libs = d.join("lib");
        let src = d.join("libvgpu.so");
        let install = |content: &[u8]| {
            std::fs::write(&src, content).unwrap();
            install_library(&src, &libs, "0.1.0").unwrap()
        };
        let (v1, v2) = (install(b"v1"), install(b"v2"));
        s.create("old", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let v3 = install(b"v3");
        std::fs::write(libs.join("notes.txt"), b"not an install").unwrap();
        // A slice from before the current install: its container may ask for an older file again.
        let old = s.list().unwrap().slices;
        assert!(prune_libraries(&libs, &v3, &old).is_empty());
        assert!(v1.exists() && v2.exists());
        // Once it is gone, only what a process maps stays: v2 mapped by this test.
        let f = std::fs::File::open(&v2).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a private read-only mapping of a 2-byte file, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 2, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
        assert_ne!(p, libc::MAP_FAILED);
        s.delete("old", true).unwrap();
        s.create("new", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        assert_eq!(prune_libraries(&libs, &v3, &s.list().unwrap().slices), vec![v1.clone()]);
        assert!(!v1.exists() && v2.exists() && v3.exists() && libs.join("notes.txt").exists());
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 2) };
        assert_eq!(prune_libraries(&libs, &v3, &s.list().unwrap().slices), vec![v2.clone()]);
        // Back to a build still installed (a rollback from v4 to v3): current from then, so the
        // slice made under v4 keeps v4.
        let v4 = install(b"v4");
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.create("newer", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        assert_eq!(install(b"v3"), v3);
        assert!(prune_libraries(&libs, &v3, &s.list().unwrap().slices).is_empty());
        assert!(v4.exists());
        assert!(!is_install_name("libvgpu.so.0.1.0.tmp.123") && is_install_name("libvgpu.so.0.1.0.0123456789abcdef"));
        std::fs::remove_dir_all(d).ok();
    }
}

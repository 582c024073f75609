//! Slices: per-container regions under the state directory, with limits only the agent writes, and
//! a small record per slice so that a restarted agent recovers every slice.
//!
//! Layout under `<state_dir>/slices/<name>/`:
//! * `region`: the usage region, mounted read-write into the container;
//! * `limits`: a region holding the limits, mounted read-only (the container cannot raise them);
//! * `slice.json`: the record (what was asked, when).
//!
//! Library installs go to `<state_dir>/lib/libvgpu.so.<version>.<digest>`, written to a temporary
//! name and renamed, never overwriting a file that running containers may have mapped.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use vgpu_region::{Init, Region};

#[derive(Debug)]
pub struct SliceError(pub String);

impl std::fmt::Display for SliceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SliceError {}

type Result<T> = std::result::Result<T, SliceError>;

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

pub struct SliceStore {
    root: PathBuf,
    /// The node's memory is oversubscribed (`memory_scaling` above 1): every slice's files carry the
    /// flag that lets its interposers serve what the GPU has no room for as unified memory.
    oversubscribe: bool,
}

/// Where the container sees the slice's files.
pub const CONTAINER_DIR: &str = "/usr/local/vgpu";

fn io(what: String) -> impl FnOnce(std::io::Error) -> SliceError {
    move |e| SliceError(format!("{what}: {e}"))
}

pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.')
}

/// Writes `data` to `path` through a temporary file and a rename (readers never see a partial file).
fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io(format!("cannot create {}", tmp.display())))?;
    f.write_all(data).and_then(|_| f.sync_all()).map_err(io(format!("cannot write {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("cannot install {}", path.display())))
}

impl SliceStore {
    pub fn open(state_dir: &Path) -> Result<SliceStore> {
        let root = state_dir.join("slices");
        std::fs::create_dir_all(&root).map_err(io(format!("cannot create {}", root.display())))?;
        Ok(SliceStore { root, oversubscribe: false })
    }

    /// Sets whether slices get the oversubscription flag (new ones at creation, existing ones at
    /// [`recover`](Self::recover) and at their next update).
    pub fn with_oversubscribe(mut self, on: bool) -> SliceStore {
        self.oversubscribe = on;
        self
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Creates a slice; fails if one of that name exists.
    pub fn create(&self, name: &str, gpus: Vec<SliceGpu>, labels: BTreeMap<String, String>) -> Result<Slice> {
        if !valid_name(name) {
            return Err(SliceError(format!(
                "invalid slice name {name:?}: use 1-63 lower-case letters, digits, '-', '_' or '.'"
            )));
        }
        if gpus.is_empty() || gpus.len() > vgpu_region::MAX_DEVICES {
            return Err(SliceError(format!("a slice has 1 to {} GPUs", vgpu_region::MAX_DEVICES)));
        }
        if let Some(g) = gpus.iter().find(|g| g.sm > 100) {
            return Err(SliceError(format!("SM limit {} % of {} is above 100", g.sm, g.uuid)));
        }
        let dir = self.dir(name);
        // A directory without its record is what an interrupted create or delete left: not a slice.
        if dir.is_dir() && !dir.join("slice.json").exists() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        std::fs::create_dir(&dir).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => SliceError(format!("slice {name} already exists")),
            _ => SliceError(format!("cannot create {}: {e}", dir.display())),
        })?;
        let init =
            || Init { devices: gpus.iter().map(|g| (g.uuid.clone(), g.memory, g.sm)).collect(), standalone: false };
        let made = (|| {
            let limits = Region::open_or_create(&dir.join("limits"), init).map_err(|e| SliceError(e.to_string()))?;
            limits.set_oversubscribe(self.oversubscribe).map_err(|e| SliceError(e.to_string()))?;
            // Only the agent writes limits (containers get the file read-only; on the host, other
            // users must not raise them). The region stays writable by every user: a container's
            // processes, whatever their uid, account their usage in it.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.join("limits"), std::fs::Permissions::from_mode(0o644))
                .map_err(io(format!("cannot restrict {}", dir.join("limits").display())))?;
            let region = Region::open_or_create(&dir.join("region"), init).map_err(|e| SliceError(e.to_string()))?;
            region.set_oversubscribe(self.oversubscribe).map_err(|e| SliceError(e.to_string()))?;
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let (created, created_ns) = (now.as_secs(), now.as_nanos() as u64);
            let s = Slice { name: name.to_owned(), gpus: gpus.clone(), created, labels, created_ns };
            write_atomic(&dir.join("slice.json"), &serde_json::to_vec_pretty(&s).expect("serialisable"))?;
            Ok(s)
        })();
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        made
    }

    pub fn get(&self, name: &str) -> Result<Slice> {
        let p = self.dir(name).join("slice.json");
        let data = std::fs::read(&p).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => SliceError(format!("no slice named {name}")),
            _ => SliceError(format!("cannot read {}: {e}", p.display())),
        })?;
        serde_json::from_slice(&data).map_err(|e| SliceError(format!("{}: {e}", p.display())))
    }

    /// Every slice on record (what a restarted agent recovers). Damaged records are reported, not
    /// skipped silently.
    pub fn list(&self) -> Result<Vec<Slice>> {
        let mut v = Vec::new();
        let rd = std::fs::read_dir(&self.root).map_err(io(format!("cannot list {}", self.root.display())))?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if valid_name(&name) && e.path().join("slice.json").exists() {
                v.push(self.get(&name)?);
            }
        }
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    /// Changes limits; running processes apply them at their next allocation or launch. The record
    /// is written first: an agent killed before the regions follow brings them in line at its next
    /// start ([`recover`](Self::recover)).
    pub fn update(&self, name: &str, gpus: &[SliceGpu]) -> Result<Slice> {
        let mut s = self.get(name)?;
        for g in gpus {
            let i = s
                .gpus
                .iter()
                .position(|x| x.uuid == g.uuid)
                .ok_or_else(|| SliceError(format!("slice {name} has no GPU {}", g.uuid)))?;
            if g.sm > 100 {
                return Err(SliceError(format!("SM limit {} % is above 100", g.sm)));
            }
            s.gpus[i] = g.clone();
        }
        write_atomic(&self.dir(name).join("slice.json"), &serde_json::to_vec_pretty(&s).expect("serialisable"))?;
        self.apply_limits(&s)?;
        Ok(s)
    }

    /// Replaces a slice's labels (the record only; limits and files are untouched).
    pub fn set_labels(&self, name: &str, labels: BTreeMap<String, String>) -> Result<Slice> {
        let mut s = self.get(name)?;
        s.labels = labels;
        write_atomic(&self.dir(name).join("slice.json"), &serde_json::to_vec_pretty(&s).expect("serialisable"))?;
        Ok(s)
    }

    /// Writes a slice's limits from its record into its limits file and region (where they differ).
    fn apply_limits(&self, s: &Slice) -> Result<bool> {
        let mut changed = false;
        for f in ["limits", "region"] {
            let r = Region::open(&self.dir(&s.name).join(f), true).map_err(|e| SliceError(e.to_string()))?;
            if r.oversubscribe() != self.oversubscribe {
                r.set_oversubscribe(self.oversubscribe).map_err(|e| SliceError(e.to_string()))?;
                changed = true;
            }
            for (i, g) in s.gpus.iter().enumerate() {
                if r.mem_limit(i) != g.memory {
                    r.set_mem_limit(i, g.memory).map_err(|e| SliceError(e.to_string()))?;
                    changed = true;
                }
                if r.sm_limit(i) != g.sm {
                    r.set_sm_limit(i, g.sm).map_err(|e| SliceError(e.to_string()))?;
                    changed = true;
                }
            }
        }
        Ok(changed)
    }

    /// Brings the store to a consistent state after an agent was killed mid-change (run at start):
    /// a directory without a record (an interrupted create or delete) is removed; a slice whose
    /// limits file or region is missing or unreadable gets new ones; limits that differ from the
    /// record are rewritten. Returns one line per repair.
    pub fn recover(&self) -> Vec<String> {
        let mut done = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.root) else { return done };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let dir = e.path();
            if !valid_name(&name) || !dir.is_dir() {
                continue;
            }
            let s = match self.get(&name) {
                Ok(s) => s,
                Err(_) if !dir.join("slice.json").exists() => {
                    if std::fs::remove_dir_all(&dir).is_ok() {
                        done.push(format!("removed {}: an interrupted create or delete", dir.display()));
                    }
                    continue;
                }
                Err(e) => {
                    done.push(format!("left {} alone: {e}", dir.display()));
                    continue;
                }
            };
            for f in ["limits", "region"] {
                let p = dir.join(f);
                if let Err(e) = Region::open(&p, true) {
                    // Recreated only if missing or damaged. One another build wrote (another ABI
                    // or layout), or one that could not be opened just now, may be in use by the
                    // slice's processes (the container's mount holds the file itself: a new file
                    // here would never reach them); it is left alone and reported.
                    if let Some(why) = keep_region(&e) {
                        done.push(format!("left {} alone: {e}{why}", p.display()));
                        continue;
                    }
                    let _ = std::fs::remove_file(&p);
                    let init = || Init {
                        devices: s.gpus.iter().map(|g| (g.uuid.clone(), g.memory, g.sm)).collect(),
                        standalone: false,
                    };
                    match Region::open_or_create(&p, init) {
                        Ok(_) => {
                            if f == "limits" {
                                use std::os::unix::fs::PermissionsExt;
                                let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644));
                            }
                            done.push(format!("recreated {} (missing or unreadable)", p.display()))
                        }
                        Err(e) => done.push(format!("cannot recreate {}: {e}", p.display())),
                    }
                }
            }
            match self.apply_limits(&s) {
                Ok(true) => done.push(format!("slice {name}: limits brought in line with its record")),
                Ok(false) => {}
                Err(e) => done.push(format!("slice {name}: {e}")),
            }
        }
        done
    }

    /// Deletes a slice. Refused while processes of the container are alive, unless `force`.
    pub fn delete(&self, name: &str, force: bool) -> Result<()> {
        self.get(name)?;
        let dir = self.dir(name);
        if !force {
            if let Ok(r) = Region::open(&dir.join("region"), true) {
                r.reap();
                let live = r.slots();
                if !live.is_empty() {
                    return Err(SliceError(format!(
                        "slice {name} has {} live process(es); stop them or force the deletion",
                        live.len()
                    )));
                }
            }
        }
        // The record goes first: a deletion interrupted after it leaves a directory that is no
        // longer a slice, which the next create or start removes.
        std::fs::remove_file(dir.join("slice.json")).map_err(io(format!("cannot remove {}", dir.display())))?;
        std::fs::remove_dir_all(&dir).map_err(io(format!("cannot remove {}", dir.display())))
    }

    /// The environment and mounts that put a process into this slice (for `docker run`).
    pub fn injection(&self, name: &str, library: Option<&Path>) -> Result<Injection> {
        let s = self.get(name)?;
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
        for (i, g) in s.gpus.iter().enumerate() {
            if g.memory > 0 {
                env.push((format!("CUDA_DEVICE_MEMORY_LIMIT_{i}"), format!("{}m", g.memory.div_ceil(1 << 20))));
            }
            if g.sm > 0 && g.sm < 100 {
                env.push((format!("CUDA_DEVICE_SM_LIMIT_{i}"), g.sm.to_string()));
            }
        }
        let dir = self.dir(name);
        let m = |host: PathBuf, container: String, read_only| Mount { host, container, read_only };
        let mut mounts = vec![
            m(dir.clone(), CONTAINER_DIR.to_string(), false),
            m(dir.join("limits"), format!("{CONTAINER_DIR}/limits"), true),
        ];
        if let Some(lib) = library {
            mounts.push(m(lib.to_owned(), format!("{CONTAINER_DIR}/libvgpu.so"), true));
        }
        Ok(Injection { env, mounts })
    }
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
    let digest = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100_0000_01b3));
    std::fs::create_dir_all(lib_dir).map_err(io(format!("cannot create {}", lib_dir.display())))?;
    let dst = lib_dir.join(format!("libvgpu.so.{version}.{digest:016x}"));
    if !dst.exists() {
        write_atomic(&dst, &data)?;
        use std::os::unix::fs::PermissionsExt;
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
        super::write_atomic(&st.dir("drift").join("slice.json"), &serde_json::to_vec(&s).unwrap()).unwrap();
        // A limits file gone and a region overwritten.
        std::fs::remove_file(st.dir("lost").join("limits")).unwrap();
        std::fs::write(st.dir("lost").join("region"), vec![0xffu8; 4096]).unwrap();
        // A new slice of the half-made one's name works even before recovery.
        let repairs = st.recover();
        assert_eq!(repairs.len(), 4, "{repairs:?}");
        assert!(!st.dir("half").exists());
        assert_eq!(st.list().unwrap().iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["drift", "lost", "ok"]);
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

    #[test]
    fn create_get_update_list_delete() {
        let (s, d) = store();
        let a = s.create("job1", vec![gpu(8 << 30, 30)], Default::default()).unwrap();
        assert_eq!(s.get("job1").unwrap(), a);
        assert!(s.create("job1", vec![gpu(1, 0)], Default::default()).unwrap_err().0.contains("already exists"));
        assert!(s
            .create("Bad Name", vec![gpu(1, 0)], Default::default())
            .unwrap_err()
            .0
            .contains("invalid slice name"));
        assert!(s.create("x", vec![gpu(1, 120)], Default::default()).unwrap_err().0.contains("above 100"));
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
            .0
            .contains("no GPU"));
        s.create("job0", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        let names: Vec<String> = s.list().unwrap().into_iter().map(|x| x.name).collect();
        assert_eq!(names, vec!["job0", "job1"]);
        // A live process in the slice blocks deletion.
        let region = Region::open(&s.dir("job1").join("region"), true).unwrap();
        let claim = region.claim(42, 42).unwrap();
        assert!(s.delete("job1", false).unwrap_err().0.contains("1 live process"));
        drop(claim);
        s.delete("job1", false).unwrap();
        assert!(s.get("job1").unwrap_err().0.contains("no slice named job1"));
        // A restarted agent recovers what is on disk.
        let again = SliceStore::open(&d).unwrap();
        assert_eq!(again.list().unwrap().len(), 1);
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
        let old = s.list().unwrap();
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
        assert_eq!(prune_libraries(&libs, &v3, &s.list().unwrap()), vec![v1.clone()]);
        assert!(!v1.exists() && v2.exists() && v3.exists() && libs.join("notes.txt").exists());
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, 2) };
        assert_eq!(prune_libraries(&libs, &v3, &s.list().unwrap()), vec![v2.clone()]);
        // Back to a build still installed (a rollback from v4 to v3): current from then, so the
        // slice made under v4 keeps v4.
        let v4 = install(b"v4");
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.create("newer", vec![gpu(1 << 30, 0)], Default::default()).unwrap();
        assert_eq!(install(b"v3"), v3);
        assert!(prune_libraries(&libs, &v3, &s.list().unwrap()).is_empty());
        assert!(v4.exists());
        assert!(!is_install_name("libvgpu.so.0.1.0.tmp.123") && is_install_name("libvgpu.so.0.1.0.0123456789abcdef"));
        std::fs::remove_dir_all(d).ok();
    }
}

//! CDI (Container Device Interface) specs for slices, for CDI-enabled runtimes (containerd with
//! `enable_cdi`, CRI-O, podman): one file per slice, `<cdi_dir>/vgpu-<slice>.json`, kind
//! `vgpu.io/slice`, one device named after the slice whose container edits are the slice's
//! injection (environment and mounts). `cdiVersion` is 0.5.0, the lowest these fields need; no other
//! fields are written (runtimes reject unknown ones). Written by write-and-rename, removed with the
//! slice.

use crate::slices::Injection;
use serde_json::json;
use std::path::{Path, PathBuf};

pub const KIND: &str = "vgpu.io/slice";

pub fn path(dir: &Path, slice: &str) -> PathBuf {
    dir.join(format!("vgpu-{slice}.json"))
}

/// The fully qualified CDI device name of a slice.
pub fn device_name(slice: &str) -> String {
    format!("{KIND}={slice}")
}

/// The kind of the CDI devices that give a DRA claim its MIG devices (`NVIDIA_VISIBLE_DEVICES`).
pub const MIG_KIND: &str = "vgpu.io/mig";

/// The kind of the CDI devices that give a DRA claim with admin access its devices whole.
pub const ADMIN_KIND: &str = "vgpu.io/admin";

pub fn spec(slice: &str, inj: &Injection) -> serde_json::Value {
    spec_of(KIND, slice, inj)
}

/// A spec of one device `name` of `kind`, whose container edits are `inj`.
pub fn spec_of(kind: &str, name: &str, inj: &Injection) -> serde_json::Value {
    let env: Vec<String> = inj.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mounts: Vec<serde_json::Value> = inj
        .mounts
        .iter()
        .map(|m| {
            let mut options = vec!["bind"];
            if m.read_only {
                options.push("ro");
            }
            json!({"hostPath": m.host.display().to_string(), "containerPath": m.container, "options": options})
        })
        .collect();
    json!({
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [{"name": name, "containerEdits": {"env": env, "mounts": mounts}}],
    })
}

pub fn write(dir: &Path, slice: &str, inj: &Injection) -> std::io::Result<()> {
    write_spec(&path(dir, slice), &spec(slice, inj))
}

/// Writes a spec at `p` by write-and-rename (a runtime never reads half a file).
pub fn write_spec(p: &Path, spec: &serde_json::Value) -> std::io::Result<()> {
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(spec).expect("serialisable"))?;
    std::fs::rename(&tmp, p)
}

pub fn remove(dir: &Path, slice: &str) {
    let _ = std::fs::remove_file(path(dir, slice));
}

/// Brings the slice specs in `dir` in line with `slices` (at start: the agent may have been down
/// while slices went, or a spec been removed by hand): each slice's spec is written where it is
/// missing or differs, a spec of this kind for a slice that no longer exists is removed, and so is
/// a temporary file a killed write left. Specs of other kinds are left alone. One line per change.
pub fn reconcile(dir: &Path, slices: &[(String, Injection)]) -> Vec<String> {
    let mut done = Vec::new();
    for (name, inj) in slices {
        let p = path(dir, name);
        let want = spec(name, inj);
        let have = crate::slices::read_bounded(&p, 1 << 20)
            .ok()
            .and_then(|d| serde_json::from_slice::<serde_json::Value>(&d).ok());
        if have.as_ref() != Some(&want) {
            match write_spec(&p, &want) {
                Ok(()) => done.push(format!(
                    "wrote {} ({})",
                    p.display(),
                    if have.is_some() { "it differed" } else { "it was missing" }
                )),
                Err(e) => done.push(format!("cannot write {}: {e}", p.display())),
            }
        }
    }
    let Ok(rd) = std::fs::read_dir(dir) else { return done };
    for e in rd.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        if file.starts_with("vgpu-") && file.ends_with(".json.tmp") {
            if std::fs::remove_file(&p).is_ok() {
                done.push(format!("removed {}: a write cut short", p.display()));
            }
            continue;
        }
        let Some(name) = file.strip_prefix("vgpu-").and_then(|f| f.strip_suffix(".json")) else { continue };
        if slices.iter().any(|(n, _)| n == name) {
            continue;
        }
        let kind = crate::slices::read_bounded(&p, 1 << 20)
            .ok()
            .and_then(|d| serde_json::from_slice::<serde_json::Value>(&d).ok())
            .and_then(|v| v["kind"].as_str().map(str::to_owned));
        if kind.as_deref() == Some(KIND) && std::fs::remove_file(&p).is_ok() {
            done.push(format!("removed {}: no slice {name} any more", p.display()));
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slices::Mount;

    #[test]
    fn specs_have_exactly_the_fields_cdi_0_5_0_defines() {
        let inj = Injection {
            env: vec![("CUDA_DEVICE_MEMORY_LIMIT_0".into(), "1024m".into())],
            mounts: vec![
                Mount { host: "/var/lib/vgpu/slices/a".into(), container: "/usr/local/vgpu".into(), read_only: false },
                Mount {
                    host: "/var/lib/vgpu/slices/a/limits".into(),
                    container: "/usr/local/vgpu/limits".into(),
                    read_only: true,
                },
            ],
        };
        let s = spec("a", &inj);
        assert_eq!(s["cdiVersion"], "0.5.0");
        assert_eq!(s["kind"], "vgpu.io/slice");
        let mut keys: Vec<&String> = s.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(keys, ["cdiVersion", "devices", "kind"]);
        let d = &s["devices"][0];
        assert_eq!(d["name"], "a");
        assert_eq!(d["containerEdits"]["env"][0], "CUDA_DEVICE_MEMORY_LIMIT_0=1024m");
        assert_eq!(d["containerEdits"]["mounts"][1]["options"], json!(["bind", "ro"]));
        assert_eq!(d["containerEdits"]["mounts"][0]["options"], json!(["bind"]));
        assert_eq!(device_name("a"), "vgpu.io/slice=a");
        let dir = std::env::temp_dir().join(format!("vgpu-cdi-{}", std::process::id()));
        write(&dir, "a", &inj).unwrap();
        let back: serde_json::Value = serde_json::from_slice(&std::fs::read(path(&dir, "a")).unwrap()).unwrap();
        assert_eq!(back, s);
        remove(&dir, "a");
        assert!(!path(&dir, "a").exists());
        std::fs::remove_dir_all(dir).ok();
    }
}

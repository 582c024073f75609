//! What the NVIDIA container runtime does to a container's view of the node: it exposes only the
//! GPUs its `NVIDIA_VISIBLE_DEVICES` names (device nodes and all), so the driver in the container
//! enumerates only those, renumbered from 0 in the node's order. The simulated CUDA driver and NVML
//! both enumerate through [`Node::exposed`].
//!
//! The variable: unset or `all`: every GPU (a process on the host, or a runtime that hides
//! nothing); `none`, `void` or empty: none; else a comma-separated list of node indices, GPU UUIDs
//! and MIG device UUIDs (which expose their parent GPU). An item that names no GPU of the node is
//! skipped with a line on stderr (the real runtime refuses to start such a container).

use crate::state::Node;
use std::sync::OnceLock;

/// The node GPUs `value` (`NVIDIA_VISIBLE_DEVICES`) exposes, for a node of `n` GPUs whose UUIDs
/// `uuid(i)` gives, where `mig_parent` finds the GPU of a MIG device UUID. Second: what named nothing.
pub fn parse(
    value: Option<&str>,
    n: usize,
    uuid: impl Fn(usize) -> String,
    mig_parent: impl Fn(&str) -> Option<usize>,
) -> (Vec<usize>, Vec<String>) {
    let v = match value.map(str::trim) {
        None | Some("all") => return ((0..n).collect(), Vec::new()),
        Some("" | "none" | "void") => return (Vec::new(), Vec::new()),
        Some(v) => v,
    };
    let (mut out, mut unknown) = (Vec::new(), Vec::new());
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let found = if let Ok(i) = item.parse::<usize>() {
            (i < n).then_some(i)
        } else if item.starts_with("MIG-") {
            mig_parent(item)
        } else {
            (0..n).find(|&i| uuid(i).eq_ignore_ascii_case(item))
        };
        match found {
            Some(i) if !out.contains(&i) => out.push(i),
            Some(_) => {}
            None => unknown.push(item.to_string()),
        }
    }
    out.sort_unstable();
    (out, unknown)
}

impl Node {
    /// The node GPUs this process's container runtime exposes (see the module), read once.
    pub fn exposed(&self) -> &'static [usize] {
        static EXPOSED: OnceLock<Vec<usize>> = OnceLock::new();
        EXPOSED.get_or_init(|| {
            let value = std::env::var("NVIDIA_VISIBLE_DEVICES").ok();
            let (v, unknown) =
                parse(value.as_deref(), self.cfg.gpus.len(), |i| self.cfg.gpus[i].uuid.clone(), |u| self.mig_parent(u));
            if !unknown.is_empty() {
                eprintln!("vgpu-sim: NVIDIA_VISIBLE_DEVICES names no GPU of this node: {}", unknown.join(", "));
            }
            v
        })
    }

    /// The node index of the GPU that holds the MIG device `uuid` now.
    pub fn mig_parent(&self, uuid: &str) -> Option<usize> {
        let mut l = self.lock();
        (0..self.cfg.gpus.len()).find(|&g| {
            let gpu_uuid = &self.cfg.gpus[g].uuid;
            let st = *self.mig(&mut l, g);
            st.gis.iter().filter(|gi| gi.live != 0).any(|gi| {
                gi.cis.iter().filter(|c| c.live != 0).any(|c| crate::mig::mig_uuid(gpu_uuid, gi.serial, c.id) == uuid)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    fn run(v: Option<&str>) -> (Vec<usize>, Vec<String>) {
        let uuids = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"];
        parse(v, 3, |i| uuids[i].to_string(), |u| (u == "MIG-1111").then_some(2))
    }

    #[test]
    fn the_variable_exposes_what_the_runtime_would() {
        assert_eq!(run(None).0, vec![0, 1, 2], "unset: a process on the host sees every GPU");
        assert_eq!(run(Some("all")).0, vec![0, 1, 2]);
        for none in ["", "none", "void"] {
            assert_eq!(run(Some(none)).0, Vec::<usize>::new(), "{none:?}");
        }
        assert_eq!(run(Some("GPU-bbbb")).0, vec![1]);
        assert_eq!(run(Some("2,0")).0, vec![0, 2], "renumbered in the node's order");
        assert_eq!(run(Some("MIG-1111")).0, vec![2], "a MIG device exposes its GPU");
        assert_eq!(run(Some("GPU-bbbb,GPU-bbbb,1")).0, vec![1]);
        assert_eq!(run(Some("GPU-dddd,7,1")), (vec![1], vec!["GPU-dddd".to_string(), "7".to_string()]));
    }
}

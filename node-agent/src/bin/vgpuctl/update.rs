//! `vgpuctl slice update`: the change worked out from the slice as it is and the node's status.

use vgpu_agent::describe::human;
use vgpu_proto::v1 as pb;

/// What `vgpuctl slice update` sends, and what it tells the operator.
#[derive(Debug, Default)]
pub struct UpdatePlan {
    /// Every named GPU with its limits after the change (what is not named keeps its value).
    pub gpus: Vec<pb::SliceGpuLimit>,
    /// One line per limit that changes or is kept.
    pub changes: Vec<String>,
    pub warnings: Vec<String>,
}

/// Works out a slice update from the slice as it is (`cur`) and the node's status: each GPU in
/// `gpus` (an index or a UUID or its prefix) gets `memory` and `sm` where given (0: no limit) and
/// keeps the other. A memory limit below what the slice's processes hold now is refused unless
/// `force`; a GPU in MIG mode is warned about.
pub fn plan_update(
    cur: &pb::SliceDetail,
    st: &pb::NodeStatus,
    gpus: &[String],
    memory: Option<u64>,
    sm: Option<u32>,
    force: bool,
) -> Result<UpdatePlan, String> {
    let mut plan = UpdatePlan::default();
    let limit_text = |m: u64| if m == 0 { "none".to_string() } else { human(m) };
    let sm_text = |v: u32| if v == 0 || v >= 100 { "none".to_string() } else { format!("{v}%") };
    for g in gpus {
        let by_index =
            g.parse::<u32>().ok().and_then(|i| st.gpus.iter().find(|x| x.index == i)).map(|x| x.uuid.clone());
        let uuid = by_index.unwrap_or_else(|| g.clone());
        let found: Vec<&pb::SliceGpuLimit> = cur.gpus.iter().filter(|x| x.gpu.starts_with(&uuid)).collect();
        let have = match found.as_slice() {
            [one] => *one,
            [] => return Err(format!("slice {} has no GPU {g:?} (it has {})", cur.name, names(cur))),
            _ => return Err(format!("GPU {g:?} matches {} of the slice's GPUs; give more of the UUID", found.len())),
        };
        let new = pb::SliceGpuLimit {
            gpu: have.gpu.clone(),
            memory: memory.unwrap_or(have.memory),
            sm: sm.unwrap_or(have.sm),
        };
        let used = st
            .slices
            .iter()
            .find(|s| s.name == cur.name)
            .and_then(|s| s.gpus.iter().find(|x| x.uuid == have.gpu))
            .map_or(0, |x| x.memory_used);
        if new.memory != 0 && new.memory < used && !force {
            return Err(format!(
                "slice {} holds {} on {} now: a memory limit of {} is below it (its processes' next allocations \
                 fail and the agent reports it over its limit); give --force to do it anyway",
                cur.name,
                human(used),
                have.gpu,
                human(new.memory)
            ));
        }
        let what = |name: &str, a: String, b: String| {
            if a == b {
                format!("{name} {a} (kept)")
            } else {
                format!("{name} {a} -> {b}")
            }
        };
        plan.changes.push(format!(
            "slice {} on {}: {}, {}",
            cur.name,
            have.gpu,
            what("memory", limit_text(have.memory), limit_text(new.memory)),
            what("SM", sm_text(have.sm), sm_text(new.sm))
        ));
        if let Some(x) = st.gpus.iter().find(|x| x.uuid == have.gpu && x.mode == "mig") {
            plan.warnings.push(format!(
                "warning: GPU {} ({}) is in MIG mode: its memory and SMs belong to its MIG instances, and a slice \
                 of the whole GPU holds nothing there",
                x.index, x.uuid
            ));
        }
        plan.gpus.push(new);
    }
    Ok(plan)
}

fn names(d: &pb::SliceDetail) -> String {
    d.gpus.iter().map(|g| g.gpu.as_str()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod update_tests {
    use super::*;

    fn slice() -> pb::SliceDetail {
        pb::SliceDetail {
            name: "job".into(),
            gpus: vec![pb::SliceGpuLimit { gpu: "GPU-aaaa".into(), memory: 8 << 30, sm: 30 }],
            ..Default::default()
        }
    }

    fn status(used: u64, mode: &str) -> pb::NodeStatus {
        pb::NodeStatus {
            gpus: vec![pb::GpuStatus { index: 0, uuid: "GPU-aaaa".into(), mode: mode.into(), ..Default::default() }],
            slices: vec![pb::SliceStatus {
                name: "job".into(),
                gpus: vec![pb::SliceGpuStatus { uuid: "GPU-aaaa".into(), memory_used: used, ..Default::default() }],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn an_update_keeps_the_limits_it_does_not_name() {
        let p = plan_update(&slice(), &status(0, "shared"), &["0".into()], Some(1 << 30), None, false).unwrap();
        assert_eq!((p.gpus[0].memory, p.gpus[0].sm), (1 << 30, 30), "the SM limit is kept");
        assert!(
            p.changes[0].contains("memory 8.0 GiB -> 1.0 GiB") && p.changes[0].contains("SM 30% (kept)"),
            "{:?}",
            p.changes
        );
        let p = plan_update(&slice(), &status(0, "shared"), &["GPU-a".into()], None, Some(50), false).unwrap();
        assert_eq!((p.gpus[0].memory, p.gpus[0].sm), (8 << 30, 50), "the memory limit is kept");
        let p = plan_update(&slice(), &status(0, "shared"), &["0".into()], Some(0), None, false).unwrap();
        assert_eq!(p.gpus[0].memory, 0, "none removes the limit");
        assert!(p.changes[0].contains("memory 8.0 GiB -> none"), "{:?}", p.changes);
    }

    #[test]
    fn shrinking_below_what_is_held_needs_force_and_mig_mode_is_warned_about() {
        let e =
            plan_update(&slice(), &status(3 << 30, "shared"), &["0".into()], Some(1 << 30), None, false).unwrap_err();
        assert!(e.contains("holds 3.0 GiB") && e.contains("--force"), "{e}");
        assert!(plan_update(&slice(), &status(3 << 30, "shared"), &["0".into()], Some(1 << 30), None, true).is_ok());
        let p = plan_update(&slice(), &status(0, "mig"), &["0".into()], Some(1 << 30), None, false).unwrap();
        assert!(p.warnings[0].contains("MIG mode"), "{:?}", p.warnings);
        let e = plan_update(&slice(), &status(0, "shared"), &["GPU-b".into()], Some(1), None, false).unwrap_err();
        assert!(e.contains("has no GPU"), "{e}");
    }
}

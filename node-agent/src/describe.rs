//! Words for what the agent reports, shared by its logs, health answer and Events and by
//! `vgpuctl`: sizes, GPU UUIDs, escapes and who runs a process.

use vgpu_proto::v1 as pb;

pub use vgpu_units::human;

/// `b` for people, with its bytes when `other` (the size it is compared with) reads the same.
pub fn exact(b: u64, other: u64) -> String {
    if human(b) == human(other) {
        format!("{} ({b} bytes)", human(b))
    } else {
        human(b)
    }
}

/// The API's form of a slice priority.
pub fn priority_pb(p: crate::slices::Priority) -> pb::SlicePriority {
    match p {
        crate::slices::Priority::Normal => pb::SlicePriority::PriorityNormal,
        crate::slices::Priority::High => pb::SlicePriority::PriorityHigh,
    }
}

/// A GPU UUID's first block, as tables show it.
pub fn short_uuid(u: &str) -> String {
    u.chars().take(12).collect()
}

/// One escape as `vgpuctl status` lists it (and `doctor` reports it).
pub fn escape_line(e: &pb::Escape) -> String {
    if e.kind == pb::escape::Kind::Bypass as i32 {
        return format!(
            "slice {} on {} uses {} % of the GPU, its launches through libvgpu.so {} %: a process skips it (busiest pid {}{}, {})",
            e.slice,
            short_uuid(&e.gpu),
            e.measured,
            e.limit,
            e.pid,
            process_owner(e),
            e.action
        );
    }
    if e.kind == pb::escape::Kind::OverLimit as i32 {
        format!(
            "slice {} over its limit on {}: NVML measures {} > {} (pid {}{}, {})",
            e.slice,
            short_uuid(&e.gpu),
            human(e.measured),
            human(e.limit),
            e.pid,
            process_owner(e),
            e.action
        )
    } else if !e.slice.is_empty() {
        format!(
            "pid {}{} of slice {} on {}, outside the slice: {} ({})",
            e.pid,
            process_owner(e),
            e.slice,
            short_uuid(&e.gpu),
            human(e.measured),
            e.action
        )
    } else {
        format!(
            "pid {}{} on {} outside every slice: {} ({})",
            e.pid,
            process_owner(e),
            short_uuid(&e.gpu),
            human(e.measured),
            e.action
        )
    }
}

/// Who runs an escape's process, as ` (python3, pod ml/train-0, container 0a1b2c3d4e5f)`: its
/// command, its pod (by name where a slice belongs to it, else by UID) and its container's short ID,
/// whichever are known; empty when none is.
pub fn process_owner(e: &pb::Escape) -> String {
    let mut parts = Vec::new();
    if !e.command.is_empty() {
        parts.push(e.command.clone());
    }
    if !e.pod.is_empty() {
        parts.push(format!("pod {}", e.pod));
    } else if !e.pod_uid.is_empty() {
        parts.push(format!("pod UID {}", e.pod_uid));
    }
    if !e.container_id.is_empty() {
        parts.push(format!("container {}", e.container_id.chars().take(12).collect::<String>()));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_read_by_kind_and_name_who_runs_them() {
        let e = |kind: pb::escape::Kind, slice: &str| pb::Escape {
            kind: kind as i32,
            gpu: "GPU-5eed0000-1000".into(),
            slice: slice.into(),
            pid: 4242,
            measured: 3 << 30,
            limit: 2 << 30,
            action: "reported".into(),
            command: "python3".into(),
            ..Default::default()
        };
        assert_eq!(
            escape_line(&e(pb::escape::Kind::OverLimit, "job1")),
            "slice job1 over its limit on GPU-5eed0000: NVML measures 3.0 GiB > 2.0 GiB (pid 4242 (python3), reported)"
        );
        assert_eq!(
            escape_line(&e(pb::escape::Kind::Unaccounted, "job1")),
            "pid 4242 (python3) of slice job1 on GPU-5eed0000, outside the slice: 3.0 GiB (reported)"
        );
        let mut out = e(pb::escape::Kind::Unaccounted, "");
        out.pod_uid = "4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d".into();
        out.container_id = "0a1b2c3d4e5f60718293".into();
        assert_eq!(
            escape_line(&out),
            "pid 4242 (python3, pod UID 4c1b2a3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d, container 0a1b2c3d4e5f) on GPU-5eed0000 \
             outside every slice: 3.0 GiB (reported)"
        );
        out.command.clear();
        out.pod = "ml/train-0".into();
        out.container_id.clear();
        assert!(escape_line(&out).starts_with("pid 4242 (pod ml/train-0) on "), "{}", escape_line(&out));
        out.pod.clear();
        out.pod_uid.clear();
        assert!(escape_line(&out).starts_with("pid 4242 on "), "nothing known: nothing added");
    }
}

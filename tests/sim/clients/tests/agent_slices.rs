//! Slices made by the agent's slice store, used by real processes with libvgpu.so on the simulated
//! GPU: limits come from the read-only limits file, change live, and a container that rewrites its
//! own (read-write) region cannot raise them.

mod common;
use common::*;

use vgpu_agent::slices::{SliceGpu, SliceStore};
use vgpu_region::Region;

const NODE: &str = "context_overhead_mib = 64\n[[gpu]]\nmodel = \"A100-40GB\"\nmemory_mib = 8192\n";

#[test]
fn agent_slices_limit_processes_and_cannot_be_raised_from_inside() {
    let s = Sim::new(Some(NODE));
    let uuid = s.status()["gpus"][0]["uuid"].as_str().unwrap().to_owned();
    let store = SliceStore::open(&s.state.join("agent")).unwrap();
    store.create("job1", vec![SliceGpu { uuid: uuid.clone(), memory: 1 << 30, sm: 0 }]).unwrap();
    let dir = store.dir("job1");
    let run = |size: &str| {
        let o = s
            .cmd(RT)
            .env("LD_PRELOAD", libvgpu())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", dir.join("region"))
            .env("VGPU_LIMITS_FILE", dir.join("limits"))
            .env("VGPU_CONTEXT_OVERHEAD", "64m")
            .args(["alloc", "--size", size, "--chunk", "100m"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        lines(&o.stdout).remove(0)
    };
    assert_eq!(run("2g")["allocated"], 900 * MIB, "1 GiB from the agent's limits file");

    // The container rewrites the limit in its own region: it does not count.
    let region = Region::open(&dir.join("region"), true).unwrap();
    region.set_mem_limit(0, 100 << 30).unwrap();
    assert_eq!(run("2g")["allocated"], 900 * MIB, "the read-only limits file wins");

    // The agent raises the limit: the next process gets it.
    store.update("job1", &[SliceGpu { uuid, memory: 2 << 30, sm: 0 }]).unwrap();
    let v = run("3g");
    assert_eq!(v["allocated"], 1900 * MIB);
    assert_eq!(v["mem_info"]["total"], 2048 * MIB);
}

//! The MIG manager against the simulated `libnvidia-ml.so.1`, loaded through nvml-wrapper in this
//! process: profiles read from NVML, mig-parted configs applied incrementally, Ampere's pending mode
//! and a reset blocked by a process, Hopper losing its mode at reboot and the desired layout coming
//! back, an apply interrupted half-way and resumed from its journal, busy instances preserved.

mod common;
use common::*;

use std::sync::Arc;
use vgpu_mig::apply::{self, Store};
use vgpu_mig::backend::{MigBackend, MigError, ModeChange, NvmlBackend};
use vgpu_mig::config::{self, Desired};
use vgpu_mig::model::Gpu;

const NODE: &str = "[[gpu]]\nmodel = \"A100-40GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"A30\"\n[[gpu]]\nmodel = \"H200-141GB\"\n";

/// Written in mig-parted's v1 format as its documentation and the GPU operator's default config
/// use it: named configs, `devices: all` or indices, `device-filter` by PCI device id.
const CONFIG: &str = r#"
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-enabled:
    - devices: all
      mig-enabled: true
      mig-devices: {}
  all-1g.5gb:
    - device-filter: ["0x20B010DE", "0x20B110DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 7
  all-balanced:
    - device-filter: ["0x20B010DE", "0x20B110DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.5gb": 2
        "2g.10gb": 1
        "3g.20gb": 1
    - device-filter: "0x233010DE"
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 2
        "2g.20gb": 1
        "3g.40gb": 1
    - device-filter: ["0x20B710DE"]
      devices: all
      mig-enabled: true
      mig-devices:
        "1g.6gb": 2
        "2g.12gb": 1
  custom:
    - devices: [3]
      mig-enabled: true
      mig-devices:
        "7g.141gb": 1
"#;

/// Panics (an agent killed mid-apply) after `left` changes.
struct Crashing<'a> {
    inner: &'a dyn MigBackend,
    left: std::cell::Cell<u32>,
}

impl Crashing<'_> {
    fn tick(&self) {
        if self.left.get() == 0 {
            panic!("simulated crash in the middle of an apply");
        }
        self.left.set(self.left.get() - 1);
    }
}

impl MigBackend for Crashing<'_> {
    fn gpu_count(&self) -> Result<u32, MigError> {
        self.inner.gpu_count()
    }
    fn gpu(&self, gpu: u32) -> Result<Gpu, MigError> {
        self.inner.gpu(gpu)
    }
    fn set_mode(&self, gpu: u32, enabled: bool) -> Result<ModeChange, MigError> {
        self.tick();
        self.inner.set_mode(gpu, enabled)
    }
    fn create(&self, gpu: u32, profile: u32, start: u32) -> Result<u32, MigError> {
        self.tick();
        self.inner.create(gpu, profile, start)
    }
    fn destroy(&self, gpu: u32, gi: u32) -> Result<(), MigError> {
        self.tick();
        self.inner.destroy(gpu, gi)
    }
    fn pci_device_id(&self, gpu: u32) -> Result<String, MigError> {
        self.inner.pci_device_id(gpu)
    }
    fn processes(&self, gpu: u32) -> Result<Vec<u32>, MigError> {
        self.inner.processes(gpu)
    }
}

/// Marks GPU instances busy, as a workload on them would.
struct Busy<'a> {
    inner: &'a dyn MigBackend,
    busy: Vec<(u32, u32)>,
}

impl MigBackend for Busy<'_> {
    fn gpu_count(&self) -> Result<u32, MigError> {
        self.inner.gpu_count()
    }
    fn gpu(&self, gpu: u32) -> Result<Gpu, MigError> {
        let mut g = self.inner.gpu(gpu)?;
        for i in &mut g.instances {
            i.busy |= self.busy.contains(&(gpu, i.gi));
        }
        Ok(g)
    }
    fn set_mode(&self, gpu: u32, enabled: bool) -> Result<ModeChange, MigError> {
        self.inner.set_mode(gpu, enabled)
    }
    fn create(&self, gpu: u32, profile: u32, start: u32) -> Result<u32, MigError> {
        self.inner.create(gpu, profile, start)
    }
    fn destroy(&self, gpu: u32, gi: u32) -> Result<(), MigError> {
        self.inner.destroy(gpu, gi)
    }
    fn pci_device_id(&self, gpu: u32) -> Result<String, MigError> {
        self.inner.pci_device_id(gpu)
    }
    fn processes(&self, gpu: u32) -> Result<Vec<u32>, MigError> {
        self.inner.processes(gpu)
    }
}

fn desired(f: &config::File, name: &str, b: &dyn MigBackend, gpu: u32) -> Desired {
    f.desired(name, gpu, &b.pci_device_id(gpu).unwrap()).unwrap().unwrap_or_else(|| panic!("{name} selects GPU {gpu}"))
}

fn layout(b: &dyn MigBackend, gpu: u32) -> Vec<(String, u32)> {
    let g = b.gpu(gpu).unwrap();
    g.instances.iter().map(|i| (g.profile(i.profile).unwrap().name.clone(), i.start)).collect()
}

/// The simulated NVML is loaded into this process and finds its node through the environment: one
/// test at a time.
static ONE_NODE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A simulated node described by `config`, the MIG backend on its NVML (loaded in this process) and
/// the applier's store; other tests of this file wait while the guard is held.
fn on_node(config: &str) -> (std::sync::MutexGuard<'static, ()>, Sim, NvmlBackend, Store) {
    let one = ONE_NODE.lock().unwrap_or_else(|p| p.into_inner());
    let s = Sim::new(Some(config));
    std::env::set_var("VGPU_SIM_STATE", &s.state);
    std::env::set_var("VGPU_SIM_CONFIG", s.config.as_ref().unwrap());
    let nvml =
        Arc::new(nvml_wrapper::Nvml::builder().lib_path(s.libs.join("libnvidia-ml.so.1").as_os_str()).init().unwrap());
    let store = Store::open(&s.state.join("mig")).unwrap();
    (one, s, NvmlBackend::new(nvml), store)
}

#[test]
fn mig_manager_on_the_simulated_node() {
    let (_one, mut s, b, store) = on_node(NODE);
    let f = config::File::parse(CONFIG).unwrap();

    // Profiles and placements come from NVML.
    let a100 = b.gpu(0).unwrap();
    assert_eq!((a100.memory_slices, a100.profiles.len()), (8, 7));
    let p = a100.profile_named("1g.10gb").unwrap();
    assert_eq!((p.compute, p.memory_slices, p.starts.clone(), p.max), (1, 2, vec![0, 2, 4, 6], 4));
    assert!(a100.profile_named("MIG 1g.5gb+me").unwrap().media_extended());
    let a30 = b.gpu(2).unwrap();
    assert_eq!(a30.memory_slices, 4);
    assert!(b.gpu(1).unwrap().profile_named("3g.40gb").is_some());
    assert!(b.gpu(3).unwrap().profile_named("7g.141gb").is_some(), "{:?}", b.gpu(3).unwrap().profiles);
    assert_eq!(b.pci_device_id(0).unwrap(), "0x20B010DE");

    // Ampere: the mode waits for a reset, which a process on the GPU blocks.
    let d = desired(&f, "all-balanced", &b, 0);
    let out = apply::apply_gpu(&b, &store, 0, &d, false).unwrap();
    assert_eq!((out.mode, out.pending_reset), (ModeChange::PendingReset, true));
    assert!(b.gpu(0).unwrap().mode_pending);
    assert!(apply::check(&b, 0, &d).unwrap().iter().any(|x| x.contains("pending a GPU reset")));
    let (pid, _) = s.spawn(RT, &["alloc", "--size", "64m", "--hold"]);
    let o = s.output(SIM, &["reset", "--gpu", "0"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("in use"), "{o:?}");
    s.kill(pid);
    assert!(s.output(SIM, &["reset", "--gpu", "0"]).status.success());
    // After the reset, reconciling applies the recorded layout.
    let r = apply::reconcile(&b, &store);
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
    assert_eq!(apply::check(&b, 0, &d).unwrap(), Vec::<String>::new());
    let l = layout(&b, 0);
    assert_eq!(l.len(), 4, "{l:?}");
    // Every instance has one compute instance spanning it, and a MIG device.
    assert!(b.gpu(0).unwrap().instances.iter().all(|i| i.compute_instances.len() == 1 && i.uuid.is_some()));

    // The planner's validity agrees with the driver's: every maximal A100 layout of 1g/2g/3g/4g/7g,
    // each reached from the one before (explicit placements, minimal steps), is accepted by NVML.
    let g = b.gpu(0).unwrap();
    let ids: Vec<u32> =
        ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"].iter().map(|n| g.profile_named(n).unwrap().id).collect();
    let layouts = vgpu_mig::planner::maximal_layouts(&g, &ids);
    assert_eq!(layouts.len(), 19);
    for l in layouts.iter().chain([&layouts[0]]) {
        let want: Vec<_> =
            l.iter().map(|p| vgpu_mig::planner::Want { profile: p.profile, start: Some(p.start) }).collect();
        let p = vgpu_mig::planner::plan(&b.gpu(0).unwrap(), &want, false).unwrap();
        apply::execute(&b, 0, &p).unwrap_or_else(|e| panic!("{l:?}: {e}"));
        let mut got: Vec<_> = b.gpu(0).unwrap().instances.iter().map(|i| (i.profile, i.start)).collect();
        got.sort();
        let mut exp: Vec<_> = l.iter().map(|p| (p.profile, p.start)).collect();
        exp.sort();
        assert_eq!(got, exp);
    }
    apply::apply_gpu(&b, &store, 0, &d, false).unwrap();

    // Idempotent: applying again changes nothing.
    let again = apply::apply_gpu(&b, &store, 0, &d, false).unwrap();
    assert!(again.plan.unwrap().steps.is_empty());

    // Incremental: to all-1g.5gb keeps the two 1g.5gb.
    let d1 = desired(&f, "all-1g.5gb", &b, 0);
    let plan = apply::plan_gpu(&b, 0, &d1, false).unwrap().unwrap();
    assert_eq!(plan.keep.len(), 2, "{plan:?}");
    // Interrupted after two changes (a crash): the journal says so; a restart finishes the job.
    let crashing = Crashing { inner: &b, left: 2.into() };
    let r =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| apply::apply_gpu(&crashing, &store, 0, &d1, false)));
    assert!(r.is_err());
    let uuid = b.gpu(0).unwrap().uuid;
    assert_eq!(store.in_progress(), vec![uuid.clone()]);
    assert_ne!(apply::check(&b, 0, &d1).unwrap(), Vec::<String>::new(), "half-way");
    let r = apply::reconcile(&b, &store);
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
    assert_eq!(apply::check(&b, 0, &d1).unwrap(), Vec::<String>::new());
    assert!(store.in_progress().is_empty());
    assert_eq!(layout(&b, 0).len(), 7);

    // A busy instance is kept: a target that needs its slices is refused and nothing changes. (The
    // 1g.5gb at slice 4 leaves no place for the 2g.10gb once the 3g.20gb takes slices 0-3.)
    let gi = b.gpu(0).unwrap().instances.iter().find(|i| i.start == 4).unwrap().gi;
    let busy = Busy { inner: &b, busy: vec![(0, gi)] };
    let before = layout(&b, 0);
    let e = apply::apply_gpu(&busy, &store, 0, &desired(&f, "all-balanced", &b, 0), false).unwrap_err();
    assert!(matches!(e, vgpu_mig::backend::MigError::Plan { .. }) && e.to_string().contains("in use"), "{e}");
    assert_eq!(layout(&b, 0), before);
    // Forced, it goes.
    apply::apply_gpu(&busy, &store, 0, &desired(&f, "all-balanced", &b, 0), true).unwrap();
    assert_eq!(layout(&b, 0).len(), 4);

    // Hopper switches at once; H100 and H200 get their own profile names from NVML.
    let out = apply::apply_gpu(&b, &store, 1, &desired(&f, "all-balanced", &b, 1), false).unwrap();
    assert_eq!(out.mode, ModeChange::Applied);
    assert_eq!(layout(&b, 1).len(), 4);
    apply::apply_gpu(&b, &store, 3, &desired(&f, "custom", &b, 3), false).unwrap();
    assert_eq!(layout(&b, 3), vec![("7g.141gb".to_string(), 0)]);
    // A30 (4 memory slices): pending, then reset, then reconciled.
    let d30 = desired(&f, "all-balanced", &b, 2);
    assert!(apply::apply_gpu(&b, &store, 2, &d30, false).unwrap().pending_reset);
    assert!(s.output(SIM, &["reset", "--gpu", "2"]).status.success());
    apply::reconcile(&b, &store);
    assert_eq!(apply::check(&b, 2, &d30).unwrap(), Vec::<String>::new());

    // A reboot: Hopper loses the mode and every instance, Ampere keeps the mode but loses the
    // instances. Reconciling brings all four back.
    assert!(s.output(SIM, &["reboot"]).status.success());
    assert!(!b.gpu(1).unwrap().mig_enabled);
    assert!(b.gpu(0).unwrap().instances.is_empty());
    let r = apply::reconcile(&b, &store);
    assert_eq!(r.len(), 4, "{r:?}");
    for (gpu, name) in [(0, "all-balanced"), (1, "all-balanced"), (2, "all-balanced"), (3, "custom")] {
        assert_eq!(apply::check(&b, gpu, &desired(&f, name, &b, gpu)).unwrap(), Vec::<String>::new(), "GPU {gpu}");
    }

    // Errors name the problem: an unknown config, a profile the GPU lacks, an impossible layout.
    assert!(f.desired("nope", 0, "0x20B010DE").unwrap_err().to_string().contains("no mig-config named \"nope\""));
    let bad = Desired { mig_enabled: true, devices: [("9g.99gb".to_string(), 1)].into(), exact: true };
    assert!(apply::apply_gpu(&b, &store, 0, &bad, false)
        .unwrap_err()
        .to_string()
        .contains("has no MIG profile \"9g.99gb\""));
    let too_many = Desired { mig_enabled: true, devices: [("4g.20gb".to_string(), 2)].into(), exact: true };
    let e = apply::apply_gpu(&b, &store, 0, &too_many, false).unwrap_err();
    assert!(e.to_string().contains("at most 1"), "{e}");
    assert_eq!(apply::check(&b, 0, &desired(&f, "all-balanced", &b, 0)).unwrap(), Vec::<String>::new(), "untouched");

    // Dynamic mode on the H200: its layout is destroyed, then MIG mode alone is recorded (a config
    // with no devices), and instances are made per request.
    for i in b.gpu(3).unwrap().instances {
        b.destroy(3, i.gi).unwrap();
    }
    apply::apply_gpu(&b, &store, 3, &Desired { mig_enabled: true, devices: Default::default(), exact: false }, false)
        .unwrap();
    let req = |mib, media| vgpu_mig::planner::Request { memory_mib: mib, compute: 0, sms: 0, media };
    let a = apply::allocate(&b, 3, &req(16 << 10, false)).unwrap();
    assert!(a.profile.starts_with("1g."), "the smallest fitting profile: {a:?}");
    assert!(a.uuid.as_deref().is_some_and(|u| u.starts_with("MIG-")), "{a:?}");
    // Recording the mode alone keeps dynamic instances through a reconcile.
    apply::reconcile(&b, &store);
    assert_eq!(b.gpu(3).unwrap().instances.len(), 1, "the dynamic instance survives");
    let m = apply::allocate(&b, 3, &req(1 << 10, true)).unwrap();
    assert!(m.profile.ends_with("+me"), "{m:?}");
    assert!(apply::allocate(&b, 3, &req(1 << 30, false)).unwrap_err().to_string().contains("no MIG profile"));
    assert!(apply::release(&b, 3, a.gi).unwrap());
    assert!(apply::release(&b, 3, m.gi).unwrap());
    assert!(!apply::release(&b, 3, m.gi).unwrap(), "a second release finds it gone, and succeeds");
    assert!(b.gpu(3).unwrap().instances.is_empty());

    // Disabling destroys the instances first (Hopper: at once).
    let off = desired(&f, "all-disabled", &b, 1);
    assert_eq!(apply::apply_gpu(&b, &store, 1, &off, false).unwrap().mode, ModeChange::Applied);
    assert!(!b.gpu(1).unwrap().mig_enabled);
}

#[test]
fn mig_parted_configs_are_parsed_and_bad_ones_rejected_precisely() {
    let f = config::File::parse(CONFIG).unwrap();
    assert_eq!(f.mig_configs.len(), 5);
    let d = f.desired("all-balanced", 0, "0x20b010de").unwrap().unwrap();
    assert_eq!(d.devices.get("3g.20gb"), Some(&1));
    assert_eq!(f.desired("all-balanced", 0, "0x9999").unwrap(), None, "no entry selects this GPU");
    assert_eq!(f.desired("custom", 2, "0x20B710DE").unwrap(), None);
    assert!(f.desired("custom", 3, "0x233510DE").unwrap().is_some());
    let e = config::File::parse("version: v2\nmig-configs: {}\n").unwrap_err();
    assert!(e.to_string().contains("version \"v2\" is not supported"), "{e}");
    let e = config::File::parse("version: v1\nmig-configs:\n  x:\n    - devices: some\n      mig-enabled: true\n")
        .unwrap_err();
    assert!(e.to_string().contains("x[0]: devices must be \"all\""), "{e}");
    let e = config::File::parse("version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1c.3g.20gb\": 2}\n").unwrap_err();
    assert!(e.to_string().contains("compute-instance sub-profiles are not supported"), "{e}");
    let e = config::File::parse(
        "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n      colour: red\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("colour"), "{e}");
}

/// A refused change is never carried out later, and every mode transition is checked before
/// anything changes (issue: disabling MIG with an instance held was refused, but recorded and done
/// at the next start; an impossible layout switched MIG on first and was retried at every start;
/// disabling with a process on the GPU destroyed every idle instance, then failed).
#[test]
fn refused_mig_changes_change_nothing_now_or_later() {
    let (_one, mut s, b, store) = on_node("[[gpu]]\nmodel = \"H100-80GB\"\n[[gpu]]\nmodel = \"H100-80GB\"\n");
    let f = config::File::parse(CONFIG).unwrap();
    let balanced = desired(&f, "all-balanced", &b, 0);
    apply::apply_gpu(&b, &store, 0, &balanced, false).unwrap();
    let before = layout(&b, 0);

    // 1. Disabling with an instance held: refused, and nothing recorded for a later start.
    let gi = b.gpu(0).unwrap().instances[0].gi;
    let busy = Busy { inner: &b, busy: vec![(0, gi)] };
    let off = desired(&f, "all-disabled", &b, 0);
    let e = apply::apply_gpu(&busy, &store, 0, &off, false).unwrap_err();
    assert!(matches!(e, vgpu_mig::backend::MigError::Plan { .. }) && e.to_string().contains("in use"), "{e}");
    assert!(store.in_progress().is_empty(), "no journal for a refused change");
    assert_eq!(store.desired(&b.gpu(0).unwrap().uuid), Some(balanced.clone()), "the recorded layout stays");
    // The holder goes; a restart's reconcile keeps the layout.
    apply::reconcile(&b, &store);
    assert!(b.gpu(0).unwrap().mig_enabled);
    assert_eq!(layout(&b, 0), before);

    // 2. An impossible layout on a GPU with MIG off: refused before the mode is switched on.
    let eight = Desired { mig_enabled: true, devices: [("1g.10gb".to_string(), 8)].into(), exact: true };
    let e = apply::apply_gpu(&b, &store, 1, &eight, false).unwrap_err();
    assert!(e.to_string().contains("at most 7"), "{e}");
    assert!(!b.gpu(1).unwrap().mig_enabled, "MIG mode left off");
    assert_eq!(store.desired(&b.gpu(1).unwrap().uuid), None);
    assert!(apply::transition(&b, 1, &eight, false).is_err(), "plan refuses it the same way");

    // 3. Disabling while a process runs on the GPU: refused before any instance is destroyed.
    let (pid, _) = s.spawn(RT, &["alloc", "--size", "64m", "--hold"]);
    let e = apply::apply_gpu(&b, &store, 0, &off, false).unwrap_err();
    assert!(matches!(&e, vgpu_mig::backend::MigError::Busy { pids, .. } if pids.contains(&pid.to_string())), "{e}");
    assert_eq!(layout(&b, 0), before, "no instance destroyed");
    assert!(b.gpu(0).unwrap().mig_enabled && store.in_progress().is_empty());
    s.kill(pid);
    let t = std::time::Instant::now();
    while !b.processes(0).unwrap().is_empty() {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the killed process is still listed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    // 4. Planning a disable counts and names every step: the instances destroyed and the mode.
    let t = apply::transition(&b, 0, &off, false).unwrap();
    assert_eq!(t.step_count(), before.len() + 1, "{t:?}");
    assert_eq!((t.destroy_first.as_ref().unwrap().steps.len(), t.mode), (before.len(), Some(false)));

    // 5. `mig-devices: {}` is mig-parted's "MIG on, no instances"; leaving it out sets the mode only.
    let empty = desired(&f, "all-enabled", &b, 0);
    assert!(empty.exact && empty.devices.is_empty());
    apply::apply_gpu(&b, &store, 0, &empty, false).unwrap();
    assert!(b.gpu(0).unwrap().mig_enabled && layout(&b, 0).is_empty(), "{:?}", layout(&b, 0));
    let mode_only =
        config::File::parse("version: v1\nmig-configs:\n  on:\n    - devices: all\n      mig-enabled: true\n")
            .unwrap()
            .desired("on", 0, "0x233010DE")
            .unwrap()
            .unwrap();
    assert!(!mode_only.exact && !mode_only.has_layout());
}

/// A config's counts are bounded before anything is built from them (4e9 instances of a profile
/// made the agent allocate 48 GB and abort), and `mig-devices: {}` asserts that no instance is
/// left (it passed with instances in place). Issue 61, items 2 and 3.
#[test]
fn huge_counts_are_refused_and_an_empty_layout_is_asserted() {
    let (_one, _s, b, store) = on_node(NODE);
    let huge = config::File::parse(
        "version: v1\nmig-configs:\n  huge:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"1g.10gb\": 4000000000}\n",
    )
    .unwrap();
    let d = desired(&huge, "huge", &b, 1);
    let e = config::wants(&b.gpu(1).unwrap(), &d).unwrap_err();
    assert!(e.to_string().contains("4000000000 x 1g.10gb") && e.to_string().contains("holds at most 7"), "{e}");
    let e = apply::apply_gpu(&b, &store, 1, &d, false).unwrap_err();
    assert!(e.to_string().contains("holds at most"), "{e}");
    assert!(layout(&b, 1).is_empty(), "nothing made: {:?}", layout(&b, 1));

    let f = config::File::parse(CONFIG).unwrap();
    apply::apply_gpu(&b, &store, 1, &desired(&f, "all-balanced", &b, 1), false).unwrap();
    assert_eq!(layout(&b, 1).len(), 4);
    let empty = desired(&f, "all-enabled", &b, 1);
    let diffs = apply::check(&b, 1, &empty).unwrap();
    assert_eq!(diffs.iter().filter(|d| d.starts_with("unwanted")).count(), 4, "{diffs:?}");
}

/// A GPU instance left without its compute instance (the agent killed between the two creations)
/// matched the layout's profiles, so `assert` passed with CUDA a device short and the replay kept
/// it. It is now never counted as done, and the agent's start removes it and makes the layout
/// whole. Issue 61, item 1.
#[test]
fn a_half_made_instance_is_not_done_and_is_removed_at_start() {
    let (_one, s, b, store) = on_node(NODE);
    let f = config::File::parse(CONFIG).unwrap();
    let d = desired(&f, "all-balanced", &b, 1);
    apply::apply_gpu(&b, &store, 1, &d, false).unwrap();
    assert_eq!(apply::check(&b, 1, &d).unwrap(), Vec::<String>::new());
    // One instance made again as a cut-short apply leaves it: the GPU instance alone.
    let g = b.gpu(1).unwrap();
    let i = g.instances[0].clone();
    let p = g.profile(i.profile).unwrap().clone();
    b.destroy(1, i.gi).unwrap();
    let nvml = nvml_wrapper::Nvml::builder().lib_path(s.libs.join("libnvidia-ml.so.1").as_os_str()).init().unwrap();
    let dev = nvml.device_by_index(1).unwrap();
    let placement = nvml_wrapper_sys::bindings::nvmlGpuInstancePlacement_t { start: i.start, size: p.memory_slices };
    let mut gi = std::ptr::null_mut();
    // SAFETY: a valid device handle of a live Nvml, a placement and an out-pointer to a local.
    let r = unsafe { nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement(dev.handle(), p.id, &placement, &mut gi) };
    assert_eq!(r, 0, "the GPU instance alone");
    let diffs = apply::check(&b, 1, &d).unwrap();
    assert!(
        diffs.iter().any(|x| x.contains(&format!("{} at slice {} has no compute instance", p.name, i.start))),
        "{diffs:?}"
    );
    // The agent's start: removed, then the recorded layout made whole.
    let removed: Vec<String> = apply::remove_half_made(&b).into_iter().map(Result::unwrap).collect();
    assert_eq!(removed, vec![format!("GPU 1: {} at slice {}", p.name, i.start)]);
    assert!(apply::reconcile(&b, &store).iter().all(Result::is_ok));
    assert_eq!(apply::check(&b, 1, &d).unwrap(), Vec::<String>::new());
    assert!(b.gpu(1).unwrap().instances.iter().all(|i| i.compute_instances.len() == 1));
}

/// `apply` without `--force` destroyed a GPU instance a process ran on: the simulated MIG devices
/// listed no process, and the parent GPU's list (which carries each process's GPU instance, as the
/// driver's does) was not read. Both now list it as the driver does, and either one keeps the
/// instance. Issue 61, item 4.
#[test]
fn a_process_on_a_mig_device_keeps_its_instance() {
    let (_one, mut s, b, store) = on_node(NODE);
    let f = config::File::parse(CONFIG).unwrap();
    apply::apply_gpu(&b, &store, 1, &desired(&f, "all-balanced", &b, 1), false).unwrap();
    let g = b.gpu(1).unwrap();
    let inst = g.instances.last().unwrap().clone();
    assert!(g.instances.iter().all(|i| !i.busy), "{:?}", g.instances);
    let mut c = s.cmd(RT);
    c.env("CUDA_VISIBLE_DEVICES", inst.uuid.as_deref().unwrap());
    let (pid, _) = s.spawn_cmd(c, &["alloc", "--size", "64m", "--hold"]);

    // The driver's two views: the parent lists it with its GPU instance, the MIG device lists it.
    let nvml = nvml_wrapper::Nvml::builder().lib_path(s.libs.join("libnvidia-ml.so.1").as_os_str()).init().unwrap();
    let parent = nvml.device_by_index(1).unwrap();
    let listed = parent.running_compute_processes().unwrap();
    assert_eq!(listed.iter().map(|p| (p.pid, p.gpu_instance_id)).collect::<Vec<_>>(), vec![(pid, Some(inst.gi))]);
    let mine = (0..parent.mig_device_count().unwrap())
        .map(|i| parent.mig_device_by_index(i).unwrap())
        .find(|m| m.uuid().ok() == inst.uuid)
        .unwrap();
    assert_eq!(mine.running_compute_processes().unwrap().iter().map(|p| p.pid).collect::<Vec<_>>(), vec![pid]);
    let busy: Vec<u32> = b.gpu(1).unwrap().instances.iter().filter(|i| i.busy).map(|i| i.gi).collect();
    assert_eq!(busy, vec![inst.gi]);

    // A layout without it is refused and changes nothing; forced, it goes.
    let before = layout(&b, 1);
    let e = apply::apply_gpu(&b, &store, 1, &desired(&f, "all-enabled", &b, 1), false).unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    assert_eq!(layout(&b, 1), before);
    s.kill(pid);
    std::thread::sleep(std::time::Duration::from_millis(20)); // NVML reaps the dead at most every 10 ms
    apply::apply_gpu(&b, &store, 1, &desired(&f, "all-enabled", &b, 1), false).unwrap();
    assert!(layout(&b, 1).is_empty());
}

/// The driver refusing the mode switch itself (an injected error) left the GPU's instances
/// destroyed and the journal replaying the disable at every start. The instances destroyed for it
/// are now made again, the change is dropped (journal and record as before), and the error says
/// what state the GPU is in. Issue 61, item 5.
#[test]
fn a_refused_mode_switch_puts_the_instances_back_and_is_not_replayed() {
    let (_one, s, b, store) = on_node(NODE);
    let f = config::File::parse(CONFIG).unwrap();
    let balanced = desired(&f, "all-balanced", &b, 1);
    apply::apply_gpu(&b, &store, 1, &balanced, false).unwrap();
    let before = layout(&b, 1);
    assert_eq!(before.len(), 4);
    let fault = |args: &[&str]| assert!(s.output(SIM, args).status.success(), "{args:?}");
    fault(&["fault", "set", "nvmlDeviceSetMigMode", "--gpu", "1", "--code", "999", "--count", "1"]);
    let e = apply::apply_gpu(&b, &store, 1, &desired(&f, "all-disabled", &b, 1), false).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, MigError::ModeRefused { .. }), "{e:?}");
    assert!(msg.contains("switching MIG off failed") && msg.contains("MIG is on, with "), "{msg}");
    assert!(msg.contains("the 4 instances destroyed for it were made again"), "{msg}");
    let mut now = layout(&b, 1);
    let mut was = before.clone();
    now.sort();
    was.sort();
    assert_eq!(now, was, "the same profiles at the same places");
    // Nothing replays the refused change: the journal is gone and the record is the layout's.
    assert!(store.in_progress().is_empty());
    assert_eq!(store.desired(&b.gpu(1).unwrap().uuid), Some(balanced.clone()));
    assert!(apply::reconcile(&b, &store).is_empty(), "the layout holds: nothing to do");
    assert!(b.gpu(1).unwrap().mig_enabled);
    assert_eq!(apply::check(&b, 1, &balanced).unwrap(), Vec::<String>::new());
}

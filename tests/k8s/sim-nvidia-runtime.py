#!/usr/bin/env python3
"""What the NVIDIA container runtime does for a driver, done for the simulated GPU: before runc
creates a container whose environment names GPUs (NVIDIA_VISIBLE_DEVICES, neither empty nor
`void`/`none`), its bundle's config.json gets the simulated driver (SIM_DIR: its libraries in
lib/, node.toml, state/) mounted at /opt/vgpu-sim and the environment that finds it, unless the
pod mounts it there itself. Then runc runs with the same arguments. Test infrastructure: the
product never sees the simulator's paths.
    sim-nvidia-runtime.py SIM_DIR RUNC [RUNC ARGUMENTS...]   (containerd's shim calls it as runc)
"""
import json
import os
import sys

MOUNT = "/opt/vgpu-sim"


def add_driver(bundle, sim_dir):
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    env = spec.setdefault("process", {}).setdefault("env", [])
    names = dict(e.split("=", 1) for e in env if "=" in e)
    devices = names.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if devices in ("", "void", "none"):
        return
    mounts = spec.setdefault("mounts", [])
    if not any(m.get("destination", "").rstrip("/") == MOUNT for m in mounts):
        mounts.append({"destination": MOUNT, "type": "bind", "source": sim_dir, "options": ["rbind", "rw"]})
    wanted = {
        "LD_LIBRARY_PATH": f"{MOUNT}/lib",
        "VGPU_SIM_CONFIG": f"{MOUNT}/node.toml",
        "VGPU_SIM_STATE": f"{MOUNT}/state",
    }
    env.extend(f"{k}={v}" for k, v in wanted.items() if k not in names)
    with open(path + ".tmp", "w") as f:
        json.dump(spec, f)
    os.replace(path + ".tmp", path)


def main():
    sim_dir, runc, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if "create" in args and "--bundle" in args:
        add_driver(args[args.index("--bundle") + 1], sim_dir)
    os.execv(runc, [runc, *args])


if __name__ == "__main__":
    main()

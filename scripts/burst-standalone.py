#!/usr/bin/env python3
"""100 processes started at once, each making a context and allocating 1 MiB under
CUDA_DEVICE_MEMORY_LIMIT=4093m with no region named (the standalone default: each process trues
itself up), bare and with LIB preloaded, in turn; prints the median wall time of REPS bursts each
(default 5) and the ratio. Needs the release build and target/release/sim-lib (scripts/demo.sh).

    REPS=9 scripts/burst-standalone.py target/x86_64-unknown-linux-gnu/release/libvgpu.so
"""
import os, subprocess, sys, time, tempfile, statistics
app = "target/release/cuda-rt-app"
lib = sys.argv[1] if len(sys.argv) > 1 else ""
n = 100
def run(pre):
    st = tempfile.mkdtemp()
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath("target/release/sim-lib"), VGPU_SIM_STATE=st)
    if pre:
        env.update(LD_PRELOAD=os.path.abspath(lib), CUDA_DEVICE_MEMORY_LIMIT="4093m")
    t = time.time()
    ps = [subprocess.Popen([app, "alloc", "--size", "1m"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]
    for p in ps: p.wait()
    return (time.time() - t) * 1e3
b = []; w = []
for _ in range(int(os.environ.get("REPS", "5"))):
    b.append(run(False)); w.append(run(True))
print("bare median %.0f ms, with %.0f ms, x%.2f" % (statistics.median(b), statistics.median(w), statistics.median(w)/statistics.median(b)))

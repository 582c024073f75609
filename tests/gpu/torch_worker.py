#!/usr/bin/env python3
"""PyTorch workloads of the real-GPU suite (tests/gpu/suite.py runs each in its own process, with or
without libvgpu.so preloaded). Usage: torch_worker.py TASK [JSON-ARGS]

Prints JSON objects, one per line; the last one is the result. Tasks that are timed print
{"event": "ready"} once warmed up and wait for a line on stdin ("go") before their timed part, so
that several workers and the NVML sampler share one window. Errors print {"error": ...} and exit 1.
"""
import json
import os
import sys
import time
import traceback


def emit(obj):
    print(json.dumps(obj), flush=True)


def ready_then_wait():
    emit({"event": "ready"})
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("stdin closed before go")


def smoke(torch, a):
    x = torch.ones(1024, device="cuda")
    return {
        "sum": float(x.sum().item()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }


def meminfo(torch, a):
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    return {"free": free, "total": total, "total_memory": props.total_memory, "name": props.name}


def oom(torch, a):
    chunk = int(a.get("chunk", 512 << 20))
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    # The baseline without the allocator's cached blocks (the end frees them too).
    torch.cuda.empty_cache()
    base_free, total = torch.cuda.mem_get_info()
    # The suite measures what the CUDA context really holds (NVML) at this point.
    emit({"event": "baseline"})
    if a.get("pause"):
        sys.stdin.readline()
    held, error, message = [], None, ""
    while len(held) < 100000:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            error, message = type(e).__name__, str(e).splitlines()[0][:200]
            break
    # The suite measures the process's real usage (NVML, outside the interposer) at this point.
    emit({"event": "at-oom", "chunks": len(held)})
    if a.get("pause"):
        sys.stdin.readline()
    small_ok = True
    try:
        s = torch.empty(64 << 20, dtype=torch.uint8, device="cuda") if len(held) > 0 else None
        del s
    except torch.OutOfMemoryError:
        small_ok = False
    # After freeing one chunk, the same request fits again.
    refit = None
    if held:
        held.pop()
        torch.cuda.empty_cache()
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            refit = True
        except torch.OutOfMemoryError:
            refit = False
    n = len(held)
    held.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after_free, _ = torch.cuda.mem_get_info()
    return {
        "chunk": chunk,
        "chunks": n,
        "allocated": n * chunk,
        # Not "error": that key means the worker itself failed.
        "oom_error": error,
        "message": message,
        "small_after_oom": small_ok,
        "refit_after_free": refit,
        "base_free": base_free,
        "after_free": after_free,
        "total": total,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }


def train(torch, a):
    torch.manual_seed(0)
    n = int(a.get("n", 4096))
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    got = (x @ y).float()
    ref = x.float() @ y.float()
    rel = float((got - ref).norm() / ref.norm())
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inp = torch.randn(256, 1024, device="cuda")
    target = torch.randn(256, 1024, device="cuda")
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inp), target)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    free, total = torch.cuda.mem_get_info()
    return {
        "matmul_rel_err": rel,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "max_reserved": torch.cuda.max_memory_reserved(),
        "free": free,
        "total": total,
    }


def _timed(torch, seconds, step, duty=1.0):
    """Runs step() repeatedly for `seconds`, synchronising every few calls; returns calls/s.

    duty below 1 paces the loop, without any limit: after each batch it stays idle for as long as
    the batch took, times (1 - duty) / duty, so the GPU is busy that fraction of the time. The rate
    is then what a perfect share of the GPU's time gives on this GPU (which may run at a higher
    clock while idle part of the time): the reference for an SM limit of that share."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    end = t0 + seconds
    n = 0
    while time.perf_counter() < end:
        b = time.perf_counter()
        for _ in range(4):
            step()
        n += 4
        torch.cuda.synchronize()
        if duty < 1.0:
            time.sleep((time.perf_counter() - b) * (1.0 - duty) / duty)
    return n / (time.perf_counter() - t0)


def _duty(a):
    d = float(a.get("duty", 1.0))
    if not 0.0 < d <= 1.0:
        raise ValueError("duty must be above 0 and at most 1, not %r" % d)
    return d


def matmul(torch, a):
    duty = _duty(a)
    n = int(a.get("n", 8192))
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.matmul(x, y, out=out)

    _timed(torch, float(a.get("warmup", 1.0)), step)
    ready_then_wait()
    rate = _timed(torch, float(a.get("seconds", 5.0)), step, duty)
    return {"per_s": rate, "n": n, "tflops": rate * 2 * n**3 / 1e12}


def mixed(torch, a):
    """Two GEMMs of one N and K in turn, M 1024 and 8192: cuBLAS tends to run both with one kernel
    function at grids 8x apart, whose GPU times differ about as much."""
    duty = _duty(a)
    n, m = int(a.get("n", 8192)), int(a.get("m_small", 1024))
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xl = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    os_, ol = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.matmul(xs, y, out=os_)
        torch.matmul(xl, y, out=ol)

    _timed(torch, float(a.get("warmup", 1.0)), step)
    ready_then_wait()
    rate = _timed(torch, float(a.get("seconds", 5.0)), step, duty)
    return {"per_s": rate, "n": n, "m_small": m}


def graph(torch, a):
    duty = _duty(a)
    n = int(a.get("n", 4096))
    depth = int(a.get("depth", 8))
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / n**0.5

    def body(inp):
        h = inp
        for _ in range(depth):
            h = torch.tanh(h @ w)
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body(x)
    torch.cuda.current_stream().wait_stream(side)
    if a.get("recapture"):
        # A graph of one matmul replayed past the interposer's early sampling, then destroyed: the
        # graph measured below is likely instantiated at the same address, and must be charged its
        # own time, not this one's.
        g0 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g0):
            torch.tanh(x @ w)
        for _ in range(int(a.get("small_replays", 1500))):
            g0.replay()
        torch.cuda.synchronize()
        g0.reset()
        del g0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body(x)
    g.replay()
    torch.cuda.synchronize()
    eager = body(x)
    match = bool(torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2))
    _timed(torch, float(a.get("warmup", 1.0)), g.replay)
    ready_then_wait()
    rate = _timed(torch, float(a.get("seconds", 5.0)), g.replay, duty)
    return {"replays_per_s": rate, "match": match, "kernels_per_replay": 2 * depth}


def recapture(torch, a):
    return graph(torch, dict(a, recapture=True))


def launch(torch, a):
    x = torch.zeros(1, device="cuda")
    for _ in range(1000):
        x.add_(1)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(int(a.get("ops", 4000))):
            x.add_(1)
        torch.cuda.synchronize()
        best = max(best, int(a.get("ops", 4000)) / (time.perf_counter() - t0))
    return {"ops_per_s": best}


def async_pool(torch, a):
    """Run with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (stream-ordered pools; PyTorch sets
    the pool's release threshold to the maximum). Allocates, frees and synchronises, then waits (the
    suite tries an allocation beside what the pool keeps), allocates the same again, captures and
    replays a graph that allocates (graph memory nodes), and empties the cache. PyTorch's
    empty_cache() trims only the stream-ordered pool: what the driver keeps for the destroyed
    graph's memory nodes goes with cuDeviceGraphMemTrim, called last here (through ctypes)."""
    n = int(a["bytes"])
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.mem_get_info()[0]
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    holding = torch.cuda.mem_get_info()[0]
    del t
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info()[0]
    emit({"event": "freed"})
    sys.stdin.readline()
    again = None
    try:
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t.fill_(2)
        torch.cuda.synchronize()
        again = "ok"
        del t
    except torch.OutOfMemoryError as e:
        again = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    graph_bytes = int(a.get("graph_bytes", 256 << 20))
    src = torch.ones(graph_bytes // 4, device="cuda")
    with torch.cuda.graph(g):
        tmp = src * 2  # allocated inside the capture: a graph memory node under this backend
        out = tmp.sum()
    g.replay()
    torch.cuda.synchronize()
    replay_ok = bool(abs(float(out.item()) - 2.0 * (graph_bytes // 4)) < 1e-3 * graph_bytes)
    replayed = torch.cuda.mem_get_info()[0]
    del g, tmp, out, src
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    emptied = torch.cuda.mem_get_info()[0]
    import ctypes

    trim = ctypes.CDLL("libcuda.so.1").cuDeviceGraphMemTrim(ctypes.c_int(torch.cuda.current_device()))
    trimmed = torch.cuda.mem_get_info()[0]
    return {"backend": torch.cuda.get_allocator_backend(), "base": base, "holding": holding, "freed": freed,
            "again": again, "replay_ok": replay_ok, "replayed": replayed, "emptied": emptied,
            "graph_bytes": graph_bytes, "graph_trim_result": trim, "trimmed": trimmed}


def hold(torch, a):
    t = torch.empty(int(a["bytes"]), dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    emit({"event": "holding", "bytes": t.numel()})
    sys.stdin.readline()
    return {"held": t.numel()}


def serve(torch, a):
    """A small model's forward passes at a fixed rate (an inference service): each request's
    latency from its arrival to its result, as percentiles (ms)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 2048)
    ).cuda().half().eval()
    x = torch.randn(int(a.get("batch", 8)), 2048, device="cuda", dtype=torch.half)
    rate, seconds, warmup = float(a.get("rate", 100)), float(a.get("seconds", 10)), int(a.get("warmup", 50))
    period, lat = 1.0 / rate, []
    with torch.no_grad():
        start = time.perf_counter()
        for i in range(warmup + int(seconds * rate)):
            arrival = start + i * period
            now = time.perf_counter()
            if now < arrival:
                time.sleep(arrival - now)
            model(x)
            torch.cuda.synchronize()
            if i >= warmup:
                lat.append((time.perf_counter() - arrival) * 1e3)
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, max(0, int(f * len(lat) + 0.999999) - 1))]
    return {"requests": len(lat), "p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": lat[-1]}


def train_loop(torch, a):
    """A training loop for `seconds` (best-effort work): its steps a second."""
    torch.manual_seed(0)
    n = int(a.get("width", 4096))
    model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.ReLU(), torch.nn.Linear(n, n)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    inp = torch.randn(int(a.get("batch", 512)), n, device="cuda")
    steps, end = 0, time.perf_counter() + float(a.get("seconds", 10))
    emit({"event": "training"})
    start = time.perf_counter()
    while time.perf_counter() < end:
        opt.zero_grad(set_to_none=True)
        model(inp).square().mean().backward()
        opt.step()
        steps += 1
        if steps % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return {"steps": steps, "steps_per_s": steps / (time.perf_counter() - start)}


TASKS = {
    "serve": serve,
    "train_loop": train_loop,
    "smoke": smoke,
    "meminfo": meminfo,
    "oom": oom,
    "train": train,
    "matmul": matmul,
    "graph": graph,
    "recapture": recapture,
    "launch": launch,
    "hold": hold,
    "mixed": mixed,
    "async_pool": async_pool,
}


def main(argv):
    if len(argv) < 2 or argv[1] not in TASKS:
        print("usage: torch_worker.py {%s} [JSON-ARGS]" % "|".join(TASKS), file=sys.stderr)
        return 2
    args = json.loads(argv[2]) if len(argv) > 2 else {}
    try:
        import torch

        emit(TASKS[argv[1]](torch, args))
        return 0
    except SystemExit:
        raise
    except BaseException as e:  # report anything, including CUDA errors, as the result
        emit({"error": "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")})
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

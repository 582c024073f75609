#!/usr/bin/env python3
"""The node agent's module graph: which module of node-agent/src imports which (`crate::m` paths,
`use crate::{..}` groups; tests left out), and the layering rule it must keep (then the
interposer's, vgpu-preload/src, below):

- the core (configuration, inventory, slices, monitoring and what they stand on) imports no
  feature module: features reach the core, never the reverse;
- no module imports, through any path, a module that imports it back (no circles);
- the interposer's modules stand on floors (`PRELOAD_FLOORS`): each imports its own floor or
  those below, and none is in a circle.

    scripts/module-graph.py          # prints the graph; exits 1 naming each breach
    scripts/module-graph.py --dot    # the same as Graphviz
Run by .ci/run.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "node-agent", "src")
# The core: what the agent is without any of its features.
CORE = {"agent", "cdi", "config", "describe", "discovery", "health", "monitor", "procfs", "slices", "sockets"}
# The top: the binaries' wiring, free to import anything.
TOP = {"lib", "daemon"}


def modules(src=SRC):
    """Module name -> its source (a directory module's files together), tests left out."""
    out = {}
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        # `m.rs` and its submodules in `m/` (or `m/mod.rs`) are one module.
        if entry.endswith(".rs"):
            out.setdefault(entry[:-3], []).append(path)
        elif os.path.isdir(path) and entry != "bin":
            files = [os.path.join(d, f) for d, _, fs in sorted(os.walk(path)) for f in sorted(fs) if f.endswith(".rs")]
            out.setdefault(entry, []).extend(files)
    text = {}
    for name, files in out.items():
        parts = []
        for f in files:
            src = open(f).read()
            # Unit tests are not the module's dependencies.
            src = re.split(r"\n#\[cfg\(test\)\]\nmod \w+ \{", src)[0]
            parts.append(re.sub(r"//[^\n]*", "", src))
        text[name] = "\n".join(parts)
    return text


def imports(text, names):
    found = set(re.findall(r"\bcrate::(\w+)", text))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
        found.update(re.findall(r"(?:^|,)\s*(\w+)", group))
    return found & names


PRELOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vgpu-preload", "src")
# The interposer's floors, bottom up: a module imports its own floor or those below, never above
# (the crate root, `lib`, wires the floors together and is above them all).
PRELOAD_FLOORS = [
    # The C edge and what stands on nothing: the declared ABI, the real driver's and NVML's tables,
    # the configuration, the log, the clock, plain tables.
    {"abicheck", "api", "charged", "clock", "config", "contexts", "ctxlimits", "guard", "log", "ptrmap", "real"},
    # The interposer's own calls of the driver and NVML, and what follows stream captures.
    {"capture", "drv", "nvquery"},
    # What the process state stands on: the devices it may use, the true-up of its account.
    {"trueup", "visible"},
    # The process state: its slot in the region, the device map, the allocation tables.
    {"state"},
    # The policies: memory, NVML's view, SM time, priority, pools, graphs, VMM.
    {"graphmem", "locate", "memory", "mps", "nvml", "pools", "priority", "sm", "smi", "stale", "vmm"},
    # The exported hooks and `dlsym`.
    {"dl", "hooks"},
]


def reach(graph, start):
    """The modules `start` imports, through any path."""
    seen, todo = set(), list(graph[start])
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph[n])
    return seen


def circles(graph):
    """The modules that reach themselves."""
    return {m for m in graph if m in reach(graph, m)}


def preload():
    """The interposer's graph: printed; breaches of its rule returned."""
    text = modules(PRELOAD)
    names = set(text)
    graph = {m: sorted(imports(t, names) - {m}) for m, t in text.items()}
    floor = {m: n for n, ms in enumerate(PRELOAD_FLOORS) for m in ms}
    floor["lib"] = len(PRELOAD_FLOORS)
    print("\nvgpu-preload:")
    for m, deps in sorted(graph.items(), key=lambda kv: (floor.get(kv[0], -1), kv[0])):
        print(f"{m:14} [floor {floor.get(m, '?')}] -> {' '.join(deps) if deps else '-'}")
    bad = [f"vgpu-preload: {m} is on no floor (add it to PRELOAD_FLOORS)" for m in sorted(names - set(floor))]
    for m in sorted(names & set(floor)):
        for d in graph[m]:
            if d in floor and floor[d] > floor[m]:
                bad.append(f"vgpu-preload: {m} (floor {floor[m]}) imports {d}, a floor above (floor {floor[d]})")
    for m in sorted(circles(graph)):
        back = [d for d in graph[m] if m in reach(graph, d)]
        bad.append(f"vgpu-preload: {m} is in a circle (through {', '.join(back)})")
    print(f"vgpu-preload: {len(names)} modules on {len(PRELOAD_FLOORS)} floors")
    return bad


def main():
    text = modules()
    names = set(text)
    graph = {m: sorted(imports(t, names) - {m}) for m, t in text.items()}
    if "--dot" in sys.argv:
        print("digraph agent {")
        for m, deps in sorted(graph.items()):
            for d in deps:
                print(f'  "{m}" -> "{d}";')
        print("}")
        return 0
    for m, deps in sorted(graph.items()):
        layer = "top" if m in TOP else "core" if m in CORE else "feature"
        print(f"{m:14} [{layer:7}] -> {' '.join(deps) if deps else '-'}")
    bad = []
    for m in sorted(CORE & names):
        for d in graph[m]:
            if d not in CORE:
                bad.append(f"core module {m} imports feature module {d}")
    for m in sorted(names - TOP):
        for d in graph[m]:
            if d in TOP:
                bad.append(f"{m} imports {d}, which only the binaries may")
    # Circles: a module that reaches itself.
    for m in sorted(circles(graph)):
        back = [d for d in graph[m] if m in reach(graph, d) or d == m]
        bad.append(f"{m} is in a circle (through {', '.join(back)})")
    bad += preload()
    if bad:
        print("\nlayering broken:\n  " + "\n  ".join(bad))
        return 1
    print(f"\nok: the agent's {len(names)} modules: the core imports no feature, no circles; the interposer: every import down its floors, no circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())

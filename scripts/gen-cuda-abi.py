#!/usr/bin/env python3
"""Generates cuda-abi/src/header.rs: the parameters of every CUDA driver entry point as the real
`cuda.h` declares them, and of every NVML entry point as `nvml.h` does, by kind and width (a pointer, an integer of N bytes, a float of N bytes, a
struct of N bytes), so that each hook `libvgpu.so` declares is checked against the header at
compile time (`vgpu-preload/src/api.rs`): a wrong argument width does not build.

The headers come from pinned wheels on PyPI (NVIDIA's CUDA runtime wheels carry `cuda.h`): CUDA
12.9's and 13.5's, merged (13 adds entry points, 12 keeps those 13 dropped; a versioned entry point
never changes, and the script stops if the two disagree). The C compiler resolves every type, so no
typedef is read by hand:

    scripts/gen-cuda-abi.py            # regenerates cuda-abi/src/header.rs
    scripts/gen-cuda-abi.py --check    # exits 1 when the committed file is not what it generates

Needs pip (PyPI) and cc. Run by .ci/run with --check.
"""
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# (wheel, its header): CUDA's and NVML's, of CUDA 12.9 and 13.
WHEELS = [
    ("nvidia-cuda-runtime-cu12==12.9.79", "cuda.h"),
    ("nvidia-cuda-runtime==13.5.37", "cuda.h"),
    ("nvidia-nvml-dev-cu12==12.9.79", "nvml.h"),
    ("nvidia-nvml-dev==13.4.92", "nvml.h"),
]
# Per header: its return type, and the preprocessor passes that between them declare every entry
# point (the default names; the older ones kept for the driver's own use; the per-thread forms).
PASSES = {
    "cuda.h": ("CUresult", ([], ["-D__CUDA_API_VERSION_INTERNAL"], ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"])),
    "nvml.h": ("nvmlReturn_t", ([], ["-DNVML_NO_UNVERSIONED_FUNC_DEFS"])),
}
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "cuda-abi", "src", "header.rs")
CACHE = os.path.join(ROOT, "target", "cuda-abi-header")
# __builtin_classify_type: integer, enumeral, boolean, pointer, real (floating), record (struct).
KIND = {1: "Int", 3: "Int", 4: "Int", 5: "Ptr", 8: "Float", 12: "Struct"}
TYPE_WORDS = {"int", "long", "char", "short", "float", "double", "unsigned", "signed", "void", "const"}


def headers(wheel, header):
    """The include directory holding `header` of a pinned wheel (downloaded once into target/)."""
    cache = os.path.join(CACHE, wheel.split("==")[0])
    found = [os.path.join(d, header) for d, _, fs in os.walk(cache) if header in fs]
    if found:
        return os.path.dirname(found[0])
    os.makedirs(cache, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", cache, wheel], check=True)
    whl = next(f for f in os.listdir(cache) if f.endswith(".whl"))
    with zipfile.ZipFile(os.path.join(cache, whl)) as z:
        inside = next(os.path.dirname(n) for n in z.namelist() if n.endswith("/include/" + header))
        for n in z.namelist():
            if n.startswith(inside + "/") and n.endswith(".h"):
                z.extract(n, cache)
    return os.path.join(cache, inside)


def prototypes(inc, header):
    """Entry point -> its parameters' types, from `header` preprocessed each of its ways."""
    ret, passes = PASSES[header]
    found = {}
    for defines in passes:
        text = subprocess.run(["cc", "-E", "-P", *defines, "-x", "c", os.path.join(inc, header)],
                              check=True, capture_output=True, text=True).stdout
        text = re.sub(r"\s+", " ", text)
        for name, params in re.findall(rf"\b{ret} ((?:cu|nvml)\w+) ?\(([^;{{]*?)\) ?;", text):
            found.setdefault(name, [type_of(p) for p in params.split(",") if p.strip() not in ("", "void")])
    return found


def type_of(param):
    """A parameter's type: the declaration without its name."""
    p = param.strip()
    m = re.match(r"^(.*?[\s*])(\w+)$", p)
    if m and m.group(2) not in TYPE_WORDS:
        return m.group(1).strip()
    return p


def classify(inc, header, protos):
    """(function, index) -> (kind, bytes), by the C compiler."""
    lines = ['#include <stdio.h>', f'#include "{header}"', "int main(void) {"]
    for name, params in sorted(protos.items()):
        for i, t in enumerate(params):
            lines.append(f'  printf("{name} {i} %d %d\\n", (int)sizeof({t}), __builtin_classify_type(*({t} *)0));')
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "abi.c"), os.path.join(d, "abi")
        open(c, "w").write("\n".join(lines) + "\n")
        # The older entry points' types (`CUdeviceptr_v1`, ...) exist only for the driver's own use.
        defines = [d for p in PASSES[header][1] for d in p]
        subprocess.run(["cc", "-w", *defines, "-I", inc, "-o", exe, c], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        name, i, size, cls = line.split()
        res[(name, int(i))] = (KIND.get(int(cls), f"Class{cls}"), int(size))
    return res


def render(sigs):
    out = [
        "// @generated by scripts/gen-cuda-abi.py from the headers of "
        + ", ".join(w for w, _ in WHEELS) + " (PyPI); do not edit.",
        "//! Every CUDA driver entry point of `cuda.h` and NVML entry point of `nvml.h`, its parameters",
        "//! by kind and width.",
        "#![allow(non_upper_case_globals)]",
        "",
        "use crate::abi::Abi::{self, *};",
        "",
    ]
    for name in sorted(sigs):
        out.append(f"pub const {name}: &[Abi] = &[{', '.join(sigs[name])}];")
    return "\n".join(out) + "\n"


def signatures(inc, header):
    """Entry point -> its parameters as `Ptr`, `Int(n)`, `Float(n)`, `Struct(n)`."""
    protos = prototypes(inc, header)
    kinds = classify(inc, header, protos)
    sigs = {}
    for name, params in protos.items():
        parts = []
        for i in range(len(params)):
            kind, size = kinds[(name, i)]
            parts.append("Ptr" if kind == "Ptr" else f"{kind}({size})")
        sigs[name] = parts
    return sigs


def main():
    merged = {}
    for wheel, header in WHEELS:
        for name, sig in signatures(headers(wheel, header), header).items():
            if name in merged and merged[name] != sig:
                print(f"{name}: {wheel} declares {sig}, an earlier header {merged[name]}", file=sys.stderr)
                return 1
            merged[name] = sig
    text = render(merged)
    pins = " and ".join(w for w, _ in WHEELS)
    if "--check" in sys.argv:
        have = open(OUT).read() if os.path.exists(OUT) else ""
        if have != text:
            print(f"{OUT} is not what scripts/gen-cuda-abi.py generates from {pins}: run it", file=sys.stderr)
            return 1
        print(f"ok: {len(merged)} entry points, as {pins} declare them")
        return 0
    open(OUT, "w").write(text)
    print(f"wrote {OUT}: {len(merged)} entry points")
    return 0


if __name__ == "__main__":
    sys.exit(main())

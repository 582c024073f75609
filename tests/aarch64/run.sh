#!/usr/bin/env bash
# libvgpu.so on AArch64 (Grace-based GPU nodes such as GH200 and GB200), checked under qemu-user on
# any Linux machine: builds the AArch64 libvgpu.so against the glibc 2.17 baseline
# (scripts/build-libvgpu.sh --arch aarch64, with its export and dependency checks), the simulated
# driver for AArch64, and a small C application (tests/c-probe/) that binds the driver with dlopen + dlsym,
# then runs the application without and with libvgpu.so preloaded and checks the limit, the dlsym
# override, cuGetProcAddress and dlsym(RTLD_NEXT) from another library.
#   tests/aarch64/run.sh
# Needs: qemu-aarch64 and the AArch64 C library in /usr/aarch64-linux-gnu (Debian: apt-get install
# qemu-user libc6-arm64-cross; installed when missing and running as root), rustup, python3; zig and
# cargo-zigbuild are installed like build-libvgpu.sh does. Exit status: 0 passed, 1 failed, 2 could
# not run.
set -euo pipefail
here=$(cd "$(dirname "$0")/../c-probe" && pwd)
cd "$here/../.."
sysroot=/usr/aarch64-linux-gnu

if ! command -v qemu-aarch64 >/dev/null 2>&1 || ! [ -e "$sysroot/lib/ld-linux-aarch64.so.1" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends qemu-user libc6-arm64-cross
    else
        echo "aarch64: needs qemu-aarch64 and $sysroot (apt-get install qemu-user libc6-arm64-cross)" >&2
        exit 2
    fi
fi

if ! rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu \
    && ! rustup target add aarch64-unknown-linux-gnu; then
    echo "aarch64: cannot install the Rust standard library for aarch64-unknown-linux-gnu" >&2
    exit 2
fi

echo "--- libvgpu.so for AArch64 (glibc 2.17 baseline) and its build checks"
scripts/build-libvgpu.sh --arch aarch64
echo "--- the simulated driver and the probe application for AArch64"
cargo zigbuild --release -q -p vgpu-sim-cuda --target aarch64-unknown-linux-gnu.2.17
out=target/aarch64-unknown-linux-gnu/vgpu-probe
rm -rf "$out" && mkdir -p "$out"
cp target/aarch64-unknown-linux-gnu/release/libcuda.so "$out/libcuda.so.1"
zigcc() {
    if command -v zig >/dev/null 2>&1; then zig cc "$@"; else python3 -m ziglang cc "$@"; fi
}
cc="-target aarch64-linux-gnu.2.17 -O1 -Wall -Werror"
zigcc $cc -shared -fPIC -o "$out/libprobe-b.so" "$here/probe-b.c"
zigcc $cc -shared -fPIC -o "$out/libprobe-a.so" "$here/probe-a.c" -ldl
# libprobe-a.so before libprobe-b.so in the search order.
zigcc $cc -o "$out/probe" "$here/probe.c" -L"$out" -Wl,--no-as-needed -lprobe-a -lprobe-b -ldl
! command -v file >/dev/null || file "$out/probe" "$out/libcuda.so.1" target/aarch64-unknown-linux-gnu/release/libvgpu.so | sed 's/, BuildID[^,]*//'

lib=$PWD/target/aarch64-unknown-linux-gnu/release/libvgpu.so
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf 'context_overhead_mib = 64\n[[gpu]]\nmodel = "A100-40GB"\nmemory_mib = 8192\n' >"$work/node.toml"
# A run of the probe on a fresh simulated node: qemu's -E sets the AArch64 process's environment
# (LD_PRELOAD and LD_LIBRARY_PATH must not reach the x86-64 qemu itself).
probe() {
    local name=$1
    shift
    mkdir -p "$work/$name"
    qemu-aarch64 -L "$sysroot" -E LD_LIBRARY_PATH="$PWD/$out" -E VGPU_SIM_STATE="$work/$name" \
        -E VGPU_SIM_CONFIG="$work/node.toml" "$@" "$PWD/$out/probe" 128 20
}
echo "--- runs under qemu-aarch64"
plain=$(probe plain)
limited=$(probe limited -E LD_PRELOAD="$lib" -E CUDA_DEVICE_MEMORY_LIMIT=1g \
    -E CUDA_DEVICE_MEMORY_SHARED_CACHE="$work/limited/region")
python3 - "$plain" "$limited" <<'PY'
import json, sys
plain, limited = (json.loads(x) for x in sys.argv[1:3])
MIB, fails = 1 << 20, []
def check(what, ok, got):
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {got}")
    if not ok:
        fails.append(what)
print("without libvgpu.so:", json.dumps(plain))
print("with libvgpu.so, 1 GiB limit:", json.dumps(limited))
check("without: the GPU's 8 GiB, 20 x 128 MiB granted, RTLD_NEXT finds libprobe-b.so's marker",
      plain["total"] == 8192 * MIB and plain["granted"] == 20 and plain["next"] == 2, plain)
check("with: cuMemGetInfo's total is the 1 GiB limit", limited["total"] == 1024 * MIB, limited["total"])
want = limited["free"] // (128 * MIB)
check(f"with: 128 MiB allocations granted up to the limit ({want}), then CUDA_ERROR_OUT_OF_MEMORY (2)",
      limited["granted"] == want and 0 < want < 8 and limited["refused"] == 2,
      (limited["granted"], limited["refused"]))
check("with: cuMemAlloc through cuGetProcAddress is limited too (2)", limited["proc_address"] == 2,
      limited["proc_address"])
check("with: dlsym(RTLD_NEXT) from a library still resolves after that library (2, not 1)",
      limited["next"] == 2, limited["next"])
check("dlvsym (not overridden) cannot reach the driver's cuMemAlloc_v2, without and with",
      plain["dlvsym"] == 0 and limited["dlvsym"] == 0, (plain["dlvsym"], limited["dlvsym"]))
sys.exit(1 if fails else 0)
PY
echo "aarch64: all checks passed"

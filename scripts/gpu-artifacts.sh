#!/usr/bin/env bash
# Builds what the real-GPU suite (tests/gpu/run.sh) needs from this checkout, in release form, into
# one folder to copy to the GPU machine beside tests/gpu/: libvgpu.so against the glibc 2.17 baseline
# (scripts/build-libvgpu.sh), and gpu-probe, nvml-probe, vgpu-node-agent and vgpuctl, stripped.
#   scripts/gpu-artifacts.sh [DIR]        # default DIR: target/gpu-artifacts
# Prints the command to run on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
    -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu-artifacts.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "gpu-artifacts.sh: one folder at most (see --help)" >&2; exit 2; }
dir=${1:-target/gpu-artifacts}
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || {
    echo "gpu-artifacts.sh: no libvgpu.so for $(uname -m)" >&2; exit 2; }
target=$(uname -m)-unknown-linux-gnu

echo "== libvgpu.so (glibc 2.17 baseline)"
scripts/build-libvgpu.sh
echo "== gpu-probe, nvml-probe, vgpu-node-agent, vgpuctl"
# The package set of the demo and of .ci/run, so that a release build already there is reused (a
# smaller set unifies dependency features differently and rebuilds them).
cargo build --release -p vgpu-sim-cuda -p vgpu-sim-nvml -p vgpu-sim-clients -p vgpu-preload \
    -p vgpu-node-agent -p vgpu-receiver

rm -rf "$dir"
mkdir -p "$dir"
for b in gpu-probe nvml-probe vgpu-node-agent vgpuctl; do
    cp "target/release/$b" "$dir/"
    strip "$dir/$b"
done
cp "target/$target/release/libvgpu.so" "$dir/"
du -sh "$dir"
echo "on the GPU machine, from a checkout's root (or beside a copy of tests/gpu/):"
echo "  tests/gpu/run.sh --lib $dir/libvgpu.so --bin-dir $dir --out gpu-results"

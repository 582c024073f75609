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
target=$(uname -m)-unknown-linux-gnu   # scripts/build-libvgpu.sh refuses an architecture without libvgpu.so

echo "== libvgpu.so (glibc 2.17 baseline)"
scripts/build-libvgpu.sh
echo "== gpu-probe, nvml-probe, vgpu-node-agent, vgpuctl"
# The demo's package set, so that a release build already there is reused.
. scripts/release-set.sh
cargo build --release "${RELEASE_SET[@]}"

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

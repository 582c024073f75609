#!/usr/bin/env bash
# Release build of libvgpu.so linked against the glibc 2.17 baseline (CentOS 7 / UBI 7 era and every
# CUDA image since), then the export and dependency checks.
#   scripts/build-libvgpu.sh [--arch x86_64|aarch64]   # default: this machine's; needs cargo-zigbuild
#                                                      # and zig (installs them if missing)
# Output: target/<arch>-unknown-linux-gnu/release/libvgpu.so
set -euo pipefail
cd "$(dirname "$0")/.."

arch=$(uname -m)
while [ $# -gt 0 ]; do
    case "$1" in
        --arch) arch=${2:?--arch needs x86_64 or aarch64}; shift 2 ;;
        -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-libvgpu.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$arch" in
    x86_64|amd64) arch=x86_64 ;;
    aarch64|arm64) arch=aarch64 ;;
    *) echo "build-libvgpu.sh: no libvgpu.so for $arch (x86_64 or aarch64)" >&2; exit 2 ;;
esac
target=$arch-unknown-linux-gnu
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    echo "installing the Rust standard library for $target"
    rustup target add "$target"
fi

# The versions this build is checked with; a zig already on the machine is used as it is (said).
ZIGLANG_VERSION=0.17.0
ZIGBUILD_VERSION=0.24.0
if command -v zig >/dev/null 2>&1; then
    echo "using zig $(zig version) from $(command -v zig) (checked with $ZIGLANG_VERSION)"
elif ! python3 -m ziglang version >/dev/null 2>&1; then
    echo "installing zig $ZIGLANG_VERSION (PyPI package ziglang)"
    python3 -m pip install -q "ziglang==$ZIGLANG_VERSION" 2>/dev/null ||
        python3 -m pip install -q --break-system-packages "ziglang==$ZIGLANG_VERSION"
fi
if ! command -v cargo-zigbuild >/dev/null 2>&1; then
    echo "installing cargo-zigbuild $ZIGBUILD_VERSION"
    cargo install --locked -q --version "$ZIGBUILD_VERSION" cargo-zigbuild
fi
cargo zigbuild --release -p vgpu-preload --target "$target.2.17"
scripts/check-libvgpu.sh "target/$target/release/libvgpu.so"

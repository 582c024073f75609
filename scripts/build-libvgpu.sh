#!/usr/bin/env bash
# Release build of libvgpu.so linked against the glibc 2.17 baseline (CentOS 7 / UBI 7 era and every
# CUDA image since), then the export and dependency checks.
#   scripts/build-libvgpu.sh            # needs cargo-zigbuild and zig (installs them if missing)
# Output: target/x86_64-unknown-linux-gnu/release/libvgpu.so
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v zig >/dev/null 2>&1 && ! python3 -m ziglang version >/dev/null 2>&1; then
    echo "installing zig (PyPI package ziglang)"
    python3 -m pip install -q ziglang 2>/dev/null || python3 -m pip install -q --break-system-packages ziglang
fi
if ! command -v cargo-zigbuild >/dev/null 2>&1; then
    echo "installing cargo-zigbuild"
    cargo install --locked -q cargo-zigbuild
fi
cargo zigbuild --release -p vgpu-preload --target x86_64-unknown-linux-gnu.2.17
scripts/check-libvgpu.sh target/x86_64-unknown-linux-gnu/release/libvgpu.so

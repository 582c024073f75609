#!/usr/bin/env bash
# vgpu's real-GPU validation suite (docs/gpu-validation.md). On a machine with an NVIDIA GPU, its
# driver, and python3 with PyTorch:
#   tests/gpu/run.sh --lib path/to/libvgpu.so --bin-dir path/to/binaries [--out DIR] [--quick]
# --bin-dir holds gpu-probe and nvml-probe (the suite's helpers), vgpu-node-agent and vgpuctl, as
# built by `cargo build --release -p vgpu-sim-clients -p vgpu-node-agent`. It never changes the GPU's
# settings. --help lists every option and --list every check. Exit status: 0 all passed (or were
# skipped), 1 a check failed, 2 bad usage.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec "${VGPU_SUITE_PYTHON:-python3}" "$here/suite.py" "$@"

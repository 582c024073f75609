# The one set of packages every release build of scripts/demo.sh, scripts/gpu-artifacts.sh and
# .ci/run names, sourced by each: cargo unifies dependency features over the packages of a build, so
# a different set would rebuild shared dependencies (minutes on two cores) instead of reusing them.
# shellcheck shell=bash
RELEASE_SET=(-p vgpu-sim-cuda -p vgpu-sim-nvml -p vgpu-sim-clients -p vgpu-preload -p vgpu-node-agent -p vgpu-receiver)

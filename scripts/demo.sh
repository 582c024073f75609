#!/usr/bin/env bash
# Quick start: builds the simulated GPU node and runs demo workloads on it, then shows what the
# driver, NVML and the simulator's own view report. Needs only cargo and a C compiler.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== building (release)"
cargo build --release -q -p vgpu-sim-cuda -p vgpu-sim-nvml -p vgpu-sim-clients -p vgpu-preload
T=$PWD/target/release
mkdir -p "$T/sim-lib"
ln -sfn ../libcuda.so "$T/sim-lib/libcuda.so.1"
ln -sfn ../libnvidia_ml.so "$T/sim-lib/libnvidia-ml.so.1"

export LD_LIBRARY_PATH=$T/sim-lib
VGPU_SIM_STATE=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-demo.XXXXXX")
export VGPU_SIM_STATE
export VGPU_SIM_CONFIG=$VGPU_SIM_STATE.toml
cat >"$VGPU_SIM_CONFIG" <<'TOML'
# The demo node: one H100 and one A100 40GB.
[[gpu]]
model = "H100-80GB"
[[gpu]]
model = "A100-40GB"
TOML

pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$VGPU_SIM_STATE" "$VGPU_SIM_CONFIG"
}
trap cleanup EXIT

echo "== the devices as a CUDA application sees them (cuda-rt-app info)"
"$T/cuda-rt-app" info

echo "== workload 1: a \"container\" limited to 10 GiB on GPU 0 (libvgpu.so preloaded) asks for 12 GiB"
CONTAINER=(env LD_PRELOAD="$T/libvgpu.so" CUDA_DEVICE_MEMORY_LIMIT=10g
    CUDA_DEVICE_MEMORY_SHARED_CACHE="$VGPU_SIM_STATE/container.region")
out1=$VGPU_SIM_STATE/w1.out
"${CONTAINER[@]}" "$T/cuda-rt-app" alloc --size 12g --chunk 1g --hold >"$out1" &
pids+=($!)
echo "== workload 2: 5 ms kernels for 2 s on GPU 0 (linked directly against libcuda.so.1)"
out2=$VGPU_SIM_STATE/w2.out
"$T/cuda-direct-app" launch --kernel sleep_5ms --seconds 2 >"$out2" &
pids+=($!)
echo "== workload 3: VMM allocations on GPU 1 (dlsym binding)"
"$T/cuda-dlsym-app" alloc --device 1 --allocator vmm --size 3g --chunk 512m --hold-secs 2 >"$VGPU_SIM_STATE/w3.out" &
pids+=($!)

for _ in $(seq 100); do [ -s "$out1" ] && break; sleep 0.05; done
sleep 1
cat "$out1"
echo
echo "== inside the container, NVML shows the slice (nvml-probe with libvgpu.so preloaded)"
"${CONTAINER[@]}" "$T/nvml-probe" --lib "$T/sim-lib/libnvidia-ml.so.1" snapshot | grep -o '"memory":{[^}]*}' | head -1
echo
echo "== vgpu-sim summary (the node's own view)"
"$T/vgpu-sim" summary
echo
echo "== NVML outside the container, through nvml-wrapper (what the node agent will see)"
"$T/nvml-probe" --lib "$T/sim-lib/libnvidia-ml.so.1" snapshot
wait "${pids[1]}" "${pids[2]}"
cat "$out2"
echo
echo "Demo done. Run the tests with: cargo test --workspace"

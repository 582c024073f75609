#!/usr/bin/env bash
# Quick start: builds vgpu and the simulated GPU node, starts the node agent on it (streaming its
# capacity to a local vgpu-receiver), creates two slices on one GPU with vgpuctl, runs a workload in
# each (and one outside every slice), and shows `vgpuctl status`, some metrics and the receiver's
# cluster view. Needs only cargo and a C compiler.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== building (release; the first build takes about 10 minutes on 2 cores, later ones seconds)"
. scripts/release-set.sh
cargo build --release "${RELEASE_SET[@]}"
T=$PWD/target/release
mkdir -p "$T/sim-lib"
ln -sfn ../libcuda.so "$T/sim-lib/libcuda.so.1"
ln -sfn ../libnvidia_ml.so "$T/sim-lib/libnvidia-ml.so.1"

export LD_LIBRARY_PATH=$T/sim-lib
DEMO=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-demo.XXXXXX")
export VGPU_SIM_STATE=$DEMO/node VGPU_SIM_CONFIG=$DEMO/node.toml VGPU_SOCKET=$DEMO/agent.sock
mkdir -p "$VGPU_SIM_STATE"
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
    [ -n "${agent:-}" ] && kill -TERM "$agent" 2>/dev/null && wait "$agent" 2>/dev/null
    [ -n "${receiver:-}" ] && kill -TERM "$receiver" 2>/dev/null && wait "$receiver" 2>/dev/null
    wait 2>/dev/null || true
    # The logs stay for a look afterwards; the rest of the demo's files go.
    rm -rf "$DEMO/node" "$DEMO/state" "$DEMO/cdi" "$DEMO/kubelet"
    echo "The demo's logs: $DEMO/agent.log, $DEMO/receiver.log (rm -rf $DEMO removes them)"
}
trap cleanup EXIT

echo "== starting vgpu-receiver (the reference capacity receiver) on a Unix socket"
"$T/vgpu-receiver" serve --unix "$DEMO/receiver.sock" 2>"$DEMO/receiver.log" &
receiver=$!
export VGPU_AGENT_SCHEDULER_ENDPOINT=unix://$DEMO/receiver.sock NODE_NAME=demo-node

echo "== starting vgpu-node-agent on the simulated node (log: $DEMO/agent.log)"
export VGPU_AGENT_LIBRARY=$T/libvgpu.so VGPU_AGENT_CDI_DIR=$DEMO/cdi VGPU_AGENT_KUBELET_DIR=$DEMO/kubelet
"$T/vgpu-node-agent" --state-dir "$DEMO/state" --socket "$VGPU_SOCKET" --metrics-address 127.0.0.1:0 \
    --nvml-library "$T/sim-lib/libnvidia-ml.so.1" run 2>"$DEMO/agent.log" &
agent=$!
for _ in $(seq 100); do "$T/vgpuctl" status >/dev/null 2>&1 && break; sleep 0.05; done

echo "== two slices on GPU 0: train (8 GiB, 30 % SM) and notebook (4 GiB, 60 % SM)"
"$T/vgpuctl" slice create --name train --gpu 0 --memory 8GiB --sm 30 | sed -n '1,2p'
"$T/vgpuctl" slice create --name notebook --gpu 0 --memory 4GiB --sm 60 | sed -n '1,2p'
uuid=$("$T/vgpuctl" slice list | awk '/^train/ {print $2}')

# A process in a slice: what the printed docker flags give a container, with host paths.
in_slice() {
    local s=$DEMO/state/slices/$1
    printf '%s\n' env LD_PRELOAD="$T/libvgpu.so" CUDA_DEVICE_MEMORY_SHARED_CACHE="$s/region" \
        VGPU_LIMITS_FILE="$s/limits" CUDA_VISIBLE_DEVICES="$uuid"
}
mapfile -t TRAIN < <(in_slice train)
mapfile -t NOTEBOOK < <(in_slice notebook)

echo "== workloads: in train, ask for 12 GiB in 1 GiB chunks and run 5 ms kernels; in notebook, run 5 ms kernels"
"${TRAIN[@]}" "$T/cuda-rt-app" alloc --size 12g --chunk 1g --hold >"$DEMO/w1.out" &
pids+=($!)
"${TRAIN[@]}" "$T/cuda-rt-app" launch --kernel sleep_5ms --seconds 4 >"$DEMO/w2.out" &
pids+=($!)
"${NOTEBOOK[@]}" "$T/cuda-rt-app" launch --kernel sleep_5ms --seconds 4 >"$DEMO/w3.out" &
pids+=($!)
echo "== and one process outside every slice on the same GPU (an escape the agent reports)"
"$T/cuda-rt-app" alloc --size 1g --hold >/dev/null &
pids+=($!)
for _ in $(seq 100); do [ -s "$DEMO/w1.out" ] && break; sleep 0.05; done
got=$(grep -o '"allocated":[0-9]*' "$DEMO/w1.out" | cut -d: -f2)
echo "train's allocation: $(awk -v b="${got:-0}" 'BEGIN { printf "%.2f GiB", b / 1073741824 }') of the 12 GiB asked" \
    "(in 1 GiB chunks until refused: the slice's 8 GiB less its two processes' CUDA contexts hold 7)"
sleep 2.5

echo
echo "== vgpuctl status"
"$T/vgpuctl" status
echo
echo "== nvidia-smi's view (NVML through libvgpu.so) in the train slice, and outside it"
# (GPU 0 only: a container sees its own GPUs, which a process on this host cannot be made to.)
"${TRAIN[@]}" "$T/nvml-probe" smi | awk '/^GPU 1/ {exit} {print}'
echo "-- outside:"
"$T/nvml-probe" smi | awk '/^GPU 1/ {exit} {print}'
echo
echo "== some metrics (Prometheus, HAMi names and vgpu's)"
addr=$(grep -o 'serving metrics address=[0-9.:]*' "$DEMO/agent.log" | cut -d= -f2)
curl -s "http://$addr/metrics" 2>/dev/null | grep -E '^(hami_vgpu_memory_used_bytes|hami_container_device_utilization_ratio|vgpu_escapes_total|vgpu_agent_loop_seconds)[{ ]' |
    head -8 || echo "(curl not installed: metrics at http://$addr/metrics)"
echo
echo "== what the central scheduler sees (vgpuctl cluster status, from the receiver)"
"$T/vgpuctl" cluster status --server "unix://$DEMO/receiver.sock"
wait "${pids[1]}" "${pids[2]}"
echo
echo "5 ms kernels run per slice in 4 s (train 30 %, notebook 60 %; 800 would be the whole GPU):"
echo "  train:    $(grep -o '"launches":[0-9]*' "$DEMO/w2.out" | cut -d: -f2)"
echo "  notebook: $(grep -o '"launches":[0-9]*' "$DEMO/w3.out" | cut -d: -f2)"
echo
echo "Demo done. Run the tests with: scripts/test.sh"

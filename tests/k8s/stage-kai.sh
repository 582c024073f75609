# shellcheck shell=bash
# The end-to-end test's stage with the real KAI Scheduler, sourced by e2e.sh (its helpers and
# variables, as for stage-hami.sh). KAI v0.13.0, built from its released source by peers.sh, from
# its own chart: its operator (the chart's only Deployment), which deploys the scheduler, binder,
# admission webhook, pod grouper, pod-group and queue controllers, with GPU sharing on; the binder
# reserves each shared GPU with a pod of the resource-reservation image. KAI itself enforces nothing
# on a shared GPU; vgpu does: the agent (replica mode, one nvidia.com/gpu per GPU, as NVIDIA's
# device plugin serves them) gives the reservation pod its GPU, and vgpu-oci-hook, the hook of the
# `nvidia` runtime that KAI's webhook sets (cluster.sh configures it as docs/deploying.md says),
# puts each sharing pod's GPU container in a slice of the GPU KAI reserved, held to the pod's
# `gpu-fraction` or `gpu-memory`.
#
# Stand-ins: the node's `nvidia.com/gpu.memory` and `nvidia.com/gpu.count` labels, which KAI reads
# and NVIDIA's GPU feature discovery writes (not part of this cluster); the chart's hook Jobs (its
# CRD upgrader and clean-up, which need a kubectl image) are left out, its CRDs applied instead.

kai_ns=kai-scheduler

# kai_yaml: the KAI chart as its users install it (GPU sharing on), less its hook Jobs.
kai_yaml() {
    "$H" template kai "$peers/kai/deployments/kai-scheduler" -n "$kai_ns" --include-crds \
        --set global.registry=vgpu.test/kai --set global.tag=e2e --set global.gpuSharing=true \
        >"$dir/kai-all.yaml" || fail "helm template of KAI's chart"
    python3 - "$dir/kai-all.yaml" "$dir/kai-crds.yaml" "$dir/kai.yaml" <<'EOF'
import re, sys
# helm template's documents, each with its top-level kind.
docs = [d for d in re.split(r"^---\s*$", open(sys.argv[1]).read(), flags=re.M) if re.search(r"^kind:", d, re.M)]
kind = lambda d: re.search(r"^kind:\s*(\S+)", d, re.M).group(1)
crds = [d for d in docs if kind(d) == "CustomResourceDefinition"]
rest = [d for d in docs if kind(d) not in ("CustomResourceDefinition", "Job")]
open(sys.argv[2], "w").write("---".join(crds))
open(sys.argv[3], "w").write("---".join(rest))
print("  KAI's chart: %d CRDs, %d objects (%d hook Jobs left out)"
      % (len(crds), len(rest), sum(kind(d) == "Job" for d in docs)))
EOF
}

# kai_gpu POD: the UUID of the GPU KAI reserved for a sharing pod (its reservation pod's annotation,
# found by the pod's GPU group label).
kai_gpu() {
    local group
    group=$("$K" -n e2e get pod "$1" -o jsonpath='{.metadata.labels.runai-gpu-group}')
    [ -n "$group" ] || return 1
    "$K" -n kai-resource-reservation get pods -l "runai-gpu-group=$group" \
        -o jsonpath='{.items[0].metadata.annotations.run\.ai/reserve_for_gpu_index}'
}
# model_of UUID: the model of one of the node's GPUs, as the agent reports it.
model_of() {
    vgpuctl -o json status | python3 -c "
import json, sys
model = [g['model'] for g in json.load(sys.stdin)['gpus'] if g['uuid'] == '$1'][0]
print('H100' if 'H100' in model else 'A100')"
}
# half_of UUID: half of that GPU's memory in bytes, whole MiB (what the hook gives gpu-fraction 0.5).
half_of() {
    vgpuctl -o json status | python3 -c "
import json, sys
total = [g['memory_total'] for g in json.load(sys.stdin)['gpus'] if g['uuid'] == '$1'][0]
print(total // 2 >> 20 << 20)"
}
# kai_pod NAME ANNOTATIONS COMMAND: a pod for KAI (its scheduler and queue), one simulated-CUDA
# container running COMMAND, asking no device resource: its share is in ANNOTATIONS.
kai_pod() {
    cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: e2e
  labels: {kai.scheduler/queue: default-queue}
  annotations: {$2}
spec:
  schedulerName: kai-scheduler
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
$(cuda_container cuda "{}" "$3")
$(sim_volume)
EOF
}
oci_slices() { vgpuctl -o json status | python3 -c "import json,sys; print(sum(s['name'].startswith('oci-') for s in json.load(sys.stdin)['slices']))"; }
no_oci_slices() { [ "$(oci_slices)" = 0 ]; }

stage_kai_real() {
    stage "KAI, real: its operator deploys scheduler, binder, admission, pod grouper, controllers"
    # The agent as NVIDIA's device plugin serves a KAI cluster: one nvidia.com/gpu per GPU (KAI's
    # reservation pods ask for one).
    "$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --set compat=replicas \
        --set splitCount=1 --wait --timeout 120s >/dev/null || fail "helm upgrade to replica mode"
    "$K" -n "$ns" rollout status ds/vgpu-node-agent --timeout=90s >/dev/null || fail "the agent did not restart"
    two_gpus() { [ "$("$K" get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" = 2 ]; }
    wait_until 60 "nvidia.com/gpu: 2 allocatable (one per GPU)" two_gpus
    # What GPU feature discovery would say of the node's GPUs (the memory of the smaller, in MiB).
    local mib
    mib=$(vgpuctl -o json status | python3 -c "import json,sys; print(min(g['memory_total'] for g in json.load(sys.stdin)['gpus']) >> 20)")
    "$K" label node "$node" --overwrite "nvidia.com/gpu.memory=$mib" nvidia.com/gpu.count=2 >/dev/null
    # The RuntimeClass that KAI's webhook and binder set (the GPU operator makes it elsewhere).
    "$K" apply -f - >/dev/null <<EOF
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nvidia}
handler: nvidia
EOF
    local kai_libs name also=()
    for name in scheduler binder admission podgrouper podgroupcontroller queuecontroller resourcereservation; do
        also+=(--also "vgpu.test/kai/$name:e2e=/usr/local/bin/$name")
    done
    # One image of all KAI's binaries (one layer, stored once), one name and entrypoint each.
    mapfile -t kai_libs < <(image_libs "$peers"/bin/kai/* target/release/sim-lib/libnvidia-ml.so.1 "$lib")
    local files=()
    for name in "$peers"/bin/kai/*; do files+=("$name=/usr/local/bin/${name##*/}"); done
    tests/k8s/oci-image.py --ref vgpu.test/kai/operator:e2e --out "$dir/images/kai.tar" \
        --entrypoint /usr/local/bin/operator "${also[@]}" "${kai_libs[@]}" "${files[@]}"
    tests/k8s/cluster.sh import "$dir" "$dir/images/kai.tar"
    kai_yaml
    "$K" create namespace "$kai_ns" >/dev/null
    "$K" apply --server-side -f "$dir/kai-crds.yaml" >"$dir/logs/kai-apply.log" 2>&1 ||
        { tail -20 "$dir/logs/kai-apply.log"; fail "kubectl apply of KAI's CRDs"; }
    "$K" wait --for=condition=Established -f "$dir/kai-crds.yaml" --timeout=60s >/dev/null
    "$K" apply --server-side -f "$dir/kai.yaml" >>"$dir/logs/kai-apply.log" 2>&1 ||
        { tail -20 "$dir/logs/kai-apply.log"; fail "kubectl apply of KAI's chart"; }
    "$K" -n "$kai_ns" rollout status deployment/kai-operator --timeout=180s >/dev/null ||
        { "$K" -n "$kai_ns" describe deployment/kai-operator >&2; fail "KAI's operator did not start"; }
    local d
    kai_deployed() { [ "$("$K" -n "$kai_ns" get deployments -o name | wc -l)" -ge 7 ]; }
    wait_until 120 "the operator's six Deployments" kai_deployed
    for d in $("$K" -n "$kai_ns" get deployments -o name); do
        "$K" -n "$kai_ns" rollout status "$d" --timeout=180s >/dev/null ||
            { "$K" -n "$kai_ns" describe "$d" >&2; fail "KAI's $d did not start"; }
    done
    echo "  $("$K" -n "$kai_ns" get deployments -o name | tr '\n' ' ')available"
    # The admission webhook serves once its configuration names it; a pod made before may miss it.
    kai_webhook() { "$K" get mutatingwebhookconfigurations -o name | grep -q .; }
    wait_until 60 "KAI's mutating webhook configured" kai_webhook

    stage "KAI, real: two pods of gpu-fraction 0.5 share a GPU, each held to half its memory"
    # The first tries to take the whole GPU and is refused at its half; the second, started after,
    # still gets all of its half.
    kai_pod kai-half-a '"gpu-fraction": "0.5"' "gpu-probe info; gpu-probe spin --seconds 3; gpu-probe fill --chunk 104857600"
    wait_until 120 "KAI's GPU for kai-half-a" kai_gpu kai-half-a
    local gpu_a
    gpu_a=$(kai_gpu kai-half-a)
    held kai-half-a "$(half_of "$gpu_a")" 100 "$(model_of "$gpu_a")"
    kai_pod kai-half-b '"gpu-fraction": "0.5"' "gpu-probe info; gpu-probe spin --seconds 3; gpu-probe fill --chunk 104857600"
    wait_until 120 "KAI's GPU for kai-half-b" kai_gpu kai-half-b
    [ "$(kai_gpu kai-half-b)" = "$gpu_a" ] || fail "KAI put the halves on two GPUs ($gpu_a, $(kai_gpu kai-half-b))"
    held kai-half-b "$(half_of "$gpu_a")" 100 "$(model_of "$gpu_a")"
    python3 - "$(logs_of kai-half-a)" "$(logs_of kai-half-b)" <<'EOF' || fail "kai-half-b did not get all of its half"
import json, sys
a, b = ([json.loads(l) for l in logs.splitlines() if l.startswith("{")][2] for logs in sys.argv[1:])
assert b["allocated"] == a["allocated"], (a, b)
EOF
    for pod in kai-half-a kai-half-b; do
        [ "$("$K" -n e2e get pod "$pod" -o jsonpath='{.status.phase}')" = Running ] || fail "$pod is not running"
    done
    echo "  KAI wrote: runtimeClassName $("$K" -n e2e get pod kai-half-a -o jsonpath='{.spec.runtimeClassName}'), GPU group $("$K" -n e2e get pod kai-half-a -o jsonpath='{.metadata.labels.runai-gpu-group}'), reserved GPU $gpu_a ($(model_of "$gpu_a"))"
    echo "  both on $gpu_a and running; the second got as much as the first after the first was refused"
    local rpod
    rpod=$("$K" -n kai-resource-reservation get pods -o jsonpath='{.items[0].metadata.name}')
    local rlog
    rlog=$("$K" -n kai-resource-reservation logs "$rpod")
    # (grep reads all of it: with pipefail, a grep -q that stops early fails the writer's SIGPIPE.)
    grep 'Found 1 GPU devices' <<<"$rlog" >/dev/null ||
        fail "the reservation pod's NVML did not show exactly one GPU: $(tail -3 <<<"$rlog")"
    echo "  the reservation pod's NVML shows one GPU (its log: Found 1 GPU devices)"
    [ "$(oci_slices)" = 2 ] || fail "$(oci_slices) oci- slices for two sharing pods"
    # The hook labels each slice with the pod (containerd's CRI annotations): status names them.
    local st
    st=$(vgpuctl status)
    grep 'e2e/kai-half-b' <<<"$st" >/dev/null || fail "vgpuctl status does not name kai-half-b: $st"
    "$K" -n e2e delete pod kai-half-a kai-half-b --wait=true --timeout=60s >/dev/null
    wait_until 60 "the sharing pods' slices removed with the pods" no_oci_slices
    echo "  the pods deleted: their slices removed"

    stage "KAI, real: gpu-memory 2000 is 2000 MiB; a two-GPU fraction is held on both GPUs"
    kai_pod kai-mem '"gpu-memory": "2000"' "gpu-probe info; gpu-probe spin --seconds 3; gpu-probe fill --chunk 104857600"
    wait_until 120 "KAI's GPU for kai-mem" kai_gpu kai-mem
    held kai-mem $((2000 << 20)) 100 "$(model_of "$(kai_gpu kai-mem)")"
    kai_pod kai-two '"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"' \
        "gpu-probe info; CUDA_VISIBLE_DEVICES=1 gpu-probe info; CUDA_VISIBLE_DEVICES=1 gpu-probe fill --chunk 104857600 & sleep 2; gpu-probe fill --chunk 104857600"
    both() { [ "$(logs_of kai-two | grep -c '"result"')" = 2 ]; }
    wait_until 180 "kai-two's clients on both GPUs ran" both
    logs_of kai-two | sed 's/^/  pod: /'
    python3 - "$(logs_of kai-two)" "$(vgpuctl -o json status)" <<'EOF' || fail "kai-two was not held to half of each of two GPUs"
import json, sys
lines = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
half = {g["model"]: g["memory_total"] // 2 >> 20 << 20 for g in json.loads(sys.argv[2])["gpus"]}
infos = [l for l in lines if "mem_total" in l]
fills = [l for l in lines if "result" in l]
assert sorted("H100" in i["name"] for i in infos) == [False, True], ("one GPU of each model", infos)
assert all(i["mem_total"] == half[i["name"]] for i in infos), (infos, half)
assert all(f["result"] == "CUDA_ERROR_OUT_OF_MEMORY" and 0 < f["allocated"] <= max(half.values()) for f in fills), fills
print("  held: half of each of its two GPUs (%s)" % ", ".join("%s %d MiB" % (i["name"], i["mem_total"] >> 20) for i in infos))
EOF
    "$K" -n e2e delete pod kai-mem kai-two --wait=true --timeout=60s >/dev/null
    wait_until 60 "the sharing pods' slices removed with the pods" no_oci_slices
    echo "  the pods deleted: their slices removed"
    kai_down
}

# kai_down: KAI's objects gone (the operator's with its Config, whose webhooks would otherwise
# outlive their server), the node's stand-in labels removed.
kai_down() {
    "$K" -n "$kai_ns" delete configs.kai.scheduler --all --wait=true --timeout=60s >/dev/null 2>&1 || true
    "$K" delete -f "$dir/kai.yaml" --wait=false >/dev/null 2>&1 || true
    local w
    for w in $("$K" get mutatingwebhookconfigurations,validatingwebhookconfigurations -o name | grep -i kai); do
        "$K" delete "$w" >/dev/null 2>&1 || true
    done
    "$K" label node "$node" nvidia.com/gpu.memory- nvidia.com/gpu.count- >/dev/null
}

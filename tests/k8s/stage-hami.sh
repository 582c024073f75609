# shellcheck shell=bash
# The end-to-end test's stage with the real HAMi scheduler, sourced by e2e.sh (its helpers and
# variables: K, H, ns, dir, node, uuid, bin, peers, libs, cuda_container, sim_volume, held, vgpuctl,
# wait_until, fail).
# HAMi v2.10.0's scheduler (extender and mutating webhook in one binary, built from its released
# source by peers.sh) runs in-cluster as HAMi's own chart (charts/hami) deploys it, its device
# plugin left out: vgpu's agent, in HAMi mode, is the node side. Pods ask HAMi's resources and
# nothing else; HAMi's webhook sends them to its scheduler, its extender filters, picks the GPUs and
# binds; the agent allocates what HAMi wrote and the client is held to it on that GPU.
#
# Three things of the test's cluster stand in for what a real one has: no kube-proxy (cluster.sh
# serves the `kubernetes` Service alone, and the API server reaches the webhook's Service through
# its endpoints: --enable-aggregator-routing), no registry (the images are built
# from the binaries and imported), and no cert-manager or the chart's certificate job (whose image
# cannot be pulled: its work, a serving certificate and the webhook's caBundle, is done here with
# openssl and kubectl).

# Where HAMi's documentation installs it (its scheduler's pod is of the system-node-critical class).
hami_ns=kube-system

# hami_gpu_model POD: the model of the GPU HAMi gave the pod's first container, from its annotation
# and the node's register annotation.
hami_gpu_model() {
    local devices
    devices=$(annotation pod "$1" e2e hami.io/vgpu-devices-allocated)
    python3 - "$devices" "$(annotation node "$node" "" hami.io/node-nvidia-register)" <<'EOF'
import json, sys
uuid = sys.argv[1].split(",")[0]
types = {d["id"]: d["type"] for d in json.loads(sys.argv[2])}
print("H100" if "H100" in types[uuid] else "A100")
EOF
}

# hami_pod NAME CONTAINERS: a pod of the given containers' YAML, as a user writes it (no scheduler
# name, no annotation).
hami_user_pod() {
    cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: e2e}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
$2
$(sim_volume)
EOF
}

stage_hami_real() {
    stage "HAMi, real: HAMi $hami_version's scheduler and webhook from its chart, in-cluster"
    # Its images: HAMi's binary, and the kube-scheduler its pod runs beside it (this cluster's).
    local sched_libs
    mapfile -t sched_libs < <(image_libs "$peers/bin/hami-scheduler" "$bin/kube-scheduler")
    tests/k8s/oci-image.py --ref vgpu.test/hami:e2e --out "$dir/images/hami.tar" --env PATH=/usr/local/bin:/bin \
        "${sched_libs[@]}" "$peers/bin/hami-scheduler=/usr/local/bin/scheduler"
    tests/k8s/oci-image.py --ref vgpu.test/kube-scheduler:e2e --out "$dir/images/kube-scheduler.tar" \
        --env PATH=/usr/local/bin:/bin "${sched_libs[@]}" "$bin/kube-scheduler=/usr/local/bin/kube-scheduler"
    tests/k8s/cluster.sh import "$dir" "$dir/images/hami.tar" "$dir/images/kube-scheduler.tar"
    # The webhook's serving certificate (the chart's certificate job's work).
    local pki=$dir/pki-hami
    serving_cert "$pki" hami-scheduler "DNS:hami-scheduler.$hami_ns.svc,IP:127.0.0.1"
    "$K" -n "$hami_ns" create secret tls hami-scheduler-tls --cert "$pki/tls.crt" --key "$pki/tls.key" >/dev/null
    # HAMi's chart, as its users install it, less its device plugin (the agent is the node side).
    "$H" template hami "$peers/hami/charts/hami" -n "$hami_ns" --kube-version "$("$K" version -o json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])')" \
        --set devicePlugin.enabled=false --set scheduler.patch.enabled=false \
        --set scheduler.kubeScheduler.image.registry=vgpu.test --set scheduler.kubeScheduler.image.repository=kube-scheduler \
        --set scheduler.kubeScheduler.image.tag=e2e --set scheduler.kubeScheduler.image.pullPolicy=Never \
        --set scheduler.extender.image.registry=vgpu.test --set scheduler.extender.image.repository=hami \
        --set scheduler.extender.image.tag=e2e --set scheduler.extender.image.pullPolicy=Never \
        >"$dir/hami.yaml" || fail "helm template of HAMi's chart"
    echo "  HAMi's chart: $(grep -c '^kind:' "$dir/hami.yaml") objects ($(grep '^kind:' "$dir/hami.yaml" | sort | uniq -c | awk '{printf "%s %s, ", $1, $3}' | sed 's/, $//'))"
    "$K" apply -f "$dir/hami.yaml" >"$dir/logs/hami-apply.log" 2>&1 || { cat "$dir/logs/hami-apply.log"; fail "kubectl apply of HAMi's chart"; }
    local ca webhook
    ca=$(base64 -w0 <"$pki/ca.crt")
    webhook=$("$K" get mutatingwebhookconfigurations -o name | grep hami) || fail "HAMi's chart made no webhook"
    "$K" patch "$webhook" --type=json \
        -p "[{\"op\": \"add\", \"path\": \"/webhooks/0/clientConfig/caBundle\", \"value\": \"$ca\"}]" >/dev/null
    in_cluster "$hami_ns" deployment/hami-scheduler
    # The webhook answers once the Service has the pod's endpoint: a pod that asks nvidia.com/gpu,
    # made in a server-side dry run, comes back with HAMi's scheduler's name.
    hami_webhook_up() {
        "$K" -n e2e create --dry-run=server -o jsonpath='{.spec.schedulerName}' -f - <<EOF | grep -qx hami-scheduler
apiVersion: v1
kind: Pod
metadata: {name: hami-probe}
spec:
  containers: [{name: c, image: vgpu.test/gpu-probe:e2e, resources: {limits: {nvidia.com/gpu: 1}}}]
EOF
    }
    wait_until 60 "HAMi's webhook answering (a dry-run pod sent to hami-scheduler)" hami_webhook_up
    echo "  $webhook, deployment/hami-scheduler available ($("$K" -n "$hami_ns" get pods -l app.kubernetes.io/component=hami-scheduler -o jsonpath='{.items[0].spec.containers[*].name}'))"

    stage "HAMi, real: one GPU, gpumem 1024, gpucores 30: placed by HAMi, held by the agent"
    hami_user_pod hami-one "$(cuda_container cuda "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1024, nvidia.com/gpucores: 30}")"
    [ "$("$K" -n e2e get pod hami-one -o jsonpath='{.spec.schedulerName}')" = hami-scheduler ] ||
        fail "HAMi's webhook did not send the pod to its scheduler: $("$K" -n e2e get pod hami-one -o jsonpath='{.spec.schedulerName}')"
    hami_bound() { [ -n "$(annotation pod "$1" e2e hami.io/vgpu-devices-allocated)" ]; }
    wait_until 120 "HAMi's annotations on hami-one" hami_bound hami-one
    echo "  HAMi wrote: hami.io/vgpu-devices-allocated=$(annotation pod hami-one e2e hami.io/vgpu-devices-allocated)"
    held hami-one $((1024 << 20)) 30 "$(hami_gpu_model hami-one)"
    [ "$(annotation pod hami-one e2e hami.io/bind-phase)" = success ] || fail "bind phase: $(annotation pod hami-one e2e hami.io/bind-phase)"

    stage "HAMi, real: two GPUs, and two containers, each held on what HAMi gave it"
    hami_user_pod hami-two "$(cuda_container cuda "limits: {nvidia.com/gpu: 2, nvidia.com/gpumem: 1024, nvidia.com/gpucores: 30}" \
        "gpu-probe info; CUDA_VISIBLE_DEVICES=1 gpu-probe info; CUDA_VISIBLE_DEVICES=1 gpu-probe fill --chunk 104857600 & sleep 2; gpu-probe fill --chunk 104857600")"
    wait_until 120 "HAMi's annotations on hami-two" hami_bound hami-two
    both() { [ "$(logs_of hami-two | grep -c '"result"')" = 2 ]; }
    wait_until 120 "hami-two's clients on both GPUs ran" both
    logs_of hami-two | sed 's/^/  pod: /'
    python3 - "$(logs_of hami-two)" <<'EOF' || fail "hami-two was not held to 1024 MiB on each of two GPUs"
import json, sys
lines = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")]
infos = [l for l in lines if "mem_total" in l]
fills = [l for l in lines if "result" in l]
assert sorted("H100" in i["name"] for i in infos) == [False, True], ("one GPU of each model", infos)
assert all(i["mem_total"] == 1024 << 20 for i in infos), infos
assert all(f["result"] == "CUDA_ERROR_OUT_OF_MEMORY" and 0 < f["allocated"] <= 1024 << 20 for f in fills), fills
print("  held: 1024 MiB on each of its two GPUs (%s)" % ", ".join(i["name"] for i in infos))
EOF
    "$K" -n e2e delete pod hami-one hami-two --wait=true --timeout=60s >/dev/null
    hami_user_pod hami-pair "$(cuda_container first "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1024, nvidia.com/gpucores: 30}")
$(cuda_container second "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 2048, nvidia.com/gpucores: 20}")"
    wait_until 120 "HAMi's annotations on hami-pair" hami_bound hami-pair
    echo "  HAMi wrote: $(annotation pod hami-pair e2e hami.io/vgpu-devices-allocated)"
    held hami-pair/first $((1024 << 20)) 30
    held hami-pair/second $((2048 << 20)) 20
    "$K" -n e2e delete pod hami-pair --wait=true --timeout=60s >/dev/null

    stage "HAMi, real: what fits nowhere stays Pending with HAMi's reason; nvidia.com/priority 0 is high"
    hami_user_pod hami-huge "$(cuda_container cuda "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 200000}")"
    hami_refused() { "$K" -n e2e get events --field-selector involvedObject.name=hami-huge -o jsonpath='{.items[*].reason}' | grep -q FilteringFailed; }
    wait_until 60 "HAMi's FilteringFailed event on hami-huge" hami_refused
    [ "$("$K" -n e2e get pod hami-huge -o jsonpath='{.status.phase}')" = Pending ] || fail "hami-huge is not Pending"
    echo "  Pending: $("$K" -n e2e get events --field-selector involvedObject.name=hami-huge,reason=FilteringFailed -o jsonpath='{.items[0].message}' | cut -c1-200)"
    "$K" -n e2e delete pod hami-huge --wait=true --timeout=60s >/dev/null
    hami_user_pod hami-urgent "$(cuda_container cuda "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1024, nvidia.com/gpucores: 30, nvidia.com/priority: 0}")"
    wait_until 120 "HAMi's annotations on hami-urgent" hami_bound hami-urgent
    held hami-urgent $((1024 << 20)) 30 "$(hami_gpu_model hami-urgent)"
    vgpuctl slice list -o json >"$dir/logs/hami-slices.json"
    python3 - "$dir/logs/hami-slices.json" <<'EOF' || fail "hami-urgent's slice is not of high priority"
import json, sys
slices = json.load(open(sys.argv[1]))
slices = slices.get("slices", slices) if isinstance(slices, dict) else slices
mine = [s for s in slices if "hami-urgent" in json.dumps(s)]
assert mine and all(str(s.get("priority", "")).lower() in ("high", "1", "priority_high") for s in mine), mine
print("  hami-urgent's slice: priority high")
EOF
    "$K" -n e2e delete pod hami-urgent --wait=true --timeout=60s >/dev/null
}

# stage_hami_mps: GPU 1 runs MPS (the chart's mps values; the simulated driver's MPS programs, in
# the agent's image, stand in for the driver's). HAMi's scheduler places a pod that asks for
# `nvidia.com/vgpu-mode: mps` on that GPU, the agent gives it the GPU's daemon, and the client runs
# as an MPS client held to its slice. The agent is put back as it was at the end.
stage_hami_mps() {
    stage "HAMi, real: GPU 1 runs MPS; a pod asking nvidia.com/vgpu-mode mps placed there, served by its daemon"
    "$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --set "mps.gpus[0]=$uuid" \
        --set mps.control=/usr/local/bin/nvidia-cuda-mps-control --wait --timeout 120s >/dev/null ||
        fail "helm upgrade with GPU 1 in MPS mode"
    "$K" -n "$ns" rollout status ds/vgpu-node-agent --timeout=90s >/dev/null || fail "the agent did not restart"
    mps_registered() {
        annotation node "$node" "" hami.io/node-nvidia-register | python3 -c "import json, sys
modes = {d['id']: d.get('mode') for d in json.load(sys.stdin)}
sys.exit(0 if modes.get('$uuid') == 'mps' and list(modes.values()).count('mps') == 1 else 1)"
    }
    wait_until 90 "the register annotation saying mode mps for GPU 1 alone" mps_registered
    mps_up() {
        vgpuctl status -o json | python3 -c "import json, sys
sys.exit(0 if any((g.get('mps') or {}).get('running') for g in json.load(sys.stdin)['gpus']) else 1)"
    }
    wait_until 60 "GPU 1's MPS daemon running (vgpuctl status)" mps_up
    vgpuctl status | grep 'MPS' | sed 's/^/  vgpuctl: /'
    local log=$dir/node/vgpu-state/mps/$uuid/log/control.log
    # HAMi's scheduler reads the register annotations every 15 s (a ticker; a Node's update does not
    # wake it): a pod made sooner meets the GPUs' old modes (CardTypeMismatch), and the scheduler
    # tries an unschedulable pod again only after minutes. One period, then the pod (made again if
    # HAMi still had the old modes).
    sleep 16
    local try
    for try in 1 2 3; do
        cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata: {name: hami-mps, namespace: e2e, annotations: {nvidia.com/vgpu-mode: mps}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
$(cuda_container cuda "limits: {nvidia.com/gpu: 1, nvidia.com/gpumem: 1024, nvidia.com/gpucores: 30}" \
            'echo mps-env $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; gpu-probe info; gpu-probe fill --chunk 104857600')
$(sim_volume)
EOF
        for _ in $(seq 20); do hami_bound hami-mps && break 2; sleep 1; done
        echo "  not placed within 20 s ($("$K" -n e2e get pod hami-mps -o jsonpath='{.status.conditions[0].message}' | cut -c1-120)); made again"
        "$K" -n e2e delete pod hami-mps --wait=true --timeout=60s >/dev/null
    done
    hami_bound hami-mps || fail "HAMi did not place hami-mps on the MPS GPU in $try tries"
    echo "  HAMi wrote: $(annotation pod hami-mps e2e hami.io/vgpu-devices-allocated)"
    wait_until 120 "hami-mps's client ran" ran hami-mps
    logs_of hami-mps | sed 's/^/  pod: /'
    python3 - "$(logs_of hami-mps)" "$(annotation pod hami-mps e2e hami.io/vgpu-devices-allocated)" "$uuid" <<'EOF' ||
import json, sys
logs, allocated, uuid = sys.argv[1], sys.argv[2], sys.argv[3]
assert allocated.split(",")[0] == uuid, ("HAMi placed it on the MPS GPU", allocated, uuid)
env = [l.split()[1:] for l in logs.splitlines() if l.startswith("mps-env")]
assert env == [["/usr/local/vgpu/mps", "30", "0=1024M"]], ("the slice's pipe, share and memory as MPS's", env)
lines = [json.loads(l) for l in logs.splitlines() if l.startswith("{")]
info = [l for l in lines if "mem_total" in l][0]
fill = [l for l in lines if "result" in l][0]
assert "H100" in info["name"] and info["mem_total"] == 1024 << 20, info
assert fill["result"] == "CUDA_ERROR_OUT_OF_MEMORY" and 0 < fill["allocated"] <= 1024 << 20, fill
print("  on the MPS GPU (%s): CUDA_MPS_* the slice's; held to 1024 MiB" % info["name"])
EOF
        fail "hami-mps was not served as an MPS client of its slice on GPU 1"
    # The client reached the daemon the agent runs, which started a server for it.
    grep -q "New client .* connected" "$log" && grep -q "Starting new server" "$log" ||
        fail "the daemon did not serve the pod's client: $(cat "$log" 2>&1)"
    echo "  the daemon's log: $(grep -c 'New client' "$log") client(s), $(grep -c 'Starting new server' "$log") server(s) started"
    "$K" -n e2e delete pod hami-mps --wait=true --timeout=60s >/dev/null
    # The agent as it was: no MPS.
    "$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --wait --timeout 120s >/dev/null ||
        fail "helm upgrade back without MPS"
    "$K" -n "$ns" rollout status ds/vgpu-node-agent --timeout=90s >/dev/null || fail "the agent did not restart"
    agent_pod=$("$K" -n "$ns" get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
    no_mps() { ! annotation node "$node" "" hami.io/node-nvidia-register | grep -q '"mps"'; }
    wait_until 90 "the register annotation without mode mps" no_mps
}

# HAMi's scheduler removed (after the stages that use it: Kueue's places through it).
hami_real_down() {
    "$K" delete -f "$dir/hami.yaml" --wait=true --timeout=60s >/dev/null 2>&1 || true
    "$K" -n "$hami_ns" delete secret hami-scheduler-tls >/dev/null
}

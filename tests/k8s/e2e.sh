#!/usr/bin/env bash
# The Kubernetes end-to-end test: a real control plane and a real node (tests/k8s/cluster.sh), the
# chart checked by Helm and by the API server and installed by Helm, the agent as the chart's
# DaemonSet on the real kubelet, containerd and runc, serving the simulated GPU:
#   1. the chart: helm lint, and each value set's rendering accepted by the API server (server-side
#      dry run); wrong values refused by values.schema.json, naming the value;
#   2. HAMi mode: the register annotation on the real Node; a pod bound by kube-scheduler with the
#      annotations HAMi's scheduler writes is allocated by the kubelet through the device plugin; its
#      simulated-CUDA client is held to the slice's memory and SM share on GPU 1 (the node's two GPUs
#      are of two models); the lock is released, the bind phase set; `vgpuctl status` names the pod;
#      an Allocate that fails leaves no slice; an agent may change only its own Node; the agent
#      follows a kubelet restart and a replaced socket; the real HAMi scheduler (stage-hami.sh, from
#      peers.sh) places pods the agent holds, one asking for MPS on the GPU the agent runs MPS on;
#      without one of its RBAC rules the agent says so, writes nothing;
#   3. Volcano mode: without the scheduler's memory unit for a node this large the agent does not
#      start and raises an Event on the Node saying what to set; with the scheduler's configuration
#      its volcano.sh/vgpu-memory is in that unit, and a pod with the annotations Volcano's scheduler
#      writes (memory in that unit) is held to it; a deleted pod's slice is removed; the real
#      Volcano (stage-volcano.sh) places a gang the agent holds; then the real KAI (stage-kai.sh):
#      the agent in replica mode gives KAI's reservation pods their GPU, and vgpu-oci-hook in the
#      node's `nvidia` runtime holds KAI's sharing pods to their gpu-fraction or gpu-memory;
#   4. DRA: `helm upgrade` to DRA restarts the agent (checksum/config); its ResourceSlices pass the
#      API server's validation; a pod with a ResourceClaim (a CEL selector on memory) is allocated by
#      kube-scheduler, prepared by the agent through the kubelet, held to the claim's memory and SM
#      share; another node's ResourceSlice is refused; deleting the pod frees the slice;
#   5. names: a second release installs beside the first (the API server's dry run); an upgrade from
#      the chart whose DaemonSet selector named no release keeps that selector (Kubernetes cannot
#      change it) and the agent runs under it.
#   tests/k8s/e2e.sh [DIR]        # DIR: scratch folder (default target/k8s-e2e); logs kept there
# VGPU_K8S_KEEP=1 leaves the cluster up when it ends (to look at it).
# Needs root, Go (tests/k8s/tools.sh), cargo, a C compiler, openssl, python3, runc, a static
# busybox (the client image's shell), ip, curl, unshare and nsenter: each is checked before
# anything starts, with how to get it. Stops all it started on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."
missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 ($2)"); }
need go "https://go.dev/dl/, 1.26 or later"
need cargo "rustup"
need cc "apt-get install gcc"
need openssl "apt-get install openssl"
need python3 "apt-get install python3"
need runc "apt-get install runc"
need ip "apt-get install iproute2"
need curl "apt-get install curl"
need unshare "apt-get install util-linux"
need nsenter "apt-get install util-linux"
busybox=$(command -v busybox 2>/dev/null || true)
[ -x /bin/busybox ] && busybox=/bin/busybox
if [ -z "$busybox" ] || ldd "$busybox" >/dev/null 2>&1; then
    missing+=("a static busybox (apt-get install busybox-static)")
fi
[ "$(id -u)" = 0 ] || missing+=("root (the node's containerd and kubelet run as root)")
if [ ${#missing[@]} -gt 0 ]; then
    printf 'e2e.sh: missing: %s\n' "${missing[@]}" >&2
    exit 2
fi
repo=$PWD
dir=${1:-target/k8s-e2e}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
node=${VGPU_K8S_NODE:-vgpu-e2e-node}
ns=vgpu-system
export VGPU_K8S_NODE=$node VGPU_K8S_CDI_DIR="$dir/node/cdi"
t0=$SECONDS
stage() { echo "=== $* (at $((SECONDS - t0)) s)"; }
fail() {
    echo "FAILED: $*" >&2
    exit 1
}

tests/k8s/cluster.sh down "$dir" 2>/dev/null || true
rm -rf "${dir:?}"/{node,logs,pids,pki,etcd-data,images,sim}
finish() {
    rc=$?
    if [ "$rc" != 0 ]; then
        echo "--- the end of each log in $dir/logs (the test failed):" >&2
        for f in "$dir"/logs/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -15 "$f" >&2; }; done
        if [ -n "${K:-}" ]; then
            "$K" get pods -A -o wide >&2 2>/dev/null || true
            echo "--- the agent's log" >&2
            "$K" -n "$ns" logs -l app.kubernetes.io/name=vgpu-node-agent --tail 30 >&2 2>/dev/null || true
            # The peers' schedulers, where a stage of theirs was running.
            for d in kube-system/hami-scheduler volcano-system/volcano-scheduler volcano-system/volcano-controllers \
                kai-scheduler/kai-operator kai-scheduler/binder kai-scheduler/kai-scheduler-default kai-scheduler/kai-admission; do
                "$K" -n "${d%/*}" get "deployment/${d#*/}" >/dev/null 2>&1 || continue
                echo "--- $d's log" >&2
                "$K" -n "${d%/*}" logs "deployment/${d#*/}" --all-containers --tail 40 >&2 2>/dev/null || true
            done
        fi
    fi
    if [ -n "${VGPU_K8S_KEEP:-}" ]; then
        echo "VGPU_K8S_KEEP: the cluster stays up (KUBECONFIG=$dir/kubeconfig; tests/k8s/cluster.sh down $dir)" >&2
        exit "$rc"
    fi
    tests/k8s/cluster.sh down "$dir" || true
    exit "$rc"
}
trap finish EXIT

# image_libs BIN...: the glibc the binaries link, as they find it here (a base image of sorts), as
# oci-image.py's SRC=DEST:MODE arguments, one a line.
image_libs() {
    ldd "$@" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/lib/ {print $1}' | sort -u |
        sed 's/.*/&=&:755/'
}
# serving_cert DIR CN SAN: a webhook's serving certificate (DIR/tls.crt, tls.key) for SAN (e.g.
# DNS:svc.ns.svc), signed by a CA of its own (DIR/ca.crt): what peers' certificate jobs make.
serving_cert() {
    mkdir -p "$1"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1/ca.key" -out "$1/ca.crt" -subj "/CN=$2-e2e-ca" \
        -days 2 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout "$1/tls.key" -out "$1/tls.csr" -subj "/CN=$2" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$3" >"$1/ext"
    openssl x509 -req -in "$1/tls.csr" -CA "$1/ca.crt" -CAkey "$1/ca.key" -CAcreateserial -days 2 \
        -extfile "$1/ext" -out "$1/tls.crt" 2>/dev/null
}
# in_cluster NS [DEPLOYMENT]: a peer's Deployments (or one) waited for (they reach the API server at
# the `kubernetes` Service, as in any cluster: cluster.sh serves its address).
in_cluster() {
    local d
    for d in ${2:-$("$K" -n "$1" get deployments -o name)}; do
        "$K" -n "$1" rollout status "$d" --timeout=180s >/dev/null || { "$K" -n "$1" describe "$d" >&2; fail "$d did not start"; }
    done
}

stage "tools (built once: tests/k8s/tools.sh) and the peer schedulers (tests/k8s/peers.sh)"
bin=$(tests/k8s/tools.sh)
K="$bin/kubectl"
H="$bin/helm"
# The real peers' stages need their source (../shared/peers); without it they are skipped, said
# here and at the end, unless VGPU_REQUIRE_PEERS=1 (CI) makes that a failure.
peers_rc=0
peers=$(tests/k8s/peers.sh) || peers_rc=$?
if [ "$peers_rc" = 3 ]; then
    peers=""
    [ -z "${VGPU_REQUIRE_PEERS:-}" ] || fail "VGPU_REQUIRE_PEERS is set, but the peers' source is missing (see above)"
    echo "  SKIPPED: the real-scheduler stages (no peer source; see above)"
elif [ "$peers_rc" != 0 ]; then
    fail "tests/k8s/peers.sh failed"
else
    hami_version=$(cat "$peers/hami/VERSION")
    echo "  peers in $peers: HAMi $hami_version, Volcano v1.15.1, KAI Scheduler v0.13.0"
fi
. tests/k8s/stage-hami.sh
. tests/k8s/stage-volcano.sh
. tests/k8s/stage-kueue.sh
. tests/k8s/stage-kai.sh
export KUBECONFIG="$dir/kubeconfig"

stage "vgpu release binaries and libvgpu.so"
. scripts/release-set.sh
cargo build --release -q "${RELEASE_SET[@]}"
scripts/build-libvgpu.sh >/dev/null
lib="target/$(uname -m)-unknown-linux-gnu/release/libvgpu.so"
# The simulated driver's libraries under the names a driver's have (as scripts/demo.sh makes them).
mkdir -p target/release/sim-lib
ln -sfn ../libcuda.so target/release/sim-lib/libcuda.so.1
ln -sfn ../libnvidia_ml.so target/release/sim-lib/libnvidia-ml.so.1

# The node's `nvidia` runtime (KAI's RuntimeClass) runs vgpu-oci-hook as its hooks (cluster.sh).
export VGPU_K8S_OCI_HOOK="$repo/target/release/vgpu-oci-hook --socket $dir/node/vgpu-run/agent.sock"

stage "control plane"
tests/k8s/cluster.sh up "$dir"
stage "node: containerd, runc, kubelet"
tests/k8s/cluster.sh node "$dir"

stage "images: the agent and a simulated-CUDA client, imported into containerd"
mkdir -p "$dir/images" "$dir/sim/lib"
mapfile -t libs < <(image_libs target/release/vgpu-node-agent target/release/gpu-probe "$lib" target/release/sim-lib/libcuda.so.1)
tests/k8s/oci-image.py --ref vgpu.test/vgpu-node-agent:e2e --out "$dir/images/agent.tar" \
    --entrypoint /usr/local/bin/vgpu-node-agent "${libs[@]}" \
    target/release/vgpu-node-agent=/usr/local/bin/vgpu-node-agent \
    target/release/vgpuctl=/usr/local/bin/vgpuctl target/release/vgpu-oci-hook=/usr/local/bin/vgpu-oci-hook \
    target/release/nvidia-cuda-mps-control=/usr/local/bin/nvidia-cuda-mps-control \
    target/release/nvidia-cuda-mps-server=/usr/local/bin/nvidia-cuda-mps-server \
    "$lib=/usr/local/lib/vgpu/libvgpu.so:644"
tests/k8s/oci-image.py --ref vgpu.test/gpu-probe:e2e --out "$dir/images/probe.tar" \
    --entrypoint /usr/local/bin/gpu-probe "${libs[@]}" target/release/gpu-probe=/usr/local/bin/gpu-probe \
    "$busybox=/bin/sh"
tests/k8s/cluster.sh import "$dir" "$dir/images/agent.tar" "$dir/images/probe.tar"
# The simulated GPU's driver libraries and state, on the node as a driver's would be.
cp -L target/release/sim-lib/libcuda.so.1 target/release/sim-lib/libnvidia-ml.so.1 "$dir/sim/lib/"
# Two GPUs of two models: a pod placed on GPU 1 must be held there, and see that GPU alone (the
# simulated driver exposes what NVIDIA_VISIBLE_DEVICES names, as the NVIDIA runtime does).
printf '[[gpu]]\nmodel = "A100-40GB"\n\n[[gpu]]\nmodel = "H100-80GB"\nmemory_mib = 40960\n' >"$dir/sim/node.toml"

stage "the chart: helm lint, the API server's server-side dry run of each value set, the schema"
"$K" create namespace "$ns" >/dev/null
"$H" lint packaging/helm/vgpu --strict --set image.repository=vgpu.test/vgpu-node-agent >"$dir/logs/helm-lint.log" || { cat "$dir/logs/helm-lint.log"; fail "helm lint"; }
cat >"$dir/values-tls.yaml" <<EOF
metrics: {tlsSecret: vgpu-metrics-tls, tokenSecret: vgpu-metrics-token, insecure: false}
EOF
cat >"$dir/values-mig.yaml" <<EOF
compat: hami
migGeometriesFile: /etc/vgpu-mig-geometries/device-config.yaml
extraConfig: |
  mig_strategy = "single"
EOF
for set in "" "--set compat=hami" "--set compat=volcano --set memoryFactor=512" \
    "--set dra=on --set devicePlugin=off --set deviceClasses=true" \
    "--set dra=on --set devicePlugin=off --set draSharing=capacity --set draMig=dynamic --set deviceClasses=true" \
    "-f $dir/values-mig.yaml" "-f $dir/values-tls.yaml" "--set compat=replicas --set receiver=true --set grafanaDashboard=true" \
    "--set imagePullSecrets[0].name=regcred --set runtimeClassName=nvidia --set nodeSelector.pool=gpu --set podLabels.team=ml" \
    "--set updateStrategy.type=OnDelete --set global.imageRegistry=example.com --set priorityNamespaces={serving} --set priorityMinShare=50" \
    "--set networkPolicy.enabled=true --set networkPolicy.from[0].namespaceSelector.matchLabels.team=mon"; do
    # shellcheck disable=SC2086
    "$H" template vgpu packaging/helm/vgpu -n "$ns" --set image.repository=vgpu.test/vgpu-node-agent $set >"$dir/rendered.yaml" ||
        fail "helm template $set"
    # The Prometheus operator's kinds need its CRDs: not part of this cluster (the Rust packaging
    # test checks them); everything else the API server validates.
    "$K" apply --dry-run=server -n "$ns" -f "$dir/rendered.yaml" >"$dir/logs/dry-run.log" 2>&1 ||
        { cat "$dir/logs/dry-run.log"; fail "the API server refused the chart rendered with: ${set:-defaults}"; }
    echo "  accepted by the API server: ${set:-defaults} ($(grep -c '^kind:' "$dir/rendered.yaml") objects)"
done
# Past the agent's bounds the schema refuses (before, splitCount up to 1024 installed and the agent
# crash-looped); the API server's version is within the chart's kubeVersion (the install proves it).
for bad in splitCount=0 splitCount=101 memoryScaling=11; do
    if out=$("$H" install bad packaging/helm/vgpu -n "$ns" --dry-run=server --set image.repository=vgpu.test/x --set "$bad" 2>&1); then
        fail "$bad was accepted"
    fi
    echo "$out" | grep -q "/${bad%=*}" || fail "the schema's refusal does not name the value: $out"
    echo "  refused: $bad ($(echo "$out" | grep "${bad%=*}" | head -1 | sed 's/^ *//'))"
done

stage "HAMi mode: helm install, the agent as a DaemonSet on the real node"
"$K" label node "$node" nvidia.com/gpu.present=true >/dev/null
k=$dir/node/kubelet
cat >"$dir/values-e2e.yaml" <<EOF
image: {repository: vgpu.test/vgpu-node-agent, tag: e2e, pullPolicy: Never}
compat: hami
logLevel: info
stateDir: $dir/node/vgpu-state
runDir: $dir/node/vgpu-run
cdiDir: $dir/node/cdi
# The kubelet's device-plugin directory is fixed (/var/lib/kubelet/device-plugins, whatever its
# --root-dir): in the node's mount namespace it is $dir/node/device-plugins (cluster.sh). Its other
# directories follow --root-dir.
kubeletDir: /var/lib/kubelet/device-plugins
kubeletRootDir: $k
priorityClassName: ""
# HAMi's nvidia.com/priority 0 is honoured for the test's pods.
priorityNamespaces: [e2e]
# The simulated GPU's NVML, mounted from the node as the NVIDIA container toolkit mounts the driver's.
extraEnv:
  - {name: VGPU_AGENT_NVML_LIBRARY, value: /opt/vgpu-sim/lib/libnvidia-ml.so.1}
  - {name: VGPU_SIM_CONFIG, value: /opt/vgpu-sim/node.toml}
  - {name: VGPU_SIM_STATE, value: /opt/vgpu-sim/state}
extraVolumes:
  - {name: sim, hostPath: {path: $dir/sim, type: Directory}}
extraVolumeMounts:
  - {name: sim, mountPath: /opt/vgpu-sim}
EOF
"$H" install vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --wait --timeout 120s >/dev/null ||
    fail "helm install"
"$K" -n "$ns" get pods -o wide
agent_pod=$("$K" -n "$ns" get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
vgpuctl() { target/release/vgpuctl --socket "$dir/node/vgpu-run/agent.sock" "$@"; }

# wait_until SECONDS WHAT CMD...: polls CMD once a second.
wait_until() {
    local limit=$1 what=$2
    shift 2
    for _ in $(seq "$limit"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    fail "$what (not within $limit s)"
}
annotation() { "$K" get "$1" "$2" ${3:+-n "$3"} -o json | python3 -c "import json,sys; print(json.load(sys.stdin)['metadata'].get('annotations',{}).get('$4',''))"; }
registered() { [ -n "$(annotation node "$node" "" hami.io/node-nvidia-register)" ]; }
wait_until 60 "the register annotation on the Node" registered
register=$(annotation node "$node" "" hami.io/node-nvidia-register)
# GPU 1 (the H100): the pods below are placed there, and must be held there.
uuid=$(echo "$register" | python3 -c "import json,sys; print([d['id'] for d in json.load(sys.stdin) if 'H100' in d['type']][0])")
echo "  registered: $(echo "$register" | python3 -c "import json,sys; d=json.load(sys.stdin); print(len(d), 'GPUs,', d[0]['type'], d[0]['devmem'], 'MiB')")"
allocatable() { [ "$("$K" get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" -gt 0 ]; }
wait_until 60 "nvidia.com/gpu allocatable on the node (the device plugin registered with kubelet)" allocatable
echo "  allocatable nvidia.com/gpu: $("$K" get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
"$K" auth can-i --list --as "system:serviceaccount:$ns:vgpu-node-agent" >"$dir/logs/can-i-hami.txt"

# The simulated-CUDA client's container and volumes, for a pod spec: it prints what the driver says
# the device has, keeps the GPU busy for 3 s (measuring the share of GPU time it got), then fills
# its GPU memory until refused and holds it. $1: its resources.
cuda_client() {
    echo "  containers:"
    cuda_container cuda "$1"
    sim_volume
}
sim_volume() {
    cat <<EOF
  volumes:
    - {name: sim, hostPath: {path: $dir/sim, type: Directory}}
EOF
}
# cuda_container NAME RESOURCES [COMMAND]: one such container (COMMAND: another shell command).
cuda_container() {
    local command=${3:-gpu-probe info; gpu-probe spin --seconds 3; gpu-probe fill --chunk 104857600}
    cat <<EOF
    - name: $1
      image: vgpu.test/gpu-probe:e2e
      imagePullPolicy: Never
      command: ["/bin/sh", "-c", "$command"]
      env:
        - {name: LD_LIBRARY_PATH, value: /opt/vgpu-sim/lib}
        - {name: VGPU_SIM_CONFIG, value: /opt/vgpu-sim/node.toml}
        - {name: VGPU_SIM_STATE, value: /opt/vgpu-sim/state}
        # By default the SM share applies only while another container shares the GPU (HAMi's
        # meaning); a tenant may ask for it always (it can tighten its limits, never loosen them).
        - {name: GPU_CORE_UTILIZATION_POLICY, value: force}
      resources:
        $2
      volumeMounts:
        - {name: sim, mountPath: /opt/vgpu-sim}
EOF
}

# logs_of POD[/CONTAINER]: a pod's (or one of its containers') log.
logs_of() {
    case "$1" in
        */*) "$K" -n e2e logs "${1%%/*}" -c "${1#*/}" ;;
        *) "$K" -n e2e logs "$1" ;;
    esac
}
ran() { logs_of "$1" 2>/dev/null | grep -q '"result"'; }
# held POD BYTES PERCENT [MODEL]: the pod's client was refused at its quota (having got no more than
# BYTES), the driver tells it the device has exactly BYTES, it got about PERCENT of the GPU's time
# (unthrottled, it gets over 90 %), and its device is a MODEL (the GPU it was placed on).
held() {
    wait_until 180 "$1's client ran" ran "$1"
    local logs
    logs=$(logs_of "$1")
    echo "$logs" | sed 's/^/  pod: /'
    python3 - "$logs" "$2" "$3" "${4:-}" <<'EOF' || fail "$1 was not held to $(($2 >> 20)) MiB and $3 % of ${4:-the GPU}"
import json, sys
info, spin, fill = [json.loads(l) for l in sys.argv[1].splitlines() if l.startswith("{")][:3]
quota, share = int(sys.argv[2]), int(sys.argv[3]) / 100
assert sys.argv[4] in info["name"], (info, "not on the GPU it was placed on:", sys.argv[4])
assert fill["result"] == "CUDA_ERROR_OUT_OF_MEMORY", fill
assert 0 < fill["allocated"] <= quota, (fill, quota)
assert info["mem_total"] == quota, (info, quota)
assert 0.02 < spin["busy"] <= share + 0.1, (spin, share)
print("  held: memory %d MiB (refused after %d MiB), GPU time %.1f %% (limit %d %%)"
      % (quota >> 20, fill["allocated"] >> 20, spin["busy"] * 100, share * 100))
EOF
}

stage "HAMi mode: a pod with HAMi's scheduler annotations, bound by kube-scheduler, allocated by kubelet"
"$K" create namespace e2e >/dev/null
# hami_pod NAME DEVICES: what HAMi's scheduler writes for a pod it placed on this node (the node
# lock naming the pod, the pod's devices), and the pod, with its simulated-CUDA client.
hami_pod() {
    local devices=$2
    "$K" annotate node "$node" --overwrite "hami.io/mutex.lock=$(date -u +%Y-%m-%dT%H:%M:%SZ),e2e,$1" >/dev/null
    cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: e2e
  annotations:
    hami.io/bind-phase: allocating
    hami.io/bind-time: "$(date +%s)"
    hami.io/vgpu-node: $node
    hami.io/vgpu-devices-to-allocate: "$devices"
    hami.io/vgpu-devices-allocated: "$devices"
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
$(cuda_client "limits: {nvidia.com/gpu: 1}")
EOF
}
# Devices of 1024 MiB and 30 %.
hami_pod hami-pod "$uuid,NVIDIA,1024,30:;"
held hami-pod $((1024 << 20)) 30 H100
[ "$(annotation pod hami-pod e2e hami.io/bind-phase)" = success ] || fail "bind phase: $(annotation pod hami-pod e2e hami.io/bind-phase)"
[ -z "$(annotation node "$node" "" hami.io/mutex.lock)" ] || fail "the node lock was not released"
vgpuctl status >"$dir/logs/vgpuctl-status-hami.txt"
grep -q "hami-pod" "$dir/logs/vgpuctl-status-hami.txt" || { cat "$dir/logs/vgpuctl-status-hami.txt"; fail "vgpuctl status does not name the pod"; }
echo "  bind phase success; lock released; vgpuctl status names e2e/hami-pod"
# From a workstation: `kubectl vgpu NODE ...` runs vgpuctl in the node's agent pod.
KUBECTL="$K" VGPU_NAMESPACE="$ns" packaging/kubectl-vgpu "$node" status --namespace e2e -o wide \
    >"$dir/logs/kubectl-vgpu-status.txt" 2>&1 || { cat "$dir/logs/kubectl-vgpu-status.txt"; fail "kubectl vgpu status failed"; }
grep -q "hami-pod" "$dir/logs/kubectl-vgpu-status.txt" || { cat "$dir/logs/kubectl-vgpu-status.txt"; fail "kubectl vgpu status does not name the pod"; }
grep -q "$uuid" "$dir/logs/kubectl-vgpu-status.txt" || { cat "$dir/logs/kubectl-vgpu-status.txt"; fail "kubectl vgpu status -o wide lacks the whole UUID"; }
echo "  kubectl vgpu $node status --namespace e2e -o wide: names it, from the agent's pod"

stage "HAMi mode: an Allocate that fails leaves nothing behind"
# The scheduler's annotations name a GPU this node does not have.
hami_pod bad-pod "GPU-00000000-0000-4000-8000-000000000000,NVIDIA,1024,30:;"
refused() { [ "$("$K" -n e2e get pod bad-pod -o jsonpath='{.status.phase}')" = Failed ]; }
wait_until 60 "bad-pod failed by kubelet" refused
echo "  kubelet: $("$K" -n e2e get pod bad-pod -o jsonpath='{.status.reason}: {.status.message}' | cut -c1-240)"
[ "$(annotation pod bad-pod e2e hami.io/bind-phase)" = failed ] || fail "bind phase: $(annotation pod bad-pod e2e hami.io/bind-phase)"
[ -z "$(annotation node "$node" "" hami.io/mutex.lock)" ] || fail "the node lock was not released"
vgpuctl status >"$dir/logs/vgpuctl-status-bad.txt"
if grep -q "bad-pod" "$dir/logs/vgpuctl-status-bad.txt"; then cat "$dir/logs/vgpuctl-status-bad.txt"; fail "a slice was left for bad-pod"; fi
[ "$(grep -c 'e2e/' "$dir/logs/vgpuctl-status-bad.txt")" = 1 ] || { cat "$dir/logs/vgpuctl-status-bad.txt"; fail "slices other than hami-pod's"; }
echo "  bind phase failed; lock released; no slice for it (hami-pod's alone)"
"$K" -n e2e delete pod bad-pod --wait=true --timeout=60s >/dev/null

stage "an agent changes only its own Node and its pods (the chart's ValidatingAdmissionPolicies)"
"$K" create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: other-node}
EOF
uid=$("$K" -n "$ns" get pod "$agent_pod" -o jsonpath='{.metadata.uid}')
token=$("$K" -n "$ns" create token vgpu-node-agent --bound-object-kind Pod --bound-object-name "$agent_pod" --bound-object-uid "$uid")
# A kubeconfig without the admin's certificate: the token alone speaks.
sed '/client-certificate\|client-key/d; s/user:$/user: {}/' "$dir/kubeconfig" >"$dir/anon.kubeconfig"
as_agent() { KUBECONFIG="$dir/anon.kubeconfig" "$K" --token "$token" "$@"; }
as_agent annotate node "$node" e2e/own=yes >/dev/null || fail "the agent could not annotate its own node"
if out=$(as_agent annotate node other-node e2e/other=yes 2>&1); then fail "the agent annotated another node"; fi
echo "$out" | grep -q "may not change node other-node" || fail "refused for another reason: $out"
echo "  refused: $out"
if out=$(as_agent label node "$node" e2e/label=yes 2>&1); then fail "the agent labelled its node"; fi
echo "  refused: $out"
# Pods likewise (HAMi and Volcano modes patch them): only those on its node, annotations only.
"$K" create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: elsewhere, namespace: e2e}
spec: {nodeName: other-node, containers: [{name: c, image: vgpu.test/none}]}
EOF
as_agent -n e2e annotate pod hami-pod e2e/own=yes >/dev/null || fail "the agent could not annotate a pod on its node"
if out=$(as_agent -n e2e annotate pod elsewhere e2e/other=yes 2>&1); then fail "the agent annotated a pod of another node"; fi
echo "$out" | grep -q "may not change pod e2e/elsewhere" || fail "refused for another reason: $out"
echo "  refused: $out"
if out=$(as_agent -n e2e label pod hami-pod e2e/label=yes 2>&1); then fail "the agent labelled a pod"; fi
echo "  refused: $out"
"$K" -n e2e delete pod elsewhere --wait=false >/dev/null
"$K" -n e2e delete pod hami-pod --wait=true --timeout=60s >/dev/null

stage "the device plugin follows the kubelet: a restart, and its socket replaced by another process"
# The plugins' directory as the host sees it (the node's namespace has it at the kubelet's path).
plugin_dir=$dir/node/device-plugins
tests/k8s/cluster.sh restart-kubelet "$dir"
wait_until 60 "nvidia.com/gpu allocatable after the kubelet restarted" allocatable
# (The kubelet serves the pod's log again a moment after it is back.)
restart_said() { "$K" -n "$ns" logs "$agent_pod" --since=120s | grep -q "kubelet restarted"; }
wait_until 30 "the agent's line saying the kubelet restarted" restart_said
echo "  kubelet restarted: the agent registered again ($("$K" get node "$node" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}') allocatable)"
# Another process binds the plugin's socket for a while (a second agent, a test's), then goes.
python3 - "$plugin_dir/vgpu.sock" <<'EOF'
import os, socket, sys, time
os.unlink(sys.argv[1])
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
time.sleep(3)
EOF
replaced() { "$K" -n "$ns" logs "$agent_pod" --since=60s | grep -q "another process replaced the device plugin socket"; }
wait_until 30 "the agent's warning of a replaced socket" replaced
wait_until 60 "nvidia.com/gpu allocatable after the socket was replaced" allocatable
# The agent listens on the path once: the servers it replaced closed their sockets.
apid=$(pgrep -f "^/usr/local/bin/vgpu-node-agent" | head -1)
listening=$(python3 - "$apid" /var/lib/kubelet/device-plugins/vgpu.sock <<'EOF'
import os, sys
pid, path = sys.argv[1], sys.argv[2]
# The agent's network namespace's table (a pod's own), its listening sockets on that path.
inodes = {l.split()[6] for l in open(f"/proc/{pid}/net/unix").read().splitlines()[1:]
          if len(l.split()) > 7 and l.split()[7] == path and int(l.split()[3], 16) & 0x10000}
fds = [os.readlink(f"/proc/{pid}/fd/{f}") for f in os.listdir(f"/proc/{pid}/fd")]
print(sum(1 for f in fds if f.startswith("socket:[") and f[8:-1] in inodes))
EOF
)
[ "$listening" = 1 ] || fail "the agent listens on its plugin socket $listening times"
echo "  socket replaced: warned, registered again, one listening socket"

if [ -n "$peers" ]; then
    stage_hami_real
    stage_kueue_real
    stage_hami_mps
    hami_real_down
fi

stage "least privilege: without its nodes patch rule the agent says so and writes nothing"
# The ClusterRole's second rule is nodes get/patch in HAMi mode: patch taken away.
"$K" get clusterrole vgpu-node-agent -o jsonpath='{.rules[1].resources[0]} {.rules[1].verbs}' | grep -q '^nodes .*patch' ||
    fail "the ClusterRole's second rule is not nodes patch: $("$K" get clusterrole vgpu-node-agent -o jsonpath='{.rules}')"
"$K" patch clusterrole vgpu-node-agent --type=json -p '[{"op": "replace", "path": "/rules/1/verbs", "value": ["get"]}]' >/dev/null
"$K" annotate node "$node" hami.io/node-nvidia-register- >/dev/null
forbidden() { "$K" -n "$ns" logs "$agent_pod" --since=60s | grep -q 'HAMi node registration failed.*forbidden'; }
wait_until 60 "a log line saying the node patch was forbidden" forbidden
"$K" -n "$ns" logs "$agent_pod" --since=60s | grep 'HAMi node registration failed' | tail -1 | cut -c1-300 | sed 's/^/  agent: /'
[ -z "$(annotation node "$node" "" hami.io/node-nvidia-register)" ] || fail "the register annotation came back without the rule"
echo "  refused and said; the register annotation stays away (the next upgrade restores the rule)"

stage "Volcano mode: memory in the scheduler's units, or no start; a pod as Volcano's scheduler writes it"
# Without the scheduler's configuration the agent counts volcano.sh/vgpu-memory in MiB, Volcano's
# default; two 40 GB GPUs are more MiB devices than the kubelet takes: the agent does not start, and
# says so in an Event on the Node. --force-conflicts: the ClusterRole's rules, which the stage above
# patched, are the chart's again.
"$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --set compat=volcano --force-conflicts \
    >/dev/null || fail "helm upgrade to Volcano mode"
units_event() { "$K" get events -A --field-selector reason=VolcanoMemoryUnits -o jsonpath='{.items[0].message}'; }
units_said() { units_event | grep -q "set gpuMemoryFactor: "; }
wait_until 90 "the agent's VolcanoMemoryUnits Event" units_said
echo "  Event: $(units_event | cut -c1-160)..."
# Volcano's device configuration, with a factor that fits (as the Event says), given to the agent.
"$K" -n "$ns" create configmap volcano-vgpu-device-config \
    --from-literal=device-config.yaml="$(printf 'nvidia:\n  resourceMemoryName: volcano.sh/vgpu-memory\n  gpuMemoryFactor: 4\n')" >/dev/null
"$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --set compat=volcano \
    --set migGeometriesConfigMap=volcano-vgpu-device-config \
    --set migGeometriesFile=/etc/vgpu-mig-geometries/device-config.yaml --wait --timeout 120s >/dev/null ||
    fail "helm upgrade to Volcano mode with the scheduler's configuration"
"$K" -n "$ns" rollout status ds/vgpu-node-agent --timeout=90s >/dev/null || fail "the agent did not restart"
agent_pod=$("$K" -n "$ns" get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
volcano_registered() { [ -n "$(annotation node "$node" "" volcano.sh/node-vgpu-register)" ]; }
wait_until 60 "Volcano's register annotation on the Node" volcano_registered
echo "  registered: $(annotation node "$node" "" volcano.sh/node-vgpu-register | cut -c1-100)"
volcano_allocatable() { [ "$("$K" get node "$node" -o jsonpath='{.status.allocatable.volcano\.sh/vgpu-number}')" -gt 0 ]; }
wait_until 60 "volcano.sh/vgpu-number allocatable on the node" volcano_allocatable
# One volcano.sh/vgpu-memory unit per 4 MiB: what the register annotation offers, and the kubelet.
units=$(annotation node "$node" "" volcano.sh/node-vgpu-register | python3 -c "import sys; print(sum(int(d.split(',')[2]) for d in sys.stdin.read().strip().split(':') if d))")
memory_allocatable() { [ "$("$K" get node "$node" -o jsonpath='{.status.allocatable.volcano\.sh/vgpu-memory}')" = "$units" ]; }
wait_until 60 "volcano.sh/vgpu-memory allocatable = the register annotation's $units units" memory_allocatable
echo "  volcano.sh/vgpu-memory: $units units of 4 MiB, in the annotation and allocatable"
# Volcano's node lock and the pod's devices: 512 units of 4 MiB (2048 MiB), 50 %.
"$K" annotate node "$node" "hamivgpu=$(date -u +%Y-%m-%dT%H:%M:%SZ)" >/dev/null
devices="$uuid,NVIDIA,512,50:;"
cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: v1
kind: Pod
metadata:
  name: volcano-pod
  namespace: e2e
  annotations:
    volcano.sh/bind-phase: allocating
    volcano.sh/bind-time: "$(date +%s)"
    volcano.sh/vgpu-node: $node
    volcano.sh/devices-to-allocate: "$devices"
    volcano.sh/vgpu-ids-new: "$devices"
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
$(cuda_client "limits: {volcano.sh/vgpu-number: 1}")
EOF
held volcano-pod $((2048 << 20)) 50 H100
[ "$(annotation pod volcano-pod e2e volcano.sh/bind-phase)" = success ] ||
    fail "bind phase: $(annotation pod volcano-pod e2e volcano.sh/bind-phase)"
[ -z "$(annotation node "$node" "" hamivgpu)" ] || fail "Volcano's node lock was not released"
echo "  bind phase success; lock released"
"$K" -n e2e delete pod volcano-pod --wait=true --timeout=60s >/dev/null
volcano_freed() { ! vgpuctl status | grep -q 'e2e/volcano-pod'; }
wait_until 60 "volcano-pod's slice removed once the pod is gone" volcano_freed
echo "  the pod deleted: its slice removed"

if [ -n "$peers" ]; then
    stage_volcano_real
    stage_kai_real
fi

stage "DRA: helm upgrade restarts the agent as a DRA driver"
old_hash=$("$K" -n "$ns" get ds vgpu-node-agent -o jsonpath='{.spec.template.metadata.annotations.checksum/config}')
"$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --set dra=on --set devicePlugin=off \
    --set deviceClasses=true --wait --timeout 120s >/dev/null || fail "helm upgrade to DRA"
new_hash=$("$K" -n "$ns" get ds vgpu-node-agent -o jsonpath='{.spec.template.metadata.annotations.checksum/config}')
[ "$old_hash" != "$new_hash" ] || fail "the configuration's checksum did not change"
"$K" -n "$ns" rollout status ds/vgpu-node-agent --timeout=90s >/dev/null || fail "the agent did not restart"
new_pod=$("$K" -n "$ns" get pods -l app.kubernetes.io/name=vgpu-node-agent -o jsonpath='{.items[0].metadata.name}')
[ "$new_pod" != "$agent_pod" ] || fail "the agent's pod was not replaced"
echo "  checksum/config changed; pod $agent_pod replaced by $new_pod"
published() { "$K" get resourceslices -o name | grep -q .; }
wait_until 60 "the agent's ResourceSlices" published
"$K" get resourceslices -o yaml >"$dir/logs/resourceslices.yaml"
echo "  ResourceSlices: $("$K" get resourceslices --no-headers | wc -l), devices: $("$K" get resourceslices -o jsonpath='{.items[*].spec.devices[*].name}' | wc -w)"
"$K" auth can-i --list --as "system:serviceaccount:$ns:vgpu-node-agent" >"$dir/logs/can-i-dra.txt"

stage "DRA: another node's ResourceSlice is refused"
uid=$("$K" -n "$ns" get pod "$new_pod" -o jsonpath='{.metadata.uid}')
token=$("$K" -n "$ns" create token vgpu-node-agent --bound-object-kind Pod --bound-object-name "$new_pod" --bound-object-uid "$uid")
slice_of() {
    cat <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: e2e-$1}
spec:
  driver: gpu.vgpu.io
  nodeName: $1
  pool: {name: $1, generation: 1, resourceSliceCount: 1}
  devices: [{name: gpu-9}]
EOF
}
if out=$(slice_of other-node | as_agent create -f - 2>&1); then fail "the agent wrote another node's ResourceSlice"; fi
echo "$out" | grep -q 'may not write a ResourceSlice of node "other-node"' || fail "refused for another reason: $out"
echo "  refused: $out"
slice_of "$node" | as_agent create -f - >/dev/null || fail "the agent could not write its own node's ResourceSlice"
"$K" delete resourceslice "e2e-$node" >/dev/null

# claim_share CLAIM: the share the scheduler allocated to a claim of namespace e2e (the capacity of
# its device in the agent's ResourceSlice): its memory in bytes and its cores in percent.
claim_share() {
    "$K" -n e2e get resourceclaim "$1" -o jsonpath='{.status.allocation.devices.results}' >"$dir/logs/claim-allocation.json"
    "$K" get resourceslices -o json >"$dir/logs/resourceslices.json"
    python3 - "$dir/logs/claim-allocation.json" "$dir/logs/resourceslices.json" <<'EOF'
import json, sys
device = json.load(open(sys.argv[1]))[0]["device"]
units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
for s in json.load(open(sys.argv[2]))["items"]:
    for d in s["spec"]["devices"]:
        if d["name"] == device:
            v = d["capacity"]["memory"]["value"]
            print(int(v[:-2]) * units[v[-2:]] if v[-2:] in units else int(v), d["capacity"]["cores"]["value"])
EOF
}

stage "DRA: a claim with a CEL selector on memory, allocated by kube-scheduler, prepared through kubelet"
cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: gpu-share, namespace: e2e}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: vgpu-share
          selectors:
            - cel:
                expression: device.capacity["gpu.vgpu.io"].memory.compareTo(quantity("1Gi")) >= 0
---
apiVersion: v1
kind: Pod
metadata: {name: dra-pod, namespace: e2e}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  resourceClaims:
    - {name: gpu, resourceClaimName: gpu-share}
$(cuda_client "claims: [{name: gpu}]")
EOF
claimed() { [ -n "$("$K" -n e2e get resourceclaim gpu-share -o jsonpath='{.status.allocation}')" ]; }
wait_until 60 "the claim allocated by kube-scheduler" claimed
read -r limit cores < <(claim_share gpu-share)
[ -n "$limit" ] || fail "the allocated device is in no ResourceSlice: $(cat "$dir/logs/claim-allocation.json")"
echo "  allocated: $(cat "$dir/logs/claim-allocation.json") ($((limit >> 20)) MiB, $cores % of the GPU)"
held dra-pod "$limit" "$cores"
vgpuctl status >"$dir/logs/vgpuctl-status-dra.txt"
grep -q "(e2e/dra-pod claim gpu-share)" "$dir/logs/vgpuctl-status-dra.txt" ||
    { cat "$dir/logs/vgpuctl-status-dra.txt"; fail "vgpuctl status does not name the pod and its claim"; }
echo "  vgpuctl status names it: e2e/dra-pod claim gpu-share"

stage "DRA: deleting the pod unprepares the claim and frees the slice"
"$K" -n e2e delete pod dra-pod --wait=true --timeout=60s >/dev/null
freed() { ! vgpuctl status | grep -q 'dra-pod\|gpu-share'; }
wait_until 60 "the claim's slice removed" freed
echo "  the slice is gone"

stage_kueue_dra

stage "a second release beside the first, and an upgrade from selectors without the release"
# Another release in its own namespace (another node pool, say): the API server's dry run of its
# install meets none of the first release's objects (the DeviceClasses are one release's to make).
"$H" install pool-b packaging/helm/vgpu -n e2e -f "$dir/values-e2e.yaml" --set deviceClasses=false \
    --dry-run=server >/dev/null || fail "a second release collides"
echo "  a second release installs beside the first (server dry run)"
"$H" uninstall vgpu -n "$ns" --wait --timeout 60s >/dev/null
# The chart as it was before its selectors named the release (the DaemonSet's selector: the name
# label only, which Kubernetes cannot change in place), installed, then upgraded to this one.
old_chart=$dir/chart-name-selector
rm -rf "$old_chart" && cp -r packaging/helm/vgpu "$old_chart"
sed -i 's|^      {{- include "vgpu.keptSelector" (dict "ctx" . "kind" "DaemonSet".*$|      app.kubernetes.io/name: vgpu-node-agent|' \
    "$old_chart/templates/daemonset.yaml"
"$H" install vgpu "$old_chart" -n "$ns" -f "$dir/values-e2e.yaml" --wait --timeout 120s >/dev/null ||
    fail "helm install of the chart with the name-only selector"
selector() { "$K" -n "$ns" get ds vgpu-node-agent -o jsonpath='{.spec.selector.matchLabels}'; }
[ "$(selector)" = '{"app.kubernetes.io/name":"vgpu-node-agent"}' ] || fail "the old chart's selector: $(selector)"
"$H" upgrade vgpu packaging/helm/vgpu -n "$ns" -f "$dir/values-e2e.yaml" --wait --timeout 120s >/dev/null ||
    fail "helm upgrade from the chart with the name-only selector"
[ "$(selector)" = '{"app.kubernetes.io/name":"vgpu-node-agent"}' ] || fail "the selector changed: $(selector)"
labels=$("$K" -n "$ns" get ds vgpu-node-agent -o jsonpath='{.spec.template.metadata.labels.app\.kubernetes\.io/instance}')
[ "$labels" = vgpu ] || fail "the upgraded pods carry no release label ($labels)"
ready=$("$K" -n "$ns" get ds vgpu-node-agent -o jsonpath='{.status.numberReady}')
[ "$ready" = 1 ] || fail "the agent of the kept selector is not ready ($ready)"
echo "  the old selector kept, the agent ready under it"

stage "helm uninstall"
"$H" uninstall vgpu -n "$ns" --wait --timeout 60s >/dev/null
if [ -n "$peers" ]; then
    echo "Kubernetes end-to-end: all stages passed in $((SECONDS - t0)) s (real peers: HAMi $hami_version, Volcano v1.15.1, Kueue v0.17.0, KAI Scheduler v0.13.0)"
else
    echo "Kubernetes end-to-end: all stages but the real peers' passed in $((SECONDS - t0)) s (SKIPPED: no peer source)"
fi

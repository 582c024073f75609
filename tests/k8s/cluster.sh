#!/usr/bin/env bash
# A real single-node Kubernetes on loopback, in a scratch folder, for the end-to-end test: etcd,
# kube-apiserver (RBAC, Node authorisation and admission on, resource.k8s.io/v1 served, certificates
# made for the run), kube-controller-manager and kube-scheduler; with `node`, also containerd, runc
# and a real kubelet registered as $VGPU_K8S_NODE.
#   tests/k8s/cluster.sh up DIR        # control plane; DIR/kubeconfig is the admin's
#   tests/k8s/cluster.sh node DIR      # containerd and the kubelet (after up)
#   tests/k8s/cluster.sh restart-kubelet DIR  # the kubelet stopped and started again
#   tests/k8s/cluster.sh import DIR TAR...  # image archives into the node's containerd
#   tests/k8s/cluster.sh address DIR    # the API server's address on the node (IP:PORT)
#   tests/k8s/cluster.sh down DIR      # stops everything up/node started (safe to repeat)
# Logs: DIR/logs/<component>.log. Binaries: tests/k8s/tools.sh (built once).
# Pods reach the API server as in any cluster, at the `kubernetes` Service (KUBERNETES_SERVICE_HOST):
# with no kube-proxy (and no iptables) here, service-proxy.py forwards that one Service's address,
# which is on an interface named after DIR, to the API server.
# Besides runc, containerd has the runtime `nvidia` (the RuntimeClass GPU schedulers such as KAI
# set): runc behind sim-nvidia-runtime, which does for the simulated GPU what the NVIDIA container
# runtime does for a driver (VGPU_K8S_SIM_DIR, default DIR/sim, mounted where a container names
# GPUs), with KAI's pod annotations passed into the containers' specs and, where VGPU_K8S_OCI_HOOK
# is a command (vgpu-oci-hook and its arguments), that command as its createRuntime and poststop
# hooks, as docs/deploying.md tells KAI users to configure it.
# Ports: VGPU_K8S_PORT (default 26443) is the API server's; the others follow it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmd=${1:-}
dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
node=${VGPU_K8S_NODE:-vgpu-e2e-node}
port=${VGPU_K8S_PORT:-26443}
etcd_port=$((port - 64)) etcd_peer=$((port - 63)) cm_port=$((port - 62)) sched_port=$((port - 61))
kubelet_port=$((port - 60)) kubelet_health=$((port - 59))
# The pods' bridge and subnet are named after the scratch folder: two runs on one host do not meet.
tag=$(echo "$dir" | sha256sum | cut -c1-8)
bridge=vgpu$tag
subnet=10.244.$((16#${tag:0:2} % 200 + 20)).0/24
# The Services' range, and the `kubernetes` Service's address (its first), likewise.
services=10.$((16#${tag:2:2} % 32 + 96)).0.0/16
api_service=${services%.0/16}.1
service_link=vsvc$tag

log() { echo "cluster.sh: $*" >&2; }
# The node's address: the kubelet refuses a loopback one; the API server reaches it there (and
# webhooks' Services through their endpoints, --enable-aggregator-routing: no kube-proxy here).
node_ip=$(ip -4 route get 192.0.2.250 2>/dev/null | grep -o 'src [0-9.]*' | cut -d' ' -f2 || true)
[ -n "$node_ip" ] || node_ip=$(hostname -I | cut -d' ' -f1)

# start NAME CMD...: runs CMD in the background, its output in logs/NAME.log, its PID in pids/NAME.
start() {
    local name=$1
    shift
    mkdir -p "$dir/logs" "$dir/pids"
    # setsid: a process group of its own, so that down stops whatever the component started.
    setsid "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$dir/pids/$name"
}

# wait_for WHAT SECONDS CMD...: polls CMD until it succeeds; on a timeout prints the log and fails.
wait_for() {
    local what=$1 limit=$2 waited=0
    shift 2
    until "$@" >/dev/null 2>&1; do
        if [ -f "$dir/pids/$what" ] && ! kill -0 "$(cat "$dir/pids/$what")" 2>/dev/null; then
            log "$what exited; the end of its log:"
            tail -40 "$dir/logs/$what.log" >&2 || true
            return 1
        fi
        if [ "$waited" -ge "$((limit * 5))" ]; then
            log "$what did not come up within $limit s; the end of its log:"
            tail -40 "$dir/logs/$what.log" >&2 || true
            return 1
        fi
        sleep 0.2
        waited=$((waited + 1))
    done
}

# cert NAME SUBJECT [SAN]: a key and a certificate signed by the run's CA.
cert() {
    local name=$1 subject=$2 san=${3:-}
    openssl genrsa -out "$dir/pki/$name.key" 2048 2>/dev/null
    openssl req -new -key "$dir/pki/$name.key" -subj "$subject" -out "$dir/pki/$name.csr" 2>/dev/null
    local ext="$dir/pki/$name.ext"
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        if [ -n "$san" ]; then
            echo "extendedKeyUsage=serverAuth,clientAuth"
            echo "subjectAltName=$san"
        else
            echo "extendedKeyUsage=clientAuth"
        fi
    } >"$ext"
    openssl x509 -req -in "$dir/pki/$name.csr" -CA "$dir/pki/ca.crt" -CAkey "$dir/pki/ca.key" \
        -CAcreateserial -days 2 -extfile "$ext" -out "$dir/pki/$name.crt" 2>/dev/null
}

# kubeconfig NAME CERT: a kubeconfig for the API server with a client certificate.
kubeconfig() {
    cat >"$dir/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority: $dir/pki/ca.crt
users:
- name: $1
  user:
    client-certificate: $dir/pki/$2.crt
    client-key: $dir/pki/$2.key
contexts:
- name: e2e
  context: {cluster: e2e, user: $1}
current-context: e2e
EOF
}

up() {
    bin=$("$here/tools.sh")
    echo "$bin" >"$dir/bin"
    if [ -f "$dir/pids/kube-apiserver" ] && kill -0 "$(cat "$dir/pids/kube-apiserver")" 2>/dev/null; then
        log "already up in $dir"
        return 0
    fi
    rm -rf "$dir/pki" "$dir/etcd-data"
    mkdir -p "$dir/pki"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$dir/pki/ca.key" -out "$dir/pki/ca.crt" \
        -subj "/CN=vgpu-e2e-ca" -days 2 2>/dev/null
    cert apiserver "/CN=kube-apiserver" \
        "IP:127.0.0.1,IP:$node_ip,IP:$api_service,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    cert admin "/O=system:masters/CN=e2e-admin"
    cert apiserver-kubelet "/O=system:masters/CN=kube-apiserver-kubelet-client"
    cert controller-manager "/CN=system:kube-controller-manager"
    cert scheduler "/CN=system:kube-scheduler"
    cert kubelet "/O=system:nodes/CN=system:node:$node"
    openssl genrsa -out "$dir/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$dir/pki/sa.key" -pubout -out "$dir/pki/sa.pub" 2>/dev/null
    kubeconfig admin admin
    cp "$dir/admin.kubeconfig" "$dir/kubeconfig"
    kubeconfig controller-manager controller-manager
    kubeconfig scheduler scheduler
    kubeconfig kubelet kubelet

    log "etcd on 127.0.0.1:$etcd_port"
    start etcd "$bin/etcd" --name e2e --data-dir "$dir/etcd-data" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
        --initial-cluster "e2e=http://127.0.0.1:$etcd_peer" --unsafe-no-fsync
    wait_for etcd 60 curl -sf "http://127.0.0.1:$etcd_port/health"

    log "kube-apiserver on 127.0.0.1:$port"
    start kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address 0.0.0.0 --advertise-address "$node_ip" --secure-port "$port" \
        --tls-cert-file "$dir/pki/apiserver.crt" --tls-private-key-file "$dir/pki/apiserver.key" \
        --client-ca-file "$dir/pki/ca.crt" --requestheader-client-ca-file "$dir/pki/ca.crt" \
        --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
        --requestheader-extra-headers-prefix X-Remote-Extra- --requestheader-allowed-names front-proxy-client \
        --kubelet-client-certificate "$dir/pki/apiserver-kubelet.crt" --kubelet-client-key "$dir/pki/apiserver-kubelet.key" \
        --kubelet-certificate-authority "$dir/pki/ca.crt" \
        --service-account-key-file "$dir/pki/sa.pub" --service-account-signing-key-file "$dir/pki/sa.key" \
        --service-account-issuer https://kubernetes.default.svc \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --runtime-config resource.k8s.io/v1=true \
        --kubelet-preferred-address-types InternalIP,Hostname \
        --service-cluster-ip-range "$services" --allow-privileged=true --profiling=false \
        --enable-aggregator-routing=true
    wait_for kube-apiserver 120 "$bin/kubectl" --kubeconfig "$dir/kubeconfig" get --raw /readyz

    log "kube-controller-manager and kube-scheduler"
    start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$dir/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$dir/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$dir/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$cm_port" --leader-elect=false \
        --use-service-account-credentials --service-account-private-key-file "$dir/pki/sa.key" \
        --root-ca-file "$dir/pki/ca.crt" --cluster-signing-cert-file "$dir/pki/ca.crt" \
        --cluster-signing-key-file "$dir/pki/ca.key" --profiling=false
    start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$dir/scheduler.kubeconfig" \
        --authentication-kubeconfig "$dir/scheduler.kubeconfig" \
        --authorization-kubeconfig "$dir/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$sched_port" --leader-elect=false --profiling=false
    wait_for kube-controller-manager 60 curl -skf "https://127.0.0.1:$cm_port/healthz"
    wait_for kube-scheduler 60 curl -skf "https://127.0.0.1:$sched_port/healthz"
    # The default ServiceAccount of a namespace is made by the controller manager: pods need it.
    wait_for kube-controller-manager 60 "$bin/kubectl" --kubeconfig "$dir/kubeconfig" get serviceaccount default
    log "control plane up: KUBECONFIG=$dir/kubeconfig"
}

# The node's mount namespace, where containerd, the kubelet and all they start run: the host's, but
# for /var/lib, whose writes go to DIR/node/var-lib (an overlay), and the kubelet's device-plugin
# directory, which the kubelet fixes at /var/lib/kubelet/device-plugins whatever its --root-dir:
# there it is DIR/node/device-plugins. So the test's kubelet and agents never meet a host's kubelet
# or its plugins. Kept as the file DIR/node/ns/mnt (nsenter --mount=... enters it).
node_namespace() {
    local root="$dir/node" ns="$dir/node/ns"
    mkdir -p "$ns" "$root/device-plugins" "$root/var-lib/upper" "$root/var-lib/work"
    # A namespace is kept by a bind mount of its file, which must not be on a shared mount.
    if ! mountpoint -q "$ns"; then
        mount --bind "$ns" "$ns"
        mount --make-private "$ns"
    fi
    touch "$ns/mnt"
    unshare --mount="$ns/mnt" --propagation slave sh -ec "
        mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$root/var-lib/upper,workdir=$root/var-lib/work /var/lib
        mkdir -p /var/lib/kubelet/device-plugins
        mount --bind $root/device-plugins /var/lib/kubelet/device-plugins"
}

node() {
    bin=$(cat "$dir/bin")
    local root="$dir/node"
    mkdir -p "$root/containerd" "$root/run" "$root/kubelet" "$root/cni-conf"
    ip link del "$bridge" 2>/dev/null || true
    # The `kubernetes` Service's address, which service-proxy.py serves, on an interface of its
    # own (the bridge plugin allows its bridge one IPv4 address; a veth pair, as no dummy driver
    # may be loaded).
    ip link del "$service_link" 2>/dev/null || true
    ip link add "$service_link" type veth peer name "${service_link}p"
    ip link set "${service_link}p" up
    ip link set "$service_link" up
    ip addr add "$api_service/32" dev "$service_link"
    start service-proxy python3 "$here/service-proxy.py" "$api_service:443" "127.0.0.1:$port"
    node_namespace
    cert kubelet-serving "/CN=$node" "IP:$node_ip,IP:127.0.0.1,DNS:$node,DNS:localhost"
    # Pod networking: a bridge on the node with addresses from host-local, no masquerading (pods
    # talk to the node only).
    cat >"$root/cni-conf/10-e2e.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "e2e", "plugins": [
  {"type": "bridge", "bridge": "$bridge", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$subnet"}]], "dataDir": "$root/cni-ipam"}},
  {"type": "loopback"}]}
EOF
    # The `nvidia` runtime: runc behind the simulated NVIDIA container runtime, with vgpu-oci-hook
    # (VGPU_K8S_OCI_HOOK) as its hooks in a base spec (containerd's default spec plus the hooks).
    local runc=${VGPU_K8S_RUNC:-$(command -v runc)} base_spec=""
    cat >"$root/nvidia-runc" <<EOF
#!/bin/sh
case " \$* " in
    *" create "*) exec python3 "$here/sim-nvidia-runtime.py" "${VGPU_K8S_SIM_DIR:-$dir/sim}" "$runc" "\$@" ;;
esac
exec "$runc" "\$@"
EOF
    chmod +x "$root/nvidia-runc"
    if [ -n "${VGPU_K8S_OCI_HOOK:-}" ]; then
        # shellcheck disable=SC2086
        "$bin/ctr" oci spec | python3 -c '
import json, os, sys
spec, hook = json.load(sys.stdin), sys.argv[1:]
entry = lambda *more: {"path": hook[0], "args": [os.path.basename(hook[0]), *hook[1:], *more]}
spec["hooks"] = {"createRuntime": [entry()], "poststop": [entry("poststop")]}
json.dump(spec, sys.stdout, indent=1)' $VGPU_K8S_OCI_HOOK >"$root/nvidia-base-spec.json"
        base_spec="base_runtime_spec = \"$root/nvidia-base-spec.json\""
    fi
    cat >"$root/containerd.toml" <<EOF
version = 3
root = "$root/containerd/root"
state = "$root/run/containerd"
[grpc]
  address = "$root/run/containerd.sock"
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  # A sandbox without CAP_SYS_RESOURCE cannot lower a process's OOM score (the pod sandbox's -998):
  # never below containerd's own.
  restrict_oom_score_adj = true
  # Pods' network namespaces in the scratch folder, so that down removes exactly these: a namespace
  # left behind keeps its veth on the bridge, and a later pod given the same address then loses
  # half its packets to the dead one (seen: connections to the API server timing out).
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = ["${VGPU_K8S_CDI_DIR:-/var/run/cdi}"]
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "$runc"
  # The containers' runc state in the scratch folder: down stops exactly these.
  Root = "$root/run/runc"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
  # KAI's asks, which it passes nowhere else.
  pod_annotations = ["gpu-memory", "gpu-fraction", "gpu-fraction-num-devices"]
  $base_spec
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia.options]
  BinaryName = "$root/nvidia-runc"
  Root = "$root/run/runc"
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["$bin/cni"]
  conf_dir = "$root/cni-conf"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "native"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "vgpu.test/pause:e2e"
EOF
    log "containerd (socket $root/run/containerd.sock)"
    PATH="$bin:$PATH" start containerd nsenter --mount="$root/ns/mnt" -- "$bin/containerd" --config "$root/containerd.toml"
    wait_for containerd 60 test -S "$root/run/containerd.sock"
    "$here/oci-image.py" --ref vgpu.test/pause:e2e --out "$root/pause.tar" --entrypoint /pause "$bin/pause=/pause"
    import_image "$root/pause.tar"
    cat >"$root/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: $kubelet_port
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_health
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $dir/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $dir/pki/kubelet-serving.crt
tlsPrivateKeyFile: $dir/pki/kubelet-serving.key
containerRuntimeEndpoint: unix://$root/run/containerd.sock
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
enforceNodeAllocatable: []
cgroupsPerQOS: false
makeIPTablesUtilChains: false
registerNode: true
staticPodPath: ""
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
# Pod logs in the scratch folder, not /var/log/pods.
podLogsDir: $root/pod-logs
EOF
    start_kubelet
    log "node $node ready (kubelet root $root/kubelet, containerd socket $root/run/containerd.sock)"
}

start_kubelet() {
    bin=$(cat "$dir/bin")
    local root="$dir/node"
    log "kubelet as node $node"
    start kubelet nsenter --mount="$root/ns/mnt" -- "$bin/kubelet" --config "$root/kubelet.yaml" --kubeconfig "$dir/kubelet.kubeconfig" \
        --hostname-override "$node" --root-dir "$root/kubelet" --node-ip "$node_ip"
    wait_for kubelet 120 "$bin/kubectl" --kubeconfig "$dir/kubeconfig" wait --for=condition=Ready "node/$node" --timeout=1s
}

# The kubelet stopped (its process group) and started again, as an upgrade or a crash does.
restart_kubelet() {
    local pid
    pid=$(cat "$dir/pids/kubelet")
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    start_kubelet
}

# import_image TAR: an image archive into containerd's Kubernetes namespace.
import_image() {
    "$(cat "$dir/bin")/ctr" --address "$dir/node/run/containerd.sock" -n k8s.io images import "$1" >/dev/null
}

down() {
    [ -d "$dir/pids" ] || return 0
    # The node first (its containers, then its components), then the control plane.
    for name in kubelet containerd service-proxy kube-scheduler kube-controller-manager kube-apiserver etcd; do
        [ -f "$dir/pids/$name" ] || continue
        local pid
        pid=$(cat "$dir/pids/$name")
        kill -TERM -- "-$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
        rm -f "$dir/pids/$name"
    done
    # The containers themselves (their processes outlive the shims), then the shims.
    # (containerd keeps each namespace's in a folder of its own under the runc root.)
    for runc_root in "$dir"/node/run/runc/*/; do
        [ -d "$runc_root" ] || continue
        for id in $(runc --root "$runc_root" list -q 2>/dev/null); do
            runc --root "$runc_root" delete --force "$id" 2>/dev/null || true
        done
    done
    # Container shims run in process groups of their own, each started with the address of this
    # node's containerd (recorded in its configuration): those, and no other process.
    local p cmd sock="$dir/node/run/containerd.sock"
    for p in /proc/[0-9]*; do
        cmd=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
        case "$cmd" in
            *containerd-shim-runc-v2\ *"-address $sock "*) kill -KILL "${p#/proc/}" 2>/dev/null || true ;;
        esac
    done
    # The node's namespace (the mounts made in it go with it once nothing runs in it), then mounts
    # made under the scratch folder on the host, deepest first.
    umount "$dir/node/ns/mnt" 2>/dev/null || true
    umount "$dir/node/ns" 2>/dev/null || true
    if [ -d "$dir/node" ]; then
        { grep -o " $dir/node/[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    fi
    # The pods' bridge (their veths went with their namespaces).
    ip link del "$bridge" 2>/dev/null || true
    ip link del "$service_link" 2>/dev/null || true
    log "stopped (logs kept in $dir/logs)"
}

case "$cmd" in
    up) up ;;
    node) node ;;
    restart-kubelet) restart_kubelet ;;
    address) echo "$node_ip:$port" ;;
    import) shift 2; for f in "$@"; do import_image "$f"; done ;;
    down) down ;;
    *) log "unknown command '$cmd': up, node, restart-kubelet, address, import or down"; exit 2 ;;
esac

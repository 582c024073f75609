# shellcheck shell=bash
# The end-to-end test's stage with the real Kueue, sourced by e2e.sh after the real HAMi stage's
# scheduler is up (its helpers and variables, as for stage-hami.sh). Kueue v0.17.0's manager (built by
# tools.sh from its Go module) runs in-cluster as its own chart deploys it, its webhooks' certificates
# made by itself (internalCertManagement); a ClusterQueue's quota covers HAMi's resources. Kueue sums
# requests per pod, and HAMi's nvidia.com/gpumem and nvidia.com/gpucores are per GPU, so the
# configuration multiplies them by nvidia.com/gpu (resources.transformations[].multiplyBy, as Kueue's
# resource-transformer KEP shows for HAMi). Two Jobs whose sum exceeds the quota only with that
# multiplication: the second is admitted only once the first ends; HAMi places each, the agent holds
# each.

kueue_ns=kueue-system

# kueue_up [FEATURE-GATE] < RESOURCES: Kueue's manager from its chart, its configuration's
# `resources` section read from stdin, with a feature gate on where one is named; waited for until
# its webhook answers.
kueue_up() {
    local chart
    chart="$(cd tests/k8s/tools/kueue && go list -mod=readonly -m -f '{{.Dir}}' sigs.k8s.io/kueue)/charts/kueue"
    local k_libs gates=()
    mapfile -t k_libs < <(image_libs "$bin/kueue")
    tests/k8s/oci-image.py --ref vgpu.test/kueue:e2e --out "$dir/images/kueue.tar" --entrypoint /manager \
        "${k_libs[@]}" "$bin/kueue=/manager"
    tests/k8s/cluster.sh import "$dir" "$dir/images/kueue.tar"
    cat >"$dir/kueue-config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
health:
  healthProbeBindAddress: :8081
metrics:
  bindAddress: :8443
webhook:
  port: 9443
leaderElection:
  leaderElect: false
integrations:
  frameworks: ["batch/job"]
$(cat)
EOF
    [ -z "${1:-}" ] || gates=(--set "controllerManager.featureGates[0].name=$1" --set "controllerManager.featureGates[0].enabled=true")
    "$H" template kueue "$chart" -n "$kueue_ns" \
        --set controllerManager.manager.image.repository=vgpu.test/kueue --set controllerManager.manager.image.tag=e2e \
        --set controllerManager.manager.image.pullPolicy=Never \
        --set controllerManager.manager.podSecurityContext.runAsUser=65532 "${gates[@]}" \
        --set-file managerConfig.controllerManagerConfigYaml="$dir/kueue-config.yaml" \
        >"$dir/kueue.yaml" || fail "helm template of Kueue's chart"
    echo "  Kueue's chart: $(grep -c '^kind:' "$dir/kueue.yaml") objects${1:+, feature gate $1}"
    "$K" create namespace "$kueue_ns" >/dev/null
    "$K" apply --server-side -f "$dir/kueue.yaml" >"$dir/logs/kueue-apply.log" 2>&1 ||
        { tail -20 "$dir/logs/kueue-apply.log"; fail "kubectl apply of Kueue's chart"; }
    in_cluster "$kueue_ns"
    # Its webhook answers once its certificate is made: a Job for a queue, in a server-side dry run,
    # comes back suspended.
    kueue_webhook_up() {
        "$K" -n e2e create --dry-run=server -o jsonpath='{.spec.suspend}' -f - <<EOF | grep -qx true
apiVersion: batch/v1
kind: Job
metadata: {name: kueue-probe, labels: {kueue.x-k8s.io/queue-name: gpu}}
spec:
  template:
    spec:
      restartPolicy: Never
      containers: [{name: c, image: vgpu.test/gpu-probe:e2e}]
EOF
    }
    wait_until 120 "Kueue's webhook answering (a dry-run Job suspended)" kueue_webhook_up
}

# kueue_down: Kueue removed, its aggregated visibility API with it (later stages' Helm reads
# discovery), and the namespace gone before another install.
kueue_down() {
    "$K" delete localqueue -n e2e gpu --wait=false >/dev/null 2>&1 || true
    "$K" delete clusterqueue gpu --wait=false >/dev/null 2>&1 || true
    "$K" delete -f "$dir/kueue.yaml" --wait=true --timeout=90s >/dev/null 2>&1 || true
    "$K" delete namespace "$kueue_ns" --wait=true --timeout=90s >/dev/null 2>&1 || true
    # Its CRDs go after their objects (a finalizer): a later install must not meet them terminating
    # ("create not allowed while custom resource definition is terminating", seen in CI).
    kueue_crds_gone() { ! "$K" get crd -o name | grep -q 'kueue.x-k8s.io'; }
    wait_until 180 "Kueue's CRDs removed" kueue_crds_gone
}

# kueue_order A B WHY: which of two Jobs made in the same second Kueue admits first (it orders by
# creation time, which does not tell them apart), in $first, the other in $second, which must then
# wait (WHY: what admitting both would mean).
kueue_order() {
    admitted() { [ "$("$K" -n e2e get job "$1" -o jsonpath='{.spec.suspend}')" = false ]; }
    one_admitted() { admitted "$1" || admitted "$2"; }
    wait_until 60 "Kueue admitting $1 or $2" one_admitted "$1" "$2"
    first=$1 second=$2
    admitted "$1" || { first=$2; second=$1; }
    sleep 3
    ! admitted "$second" || fail "Kueue admitted $second beside $first: $3"
    echo "  $first admitted; $second waits ($("$K" -n e2e get workloads -o jsonpath='{range .items[*]}{.metadata.name}: {.status.conditions[?(@.type=="QuotaReserved")].reason}; {end}'))"
}

# kueue_queue RESOURCE=QUOTA...: the ClusterQueue `gpu` (a flavor `default`, cpu and memory
# besides these) and its LocalQueue in e2e.
kueue_queue() {
    local names="" quotas="" r
    for r in "$@"; do
        names+=", ${r%%=*}"
        quotas+=$'\n'"            - {name: ${r%%=*}, nominalQuota: \"${r#*=}\"}"
    done
    "$K" apply -f - >/dev/null <<EOF
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: default}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: gpu}
spec:
  namespaceSelector: {}
  resourceGroups:
    - coveredResources: [cpu, memory$names]
      flavors:
        - name: default
          resources:
            - {name: cpu, nominalQuota: "4"}
            - {name: memory, nominalQuota: 8Gi}$quotas
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: gpu, namespace: e2e}
spec: {clusterQueue: gpu}
EOF
}

# kueue_job NAME RESOURCES [POD-LINES]: a Job for the LocalQueue gpu, one simulated-CUDA container
# of RESOURCES that runs a few seconds and ends (POD-LINES: more of its pod spec, indented 6).
kueue_job() {
    cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: batch/v1
kind: Job
metadata: {name: $1, namespace: e2e, labels: {kueue.x-k8s.io/queue-name: gpu}}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: 1${3:+
$3}
      containers:
$(cuda_container cuda "$2" \
        "gpu-probe info; gpu-probe spin --seconds 3; timeout 6 gpu-probe fill --chunk 104857600; true" | sed 's/^/    /')
$(sim_volume | sed 's/^/    /')
EOF
}

# kueue_pair A B WHY CHECK: Jobs A and B, made together, one admitted and the other waiting until
# it ends (kueue_order); CHECK POD then checks each one's pod.
kueue_pair() {
    local first second j pod
    kueue_order "$1" "$2" "$3"
    done_job() { [ "$("$K" -n e2e get job "$1" -o jsonpath='{.status.succeeded}')" = 1 ]; }
    job_pod() { "$K" -n e2e get pods -l "job-name=$1" -o jsonpath='{.items[0].metadata.name}' | grep . >/dev/null; }
    for j in "$first" "$second"; do
        [ "$j" = "$first" ] || wait_until 60 "Kueue admitting $second once $first ended" admitted "$j"
        wait_until 60 "$j's pod" job_pod "$j"
        pod=$("$K" -n e2e get pods -l "job-name=$j" -o jsonpath='{.items[0].metadata.name}')
        "$4" "$pod"
        wait_until 60 "$j completed" done_job "$j"
    done
    echo "  $second admitted after $first ended; each held"
}

stage_kueue_real() {
    stage "Kueue, real: Kueue $(cd tests/k8s/tools/kueue && go list -mod=readonly -m -f '{{.Version}}' sigs.k8s.io/kueue)'s manager from its chart; a quota over HAMi's resources"
    kueue_up <<EOF
resources:
  transformations:
    - {input: nvidia.com/gpumem, strategy: Replace, multiplyBy: nvidia.com/gpu, outputs: {nvidia.com/gpumem: "1"}}
    - {input: nvidia.com/gpucores, strategy: Replace, multiplyBy: nvidia.com/gpu, outputs: {nvidia.com/gpucores: "1"}}
EOF
    kueue_queue nvidia.com/gpu=4 nvidia.com/gpumem=1536 nvidia.com/gpucores=200
    echo "  ClusterQueue gpu: nvidia.com/gpumem 1536 (MiB, per GPU x GPUs), nvidia.com/gpucores 200"

    stage "Kueue, real: two Jobs of 2 GPUs x 512 MiB: the second admitted only when the first ends"
    local j
    for j in kueue-a kueue-b; do
        kueue_job "$j" "{requests: {cpu: 100m, memory: 64Mi}, limits: {nvidia.com/gpu: 2, nvidia.com/gpumem: 512, nvidia.com/gpucores: 20}}"
    done
    held_512() { held "$1" $((512 << 20)) 20; }
    kueue_pair kueue-a kueue-b "2 x 1024 MiB counted within 1536 (no multiplyBy?)" held_512
    "$K" -n e2e delete job kueue-a kueue-b --wait=true --timeout=60s >/dev/null
    kueue_down
}

# The same with DRA (after e2e.sh's DRA stages, the agent a DRA driver): behind Kueue's
# DynamicResourceAllocation gate, a ClusterQueue's quota counts devices of the DeviceClass
# vgpu-share (resources.deviceClassMappings); two Jobs of one claim each on a quota of one: the
# second admitted only once the first ends, each held by the agent to the share it was allocated.
stage_kueue_dra() {
    stage "Kueue, real, with DRA: a quota of one vgpu-share device, two Jobs of one claim each"
    kueue_up DynamicResourceAllocation <<EOF
resources:
  deviceClassMappings:
    - {name: vgpu.io/share, deviceClassNames: [vgpu-share]}
EOF
    kueue_queue vgpu.io/share=1
    "$K" apply -f - >/dev/null <<EOF
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: share, namespace: e2e}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: vgpu-share, allocationMode: ExactCount, count: 1}
EOF
    echo "  ClusterQueue gpu: vgpu.io/share 1 (devices of the DeviceClass vgpu-share)"
    local j
    for j in kueue-dra-a kueue-dra-b; do
        kueue_job "$j" "{requests: {cpu: 100m, memory: 64Mi}, claims: [{name: gpu}]}" \
            "      resourceClaims: [{name: gpu, resourceClaimTemplateName: share}]"
    done
    # held to the share its claim (made from the template) was allocated.
    held_claimed() {
        pod_claimed() { [ -n "$("$K" -n e2e get pod "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}')" ]; }
        wait_until 60 "$1's claim made from the template" pod_claimed "$1"
        local claim limit cores
        claim=$("$K" -n e2e get pod "$1" -o jsonpath='{.status.resourceClaimStatuses[0].resourceClaimName}')
        claim_allocated() { [ -n "$("$K" -n e2e get resourceclaim "$1" -o jsonpath='{.status.allocation}')" ]; }
        wait_until 60 "$claim allocated by kube-scheduler" claim_allocated "$claim"
        read -r limit cores < <(claim_share "$claim")
        held "$1" "$limit" "$cores"
    }
    kueue_pair kueue-dra-a kueue-dra-b "two devices within a quota of one" held_claimed
    "$K" -n e2e delete job kueue-dra-a kueue-dra-b --wait=true --timeout=60s >/dev/null
    "$K" -n e2e delete resourceclaimtemplate share >/dev/null
    kueue_down
}

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

stage_kueue_real() {
    local chart
    chart="$(cd tests/k8s/tools/kueue && go list -mod=readonly -m -f '{{.Dir}}' sigs.k8s.io/kueue)/charts/kueue"
    stage "Kueue, real: Kueue $(cd tests/k8s/tools/kueue && go list -mod=readonly -m -f '{{.Version}}' sigs.k8s.io/kueue)'s manager from its chart; a quota over HAMi's resources"
    local k_libs
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
resources:
  transformations:
    - {input: nvidia.com/gpumem, strategy: Replace, multiplyBy: nvidia.com/gpu, outputs: {nvidia.com/gpumem: "1"}}
    - {input: nvidia.com/gpucores, strategy: Replace, multiplyBy: nvidia.com/gpu, outputs: {nvidia.com/gpucores: "1"}}
EOF
    "$H" template kueue "$chart" -n "$kueue_ns" \
        --set controllerManager.manager.image.repository=vgpu.test/kueue --set controllerManager.manager.image.tag=e2e \
        --set controllerManager.manager.image.pullPolicy=Never \
        --set controllerManager.manager.podSecurityContext.runAsUser=65532 \
        --set-file managerConfig.controllerManagerConfigYaml="$dir/kueue-config.yaml" \
        >"$dir/kueue.yaml" || fail "helm template of Kueue's chart"
    echo "  Kueue's chart: $(grep -c '^kind:' "$dir/kueue.yaml") objects"
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
    - coveredResources: [cpu, memory, nvidia.com/gpu, nvidia.com/gpumem, nvidia.com/gpucores]
      flavors:
        - name: default
          resources:
            - {name: cpu, nominalQuota: "4"}
            - {name: memory, nominalQuota: 8Gi}
            - {name: nvidia.com/gpu, nominalQuota: "4"}
            - {name: nvidia.com/gpumem, nominalQuota: "1536"}
            - {name: nvidia.com/gpucores, nominalQuota: "200"}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: gpu, namespace: e2e}
spec: {clusterQueue: gpu}
EOF
    echo "  ClusterQueue gpu: nvidia.com/gpumem 1536 (MiB, per GPU x GPUs), nvidia.com/gpucores 200"

    stage "Kueue, real: two Jobs of 2 GPUs x 512 MiB: the second admitted only when the first ends"
    local j
    for j in kueue-a kueue-b; do
        cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: batch/v1
kind: Job
metadata: {name: $j, namespace: e2e, labels: {kueue.x-k8s.io/queue-name: gpu}}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: 1
      containers:
$(cuda_container cuda "{requests: {cpu: 100m, memory: 64Mi}, limits: {nvidia.com/gpu: 2, nvidia.com/gpumem: 512, nvidia.com/gpucores: 20}}" \
        "gpu-probe info; gpu-probe spin --seconds 3; timeout 6 gpu-probe fill --chunk 104857600; true" | sed 's/^/    /')
$(sim_volume | sed 's/^/    /')
EOF
    done
    admitted() { [ "$("$K" -n e2e get job "$1" -o jsonpath='{.spec.suspend}')" = false ]; }
    wait_until 60 "Kueue admitting kueue-a" admitted kueue-a
    sleep 3
    admitted kueue-b && fail "Kueue admitted kueue-b beside kueue-a: 2 x 1024 MiB counted within 1536 (no multiplyBy?)"
    echo "  kueue-a admitted; kueue-b waits ($("$K" -n e2e get workloads -o jsonpath='{range .items[*]}{.metadata.name}: {.status.conditions[?(@.type=="QuotaReserved")].reason}; {end}'))"
    local pod
    pod=$("$K" -n e2e get pods -l job-name=kueue-a -o jsonpath='{.items[0].metadata.name}')
    held "$pod" $((512 << 20)) 20
    done_job() { [ "$("$K" -n e2e get job "$1" -o jsonpath='{.status.succeeded}')" = 1 ]; }
    wait_until 60 "kueue-a completed" done_job kueue-a
    wait_until 60 "Kueue admitting kueue-b once kueue-a ended" admitted kueue-b
    pod=$("$K" -n e2e get pods -l job-name=kueue-b -o jsonpath='{.items[0].metadata.name}')
    held "$pod" $((512 << 20)) 20
    echo "  kueue-b admitted after kueue-a ended, held alike"
    "$K" -n e2e delete job kueue-a kueue-b --wait=true --timeout=60s >/dev/null
    # Kueue removed, its aggregated visibility API with it (the later stages' Helm reads discovery).
    "$K" delete localqueue -n e2e gpu --wait=false >/dev/null
    "$K" delete clusterqueue gpu --wait=false >/dev/null
    "$K" delete -f "$dir/kueue.yaml" --wait=true --timeout=90s >/dev/null 2>&1 || true
}

# shellcheck shell=bash
# The end-to-end test's stage with the real Volcano scheduler, sourced by e2e.sh (its helpers and
# variables, as for stage-hami.sh). Volcano v1.15.1's vc-scheduler (its deviceshare plugin with
# vGPU on) and vc-controller-manager (queues' state, vcjobs' pods and podgroups), built from its
# released source by peers.sh, run in-cluster as Volcano's own chart deploys them; the agent, in
# Volcano mode with Volcano's device configuration, is the node side. A vcjob of two vGPU pods (a
# gang: both or neither) is placed by Volcano and each pod held to what Volcano wrote, its memory in
# the configuration's unit.
#
# vc-webhook-manager (Volcano's admission: vcjobs', podgroups' and queues' defaults and validation)
# runs too; its chart's init job, which makes the webhook's serving certificate with a script in
# Volcano's image, is the one object left out: the test makes that certificate (as for HAMi), and the
# webhook manager puts its CA in its webhooks' configurations itself. Stand-ins as for HAMi: the `kubernetes` Service alone, images built
# from the binaries.

volcano_ns=volcano-system

stage_volcano_real() {
    stage "Volcano, real: vc-scheduler (deviceshare, vGPU on) and vc-controller-manager from Volcano's chart"
    "$K" create namespace "$volcano_ns" >/dev/null
    local vc_libs name
    mapfile -t vc_libs < <(image_libs "$peers/bin/vc-scheduler" "$peers/bin/vc-controller-manager" "$peers/bin/vc-webhook-manager")
    for name in vc-scheduler vc-controller-manager vc-webhook-manager; do
        tests/k8s/oci-image.py --ref "vgpu.test/$name:e2e" --out "$dir/images/$name.tar" \
            --entrypoint "/usr/local/bin/$name" "${vc_libs[@]}" "$peers/bin/$name=/usr/local/bin/$name"
    done
    tests/k8s/cluster.sh import "$dir" "$dir/images/vc-scheduler.tar" "$dir/images/vc-controller-manager.tar" \
        "$dir/images/vc-webhook-manager.tar"
    # The admission webhook's serving certificate, as the chart's init job would make it.
    local pki=$dir/pki-volcano
    serving_cert "$pki" volcano-admission "DNS:volcano-admission-service.$volcano_ns.svc"
    "$K" -n "$volcano_ns" create secret generic volcano-admission-secret --from-file=tls.crt="$pki/tls.crt" \
        --from-file=tls.key="$pki/tls.key" --from-file=ca.crt="$pki/ca.crt" >/dev/null
    # The scheduler's configuration: Volcano's default tiers with deviceshare's vGPU on, as Volcano's
    # vGPU guide documents it; its device configuration where deviceshare reads it (kube-system).
    cat >"$dir/volcano-scheduler.conf" <<EOF
actions: "enqueue, allocate, backfill"
tiers:
- plugins:
  - name: priority
  - name: gang
    enablePreemptable: false
  - name: conformance
- plugins:
  - name: drf
    enablePreemptable: false
  - name: deviceshare
    arguments:
      deviceshare.VGPUEnable: true
  - name: predicates
  - name: proportion
  - name: nodeorder
  - name: binpack
EOF
    "$K" -n kube-system create configmap volcano-vgpu-device-config \
        --from-literal=device-config.yaml="$(printf 'nvidia:\n  resourceCountName: volcano.sh/vgpu-number\n  resourceMemoryName: volcano.sh/vgpu-memory\n  resourceCoreName: volcano.sh/vgpu-cores\n  gpuMemoryFactor: 4\n')" >/dev/null
    "$H" template volcano "$peers/volcano/installer/helm/chart/volcano" -n "$volcano_ns" \
        --set basic.image_registry=vgpu.test --set basic.image_tag_version=e2e --set basic.image_pull_policy=Never \
        --set basic.scheduler_image_name=vc-scheduler --set basic.controller_image_name=vc-controller-manager \
        --set basic.admission_image_name=vc-webhook-manager \
        --set-file custom.scheduler_config_override="$dir/volcano-scheduler.conf" \
        >"$dir/volcano.yaml" || fail "helm template of Volcano's chart"
    # Less its admission init job (the certificate is made above).
    python3 - "$dir/volcano.yaml" <<'EOF'
import re, sys
docs = re.split(r"^---\s*$", open(sys.argv[1]).read(), flags=re.M)
keep = [d for d in docs if not re.search(r"^kind:\s*Job\s*$", d, re.M)]
open(sys.argv[1], "w").write("---".join(keep))
EOF
    echo "  Volcano's chart: $(grep -c '^kind:' "$dir/volcano.yaml") objects (its admission init job left out)"
    "$K" apply --server-side -f "$dir/volcano.yaml" >"$dir/logs/volcano-apply.log" 2>&1 ||
        { tail -20 "$dir/logs/volcano-apply.log"; fail "kubectl apply of Volcano's chart"; }
    in_cluster "$volcano_ns"
    queue_open() { [ "$("$K" get queue default -o jsonpath='{.status.state}')" = Open ]; }
    wait_until 60 "the default Queue (vc-scheduler makes it) Open (vc-controller-manager sets it)" queue_open
    # vc-scheduler builds a node's vGPU devices only on a node event after its plugin came on: the
    # agent's next handshake (every 30 s) is one. Until then it would bind vGPU pods without devices.
    local shake
    shake=$(annotation node "$node" "" volcano.sh/node-vgpu-handshake)
    [ -n "$shake" ] || fail "the agent writes no volcano.sh/node-vgpu-handshake"
    shaken() { [ "$(annotation node "$node" "" volcano.sh/node-vgpu-handshake)" != "$shake" ]; }
    wait_until 60 "the agent's next handshake (a node event for vc-scheduler)" shaken
    # The admission webhook answers once vc-webhook-manager has put its CA in the configurations: a
    # vcjob without a queue, in a server-side dry run, comes back with the default one (its mutation).
    vc_webhook_up() {
        "$K" -n e2e create --dry-run=server -o jsonpath='{.spec.queue}' -f - <<EOF | grep -qx default
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata: {name: vc-probe}
spec:
  schedulerName: volcano
  tasks: [{name: t, replicas: 1, template: {spec: {containers: [{name: c, image: vgpu.test/gpu-probe:e2e}]}}}]
EOF
    }
    wait_until 90 "vc-webhook-manager's admission answering (a dry-run vcjob given the default queue)" vc_webhook_up
    echo "  $("$K" -n "$volcano_ns" get deployments -o name | tr '\n' ' ')available; Queue default Open; admission on"

    stage "Volcano, real: a vcjob of two vGPU pods (a gang), placed by Volcano, each held by the agent"
    cat <<EOF | "$K" apply -f - >/dev/null
apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata: {name: vc-gang, namespace: e2e}
spec:
  schedulerName: volcano
  queue: default
  minAvailable: 2
  tasks:
    - name: worker
      replicas: 2
      template:
        spec:
          restartPolicy: Never
          terminationGracePeriodSeconds: 1
          containers:
$(cuda_container cuda "limits: {volcano.sh/vgpu-number: 1, volcano.sh/vgpu-memory: 256, volcano.sh/vgpu-cores: 30}" | sed 's/^/        /')
$(sim_volume | sed 's/^/        /')
EOF
    vc_pods() { [ "$("$K" -n e2e get pods -l volcano.sh/job-name=vc-gang -o name | wc -l)" = 2 ]; }
    wait_until 60 "vc-controller-manager's two pods of vc-gang" vc_pods
    # vc_model POD: the model of the GPU Volcano gave the pod (its annotation, the register annotation).
    vc_model() {
        python3 - "$(annotation pod "$1" e2e volcano.sh/vgpu-ids-new)" \
            "$(annotation node "$node" "" volcano.sh/node-vgpu-register)" <<'EOF'
import sys
uuid = sys.argv[1].split(",")[0]
types = {d.split(",")[0]: d.split(",")[3] for d in sys.argv[2].split(":") if d.count(",") >= 5}
print("H100" if "H100" in types[uuid] else "A100")
EOF
    }
    local pod
    for pod in vc-gang-worker-0 vc-gang-worker-1; do
        vc_bound() { [ -n "$(annotation pod "$1" e2e volcano.sh/vgpu-ids-new)" ]; }
        wait_until 120 "Volcano's annotations on $pod" vc_bound "$pod"
        echo "  Volcano wrote on $pod: volcano.sh/vgpu-ids-new=$(annotation pod "$pod" e2e volcano.sh/vgpu-ids-new)"
        # 256 units of 4 MiB (gpuMemoryFactor: 4).
        held "$pod" $((1024 << 20)) 30 "$(vc_model "$pod")"
        [ "$(annotation pod "$pod" e2e volcano.sh/bind-phase)" = success ] ||
            fail "$pod's bind phase: $(annotation pod "$pod" e2e volcano.sh/bind-phase)"
    done
    "$K" -n e2e delete jobs.batch.volcano.sh vc-gang --wait=true --timeout=60s >/dev/null
    "$K" delete -f "$dir/volcano.yaml" --wait=false >/dev/null 2>&1 || true
    "$K" delete queue default --wait=false >/dev/null 2>&1 || true
    "$K" -n kube-system delete configmap volcano-vgpu-device-config >/dev/null
}

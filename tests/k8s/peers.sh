#!/usr/bin/env bash
# Builds the peer schedulers that the Kubernetes end-to-end test runs for real, from their released
# source (a `git archive` of each tag, kept in ../shared/peers beside the checkout with its
# SHA256SUMS; their Go modules are not served here, their dependencies are), once: a folder keyed by
# the tarballs' digests and this recipe is reused, and Go's module and build caches (their default
# places) make a rebuild fast. Test infrastructure only: nothing of theirs goes into the product.
#   tests/k8s/peers.sh      # builds if needed; prints the folder (bin/ and each peer's source)
# Exit 3 (and a line saying so) when the peers' source is not there: the stages that need them are
# skipped, unless the caller makes that a failure (.ci/run does, with VGPU_REQUIRE_PEERS=1).
# VGPU_PEERS_SRC: the tarballs' folder (default ../shared/peers); VGPU_K8S_TOOLS: where the keyed
# folders live (default ~/.cache/vgpu/k8s-tools, beside the Kubernetes tools).
#
# | peer | version | built |
# | HAMi | v2.10.0 (4707fb0) | cmd/scheduler (extender and mutating webhook); its chart, charts/hami |
# | Volcano | v1.15.1 (0a56ed3) | cmd/scheduler (vc-scheduler, deviceshare inside), cmd/controller-manager, cmd/webhook-manager; its chart, installer/helm/chart/volcano |
# | KAI Scheduler | v0.13.0 (5d35eca) | cmd/ operator, scheduler, binder, admission, podgrouper, podgroupcontroller, queuecontroller, resourcereservation (NVML through cgo); its chart, deployments/kai-scheduler |
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${VGPU_PEERS_SRC:-$here/../../../shared/peers}
if [ ! -f "$src/SHA256SUMS" ]; then
    echo "peers.sh: no peer source at $src (../shared/peers beside the checkout, or VGPU_PEERS_SRC)" >&2
    exit 3
fi
src=$(cd "$src" && pwd)
command -v go >/dev/null || { echo "peers.sh: Go is required (https://go.dev/dl/; 1.26.6 or later)" >&2; exit 1; }
(cd "$src" && sha256sum --quiet -c SHA256SUMS) >&2 || { echo "peers.sh: $src does not match its SHA256SUMS" >&2; exit 1; }
key=$(cat "$src/SHA256SUMS" "$here/peers.sh" | sha256sum | cut -c1-16)
root=${VGPU_K8S_TOOLS:-$HOME/.cache/vgpu/k8s-tools}
out="$root/peers-$key"
if [ -f "$out/.complete" ]; then
    echo "$out"
    exit 0
fi
rm -rf "$out.partial"
mkdir -p "$out.partial/bin"

# unpack TARBALL NAME: the source into NAME/ (the archive's single top folder, renamed).
unpack() {
    mkdir -p "$out.partial/$2.tmp"
    tar -xzf "$src/$1" -C "$out.partial/$2.tmp"
    mv "$out.partial/$2.tmp"/* "$out.partial/$2"
    rmdir "$out.partial/$2.tmp"
}

start=$SECONDS
echo "peers.sh: building HAMi's scheduler (cmd/scheduler of $(ls "$src" | grep '^hami-'))" >&2
unpack hami-v2.10.0-4707fb0.tar.gz hami
hami_version=$(cat "$out.partial/hami/VERSION")
# As HAMi's Makefile builds it (its version in the binary); -mod=readonly: its go.sum is the truth.
(cd "$out.partial/hami" && go build -mod=readonly -o "$out.partial/bin/hami-scheduler" \
    -ldflags "-s -w -X github.com/Project-HAMi/HAMi/pkg/version.version=$hami_version \
        -X github.com/Project-HAMi/HAMi/pkg/version.revision=4707fb0" ./cmd/scheduler) >&2
echo "peers.sh: HAMi $hami_version built in $((SECONDS - start)) s" >&2

start=$SECONDS
echo "peers.sh: building Volcano's scheduler, controller manager and webhook manager ($(ls "$src" | grep '^volcano-'))" >&2
unpack volcano-v1.15.1.tar.gz volcano
# As Volcano's Makefile builds them (CGO off, its version in the binary).
vc_flags="-s -w -X volcano.sh/volcano/pkg/version.Version=v1.15.1 -X volcano.sh/volcano/pkg/version.GitSHA=0a56ed331897f5455916a44d3075671376d731d6"
(cd "$out.partial/volcano" && CGO_ENABLED=0 go build -mod=readonly -ldflags "$vc_flags" \
    -o "$out.partial/bin/vc-scheduler" ./cmd/scheduler &&
    CGO_ENABLED=0 go build -mod=readonly -ldflags "$vc_flags" -o "$out.partial/bin/vc-controller-manager" \
        ./cmd/controller-manager &&
    CGO_ENABLED=0 go build -mod=readonly -ldflags "$vc_flags" -o "$out.partial/bin/vc-webhook-manager" \
        ./cmd/webhook-manager) >&2
echo "peers.sh: Volcano v1.15.1 built in $((SECONDS - start)) s" >&2

start=$SECONDS
echo "peers.sh: building KAI Scheduler's operator and the seven images it deploys ($(ls "$src" | grep '^kai-'))" >&2
unpack kai-scheduler-v0.13.0.tar.gz kai
# As KAI's Makefile builds them (its version in the binaries); CGO off but for the reservation
# pod's binary, which reads the GPU's UUID through NVML (go-nvml loads the driver's library).
kai_flags="-s -w -X github.com/NVIDIA/KAI-scheduler/pkg/scheduler/version.gitVersion=v0.13.0 \
    -X github.com/NVIDIA/KAI-scheduler/pkg/scheduler/version.gitCommit=5d35ecab74e693d6f40309d2e23a68b8ac138571"
mkdir -p "$out.partial/bin/kai"
for c in operator scheduler binder admission podgrouper podgroupcontroller queuecontroller resourcereservation; do
    cgo=0
    [ "$c" = resourcereservation ] && cgo=1
    (cd "$out.partial/kai" && CGO_ENABLED=$cgo go build -mod=readonly -buildvcs=false -ldflags "$kai_flags" \
        -o "$out.partial/bin/kai/$c" "./cmd/$c") >&2
done
echo "peers.sh: KAI Scheduler v0.13.0 built in $((SECONDS - start)) s" >&2

touch "$out.partial/.complete"
rm -rf "$out"
mv "$out.partial" "$out"
# Only the current build is kept.
find "$root" -mindepth 1 -maxdepth 1 -type d -name 'peers-*' ! -name "peers-$key" -exec rm -rf {} +
echo "$out"

#!/usr/bin/env bash
# Builds the real Kubernetes components, etcd, Helm, containerd and Kueue from their Go modules (the
# versions pinned in tests/k8s/tools/*/go.mod), with CNI's plugins and the pause process, into one folder, once: a folder keyed by the go.mod
# and go.sum files is reused, and Go's own module and build caches (their default places) make a
# rebuild after a version change fast. Test infrastructure only: nothing here goes into the product.
#   tests/k8s/tools.sh            # builds if needed; prints the folder
# VGPU_K8S_TOOLS: where the keyed folders live (default ~/.cache/vgpu/k8s-tools).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

command -v go >/dev/null || { echo "tools.sh: Go is required (https://go.dev/dl/; 1.26 or later)" >&2; exit 1; }
# The pins and this recipe make the key: a change to either builds anew.
key=$(cat "$here"/tools/*/go.mod "$here"/tools/*/go.sum "$here/tools.sh" | sha256sum | cut -c1-16)
root=${VGPU_K8S_TOOLS:-$HOME/.cache/vgpu/k8s-tools}
bin="$root/$key"
if [ -f "$bin/.complete" ]; then
    echo "$bin"
    exit 0
fi
mkdir -p "$bin.partial"
# Kubernetes' binaries carry their version, as its release build sets it (hack/lib/version.sh):
# `kubectl version` and every client that reads the API server's version (Kueue, the peers'
# schedulers) need it; without it they see v0.0.0-master.
k8s_version() {
    local v
    v=$(cd "$here/tools/kubernetes" && go list -mod=readonly -m -f '{{.Version}}' k8s.io/kubernetes)
    local major=${v#v}
    major=${major%%.*}
    local minor=${v#v*.}
    minor=${minor%%.*}
    local flags="" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        flags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    echo "$flags"
}
for module in kubernetes etcd helm containerd cni kueue; do
    start=$SECONDS
    echo "tools.sh: building $module (go build tool in tests/k8s/tools/$module)" >&2
    flags='-s -w'
    [ "$module" = kubernetes ] && flags+=$(k8s_version)
    # -mod=readonly: the committed go.mod and go.sum are the whole truth; a module that would change
    # them is an error, never a silent upgrade. -s -w: no symbol tables (smaller, faster to link).
    (cd "$here/tools/$module" && go build -mod=readonly -ldflags="$flags" -o "$bin.partial/" tool) >&2
    echo "tools.sh: $module built in $((SECONDS - start)) s" >&2
done
# etcd's server package is its command; its binary takes the package's name.
mv "$bin.partial/server" "$bin.partial/etcd"
# The CNI plugins in a folder of their own (containerd's bin_dirs).
mkdir -p "$bin.partial/cni"
mv "$bin.partial/bridge" "$bin.partial/loopback" "$bin.partial/host-local" "$bin.partial/cni/"
# The pod sandbox's pause process, from the C source in the same Kubernetes module (no registry
# holds an image for it here).
pause_src="$(cd "$here/tools/kubernetes" && go list -mod=readonly -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
cc -static -O2 -DVERSION=e2e -o "$bin.partial/pause" "$pause_src"
touch "$bin.partial/.complete"
rm -rf "$bin"
mv "$bin.partial" "$bin"
# Folders of earlier pins are half a gigabyte each: only the current one is kept.
find "$root" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -exec rm -rf {} +
echo "$bin"

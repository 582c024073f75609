#!/usr/bin/env bash
# Installs vgpu on a host without Kubernetes: the agent binary, libvgpu.so under a versioned name
# (never overwriting one that running containers may have mapped), the default configuration and the
# systemd unit.
#   scripts/install.sh [--destdir DIR] [--no-build] [--libvgpu PATH]
# Then: systemctl daemon-reload && systemctl enable --now vgpu-node-agent
set -euo pipefail
cd "$(dirname "$0")/.."
destdir="" build=1 lib=""
while [ $# -gt 0 ]; do
    case "$1" in
        --destdir) destdir=$2; shift 2 ;;
        --no-build) build=0; shift ;;
        --libvgpu) lib=$2; shift 2 ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ "$build" = 1 ]; then
    cargo build --release -q -p vgpu-node-agent -p vgpu-preload
fi
lib=${lib:-target/release/libvgpu.so}
for f in target/release/vgpu-node-agent target/release/vgpuctl target/release/vgpu-oci-hook "$lib"; do
    [ -f "$f" ] || { echo "error: $f is missing (build first, or pass --libvgpu)" >&2; exit 1; }
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
digest=$(sha256sum "$lib" | cut -c1-16)
libdir="$destdir/usr/local/lib/vgpu"
install -d "$destdir/usr/local/bin" "$libdir" "$destdir/etc/vgpu" "$destdir/etc/systemd/system" "$destdir/var/lib/vgpu"
install -m 0755 target/release/vgpu-node-agent "$destdir/usr/local/bin/vgpu-node-agent"
install -m 0755 target/release/vgpuctl "$destdir/usr/local/bin/vgpuctl"
install -m 0755 target/release/vgpu-oci-hook "$destdir/usr/local/bin/vgpu-oci-hook"
versioned="$libdir/libvgpu.so.$version.$digest"
if [ ! -e "$versioned" ]; then
    install -m 0755 "$lib" "$versioned.tmp.$$"
    mv "$versioned.tmp.$$" "$versioned"
fi
# The stable name points at the newest install; containers get the versioned file.
ln -sfn "libvgpu.so.$version.$digest" "$libdir/libvgpu.so.tmp.$$"
mv -T "$libdir/libvgpu.so.tmp.$$" "$libdir/libvgpu.so"
[ -e "$destdir/etc/vgpu/agent.toml" ] || install -m 0644 packaging/agent.toml "$destdir/etc/vgpu/agent.toml"
install -m 0644 packaging/systemd/vgpu-node-agent.service "$destdir/etc/systemd/system/vgpu-node-agent.service"
echo "installed: $destdir/usr/local/bin/vgpu-node-agent, $destdir/usr/local/bin/vgpuctl, $versioned, $destdir/etc/vgpu/agent.toml,"
echo "           $destdir/etc/systemd/system/vgpu-node-agent.service"
[ -n "$destdir" ] || echo "next: systemctl daemon-reload && systemctl enable --now vgpu-node-agent"

#!/usr/bin/env python3
"""Writes a one-layer OCI image archive from files on this machine, for `ctr images import`:
the end-to-end test's images (the pod sandbox's pause, the simulated-CUDA client), since no
registry can be reached.
  oci-image.py --ref NAME:TAG --out FILE.tar [--entrypoint ARG]... [--also NAME:TAG=PATH]...
      SRC=DEST[:MODE]...
--also: one more image in the archive, of the same layer (stored once), with PATH its entrypoint.
The layer is not compressed: the archive stays on this machine.
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile


def blob(files, data):
    digest = hashlib.sha256(data).hexdigest()
    files[f"blobs/sha256/{digest}"] = data
    return {"digest": f"sha256:{digest}", "size": len(data)}


def layer(entries):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = set()
        for src, dest, mode in entries:
            parts = dest.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
            with open(src, "rb") as f:
                data = f.read()
            info = tarfile.TarInfo(dest.strip("/"))
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", required=True, help="the image's name, e.g. docker.io/library/x:e2e")
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--also", action="append", default=[], metavar="NAME:TAG=PATH")
    ap.add_argument("files", nargs="+", metavar="SRC=DEST[:MODE]")
    a = ap.parse_args()
    entries = []
    for spec in a.files:
        if "=" not in spec:
            sys.exit(f"oci-image.py: '{spec}' is not SRC=DEST[:MODE]")
        src, dest = spec.split("=", 1)
        mode = 0o755
        if ":" in dest:
            dest, m = dest.rsplit(":", 1)
            mode = int(m, 8)
        if not os.path.isfile(src):
            sys.exit(f"oci-image.py: no file {src}")
        entries.append((src, dest, mode))
    files = {}
    diff = layer(entries)
    layer_desc = blob(files, diff)
    layer_desc["mediaType"] = "application/vnd.oci.image.layer.v1.tar"
    images = [(a.ref, a.entrypoint)]
    for also in a.also:
        if "=" not in also:
            sys.exit(f"oci-image.py: --also '{also}' is not NAME:TAG=PATH")
        ref, path = also.split("=", 1)
        images.append((ref, [path]))
    manifests = []
    for ref, entrypoint in images:
        config = {
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
            "os": "linux",
            "config": {"Entrypoint": entrypoint or None, "Env": a.env or ["PATH=/usr/local/bin:/usr/bin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
        }
        config_desc = blob(files, json.dumps(config).encode())
        config_desc["mediaType"] = "application/vnd.oci.image.config.v1+json"
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": config_desc, "layers": [layer_desc]}
        manifest_desc = blob(files, json.dumps(manifest).encode())
        manifest_desc["mediaType"] = "application/vnd.oci.image.manifest.v1+json"
        manifest_desc["annotations"] = {"io.containerd.image.name": ref,
                                        "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]}
        manifests.append(manifest_desc)
    files["index.json"] = json.dumps({"schemaVersion": 2, "manifests": manifests}).encode()
    files["oci-layout"] = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
    with tarfile.open(a.out, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()

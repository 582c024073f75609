#!/usr/bin/env python3
"""Every `unsafe` block and `unsafe impl` in the product crates carries a `SAFETY:` comment that
states its invariant (within the six lines before it). Run by .ci/run; exits 1 listing offenders."""
import os
import re
import sys

ROOTS = ["vgpu-preload/src", "region/src", "node-agent/src", "mig-manager/src", "receiver/src", "cuda-abi/src", "proto/src"]
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
total, bad = 0, []
for root in ROOTS:
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            lines = open(path).read().split("\n")
            for i, line in enumerate(lines):
                if re.search(r"\bunsafe\s*\{", line) or re.search(r"\bunsafe impl\b", line):
                    total += 1
                    if "SAFETY" not in "\n".join(lines[max(0, i - 6) : i + 1]):
                        bad.append("%s:%d: %s" % (path, i + 1, line.strip()))
if bad:
    print("unsafe without a SAFETY comment:\n  " + "\n  ".join(bad))
    sys.exit(1)
print("ok: all %d unsafe blocks and impls carry a SAFETY comment" % total)

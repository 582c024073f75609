#!/usr/bin/env bash
# Build checks of a libvgpu.so: no glibc symbol newer than the baseline, no unexpected library
# dependency, exactly the hook symbols of vgpu-preload/src/api.rs (plus dlsym) exported, and the
# library's own references to them bound when it was linked (none left for the loader to look up).
#   scripts/check-libvgpu.sh PATH [GLIBC_BASELINE=2.17]
set -euo pipefail
cd "$(dirname "$0")/.."
lib=${1:?usage: check-libvgpu.sh PATH [baseline]}
baseline=${2:-2.17}
fail=0

newest=$(objdump -T "$lib" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
if [ "$(printf '%s\n%s\n' "$newest" "$baseline" | sort -V | tail -1)" != "$baseline" ]; then
    echo "FAIL: needs glibc $newest, newer than the $baseline baseline:"
    objdump -T "$lib" | grep -E "GLIBC_$newest" | awk '{print "  " $NF}'
    fail=1
else
    echo "ok: newest glibc symbol version is $newest (baseline $baseline)"
fi

allowed='^(libc\.so\.6|libdl\.so\.2|libpthread\.so\.0|libm\.so\.6|librt\.so\.1|libgcc_s\.so\.1|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1)$'
bad=$(readelf -d "$lib" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | grep -Ev "$allowed" || true)
if [ -n "$bad" ]; then
    echo "FAIL: unexpected shared-library dependencies: $bad"
    fail=1
else
    echo "ok: depends only on $(readelf -d "$lib" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ')"
fi

expected=$( (awk '/macro_rules! cuda_hooks/,/macro_rules! cuda_helpers/' vgpu-preload/src/api.rs \
    | grep -oE '^\s+(cu|nvml)[A-Za-z0-9_]+\(' | tr -d ' (' ; echo dlsym) | sort -u)
actual=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort -u)
if [ "$expected" != "$actual" ]; then
    echo "FAIL: exported symbols differ from the hook list (< expected, > exported):"
    diff <(echo "$expected") <(echo "$actual") | grep '^[<>]' | sed 's/^/  /'
    fail=1
else
    echo "ok: exports exactly the $(echo "$expected" | wc -l) hook symbols"
fi
# The hook tables hand out the hooks' addresses: bound at link time (vgpu-preload/build.rs), the
# loader looks none of them up by name, and a process's own `cu*` function is never handed out.
own=$(readelf -rW "$lib" | awk '$3 ~ /GLOB_DAT|JUMP_SLOT|R_X86_64_64|R_AARCH64_ABS64/ {print $5}' | sed 's/@.*//' \
    | grep -Fx -f <(echo "$expected") || true)
if [ -n "$own" ]; then
    echo "FAIL: $(echo "$own" | wc -l) references to the library's own hooks are left to the loader (first: $(echo "$own" | head -1))"
    fail=1
else
    echo "ok: the library's references to its own hooks are bound at link time"
fi
exit $fail

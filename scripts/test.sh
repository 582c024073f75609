#!/usr/bin/env bash
# The README's test command: every test of the workspace (`cargo test --workspace`, with any extra
# arguments). A check that cannot run on this machine (no root, runc, busybox, Prometheus or Helm)
# is listed at the end and counted as skipped, never as passed; set VGPU_REQUIRE_RUNC,
# VGPU_REQUIRE_PROMETHEUS and VGPU_REQUIRE_HELM (as CI does) to make those fail instead.
set -uo pipefail
cd "$(dirname "$0")/.."
skips=$(mktemp)
out=$(mktemp)
trap 'rm -f "$skips" "$out"' EXIT
export VGPU_SKIP_LOG=$skips
cargo test --workspace "$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
# libtest counts a test that returned early as passed: take the skipped ones out of that count.
read -r passed failed ignored < <(awk '/^test result:/ {
    for (i = 1; i <= NF; i++) {
        if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i
    } } END { print p + 0, f + 0, g + 0 }' "$out")
skipped=$(sort -u "$skips" | awk -F: '{print $1}' | sort -u | wc -l)
echo
echo "tests: $((passed - skipped)) passed, $skipped skipped (could not run here), $failed failed, $ignored ignored"
if [ "$skipped" -gt 0 ]; then
    echo "skipped, each with what it needs (tests/k8s/tools.sh builds Helm; .ci/run installs the rest):"
    sort -u "$skips" | sed 's/^/  /'
fi
if [ "$rc" != 0 ] && ! grep -q '^test result:' "$out"; then
    # The build itself failed. A linker's error comes after its whole command line, which can be
    # longer than what a CI log keeps: repeat the errors without it, and the room the build had.
    echo "the build failed; its errors, without the linker's command lines:"
    grep -E '^error|= note: |^(/usr/bin/)?ld|collect2|undefined reference' "$out" | grep -vE '= note: +"cc"' \
        | cut -c1-400 | head -40 | sed 's/^/  /'
    echo "room at the end of the build:"
    df -h . /tmp 2>/dev/null | sed 's/^/  /'
    free -m 2>/dev/null | sed 's/^/  /'
fi
exit "$rc"

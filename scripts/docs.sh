#!/usr/bin/env bash
# Builds the documentation site (mdBook, pinned) into target/book: docs/SUMMARY.md is its table of
# contents. mdBook is installed from crates.io into target/tools the first time (about 2 minutes on
# 2 cores). Links between the documents are checked by `cargo test` (node-agent/tests/packaging.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.5.4
tools=target/tools
mdbook=$tools/bin/mdbook
if ! [ -x "$mdbook" ] || [ "$("$mdbook" --version)" != "mdbook v$version" ]; then
    echo "installing mdbook $version into $tools" >&2
    cargo install mdbook --version "$version" --locked --root "$tools" >&2
fi
"$mdbook" build
echo "the site: target/book/index.html"

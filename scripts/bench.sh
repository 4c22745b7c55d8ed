#!/usr/bin/env bash
# Benchmarks on throwaway local servers; prints a Markdown table and writes BENCHMARKS.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh" --release
say "Running the benchmarks (about 55 minutes; nothing else should load the machine)"
cargo bench --quiet "${CARGO_FEATURES[@]}" --bench bench

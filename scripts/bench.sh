#!/usr/bin/env bash
# Benchmarks on throwaway local servers; prints a Markdown table and writes BENCHMARKS.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh" --release
# IDMP against markers needs Redis 8.6, which scripts/fetch-redis.sh fetches.
if [ -z "${OUTBOX_BENCH_REDIS8:-}" ]; then
  OUTBOX_BENCH_REDIS8="$("$REDIS_NEXT" redis | tail -n 1)"
  export OUTBOX_BENCH_REDIS8
fi
say "Running the benchmarks (about 55 minutes; nothing else should load the machine)"
cargo bench --quiet "${CARGO_FEATURES[@]}" --bench bench

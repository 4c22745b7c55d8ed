#!/usr/bin/env bash
# The whole test suite: lints, unit tests, and integration tests against real PostgreSQL and
# Redis servers that the tests start and stop themselves.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh"

say "Checking formatting (cargo fmt --check)"
cargo fmt --all -- --check
say "Linting (cargo clippy -D warnings)"
cargo clippy --all-targets -- -D warnings
say "Running unit and integration tests (each integration test starts its own servers)"
PG_CONFIG="$PG_CONFIG" cargo test -- --test-threads="${TEST_THREADS:-2}"

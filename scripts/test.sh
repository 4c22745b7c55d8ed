#!/usr/bin/env bash
# The whole test suite against one PostgreSQL (PG=16, or PG_CONFIG=...; Debian's 15 by
# default): lints, unit tests, and integration tests against real PostgreSQL and Redis servers
# that the tests start and stop themselves.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh"

say "Checking formatting (cargo fmt --check)"
cargo fmt --all -- --check
say "Linting for PostgreSQL $PG_MAJOR (cargo clippy -D warnings)"
cargo clippy --all-targets "${CARGO_FEATURES[@]}" -- -D warnings
say "Running unit and integration tests on PostgreSQL $PG_MAJOR (each integration test starts its own servers)"
cargo test "${CARGO_FEATURES[@]}" -- --test-threads="${TEST_THREADS:-2}"

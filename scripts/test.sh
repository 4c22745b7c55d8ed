#!/usr/bin/env bash
# The whole test suite against one PostgreSQL (PG=16, or PG_CONFIG=...; Debian's 15 by
# default): lints, unit tests, pg_regress and isolation specs, and integration tests against real
# PostgreSQL and Redis servers that the tests start and stop themselves (Debian's Redis 7.0; the
# other Redis servers too with REDIS_MATRIX=1). MAJOR_DEPENDENT_ONLY=1: what depends on the major.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh"

if [ "${MAJOR_DEPENDENT_ONLY:-}" = 1 ]; then
  # The matrix's other majors: the extension's code for this major, and what depends on the
  # major (MAJOR_TESTS in lib.sh). The integration tests' crate is the same for every major.
  # What differs between majors is under cfg(pg15) and cfg(any(pg18, pg19)): the first major and
  # the last lint every branch; the build above compiles this one's.
  if [ "$PG_MAJOR" = "${TESTED_MAJORS[-1]}" ]; then
    say "Linting the extension for PostgreSQL $PG_MAJOR (cargo clippy -D warnings)"
    cargo clippy -p outbox --lib "${CARGO_FEATURES[@]}" -- -D warnings
  else
    say "Not linting for PostgreSQL $PG_MAJOR: its branches are linted on ${TESTED_MAJORS[0]} and ${TESTED_MAJORS[-1]} (make lint PG=$PG_MAJOR lints it)"
  fi
  say "Running the integration tests that depend on the major on PostgreSQL $PG_MAJOR (${MAJOR_TESTS[*]}; the others ran on ${TESTED_MAJORS[0]})"
  cargo test -p outbox-tests "${MAJOR_TESTS[@]/#/--test=}" -- --test-threads="${TEST_THREADS:-2}"
else
  say "Checking formatting (cargo fmt --check)"
  cargo fmt --all -- --check
  say "Checking the Markdown links and anchors (scripts/check-links.py)"
  python3 "$here/check-links.py"
  say "Linting for PostgreSQL $PG_MAJOR (cargo clippy -D warnings)"
  cargo clippy --workspace --all-targets "${CARGO_FEATURES[@]}" -- -D warnings
  say "Running the unit tests: the extension's pure logic, the Redis side's (each starts its own redis-server) and the consumer's"
  cargo test -p outbox --lib "${CARGO_FEATURES[@]}" -- --test-threads="${TEST_THREADS:-2}"
  cargo test -p outbox-redis -p outbox-consumer -- --test-threads="${TEST_THREADS:-2}"
  say "Running the integration tests on PostgreSQL $PG_MAJOR (each starts its own servers)"
  cargo test -p outbox-tests -- --test-threads="${TEST_THREADS:-2}"
fi

say "The SQL surface in pg_regress and isolation specs (scripts/installcheck.sh)"
"$here/installcheck.sh"

# The Redis-facing tests again against the other servers the relay supports (the run above used
# Debian's Redis 7.0): Redis 6.2, Redis 8.6 (IDMP, ACKED trimming, XACKDEL) and Valkey 9.1,
# fetched by scripts/fetch-redis.sh. With REDIS_MATRIX=1: `make test` sets it for its first
# major, once per matrix.
if [ "${REDIS_MATRIX:-}" = 1 ]; then
  for server in redis6 redis valkey; do
    say "Fetching the $server server if it is not here yet ($REDIS_NEXT $server)"
    binary="$("$REDIS_NEXT" "$server" | tail -n 1)"
    [ -x "$binary" ] || die "$REDIS_NEXT $server gave no server program"
    say "The Redis-facing tests against $("$binary" --version | cut -d ' ' -f 1-3)"
    OUTBOX_TEST_REDIS_SERVER="$binary" cargo test -p outbox-redis -- --test-threads="${TEST_THREADS:-2}"
    OUTBOX_TEST_REDIS_SERVER="$binary" cargo test -p outbox-tests "${REDIS_FACING_TESTS[@]/#/--test=}" \
      -- --test-threads="${TEST_THREADS:-2}"
  done
elif [ "${MAJOR_DEPENDENT_ONLY:-}" != 1 ]; then
  say "Not running the Redis-facing tests against Redis 6.2, 8.6 and Valkey 9.1: make test runs them, or REDIS_MATRIX=1"
fi

# The Debian package, on Debian's own PostgreSQL: built, installed with dpkg -i where the build
# above was installed (the test removes those files first), used, and removed with dpkg -r. The
# debug build goes back in place afterwards.
if [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ] && is_root; then
  deb="$("$here/package.sh" | tail -n 1)"
  say "Installing $deb with dpkg, relaying an event, removing it with dpkg -r"
  OUTBOX_TEST_PACKAGE="$PWD/$deb" cargo test -p outbox-tests --test package -- --ignored
  "$here/install.sh"
elif [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ]; then
  say "Not testing the Debian package: installing it with dpkg needs root"
fi

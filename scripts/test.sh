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

# The Debian package, on Debian's own PostgreSQL, is tested at the end. Its release build takes
# minutes of one core, so it starts now, at the lowest priority, and uses what the lints and tests
# leave idle (cargo locks the debug and release builds separately). It runs in a session of its
# own, so that it can be stopped as a whole; where the kernel groups the CPU by session
# (autogroup), that session's group gets the lowest priority too, or it would get half the CPU.
package_build=""
if [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ] && is_root; then
  package_log="$(mktemp)"
  say "Building the Debian package meanwhile, at the lowest priority (scripts/package.sh, log in $package_log)"
  setsid sh -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null; exec nice -n 19 "$0"' "$here/package.sh" \
    >"$package_log" 2>&1 &
  package_build=$!
  trap 'kill -- -"$package_build" 2>/dev/null || true; rm -f "$package_log"' EXIT
fi

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
  say "Checking that the code imports in no circle, and the extension's folders only downward (scripts/import-cycles.py)"
  for crate in src crates/outbox-redis/src crates/outbox-consumer/src; do
    python3 "$here/import-cycles.py" "$crate" | tail -n +2
  done
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
    # The faults' fixed seeds ran on Debian's Redis; here, their random seed.
    OUTBOX_TEST_REDIS_SERVER="$binary" cargo test -p outbox-tests "${REDIS_FACING_TESTS[@]/#/--test=}" \
      -- --test-threads="${TEST_THREADS:-2}" --skip fixed_seed
  done
elif [ "${MAJOR_DEPENDENT_ONLY:-}" != 1 ]; then
  say "Not running the Redis-facing tests against Redis 6.2, 8.6 and Valkey 9.1: make test runs them, or REDIS_MATRIX=1"
fi

# The Debian package, on Debian's own PostgreSQL: built meanwhile (above), installed with dpkg -i
# where the debug build was installed (the test removes those files first), used, and removed with
# dpkg -r. The debug build goes back in place afterwards.
if [ -n "$package_build" ]; then
  say "Waiting for the Debian package's build"
  wait "$package_build" || { cat "$package_log"; die "scripts/package.sh failed (its output is above)"; }
  cat "$package_log"
  deb="$(tail -n 1 "$package_log")"
  say "Installing $deb with dpkg, relaying an event, removing it with dpkg -r"
  OUTBOX_TEST_PACKAGE="$PWD/$deb" cargo test -p outbox-tests --test package -- --ignored
  "$here/install.sh"
elif [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ]; then
  say "Not testing the Debian package: installing it with dpkg needs root"
fi

#!/usr/bin/env bash
# The test suite on every PostgreSQL major that is tested here (15 to 19), one after the
# other; each installs what it needs first. The first runs the whole suite and the Redis-facing
# tests against every Redis server; the others run what depends on the major (lib.sh's
# MAJOR_TESTS; the other tests run once). Builds share the target directory, so only the parts
# that differ between majors are compiled again. Ends with the tests counted over all majors.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for major in "${TESTED_MAJORS[@]}"; do
  if [ "$major" = "${TESTED_MAJORS[0]}" ]; then
    say "PostgreSQL $major: the whole suite, and the Redis-facing tests against every Redis server"
    PG="$major" PG_CONFIG="" REDIS_MATRIX=1 "$here/test.sh" 2>&1 | tee -a "$log"
  else
    say "PostgreSQL $major: what depends on the major"
    PG="$major" PG_CONFIG="" MAJOR_DEPENDENT_ONLY=1 "$here/test.sh" 2>&1 | tee -a "$log"
  fi
done
passed="$(grep -oE '^test result: [a-z]+\. [0-9]+ passed' "$log" | awk '{s += $4} END {print s + 0}')"
failed="$(grep -oE '; [0-9]+ failed' "$log" | awk '{s += $2} END {print s + 0}')"
say "All tests passed on PostgreSQL ${TESTED_MAJORS[*]}"
echo "$passed passed, $failed failed"

#!/usr/bin/env bash
# The whole test suite on every PostgreSQL major that is tested here (15, 16 and 18), one after
# the other; each installs what it needs first. Builds share the target directory, so only the
# parts that differ between majors are compiled again.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"

for major in "${TESTED_MAJORS[@]}"; do
  say "PostgreSQL $major: the whole suite"
  PG="$major" PG_CONFIG="" "$here/test.sh"
done
say "All tests passed on PostgreSQL ${TESTED_MAJORS[*]}"

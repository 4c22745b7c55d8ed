#!/usr/bin/env bash
# Builds the extension and installs it into the PostgreSQL that PG_CONFIG (or PG) names.
# Usage: scripts/install.sh [--release]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

profile=()
[ "${1:-}" = "--release" ] && profile=(--release)
sudo_flag=()
is_root || sudo_flag=(--sudo)
say "Building and installing the extension into PostgreSQL $PG_MAJOR, $("$PG_CONFIG" --pkglibdir) ${profile[*]:-(debug build)}"
cargo pgrx install "${profile[@]}" "${sudo_flag[@]}" "${CARGO_FEATURES[@]}" --pg-config "$PG_CONFIG" \
  2>&1 | grep -Ev '^\s*$' | tail -n 3

# The released versions' scripts, so that `CREATE EXTENSION outbox VERSION '0.1.0'` followed by
# `ALTER EXTENSION outbox UPDATE` works as it does for a user who upgrades.
extdir="$("$PG_CONFIG" --sharedir)/extension"
for released in sql/archive/outbox--*.sql; do
  as_root install -m 644 "$released" "$extdir/"
done

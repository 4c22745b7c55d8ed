#!/usr/bin/env bash
# Builds the extension and installs it into the system's PostgreSQL.
# Usage: scripts/install.sh [--release]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

profile=()
[ "${1:-}" = "--release" ] && profile=(--release)
sudo_flag=()
is_root || sudo_flag=(--sudo)
say "Building and installing the extension into $("$PG_CONFIG" --pkglibdir) ${profile[*]:-(debug build)}"
cargo pgrx install "${profile[@]}" "${sudo_flag[@]}" --pg-config "$PG_CONFIG" 2>&1 | grep -Ev '^\s*$' | tail -n 3

#!/usr/bin/env bash
# Installs what building and testing the extension needs, skipping what is already there:
# Debian packages, the pinned cargo-pgrx, and pgrx's configuration for PostgreSQL 15.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if ! is_root && ! command -v sudo >/dev/null; then
    die "missing packages (${missing[*]}) and no sudo to install them"
  fi
  say "Installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
  say "Debian packages already installed"
fi

command -v cargo >/dev/null || die "cargo is not installed: install Rust (https://rustup.rs) first"

if [ "$(cargo pgrx --version 2>/dev/null | awk '{print $2}')" != "$PGRX_VERSION" ]; then
  say "Installing cargo-pgrx $PGRX_VERSION (compiles for about 4 minutes, once)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
else
  say "cargo-pgrx $PGRX_VERSION already installed"
fi

if ! grep -qs "^pg$PG_MAJOR *=" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
  say "Pointing pgrx at PostgreSQL $PG_MAJOR ($PG_CONFIG)"
  cargo pgrx init --pg$PG_MAJOR "$PG_CONFIG" >/dev/null
fi

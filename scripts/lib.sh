# Shared by the scripts in this folder: messages, privilege handling, free ports.
# shellcheck shell=bash

PG_MAJOR="${PG_MAJOR:-15}"
PG_CONFIG="${PG_CONFIG:-/usr/lib/postgresql/$PG_MAJOR/bin/pg_config}"
PGRX_VERSION="0.18.1"
APT_PACKAGES=(postgresql-$PG_MAJOR postgresql-server-dev-$PG_MAJOR redis-server libclang-dev clang pkg-config libssl-dev sudo)

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

is_root() { [ "$(id -u)" = 0 ]; }

# Runs a command as root: directly when we are root, through sudo otherwise.
as_root() { if is_root; then "$@"; else sudo "$@"; fi; }

# Runs a PostgreSQL server program: as the postgres OS user when we are root (the server
# refuses to run as root), as ourselves otherwise.
as_pg() { if is_root; then runuser -u postgres -- "$@"; else "$@"; fi; }

# Hands a directory to whoever runs the server.
give_to_pg() { if is_root; then chown -R postgres:postgres "$1"; fi; }

# Prints a TCP port on 127.0.0.1 that nothing listens on.
free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return
    fi
  done
}

# cargo-pgrx installs to ~/.cargo/bin, which a fresh shell may not have on its PATH.
export PATH="$HOME/.cargo/bin:$PATH"

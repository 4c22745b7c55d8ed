#!/usr/bin/env bash
# The SQL surface in PostgreSQL's own test forms, against the extension installed in the chosen
# PostgreSQL: tests/regress (pg_regress: each file's output, messages, SQLSTATEs and hints
# included, against tests/regress/expected) and tests/isolation (pg_isolation_regress: what
# concurrent sessions see, step by step). One throwaway server on a free port, outbox preloaded,
# no relay (outbox.workers = 0), removed afterwards.
# Usage: scripts/installcheck.sh   (after scripts/install.sh; PG=16 or PG_CONFIG=... picks another)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

bindir="$("$PG_CONFIG" --bindir)"
pgxs="$(dirname "$("$PG_CONFIG" --pgxs)")/.."
pg_regress="$pgxs/test/regress/pg_regress"
pg_isolation_regress="$pgxs/test/isolation/pg_isolation_regress"
for program in "$pg_regress" "$pg_isolation_regress" "$pgxs/test/isolation/isolationtester"; do
  # The PyPI package's zip archive keeps no modes (setup.sh marks its bin/ alone).
  if [ -f "$program" ] && [ ! -x "$program" ]; then as_root chmod a+x "$program"; fi
  [ -x "$program" ] || die "$program is missing: it comes with PostgreSQL $PG_MAJOR's server headers (postgresql-server-dev-$PG_MAJOR)"
done
# The drivers only run psql and isolationtester against the server and compare their output,
# whatever the server's major. The PyPI package's 18 has copies that crash at once (their ELF
# notes were mangled when the wheel was repaired): Debian 12's 15 drives that server instead.
if ! "$pg_regress" --version >/dev/null 2>&1 || ! "$pg_isolation_regress" --version >/dev/null 2>&1; then
  debian=/usr/lib/postgresql/15/lib/pgxs/src
  if [ ! -x "$debian/test/regress/pg_regress" ]; then
    say "Installing postgresql-server-dev-15 for its pg_regress"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-server-dev-15 >/dev/null
  fi
  say "PostgreSQL $PG_MAJOR's pg_regress does not run here: using Debian's 15 ($debian/test)"
  pg_regress="$debian/test/regress/pg_regress"
  pg_isolation_regress="$debian/test/isolation/pg_isolation_regress"
fi

work="$(mktemp -d /tmp/outbox-installcheck.XXXXXX)"
give_to_pg "$work"
cleanup() {
  as_pg "$bindir/pg_ctl" -D "$work/data" -m immediate -w stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

as_pg "$bindir/initdb" -D "$work/data" -A trust -U postgres --no-sync >/dev/null
cat >>"$work/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
shared_preload_libraries = 'outbox'
outbox.workers = 0
fsync = off
CONF
# Without a backtrace appended to the errors that pass through pgrx (see demo.sh). A port free
# when chosen can be taken before the server binds it: then another one.
for attempt in 1 2 3; do
  port="$(free_port)"
  say "Starting PostgreSQL $PG_MAJOR on 127.0.0.1:$port for pg_regress and the isolation specs"
  if RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0 as_pg "$bindir/pg_ctl" -D "$work/data" -o "-p $port" \
    -l "$work/server.log" -w start >/dev/null; then
    break
  fi
  tail -n 20 "$work/server.log" >&2 || true
  [ "$attempt" = 3 ] && die "PostgreSQL $PG_MAJOR did not start (its log above)"
done

tests() { find "$1" -name "*.$2" -printf '%f\n' | sed "s/\.$2\$//" | sort; }
status=0
common=(--host=127.0.0.1 --port="$port" --user=postgres --bindir="$bindir")
mkdir -p "$work/regress" "$work/isolation"
give_to_pg "$work"
# The expected outputs are compared as the postgres user writes them; the files are read only.
say "pg_regress: tests/regress ($(tests tests/regress/sql sql | xargs))"
PGUSER=postgres as_pg "$pg_regress" "${common[@]}" --inputdir=tests/regress \
  --outputdir="$work/regress" --dbname=outbox_regress $(tests tests/regress/sql sql) || status=$?
say "pg_isolation_regress: tests/isolation ($(tests tests/isolation/specs spec | xargs))"
PGUSER=postgres as_pg "$pg_isolation_regress" "${common[@]}" --inputdir=tests/isolation \
  --outputdir="$work/isolation" --dbname=outbox_isolation $(tests tests/isolation/specs spec) || status=$?
if [ "$status" != 0 ]; then
  for diffs in "$work"/regress/regression.diffs "$work"/isolation/regression.diffs; do
    [ -s "$diffs" ] && cat "$diffs"
  done
  # Kept for writing the expected files of new tests: the outputs as the server gave them.
  rm -rf target/installcheck && mkdir -p target/installcheck
  cp -r "$work/regress" "$work/isolation" target/installcheck/ 2>/dev/null || true
  die "pg_regress or the isolation specs failed on PostgreSQL $PG_MAJOR (outputs in target/installcheck)"
fi

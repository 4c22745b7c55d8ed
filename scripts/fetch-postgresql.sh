#!/usr/bin/env bash
# Prints the directory of a PostgreSQL installation (its bin/pg_config) that Debian 12 does not
# ship, fetching it the first time (a minute or two; later calls print at once):
#
#   scripts/fetch-postgresql.sh 17   PostgreSQL 17 from Debian 13
#   scripts/fetch-postgresql.sh 19   PostgreSQL 19 from Debian experimental, libraries from unstable
#
# Into /var/tmp/outbox-pg-next/<major> (OUTBOX_PG_NEXT_CACHE), nothing system-wide: the server,
# client programs, headers and pg_config, with the libraries they link. Those builds need a
# newer C library than Debian 12's, so the programs are pointed at the libraries unpacked beside
# them (patchelf: their loader and library path). pg_config reports paths under that directory,
# so cargo-pgrx builds and installs against it as against any installation.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/debian.sh"

major="${1:-17}"
case "$major" in
  17) suite=trixie; server_suite=trixie; icu=libicu76; xml=libxml2; extra=() ;;
  19) suite=sid; server_suite=experimental; icu=libicu78; xml=libxml2-16; extra=(libnuma1 liburing2) ;;
  *) echo "usage: scripts/fetch-postgresql.sh 17|19" >&2; exit 2 ;;
esac
top="${OUTBOX_PG_NEXT_CACHE:-/var/tmp/outbox-pg-next}"
root="$top/$major"
pgdir="$root/usr/lib/postgresql/$major"
if ! "$pgdir/bin/pg_config" --version >/dev/null 2>&1; then
  command -v patchelf >/dev/null || apt-get install -y -qq patchelf >&2
  echo "fetch-postgresql: PostgreSQL $major from Debian $server_suite, its libraries from Debian $suite" >&2
  suites=("$suite")
  [ "$server_suite" = "$suite" ] || suites+=("$server_suite")
  private_apt "$top/apt-$major" "${suites[@]}"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (
    cd "$work"
    for package in "postgresql-$major" "postgresql-server-dev-$major" "postgresql-client-$major" \
      libpq5 libpq-dev; do
      download_debs "$package/$server_suite"
    done
    for library in libc6 libgcc-s1 libstdc++6 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
      libkrb5support0 libcom-err2 libkeyutils1 "$icu" libldap2 libsasl2-2 liblz4-1 libpam0g \
      libaudit1 libcap-ng0 libselinux1 libpcre2-8-0 libssl3t64 libsystemd0 libcap2 libuuid1 \
      "$xml" libxslt1.1 libzstd1 zlib1g liblzma5 libgcrypt20 libgpg-error0 libgnutls30t64 \
      libidn2-0 libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10 libp11-kit0 \
      libffi8 libreadline8t64 libtinfo6 "${extra[@]}"; do
      download_debs "$library/$suite"
    done
    rm -rf "$root" && mkdir -p "$root"
    for deb in *.deb; do dpkg-deb -x "$deb" "$root"; done
  )
  libs="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
  loader="$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  for program in "$pgdir"/bin/* "$pgdir"/lib/pgxs/src/test/*/pg_*regress \
    "$pgdir"/lib/pgxs/src/test/isolation/isolationtester; do
    if [ -f "$program" ] && head -c 4 "$program" | grep -q ELF; then
      patchelf --set-interpreter "$loader" --force-rpath --set-rpath "$libs" "$program"
    fi
  done
  for library in "$pgdir"/lib/*.so; do
    patchelf --force-rpath --set-rpath "$libs" "$library" 2>/dev/null || true
  done
  # The postgres OS user, which runs the test servers, reads and runs all of it.
  chmod -R a+rX "$top"
fi
"$pgdir/bin/pg_config" --version >&2
echo "$pgdir"

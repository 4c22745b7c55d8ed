#!/usr/bin/env bash
# Builds the extension's Debian package and a tarball for one PostgreSQL major (PG=16, or
# PG_CONFIG=...; Debian's 15 by default), into target/package/:
#   postgresql-15-outbox_<version>_<arch>.deb  laid out as Debian's own extension packages are
#                                              (/usr/lib/postgresql/15/lib, /usr/share/postgresql/15/extension),
#                                              depending on postgresql-15
#   outbox-<version>-pg15-linux-<arch>.tar.gz   the same files, for other systems (its INSTALL says where they go)
# `make package` runs it for every tested major. Prints the package's path last.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

version="$(sed -nE 's/^version = "([^"]+)"/\1/p' Cargo.toml | head -n 1)"
arch="$(dpkg --print-architecture)"
name="postgresql-$PG_MAJOR-outbox"
out="target/package"
work="$out/pg$PG_MAJOR"
rm -rf "$work"
mkdir -p "$work"

say "Building outbox $version for PostgreSQL $PG_MAJOR (cargo pgrx package, release)"
cargo pgrx package "${CARGO_FEATURES[@]}" --pg-config "$PG_CONFIG" --out-dir "$work/pgrx" \
  2>&1 | grep -Ev '^\s*$' | tail -n 2
library="$(find "$work/pgrx" -name outbox.so -type f)"
control="$(find "$work/pgrx" -name outbox.control -type f)"
[ -f "$library" ] && [ -f "$control" ] || die "cargo pgrx package made no outbox.so or outbox.control"

# Where Debian's PostgreSQL of this major looks, whatever installation it was built against.
root="$work/root"
libdir="$root/usr/lib/postgresql/$PG_MAJOR/lib"
extdir="$root/usr/share/postgresql/$PG_MAJOR/extension"
docdir="$root/usr/share/doc/$name"
install -d "$libdir" "$extdir" "$docdir" "$root/DEBIAN"
install -m 644 "$library" "$libdir/outbox.so"
strip --strip-unneeded "$libdir/outbox.so"
install -m 644 "$(dirname "$control")"/outbox.control "$(dirname "$control")"/outbox--*.sql "$extdir/"
install -m 644 contrib/postgres_exporter.yml "$docdir/"
cat >"$docdir/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: outbox
Files: *
License: PostgreSQL
EOF

# The libraries outbox.so links to, as package dependencies (dpkg-shlibdeps reads a control
# file of a source package, so it gets a minimal one).
shlibs="$(
  cd "$work" && mkdir -p debian && printf 'Source: outbox\n\nPackage: %s\nArchitecture: any\n' "$name" >debian/control \
    && dpkg-shlibdeps -O "root/usr/lib/postgresql/$PG_MAJOR/lib/outbox.so" 2>/dev/null | sed -n 's/^shlibs:Depends=//p'
)"
# pgrx checks a composite row's version with heap_datum_check where the headers it builds
# against have it (the minors of November 2026 on: 15.20, 17.12, ...). A library that calls it
# loads only on that minor and later; ours does not call it today, and the package would say so.
depends="postgresql-$PG_MAJOR"
if nm -D --undefined-only "$libdir/outbox.so" | grep -qw heap_datum_check; then
  depends="postgresql-$PG_MAJOR (>= $("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+\.[0-9]+).*/\1/'))"
fi
size="$(du -sk --exclude=DEBIAN "$root" | cut -f1)"
cat >"$root/DEBIAN/control" <<EOF
Package: $name
Version: $version
Architecture: $arch
Maintainer: outbox maintainers <outbox@localhost>
Depends: $depends${shlibs:+, $shlibs}
Section: database
Priority: optional
Installed-Size: $size
Description: transactional outbox for PostgreSQL $PG_MAJOR, relayed to Redis Streams
 outbox_enqueue() writes an event in the caller's transaction; a background worker
 inside the server publishes it to a Redis stream once the transaction commits.
 Add 'outbox' to shared_preload_libraries, restart, then CREATE EXTENSION outbox.
EOF

deb="$out/${name}_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null

# The tarball: the same files under lib/ and extension/, and where to put them.
tarname="outbox-$version-pg$PG_MAJOR-linux-$arch"
tardir="$work/$tarname"
install -d "$tardir/lib" "$tardir/extension"
install -m 644 "$libdir/outbox.so" "$tardir/lib/"
install -m 644 "$extdir"/* "$tardir/extension/"
install -m 644 contrib/postgres_exporter.yml "$tardir/"
cat >"$tardir/INSTALL" <<EOF
outbox $version for PostgreSQL $PG_MAJOR ($arch). As root, with that PostgreSQL's pg_config:

  install -m 755 lib/outbox.so "\$(pg_config --pkglibdir)/"
  install -m 644 extension/* "\$(pg_config --sharedir)/extension/"

then add 'outbox' to shared_preload_libraries, restart the server, and CREATE EXTENSION outbox.
EOF
tar -C "$work" --owner=0 --group=0 -czf "$out/$tarname.tar.gz" "$tarname"

say "Built $deb and $out/$tarname.tar.gz"
dpkg-deb --contents "$deb" | awk '{print "    " $NF}'
echo "$deb"

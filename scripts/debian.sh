# Programs from Debian suites newer than Debian 12 (13, unstable, experimental), fetched without
# installing anything system-wide: their packages are downloaded through a private apt list and
# unpacked under /var/tmp, and the programs run with the C library and the other libraries
# that came with them. Sourced by fetch-redis.sh and fetch-postgresql.sh.
# shellcheck shell=bash

# The Debian mirror this machine's apt already uses, read from its sources.
debian_mirror() {
  local mirror
  mirror="$(grep -rhoE '(URIs:|deb)[[:space:]]+(\[[^]]*\][[:space:]]+)?https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
    /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
    grep -oE 'https?://[^[:space:]]+/debian' | head -n 1 || true)"
  [ -n "$mirror" ] || { echo "no Debian mirror in this machine's apt sources" >&2; return 1; }
  echo "$mirror"
}

# Sets APT_OPTS for a private package list in directory $1 that reads the suites named after
# it, and reads that list.
private_apt() {
  local dir="$1" mirror suite
  shift
  mirror="$(debian_mirror)"
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
  for suite in "$@"; do
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main"
  done > "$dir/sources.list"
  APT_OPTS=(-o "Dir::Etc::SourceList=$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache" -o APT::Sandbox::User=root)
  apt-get "${APT_OPTS[@]}" -qq update >&2
}

# Downloads each package/suite given into the current directory (after private_apt); a
# package the suite lacks is named, and the others are still downloaded.
download_debs() {
  local package
  for package in "$@"; do
    apt-get "${APT_OPTS[@]}" -qq download "$package" >&2 || echo "no $package" >&2
  done
}

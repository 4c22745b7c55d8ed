#!/usr/bin/env bash
# Faults at random (tests/faults.rs): schedules of a minute each, from SEED (random if unset) on,
# for MINUTES (10 if unset), against Debian's Redis 7.0, or OUTBOX_TEST_REDIS_SERVER; SERVERS=all
# splits the minutes between Redis 7.0, Redis 8.6 (IDMP) and Valkey 9.1, one after the other, the
# seeds going on from one to the next (a seed's remainder by 3 picks its topology: one Redis, a
# cluster, sentinels). Prints the seed first, each schedule's summary, and on a violation the
# seed, the schedule and the events at fault.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh"
seed="${SEED:-$((RANDOM * 32768 + RANDOM))}"
minutes="${MINUTES:-10}"
if [ "${SERVERS:-}" = all ]; then
  programs=("$(command -v redis-server)")
  for server in redis valkey; do
    programs+=("$("$REDIS_NEXT" "$server" | tail -n 1)")
  done
else
  programs=("${OUTBOX_TEST_REDIS_SERVER:-$(command -v redis-server)}")
fi
share="$(python3 -c "print($minutes / ${#programs[@]})")"
say "Faults at random from seed $seed for $minutes minutes (make faults SEED=$seed${SERVERS:+ SERVERS=$SERVERS} to run it again)"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for program in "${programs[@]}"; do
  say "$share minutes against $("$program" --version | cut -d ' ' -f 1-3), from seed $seed"
  if ! OUTBOX_TEST_REDIS_SERVER="$program" OUTBOX_FAULTS_SEED="$seed" OUTBOX_FAULTS_MINUTES="$share" \
    cargo test -p outbox-tests --test faults -- --ignored --nocapture faults_campaign 2>&1 | tee -a "$log"; then
    die "a violation against $program: see above"
  fi
  # The next server goes on from the seed after the last one run.
  last="$(grep -oE '^faults: seed [0-9]+' "$log" | tail -n 1 | awk '{print $3}')"
  seed=$((last + 1))
done
say "Every schedule held: $(grep -cE '^faults: seed [0-9]+ \(' "$log") schedules, 0 violations"

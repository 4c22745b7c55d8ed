#!/usr/bin/env bash
# Faults at random (tests/faults.rs): schedules of a minute each, from SEED (random if unset) on,
# for MINUTES (10 if unset), against Debian's Redis 7.0, or OUTBOX_TEST_REDIS_SERVER. Prints the
# seed first, each schedule's summary, and on a violation the seed, the schedule and the events
# at fault.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/lib.sh"
cd "$here/.."

"$here/setup.sh"
"$here/install.sh"
seed="${SEED:-$((RANDOM * 32768 + RANDOM))}"
say "Faults at random from seed $seed for ${MINUTES:-10} minutes (make faults SEED=$seed to run it again)"
OUTBOX_FAULTS_SEED="$seed" OUTBOX_FAULTS_MINUTES="${MINUTES:-10}" \
  cargo test -p outbox-tests --test faults -- --ignored --nocapture faults_campaign

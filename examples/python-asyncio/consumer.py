"""Reads account.created from Redis through a consumer group and sends each new account one
welcome e-mail (here: a row in welcome_emails), exactly once, whenever the process dies.

    DATABASE_URL=postgresql://welcome@127.0.0.1/welcome REDIS_URL=redis://127.0.0.1:6379 \
        CONSUMER=worker-1 python consumer.py

Redis delivers an entry again until it is acknowledged, so the order of the steps is what makes
it safe to kill at any moment (SIGKILL included):

1. XREADGROUP hands the consumer a batch, which Redis keeps pending at it;
2. one PostgreSQL transaction inserts each event's identity, its (id, created_at), into
   processed_events with ON CONFLICT DO NOTHING and applies the effect only where the row is
   new, then commits;
3. only then does it XACK the batch.

Killed before the commit, nothing of the batch is applied and its entries are still pending;
killed after it, they are delivered again and processed_events skips them. So there is no
shutdown procedure, and any error ends the process: run it under something that starts it
again (systemd, Kubernetes). At start it finishes its own pending entries (keep CONSUMER stable
across restarts), then takes over those pending longer than MIN_IDLE_MS at consumers that are
gone (XAUTOCLAIM), and looks for those again every CLAIM_EVERY_MS.
"""

import asyncio
import json
import os
import socket
import sys
import time
from datetime import datetime
from typing import Any

import asyncpg
import redis.asyncio as redis
from redis.exceptions import ResponseError

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/welcome")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
STREAM = os.environ.get("STREAM", "account.created")
GROUP = os.environ.get("GROUP", "welcome")
CONSUMER = os.environ.get("CONSUMER", socket.gethostname())
COUNT = int(os.environ.get("COUNT", "50"))
BLOCK_MS = int(os.environ.get("BLOCK_MS", "2000"))
# Well above the time a batch takes: a slow consumer's entries would be taken over too (and
# skipped by processed_events, but the work is done twice).
MIN_IDLE_MS = int(os.environ.get("MIN_IDLE_MS", "60000"))
CLAIM_EVERY_MS = int(os.environ.get("CLAIM_EVERY_MS", "10000"))

SCHEMA = """
-- One row per event applied. Delete rows once no copy of their event can arrive any more
-- (older than the longest the consumers may be down, with a margin).
CREATE TABLE IF NOT EXISTS processed_events (
    event_id     bigint      NOT NULL,
    created_at   timestamptz NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, created_at)
);
-- The effect. No unique key: it stands for what cannot be made idempotent by itself (an
-- e-mail sent), so an event applied twice would show as two rows.
CREATE TABLE IF NOT EXISTS welcome_emails (
    account_id bigint      NOT NULL,
    email      text        NOT NULL,
    event_id   bigint      NOT NULL,
    sent_at    timestamptz NOT NULL DEFAULT now()
);
"""

Entry = tuple[str, dict[str, str]]


async def send_welcome_email(db: asyncpg.Connection, event_id: int, payload: Any) -> None:
    """What the service does with an event, in the transaction it is given: replace it."""
    await db.execute(
        "INSERT INTO welcome_emails (account_id, email, event_id) VALUES ($1, $2, $3)",
        payload["account_id"],
        payload["email"],
        event_id,
    )


async def handle(
    db: asyncpg.Connection, r: redis.Redis, entries: list[Entry], source: str
) -> None:
    """Applies a batch in one transaction, then acknowledges it: only after the commit, as an
    entry Redis forgot before its effect was durable would be lost by a crash in between."""
    # Redis 6.2's XAUTOCLAIM answers nil (here id None) for an entry deleted while pending.
    entries = [(entry_id, fields) for entry_id, fields in entries if entry_id is not None]
    if not entries:
        return
    applied = duplicates = skipped = 0
    async with db.transaction():
        for entry_id, fields in entries:
            try:
                event_id = int(fields["id"])
                created_at = datetime.fromisoformat(fields["created_at"])
                payload = json.loads(fields["payload"])
            except (KeyError, ValueError) as e:
                # Not an event (or an entry deleted from the stream while it was pending):
                # acknowledged with the rest, so that it does not hold up the stream.
                print(
                    f"{STREAM} {entry_id}: skipped, not an event ({e!r}): {fields}",
                    file=sys.stderr,
                )
                skipped += 1
                continue
            # True: the first delivery of this event. None: processed_events has it, from a
            # transaction that committed (another consumer's still open one makes this wait for
            # its outcome, so two consumers never both apply an event).
            new = await db.fetchval(
                "INSERT INTO processed_events (event_id, created_at) VALUES ($1, $2) "
                "ON CONFLICT DO NOTHING RETURNING true",
                event_id,
                created_at,
            )
            if new:
                await send_welcome_email(db, event_id, payload)
                applied += 1
            else:
                duplicates += 1
    await r.xack(STREAM, GROUP, *[entry_id for entry_id, _ in entries])
    print(
        f"batch source={source} entries={len(entries)} applied={applied} "
        f"duplicates={duplicates} skipped={skipped}",
        flush=True,
    )


async def finish_own_pending(db: asyncpg.Connection, r: redis.Redis) -> None:
    """The entries this consumer read before it stopped and did not acknowledge: the id 0
    instead of > reads its pending list, from after the last entry handled."""
    after = "0"
    while True:
        reply = await r.xreadgroup(GROUP, CONSUMER, {STREAM: after}, count=COUNT)
        entries = reply[0][1] if reply else []
        if not entries:
            return
        await handle(db, r, entries, "pending")
        after = entries[-1][0]


async def claim_abandoned(db: asyncpg.Connection, r: redis.Redis) -> None:
    """Takes over and handles the entries pending at any consumer of the group for longer than
    MIN_IDLE_MS: those of a consumer that died and did not come back under its name."""
    cursor = "0-0"
    while True:
        cursor, entries, *_ = await r.xautoclaim(
            STREAM, GROUP, CONSUMER, MIN_IDLE_MS, cursor, count=COUNT
        )
        await handle(db, r, entries, "claimed")
        if cursor == "0-0":
            return


async def main() -> None:
    db = await asyncpg.connect(DATABASE_URL)
    async with db.transaction():
        # Consumers started together would race on CREATE TABLE IF NOT EXISTS: they take turns.
        await db.execute("SELECT pg_advisory_xact_lock(hashtext('processed_events'))")
        await db.execute(SCHEMA)
    r = redis.from_url(REDIS_URL, decode_responses=True)
    try:
        # From the start of the stream (0, not $): a group created after the relay began
        # publishing still reads every event in the stream. MKSTREAM: before the first event.
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    print(f"start group={GROUP} consumer={CONSUMER} stream={STREAM}", flush=True)

    await finish_own_pending(db, r)
    await claim_abandoned(db, r)
    last_claim = time.monotonic()
    while True:
        reply = await r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"}, count=COUNT, block=BLOCK_MS)
        for _, entries in reply:
            await handle(db, r, entries, "new")
        if time.monotonic() - last_claim >= CLAIM_EVERY_MS / 1000:
            await claim_abandoned(db, r)
            last_claim = time.monotonic()


if __name__ == "__main__":
    asyncio.run(main())

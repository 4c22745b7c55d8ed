// Reads account.created from Redis through a consumer group and sends each new account one
// welcome e-mail (here: a row in welcome_emails), exactly once, whenever the process dies.
//
//     DATABASE_URL=postgresql://welcome@127.0.0.1/welcome REDIS_URL=redis://127.0.0.1:6379 \
//         CONSUMER=worker-1 node consumer.js
//
// Redis delivers an entry again until it is acknowledged, so the order of the steps is what
// makes it safe to kill at any moment (SIGKILL included):
//
// 1. XREADGROUP hands the consumer a batch, which Redis keeps pending at it;
// 2. one PostgreSQL transaction inserts each event's identity, its (id, created_at), into
//    processed_events with ON CONFLICT DO NOTHING and applies the effect only where the row is
//    new, then commits;
// 3. only then does it XACK the batch.
//
// Killed before the commit, nothing of the batch is applied and its entries are still pending;
// killed after it, they are delivered again and processed_events skips them. So there is no
// shutdown procedure, and any error ends the process: run it under something that starts it
// again (systemd, Kubernetes). At start it finishes its own pending entries (keep CONSUMER
// stable across restarts), then takes over those pending longer than MIN_IDLE_MS at consumers
// that are gone (XAUTOCLAIM), and looks for those again every CLAIM_EVERY_MS.

import os from 'node:os';
import pg from 'pg';
import { createClient } from 'redis';

const env = process.env;
const DATABASE_URL = env.DATABASE_URL ?? 'postgresql://postgres@127.0.0.1:5432/welcome';
const REDIS_URL = env.REDIS_URL ?? 'redis://127.0.0.1:6379';
const STREAM = env.STREAM ?? 'account.created';
const GROUP = env.GROUP ?? 'welcome';
const CONSUMER = env.CONSUMER ?? os.hostname();
const COUNT = Number(env.COUNT ?? 50);
const BLOCK_MS = Number(env.BLOCK_MS ?? 2000);
// Well above the time a batch takes: a slow consumer's entries would be taken over too (and
// skipped by processed_events, but the work is done twice).
const MIN_IDLE_MS = Number(env.MIN_IDLE_MS ?? 60000);
const CLAIM_EVERY_MS = Number(env.CLAIM_EVERY_MS ?? 10000);

const SCHEMA = `
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
)`;

// What the service does with an event, in the transaction it is given: replace it.
async function sendWelcomeEmail(db, eventId, payload) {
  await db.query(
    'INSERT INTO welcome_emails (account_id, email, event_id) VALUES ($1, $2, $3)',
    [payload.account_id, payload.email, eventId],
  );
}

// The event in an entry's fields, or null if the entry is not one.
function parse(fields) {
  if (!/^[0-9]+$/.test(fields?.id ?? '') || Number.isNaN(Date.parse(fields.created_at))) {
    return null;
  }
  try {
    // created_at stays text: PostgreSQL reads its microseconds, which a Date would drop.
    return { id: fields.id, createdAt: fields.created_at, payload: JSON.parse(fields.payload) };
  } catch {
    return null;
  }
}

// Applies a batch in one transaction, then acknowledges it: only after the commit, as an entry
// Redis forgot before its effect was durable would be lost by a crash in between.
async function handle(db, redis, messages, source) {
  // Redis 6.2's XAUTOCLAIM answers nil for an entry deleted while pending.
  messages = messages.filter((message) => message !== null);
  if (messages.length === 0) {
    return;
  }
  let applied = 0;
  let duplicates = 0;
  let skipped = 0;
  await db.query('BEGIN');
  try {
    for (const { id: entryId, message: fields } of messages) {
      const event = parse(fields);
      if (event === null) {
        // Acknowledged with the rest, so that it does not hold up the stream.
        console.error(`${STREAM} ${entryId}: skipped, not an event: ${JSON.stringify(fields)}`);
        skipped++;
        continue;
      }
      // 1 row: the first delivery of this event. 0: processed_events has it, from a transaction
      // that committed (another consumer's still open one makes this wait for its outcome, so
      // two consumers never both apply an event).
      const { rowCount } = await db.query(
        'INSERT INTO processed_events (event_id, created_at) VALUES ($1, $2::timestamptz) ' +
          'ON CONFLICT DO NOTHING',
        [event.id, event.createdAt],
      );
      if (rowCount === 1) {
        await sendWelcomeEmail(db, event.id, event.payload);
        applied++;
      } else {
        duplicates++;
      }
    }
    await db.query('COMMIT');
  } catch (error) {
    await db.query('ROLLBACK').catch(() => {});
    throw error;
  }
  await redis.xAck(STREAM, GROUP, messages.map((message) => message.id));
  console.log(
    `batch source=${source} entries=${messages.length} applied=${applied} ` +
      `duplicates=${duplicates} skipped=${skipped}`,
  );
}

// The entries this consumer read before it stopped and did not acknowledge: the id 0 instead of
// > reads its pending list, from after the last entry handled. Sent as a raw command: an entry
// deleted from the stream while pending comes with nil fields, which xReadGroup cannot read.
async function finishOwnPending(db, redis) {
  let after = '0';
  for (;;) {
    const reply = await redis.sendCommand(
      ['XREADGROUP', 'GROUP', GROUP, CONSUMER, 'COUNT', String(COUNT), 'STREAMS', STREAM, after],
    );
    const messages = (reply?.[0]?.[1] ?? []).map(([id, fields]) => ({
      id,
      message: fields && Object.fromEntries(
        Array.from({ length: fields.length / 2 }, (_, i) => [fields[2 * i], fields[2 * i + 1]]),
      ),
    }));
    if (messages.length === 0) {
      return;
    }
    await handle(db, redis, messages, 'pending');
    after = messages[messages.length - 1].id;
  }
}

// Takes over and handles the entries pending at any consumer of the group for longer than
// MIN_IDLE_MS: those of a consumer that died and did not come back under its name.
async function claimAbandoned(db, redis) {
  let cursor = '0-0';
  do {
    const { nextId, messages } = await redis.xAutoClaim(
      STREAM,
      GROUP,
      CONSUMER,
      MIN_IDLE_MS,
      cursor,
      { COUNT },
    );
    await handle(db, redis, messages, 'claimed');
    cursor = nextId;
  } while (cursor !== '0-0');
}

const db = new pg.Client({ connectionString: DATABASE_URL });
await db.connect();
await db.query('BEGIN');
// Consumers started together would race on CREATE TABLE IF NOT EXISTS: they take turns.
await db.query("SELECT pg_advisory_xact_lock(hashtext('processed_events'))");
await db.query(SCHEMA);
await db.query('COMMIT');

// Any Redis error ends the process, as any PostgreSQL error does (no reconnecting here).
const redis = createClient({ url: REDIS_URL, socket: { reconnectStrategy: false } });
redis.on('error', (error) => {
  console.error(`consumer: ${error.message}`);
  process.exit(1);
});
await redis.connect();
try {
  // From the start of the stream (0, not $): a group created after the relay began publishing
  // still reads every event in the stream. MKSTREAM: before the first event.
  await redis.xGroupCreate(STREAM, GROUP, '0', { MKSTREAM: true });
} catch (error) {
  if (!String(error.message).includes('BUSYGROUP')) {
    throw error;
  }
}
console.log(`start group=${GROUP} consumer=${CONSUMER} stream=${STREAM}`);

await finishOwnPending(db, redis);
await claimAbandoned(db, redis);
let lastClaim = Date.now();
for (;;) {
  const reply = await redis.xReadGroup(GROUP, CONSUMER, { key: STREAM, id: '>' }, {
    COUNT,
    BLOCK: BLOCK_MS,
  });
  for (const { messages } of reply ?? []) {
    await handle(db, redis, messages, 'new');
  }
  if (Date.now() - lastClaim >= CLAIM_EVERY_MS) {
    await claimAbandoned(db, redis);
    lastClaim = Date.now();
  }
}

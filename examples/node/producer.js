// Creates accounts, each with its account.created event, in one transaction.
//
//     DATABASE_URL=postgresql://app@127.0.0.1/app node producer.js 10
//
// The database must have the extension (CREATE EXTENSION outbox) and be one the relay works in
// (outbox.database). The event reaches the Redis stream account.created (with
// outbox.stream_prefix in front) once the transaction commits; if it rolls back, the event never
// existed.

import pg from 'pg';

const SCHEMA = `
CREATE TABLE IF NOT EXISTS accounts (
    id    bigserial PRIMARY KEY,
    email text NOT NULL
)`;

// The business row and its event: both commit, or neither does. Nothing to publish by hand: the
// relay inside PostgreSQL is woken at commit.
async function createAccount(client, email) {
  await client.query('BEGIN');
  try {
    const { rows } = await client.query(
      'INSERT INTO accounts (email) VALUES ($1) RETURNING id',
      [email],
    );
    const accountId = Number(rows[0].id); // pg returns bigint as a string
    await client.query("SELECT outbox_enqueue('account.created', $1::jsonb)", [
      JSON.stringify({ account_id: accountId, email }),
    ]);
    await client.query('COMMIT');
    return accountId;
  } catch (error) {
    await client.query('ROLLBACK');
    throw error;
  }
}

const count = Number(process.argv[2] ?? 1);
const client = new pg.Client({
  connectionString: process.env.DATABASE_URL ?? 'postgresql://postgres@127.0.0.1:5432/postgres',
});
await client.connect();
try {
  await client.query(SCHEMA);
  for (let n = 0; n < count; n++) {
    await createAccount(client, `user-${n}@example.com`);
  }
} finally {
  await client.end();
}
console.log(`created ${count} accounts`);

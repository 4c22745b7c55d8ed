"""Creates accounts, each with its account.created event, in one transaction.

    DATABASE_URL=postgresql://app@127.0.0.1/app python producer.py 10

The database must have the extension (CREATE EXTENSION outbox) and be one the relay works in
(outbox.database). The event reaches the Redis stream account.created (with outbox.stream_prefix
in front) once the transaction commits; if it rolls back, the event never existed.
"""

import asyncio
import json
import os
import sys

import asyncpg

SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    id    bigserial PRIMARY KEY,
    email text NOT NULL
);
"""


async def create_account(conn: asyncpg.Connection, email: str) -> int:
    """The business row and its event: both commit, or neither does. Nothing to publish by
    hand and no pg_notify: the relay inside PostgreSQL is woken at commit."""
    async with conn.transaction():
        account_id = await conn.fetchval(
            "INSERT INTO accounts (email) VALUES ($1) RETURNING id", email
        )
        await conn.execute(
            "SELECT outbox_enqueue('account.created', $1::jsonb)",
            json.dumps({"account_id": account_id, "email": email}),
        )
        return account_id


async def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    url = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(SCHEMA)
        for n in range(count):
            await create_account(conn, f"user-{n}@example.com")
    finally:
        await conn.close()
    print(f"created {count} accounts")


if __name__ == "__main__":
    asyncio.run(main())

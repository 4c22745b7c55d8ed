"""Creates accounts through a SQLAlchemy ORM session, each with its account.created event (with
a key and headers) written in the session's transaction.

    DATABASE_URL=postgresql+psycopg://app@127.0.0.1/app python producer.py 10

The database must have the extension (CREATE EXTENSION outbox) and be one the relay works in
(outbox.database).
"""

import os
import secrets
import sys

from sqlalchemy import BigInteger, Identity, bindparam, create_engine, func, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "accounts"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    email: Mapped[str]


def create_account(session: Session, email: str, headers: dict[str, str]) -> int:
    """Adds the account and enqueues its event in the session's transaction: both commit with
    it, or neither does."""
    account = Account(email=email)
    session.add(account)
    session.flush()  # the INSERT, which gives the account its id
    payload = {"account_id": account.id, "email": email}
    # The JSON values go in as Python objects bound as JSONB, which the driver serializes once.
    # (A string from json.dumps bound as JSONB would be serialized again: a JSON string, not an
    # object.)
    session.execute(
        select(
            func.outbox_enqueue(
                "account.created",
                bindparam("payload", payload, type_=JSONB),
                f"account-{account.id}",  # the key: this account's events stay in order
                bindparam("headers", headers, type_=JSONB),
            )
        )
    )
    return account.id


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    engine = create_engine(
        os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    )
    Base.metadata.create_all(engine)
    for n in range(count):
        # The W3C trace context of the request that creates the account, say.
        traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        with Session(engine) as session, session.begin():
            create_account(session, f"user-{n}@example.com", {"traceparent": traceparent})
    engine.dispose()
    print(f"created {count} accounts")


if __name__ == "__main__":
    main()

"""The same write from Django: the model's row and its event in one transaction.atomic(). Not
run by the tests (Django is not installed there): `Account` stands for a model of yours with an
`email` field.
"""

import json

from django.db import connection, transaction

from accounts.models import Account  # your app's model


def create_account(email: str, headers: dict[str, str]) -> int:
    with transaction.atomic():
        account = Account.objects.create(email=email)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT outbox_enqueue(%s, %s::jsonb, %s, %s::jsonb)",
                [
                    "account.created",
                    json.dumps({"account_id": account.id, "email": email}),
                    f"account-{account.id}",
                    json.dumps(headers),
                ],
            )
        return account.id

"""Responses in the job database (``--media-db``), in a table of their own.

Each row holds the response object as it was returned, the input items it was given (for
``GET /v1/responses/{id}/input_items``) and the conversation through its output, as the
chat messages that render it: a request naming it as ``previous_response_id`` starts from
those. Rows belong to the API key that created them, by the same owner tag as media jobs
(an HMAC of the key under the secret the database keeps in ``meta``), so a key sees its
own responses and the shared ones, an admin key all. Calls block; the gateway makes them
on threads (:mod:`penstock.responses.async_store`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Integer,
    MetaData,
    Table,
    Text,
    delete,
    insert,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError

from penstock.errors import JobDatabaseError, JobStoreUnavailableError
from penstock.media.jobs import (
    RETRY_AFTER_S,
    database_url,
    keyed_tag,
    open_database,
    owner_secret,
    transaction,
)
from penstock.media.records import Owner
from penstock.responses.records import StoredResponse

# Held while one gateway creates the table, so two starting at once don't race.
_SCHEMA_LOCK_KEY = 0x72657370

_metadata = MetaData()

stored_responses = Table(
    "responses",
    _metadata,
    Column("seq", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("id", Text, nullable=False, unique=True),
    Column("owner", Text, nullable=False),
    Column("created_at", BigInteger().with_variant(Integer(), "sqlite"), nullable=False),
    Column("response", Text, nullable=False),
    Column("input_items", Text, nullable=False),
    Column("conversation", Text, nullable=False),
    sqlite_autoincrement=True,
)


def unavailable(why: str) -> JobStoreUnavailableError:
    """The 503 of a call that failed for want of the database, not of the call."""
    return JobStoreUnavailableError(
        f"the response store {why}; try again in {RETRY_AFTER_S} seconds",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class ResponseStore:
    def __init__(self, location: Path | str | None) -> None:
        """``location``: a SQLite file, None for memory, or a database URL."""
        self._engine = open_database(database_url(location))
        self.shared = self._engine.dialect.name != "sqlite"
        try:
            with self._engine.begin() as conn:
                self._owner_secret = bytes.fromhex(self._prepare(conn))
        except DBAPIError as exc:
            self._engine.dispose()
            reason = str(getattr(exc, "orig", exc)).strip().splitlines() or [type(exc).__name__]
            raise JobDatabaseError(f"cannot open the response store: {reason[0]}") from exc

    def _prepare(self, conn: Connection) -> str:
        """Create the tables that are missing; returns the owner secret."""
        if self.shared:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
        _metadata.create_all(conn)
        return owner_secret(conn)

    def _tx(self) -> contextlib.AbstractContextManager[Connection]:
        return transaction(self._engine, unavailable)

    def owner_tag(self, api_key: str) -> str:
        return keyed_tag(self._owner_secret, api_key)

    def close(self) -> None:
        self._engine.dispose()

    def add(self, owner: str, stored: StoredResponse) -> None:
        response = stored.response
        with self._tx() as conn:
            conn.execute(
                insert(stored_responses).values(
                    id=response["id"],
                    owner=owner,
                    created_at=response["created_at"],
                    response=json.dumps(response),
                    input_items=json.dumps(stored.input_items),
                    conversation=json.dumps(stored.conversation),
                )
            )

    def get(self, response_id: str, owner: Owner) -> StoredResponse | None:
        """The response, or None when there is none or ``owner`` may not see it."""
        query = select(stored_responses).where(stored_responses.c.id == response_id)
        with self._tx() as conn:
            row = conn.execute(query).first()
        if row is None or not owner.sees(row.owner):
            return None
        return StoredResponse(
            json.loads(row.response), json.loads(row.input_items), json.loads(row.conversation)
        )

    def delete(self, response_id: str, owner: Owner) -> bool:
        """Delete the response if ``owner`` may see it; whether there was one."""
        statement = delete(stored_responses).where(stored_responses.c.id == response_id)
        tags = owner.tags()
        if tags is not None:
            statement = statement.where(stored_responses.c.owner.in_(tags))
        with self._tx() as conn:
            return conn.execute(statement).rowcount > 0

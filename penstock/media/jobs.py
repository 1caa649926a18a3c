"""Video job records in a database through SQLAlchemy Core: they outlive the process.

The records themselves (:class:`~penstock.media.records.VideoJob`, states, owners) live in
:mod:`penstock.media.records`, which imports no SQLAlchemy; this module is imported only
where a store is opened.

Two backends, one store: SQLite (a file, or memory) is the embedded default, for one
gateway process; PostgreSQL (a ``postgresql+psycopg://`` URL) lets several gateways, on
any nodes, share one set of jobs. Every write commits at once; SQLite runs in WAL mode, so
readers never wait. Calls block (a round trip to PostgreSQL): the gateway makes them on
threads (:class:`~penstock.media.async_jobs.AsyncJobStore`), never on its event loop. Each
is bounded on PostgreSQL: connecting, every statement and every unacknowledged send have a
time limit, so a server that went away fails the call rather than holding it. A database
that cannot be reached gives :class:`~penstock.errors.JobStoreUnavailableError` (503, with
``Retry-After``) to the request that needed it.

The engine request of each job is stored too, so a job still queued when its gateway
stopped can run later, on that gateway after a restart or on another one sharing the
store. Each job row names its ``runner``, the gateway that holds it (queued in its pool or
running); gateways register in ``media_gateways`` and bump a beat counter there, and
:meth:`JobStore.settle` hands the jobs of gateways found dead to a live one: queued jobs
are adopted, running ones are failed with the reason. :meth:`JobStore.claim` starts a job
only if it is still queued and still held by the caller, so no job runs twice.

Jobs and stored images belong to the API key that created them: each row keeps an owner
tag, an HMAC-SHA256 of the key under a random secret kept in the database (so every gateway
sharing it computes the same tags), never the key. The empty tag is the shared scope: jobs
made with no keys configured, and jobs from databases older than the owner column
(migrated on open), which every caller sees.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Float,
    Integer,
    MetaData,
    Row,
    Table,
    Text,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.pool import StaticPool

from penstock.errors import JobDatabaseError, JobStoreUnavailableError
from penstock.media.records import (
    FAILED,
    IN_PROGRESS,
    QUEUED,
    UNFINISHED,
    Owner,
    PageQuery,
    VideoJob,
)

BACKENDS = ("sqlite", "postgresql")
# Held while one gateway creates or migrates the tables, so two starting at once don't race.
_SCHEMA_LOCK_KEY = 0x70656E73
# What a client is told to wait before trying a job route again while the store is away.
RETRY_AFTER_S = 5
# Connections at most, to PostgreSQL, of one gateway; as many threads make its calls.
POOL_CONNECTIONS = 8
# The bounds of one call on PostgreSQL, unless the URL sets them: seconds to connect,
# milliseconds per statement (lock waits included), milliseconds a send may go
# unacknowledged, and TCP keepalives to find a peer that vanished while idle.
_CONNECTION_BOUNDS: dict[str, Any] = {
    "connect_timeout": 5,
    "tcp_user_timeout": 10_000,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
}
_STATEMENT_TIMEOUT_MS = 5_000

# INTEGER in SQLite, where only ``INTEGER PRIMARY KEY`` is the row id; 64-bit elsewhere.
_Int = BigInteger().with_variant(Integer(), "sqlite")

_metadata = MetaData()

video_jobs = Table(
    "video_jobs",
    _metadata,
    Column("seq", _Int, primary_key=True, autoincrement=True),
    Column("id", Text, nullable=False, unique=True),
    Column("model", Text, nullable=False),
    Column("prompt", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("progress", Integer, nullable=False, server_default="0"),
    Column("created_at", _Int, nullable=False),
    Column("completed_at", _Int),
    Column("seconds", Text, nullable=False),
    Column("size", Text, nullable=False),
    Column("error_code", Text),
    Column("error_message", Text),
    Column("artifact", Text),
    Column("content_type", Text),
    Column("inference_time_s", Float),
    Column("request", Text, nullable=False),
    Column("owner", Text, nullable=False, server_default=""),
    Column("runner", Text),
    sqlite_autoincrement=True,
)

_meta = Table(
    "meta",
    _metadata,
    Column("name", Text, primary_key=True),
    Column("value", Text, nullable=False),
)

stored_images = Table(
    "stored_images",
    _metadata,
    Column("id", Text, primary_key=True),
    Column("owner", Text, nullable=False),
    Column("created_at", _Int, nullable=False),
)

gateways = Table(
    "media_gateways",
    _metadata,
    Column("id", Text, primary_key=True),
    Column("beats", _Int, nullable=False, server_default="0"),
)

# Columns later versions added, with what an older database gets on open.
_ADDED_COLUMNS = {
    "owner": "ALTER TABLE video_jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''",
    "runner": "ALTER TABLE video_jobs ADD COLUMN runner TEXT",
}


_COLUMNS = tuple(f.name for f in fields(VideoJob))


def _row_to_job(row: Row[Any]) -> VideoJob:
    values = {name: getattr(row, name) for name in _COLUMNS}
    values["request"] = json.loads(values["request"])
    return VideoJob(**values)


def database_url(location: Path | str | None) -> str:
    """The SQLAlchemy URL of ``location``: a SQLite file, memory (None), or a URL as given.

    Raises :class:`~penstock.errors.JobDatabaseError` for a URL of another backend.
    """
    if location is None:
        return "sqlite://"
    if isinstance(location, Path):
        return f"sqlite:///{location}"
    try:
        backend = make_url(location).get_backend_name()
    except (ArgumentError, ValueError) as exc:
        # Not echoed: it may hold a password.
        raise JobDatabaseError(f"--media-db is not a database URL: {exc}") from exc
    if backend not in BACKENDS:
        raise JobDatabaseError(
            f"--media-db: the {backend!r} backend is not supported; use a file path, "
            "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
    return location


def _redacted(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def open_database(url: str) -> Engine:
    """An engine on ``url`` (from :func:`database_url`): SQLite in WAL mode, or PostgreSQL
    with every call bounded."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
        if not database or database == ":memory:":
            # One connection, or each checkout would see a fresh empty database.
            options["poolclass"] = StaticPool
        engine = create_engine(url, **options)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    # A server that stopped answering must fail the calls soon, not hold their threads.
    connect_args = {k: v for k, v in _CONNECTION_BOUNDS.items() if k not in parsed.query}
    if "options" not in parsed.query:
        connect_args["options"] = (
            f"-c statement_timeout={_STATEMENT_TIMEOUT_MS} -c lock_timeout={_STATEMENT_TIMEOUT_MS}"
        )
    try:
        # pre_ping: a database restarted under a running gateway costs one retry, not errors.
        return create_engine(
            url,
            pool_pre_ping=True,
            pool_size=POOL_CONNECTIONS // 2,
            max_overflow=POOL_CONNECTIONS - POOL_CONNECTIONS // 2,
            pool_timeout=connect_args.get("connect_timeout", 5),
            connect_args=connect_args,
        )
    except NoSuchModuleError as exc:
        raise JobDatabaseError(f"--media-db {_redacted(url)}: {exc}") from exc
    except ImportError as exc:
        raise JobDatabaseError(
            f"--media-db {_redacted(url)}: its driver is not installed ({exc.name}); "
            "pip install 'penstock[postgres]'"
        ) from exc


def owner_secret(conn: Connection) -> str:
    """The database's owner secret (hex), made on first use; every store in the database
    tags owners with it."""
    _meta.create(conn, checkfirst=True)
    upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(
        upsert(_meta)
        .values(name="owner_secret", value=secrets.token_hex(32))
        .on_conflict_do_nothing()
    )
    return str(conn.scalar(select(_meta.c.value).where(_meta.c.name == "owner_secret")))


def keyed_tag(secret: bytes, api_key: str) -> str:
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


@contextlib.contextmanager
def transaction(
    engine: Engine, unavailable: Callable[[str], JobStoreUnavailableError]
) -> Iterator[Connection]:
    """One committed transaction; a database that is away gives ``unavailable(why)``."""
    try:
        with engine.begin() as conn:
            yield conn
    except (OperationalError, PoolTimeoutError) as exc:
        # The server is gone, too slow or the file is locked, not a statement that is wrong.
        raise unavailable("cannot be reached") from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise unavailable("dropped the connection") from exc
        raise


class JobStore:
    """CRUD over the ``video_jobs`` table; newest first means highest insertion order."""

    def __init__(self, location: Path | str | None) -> None:
        """``location``: a SQLite file, None to keep the jobs in memory only (for stores
        that don't outlive the process either), or a database URL (``sqlite:///PATH``,
        ``postgresql+psycopg://...``)."""
        url = database_url(location)
        self.path = location if isinstance(location, Path) else None
        self.url = _redacted(url)
        self._engine = open_database(url)
        self.backend = self._engine.dialect.name
        try:
            with self._engine.begin() as conn:
                self._owner_secret = bytes.fromhex(self._prepare(conn))
        except DBAPIError as exc:
            self._engine.dispose()
            raise JobDatabaseError(
                f"--media-db {self.url}: cannot open the job database: {_first_line(exc)}"
            ) from exc

    @property
    def shared(self) -> bool:
        """Whether other gateway processes may use this database at the same time."""
        return self.backend != "sqlite"

    def _prepare(self, conn: Connection) -> str:
        """Create or migrate the tables; returns the owner secret."""
        if self.backend == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
        _metadata.create_all(conn)
        columns = {column["name"] for column in inspect(conn).get_columns("video_jobs")}
        for name, ddl in _ADDED_COLUMNS.items():
            if name not in columns:
                conn.execute(text(ddl))
        return owner_secret(conn)

    def _tx(self) -> contextlib.AbstractContextManager[Connection]:
        return transaction(self._engine, unavailable)

    def owner_tag(self, api_key: str) -> str:
        """What the rows of ``api_key``'s jobs store: a keyed hash, so the key never is."""
        return keyed_tag(self._owner_secret, api_key)

    def close(self) -> None:
        self._engine.dispose()

    def add(self, job: VideoJob, given_up: threading.Event | None = None) -> None:
        """Store a new job; rolled back if ``given_up`` is set by the time the row is in
        (its caller was answered 503: no one would run it)."""
        values = {name: getattr(job, name) for name in _COLUMNS}
        values["request"] = json.dumps(job.request)
        with self._tx() as conn:
            conn.execute(insert(video_jobs).values(**values))
            if given_up is not None and given_up.is_set():
                raise unavailable("answered too late")

    def get(self, job_id: str, owner: Owner | None = None) -> VideoJob | None:
        """The job, or None when there is none or ``owner`` (if given) may not see it."""
        with self._tx() as conn:
            row = conn.execute(select(video_jobs).where(video_jobs.c.id == job_id)).first()
        if row is None or (owner is not None and not owner.sees(row.owner)):
            return None
        return _row_to_job(row)

    def update(self, job_id: str, held_by: str | None = None, **changes: Any) -> bool:
        """Change the job's fields; with ``held_by``, only while that gateway runs it (not
        once it was deleted, or failed by another gateway that found the holder dead).
        Returns whether the row changed."""
        unknown = set(changes) - set(_COLUMNS)
        if unknown:
            raise KeyError(f"unknown job fields: {sorted(unknown)}")
        if "request" in changes:
            changes["request"] = json.dumps(changes["request"])
        statement = update(video_jobs).where(video_jobs.c.id == job_id).values(**changes)
        if held_by is not None:
            statement = statement.where(
                video_jobs.c.runner == held_by, video_jobs.c.status == IN_PROGRESS
            )
        with self._tx() as conn:
            return conn.execute(statement).rowcount > 0

    def delete(self, job_id: str) -> bool:
        with self._tx() as conn:
            return conn.execute(delete(video_jobs).where(video_jobs.c.id == job_id)).rowcount > 0

    def page(self, query: PageQuery) -> tuple[list[VideoJob], bool]:
        """The jobs of ``query``'s page, and whether more follow.

        An ``after`` that names no job its owner sees gives :class:`KeyError`.
        """
        after, newest_first, owner = query.after, query.newest_first, query.owner
        seq = video_jobs.c.seq
        statement = select(video_jobs).order_by(seq.desc() if newest_first else seq.asc())
        tags = owner.tags() if owner is not None else None
        if tags is not None:
            statement = statement.where(video_jobs.c.owner.in_(tags))
        with self._tx() as conn:
            if after is not None:
                cursor = conn.execute(
                    select(video_jobs.c.seq, video_jobs.c.owner).where(video_jobs.c.id == after)
                ).first()
                if cursor is None or (owner is not None and not owner.sees(cursor.owner)):
                    raise KeyError(after)
                statement = statement.where(seq < cursor.seq if newest_first else seq > cursor.seq)
            rows = conn.execute(statement.limit(query.limit + 1)).all()
        return [_row_to_job(r) for r in rows[: query.limit]], len(rows) > query.limit

    def count_by_status(self) -> dict[str, int]:
        with self._tx() as conn:
            rows = conn.execute(
                select(video_jobs.c.status, func.count()).group_by(video_jobs.c.status)
            ).all()
        return {status: count for status, count in rows}

    def unfinished(self) -> list[VideoJob]:
        with self._tx() as conn:
            rows = conn.execute(
                select(video_jobs)
                .where(video_jobs.c.status.in_(UNFINISHED))
                .order_by(video_jobs.c.seq.asc())
            ).all()
        return [_row_to_job(r) for r in rows]

    def existing(self, job_ids: Collection[str]) -> set[str]:
        """Which of ``job_ids`` still have a row."""
        if not job_ids:
            return set()
        with self._tx() as conn:
            rows = conn.execute(select(video_jobs.c.id).where(video_jobs.c.id.in_(job_ids)))
            return {row.id for row in rows}

    def queue_position(self, job_id: str) -> int | None:
        """1-based place of a queued job among the queued jobs of its runner; None when it
        is not queued."""
        job = select(video_jobs.c.seq, video_jobs.c.runner).where(
            video_jobs.c.id == job_id, video_jobs.c.status == QUEUED
        )
        with self._tx() as conn:
            row = conn.execute(job).first()
            if row is None:
                return None
            return int(
                conn.scalar(
                    select(func.count()).where(
                        video_jobs.c.status == QUEUED,
                        video_jobs.c.runner.is_not_distinct_from(row.runner),
                        video_jobs.c.seq <= row.seq,
                    )
                )
                or 0
            )

    # -- gateways sharing the store --------------------------------------------------------

    def register(self, gateway: str) -> None:
        with self._tx() as conn:
            conn.execute(insert(gateways).values(id=gateway, beats=0))

    def beat(self, gateway: str) -> dict[str, int]:
        """Bump ``gateway``'s beat counter (registering it again if another gateway took it
        for dead); returns every registered gateway's counter."""
        with self._tx() as conn:
            bumped = conn.execute(
                update(gateways).where(gateways.c.id == gateway).values(beats=gateways.c.beats + 1)
            ).rowcount
            if not bumped:
                conn.execute(insert(gateways).values(id=gateway, beats=0))
            return {row.id: int(row.beats) for row in conn.execute(select(gateways))}

    def forget(self, gateway_ids: Collection[str]) -> None:
        """Unregister gateways (stopped, or found dead): their queued jobs become adoptable."""
        if gateway_ids:
            with self._tx() as conn:
                conn.execute(delete(gateways).where(gateways.c.id.in_(gateway_ids)))

    def settle(
        self, live: Collection[str], adopter: str, reason: str
    ) -> tuple[list[str], list[str]]:
        """Hand over the unfinished jobs of every runner not in ``live``: queued ones are
        adopted by ``adopter``, running ones failed with ``reason``. Returns the ids
        adopted (oldest first) and failed. A job another gateway settled first is left
        to it."""
        holder = video_jobs.c.runner
        orphans = select(video_jobs.c.id, video_jobs.c.status, holder).where(
            video_jobs.c.status.in_(UNFINISHED), holder.is_(None) | holder.not_in(live)
        )
        adopted: list[str] = []
        failed: list[str] = []
        with self._tx() as conn:
            rows = conn.execute(orphans.order_by(video_jobs.c.seq.asc())).all()
        for row in rows:
            same = update(video_jobs).where(
                video_jobs.c.id == row.id,
                video_jobs.c.status == row.status,
                holder.is_not_distinct_from(row.runner),
            )
            if row.status == QUEUED:
                changed = same.values(runner=adopter)
            else:
                changed = same.values(
                    status=FAILED,
                    error_code="interrupted",
                    error_message=reason,
                    completed_at=int(time.time()),
                )
            with self._tx() as conn:
                if conn.execute(changed).rowcount:
                    (adopted if row.status == QUEUED else failed).append(row.id)
        return adopted, failed

    def claim(self, job_id: str, gateway: str) -> bool:
        """Start the job: only if it is still queued and held by ``gateway``."""
        with self._tx() as conn:
            return (
                conn.execute(
                    update(video_jobs)
                    .where(
                        video_jobs.c.id == job_id,
                        video_jobs.c.status == QUEUED,
                        video_jobs.c.runner == gateway,
                    )
                    .values(status=IN_PROGRESS, progress=0)
                ).rowcount
                > 0
            )

    # -- stored images ---------------------------------------------------------------------

    def add_image(self, image_id: str, owner: str) -> None:
        with self._tx() as conn:
            conn.execute(
                insert(stored_images).values(id=image_id, owner=owner, created_at=int(time.time()))
            )

    def image_visible(self, image_id: str, owner: Owner) -> bool:
        """Whether ``owner`` may download the stored image; images stored before owners
        were recorded have no row and stay shared."""
        with self._tx() as conn:
            row = conn.execute(
                select(stored_images.c.owner).where(stored_images.c.id == image_id)
            ).first()
        return row is None or owner.sees(row.owner)


def unavailable(why: str) -> JobStoreUnavailableError:
    """The 503 of a job store call that failed for want of the database, not of the call."""
    return JobStoreUnavailableError(
        f"the video job database {why}; try again in {RETRY_AFTER_S} seconds",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__

"""Everything media generation needs in one gateway process.

The video and image routers share one :class:`MediaService`, built and started once by
:func:`penstock.app.factory.create_app`: one job store, one artifact store and one worker
pool, so its ``workers`` bound all generations on the engine together.

Video jobs are rows in the job store before they run. A job runs on the gateway that
accepted it (its ``runner``), in that gateway's pool, so the streaming form's progress
events come from the process that holds the client. Other gateways sharing the store
(PostgreSQL) can poll, list, download and delete it. Jobs outlive their gateway: every
gateway bumps its beat in the store every ``lease_s / 3`` seconds, and one whose beat has
not moved for ``lease_s`` is dead to the others, which adopt its queued jobs (they run
again from the stored engine request) and mark its running ones failed with the reason
(a job that kills its gateway must not kill the next one too). A gateway that stops
cleanly fails its running jobs the same way and leaves its queued ones to the others at
once. With SQLite, one process owns the store: on startup every job a previous process
left is settled at once. A job deleted through another gateway is stopped (or taken out
of the queue) by its runner at the next beat.

The store may go away (a database restarted, hung or out of reach): every call to it is
made off the event loop and bounded (:class:`~penstock.media.async_jobs.AsyncJobStore`),
so only the job routes notice (503). A job that ends meanwhile keeps its outcome in memory
and the outcome is written once the store is back; a progress write that fails is
skipped, the generation goes on. A gateway is taken for dead only after its lease elapsed
while the store answered: after a beat of its own failed, a gateway gives every other one
a full lease again, since none could beat meanwhile.

Progress: a raw engine yields objects whose ``status`` is ``in_progress`` (carrying
``progress`` 0-100 and optionally ``step`` / ``total_steps``) and ends with its terminal
object. The service stores the percentage, computes an ETA from the elapsed time, and
publishes each change to the subscribers of that job (the streaming route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from penstock.engines.context import Context
from penstock.errors import EngineError, JobStoreUnavailableError, PenstockError
from penstock.media.artifacts import ArtifactStore
from penstock.media.async_jobs import AsyncJobStore
from penstock.media.pool import WorkerPool
from penstock.media.records import COMPLETED, FAILED, IN_PROGRESS, QUEUED, VideoJob
from penstock.multimodal.encoding import VIDEO_CONTENT_TYPES, data_url_bytes

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from penstock.gateway import Gateway, ServedModel

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 30.0
DEFAULT_LEASE_S = 30.0
INTERRUPTED_REASON = "the server stopped while this job was running; create it again"
SHUTDOWN_REASON = "the server shut down while this job was running; create it again"
_PROGRESS_STATUSES = frozenset({QUEUED, IN_PROGRESS})
CANCELLED = "cancelled"
_FORMAT_RE = re.compile(r"^[a-z0-9]{1,8}$")
# How often a call the store could not take is made again, while it stays away.
STORE_RETRY_S = 1.0
T = TypeVar("T")


def is_progress(chunk: dict[str, Any]) -> bool:
    return chunk.get("status") in _PROGRESS_STATUSES and not chunk.get("data")


@dataclass
class _Run:
    """A generation being executed."""

    served: ServedModel
    context: Context
    started: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # The latest denoising step reported and when, to time the steps between reports.
    step: int | None = None
    step_at: float = 0.0
    # The video job it runs (None for a one-shot generation), and its progress write.
    job: VideoJob | None = None
    progress_write: asyncio.Task[None] | None = None


@dataclass
class _Outcome:
    """How a video job ended, kept until the store has it."""

    job: VideoJob
    changes: dict[str, Any]
    error: PenstockError | None = None
    # The file stored for it, dropped if the job turns out to be no longer this gateway's.
    artifact: str | None = None

    @property
    def status(self) -> str:
        """How the metrics count its end: completed, failed or cancelled."""
        return CANCELLED if self.changes.get("error_code") == CANCELLED else self.changes["status"]


@dataclass
class JobEvent:
    """A change of one job, as streaming subscribers see it."""

    job: VideoJob
    queue_position: int | None = None
    step: int | None = None
    total_steps: int | None = None
    eta_s: float | None = None
    error: PenstockError | None = None

    @property
    def final(self) -> bool:
        return self.job.finished


class MediaService:
    """Video jobs and one-shot generations on the engines of ``gateway``.

    ``store`` is a folder or fsspec URL for the generated files, ``db_path`` the job
    database (a SQLite file, None for memory, or a database URL), ``workers`` how many
    generations run at once, ``lease_s`` how long a silent gateway sharing the store is
    given before its jobs are taken over. :meth:`start` once before serving, :meth:`stop`
    once after.
    """

    def __init__(
        self,
        gateway: Gateway,
        *,
        store: str,
        db_path: Path | str | None,
        workers: int,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.gateway = gateway
        self.artifacts = ArtifactStore(store)
        self.jobs = AsyncJobStore(db_path)
        self.pool = WorkerPool(workers)
        self.runner = uuid.uuid4().hex
        self.lease_s = lease_s
        self._runs: dict[str, _Run] = {}
        # Video jobs this gateway holds: waiting in its pool or running.
        self._held: set[str] = set()
        # Each other gateway's beat counter, and when (monotonic) it last moved.
        self._beats: dict[str, tuple[int, float]] = {}
        # Whether this gateway's latest beat failed: nobody's lease ran meanwhile.
        self._beat_failed = False
        self._keeper: asyncio.Task[None] | None = None
        # Outcomes of ended jobs that the store could not take yet, and their writer.
        self._unwritten: dict[str, _Outcome] = {}
        self._writer: asyncio.Task[None] | None = None
        self._subscribers: dict[str, list[asyncio.Queue[JobEvent]]] = {}
        self.metrics = gateway.media_metrics
        self.metrics.watch(
            self.jobs.counts_now, lambda: self.pool.waiting, lambda: self.pool.running
        )

    def start(self) -> None:
        """Settle the jobs that gateways no longer running left unfinished, then start the
        workers and the beat. Runs before the gateway serves, so it calls the store
        directly."""
        store = self.jobs.sync
        store.register(self.runner)
        live = {self.runner}
        if store.shared:
            # Gateways registered now get a lease to show they still beat.
            live |= set(self._observe(store.beat(self.runner)))
        self._took_over(*store.settle(live, self.runner, INTERRUPTED_REASON))
        self.pool.start()
        if store.shared:
            self._keeper = asyncio.get_running_loop().create_task(
                self._keep(), name="media-job-keeper"
            )

    async def stop(self) -> None:
        """Cancel the running jobs (they end failed, with the reason), leave the queued
        ones to the other gateways, and close the store."""
        for task in (self._keeper, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        running = [run.job for run in self._runs.values() if run.job is not None]
        await self.pool.stop()
        for job in running:
            self._unwritten[job.id] = self._failure(job, "interrupted", SHUTDOWN_REASON)
        await self._write_unwritten()
        for job_id in self._unwritten:
            logger.warning(
                "video job %s: the job store is away, its outcome is lost; the gateways "
                "sharing the store fail it once this one's lease elapsed",
                job_id,
            )
        try:
            await self.jobs.forget([self.runner])
        except PenstockError as exc:
            logger.warning("could not unregister from the job store: %s", exc.message)
        self.jobs.close()

    # -- gateways sharing the store ------------------------------------------------------

    def _observe(self, beats: dict[str, int]) -> list[str]:
        """The other gateways whose beat moved within the lease."""
        now = time.monotonic()
        if self._beat_failed:
            # The store was away for this gateway, so maybe for all: a lease runs only
            # while the store answers, and every other gateway's starts again now.
            self._beats = {gateway: (count, now) for gateway, (count, _) in self._beats.items()}
            self._beat_failed = False
        live = []
        for gateway, count in beats.items():
            if gateway == self.runner:
                continue
            seen = self._beats.get(gateway)
            if seen is None or seen[0] != count:
                seen = self._beats[gateway] = (count, now)
            if now - seen[1] < self.lease_s:
                live.append(gateway)
        for gone in set(self._beats) - set(beats):
            del self._beats[gone]
        return live

    def _took_over(self, adopted: list[str], failed: list[str]) -> None:
        for job_id in failed:
            logger.warning("video job %s was running when its server stopped", job_id)
        for job_id in adopted:
            self._hold(job_id)

    def _hold(self, job_id: str) -> None:
        self._held.add(job_id)
        self.pool.submit(job_id, lambda: self._run_video(job_id))

    async def _keep(self) -> None:
        """Beat, take over the jobs of dead gateways, and drop the jobs deleted elsewhere
        (a shared store only: a SQLite one is settled once, at startup)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                beats = await self.jobs.beat(self.runner)
            except Exception as exc:
                self._beat_failed = True
                logger.warning("video job upkeep skipped: the beat failed: %s", exc)
                continue
            try:
                live = {self.runner, *self._observe(beats)}
                self._took_over(*await self.jobs.settle(live, self.runner, INTERRUPTED_REASON))
                await self.jobs.forget([gateway for gateway in beats if gateway not in live])
                await self._drop_deleted()
            except PenstockError as exc:
                logger.warning("video job upkeep skipped: %s", exc.message)
            except Exception:
                logger.exception("video job upkeep failed")

    async def _drop_deleted(self) -> None:
        for job_id in set(self._held) - await self.jobs.existing(self._held):
            if self.pool.withdraw(job_id):
                self._held.discard(job_id)
            elif (run := self._runs.get(job_id)) is not None:
                run.served.host.cancel(run.context)

    # -- video jobs ----------------------------------------------------------------------

    def holds(self, job_id: str) -> bool:
        """Whether the job is queued or running on this gateway: not ended, not elsewhere."""
        return job_id in self._held

    async def queue_position(self, job: VideoJob) -> int | None:
        if job.status != QUEUED:
            return None
        if job.id in self._held:
            return self.pool.position(job.id)
        return await self.jobs.queue_position(job.id)

    async def video_object(self, job: VideoJob) -> dict[str, Any]:
        return job.video_object(await self.queue_position(job))

    async def submit_video(self, job: VideoJob) -> None:
        job.runner = self.runner
        await self.jobs.add(job)
        self._hold(job.id)

    def subscribe(self, job_id: str) -> asyncio.Queue[JobEvent]:
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._subscribers.setdefault(job_id, []).append(queue)
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue[JobEvent]) -> None:
        queues = self._subscribers.get(job_id, [])
        with contextlib.suppress(ValueError):
            queues.remove(queue)
        if not queues:
            self._subscribers.pop(job_id, None)

    def _publish(self, event: JobEvent) -> None:
        for queue in self._subscribers.get(event.job.id, []):
            queue.put_nowait(event)

    @staticmethod
    def _failure(
        job: VideoJob, code: str, message: str, error: PenstockError | None = None
    ) -> _Outcome:
        changes = {
            "status": FAILED,
            "error_code": code,
            "error_message": message,
            "completed_at": int(time.time()),
        }
        return _Outcome(job, changes, error)

    async def _end(self, outcome: _Outcome) -> None:
        """Store how a job ended and tell its subscribers; while the store is away the
        outcome waits here and is written once it is back."""
        try:
            stored = await self.jobs.update(outcome.job.id, held_by=self.runner, **outcome.changes)
        except JobStoreUnavailableError as exc:
            logger.warning("video job %s ended; its outcome waits: %s", outcome.job.id, exc)
            self._unwritten[outcome.job.id] = outcome
            if self._writer is None or self._writer.done():
                self._writer = asyncio.get_running_loop().create_task(
                    self._write_later(), name="media-job-outcomes"
                )
            return
        await self._stored(outcome, stored)

    async def _stored(self, outcome: _Outcome, stored: bool) -> None:
        if not stored:
            # Deleted meanwhile, or taken for dead and failed by another gateway.
            if outcome.artifact is not None:
                await asyncio.to_thread(self.artifacts.delete, outcome.artifact)
            return
        self._publish(JobEvent(replace(outcome.job, **outcome.changes), error=outcome.error))

    async def _write_later(self) -> None:
        while self._unwritten:
            await asyncio.sleep(STORE_RETRY_S)
            await self._write_unwritten()

    async def _write_unwritten(self) -> None:
        """Write the outcomes kept while the store was away, until it fails again."""
        for job_id, outcome in list(self._unwritten.items()):
            try:
                stored = await self.jobs.update(job_id, held_by=self.runner, **outcome.changes)
            except JobStoreUnavailableError:
                return
            del self._unwritten[job_id]
            logger.info("video job %s: its outcome is stored", job_id)
            await self._stored(outcome, stored)

    async def cancel_video(self, job_id: str) -> None:
        """Stop a job wherever it is: out of the queue, or stopped between engine steps."""
        if self.pool.withdraw(job_id):
            self._held.discard(job_id)
            return
        run = self._runs.get(job_id)
        if run is None:
            return
        run.served.host.cancel(run.context)
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                await run.done.wait()
        except TimeoutError:
            logger.warning("video job %s still running %.0fs after cancel", job_id, CANCEL_WAIT_S)

    async def delete_video(self, job_id: str) -> None:
        """Cancel the job if it runs, then drop its record and its stored video."""
        await self.cancel_video(job_id)
        job = await self.jobs.get(job_id)
        if job is None:
            return
        await self.jobs.delete(job_id)
        if job.artifact and not job.artifact.startswith(("http://", "https://")):
            await asyncio.to_thread(self.artifacts.delete, job.artifact)

    async def _run_video(self, job_id: str) -> None:
        try:
            await self._claim_and_run(job_id)
        finally:
            self._held.discard(job_id)

    async def _patiently(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``call``, made again while the store is away (nothing can start meanwhile)."""
        while True:
            try:
                return await call(*args)
            except JobStoreUnavailableError:
                await asyncio.sleep(STORE_RETRY_S)

    async def _claimed(self, job_id: str) -> VideoJob | None:
        """The job once this gateway started it; None if it is no longer to start."""
        await self._patiently(self.jobs.claim, job_id, self.runner)
        # Read back rather than trusting the answer: a claim retried after a timeout may
        # find its first attempt committed.
        job = await self._patiently(self.jobs.get, job_id)
        if job is None or job.status != IN_PROGRESS or job.runner != self.runner:
            return None
        return job

    async def _claim_and_run(self, job_id: str) -> None:
        job = await self._claimed(job_id)
        if job is None:
            return
        try:
            served = self.gateway.resolve(job.model)
        except PenstockError as exc:
            await self._end(self._failure(job, "model_not_found", exc.message, exc))
            return
        run = _Run(served, Context(job_id), job=job)
        self._runs[job_id] = run
        try:
            outcome = await self._execute_video(job, run)
            await self._end(outcome)
        finally:
            self._runs.pop(job_id, None)
            run.done.set()
        self._record_end(run, "video", outcome.status)

    def _record_end(self, run: _Run, kind: str, status: str) -> None:
        self.metrics.generation_done(run.served.name, kind, status, time.monotonic() - run.started)

    def _record_step(self, run: _Run, step: Any) -> None:
        """Time the denoising steps since the previous report; the first report only
        starts the clock, as it also covers the work before the first step."""
        if not isinstance(step, int) or isinstance(step, bool):
            return
        now = time.monotonic()
        if run.step is not None and step > run.step:
            self.metrics.steps_done(run.served.name, step - run.step, now - run.step_at)
        run.step, run.step_at = step, now

    async def _execute_video(self, job: VideoJob, run: _Run) -> _Outcome:
        self._publish(JobEvent(job))
        terminal: dict[str, Any] | None = None
        try:
            async for chunk in run.served.host.generate(dict(job.request), run.context):
                if not isinstance(chunk, dict):
                    raise EngineError("engine yielded a non-object")
                terminal = chunk
                if is_progress(chunk):
                    self._record_progress(job, run, chunk)
        except PenstockError as exc:
            return self._failure(job, exc.code, exc.message, exc)
        if run.context.is_stopped():
            return self._failure(job, CANCELLED, "the job was cancelled")
        if terminal is None or is_progress(terminal):
            return self._failure(job, "engine_error", "the engine ended without a video")
        try:
            return await self._stored_result(job, run, terminal)
        except Exception as exc:
            # Whatever the store raises, the job must end failed, never stay in progress.
            logger.exception("could not store the video of job %s", job.id)
            return self._failure(job, "storage_error", f"could not store the video: {exc}")

    def _record_progress(self, job: VideoJob, run: _Run, chunk: dict[str, Any]) -> None:
        try:
            progress = min(max(int(chunk.get("progress", job.progress)), 0), 99)
        except (TypeError, ValueError):
            progress = job.progress
        step, total = chunk.get("step"), chunk.get("total_steps")
        self._record_step(run, step)
        elapsed = time.monotonic() - run.started
        eta: float | None = None
        if isinstance(step, int) and isinstance(total, int) and 0 < step <= total:
            eta = elapsed / step * (total - step)
        elif progress > 0:
            eta = elapsed / progress * (100 - progress)
        if progress != job.progress:
            job.progress = progress
            # One write at a time, never waited for: a slow store must not slow the steps.
            if run.progress_write is None or run.progress_write.done():
                run.progress_write = asyncio.get_running_loop().create_task(
                    self._write_progress(job)
                )
        self._publish(
            JobEvent(
                job,
                step=step if isinstance(step, int) else None,
                total_steps=total if isinstance(total, int) else None,
                eta_s=round(eta, 3) if eta is not None else None,
            )
        )

    async def _write_progress(self, job: VideoJob) -> None:
        try:
            await self.jobs.update(job.id, held_by=self.runner, progress=job.progress)
        except JobStoreUnavailableError as exc:
            logger.warning("video job %s: progress not stored: %s", job.id, exc.message)

    async def _stored_result(self, job: VideoJob, run: _Run, terminal: dict[str, Any]) -> _Outcome:
        """The outcome of an engine's terminal object, its video put in the artifact store."""
        if terminal.get("status") == FAILED or terminal.get("error"):
            return self._failure(job, "generation_failed", str(terminal.get("error") or "failed"))
        items = terminal.get("data") or []
        item = items[0] if items and isinstance(items[0], dict) else {}
        output_format = str(item.get("output_format") or "mp4").lower()
        if not _FORMAT_RE.match(output_format):
            output_format = "bin"
        payload: bytes | None = None
        external_url: str | None = None
        if isinstance(item.get("b64_json"), str):
            payload = data_url_bytes(item["b64_json"])
        elif isinstance(item.get("url"), str):
            url = item["url"]
            if url.startswith("data:"):
                payload = data_url_bytes(url)
            elif url.startswith(("http://", "https://")):
                external_url = url
        if payload is None and external_url is None:
            return self._failure(job, "engine_error", "the engine's answer holds no readable video")
        artifact = external_url
        if payload is not None:
            artifact = f"videos/{job.id}.{output_format}"
            await asyncio.to_thread(self.artifacts.put, artifact, payload)
        inference_time = terminal.get("inference_time_s")
        changes = {
            "status": COMPLETED,
            "progress": 100,
            "completed_at": int(time.time()),
            "artifact": artifact,
            "content_type": VIDEO_CONTENT_TYPES.get(output_format, "application/octet-stream"),
            "inference_time_s": (
                float(inference_time)
                if isinstance(inference_time, int | float)
                else round(time.monotonic() - run.started, 3)
            ),
        }
        return _Outcome(job, changes, artifact=artifact if payload is not None else None)

    # -- one-shot generations (images) ------------------------------------------------

    async def generate_once(
        self, served: ServedModel, request: dict[str, Any], context: Context
    ) -> dict[str, Any]:
        """Run one request through the pool and return the engine's terminal object.

        If the caller goes away, the request leaves the queue or the engine is told to
        stop.
        """
        loop = asyncio.get_running_loop()
        result: asyncio.Future[dict[str, Any]] = loop.create_future()
        key = f"once-{context.id()}"

        async def work() -> None:
            if result.done():
                return
            run = _Run(served, context)
            terminal: dict[str, Any] | None = None
            try:
                async for chunk in served.host.generate(request, context):
                    terminal = chunk
                    if isinstance(chunk, dict) and is_progress(chunk):
                        self._record_step(run, chunk.get("step"))
            except BaseException as exc:
                self._record_end(run, "image", CANCELLED if context.is_stopped() else FAILED)
                if not result.done():
                    result.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            if result.done():
                self._record_end(run, "image", CANCELLED)
                return
            if terminal is None or is_progress(terminal):
                self._record_end(run, "image", FAILED)
                result.set_exception(EngineError("the engine ended without a result"))
            else:
                self._record_end(run, "image", COMPLETED)
                result.set_result(terminal)

        self.pool.submit(key, work)
        try:
            return await asyncio.shield(result)
        except asyncio.CancelledError:
            if not self.pool.withdraw(key):
                served.host.cancel(context)
            raise

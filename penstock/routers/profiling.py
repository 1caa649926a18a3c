"""SGLang's profiling routes: a torch profiler trace of this server process, on the CPU.

* ``POST /start_profile {output_dir, activities?, with_stack?, record_shapes?,
  start_step?, num_steps?, profile_by_stage?}`` -> ``Start profiling.``: records every
  thread of the process (the engine's included) until ``/stop_profile``. ``output_dir``
  is required (a folder this server can write, made if missing); ``activities`` may only
  name ``CPU``; step counts (``start_step``, ``num_steps``) and ``profile_by_stage`` are
  refused by name: the profile spans the calls, not engine steps. A second start while
  one runs is a 409.
* ``POST /stop_profile`` -> ``Stop profiling. Trace written to <path>.``: a Chrome trace
  (``penstock-<time>.trace.json``) in ``output_dir``; none running is a 409.

Admin routes, guarded here and not only by the SGLang router that includes them: the
inference-key check knows an admin route by what the route itself declares
(:func:`penstock.routers.security.is_admin_route`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from penstock.errors import (
    ConflictError,
    InternalServerError,
    InvalidRequestError,
    PenstockError,
    clip,
)
from penstock.rl.fields import bool_field, invalid, json_object_body, required_str
from penstock.routers.security import require_admin_key

router = APIRouter(dependencies=[Depends(require_admin_key)])

_PROFILE_KEY = "torch_profile"
_CPU_ACTIVITIES = frozenset({"CPU"})


def _refuse(field: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{field} is not supported by this server: {reason}",
        param=field,
        code="unsupported_parameter",
    )


class TorchProfile:
    """One ``torch.profiler`` session over every thread of the process.

    The profiler is started and stopped on one thread of its own: torch's profiler must
    stop on the thread that started it, and the event loop must not wait on the export.
    """

    def __init__(self, output_dir: Path, with_stack: bool, record_shapes: bool) -> None:
        self.output_dir = output_dir
        self._options = {"with_stack": with_stack, "record_shapes": record_shapes}
        self._started = threading.Event()
        self._stop = threading.Event()
        self._trace: Path | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="torch-profile", daemon=True)

    def start(self) -> None:
        """Returns once the profiler records, or raises why it could not start."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            if isinstance(self._error, PenstockError):
                raise self._error
            raise ConflictError(f"torch's profiler did not start: {self._error}")

    def finish(self) -> Path:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise InternalServerError(f"the profile trace was not written: {self._error}")
        assert self._trace is not None
        return self._trace

    def _run(self) -> None:
        try:
            profiler = _all_threads_profiler(**self._options)
            profiler.start()
        except Exception as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._stop.wait()
        try:
            profiler.stop()
            path = self.output_dir / f"penstock-{time.time_ns()}.trace.json"
            profiler.export_chrome_trace(str(path))
            self._trace = path
        except Exception as exc:
            self._error = exc


def _all_threads_profiler(with_stack: bool, record_shapes: bool) -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        # The engine runs on threads of its own; by default torch records only the
        # thread that started the profiler.
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        raise InvalidRequestError(
            f"profiling is not supported with torch {torch.__version__}: its profiler "
            "cannot record every thread (profile_all_threads)",
            code="unsupported_operation",
        ) from None
    return profile(
        activities=[ProfilerActivity.CPU],
        with_stack=with_stack,
        record_shapes=record_shapes,
        experimental_config=config,
    )


def _output_dir(body: dict[str, Any]) -> Path:
    folder = Path(required_str(body, "output_dir")).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise invalid("output_dir", f"cannot be made: {exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise invalid("output_dir", "must be a folder")
    return folder


def _check_activities(body: dict[str, Any]) -> None:
    activities = body.get("activities")
    if activities is None:
        return
    if not isinstance(activities, list) or not all(isinstance(a, str) for a in activities):
        raise invalid("activities", "must be a list of strings")
    others = [a for a in activities if a not in _CPU_ACTIVITIES]
    if others:
        raise _refuse("activities", f"only CPU is profiled here, got {clip(repr(others))}")


@router.post("/start_profile")
async def start_profile(request: Request) -> PlainTextResponse:
    body = await json_object_body(request)
    for field in ("start_step", "num_steps"):
        if body.get(field) is not None:
            raise _refuse(field, "the profile runs from /start_profile to /stop_profile")
    if bool_field(body, "profile_by_stage", False):
        raise _refuse("profile_by_stage", "the engine has no prefill/decode stages to split")
    _check_activities(body)
    with_stack = bool_field(body, "with_stack", False)
    record_shapes = bool_field(body, "record_shapes", False)
    folder = _output_dir(body)
    if getattr(request.app.state, _PROFILE_KEY, None) is not None:
        raise ConflictError("a profile is running already: POST /stop_profile first")
    profile = TorchProfile(folder, with_stack, record_shapes)
    # Claimed before the wait, so a second start can't begin meanwhile.
    setattr(request.app.state, _PROFILE_KEY, profile)
    try:
        await asyncio.to_thread(profile.start)
    except BaseException:
        setattr(request.app.state, _PROFILE_KEY, None)
        raise
    return PlainTextResponse("Start profiling.\n")


@router.post("/stop_profile")
async def stop_profile(request: Request) -> PlainTextResponse:
    profile: TorchProfile | None = getattr(request.app.state, _PROFILE_KEY, None)
    if profile is None:
        raise ConflictError("no profile is running: POST /start_profile first")
    setattr(request.app.state, _PROFILE_KEY, None)
    path = await asyncio.to_thread(profile.finish)
    return PlainTextResponse(f"Stop profiling. Trace written to {path}.\n")

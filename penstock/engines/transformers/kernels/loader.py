"""Builds a C++ extension from this folder's sources on first use, then loads it from disk.

A build lands in ``torch_extensions/<name>_<key>/<name>_<key>.so`` of the model cache
folder. The key is a digest of what the library depends on and nothing else: the sources
(with the local headers they include, so an edited kernel is built afresh), the compiler
flags (which name the CPU features the build uses), torch's version and C++ ABI, and
Python's. Not the path of the torch that built it: ``torch.utils.cpp_extension``'s own
build folder records its venv's include paths, so two venvs sharing one cache folder
rebuilt it on every alternate start; here a second venv with the same torch loads the
first one's library as it is.

The compiler runs under a child process of its own session (``build.py``, which calls
``cpp_extension.load`` into a private staging folder), so a start stopped mid-build (see
:func:`run_cancellable`) kills them all at once instead of waiting a minute for them.
The finished library is moved into place in one rename, under a file lock that makes a
second process starting at the same time wait for the first's build and then load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
_BUILD_SCRIPT = KERNEL_DIR / "build.py"
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# How many lines of a failed build's output its error carries.
_ERROR_LINES = 12
_LOCK_POLL_S = 0.2
# at::parallel_for splits a kernel over torch's intra-op threads (--cpu-threads) only where
# it is compiled with OpenMP: without it, one thread runs the whole range. build.py links
# with it too, and the libgomp.so.1 that needs is the one torch has loaded (same soname),
# so the kernels share torch's threads and thread count.
_PARALLEL_FLAGS = ["-fopenmp"]

T = TypeVar("T")


class KernelBuildError(Exception):
    """A kernel could not be built; the message says why in a line or a few."""


class CompilerMissing(KernelBuildError):
    """No C++ compiler: none of the kernels can be built."""


class BuildCancelled(BaseException):
    """The start that asked for the build was stopped. A ``BaseException``, like
    ``CancelledError``, so that a caller's fallback for a failed build lets it through."""


class _BuildScope:
    """The builds one start runs, so that stopping the start kills them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen[bytes]] = set()
        self.cancelled = False

    def track(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._children.add(child)
            if self.cancelled:
                _kill_build(child)

    def untrack(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._children.discard(child)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            for child in self._children:
                _kill_build(child)


_compiler_reported = threading.Event()
_NO_COMPILER_COST = (
    "decode attention copies each row's KV into a padded batch and weights stay float32: "
    "the same results, slower decoding"
)


def report_missing_compiler(exc: CompilerMissing) -> None:
    """Log, once per process, the one warning that names all a missing compiler costs."""
    if not _compiler_reported.is_set():
        _compiler_reported.set()
        logger.warning("the CPU kernels cannot be built, %s; %s", exc, _NO_COMPILER_COST)


def compiler_missing_reported() -> bool:
    return _compiler_reported.is_set()


_scope: contextvars.ContextVar[_BuildScope | None] = contextvars.ContextVar(
    "penstock_kernel_builds", default=None
)


async def run_cancellable(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` in a thread, as ``asyncio.to_thread``; cancelling the await kills
    the kernel builds the call is running, which then raise :class:`BuildCancelled` in the
    thread, and keeps it from starting more, so the thread ends within a moment."""
    scope = _BuildScope()
    token = _scope.set(scope)
    try:
        # to_thread runs the call in a copy of this context: the builds find their scope.
        return await asyncio.to_thread(call, *args)
    except asyncio.CancelledError:
        scope.cancel()
        raise
    finally:
        _scope.reset(token)


def source_files(sources: list[str], folder: Path = KERNEL_DIR) -> list[Path]:
    """``sources`` and every local header they include, directly or not, in a stable order."""
    found: list[Path] = []
    pending = [folder / name for name in sources]
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found.append(path)
        included = _LOCAL_INCLUDE.findall(path.read_text(encoding="utf-8"))
        pending += [path.parent / name for name in included]
    return found


def toolchain() -> list[str]:
    """What a built library depends on besides its sources and flags."""
    return [
        torch.__version__,
        f"cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        sys.implementation.cache_tag or sys.version,
        platform.machine(),
    ]


def compiler_flags(flags: tuple[str, ...] | list[str]) -> list[str]:
    """A kernel's own flags and the ones every kernel is built with."""
    return [*flags, *_PARALLEL_FLAGS]


def build_name(
    name: str, sources: list[str], folder: Path = KERNEL_DIR, flags: tuple[str, ...] = ()
) -> str:
    digest = hashlib.sha256()
    for path in source_files(sources, folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join([*compiler_flags(flags), *toolchain()]).encode())
    return f"{name}_{digest.hexdigest()[:16]}"


def load_extension(
    name: str,
    sources: list[str],
    flags: list[str],
    cache_dir: Path,
    *,
    build_cpu_s: float,
    folder: Path = KERNEL_DIR,
) -> Any:
    """Import the extension ``name`` built from ``sources`` (files of ``folder``),
    building it first when the cache holds no build of them (``build_cpu_s``: the CPU
    seconds that takes, for the log). Raises :class:`KernelBuildError` when it cannot be
    built or loaded, :class:`BuildCancelled` when its start is stopped meanwhile."""
    full_name = build_name(name, sources, folder, tuple(flags))
    root = cache_dir / "torch_extensions"
    library = root / full_name / f"{full_name}.so"
    if not library.exists():
        root.mkdir(parents=True, exist_ok=True)
        with _build_lock(root / f"{full_name}.lock", full_name):
            if not library.exists():
                _build(
                    full_name, [folder / source for source in sources], flags, library, build_cpu_s
                )
    try:
        return _import_library(full_name, library)
    except ImportError as exc:
        raise KernelBuildError(f"{library} cannot be loaded: {exc}") from exc


def _import_library(full_name: str, library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(full_name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(path: Path, full_name: str) -> Iterator[None]:
    """Held while one process builds ``full_name``; another one waits (stoppably)."""
    scope = _scope.get()
    with path.open("a") as handle:
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if scope is not None and scope.cancelled:
                    raise BuildCancelled from None
                if not waiting:
                    logger.info("waiting for another process's build of CPU kernel %s", full_name)
                    waiting = True
                time.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def expected_build_s(build_cpu_s: float) -> float:
    """Wall seconds for a single-threaded build of ``build_cpu_s`` CPU seconds on this
    machine as loaded as it is now."""
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return build_cpu_s * max(1.0, busy)


def _build(
    full_name: str, sources: list[Path], flags: list[str], library: Path, build_cpu_s: float
) -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CompilerMissing(f"no C++ compiler ({compiler!r} is not on PATH; CXX names it)")
    logger.info(
        "building CPU kernel %s for this CPU (first start only, about %.0f s) into %s",
        full_name,
        expected_build_s(build_cpu_s),
        library.parent.parent,
    )
    started = time.monotonic()
    # Under the lock, a staging folder of this build is a killed process's leftover.
    for leftover in library.parent.parent.glob(f"{full_name}.building.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{full_name}.building.", dir=library.parent.parent))
    try:
        _run_build(full_name, sources, flags, staging)
        library.parent.mkdir(exist_ok=True)
        os.replace(staging / library.name, library)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "built CPU kernel %s in %.0f s; later starts load it from the cache",
        full_name,
        time.monotonic() - started,
    )


def _run_build(full_name: str, sources: list[Path], flags: list[str], staging: Path) -> None:
    scope = _scope.get()
    if scope is not None and scope.cancelled:
        raise BuildCancelled
    flags = compiler_flags(flags)
    command = [sys.executable, str(_BUILD_SCRIPT), full_name, str(staging), json.dumps(flags)]
    # The venv's own ninja, where it has one, even when the venv is not activated.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    with (staging / "build.log").open("w+b") as log:
        child = subprocess.Popen(
            [*command, *map(str, sources)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PATH": path},
            start_new_session=True,
        )
        if scope is not None:
            scope.track(child)
        try:
            code = child.wait()
        finally:
            if scope is not None:
                scope.untrack(child)
            if child.poll() is None:
                _kill_build(child)
                child.wait()
        if scope is not None and scope.cancelled:
            raise BuildCancelled
        if code != 0:
            log.seek(0)
            lines = log.read().decode(errors="replace").strip().splitlines()
            tail = "\n".join(lines[-_ERROR_LINES:])
            raise KernelBuildError(f"the build of {full_name} failed (exit {code}):\n{tail}")


def _kill_build(child: subprocess.Popen[bytes]) -> None:
    """Kill the build: every process of the child's session. ninja runs each compiler in
    a process group of its own, so killing the child's group would leave them running."""
    # Twice: ninja may have started a compiler between the first pass's reads and kills.
    for _ in range(2):
        for pid in _session_members(child.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == session:
                    members.append(int(entry.name))
    return members

"""A SIGTERM while the first start builds its CPU kernels ends the server at once: the
compiler is killed with it, not waited for (it takes a minute or more), and no build is
left half-written in the cache.

The module starts one server on a tiny checkpoint with an empty cache folder, so its
start builds the paged attention kernel; it is stopped a moment into that build.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import pytest

from tests.support.server import start_server
from tests.support.tiny_llm import build_tiny_llama

pytestmark = pytest.mark.timeout(400)

# The bound is 2 s; this one leaves room for a machine under load.
EXIT_BOUND_S = 10


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, grown = {root}, True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in below and pid not in below:
                below.add(pid)
                grown = True
    return below - {root}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_sigterm_during_the_first_kernel_build_ends_the_server_promptly(
    tmp_path: Path,
) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    cache = tmp_path / "cache"
    args = ["--engine", "transformers", "--model", str(model)]
    server = start_server(
        args, tmp_path, env={"PENSTOCK_MODEL_CACHE": str(cache)}, wait_ready=False
    )
    try:
        deadline = time.monotonic() + 300
        while "building CPU kernel" not in server.log():
            assert server.process.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        # Past the build's start: its compiler is running.
        time.sleep(3)
        build = descendants(server.process.pid)
        assert build, server.log()
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log()
        took = time.monotonic() - signalled
        print(f"exited {took:.2f} s after the SIGTERM")
        assert took < EXIT_BOUND_S, server.log()
    finally:
        if server.process.poll() is None:
            server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in build) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in build if alive(pid)]
    log = server.log()
    assert "told to stop while the engine was starting" in log
    assert "built CPU kernel" not in log and "Traceback" not in log
    assert list((cache / "torch_extensions").rglob("*.so")) == []
    assert [path.name for path in (cache / "torch_extensions").iterdir() if path.is_dir()] == []

"""One NIXL agent over UCX: what embedding transfer (:mod:`penstock.multimodal.transfer`)
and weight pulls (:mod:`penstock.engines.weights.sync`) share.

The NIXL module is imported on first use (``nixl`` or ``nixl_cu12``/``nixl_cu13``,
whichever is installed: ``pip install 'penstock[nixl]'``). Agents are created with the UCX
backend only, so NIXL does not try plugins that cannot load here. NIXL's progress thread
spins about half a core even while idle; an agent whose owner keeps polling while a peer
may need it (its own transfers, and notifications while a peer connects or reads) goes
without it (``progress_thread=False``): polling makes the same progress. Between
processes on one host UCX copies through the kernel (``cma``), with GPU memory on CUDA
machines. An agent is not thread-safe: one owner at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_POLL_S = 0.001


def nixl_api() -> Any:
    """The ``_api`` module of whichever NIXL package is installed."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise RuntimeError("NIXL transfers need NIXL: pip install 'penstock[nixl]'")


def nixl_installed() -> bool:
    """Whether a NIXL package is installed, without importing it (that imports torch)."""
    return any(
        importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu12", "nixl_cu13")
    )


def mem_type_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id for a tensor's memory."""
    device = tensor.get_device()
    return ("DRAM", 0) if device < 0 else ("VRAM", device)


class NixlAgent:
    """One NIXL agent over UCX, and the notifications it has received but not yet used."""

    def __init__(self, role: str, *, progress_thread: bool = True) -> None:
        api = nixl_api()
        self.name = f"penstock-{role}-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = api.nixl_agent(self.name, config)
        self.remotes: set[str] = set()
        self._arrived: set[tuple[str, bytes]] = set()

    def metadata(self) -> bytes:
        """This agent's metadata as of now: it lists the memory registered so far."""
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh) a peer's metadata; returns its agent name."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.remotes.add(name)
        return name

    def forget(self, remote: str) -> None:
        """Drop a peer's metadata (and the connection to it)."""
        if remote in self.remotes:
            self.remotes.discard(remote)
            self.agent.remove_remote_agent(remote)

    def poll(self) -> list[tuple[str, bytes]]:
        return [
            (remote, message)
            for remote, messages in self.agent.get_new_notifs().items()
            for message in messages
        ]

    def take(self, remote: str | None, message: bytes) -> bool:
        """Whether that exact notification has arrived (consuming it); ``None``: from anyone."""
        self._arrived.update(self.poll())
        for arrived in self._arrived:
            if arrived[1] == message and (remote is None or arrived[0] == remote):
                self._arrived.discard(arrived)
                return True
        return False

    def wait_for(self, remote: str | None, message: bytes, timeout_s: float) -> bool:
        """Block until that notification arrives; False when it did not in time."""
        deadline = time.monotonic() + timeout_s
        while not self.take(remote, message):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    async def run(self, local: Any, remote: Any, peer: str, op: str, tag: bytes) -> bool:
        """One READ or WRITE to completion, yielding to the event loop; False when it failed."""
        handle = self.agent.initialize_xfer(op, local, remote, peer, tag)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                await asyncio.sleep(0)
                state = self.agent.check_xfer_state(handle)
            return state == "DONE"
        finally:
            self.agent.release_xfer_handle(handle)

    def run_blocking(self, handle: Any) -> bool:
        """Post a transfer made by ``initialize_xfer`` and block this thread until it ends."""
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                # Lets the process's other threads (its event loop) run between polls.
                time.sleep(0)
                state = self.agent.check_xfer_state(handle)
            return state == "DONE"
        finally:
            self.agent.release_xfer_handle(handle)

"""The trainer's half of weight sync: the client a trainer author would otherwise write.

::

    from penstock.rl.trainer import WeightPusher

    pusher = WeightPusher("http://engine:8000", admin_key="...")
    pusher.init_group("10.0.0.5", 29500)           # this process becomes rank 0 (gloo/nccl)
                                                   # of 1 + one rank per fleet replica
    pusher.pause()                                 # keep mode: in-flight requests freeze
    reply = pusher.broadcast(model.state_dict(), weight_version="step-3")
    assert reply["checksum"] == pusher.checksum(model.state_dict(), dtype=torch.float32)
    pusher.resume()
    pusher.push_tensors(some_tensors, weight_version="step-4")  # same, over HTTP
    pusher.push_nixl(model.state_dict(), weight_version="step-5")  # the engine READs them
    pusher.push_cuda_ipc(cuda_state, weight_version="step-6")  # colocated, same GPU

The HTTP calls speak SGLang's routes. A broadcast posts the metadata and sends the bytes
at the same time; if the engine refuses the request while this side is still sending,
the collective is abandoned with the engine's error and the group must be re-created
(``destroy_group`` then ``init_group``). A NIXL push registers the tensors with this
process's NIXL agent (made on the first push), posts their descriptors, polls the agent
(which serves the engines' connections) until the engine answers and the READ
notification of every engine that read is in (one per replica of a ``--ray`` fleet),
then deregisters them; the engines read this process's memory meanwhile, so the tensors
must not change until the call returns. A CUDA-IPC push (``push_cuda_ipc``, for a trainer
on the engine's own GPU; the server needs ``--trust-weight-payloads``) posts the tensors'
IPC handles, and the engine copies from this process's GPU memory before it answers.
``init_group(..., backend="nccl")`` needs the engine on CUDA and this rank on another GPU
(NCCL takes one rank per GPU). Torch is imported only when a method needs it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from penstock.engines.weights.sync import (
    DEFAULT_GROUP_NAME,
    distinct_regions,
    dtype_name,
    encode_safetensors,
    init_custom_process_group,
    nixl_pull_body,
    weights_checksum,
)

if TYPE_CHECKING:
    import torch


class EngineRefused(RuntimeError):
    """The engine answered a weight-sync call with an error status."""

    def __init__(self, response: httpx.Response) -> None:
        self.status_code = response.status_code
        try:
            self.body: Any = response.json()
        except ValueError:
            self.body = response.text
        super().__init__(f"{response.request.url.path}: {response.status_code} {self.body}")


def readers_of(answer: Mapping[str, Any]) -> int:
    """How many engines READ a NIXL push: each replica of a ``--ray`` fleet (its answer
    lists them under ``replicas``), else the one engine."""
    replicas = answer.get("replicas")
    if isinstance(replicas, dict) and replicas:
        return sum(1 for replica in replicas.values() if replica.get("ok"))
    return 1


def broadcast_body(
    tensors: Mapping[str, torch.Tensor],
    group_name: str = DEFAULT_GROUP_NAME,
    *,
    weight_version: str | None = None,
    flattened: bool = False,
) -> dict[str, Any]:
    """The ``update_weights_from_distributed`` body announcing ``tensors``, in their order
    (the order rank 0 broadcasts them in)."""
    body: dict[str, Any] = {
        "names": list(tensors),
        "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": group_name,
        "flush_cache": True,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    if flattened:
        body["load_format"] = "flattened_bucket"
    return body


def cuda_ipc_entry(tensors: Mapping[str, torch.Tensor]) -> str:
    """One ``serialized_named_tensors`` entry holding IPC handles to CUDA ``tensors``,
    which must stay unchanged until the engine has answered."""
    import base64
    from multiprocessing.reduction import ForkingPickler

    # Importing torch.multiprocessing registers the reducers that pickle CUDA storage
    # as an IPC handle instead of its bytes.
    import torch.multiprocessing  # noqa: F401

    off_gpu = [name for name, t in tensors.items() if not t.is_cuda]
    if off_gpu:
        raise ValueError(
            f"a CUDA-IPC push sends CUDA tensors; {', '.join(off_gpu[:5])} are not on a GPU: "
            "use push_tensors"
        )
    pairs = [(name, t.detach().contiguous()) for name, t in tensors.items()]
    return base64.b64encode(ForkingPickler.dumps(pairs)).decode()


class WeightPusher:
    def __init__(
        self, base_url: str, *, admin_key: str | None = None, timeout_s: float = 120.0
    ) -> None:
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self.group: Any = None
        self.group_name = DEFAULT_GROUP_NAME
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._nixl: Any = None
        self._pushes = itertools.count()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        agent, self._nixl = self._nixl, None
        if agent is not None:
            for remote in list(agent.remotes):
                agent.forget(remote)

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self.http.post(path, json=body or {})
        if response.is_error:
            raise EngineRefused(response)
        result: dict[str, Any] = response.json()
        return result

    def pause(self, mode: str = "retract") -> dict[str, Any]:
        return self.post("/pause_generation", {"mode": mode})

    def resume(self) -> dict[str, Any]:
        return self.post("/continue_generation")

    @staticmethod
    def checksum(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
        """What the engine answers after holding exactly ``tensors`` (in ``dtype``)."""
        return weights_checksum(tensors, dtype)[0]

    def init_group(
        self,
        master_address: str,
        master_port: int,
        *,
        world_size: int | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        timeout_s: float = 30.0,
    ) -> dict[str, Any]:
        """Ask the engine to join as rank 1.., and join as rank 0 meanwhile.

        ``world_size`` defaults to 1 + :meth:`engine_ranks`: one rank per replica of a
        ``--ray`` fleet (each joins with its own rank), else one."""
        if world_size is None:
            world_size = 1 + self.engine_ranks()
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
            "timeout_s": timeout_s,
        }
        joined = self._pool.submit(self.post, "/init_weights_update_group", body)
        self.group = init_custom_process_group(
            backend=backend,
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            timeout_s=timeout_s,
        )
        self.group_name = group_name
        return joined.result()

    def engine_ranks(self) -> int:
        """How many ranks the server's engines take in a weights update group: its fleet's
        live replicas under ``--ray``, else 1."""
        response = self.http.get("/engine/capabilities")
        if response.is_error:
            raise EngineRefused(response)
        fleet = response.json().get("fleet")
        return int(fleet["size"]) if isinstance(fleet, dict) and fleet.get("size") else 1

    def destroy_group(self) -> dict[str, Any]:
        from penstock.engines.weights.sync import destroy_process_group

        result = self.post("/destroy_weights_update_group", {"group_name": self.group_name})
        if self.group is not None:
            destroy_process_group(self.group)
            self.group = None
        return result

    def broadcast(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None = None,
        flattened: bool = False,
    ) -> dict[str, Any]:
        """Post the metadata and broadcast the bytes; the engine's answer (with checksum)."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            raise RuntimeError("init_group first")
        items = [(name, t.detach().contiguous()) for name, t in tensors.items()]
        body = broadcast_body(
            dict(items), self.group_name, weight_version=weight_version, flattened=flattened
        )
        answered = self._pool.submit(self.post, "/update_weights_from_distributed", body)
        sends = (
            [torch.cat([t.reshape(-1) for _, t in items])] if flattened else [t for _, t in items]
        )
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in sends]
        # An engine that refuses before receiving would leave the sends waiting for the
        # group timeout: its answer ends the wait.
        while not all(work.is_completed() for work in works):
            refusal = answered.exception() if answered.done() else None
            if refusal is not None:
                raise refusal
            time.sleep(0.001)
        for work in works:
            work.wait()
        return answered.result()

    def push_tensors(
        self, tensors: Mapping[str, torch.Tensor], *, weight_version: str | None = None
    ) -> dict[str, Any]:
        """``update_weights_from_tensor`` with base64 safetensors bytes."""
        return self._post_tensor_entry(encode_safetensors(tensors), weight_version)

    def push_cuda_ipc(
        self, tensors: Mapping[str, torch.Tensor], *, weight_version: str | None = None
    ) -> dict[str, Any]:
        """``update_weights_from_tensor`` with CUDA IPC handles: one pickled list of
        ``(name, tensor)``, as SGLang's ``MultiprocessingSerializer`` sends it."""
        return self._post_tensor_entry(cuda_ipc_entry(tensors), weight_version)

    def _post_tensor_entry(self, entry: str, weight_version: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"serialized_named_tensors": [entry], "flush_cache": True}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self.post("/update_weights_from_tensor", body)

    def push_nixl(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None = None,
        notify_timeout_s: float = 10.0,
    ) -> dict[str, Any]:
        """``update_weights_from_nixl``: the engine READs ``tensors`` from this process."""
        from penstock.nixl_agent import NixlAgent

        if self._nixl is None:
            # Polled below while the engine connects and reads: no idle progress thread.
            self._nixl = NixlAgent("trainer", progress_thread=False)
        agent = self._nixl
        items = {name: t.detach().contiguous() for name, t in tensors.items()}
        registration = agent.agent.register_memory(distinct_regions(items.values()))
        try:
            notify = f"penstock-weights-{next(self._pushes)}"
            body = nixl_pull_body(agent.name, agent.metadata(), items, notify)
            body["flush_cache"] = True
            if weight_version is not None:
                body["weight_version"] = weight_version
            answered = self._pool.submit(self.post, "/update_weights_from_nixl", body)
            tag = notify.encode()
            notified = 0
            # Polled until the answer, not just until the first notification: this agent
            # has no progress thread, and each replica of a fleet reads on its own.
            while not answered.done():
                notified += agent.take(None, tag)
                time.sleep(0.001)
            answer = answered.result()
            # Each reader notifies after its READ, maybe a little after the answer; once
            # all are in, no READ of this memory is outstanding.
            for reader in range(notified, readers_of(answer)):
                if not agent.wait_for(None, tag, notify_timeout_s):
                    raise RuntimeError(
                        f"the READ notification {notify!r} of reader {reader + 1} never came"
                    )
            return answer
        finally:
            agent.agent.deregister_memory(registration)

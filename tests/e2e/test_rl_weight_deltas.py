"""Weight syncs through the disk, as the trainers drive them, against ``penstock serve
--engine transformers`` on the tiny Llama.

slime's and SkyRL's delta syncs: this process publishes each version in the trainer's own
layout (zstd-compressed patches of the previous version's bytes, each with the checksum
of its new bytes), asks the server to pull it into a host-local checkpoint, then has it
reload that checkpoint. Afterwards the greedy tokens and logprobs are the trainer's own.
AReaL's LoRA reload from a folder: afterwards the adapter's greedy tokens are peft's.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from safetensors.numpy import load_file, save_file
from transformers import LlamaForCausalLM

from penstock.rl.deltas import checksum
from tests.e2e.test_rl_trainer_weights import assert_serves, trained
from tests.engines.transformers.conftest import peft_greedy, save_tiny_lora
from tests.support.server import ServerProcess, transformers_server
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "delta-admin-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    with transformers_server(
        model_dir, tmp_path_factory.mktemp("serve"), "--admin-api-key", ADMIN_KEY
    ) as process:
        yield process


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        yield http


def tensor_bytes(folder: Path) -> dict[str, np.ndarray]:
    """Each tensor of a checkpoint as its raw bytes."""
    return {
        name: np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        for name, array in load_file(folder / "model.safetensors").items()
    }


def saved(model: LlamaForCausalLM, folder: Path) -> dict[str, np.ndarray]:
    model.save_pretrained(folder)
    return tensor_bytes(folder)


def overwrite_patch(old: np.ndarray, new: np.ndarray) -> bytes:
    """slime's ``overwrite`` encoding: count, positions (u32 each), new bytes there."""
    positions = np.flatnonzero(old != new).astype("<u4")
    count = np.array([positions.size], "<u4")
    return count.tobytes() + positions.tobytes() + new[positions].tobytes()


def publish_slime(
    folder: Path,
    version: int,
    old: dict[str, np.ndarray],
    new: dict[str, np.ndarray],
    *,
    encoding: str,
    algorithm: str,
    digest: Any,
) -> None:
    """``weight_v<N>/`` as slime's ``UpdateWeightFromDiskDelta`` writes it."""
    folder.mkdir(parents=True)
    payload: dict[str, np.ndarray] = {}
    sums: dict[str, str] = {}
    for name, data in new.items():
        if np.array_equal(data, old[name]):
            continue
        raw = (
            (data ^ old[name]).tobytes() if encoding == "xor" else overwrite_patch(old[name], data)
        )
        payload[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(raw), np.uint8)
        sums[name] = digest(data)
    save_file(payload, str(folder / "model-00000-of-00001.safetensors"), metadata=sums)
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": algorithm,
        },
        "weight_map": {name: "model-00000-of-00001.safetensors" for name in payload},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def adler32(data: np.ndarray) -> str:
    return f"{zlib.adler32(data.tobytes()) & 0xFFFFFFFF:08x}"


def sha256(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


def test_xxh3_128_matches_the_reference_digests() -> None:
    # XXH3-128 test vectors: the empty input and "abc", as xxhash's hexdigest prints them.
    assert checksum("xxh3-128", np.zeros(0, np.uint8)) == "99aa06d3014798d86001c324468d497f"
    abc = np.frombuffer(b"abc", np.uint8)
    assert checksum("xxh3-128", abc) == "06b05ab6733a618578af5f94892f3950"


def slime_reload(admin: httpx.Client, local: Path, version: str) -> None:
    """slime's ``_reload_engines`` after the pull: pause, flush, disk update, continue."""
    assert admin.post("/pause_generation", json={}).status_code == 200
    try:
        assert admin.get("/flush_cache").status_code == 200
        body = {"model_path": str(local), "weight_version": version}
        reloaded = admin.post("/update_weights_from_disk", json=body)
        assert reloaded.status_code == 200, reloaded.text
    finally:
        assert admin.post("/continue_generation", json={}).status_code == 200


def test_slime_pulls_deltas_and_reloads_them(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    source, local = tmp_path / "published", tmp_path / "local"
    source.mkdir()

    def pull(target: int) -> httpx.Response:
        body = {
            "local_checkpoint_dir": str(local),
            "source_dir": str(source),
            "target_version": target,
        }
        return admin.post("/pull_weights", json=body)

    missing = admin.post(
        "/pull_weights",
        json={
            "local_checkpoint_dir": str(local),
            "source_dir": str(tmp_path / "nowhere"),
            "target_version": 1,
        },
    )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "source_dir"
    # slime's baseline capture: version 0 is the served model's own checkpoint.
    first = pull(0)
    assert first.status_code == 200, first.text
    assert first.json()["success"] is True
    base = tensor_bytes(model_dir)
    one, two = trained(tmp_path, model_dir, seed=5), trained(tmp_path, model_dir, seed=6)
    step_one, step_two = saved(one, tmp_path / "one"), saved(two, tmp_path / "two")
    publish_slime(
        source / "weight_v000001",
        1,
        base,
        step_one,
        encoding="xor",
        algorithm="adler32",
        digest=adler32,
    )
    publish_slime(
        source / "weight_v000002",
        2,
        step_one,
        step_two,
        encoding="overwrite",
        algorithm="xxh3-128",
        digest=lambda data: checksum("xxh3-128", data),
    )
    pulled = pull(2)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["applied_versions"] == [1, 2]
    assert all(np.array_equal(tensor_bytes(local)[n], b) for n, b in step_two.items())
    slime_reload(admin, local, "2")
    assert admin.get("/get_weight_version").json()["weight_version"] == "2"
    assert_serves(admin, two)

    # A version whose published checksums do not match what the patches produce: a 400,
    # and the served weights and version stay.
    three = saved(trained(tmp_path, model_dir, seed=7), tmp_path / "three")
    publish_slime(
        source / "weight_v000003",
        3,
        step_two,
        three,
        encoding="xor",
        algorithm="sha256",
        digest=lambda data: sha256(data[::-1]),
    )
    refused = pull(3)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_weights"
    assert "checksums" in refused.json()["error"]["message"]
    assert admin.get("/get_weight_version").json()["weight_version"] == "2"
    assert_serves(admin, two)
    # The half-patched copy is never reused: the next pull starts again from the base.
    again = pull(2)
    assert again.status_code == 200, again.text
    assert again.json()["seeded_from"] == str(model_dir)
    assert again.json()["applied_versions"] == [1, 2]
    assert all(np.array_equal(tensor_bytes(local)[n], b) for n, b in step_two.items())


def publish_skyrl(
    sync_dir: Path, version: int, old: dict[str, np.ndarray], new: dict[str, np.ndarray]
) -> dict[str, Any]:
    """``delta-<N>/`` as SkyRL's ``DeltaCheckpointPublisher`` writes it; returns the
    ``update_info`` its ``publish`` hands the receivers."""
    folder = sync_dir / f"delta-{version:08d}"
    folder.mkdir(parents=True)
    payload_file = "delta-rank00000-file000000.safetensors"
    payload: dict[str, np.ndarray] = {}
    records = []
    for name, data in new.items():
        patch = data ^ old[name]
        if not patch.any():
            continue
        compressed = zstandard.ZstdCompressor(level=1).compress(patch.tobytes())
        payload[name] = np.frombuffer(compressed, np.uint8)
        records.append(
            {
                "name": name,
                "dtype": "float32",
                "shape": [data.size // 4],
                "uncompressed_num_bytes": data.size,
                "compressed_num_bytes": len(compressed),
                "payload_file": payload_file,
                "payload_key": name,
                "checksum": sha256(data),
                "checksum_algorithm": "sha256",
            }
        )
    save_file(payload, str(folder / payload_file))
    manifest = {
        "version": version,
        "base_version": version - 1,
        "tensors": records,
        "total_uncompressed_num_bytes": sum(r["uncompressed_num_bytes"] for r in records),
        "total_compressed_num_bytes": sum(r["compressed_num_bytes"] for r in records),
        "payload_files": [payload_file],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    uri = str(folder)
    return {"target_version": version, "version": version, "sync_dir": str(sync_dir), "uri": uri}


def test_skyrl_fetches_a_delta_and_reloads_it(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    sync_dir, local = tmp_path / "sync", tmp_path / "skyrl-local"
    # ``DeltaInitInfo.to_api_payload``.
    init_info = {
        "base_model_path": str(model_dir),
        "local_checkpoint_dir": str(local),
        "cloud_download_workers": 4,
        "checkpoint_load_format": "vllm_multi_thread_safetensors",
        "multi_thread_safetensors_max_workers": 8,
    }
    init = admin.post("/init_weight_transfer_engine", json={"init_info": init_info})
    assert init.status_code == 200, init.text
    model = trained(tmp_path, model_dir, seed=8)
    update_info = publish_skyrl(
        sync_dir, 1, tensor_bytes(model_dir), saved(model, tmp_path / "step")
    )
    remote = admin.post("/fetch_weights", json={"target_version": 1, "uri": "s3://bucket/x"})
    assert remote.status_code == 400
    assert remote.json()["error"]["param"] == "uri"
    # ``DeltaWeightTransferSender._apply_receiver_update``, call by call.
    fetch = {"target_version": 1, "sync_dir": update_info["sync_dir"], "uri": update_info["uri"]}
    fetched = admin.post("/fetch_weights", json=fetch)
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["status"] == "ok"
    assert admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    try:
        reset = admin.post("/reset_prefix_cache", json={"reset_running_requests": True})
        assert reset.status_code == 200
        start = {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}
        assert admin.post("/collective_rpc", json=start).status_code == 200
        reloaded = admin.post("/update_weights", json={"update_info": update_info})
        assert reloaded.status_code == 200, reloaded.text
        finish = admin.post("/collective_rpc", json={"method": "skyrl_finish_weight_update"})
        assert finish.status_code == 200
    finally:
        assert admin.post("/resume").status_code == 200
    assert_serves(admin, model)
    assert admin.get("/weight_info").json()["weight_version"] == "1"


def test_areal_reloads_a_lora_adapter_from_its_folder(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    prompt = [5, 17, 42, 9]
    base = admin.get("/v1/models").json()["data"][0]["id"]
    # The syncs above replaced the base weights; peft runs the adapters on the originals.
    slime_reload(admin, model_dir, "base")
    steps = [save_tiny_lora(model_dir, tmp_path / f"step_{n}", seed=40 + n) for n in range(2)]
    for version, step in enumerate(steps):
        # ``UpdateWeightsRequestLora``, one versioned adapter name per step as AReaL names them.
        body = {
            "lora_model_path": str(step),
            "lora_name": "policy-v0",
            "lora_int_id": 1,
            "base_model_name": base,
            "load_format": "auto",
            "abort_all_requests": False,
        }
        reloaded = admin.post("/areal_update_weights_lora", json=body)
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["success"] is True
        completion = {
            "model": "policy-v0",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = admin.post("/v1/completions", json=completion).json()["choices"][0]
        assert answer["token_ids"] == peft_greedy(model_dir, step, prompt, 4), version
    wrong = admin.post(
        "/areal_update_weights_lora",
        json={"lora_model_path": str(steps[0]), "lora_name": "x", "base_model_name": "other"},
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "base_model_name"
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "policy-v0"}).status_code == 200

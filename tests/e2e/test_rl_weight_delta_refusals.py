"""What the delta weight syncs refuse, against ``penstock serve --engine transformers`` on
the tiny Llama: local checkpoints anywhere but a folder of the server's own (or inside
``--weights-dir``), and published deltas that are malformed, each a 400 that leaves the
served weights as they were."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from penstock.rl.deltas import checksum
from tests.e2e.test_rl_trainer_weights import engine_rollout
from tests.e2e.test_rl_weight_deltas import tensor_bytes
from tests.support.server import ServerProcess, running_servers, transformers_args
from tests.support.tiny_llm import build_tiny_llama

ADMIN_KEY = "refusal-admin-key"
PAYLOAD = "model-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, weights_dir: Path
) -> Iterator[list[ServerProcess]]:
    """One server as started by default, one with ``--weights-dir``."""
    key = ("--admin-api-key", ADMIN_KEY)
    starts = [
        (transformers_args(model_dir, *key), tmp_path_factory.mktemp("serve")),
        (
            transformers_args(model_dir, *key, "--weights-dir", str(weights_dir)),
            tmp_path_factory.mktemp("serve-weights-dir"),
        ),
    ]
    with running_servers(starts, env={"HF_HUB_OFFLINE": "1"}, ready_timeout=180) as started:
        yield started


def client(server: ServerProcess) -> httpx.Client:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def admin(servers: list[ServerProcess]) -> Iterator[httpx.Client]:
    with client(servers[0]) as http:
        yield http


def pull(admin: httpx.Client, local: Path | str, source: Path, target: int) -> httpx.Response:
    body = {"local_checkpoint_dir": str(local), "source_dir": str(source), "target_version": target}
    return admin.post("/pull_weights", json=body)


def refused(answer: httpx.Response, param: str | None, code: str) -> bool:
    error = answer.json().get("error") or {}
    return answer.status_code == 400 and (error.get("param"), error.get("code")) == (param, code)


def listing(folder: Path) -> dict[str, int]:
    return {entry.name: entry.stat().st_size for entry in os.scandir(folder)}


def test_a_pull_never_writes_in_a_folder_holding_files_of_others(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the operator's")
    (foreign / "model.safetensors").write_bytes(b"not the server's")
    before = listing(foreign)
    answer = pull(admin, foreign, tmp_path / "published", 0)
    assert refused(answer, "local_checkpoint_dir", "invalid_value"), answer.text
    assert listing(foreign) == before


def test_a_new_seed_removes_only_what_the_server_wrote(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    local, source = tmp_path / "local", tmp_path / "published"
    assert pull(admin, local, source, 0).status_code == 200
    (local / "keep.txt").write_text("written beside the checkpoint by the operator")
    # Version 1 published whole, with a file version 0 lacks; back at 0 the copy is
    # seeded from the served model again and that file goes, the operator's stays.
    shutil.copytree(model_dir, source / "weight_v000001")
    (source / "weight_v000001" / "extra.json").write_text("{}")
    ahead = pull(admin, local, source, 1)
    assert ahead.status_code == 200 and ahead.json()["seeded_from"].endswith("weight_v000001")
    back = pull(admin, local, source, 0)
    assert back.status_code == 200 and back.json()["seeded_from"] == str(model_dir)
    assert (local / "keep.txt").read_text().startswith("written beside")
    assert not (local / "extra.json").exists()


def test_the_served_model_and_system_folders_are_refused(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "published"
    served = listing(model_dir)
    for folder in (model_dir, model_dir / "inside", model_dir.parent):
        answer = pull(admin, folder, source, 0)
        assert refused(answer, "local_checkpoint_dir", "invalid_value"), (folder, answer.text)
    assert listing(model_dir) == served and not (model_dir / "inside").exists()
    system = Path("/etc/penstock-pull-test")
    answer = pull(admin, system, source, 0)
    assert refused(answer, "local_checkpoint_dir", "invalid_value"), answer.text
    assert not system.exists()
    root = listing(Path("/"))
    answer = pull(admin, "/", source, 0)
    assert refused(answer, "local_checkpoint_dir", "invalid_value"), answer.text
    assert listing(Path("/")) == root
    for local in (str(model_dir), "/"):
        init_info = {"base_model_path": str(model_dir), "local_checkpoint_dir": local}
        answer = admin.post("/init_weight_transfer_engine", json={"init_info": init_info})
        assert refused(answer, "init_info.local_checkpoint_dir", "invalid_value"), answer.text


def test_with_a_weights_dir_pulls_write_only_inside_it(
    servers: list[ServerProcess], weights_dir: Path, tmp_path: Path
) -> None:
    with client(servers[1]) as admin:
        outside = pull(admin, tmp_path / "elsewhere", tmp_path / "published", 0)
        assert refused(outside, "local_checkpoint_dir", "invalid_value"), outside.text
        assert not (tmp_path / "elsewhere").exists()
        inside = pull(admin, weights_dir / "slime", tmp_path / "published", 0)
        assert inside.status_code == 200, inside.text
        assert (weights_dir / "slime" / "model.safetensors").is_file()


def changed(base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trainer's next version: one byte of every tensor flipped."""
    new = {name: data.copy() for name, data in base.items()}
    for data in new.values():
        data[0] ^= 0xFF
    return new


def zstd(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1).compress(raw)


def sha256(data: np.ndarray) -> str:
    return checksum("sha256", data)


def slime_version(folder: Path, base: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True)
    new = changed(base)
    payload = {
        name: np.frombuffer(zstd((new[name] ^ base[name]).tobytes()), np.uint8) for name in base
    }
    sums = {name: sha256(new[name]) for name in base}
    save_file(payload, str(folder / PAYLOAD), metadata=sums)
    metadata = {
        "base_version": "000000",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "sha256",
    }
    index = {"metadata": metadata, "weight_map": dict.fromkeys(payload, PAYLOAD)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def rewrite_patches(folder: Path, patch: Callable[[bytes], bytes]) -> None:
    """The version's patches file again, each patch's compressed bytes passed through
    ``patch``."""
    with safe_open(str(folder / PAYLOAD), "np") as handle:
        sums = handle.metadata()
    arrays = load_file(folder / PAYLOAD)
    rewritten = {
        name: np.frombuffer(patch(data.tobytes()), np.uint8) for name, data in arrays.items()
    }
    save_file(rewritten, str(folder / PAYLOAD), metadata=sums)


def edit_index(folder: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def header_of(folder: Path) -> tuple[bytes, bytes]:
    """The patches file's header JSON and its data."""
    raw = (folder / PAYLOAD).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + length], raw[8 + length :]


def with_header(folder: Path, header: bytes, data: bytes) -> None:
    (folder / PAYLOAD).write_bytes(len(header).to_bytes(8, "little") + header + data)


def edit_header(folder: Path, edit: Callable[[dict[str, Any], str], object]) -> None:
    """The patches file with ``edit`` applied to its header and its first tensor's name."""
    header, data = header_of(folder)
    parsed = json.loads(header)
    edit(parsed, next(key for key in parsed if key != "__metadata__"))
    with_header(folder, json.dumps(parsed).encode(), data)


# Each way a published version is malformed: what it breaks, and how (rewriting a valid
# version's folder in place).
SLIME_BREAKS: dict[str, Callable[[Path], object]] = {
    "truncated zstd patch": lambda f: rewrite_patches(f, lambda raw: raw[: len(raw) // 2]),
    "patch that is not zstd": lambda f: rewrite_patches(f, lambda raw: b"\x00" * len(raw)),
    "zstd patch larger than its tensor": lambda f: rewrite_patches(
        f, lambda raw: zstd(b"\x00" * (1 << 20))
    ),
    "overwrite patch without its count": lambda f: (
        rewrite_patches(f, lambda raw: zstd(b"\x01")),
        edit_index(f, lambda index: index["metadata"].update(delta_encoding="overwrite")),
    ),
    "index that is not JSON": lambda f: (f / "model.safetensors.index.json").write_text("{"),
    "index metadata that is a list": lambda f: edit_index(
        f, lambda index: index.update(metadata=[1])
    ),
    "base version that is not a number": lambda f: edit_index(
        f, lambda index: index["metadata"].update(base_version="zero")
    ),
    "header length past the file": lambda f: (f / PAYLOAD).write_bytes(
        (1 << 60).to_bytes(8, "little") + b"{}"
    ),
    "header that is not an object": lambda f: with_header(f, b"[1, 2]", b""),
    "data section cut short": lambda f: with_header(f, *header_of(f)[:1], header_of(f)[1][:10]),
    "offsets out of order": lambda f: edit_header(
        f, lambda header, name: header[name].update(data_offsets=header[name]["data_offsets"][::-1])
    ),
    "tensor entry that is not an object": lambda f: edit_header(
        f, lambda header, name: header.update({name: 5})
    ),
}


def skyrl_version(sync_dir: Path, base: dict[str, np.ndarray]) -> Path:
    folder = sync_dir / "delta-00000001"
    folder.mkdir(parents=True)
    new = changed(base)
    payload = {
        name: np.frombuffer(zstd((new[name] ^ base[name]).tobytes()), np.uint8) for name in base
    }
    save_file(payload, str(folder / PAYLOAD))
    records = [
        {
            "name": name,
            "payload_file": PAYLOAD,
            "payload_key": name,
            "checksum": sha256(new[name]),
            "checksum_algorithm": "sha256",
        }
        for name in base
    ]
    manifest = {"version": 1, "base_version": 0, "tensors": records}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def edit_manifest(folder: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def first_record(**fields: Any) -> Callable[[dict[str, Any]], object]:
    return lambda manifest: manifest["tensors"][0].update(fields)


SKYRL_BREAKS: dict[str, Callable[[Path], object]] = {
    "payload file climbing out of the folder": lambda f: edit_manifest(
        f, first_record(payload_file="../../../../../../../../etc/passwd")
    ),
    "payload file at an absolute path": lambda f: edit_manifest(
        f, first_record(payload_file="/etc/hostname")
    ),
    "payload file that is a number": lambda f: edit_manifest(f, first_record(payload_file=7)),
    "record without its payload key": lambda f: edit_manifest(
        f, lambda manifest: manifest["tensors"][0].pop("payload_key")
    ),
    "manifest that is not JSON": lambda f: (f / "manifest.json").write_text("not json"),
    "manifest without its version": lambda f: edit_manifest(f, lambda m: m.pop("version")),
    "tensors that are not a list": lambda f: edit_manifest(f, lambda m: m.update(tensors=5)),
    "manifest that is a folder": lambda f: (
        (f / "manifest.json").unlink(),
        (f / "manifest.json").mkdir(),
    ),
    "truncated zstd payload": lambda f: rewrite_patches(f, lambda raw: raw[: len(raw) // 2]),
}


def test_malformed_deltas_are_each_a_400_and_the_served_weights_stay(
    admin: httpx.Client, model_dir: Path, tmp_path: Path
) -> None:
    base = tensor_bytes(model_dir)
    served = engine_rollout(admin)
    version = admin.get("/get_weight_version").json()["weight_version"]
    local = tmp_path / "slime-local"
    answers: dict[str, tuple[int, Any]] = {}
    for kind, breaks in SLIME_BREAKS.items():
        source = tmp_path / kind.replace(" ", "-")
        slime_version(source / "weight_v000001", base)
        breaks(source / "weight_v000001")
        answer = pull(admin, local, source, 1)
        answers[kind] = (answer.status_code, answer.json().get("error", {}).get("code"))
    init_info = {"base_model_path": str(model_dir), "local_checkpoint_dir": str(tmp_path / "sky")}
    init = admin.post("/init_weight_transfer_engine", json={"init_info": init_info})
    assert init.status_code == 200, init.text
    for kind, breaks in SKYRL_BREAKS.items():
        folder = skyrl_version(tmp_path / f"sync-{kind.replace(' ', '-')}", base)
        breaks(folder)
        answer = admin.post("/fetch_weights", json={"target_version": 1, "uri": str(folder)})
        answers[kind] = (answer.status_code, answer.json().get("error", {}).get("code"))
    assert answers == dict.fromkeys(answers, (400, "invalid_weights"))
    assert admin.get("/get_weight_version").json()["weight_version"] == version
    assert engine_rollout(admin) == served
    # The same versions well formed are applied.
    slime_version(tmp_path / "good" / "weight_v000001", base)
    assert pull(admin, local, tmp_path / "good", 1).status_code == 200
    good = skyrl_version(tmp_path / "sync-good", base)
    fetched = admin.post("/fetch_weights", json={"target_version": 1, "uri": str(good)})
    assert fetched.status_code == 200, fetched.text

"""What a text server leaves out, and what a request or startup that needs it gets: an
error naming how to install it. The README's commands install xgrammar the way the error
says."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from penstock.engines.loading import load_engine_class
from penstock.engines.transformers.features.lora import LoraError, lora_config, read_adapter
from penstock.errors import EngineLoadError, NotInstalledError
from penstock.extras import LORA_INSTALL, VIDEO_INSTALL, XGRAMMAR_INSTALL
from penstock.http import UrlValidationPolicy
from penstock.http.httpx_client import HttpxClient
from penstock.multimodal.inputs import MediaInputs, MediaRef

REPO = Path(__file__).resolve().parents[1]
CODE_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import`` of each of ``modules`` fail as it does where it is not installed,
    and forget Penstock modules that imported one already."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [name for name in sys.modules if name.startswith("penstock.engines.diffusion")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_readme_commands_install_xgrammar_without_triton_as_the_error_says() -> None:
    with (REPO / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    (grammar,) = project["optional-dependencies"]["grammar"]
    assert XGRAMMAR_INSTALL == f"pip install --no-deps '{grammar}'"
    assert not any(line.startswith("xgrammar") for line in project["dependencies"])
    first, tests = CODE_BLOCK.findall((REPO / "README.md").read_text())[:2]
    assert f"--no-deps '{grammar}'" in first
    assert f"'{grammar}'" in tests and "--no-deps" in tests
    # The first command installs Penstock alone, no extra.
    assert " -e . " in first


def test_the_diffusion_engine_without_its_packages_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without(monkeypatch, "diffusers")
    with pytest.raises(EngineLoadError, match=re.escape(VIDEO_INSTALL)) as raised:
        load_engine_class("diffusion")
    assert "the diffusion engine needs diffusers" in str(raised.value)


def test_a_lora_load_without_peft_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without(monkeypatch, "peft")
    with pytest.raises(LoraError, match=re.escape(LORA_INSTALL)):
        read_adapter("math", "a1", tmp_path)
    with pytest.raises(LoraError, match=re.escape(LORA_INSTALL)):
        lora_config({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})


async def test_audio_without_pyav_is_a_501_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without(monkeypatch, "av")
    monkeypatch.delitem(sys.modules, "penstock.multimodal.audio_loader", raising=False)
    inputs = MediaInputs(
        HttpxClient(),
        UrlValidationPolicy(),
        fetch_timeout_s=5,
        max_bytes=1 << 20,
        max_image_pixels=1 << 20,
        max_audio_s=30,
    )
    ref = MediaRef("https://example.invalid/a.wav", "messages[0].content[0].audio_url.url")
    with pytest.raises(NotInstalledError, match=re.escape(VIDEO_INSTALL)) as raised:
        await inputs.load_audio([ref])
    assert raised.value.status_code == 501
    assert "decoding audio needs av" in raised.value.message

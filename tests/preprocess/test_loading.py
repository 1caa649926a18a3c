from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from penstock.errors import InvalidRequestError
from penstock.preprocess import Preprocessor, PreprocessorLoadError
from tests.preprocess.conftest import ModelFolderFactory
from tests.support.tiny import build_tokenizer

USER_HI = [{"role": "user", "content": "hi"}]


def test_loads_a_freshly_trained_tokenizer_folder(tmp_path: Path) -> None:
    preprocessor = Preprocessor.from_folder(build_tokenizer(tmp_path / "tiny", vocab_size=600))

    assert preprocessor.vocab_size == 600
    assert preprocessor.eos_token_ids == [preprocessor.encode("<|im_end|>")[0]]
    assert preprocessor.bos_token_id is None
    assert preprocessor.has_chat_template
    assert preprocessor.model_max_length == 2048
    assert preprocessor.decode(preprocessor.encode("def main():\n    pass")) == (
        "def main():\n    pass"
    )


def test_missing_folder_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(PreprocessorLoadError, match=re.escape(str(missing))):
        Preprocessor.from_folder(missing)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(PreprocessorLoadError) as caught:
        Preprocessor.from_folder(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(caught.value)
    assert "missing" in str(caught.value)


def test_corrupt_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(PreprocessorLoadError, match="could not be loaded as a tokenizer") as caught:
        Preprocessor.from_folder(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(caught.value)


def test_unparsable_tokenizer_config_names_the_file(model_folder: ModelFolderFactory) -> None:
    folder = model_folder()
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(PreprocessorLoadError, match=r"tokenizer_config\.json is unreadable"):
        Preprocessor.from_folder(folder)


def test_template_from_tokenizer_config(model_folder: ModelFolderFactory) -> None:
    preprocessor = Preprocessor.from_folder(
        model_folder(chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    )
    assert preprocessor.render_chat(USER_HI) == "[hi]"


def test_template_from_chat_template_jinja_wins_over_config(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(
        chat_template="config template",
        files={"chat_template.jinja": "{% for m in messages %}<{{ m.content }}>{% endfor %}"},
    )
    assert Preprocessor.from_folder(folder).render_chat(USER_HI) == "<hi>"


def test_template_from_processor_chat_template_json(model_folder: ModelFolderFactory) -> None:
    folder = model_folder(
        chat_template=None,
        files={"chat_template.json": {"chat_template": "{{ messages[0].content }}!"}},
    )
    assert Preprocessor.from_folder(folder).render_chat(USER_HI) == "hi!"


def test_list_of_templates_uses_default_and_tool_use_when_tools_are_given(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(
        chat_template=[
            {"name": "default", "template": "plain {{ messages[0].content }}"},
            {
                "name": "tool_use",
                "template": "tools={{ tools | length }} {{ messages[0].content }}",
            },
        ]
    )
    preprocessor = Preprocessor.from_folder(folder)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}

    assert preprocessor.render_chat(USER_HI) == "plain hi"
    assert preprocessor.render_chat(USER_HI, tools=[tool]) == "tools=1 hi"


def test_list_of_templates_without_default_has_no_chat_template_for_plain_requests(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Preprocessor.from_folder(folder).render_chat(USER_HI)


def test_malformed_template_list_is_a_load_error(model_folder: ModelFolderFactory) -> None:
    with pytest.raises(PreprocessorLoadError, match='"name": <string>'):
        Preprocessor.from_folder(model_folder(chat_template=[{"template": "x"}]))


def test_template_syntax_error_is_a_load_error(model_folder: ModelFolderFactory) -> None:
    folder = model_folder(chat_template="{% for m in messages %}{{ m.content }}")
    with pytest.raises(PreprocessorLoadError, match="does not compile") as caught:
        Preprocessor.from_folder(folder)
    assert str(folder) in str(caught.value)


def test_no_template_means_chat_is_refused_with_a_pointer_to_completions(
    model_folder: ModelFolderFactory,
) -> None:
    preprocessor = Preprocessor.from_folder(model_folder(chat_template=None))

    assert not preprocessor.has_chat_template
    with pytest.raises(InvalidRequestError) as caught:
        preprocessor.render_chat(USER_HI)
    assert "no chat template" in caught.value.message
    assert "/v1/completions" in caught.value.message
    assert caught.value.status_code == 400


def test_generation_config_eos_list_adds_to_tokenizer_eos(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(files={"generation_config.json": {"eos_token_id": [0, 2, 3]}})
    preprocessor = Preprocessor.from_folder(folder)
    im_end = preprocessor.encode("<|im_end|>")[0]

    assert preprocessor.eos_token_ids[0] == im_end
    assert sorted(preprocessor.eos_token_ids) == sorted({im_end, 0, 2, 3})


def test_generation_config_single_eos_id(model_folder: ModelFolderFactory) -> None:
    folder = model_folder(
        extra_config={"eos_token": None},
        files={"generation_config.json": {"eos_token_id": 0}},
    )
    assert Preprocessor.from_folder(folder).eos_token_ids == [0]


def test_generation_config_with_a_non_integer_eos_is_a_load_error(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(files={"generation_config.json": {"eos_token_id": ["</s>"]}})
    with pytest.raises(PreprocessorLoadError, match=r"generation_config\.json: eos_token_id"):
        Preprocessor.from_folder(folder)


def test_special_tokens_as_objects_and_from_special_tokens_map(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder(
        extra_config={"bos_token": {"content": "<|endoftext|>", "lstrip": False}},
        files={"special_tokens_map.json": {"eos_token": {"content": "<|endoftext|>"}}},
    )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["eos_token"]
    config_path.write_text(json.dumps(config))
    preprocessor = Preprocessor.from_folder(folder)
    endoftext = preprocessor.encode("<|endoftext|>")[0]

    assert preprocessor.bos_token_id == endoftext
    assert preprocessor.eos_token_ids == [endoftext]


def test_unknown_model_max_length_placeholder_is_ignored(model_folder: ModelFolderFactory) -> None:
    folder = model_folder(extra_config={"model_max_length": 1000000000000000019884624838656})
    assert Preprocessor.from_folder(folder).model_max_length is None


def test_truncation_saved_in_tokenizer_json_does_not_cut_prompts(
    model_folder: ModelFolderFactory,
) -> None:
    folder = model_folder()
    tokenizer_file = folder / "tokenizer.json"
    saved = json.loads(tokenizer_file.read_text())
    saved["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    tokenizer_file.write_text(json.dumps(saved))

    assert len(Preprocessor.from_folder(folder).encode("one two three four five six")) > 4


def test_encode_parses_special_tokens_in_text_but_adds_none(
    preprocessor: Preprocessor,
) -> None:
    ids = preprocessor.encode("<|im_start|>user\nhi<|im_end|>")

    assert ids[0] == preprocessor.encode("<|im_start|>")[0]
    assert ids[-1] in preprocessor.eos_token_ids
    assert len(preprocessor.encode("<|im_start|>")) == 1
    assert preprocessor.encode("") == []

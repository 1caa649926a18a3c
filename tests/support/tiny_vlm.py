"""A complete tiny vision-language checkpoint built offline: random LLaVA weights (a tiny
CLIP vision tower, a tiny Llama text model), the tiny tokenizer with an ``<image>`` token,
a CLIP image processor and an HF-style chat template that places the image placeholder."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

from tests.support.tiny import build_tokenizer
from tests.support.tiny_llm import save_sharpened, tiny_llama_config

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
# The "default" feature strategy drops CLS: one token per patch.
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
# An HF-style template: content is a string or a list of parts, images placed in order.
VLM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_vlm(folder: Path, *, seed: int = 0) -> Path:
    """Save a random-init ``LlavaForConditionalGeneration`` with its processor files."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    tokenizer.save(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["chat_template"] = VLM_TEMPLATE
    config_file.write_text(json.dumps(tokenizer_config, indent=2))
    image_token_id = tokenizer.token_to_id(IMAGE_TOKEN)
    text_config = tiny_llama_config(tokenizer)
    vision_config = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        image_seq_length=IMAGE_TOKENS_PER_IMAGE,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    # A louder projector lets the image steer the output.
    with torch.no_grad():
        for parameter in model.model.multi_modal_projector.parameters():
            parameter.mul_(4.0)
    save_sharpened(model, text_config, folder)
    processor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True,
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return folder

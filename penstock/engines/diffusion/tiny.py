"""A tiny Wan text-to-video pipeline with random weights, built from config in memory.

It makes noise-like videos, but through the real pipeline (UMT5 text encoder, Wan
transformer, Wan VAE, flow-matching scheduler) in well under a second on a CPU, so the
whole media path can run offline. The weights come from a fixed seed: every process
builds the same pipeline, so the same request seed gives the same video everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "sample-tokenizer"
TINY_MAX_SEQUENCE_LENGTH = 64


def build_tiny_wan_pipeline(seed: int = 0) -> WanPipeline:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"),
        pad_token="<pad>",
        eos_token="<|im_end|>",
        model_max_length=TINY_MAX_SEQUENCE_LENGTH,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
            )
        )
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=1024,
        )
    # Freshly built modules are in training mode, where dropout makes runs differ.
    for module in (text_encoder, vae, transformer):
        module.eval()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=transformer,
    )

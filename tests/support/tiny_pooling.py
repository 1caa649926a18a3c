"""Tiny pooling checkpoints built offline: a BERT encoder with a sentence-transformers
mean-pooling config, and a Llama reward model (``LlamaForSequenceClassification``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertModel, LlamaForSequenceClassification

from tests.support.tiny import build_tokenizer, stdlib_corpus
from tests.support.tiny_llm import tiny_llama_config

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_CONTEXT = 64


def build_wordpiece_tokenizer(folder: Path, vocab_size: int = 1000) -> Tokenizer:
    """A BERT-style tokenizer: WordPiece, and ``[CLS] ... [SEP]`` around every input."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.train(stdlib_corpus(20), trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", sep_id), ("[CLS]", cls_id))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_max_length": BERT_CONTEXT,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer


def build_tiny_bert_embedder(folder: Path, *, seed: int = 0) -> Path:
    """A random ``BertModel`` whose sentence-transformers config asks for mean pooling."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_wordpiece_tokenizer(folder)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=BERT_CONTEXT,
        pad_token_id=tokenizer.token_to_id("[PAD]"),
        architectures=["BertModel"],
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return folder


def build_tiny_reward_model(folder: Path, *, seed: int = 0) -> Path:
    """A random ``LlamaForSequenceClassification`` with one output: a reward model."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = tiny_llama_config(tokenizer)
    config.num_labels = 1
    config.id2label = {0: "reward"}
    config.label2id = {"reward": 0}
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder

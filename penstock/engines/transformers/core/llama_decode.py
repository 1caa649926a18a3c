"""A decode step for Llama-architecture models in plain tensor ops, over the KV pool's blocks.

Why: at one row on the CPU, a decode step of SmolLM2-135M reads ~142 MB of int8 weights
(~13 ms), and transformers' forward adds ~9-12 ms of Python around it (module calls and
their hooks, the attention interface lookup, mask creation, the cache classes, rotary
embeddings recomputed per layer). This step computes the same thing with about thirty
tensor ops a layer: the model's own parameters, read at every step (so weight updates,
moves between devices and requantization are seen), the linear layers through the
engine's own path (the CPU kernels of :mod:`.cpu_weights` where they apply), rotary
embeddings from the model's own ``inv_freq`` once per step, and each row's keys and
values written straight into its next slot of the KV pool, where attention reads every
row's own tokens in place (:class:`.kv_cache.StepKv`). On the CPU kernels, a step of
float32 rows alone replaces those ops with a few kernel calls a layer (norms, attention
with its rotations and writes) and gives the same bits.

It is used only where it computes what the transformers forward does:
:meth:`LlamaDecoder.for_model` returns None for anything else (other architectures, a
peft wrapper, rope types whose frequencies depend on the length, registered hooks), and
the scheduler then keeps calling the model. Prefill always runs the transformers forward.
Nothing here is CPU-specific: on CUDA the linear layers are plain ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from penstock.engines.transformers.core.kv_cache import StepKv
from penstock.engines.transformers.core.prompt_kv import PromptChunk
from penstock.engines.transformers.kernels.paged_attention import add_rms_norm, rms_norm
from penstock.engines.transformers.weights.cpu_weights import row_linear, row_linears

# Rope types whose frequencies do not depend on the sequence length (transformers'
# ``dynamic_rope_update`` rewrites ``inv_freq`` per call for "dynamic" and "longrope").
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM"})

Linear = Callable[[torch.Tensor], torch.Tensor]
Linears = Callable[[torch.Tensor], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.nn.Parameter
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    post_attention_norm: torch.nn.Parameter
    gate: Linear
    up: Linear
    down: Linear
    # q, k and v; gate and up: each set in one call where the kernels allow.
    qkv: Linears
    gate_up: Linears


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`LlamaDecoder` can't stand in for ``model``'s forward; None when it can."""
    name = type(model).__name__
    if name not in _SUPPORTED_ARCHITECTURES:
        return f"{name} is not a supported architecture"
    config = model.config
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    rope_type = getattr(model.model.rotary_emb, "rope_type", None)
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r}"
    if len(model.model.layers) != config.num_hidden_layers:
        return "the model runs a subset of its layers"
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"{type(module).__name__} has forward hooks"
    return None


class LlamaDecoder:
    """One decode step of a ``LlamaForCausalLM``: logits of each row's next token."""

    def __init__(self, model: Any, *, max_rows: int) -> None:
        config = model.config
        body = model.model
        self.hidden_size = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.heads)
        self.scaling = self.head_dim**-0.5
        self.eps = float(config.rms_norm_eps)
        self._embed = body.embed_tokens.forward
        self._rotary = body.rotary_emb
        self._final_norm = body.norm.weight
        self._lm_head = row_linear(model.lm_head, max_rows)
        self._layers: list[_Layer] = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                q=row_linear(layer.self_attn.q_proj, max_rows),
                k=row_linear(layer.self_attn.k_proj, max_rows),
                v=row_linear(layer.self_attn.v_proj, max_rows),
                o=row_linear(layer.self_attn.o_proj, max_rows),
                post_attention_norm=layer.post_attention_layernorm.weight,
                gate=row_linear(layer.mlp.gate_proj, max_rows),
                up=row_linear(layer.mlp.up_proj, max_rows),
                down=row_linear(layer.mlp.down_proj, max_rows),
                qkv=row_linears(
                    (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                    max_rows,
                ),
                gate_up=row_linears((layer.mlp.gate_proj, layer.mlp.up_proj), max_rows),
            )
            for layer in body.layers
        ]
        # The norm each layer's MLP output is added before: the next layer's, then the final.
        self._norms_after = [layer.input_norm for layer in self._layers[1:]] + [self._final_norm]
        norms = [layer.input_norm for layer in self._layers] + [self._final_norm]
        norms += [layer.post_attention_norm for layer in self._layers]
        self._float32_norms = all(norm.dtype == torch.float32 for norm in norms)

    @classmethod
    def for_model(cls, model: Any, *, max_rows: int) -> LlamaDecoder | None:
        """A decoder for ``model``, or None when it must keep its own forward."""
        if unsupported_reason(model) is not None:
            return None
        return cls(model, max_rows=max_rows)

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm, op for op: the same rounding as the model's forward.
        dtype = hidden.dtype
        wide = hidden if dtype == torch.float32 else hidden.float()
        variance = wide.pow(2).mean(-1, keepdim=True)
        wide = wide * torch.rsqrt(variance + self.eps)
        return weight * (wide if dtype == torch.float32 else wide.to(dtype))

    def _rotation(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` shaped ``[rows, 1, head_dim]``; ``sin``'s first half negated.

        transformers rotates ``x`` into ``x * cos + rotate_half(x) * sin`` with
        ``rotate_half(x) = cat(-x2, x1)``; ``roll(x) * signed_sin`` is the same product
        (a sign moved between factors is exact) in one op instead of four.
        """
        rotary = self._rotary
        inv_freq = rotary.inv_freq
        freqs = positions[:, None].float() * inv_freq.to(device=positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * rotary.attention_scaling
        sin = angles.sin() * rotary.attention_scaling
        half = self.head_dim // 2
        sin[:, :half].neg_()
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, kv: StepKv) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after feeding each row's token at its position; this
        step's keys and values are written into the rows' slots (``kv``)."""
        if kv.in_place and self._float32_norms:
            hidden = self._embed(token_ids)
            if hidden.dtype == torch.float32:
                return self._decode_in_place(hidden, positions, kv)
        logits, _ = self.step(token_ids, positions, kv, None)
        assert logits is not None
        return logits

    def _decode_in_place(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv: StepKv
    ) -> torch.Tensor:
        """:meth:`step` of float32 rows alone on the CPU kernels: between its linear layers,
        a layer makes four calls (two norms, each adding the residual first; attention with
        its rotations and KV writes; SiLU) where the general path makes ~30 torch ops, and
        q, k and v (gate and up) are one call where the kernels allow; the same bits."""
        cos, sin = self._rotation(positions, hidden.dtype)
        rotation = (cos.squeeze(1), sin.squeeze(1))
        eps, scaling = self.eps, self.scaling
        normed = rms_norm(hidden, self._layers[0].input_norm, eps)
        for index, (layer, norm_after) in enumerate(
            zip(self._layers, self._norms_after, strict=True)
        ):
            query, key, value = layer.qkv(normed)
            attended = kv.rotate_write_attend(index, (query, key, value), rotation, scaling)
            normed = add_rms_norm(hidden, layer.o(attended), layer.post_attention_norm, eps)
            gate, up = layer.gate_up(normed)
            mlp = layer.down(F.silu(gate, inplace=True).mul_(up))
            normed = add_rms_norm(hidden, mlp, norm_after, eps)
        return self._lm_head(normed)

    def _attend_rows(
        self,
        index: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv: StepKv,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The batch rows' attention in layer ``index``, their keys (rotated here) and
        values written into their slots first; ``[rows, heads * dim]``."""
        rows = query.shape[0]
        kv.write(index, key * cos + key.roll(self.head_dim // 2, -1) * sin, value)
        return kv.attend(index, query, self.scaling).view(rows, self.heads * self.head_dim)

    def step(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: StepKv | None,
        chunk: PromptChunk | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A decode step of the batch (``token_ids`` may be empty, ``kv`` then None)
        with, in the same pass, the next ``chunk`` of a prompt prefilled over several
        steps: every linear layer reads its weights once for both. Returns the batch's
        logits (None without rows) and the chunk's: of every token of it when
        ``chunk.every_logit``, else of its last token (``[1, vocab]``) when ``chunk.last``,
        else None."""
        rows = token_ids.shape[0]
        inputs, all_positions = token_ids, positions
        if chunk is not None:
            inputs = torch.cat((token_ids, chunk.token_ids))
            all_positions = torch.cat((positions, chunk.positions))
        hidden = self._embed(inputs)
        cos, sin = self._rotation(all_positions, hidden.dtype)
        half = self.head_dim // 2
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        tokens = hidden.shape[0]
        chunk_mask = None if chunk is None else chunk.mask(group)
        row_cos, row_sin = (cos, sin) if chunk is None else (cos[:rows], sin[:rows])
        for index, layer in enumerate(self._layers):
            normed = self._norm(hidden, layer.input_norm)
            query = layer.q(normed).view(tokens, heads, head_dim)
            key = layer.k(normed).view(tokens, kv_heads, head_dim)
            value = layer.v(normed).view(tokens, kv_heads, head_dim)
            query = query * cos + query.roll(half, -1) * sin
            parts = []
            if rows:
                assert kv is not None
                row_qkv = (query, key, value)
                if chunk is not None:
                    row_qkv = (query[:rows], key[:rows], value[:rows])
                parts.append(self._attend_rows(index, *row_qkv, kv, row_cos, row_sin))
            if chunk is not None:
                rotated = key[rows:] * cos[rows:] + key[rows:].roll(half, -1) * sin[rows:]
                attended = chunk.attend(
                    index, query[rows:], rotated, value[rows:], chunk_mask, self.scaling
                )
                parts.append(attended)
            attended_all = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = hidden + layer.o(attended_all)
            normed = self._norm(hidden, layer.post_attention_norm)
            hidden = hidden + layer.down(F.silu(layer.gate(normed)) * layer.up(normed))
        decoded = hidden if chunk is None else hidden[:rows]
        logits = self._lm_head(self._norm(decoded, self._final_norm)) if rows else None
        chunk_logits = None
        if chunk is not None and (chunk.last or chunk.every_logit):
            kept = hidden[rows:] if chunk.every_logit else hidden[-1:]
            chunk_logits = self._lm_head(self._norm(kept, self._final_norm))
        return logits, chunk_logits

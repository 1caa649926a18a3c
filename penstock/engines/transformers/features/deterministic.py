"""Logprobs as a trainer computes them, and the ``--deterministic`` mode.

An RL trainer recomputes a rollout's logprobs with one forward pass over prompt and
completion, ``log_softmax(model(input_ids).logits.float())``. The serving forward passes
differ from that one: prompts prefilled side by side (padded), decode steps one token at a
time over a KV cache, a prompt computed in chunks. Each changes the order of the floating
point sums, so the logprobs differ in their last bits in float32 and by about 1e-2 in
bfloat16 (``bench/README.md``, "On-policy logprobs"), even the logits of one position over
a shorter and a longer sequence.

:func:`forward_logprobs` is the trainer's pass: one sequence, no padding, no cache, the
live model (and the request's LoRA adapter). It gives prompt logprobs
(:func:`prompt_logprobs`, vLLM's ``prompt_logprobs``) in ``--deterministic`` mode; else
they are gathered from the prefill's own passes, chunk by chunk (:mod:`.prompt_logprobs`).

``--deterministic`` (:class:`DeterministicRunner`) makes a request's output its own:

- each prompt is prefilled in a forward pass of its own, in one pass however long (the
  chunks a busy step would cut it into depend on the other rows), and each sequence
  decodes in a forward pass of its own over its own KV cache, unpadded; the prefix cache
  is off (a cached prefix's KV was computed inside another prompt);
- every returned logprob (and top logprob) is recomputed when the choice ends, by
  :func:`forward_logprobs` over its prompt and completion: equal to the trainer's pass
  for the same weights, dtype and kernels (on the CPU, the same thread count). The
  choice's chunks are held until then, so a stream with logprobs arrives at the end.

A mixture-of-experts model's routing is recorded there too (:mod:`.routing`), for a
request asking ``output_options.return_routed_experts``: the experts of each token of its
prompt and output, from the passes that computed them.

A greedy or seeded request then gets the same tokens and logprobs alone or beside any
others; an unseeded sampled one draws from the generator every such row shares. A row
preempted for KV blocks recomputes its KV, which can change its later tokens.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from penstock.engines.transformers.core.model_runner import (
    ModelRunner,
    Prefilled,
    PrefillRow,
    cache_argument,
)
from penstock.engines.transformers.core.sampling import TokenChoice, choose_tokens
from penstock.engines.transformers.core.sequence import Sequence, Submission
from penstock.engines.transformers.features.routing import ExpertRecorder

Chunk = dict[str, Any]


def forward_logprobs(
    runner: ModelRunner,
    submission: Submission,
    tokens: list[int],
    first: int = 0,
    temperature: float = 1.0,
) -> Any:
    """``[len(tokens) - first, vocab]`` float32 log-probabilities of the next token at
    each position from ``first`` on: the trainer's forward pass over ``tokens``
    (``submission``'s prompt first), its logits divided by ``temperature``."""
    ids = torch.tensor([tokens], device=runner.device)
    inputs: dict[str, Any] = {"input_ids": ids}
    if submission.embed is not None:
        # Image placeholders of the prompt stand for features; the rest are plain tokens.
        prompt = len(submission.prompt_ids)
        embeds = submission.embed(runner.model, ids[:, :prompt])
        if len(tokens) > prompt:
            rest = runner.model.get_input_embeddings()(ids[:, prompt:])
            embeds = torch.cat([embeds, rest.to(embeds.dtype)], dim=1)
        inputs = {"inputs_embeds": embeds}
    adapters = runner._adapter_names([submission])
    logits = runner.model(**inputs, use_cache=False, **adapters).logits
    # Every position's logits, as the trainer's pass computes them (fewer would change the
    # output layer's product); only the rows asked for are normalised, each on its own.
    rows = logits[0, first:].float()
    if temperature != 1.0:
        rows = rows / temperature
    return torch.log_softmax(rows, dim=-1)


def _entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"token_id": token_id, "logprob": logprob, "rank": rank}


def prompt_logprobs(runner: ModelRunner, submission: Submission, top: int) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token its
    logprob and vocabulary rank, followed by the ``top`` most likely others (at the
    request's ``prompt_temperature``)."""
    tokens = submission.prompt_ids
    if len(tokens) < 2:
        return [None]
    temperature = submission.params.prompt_temperature
    rows = forward_logprobs(runner, submission, tokens, temperature=temperature)[:-1]
    ids = torch.tensor(tokens[1:], device=rows.device)
    actual = rows.gather(1, ids.unsqueeze(1))
    ranks = (rows > actual).sum(dim=1) + 1
    positions: list[Any] = [None]
    top_values: list[list[float]] = [[] for _ in ids.tolist()]
    top_ids: list[list[int]] = [[] for _ in ids.tolist()]
    if top:
        best, best_ids = rows.topk(top)
        top_values, top_ids = best.tolist(), best_ids.tolist()
    for token, value, rank, values, others in zip(
        tokens[1:], actual.squeeze(1).tolist(), ranks.tolist(), top_values, top_ids, strict=True
    ):
        entries = [_entry(token, value, rank)]
        ranked = enumerate(zip(others, values, strict=True), start=1)
        entries += [_entry(other, lp, place) for place, (other, lp) in ranked if other != token]
        positions.append(entries)
    return positions


class OutgoingChunks:
    """What the scheduler sends for a choice's token chunk: prompt logprobs on the first
    chunk of choice 0 when asked for, and in ``--deterministic`` mode (``runner`` a
    :class:`DeterministicRunner`) chunks with logprobs held until the choice ends."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def emit(self, seq: Sequence, chunk: Chunk, *, last: bool) -> list[Chunk]:
        params = seq.submission.params
        first_chunk = seq.index == 0 and len(seq.output_ids) == 1 and bool(chunk["token_ids"])
        if params.prompt_logprobs is not None and first_chunk:
            gathered = seq.submission.prompt_logprobs
            chunk["prompt_logprobs"] = (
                prompt_logprobs(self.runner, seq.submission, params.prompt_logprobs)
                if gathered is None
                else gathered.entries
            )
        runner = self.runner
        if last and isinstance(runner, DeterministicRunner):
            routes = runner.routes.pop(seq, None)
            if routes:
                chunk["routed_experts"] = torch.cat(routes).tolist()
        if params.logprobs is None or not isinstance(runner, DeterministicRunner):
            return [chunk]
        held = runner.held.setdefault(seq, [])
        held.append(chunk)
        if not last:
            return []
        del runner.held[seq]
        if chunk.get("finish_reason") in ("stop", "length"):
            self._recompute(seq, held, params.logprobs)
        return held

    def _recompute(self, seq: Sequence, chunks: list[Chunk], top: int) -> None:
        submission = seq.submission
        tokens = submission.prompt_ids + seq.output_ids
        position = 0
        rows = forward_logprobs(self.runner, submission, tokens, len(submission.prompt_ids) - 1)
        for chunk in chunks:
            values, tops = [], []
            for token in chunk["token_ids"]:
                row = rows[position]
                values.append(float(row[token]))
                if top:
                    best, ids = row.topk(top)
                    tops.append(
                        [
                            {"rank": rank, "token_id": token_id, "logprob": logprob}
                            for rank, (token_id, logprob) in enumerate(
                                zip(ids.tolist(), best.tolist(), strict=True), start=1
                            )
                        ]
                    )
                position += 1
            if chunk["token_ids"]:
                chunk["log_probs"] = values
                if top:
                    chunk["top_logprobs"] = tops


class DeterministicRunner(ModelRunner):
    """Forward passes of one sequence each: every decode row over its own KV cache,
    every prompt alone and whole (see the module's docstring)."""

    # Prompt logprobs come from the trainer's pass over the whole prompt, as every logprob.
    gathers_prompt_logprobs = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._caches: dict[Sequence, DynamicCache] = {}
        # The chunks of choices with logprobs, until each choice ends (see OutgoingChunks).
        self.held: dict[Sequence, list[Chunk]] = {}
        self.experts = ExpertRecorder.for_model(self.model)
        # The experts of each pass over a sequence asking for them, until it ends.
        self.routes: dict[Sequence, list[torch.Tensor]] = {}

    @property
    def records_experts(self) -> bool:
        return self.experts is not None

    @property
    def fuses_chunks(self) -> bool:
        # A chunk in the decode rows' pass would batch the prompt with them.
        return False

    def decode(
        self, rows: list[Sequence], chunk: tuple[PrefillRow, int] | None = None
    ) -> tuple[list[TokenChoice], Prefilled | None]:
        assert chunk is None, "chunks never ride in a deterministic decode pass"
        choices: list[TokenChoice] = []
        for seq in rows:
            with self._routing(seq.submission) as routes:
                output = self.model(
                    input_ids=torch.tensor([[seq.next_token]], device=self.device),
                    position_ids=torch.tensor([[seq.kv_length]], device=self.device),
                    **cache_argument(self._caches[seq]),
                    use_cache=True,
                    **self._adapter_names([seq.submission]),
                )
            self.routes.get(seq, []).extend(routes)
            seq.kv_length += 1
            choices += choose_tokens(
                output.logits[:, -1, :],
                [seq.sampling(self.eos_token_ids)],
                self._shared_generator,
            )
        return choices, None

    def prefill(self, rows: list[PrefillRow]) -> list[Prefilled]:
        prefilled: list[Prefilled] = []
        for row in rows:
            with self._routing(row.submission) as routes:
                prefilled += super().prefill([row])
            if row.submission.params.routed_experts:
                # A preempted choice recomputes its prompt and output: its routes restart.
                for seq in row.sequences:
                    self.routes[seq] = list(routes)
        return prefilled

    def _routing(self, submission: Submission) -> Any:
        """Record the passes run inside when ``submission`` asks for its experts."""
        if self.experts is None or not submission.params.routed_experts:
            return nullcontext([])
        return self.experts.capture(self.model)

    def prefill_chunk(self, row: PrefillRow, end: int) -> Prefilled | None:
        """The chunks only count the step budget; the whole prompt is computed at once
        with its last chunk."""
        if end < len(row.tokens):
            row.computed = end
            return None
        (done,) = self.prefill([row])
        row.computed = end
        return done

    def rebuild_batch(
        self, running: list[Sequence], joined: list[tuple[Sequence, list[Any]]]
    ) -> list[Sequence] | None:
        for seq in running:
            if not seq.in_batch:
                self._caches.pop(seq, None)
        if all(seq.in_batch for seq in running) and not joined:
            return None
        for seq, layers in joined:
            cache = DynamicCache()
            for index, (keys, values) in enumerate(layers):
                cache.update(keys, values, index)
            self._caches[seq] = cache
        return [seq for seq in running if seq.in_batch] + [seq for seq, _ in joined]

    def reset(self) -> None:
        self._caches.clear()
        self.held.clear()
        self.routes.clear()
        super().reset()

    def move_kv(self, device: torch.device) -> None:
        for cache in self._caches.values():
            for layer in cache.layers:
                layer.keys = layer.keys.to(device)
                layer.values = layer.values.to(device)

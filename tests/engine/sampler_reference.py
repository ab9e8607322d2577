"""The sampler as it was before issue #14 (sampling on the CPU with a full sort), kept verbatim below this
docstring as the reference that pins seeded outputs: tests/engine/test_sampling.py asserts that
omni_backend/engine/sampler.py gives the same tokens for seeded rows, and scripts/bench_sampler.py times the
two in the same run. Not used by the engine.

It reads `seq.generator` and expects a CPU torch.Generator seeded with the request's seed there (what
Sequence.__init__ used to make); callers set it.

Original docstring:

Batched token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Order of logit processing follows Hugging Face `generate` / vLLM: penalties on raw logits, then temperature,
then top-k, top-p (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2019) and min-p
(Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024). Penalties: repetition (CTRL, Keskar et al.
2019: positive logits divided, negative multiplied, over prompt and output tokens), presence and frequency
(OpenAI API semantics, over output tokens). A draw is argmax(p / E) with E ~ Exp(1) per token, which samples
from p exactly (the exponential race / Gumbel-max trick); E comes from the request's own generator when it
has a seed, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_backend.engine.sequence import Sequence


@dataclass
class SampleResult:
    """Per-row outcome. token_ids [B] int64; logprobs: per row None or (chosen logprob, [(id, logprob)])."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples one token per row of a logits matrix [B, vocab] (float32) for the given sequences."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        logits = logits.float()
        raw = logits
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = logits.clone()
            for row, seq in enumerate(seqs):
                self._apply_penalties(logits[row], seq)

        if all(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._sample(logits, seqs)

        ids = token_ids.tolist()
        logprobs: list = [None] * len(seqs)
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            log_probs = torch.log_softmax(raw[wanted], dim=-1)
            for i, row in enumerate(wanted):
                top_n = params[row].logprobs
                chosen = log_probs[i, ids[row]].item()
                top: list[tuple[int, float]] = []
                if top_n:
                    values, indices = log_probs[i].topk(top_n)
                    top = list(zip(indices.tolist(), values.tolist()))
                logprobs[row] = (chosen, top)
        return SampleResult(ids, logprobs)

    @staticmethod
    def _apply_penalties(row_logits: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            values = row_logits[seen]
            row_logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                           values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=row_logits.numel()).to(row_logits.dtype)
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row_logits.dtype)

    @staticmethod
    def _sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        rows, vocab = logits.shape
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]).unsqueeze(1)
        scaled = logits / temperature
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)

        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p) | (probs < min_p * probs[:, :1])
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)

        noise = torch.empty_like(probs)
        for row, seq in enumerate(seqs):
            noise[row].exponential_(generator=seq.generator)
        choice = (probs / noise).argmax(dim=-1)
        sampled = sorted_idx.gather(1, choice.unsqueeze(1)).squeeze(1)
        greedy_rows = torch.tensor([p.greedy for p in params])
        if greedy_rows.any():
            sampled = torch.where(greedy_rows, logits.argmax(dim=-1), sampled)
        return sampled

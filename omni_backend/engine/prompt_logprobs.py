"""Logprobs of a prompt's own tokens (OpenAI completions' `echo` with `logprobs`; vLLM's `prompt_logprobs`).

The hidden state at prompt position p predicts the token at p + 1, so a prefill chunk that computes positions
[s, e) yields the logprobs of prompt tokens s + 1 .. e (those inside the prompt). They are read from the
step's hidden states after the forward pass, as raw log-softmax values like the sampled tokens' (`sampler.py`),
with the top `prompt_logprobs` alternatives. The first prompt token has no logprob (nothing precedes it).
A sequence keeps what was recorded, so a chunk computed again after a preemption records nothing twice.
"""

from __future__ import annotations

import torch

from omni_backend.engine.scheduler import ScheduledBatch


def record_prompt_logprobs(batch: ScheduledBatch, hidden: torch.Tensor, compute_logits) -> None:
    """Append to `seq.prompt_logprobs` the entries (token id, logprob or None, [(id, logprob)] top) of the prompt
    tokens this step's prefill chunks predict, for the sequences whose params ask for prompt logprobs.

    Args:
        batch: the step (its prefill chunks come first, rows of `hidden` in the same order).
        hidden: the step's hidden states [tokens, hidden size].
        compute_logits: the model's hidden -> logits projection.
    """
    row = 0
    for seq, count in zip(batch.seqs[:batch.num_prefills], batch.num_tokens):
        top_n = seq.params.prompt_logprobs
        start = seq.num_computed_tokens
        if top_n is not None:
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append((seq.token_ids[0], None, []))
            first = len(seq.prompt_logprobs) - 1  # the first position whose next token is not recorded yet
            end = min(start + count, seq.num_prompt_tokens - 1)  # positions that predict a prompt token
            if end > first >= start:
                rows = hidden[row + first - start:row + end - start]
                log_probs = torch.log_softmax(compute_logits(rows).float(), dim=-1)
                targets = torch.tensor(seq.token_ids[first + 1:end + 1], device=log_probs.device)
                chosen = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                tops = log_probs.topk(top_n, dim=-1) if top_n else None
                for i, token in enumerate(targets.tolist()):
                    top = list(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else []
                    seq.prompt_logprobs.append((token, chosen[i], top))
        row += count

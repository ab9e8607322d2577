"""What a talker needs from its thinker: each token's layer-0 input embedding and last-layer hidden state.

Qwen2.5-Omni's talker reads, for the prompt and for every generated token the thinker fed back, the thinker's
input embedding (the token's embedding, or the encoder output spliced in at an image/audio placeholder) and its
hidden state after the final norm (transformers' `hidden_states[0]` and `hidden_states[-1]` of `generate(...,
output_hidden_states=True)`, as `Qwen2_5OmniForConditionalGeneration.generate` takes them). A request asks with
`SamplingParams.return_hidden_states`; a request that does not costs nothing here.

The rows of token positions [s, e) come from the step that computes them. A generated token's rows exist once it is
fed back (the step that samples the token after it); the last token a request samples is never fed, so its rows
never exist, as in transformers. Rows are kept on the sequence until its next output carries them
(`Sequence.hidden_rows`), in position order. After a preemption the recomputed positions whose rows were already
taken record nothing again; a prefix-cache hit would skip computing positions, so such a request starts only from
cached blocks whose rows it already has (`BlockManager.cached_prefix`).
"""

from __future__ import annotations

import torch

from omni_backend.engine.scheduler import ScheduledBatch


def record_hidden_states(batch: ScheduledBatch, input_ids: torch.Tensor, hidden: torch.Tensor,
                         embed_tokens: torch.nn.Module) -> None:
    """Append to `seq.hidden_rows` the rows (float32, on the host) of the positions this step computes for the first
    time, for the sequences whose params ask for them; advances `seq.num_hidden_rows`.

    Args:
        batch: the step (prefill chunks first, then decodes; rows of `input_ids`/`hidden` in the same order).
        input_ids: the step's token ids int64 [T] (on the model's device).
        hidden: the step's last-layer hidden states [T, hidden size] (after the final norm).
        embed_tokens: the model's input embedding table (the placeholders' encoder rows replace its rows, as the
            forward pass did: `Sequence.prompt_embeds`).
    """
    row = 0
    for seq, count in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        first = max(start, seq.num_hidden_rows)
        end = start + count
        if seq.params.return_hidden_states and end > first:
            take = slice(row + first - start, row + count)
            embeds = embed_tokens(input_ids[take]).float()
            if seq.prompt_embeds is not None and first < seq.num_prompt_tokens:
                offsets, values = seq.prompt_embeds.in_range(first, end)
                embeds[offsets.to(embeds.device)] = values.to(device=embeds.device, dtype=embeds.dtype)
            seq.hidden_rows.append((hidden[take].float().cpu(), embeds.cpu()))
            seq.num_hidden_rows = end
        row += count


def take_hidden_rows(seq) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows `record_hidden_states` kept on `seq` since the last call, joined: (hidden states [k, H], input
    embeddings [k, H]) float32, or (None, None) when none are waiting."""
    if not seq.hidden_rows:
        return None, None
    hidden = torch.cat([h for h, _ in seq.hidden_rows])
    embeds = torch.cat([e for _, e in seq.hidden_rows])
    seq.hidden_rows.clear()
    return hidden, embeds

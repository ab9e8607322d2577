"""A step's model inputs, built on the host and uploaded to the engine's device with one copy.

The scheduler's batch becomes flat integer arrays (token ids, positions, cache slots, block-table pool rows,
context lengths, prefill query offsets, rows whose logits are sampled), packed into one staging buffer and sent
with one asynchronous copy (`device.HostToDeviceStaging`): the host never waits for the device while it
prepares a step. `host_step` builds the arrays (`HostStep`, which the other tensor-parallel ranks also get),
`upload_step` sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_backend.engine.attention.interface import AttentionMetadata, DecodePlans
from omni_backend.engine.device import HostToDeviceStaging
from omni_backend.engine.scheduler import ScheduledBatch
from omni_backend.engine.sequence import Sequence


@dataclass
class StepInputs:
    """One step's inputs on the engine device (tokens: prefill chunks first, then one token per decode).

    Attributes:
        input_ids, slot_mapping: int64 [T].
        positions: int64 [T], or [3, T] (M-RoPE t/h/w rows; 1-D ids repeated) when a prefill chunk of a prompt with
            `prompt_positions` is in the step.
        pool_rows: int64 [S], each sequence's row in the block-table pool.
        context_lens: int32 [S], KV length of each sequence including this step's tokens.
        prefill_query_start_loc: int32 [P + 1] cumulative query lengths of the P prefill sequences (None if P = 0).
        logit_rows: int64 [N], token index whose hidden state is sampled, one per sampling sequence.
        num_prefills: P; num_prefill_tokens: tokens of the prefill chunks.
        sampled: the N sequences that sample a token this step (their last token is computed), in order.
        embed_rows, embed_values: prompt-embedding replacements (token index int64 [k], [k, hidden] float) or
            None; kept on the host until used (only prefill chunks of multimodal prompts have them).
        addend_rows, addend_values: rows added to generated tokens' embeddings (token index int64 [a], [a, hidden]
            float32; `Sequence.input_addends`) or None; on the host until used.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    pool_rows: torch.Tensor
    context_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor | None
    logit_rows: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    sampled: list[Sequence]
    embed_rows: torch.Tensor | None
    embed_values: torch.Tensor | None
    addend_rows: torch.Tensor | None = None
    addend_values: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.num_prefills == 0

    @property
    def num_seqs(self) -> int:
        return self.pool_rows.shape[0]

    def attention_metadata(self, tables: torch.Tensor, plans: DecodePlans) -> AttentionMetadata:
        """The step's attention inputs, `tables` int32 [S, max_blocks_per_seq] its sequences' block tables and
        `plans` the split-KV plans of this rank's heads."""
        p, ctx = self.num_prefills, self.context_lens
        decodes = self.num_seqs - p
        splits, workspace = plans(decodes) if decodes else (None, None)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, num_prefill_tokens=self.num_prefill_tokens,
            prefill_query_start_loc=self.prefill_query_start_loc,
            prefill_context_lens=ctx[:p] if p else None, prefill_block_tables=tables[:p] if p else None,
            decode_context_lens=ctx[p:] if decodes else None, decode_block_tables=tables[p:] if decodes else None,
            decode_num_splits=splits, decode_workspace=workspace)

    def input_embeds(self, embed_tokens: torch.nn.Embedding) -> torch.Tensor | None:
        """The step's input embeddings where its token ids alone do not give them: prompt embeddings spliced in,
        input addends added; None otherwise (the model embeds the ids itself)."""
        if self.embed_rows is None and self.addend_rows is None:
            return None
        device = self.input_ids.device
        embeds = embed_tokens(self.input_ids)
        if self.embed_rows is not None:
            embeds[self.embed_rows.to(device)] = self.embed_values.to(device=device, dtype=embeds.dtype)
        if self.addend_rows is not None:
            rows = self.addend_rows.to(device)
            embeds[rows] = embeds[rows] + self.addend_values.to(device=device, dtype=embeds.dtype)
        return embeds


def staging_capacity(max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """int64 elements one step needs at most: 5 per token (id, three position rows, slot), 4 per sequence (pool
    row, context length, query start, logit row) and one more query start."""
    return 5 * max_num_batched_tokens + 4 * max_num_seqs + 1


@dataclass
class HostStep:
    """A step's inputs on the host, before their upload (`upload_step`): what the other tensor-parallel ranks get
    of each step (engine/tp_ranks.py), so no rank copies anything back from a device.

    Attributes:
        arrays: the int64 values of StepInputs' input_ids, positions (3 rows, flattened, when `mrope`),
            slot_mapping, pool_rows, context_lens, prefill_query_start_loc (empty without prefills) and
            logit_rows, in that order.
        mrope: whether positions are M-RoPE rows; num_prefills, num_prefill_tokens, embed_*, addend_*: StepInputs'.
    """

    arrays: list[list[int]]
    mrope: bool
    num_prefills: int
    num_prefill_tokens: int
    embed_rows: torch.Tensor | None
    embed_values: torch.Tensor | None
    addend_rows: torch.Tensor | None
    addend_values: torch.Tensor | None


def host_step(batch: ScheduledBatch, block_size: int) -> tuple[HostStep, list[Sequence]]:
    """The model inputs of `batch` on the host, and the sequences that sample a token this step (in order)."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    context_lens: list[int] = []
    query_start = [0]
    logit_rows: list[int] = []
    sampled: list[Sequence] = []
    embed_rows: list[torch.Tensor] = []
    embed_values: list[torch.Tensor] = []
    addend_rows: list[torch.Tensor] = []
    addend_values: list[torch.Tensor] = []
    mrope_rows: list[tuple[int, torch.Tensor]] = []  # (first token index in the step, [3, count] ids)
    num_prefills = batch.num_prefills
    for seq, count in zip(batch.seqs, batch.num_tokens):
        start = seq.num_computed_tokens
        end = start + count
        if seq.prompt_embeds is not None and start < seq.num_prompt_tokens:
            offsets, values = seq.prompt_embeds.in_range(start, end)
            embed_rows.append(offsets + len(token_ids))
            embed_values.append(values)
        generated = max(start, seq.num_prompt_tokens)
        if seq.input_addends is not None and end > generated:
            addend_rows.append(torch.arange(generated - start, end - start) + len(token_ids))
            addend_values.append(seq.input_addends.rows(generated - seq.num_prompt_tokens,
                                                        end - seq.num_prompt_tokens))
        ids = seq.position_ids(start, end)
        if ids is None:
            mrope_rows.append((len(token_ids), seq.prompt_positions.rows(start, end)))
            ids = range(start, end)
        positions.extend(ids)
        token_ids.extend(seq.token_ids[start:end])
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        rows.append(seq.pool_row)
        context_lens.append(end)
        query_start.append(query_start[-1] + count)
        if end == len(seq):
            logit_rows.append(len(token_ids) - 1)
            sampled.append(seq)
    prefill_starts = query_start[:num_prefills + 1] if num_prefills else []
    if mrope_rows:
        grid = torch.tensor(positions, dtype=torch.int64).expand(3, -1).clone()
        for offset, block in mrope_rows:
            grid[:, offset:offset + block.shape[1]] = block
        positions = grid.flatten().tolist()
    step = HostStep(
        arrays=[token_ids, positions, slots, rows, context_lens, prefill_starts, logit_rows],
        mrope=bool(mrope_rows), num_prefills=num_prefills, num_prefill_tokens=query_start[num_prefills],
        embed_rows=torch.cat(embed_rows) if embed_rows else None,
        embed_values=torch.cat(embed_values) if embed_values else None,
        addend_rows=torch.cat(addend_rows) if addend_rows else None,
        addend_values=torch.cat(addend_values) if addend_values else None)
    return step, sampled


def upload_step(step: HostStep, staging: HostToDeviceStaging, sampled: list[Sequence] | None = None) -> StepInputs:
    """`step` on the staging's device, with one copy (`sampled`: `host_step`'s; None on a rank that samples
    nothing)."""
    ids_t, pos_t, slots_t, rows_t, ctx_t, qsl_t, logit_t = staging.upload(step.arrays)
    if step.mrope:
        pos_t = pos_t.view(3, -1)
    return StepInputs(
        input_ids=ids_t, positions=pos_t, slot_mapping=slots_t, pool_rows=rows_t,
        context_lens=ctx_t.to(torch.int32),
        prefill_query_start_loc=qsl_t.to(torch.int32) if step.num_prefills else None,
        logit_rows=logit_t, num_prefills=step.num_prefills, num_prefill_tokens=step.num_prefill_tokens,
        sampled=sampled or [], embed_rows=step.embed_rows, embed_values=step.embed_values,
        addend_rows=step.addend_rows, addend_values=step.addend_values)


def block_tables(tables: list[list[int]], max_blocks_per_seq: int, device: torch.device) -> torch.Tensor:
    """Sequences' block tables (block ids, in order) as int32 [S, max_blocks_per_seq] on `device`, unused entries 0
    (as `block_manager.BlockTablePool` rows: kernels read only the entries their context length covers)."""
    padded = torch.zeros(len(tables), max_blocks_per_seq, dtype=torch.int32)
    for row, blocks in enumerate(tables):
        padded[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return padded.to(device)


def dummy_step(prefill_tokens: int, prefills: int, decodes: int, max_blocks_per_seq: int, plans: DecodePlans,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of a step that writes nothing: `prefills` sequences of `prefill_tokens`
    tokens each (none: one sequence of `prefill_tokens`) then `decodes` one-token rows of context 1, every slot -1
    and every block-table entry 0 (the model runner's GPU profiling and warm-up steps)."""
    prefills = max(prefills, 1) if prefill_tokens else 0
    per_seq = prefill_tokens // prefills if prefills else 0
    tokens = per_seq * prefills + decodes
    tables = torch.zeros(prefills + decodes, max_blocks_per_seq, dtype=torch.int32, device=device)
    ctx = torch.tensor([per_seq] * prefills + [1] * decodes, dtype=torch.int32, device=device)
    splits, workspace = plans(decodes) if decodes else (None, None)
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        num_prefill_tokens=per_seq * prefills,
        prefill_query_start_loc=(torch.arange(prefills + 1, dtype=torch.int32, device=device) * per_seq
                                 if prefills else None),
        prefill_context_lens=ctx[:prefills] if prefills else None,
        prefill_block_tables=tables[:prefills] if prefills else None,
        decode_context_lens=ctx[prefills:] if decodes else None,
        decode_block_tables=tables[prefills:] if decodes else None,
        decode_num_splits=splits, decode_workspace=workspace)
    positions = torch.cat([torch.arange(per_seq, device=device).repeat(prefills),
                           torch.zeros(decodes, dtype=torch.int64, device=device)])
    return torch.zeros(tokens, dtype=torch.int64, device=device), positions, meta

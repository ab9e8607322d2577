"""CUDA graphs for decode steps at fixed batch sizes.

Decode steps launch hundreds of small kernels whose CPU launch cost dominates at small batch; a captured graph
replays them with one launch. Graphs need fixed shapes and addresses, so (as in vLLM and nano-vllm) decode
is captured once per batch size bucket (1, 2, 4, 8, then multiples of 8 up to max_num_seqs) over static
input buffers allocated at the largest size; a live batch is copied into the buffers and padded to the
next bucket (padding rows: token 0, position 0, slot -1 so nothing is stored, context length 0 so attention
returns zeros). Batches above the largest bucket, and any step with prefill tokens, run eagerly. All
buckets share one memory pool (`torch.cuda.graph(pool=...)`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

DecodeFn = Callable[..., torch.Tensor]


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, 16, 24, 32, ... (multiples of 8) up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class CapturedGraph:
    """A replayable computation and its static output tensor."""

    replay: Callable[[], None]
    output: torch.Tensor


class TorchCudaGraphCapture:
    """Captures a callable into a `torch.cuda.CUDAGraph`; all captures share one memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: lazy initialisation and Triton autotuning must not happen during capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        self.pool = graph.pool()
        return CapturedGraph(graph.replay, output)


class DecodeGraphRunner:
    """Pads decode batches to captured sizes and replays their graphs.

    Args:
        decode_fn: (input_ids int64 [b], positions int64 [b], slot_mapping int64 [b], context_lens int32 [b],
            block_tables int32 [b, max_blocks], input_embeds [b, embed_width] or None) -> hidden [b, hidden_size];
            must only read these tensors.
        max_num_seqs: largest bucket.
        max_blocks_per_seq: block-table columns.
        device: where the static buffers live.
        capture: graph capturer (TorchCudaGraphCapture on GPU; tests pass a stand-in that replays eagerly).
        embed_width: for a model whose decode input is an embedding row per token (a talker: codec embedding plus
            its thinker's row), the row width; the graphs then read a static `input_embeds` buffer [max_num_seqs,
            embed_width] of that dtype (`embed_dtype`). None: they read the token ids only.
    """

    def __init__(self, decode_fn: DecodeFn, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 capture=None, embed_width: int | None = None, embed_dtype: torch.dtype = torch.float32):
        self.decode_fn = decode_fn
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.capture_impl = capture or TorchCudaGraphCapture()
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.input_embeds = (torch.zeros(n, embed_width, dtype=embed_dtype, device=device)
                             if embed_width is not None else None)
        self.graphs: dict[int, CapturedGraph] = {}
        self.num_replays = 0
        self.num_padded_rows = 0

    def capture_all(self) -> None:
        """Capture one graph per bucket, largest first (so the shared pool is sized by the largest)."""
        for size in reversed(self.batch_sizes):
            self.graphs[size] = self.capture_impl.capture(self._bound(size))

    def _bound(self, size: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            embeds = self.input_embeds[:size] if self.input_embeds is not None else None
            return self.decode_fn(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                                  self.context_lens[:size], self.block_tables[:size], embeds)
        return run

    def bucket(self, batch_size: int) -> int | None:
        """Smallest captured size >= batch_size, or None when the batch must run eagerly."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) and self.graphs else None

    def run(self, input_ids, positions, slot_mapping, context_lens, block_tables,
            input_embeds=None) -> torch.Tensor | None:
        """Replay the bucket's graph for a live decode batch of b rows (`input_embeds` [b, embed_width] when the
        graphs read embeddings); returns hidden [b, H] or None.

        None means no bucket fits (b > max_num_seqs or nothing captured): the caller runs eagerly.
        """
        b = input_ids.shape[0]
        size = self.bucket(b)
        if size is None:
            return None
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slot_mapping[:b].copy_(slot_mapping)
        self.context_lens[:b].copy_(context_lens)
        self.block_tables[:b].copy_(block_tables)
        if self.input_embeds is not None:
            self.input_embeds[:b].copy_(input_embeds)
        if size > b:
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slot_mapping[b:size].fill_(-1)
            self.context_lens[b:size].zero_()
        graph = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        self.num_padded_rows += size - b
        return graph.output[:b]

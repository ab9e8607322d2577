"""Tensor parallelism: which part of each layer a rank holds, and the all-reduce that joins the parts.

The split is Megatron-LM's (Shoeybi et al., 2019, section 3; vLLM and nano-vllm shard the same way): attention is
split by heads (q/k/v projections by output rows, o_proj by input columns) and the MLP by its intermediate units
(gate/up by rows, down_proj by columns), so each rank computes its heads and units from the whole input and
o_proj / down_proj give partial sums that one all-reduce per projection adds up. A rank keeps whole KV-head groups
(a KV head with the query heads that read it), so its KV cache holds only its own KV heads.

Groups and units need not divide evenly: the first `total % size` ranks take one more (SmolLM2-135M's 3 KV heads
split 2 + 1 over two ranks). A rank without a KV head is refused: replicating KV heads, as vLLM does when the ranks
outnumber them, is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: query heads [q_start, q_start + num_q) and KV heads [kv_start, kv_start + num_kv)
    of the checkpoint's, in its order (each KV head's query heads are contiguous, as grouped-query attention
    lays them out)."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int

    def qkv_spans(self, head_dim: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """[start, stop) output rows of the checkpoint's q, k and v projections this rank keeps."""
        q = (self.q_start * head_dim, (self.q_start + self.num_q) * head_dim)
        kv = (self.kv_start * head_dim, (self.kv_start + self.num_kv) * head_dim)
        return q, kv, kv


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel ranks (size 1: the whole model, no communication).

    Raises (`heads`, `span`):
        ValueError: fewer KV heads or MLP units than ranks, or query heads that are not a whole number per KV head.
    """

    rank: int = 0
    size: int = 1

    def span(self, total: int) -> tuple[int, int]:
        """This rank's contiguous [start, stop) of `total` units, split as evenly as possible (the first
        `total % size` ranks one more)."""
        if total < self.size:
            raise ValueError(f"cannot split {total} units over tensor_parallel_size {self.size}")
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's KV heads (`span` of them) and the query heads that read them."""
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
        if num_kv_heads < self.size:
            raise ValueError(f"tensor_parallel_size {self.size} exceeds the model's {num_kv_heads} KV heads (each "
                             f"rank needs a KV head of its own; KV heads are not replicated)")
        group = num_heads // num_kv_heads
        start, stop = self.span(num_kv_heads)
        return HeadShard(start * group, (stop - start) * group, start, stop - start)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `partial` (every rank's [T, hidden] part), in place; `partial` itself when
        there is one rank."""
        if self.size > 1:
            dist.all_reduce(partial)
        return partial


SINGLE = Shard()

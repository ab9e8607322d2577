"""KV-cache block allocation and the device-resident block-table pool.

Paged KV cache after Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023): the cache is split into fixed-size blocks; each sequence owns a list of block
ids (its block table); attention kernels gather K/V through it.
"""

from __future__ import annotations

from collections import deque

import torch

from omni_backend.engine.device import Device, HostToDeviceStaging
from omni_backend.engine.sequence import Sequence


class BlockTablePool:
    """Preallocated int32 block tables [max_num_seqs, max_blocks_per_seq] kept on the engine's device.

    A running sequence owns one row. New blocks are written in place: `append` queues (row, column, block)
    triples and `flush` uploads all of a step's updates with one asynchronous copy and applies them with one
    indexed write, so the host never rebuilds or re-uploads whole tables. Unused entries hold 0 (a valid block
    id: kernels must only read entries below ceil(context_len / block_size)).
    """

    # updates uploaded per copy; a larger flush (a burst of admissions) takes several
    STAGED_UPDATES = 4096

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: Device):
        self.tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device.torch_device)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._pending: list[tuple[int, int, int]] = []
        self._staging = HostToDeviceStaging(3 * self.STAGED_UPDATES, device)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire_row(self) -> int:
        """Take a free row. Raises RuntimeError when all max_num_seqs rows are in use."""
        if not self._free_rows:
            raise RuntimeError("block-table pool exhausted")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def append(self, row: int, column: int, block_id: int) -> None:
        self._pending.append((row, column, block_id))

    def flush(self) -> int:
        """Apply queued updates (one upload and one indexed write per STAGED_UPDATES); returns how many entries
        changed."""
        count = len(self._pending)
        for start in range(0, count, self.STAGED_UPDATES):
            chunk = self._pending[start:start + self.STAGED_UPDATES]
            rows, columns, blocks = self._staging.upload([[u[0] for u in chunk], [u[1] for u in chunk],
                                                          [u[2] for u in chunk]])
            self.tables.index_put_((rows, columns), blocks.to(torch.int32))
        self._pending.clear()
        return count


class BlockManager:
    """Allocates and frees KV-cache blocks with reference counts.

    Reference counts are kept so blocks can later be shared between sequences (prefix caching); today each
    block has one owner. Allocation is all-or-nothing per call.
    """

    def __init__(self, num_blocks: int, block_size: int, pool: BlockTablePool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = pool
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` fit."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens, writing new entries into its pool row.

        Raises:
            RuntimeError: not enough free blocks (callers check `can_allocate` first) or no pool row.
        """
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"need {needed} KV blocks, {len(self._free)} free")
        if seq.pool_row is None:
            seq.pool_row = self.pool.acquire_row()
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            self.pool.append(seq.pool_row, len(seq.block_table), block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks and its pool row."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table.clear()
        if seq.pool_row is not None:
            self.pool.release_row(seq.pool_row)
            seq.pool_row = None

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot (block_id * block_size + offset) of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

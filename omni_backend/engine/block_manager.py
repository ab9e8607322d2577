"""KV-cache block allocation and the device-resident block-table pool.

Paged KV cache after Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023): the cache is split into fixed-size blocks; each sequence owns a list of block
ids (its block table); attention kernels gather K/V through it.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from omni_backend.engine import prefix_cache
from omni_backend.engine.device import Device, HostToDeviceStaging
from omni_backend.engine.kv_events import KVEventRecorder
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
    """Allocates and frees KV-cache blocks with reference counts, and keeps freed full blocks for reuse (automatic
    prefix caching).

    With prefix caching on, every full block whose KV is computed is offered to the cache under its name
    (`prefix_cache.block_hash`, chained over the tokens before it). A new sequence whose leading full blocks have
    cached names shares those blocks (their reference counts go up) and prefills only the rest; at least one token
    is always computed, so its first logits exist. Shared blocks are never written: a sequence writes only the
    positions at and after its computed tokens, which lie past every block it took from the cache.

    A block being computed right now -- a full block of a running sequence's known tokens, past its cached prefix,
    whose prefill has not reached its end -- is *in flight* under the name it will be offered under (`in_flight`): a
    waiting sequence whose next block has that name can wait for it and then take it from the cache instead of
    computing the same KV again (the scheduler decides, scheduler.py 2.). A block leaves flight when it is offered
    to the cache or its sequence is freed (finished, aborted or preempted before computing it).

    A block whose last reference goes away keeps its KV and its name and becomes evictable; it still counts as
    free. A new block comes from the never-named free blocks first, then from the evictable ones, least recently
    freed first (LRU; a sequence's blocks are released last block first, so a prefix's tail goes before its head).
    A block named twice (two sequences computed the same content at once) keeps the first owner's name; the
    other copy is freed as unnamed.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        pool: the device-resident block tables.
        enable_prefix_caching: reuse cached blocks (off: every block is private and freed unnamed).

    Attributes:
        prefix_cache_queries: prompt tokens looked up in the cache at admission (tokens; counter).
        prefix_cache_hits: of those, tokens whose KV was reused (tokens; counter).
        kv_events: where names given, evicted and cleared are recorded (engine/kv_events.py), None (the default)
            until `record_kv_events`.
    """

    def __init__(self, num_blocks: int, block_size: int, pool: BlockTablePool, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = pool
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # free and unnamed
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and named, least recently freed first
        self._ref_counts = [0] * num_blocks
        self._names: list[bytes | None] = [None] * num_blocks
        self._by_name: dict[bytes, int] = {}
        self._in_flight: dict[bytes, int] = {}  # name -> the block a running sequence is computing under it
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_events: KVEventRecorder | None = None
        self._resets = 0  # prefix cache resets so far: a sequence admitted before the last one offers again

    def record_kv_events(self) -> KVEventRecorder:
        """From now on, record every block named, evicted or cleared; returns the recorder."""
        if self.kv_events is None:
            self.kv_events = KVEventRecorder()
        return self.kv_events

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: unnamed free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a named, reusable prefix (in use or evictable)."""
        return len(self._by_name)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` fit."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting `seq` (holding no blocks) would start with: its longest run of leading full
        blocks with cached names, short of its last token (which is always computed). Empty when caching is off
        or the sequence asks for prompt logprobs (they are read from the prefill's hidden states); a sequence that
        returns its hidden states starts only from blocks whose rows it has already recorded (a preempted one)."""
        blocks = []
        for index in range(self._reusable_blocks(seq)):
            block = self._by_name.get(prefix_cache.block_name(seq, index, self.block_size))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def in_flight(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether the block that waiting `seq` would take right after its `cached` prefix (`cached_prefix`) is in
        flight: being computed now by a running sequence, so that `seq` could take it from the cache once it is.
        False where `seq` could not reuse that block anyway (the same rules as `cached_prefix`)."""
        index = len(cached)
        return index < self._reusable_blocks(seq) and \
            prefix_cache.block_name(seq, index, self.block_size) in self._in_flight

    def _reusable_blocks(self, seq: Sequence) -> int:
        """How many leading full blocks of waiting `seq` may come from the cache (`cached_prefix`'s rules)."""
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0
        usable = (len(seq) - 1) // self.block_size
        if seq.params.return_hidden_states:
            usable = min(usable, seq.num_hidden_rows // self.block_size)
        return usable

    def blocks_to_admit(self, seq: Sequence, num_tokens: int, cached: list[int]) -> int:
        """Free blocks that admitting waiting `seq` for `num_tokens` tokens takes when it starts with the `cached`
        blocks (`cached_prefix`): the new blocks, plus the cached ones that are evictable now (free until taken)."""
        return self.blocks_needed(seq, num_tokens) - len(cached) + sum(self._ref_counts[b] == 0 for b in cached)

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens, writing new entries into its pool row.

        `cached` (only for a sequence holding no blocks: its `cached_prefix`) become its first blocks, shared, and
        its computed tokens start after them; the lookup is counted in the prefix-cache counters, and the full blocks
        of its known tokens after them are in flight (class docstring) until computed.

        Raises:
            RuntimeError: not enough free blocks (callers check `can_allocate`/`blocks_to_admit` first) or no
                pool row.
        """
        needed = self.blocks_needed(seq, num_tokens) - len(cached)
        taken = needed + sum(self._ref_counts[b] == 0 for b in cached)
        if taken > self.num_free_blocks:
            raise RuntimeError(f"need {taken} KV blocks, {self.num_free_blocks} free")
        if seq.pool_row is None:
            seq.pool_row = self.pool.acquire_row()
        admission = not seq.block_table
        if admission:
            seq.prefix_cache_resets = self._resets
            if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
                self.prefix_cache_queries += len(seq)
                self.prefix_cache_hits += len(cached) * self.block_size
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = len(cached) * self.block_size
        for block in cached:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            self._append(seq, block)
        if cached:
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.num_registered_blocks = len(cached)
        for _ in range(needed):
            block = self._take_free_block()
            self._ref_counts[block] = 1
            self._append(seq, block)
        if admission and self.enable_prefix_caching:
            self._take_flight(seq, len(cached))

    def _take_flight(self, seq: Sequence, start: int) -> None:
        """Put admitted `seq`'s full blocks of known tokens from `start` in flight, except those whose name is
        cached or already in flight for another block (this copy will not be named: `register_computed_blocks`)."""
        for index in range(start, len(seq) // self.block_size):
            name = prefix_cache.block_name(seq, index, self.block_size)
            if name not in self._by_name and name not in self._in_flight:
                self._in_flight[name] = seq.block_table[index]

    def _land(self, seq: Sequence, index: int) -> None:
        """Take `seq`'s block `index` out of flight (computed or dropped), if it is the one in flight."""
        if index < len(seq.block_hashes):
            name = seq.block_hashes[index]
            if self._in_flight.get(name) == seq.block_table[index]:
                del self._in_flight[name]

    def _append(self, seq: Sequence, block: int) -> None:
        self.pool.append(seq.pool_row, len(seq.block_table), block)
        seq.block_table.append(block)

    def _take_free_block(self) -> int:
        """An unnamed free block, else the least recently freed cached one, whose name is dropped."""
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._by_name[self._names[block]]
        if self.kv_events is not None:
            self.kv_events.removed(self._names[block])
        self._names[block] = None
        return block

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer to the cache `seq`'s full blocks whose KV is now computed (call after each step that computed
        tokens of it), prompt and generated tokens alike: a chat's next turn resends the answer. A name already
        cached for another block leaves this copy unnamed. After a prefix cache reset, a sequence admitted before it
        offers its blocks again from the first: their names were dropped, and a KV-event subscriber, told to forget
        every block, drops a BlockStored whose parent it does not hold (vLLM's and Dynamo's indexers), so the
        sequence's chain is stored anew from its root (parent None)."""
        if not self.enable_prefix_caching:
            return
        if seq.prefix_cache_resets != self._resets:
            seq.prefix_cache_resets = self._resets
            seq.num_registered_blocks = 0
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        named = []
        for index in range(seq.num_registered_blocks, full):
            block, name = seq.block_table[index], prefix_cache.block_name(seq, index, self.block_size)
            self._land(seq, index)
            if self._names[block] is None and name not in self._by_name:
                self._names[block] = name
                self._by_name[name] = block
                named.append(index)
        seq.num_registered_blocks = full
        if self.kv_events is not None and named:
            self._record_stored(seq, named)

    def _record_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One BlockStored per run of consecutive newly named blocks of `seq` (a block whose name another block
        already holds is not stored again, and breaks the run)."""
        size, names = self.block_size, seq.block_hashes
        start = 0
        for end in range(1, len(indices) + 1):
            if end == len(indices) or indices[end] != indices[end - 1] + 1:
                first, last = indices[start], indices[end - 1]
                self.kv_events.stored(names[first:last + 1], names[first - 1] if first else None,
                                      seq.token_ids[first * size:(last + 1) * size], size)
                start = end

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks (last block first) and return its pool row. A block no longer
        referenced is evictable when named, else free; its blocks in flight land uncomputed."""
        for index in range(seq.num_registered_blocks, len(seq.block_table)):
            self._land(seq, index)
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._names[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        if seq.pool_row is not None:
            self.pool.release_row(seq.pool_row)
            seq.pool_row = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached name (blocks in use keep their KV and stay allocated; evictable ones become plain
        free blocks; their sequences offer them again after their next step: `register_computed_blocks`).
        Returns how many names were dropped. For benchmarks that must start cold."""
        dropped = len(self._by_name)
        self._resets += 1
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._names = [None] * self.num_blocks
        self._by_name.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return dropped

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot (block_id * block_size + offset) of token `position` of `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

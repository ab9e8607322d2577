"""KV-cache events: the blocks the prefix cache names (stored), evicts (removed) or forgets all at once (cleared).

A KV-aware router (NVIDIA Dynamo's, llm-d's precise prefix scorer) keeps an index of which engine holds which
prefix from these events, in the form vLLM publishes them (`vllm/distributed/kv_events.py`): `BlockStored`
(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name), `BlockRemoved`
(block_hashes, medium) and `AllBlocksCleared`, each a msgspec struct with `tag=True, array_like=True`, i.e. on
the wire a list that starts with the class name and holds the fields in that order. (vLLM's main branch has sent
each event as a tagged map instead since its PR 42892; Dynamo's decoder reads both forms, older vLLM-format
consumers only the list, so the list is what goes out here.)

A block's hash on the wire is a 64-bit integer: our block names (`prefix_cache.block_hash`, 16-byte BLAKE2b
chained over the parent's name, the token ids and the image/audio embedding key) read as a big-endian integer
and cut to its low 64 bits, i.e. the name's last 8 bytes, unsigned, which is vLLM's `maybe_convert_block_hash`
for its own byte hashes. Two blocks with the same tokens but different images keep different hashes, as they
keep different names. `lora_id`, `medium` and `lora_name` are nil: there are no adapters, and a nil medium is
the engine's own KV cache (Dynamo reads it as its device tier).

The block manager records events only after `BlockManager.record_kv_events()` (the `kv_events` setting of the llm
stage); until then it holds no recorder and records nothing. Building an event costs the engine loop a list
append; turning it into the wire form (`wire`) is left to the thread that publishes it.
"""

from __future__ import annotations

from dataclasses import dataclass


def external_hash(name: bytes) -> int:
    """The 64-bit form of a block name: its last 8 bytes as an unsigned big-endian integer (0 <= h < 2**64)."""
    return int.from_bytes(name[-8:], "big")


@dataclass
class BlockStored:
    """Consecutive blocks of one sequence newly named: `names` in chain order, `parent` the name of the block
    before the first (None for a sequence's first block), `token_ids` their block_size tokens each."""

    names: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    block_size: int

    def wire(self) -> list:
        """vLLM's array form: [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
        lora_name]."""
        parent = None if self.parent is None else external_hash(self.parent)
        return ["BlockStored", [external_hash(n) for n in self.names], parent, self.token_ids, self.block_size,
                None, None, None]


@dataclass
class BlockRemoved:
    """Blocks evicted from the cache (their names dropped), in eviction order."""

    names: list[bytes]

    def wire(self) -> list:
        """vLLM's array form: [tag, block_hashes, medium]."""
        return ["BlockRemoved", [external_hash(n) for n in self.names], None]


@dataclass
class AllBlocksCleared:
    """Every name forgotten (a prefix cache reset)."""

    def wire(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventRecorder:
    """The events of one engine since the last `take`, in the order they happened. Only the engine loop calls it
    (the block manager's methods run there)."""

    def __init__(self):
        self._events: list[KVEvent] = []

    def stored(self, names: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int) -> None:
        self._events.append(BlockStored(names, parent, token_ids, block_size))

    def removed(self, name: bytes) -> None:
        """One evicted block; evictions in a row share one BlockRemoved (an admission often evicts several)."""
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.names.append(name)
        else:
            self._events.append(BlockRemoved([name]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first; the recorder starts empty again."""
        events, self._events = self._events, []
        return events

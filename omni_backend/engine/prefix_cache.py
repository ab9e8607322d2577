"""Names of full KV blocks for automatic prefix caching.

A full block's KV depends on every token before it, so a block is named by a hash chained over its parent's
name and its own token ids (vLLM's automatic prefix caching and nano-vllm hash blocks the same way; SGLang keeps
a radix tree over the same tokens). Two blocks with the same name hold the same KV, so a new request whose first
blocks have names already in the cache reuses them and prefills only the rest.

Token ids alone do not always determine the KV: an image or audio clip enters the prompt as a run of identical
placeholder ids whose embeddings (the encoder's output) differ per image. A block that holds such positions adds
an extra key to its name: the positions (relative to the block) and the bytes of the embeddings that replace them.
Different images with the same placeholder ids therefore never share a block. A prompt with M-RoPE position ids
(t, h, w rows that differ from the token index: images, video, audio in Qwen2.5-Omni) adds the ids of the block's
positions too, so that the same embeddings at other grid positions never share a block; the blocks after the
prompt are rotated by ids the prompt's blocks, named before them in the chain, determine.

The hash is BLAKE2b with a 16-byte digest (RFC 7693): collisions are not a practical concern at 2^64 work, so a
name stands for its content and the cache never compares token ids on a hit.
"""

from __future__ import annotations

import hashlib
from array import array

import torch

from omni_backend.engine.sequence import PromptEmbeds, PromptPositions, Sequence

DIGEST_BYTES = 16


def block_hash(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """The name of a full block.

    Args:
        parent: the name of the block before it (None for a sequence's first block).
        token_ids: the block's block_size token ids.
        extra: the embedding key of its positions replaced by prompt embeddings (`embeds_key`), b"" for none.

    Returns:
        a DIGEST_BYTES-byte digest. The fields cannot run into each other: the parent has a fixed length (or is
        absent for every first block), the token ids a fixed length per block size, and the extra key comes last.
    """
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return digest.digest()


def embeds_key(prompt_embeds: PromptEmbeds | None, start: int, end: int) -> bytes:
    """The extra key of positions [start, end) of a prompt: the offsets and float32 bytes of the prompt embeddings
    that replace tokens there (b"" when none does)."""
    if prompt_embeds is None:
        return b""
    offsets, values = prompt_embeds.in_range(start, end)
    if offsets.numel() == 0:
        return b""
    return (array("q", offsets.tolist()).tobytes()
            + values.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())


def positions_key(prompt_positions: PromptPositions | None, start: int, end: int) -> bytes:
    """The extra key of positions [start, end) of a prompt with M-RoPE position ids: their count, then their t, h
    and w rows, as int64 bytes (b"" for a prompt whose ids are its token indices). It goes first in the extra key,
    so its length prefix keeps it apart from the embedding key after it."""
    if prompt_positions is None:
        return b""
    rows = prompt_positions.positions[:, start:end]
    return array("q", [rows.shape[1]]).tobytes() + rows.contiguous().numpy().tobytes()


def block_name(seq: Sequence, index: int, block_size: int) -> bytes:
    """The name of `seq`'s block `index` (full of known token ids), extending the memo `seq.block_hashes` up to it
    (token ids only ever grow at the end, so names once computed stay true). Callers that stop at the first
    block not in the cache hash no further."""
    hashes = seq.block_hashes
    while len(hashes) <= index:
        start = len(hashes) * block_size
        extra = b""
        if start < seq.num_prompt_tokens:
            extra = (positions_key(seq.prompt_positions, start, start + block_size)
                     + embeds_key(seq.prompt_embeds, start, start + block_size))
        hashes.append(block_hash(hashes[-1] if hashes else None, seq.token_ids[start:start + block_size], extra))
    return hashes[index]

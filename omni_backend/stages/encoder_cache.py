"""A content-addressed cache of encoder outputs: an image or clip seen recently skips the encoder.

Chat traffic resends media: every turn of a conversation about a picture carries the picture again, and several
users ask about the same one. The encoder stages key each item (one image's normalized pixels, one clip's log-mel
features: the encoder's whole input for it) by a BLAKE2b-128 digest (RFC 7693) of its dtype, shape and bytes, and
keep its embeddings in a least-recently-used map bounded in bytes. Equal digests mean equal inputs, hence equal
outputs; items repeated inside one batch are encoded once too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

# The window of recent media a stage keeps: about 590 images of the default vision stage (49 tokens x 576 hidden,
# float32: 110 KiB each) or 77 thirty-second clips of the default audio stage (375 x 576: 844 KiB); an eighth of the
# llm's default 512 MiB CPU KV cache.
CAPACITY_BYTES = 64 * 2**20


def content_key(item: np.ndarray) -> bytes:
    """The digest of one encoder input item (any shape and dtype): equal for equal dtype, shape and values."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{item.dtype.str}{item.shape}".encode())
    digest.update(np.ascontiguousarray(item).tobytes())
    return digest.digest()


class EncoderCache:
    """Embeddings of recent encoder inputs, least recently used evicted first, at most `capacity_bytes` of them.

    Not thread-safe (a stage's `execute` runs on one thread).
    """

    def __init__(self, capacity_bytes: int = CAPACITY_BYTES):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> np.ndarray | None:
        """The embeddings stored under `key` (marked most recently used), None when absent."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: np.ndarray) -> None:
        """Store `value` under `key`, evicting the least recently used entries beyond the capacity (a value larger
        than the whole capacity is not stored)."""
        if value.nbytes > self.capacity_bytes or key in self._entries:
            return
        self._entries[key] = value
        self._bytes += value.nbytes
        while self._bytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes

"""What crosses into the engine loop's inbox: one typed message per kind (vLLM v1's EngineCoreRequest and its
utility calls play this part there)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from omni_backend.engine.sequence import Sequence


@dataclass(frozen=True)
class AddRequest:
    """A new request, checked by the engine (`LLMEngine.make_sequence`) and admitted (`LLMService.submit`)."""

    sequence: Sequence


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request now and free its KV blocks (a cancelled client, a failed send, the server stopping)."""

    request_id: str


@dataclass(frozen=True)
class ExtendInputs:
    """More input addend rows [k, width] for a held request (a talker's next rows from its thinker), and with
    `tail` its last ones (`LLMEngine.extend_inputs`)."""

    request_id: str
    rows: torch.Tensor | None
    tail: torch.Tensor | None = None


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix before the next step; `done` gets the number of cached blocks dropped."""

    done: concurrent.futures.Future


InboxMessage = AddRequest | AbortRequest | ExtendInputs | ResetPrefixCache

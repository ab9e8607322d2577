"""Postprocess stage: the llm stage's outputs -> the response the client sees.

Text detokenization (incremental, UTF-8 safe, with stop strings) happens in the LLM engine, because deciding
to stop needs the text; this stage passes `text_output` through and turns the engine's token-id logprobs into
what the OpenAI API returns: each token's string and its exact UTF-8 bytes.

Input tensors (from the llm stage, one request per streamed llm response):

    text_output        STRING [1]  text delta (streaming) or whole text
    finish_reason      STRING [1]  "" until the last response, then "stop", "length" or "abort"
    prompt_tokens      INT32  [1]
    completion_tokens  INT32  [1]  cumulative
    cached_tokens      INT32  [1]  optional; prompt tokens the prefix cache supplied (0 when absent)
    output_logprobs    STRING [1]  JSON list, one entry per token of this delta:
                                   {"id": int, "logprob": float, "top": [[id, logprob], ...]}; "" when off
    prompt_token_logprobs STRING [1] optional; the same for every prompt token (the first with logprob null), in a
                                   request's first response when asked for; "" otherwise

Output tensors: the same names, with `output_logprobs` and `prompt_token_logprobs` rewritten to JSON lists of
`{"token": str, "bytes": [int], "logprob": float, "top_logprobs": [{"token", "bytes", "logprob"}]}`
("" when logprobs were not requested). A response without logprob entries comes out as it went in, so callers skip
the stage for it (`carries_logprobs`): a round trip per token saved.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import numpy as np

from omni_backend import tensor_names as T
from omni_backend.settings import parse_field
from omni_backend.stages.tensors import one_value, string_tensor

INPUT_NAMES = (T.TEXT_OUTPUT, T.FINISH_REASON, T.PROMPT_TOKENS, T.COMPLETION_TOKENS, T.CACHED_TOKENS,
               T.OUTPUT_LOGPROBS, T.PROMPT_TOKEN_LOGPROBS)
OUTPUT_NAMES = INPUT_NAMES
REWRITTEN = (T.OUTPUT_LOGPROBS, T.PROMPT_TOKEN_LOGPROBS)  # the inputs this stage changes; it passes the rest through

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2 style): printable character -> the byte it stands for.

    Byte-level BPE vocabularies spell every byte as one printable character: bytes that are already
    printable Latin-1 characters stand for themselves, the others (controls, space, ...) are shifted to
    code points 256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


class TokenBytes:
    """Token id -> (token string, exact UTF-8 bytes) for a transformers tokenizer.

    Handles byte-level BPE (GPT-2, Llama 3, SmolLM2) and SentencePiece-style vocabularies (`▁` for a space,
    `<0xNN>` byte fallback); special/added tokens are their text. Other vocabularies fall back to decoding
    the single token. The string is the bytes decoded with U+FFFD for an incomplete character (a token may
    hold part of a multi-byte character; `bytes` stays exact).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None))
        if "ByteLevel" in decoder:
            self.scheme = "byte_level"
        elif "Metaspace" in decoder or "ByteFallback" in decoder or "▁" in decoder:
            self.scheme = "sentencepiece"
        else:
            self.scheme = "decode"
        self._alphabet = byte_level_alphabet()
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if token_id in self._added:
            data = self._added[token_id].encode("utf-8")
        elif self.scheme == "decode":
            data = self.tokenizer.decode([token_id]).encode("utf-8")
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
            if self.scheme == "byte_level":
                if all(c in self._alphabet for c in piece):
                    data = bytes(self._alphabet[c] for c in piece)
                else:  # not a byte-level spelling (should not happen): take the text
                    data = piece.encode("utf-8")
            else:
                match = _BYTE_FALLBACK.match(piece)
                data = bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")
        return data.decode("utf-8", errors="replace"), data

    def entry(self, token_id: int, logprob: float | None) -> dict:
        """OpenAI-style `{"token", "bytes", "logprob"}` for one token (logprob None: a prompt's first token)."""
        text, data = self.lookup(int(token_id))
        return {"token": text, "bytes": list(data), "logprob": None if logprob is None else float(logprob)}


class Postprocessor:
    """Passes the llm stage's text through and converts its logprobs for one model's tokenizer."""

    input_names = INPUT_NAMES  # the model's inputs (triton_glue.StageModel)

    def __init__(self, tokenizer):
        self.token_bytes = TokenBytes(tokenizer)

    @classmethod
    def from_pretrained(cls, model_path: str) -> "Postprocessor":
        """Load the tokenizer from a local checkpoint folder (offline)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path, local_files_only=True))

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "Postprocessor":
        """From the postprocess model's string parameters: the engine's `llm_model_path` (its tokenizer)."""
        from omni_backend.engine.config import EngineConfig

        return cls.from_pretrained(parse_field(EngineConfig, "model_path", parameters.get("llm_model_path"),
                                               "llm_model_path"))

    def convert_logprobs(self, engine_json: str, name: str = T.OUTPUT_LOGPROBS) -> str:
        """Engine logprobs JSON (`[{"id", "logprob", "top": [[id, logprob], ...]}]`) -> OpenAI-style JSON.

        Returns "" for "" (logprobs not requested).

        Raises:
            ValueError: malformed JSON or entries, or a token id outside the vocabulary (naming the tensor `name`).
        """
        if not engine_json:
            return ""
        try:
            entries = json.loads(engine_json)
            converted = []
            for item in entries:
                entry = self.token_bytes.entry(item["id"], item["logprob"])
                entry["top_logprobs"] = [self.token_bytes.entry(i, lp) for i, lp in item.get("top", [])]
                converted.append(entry)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"{name} is malformed: {exc}") from None
        return json.dumps(converted, ensure_ascii=False)

    def run(self, arrays: dict) -> dict[str, np.ndarray]:
        """One llm response: input arrays by tensor name -> output arrays (see module docstring).

        Raises:
            ValueError: malformed tensors (wrong element count, bad UTF-8, bad logprobs JSON).
        """
        return {
            # The engine's text deltas are already UTF-8 safe: passed through as the same bytes.
            T.TEXT_OUTPUT: _one_string(arrays, T.TEXT_OUTPUT),
            T.FINISH_REASON: string_tensor(one_value(arrays, T.FINISH_REASON, str, "")),
            T.PROMPT_TOKENS: np.asarray([one_value(arrays, T.PROMPT_TOKENS, int, 0)], dtype=np.int32),
            T.COMPLETION_TOKENS: np.asarray([one_value(arrays, T.COMPLETION_TOKENS, int, 0)], dtype=np.int32),
            T.CACHED_TOKENS: np.asarray([one_value(arrays, T.CACHED_TOKENS, int, 0)], dtype=np.int32),
            **{name: string_tensor(self.convert_logprobs(one_value(arrays, name, str, ""), name))
               for name in REWRITTEN},
        }


def carries_logprobs(arrays: dict) -> bool:
    """Whether llm outputs (tensor name -> array) hold logprob entries for this stage to rewrite ("" or absent when
    not asked for); without them `Postprocessor.run` changes nothing.

    Raises:
        FieldError: a logprobs tensor of more than one element or not UTF-8.
    """
    return any(one_value(arrays, name, str, "") for name in REWRITTEN)


def _one_string(arrays: dict, name: str) -> np.ndarray:
    """The STRING tensor `name` as a 1-element object array, unchanged; b"" when absent.

    Raises:
        ValueError: the tensor holds more or fewer than one element.
    """
    array = arrays.get(name)
    if array is None:
        return np.array([b""], dtype=np.object_)
    flat = np.asarray(array, dtype=np.object_).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got {flat.size}")
    return flat

"""Grammar-constrained decoding (structured outputs) with xgrammar (Dong et al., "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models", 2024).

The design follows vLLM v1's structured-output path (`vllm/v1/structured_output/`), written anew here:

- A request names its grammar with SamplingParams' `guide_type` and `guide` (the TensorRT-LLM backend's
  `guided_decoding_guide_type` / `guided_decoding_guide`: `json` any JSON object, `json_schema`, `regex`,
  `ebnf_grammar`, and `structural_tag` as TensorRT-LLM's GuidedDecodingParams has it: xgrammar's structural tag,
  free text until a trigger string, then the grammar of the tag it opens, as the tools of an `auto` tool choice). `check_guide` parses one without a tokenizer (a bad schema, regex or grammar is refused before
  the request is queued; the preprocess stage calls it).
- `GrammarCompiler` compiles each distinct (type, guide) once, on one worker thread of its own, and keeps the
  compiled grammars (least recently used dropped past `cache_size`): the engine loop submits and goes on stepping
  the other requests; the request waits outside the scheduler until its grammar is ready (llm_engine.py).
- Each constrained sequence holds a `GrammarMatcher` (its parser state). Before sampling, `apply_grammar_bitmask`
  fills one row of a token bitmask per constrained row and applies them all with one
  `xgrammar.apply_token_bitmask_inplace` on the logits' device (disallowed tokens -> -inf); unconstrained rows are
  not touched. The engine then advances each matcher with its sampled token; a matcher that has accepted a stop
  token is terminated and its request ends ("stop").

A preempted sequence keeps its generated tokens (preemption by recompute), so its matcher stays valid and needs no
rollback. Logprobs of a constrained row are those of the masked logits (disallowed tokens have -inf).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import torch
import xgrammar

from omni_backend.engine.sampling_params import InvalidSamplingParam

logger = logging.getLogger(__name__)

GUIDE_FIELD = "guide"
"""The SamplingParams attribute a grammar error names."""
CACHE_SIZE = 256
"""Compiled grammars kept (each a few hundred KiB for a JSON schema on a 49k vocabulary)."""
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[09:28:46] /project/cpp/x.cc:83: " prefix
_ANY_OBJECT = '{"type": "object"}'


def _grammar(guide_type: str, guide: str | None) -> xgrammar.Grammar:
    """The xgrammar Grammar of a guide (no tokenizer needed).

    JSON is generated compactly (`any_whitespace=False`: xgrammar's default separators ", " and ": ", no
    newlines), so a small model cannot stall in whitespace until max_tokens; `json_schema` is strict (no
    properties beyond those declared, as OpenAI's `strict`), `json` any object.

    Raises:
        InvalidSamplingParam (field `guide`): an invalid JSON schema (jsonschema's meta-schema check), a schema
            feature xgrammar does not support, a regex, EBNF grammar or structural tag that does not parse.
    """
    try:
        if guide_type == "json":
            return xgrammar.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if guide_type == "json_schema":
            schema = json.loads(guide)
            if not isinstance(schema, (dict, bool)):
                raise InvalidSamplingParam(GUIDE_FIELD, "must be a JSON schema (an object), got "
                                           f"{type(schema).__name__}")
            jsonschema.validators.validator_for(schema).check_schema(schema)
            return xgrammar.Grammar.from_json_schema(guide, any_whitespace=False, strict_mode=True)
        if guide_type == "regex":
            return xgrammar.Grammar.from_regex(guide)
        if guide_type == "structural_tag":
            return xgrammar.Grammar.from_structural_tag(guide)
        return xgrammar.Grammar.from_ebnf(guide)
    except json.JSONDecodeError as exc:
        raise InvalidSamplingParam(GUIDE_FIELD, f"is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the schema's top level"
        raise InvalidSamplingParam(GUIDE_FIELD, f"is not a valid JSON schema: at {where}: {exc.message}") from None
    except RuntimeError as exc:  # xgrammar's converters and parsers raise RuntimeError with the reason
        reason = _NATIVE_PREFIX.sub("", str(exc)).strip()
        raise InvalidSamplingParam(GUIDE_FIELD, f"cannot be used as a {guide_type} guide: {reason}") from None


def check_guide(guide_type: str, guide: str | None) -> None:
    """Refuse a guide that can never compile (see `_grammar`); cheap (no tokenizer: about a millisecond for a
    nested schema).

    Raises:
        InvalidSamplingParam: naming `guide`.
    """
    _grammar(guide_type, guide)


class GrammarCompiler:
    """Compiles guides against one tokenizer on a worker thread and caches them.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary: padded rows are never
            allowed).
        stop_token_ids: the tokens that end generation (the engine's EOS ids): a grammar allows them only where it
            may end.
        cache_size: compiled grammars kept.

    Attributes:
        ready: the future of the compiler's preparation (xgrammar's TokenizerInfo), started at construction.
        num_requests: grammars asked for; num_cache_hits: of them, found compiled or compiling.
        compile_seconds: durations of finished compiles not yet taken by `take_compile_seconds` (metrics).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = CACHE_SIZE):
        self._tokenizer, self._stop_token_ids = tokenizer, sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # the tokenizer's vocabulary as xgrammar reads it, read now on the compile thread (0.1 s for SmolLM2's 49k
        # tokens on an idle core, 0.5 s on a busy one): the engine starts without waiting for it, and the first
        # constrained request does not pay for it (the thread runs it before any compile)
        self.ready = self._executor.submit(self._make_compiler)
        self._cache: OrderedDict[tuple[str, str | None], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.num_requests = 0
        self.num_cache_hits = 0
        self.compile_seconds: list[float] = []

    def submit(self, guide_type: str, guide: str | None) -> Future:
        """A future of the compiled grammar (`xgrammar.CompiledGrammar`); raises InvalidSamplingParam through the
        future for a guide that does not compile. Thread-safe."""
        key = (guide_type, None if guide_type == "json" else guide)
        with self._lock:
            self.num_requests += 1
            future = self._cache.get(key)
            if future is not None:
                self.num_cache_hits += 1
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def forget(self, guide_type: str, guide: str | None) -> None:
        """Drop a cached entry (one whose compile timed out: a later request tries again)."""
        with self._lock:
            self._cache.pop((guide_type, None if guide_type == "json" else guide), None)

    def _make_compiler(self) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self._stop_token_ids)
        # one compile thread, and xgrammar's own pool inside a compile at 1 too: the engine's step owns the other
        # cores (a second thread gained nothing measurable on a busy 2-core machine); our cache is `_cache`
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, guide_type: str, guide: str | None) -> xgrammar.CompiledGrammar:
        self.ready.result()  # done (the same thread ran it first); raises what reading the vocabulary raised
        start = time.perf_counter()
        compiled = self._compiler.compile_grammar(_grammar(guide_type, guide))
        elapsed = time.perf_counter() - start
        with self._lock:
            self.compile_seconds.append(elapsed)
        logger.debug("compiled a %s guide in %.1f ms", guide_type, elapsed * 1e3)
        return compiled

    def take_compile_seconds(self) -> list[float]:
        """The compile durations (s) since the previous call."""
        with self._lock:
            taken, self.compile_seconds = self.compile_seconds, []
        return taken

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def matcher(compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
    """A fresh parser state for one sequence (accept_token, is_terminated, fill_next_token_bitmask)."""
    return xgrammar.GrammarMatcher(compiled)


def apply_grammar_bitmask(logits: torch.Tensor, matchers: list[xgrammar.GrammarMatcher | None]) -> None:
    """Mask, in place, every token a row's grammar does not allow next (logit -> -inf).

    Args:
        logits: float32 [B, V] on the engine's device (CPU or CUDA), row i for matchers[i]; V is the width the
            matchers' tokenizer info was built with.
        matchers: per row its sequence's matcher, None for an unconstrained row (left untouched).

    The bitmask (int32 [B, ceil(V / 32)], one bit per token) is filled on the host, copied to the logits' device
    once and applied by one xgrammar call over the constrained rows; this runs after the model's forward pass,
    outside any captured CUDA graph.
    """
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         vocab_size=logits.shape[-1], indices=rows)

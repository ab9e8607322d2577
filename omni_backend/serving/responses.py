"""Shaping a generation into OpenAI's answers: `chat.completion` / `text_completion` objects, and their streamed
chunks as server-sent events (`chat.completion.chunk`, `text_completion`), then usage (if asked) and `[DONE]`.
A chat answer that is spoken too takes its message and deltas from its SpokenAnswer (serving/spoken.py).
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from sse_starlette import ServerSentEvent

from omni_backend.serving import protocol
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.generation import ChoiceResult, Generation, GenerationRequest
from omni_backend.serving.speech_backend import Audio
from omni_backend.serving.spoken import SpokenAnswer
from omni_backend.serving.tool_parser import ToolCallParser

SYSTEM_FINGERPRINT = "fp_omni_backend"


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """The postprocess stage's logprob entries as a chat choice's `logprobs` object."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], text_offset: int) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset.

    Args:
        entries: the postprocess stage's entries, in text order (a prompt's first token has logprob None and
            no alternatives: nothing comes before it).
        text_offset: character offset of the first entry's token in the choice's text.
    """
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        tokens.append(entry["token"])
        logprobs.append(entry["logprob"])
        tops.append(None if entry["logprob"] is None else
                    {top["token"]: top["logprob"] for top in entry.get("top_logprobs", [])})
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def usage(request: GenerationRequest, prompt_tokens: list[int], completion_tokens: list[int],
          cached_tokens: list[int]) -> dict:
    """Usage over all choices (token counts per choice, in choice order): each prompt counted once, with the
    cached tokens of its first choice (the choices of a prompt are separate engine requests, which may find
    different cached prefixes), and every choice's completion tokens."""
    return protocol.usage(sum(prompt_tokens[::request.n]), sum(completion_tokens), sum(cached_tokens[::request.n]))


def chat_message(request: GenerationRequest, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason: the text as content, or, for a request with tools whose answer
    holds tool calls (serving/tool_parser.py), the calls and what text is left (`tool_finish_reason`)."""
    message = {"role": "assistant", "content": text}
    if request.tools is None or not request.tools.parses:
        return message, finish_reason
    content, calls = request.tools.calls(text)
    if not calls:  # the content is then the whole text
        return message, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, tool_finish_reason(calls, finish_reason)


def tool_finish_reason(calls: list, finish_reason: str | None) -> str | None:
    """"tool_calls" for an answer that ended ("stop") with calls; any other end (max_tokens) stays as it is."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def completion_object(request: GenerationRequest, generation: Generation, results: list[ChoiceResult],
                      request_id: str, spoken: SpokenAnswer | None = None) -> dict:
    """A non-streamed `chat.completion` or `text_completion` object (`spoken`: a chat answer spoken too)."""
    choices = []
    for choice, result in zip(generation.choices, results):
        if request.kind == "chat":
            message, finish_reason = chat_message(request, result.text, result.finish_reason) if spoken is None \
                else (spoken.message(result), result.finish_reason)
            choices.append({"index": choice.index, "message": message, "logprobs": chat_logprobs(result.logprobs),
                            "finish_reason": finish_reason})
            continue
        prefix = choice.prepared.prompt_text if request.echo else ""
        logprobs = None
        if request.logprobs is not None:
            entries = (result.prompt_logprobs or []) if request.prompt_logprobs else []
            logprobs = completion_logprobs(entries + (result.logprobs or []), 0 if entries else len(prefix))
        choices.append({"index": choice.index, "text": prefix + result.text, "logprobs": logprobs,
                        "finish_reason": result.finish_reason})
    return {"id": request_id, "object": "chat.completion" if request.kind == "chat" else "text_completion",
            "created": protocol.now(), "model": request.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": usage(request, [r.prompt_tokens for r in results], [r.completion_tokens for r in results],
                           [r.cached_tokens for r in results])}


async def stream_events(request: GenerationRequest, generation: Generation, request_id: str,
                        spoken: SpokenAnswer | None = None) -> AsyncIterator:
    """Server-sent events for a streamed answer: one chunk per delta, then usage (if asked), then [DONE].

    `spoken`: a chat answer spoken too (its text deltas, audio deltas and finish as SpokenAnswer shapes them).
    A chat answer that may hold tool calls streams its content and `tool_calls` deltas as its parser reads them
    (serving/tool_parser.py). An error after the first chunk is sent as an `{"error": ...}` event
    (the status line is already out).
    """
    created = protocol.now()
    chat = request.kind == "chat"
    object_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], **extra) -> ServerSentEvent:
        body = {"id": request_id, "object": object_name, "created": created, "model": request.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
        if request.include_usage:
            body["usage"] = None
        body.update(extra)
        return ServerSentEvent(json.dumps(body, ensure_ascii=False))

    def chat_chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None):
        return chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    completion_tokens = {c.index: 0 for c in generation.choices}
    prompt_tokens = {c.index: c.prepared.prompt_tokens for c in generation.choices}
    cached_tokens = {c.index: 0 for c in generation.choices}
    text_offset = {c.index: 0 for c in generation.choices}
    echoed = {c.index: not request.echo for c in generation.choices}
    parsers = ({c.index: request.tools.parser() for c in generation.choices}
               if request.tools and request.tools.parses else None)
    try:
        if chat:
            first = {"role": "assistant", "content": "" if spoken is None else None}  # spoken: no text content
            yield chunk([{"index": c.index, "delta": first, "logprobs": None, "finish_reason": None}
                         for c in generation.choices])
        async for choice, step in generation.merged() if spoken is None else spoken.merged(generation):
            i = choice.index
            if isinstance(step, Audio):
                if step.samples.size:
                    yield chat_chunk(i, spoken.audio_delta(step))
                continue
            completion_tokens[i] = step.completion_tokens
            cached_tokens[i] = step.cached_tokens
            if step.finish_reason and step.prompt_tokens:
                prompt_tokens[i] = step.prompt_tokens
            if chat and parsers is not None:
                for event in _tool_answer(parsers[i], step, chat_chunk, i):
                    yield event
                continue
            if chat:
                if step.text or step.logprobs:
                    delta = {"content": step.text} if spoken is None else spoken.text_delta(step.text)
                    yield chat_chunk(i, delta, chat_logprobs(step.logprobs))
                if step.finish_reason:
                    yield chat_chunk(i, {} if spoken is None else spoken.finish_delta(), None, step.finish_reason)
                continue
            if not echoed[i]:  # the prompt first, with its own logprobs when asked
                echoed[i] = True
                prompt_text = choice.prepared.prompt_text
                logprobs = (completion_logprobs(step.prompt_logprobs or [], 0)
                            if request.prompt_logprobs else None)
                text_offset[i] = len(prompt_text)
                yield chunk([{"index": i, "text": prompt_text, "logprobs": logprobs, "finish_reason": None}])
            if step.text or step.logprobs:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(step.logprobs or [], text_offset[i])
                text_offset[i] += len(step.text)
                yield chunk([{"index": i, "text": step.text, "logprobs": logprobs, "finish_reason": None}])
            if step.finish_reason:
                yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": step.finish_reason}])
        if request.include_usage:
            indices = sorted(prompt_tokens)
            yield chunk([], usage=usage(request, [prompt_tokens[i] for i in indices],
                                        [completion_tokens[i] for i in indices], [cached_tokens[i] for i in indices]))
        yield ServerSentEvent("[DONE]")
    except OpenAIError as exc:
        yield ServerSentEvent(json.dumps(exc.body()))
        yield ServerSentEvent("[DONE]")
    finally:
        await generation.close()


def _tool_answer(parser: ToolCallParser, step, chat_chunk, index: int):
    """The chunks of one step of a chat choice that may hold tool calls: its content and `tool_calls` deltas (with
    the step's logprobs), then, at its end, the finish chunk."""
    content, calls = parser.feed(step.text)
    if step.finish_reason:
        more_content, more_calls = parser.finish()
        content, calls = content + more_content, calls + more_calls
    delta = {"content": content} if content or (step.logprobs and not calls) else {}
    if calls:
        delta["tool_calls"] = calls
    if delta:
        yield chat_chunk(index, delta, chat_logprobs(step.logprobs))
    if step.finish_reason:
        yield chat_chunk(index, {}, None, tool_finish_reason(parser.calls, step.finish_reason))

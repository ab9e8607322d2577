"""The front door's request core: a typed generation request, and running its choices through the pipeline.

`GenerationRequest` is what the chat and completions endpoints ask of the pipeline once their OpenAI bodies are
parsed and validated (serving/protocol.py): prompts, and the sampling settings by their vocabulary names
(`omni_backend.vocabulary`, SamplingParams attributes). `Generation` runs its choices: each (prompt, choice) is
prepared by preprocess and streamed from the llm stage (serving/pipeline.py), and the steps of all choices are
merged in arrival order. Shaping the answer is serving/responses.py's; speaking it, serving/spoken.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from omni_backend import tensor_names as T
from omni_backend.serving import errors
from omni_backend.serving.errors import OpenAIError
from omni_backend.serving.pipeline import Prepared, Step, TritonPipeline
from omni_backend.serving.speech_backend import Audio
from omni_backend.serving.structured import Guide
from omni_backend.serving.tools import ToolRequest
from omni_backend.stages.tts_options import SpeechOptions
from omni_backend.stages.voice_answer import with_hidden_states


@dataclass
class Prompt:
    """One prompt: text (a plain prompt, or the chat messages as preprocess's JSON array) or token ids, and the
    preprocess inputs about the prompt that differ from their defaults (`template`: the chat template flags
    `add_generation_prompt` and `continue_final_message`, or `prompt_is_text` for a completions prompt, and
    `tools`, the tool definitions as a JSON array)."""

    text: str = ""
    token_ids: list[int] | None = None
    template: dict[str, bool | str] = field(default_factory=dict)


@dataclass
class GenerationRequest:
    """One chat or completions request, ready for the pipeline.

    Attributes:
        kind: "chat" or "completion" (the response's shape).
        model: the served model the client named.
        prompt_field: the request field the prompt came in ("messages" or "prompt"), for error messages.
        prompts: one Prompt per prompt (chat: one).
        settings: SamplingParams attribute -> value for the settings given (absent ones take the stages'
            defaults; no max_tokens: the rest of the context).
        n: choices per prompt; choice i of a seeded request uses seed + i.
        include_usage: a streamed answer ends with a usage chunk.
        echo: the completion text starts with the prompt.
        generate: False when the client asked for no tokens (completions' max_tokens 0): the prompt is still
            checked and counted, and the llm stage runs only when the prompt's logprobs are asked (its one token
            is dropped).
        prompt_logprobs: the prompt's tokens get logprobs too (completions' echo with logprobs).
        speech: how to speak the answer (chat with audio output; n is 1), None for a written answer only.
        guide: the grammar the answer follows (response_format / structured_outputs, or a required or named
            tool_choice), None for free text.
        tools: the chat request's tools (serving/tools.py): its answers are parsed for tool calls; None without.
        own_voice: the served model speaks it with its own voice (serving/voiced.py): the llm returns the
            thinker's rows too.
    """

    kind: str
    model: str
    prompt_field: str
    prompts: list[Prompt]
    settings: dict[str, Any]
    n: int = 1
    include_usage: bool = False
    echo: bool = False
    generate: bool = True
    prompt_logprobs: bool = False
    speech: SpeechOptions | None = None
    guide: Guide | None = None
    tools: ToolRequest | None = None
    own_voice: bool = False

    @property
    def stream(self) -> bool:
        """The client asked for a streamed answer."""
        return bool(self.settings.get("stream"))

    @property
    def logprobs(self) -> int | None:
        return self.settings.get("logprobs")

    def choice_settings(self, index: int) -> dict[str, Any]:
        """The settings of choice `index` of a prompt: seeded choices use seed + index, so they differ and
        repeat across calls; a spoken answer streams from the llm (its phrases are spoken while it goes on)."""
        settings = self.settings if self.speech is None else {**self.settings, "stream": True}
        if self.guide is not None:
            settings = {**settings, **self.guide.settings()}
        if settings.get("seed") is None or self.n == 1:
            return settings
        return {**settings, "seed": settings["seed"] + index}


class Choice:
    """One choice being generated: its index, prompt and Triton stream.

    Args:
        steps: the llm stream's steps; None when nothing runs (the prompt was checked by preprocess).
        prompt_only: the client asked for no tokens: each step keeps only its prompt logprobs and counts.
    """

    def __init__(self, index: int, prepared: Prepared, steps: AsyncIterator[Step] | None, prompt_only: bool):
        self.index, self.prepared, self.steps, self.prompt_only = index, prepared, steps, prompt_only
        self.first: Step | None = None

    async def start(self) -> None:
        """Wait for the first response (so that errors before any text still get their own HTTP status)."""
        if self.steps is None:
            self.first = Step("", "length", self.prepared.prompt_tokens, 0, None)
        else:
            self.first = self._shown(await self.steps.__anext__())

    async def all_steps(self) -> AsyncIterator[Step]:
        yield self.first
        if self.steps is not None and not self.first.finish_reason:
            async for step in self.steps:
                yield self._shown(step)

    def _shown(self, step: Step) -> Step:
        if not self.prompt_only:
            return step
        return Step("", "length" if step.finish_reason else None, step.prompt_tokens, 0, None, step.prompt_logprobs,
                    step.cached_tokens)

    async def close(self) -> None:
        if self.steps is not None:
            await self.steps.aclose()


class Generation:
    """The choices of one GenerationRequest: prepared, started, and merged in arrival order."""

    def __init__(self, pipeline: TritonPipeline, request: GenerationRequest, request_id: str):
        self.pipeline, self.request, self.request_id = pipeline, request, request_id
        self.choices: list[Choice] = []

    async def start(self) -> None:
        """Preprocess every (prompt, choice) and wait for each choice's first response.

        Raises:
            OpenAIError: from preprocess or the llm stage (400 for bad input, 429/503 when refused, 500); one about
                the guide names the request field it came from.
        """
        try:
            await self._start()
        except OpenAIError as exc:
            if self.request.guide is None:
                raise
            raise self.request.guide.rename(exc) from None

    async def _start(self) -> None:
        request = self.request
        jobs = [self.pipeline.prepare(prompt.text, prompt.token_ids, request.choice_settings(i), request.prompt_field,
                                      f"{self.request_id}-{p * request.n + i}", prompt.template)
                for p, prompt in enumerate(request.prompts) for i in range(request.n)]
        prepared = await asyncio.gather(*jobs, return_exceptions=True)
        for item in prepared:
            if isinstance(item, BaseException):
                raise item
            if request.own_voice:
                item.tensors[T.SAMPLING_PARAMS] = with_hidden_states(item.tensors[T.SAMPLING_PARAMS])[0]
        runs_llm = request.generate or request.prompt_logprobs
        for index, prep in enumerate(prepared):
            steps = (self.pipeline.generate(prep, request.prompt_field, f"{self.request_id}-{index}")
                     if runs_llm else None)
            self.choices.append(Choice(index, prep, steps, prompt_only=not request.generate))
        results = await asyncio.gather(*(c.start() for c in self.choices), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.close()
            raise failures[0]

    async def close(self) -> None:
        for choice in self.choices:
            await choice.close()

    async def merged(self) -> AsyncIterator[tuple[Choice, Step]]:
        """(choice, step) pairs from all choices as they arrive; closing this cancels the unfinished ones.

        Raises:
            OpenAIError: 503 for a request the server aborted (shutting down), or a choice's error.
        """
        async for choice, step in self._merged():
            if step.finish_reason == "abort":
                raise errors.unavailable("the request was aborted by the server: it is shutting down")
            yield choice, step

    async def _merged(self) -> AsyncIterator[tuple[Choice, Step]]:
        if len(self.choices) == 1:
            choice = self.choices[0]
            async for step in choice.all_steps():
                yield choice, step
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            try:
                async for step in choice.all_steps():
                    await queue.put((choice, step, None))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((choice, None, exc))
            finally:
                await queue.put((choice, None, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, step, exc = await queue.get()
                if exc is not None:
                    raise exc
                if step is None:
                    remaining -= 1
                    continue
                yield choice, step
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()


@dataclass
class ChoiceResult:
    """A choice run to its end (token counts as in `Step`; `audio`: a spoken answer's audio, phrase by phrase)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None
    cached_tokens: int = 0
    audio: list[Audio] = field(default_factory=list)


async def collect(generation: Generation,
                  items: AsyncIterator[tuple[Choice, Step | Audio]] | None = None) -> list[ChoiceResult]:
    """Run every choice to the end: per choice its text, logprob entries, finish reason, token counts (prompt,
    completion, and the prompt tokens the prefix cache supplied) and audio. `items`: `generation.merged()` (the
    default), or a spoken answer's steps and audio (`SpokenAnswer.merged`, serving/spoken.py)."""
    texts: list[list[str]] = [[] for _ in generation.choices]
    out = [ChoiceResult("", None, c.prepared.prompt_tokens, 0) for c in generation.choices]
    async for choice, step in (generation.merged() if items is None else items):
        item = out[choice.index]
        if isinstance(step, Audio):
            item.audio.append(step)
            continue
        texts[choice.index].append(step.text)
        if step.logprobs is not None:
            item.logprobs = (item.logprobs or []) + step.logprobs
        if step.prompt_logprobs is not None:
            item.prompt_logprobs = step.prompt_logprobs
        item.completion_tokens = step.completion_tokens
        if step.finish_reason:
            item.finish_reason = step.finish_reason
            item.prompt_tokens = step.prompt_tokens or item.prompt_tokens
            item.cached_tokens = step.cached_tokens
    for item, text in zip(out, texts):
        item.text = "".join(text)
    return out

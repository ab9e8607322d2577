"""Qwen2.5-Omni's voice in one process: its talker engine and code2wav, fed by a thinker's streamed outputs.

Per answer: `start` (voice, seed, the thinker prompt's length and positions), then `push` each thinker output's
rows as it comes (`talker.ReplyFeed` makes the talker's prompt, later rows and tail), and `step` as often as there
is work: one talker engine step (its new codec tokens go to code2wav) and one code2wav step (the waveform chunks
that are ready, batched across answers). A talker or code2wav fault ends that answer alone with an error chunk.
One thread drives it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from omni_backend.engine.llm_engine import LLMEngine
from omni_backend.stages.code2wav import Chunk, Code2Wav, Code2WavSettings
from omni_backend.stages.talker import ReplyFeed, Speakers, TalkerInputs, TalkerSettings, engine_config


class OmniVoice:
    """The talker and code2wav of a Qwen2.5-Omni folder (module docstring).

    Args:
        folder: the checkpoint folder.
        talker: the talker engine's settings (batch, cache, sampling: `TalkerSettings`).
        code2wav: chunking and batching of code2wav.
        device: where both run ("cpu", "cuda", "cuda:N").
        dtype: the talker engine's dtype ("auto": the engine's choice); code2wav runs in float32.

    Raises (constructor):
        what `LLMEngine`, `TalkerInputs` and `Code2Wav` raise for a folder without a talker.
    """

    def __init__(self, folder: str | Path, talker: TalkerSettings, code2wav: Code2WavSettings, device: str = "cpu",
                 dtype: str = "auto"):
        self.settings = talker
        self.inputs = TalkerInputs(folder, Speakers.load(folder))
        self.talker = LLMEngine(engine_config(str(folder), talker, device=device, dtype=dtype))
        self.code2wav = Code2Wav(folder, code2wav, device=device)
        self.feeds: dict[str, tuple[ReplyFeed, int]] = {}
        self.talker_batch_sizes: Counter[int] = Counter()  # talker steps per number of answers that got a token
        self._stalled = False  # the talker's last step ran nothing though sequences waited (`step`)
        self._held_steps = 0  # talker steps code2wav had a ready chunk and waited (Code2WavSettings.max_delay_steps)

    def start(self, request_id: str, voice: str, seed: int, num_prompt_tokens: int,
              prompt_positions: torch.Tensor | None = None, media_positions: torch.Tensor | None = None) -> None:
        """Begin an answer: its voice, the seed of its talker sampling and code2wav noise, its thinker prompt's
        length N, M-RoPE ids int64 [3, N] (None: a text prompt) and media placeholder positions int64 [k].

        Raises:
            StageError: an unknown voice (INVALID_ARGUMENT, field `voice`). ValueError: a request id in use.
        """
        if request_id in self.feeds:
            raise ValueError(f"duplicate request id {request_id}")
        feed = ReplyFeed(self.inputs, voice, num_prompt_tokens, prompt_positions, media_positions)
        self.code2wav.start(request_id, voice, seed)
        self.feeds[request_id] = (feed, seed)

    def push(self, request_id: str, hidden: torch.Tensor | None, embeds: torch.Tensor | None,
             finished: bool) -> None:
        """A thinker output's rows (`RequestOutput.hidden_states`, `.input_embeds`) and whether it was the last.
        Nothing for an answer no longer held.

        Raises:
            ValueError: what `ReplyFeed.push` and the talker engine refuse (the answer is dropped).
        """
        held = self.feeds.get(request_id)
        if held is None:
            return
        feed, seed = held
        try:
            request = feed.push(hidden, embeds, finished)
            if request.prompt is not None:
                ids, prompt, positions = request.prompt
                # a long prompt leaves fewer codec tokens: the speech ends "length" rather than failing
                room = min(self.settings.max_codec_tokens, self.settings.max_model_len - len(ids))
                self.talker.add_request(request_id, ids, self.inputs.sampling(self.settings, seed, room), prompt,
                                        positions, self.inputs.addends(request.rows))
                if request.tail is not None:
                    self.talker.extend_inputs(request_id, None, request.tail)
            elif request.rows is not None or request.tail is not None:
                self.talker.extend_inputs(request_id, request.rows, request.tail)
        except ValueError:
            self.abort(request_id)
            raise
        self._stalled = False  # new rows may let a waiting sequence go on

    def has_work(self) -> bool:
        """Whether `step` could produce something now (a talker waiting for its thinker's rows could not)."""
        scheduler = self.talker.scheduler
        runnable = not self._stalled and any(seq.inputs_ready() for seq in (*scheduler.running, *scheduler.waiting))
        return runnable or self.code2wav.has_work()

    def step(self) -> list[Chunk]:
        """One talker step and one code2wav step: the chunks ready (an answer's last has `final`; a failed
        answer's only remaining one has `error`). While the talker has work, a ready chunk may wait up to
        `max_delay_steps` talker steps for other answers' chunks to batch with."""
        failed = []
        outputs = self.talker.step()
        # nothing ran though sequences wait (no batch slot or KV blocks free): no more talker steps until rows
        # arrive or an answer ends (`push`, `abort`), else the worker would spin
        self._stalled = self.talker.stalled
        if outputs:
            self.talker_batch_sizes[len(outputs)] += 1
        for output in outputs:
            if output.finish_reason == "error":
                failed.append(Chunk(output.request_id, -1, torch.zeros(0), True, f"talker failed: {output.error}"))
                continue
            try:
                self.code2wav.add(output.request_id, output.token_ids, finished=output.finished)
            except ValueError as exc:
                self.talker.abort(output.request_id)
                failed.append(Chunk(output.request_id, -1, torch.zeros(0), True, f"code2wav refused: {exc}"))
        for chunk in failed:
            self.abort(chunk.request_id)
        if outputs and self.code2wav.has_work() and self._held_steps < self.code2wav.settings.max_delay_steps:
            self._held_steps += 1
            return failed
        self._held_steps = 0
        chunks = self.code2wav.step()
        for chunk in chunks:
            if chunk.final:
                self.feeds.pop(chunk.request_id, None)
        return failed + chunks

    def kv_blocks(self) -> tuple[int, int]:
        """The talker engine's KV cache blocks in use, and in all."""
        runner = self.talker.runner
        return runner.num_blocks - runner.block_manager.num_free_blocks, runner.num_blocks

    def abort(self, request_id: str) -> None:
        """Stop an answer in both engines and free its KV blocks."""
        self._stalled = False  # its slot and blocks may let a waiting sequence in
        self.feeds.pop(request_id, None)
        self.talker.abort(request_id)
        self.code2wav.abort(request_id)

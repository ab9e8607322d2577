"""The code2wav stage: Qwen2.5-Omni's codec tokens to speech, batched across answers and streamed in chunks while
the talker still writes.

transformers' `Qwen2_5OmniToken2WavModel` (modeling_qwen2_5_omni.py, transformers 5) does the math: its DiT turns
codec tokens (`repeats` mel frames each) into an 80-bin mel spectrogram by flow matching, conditioned on a voice's
`cond` [192] and `ref_mel` [frames, 80] (`spk_dict.pt`), and its BigVGAN vocoder turns that into a waveform (one
sample per `hop` = product of its upsample rates, 240 in the released model: 24 kHz at 100 mel frames a second).
This module decides what runs together:

    blocks     the DiT attends within blocks of `block_size` mel frames (some layers one block back or ahead)
    chunk      `chunk_blocks` blocks of codec frames (doubling with each chunk of the answer up to
               `max_chunk_blocks`: each window recomputes its look-back and look-ahead, so later chunks are made
               larger, the first small), computed once `future_blocks` blocks of codes after it are
               known (at least the codes of the vocoder's right context; or the answer ended), inside a window of up
               to `past_blocks` blocks before it and as many codes after it; windows start on block boundaries, so
               their blocks are the utterance's
    noise      an answer's starting noise is drawn block by block from its own seeded generator and a window takes
               its frames' rows: every chunk starts from the noise the whole utterance would, the noise
               transformers' `sample` draws after `torch.manual_seed(seed)` (torch's CPU normals come in groups of
               16 values, and a block of frames is a multiple of 16 values)
    flow       `sample`'s solver and constants: `num_steps` time points of transformers'
               `RungeKutta4ODESolver`, classifier-free guidance 0.5, sway -1; run here because `sample` draws its
               own noise
    vocoder    BigVGAN over the chunk's mel frames and up to `vocoder_context` frames of the window's mel on each
               side, cut to the chunk's samples
    batching   windows of equal length and equal reference-mel length go through the DiT in one call, mel slices
               of equal length through BigVGAN in one call (`batch_sizes` counts the DiT's)

Joined chunks differ from the whole utterance where the flow carries information farther than a window reaches
(each of its DiT evaluations sees up to a block further); tests/multimodal/test_qwen2_5_omni_speech.py states
the tolerance measured.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_backend.settings import SettingGroup, setting
from omni_backend.stages.hf_encoders import load_prefixed_weights
from omni_backend.stages.talker import Speakers

# `Qwen2_5OmniToken2WavModel.forward`'s defaults (transformers 5.x); its num_steps (10) is a setting here
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0
CHECKPOINT_PREFIX = "token2wav."  # where a Qwen2.5-Omni checkpoint keeps Qwen2_5OmniToken2WavModel


@dataclass
class Code2WavSettings(SettingGroup):
    """Settings of the code2wav stage (rendered as `code2wav_<field>`, omni_backend/repository.py)."""

    chunk_blocks: int = setting(2, "DiT blocks of codec frames per streamed chunk (a block is 24 mel frames, 0.24 s of "
                                "speech, in the released model)", low=1)
    max_chunk_blocks: int = setting(4, "an answer's chunks double in size from chunk_blocks up to this many blocks: "
                                    "the first stays small for the time to first audio, later ones recompute less "
                                    "(a window computes past_blocks + future_blocks blocks beyond its chunk)", low=1)
    past_blocks: int = setting(1, "blocks of codes before a chunk its window also computes", low=0)
    future_blocks: int = setting(1, "blocks of codes after a chunk its window also computes (a chunk waits for them; "
                                 "at least the codes of vocoder_context are waited for)", low=0)
    vocoder_context: int = setting(16, "mel frames of the window on each side of a chunk the vocoder also reads",
                                   low=0)
    max_batch: int = setting(16, "chunks computed in one step at most", low=1)
    max_delay_steps: int = setting(0, "talker steps a ready chunk may wait while the talker has work, so that other "
                                   "answers' chunks join its batch; 0: computed at the next step", low=0)
    num_steps: int = setting(10, "time points of the DiT's flow (transformers' default 10: nine Runge-Kutta steps of "
                             "four DiT evaluations); fewer is faster and rougher", low=2)

    PREFIX = "code2wav_"


class _RepeatedInputMemo(torch.nn.Module):
    """The DiT's speaker encoder (an ECAPA-TDNN over the reference mel, inside `DiTInputEmbedding`), answering an
    input equal to its last one from memory: a flow calls it with the same reference mels at each of its DiT
    evaluations, and on a CPU it cost two thirds of the flow."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0].shape == mel.shape and torch.equal(last[0], mel):
            return last[1]
        out = self.module(mel)
        self._last = (mel, out)
        return out


@dataclass
class Chunk:
    """A piece of an answer's waveform: float32 samples in [-1, 1] at the model's rate; `final` on its last.
    `error`: the answer failed (omni_voice.py; then final, empty, index -1)."""

    request_id: str
    index: int
    audio: torch.Tensor
    final: bool
    error: str | None = None


class _Answer:
    """One answer's codes so far, its starting noise and how far its chunks have gone."""

    def __init__(self, voice: dict, seed: int):
        self.cond = voice["cond"].float()
        self.ref_mel = voice["ref_mel"].float()
        self.generator = torch.Generator().manual_seed(seed)
        self.noise: torch.Tensor | None = None
        self.codes: list[int] = []
        self.finished = False
        self.sent = 0  # codec frames whose samples were sent
        self.chunks = 0
        self.closed = False  # its final chunk was sent

    def noise_rows(self, start: int, end: int, block: int, bins: int) -> torch.Tensor:
        """Noise of mel frames [start, end) [end - start, bins], drawn a block at a time as needed."""
        have = 0 if self.noise is None else self.noise.shape[0]
        if end > have:
            more = torch.randn(math.ceil((end - have) / block) * block, bins, generator=self.generator)
            self.noise = more if self.noise is None else torch.cat([self.noise, more])
        return self.noise[start:end]


@dataclass
class _Window:
    answer: _Answer
    request_id: str
    start: int  # codec frames [start, end) the DiT computes
    end: int
    chunk_start: int  # codec frames [chunk_start, chunk_end) whose samples are sent
    chunk_end: int


class Code2Wav:
    """Codec tokens to waveform chunks for many answers at once (module docstring). One thread drives it.

    Args:
        folder: a Qwen2.5-Omni folder (its token2wav config and weights, its `spk_dict.pt` voices).
        settings: chunking and batching.
        device: where the model runs (float32, as transformers runs it).

    Attributes:
        sample_rate: samples per second of the waveform (mel frames a second x hop).
        batch_sizes: how many DiT calls ran each batch size so far (for the stage's metrics).

    Raises (constructor):
        FileNotFoundError: no spk_dict.pt. KeyError: the checkpoint lacks token2wav weights.
    """

    MEL_FRAMES_PER_SECOND = 100  # the released model's mel rate (24 kHz / hop 240); the tiny one keeps it

    def __init__(self, folder: str | Path, settings: Code2WavSettings, device: str = "cpu"):
        from transformers import AutoConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        config = AutoConfig.from_pretrained(folder).token2wav_config
        model = Qwen2_5OmniToken2WavModel._from_config(config, dtype=torch.float32)
        model.checkpoint_prefixes = {name: (f"{CHECKPOINT_PREFIX}{name}.",)
                                     for name in ("code2wav_dit_model", "code2wav_bigvgan_model")}
        load_prefixed_weights(model, folder)
        embed = model.code2wav_dit_model.input_embed
        embed.spk_encoder = _RepeatedInputMemo(embed.spk_encoder)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.settings = settings
        dit = config.dit_config
        self.repeats, self.block_mel, self.bins = dit.repeats, dit.block_size, dit.mel_dim
        if self.block_mel % self.repeats:
            raise ValueError(f"a DiT block of {self.block_mel} mel frames is no whole number of codec frames "
                             f"({self.repeats} mel frames each)")
        self.block = self.block_mel // self.repeats  # codec frames per block
        # codec frames a window reaches past its chunk: the future blocks, at least the vocoder's right context
        self.ahead = max(settings.future_blocks * self.block, math.ceil(settings.vocoder_context / self.repeats))
        self.num_codes = dit.num_embeds + 1  # the DiT's codec embedding rows
        self.hop = math.prod(config.bigvgan_config.upsample_rates)
        self.sample_rate = self.MEL_FRAMES_PER_SECOND * self.hop
        self.speakers = Speakers.load(folder)
        self.answers: dict[str, _Answer] = {}
        self.batch_sizes: Counter[int] = Counter()

    def start(self, request_id: str, voice: str, seed: int) -> None:
        """Begin an answer spoken by `voice`, its noise drawn from `seed`.

        Raises:
            StageError: an unknown voice (INVALID_ARGUMENT, field `voice`). ValueError: a request id in use.
        """
        entry = self.speakers.check(voice, "voice")
        if request_id in self.answers:
            raise ValueError(f"duplicate request id {request_id}")
        self.answers[request_id] = _Answer(entry, seed)

    def add(self, request_id: str, codes: list[int], finished: bool = False) -> None:
        """More codec tokens of an answer; `finished`: they were its last. Nothing for an answer no longer held.

        Raises:
            ValueError: a code outside the DiT's codec vocabulary [0, num_embeds] (the answer is dropped).
        """
        answer = self.answers.get(request_id)
        if answer is None:
            return
        bad = [code for code in codes if not 0 <= code < self.num_codes]
        if bad:
            del self.answers[request_id]
            raise ValueError(f"codec tokens must be in [0, {self.num_codes - 1}], got {bad[:4]}")
        answer.codes += codes
        answer.finished = answer.finished or finished

    def abort(self, request_id: str) -> None:
        self.answers.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self._window(request_id, answer) is not None for request_id, answer in self.answers.items())

    def step(self) -> list[Chunk]:
        """The next chunk of up to `max_batch` answers that have one ready (those served longest ago first),
        computed together; answers whose final chunk went are forgotten."""
        windows = []
        for request_id, answer in self.answers.items():
            window = self._window(request_id, answer)
            if window is not None:
                windows.append(window)
                if len(windows) == self.settings.max_batch:
                    break
        if not windows:
            return []
        mels = self._mel(windows)
        chunks = self._vocode(windows, mels)
        for chunk in chunks:
            answer = self.answers.pop(chunk.request_id)
            if not chunk.final:  # to the back of the line: past max_batch, every answer gets its turn
                self.answers[chunk.request_id] = answer
        return chunks

    def _window(self, request_id: str, answer: _Answer) -> _Window | None:
        """The window of an answer's next chunk, or None: nothing ready (or its final chunk already went)."""
        if answer.closed:
            return None
        count, start = len(answer.codes), answer.sent
        if answer.finished and start >= count:  # the last chunk went before the answer was known to end
            return _Window(answer, request_id, count, count, count, count)
        end = start + self._chunk_blocks(answer.chunks) * self.block
        if not answer.finished and count < end + self.ahead:
            return None
        end = min(end, count)
        return _Window(answer, request_id, max(0, start - self.settings.past_blocks * self.block),
                       min(count, end + self.ahead), start, end)

    def _chunk_blocks(self, index: int) -> int:
        """Blocks of an answer's chunk `index`: chunk_blocks doubled per chunk, up to max_chunk_blocks (never fewer
        than chunk_blocks)."""
        first = self.settings.chunk_blocks
        return max(first, min(self.settings.max_chunk_blocks, first << min(index, 16)))

    @torch.no_grad()
    def _mel(self, windows: list[_Window]) -> list[torch.Tensor]:
        """Each window's mel [frames, bins], the windows grouped by shape into batched flows."""
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, w in enumerate(windows):
            groups[(w.end - w.start, w.answer.ref_mel.shape[0])].append(index)
        mels: list[torch.Tensor | None] = [None] * len(windows)
        for (length, _), members in groups.items():
            if length == 0:  # an answer that ended with nothing more to say
                for index in members:
                    mels[index] = torch.zeros(0, self.bins)
                continue
            group = [windows[index] for index in members]
            self.batch_sizes[len(group)] += 1
            out = self._flow(group, length * self.repeats)
            for index, mel in zip(members, out):
                mels[index] = mel
        return mels

    def _flow(self, group: list[_Window], frames: int) -> torch.Tensor:
        """`Qwen2_5OmniToken2WavDiTModel.sample`'s flow over a batch of equally long windows, from their noise."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        device, dit = self.device, self.model.code2wav_dit_model
        codes = torch.tensor([w.answer.codes[w.start:w.end] for w in group], device=device)
        noise = torch.stack([w.answer.noise_rows(w.start * self.repeats, w.end * self.repeats, self.block_mel,
                                                 self.bins) for w in group]).to(device)
        cond = torch.stack([w.answer.cond for w in group]).to(device)[:, None].expand(-1, frames, -1)
        ref_mel = torch.stack([w.answer.ref_mel for w in group]).to(device)

        def velocity(time, state):
            out = dit(hidden_states=state, quantized_code=codes, speaker_embedding=cond, condition_vector=ref_mel,
                      time_step=time, apply_cfg=True)
            guided, unconditioned = out.chunk(2, dim=0)
            return guided + (guided - unconditioned) * GUIDANCE_SCALE

        times = torch.linspace(0, 1, self.settings.num_steps, device=device)
        times = times + SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
        return RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1]

    @torch.no_grad()
    def _vocode(self, windows: list[_Window], mels: list[torch.Tensor]) -> list[Chunk]:
        """Each window's chunk of samples: BigVGAN over its chunk's mel and context, equal lengths batched."""
        context, r = self.settings.vocoder_context, self.repeats
        slices = []
        for w, mel in zip(windows, mels):
            first, last = (w.chunk_start - w.start) * r, (w.chunk_end - w.start) * r
            low, high = max(0, first - context), min(mel.shape[0], last + context)
            slices.append((low, high, first, last))
        groups: dict[int, list[int]] = defaultdict(list)
        for index, (low, high, _, _) in enumerate(slices):
            groups[high - low].append(index)
        audio: list[torch.Tensor | None] = [None] * len(windows)
        for length, members in groups.items():
            if length == 0:
                for index in members:
                    audio[index] = torch.zeros(0)
                continue
            batch = torch.stack([mels[index][slices[index][0]:slices[index][1]] for index in members])
            waves = self.model.code2wav_bigvgan_model(batch.transpose(1, 2)).reshape(len(members), -1)
            for index, wave in zip(members, waves):
                low, _, first, last = slices[index]
                audio[index] = wave[(first - low) * self.hop:(last - low) * self.hop].float().cpu()
        chunks = []
        for w, samples in zip(windows, audio):
            answer = w.answer
            answer.sent = w.chunk_end
            final = answer.finished and w.chunk_end == len(answer.codes)
            answer.closed = final
            chunks.append(Chunk(w.request_id, answer.chunks, samples, final))
            answer.chunks += 1
        return chunks

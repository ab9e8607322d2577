"""The talker stage: Qwen2.5-Omni's codec tokens out of its thinker's reply, on an engine of its own.

A second engine instance (`EngineConfig.talker`: its own paged KV cache, continuous batching, CUDA graphs on a GPU)
inside the llm stage's `LLMService` (engine loop, response thread, cancellation), fed as transformers'
`Qwen2_5OmniForConditionalGeneration.generate` feeds its talker (modeling_qwen2_5_omni.py, transformers 5):

    thinker rows     each token's last-layer hidden state + layer-0 input embedding (`thinker_rows`; the input
                     embeddings of image, audio and video placeholders count as zero, as transformers zeroes them)
    prompt           the N prompt rows, the speaker's first token's thinker embedding + the codec pad embedding, the
                     first reply token's row + the codec bos embedding; token ids [codec mask] x N, pad, bos;
                     positions: the thinker prompt's M-RoPE ids, then two text positions after them
    decode step j    codec embedding of the token fed + reply row j + 1 (the thinker's reply tokens after the first),
                     then the thinker's text-end embedding, then its text-pad embedding for every step after
                     (`sequence.InputAddends`: a request whose next row has not come waits, the others go on)
    sampling         transformers' talker defaults: top-k 40, top-p 0.8, temperature 0.9, repetition penalty 1.05
                     over prompt and output ids, codec bos suppressed, stop at codec pad or codec end
                     (`TalkerSettings.greedy`, for tests: argmax with the same penalty and suppression)

A request can start once the thinker's prompt rows and its first reply row exist (`TalkerInputs.prompt`) and take the
later rows as they come (`LLMEngine.extend_inputs`; through the engine loop, `stages.llm.messages.ExtendInputs`), so
speech starts while the thinker writes.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from omni_backend.engine.config import EngineConfig
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import InputAddends, PromptEmbeds, PromptPositions
from omni_backend.settings import SettingGroup, setting
from omni_backend.vocabulary import ErrorKind, StageError

# transformers' `Qwen2_5OmniForConditionalGeneration.generate` talker defaults (modeling_qwen2_5_omni.py, 5.x)
SAMPLING = dict(top_k=40, top_p=0.8, temperature=0.9, repetition_penalty=1.05)
SPEAKER_FILE = "spk_dict.pt"
THINKER_EMBEDDINGS = "thinker.model.embed_tokens.weight"


@dataclass
class TalkerSettings(SettingGroup):
    """Settings of the talker stage (rendered as `talker_<field>`, omni_backend/repository.py); its engine reads
    the checkpoint, device and dtype of the llm's settings."""

    max_num_seqs: int = setting(16, "answers the talker speaks at once (its engine's batch)", low=1)
    kv_cache_bytes: int = setting(0, "the talker's paged KV cache, bytes; 0: the engine's default (engine/memory.py)",
                                  low=0)
    max_model_len: int = setting(6144, "longest thinker prompt + 2 + codec tokens of one answer", low=16)
    max_codec_tokens: int = setting(4096, "codec tokens of one answer at most (50 per second of speech; "
                                    "transformers' talker_max_new_tokens)", low=1)
    gpu_memory_utilization: float = setting(0.08, "share of the GPU for the talker engine (weights, KV cache)",
                                            low=0.0, low_open=True, high=1.0)
    greedy: bool = setting(False, "argmax codec tokens (tests compare them with transformers')", operator=False)

    PREFIX = "talker_"


class Speakers:
    """The voices of a Qwen2.5-Omni folder (`spk_dict.pt`: name -> its first thinker token `bos_token`, the
    speaker condition `cond` [192] and reference mel `ref_mel` [frames, 80] code2wav reads).

    Raises (`load`):
        FileNotFoundError: the folder has no spk_dict.pt.
    """

    def __init__(self, table: dict[str, dict]):
        self.table = table

    @classmethod
    def load(cls, folder: str | Path) -> "Speakers":
        return cls(torch.load(Path(folder) / SPEAKER_FILE, weights_only=True))

    def check(self, voice: str, field: str) -> dict:
        """The voice's entry.

        Raises:
            StageError: INVALID_ARGUMENT naming `field` and the voices, for a voice this model does not have.
        """
        if voice not in self.table:
            raise StageError(ErrorKind.INVALID_ARGUMENT, f"{field} {voice!r} is not a voice of this model; its voices: "
                             f"{', '.join(self.table)}", field)
        return self.table[voice]


def thinker_rows(hidden: torch.Tensor, embeds: torch.Tensor, media_positions: torch.Tensor | None = None,
                 first: int = 0) -> torch.Tensor:
    """What the talker reads of thinker positions [first, first + k): hidden state + input embedding [k, H] float32,
    the embeddings of image, audio and video placeholders (their prompt positions `media_positions`) counted as zero
    (transformers' generate zeroes them before its talker sees them).

    Raises:
        ValueError: hidden and embeds of different shapes.
    """
    if hidden.shape != embeds.shape:
        raise ValueError(f"hidden states {list(hidden.shape)} and input embeddings {list(embeds.shape)} differ")
    embeds = embeds.float()
    if media_positions is not None and media_positions.numel():
        inside = media_positions[(media_positions >= first) & (media_positions < first + embeds.shape[0])] - first
        embeds = embeds.clone()
        embeds[inside] = 0
    return hidden.float() + embeds


class TalkerInputs:
    """The talker's prompt and reply rows out of thinker rows (module docstring), for one checkpoint.

    Args:
        folder: the Qwen2.5-Omni folder: its talker config's codec and text token ids, the thinker's embeddings of
            the text marks and of every speaker's first token (a few rows read from the checkpoint), and the talker's
            codec embeddings of its pad and bos tokens.
        speakers: the folder's voices.

    Raises (constructor):
        KeyError: the checkpoint lacks the embedding tables.
    """

    def __init__(self, folder: str | Path, speakers: Speakers):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder).talker_config
        self.codec_mask, self.codec_pad = config.tts_codec_mask_token_id, config.tts_codec_pad_token_id
        self.codec_bos, self.codec_end = config.tts_codec_start_token_id, config.tts_codec_end_token_id
        self.speakers = speakers
        voices = {name: int(entry["bos_token"]) for name, entry in speakers.table.items()}
        texts = [config.tts_text_end_token_id, config.tts_text_pad_token_id, *voices.values()]
        thinker = dict(zip(texts, _checkpoint_rows(folder, THINKER_EMBEDDINGS, texts)))
        self.tail = torch.stack([thinker[config.tts_text_end_token_id], thinker[config.tts_text_pad_token_id]])
        self.voice_rows = {name: thinker[token] for name, token in voices.items()}
        pad, bos = _checkpoint_rows(folder, "talker.model.embed_tokens.weight", [self.codec_pad, self.codec_bos])
        self.codec_pad_row, self.codec_bos_row = pad, bos

    @property
    def width(self) -> int:
        return self.tail.shape[1]

    @property
    def stop_token_ids(self) -> list[int]:
        """Where an answer's codec tokens end: codec pad or codec end (transformers' talker_eos_token_id)."""
        return [self.codec_pad, self.codec_end]

    def prompt(self, voice: str, prompt_rows: torch.Tensor, first_reply_row: torch.Tensor,
               prompt_positions: torch.Tensor | None) -> tuple[list[int], PromptEmbeds, PromptPositions | None]:
        """The talker's prompt: token ids, its embeddings (every position) and its M-RoPE ids (None for a text
        prompt: each token's index).

        Args:
            voice: a speaker of the folder.
            prompt_rows: `thinker_rows` of the thinker's prompt [N, H].
            first_reply_row: `thinker_rows` of the first reply token [H] (or [1, H]).
            prompt_positions: the thinker prompt's M-RoPE ids int64 [3, N], or None for a text prompt.

        Raises:
            StageError: an unknown voice (INVALID_ARGUMENT, field `voice`).
        """
        self.speakers.check(voice, "voice")
        count = prompt_rows.shape[0]
        rows = torch.cat([prompt_rows.float(), (self.voice_rows[voice] + self.codec_pad_row)[None],
                          first_reply_row.reshape(1, -1).float() + self.codec_bos_row])
        ids = [self.codec_mask] * count + [self.codec_pad, self.codec_bos]
        positions = None
        if prompt_positions is not None and prompt_positions.numel():
            after = int(prompt_positions.max()) + 1 + torch.arange(2)
            positions = PromptPositions(torch.cat([prompt_positions.to(torch.int64), after.expand(3, -1)], dim=1))
        return ids, PromptEmbeds(torch.arange(count + 2), rows), positions

    def sampling(self, settings: TalkerSettings, seed: int | None = None,
                 max_tokens: int | None = None) -> SamplingParams:
        """The talker's sampling (module docstring); greedy keeps the penalty and the suppression. `max_tokens`:
        codec tokens at most (default `settings.max_codec_tokens`)."""
        values = dict(SAMPLING, temperature=0.0) if settings.greedy else dict(SAMPLING)
        return SamplingParams(max_tokens=max_tokens or settings.max_codec_tokens, seed=seed,
                              stop_token_ids=self.stop_token_ids,
                              suppress_token_ids=[self.codec_bos], stream=True, **values)

    def addends(self, later_rows: torch.Tensor | None = None) -> InputAddends:
        """The decode-step rows of a request, starting with `later_rows` (reply rows after the first) if given."""
        addends = InputAddends(self.width)
        if later_rows is not None and later_rows.shape[0]:
            addends.extend(later_rows)
        return addends


@dataclass
class TalkerRequest:
    """What a talker engine is given for an answer: `prompt` (token ids, prompt embeddings, M-RoPE ids or None:
    `LLMEngine.add_request`'s) once, then later reply `rows` [k, H] and, at the end, the `tail`
    (`LLMEngine.extend_inputs`)."""

    prompt: tuple[list[int], PromptEmbeds, PromptPositions | None] | None = None
    rows: torch.Tensor | None = None
    tail: torch.Tensor | None = None


class ReplyFeed:
    """One answer's hand-off from its thinker to its talker, as the thinker streams (`RequestOutput.hidden_states`
    and `input_embeds`, prompt rows first): its talker request as soon as the prompt rows and the first reply row
    are known, then each later row as it comes, then the tail (text end, text pad) when the thinker has finished.

    A reply of one token has no reply row (its only token is never fed back; transformers' `generate` fails on such
    a reply): the text-end row takes the first reply row's place and the tail is the pad row.

    Args:
        inputs: the checkpoint's `TalkerInputs`.
        voice: a voice of the checkpoint.
        num_prompt_tokens: the thinker prompt's length N.
        prompt_positions: the thinker prompt's M-RoPE ids int64 [3, N], or None for a text prompt.
        media_positions: prompt positions of image, audio and video placeholders int64 [k], or None.

    Raises (constructor):
        StageError: an unknown voice (INVALID_ARGUMENT, field `voice`), before the thinker runs.
    """

    def __init__(self, inputs: TalkerInputs, voice: str, num_prompt_tokens: int,
                 prompt_positions: torch.Tensor | None = None, media_positions: torch.Tensor | None = None):
        inputs.speakers.check(voice, "voice")
        self.inputs, self.voice, self.num_prompt_tokens = inputs, voice, num_prompt_tokens
        self.prompt_positions, self.media_positions = prompt_positions, media_positions
        self.seen = 0  # thinker positions whose rows came
        self.started = False
        self._held: list[torch.Tensor] = []  # rows before the talker's prompt is complete

    def push(self, hidden: torch.Tensor | None, embeds: torch.Tensor | None, finished: bool) -> TalkerRequest:
        """The next thinker output's rows (hidden states and input embeddings [k, H], or None) and whether it was
        the last; what to give the talker now.

        Raises:
            ValueError: hidden states and embeddings of different shapes; a thinker that ended without its prompt's
                rows.
        """
        rows = None
        if hidden is not None and hidden.shape[0]:
            rows = thinker_rows(hidden, embeds, self.media_positions, self.seen)
            self.seen += rows.shape[0]
        out = TalkerRequest(tail=self.inputs.tail if finished else None)
        if self.started:
            out.rows = rows
            return out
        if rows is not None:
            self._held.append(rows)
        if self.seen <= self.num_prompt_tokens and not finished:
            return out
        held = torch.cat(self._held) if self._held else torch.zeros(0, self.inputs.width)
        count = self.num_prompt_tokens
        if held.shape[0] < count:
            raise ValueError(f"the thinker ended after rows of {held.shape[0]} of its {count} prompt positions (a "
                             f"spoken answer's thinker request must return hidden states)")
        if held.shape[0] > count:
            first, out.rows = held[count], held[count + 1:]
        else:  # a one-token reply
            first, out.tail = self.inputs.tail[0], self.inputs.tail[1:]
        out.prompt = self.inputs.prompt(self.voice, held[:count], first, self.prompt_positions)
        self.started, self._held = True, []
        return out


def engine_config(folder: str, settings: TalkerSettings, device: str = "auto", dtype: str = "auto") -> EngineConfig:
    """The talker engine's config: the llm's checkpoint, device and dtype; the stage's batch and cache sizes; no
    prefix caching (a talker prompt is its thinker's rows, never shared)."""
    return EngineConfig(model_path=folder, device=device, dtype=dtype, talker=True,
                        max_num_seqs=settings.max_num_seqs, kv_cache_bytes=settings.kv_cache_bytes,
                        max_model_len=settings.max_model_len, enable_prefix_caching=False,
                        gpu_memory_utilization=settings.gpu_memory_utilization)


def _checkpoint_rows(folder: str | Path, name: str, ids: list[int]) -> list[torch.Tensor]:
    """Rows `ids` of the checkpoint tensor `name`, float32, read one row each (a multi-GB embedding table is
    never loaded whole).

    Raises:
        KeyError: no tensor of that name.
    """
    for path in sorted(glob.glob(str(Path(folder) / "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            if name in handle.keys():
                table = handle.get_slice(name)
                return [table[i:i + 1][0].float() for i in ids]
    raise KeyError(f"checkpoint {folder} lacks {name!r}")

"""Qwen2.5-Omni (Qwen Team, "Qwen2.5-Omni Technical Report", 2025), its thinker: a Whisper-style audio encoder, a
Qwen2.5-VL windowed vision encoder and a Qwen2 language model with M-RoPE (models/qwen2_5_omni.py of the engine).
Speech output (talker, code2wav) is not served.

    encoders    image / video: the vision encoder's patches of one image or of one temporal group of two frames,
                [grid_h/m, grid_w/m, m²·C·T·P²] (the processor's rows, reshaped) -> [grid_h·grid_w/m², H];
                audio: log-mel [128, F] + its valid frames -> [tokens, H]; both as transformers 5's
                `get_image_features` / `get_video_features` / `get_audio_features` compute them
    processor   transformers' `Qwen2_5OmniProcessor` (chat template, image resizing to its min/max pixels,
                placeholder expansion, a video's audio interleaved with its frames by time) and the prompt's
                M-RoPE position ids, computed as transformers' `get_rope_index` does

Video frames: transformers' video processor needs torchvision, which has no build for this project's CPU torch.
`FrameProcessor` stands in for it: the frames it is given were sampled by the video processor's rule
(`sample_frames`, at the processor's 2 fps) and each goes through the checkpoint's image processor at the video
processor's pixel limits (Pillow's bicubic resize where torchvision's would round a few values differently), two
frames per temporal patch, as the video processor lays them out.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import Qwen2_5OmniProcessor
from transformers.processing_utils import ProcessorMixin

from omni_backend import tensor_names as T
from omni_backend.engine.models.registry import Architecture
from omni_backend.stages.chat_template import ChatTemplate
from omni_backend.stages.hf_prompt import ProcessorPrompt, added_around

MEDIA_TOKENS = {"image": "image_token", "audio": "audio_token", "video": "video_token"}  # processor attributes


class Qwen2_5OmniVisionEncoder(nn.Module):
    """Vision items [B, grid_h/m, grid_w/m, m²·patch] (one image, or one temporal group of a video, each) ->
    [B, grid_h·grid_w/m², text hidden]: the processor's patch rows of each item, one attention sequence each
    (transformers' vision encoder attends within each temporal group), the merger's output in the prompt's order."""

    checkpoint_prefixes = {"visual": ("thinker.visual.",)}

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder as Tower

        vision = config.thinker_config.vision_config
        self.merge = vision.spatial_merge_size
        self.visual = Tower(vision)

    def forward(self, items: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        batch, rows, cols, width = items.shape
        m = self.merge
        patches = items.reshape(batch * rows * cols * m * m, width // (m * m))
        grid = torch.tensor([[1, rows * m, cols * m]] * batch, device=items.device)
        merged = self.visual(patches, grid_thw=grid).pooler_output
        return merged.reshape(batch, rows * cols, -1)


class Qwen2_5OmniAudioEncoder(nn.Module):
    """Log-mel [B, 128, F] and valid frames [B] -> [B, max tokens, text hidden]: each clip's valid frames through
    the audio tower (its own `n_window` chunks), the first `audio_tokens(frames)` rows of each row its clip's."""

    checkpoint_prefixes = {"audio_tower": ("thinker.audio_tower.",)}

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder as Tower

        self.audio_tower = Tower(config.thinker_config.audio_config)

    def forward(self, input_features: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        batch, _, frames = input_features.shape
        lengths = (torch.full((batch,), frames) if lengths is None else lengths).to(torch.long).cpu()
        valid = torch.cat([input_features[i, :, :n] for i, n in enumerate(lengths.tolist())], dim=1)
        after_cnn = (lengths - 1) // 2 + 1
        hidden = self.audio_tower(valid, feature_lens=lengths.to(valid.device),
                                  aftercnn_lens=after_cnn.to(valid.device)).last_hidden_state
        clips = hidden.split([audio_tokens(n) for n in lengths.tolist()])
        return nn.utils.rnn.pad_sequence(list(clips), batch_first=True)


def audio_tokens(frames: int) -> int:
    """Embeddings a clip of `frames` valid mel frames gets (the processor's count; the audio tower's output
    rows)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def sample_frames(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                  temporal_patch_size: int) -> list[int]:
    """The frames transformers' Qwen2-VL video processor samples (`sample_frames`): `fps` per second of video,
    at least `min_frames`, at most `max_frames` and the video's own, a multiple of `temporal_patch_size`, spread
    evenly.

    Raises:
        ValueError: a video too short to give one temporal patch.
    """
    cap = math.floor(min(max_frames, total) / temporal_patch_size) * temporal_patch_size
    count = min(max(total / video_fps * fps, min_frames), cap, total)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count < temporal_patch_size:
        raise ValueError(f"the video has {total} frames; the model needs at least {temporal_patch_size}")
    return torch.arange(0, total, total / count).int().tolist()


class FrameProcessor:
    """Stands in for transformers' `Qwen2VLVideoProcessor` (module docstring): videos as lists of sampled RGB
    frames -> `pixel_values_videos` [rows, C·T·P²] and `video_grid_thw` [videos, 3], the video processor's layout.

    Attributes:
        size: the per-frame pixel limits ({"shortest_edge": min, "longest_edge": max}), the processor's video
            defaults; fps, min_frames, max_frames: its sampling; patch_size, temporal_patch_size, merge_size: the
            image processor's.
    """

    fps, min_frames, max_frames = 2.0, 4, 768  # Qwen2VLVideoProcessor's and the Omni processor's defaults

    def __init__(self, image_processor, size: dict):
        self.image_processor = image_processor
        self.size = dict(size)
        self.patch_size = image_processor.patch_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.merge_size = image_processor.merge_size

    def __call__(self, videos: list[list], **kwargs) -> dict:
        rows, grids = [], []
        tp = self.temporal_patch_size
        for frames in videos:
            frames = list(frames) + [frames[-1]] * (-len(frames) % tp)  # the video processor pads with the last
            encoded = self.image_processor(images=frames, size=self.size, return_tensors="np")
            _, grid_h, grid_w = (int(v) for v in encoded["image_grid_thw"][0])
            # Each frame's rows hold it T times over (C, T, P, P); a temporal patch takes one copy of each frame.
            p = self.patch_size
            single = np.asarray(encoded["pixel_values"]).reshape(len(frames), grid_h * grid_w, -1, tp, p, p)[:, :, :, 0]
            groups = single.reshape(len(frames) // tp, tp, grid_h * grid_w, -1, p, p).transpose(0, 2, 3, 1, 4, 5)
            rows.append(groups.reshape(len(frames) // tp * grid_h * grid_w, -1))
            grids.append([len(frames) // tp, grid_h, grid_w])
        return {"pixel_values_videos": np.concatenate(rows), "video_grid_thw": np.asarray(grids, dtype=np.int64)}


class OmniProcessor(Qwen2_5OmniProcessor):
    """transformers' `Qwen2_5OmniProcessor` with a `FrameProcessor` for its video processor: loaded from a folder's
    image processor, feature extractor, tokenizer and chat template (`from_pretrained`)."""

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image", "audio", "video"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
            setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
        self.video_processor = FrameProcessor(image_processor, Qwen2_5OmniProcessor.videos_kwargs["size"])


class Qwen2_5OmniPrompt(ProcessorPrompt):
    """Qwen2.5-Omni prompts (`ProcessorPrompt`): images, audio clips and videos in one chat, each video with its
    audio track when its part asks (`use_audio_in_video`), and the prompt's M-RoPE position ids
    (`mrope_positions`) among the items as `prompt_positions` [3, n].

    Media parts: an image is one item of the vision encoder; a video one item per temporal patch (two frames),
    its embeddings in its <|VIDEO|> positions; a clip one audio item; a video's audio track an "audio" part right
    after its video part, its embeddings in the <|AUDIO|> positions interleaved with the frames'.
    """

    kinds = frozenset({"image", "audio", "video"})

    def __init__(self, folder: str | Path, architecture: Architecture):
        from transformers import AutoConfig

        self.processor = OmniProcessor.from_pretrained(str(folder), local_files_only=True)
        self.sampling_rate = int(self.processor.feature_extractor.sampling_rate)
        self.chat = ChatTemplate(self.processor.tokenizer, self.processor)
        self._added = added_around(self.processor.tokenizer)
        thinker = AutoConfig.from_pretrained(str(folder)).thinker_config
        self.ids = {kind: int(getattr(thinker, key.rpartition(".")[2])) for kind, key in
                    architecture.placeholders.items()}
        self.vision_bos = int(thinker.vision_start_token_id)
        self.audio_bos, self.audio_eos = int(thinker.audio_start_token_id), int(thinker.audio_end_token_id)
        self.per_second = float(thinker.position_id_per_seconds)
        self.merge = int(thinker.vision_config.spatial_merge_size)
        self.video = self.processor.video_processor

    def pick_frames(self, total: int, video_fps: float) -> list[int]:
        """The frames of a video of `total` frames at `video_fps` the processor samples (`sample_frames`)."""
        v = self.video
        return sample_frames(total, video_fps, v.fps, v.min_frames, v.max_frames, v.temporal_patch_size)

    def render(self, messages: list[dict], media: list, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None
               ) -> tuple[list[int], list[dict], np.ndarray, dict[str, np.ndarray]]:
        """`ProcessorPrompt.render` for images (RGB `PIL.Image`), clips (float32 samples at `sampling_rate`) and
        videos (`media.DecodedVideo`, its `audio` set when the part asks for its track) in message order. The items
        are `pixel_values` [vision items, rows, cols, width] (zero-padded; each part's `size` is its own [rows, cols]),
        `input_features` [clips, mel bins, frames] (to the longest clip's frames) and `prompt_positions` [3, n]."""
        text = self.chat.render(messages, add_generation_prompt, continue_final_message, tools)
        kinds = [part["type"] for message in messages if isinstance(message["content"], list)
                 for part in message["content"] if part.get("type") in self.kinds]
        if len(kinds) != len(media):
            raise ValueError(f"the messages hold {len(kinds)} media parts for {len(media)} decoded media")
        encoded = {}
        if media:
            encoded = self._processor_outputs(kinds, media)
            expansions = {kind: [entry["replacement"] for entry in encoded["text_replacement_offsets"][0]
                                 if entry["type"] == kind] for kind in self.kinds}
            try:
                text = self.processor.get_text_with_replacements(
                    [text], images_replacements=expansions["image"], videos_replacements=expansions["video"],
                    audio_replacements=expansions["audio"])[0][0]
            except StopIteration:  # more placeholders in the text than expansions
                raise ValueError("the chat template wrote more media placeholders than there are media parts") from None
        before, after = self._added
        ids = before + self.chat.encode(text) + after
        if not media:
            return ids, [], np.zeros(0, dtype=np.int32), {}
        parts, spans, items = self._parts(ids, kinds, media, encoded)
        positions = np.concatenate(spans).astype(np.int32)
        if positions.size != sum(p["tokens"] for p in parts):
            raise ValueError(f"the processor wrote {positions.size} placeholders for media parts of "
                             f"{sum(p['tokens'] for p in parts)} embeddings")
        items[T.PROMPT_POSITIONS] = self.mrope_positions(ids, parts, spans).astype(np.int32)
        return ids, parts, positions, items

    def _processor_outputs(self, kinds: list[str], media: list) -> dict:
        """The processor's outputs for media in a text of their placeholders only (the client's text never passes
        through it); a video's audio track is given to it as the audio of that video."""
        placeholders = "".join(getattr(self.processor, MEDIA_TOKENS[kind]) for kind in kinds)
        images = [m for kind, m in zip(kinds, media) if kind == "image"]
        clips = [m for kind, m in zip(kinds, media) if kind == "audio"]
        videos = [m for kind, m in zip(kinds, media) if kind == "video"]
        tracks = [(index, v.audio) for index, v in enumerate(videos) if v.audio is not None]
        options = {}
        if tracks:
            options = {"load_audio_from_video": True,
                       "audio_from_video_indices": [None] * len(clips) + [index for index, _ in tracks]}
        if videos:
            options["videos_kwargs"] = {"fps": self.video.fps}
        return self.processor(text=placeholders, images=images or None, videos=[v.frames for v in videos] or None,
                              audio=clips + [track for _, track in tracks] or None, return_tensors="np",
                              return_text_replacement_offsets=True, **options)

    def _parts(self, ids: list[int], kinds: list[str], media: list, encoded: dict):
        """(parts, each part's placeholder positions, items) of the processor's output, in message order."""
        ids_array = np.asarray(ids)
        runs = {kind: np.flatnonzero(ids_array == token) for kind, token in self.ids.items()}
        taken = dict.fromkeys(runs, 0)

        def take(kind: str, count: int) -> np.ndarray:
            span = runs[kind][taken[kind]:taken[kind] + count]
            taken[kind] += count
            if span.size != count:
                raise ValueError(f"the processor's {kind} expansion is shorter than its {kind} items")
            return span

        m = self.merge
        grids = {kind: np.asarray(encoded.get(f"{kind}_grid_thw", np.zeros((0, 3))), dtype=np.int64)
                 for kind in ("image", "video")}
        pixels = {"image": encoded.get("pixel_values"), "video": encoded.get("pixel_values_videos")}
        row_start = {"image": 0, "video": 0}
        seen = {"image": 0, "video": 0}
        clips = iter(range(sum(k == "audio" for k in kinds)))
        tracks = iter(range(sum(k == "audio" for k in kinds), 1 << 30))
        mel = np.asarray(encoded.get("input_features", np.zeros((0, 0, 0))), dtype=np.float32)
        frames = (np.asarray(encoded["feature_attention_mask"]).sum(axis=-1).astype(int)
                  if "feature_attention_mask" in encoded else [])
        parts, spans, vision_items, audio_items = [], [], [], []

        def audio_part(clip: int, with_video: dict | None = None) -> None:
            part = {"kind": "audio", "tokens": audio_tokens(int(frames[clip])), "items": 1, "frames": int(frames[clip])}
            if with_video is not None:
                part["video"] = True
            parts.append(part)
            spans.append(take("audio", part["tokens"]))
            audio_items.append(mel[clip])

        for kind, item in zip(kinds, media):
            if kind == "audio":
                audio_part(next(clips))
                continue
            gt, gh, gw = (int(v) for v in grids[kind][seen[kind]])
            seen[kind] += 1
            count = gt * gh * gw
            rows = np.asarray(pixels[kind][row_start[kind]:row_start[kind] + count], dtype=np.float32)
            row_start[kind] += count
            vision_items += list(rows.reshape(gt, gh // m, gw // m, -1))
            part = {"kind": kind, "tokens": count // (m * m), "items": gt, "size": [gh // m, gw // m]}
            if kind == "video":
                part["seconds_per_grid"] = float(encoded["video_second_per_grid"][seen[kind] - 1])
            parts.append(part)
            spans.append(take(kind, part["tokens"]))
            if kind == "video" and item.audio is not None:
                audio_part(next(tracks), with_video=part)
        if any(taken[kind] != runs[kind].size for kind in runs):
            raise ValueError("the processor wrote placeholders beyond its media items")
        items = {}
        if vision_items:
            rows_max = max(v.shape[0] for v in vision_items)
            cols_max = max(v.shape[1] for v in vision_items)
            padded = np.zeros((len(vision_items), rows_max, cols_max, vision_items[0].shape[2]), dtype=np.float32)
            for index, v in enumerate(vision_items):
                padded[index, :v.shape[0], :v.shape[1]] = v
            items[T.PIXEL_VALUES] = padded
        if audio_items:
            longest = max(p["frames"] for p in parts if p["kind"] == "audio")
            items[T.INPUT_FEATURES] = np.ascontiguousarray(np.stack(audio_items)[:, :, :longest])
        return parts, spans, items

    def mrope_positions(self, ids: list[int], parts: list[dict], spans: list[np.ndarray]) -> np.ndarray:
        """The prompt's M-RoPE position ids int64 [3, n], as transformers' `get_rope_index` gives them: a text token
        (markers such as <|vision_bos|> included) one past the largest id before it on all three rows; an image or
        video patch start + (t, h, w) of its merged grid, t advancing `position_id_per_seconds` per second of video
        (`seconds_per_grid` per temporal patch); an audio run consecutive ids from its start. A video with its audio
        track: both opening markers at one id, frames and audio from the next id each on its own time axis, both
        closing markers one past the largest of them."""
        n = len(ids)
        out = np.zeros((3, n), dtype=np.int64)
        blocks = []  # (first token, last token + 1, fill(start) -> next start)
        index = 0
        while index < len(parts):
            part, span = parts[index], spans[index]
            if part["kind"] == "video" and index + 1 < len(parts) and parts[index + 1].get("video"):
                audio_span = spans[index + 1]
                first, last = int(min(span[0], audio_span[0])) - 2, int(max(span[-1], audio_span[-1])) + 3
                if ids[first] != self.vision_bos or ids[first + 1] != self.audio_bos:
                    raise ValueError("the processor's video-with-audio expansion is not the one the model reads")
                blocks.append((first, last, self._video_with_audio(out, part, span, audio_span, first, last)))
                index += 2
                continue
            if part["kind"] == "audio":
                blocks.append((int(span[0]), int(span[-1]) + 1, self._audio_run(out, span)))
            else:
                blocks.append((int(span[0]), int(span[-1]) + 1, self._grid(out, part, span)))
            index += 1
        cursor, start = 0, 0
        for first, last, fill in sorted(blocks, key=lambda b: b[0]):
            out[:, cursor:first] = np.arange(start, start + first - cursor)
            start += first - cursor
            start = fill(start)
            cursor = last
        out[:, cursor:] = np.arange(start, start + n - cursor)
        return out

    def _grid_ids(self, part: dict, start: int) -> np.ndarray:
        """[3, tokens] ids of an image's or a video's merged patches from `start`, t-major as the encoder gives
        them."""
        rows, cols = part["size"]
        temporal = part["items"]
        scale = part.get("seconds_per_grid", 1.0) * self.per_second
        # float32 products truncated, as transformers computes them
        t = (torch.arange(temporal) * torch.tensor(scale, dtype=torch.float32)).long().numpy()
        grid = np.stack(np.meshgrid(t, np.arange(rows), np.arange(cols), indexing="ij")).reshape(3, -1)
        return grid + start

    def _grid(self, out: np.ndarray, part: dict, span: np.ndarray):
        def fill(start: int) -> int:
            out[:, span] = self._grid_ids(part, start)
            return int(out[:, span].max()) + 1
        return fill

    @staticmethod
    def _audio_run(out: np.ndarray, span: np.ndarray):
        def fill(start: int) -> int:
            out[:, span] = np.arange(start, start + span.size)
            return start + span.size
        return fill

    def _video_with_audio(self, out: np.ndarray, part: dict, span: np.ndarray, audio_span: np.ndarray, first: int,
                          last: int):
        def fill(start: int) -> int:
            out[:, first:first + 2] = start
            out[:, span] = self._grid_ids(part, start + 1)
            out[:, audio_span] = np.arange(start + 1, start + 1 + audio_span.size)
            top = int(max(out[:, span].max(), out[:, audio_span].max()))
            out[:, last - 2:last] = top + 1
            return top + 2
        return fill


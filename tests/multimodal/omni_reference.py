"""The tiny Qwen2.5-Omni's test inputs (text, the astronaut photo, Piper's spoken question, an 8-frame video of the
photo with and without that question as its audio track) and transformers' answers for them, shared by
test_qwen2_5_omni.py and test_qwen2_5_omni_server.py.

transformers' video processor needs torchvision, which has no build beside this project's CPU torch: the reference
video input is made here from the frames the Qwen2-VL video processor's rule samples (2 fps: frames 0, 2, 4, 6 of
this 4 fps clip), each through the checkpoint's image processor at the video pixel limits, two frames per temporal
patch (`ReferenceFrames`); the video arrives losslessly coded (FFV1), so the decoded frames are the originals."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from helpers.media_inputs import audio_bytes, audio_part, image_bytes, image_part, speech, video_bytes, video_part

from omni_backend.stages.media import MediaLimits, decode_audio, resample

QUESTION = "What is this?"
NEW_TOKENS = 6
LONG = 40  # tokens a preempting run generates
CASES = ("text", "image", "audio", "video", "video_audio")
VIDEO_FPS = 4
SAMPLED = [0, 2, 4, 6]  # 8 frames at 4 fps, sampled at the processor's 2 fps


def clip_frames() -> np.ndarray:
    """8 frames [8, 84, 112, 3] of the astronaut photo, the view moving down and right."""
    from skimage import data

    photo = data.astronaut()
    return np.stack([photo[i * 20:i * 20 + 84, i * 10:i * 10 + 112] for i in range(8)])


def clip_track() -> np.ndarray:
    """2 s of Piper's spoken question at 16 kHz (the video's audio track)."""
    samples, rate = speech()
    return resample(samples.astype(np.float64), rate, 16_000)[:32_000]


def content(case: str) -> list[dict]:
    parts = {"text": [], "image": [image_part(image_bytes("PNG"))], "audio": [audio_part(audio_bytes())],
             "video": [video_part(video_bytes(clip_frames(), VIDEO_FPS))],
             "video_audio": [video_part(video_bytes(clip_frames(), VIDEO_FPS, clip_track()), use_audio_in_video=True)]}
    return [{"type": "text", "text": QUESTION}, *parts[case]]


def messages(case: str) -> list[dict]:
    return [{"role": "user", "content": content(case)}]


class ReferenceFrames:
    """The Qwen2-VL video processor's output for already sampled frames, made frame by frame: each frame through the
    checkpoint's image processor at the video pixel limits, its first temporal copy, two frames per patch row."""

    def __init__(self, image_processor):
        from transformers import Qwen2_5OmniProcessor

        self.image_processor = image_processor
        self.size = Qwen2_5OmniProcessor.videos_kwargs["size"]
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size

    def __call__(self, videos, **kwargs):
        rows, grids = [], []
        p = self.image_processor.patch_size
        for frames in videos:
            singles = []
            for frame in frames:
                out = self.image_processor(images=[frame], size=self.size, return_tensors="np")
                singles.append(out["pixel_values"].reshape(out["pixel_values"].shape[0], 3, 2, p, p)[:, :, 0])
                grid = [int(v) for v in out["image_grid_thw"][0]]
            for t in range(0, len(frames), 2):
                rows += [np.stack([singles[t][i], singles[t + 1][i]], axis=1).reshape(-1)
                         for i in range(singles[t].shape[0])]
            grids.append([len(frames) // 2, grid[1], grid[2]])
        return {"pixel_values_videos": np.stack(rows), "video_grid_thw": np.asarray(grids)}


def transformers_inputs(processor, case: str):
    """The processor's tensors for `messages(case)`, as a transformers user makes them."""
    from PIL import Image

    kind = {"text": [], "image": ["image"], "audio": ["audio"], "video": ["video"], "video_audio": ["video"]}[case]
    chat = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *({"type": k} for k in kind)]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    media = {}
    if case == "image":
        media["images"] = [Image.open(io.BytesIO(image_bytes("PNG"))).convert("RGB")]
    if case == "audio":
        media["audio"] = [decode_audio(base64.b64encode(audio_bytes()).decode(), "clip", MediaLimits())]
    if case.startswith("video"):
        media["videos"] = [[Image.fromarray(frame) for frame in clip_frames()[SAMPLED]]]
        media["videos_kwargs"] = {"fps": 2.0}
    if case == "video_audio":
        # as the 16-bit PCM track holds it (video_bytes), read back at full scale 32768
        track = (np.clip(clip_track(), -1, 1) * 32767).astype(np.int16).astype(np.float32) / 32768
        media |= {"audio": [track], "load_audio_from_video": True, "audio_from_video_indices": [0]}
    return processor(text=text, return_tensors="pt", **media)


def transformers_positions(thinker, inputs, case: str) -> np.ndarray:
    mask = inputs.get("feature_attention_mask")
    positions, _ = thinker.get_rope_index(
        inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"), inputs["attention_mask"],
        case == "video_audio", mask.sum(-1) if mask is not None else None, inputs.get("video_second_per_grid"))
    return positions[:, 0].numpy()


def transformers_embeds(thinker, inputs, case: str) -> np.ndarray:
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    handle = thinker.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        thinker(**inputs, use_audio_in_video=case == "video_audio")
    handle.remove()
    return captured["embeds"][0].numpy()


def transformers_greedy(thinker, inputs, case: str, new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = thinker.generate(**inputs, use_audio_in_video=case == "video_audio", max_new_tokens=new_tokens,
                               do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def transformers_reference(folder: str):
    """transformers' thinker (float32) and processor (its video processor `ReferenceFrames`) of the folder."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_backend.stages.models.qwen2_5_omni import OmniProcessor

    processor = OmniProcessor.from_pretrained(folder)
    processor.video_processor = ReferenceFrames(processor.image_processor)
    thinker = Qwen2_5OmniForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).thinker.eval()
    thinker.generation_config.eos_token_id = None  # the requests set ignore_eos
    return processor, thinker
